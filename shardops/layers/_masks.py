"""Which keys each query may attend to, for the einsum reference: causal (by the tokens' global
positions) and within its segment for packed sequences. The blocked core (``_flash``) builds
its own mask per key block."""

from __future__ import annotations


def visible(q_positions, k_positions, q_segments, k_segments, causal: bool):
    """``visible[B or 1, 1, Sq, Sk]``: key ``j`` visible to query ``i`` (same segment and, with
    ``causal``, ``k_positions[j] ≤ q_positions[i]``: global positions), or None (every key).
    ``q_positions[Sq]``, ``k_positions[Sk]`` integers; ``q_segments[B, Sq]``, ``k_segments[B,
    Sk]``: both or neither."""
    visible = None
    if causal:
        visible = (k_positions[None, :] <= q_positions[:, None])[None, None]  # [1, 1, Sq, Sk]
    if q_segments is not None:
        same = q_segments[:, None, :, None] == k_segments[:, None, None, :]  # [B, 1, Sq, Sk]
        visible = same if visible is None else same & visible
    return visible
