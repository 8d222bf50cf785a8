"""A GPT-style language model built only from shardops layers, for every strategy.

    ids[B, S] → embed: table[V, D][ids] + pos[S, D][positions]               (unit "embed")
      → L × block: x + attention(layer_norm(x))       (unit per block; stacked: one lax.scan)
                   x + down(gelu(up(layer_norm(x))))
      → layer_norm → head w[D, V] → logits[B, S, V]                          (unit "head")
      → cross-entropy against the next tokens labels[B, S] (integers)

The default plan (``Gpt.plan``) is Megatron's: the token table split by vocabulary, attention by
heads, ``up`` column- and ``down`` row-parallel, the head column-parallel (logits stay split
over the vocabulary; the loss is vocab-parallel and never gathers them), norms and positions
replicated. Under sequence parallelism (``sp``) the activations between layers are
``x[B, S_model, D]``.

**Stacked layers** (``Gpt(stacked=True)``, MaxText's ``scan_layers``): the blocks' parameters
stack the layers along dim 0 (``params["blocks"]["up"]["w"][L, D, F]``, plan
``stacked(block)``) and run with ``ctx.scan``, as the Llama's do: one compiled block whatever
the depth, and the layout pipeline parallelism (``pp``) cuts into stages. The unrolled default
keeps a list of per-block dicts (``params["blocks"][l]``), one ``ctx.unit`` a block. The two
are the same function of the same weights: ``init`` draws the same numbers either way, stacked
(``stack_blocks``/``unstack_blocks`` convert a tree between them).

``reference_logits`` is the same model in plain ``jax.numpy`` with no shardops layer, written
independently: the ``ref`` strategy is checked against it, every other strategy against ``ref``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

import shardops
from shardops_models.networks._lm import PAD_LABEL, LanguageModel, check_token_range
from shardops_models.strategies.plan import COLUMN, HEAD, REPLICATED, ROW, VOCAB, stacked
from shardops_models.strategies.remat import MLP_HIDDEN, MLP_INPUT, MLP_OUTPUT

__all__ = ["PAD_LABEL", "Gpt", "check_token_range", "stack_blocks", "unstack_blocks"]


@dataclasses.dataclass(frozen=True)
class Gpt(LanguageModel):
    """A decoder-only transformer: ``num_layers`` blocks of width ``d_model`` with ``num_heads``
    heads of ``d_model / num_heads``, an MLP of ``d_ff`` (default 4·d_model), learned positions
    up to ``context``, causal attention and a separate (untied) output head. ``stacked``:
    the blocks stored ``[L, …]`` and run by one ``lax.scan`` (``ctx.scan``; needed by
    pipeline parallelism), else unrolled, one ``ctx.unit`` a block (module docstring)."""

    vocab_size: int = 256
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4
    context: int = 128
    d_ff: int | None = None
    init_scale: float = 0.02
    stacked: bool = False  # the blocks [L, …] under one scan (pp needs it); else a list

    def __post_init__(self):
        if not isinstance(self.stacked, bool):
            raise TypeError(f"Gpt: stacked must be a bool (True: the blocks stacked [L, …] "
                            f"and scanned; False: a list, unrolled); got {self.stacked!r}")  # fmt: skip
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "context"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"Gpt: {name} must be a positive int; got {n!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"Gpt: d_model={self.d_model} must divide by num_heads={self.num_heads} "
                f"(head_dim = d_model / num_heads)"
            )
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)

    @property
    def name(self) -> str:
        return (f"gpt L={self.num_layers} D={self.d_model} H={self.num_heads} "
                f"F={self.d_ff} V={self.vocab_size} S≤{self.context}"
                f"{' stacked' if self.stacked else ''}")  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def init(self, key, dtype=None):
        """Full parameters: GPT-2's init (normal × 0.02, the residual projections scaled by
        1/√(2L)), biases zero, norms identity. Drawn in float32, then cast to ``dtype``.
        ``stacked``: the same numbers, the blocks stacked ``[L, …]`` (``stack_blocks``)."""
        d, v, f = self.d_model, self.vocab_size, self.d_ff
        normal = jax.nn.initializers.normal(self.init_scale)
        residual = jax.nn.initializers.normal(self.init_scale / math.sqrt(2 * self.num_layers))
        k_embed, k_pos, k_head, *k_blocks = jax.random.split(key, 3 + self.num_layers)
        blocks = []
        for k in k_blocks:
            k_attn, k_o, k_up, k_down = jax.random.split(k, 4)
            attn = shardops.init_attention(k_attn, d, self.num_heads, self.head_dim)
            attn["wo"] = residual(k_o, (d, d))
            # No key bias: softmax ignores a shift shared by every key, so its gradient is zero
            # in exact arithmetic and rounding noise in practice (which Adam would amplify).
            del attn["bk"]
            blocks.append({
                "ln1": _norm(d),
                "attn": attn,
                "ln2": _norm(d),
                "up": shardops.init_dense(k_up, d, f, w_init=normal),
                "down": shardops.init_dense(k_down, f, d, w_init=residual),
            })  # fmt: skip
        params = {
            "embed": {"table": normal(k_embed, (v, d))},  # table[V, D]
            "pos": {"table": normal(k_pos, (self.context, d))},  # pos[S, D]
            "blocks": stack_blocks(blocks) if self.stacked else blocks,
            "ln_f": _norm(d),
            "head": {"w": normal(k_head, (d, v))},  # w[D, V]
        }
        return params if dtype is None else jax.tree.map(lambda a: a.astype(dtype), params)

    def train_flops_per_token(self, seq: int) -> float:
        """Model FLOPs of one training step per token at sequence length ``seq``, as PaLM
        counts them: 6 × the matmul parameters (4·D² attention, 2·D·F MLP per block, the
        head) + 12 · L · D · S for attention's two products."""
        d, n = self.d_model, self.num_layers
        matmul = n * (4 * d * d + 2 * d * self.d_ff) + d * self.vocab_size
        return 6 * matmul + 12 * n * d * seq

    def plan(self):
        """Megatron's roles (see the module docstring); ``stacked``: the blocks' one plan."""
        block = {"ln1": REPLICATED, "attn": HEAD, "ln2": REPLICATED, "up": COLUMN, "down": ROW}
        blocks = stacked(block) if self.stacked else [dict(block) for _ in range(self.num_layers)]
        return {
            "embed": VOCAB,
            "pos": REPLICATED,
            "blocks": blocks,
            "ln_f": REPLICATED,
            "head": COLUMN,
        }

    # --- the forward, once for every strategy

    def apply(self, ctx, params, ids, *, start=0):
        """Logits ``[b, S, V]`` (``[b, S, V_model]`` under a column head) of ``ids[b, S]``, and
        no auxiliary loss (``models.Model``). ``start``: the position of ``ids[:, 0]`` (an
        int, or a traced int32 scalar), where the learned positions are read from: 0 in
        training, the cache's length in a KV-cache decoder's step (``models.generation``)."""
        x = ctx.unit(self._embed(ctx, start),
                     {"embed": params["embed"], "pos": params["pos"]}, ids)  # fmt: skip
        if self.stacked:  # one lax.scan over blocks[L, …] (pp: this stage's layers)
            x = ctx.scan(self._block(ctx), params["blocks"], x)  # x[b, S(_model), D]
        else:
            for block in params["blocks"]:
                x = ctx.unit(self._block(ctx), block, x)  # x[b, S, D] (sp: x[b, S_model, D])
        head = {"ln_f": params["ln_f"], "head": params["head"]}
        return ctx.unit(self._head(ctx), head, x), {}  # logits[b, S, V(_model)]

    def _embed(self, ctx, start=0):
        def embed(p, ids):
            positions = jnp.broadcast_to(start + jnp.arange(ids.shape[1]), ids.shape)  # [b, S]
            return ctx.embed(p["embed"], ids) + ctx.embed(p["pos"], positions)  # x[b, S, D]

        return embed

    def _block(self, ctx):
        def block(p, x):
            h = ctx.layer_norm(p["ln1"], x)
            x = x + ctx.attention(p["attn"], h, num_heads=self.num_heads, causal=True)
            h = checkpoint_name(ctx.layer_norm(p["ln2"], x), MLP_INPUT)  # h[b, S, D]
            h = checkpoint_name(ctx.dense(p["up"], h), MLP_HIDDEN)  # h[b, S, F_model]
            y = checkpoint_name(ctx.dense(p["down"], jax.nn.gelu(h)), MLP_OUTPUT)  # y[b, S, D]
            return x + y  # x[b, S, D] (names: what a remat policy may save, ``remat``)

        return block

    def _head(self, ctx):
        def head(p, x):
            return ctx.dense(p["head"], ctx.layer_norm(p["ln_f"], x))  # logits[b, S, V(_model)]

        return head

    def output_layer(self, params):
        """The layer whose output is the logits (split over the vocabulary under a column head)."""
        return params["head"]

    # --- the independent reference

    def reference_logits(self, params, ids):
        """The model in plain ``jax.numpy`` (no shardops), float32: ``logits[B, S, V]``.
        Stacked blocks are unstacked and run one after another, as unrolled ones."""
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
        if self.stacked:
            params = {**params, "blocks": unstack_blocks(params["blocks"])}
        seq = ids.shape[1]
        x = params["embed"]["table"][ids] + params["pos"]["table"][:seq][None]
        mask = np.tril(np.ones((seq, seq), bool))
        for p in params["blocks"]:
            h = _layer_norm_reference(x, p["ln1"])
            x = x + self._attention_reference(h, p["attn"], mask)
            h = _layer_norm_reference(x, p["ln2"])
            h = jax.nn.gelu(h @ p["up"]["w"] + p["up"]["b"])
            x = x + h @ p["down"]["w"] + p["down"]["b"]
        return _layer_norm_reference(x, params["ln_f"]) @ params["head"]["w"]

    def _attention_reference(self, x, p, mask):
        b, s, _ = x.shape

        def heads(w, bias):
            return (x @ w + bias).reshape(b, s, self.num_heads, self.head_dim)  # (B, S, H, hd)

        q, k, v = heads(p["wq"], p["bq"]), heads(p["wk"], 0.0), heads(p["wv"], p["bv"])
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)  # (B, H, S, S)
        o = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, self.d_model)
        return o @ p["wo"] + p["bo"]


def stack_blocks(blocks: list) -> dict:
    """Per-block trees ``[{"up": {"w": w[D, F]}, …}] * L`` → one tree of ``[L, …]`` leaves
    (``{"up": {"w": w[L, D, F]}, …}``): the unrolled GPT's blocks as ``Gpt(stacked=True)``
    holds them."""
    return jax.tree.map(lambda *layers: jnp.stack(layers), *blocks)


def unstack_blocks(blocks: dict) -> list:
    """``stack_blocks``' inverse: one tree of ``[L, …]`` leaves → ``L`` per-block trees."""
    n = jax.tree.leaves(blocks)[0].shape[0]
    return [jax.tree.map(lambda a, i=i: a[i], blocks) for i in range(n)]


def _norm(d: int) -> dict:
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def _layer_norm_reference(x, p, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]
