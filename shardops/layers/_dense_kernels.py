"""Per-device kernels of the column- and row-parallel dense layers.

These are the bodies that run inside ``jax.shard_map``: they see local blocks and say every
collective they need. Call them from your own ``shard_map`` (with ``check_vma=True``, the
default), or use the global-array layers in ``_dense.py``, which build the ``shard_map`` for you.

Notation (the JAX scaling book): ``w[D, F_model]`` is split over mesh axis ``model`` along F;
``y[B, D]{U_model}`` holds partial sums not yet reduced over ``model``; ``p`` is the size of
``model``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from shardops._axes import MODEL_AXIS
from shardops._precision import FLOAT32, Precision
from shardops.comm._mappings import (
    REPLICATED_INPUT,
    copy_to_region,
    gather_from_region,
    gather_to_region,
    reduce_from_region,
    reduce_scatter_from_region,
)
from shardops.comm._reasons import Reason, because
from shardops.layers import _collective_dense
from shardops.layers._collective_dense import check_collective_matmul
from shardops.layers._common import (
    bound_axis_size,
    check_even_block,
    check_reduce,
    check_replicated_over,
    check_sharded_over,
    scoped,
)

# Why each collective of these kernels runs (``shardops.comm.because``; ``explain`` reads them).
_COLUMN_GATHER = Reason("column_sequence_gather", forward={
    "all_gather": "the input is split over {axis} along its batch or sequence dim (sequence "
                  "parallelism) and the layer needs all of it",
    "ppermute": "collective matmul: the input's blocks, split over {axis} along its batch or "
                "sequence dim, pass round a ring while each device multiplies the block it holds",
}, backward={
    "psum_scatter": "it is the transpose of the sequence-parallel gather: dx partial sums are "
                    "reduced and split back over {axis}",
    "ppermute": "collective matmul's backward: dx partial sums pass round the ring over {axis}, "
                "each device adding its block's, until each holds its own",
})  # fmt: skip
_COLUMN_OUTPUT = Reason("column_gather_output", forward={
    "all_gather": "gather_output asks for the full y, whose columns are split over {axis}",
})  # fmt: skip
_ROW_REDUCE = Reason("row_partial_sums", forward={
    "psum": "the contraction dim is split over {axis} (each device holds partial sums y{U})",
    "psum_scatter": "the contraction dim is split over {axis} and the output is kept split: "
                    "partial sums are reduced and scattered",
    "ppermute": "collective matmul: the contraction dim is split over {axis}; partial sums pass "
                "round a ring, each device adding its product for the block passing by",
    "all_gather": "collective matmul's psum: the ring's reduced blocks are gathered, so every "
                  "device holds all of y",
}, backward={
    "all_gather": "it is the transpose of the forward psum_scatter: each device needs all of dy",
    "ppermute": "collective matmul's backward: dy's blocks pass round the ring over {axis}, each "
                "device computing dx for the block passing by",
})  # fmt: skip
_ROW_INPUT = Reason("row_replicated_input", backward={
    "psum": "the replicated input was sliced over {axis}: each device's zero-padded dx is summed",
})  # fmt: skip
_ROW_BIAS = Reason("row_bias", backward={
    "psum": "the bias is replicated but the output is split over {axis}: its gradient is summed",
})  # fmt: skip


@scoped("column_parallel_dense")
def column_parallel_dense_kernel(
    x,
    w,
    b=None,
    *,
    axis_name: str = MODEL_AXIS,
    gather_input: bool = False,
    gather_dimension: int = 0,
    gather_output: bool = False,
    out_features: int | None = None,
    precision: Precision = FLOAT32,
    collective_matmul: str | None = None,
    gathered_input: bool = False,
):
    """Column-parallel dense on local blocks: ``x[..., D] · w[D, F_model] + b[F_model] → y[..., F_model]``.

    Arguments (local blocks, ``p`` = size of ``axis_name``):
        x: ``x[..., D]`` (any leading dims, e.g. ``x[B, S, D]``) replicated over ``axis_name``;
            with ``gather_input``, split along ``gather_dimension`` (sequence parallelism:
            ``x[B, S/p, D]`` with ``gather_dimension=1``).
        w: the weight shard ``w[D, F/p]``.
        b: the bias shard ``b[F/p]``, or ``None``.
        gather_output: return the full ``y[..., F]``, replicated over ``axis_name``.
        out_features: the logical F when the stored F is padded to a multiple of p
            (``shardops.pad_params``): the padded output columns are zero, and
            ``gather_output`` returns ``y[..., out_features]``.
        collective_matmul: one of ``COLLECTIVE_MATMULS``. With ``gather_input``, ``"ring"``
            (``"bidirectional"``) replaces the AllGather and the matmul by a ring of
            collective-permutes, one (two) per step, each step multiplying the block that just
            arrived (``_collective_dense.all_gather_dense``); ``"bidirectional"`` needs an even
            block along ``gather_dimension``. Without ``gather_input`` the forward pass has no
            collective to overlap, and the option changes nothing.
        gathered_input: ``x[.., S, .., D]`` was gathered already along its split dim by
            ``shardops.comm.gather_to_region`` (Megatron's sequence-parallel "g" once, read by
            several column layers: q, k and v of one normed input), so it varies over
            ``axis_name``: this layer communicates nothing, and the gather's backward
            ReduceScatters the layers' summed ``dx``.

    Returns:
        ``y[..., F/p]`` in compute dtype, or ``y[..., F]`` with ``gather_output``.

    Communication over ``axis_name``:
        forward: none. ``gather_input``: AllGather ``x[.., S_model, .., D] → x[.., S, .., D]``
        (in compute dtype). ``gather_output``: AllGather ``y[..., F_model] → y[..., F]``.
        backward: ``dx[..., D]{U_model}`` is reduced only if ``x`` needs a gradient: AllReduce
        (Megatron's "f" operator, the transpose of ``pcast`` to varying), or ReduceScatter to
        ``dx[.., S_model, .., D]`` with ``gather_input``, in ``accum_dtype`` either way
        (``_mappings``), then cast to ``x``'s dtype once. ``dw`` and ``db`` are local. The
        backward of ``gather_output`` is a local slice (the gathered ``y`` is invariant, so is
        its cotangent).
        ``gathered_input``: none either way (the caller's gather and its ReduceScatter).
        ``collective_matmul`` with ``gather_input``: forward p − 1 collective-permutes of
        ``x``'s block per direction (in ``x``'s dtype), backward p − 1 of ``dx``'s partial sums
        (in ``accum_dtype``), the same bytes as the AllGather and ReduceScatter they replace.
    """
    op = "column_parallel_dense_kernel"
    check_collective_matmul(collective_matmul, op)
    p = bound_axis_size(axis_name, op)
    check_sharded_over(w, axis_name, "w", op)
    _check_local_shapes(x, w, b, op)
    accum = precision.accum_dtype
    if gather_input and gathered_input:
        raise ValueError(f"{op}: gather_input and gathered_input both set; an input is split "
                         f"(gather_input: this layer gathers it) or gathered already, not both")  # fmt: skip
    if gather_input:
        gather_dimension = _check_dim(gather_dimension, x.ndim - 1, "gather_dimension", op)
    if gather_input and collective_matmul is not None:
        block = x.shape[gather_dimension]
        check_even_block(op, collective_matmul, block,
                         f"the block along gather_dimension={gather_dimension} has {block} rows",
                         "an even block (a multiple of 2 × the axis size in the global array)")  # fmt: skip
        # x_block[.., S/p, .., D] travels the ring; backward: a ring ReduceScatter of dx in accum.
        bidirectional = collective_matmul == "bidirectional"
        with because(_COLUMN_GATHER, axis_name):
            y_acc = _collective_dense.all_gather_dense(  # y[.., S, .., F/p] in accum
                x, w, axis_name, axis=gather_dimension, bidirectional=bidirectional,
                precision=precision,
            )  # fmt: skip
    else:
        if gather_input:
            # x_block[.., S/p, .., D] → x[.., S, .., D]; backward: ReduceScatter of dx in accum.
            with because(_COLUMN_GATHER, axis_name):
                x = gather_to_region(x, axis_name, gather_dimension, accum)  # x[..., D] in accum
        elif gathered_input:  # gathered by the caller: its backward reduces dx
            x = x.astype(accum)  # x[..., D] in accum
        else:
            check_replicated_over(x, axis_name, "x", op)
            # Megatron's "f": identity forward; backward: AllReduce of dx over model in accum.
            with because(REPLICATED_INPUT, axis_name):
                x = copy_to_region(x, axis_name, accum)  # x[..., D] in accum
        y_acc = precision.matmul(x, w)  # y[..., F/p] in accum
    y_block = precision.finish(y_acc, b)  # y[..., F/p]
    f_local = w.shape[1]
    if out_features is not None and out_features < f_local * p:
        # Padded columns (global index ≥ out_features) are zero, whatever their weights hold.
        y_block = y_block * _valid_columns(axis_name, f_local, out_features, y_block.dtype)
    if gather_output:
        # invariant output: its cotangent is replicated, so the transpose is a local slice.
        with because(_COLUMN_OUTPUT, axis_name):
            y = gather_from_region(y_block, axis_name, y_block.ndim - 1)
        return y if out_features is None else y[..., :out_features]  # y[..., F]
    return y_block


@scoped("row_parallel_dense")
def row_parallel_dense_kernel(
    x,
    w,
    b=None,
    *,
    axis_name: str = MODEL_AXIS,
    input_is_parallel: bool = True,
    in_features: int | None = None,
    reduce: str = "psum",
    scatter_dimension: int = 0,
    precision: Precision = FLOAT32,
    collective_matmul: str | None = None,
):
    """Row-parallel dense on local blocks: ``x[..., F_model] · w[F_model, D] → y[..., D]{U_model}``, then reduce.

    Arguments (local blocks, ``p`` = size of ``axis_name``):
        x: ``x[..., F/p]`` (``input_is_parallel``, e.g. a column-parallel layer's output), or the
            replicated ``x[..., F]``, which is sliced locally with ``axis_index``.
        w: the weight shard ``w[F/p, D]``.
        b: ``b[D]`` replicated, or the shard ``b[D/p]`` when ``reduce="psum_scatter"`` along the
            last (feature) dimension; or ``None``. It is added exactly once, after the reduction.
        in_features: the logical F when the stored F is padded to a multiple of p: the padded
            input columns are masked to zero, so neither they nor the padded weight rows reach
            the output or receive a gradient.
        reduce: ``"psum"`` → ``y[..., D]`` replicated; ``"psum_scatter"`` → ``y`` split along
            ``scatter_dimension``: the batch (0), the sequence (``y[B, S_model, D]``, 1 of a
            rank-3 ``y``), or the features (the last dim, ``y[..., D_model]``).
        collective_matmul: one of ``COLLECTIVE_MATMULS``. ``"ring"`` (``"bidirectional"``)
            computes the reduction as a ring of collective-permutes along ``scatter_dimension``
            (a leading dim of ``y``, divisible by p; with ``"bidirectional"`` into blocks of an
            even size), each step adding this device's product for the block passing by
            (``_collective_dense``). ``"psum"`` then AllGathers the reduced blocks (builtin,
            invariant over ``axis_name`` like psum's output). A ``psum_scatter`` over the
            features is not supported: the ring would split ``w``'s columns, not ``x``'s rows.

    Communication over ``axis_name`` (V = bytes of ``y[..., D]`` in ``accum_dtype``):
        forward: ``psum``: AllReduce ``y{U_model} → y`` (2V(p−1)/p per device on a ring).
        ``psum_scatter``: ReduceScatter ``y{U_model} → y[.., S_model, .., D]`` or
        ``y[..., D_model]`` (V(p−1)/p).
        backward: ``psum``: none (its transpose only marks the cotangent varying).
        ``psum_scatter``: AllGather of ``dy``; along a non-feature dim also an AllReduce of the
        replicated bias' gradient ``db[D]`` (in ``accum_dtype``).
        ``input_is_parallel=False``: the slice's transpose zero-pads ``dx`` to ``[..., F]`` and
        AllReduces it in ``accum_dtype``, 2·|x|·(p−1)/p per device: twice the bytes of the
        AllGather that an already-parallel input would need. Prefer feeding a column-parallel
        output.
        ``collective_matmul``: the forward ReduceScatter becomes p − 1 collective-permutes of
        partial sums per direction in ``accum_dtype`` (its bytes), and ``psum`` adds the
        builtin AllGather (together the AllReduce's bytes). Backward: ``psum``: none, as
        without the option; ``psum_scatter``: a ring AllGather of ``dy`` in ``accum_dtype``,
        ``dx`` computed block by block as it arrives.
    """
    op = "row_parallel_dense_kernel"
    check_collective_matmul(collective_matmul, op)
    p = bound_axis_size(axis_name, op)
    check_sharded_over(w, axis_name, "w", op)
    check_reduce(reduce, "y")
    f_local = w.shape[0]
    if not input_is_parallel:  # x[..., F] → x_block[..., F/p]
        x = _block_of_replicated_input(x, f_local, p, in_features, axis_name, precision, op)
    _check_local_shapes(x, w, None, op)
    if in_features is not None and in_features < f_local * p:
        x = x * _valid_columns(axis_name, f_local, in_features, x.dtype)  # padding → 0
    y_shape = (*x.shape[:-1], w.shape[1])  # y[B, D]
    if reduce == "psum_scatter" or collective_matmul is not None:
        scatter_dimension = _check_scatter_dimension(
            scatter_dimension, y_shape, p, axis_name, collective_matmul, op
        )
    if collective_matmul is not None:  # y[B, D] replicated (psum) or y[.., S/p, .., D], in accum
        y = _ring_reduced_dense(
            x, w, axis_name, reduce, scatter_dimension, collective_matmul, precision
        )
    else:
        y_partial = precision.matmul(x, w)  # y[B, D]{U_model}
        with because(_ROW_REDUCE, axis_name):
            if reduce == "psum":
                y = reduce_from_region(y_partial, axis_name)  # y[B, D]
            else:  # y[.., S/p, .., D] or y[..., D/p]
                y = reduce_scatter_from_region(y_partial, axis_name, scatter_dimension)
    if reduce == "psum_scatter" and b is not None and scatter_dimension != y.ndim - 1:
        # b[D] is replicated but y is a batch/sequence shard: db all-reduces over model.
        with because(_ROW_BIAS, axis_name):
            b = copy_to_region(b, axis_name, precision.accum_dtype)  # b[D] in accum
    if b is not None and b.shape != y.shape[-1:]:
        raise ValueError(
            f"{op}: local bias has shape {b.shape} but the reduced output has {y.shape[-1]} "
            f"features; with psum_scatter over features pass the bias shard"
        )
    return precision.finish(y, b)  # bias exactly once, after the reduction


def _block_of_replicated_input(
    x, f_local: int, p: int, in_features, axis_name: str, precision: Precision, op: str
):
    """This device's ``x_block[..., F/p]`` of a replicated ``x[..., F]``, sliced with ``axis_index``.

    ``x`` may hold the stored (padded) F, ``f_local · p``, or the logical ``in_features``, which
    is zero-padded to the stored F first. Backward: the slice's transpose zero-pads
    ``dx[..., F]``, and ``copy_to_region`` AllReduces it over ``axis_name`` in ``accum_dtype``.
    """
    check_replicated_over(x, axis_name, "x", op)
    logical = f_local * p if in_features is None else in_features
    if x.ndim >= 2 and x.shape[-1] not in (f_local * p, logical):
        raise ValueError(
            f"{op}: replicated x[..., F] has F={x.shape[-1]} but the weight shard has "
            f"{f_local} rows × {p} devices on {axis_name!r} = {f_local * p}"
        )
    # Its transpose all-reduces the zero-padded dx[..., F] over model, in accum_dtype.
    with because(_ROW_INPUT, axis_name):
        x = copy_to_region(x, axis_name, precision.accum_dtype)  # x[..., F] in accum
    if x.shape[-1] < f_local * p:  # the logical F: pad to the stored (padded) F
        pad = [(0, 0)] * (x.ndim - 1) + [(0, f_local * p - x.shape[-1])]
        x = jnp.pad(x, pad)  # x[..., F_padded]
    start = lax.axis_index(axis_name) * f_local
    return lax.dynamic_slice_in_dim(x, start, f_local, axis=x.ndim - 1)  # x_block[..., F/p]


def _check_scatter_dimension(
    scatter_dimension: int,
    y_shape: tuple,
    p: int,
    axis_name: str,
    collective_matmul: str | None,
    op: str,
) -> int:
    """``scatter_dimension`` as a non-negative dim of ``y[..., D]`` that ``p`` devices can split.

    With a ``collective_matmul`` ring it must be a leading dim (not the features) whose block of
    ``y_shape[scatter_dimension] / p`` rows is even where ``"bidirectional"`` needs it.
    """
    scatter_dimension = _check_dim(scatter_dimension, len(y_shape), "scatter_dimension", op)
    if collective_matmul is not None and scatter_dimension == len(y_shape) - 1:
        raise ValueError(
            f"{op}: collective_matmul={collective_matmul!r} splits its ring along a leading "
            f"dim of y (batch or sequence), but scatter_dimension={scatter_dimension} is "
            f"the feature dim of y{y_shape}, which would split w's columns instead. Use "
            f"scatter_dimension=0 (or the sequence) or collective_matmul=None."
        )
    if y_shape[scatter_dimension] % p:
        if collective_matmul is None:
            using, fix = "psum_scatter", ""
        else:
            using = f"the ring of collective_matmul={collective_matmul!r}"
            fix = f"; choose a scatter_dimension whose size divides by {p}, or no ring"
        raise ValueError(
            f"{op}: output dim {scatter_dimension} = {y_shape[scatter_dimension]} is not "
            f"divisible by mesh axis {axis_name!r} (size {p}), so {using} cannot split it{fix}"
        )
    if collective_matmul is not None:
        block = y_shape[scatter_dimension] // p
        check_even_block(op, collective_matmul, block,
                         f"the block along scatter_dimension={scatter_dimension} has {block} rows",
                         "an even block (a multiple of 2 × the axis size in the global array)")  # fmt: skip
    return scatter_dimension


def _ring_reduced_dense(
    x,
    w,
    axis_name: str,
    reduce: str,
    scatter_dimension: int,
    collective_matmul: str,
    precision: Precision,
):
    """``x[..., F_model] · w[F_model, D]``, reduced by a collective-matmul ring: ``y[B, D]``.

    ``reduce="psum"``: a ring ReduceScatter along ``scatter_dimension``, then the builtin
    AllGather → ``y[B, D]`` replicated; ``"psum_scatter"``: the ring alone →
    ``y[.., S/p, .., D]``. All in ``accum_dtype`` (``_collective_dense``).
    """
    # psum: ring ReduceScatter, then AllGather; psum_scatter: the ring alone (all in accum).
    ring_dense = (
        _collective_dense.dense_all_reduce
        if reduce == "psum"
        else _collective_dense.dense_reduce_scatter
    )
    bidirectional = collective_matmul == "bidirectional"
    with because(_ROW_REDUCE, axis_name):
        return ring_dense(  # y[B, D] replicated (psum) or y[.., S/p, .., D], in accum
            x, w, axis_name, scatter_dimension=scatter_dimension,
            bidirectional=bidirectional, precision=precision,
        )  # fmt: skip


def _valid_columns(axis_name: str, f_local: int, logical: int, dtype):
    """``mask[F/p]``: 1 where this device's column (global index ``i·F/p + j``) is < ``logical``."""
    index = lax.axis_index(axis_name) * f_local + jnp.arange(f_local)  # (F/p,)
    return (index < logical).astype(dtype)


def _check_dim(dim: int, ndim: int, argument: str, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"{op}: {argument} must be a dim of the {ndim} allowed; got {dim!r}")
    return dim % ndim


def _check_local_shapes(x, w, b, op: str) -> None:
    if x.ndim < 2 or w.ndim != 2:
        raise ValueError(
            f"{op}: expected x[..., D] of rank ≥ 2 and w[D, F] of rank 2; got x{tuple(x.shape)} "
            f"and w{tuple(w.shape)}"
        )
    check_dense_shapes(op, x.shape, w.shape, None if b is None else b.shape, scope="local ")


def check_dense_shapes(op: str, x_shape, w_shape, b_shape, *, scope: str = "") -> None:
    """``x[..., D] · w[D, F] + b[F]``: inner dimensions agree and the bias matches, no broadcast."""
    if x_shape[-1] != w_shape[0]:
        raise ValueError(
            f"{op}: inner dimensions differ: {scope}x{tuple(x_shape)} has {x_shape[-1]} features "
            f"but {scope}w{tuple(w_shape)} has {w_shape[0]} rows"
        )
    if b_shape is not None and tuple(b_shape) != (w_shape[1],):
        raise ValueError(
            f"{op}: {scope}b must have shape ({w_shape[1]},) to match {scope}w{tuple(w_shape)}; "
            f"got {tuple(b_shape)}. No broadcasting is done."
        )
