"""The attention masks of the einsum reference: which keys each query may attend to (causal,
and within its segment for packed sequences). The blocked core (``_flash``) builds its own per
key block."""

from __future__ import annotations

import jax.numpy as jnp


def visible(seq: int, causal: bool, segment_ids):
    """``visible[B or 1, 1, S_query, S_key]``: the keys each query may attend to, or None."""
    visible = None
    if causal:
        visible = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]  # [S, S]: key j ≤ query i
        visible = visible[None, None]
    if segment_ids is not None:
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # [B, 1, S, S]
        visible = same if visible is None else same & visible
    return visible
