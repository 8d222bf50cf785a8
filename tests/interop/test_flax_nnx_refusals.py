"""What ``FlaxModel`` cannot run explicitly is refused by name, with the fix; and mutants
of the adapter, each caught by the Flax checks (tests/_flax_checks.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _flax_checks import (
    MAKE,
    MLP_RULES,
    ORIGINAL_ATTENTION,
    STRATEGIES,
    FlaxModel,
    Mlp,
    _check_attention_core,
    _check_plan,
    _mutant,
    annotated,
    check_trains_like_flax,
    flax_llama,
    flax_model,
    mesh_for,
)
from flax import nnx

import shardops_models as models


class Conv(nnx.Module):
    def __init__(self, *, rngs):
        self.conv = nnx.Conv(3, 4, kernel_size=(3,), rngs=rngs)
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.conv(x).mean(1))


class OwnMatmul(nnx.Module):
    def __init__(self, *, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 2)))

    def __call__(self, x):
        return jnp.dot(x, self.w[...])


class Bf16(nnx.Module):
    def __init__(self, *, rngs):
        self.out = nnx.Linear(4, 2, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


class Bf16Params(nnx.Module):
    def __init__(self, *, rngs):
        self.out = nnx.Linear(4, 2, param_dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


class KeepsRngs(nnx.Module):
    def __init__(self, *, rngs):
        self.out, self.dropout = nnx.Linear(4, 2, rngs=rngs), nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.out(x))


def _odd_einsum(rngs):
    return nnx.Einsum("BD,NDH->BNH", (2, 4, 3), rngs=rngs)


def _head_dim_split(rngs):
    init = annotated(nnx.initializers.lecun_normal(), ("embed", "heads", "head_dim"))
    return nnx.LinearGeneral(4, (2, 2), kernel_init=init, rngs=rngs)


def _split_both(rngs):
    init = annotated(nnx.initializers.lecun_normal(), ("mlp", "mlp"))
    return nnx.Linear(4, 4, kernel_init=init, rngs=rngs)


@pytest.mark.parametrize(
    ("make", "rules", "strategy", "error", "match"),
    [
        (Conv, (), "dp", ValueError, r"parameter conv\.\w+ belongs to Conv at conv, which "
                                     r"shardops cannot run"),
        (OwnMatmul, (), "dp", ValueError, r"parameter w belongs to OwnMatmul at the module"),
        (Bf16, (), "dp", ValueError, r"out: Linear\(dtype=bfloat16\) but the precision policy "
                                     r"computes in float32"),
        (Bf16Params, (), "dp", ValueError, r"out: Linear\(param_dtype=bfloat16\) but the "
                                           r"precision policy keeps parameters in float32"),
        (KeepsRngs, (), "dp", ValueError, r"dropout\.rngs.* not an nnx\.Param"),
        (_split_both, [("mlp", "model")], "2d", ValueError, r"kernel: both dims map to 'model'"),
        (lambda rngs: Mlp(24, 64, 8, rngs=rngs), [("mlp", "data")], "2d", ValueError,
         r"\w+\.kernel: rules map 'mlp' to 'data'; shardops splits parameters over the data"),
        (_odd_einsum, (), "dp", ValueError, r"nnx\.Einsum\('BD,NDH->BNH'\) is not a dense "
                                            r"layer's contraction"),
        (_head_dim_split, [("head_dim", "model")], "2d", ValueError,
         r"the dims mapped to 'model' are \[2\] of a kernel \[\*in \(1 dims\), \*out\]"),
        ("llama", flax_llama.RULES, "2d+ep", ValueError,
         r"strategy '2d\+ep' splits experts over 'expert' \(ep\), and the model's plan gives "
         r"no parameter the role 'experts'"),
    ],
    ids=["conv", "own-matmul", "dtype", "param-dtype", "rngs", "both-dims", "data-rule", "einsum", "head-dim",
         "ep"],
)  # fmt: skip
def test_what_shardops_cannot_run_explicitly_is_refused_by_name(make, rules, strategy, error,
                                                                 match):  # fmt: skip
    make = MAKE[make] if make == "llama" else make
    mesh = {"dp": {"data": 8}, "2d": {"data": 4, "model": 2},
            "2d+ep": {"data": 2, "expert": 2, "model": 2}}  # fmt: skip
    with pytest.raises(error, match=match):
        model = FlaxModel(lambda rngs: make(rngs=rngs), rules=rules, task="classify"
                          if make is not MAKE["llama"] else "lm", example_shape=(4,),
                          num_heads=4, num_kv_heads=2)  # fmt: skip
        setup = models.build(strategy, mesh_for(mesh[strategy]), model=model,
                             optimizer=optax.sgd(0.1))  # fmt: skip
        setup.collective_budget(8, 16)  # traces the step: the layers meet the strategy here


@pytest.mark.parametrize(
    ("name", "positions", "rules", "strategy", "match"),
    [
        # Context parallelism: positions the module would compute from its block.
        ("llama-sdpa", None, flax_llama.RULES, "2d+ring",
         r"under '2d\+ring': context parallelism gives each device chunks i and 2N−1−i .* "
         r"FlaxModel\(positions='positions'\)"),
        # Its own einsum attention would see the block alone.
        ("llama", "positions", flax_llama.RULES, "2d+ring",
         r"the module called no attention shardops runs"),
        # nnx.MultiHeadAttention's causal mask over the whole sequence (Flax's attention
        # passes it on to JAX's): the context method computes no mask.
        ("mha", "positions", flax_llama.RULES, "2d+ring",
         r"jax\.nn\.dot_product_attention under context parallelism, called with mask"),
        # Sequence parallelism: a post-norm block's sublayer reads the residual stream.
        ("llama-post-norm", None, flax_llama.RULES, "dp_sp",
         r"blocks\.0\.attn\.wo: row-parallel under sequence parallelism, but its input is this "
         r"device's block .* pre-norm"),
        # Sequence parallelism: a replicated MLP reading the gathered norm output.
        ("llama", None, [(n, None if n == "mlp" else a) for n, a in flax_llama.RULES], "dp_sp",
         r"blocks\.0\.mlp\.gate: replicated .* under sequence parallelism its input is the "
         r"whole sequence"),
    ],
    ids=["cp-no-positions", "cp-own-attention", "cp-mha-mask", "sp-post-norm",
         "sp-replicated-mlp"],
)  # fmt: skip
def test_a_split_sequence_the_module_cannot_see_is_refused(name, positions, rules, strategy,
                                                           match):  # fmt: skip
    model = FlaxModel(MAKE[name], rules=rules, positions=positions, num_heads=4,
                      num_kv_heads=None if name == "mha" else 2)  # fmt: skip
    setup = models.build(strategy, mesh_for(STRATEGIES[strategy]), model=model,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    with pytest.raises(ValueError, match=match):
        setup.collective_budget(8, 16)  # traces the step


@pytest.mark.parametrize(
    ("line", "replacement", "check"),
    [
        # Every Linear silently replicated: the values stay right; the plan (and the ledger,
        # with no tp collective) is what sees it.
        ("        return COLUMN if split[1] else ROW if split[0] else REPLICATED",
         "        return REPLICATED", "plan"),
        # A Linear's bias dropped on the way to ctx.dense: the trajectory sees it.
        ('''    renames = {LINEAR: {"kernel": "w", "bias": "b"}, EMBED: {"embedding": "table"}}.get(kind, {})''',
         '''    renames = {LINEAR: {"kernel": "w"}, EMBED: {"embedding": "table"}}.get(kind, {})
    p = {k: v for k, v in p.items() if k != "bias"}''', "train"),
        # A norm's epsilon not passed on (the ctx layer's default, 1e-5, for the MLP's 1e-3).
        ("            y = self._run(lambda q, x: norm(q, x, eps=self.eps), p, x)",
         "            y = self._run(lambda q, x: norm(q, x), p, x)", "train"),
        # The attention functions left as they are: JAX's own runs (the same values).
        ('ATTENTION_FUNCTIONS = ((jax.nn, "dot_product_attention"), (nnx, "dot_product_attention"))',
         "ATTENTION_FUNCTIONS = ()", "attention"),
        # Under cp, each device's queries over its own block only (no context method).
        ("                                            context=context)  # fmt: skip",
         "                                            context=None)  # fmt: skip", "context"),
    ],
    ids=["linear-replicated", "bias-dropped", "norm-eps-dropped", "attention-not-swapped",
         "block-attention-under-cp"],
)  # fmt: skip
def test_a_mutant_of_the_adapter_is_caught(line, replacement, check):
    module = _mutant(line, replacement)
    name = {"plan": "llama", "context": "llama-sdpa"}.get(check, "mlp")
    with pytest.raises(AssertionError):
        if check == "plan":
            _check_plan(flax_model(name, module))
        elif check == "attention":
            _check_attention_core(module)
        else:
            strategy = "2d+ring" if check == "context" else "2d"
            check_trains_like_flax(flax_model(name, module), name, strategy, "sgd")


def test_the_unmutated_adapter_copy_passes():
    module = _mutant(
        "        self.layer_norm = isinstance(layer, nnx.LayerNorm)",
        "        self.layer_norm = isinstance(layer, nnx.LayerNorm)",
    )
    _check_plan(flax_model("llama", module))
    check_trains_like_flax(flax_model("mlp", module), "mlp", "2d", "sgd")


# The collectives of one 2d step (data=4 × model=2, SGD, global batch 16: b = 4 a device),
# float32, counted by hand from the modules' shapes: (count, bytes) per (kind, axes, dtype).


def _kv_unsplit(rules):
    return [(n, None if n == "kv_heads" else a) for n, a in rules]


@pytest.mark.parametrize(
    ("name", "rules", "mesh", "match"),
    [
        # K/V replicated while the query heads are split: each device's query heads would
        # read the wrong KV heads (JAX's own attention pairs them by local index).
        ("llama-sdpa", _kv_unsplit(flax_llama.RULES), {"data": 4, "model": 2},
         r"this device holds 2 query heads and 2 KV heads; the model's 4 and 2 split over "
         r"'model' \(size 2\) give 2 and 1"),
        # 2 KV heads over 4 devices: a device would hold half a head (stored padded).
        ("llama-general", flax_llama.RULES, {"data": 2, "model": 4},
         r"num_kv_heads=2 is not divisible by the tp axis 'model' \(size 4\)"),
        # A hidden size the tp axis does not divide: the user's code would see the padding.
        ("mlp-60", MLP_RULES, {"data": 1, "model": 8},
         r"(up|down)\.kernel of shape \(\d+, \d+\) is split over the tp axis 'model', which "
         r"does not divide it \(stored padded to \(\d+, \d+\)\)"),
    ],
    ids=["kv-replicated", "kv-heads-do-not-divide", "padded-hidden"],
)  # fmt: skip
def test_heads_and_widths_a_device_cannot_hold_whole_are_refused(name, rules, mesh, match):
    if name == "mlp-60":
        model = FlaxModel(lambda rngs: Mlp(24, 60, 8, rngs=rngs), rules=rules, task="classify",
                          example_shape=(24,))  # fmt: skip
    else:
        model = FlaxModel(MAKE[name], rules=rules, num_heads=4, num_kv_heads=2)
    setup = models.build("2d", mesh_for(mesh), model=model, optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match=match):
        setup.collective_budget(8, 16)
    assert jax.nn.dot_product_attention is ORIGINAL_ATTENTION  # restored after the error


class ReadsItsEmbedding(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)

    def __call__(self, ids):
        return self.embed(ids) @ self.embed.embedding[...].T  # a tied head by hand


class PassesANormMask(nnx.Module):
    def __init__(self, *, rngs):
        self.norm, self.out = nnx.RMSNorm(4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(x, mask=x > 0))


@pytest.mark.parametrize(
    ("make", "task", "match"),
    [
        (ReadsItsEmbedding, "lm", r"embed\.embedding: the module's code reads an attribute of a "
                                  r"layer FlaxModel runs .*a tied head: embed\.attend\(x\)"),
        (PassesANormMask, "classify", r"norm: called with mask=.*; under FlaxModel a layer takes "
                                      r"its input alone"),
    ],
    ids=["reads-a-weight", "extra-argument"],
)  # fmt: skip
def test_a_module_that_reaches_into_a_swapped_layer_is_refused_by_name(make, task, match):
    model = FlaxModel(lambda rngs: make(rngs=rngs), task=task, example_shape=(4,))
    setup = models.build("dp", mesh_for(STRATEGIES["dp"]), model=model, optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError if task == "classify" else AttributeError, match=match):
        setup.collective_budget(8, 4)


def test_the_first_rule_for_a_name_holds_as_in_flax():
    """MaxText's tables repeat a name (fallbacks); the first rule holds."""
    model = FlaxModel(MAKE["mlp"], rules=[("mlp", "model"), ("mlp", None)], task="classify")
    assert model.plan()["up"]["kernel"] == "column"


def _one(layer):
    """A module holding one layer (``layer(rngs)``), called on its input."""

    class One(nnx.Module):
        def __init__(self, *, rngs):
            self.layer = layer(rngs)

        def __call__(self, x):
            return self.layer(x)

    return lambda rngs: One(rngs=rngs)


def _features_split(rngs):
    init = annotated(nnx.initializers.normal(1.0), ("vocab", "embed"))
    return nnx.Embed(8, 4, embedding_init=init, rngs=rngs)


@pytest.mark.parametrize(
    ("make", "options", "rules", "match"),
    [
        (_one(lambda r: nnx.Linear(4, 2, precision="highest", rngs=r)), {}, (),
         r"layer: Linear with precision='highest'; shardops runs dense layers with its kernels"),
        (_one(lambda r: nnx.LayerNorm(4, reduction_axes=(-2, -1), rngs=r)), {}, (),
         r"layer: LayerNorm over the last axis only"),
        (_one(lambda r: nnx.LinearGeneral(4, 2, axis=0, rngs=r)), {}, (),
         r"layer: nnx\.LinearGeneral\(axis=\(0,\), .*contracts the trailing dims of x"),
        (_one(lambda r: nnx.Einsum("BD,DF->BF", (4, 2), (4,), rngs=r)), {}, (),
         r"layer: nnx\.Einsum's bias \(4,\) is not its output features \(2,\)"),
        (_one(_features_split), {"task": "lm"}, [("embed", "model")],
         r"layer\.embedding: its features dim maps to 'model'"),
        (_one(lambda r: nnx.RMSNorm(4, scale_init=annotated(nnx.initializers.ones_init(),
                                                            ("embed",)), rngs=r)),
         {}, [("embed", "model")], r"layer\.scale: a norm's features are not split"),
        (_one(lambda r: nnx.Linear(4, 2, rngs=r)), {"task": "translate"}, (),
         r"FlaxModel: task must be one of \('lm', 'classify'\); got 'translate'"),
        (_one(lambda r: nnx.Linear(4, 2, rngs=r)), {}, 5, r"FlaxModel: rules must be"),
        (lambda rngs: jnp.zeros(3), {}, (), r"make\(rngs\) must return an nnx\.Module; got"),
        (_one(lambda r: nnx.Linear(4, 2, rngs=r)), {"task": "lm"}, (),
         r"the module needs one nnx\.Embed \(the tokens'\); it has 0"),
    ],
    ids=["precision", "norm-axes", "general-axis", "einsum-bias", "embed-features",
         "norm-split", "task", "rules", "not-a-module", "no-embed"],
)  # fmt: skip
def test_each_layer_option_shardops_cannot_honour_is_refused_at_once(make, options, rules,
                                                                      match):  # fmt: skip
    """Refused when the model is made or its plan read, before anything is traced."""
    with pytest.raises((ValueError, TypeError), match=match):
        FlaxModel(make, rules=rules, **{"task": "classify", **options}).plan()


def test_a_classifier_needs_its_example_shape_and_integer_labels():
    model = FlaxModel(_one(lambda r: nnx.Linear(4, 2, rngs=r)), task="classify")
    with pytest.raises(ValueError, match=r"give example_shape \(one example's shape"):
        model.abstract_batch(8, None)
    with pytest.raises(ValueError, match=r"labels must be integer classes of shape \(8,\); got "
                                         r"float32\(8, 2\)"):  # fmt: skip
        model.check_batch(np.zeros((8, 4), np.float32), np.zeros((8, 2), np.float32))
