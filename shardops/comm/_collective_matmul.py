"""Collective matmul: a ring of ``ppermute`` steps, one block of matmul per step.

Per-device kernels for ``jax.shard_map`` (as in the JAX shard_map documentation's collective
matmul and the scaling book's "overlapping communication"). Each step starts the transfer of
the next block and multiplies the block it holds, so that on hardware with asynchronous
collectives the transfer hides behind the matmul; the result equals the unfused form.

- ``all_gather_matmul``: ``AllGather(x[.., S_X, .., K]) · w[K, F] → y[.., S, .., F]``, the
  sequence-parallel input of a column-parallel layer. N matmuls of one block, N − 1 steps
  sending ``x``'s block (V/N bytes each).
- ``matmul_reduce_scatter``: ``ReduceScatter_S(x[.., S, .., K_X] · w[K_X, F]) →
  y[.., S_X, .., F]``, the row-parallel layer's output scattered along the sequence. The
  partial sum of row block j starts at device j + 1 and travels the ring, each device adding
  its own product for block j, computed just in time: N matmuls, N − 1 steps of one output
  block.

``bidirectional=True`` splits each block in two along the gathered (scattered) dimension and
runs one half each way round the ring: the same bytes over both directions of each link. The
block must then have an even size along that dimension.

Both rings are written once, over any block-wise ``fn`` (``all_gather_map``,
``map_reduce_scatter``); ``shardops.layers._collective_dense`` runs them with the precision policy's
products and its own backward pass.

Gradients come from autodiff of the loop: the transpose of a ``ppermute`` is the reverse one,
so the backward pass is again a ring (``dx`` of ``all_gather_matmul`` is a ring
reduce-scatter of ``dy · wᵀ``; ``dw`` is local). A test checks forward and gradients against
the unfused builtins bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from shardops.comm._ring import ring_pairs


def _check(x, dim: int, name: str, op: str) -> int:
    if not (-x.ndim <= dim < x.ndim and dim % x.ndim < x.ndim - 1):
        raise ValueError(
            f"{op}: {name}={dim} must name a leading dim of x (rank {x.ndim}; the last one is "
            f"the contraction)"
        )
    return dim % x.ndim


def _halves_ok(size: int, name: str, op: str) -> None:
    if size % 2:
        raise ValueError(
            f"{op}: bidirectional=True splits each block in two along {name}, but the block has "
            f"{size} rows there; use an even block or bidirectional=False"
        )


def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name: str, *, axis: int = 0,
                      bidirectional: bool = False) -> jax.Array:  # fmt: skip
    """``lax.all_gather(x, axis_name, axis=axis, tiled=True) @ w`` by a ring of N − 1 steps.

    Arguments (local blocks, N = size of ``axis_name``):
        x: ``x[.., S/N, .., K]``, split along ``axis`` (a leading dim).
        w: ``w[K, F]`` (e.g. a column-parallel weight shard ``w[K, F/N]``).

    Returns ``y[.., S, .., F]``.
    """
    return all_gather_map(x, lambda block: block @ w, axis_name, axis=axis,
                          bidirectional=bidirectional, op="all_gather_matmul")  # fmt: skip


def all_gather_map(x: jax.Array, fn, axis_name: str, *, axis: int = 0,
                   bidirectional: bool = False, op: str = "all_gather_map"):  # fmt: skip
    """``fn(lax.all_gather(x, axis_name, axis=axis, tiled=True))`` by a ring of N − 1 steps,
    for an ``fn`` that maps each row block along ``axis`` on its own (a matmul by a local
    ``w``, or the identity): each step applies it to the block that just arrived.

    Arguments (local blocks, N = size of ``axis_name``):
        x: ``x[.., S/N, .., K]``, split along ``axis`` (a leading dim); its blocks travel the
            ring in ``x``'s dtype.
        fn: ``block[.., m, .., K] → out[.., m, .., *]`` (an array or a tuple of arrays,
            each with the block's rows along ``axis``).

    Returns ``fn``'s output for the gathered ``x[.., S, .., K]``: ``out[.., S, .., *]``.
    """
    axis = _check(x, axis, "axis", op)
    n = lax.axis_size(axis_name)
    i = lax.axis_index(axis_name)
    m = x.shape[axis]
    out = None

    def put(out, value, start):
        """Write ``value`` (each leaf a block of rows) at row ``start`` of ``out[.., N·m, ..]``."""
        if out is None:
            out = jax.tree.map(
                lambda v: jnp.zeros((*v.shape[:axis], n * m, *v.shape[axis + 1 :]), v.dtype), value
            )
        return jax.tree.map(
            lambda o, v: lax.dynamic_update_slice_in_dim(o, v, start, axis), out, value
        )

    if not bidirectional:
        block = x
        for s in range(n):
            nxt = lax.ppermute(block, axis_name, ring_pairs(n, +1)) if s < n - 1 else None
            # After s steps of i → i + 1, device i holds the block of device i − s.
            start = ((i - s) % n) * m
            out = put(out, fn(block), start)
            block = nxt
        return out
    _halves_ok(m, f"axis {axis}", op)
    h = m // 2
    right = lax.slice_in_dim(x, 0, h, axis=axis)  # first halves travel i → i + 1
    left = lax.slice_in_dim(x, h, m, axis=axis)  # second halves travel i → i − 1
    for s in range(n):
        nxt_r = lax.ppermute(right, axis_name, ring_pairs(n, +1)) if s < n - 1 else None
        nxt_l = lax.ppermute(left, axis_name, ring_pairs(n, -1)) if s < n - 1 else None
        out = put(out, fn(right), ((i - s) % n) * m)
        out = put(out, fn(left), ((i + s) % n) * m + h)
        right, left = nxt_r, nxt_l
    return out


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis_name: str, *,
                          scatter_dimension: int = 0, bidirectional: bool = False
                          ) -> jax.Array:  # fmt: skip
    """``lax.psum_scatter(x @ w, axis_name, scatter_dimension=..., tiled=True)`` by a ring of
    N − 1 steps, each device computing its product for one output block per step.

    Arguments (local blocks, N = size of ``axis_name``):
        x: ``x[.., S, .., K/N]`` (e.g. a column-parallel layer's output), ``S`` along
            ``scatter_dimension`` (a leading dim) divisible by N.
        w: ``w[K/N, F]`` (a row-parallel weight shard).

    Returns ``y[.., S/N, .., F]``: this device's block of the sum over the axis.
    """

    def product(rows):
        return rows @ w

    return map_reduce_scatter(x, product, axis_name, scatter_dimension=scatter_dimension,
                              bidirectional=bidirectional, op="matmul_reduce_scatter")  # fmt: skip


def map_reduce_scatter(x: jax.Array, fn, axis_name: str, *, scatter_dimension: int = 0,
                       bidirectional: bool = False, op: str = "map_reduce_scatter"
                       ) -> jax.Array:  # fmt: skip
    """``lax.psum_scatter(fn(x), axis_name, scatter_dimension=..., tiled=True)`` by a ring
    of N − 1 steps, for an ``fn`` that maps each row block along ``scatter_dimension`` on its
    own; the partial sums travel and are summed in ``fn``'s output dtype.

    Arguments (local blocks, N = size of ``axis_name``):
        x: ``x[.., S, .., K]``, ``S`` along ``scatter_dimension`` (a leading dim) divisible by N.
        fn: ``rows[.., m, .., K] → y[.., m, .., F]``, this device's addend for those rows.

    Returns ``y[.., S/N, .., F]``: this device's block of the sum over the axis.
    """
    dim = _check(x, scatter_dimension, "scatter_dimension", op)
    n = lax.axis_size(axis_name)
    i = lax.axis_index(axis_name)
    if x.shape[dim] % n:
        raise ValueError(
            f"{op}: x dim {dim} = {x.shape[dim]} is not divisible by mesh axis {axis_name!r} "
            f"(size {n}); pad it to a multiple of {n}"
        )
    m = x.shape[dim] // n

    def product(j, lo: int, size: int):
        """This device's addend for rows ``[lo, lo + size)`` of output block ``j``."""
        return fn(lax.dynamic_slice_in_dim(x, (j % n) * m + lo, size, dim))

    def ring(lo: int, size: int, shift: int):
        # The partial sum of block j starts at device j + shift and moves by +shift each step.
        acc = product(i - shift, lo, size)
        for s in range(1, n):
            acc = lax.ppermute(acc, axis_name, ring_pairs(n, shift))
            acc = acc + product(i - (s + 1) * shift, lo, size)
        return acc

    if not bidirectional:
        return ring(0, m, +1)
    _halves_ok(m, f"scatter_dimension {dim}", op)
    h = m // 2
    return jnp.concatenate([ring(0, h, +1), ring(h, h, -1)], axis=dim)
