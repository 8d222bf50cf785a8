"""A Llama in Flax NNX, written as Flax's guide to scaling on multiple devices and MaxText write
one: each parameter annotated with logical axis names (``nnx.with_partitioning``), one rules
table mapping them to mesh axes. Nothing in it knows shardops; ``FlaxModel`` trains it as it is.

    model = FlaxModel(lambda rngs: Llama(Config(), rngs=rngs), rules=RULES,
                      num_heads=Config.num_heads, num_kv_heads=Config.num_kv_heads)

Grouped-query attention with rotary positions (rotate-half), a SwiGLU MLP, RMSNorm before each
sublayer and at the end, an untied head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

RULES = (
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv_heads", "model"),
    ("norm", None),
)
"""MaxText's ``logical_axis_rules`` for this model: tensor parallelism over ``model``."""


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 256
    d_model: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    d_ff: int = 128
    num_layers: int = 2
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


def dense(d_in, d_out, names, rngs):
    init = nnx.with_partitioning(nnx.initializers.normal(d_in**-0.5), names)
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=init, rngs=rngs)


def norm(d, eps, rngs):
    init = nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",))
    return nnx.RMSNorm(d, epsilon=eps, scale_init=init, rngs=rngs)


def rope(x, theta, positions=None):
    """Rotary positions (rotate-half) of ``x[B, S, heads, hd]`` at ``positions[B, S]`` (default
    0 … S−1)."""
    half = x.shape[-1] // 2
    if positions is None:
        positions = jnp.arange(x.shape[1])[None]  # (1, S)
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # (hd/2,)
    angle = positions.astype(jnp.float32)[..., None] * freq  # (B, S, hd/2)
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]  # (B, S, 1, hd/2)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.c = c
        self.wq = dense(c.d_model, c.num_heads * c.head_dim, ("embed", "heads"), rngs)
        self.wk = dense(c.d_model, c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), rngs)
        self.wv = dense(c.d_model, c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), rngs)
        self.wo = dense(c.num_heads * c.head_dim, c.d_model, ("heads", "embed"), rngs)

    def __call__(self, x, positions=None):
        b, s, hd, theta = x.shape[0], x.shape[1], self.c.head_dim, self.c.rope_theta
        q = rope(self.wq(x).reshape(b, s, -1, hd), theta, positions)  # (B, S, H, hd)
        k = rope(self.wk(x).reshape(b, s, -1, hd), theta, positions)  # (B, S, KV, hd)
        v = self.wv(x).reshape(b, s, -1, hd)  # (B, S, KV, hd)
        group = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # (B, S, H, hd)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(q.dtype)
        causal = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)  # (B, S, H, hd)
        return self.wo(out.reshape(b, s, -1))  # (B, S, D)


class Mlp(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.gate = dense(c.d_model, c.d_ff, ("embed", "mlp"), rngs)
        self.up = dense(c.d_model, c.d_ff, ("embed", "mlp"), rngs)
        self.down = dense(c.d_ff, c.d_model, ("mlp", "embed"), rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.attn_norm = norm(c.d_model, c.norm_eps, rngs)
        self.attn = Attention(c, rngs=rngs)
        self.mlp_norm = norm(c.d_model, c.norm_eps, rngs)
        self.mlp = Mlp(c, rngs=rngs)

    def __call__(self, x, positions=None):
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embed = nnx.Embed(c.vocab_size, c.d_model, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)])
        self.norm = norm(c.d_model, c.norm_eps, rngs)
        self.head = dense(c.d_model, c.vocab_size, ("embed", "vocab"), rngs)

    def __call__(self, ids, positions=None):
        """Logits ``[B, S, V]`` of ``ids[B, S]`` at ``positions[B, S]`` (MaxText's
        ``decoder_positions``; default 0 … S−1)."""
        x = self.embed(ids)  # (B, S, D)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(self.norm(x))  # (B, S, V)
