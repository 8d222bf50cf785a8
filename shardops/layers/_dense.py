"""Column- and row-parallel dense layers on global arrays: they build the ``shard_map``.

Each layer validates its arguments against the mesh before anything is traced, takes its
PartitionSpecs from one ``DenseSpecs`` value (also used to shard parameters), and runs the
per-device kernel of ``_dense_kernels.py`` under ``jax.named_scope("shardops.<layer>")``.

Two layers compose inside a user's ``jit`` without resharding when the first one's ``y`` spec is
the second one's ``x`` spec, e.g. ``column_parallel_dense`` (``y[B, F_model]``) followed by
``row_parallel_dense(input_is_parallel=True)`` (``x[B, F_model]``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardops._axes import MODEL_AXIS
from shardops._mesh import axis_size, check_divisible, spec_entry
from shardops._precision import FLOAT32, Precision
from shardops.layers import _dense_kernels as _kernels
from shardops.layers._collective_dense import check_collective_matmul
from shardops.layers._common import (
    check_axes,
    check_even_block,
    check_precision,
    check_reduce,
    run_layer,
)


class DenseSpecs(NamedTuple):
    """PartitionSpecs of one dense layer's input ``x``, weight ``w``, bias ``b`` and output ``y``."""

    x: P
    w: P
    b: P
    y: P

    @property
    def params(self) -> dict[str, P]:
        """The specs of the parameter dict ``{"w": ..., "b": ...}``, for ``shard_params``."""
        return {"w": self.w, "b": self.b}


def column_parallel_dense_specs(
    *,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    gather_input: bool = False,
    gather_dimension: int = 0,
    gather_output: bool = False,
    ndim: int = 2,
) -> DenseSpecs:
    """Layout of ``column_parallel_dense``: ``x[B_batch, ..., D] · w[D, F_model] + b[F_model]``.

    ``gather_input`` takes ``x`` split over ``axis_name`` along ``gather_dimension`` too (minor
    to ``batch_axis`` on dim 0: ``x[B_(batch,model), D]``; the sequence: ``x[B_batch, S_model,
    D]``); ``gather_output`` returns ``y[B_batch, ..., F]``. ``ndim`` is the rank of ``x``.
    """
    _check_rank(ndim)
    x = [spec_entry(batch_axis)] + [None] * (ndim - 1)
    if gather_input:
        g = _normalized_dim(gather_dimension, ndim - 1, "gather_dimension")
        x[g] = spec_entry(*((batch_axis,) if g == 0 else ()), axis_name)
    y = [spec_entry(batch_axis)] + [None] * (ndim - 1)
    y[-1] = None if gather_output else axis_name
    return DenseSpecs(x=P(*x), w=P(None, axis_name), b=P(axis_name), y=P(*y))


def row_parallel_dense_specs(
    *,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    input_is_parallel: bool = True,
    reduce: str = "psum",
    scatter_dimension: int = 0,
    ndim: int = 2,
) -> DenseSpecs:
    """Layout of ``row_parallel_dense``: ``x[B_batch, ..., F_model] · w[F_model, D] → y[B_batch, ..., D]{U_model}``.

    ``reduce="psum"`` gives ``y[B_batch, ..., D]``; ``"psum_scatter"`` splits ``y`` over
    ``axis_name`` along ``scatter_dimension``: ``y[B_(batch,model), D]`` (0), ``y[B_batch,
    S_model, D]`` (the sequence of a rank-3 ``y``), or ``y[..., D_model]`` with bias
    ``b[D_model]`` (the last dim). ``ndim`` is the rank of ``x``.
    """
    _check_reduce(reduce, scatter_dimension, ndim)
    rows = [spec_entry(batch_axis)] + [None] * (ndim - 1)
    x = list(rows)
    x[-1] = axis_name if input_is_parallel else None
    y = list(rows)
    scatter_features = False
    if reduce == "psum_scatter":
        d = scatter_dimension % ndim
        scatter_features = d == ndim - 1
        y[d] = spec_entry(*((batch_axis,) if d == 0 else ()), axis_name)
    return DenseSpecs(
        x=P(*x), w=P(axis_name, None), b=P(axis_name) if scatter_features else P(None), y=P(*y)
    )


def column_parallel_dense(
    x,
    w,
    b=None,
    *,
    mesh: Mesh,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    gather_input: bool = False,
    gather_dimension: int = 0,
    gather_output: bool = False,
    out_features: int | None = None,
    precision: Precision = FLOAT32,
    collective_matmul: str | None = None,
):
    """Column-parallel dense layer on global arrays: ``x[B, ..., D] · w[D, F_model] + b[F_model] → y[B, ..., F_model]``.

    Arguments:
        x: ``x[B, ..., D]`` (rank ≥ 2, e.g. ``x[B, S, D]``) in ``precision.compute_dtype``;
            replicated over ``axis_name`` and split over ``batch_axis`` (if given) along B. With
            ``gather_input``, also split over ``axis_name`` along ``gather_dimension`` (0: the
            batch; 1 of ``x[B, S, D]``: the sequence) and gathered first (sequence parallelism).
        w: ``w[D, F]`` in ``precision.param_dtype``, split over ``axis_name`` along F. F must
            divide by the axis size: pad it (``shardops.pad_params``) and pass ``out_features``.
        b: ``b[F]`` or ``None``.
        mesh: the mesh (Auto or Explicit axes).
        gather_output: return ``y[B, ..., F]`` replicated over ``axis_name``.
        out_features: the logical F of a padded ``w``: padded output columns are zero, and
            ``gather_output`` returns ``y[..., out_features]``.
        collective_matmul: ``None`` (the builtin AllGather), ``"ring"`` or ``"bidirectional"``
            (``shardops.layers.COLLECTIVE_MATMULS``): with ``gather_input``, gather ``x`` by a ring of
            collective-permutes, multiplying each block as it arrives so that the transfers
            can hide behind the matmul (``"bidirectional"``: half of each block each way, which
            needs an even local block along ``gather_dimension``). Without ``gather_input``
            there is no forward collective to overlap and the option changes nothing.

    Returns:
        ``y[B, ..., F]`` in ``precision.compute_dtype``, laid out as ``column_parallel_dense_specs(...).y``.

    Communication: see ``column_parallel_dense_kernel``. Forward none (plus the requested
    gathers); backward one AllReduce of ``dx[B, ..., D]`` over ``axis_name`` when ``x`` needs a
    gradient (a ReduceScatter with ``gather_input``). With ``collective_matmul`` the gather of
    ``x`` and the ReduceScatter of ``dx`` are rings of N − 1 collective-permutes per direction,
    moving the same bytes as the builtins.
    """
    op = "column_parallel_dense"
    check_collective_matmul(collective_matmul, op)
    check_axes(mesh, axis_name, batch_axis)
    _check_dense_args(op, x, w, b, precision)
    specs = column_parallel_dense_specs(
        axis_name=axis_name,
        batch_axis=batch_axis,
        gather_input=gather_input,
        gather_dimension=gather_dimension,
        gather_output=gather_output,
        ndim=x.ndim,
    )
    check_divisible(
        argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh, axes=(batch_axis,)
    )
    if gather_input:
        g = gather_dimension % (x.ndim - 1)
        axes = (batch_axis, axis_name) if g == 0 else (axis_name,)
        name = "batch" if g == 0 else "sequence"
        check_divisible(argument="x", dim=g, dim_name=name, size=x.shape[g], mesh=mesh, axes=axes)
        _check_even_layer_block(
            op, collective_matmul, "gather_dimension", g, x.shape[g], mesh, axes
        )
    _check_padded(
        op, "w", 1, "out features", w.shape[1], out_features, "out_features", mesh, axis_name
    )
    kernel = functools.partial(
        _kernels.column_parallel_dense_kernel,
        axis_name=axis_name,
        gather_input=gather_input,
        gather_dimension=gather_dimension,
        gather_output=gather_output,
        out_features=out_features,
        precision=precision,
        collective_matmul=collective_matmul,
    )
    return _run(op, kernel, mesh, specs, x, w, b)


def row_parallel_dense(
    x,
    w,
    b=None,
    *,
    mesh: Mesh,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    input_is_parallel: bool = True,
    in_features: int | None = None,
    reduce: str = "psum",
    scatter_dimension: int = 0,
    precision: Precision = FLOAT32,
    collective_matmul: str | None = None,
):
    """Row-parallel dense layer on global arrays: ``x[B, ..., F_model] · w[F_model, D] → y[B, ..., D]{U_model}`` → reduce, + b.

    Arguments:
        x: ``x[B, ..., F]`` (rank ≥ 2) in ``precision.compute_dtype``, split over ``axis_name``
            along F (``input_is_parallel=True``, the output of ``column_parallel_dense``) or
            replicated over it (``False``: each device slices its block locally). B is split
            over ``batch_axis`` if given.
        w: ``w[F, D]`` in ``precision.param_dtype``, split over ``axis_name`` along F (padded to
            a multiple of the axis size if needed: pass ``in_features``).
        b: ``b[D]`` or ``None``; added once, after the reduction.
        in_features: the logical F of a padded ``w``: padded input columns are masked to zero.
        reduce: ``"psum"`` → ``y[B, ..., D]`` replicated over ``axis_name``; ``"psum_scatter"``
            → ``y`` split over ``axis_name`` along ``scatter_dimension`` (0: batch, 1 of a
            rank-3 ``y``: sequence, last: features).
        collective_matmul: ``None`` (the builtin collective), ``"ring"`` or ``"bidirectional"``
            (``shardops.layers.COLLECTIVE_MATMULS``): reduce-scatter ``y`` along ``scatter_dimension``
            (0: batch, 1 of a rank-3 ``y``: sequence; not the features) by a ring of
            collective-permutes, each step adding this device's product for the block passing
            by; ``"psum"`` then all-gathers the blocks (the output stays replicated).
            ``y``'s local size along ``scatter_dimension`` must divide by the axis size (and
            give even blocks for ``"bidirectional"``), also with ``"psum"``.

    Returns:
        ``y[B, ..., D]`` in ``precision.compute_dtype``, laid out as ``row_parallel_dense_specs(...).y``.

    Communication: see ``row_parallel_dense_kernel``. ``psum``: one AllReduce of ``y[B, ..., D]``
    forward and none backward (for ``x``, ``w`` and ``b``). With ``collective_matmul`` the
    ReduceScatter (half of the AllReduce) is a ring of N − 1 collective-permutes per direction,
    moving the same bytes as the builtin.
    """
    op = "row_parallel_dense"
    check_collective_matmul(collective_matmul, op)
    check_axes(mesh, axis_name, batch_axis)
    _check_dense_args(op, x, w, b, precision, replicated_f=not input_is_parallel)
    specs = row_parallel_dense_specs(
        axis_name=axis_name,
        batch_axis=batch_axis,
        input_is_parallel=input_is_parallel,
        reduce=reduce,
        scatter_dimension=scatter_dimension,
        ndim=x.ndim,
    )
    check_divisible(
        argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh, axes=(batch_axis,)
    )
    _check_padded(
        op, "w", 0, "in features", w.shape[0], in_features, "in_features", mesh, axis_name
    )
    if input_is_parallel and x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{op}: inner dimensions differ: x{tuple(x.shape)} has {x.shape[-1]} features but "
            f"w{tuple(w.shape)} has {w.shape[0]} rows"
        )
    if reduce == "psum_scatter":
        _check_scatter_divisible(x, w, mesh, axis_name, batch_axis, scatter_dimension)
    if collective_matmul is not None:
        _check_ring_dimension(
            op, x, w, mesh, axis_name, batch_axis, reduce, scatter_dimension, collective_matmul
        )
    kernel = functools.partial(
        _kernels.row_parallel_dense_kernel,
        axis_name=axis_name,
        input_is_parallel=input_is_parallel,
        in_features=in_features,
        reduce=reduce,
        scatter_dimension=scatter_dimension,
        precision=precision,
        collective_matmul=collective_matmul,
    )
    if not input_is_parallel and x.shape[-1] != w.shape[0]:  # a logical-width replicated x
        x = _padded_to_stored_width(op, x, w, in_features)  # x[B, ..., F_padded]
    return _run(op, kernel, mesh, specs, x, w, b)


def _check_scatter_divisible(x, w, mesh: Mesh, axis_name: str, batch_axis, scatter_dimension):
    """``reduce="psum_scatter"``: the dim of ``y[B, ..., D]`` it splits divides by its mesh axes.

    Batch (dim 0) is split over ``batch_axis`` and ``axis_name``, the sequence over
    ``axis_name``, the features (``w``'s dim 1) over ``axis_name``.
    """
    d = scatter_dimension % x.ndim
    names = {0: "batch", x.ndim - 1: "out features"}
    size = w.shape[1] if d == x.ndim - 1 else x.shape[d]
    axes = (batch_axis, axis_name) if d == 0 else (axis_name,)
    arg, dim = ("w", 1) if d == x.ndim - 1 else ("x", d)
    check_divisible(argument=arg, dim=dim, dim_name=names.get(d, "sequence"), size=size,
                    mesh=mesh, axes=axes)  # fmt: skip


def _check_ring_dimension(
    op,
    x,
    w,
    mesh: Mesh,
    axis_name: str,
    batch_axis,
    reduce: str,
    scatter_dimension: int,
    collective_matmul: str,
) -> None:
    """``collective_matmul``'s ring splits ``y`` along a leading ``scatter_dimension``: not the
    features, divisible by its mesh axes, in even blocks where ``"bidirectional"`` needs them."""
    d = scatter_dimension % x.ndim
    if d == x.ndim - 1:
        raise ValueError(
            f"{op}: collective_matmul={collective_matmul!r} splits its ring along a leading "
            f"dim of y (batch or sequence), but scatter_dimension={scatter_dimension} is "
            f"the feature dim of y{(*x.shape[:-1], w.shape[1])}, which would split w's "
            f"columns instead. Use scatter_dimension=0 (or the sequence) or "
            f"collective_matmul=None."
        )
    axes = (batch_axis, axis_name) if d == 0 else (axis_name,)
    name = "batch" if d == 0 else "sequence"
    hint = (
        f" (collective_matmul={collective_matmul!r} reduce-scatters y along "
        f"scatter_dimension={scatter_dimension}, also with reduce={reduce!r})"
    )
    check_divisible(argument="x", dim=d, dim_name=name, size=x.shape[d], mesh=mesh,
                    axes=axes, hint=hint)  # fmt: skip
    _check_even_layer_block(op, collective_matmul, "scatter_dimension", d, x.shape[d], mesh, axes)


def _padded_to_stored_width(op, x, w, in_features):
    """A replicated ``x[B, ..., F]`` of the logical width ``in_features``, zero-padded to the
    ``F_padded`` rows ``w`` stores: ``x[B, ..., F_padded]``. Any other width is refused."""
    if x.shape[-1] != in_features:
        raise ValueError(
            f"{op}: inner dimensions differ: x{tuple(x.shape)} has {x.shape[-1]} features "
            f"but w{tuple(w.shape)} has {w.shape[0]} rows (and in_features={in_features}); "
            f"for a padded w pass in_features={x.shape[-1]}"
        )
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, w.shape[0] - x.shape[-1])])


def _run(op: str, kernel, mesh: Mesh, specs: DenseSpecs, x, w, b):
    args, in_specs = {"x": x, "w": w}, {"x": specs.x, "w": specs.w}
    if b is not None:
        args["b"], in_specs["b"] = b, specs.b
    return run_layer(op, kernel, mesh, args, in_specs, specs.y)


def _check_even_layer_block(op, collective_matmul, argument, dim, size, mesh, axes) -> None:
    """The global dim ``size`` split over ``axes``: each device's block, for ``check_even_block``."""
    parts = math.prod(axis_size(mesh, a) for a in axes)
    over = " × ".join(f"{a!r} (size {axis_size(mesh, a)})" for a in axes if a is not None)
    check_even_block(op, collective_matmul, size // parts,
                     f"x dim {dim} ({argument}={dim}) = {size} over mesh axis {over} gives "
                     f"blocks of {size // parts} rows", f"a multiple of {2 * parts}")  # fmt: skip


def _check_reduce(reduce: str, scatter_dimension: int, ndim: int = 2) -> None:
    check_reduce(reduce, "output")
    _check_rank(ndim)
    _normalized_dim(scatter_dimension, ndim, "scatter_dimension")


def _check_rank(ndim: int) -> None:
    if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 2:
        raise ValueError(f"ndim (the rank of x) must be an int ≥ 2 (x[B, ..., D]); got {ndim!r}")


def _normalized_dim(dim: int, ndim: int, argument: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(
            f"{argument} must be one of the {ndim} dims it may split (0 = batch, "
            f"{'1 = sequence of x[B, S, D], ' if ndim > 2 else ''}-1 = last); got {dim!r}"
        )
    return dim % ndim


def _check_padded(op, argument, dim, dim_name, size, logical, logical_name, mesh, axis_name):
    """``size`` (the stored dim) must divide by the axis; ``logical`` (if given) ≤ ``size``."""
    p = axis_size(mesh, axis_name)
    if logical is not None and (
        isinstance(logical, bool) or not isinstance(logical, int) or not 0 < logical <= size
    ):
        raise ValueError(
            f"{op}: {logical_name}={logical!r} must be an int in 1..{size} ({argument} dim "
            f"{dim}, {dim_name}, holds {size} including padding)"
        )
    if size % p:
        padded = -(-size // p) * p
        raise ValueError(
            f"{op}: {argument} dim {dim} ({dim_name}) = {size} is not divisible by mesh axis "
            f"{axis_name!r} (size {p}). Pad it to {padded} with shardops.pad_params (or "
            f"shard_params(..., pad=True)) and pass {logical_name}={logical or size}."
        )


def _check_dense_args(op: str, x, w, b, precision: Precision, *, replicated_f=False) -> None:
    check_precision(op, precision)
    for name, arg, ok, meaning in (("x", x, lambda r: r >= 2, "rank ≥ 2 (x[B, ..., D])"),
                                   ("w", w, lambda r: r == 2, "rank 2 (w[D, F])")):  # fmt: skip
        if not hasattr(arg, "shape") or not ok(len(arg.shape)):
            got = f"shape {tuple(arg.shape)}" if hasattr(arg, "shape") else type(arg).__name__
            raise ValueError(f"{op}: {name} must have {meaning}; got {got}")
    b_shape = None if b is None else tuple(getattr(b, "shape", ()))
    # A replicated row input may have the logical (unpadded) F; the layer checks it against
    # in_features. Everything else must match the stored shapes.
    x_shape = (*x.shape[:-1], w.shape[0]) if replicated_f else x.shape
    _kernels.check_dense_shapes(op, x_shape, w.shape, b_shape)
    precision.check_activation("x", x.dtype)
    precision.check_param("w", w.dtype)
    if b is not None:
        precision.check_param("b", b.dtype)
