"""Vocab-parallel embedding (Megatron's ``VocabParallelEmbedding``): per-device kernel, layer, specs.

The table ``table[V_model, D]`` is split over mesh axis ``model`` along the vocabulary: each
device holds ``V/p`` consecutive rows and looks up only the ids that fall in its block. The
other ids get a zero vector, and one ``psum`` over ``model`` (or a ``psum_scatter``, for
sequence parallelism) assembles ``x[B, S, D]``: every id is found on exactly one device.

An uneven vocabulary (50257 tokens on 2 devices, Megatron-LM issue 1754) is stored padded with
zero rows to a multiple of p (``shard_params`` does it by default, or ``pad_params``) and the
layer is told the logical ``vocab_size``: ids ≥ ``vocab_size`` are never looked up, so the
padding rows get exactly zero gradient.

Notation (the JAX scaling book): ``table[V_model, D]`` is split over ``model`` along V;
``x[B, S, D]{U_model}`` holds partial sums not yet reduced over ``model``; ``p`` is the size of
``model``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardops._after import zero_after
from shardops._axes import MODEL_AXIS, SEQUENCE_DIM
from shardops._mesh import axis_size, check_divisible, spec_entry
from shardops._precision import FLOAT32, Precision, _reduce_to
from shardops.comm._mappings import reduce_from_region, reduce_scatter_from_region
from shardops.comm._reasons import Reason, because
from shardops.layers._common import (
    bound_axis_size,
    check_axes,
    check_precision,
    check_reduce,
    check_replicated_over,
    check_sharded_over,
    run_layer,
    scoped,
)
from shardops.layers._params import padded_size

# Why the kernel's collective runs (``shardops.comm.because``; ``explain`` reads it).
_ROWS = Reason("embedding_rows", forward={
    "psum": "the table's rows are split over {axis}: each device looks up only the ids in its "
            "rows (zeros elsewhere), and the partial embeddings are summed",
    "psum_scatter": "the table's rows are split over {axis}: each device looks up only the ids "
                    "in its rows (zeros elsewhere), and the partial embeddings are summed, and "
                    "the result is kept split along the sequence",
}, backward={
    "all_gather": "it is the transpose of the forward psum_scatter: each device needs all of dx",
})  # fmt: skip


class EmbeddingSpecs(NamedTuple):
    """PartitionSpecs of the embedding's token ``ids``, its ``table`` and its output ``x``."""

    ids: P
    table: P
    x: P

    @property
    def params(self) -> dict[str, P]:
        """The specs of the parameter dict ``{"table": ...}``, for ``shard_params``."""
        return {"table": self.table}


def vocab_parallel_embedding_specs(
    *,
    ids_ndim: int = 2,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    reduce: str = "psum",
    scatter_dimension: int = SEQUENCE_DIM,
) -> EmbeddingSpecs:
    """Layout of ``vocab_parallel_embedding``: ``ids[B_batch, S] → x[B_batch, S, D]``, ``table[V_model, D]``.

    ``ids_ndim`` is the rank of ``ids`` (``ids[B, S]``: 2). ``reduce="psum_scatter"`` splits
    ``x`` over ``axis_name`` along ``scatter_dimension`` too: ``x[B_batch, S_model, D]``
    (the default, sequence parallelism) or ``x[B_(batch,model), S, D]`` (0).
    """
    _check_ids_ndim(ids_ndim)
    _check_reduce(reduce, scatter_dimension, ids_ndim)
    token_dims = [spec_entry(batch_axis)] + [None] * (ids_ndim - 1)
    x_dims = [*token_dims, None]
    if reduce == "psum_scatter":
        x_dims[scatter_dimension] = spec_entry(token_dims[scatter_dimension], axis_name)
    return EmbeddingSpecs(ids=P(*token_dims), table=P(axis_name, None), x=P(*x_dims))


@scoped("vocab_parallel_embedding")
def vocab_parallel_embedding_kernel(
    ids,
    table,
    *,
    vocab_size: int | None = None,
    axis_name: str = MODEL_AXIS,
    reduce: str = "psum",
    scatter_dimension: int = SEQUENCE_DIM,
    precision: Precision = FLOAT32,
):
    """Vocab-parallel lookup on local blocks: ``table[V_model, D][ids[B, S]] → x[B, S, D]{U_model}`` → reduce.

    Arguments (local blocks, ``p`` = size of ``axis_name``):
        ids: integer ``ids[B, S]`` (any rank ≥ 1), replicated over ``axis_name``.
        table: the row block ``table[V/p, D]`` in ``precision.param_dtype``: rows
            ``i·V/p … (i+1)·V/p − 1`` on device ``i`` of ``axis_name``.
        vocab_size: the logical vocabulary when the stored ``p·V/p`` rows are padded; ids
            ≥ ``vocab_size`` (and < 0) get a zero vector and give no gradient. Default: all rows.
        reduce: ``"psum"`` → ``x[B, S, D]`` replicated over ``axis_name``; ``"psum_scatter"``
            → ``x`` split along ``scatter_dimension`` (``x[B, S/p, D]`` by default).

    Returns:
        ``x[B, S, D]`` (or its ``psum_scatter`` block) in ``precision.compute_dtype``.

    Communication over ``axis_name`` (V = bytes of ``x[B, S, D]`` in ``accum_dtype``):
        forward: ``psum``: AllReduce ``x{U_model} → x`` (each element has one nonzero term, so
        the sum is exact). ``psum_scatter``: ReduceScatter ``x{U_model} → x[B, S_model, D]``.
        Both in ``accum_dtype``; ``x`` is cast to ``compute_dtype`` once, after.
        backward: ``psum``: none: the table's gradient is a local scatter-add of ``dx`` into
        ``dtable[V/p, D]`` in ``accum_dtype``, cast once to the table's dtype.
        ``psum_scatter``: AllGather of ``dx`` (in ``accum_dtype``), then the same local
        scatter-add. ``ids`` split over a batch axis: ``dtable`` is all-reduced over that axis
        (in ``accum_dtype``); never over ``axis_name``.
        Under ``jit`` ids cannot be checked: one outside ``[0, vocab_size)`` gives a zero vector.
    """
    op = "vocab_parallel_embedding_kernel"
    p = bound_axis_size(axis_name, op)
    _check_table_rank(op, table, scope="local ")
    check_sharded_over(table, axis_name, "table", op)
    _check_ids_dtype(op, ids)
    check_replicated_over(ids, axis_name, "ids", op)
    v_local = table.shape[0]  # V/p rows here
    vocab_size = _check_vocab_size(op, vocab_size, v_local * p, "table dim 0 (vocabulary)")
    _check_reduce(reduce, scatter_dimension, ids.ndim)
    if reduce == "psum_scatter" and ids.shape[scatter_dimension] % p:
        raise ValueError(
            f"{op}: local ids dim {scatter_dimension} = {ids.shape[scatter_dimension]} is not "
            f"divisible by mesh axis {axis_name!r} (size {p}), so psum_scatter cannot split x "
            f"along it"
        )
    local = ids - lax.axis_index(axis_name) * v_local  # ids[B, S] → rows of this block
    found = (local >= 0) & (local < v_local) & (ids < vocab_size)  # [B, S]: here, not padding
    rows = jnp.where(found, local, 0)  # [B, S] in [0, V/p)
    x_partial = _lookup_rows(np.dtype(precision.accum_dtype), table, rows, found)  # x[B, S, D]{U}
    with because(_ROWS, axis_name):
        if reduce == "psum":
            x = reduce_from_region(x_partial, axis_name)  # x[B, S, D] in accum
        else:  # x[B, S/p, D] in accum
            x = reduce_scatter_from_region(x_partial, axis_name, scatter_dimension)
    return x.astype(precision.compute_dtype)  # one rounding


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup_rows(accum_dtype, table, rows, found):
    """``table[rows]`` in ``accum_dtype``, zero where not ``found``: ``[..., D]``.

    A custom VJP because autodiff of a gather in the table's dtype would scatter-add the
    gradient in that dtype (bfloat16 under ``BFLOAT16``), rounding every repeated token's sum;
    here ``dtable`` is accumulated (and, over a batch axis, all-reduced) in ``accum_dtype`` and
    rounded once. The forward gathers in the table's dtype (no float32 copy of the table).
    """
    x = jnp.take(table, rows, axis=0, mode="clip").astype(accum_dtype)  # [..., D]
    return jnp.where(found[..., None], x, 0)  # [..., D]


def _lookup_rows_fwd(accum_dtype, table, rows, found):
    # table[:, :0] carries the block's rows, dtype and varying mesh axes into the backward.
    return _lookup_rows(accum_dtype, table, rows, found), (rows, found, table[:, :0])


def _lookup_rows_bwd(accum_dtype, residuals, g):
    rows, found, table_kind = residuals  # rows[...], found[...], table_kind[V/p, 0]
    g = jnp.where(found[..., None], g, 0).reshape(-1, g.shape[-1])  # dx[N, D] in accum
    # zeros made once g arrives (``zero_after``): a constant's in-place copies would each be
    # made at the program's start, one V/p × D buffer per backward phase of a pipeline
    dtable = jnp.zeros((table_kind.shape[0], g.shape[-1]), accum_dtype) + zero_after(g).astype(
        accum_dtype)  # dtable[V/p, D]  # fmt: skip
    dtable = dtable.at[rows.reshape(-1)].add(g, mode="promise_in_bounds")  # scatter-add in accum
    # ids split over a batch axis the table is replicated over: all-reduce dtable over it.
    dtable = _reduce_to(dtable, table_kind)  # dtable[V/p, D] in accum
    return dtable.astype(table_kind.dtype), None, None  # one rounding to the table's dtype


_lookup_rows.defvjp(_lookup_rows_fwd, _lookup_rows_bwd)


def vocab_parallel_embedding(
    ids,
    table,
    *,
    mesh: Mesh,
    vocab_size: int | None = None,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    reduce: str = "psum",
    scatter_dimension: int = SEQUENCE_DIM,
    precision: Precision = FLOAT32,
):
    """Vocab-parallel embedding on global arrays: ``table[V_model, D][ids[B, S]] → x[B, S, D]``.

    Arguments:
        ids: integer token ids ``ids[B, S]`` (any rank ≥ 1), replicated over ``axis_name`` and
            split over ``batch_axis`` (if given) along dim 0. Concrete ids are checked to lie in
            ``[0, vocab_size)``; under ``jit`` they cannot be, and an id outside gets a zero
            vector (and gives no gradient).
        table: ``table[V, D]`` in ``precision.param_dtype``, split over ``axis_name`` along V;
            V must divide by the axis size: pad it with zero rows
            (``shard_params({"table": table}, mesh, specs.params)`` does, or ``pad_params``) and
            pass ``vocab_size``.
        vocab_size: the logical vocabulary (≤ V); the rows from ``vocab_size`` on are padding,
            never looked up, and their gradient is zero. Default: V.
        reduce: ``"psum"`` → ``x[B, S, D]`` replicated over ``axis_name``; ``"psum_scatter"``
            → ``x`` split over ``axis_name`` along ``scatter_dimension`` of ``ids`` (default 1,
            the sequence: ``x[B, S_model, D]`` for sequence parallelism).

    Returns:
        ``x[B, S, D]`` in ``precision.compute_dtype``, laid out as
        ``vocab_parallel_embedding_specs(...).x``: each row exactly the table's row, rounded
        once to the compute dtype.

    Communication: see ``vocab_parallel_embedding_kernel``. ``psum``: one AllReduce of
    ``x[B, S, D]`` (in ``accum_dtype``) forward, none backward (the table's gradient stays on
    its rows' device; all-reduced over ``batch_axis`` only).
    """
    op = "vocab_parallel_embedding"
    check_axes(mesh, axis_name, batch_axis)
    check_precision(op, precision)
    if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
        raise TypeError(f"{op}: ids must be an integer array; got {type(ids).__name__}")
    _check_ids_ndim(ids.ndim, op)
    _check_ids_dtype(op, ids)
    _check_table_rank(op, table)
    precision.check_param("table", table.dtype)
    p = axis_size(mesh, axis_name)
    _check_vocab_divisible(op, table.shape[0], mesh, axis_name)
    vocab_size = _check_vocab_size(op, vocab_size, table.shape[0], "table dim 0 (vocabulary)")
    specs = vocab_parallel_embedding_specs(
        ids_ndim=ids.ndim,
        axis_name=axis_name,
        batch_axis=batch_axis,
        reduce=reduce,
        scatter_dimension=scatter_dimension,
    )
    check_divisible(
        argument="ids", dim=0, dim_name="batch", size=ids.shape[0], mesh=mesh, axes=(batch_axis,)
    )
    if reduce == "psum_scatter":
        d = scatter_dimension
        over = (batch_axis, axis_name) if d == 0 else (axis_name,)
        parts = axis_size(mesh, batch_axis) * p if d == 0 else p
        if ids.shape[d] % parts:
            names = " × ".join(f"{a!r} (size {mesh.shape[a]})" for a in over if a is not None)
            raise ValueError(
                f"{op}: ids dim {d} ({'batch' if d == 0 else 'sequence'}) = {ids.shape[d]} is "
                f"not divisible by mesh axis {names}, so reduce='psum_scatter' cannot split x "
                f"along it; choose a multiple of {parts}, another scatter_dimension, or "
                f"reduce='psum'."
            )
    _check_in_range(op, "ids", ids, vocab_size, "an id outside gets a zero vector")
    kernel = functools.partial(
        vocab_parallel_embedding_kernel,
        vocab_size=vocab_size,
        axis_name=axis_name,
        reduce=reduce,
        scatter_dimension=scatter_dimension,
        precision=precision,
    )
    args = {"ids": ids, "table": table}
    return run_layer(op, kernel, mesh, args, {"ids": specs.ids, "table": specs.table}, specs.x)


# --- checks -----------------------------------------------------------------------------------


def _check_ids_ndim(ids_ndim, op: str = "vocab_parallel_embedding_specs") -> None:
    if isinstance(ids_ndim, bool) or not isinstance(ids_ndim, int) or ids_ndim < 1:
        raise ValueError(
            f"{op}: ids must have rank ≥ 1 (ids[B] or ids[B, S, ...]); got rank {ids_ndim!r}. "
            f"A single id is ids[None]."
        )


def _check_ids_dtype(op: str, ids) -> None:
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"{op}: ids must be integer token ids; got dtype {np.dtype(ids.dtype).name}. Cast "
            f"them with ids.astype(jnp.int32) (rounding floats to ids is rarely what you want)."
        )


def _check_table_rank(op: str, table, *, scope: str = "") -> None:
    if not hasattr(table, "shape") or len(table.shape) != 2:
        got = f"shape {tuple(table.shape)}" if hasattr(table, "shape") else type(table).__name__
        raise ValueError(f"{op}: {scope}table must have rank 2 (table[V, D]); got {got}")


def _check_reduce(reduce: str, scatter_dimension: int, ids_ndim: int) -> None:
    check_reduce(reduce, "x")
    if reduce == "psum_scatter" and (
        isinstance(scatter_dimension, bool)
        or not isinstance(scatter_dimension, int)
        or not 0 <= scatter_dimension < ids_ndim
    ):
        raise ValueError(
            f"scatter_dimension must be a dim of ids (0 = batch, 1 = sequence, … < {ids_ndim} "
            f"for ids of rank {ids_ndim}); got {scatter_dimension!r}"
        )


def _check_vocab_divisible(op: str, rows: int, mesh: Mesh, axis_name: str) -> None:
    p = axis_size(mesh, axis_name)
    if rows % p:
        raise ValueError(
            f"{op}: table dim 0 (vocabulary) = {rows} is not divisible by mesh axis "
            f"{axis_name!r} (size {p}); pad it with zero rows to {padded_size(rows, p)} "
            f"(shardops.shard_params({{'table': table}}, mesh, specs.params) does by default, or "
            f"shardops.pad_params) and pass vocab_size={rows}."
        )


def _check_vocab_size(op: str, vocab_size, stored: int, what: str) -> int:
    if vocab_size is None:
        return stored
    if (
        isinstance(vocab_size, bool)
        or not isinstance(vocab_size, int | np.integer)
        or not 0 < vocab_size <= stored
    ):
        raise ValueError(
            f"{op}: vocab_size={vocab_size!r} must be an int in 1..{stored}: {what} holds "
            f"{stored} entries, padding included"
        )
    return int(vocab_size)


def _check_in_range(op: str, argument: str, values, vocab_size: int, under_jit: str) -> None:
    """Concrete ``values`` must lie in ``[0, vocab_size)``; tracers (inside ``jit``) cannot be
    checked, and ``under_jit`` says what happens to one outside."""
    if (
        isinstance(values, jax.core.Tracer)
        or not values.size
        or not getattr(values, "is_fully_addressable", True)  # other hosts hold parts of it
    ):
        return
    host = np.asarray(values)  # concrete: closed over by a jit, or eager
    lo, hi = int(host.min()), int(host.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"{op}: {argument} must lie in [0, vocab_size={vocab_size}); got min {lo}, max {hi}. "
            f"Fix the data (or vocab_size). Under jit they are not checked: {under_jit}."
        )
