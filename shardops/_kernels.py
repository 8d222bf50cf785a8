"""Per-device kernels of the column- and row-parallel dense layers.

These are the bodies that run inside ``jax.shard_map``: they see local blocks and say every
collective they need. Call them from your own ``shard_map`` (with ``check_vma=True``, the
default), or use the global-array layers in ``_layers.py``, which build the ``shard_map`` for you.

Notation (the JAX scaling book): ``w[D, F_model]`` is split over mesh axis ``model`` along F;
``y[B, D]{U_model}`` holds partial sums not yet reduced over ``model``; ``p`` is the size of
``model``.
"""

from __future__ import annotations

import jax
from jax import lax

from shardops._axes import MODEL_AXIS
from shardops._mappings import copy_to_region, gather_to_region
from shardops._precision import FLOAT32, Precision

REDUCTIONS = ("psum", "psum_scatter")


def column_parallel_dense_kernel(
    x,
    w,
    b=None,
    *,
    axis_name: str = MODEL_AXIS,
    gather_input: bool = False,
    gather_output: bool = False,
    precision: Precision = FLOAT32,
):
    """Column-parallel dense on local blocks: ``x[B, D] · w[D, F_model] + b[F_model] → y[B, F_model]``.

    Arguments (local blocks, ``p`` = size of ``axis_name``):
        x: ``x[B, D]`` replicated over ``axis_name``; with ``gather_input``, the batch shard
            ``x[B/p, D]`` (sequence parallelism).
        w: the weight shard ``w[D, F/p]``.
        b: the bias shard ``b[F/p]``, or ``None``.
        gather_output: return the full ``y[B, F]``, replicated over ``axis_name``.

    Returns:
        ``y[B, F/p]``, or ``y[B, F]`` with ``gather_output``.

    Communication over ``axis_name``:
        forward: none. ``gather_input``: AllGather ``x[B_model, D] → x[B, D]``.
        ``gather_output``: AllGather ``y[B, F_model] → y[B, F]``.
        backward: ``dx[B, D]{U_model}`` is reduced only if ``x`` needs a gradient: AllReduce
        (Megatron's "f" operator, the transpose of ``pcast`` to varying), or ReduceScatter to
        ``dx[B_model, D]`` with ``gather_input``, in ``accum_dtype`` either way (``_mappings``),
        then cast to ``x``'s dtype once. ``dw`` and ``db`` are local. The backward of
        ``gather_output`` is a local slice (the gathered ``y`` is invariant, so is its cotangent).
    """
    _bound_axis_size(axis_name, "column_parallel_dense_kernel")
    _check_sharded_over(w, axis_name, "w", "column_parallel_dense_kernel")
    _check_local_shapes(x, w, b, "column_parallel_dense_kernel")
    accum = precision.accum_dtype
    if gather_input:
        # x_block[B/p, D] → x[B, D]; backward: ReduceScatter of dx in accum_dtype.
        x = gather_to_region(x, axis_name, 0, accum)  # x[B, D] in accum
    else:
        _check_replicated_over(x, axis_name, "x", "column_parallel_dense_kernel")
        # Megatron's "f": identity forward; backward: AllReduce of dx over model in accum_dtype.
        x = copy_to_region(x, axis_name, accum)  # x[B, D] in accum
    y_block = precision.finish(precision.matmul(x, w), b)  # y[B, F/p]
    if gather_output:
        # invariant output: its cotangent is replicated, so the transpose is a local slice.
        return lax.all_gather(y_block, axis_name, axis=1, tiled=True, to="invarying")  # y[B, F]
    return y_block


def row_parallel_dense_kernel(
    x,
    w,
    b=None,
    *,
    axis_name: str = MODEL_AXIS,
    input_is_parallel: bool = True,
    reduce: str = "psum",
    scatter_dimension: int = 0,
    precision: Precision = FLOAT32,
):
    """Row-parallel dense on local blocks: ``x[B, F_model] · w[F_model, D] → y[B, D]{U_model}``, then reduce.

    Arguments (local blocks, ``p`` = size of ``axis_name``):
        x: ``x[B, F/p]`` (``input_is_parallel``, e.g. a column-parallel layer's output), or the
            replicated ``x[B, F]``, which is sliced locally with ``axis_index``.
        w: the weight shard ``w[F/p, D]``.
        b: ``b[D]`` replicated, or the shard ``b[D/p]`` when ``reduce="psum_scatter"`` with
            ``scatter_dimension=1``; or ``None``. It is added exactly once, after the reduction.
        reduce: ``"psum"`` → ``y[B, D]`` replicated; ``"psum_scatter"`` → ``y[B/p, D]``
            (``scatter_dimension=0``, sequence parallelism) or ``y[B, D/p]`` (``=1``).

    Communication over ``axis_name`` (V = bytes of ``y[B, D]`` in ``accum_dtype``):
        forward: ``psum``: AllReduce ``y{U_model} → y`` (2V(p−1)/p per device on a ring).
        ``psum_scatter``: ReduceScatter ``y{U_model} → y[B_model, D]`` or ``y[B, D_model]``
        (V(p−1)/p).
        backward: ``psum``: none (its transpose only marks the cotangent varying).
        ``psum_scatter``: AllGather of ``dy``; with ``scatter_dimension=0`` also an AllReduce of
        the replicated bias' gradient ``db[D]`` (in ``accum_dtype``).
        ``input_is_parallel=False``: the slice's transpose zero-pads ``dx`` to ``[B, F]`` and
        AllReduces it in ``accum_dtype``, 2·B·F(p−1)/p per device: twice the bytes of the
        AllGather that an already-parallel input would need. Prefer feeding a column-parallel
        output.
    """
    p = _bound_axis_size(axis_name, "row_parallel_dense_kernel")
    _check_sharded_over(w, axis_name, "w", "row_parallel_dense_kernel")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}; got {reduce!r}")
    if not input_is_parallel:
        _check_replicated_over(x, axis_name, "x", "row_parallel_dense_kernel")
        f_local = w.shape[0]
        if x.ndim == 2 and x.shape[1] != f_local * p:
            raise ValueError(
                f"row_parallel_dense_kernel: replicated x[B, F] has F={x.shape[1]} but the "
                f"weight shard has {f_local} rows × {p} devices on {axis_name!r} = {f_local * p}"
            )
        # Its transpose all-reduces the zero-padded dx[B, F] over model, in accum_dtype.
        x = copy_to_region(x, axis_name, precision.accum_dtype)  # x[B, F] in accum
        start = lax.axis_index(axis_name) * f_local
        x = lax.dynamic_slice_in_dim(x, start, f_local, axis=1)  # x_block[B, F/p]
    _check_local_shapes(x, w, None, "row_parallel_dense_kernel")
    y_partial = precision.matmul(x, w)  # y[B, D]{U_model}
    if reduce == "psum":
        y = lax.psum(y_partial, axis_name)  # y[B, D]
    else:
        if scatter_dimension not in (0, 1):
            raise ValueError(f"scatter_dimension must be 0 or 1; got {scatter_dimension!r}")
        if y_partial.shape[scatter_dimension] % p:
            raise ValueError(
                f"row_parallel_dense_kernel: output dim {scatter_dimension} = "
                f"{y_partial.shape[scatter_dimension]} is not divisible by mesh axis "
                f"{axis_name!r} (size {p}), so psum_scatter cannot split it"
            )
        y = lax.psum_scatter(
            y_partial, axis_name, scatter_dimension=scatter_dimension, tiled=True
        )  # y[B/p, D] or y[B, D/p]
        if b is not None and scatter_dimension == 0:
            # b[D] is replicated but y is a batch shard: db all-reduces over model (in accum).
            b = copy_to_region(b, axis_name, precision.accum_dtype)  # b[D] in accum
    if b is not None and b.shape != y.shape[-1:]:
        raise ValueError(
            f"row_parallel_dense_kernel: local bias has shape {b.shape} but the reduced output "
            f"has {y.shape[-1]} features; with psum_scatter over features pass the bias shard"
        )
    return precision.finish(y, b)  # bias exactly once, after the reduction


def _bound_axis_size(axis_name: str, op: str) -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{op} is a per-device kernel: call it inside jax.shard_map over a mesh with axis "
            f"{axis_name!r}. For global arrays use the layer of the same name without "
            f"'_kernel' (e.g. shardops.{op.removesuffix('_kernel')})."
        ) from None


def _varying_axes(x) -> frozenset:
    return jax.typeof(x).manual_axis_type.varying


def _check_sharded_over(w, axis_name: str, argument: str, op: str) -> None:
    if axis_name not in _varying_axes(w):
        raise ValueError(
            f"{op}: {argument} must be the local shard of a weight split over mesh axis "
            f"{axis_name!r}, but it is the same on every device of that axis. Give shard_map an "
            f"in_spec that splits it over {axis_name!r}; and keep check_vma=True (the default), "
            f"which autodiff needs to reduce gradients correctly."
        )


def _check_replicated_over(x, axis_name: str, argument: str, op: str) -> None:
    if axis_name in _varying_axes(x):
        raise ValueError(
            f"{op}: {argument} must be replicated over mesh axis {axis_name!r}, but it varies "
            f"over it. Reduce it first (lax.psum), or use the option that takes a sharded input."
        )


def _check_local_shapes(x, w, b, op: str) -> None:
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(
            f"{op}: expected x[B, D] and w[D, F] of rank 2; got x{tuple(x.shape)} and "
            f"w{tuple(w.shape)}"
        )
    check_dense_shapes(op, x.shape, w.shape, None if b is None else b.shape, scope="local ")


def check_dense_shapes(op: str, x_shape, w_shape, b_shape, *, scope: str = "") -> None:
    """``x[B, D] · w[D, F] + b[F]``: inner dimensions agree and the bias matches, no broadcast."""
    if x_shape[1] != w_shape[0]:
        raise ValueError(
            f"{op}: inner dimensions differ: {scope}x{tuple(x_shape)} has {x_shape[1]} features "
            f"but {scope}w{tuple(w_shape)} has {w_shape[0]} rows"
        )
    if b_shape is not None and tuple(b_shape) != (w_shape[1],):
        raise ValueError(
            f"{op}: {scope}b must have shape ({w_shape[1]},) to match {scope}w{tuple(w_shape)}; "
            f"got {tuple(b_shape)}. No broadcasting is done."
        )
