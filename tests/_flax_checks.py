"""Shared checks of the Flax NNX tests (tests/interop/test_flax_nnx.py and
test_flax_nnx_refusals.py): the modules, as their authors write them, their batches,
the same module trained by Flax alone, and the trajectory check against it."""

import dataclasses
import functools
import pathlib
import sys

import _foreign_checks
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _cover import cover
from _gpt_checks import TOL, optimizer
from _model_checks import mesh_for
from _mutants import copies
from flax import nnx

import shardops_models as models
from shardops_models.interop import flax_nnx
from shardops_models.interop.flax_nnx import FlaxModel

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
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

    def __call__(self, x, positions=None):
        b, s, hd, theta = x.shape[0], x.shape[1], self.c.head_dim, self.c.rope_theta
        q = flax_llama.rope(self.wq(x).reshape(b, s, -1, hd), theta, positions)  # (B, S, H, hd)
        k = flax_llama.rope(self.wk(x).reshape(b, s, -1, hd), theta, positions)  # (B, S, KV, hd)
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


class SandwichBlock(flax_llama.Block):
    """The example's block with Gemma's norms after each sublayer too (before the residual
    add): under sp a norm of a sublayer's output keeps it this device's block."""

    def __call__(self, x, positions=None):
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), positions))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))


class PostNormBlock(flax_llama.Block):
    """The original Transformer's order, norm(x + f(x)): under sp the sublayer reads the
    residual stream's block."""

    def __call__(self, x, positions=None):
        x = self.attn_norm(x + self.attn(x, positions))
        return self.mlp_norm(x + self.mlp(x))


def blocks_as(cls, rngs, extra_norms: bool = False):
    """The example's Llama with each block's ``__call__`` ``cls``'s (the same parameters, and
    with ``extra_norms`` two more norms a block)."""
    model = flax_llama.Llama(CONFIG, rngs=rngs)
    for block in model.blocks:
        if extra_norms:
            block.post_attn_norm = flax_llama.norm(CONFIG.d_model, CONFIG.norm_eps, rngs)
            block.post_mlp_norm = flax_llama.norm(CONFIG.d_model, CONFIG.norm_eps, rngs)
        block.__class__ = cls
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

    def __call__(self, x, positions=None):
        q = flax_llama.rope(self.wq(x), self.c.rope_theta, positions)  # (B, S, H, hd)
        k = flax_llama.rope(self.wk(x), self.c.rope_theta, positions)  # (B, S, KV, hd)
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

    def __call__(self, ids, positions=None):  # no positional encoding: positions unread
        x = self.embed(ids)  # (B, S, D)
        x = x + self.attn(self.norm(x), mask=nnx.make_causal_mask(ids))
        return self.head(x)  # (B, S, V)


class MoeMlp(nnx.Module):
    """Mixtral's sparse MLP as a Flax user writes one: a router ``nnx.Linear``, each expert's
    SwiGLU stacked in three ``nnx.Param``s ``[E, …]`` (MaxText's ``wi_0``, ``wi_1``, ``wo``),
    the softmax's top k renormalised, every expert run on every token and the k chosen ones'
    outputs added by their weights (dropless); Switch's load-balancing loss over the batch
    sown (``nnx.Intermediate``), for the training loop to add."""

    def __init__(self, c, experts: int, k: int, *, rngs):
        d, f, self.k = c.d_model, c.d_ff, k
        self.router = flax_llama.dense(d, experts, ("embed", None), rngs)
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.wi_0 = nnx.Param(
            annotated(init, ("exp", "embed", "mlp"))(rngs.params(), (experts, d, f))
        )
        self.wi_1 = nnx.Param(
            annotated(init, ("exp", "embed", "mlp"))(rngs.params(), (experts, d, f))
        )
        self.wo = nnx.Param(
            annotated(init, ("exp", "mlp", "embed"))(rngs.params(), (experts, f, d))
        )

    def __call__(self, x):
        probs = jax.nn.softmax(self.router(x), axis=-1)  # (B, S, E)
        top, chosen = jax.lax.top_k(probs, self.k)  # (B, S, k)
        top = top / jnp.sum(top, axis=-1, keepdims=True)
        chose = jax.nn.one_hot(chosen, probs.shape[-1])  # (B, S, k, E)
        share = jnp.mean(jnp.sum(chose, axis=-2), axis=(0, 1)) / self.k  # of the choices, (E,)
        self.sow(nnx.Intermediate, "load_balance",
                 probs.shape[-1] * jnp.sum(share * jnp.mean(probs, axis=(0, 1))))  # fmt: skip
        combine = jnp.sum(chose * top[..., None], axis=-2)  # (B, S, E)
        gate = jnp.einsum("bsd,edf->bsef", x, self.wi_0[...])
        h = jax.nn.silu(gate) * jnp.einsum("bsd,edf->bsef", x, self.wi_1[...])
        y = jnp.einsum("bsef,efd->bsed", h, self.wo[...])  # (B, S, E, D)
        return jnp.einsum("bsed,bse->bsd", y, combine)  # (B, S, D)


EXPERTS, EXPERTS_K = 4, 2


def moe_experts(module=flax_nnx, **changes) -> dict:
    """The declaration of ``MoeMlp`` (``module``'s ``FlaxExperts``): where it sits, its
    parameters and its routing; ``changes``: other values of its fields."""
    fields = {"router": "router.kernel", "gate": "wi_0", "up": "wi_1", "down": "wo",
              "k": EXPERTS_K, **changes}  # fmt: skip
    return {"blocks.*.mlp": module.FlaxExperts(**fields)}


def moe_llama(rngs):
    """The example's Llama with ``MoeMlp`` for each block's MLP."""
    model = flax_llama.Llama(CONFIG, rngs=rngs)
    for block in model.blocks:
        block.mlp = MoeMlp(CONFIG, EXPERTS, EXPERTS_K, rngs=rngs)
    return model


class StackedLlama(flax_llama.Llama):
    """The example's Llama with its blocks stacked by ``nnx.vmap`` (every parameter ``[L, …]``,
    the layers' logical name in front) and run by ``nnx.scan``, as Flax's guide to scanning over
    layers writes them."""

    def __init__(self, c, *, rngs: nnx.Rngs):
        super().__init__(dataclasses.replace(c, num_layers=0), rngs=rngs)

        @nnx.split_rngs(splits=c.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create_block(rngs):
            return flax_llama.Block(c, rngs=rngs)

        self.blocks = create_block(rngs)

    def __call__(self, ids, positions=None):
        @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
        def forward(x, block, positions):
            return block(x, positions)

        return self.head(self.norm(forward(self.embed(ids), self.blocks, positions)))


MLP_RULES = (("batch", "data"), ("embed", None), ("mlp", "model"))
CONFIG = flax_llama.Config()
MAKE = {
    "mlp": lambda rngs: Mlp(24, 64, 8, rngs=rngs),
    "llama": lambda rngs: flax_llama.Llama(CONFIG, rngs=rngs),
    "llama-sdpa": sdpa_llama,
    "llama-nnx-sdpa": lambda rngs: sdpa_llama(rngs, flax=True),
    "llama-general": general_llama,
    "mha": lambda rngs: MhaLm(rngs=rngs),
    "llama-sandwich": lambda rngs: blocks_as(SandwichBlock, rngs, extra_norms=True),
    "llama-post-norm": lambda rngs: blocks_as(PostNormBlock, rngs),
    "llama-moe": moe_llama,
    "llama-stacked": lambda rngs: StackedLlama(
        dataclasses.replace(CONFIG, num_layers=4), rngs=rngs
    ),
}


POSITIONS = ("llama-sdpa", "llama-nnx-sdpa", "llama-general")


def flax_model(name: str, module=flax_nnx, **options) -> FlaxModel:
    if name == "mlp":
        return module.FlaxModel(
            MAKE["mlp"], rules=MLP_RULES, task="classify", name="flax mlp", example_shape=(24,)
        )
    kv_heads = None if name == "mha" else CONFIG.num_kv_heads  # MHA: a KV head per query head
    # The Llamas calling JAX's or Flax's attention take their positions (as MaxText's do): the
    # ones context parallelism runs. The example's own (einsum attention) computes them.
    positions = "positions" if name in POSITIONS else None
    experts = moe_experts(module) if name == "llama-moe" else ()
    if name == "llama-stacked":
        options = {"stacked": "blocks", **options}
    return module.FlaxModel(MAKE[name], rules=flax_llama.RULES, name=f"flax {name}",
                            num_heads=CONFIG.num_heads, num_kv_heads=kv_heads,
                            positions=positions, moe=experts, **options)  # fmt: skip


def batches(name: str):
    rng = np.random.default_rng(1)
    if name == "mlp":  # the Llamas' batches: tokens
        xs = rng.normal(size=(STEPS, BATCH, 24)).astype(np.float32)
        return xs, rng.integers(0, 8, (STEPS, BATCH)).astype(np.int32)
    tokens = rng.integers(0, CONFIG.vocab_size, (STEPS, BATCH, SEQ + 1)).astype(np.int32)
    return tokens[..., :-1], tokens[..., 1:]


@functools.cache
def flax_trajectory(name: str, opt_name: str, load_balance: float = 0.0):
    """Losses, each step's gradients and the final parameters of the module trained by Flax
    alone, unsharded (once per session for each module and optimizer); the objective adds
    ``load_balance`` × the load-balancing losses the module sows (``MoeMlp``'s)."""
    with nnx.use_eager_sharding(False):
        module = MAKE[name](nnx.Rngs(jax.random.key(0)))
    opt = nnx.Optimizer(module, optimizer(opt_name, sharded=False, sgd_lr=SGD_LR), wrt=nnx.Param)

    @nnx.jit
    def step(module, opt, x, y):
        def loss(module):
            logits, sown = nnx.capture(module, nnx.Intermediate)(x)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return ce + load_balance * sum(jax.tree.leaves(sown), 0.0)

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
              "hsdp_tp": {"replica": 2, "data": 2, "model": 2}, "dp_sp": {"data": 4, "model": 2},
              "2d+ring": {"data": 2, "context": 2, "model": 2},
              "fsdp+allgather": {"data": 2, "context": 4}, "dp+ulysses": {"data": 4, "context": 2},
              "sp+ring": {"context": 4, "model": 2},
              "2d+ep": {"data": 2, "expert": 2, "model": 2}, "fsdp+ep": {"data": 2, "expert": 4},
              "hsdp+ep": {"replica": 2, "data": 2, "expert": 2}}  # fmt: skip
CONTEXT = ("2d+ring", "fsdp+allgather", "dp+ulysses", "sp+ring")
"""The context-parallel strategies: for the Llamas that call JAX's or Flax's attention."""
SEQUENCE_SPLIT = ("dp_sp",)
"""The strategies that split the sequence: for the language models only."""
EXPERT_PARALLEL = ("2d+ep", "fsdp+ep", "hsdp+ep")
"""The strategies that split experts: for the Llama with a mixture of experts only."""
PIPELINES = {"2d+1f1b": {"pipe": 2, "data": 2, "model": 2}, "fsdp+circular": {"pipe": 2, "data": 4},
             "ref+gpipe": {"pipe": 4}}  # fmt: skip
"""The pipelines (2 microbatches): for the Llama whose blocks are stacked only."""
STRATEGIES.update(PIPELINES)
CASES = cover(["mlp", "llama"], [s for s in STRATEGIES
                                 if s not in (*CONTEXT, *EXPERT_PARALLEL, *PIPELINES)],
              ["sgd", "adam"],
              valid=lambda name, strategy, _: name != "mlp" or strategy not in SEQUENCE_SPLIT)  # fmt: skip


def train(model, strategy: str, opt_name: str, name: str, budget: bool = False, **options):
    """``_foreign_checks.train`` of ``model`` under ``strategy`` on ``name``'s batches."""
    return _foreign_checks.train(model, STRATEGIES[strategy], opt_name, batches(name), SGD_LR,
                                 budget, strategy=strategy, **options)  # fmt: skip


def check_trains_like_flax(model, name: str, strategy: str, opt_name: str, budget=False,
                           **options):  # fmt: skip
    """``model`` under ``strategy`` trains like Flax trains the module ``name`` (with the
    model's load-balancing weight)."""
    load_balance = (model.aux_weights or {}).get("load_balance", 0.0)
    _foreign_checks.check_trains_like(
        model, train(model, strategy, opt_name, name, budget, **options),
        flax_trajectory(name, opt_name, load_balance), TOL[opt_name], MIN_MOVE,
        _foreign_checks.report_key(name, strategy, STRATEGIES[strategy], opt_name),
    )  # fmt: skip


ORIGINAL_ATTENTION = jax.nn.dot_product_attention


def _check_attention_core(module, name: str = "llama-sdpa") -> None:
    """Under tp the traced step holds shardops' blocked core (its named scope), not JAX's."""
    setup = models.build("tp", mesh_for(STRATEGIES["tp"]), model=flax_model(name, module),
                         optimizer=optax.sgd(0.1), attention="blocked")  # fmt: skip
    state = setup.shard(setup.model.init(jax.random.key(0)))
    xs, ys = batches("llama")
    lowered = setup.train_step.lower(state, *setup.place_batch(xs[0], ys[0]))
    assert "shardops.blocked_attention" in lowered.as_text(debug_info=True)


def _mutant(line: str, replacement: str):
    """A copy of ``flax_nnx`` (and the modules it imports), ``line`` replaced in the one
    holding it."""
    modules = (
        "_flax_dense",
        "_flax_layers",
        "_flax_attention",
        "_flax_experts",
        "_flax_stacked",
        "flax_nnx",
    )
    return copies("shardops_models.interop", modules, "flax", line, replacement)["flax_nnx"]


def _check_plan(model) -> None:
    plan = model.plan()
    assert plan["blocks"][0]["attn"]["wq"]["kernel"] == "column", plan
