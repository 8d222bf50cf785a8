"""Ring collectives built from ``lax.ppermute``: all-gather, reduce-scatter and all-reduce.

Per-device kernels for use inside ``jax.shard_map``, equal to ``lax.all_gather(tiled=True)``,
``lax.psum_scatter(tiled=True)`` and ``lax.psum`` over one mesh axis of N devices. They are the
building blocks of collective matmul (communication a step at a time, so each step's transfer
can overlap a block of compute), and they spell out what the builtins hide.

Notation (scaling book): a block ``A[I_X]`` of V/N bytes per device. One ring step sends one
block to the next device, ``i → i + 1``:

- **all-gather** ``A[I_X] → A[I]``: N − 1 steps. After step s, device i holds the block of
  device i − s and writes it in place. Sent per device: (N − 1) · V/N.
- **reduce-scatter** ``A[I]{U_X} → A[I_X]``: N − 1 steps. The partial sum of block j starts at
  device j + 1 and travels the ring, each device adding its own block j; after N − 1 hops it
  arrives, complete, at device j. Sent per device: (N − 1) · V/N.
- **all-reduce** = reduce-scatter then all-gather, over the flattened array (padded to split):
  2 (N − 1) · V/N, the ring all-reduce's bytes.

``bidirectional=True`` splits every block into two halves and sends one half each way round
the ring (``i → i + 1`` and ``i → i − 1``) at each step: the same bytes over both directions
of every link, so each step moves half as much per direction.

Gradients: ``ppermute``'s transpose is the reverse permutation, so autodiff gives the ring
reduce-scatter as the gradient of the ring all-gather and vice versa, with no extra collective.
With ``check_vma`` the results are typed varying over the axis (like ``lax.all_gather``'s);
where ``lax.psum`` would give an invariant value, the ring all-reduce's is varying.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def ring_pairs(n: int, shift: int) -> list[tuple[int, int]]:
    """``lax.ppermute``'s ``perm`` for one ring step over ``n`` devices: ``i → i + shift``."""
    return [(i, (i + shift) % n) for i in range(n)]


def _halves(flat: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``flat[N, K]`` → two ``[N, ⌈K/2⌉]`` halves (the second zero-padded when K is odd)."""
    k = flat.shape[1]
    pad = k % 2
    if pad:
        flat = jnp.pad(flat, ((0, 0), (0, pad)))
    return flat[:, : flat.shape[1] // 2], flat[:, flat.shape[1] // 2 :]


def _gather_blocks(block: jax.Array, axis_name: str, shift: int) -> jax.Array:
    """``block[K]`` of every device along the ring → ``[N, K]`` in device order."""
    n = lax.axis_size(axis_name)
    i = lax.axis_index(axis_name)
    out = jnp.zeros((n, *block.shape), block.dtype)
    out = lax.dynamic_update_index_in_dim(out, block, i, 0)
    for s in range(1, n):
        block = lax.ppermute(block, axis_name, ring_pairs(lax.axis_size(axis_name), shift))
        # After s steps of i → i + shift, device i holds the block of device i − s·shift.
        out = lax.dynamic_update_index_in_dim(out, block, (i - s * shift) % n, 0)
    return out


def _reduce_blocks(blocks: jax.Array, axis_name: str, shift: int) -> jax.Array:
    """``blocks[N, K]`` (block j of this device's addend) → the sum over devices of block i."""
    n = lax.axis_size(axis_name)
    i = lax.axis_index(axis_name)

    def block(j):
        return lax.dynamic_index_in_dim(blocks, j % n, 0, keepdims=False)

    # The partial sum of block j starts at device j + shift and moves by +shift each step.
    acc = block(i - shift)
    for s in range(1, n):
        acc = lax.ppermute(acc, axis_name, ring_pairs(lax.axis_size(axis_name), shift))
        acc = acc + block(i - (s + 1) * shift)
    return acc


def _check_axis(x: jax.Array, axis: int, name: str) -> int:
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{name}={axis} is out of range for an array of rank {x.ndim}")
    return axis % x.ndim


def ring_all_gather(x: jax.Array, axis_name: str, *, axis: int = 0,
                    bidirectional: bool = False) -> jax.Array:  # fmt: skip
    """``lax.all_gather(x, axis_name, axis=axis, tiled=True)`` by N − 1 ring steps.

    ``x[..., D_X, ...]`` (this device's block along ``axis``) → ``[..., D, ...]``.
    """
    axis = _check_axis(x, axis, "axis")
    n = lax.axis_size(axis_name)
    moved = jnp.moveaxis(x, axis, 0)  # [D/N, ...]
    flat = moved.reshape(1, -1)  # [1, K]
    if bidirectional:
        first, second = _halves(flat)
        gathered = jnp.concatenate(
            [_gather_blocks(first[0], axis_name, +1), _gather_blocks(second[0], axis_name, -1)],
            axis=1,
        )  # [N, K + pad]
        gathered = gathered[:, : flat.shape[1]]
    else:
        gathered = _gather_blocks(flat[0], axis_name, +1)  # [N, K]
    out = gathered.reshape(n * moved.shape[0], *moved.shape[1:])  # [D, ...]
    return jnp.moveaxis(out, 0, axis)


def ring_reduce_scatter(x: jax.Array, axis_name: str, *, scatter_dimension: int = 0,
                        bidirectional: bool = False) -> jax.Array:  # fmt: skip
    """``lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=True)`` by N − 1 ring
    steps: ``x[..., D, ...]{U_X}`` → ``[..., D_X, ...]``, the sum over the axis of this
    device's block. ``D`` must divide by N."""
    dim = _check_axis(x, scatter_dimension, "scatter_dimension")
    n = lax.axis_size(axis_name)
    if x.shape[dim] % n:
        raise ValueError(
            f"ring_reduce_scatter: x dim {dim} = {x.shape[dim]} is not divisible by mesh axis "
            f"{axis_name!r} (size {n}); pad it to a multiple of {n}"
        )
    moved = jnp.moveaxis(x, dim, 0)  # [D, ...]
    block_shape = (moved.shape[0] // n, *moved.shape[1:])
    blocks = moved.reshape(n, -1)  # [N, K]
    if bidirectional:
        first, second = _halves(blocks)
        flat = jnp.concatenate(
            [_reduce_blocks(first, axis_name, +1), _reduce_blocks(second, axis_name, -1)]
        )[: blocks.shape[1]]
    else:
        flat = _reduce_blocks(blocks, axis_name, +1)  # [K]
    return jnp.moveaxis(flat.reshape(block_shape), 0, dim)


def ring_all_reduce(x: jax.Array, axis_name: str, *, bidirectional: bool = False) -> jax.Array:
    """``lax.psum(x, axis_name)`` as a ring reduce-scatter then a ring all-gather of the
    flattened ``x`` (zero-padded to split over the N devices): 2 (N − 1) steps."""
    n = lax.axis_size(axis_name)
    size = math.prod(x.shape)
    flat = x.reshape(-1)
    pad = -size % n
    if pad:
        flat = jnp.pad(flat, (0, pad))
    part = ring_reduce_scatter(flat, axis_name, bidirectional=bidirectional)
    whole = ring_all_gather(part, axis_name, bidirectional=bidirectional)
    return whole[:size].reshape(x.shape)
