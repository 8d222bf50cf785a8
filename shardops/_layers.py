"""Column- and row-parallel dense layers on global arrays: they build the ``shard_map``.

Each layer validates its arguments against the mesh before anything is traced, takes its
PartitionSpecs from one ``DenseSpecs`` value (also used to shard parameters), and runs the
per-device kernel of ``_kernels.py`` under ``jax.named_scope("shardops.<layer>")``.

Two layers compose inside a user's ``jit`` without resharding when the first one's ``y`` spec is
the second one's ``x`` spec, e.g. ``column_parallel_dense`` (``y[B, F_model]``) followed by
``row_parallel_dense(input_is_parallel=True)`` (``x[B, F_model]``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from shardops import _kernels
from shardops._axes import MODEL_AXIS
from shardops._devices import check_devices
from shardops._mesh import axis_size, check_divisible, normalized_spec, spec_entry
from shardops._precision import FLOAT32, Precision


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


def column_parallel_specs(
    *,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    gather_input: bool = False,
    gather_output: bool = False,
) -> DenseSpecs:
    """Layout of ``column_parallel_dense``: ``x[B_batch, D] · w[D, F_model] + b[F_model]``.

    ``gather_input`` takes ``x[B_(batch,model), D]``; ``gather_output`` returns ``y[B_batch, F]``.
    """
    x_rows = spec_entry(batch_axis, axis_name) if gather_input else spec_entry(batch_axis)
    y_cols = None if gather_output else axis_name
    return DenseSpecs(
        x=P(x_rows, None),
        w=P(None, axis_name),
        b=P(axis_name),
        y=P(spec_entry(batch_axis), y_cols),
    )


def row_parallel_specs(
    *,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    input_is_parallel: bool = True,
    reduce: str = "psum",
    scatter_dimension: int = 0,
) -> DenseSpecs:
    """Layout of ``row_parallel_dense``: ``x[B_batch, F_model] · w[F_model, D] → y[B_batch, D]{U_model}``.

    ``reduce="psum"`` gives ``y[B_batch, D]``; ``"psum_scatter"`` gives ``y[B_(batch,model), D]``
    (``scatter_dimension=0``) or ``y[B_batch, D_model]`` with bias ``b[D_model]`` (``=1``).
    """
    _check_reduce(reduce, scatter_dimension)
    rows = spec_entry(batch_axis)
    scatter = reduce == "psum_scatter"
    if scatter and scatter_dimension == 0:
        y = P(spec_entry(batch_axis, axis_name), None)
    elif scatter:
        y = P(rows, axis_name)
    else:
        y = P(rows, None)
    return DenseSpecs(
        x=P(rows, axis_name if input_is_parallel else None),
        w=P(axis_name, None),
        b=P(axis_name) if scatter and scatter_dimension == 1 else P(None),
        y=y,
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
    gather_output: bool = False,
    precision: Precision = FLOAT32,
):
    """Column-parallel dense layer on global arrays: ``x[B, D] · w[D, F_model] + b[F_model] → y[B, F_model]``.

    Arguments:
        x: ``x[B, D]`` in ``precision.compute_dtype``; replicated over ``axis_name`` and split
            over ``batch_axis`` (if given) along B. With ``gather_input``, B is split over
            ``(batch_axis, axis_name)`` and gathered first (sequence parallelism).
        w: ``w[D, F]`` in ``precision.param_dtype``, split over ``axis_name`` along F.
        b: ``b[F]`` or ``None``.
        mesh: the mesh (Auto or Explicit axes).
        gather_output: return ``y[B, F]`` replicated over ``axis_name`` instead of ``y[B, F_model]``.

    Returns:
        ``y[B, F]`` in ``precision.compute_dtype``, laid out as ``column_parallel_specs(...).y``.

    Communication: see ``column_parallel_dense_kernel``. Forward none (plus the requested
    gathers); backward one AllReduce of ``dx[B, D]`` over ``axis_name`` when ``x`` needs a
    gradient.
    """
    specs = column_parallel_specs(
        axis_name=axis_name,
        batch_axis=batch_axis,
        gather_input=gather_input,
        gather_output=gather_output,
    )
    op = "column_parallel_dense"
    _check_axes(mesh, axis_name, batch_axis)
    _check_dense_args(op, x, w, b, precision)
    rows = (batch_axis, axis_name) if gather_input else (batch_axis,)
    check_divisible(argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh, axes=rows)
    check_divisible(
        argument="w", dim=1, dim_name="out features", size=w.shape[1], mesh=mesh, axes=(axis_name,)
    )
    kernel = functools.partial(
        _kernels.column_parallel_dense_kernel,
        axis_name=axis_name,
        gather_input=gather_input,
        gather_output=gather_output,
        precision=precision,
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
    reduce: str = "psum",
    scatter_dimension: int = 0,
    precision: Precision = FLOAT32,
):
    """Row-parallel dense layer on global arrays: ``x[B, F_model] · w[F_model, D] → y[B, D]{U_model}`` → reduce, + b.

    Arguments:
        x: ``x[B, F]`` in ``precision.compute_dtype``, split over ``axis_name`` along F
            (``input_is_parallel=True``, the output of ``column_parallel_dense``) or replicated
            over it (``False``: each device slices its block locally). B is split over
            ``batch_axis`` if given.
        w: ``w[F, D]`` in ``precision.param_dtype``, split over ``axis_name`` along F.
        b: ``b[D]`` or ``None``; added once, after the reduction.
        reduce: ``"psum"`` → ``y[B, D]`` replicated over ``axis_name``; ``"psum_scatter"`` →
            ``y`` split over ``axis_name`` along ``scatter_dimension`` (0: batch, 1: features).

    Returns:
        ``y[B, D]`` in ``precision.compute_dtype``, laid out as ``row_parallel_specs(...).y``.

    Communication: see ``row_parallel_dense_kernel``. ``psum``: one AllReduce of ``y[B, D]``
    forward and none backward (for ``x``, ``w`` and ``b``).
    """
    specs = row_parallel_specs(
        axis_name=axis_name,
        batch_axis=batch_axis,
        input_is_parallel=input_is_parallel,
        reduce=reduce,
        scatter_dimension=scatter_dimension,
    )
    op = "row_parallel_dense"
    _check_axes(mesh, axis_name, batch_axis)
    _check_dense_args(op, x, w, b, precision)
    scatter = reduce == "psum_scatter"
    rows = (batch_axis, axis_name) if scatter and scatter_dimension == 0 else (batch_axis,)
    check_divisible(argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh, axes=rows)
    check_divisible(
        argument="w", dim=0, dim_name="in features", size=w.shape[0], mesh=mesh, axes=(axis_name,)
    )
    if scatter and scatter_dimension == 1:
        check_divisible(
            argument="w",
            dim=1,
            dim_name="out features",
            size=w.shape[1],
            mesh=mesh,
            axes=(axis_name,),
        )
    kernel = functools.partial(
        _kernels.row_parallel_dense_kernel,
        axis_name=axis_name,
        input_is_parallel=input_is_parallel,
        reduce=reduce,
        scatter_dimension=scatter_dimension,
        precision=precision,
    )
    return _run(op, kernel, mesh, specs, x, w, b)


def _run(op: str, kernel, mesh: Mesh, specs: DenseSpecs, x, w, b):
    args, in_specs = [x, w], [specs.x, specs.w]
    if b is not None:
        args.append(b)
        in_specs.append(specs.b)
    check_devices(mesh, op, **dict(zip(("x", "w", "b"), args, strict=False)))
    for name, arg, spec in zip(("x", "w", "b"), args, in_specs, strict=False):
        _check_explicit_layout(op, name, arg, spec, mesh)
    with jax.named_scope(f"shardops.{op}"):
        return jax.shard_map(
            kernel, mesh=mesh, in_specs=tuple(in_specs), out_specs=specs.y, check_vma=True
        )(*args)


def _check_reduce(reduce: str, scatter_dimension: int) -> None:
    if reduce not in _kernels.REDUCTIONS:
        raise ValueError(
            f"reduce must be one of {_kernels.REDUCTIONS}; got {reduce!r}. 'psum' gives a "
            f"replicated output, 'psum_scatter' one split along scatter_dimension."
        )
    if scatter_dimension not in (0, 1):
        raise ValueError(
            f"scatter_dimension must be 0 (batch) or 1 (features); got {scatter_dimension!r}"
        )


def _check_axes(mesh: Mesh, axis_name: str, batch_axis: str | None) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (see shardops.make_mesh); got {type(mesh).__name__}"
        )
    axis_size(mesh, axis_name, argument="axis_name")
    axis_size(mesh, batch_axis, argument="batch_axis")
    if batch_axis == axis_name:
        raise ValueError(
            f"batch_axis and axis_name are both {axis_name!r}; the batch and the weights must be "
            f"split over different mesh axes"
        )


def _check_dense_args(op: str, x, w, b, precision: Precision) -> None:
    if not isinstance(precision, Precision):
        raise TypeError(
            f"{op}: precision must be a shardops.Precision (FLOAT32, BFLOAT16 or "
            f"MIXED_BFLOAT16); got {precision!r}"
        )
    for name, arg, rank, meaning in (("x", x, 2, "x[B, D]"), ("w", w, 2, "w[D, F]")):
        if not hasattr(arg, "shape") or len(arg.shape) != rank:
            got = f"shape {tuple(arg.shape)}" if hasattr(arg, "shape") else type(arg).__name__
            raise ValueError(
                f"{op}: {name} must have rank {rank} ({meaning}); got {got}. Flatten leading "
                f"dims first, e.g. x.reshape(-1, x.shape[-1])."
            )
    b_shape = None if b is None else tuple(getattr(b, "shape", ()))
    _kernels.check_dense_shapes(op, x.shape, w.shape, b_shape)
    precision.check_activation("x", x.dtype)
    precision.check_param("w", w.dtype)
    if b is not None:
        precision.check_param("b", b.dtype)


def _check_explicit_layout(op: str, name: str, arg, spec: P, mesh: Mesh) -> None:
    """On Explicit mesh axes, an argument's sharding is part of its type: it must match."""
    explicit = {
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    }
    if not explicit:
        return
    sharding = getattr(jax.typeof(arg), "sharding", None)
    got = getattr(sharding, "spec", P())
    ndim = len(arg.shape)

    def explicit_only(s):
        return tuple(tuple(a for a in e if a in explicit) for e in normalized_spec(s, ndim))

    if explicit_only(got) != explicit_only(spec):
        raise ValueError(
            f"{op}: {name} is laid out as {got} but this layer needs {spec} on the Explicit "
            f"mesh {dict(mesh.shape)}. Reshard it deliberately with "
            f"jax.sharding.reshard({name}, {spec}) (or place it with jax.device_put and "
            f"NamedSharding(mesh, {spec})), or use a mesh with Auto axes to let XLA move it."
        )
