"""Rotary position embeddings (RoPE) in Hugging Face's rotate-half convention, and the positions
they rotate by.

Dims ``d`` and ``d + hd/2`` of a head form a pair rotated by ``position · θ^(−2d/hd)``
(``shardops.layers._attention``'s module docstring says why this convention). Positions are each
token's *global* position; with packed sequences (``segment_ids``) they restart at 0 at each
document (``segment_positions``). Everything here is float32 and local: no communication.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np
from jax import lax


def segment_positions(segment_ids):
    """``positions[B, S]``: each token's position within its segment (a packed document: a run
    of equal ids), restarting at 0 where the id changes. ``segment_ids[B, S]`` integers."""
    segment_ids = jnp.asarray(segment_ids)
    seq = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]],
        axis=-1,
    )  # [B, S]: True where a segment begins
    first = lax.cummax(jnp.where(starts, index, 0), axis=segment_ids.ndim - 1)  # its start
    return index - first


def check_rope(op: str, rope_theta, head_dim: int) -> None:
    if rope_theta is None:
        return
    if (
        isinstance(rope_theta, bool)
        or not isinstance(rope_theta, numbers.Real)
        or not (rope_theta > 1)
    ):
        raise ValueError(f"{op}: rope_theta must be a number > 1 (e.g. 10000.0) or None; got "
                         f"{rope_theta!r}")  # fmt: skip
    if head_dim % 2:
        raise ValueError(
            f"{op}: rotary embeddings rotate pairs of dims (d, d + hd/2), so head_dim must be "
            f"even; got head_dim={head_dim}"
        )


def rotation(positions, seq: int, head_dim: int, theta: float):
    """``cos, sin[B or 1, 1, S, hd/2]`` in float32 of the angles ``position · θ^(−2d/hd)``.

    The frequencies are computed in float64 at trace time and rounded once to float32."""
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [hd/2]
    if positions is None:
        positions = jnp.arange(seq)[None]  # [1, S]
    angles = positions.astype(jnp.float32)[:, None, :, None] * freqs.astype(np.float32)
    return jnp.cos(angles), jnp.sin(angles)  # [B, 1, S, hd/2]


def rotate(t, cos, sin):
    """Hugging Face's ``t·cos + rotate_half(t)·sin`` on ``t[B, n, S, hd]`` in float32: the
    pairs are dims ``(d, d + hd/2)``."""
    half = t.shape[-1] // 2
    t1, t2 = t[..., :half], t[..., half:]
    return jnp.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1)
