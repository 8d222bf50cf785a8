"""Flax NNX modules as their authors wrote them (``examples/flax_llama.py``, an MLP here), trained
by ``FlaxModel`` under the strategies, each against the same module trained by Flax itself
(``nnx.jit``, ``nnx.Optimizer``) unsharded; the plan read from the annotations; the refusals.

The reference shares nothing with shardops but the initial key: Flax builds the module, computes
the loss of its own ``__call__`` and applies optax's update. Five steps: the losses at every step
and the parameters after the last are held to ``_gpt_checks.TOL`` (sharding only reorders float32
sums), and every parameter must move ≥ 100× that bound, so a zeroed, doubled or dropped gradient
(or a layer left out of the swap) cannot hide under it.
"""

import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cover import cover
from _gpt_checks import TOL, check_budget, optimizer
from _lm_budgets import by_dtype
from _model_checks import TRAJECTORY_ERRORS, mesh_for
from _mutants import copies
from _resume_checks import load_example, run_main
from flax import nnx

import shardops
import shardops_models as models
from shardops_models.interop import flax_nnx
from shardops_models.interop.flax_nnx import FlaxModel
from shardops_models.training.checkpoint import Checkpoints

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
import flax_llama

STEPS, BATCH, SEQ, SGD_LR, MIN_MOVE = 5, 16, 16, 0.5, 100
# Flax's run and shardops' reduce in other orders (Flax's softmax cross-entropy over the whole
# vocabulary, shardops' vocab-parallel one; the data axes' sums). The Llama's loss (≈ 5.6,
# float32 ulp 4.8e-7) came within 3.8e-6 (8 ulps) of Flax's in every case under the default
# run's compiler: held to 8e-6, twice that, still 100× under the 1e-3 that the mutants below
# move it by (a bias dropped, a norm's epsilon lost). Parameters as the GPT's.
TOL = {opt: {**bounds, "loss": 8e-6} for opt, bounds in TOL.items()}


def annotated(init, names):
    return nnx.with_partitioning(init, names)


class Mlp(nnx.Module):
    """An MLP as Flax's guide to scaling writes one: LayerNorm, then Linear → ReLU → Linear."""

    def __init__(self, d_in: int, d_hidden: int, classes: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d_in, epsilon=1e-3, rngs=rngs)
        self.up = nnx.Linear(
            d_in, d_hidden, rngs=rngs,
            kernel_init=annotated(nnx.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=annotated(nnx.initializers.normal(0.1), ("mlp",)),
        )  # fmt: skip
        self.down = nnx.Linear(
            d_hidden, classes, rngs=rngs,
            kernel_init=annotated(nnx.initializers.lecun_normal(), ("mlp", "embed")),
            bias_init=annotated(nnx.initializers.normal(0.1), ("embed",)),
        )  # fmt: skip

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(self.norm(x))))  # (B, classes)


class SdpaAttention(flax_llama.Attention):
    """The example's attention as many Flax models write it: ``jax.nn.dot_product_attention``
    (grouped heads, causal), or Flax's own ``nnx.dot_product_attention`` over K/V repeated."""

    def __call__(self, x):
        b, s, hd, theta = x.shape[0], x.shape[1], self.c.head_dim, self.c.rope_theta
        q = flax_llama.rope(self.wq(x).reshape(b, s, -1, hd), theta)  # (B, S, H, hd)
        k = flax_llama.rope(self.wk(x).reshape(b, s, -1, hd), theta)  # (B, S, KV, hd)
        v = self.wv(x).reshape(b, s, -1, hd)  # (B, S, KV, hd)
        if self.flax:
            group = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
            o = nnx.dot_product_attention(q, k, v, is_causal=True)
        else:
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # (B, S, H, hd)
        return self.wo(o.reshape(b, s, -1))


def sdpa_llama(rngs, flax: bool = False):
    """The example's Llama with ``SdpaAttention`` in each block."""
    model = flax_llama.Llama(CONFIG, rngs=rngs)
    for block in model.blocks:
        attention = block.attn
        attention.__class__ = SdpaAttention  # the same parameters, the other __call__
        attention.flax = flax
    return model


class GeneralAttention(nnx.Module):
    """Attention as MaxText writes it: ``nnx.LinearGeneral`` projections to ``[heads,
    head_dim]`` and back from them (``axis=(-2, -1)``), JAX's dot-product attention."""

    def __init__(self, c, *, rngs):
        def proj(d_in, d_out, names, axis=-1):
            init = annotated(nnx.initializers.lecun_normal(in_axis=0, out_axis=-1), names)
            return nnx.LinearGeneral(d_in, d_out, axis=axis, use_bias=False, kernel_init=init,
                                     rngs=rngs)  # fmt: skip

        self.c, hd = c, c.head_dim
        self.wq = proj(c.d_model, (c.num_heads, hd), ("embed", "heads", "head_dim"))
        self.wk = proj(c.d_model, (c.num_kv_heads, hd), ("embed", "kv_heads", "head_dim"))
        self.wv = proj(c.d_model, (c.num_kv_heads, hd), ("embed", "kv_heads", "head_dim"))
        self.wo = proj((c.num_heads, hd), c.d_model, ("heads", "head_dim", "embed"), (-2, -1))

    def __call__(self, x):
        q = flax_llama.rope(self.wq(x), self.c.rope_theta)  # (B, S, H, hd)
        k = flax_llama.rope(self.wk(x), self.c.rope_theta)  # (B, S, KV, hd)
        o = jax.nn.dot_product_attention(q, k, self.wv(x), is_causal=True)  # (B, S, H, hd)
        return self.wo(o)  # (B, S, D)


class EinsumMlp(nnx.Module):
    """SwiGLU written with ``nnx.Einsum`` (gemma's style), biased up projection."""

    def __init__(self, c, *, rngs):
        def einsum(equation, shape, names, bias=None):
            init = annotated(nnx.initializers.lecun_normal(), names)
            bias_init = annotated(nnx.initializers.normal(0.1), names[1:])
            return nnx.Einsum(equation, shape, bias, kernel_init=init, bias_init=bias_init,
                              rngs=rngs)  # fmt: skip

        self.gate = einsum("BTD,DF->BTF", (c.d_model, c.d_ff), ("embed", "mlp"))
        self.up = einsum("...D,DF->...F", (c.d_model, c.d_ff), ("embed", "mlp"), (c.d_ff,))
        self.down = einsum("BTF,FD->BTD", (c.d_ff, c.d_model), ("mlp", "embed"))

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def general_llama(rngs):
    """The example's Llama with MaxText's projections and gemma's Einsum MLP in each block."""
    model = flax_llama.Llama(CONFIG, rngs=rngs)
    for block in model.blocks:
        block.attn, block.mlp = GeneralAttention(CONFIG, rngs=rngs), EinsumMlp(CONFIG, rngs=rngs)
    return model


class MhaLm(nnx.Module):
    """One block of Flax's own ``nnx.MultiHeadAttention`` (its causal mask from
    ``nnx.make_causal_mask``) between an embedding and a head, as Flax's examples write it."""

    def __init__(self, *, rngs):
        c = CONFIG
        init = annotated(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embed = nnx.Embed(c.vocab_size, c.d_model, embedding_init=init, rngs=rngs)
        self.norm = nnx.LayerNorm(c.d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            c.num_heads, c.d_model, decode=False, keep_rngs=False, deterministic=True,
            use_bias=False, rngs=rngs,
            kernel_init=annotated(nnx.initializers.lecun_normal(), ("embed", "heads", "kv")),
            out_kernel_init=annotated(nnx.initializers.lecun_normal(), ("heads", "kv", "embed")),
        )  # fmt: skip
        init = annotated(nnx.initializers.lecun_normal(), ("embed", "vocab"))
        self.head = nnx.Linear(c.d_model, c.vocab_size, kernel_init=init, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)  # (B, S, D)
        x = x + self.attn(self.norm(x), mask=nnx.make_causal_mask(ids))
        return self.head(x)  # (B, S, V)


MLP_RULES = (("batch", "data"), ("embed", None), ("mlp", "model"))
CONFIG = flax_llama.Config()
MAKE = {
    "mlp": lambda rngs: Mlp(24, 64, 8, rngs=rngs),
    "llama": lambda rngs: flax_llama.Llama(CONFIG, rngs=rngs),
    "llama-sdpa": sdpa_llama,
    "llama-nnx-sdpa": lambda rngs: sdpa_llama(rngs, flax=True),
    "llama-general": general_llama,
    "mha": lambda rngs: MhaLm(rngs=rngs),
}


def flax_model(name: str, module=flax_nnx) -> FlaxModel:
    if name == "mlp":
        return module.FlaxModel(
            MAKE["mlp"], rules=MLP_RULES, task="classify", name="flax mlp", example_shape=(24,)
        )
    kv_heads = None if name == "mha" else CONFIG.num_kv_heads  # MHA: a KV head per query head
    return module.FlaxModel(MAKE[name], rules=flax_llama.RULES, name=f"flax {name}",
                            num_heads=CONFIG.num_heads, num_kv_heads=kv_heads)  # fmt: skip


def batches(name: str):
    rng = np.random.default_rng(1)
    if name == "mlp":  # the Llamas' batches: tokens
        xs = rng.normal(size=(STEPS, BATCH, 24)).astype(np.float32)
        return xs, rng.integers(0, 8, (STEPS, BATCH)).astype(np.int32)
    tokens = rng.integers(0, CONFIG.vocab_size, (STEPS, BATCH, SEQ + 1)).astype(np.int32)
    return tokens[..., :-1], tokens[..., 1:]


@functools.cache
def flax_trajectory(name: str, opt_name: str):
    """Losses, each step's gradients and the final parameters of the module trained by Flax
    alone, unsharded (once per session for each module and optimizer)."""
    with nnx.use_eager_sharding(False):
        module = MAKE[name](nnx.Rngs(jax.random.key(0)))
    opt = nnx.Optimizer(module, optimizer(opt_name, sharded=False, sgd_lr=SGD_LR), wrt=nnx.Param)

    @nnx.jit
    def step(module, opt, x, y):
        def loss(module):
            return optax.softmax_cross_entropy_with_integer_labels(module(x), y).mean()

        value, grads = nnx.value_and_grad(loss)(module)
        opt.update(module, grads)
        return value, grads

    losses, grads = [], []
    for x, y in zip(*batches(name), strict=True):
        loss, g = step(module, opt, x, y)
        losses.append(float(loss))
        grads.append(nnx.to_pure_dict(g))
    return np.array(losses), grads, nnx.to_pure_dict(nnx.state(module, nnx.Param))


STRATEGIES = {"ref": None, "dp": {"data": 8}, "fsdp": {"data": 8}, "zero1": {"data": 8},
              "tp": {"data": 1, "model": 2}, "2d": {"data": 4, "model": 2},
              "fsdp_tp": {"data": 4, "model": 2},
              "hsdp_tp": {"replica": 2, "data": 2, "model": 2}}  # fmt: skip
CASES = cover(["mlp", "llama"], list(STRATEGIES), ["sgd", "adam"])


def train(model, strategy: str, opt_name: str, name: str, budget: bool = False, **options):
    """Losses, SGD's gradients as each step applied them ((p_t − p_t+1) / lr; none for Adam)
    and the final parameters of ``model`` trained by shardops under ``strategy``."""
    setup = models.build(strategy, mesh_for(STRATEGIES[strategy]), model=model,
                         optimizer=optimizer(opt_name, sgd_lr=SGD_LR), **options)  # fmt: skip
    state = setup.shard(model.init(jax.random.key(0)))
    xs, ys = batches(name)
    step = setup.train_step.lower(state, *setup.place_batch(xs[0], ys[0])).compile()
    if budget:
        check_budget(setup, step, xs.shape[1:])
    losses, grads, before = [], [], setup.gather(state.params)
    for x, y in zip(xs, ys, strict=True):
        state, loss = step(state, *setup.place_batch(x, y))
        losses.append(float(loss))  # one step in flight
        if opt_name == "sgd":
            after = setup.gather(state.params)
            grads.append(jax.tree.map(lambda p, q: (np.float64(p) - q) / SGD_LR, before, after))
            before = after
    return np.array(losses), grads, setup.gather(state.params)


def check_trains_like_flax(model, name: str, strategy: str, opt_name: str, budget=False,
                           **options):  # fmt: skip
    losses, grads, params = train(model, strategy, opt_name, name, budget, **options)
    ref_losses, ref_grads, ref_params = flax_trajectory(name, opt_name)
    tol = TOL[opt_name]
    where = f"{model.name} under {strategy} with {opt_name}"
    # SGD's gradients, read back from each step (rounding ulp(p) / lr ≤ 2.4e-7 at |p| ≤ 1),
    # against Flax's own; Adam's are seen through its parameters.
    grad_errors = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for g, r in zip(grads, ref_grads, strict=False)
                   for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r), strict=True)]  # fmt: skip
    errors = {"loss": float(np.max(np.abs(losses - ref_losses))),
              "grads": max(grad_errors, default=0.0), "params": 0.0}  # fmt: skip
    assert errors["grads"] <= tol["grads"], (where, errors)
    assert errors["loss"] <= tol["loss"], (where, losses, ref_losses)
    start = model.init(jax.random.key(0))
    for (path, p), q, p0 in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree.leaves(ref_params), jax.tree.leaves(start),
                                strict=True):  # fmt: skip
        err = float(np.max(np.abs(np.asarray(p) - np.asarray(q))))
        assert err <= tol["params"], f"{where}: {jax.tree_util.keystr(path)} off by {err:.2e}"
        moved = float(np.max(np.abs(np.asarray(q) - np.asarray(p0))))
        assert moved >= MIN_MOVE * tol["params"], f"{jax.tree_util.keystr(path)} moved {moved}"
        errors["params"] = max(errors["params"], err)
    mesh = STRATEGIES[strategy]
    key = (f"{name} {strategy}", "x".join(map(str, mesh.values())) if mesh else "1", opt_name)
    old = TRAJECTORY_ERRORS.get(key, {})  # the run's report: worst errors against Flax's run
    TRAJECTORY_ERRORS[key] = {k: max(v, old.get(k, 0.0)) for k, v in errors.items()}


@pytest.mark.parametrize(("name", "strategy", "opt_name"), CASES, ids=["-".join(c) for c in CASES])
def test_a_flax_module_trains_like_flax_trains_it(name, strategy, opt_name):
    # The traced budget equals the compiled step's collectives wherever a tp axis splits layers.
    check_trains_like_flax(flax_model(name), name, strategy, opt_name,
                           budget=STRATEGIES[strategy] is not None and "model" in STRATEGIES[strategy])  # fmt: skip


@pytest.mark.parametrize(
    ("name", "strategy", "attention", "remat"),
    [("llama-sdpa", "tp", "einsum", False), ("llama-sdpa", "fsdp_tp", "blocked", "full"),
     ("llama-nnx-sdpa", "2d", "auto", "matmuls"), ("llama", "hsdp_tp", "auto", "full")],
    ids=["jax-sdpa-einsum", "jax-sdpa-blocked-remat", "nnx-sdpa-remat", "einsum-remat"],
)  # fmt: skip
def test_attention_choices_and_remat_policies_reach_the_module(name, strategy, attention, remat):
    """A module calling ``jax.nn.dot_product_attention`` or ``nnx.dot_product_attention`` runs
    the attention ``build`` chose on each device's heads; each swapped layer is a remat unit.
    Both still train like Flax trains the module."""
    check_trains_like_flax(flax_model(name), name, strategy, "adam", attention=attention,
                           remat=remat)  # fmt: skip
    assert jax.nn.dot_product_attention is ORIGINAL_ATTENTION  # restored after the trace


ORIGINAL_ATTENTION = jax.nn.dot_product_attention


@pytest.mark.parametrize("name", ["llama-sdpa", "llama-nnx-sdpa"])
def test_the_attention_runs_shardops_core_in_the_traced_step(name):
    _check_attention_core(flax_nnx, name)


def _check_attention_core(module, name: str = "llama-sdpa") -> None:
    """Under tp the traced step holds shardops' blocked core (its named scope), not JAX's."""
    setup = models.build("tp", mesh_for(STRATEGIES["tp"]), model=flax_model(name, module),
                         optimizer=optax.sgd(0.1), attention="blocked")  # fmt: skip
    state = setup.shard(setup.model.init(jax.random.key(0)))
    xs, ys = batches("llama")
    lowered = setup.train_step.lower(state, *setup.place_batch(xs[0], ys[0]))
    assert "shardops.blocked_attention" in lowered.as_text(debug_info=True)


@pytest.mark.parametrize(
    ("strategy", "opt_name"),
    [("tp", "sgd"), ("fsdp_tp", "adam"), ("hsdp_tp", "sgd"), ("zero1", "adam")],
)
def test_linear_general_and_einsum_layers_train_like_flax(strategy, opt_name):
    """``nnx.LinearGeneral`` to and from ``[heads, head_dim]`` and ``nnx.Einsum`` as dense
    layers: column-parallel by head, row-parallel over the heads, under tp and fsdp."""
    plan = flax_model("llama-general").plan()["blocks"][0]
    assert (plan["attn"]["wq"]["kernel"], plan["attn"]["wo"]["kernel"]) == ("column", "row")
    assert (plan["mlp"]["up"]["bias"], plan["mlp"]["down"]["kernel"]) == ("column", "row")
    check_trains_like_flax(flax_model("llama-general"), "llama-general", strategy, opt_name,
                           budget=strategy != "zero1")  # fmt: skip


@pytest.mark.parametrize(("strategy", "opt_name"), [("tp", "adam"), ("fsdp_tp", "sgd")])
def test_flax_multi_head_attention_with_its_mask_trains_like_flax(strategy, opt_name):
    """``nnx.MultiHeadAttention``: its ``LinearGeneral`` projections swapped (by head), its
    masked attention Flax's own on each device's heads (a ``[B, 1, T, S]`` mask broadcasts)."""
    check_trains_like_flax(flax_model("mha"), "mha", strategy, opt_name)


def test_the_plan_is_read_from_the_annotations_and_the_rules():
    plan = flax_model("llama").plan()
    block = plan["blocks"][0]
    assert plan["embed"] == {"embedding": "vocab"} and plan["head"] == {"kernel": "column"}
    assert block["attn"]["wq"]["kernel"] == block["mlp"]["up"]["kernel"] == "column"
    assert block["attn"]["wo"]["kernel"] == block["mlp"]["down"]["kernel"] == "row"
    assert block["attn_norm"] == {"scale": "replicated"}
    # The same module with a rules table that splits nothing: every layer replicated.
    whole = FlaxModel(MAKE["llama"], rules=[(n, None) for n, _ in flax_llama.RULES])
    assert set(jax.tree.leaves(whole.plan())) == {"replicated"}


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
        ("llama", flax_llama.RULES, "sp", ValueError,
         r"FlaxModel 'flax' under 'sp': sp splits the activations between layers"),
    ],
    ids=["conv", "own-matmul", "dtype", "param-dtype", "rngs", "both-dims", "data-rule", "einsum", "head-dim",
         "sp"],
)  # fmt: skip
def test_what_shardops_cannot_run_explicitly_is_refused_by_name(make, rules, strategy, error,
                                                                 match):  # fmt: skip
    make = MAKE[make] if make == "llama" else make
    mesh = {"dp": {"data": 8}, "2d": {"data": 4, "model": 2}, "sp": {"data": 4, "model": 2}}
    with pytest.raises(error, match=match):
        model = FlaxModel(lambda rngs: make(rngs=rngs), rules=rules, task="classify"
                          if make is not MAKE["llama"] else "lm", example_shape=(4,),
                          num_heads=4, num_kv_heads=2)  # fmt: skip
        setup = models.build(strategy, mesh_for(mesh[strategy]), model=model,
                             optimizer=optax.sgd(0.1))  # fmt: skip
        setup.collective_budget(8, 16)  # traces the step: the layers meet the strategy here


def _mutant(line: str, replacement: str):
    """A copy of ``flax_nnx`` (and the modules it imports), ``line`` replaced in the one
    holding it."""
    modules = ("_flax_dense", "_flax_attention", "flax_nnx")
    return copies("shardops_models.interop", modules, "flax", line, replacement)["flax_nnx"]


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
        ("            y = ctx.unit(lambda q, x: norm(q, x, eps=self.eps), p, x)",
         "            y = ctx.unit(lambda q, x: norm(q, x), p, x)", "train"),
        # The attention functions left as they are: JAX's own runs (the same values).
        ('ATTENTION_FUNCTIONS = ((jax.nn, "dot_product_attention"), (nnx, "dot_product_attention"))',
         "ATTENTION_FUNCTIONS = ()", "attention"),
    ],
    ids=["linear-replicated", "bias-dropped", "norm-eps-dropped", "attention-not-swapped"],
)  # fmt: skip
def test_a_mutant_of_the_adapter_is_caught(line, replacement, check):
    module = _mutant(line, replacement)
    name = "llama" if check == "plan" else "mlp"
    with pytest.raises(AssertionError):
        if check == "plan":
            _check_plan(flax_model(name, module))
        elif check == "attention":
            _check_attention_core(module)
        else:
            check_trains_like_flax(flax_model(name, module), name, "2d", "sgd")


def _check_plan(model) -> None:
    plan = model.plan()
    assert plan["blocks"][0]["attn"]["wq"]["kernel"] == "column", plan


def test_the_unmutated_adapter_copy_passes():
    module = _mutant(
        "        self.layer_norm = isinstance(layer, nnx.LayerNorm)",
        "        self.layer_norm = isinstance(layer, nnx.LayerNorm)",
    )
    _check_plan(flax_model("llama", module))
    check_trains_like_flax(flax_model("mlp", module), "mlp", "2d", "sgd")


# The collectives of one 2d step (data=4 × model=2, SGD, global batch 16: b = 4 a device),
# float32, counted by hand from the modules' shapes: (count, bytes) per (kind, axes, dtype).
HAND = {
    # Mlp(24, 64, 8). Local parameters: LayerNorm scale+bias 2 × 24 × 4 = 192 bytes
    # (replicated), up kernel [24, 64/2] 3,072 and bias [32] 128 (column), down kernel [64/2, 8]
    # 1,024 (row) and bias [8] 32 (added after the row's AllReduce: replicated). Over data: one
    # AllReduce per leaf of its gradient, 6 leaves, 4,448 bytes, and the loss's one float32.
    # Over model: the row layer's output y[4, 8] forward (128) and the column layer's dx[4, 24]
    # backward (384).
    "mlp": {("all-reduce", ("data",), "f32"): (7, 4452),
            ("all-reduce", ("model",), "f32"): (2, 512)},
    # flax_llama.Config(): V = 256, D = 64, H = 4 and KV = 2 heads of 16, F = 128, L = 2, S = 16.
    # Over model, x[4, 16, 64] = 16,384 bytes: forward the vocab-parallel embedding's sum and
    # per block the two row layers' (wo, down); backward per block the five column layers' dx
    # (wq, wk, wv, gate, up) and the head's: 1 + 2 × 7 + 1 = 16 × 16,384; the vocab-parallel
    # loss's max, Σexp and target logit over [4, 16]: 3 × 256. Over data: the 21 leaves'
    # gradients, local bytes: embedding [128, 64] 32,768; per block 2 norms 2 × 256, wq [64, 32]
    # 8,192, wk, wv [64, 16] 2 × 4,096, wo [32, 64] 8,192, gate, up [64, 64], down [64, 64]
    # 3 × 16,384 (74,240); the final norm 256; the head [64, 128] 32,768: 214,272; and the loss.
    "llama": {("all-reduce", ("model",), "f32"): (19, 16 * 16384 + 3 * 256),
              ("all-reduce", ("data",), "f32"): (22, 214272 + 4)},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HAND))
def test_the_ledger_under_2d_is_the_count_by_hand(name):
    """The traced step asks for ``HAND[name]`` (count and bytes), and the compiled step moves
    those bytes."""
    setup = models.build("2d", mesh_for(STRATEGIES["2d"]), model=flax_model(name),
                         optimizer=optax.sgd(SGD_LR))  # fmt: skip
    xs, ys = batches(name)
    assert by_dtype(setup.budget(*xs.shape[1:]).requested) == HAND[name]
    state = setup.shard(setup.model.init(jax.random.key(0)))
    compiled = setup.train_step.lower(state, *setup.place_batch(xs[0], ys[0])).compile()
    moved = by_dtype(shardops.inspect.collectives(setup.mesh, compiled))
    assert {k: b for k, (_, b) in moved.items()} == {k: b for k, (_, b) in HAND[name].items()}


def test_a_checkpoint_saved_under_2d_restores_under_fsdp_and_into_the_flax_module(tmp_path):
    model = flax_model("llama")
    xs, ys = batches("llama")
    saved = models.build("2d", mesh_for(STRATEGIES["2d"]), model=model,
                         optimizer=optimizer("adam"))  # fmt: skip
    state = saved.shard(model.init(jax.random.key(0)))
    for x, y in zip(xs[:2], ys[:2], strict=True):
        state, loss = saved.train_step(state, *saved.place_batch(x, y))
        float(loss)  # one step in flight
    with Checkpoints(tmp_path) as ckpt:
        ckpt.save(2, saved, state)
    fsdp = models.build("fsdp", mesh_for(STRATEGIES["fsdp"]), model=model,
                        optimizer=optimizer("adam"))  # fmt: skip
    with Checkpoints(tmp_path) as ckpt:
        restored, _ = ckpt.restore(fsdp)
        assert ckpt.record()["model"]["config"]["module_type"] == "flax_llama.Llama"
    params = fsdp.gather(restored.params)
    for a, b in zip(jax.tree.leaves(saved.gather(state.params)), jax.tree.leaves(params),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    # Into Flax: the module holding the restored parameters computes the sharded run's logits.
    module = model.module(params)
    assert isinstance(module, flax_llama.Llama)
    assert nnx.to_pure_dict(nnx.state(module, nnx.Param)).keys() == params.keys()
    sharded = saved.logits(state.params, saved.place_batch(xs[2], ys[2])[0])
    np.testing.assert_allclose(module(xs[2]), sharded, atol=1e-5, rtol=0)


def test_the_example_trains_the_flax_llama_like_its_unsharded_run(tmp_path):
    """``transformer_lm.py --model flax-llama`` on fsdp_tp 4×2 with ``--compare-reference``:
    the final losses agree to the example's own limit, a sample is recomputed, no MFU."""
    metrics = tmp_path / "lm.json"
    out = run_main(load_example("transformer_lm"), [
        "--model", "flax-llama", "--strategy", "fsdp_tp", "--mesh", "4x2", "--compare-reference",
        "--text-source", "stdlib", "--steps", "4", "--layers", "2", "--width", "32", "--heads",
        "4", "--context", "16", "--batch-size", "8", "--eval-every", "0", "--eval-batches", "1",
        "--prompt-bytes", "8", "--sample-tokens", "4", "--metrics-json", str(metrics),
    ])  # fmt: skip
    result = json.loads(metrics.read_text())
    assert result["model"] == "flax llama L=2 D=32 H=4/2", result["model"]
    assert abs(result["final_loss"] - result["final_reference_loss"]) <= 4e-6, result
    assert "Decoding by recomputing the prefix" in out and "Model FLOPs utilisation" not in out


@pytest.mark.parametrize(
    ("flags", "says"),
    [(["--moe"], "without --moe"), (["--strategy", "sp", "--mesh", "2x4"], "sequence parallelism"),
     (["--mesh", "1x8"], "num_heads=4 is not divisible by the tp axis 'model' (size 8)")],
    ids=["moe", "sp", "heads"],
)  # fmt: skip
def test_the_example_refuses_what_a_flax_module_cannot_honour(flags, says, capsys):
    """A usage error (exit status 2), before any step: flags, and a mesh the heads do not
    divide (the module's layout checks run in the step's trace, made at set-up)."""
    with pytest.raises(SystemExit) as stop:
        load_example("transformer_lm").main(["--model", "flax-llama", *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and says in err and "Traceback" not in err, err


def test_explain_names_each_collective_and_the_locator_compares_every_layer():
    """``explain`` reads the swapped layers' reasons from the step; ``locate`` compares every
    swapped layer of the Flax module (outputs, gradients, parameter gradients) with the
    unsharded run, each within its bound."""
    from shardops_models.training.locate import locate

    xs, ys = batches("llama")
    model = flax_model("llama")
    setup = models.build("2d", mesh_for(STRATEGIES["2d"]), model=model,
                         optimizer=optax.sgd(SGD_LR))  # fmt: skip
    state = setup.shard(model.init(jax.random.key(0)))
    lines = shardops.inspect.explain(setup.mesh, setup.train_step, state,
                                     *setup.place_batch(xs[0], ys[0]), traced=True)  # fmt: skip
    assert any(line.startswith("row_parallel_dense: psum over 'model'") for line in lines)
    assert any(line.startswith("vocab_parallel_embedding") for line in lines), lines
    report = locate(setup, state.params, xs[0], ys[0])
    assert report.first is None, report
    swapped = {"".join(f"[{k!r}]" for k in path) for path in model._layers}
    assert {row.layer for row in report.rows} == swapped | {"loss"}


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
