"""A Flax NNX mixture of experts as its author writes it (tests/_flax_checks.py's ``MoeMlp``: a
router ``nnx.Linear``, the experts stacked in three ``nnx.Param``s, its own routing), declared by
``FlaxExperts`` and run as ``ctx.moe``: under tp, ep and tp+ep it trains like Flax trains the
same module unsharded; what the declaration gets wrong is refused by name; a mutant of the
dropless capacity is caught."""

import _foreign_checks
import jax.numpy as jnp
import optax
import pytest
from _cover import cover
from _flax_checks import (
    CONFIG,
    EXPERTS,
    EXPERTS_K,
    STRATEGIES,
    MoeMlp,
    _mutant,
    annotated,
    batches,
    check_trains_like_flax,
    flax_llama,
    flax_model,
    mesh_for,
    moe_experts,
)
from flax import nnx

import shardops_models as models
from shardops_models.interop.flax_nnx import FlaxExperts, FlaxModel

MOE_CASES = cover(["tp", "2d+ep", "fsdp+ep", "hsdp+ep"], ["sgd", "adam"])


@pytest.mark.parametrize(("strategy", "opt_name"), MOE_CASES, ids=["-".join(c) for c in MOE_CASES])
def test_a_flax_mixture_of_experts_trains_like_flax_trains_it(strategy, opt_name):
    """Its experts split over ``expert`` (ep; dropless as S slots per expert per sequence) and
    each expert's hidden units over ``model`` (tp); under 2d+ep the traced budget (its
    AllToAlls) equals the compiled step's collectives."""
    check_trains_like_flax(flax_model("llama-moe"), "llama-moe", strategy, opt_name,
                           budget=strategy == "2d+ep")  # fmt: skip


def test_the_load_balancing_loss_is_the_one_the_module_sows():
    """``aux_weights``: the step adds 0.1 × shardops' load-balancing loss (over the whole batch,
    on two batch axes: data and expert) as Flax's run adds 0.1 × the one the module sows."""
    model = flax_model("llama-moe", aux_weights={"load_balance": 0.1})
    check_trains_like_flax(model, "llama-moe", "fsdp+ep", "sgd")


def test_the_experts_are_laid_out_by_expert_and_hidden_unit():
    setup = models.build("2d+ep", mesh_for(STRATEGIES["2d+ep"]), model=flax_model("llama-moe"),
                         optimizer=optax.sgd(0.1))  # fmt: skip
    mlp = setup.param_specs["blocks"][0]["mlp"]
    assert tuple(mlp["wi_0"]) == ("expert", None, "model"), mlp
    assert tuple(mlp["wo"]) == ("expert", "model", None), mlp
    assert tuple(mlp["router"]["kernel"]) in ((), (None, None)), mlp


def test_a_mutant_that_drops_tokens_under_ep_is_caught():
    """Dropless under ep runs at S slots per expert per sequence (E / k); at half that a token
    is dropped, which Flax's module never does."""
    module = _mutant(
        '            factor = self.p["router"].value.shape[-1] / declared.k',
        '            factor = self.p["router"].value.shape[-1] / declared.k / 2',
    )
    with pytest.raises(AssertionError):
        check_trains_like_flax(flax_model("llama-moe", module), "llama-moe", "fsdp+ep", "sgd")


def _moe_llama(wi_0_names=None, transposed=False, spare=False, **router):
    """The Llama with ``MoeMlp`` whose router is an ``nnx.Linear(**router)`` (``transposed``:
    ``[E, D]``) and whose ``wi_0`` is annotated ``wi_0_names``, where given; ``spare``: one
    more ``MoeMlp`` the forward never calls."""

    def make(rngs):
        model = flax_llama.Llama(CONFIG, rngs=rngs)
        if spare:
            model.spare = MoeMlp(CONFIG, EXPERTS, EXPERTS_K, rngs=rngs)
        for block in model.blocks:
            block.mlp = mlp = MoeMlp(CONFIG, EXPERTS, EXPERTS_K, rngs=rngs)
            if router or transposed:
                shape = (EXPERTS, CONFIG.d_model) if transposed else (CONFIG.d_model, EXPERTS)
                mlp.router = nnx.Linear(*shape, rngs=rngs, **router)
            if wi_0_names:
                init = annotated(nnx.initializers.lecun_normal(), wi_0_names)
                mlp.wi_0 = nnx.Param(init(rngs.params(), mlp.wi_0.shape))
        return model

    return make


def _model(make=None, rules=flax_llama.RULES, **experts):
    return FlaxModel(make or _moe_llama(), rules=rules, num_heads=CONFIG.num_heads,
                     num_kv_heads=CONFIG.num_kv_heads, moe=experts or moe_experts())  # fmt: skip


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: _model(**{"blocks.*.moe": moe_experts()["blocks.*.mlp"]}),
         r"moe pattern 'blocks\.\*\.moe' matches no sub-module; the module's are \["),
        (lambda: FlaxModel(moe=None, make=None), "moe must be"),
        (lambda: _model(**moe_experts(gate="w_in")), r"gate='w_in'\) names no nnx.Param"),
        (lambda: _model(**moe_experts(gate="wo", down="wi_0")),
         r"blocks\.0\.mlp: wo has shape \(4, 128, 64\); .* reads gate\[E, D, F\]: \(4, 64, F\)"),
        (lambda: _model(**moe_experts(up="wo")), "FlaxExperts declares 'wo' as up and down"),
        (lambda: _model(**moe_experts(up="wo", down="wi_1")),
         r"blocks\.0\.mlp: wo has shape \(4, 128, 64\); .* reads up\[E, D, F\] = \(4, 64, 128\)"),
        (lambda: _model(_moe_llama(use_bias=True)),
         r"blocks\.0\.mlp\.router\.bias: a parameter of the mixture of experts that FlaxExperts "
         r"does not declare"),
        (lambda: _model(**moe_experts(k=5)), r"FlaxExperts\(k=5\) but the router has 4 experts"),
        (lambda: FlaxExperts("router.kernel", "wi_0", "wi_1", "wo", k=0), "k must be a positive"),
        (lambda: FlaxExperts("router.kernel", "wi_0", "wi_1", "wo", k=2, score="relu"),
         "score must be one of"),
        (lambda: FlaxExperts("router.kernel", "wi_0", "wi_1", "wo", k=2, capacity_factor=0.0),
         "capacity_factor must be None"),
        (lambda: FlaxExperts("router.kernel", "wi_0", "wi_1", "wo", k=2, load_balance="seq"),
         "load_balance must be 'global' or 'group'"),
        (lambda: _model(_moe_llama(transposed=True, use_bias=False)),
         r"router\.kernel has shape \(4, 64\), which reads as router\[E, D\] beside gate"),
        (lambda: _model(_moe_llama(("exp", "split", "mlp")),
                        rules=(*flax_llama.RULES, ("split", "model"))).plan(),
         r"blocks\.0\.mlp\.wi_0: dim 1 \('split'\) maps to 'model'; of a mixture of experts "
         r"shardops splits the experts' hidden dim F over it"),
        (lambda: _model(_moe_llama(("exp", "embed", "hidden"))).plan(),
         r"the experts' hidden dim F maps to 'model' in some of gate, up and down but not all"),
    ],
    ids=["no-match", "not-declarations", "no-param", "transposed", "twice", "up-transposed",
         "router-bias", "k", "k-0",
         "score", "capacity", "load-balance", "router-transposed", "embed-split",
         "hidden-unalike"],
)  # fmt: skip
def test_a_declaration_the_module_does_not_fit_is_refused_by_name(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_a_pattern_that_also_matches_inside_a_mixture_declares_the_mixture_alone():
    """``blocks.*.mlp.*`` names each mixture's router (which Flax lists before its parent): the
    router is the mixture's, as declared, not a mixture of its own."""
    declared = moe_experts()["blocks.*.mlp"]
    plan = _model(**{"blocks.*.mlp": declared, "blocks.*.mlp.*": declared}).plan()
    assert plan["blocks"][0]["mlp"]["router"]["kernel"] == "experts", plan


def test_a_checkpoint_of_the_experts_restores_under_another_strategy(tmp_path):
    """Saved under 2d (each expert's hidden units over model), restored under fsdp bit for
    bit, and into the Flax module, whose logits are the sharded run's."""

    def logits(module, ids):  # what the module sows (its load-balancing loss) left aside
        return nnx.capture(module, nnx.Intermediate)(ids)[0]

    _foreign_checks.check_checkpoint(flax_model("llama-moe"), STRATEGIES, batches("llama"),
                                     "flax_llama.Llama", logits, tmp_path)  # fmt: skip


@pytest.mark.parametrize(
    ("model", "strategy", "match"),
    [(flax_model("llama-moe"), "dp_sp", "mixture of experts .* not run on a split sequence"),
     (_model(_moe_llama(spare=True), **moe_experts(), spare=moe_experts()["blocks.*.mlp"]),
      "2d+ep",
      "the mixture of experts spare that moe= declares was not called"),
     (_model(_moe_llama(use_bias=False, dtype=jnp.bfloat16)), "2d+ep",
      r"blocks\.0\.mlp\.router: Linear\(dtype=bfloat16\) but the precision policy computes in "
      r"float32")],
    ids=["sp", "router-dtype", "uncalled"],
)  # fmt: skip
def test_experts_the_strategy_cannot_run_as_written_are_refused(model, strategy, match):
    setup = models.build(strategy, mesh_for(STRATEGIES[strategy]), model=model,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    with pytest.raises(ValueError, match=match):
        setup.collective_budget(8, 16)  # traces the step: the layers meet the strategy here
