"""Collective matmul under a precision policy: the dense kernels' ``collective_matmul`` option.

The rings of ``_collective_matmul`` (``all_gather_map``, ``map_reduce_scatter``) run with the
policy's block products, ``_dot(..., compute, accum)``, and a hand-written backward pass
(``jax.custom_vjp``) that keeps ``_precision``'s discipline: autodiff of the loop would sum
``dx`` in bfloat16 (the transpose of a bf16 ``ppermute``) and build ``dw`` from N rounded pieces.

| function                 | forward (N − 1 permutes per direction)          | backward                                  |
|--------------------------|-------------------------------------------------|-------------------------------------------|
| ``all_gather_dense``     | ``x``'s blocks travel in ``x``'s dtype, each    | ``dx``: ring ReduceScatter of ``g · wᵀ``  |
|                          | multiplied on arrival, ``y`` in accum           | in accum, cast once; ``dw = xᵀ · g`` local |
| ``dense_reduce_scatter`` | partial sums of ``y`` travel in accum           | ring AllGather of ``g`` in accum, ``dx``  |
|                          |                                                 | per block; ``dw = xᵀ · g`` local          |
| ``dense_all_reduce``     | ``dense_reduce_scatter``'s ring, then the       | none: ``g`` is replicated, ``dx`` and     |
|                          | builtin AllGather (invariant output, as psum's) | ``dw`` local                              |

``dw`` is always one product over the full contraction (the gathered ``x`` is the forward's
residual, collected by the ring itself), accumulated in ``accum_dtype`` and cast to ``w``'s dtype
once. Cotangents that vary over mesh axes their primal does not (``w`` replicated over a data
axis) are reduced there in ``accum_dtype``, as ``_precision.matmul`` does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import numpy as np
from jax import lax

from shardops._precision import Precision, _dot, _matmul_bwd, _reduce_to
from shardops.comm import _collective_matmul
from shardops.comm._mappings import gather_from_region

COLLECTIVE_MATMULS = (None, "ring", "bidirectional")


def check_collective_matmul(collective_matmul, op: str) -> None:
    """Raise ``ValueError`` unless ``collective_matmul`` is one of ``COLLECTIVE_MATMULS``."""
    if collective_matmul not in COLLECTIVE_MATMULS or isinstance(collective_matmul, bool):
        raise ValueError(
            f"{op}: collective_matmul must be one of {COLLECTIVE_MATMULS}; got "
            f"{collective_matmul!r}. None uses the builtin collective, 'ring' a ring of "
            f"collective-permutes overlapped with the matmul, 'bidirectional' one each way."
        )


class _Ring(NamedTuple):
    """The static half of a ring dense: mesh axis, ring dim, direction(s) and dtypes."""

    axis_name: str
    dim: int
    bidirectional: bool
    compute: np.dtype
    accum: np.dtype
    precision: lax.Precision

    def dot(self, a, b, contract):
        """``a · b`` contracting ``contract``: operands in compute dtype, result in accum."""
        return _dot(a, b, contract, self.compute, self.accum, self.precision)


def _ring_setup(axis_name, dim, bidirectional, precision: Precision) -> _Ring:
    compute, accum = precision.compute_dtype, precision.accum_dtype
    return _Ring(axis_name, dim, bidirectional, compute, accum, precision.matmul_precision)


def _kind(a):
    """An empty slice of ``a``: carries its dtype and varying mesh axes into the backward pass."""
    return a.reshape(-1)[:0]


# --- AllGather(x) · w


def all_gather_dense(x, w, axis_name: str, *, axis: int, bidirectional: bool, precision: Precision):
    """``precision.matmul(AllGather(x), w)`` by a ring: ``x[.., S_X, .., D] · w[D, F] → y[.., S, .., F]``.

    Arguments (local blocks, N = size of ``axis_name``):
        x: ``x[.., S/N, .., D]`` split along ``axis`` (a leading dim), in any float dtype; its
            blocks travel the ring in that dtype (bfloat16 moves half the bytes of float32).
        w: ``w[D, F]`` (a column-parallel shard ``w[D, F/N]``).

    Returns ``y[.., S, .., F]`` in ``accum_dtype``.

    Communication over ``axis_name``: forward N − 1 collective-permutes of ``x``'s block per
    direction, (N − 1)/N of the gathered ``x``: the builtin AllGather's bytes. Backward: a ring
    ReduceScatter of ``dx[.., S, .., D]{U_X}`` in ``accum_dtype`` (the builtin's bytes), cast to
    ``x``'s dtype once; ``dw`` local.
    """
    return _all_gather_dense(_ring_setup(axis_name, axis, bidirectional, precision), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _all_gather_dense(ring: _Ring, x, w):
    return _all_gather_dense_fwd(ring, x, w)[0]


def _all_gather_dense_fwd(ring: _Ring, x, w):
    w_c = w.astype(ring.compute)  # w[D, F] in compute

    def product(x_block):  # x_block[.., m, .., D] in x's dtype, as it arrived
        x_c = x_block.astype(ring.compute)
        y_block = ring.dot(x_c, w_c, ((x_c.ndim - 1,), (0,)))  # y_block[.., m, .., F] in accum
        return y_block, x_c  # x_c kept for dw

    y, x_c = _collective_matmul.all_gather_map(  # y[.., S, .., F], x_c[.., S, .., D]
        x, product, ring.axis_name, axis=ring.dim, bidirectional=ring.bidirectional, op=_AG
    )
    return y, (x_c, w_c, _kind(x), _kind(w))


def _all_gather_dense_bwd(ring: _Ring, residuals, g):
    x_c, w_c, x_kind, w_kind = residuals  # x_c[.., S, .., D] gathered, w_c[D, F]
    g = g.astype(ring.accum)  # g[.., S, .., F]
    lead = tuple(range(x_c.ndim - 1))

    def product(g_rows):  # g_rows[.., m, .., F] → dx partial[.., m, .., D] in accum
        return ring.dot(g_rows, w_c, ((g_rows.ndim - 1,), (1,)))

    dx = _collective_matmul.map_reduce_scatter(  # dx[.., S/N, .., D], summed in accum
        g,
        product,
        ring.axis_name,
        scatter_dimension=ring.dim,
        bidirectional=ring.bidirectional,
        op=_AG,
    )
    dw = ring.dot(x_c, g, (lead, lead))  # dw[D, F] in accum: one product, all of S
    dx, dw = _reduce_to(dx, x_kind), _reduce_to(dw, w_kind)
    return dx.astype(x_kind.dtype), dw.astype(w_kind.dtype)


_all_gather_dense.defvjp(_all_gather_dense_fwd, _all_gather_dense_bwd)


# --- ReduceScatter(x · w)


def dense_reduce_scatter(
    x, w, axis_name: str, *, scatter_dimension: int, bidirectional: bool, precision: Precision
):
    """``psum_scatter(precision.matmul(x, w))`` by a ring: ``x[.., S, .., F_X] · w[F_X, D] →
    y[.., S_X, .., D]``.

    Arguments (local blocks, N = size of ``axis_name``):
        x: ``x[.., S, .., F/N]``, S along ``scatter_dimension`` (a leading dim) divisible by N.
        w: the row-parallel shard ``w[F/N, D]``.

    Returns ``y[.., S/N, .., D]`` in ``accum_dtype``.

    Communication over ``axis_name``: forward N − 1 collective-permutes of one block of partial
    sums per direction, in ``accum_dtype``: the builtin ReduceScatter's bytes. Backward: a ring
    AllGather of ``dy`` in ``accum_dtype``, ``dx`` computed block by block as ``dy`` arrives;
    ``dw`` local, one product over the gathered ``dy``.
    """
    ring = _ring_setup(axis_name, scatter_dimension, bidirectional, precision)
    return _dense_reduce_scatter(ring, x, w)


def _reduce_scatter_ring(ring: _Ring, x_c, w_c):
    """The forward ring: ``y[.., S/N, .., D]`` in accum, partial sums travelling in accum."""

    def product(x_rows):  # x_rows[.., m, .., F/N] → y partial[.., m, .., D] in accum
        return ring.dot(x_rows, w_c, ((x_rows.ndim - 1,), (0,)))

    return _collective_matmul.map_reduce_scatter(
        x_c,
        product,
        ring.axis_name,
        scatter_dimension=ring.dim,
        bidirectional=ring.bidirectional,
        op=_RS,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense_reduce_scatter(ring: _Ring, x, w):
    return _dense_reduce_scatter_fwd(ring, x, w)[0]


def _dense_reduce_scatter_fwd(ring: _Ring, x, w):
    x_c, w_c = x.astype(ring.compute), w.astype(ring.compute)  # x[.., S, .., F/N], w[F/N, D]
    y = _reduce_scatter_ring(ring, x_c, w_c)  # y[.., S/N, .., D] in accum
    return y, (x_c, w_c, _kind(x), _kind(w))


def _dense_reduce_scatter_bwd(ring: _Ring, residuals, g):
    x_c, w_c, x_kind, w_kind = residuals  # x_c[.., S, .., F/N], w_c[F/N, D]
    lead = tuple(range(x_c.ndim - 1))

    def product(g_block):  # g_block[.., m, .., D] in accum, as it arrived
        dx_block = ring.dot(g_block, w_c, ((g_block.ndim - 1,), (1,)))  # [.., m, .., F/N]
        return dx_block, g_block  # g_block kept for dw

    dx, g_full = _collective_matmul.all_gather_map(  # dx[.., S, .., F/N], g_full[.., S, .., D]
        g.astype(ring.accum),
        product,
        ring.axis_name,
        axis=ring.dim,
        bidirectional=ring.bidirectional,
        op=_RS,
    )
    dw = ring.dot(x_c, g_full, (lead, lead))  # dw[F/N, D] in accum: one product, all of S
    dx, dw = _reduce_to(dx, x_kind), _reduce_to(dw, w_kind)
    return dx.astype(x_kind.dtype), dw.astype(w_kind.dtype)


_dense_reduce_scatter.defvjp(_dense_reduce_scatter_fwd, _dense_reduce_scatter_bwd)


# --- AllReduce(x · w) = AllGather(ReduceScatter(x · w))


def dense_all_reduce(
    x, w, axis_name: str, *, scatter_dimension: int, bidirectional: bool, precision: Precision
):
    """``psum(precision.matmul(x, w))`` as a ReduceScatter ring then the builtin AllGather:
    ``x[.., S, .., F_X] · w[F_X, D] → y[.., S, .., D]``, invariant over ``axis_name`` (as
    ``psum``'s output is).

    Arguments: as ``dense_reduce_scatter``; the ring splits ``y`` along ``scatter_dimension``.

    Returns ``y[.., S, .., D]`` in ``accum_dtype``.

    Communication over ``axis_name``: forward N − 1 collective-permutes of partial sums per
    direction (the ReduceScatter half of the AllReduce, hidden behind the matmul), then an
    AllGather, both in ``accum_dtype``: together the builtin AllReduce's 2V(N − 1)/N. Backward:
    none, as for ``psum`` (``dy`` is replicated, so ``dx`` and ``dw`` are local products).
    """
    ring = _ring_setup(axis_name, scatter_dimension, bidirectional, precision)
    return _dense_all_reduce(ring, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense_all_reduce(ring: _Ring, x, w):
    return _dense_all_reduce_fwd(ring, x, w)[0]


def _dense_all_reduce_fwd(ring: _Ring, x, w):
    x_c, w_c = x.astype(ring.compute), w.astype(ring.compute)  # x[.., S, .., F/N], w[F/N, D]
    y_block = _reduce_scatter_ring(ring, x_c, w_c)  # y[.., S/N, .., D] in accum
    # the caller's reason explains it (row_parallel_dense: collective matmul's psum)
    y = gather_from_region(y_block, ring.axis_name, ring.dim)
    return y, (x_c, w_c, _kind(x), _kind(w))  # y[.., S, .., D], replicated over the axis


def _dense_all_reduce_bwd(ring: _Ring, residuals, g):
    # g[.., S, .., D] is replicated, as psum's cotangent: the local products of precision.matmul.
    return _matmul_bwd(ring.compute, ring.accum, ring.precision, residuals, g)


_dense_all_reduce.defvjp(_dense_all_reduce_fwd, _dense_all_reduce_bwd)

_AG, _RS = "all_gather_dense", "dense_reduce_scatter"
