"""A Flax NNX Llama whose blocks are stacked by ``nnx.vmap`` and run by ``nnx.scan``, as Flax's
guide to scanning over layers writes them (tests/_flax_checks.py's ``StackedLlama``), named by
``FlaxModel(stacked="blocks")``: under pp (1F1B beside dp and tp, the circular schedule beside
fsdp, GPipe alone) and the dense strategies it trains like Flax trains the same module
unsharded; its layout is one block's, the layers in front; what the module's forward does with
the stacked blocks that shardops cannot run is refused by name; a mutant of the layout is
caught."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from _cover import FULL
from _flax_checks import (
    CONFIG,
    STRATEGIES,
    StackedLlama,
    _mutant,
    batches,
    check_trains_like_flax,
    flax_llama,
    flax_model,
    mesh_for,
)
from flax import nnx

import shardops_models as models
from shardops_models.interop.flax_nnx import FlaxModel

STACKED_CASES = [("2d+1f1b", "adam"), ("fsdp+circular", "sgd")]
if FULL:
    STACKED_CASES += [("ref", "sgd"), ("tp", "adam"), ("fsdp", "sgd"), ("ref+gpipe", "sgd"),
                      ("hsdp_tp", "adam"), ("fsdp+circular", "adam"), ("dp_sp", "sgd"),
                      ("zero1", "adam")]  # fmt: skip
MICROBATCHES = 2  # the circular schedule's groups of P = 2
FLAX_SCAN = nnx.scan


def _options(strategy: str) -> dict:
    return {"microbatches": MICROBATCHES} if "+" in strategy else {}


@pytest.mark.parametrize(("strategy", "opt_name"), STACKED_CASES,
                         ids=["-".join(c) for c in STACKED_CASES])  # fmt: skip
def test_stacked_flax_blocks_train_like_flax_scans_them(strategy, opt_name):
    """4 stacked blocks: under 2d+1f1b (pipe 2 × data 2 × model 2) each stage holds 2 of
    them, split over model, and the traced budget (its sends between stages) equals the
    compiled step's collectives; under fsdp+circular each of the 2 stages holds 2 chunks of
    one block, stored in the circular order, which the gathered parameters undo."""
    check_trains_like_flax(flax_model("llama-stacked"), "llama-stacked", strategy, opt_name,
                           budget=strategy == "2d+1f1b", **_options(strategy))  # fmt: skip
    assert nnx.scan is FLAX_SCAN, "nnx.scan left patched (a stage's StageExit)"


def _specs(model, strategy="2d+1f1b"):
    setup = models.build(strategy, mesh_for(STRATEGIES[strategy]), model=model,
                         optimizer=optax.sgd(0.1), **_options(strategy))  # fmt: skip
    return setup.param_specs["blocks"]


def test_the_stacked_blocks_are_laid_out_as_one_block_with_the_layers_in_front():
    """One block's roles from its logical names (nnx.vmap puts ``layers`` in front, which
    the plan drops): wq column, wo row, the norm whole; under pp dim 0 over ``pipe``."""
    specs = _specs(flax_model("llama-stacked"))
    assert tuple(specs["attn"]["wq"]["kernel"]) == ("pipe", None, "model"), specs
    assert tuple(specs["attn"]["wo"]["kernel"]) == ("pipe", "model", None), specs
    assert tuple(specs["mlp"]["gate"]["kernel"]) == ("pipe", None, "model"), specs
    assert tuple(specs["attn_norm"]["scale"])[:1] == ("pipe",), specs
    assert "model" not in tuple(specs["attn_norm"]["scale"]), specs


def test_a_mutant_that_keeps_the_layers_name_in_one_block_is_caught():
    """Reading one block's names with the stacked ``layers`` name still in front shifts every
    name by one: wq would read (layers, embed) as its dims and run replicated, its values
    right (no trajectory sees it), its layout not."""
    module = _mutant('            "out_sharding": tuple(names[1:])}',
                     '            "out_sharding": tuple(names)}')  # fmt: skip
    specs = _specs(flax_model("llama-stacked", module))
    assert tuple(specs["attn"]["wq"]["kernel"]) != ("pipe", None, "model"), specs


class _Forward(StackedLlama):
    """``StackedLlama`` whose forward runs the stacked blocks by ``forward(self, x)``."""

    forward = None

    def __call__(self, ids, positions=None):
        return self.head(self.norm(type(self).forward(self, self.embed(ids))))


def _stacked(forward) -> FlaxModel:
    kind = type("Forward", (_Forward,), {"forward": staticmethod(forward)})
    config = dataclasses.replace(CONFIG, num_layers=4)
    return FlaxModel(lambda rngs: kind(config, rngs=rngs), rules=flax_llama.RULES,
                     num_heads=CONFIG.num_heads, num_kv_heads=CONFIG.num_kv_heads,
                     stacked="blocks")  # fmt: skip


def _scan(**options):
    def forward(model, x):
        return nnx.scan(lambda x, block: block(x), **options)(x, model.blocks)

    return forward


@pytest.mark.parametrize(
    ("model", "match"),
    [(_stacked(_scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))),
      r"blocks: nnx.scan over the stacked blocks with out_axes=\(.*Carry.*, 0\); FlaxModel "
      r"runs nnx.scan\(f, in_axes=\(nnx.Carry, 0\[, None …\]\), out_axes=nnx.Carry\)"),
     (_stacked(_scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, reverse=True)),
      "with reverse=True"),
     (_stacked(_scan(in_axes=(nnx.Carry, 0))), r"with out_axes=\(.*Carry.*, 0\)"),
     (_stacked(lambda model, x: nnx.scan(lambda c, block: (block(c[0]), c[1]),
                                         in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(
         (x, x), model.blocks)[0]),
      "carries a tuple; FlaxModel carries one array from block to block"),
     (_stacked(lambda model, x: model.blocks(x)),
      "blocks: the stacked blocks were called directly"),
     (_stacked(lambda model, x: nnx.scan(nnx.remat(lambda x, block: block(x)),
                                         in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(
         x, model.blocks)), r"a transform inside the function nnx.scan runs .* \(nnx.remat"),
     (_stacked(lambda model, x: x),
      "the stacked blocks blocks that stacked= names were not run by the module's forward")],
    ids=["out-axes", "reverse", "out-axes-default", "tuple-carry", "called", "remat", "not-run"],
)  # fmt: skip
def test_what_shardops_cannot_run_of_stacked_blocks_is_refused_by_name(model, match):
    setup = models.build("2d+1f1b", mesh_for(STRATEGIES["2d+1f1b"]), model=model,
                         optimizer=optax.sgd(0.1), microbatches=MICROBATCHES)  # fmt: skip
    with pytest.raises(ValueError, match=match):
        setup.collective_budget(16, 16)  # traces the step: the forward meets the strategy
    assert nnx.scan is FLAX_SCAN, "nnx.scan left patched"


def _blocks_second(model, x):  # the migration guide's order: the module scanned, x carried
    return nnx.scan(lambda block, x: block(x), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(
        model.blocks, x
    )


def _by_keyword(model, x):  # arguments by keyword, a default left out
    def step(x, block, positions=None):
        return block(x, positions)

    return nnx.scan(step, in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)(x=x, block=model.blocks)


@pytest.mark.parametrize("forward", [_blocks_second, _by_keyword], ids=["blocks-first", "keywords"])
def test_a_scan_s_argument_order_and_keywords_are_flax_s(forward):
    """The logits under tp equal the module's own (Flax's nnx.scan, unsharded)."""
    model = _stacked(forward)
    setup = models.build("tp", mesh_for(STRATEGIES["tp"]), model=model, optimizer=optax.sgd(0.1))
    params = model.init(jax.random.key(0))
    ids = batches("llama")[0][0]
    got = np.asarray(setup.logits(setup.shard(params).params, setup.place_batch(ids)))
    np.testing.assert_allclose(got, np.asarray(model.module(params)(ids)), atol=2e-5, rtol=0)


def test_pp_of_a_flax_module_without_stacked_blocks_is_refused_when_built():
    with pytest.raises(
        ValueError,
        match=r"the model's plan stacks none .* a Flax module's "
        r"blocks stacked by nnx.vmap: FlaxModel\(stacked=\.\.\.\)",
    ):
        _specs(flax_model("llama"))


def _stacked_llama(rngs):
    return StackedLlama(dataclasses.replace(CONFIG, num_layers=4), rngs=rngs)


@pytest.mark.parametrize(
    ("make", "stacked", "match"),
    [(_stacked_llama, "stack",
      r"FlaxModel\(stacked='stack'\): no sub-module of blocks there; the module's are"),
     (_stacked_llama, "head", r"FlaxModel\(stacked='head'\): no sub-module of blocks there"),
     (lambda rngs: flax_llama.Llama(CONFIG, rngs=rngs), "blocks.0",
      r"stacked='blocks\.0'\): every parameter of the stacked blocks holds \[L, …\]")],
    ids=["missing", "a-layer", "unstacked"],
)  # fmt: skip
def test_a_stacked_path_that_names_no_stacked_blocks_is_refused(make, stacked, match):
    with pytest.raises(ValueError, match=match):
        FlaxModel(make, rules=flax_llama.RULES, stacked=stacked)


class _Square(nnx.Module):
    def __init__(self, d, *, rngs):
        self.proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)


def test_stacked_blocks_whose_dim_0_is_not_the_layers_are_refused():
    """3 blocks of one Linear(8, 8) stacked along dim 1 (``nnx.vmap(out_axes=1)``): every
    parameter's dim 0 agrees (8), and one block's kernel [3, 8] is not the Linear's [8, 8]."""

    def make(rngs):
        module = nnx.Module()
        module.blocks = nnx.split_rngs(splits=3)(
            nnx.vmap(lambda rngs: _Square(8, rngs=rngs), in_axes=0, out_axes=1)
        )(rngs)
        return module

    with pytest.raises(
        ValueError,
        match=r"proj\.kernel of one block has shape \(3, 8\), but the "
        r"Linear holds \(8, 8\); .*\(nnx\.vmap's out_axes=0\)",
    ):
        FlaxModel(make, task="classify", stacked="blocks", example_shape=(8,))


SCAN_BUILT_BEFORE = nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0),
                             out_axes=nnx.Carry)  # fmt: skip


def test_a_scan_built_before_the_forward_names_the_stacked_blocks():
    """A scan FlaxModel cannot patch (built at import) receives the stacked blocks: the error
    names them and the form to use."""
    model = _stacked(lambda model, x: SCAN_BUILT_BEFORE(x, model.blocks))
    setup = models.build("tp", mesh_for(STRATEGIES["tp"]), model=model, optimizer=optax.sgd(0.1))
    with pytest.raises(
        ValueError,
        match=r"blocks: the stacked blocks reached a scan FlaxModel does not run \(Expected an "
        r"array, got StackedBlocks.*\); scan them with nnx\.scan\(f, in_axes=.* built inside",
    ):
        setup.collective_budget(16, 16)
    assert nnx.scan is FLAX_SCAN


def test_the_module_reading_an_attribute_of_the_stacked_blocks_is_refused():
    model = _stacked(lambda model, x: model.blocks.attn(x))
    setup = models.build("tp", mesh_for(STRATEGIES["tp"]), model=model, optimizer=optax.sgd(0.1))
    with pytest.raises(
        AttributeError,
        match=r"blocks\.attn: the module's code reads an attribute "
        r"of the stacked blocks, whose parameters are laid out "
        r"by the strategy; scan over them with nnx\.scan",
    ):
        setup.collective_budget(16, 16)
    assert nnx.scan is FLAX_SCAN
