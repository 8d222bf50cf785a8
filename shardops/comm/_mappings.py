"""Communication into and out of a model-parallel region, with the backward pass in the
accumulation dtype (Megatron's ``tensor_parallel/mappings.py``: one name per pattern, forward and
backward side by side).

A collective's transpose runs in the dtype of the value it was applied to. Applied to a bfloat16
activation, autodiff would reduce bfloat16 partial gradients. These helpers move the cast so that
every gradient reduction runs in ``accum_dtype`` (float32), while the forward pass moves no more
bytes than it must.

| helper                 | forward                                      | backward                           |
|------------------------|----------------------------------------------|------------------------------------|
| ``copy_to_region``     | cast to accum, ``pcast`` to varying (free)   | AllReduce ``dx`` in accum, cast back |
| ``gather_to_region``   | AllGather in the input's dtype, cast to accum | ReduceScatter ``dx`` in accum, cast back |
| ``gather_many_to_region`` | one AllGather of several arrays' blocks   | one ReduceScatter of their ``dx``  |
| ``reduce_from_region`` | AllReduce ``y{U_axis}`` → ``y``               | none (``dy`` is every device's)    |
| ``reduce_scatter_from_region`` | ReduceScatter ``y{U_axis}`` → ``y[D_axis]`` | AllGather ``dy``           |
| ``gather_from_region`` | AllGather ``y[F_axis]`` → ``y[F]`` (invariant) | none: each device slices its ``dy`` |

Leaving a region: the kernels reduce their partial sums (or gather their blocks) with these, in
the dtype the partials already have (the accumulation dtype), so every name a kernel calls says
its forward and backward communication.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardops.comm._reasons import Reason, because

_REPLICA_SHARDS = Reason("replica_gradient_shards", backward={
    "psum": "the weights are replicated over {axis} while the batch splits over it (HSDP): each "
            "replica's gradient shard is summed, after the reduce-scatter",
})  # fmt: skip

REPLICATED_INPUT = Reason("replicated_input", backward={
    "psum": "x is replicated over {axis} but each device multiplies it by its own block of the "
            "weights (its columns, its heads): the partial dx are summed (Megatron's f)",
})  # fmt: skip
"""Why ``copy_to_region``'s backward AllReduce runs in a column-parallel layer (dense, gated
MLP, FSDP's moving activations): every kernel that enters ``x`` into its region says this one."""

REPLICATED_GRADIENT = Reason("replicated_gradient", backward={
    "psum": "parameters replicated over {axis} meet activations split over {axis} (a batch or "
            "sequence shard): their gradients are summed (autodiff inserts this reduction)",
}, fallback=True)  # fmt: skip
"""Why ``shardops.precision``'s matmul sums a cotangent over the axes its primal is invariant
over (what autodiff does for ordinary ops): a fallback, so the kernel around it says why."""


def copy_to_region(x, axis_name, accum_dtype):
    """``x`` (replicated over ``axis_name``) as a varying ``accum_dtype`` value.

    Forward: no communication. Backward: AllReduce of ``dx{U_axis}`` over ``axis_name`` in
    ``accum_dtype`` (the transpose of ``pcast``), then one cast to ``x``'s dtype.
    """
    return lax.pcast(x.astype(accum_dtype), axis_name, to="varying")


def gather_to_region(x, axis_name, axis: int, accum_dtype, replicated_over=()):
    """AllGather ``x[.., N_axis, ..] → x[.., N, ..]`` along ``axis``, returned in ``accum_dtype``.

    Forward: AllGather in ``x``'s own dtype (bfloat16 moves half the bytes of float32).
    Backward: ReduceScatter of ``dx[.., N, ..]{U_axis}`` in ``accum_dtype``, then one cast.

    ``replicated_over``: mesh axes over which ``x`` is replicated while the batch splits (HSDP's
    replica axes). The gathered value is varying over them, and the backward AllReduces the
    gradient's *shard* over them after the ReduceScatter, in ``accum_dtype``: the small tensor
    crosses the replica axes, not the whole one.
    """
    axis = _dim("gather_to_region", "x", x, axis, "axis")
    return _gather(axis_name, axis, np.dtype(accum_dtype), tuple(replicated_over), x)


def _dim(op: str, argument: str, x, dim, name: str, axis_name: str | None = None) -> int:
    """``dim`` of ``x`` as a non-negative index (a negative one counts from the end), else a
    ValueError naming ``op``, the argument, its shape and the valid range; with ``axis_name``
    (a scatter along ``dim``), also the size the mesh axis must divide."""
    ndim = np.ndim(x)
    if not isinstance(dim, int | np.integer) or not -ndim <= dim < ndim:
        raise ValueError(
            f"{op}: {name}={dim!r} is not a dim of {argument} of shape {tuple(np.shape(x))} "
            f"({ndim} dims); pass an integer in [{-ndim}, {ndim})"
        )
    dim = int(dim) % ndim
    if axis_name is not None:
        n, size = lax.axis_size(axis_name), np.shape(x)[dim]
        if size % n:
            raise ValueError(
                f"{op}: {argument} dim {dim} = {size} is not divisible by mesh axis "
                f"{axis_name!r} (size {n}), so it cannot be scattered over it; pad that dim to a "
                f"multiple of {n} or scatter another"
            )
    return dim


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gather(axis_name, axis, accum_dtype, replicated_over, x):
    if replicated_over:
        x = lax.pcast(x, replicated_over, to="varying")  # free: a type, not a move
    return lax.all_gather(x, axis_name, axis=axis, tiled=True).astype(accum_dtype)


def _gather_fwd(axis_name, axis, accum_dtype, replicated_over, x):
    out = _gather(axis_name, axis, accum_dtype, replicated_over, x)
    return out, x.reshape(-1)[:0]  # carries x's dtype


def _gather_bwd(axis_name, axis, accum_dtype, replicated_over, x_kind, g):
    dx = lax.psum_scatter(g.astype(accum_dtype), axis_name, scatter_dimension=axis, tiled=True)
    if replicated_over:
        with because(_REPLICA_SHARDS, replicated_over):
            dx = lax.psum(dx, replicated_over)  # the shard's AllReduce over the replicas
    return (dx.astype(x_kind.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather_many_to_region(xs, axis_name, axes, accum_dtype, replicated_over=()):
    """``gather_to_region`` of several arrays in one AllGather (and one ReduceScatter back).

    ``xs[i]`` is split over ``axis_name`` along ``axes[i]``; all share one dtype and the same
    varying mesh axes. Their local blocks are flattened into one buffer ``flat[Σ|x_i|]``, which
    is AllGathered once (``[N, Σ|x_i|]``) and cut back into each ``x_i[.., N·n_i, ..]`` in
    ``accum_dtype``. The backward pass concatenates the cotangents the same way and
    ReduceScatters them in ``accum_dtype`` in one collective. The bytes are those of the
    separate gathers; the count of collectives (each a rendezvous of every device on the
    axis) drops to one, as FSDP's flat parameters do. ``replicated_over`` as for
    ``gather_to_region``: one AllReduce of the flat gradient shard over those axes.
    """
    xs = tuple(xs)
    if len({np.dtype(x.dtype) for x in xs}) > 1:
        raise ValueError(
            f"gather_many_to_region: every array must have one dtype; got "
            f"{sorted({np.dtype(x.dtype).name for x in xs})}"
        )
    return _gather_many(axis_name, tuple(axes), np.dtype(accum_dtype), tuple(replicated_over), xs)


def _pieces(flat, shapes, axes, n: int):
    """``flat[N, Σ|x_i|]`` → each ``x_i`` gathered along its axis: ``[.., N·n_i, ..]``."""
    out, start = [], 0
    for shape, axis in zip(shapes, axes, strict=True):
        size = int(np.prod(shape))
        block = flat[:, start : start + size].reshape(n, *shape)  # [N, ..., n_i, ...]
        block = jnp.moveaxis(block, 0, axis)  # [..., N, n_i, ...]
        whole = list(shape)
        whole[axis] *= n
        out.append(block.reshape(whole))
        start += size
    return out


def _blocks(gs, axes, n: int):
    """The inverse of ``_pieces``: each ``g_i[.., N·n_i, ..]`` → ``[N, Σ|x_i|]``."""
    rows = []
    for g, axis in zip(gs, axes, strict=True):
        shape = list(g.shape)
        shape[axis : axis + 1] = [n, g.shape[axis] // n]
        rows.append(jnp.moveaxis(g.reshape(shape), axis, 0).reshape(n, -1))
    return jnp.concatenate(rows, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gather_many(axis_name, axes, accum_dtype, replicated_over, xs):
    n = lax.axis_size(axis_name)
    flat = jnp.concatenate([x.reshape(-1) for x in xs])  # this device's blocks, in x's dtype
    if replicated_over:
        flat = lax.pcast(flat, replicated_over, to="varying")
    gathered = lax.all_gather(flat, axis_name, axis=0)  # [N, Σ|x_i|]
    pieces = _pieces(gathered, [x.shape for x in xs], axes, n)
    return tuple(piece.astype(accum_dtype) for piece in pieces)


def _gather_many_fwd(axis_name, axes, accum_dtype, replicated_over, xs):
    kinds = tuple(x.reshape(-1)[:0] for x in xs)  # carry each x's dtype and shape-free type
    out = _gather_many(axis_name, axes, accum_dtype, replicated_over, xs)
    return out, (kinds, tuple(x.shape for x in xs))


def _gather_many_bwd(axis_name, axes, accum_dtype, replicated_over, residuals, gs):
    kinds, shapes = residuals
    n = lax.axis_size(axis_name)
    flat = _blocks([g.astype(accum_dtype) for g in gs], axes, n)  # [N, Σ|x_i|] in accum
    mine = lax.psum_scatter(flat, axis_name, scatter_dimension=0)  # [Σ|x_i|]: this device's
    if replicated_over:
        with because(_REPLICA_SHARDS, replicated_over):
            mine = lax.psum(mine, replicated_over)
    out, start = [], 0
    for kind, shape in zip(kinds, shapes, strict=True):
        size = int(np.prod(shape))
        out.append(mine[start : start + size].reshape(shape).astype(kind.dtype))
        start += size
    return (tuple(out),)


_gather_many.defvjp(_gather_many_fwd, _gather_many_bwd)


def reduce_from_region(y_partial, axis_name: str):
    """``y{U_axis}`` (this device's partial sum) → ``y``, replicated over ``axis_name``.

    Forward: AllReduce (``lax.psum``) over ``axis_name``, in ``y_partial``'s dtype. Backward: no
    communication; under ``check_vma`` the cotangent of the invariant ``y`` reaches each
    device's partial as it is.
    """
    return lax.psum(y_partial, axis_name)


def reduce_scatter_from_region(y_partial, axis_name: str, dim: int):
    """``y{U_axis}`` → ``y`` split along ``dim`` over ``axis_name`` (``y[.., D_axis, ..]``).

    Forward: ReduceScatter (``lax.psum_scatter``, tiled) in ``y_partial``'s dtype. Backward:
    AllGather of ``dy`` along ``dim``.
    """
    dim = _dim("reduce_scatter_from_region", "y_partial", y_partial, dim, "dim", axis_name)
    return lax.psum_scatter(y_partial, axis_name, scatter_dimension=dim, tiled=True)


def gather_from_region(y_block, axis_name: str, axis: int):
    """``y[.., F_axis]`` (this device's block along ``axis``) → ``y[.., F]``, invariant over
    ``axis_name``.

    Forward: AllGather along ``axis``. Backward: no communication; the cotangent is replicated,
    so the transpose is each device's slice of it.
    """
    axis = _dim("gather_from_region", "y_block", y_block, axis, "axis")
    return lax.all_gather(y_block, axis_name, axis=axis, tiled=True, to="invarying")
