"""Context parallelism: every activation split along the sequence over one mesh axis.

    x[b, S_context, D] in load-balanced chunks     params replicated     dw AllReduced

Token ids, positions and segment ids enter whole; ``ctx.embed`` and ``ctx.attention`` take this
device's tokens (``shardops.layers.balanced_order``: chunks i and 2N−1−i of 2N). Attention runs
by the strategy's ``cp_method`` (``shardops.layers.context_parallel_attention_kernel``: K/V
all-gathered, passed round a ring, or Ulysses' all-to-all); the loss and the metrics sum over
the shards. ``ctx.moe`` routes each device's chunks of a sequence as one capacity group (S/N
tokens; ``moe_options``). Under sp the tp axis splits each context block again.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

import shardops
from shardops import SEQUENCE_DIM
from shardops_models.strategies.kind import Kind, LayoutContext
from shardops_models.strategies.plan import HEAD

_WHOLE_SEQUENCE = shardops.comm.Reason("whole_sequence", forward={
    "all_gather": "a caller outside the mesh asks for the logits of every token, whose sequence "
                  "is split over {axis} (context parallelism)",
})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ContextKind(Kind):
    """Context parallelism over one axis, attention by ``method``
    (``shardops.layers.CONTEXT_METHODS``)."""

    method: str = "ring"

    name: ClassVar[str] = "cp"
    doc: ClassVar[str] = ("every activation split along the sequence (load-balanced chunks); "
                          "parameters replicated; gradients AllReduced; attention by")  # fmt: skip
    splits_sequence: ClassVar[bool] = True
    sums_gradients: ClassVar[bool] = True

    @property
    def axis(self) -> str:
        return self.axes[0]

    def description(self) -> str:
        return f"{self.doc} {self.method}"

    def local_tokens(self, tokens):
        """``tokens[b, S, ...]`` → this device's ``tokens[b, S_context, ...]``: its chunks i and
        2N−1−i of 2N (``shardops.layers.balanced_order``)."""
        context = shardops.layers.ContextParallel(self.axis, self.method)
        n, seq = lax.axis_size(context.axis_name), tokens.shape[SEQUENCE_DIM]
        shardops.layers.check_context_sequence("ctx.local_tokens", "tokens", seq,
                                               context.axis_name, n)  # fmt: skip
        return jnp.take(tokens, context.positions(seq // n), axis=SEQUENCE_DIM)

    def attention_options(self, ctx, options):
        """``positions`` and ``segment_ids`` of the whole sequence → this device's (RoPE's
        default positions within documents computed on the whole sequence first), and
        ``context``, the attention over the axis (``shardops.layers.ContextParallel``) that a
        head-parallel kernel takes."""
        positions, segment_ids = options["positions"], options["segment_ids"]
        if positions is None and segment_ids is not None and options["rope_theta"] is not None:
            positions = shardops.layers.segment_positions(segment_ids)
        return {**options, "positions": None if positions is None else self.local_tokens(positions),
                "segment_ids": None if segment_ids is None else self.local_tokens(segment_ids),
                "context": shardops.layers.ContextParallel(self.axis, self.method)}  # fmt: skip

    def attention(self, ctx, p, x, options):
        """Attention of this device's tokens by the method, the parameters replicated
        (``context_parallel_attention_kernel``); a head-parallel one is the tensor kind's."""
        params = {k: ctx._arrays(p, k, "attention") for k in p}
        options = {k: v for k, v in options.items() if k != "context"}
        return shardops.layers.context_parallel_attention_kernel(
            x, params, method=self.method, context_axis=self.axis, precision=ctx.precision,
            **options,
        )  # fmt: skip

    def moe_options(self, ctx, p, options):
        """Each device routes its own tokens: every sequence's chunks i and 2N−1−i on this
        device (``x[b, S_context, D]``, S/N tokens in order of position) are one capacity
        group, ``C = ceil(capacity_factor · S/N · k / E)`` (Megatron's: capacity per device's
        tokens; the reference's ``context_shards``). The tokens are split over the axis, so
        the global load balance and z-loss sum their counts over it too (``batch_axes``). The
        experts are replicated over it: autodiff sums their gradients (``ctx.unit``)."""
        return {**options, "batch_axes": (*options["batch_axes"], self.axis)}

    def check_locate(self, strategy) -> None:
        raise ValueError(
            f"the divergence locator compares activations in the natural token order; under "
            f"context parallelism ({strategy.name!r}) each device holds load-balanced "
            f"chunks. Locate on the same strategy without '+{self.method}' "
            f"(the other axes' layers are the same)."
        )

    def gather_logits(self, logits, *, model, params, ctx):
        """``logits[b, S_context, V]`` in the load-balanced layout → every token's, in token
        order: AllGather over the axis, then the layout undone."""
        logits = shardops.comm.all_gather(logits, self.axis, axis=1, to="invarying",
                                          reason=_WHOLE_SEQUENCE)  # fmt: skip
        n = lax.axis_size(self.axis)
        return logits[:, shardops.layers.inverse_order(logits.shape[1], n)]

    def check_model(self, strategy, declared, model_name: str) -> None:
        if not declared.sequence:
            raise ValueError(
                f"strategy {strategy.name!r} splits the sequence over {self.axis!r} (context "
                f"parallelism); {model_name} has no sequence dimension. Drop '+{self.method}'."
            )

    def check_mesh(self, strategy, mesh, context: LayoutContext) -> None:
        """Ulysses trades the sequence split for a head split: each device's query heads (and
        the K/V heads it sends) must split over the context axis."""
        declared = context.declared
        if self.method != "ulysses" or not declared.num_heads:
            return
        heads, kv_heads = declared.num_heads, declared.kv_heads
        heads_axis = context.rules.get("heads")  # the axis a head role splits (tp's), or None
        split_heads = heads_axis is not None and HEAD in jax.tree.leaves(context.roles)
        p = mesh.shape[heads_axis] if split_heads else 1
        if heads % p:
            return  # a head count the heads' axis does not divide: its kind refuses it
        sent = shardops.layers.kv_cache_heads(heads, kv_heads, p)
        if p > 1 and not shardops.layers.splits_kv_heads(kv_heads, p) and sent > 1:
            sent = heads // p  # replicated K/V read by index: one per query head
        shardops.layers.check_ulysses_heads("build", heads // p, sent, self.axis,
                                            mesh.shape[self.axis])  # fmt: skip

    def check_batch(self, strategy, mesh, x) -> None:
        """S splits into 2N chunks, each of which a kind that splits the activations along S
        between layers (sp, ``Kind.sequence_axes``) splits again."""
        (inner, *_) = [a for k in strategy.kinds for a in k.sequence_axes] or [None]
        shardops.layers.check_context_sequence(
            "the batch", "x", x.shape[1], self.axis, mesh.shape[self.axis],
            inner, mesh.shape[inner] if inner else 1,
        )  # fmt: skip
