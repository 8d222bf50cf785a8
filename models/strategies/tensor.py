"""Tensor parallelism (Megatron): each layer's weights split over one mesh axis by its plan role,
and with ``sequence`` the activations between layers split along S over the same axis (sp).

    column   x[b, S, D] · w[D, F_model] → y[b, S, F_model]      no communication forward
    row      y[b, S, F_model] · w[F_model, D] → z{U_model}      AllReduce (sp: ReduceScatter
                                                                along S; a column layer's
                                                                input AllGathered along S)

Layout: every leaf's split from its plan role (``models.strategies.plan``), a dim the axis does
not divide padded up to a multiple of it (the layers mask the padding); each device holds whole
attention heads.

The kernel each role runs (the layer hooks, which ``ctx.dense`` and the other layers ask):

    dense        column: ``column_parallel_dense_kernel`` (sp: x gathered along S, unless
                 ``ctx.gather_sequence`` gathered it once for several layers)
                 row: ``row_parallel_dense_kernel`` (AllReduce; sp: ReduceScatter along S)
    embed        vocab: ``vocab_parallel_embedding_kernel``; a replicated table under sp:
                 the local lookup, this device's block of S kept (dx AllReduced)
    attention    head: ``head_parallel_attention_kernel`` (with the context kind's
                 ``context`` under cp)
    gated_mlp    gate, up column and down row: ``tensor_parallel_gated_mlp_kernel``
    tied_head    vocab: a column layer of the table's rows
    the loss     ``vocab_parallel_cross_entropy_kernel``, ``vocab_parallel_argmax_kernel``

Under sp every layer that mixes tokens must be one of these (it sees the whole sequence only
through them): a replicated attention, gated MLP or tied head is refused.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

import shardops
from shardops import SEQUENCE_DIM, entry_axes
from shardops_models.networks import contract
from shardops_models.strategies.kind import Kind, LayoutContext, is_spec, role_layout
from shardops_models.strategies.plan import (
    COLUMN,
    HEAD,
    REPLICATED,
    ROW,
    VOCAB,
    is_shape,
    logical_rules,
)

_WHOLE_LOGITS = shardops.comm.Reason("whole_logits", forward={
    "all_gather": "a caller outside the mesh asks for all the logits, whose vocabulary is split "
                  "over {axis}",
})  # fmt: skip
_SEQUENCE_BLOCK = shardops.comm.Reason("embedding_sequence_block", backward={
    "psum": "every device looks up the whole sequence and keeps its block over {axis} "
            "(sequence parallelism): the zero-padded dx are summed",
})  # fmt: skip


_SUBLAYER_GATHER = shardops.comm.Reason("sublayer_sequence_gather", forward={
    "all_gather": "a sublayer's input is split over {axis} along the sequence (sequence "
                  "parallelism) and its column layers read all of it: gathered once for them",
}, backward={
    "psum_scatter": "it is the transpose of that gather: the column layers' dx partial sums "
                    "are reduced and split back over {axis}",
})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TensorKind(Kind):
    """Tensor parallelism over one axis; ``sequence``: sequence parallelism on it too."""

    sequence: bool = False

    splits_layers: ClassVar[bool] = True

    @property
    def name(self) -> str:  # type: ignore[override]
        return "sp" if self.sequence else "tp"

    def description(self) -> str:
        if self.sequence:
            return "tp, with activations split along the sequence between layers"
        return "each layer's weights split by its plan role (Megatron tensor parallelism)"

    @property
    def axis(self) -> str:
        return self.axes[0]

    @property
    def sequence_axes(self) -> tuple[str, ...]:  # type: ignore[override]
        """sp: the activations between layers are split along S over the axis."""
        return (self.axis,) if self.sequence else ()

    def logical_rules(self) -> dict[str, str]:
        """The dims the plan roles split over the axis (``plan.logical_rules``: vocab, mlp,
        heads, kv_heads)."""
        return {dim: axis for dim, axis in logical_rules(self.axis).items() if axis is not None}

    def splits_heads(self, roles) -> bool:
        """Whether the plan gives any leaf the head role (its attention split over the axis)."""
        return HEAD in jax.tree.leaves(roles)

    def layout(self, specs, stored, context: LayoutContext):
        """The split by role is the core's (``specs``, through the strategy's rules); a dim
        this axis splits and does not divide is stored padded up to a multiple of it."""
        p = context.mesh.shape[self.axis]
        stored = jax.tree.map(
            lambda spec, shape: tuple(
                shardops.padded_size(n, p) if self.axis in entry_axes(e) else n
                for n, e in zip(shape, shardops.spec_entries(spec, len(shape)), strict=True)
            ),
            specs, stored, is_leaf=is_spec,
        )  # fmt: skip
        return specs, stored

    def gather_logits(self, logits, *, model, params, ctx):
        """``logits[b, ..., V_model]`` from a column (or vocab) output layer → the whole
        vocabulary, the padded columns dropped: AllGather over the axis. The model's
        ``output_layer`` says which layer made them; logits that vary over the axis without one
        are refused."""
        head = contract.declared(model).output_layer
        if head is None and self.axis in shardops.varying_axes(logits):
            raise ValueError(
                f"setup.logits: {type(model).__name__}'s logits{tuple(logits.shape)} (per "
                f"device) vary over the tp axis {self.axis!r}, and the model has no "
                f"output_layer(params) saying which layer makes them: define it (return the "
                f"head's parameter dict, as models.Gpt does) so that logits split over the "
                f"vocabulary are gathered"
            )
        if head is None or not ctx.is_split(head(params)):
            return logits
        logits = shardops.comm.all_gather(logits, self.axis, axis=logits.ndim - 1,
                                          to="invarying", reason=_WHOLE_LOGITS)  # fmt: skip
        return logits[..., : _output_features(head(params))]  # the padding's columns dropped

    # --- the kernel each plan role runs (the module docstring's table)

    def dense(self, ctx, p, x, whole_sequence: bool = False):
        role, sp = p["w"].role, self.sequence and x.ndim > 2
        if role not in (COLUMN, ROW):
            return None
        w, b = ctx._arrays(p, "w", "dense"), ctx._optional(p, "b")
        ring = ctx.collective_matmul
        if role == COLUMN:
            return shardops.layers.column_parallel_dense_kernel(
                x, w, b, gather_input=sp and not whole_sequence, gather_dimension=SEQUENCE_DIM,
                gathered_input=sp and whole_sequence, axis_name=self.axis,
                out_features=_logical(p["w"], 1), precision=ctx.precision,
                collective_matmul=ring,
            )  # fmt: skip
        reduce = "psum_scatter" if sp else "psum"
        # a ring splits y along S (or along the batch when y has no sequence)
        scatter = SEQUENCE_DIM if x.ndim > 2 else 0
        return shardops.layers.row_parallel_dense_kernel(
            x, w, b, reduce=reduce, scatter_dimension=scatter, axis_name=self.axis,
            in_features=_logical(p["w"], 0), precision=ctx.precision,
            collective_matmul=ring,
        )  # fmt: skip

    def gather_sequence(self, ctx, x):
        if not self.sequence or self.axis not in shardops.varying_axes(x):
            return None
        with shardops.comm.because(_SUBLAYER_GATHER, self.axis):
            whole = shardops.comm.gather_to_region(x, self.axis, SEQUENCE_DIM,
                                                   ctx.precision.accum_dtype)  # fmt: skip
        return whole.astype(x.dtype)  # x[B, S, ...]

    def embed(self, ctx, p, ids):
        table, precision = ctx._arrays(p, "table", "embed"), ctx.precision
        if p["table"].role == VOCAB:
            reduce = "psum_scatter" if self.sequence else "psum"
            return shardops.layers.vocab_parallel_embedding_kernel(
                ids, table, reduce=reduce, scatter_dimension=SEQUENCE_DIM, axis_name=self.axis,
                vocab_size=_logical(p["table"], 0), precision=precision,
            )  # fmt: skip
        if not self.sequence:
            return None
        x = jnp.take(table, ids, axis=0).astype(precision.compute_dtype)  # x[B, S, D]
        # keep this device's part of S; dx AllReduced over the axis
        with shardops.comm.because(_SEQUENCE_BLOCK, self.axis):
            x = shardops.comm.copy_to_region(x, self.axis, precision.accum_dtype)
        return _sequence_block(x, self.axis).astype(precision.compute_dtype)  # x[B, S/p, D]

    def attention(self, ctx, p, x, options):
        if {q.role for q in p.values()} == {HEAD}:
            _check_kv_heads_as_planned(p, options["num_heads"], options["num_kv_heads"],
                                       self.axis)  # fmt: skip
            params = {k: ctx._arrays(p, k, "attention") for k in p}
            return shardops.layers.head_parallel_attention_kernel(
                x, params, axis_name=self.axis, sequence_parallel=self.sequence,
                precision=ctx.precision, **options,
            )  # fmt: skip
        if self.sequence:
            raise ValueError(
                "under sequence parallelism attention must have the head role (it sees the "
                "whole sequence): set the plan's attention role to 'head'"
            )
        return None

    def gated_mlp(self, ctx, p, x, activation):
        roles = tuple(p[name]["w"].role for name in ("gate", "up", "down"))
        if roles == (COLUMN, COLUMN, ROW):
            params = {k: {n: ctx._value(q, "gated_mlp") for n, q in p[k].items()} for k in p}
            return shardops.layers.tensor_parallel_gated_mlp_kernel(
                x, params, axis_name=self.axis, sequence_parallel=self.sequence,
                hidden=_logical(p["gate"]["w"], 1), activation=activation,
                precision=ctx.precision,
            )  # fmt: skip
        if set(roles) - {REPLICATED}:
            paths = [p[name]["w"].path for name in ("gate", "up", "down")]
            where = paths[0][: paths[0].rfind("['gate']")]
            raise ValueError(
                f"{where}: under tp a gated MLP takes the "
                f"roles gate column, up column, down row (or all replicated); the plan says "
                f"{dict(zip(('gate', 'up', 'down'), roles, strict=True))}"
            )
        if self.sequence:
            raise ValueError("under sequence parallelism the gated MLP must be tensor-parallel "
                             "(gate and up column, down row): it sees the whole sequence")  # fmt: skip
        return None

    def tied_head(self, ctx, p, w, x, whole_sequence: bool = False):
        if p["table"].role == VOCAB:
            sp = self.sequence and x.ndim > 2
            return shardops.layers.column_parallel_dense_kernel(
                x, w, gather_input=sp and not whole_sequence, gather_dimension=SEQUENCE_DIM,
                gathered_input=sp and whole_sequence, axis_name=self.axis, out_features=_logical(p["table"], 0),
                precision=ctx.precision,
            )  # fmt: skip
        if self.sequence:
            raise ValueError("under sequence parallelism a tied head must be vocab-parallel: "
                             "give the embedding the plan's role 'vocab'")  # fmt: skip
        return None

    def moe_options(self, ctx, p, options):
        """Each expert's hidden units split over the axis: ``model_axis``; under sp the tokens
        enter split along S over it too (gathered whole into the layer, each sequence routed
        as one group, and the output ReduceScattered along S: ``sequence_parallel``)."""
        if any(self.axis in entry_axes(e) for e in p["gate"].spec):
            return {**options, "model_axis": self.axis, "sequence_parallel": self.sequence}
        if self.sequence:
            raise ValueError(
                f"ctx.moe under sequence parallelism over {self.axis!r}: the experts' hidden "
                f"units are not split over it (their spec {p['gate'].spec}), and the layer "
                f"gathers the sequence only where they are; give the experts the plan role "
                f"EXPERTS (hidden units over 'mlp')"
            )
        return options

    def splits_output(self, p) -> bool:
        """A column layer's output, or a vocab table's logits (a tied head)."""
        if "table" in p:
            return p["table"].role == VOCAB
        return p["w"].role == COLUMN

    def cross_entropy(self, ctx, logits, labels, vocab_size):
        return shardops.layers.vocab_parallel_cross_entropy_kernel(
            logits, labels, vocab_size=vocab_size, axis_name=self.axis, precision=ctx.precision
        )

    def argmax(self, ctx, logits, vocab_size):
        return shardops.layers.vocab_parallel_argmax_kernel(
            logits, vocab_size=vocab_size, axis_name=self.axis
        )

    # --- checks

    def check_model(self, strategy, declared, model_name: str) -> None:
        if self.sequence and not declared.sequence:
            raise ValueError(
                f"strategy {strategy.name!r} splits activations along the sequence; "
                f"{model_name} has no sequence dimension. Use the same strategy with tp "
                f"instead of sp."
            )

    def check_mesh(self, strategy, mesh, context: LayoutContext) -> None:
        """Each device holds whole heads: the head counts, and every dim a head role splits,
        divide by the axis (a vocabulary or a width it does not divide is padded instead)."""
        axis, p = self.axis, mesh.shape[self.axis]
        heads, kv_heads = context.declared.num_heads, context.declared.kv_heads
        if heads is not None and self.splits_heads(context.roles):
            shardops.layers.check_head_counts("build", heads, kv_heads, axis, p)
        specs = role_layout(context)  # the split build makes: each leaf by its role's dims
        for (path, shape), spec, role in zip(
            jax.tree_util.tree_leaves_with_path(context.shapes, is_leaf=is_shape),
            jax.tree.leaves(specs, is_leaf=is_spec), jax.tree.leaves(context.roles), strict=True,
        ):  # fmt: skip
            for dim, entry in enumerate(spec):
                if entry_axes(entry) and shape[dim] % p and role == HEAD:
                    raise ValueError(
                        f"params{jax.tree_util.keystr(path)} dim {dim} (heads × head_dim) = "
                        f"{shape[dim]} is not divisible by mesh axis {axis!r} (size {p}); the "
                        f"plan makes it head, and each device holds whole heads. Choose "
                        f"num_heads a multiple of {p}, a smaller {axis!r} axis, or role "
                        f"'replicated'"
                    )

    def check_batch(self, strategy, mesh, x) -> None:
        if self.sequence and not any(k.splits_sequence for k in strategy.kinds):  # (else the
            # kind that splits the tokens checks S: each of its chunks is split again here)
            shardops.check_divisible(
                argument="x", dim=1, dim_name="sequence", size=x.shape[1], mesh=mesh,
                axes=(self.axis,),
            )  # fmt: skip


def _output_features(head) -> int | None:
    """The model's own number of output features of the output layer (a dense ``w[D, V]`` or
    a tied ``table[V, D]``), or None where it is not padded."""
    leaf = head["table"] if "table" in head else head["w"]
    if leaf.logical is None:
        return None
    return leaf.logical[0] if "table" in head else leaf.logical[-1]


def _logical(p, dim: int) -> int | None:
    """The model's own size of ``p``'s dim ``dim`` (None where nothing is padded)."""
    return None if p.logical is None else p.logical[dim]


def _sequence_block(x, axis: str):
    """This device's block of ``x[B, S, D]`` along S: ``x[B, S/p, D]``."""
    p = lax.axis_size(axis)
    s = x.shape[SEQUENCE_DIM] // p
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * s, s, axis=SEQUENCE_DIM)


def _check_kv_heads_as_planned(p, num_heads: int, num_kv_heads, tp: str) -> None:
    """The plan split ``wk``, ``wv`` by KV head over ``tp`` (it counted them with the model's
    ``num_heads`` attribute): the heads ``ctx.attention`` is given must split so too, or each
    device would hold part of a KV head. A ValueError naming both counts and the fix."""
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    wk = p["wk"]
    n = lax.axis_size(tp)  # static: the mesh axis size
    split = any(tp in entry_axes(e) for e in wk.spec)
    if split and isinstance(kv_heads, int) and kv_heads % n:
        raise ValueError(
            f"ctx.attention at {wk.path[: wk.path.rfind('[')]}: the plan split wk, wv by KV "
            f"head over mesh axis {tp!r} (size {n}) (by the model's num_heads attribute, or, "
            f"without one, by columns as wide as wq's), but this call has num_heads="
            f"{num_heads}, num_kv_heads={kv_heads}, and {kv_heads} KV heads do not split over "
            f"{n} devices (each would hold part of a head). Give the model num_heads (and "
            f"num_kv_heads) attributes equal to what its forward passes to ctx.attention, so "
            f"that the plan replicates them, or a head count {n} divides."
        )
