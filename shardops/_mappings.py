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
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax


def copy_to_region(x, axis_name: str, accum_dtype):
    """``x`` (replicated over ``axis_name``) as a varying ``accum_dtype`` value.

    Forward: no communication. Backward: AllReduce of ``dx{U_axis}`` over ``axis_name`` in
    ``accum_dtype`` (the transpose of ``pcast``), then one cast to ``x``'s dtype.
    """
    return lax.pcast(x.astype(accum_dtype), axis_name, to="varying")


def gather_to_region(x, axis_name: str, axis: int, accum_dtype):
    """AllGather ``x[.., N_axis, ..] → x[.., N, ..]`` along ``axis``, returned in ``accum_dtype``.

    Forward: AllGather in ``x``'s own dtype (bfloat16 moves half the bytes of float32).
    Backward: ReduceScatter of ``dx[.., N, ..]{U_axis}`` in ``accum_dtype``, then one cast.
    """
    return _gather(axis_name, axis, np.dtype(accum_dtype), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _gather(axis_name, axis, accum_dtype, x):
    return lax.all_gather(x, axis_name, axis=axis, tiled=True).astype(accum_dtype)


def _gather_fwd(axis_name, axis, accum_dtype, x):
    return _gather(axis_name, axis, accum_dtype, x), x.reshape(-1)[:0]  # carries x's dtype


def _gather_bwd(axis_name, axis, accum_dtype, x_kind, g):
    dx = lax.psum_scatter(g.astype(accum_dtype), axis_name, scatter_dimension=axis, tiled=True)
    return (dx.astype(x_kind.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)
