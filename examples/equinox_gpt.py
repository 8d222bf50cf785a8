"""A GPT in Equinox, written as Equinox's BERT example writes its encoder: per example
(``ids[S]``), each layer applied per token by ``jax.vmap``, ``eqx.nn.MultiheadAttention`` with a
causal mask. Nothing in it knows shardops; ``EquinoxModel`` trains it as it is, given roles by
path:

    model = EquinoxModel(lambda key: Gpt(Config(), key), roles=ROLES, num_heads=Config.num_heads)

Token and position embeddings, pre-norm blocks (``LayerNorm`` before attention, ``RMSNorm``
before a GELU MLP), a final ``LayerNorm`` and an untied head.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

ROLES = {"embed": "vocab", "blocks.*.attn.output_proj": "row", "blocks.*.attn.*_proj": "column",
         "blocks.*.up": "column", "blocks.*.down": "row", "head": "column"}  # fmt: skip
"""Megatron's plan by path (the first match holds, so ``output_proj``'s rule comes before the
other projections' pattern); the position table and the norms are replicated."""


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 80
    d_model: int = 32
    num_heads: int = 4
    d_ff: int = 64
    num_layers: int = 2
    context: int = 16


class Block(eqx.Module):
    attn_norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, c: Config, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn_norm = eqx.nn.LayerNorm(c.d_model)
        # No key bias: softmax is blind to it (its gradient is 0).
        self.attn = eqx.nn.MultiheadAttention(c.num_heads, c.d_model, use_query_bias=True,
                                              use_value_bias=True, use_output_bias=True, key=k1)  # fmt: skip
        self.mlp_norm = eqx.nn.RMSNorm(c.d_model)
        self.up = eqx.nn.Linear(c.d_model, c.d_ff, key=k2)
        self.down = eqx.nn.Linear(c.d_ff, c.d_model, key=k3)

    def __call__(self, x):  # x[S, D]
        h = jax.vmap(self.attn_norm)(x)
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attn(h, h, h, mask=causal)
        h = jax.vmap(self.mlp_norm)(x)
        return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(h)


class Gpt(eqx.Module):
    embed: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, c: Config, key):
        keys = jax.random.split(key, c.num_layers + 3)
        self.embed = eqx.nn.Embedding(c.vocab_size, c.d_model, key=keys[0])
        self.pos = eqx.nn.Embedding(c.context, c.d_model, key=keys[1])
        self.blocks = [Block(c, k) for k in keys[3:]]
        self.norm = eqx.nn.LayerNorm(c.d_model)
        self.head = eqx.nn.Linear(c.d_model, c.vocab_size, use_bias=False, key=keys[2])

    def __call__(self, ids):  # ids[S] → logits[S, V]
        x = jax.vmap(self.embed)(ids) + jax.vmap(self.pos)(jnp.arange(ids.shape[0]))
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))
