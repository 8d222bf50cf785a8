"""Global-norm gradient clipping that is right under any sharding.

``optax.clip_by_global_norm`` inside ``jax.shard_map`` computes each device's norm of the shards
it holds: under FSDP (and any split of a parameter) every device then clips by a different, too
small norm. Here each leaf's squared sum is reduced over exactly the mesh axes its gradient is
split over, read from its ``check_vma`` type (``varying_axes``): a gradient split over ``data``
(FSDP, ZeRO-1's shards) or ``model`` (tensor parallelism) varies over that axis, a replicated
one does not (autodiff has already summed it). Leaves that vary over the same axes are summed
locally first, so each distinct set of axes costs one AllReduce of one float32 scalar:

    ‖g‖² = Σ_axes-sets psum(Σ_{leaves varying over them} Σ g², axes)

Outside ``shard_map`` (one device, or a jitted program under GSPMD) nothing varies, and the
result is ``optax.clip_by_global_norm``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from shardops._mesh import varying_axes
from shardops.comm._collectives import all_reduce
from shardops.comm._reasons import Reason

_SQUARES = Reason("global_norm", forward={
    "psum": "each device holds the gradients' shards split over {axis}: their squared sums are "
            "added for the global norm",
})  # fmt: skip


def global_norm(tree) -> jax.Array:
    """The L2 norm (float32) of every leaf of ``tree`` together, over the whole global arrays:
    inside ``jax.shard_map`` each leaf's squared sum is AllReduced over the mesh axes it varies
    over (one AllReduce of a scalar per distinct set of axes)."""
    by_axes: dict[tuple[str, ...], jax.Array] = {}
    for leaf in jax.tree.leaves(tree):
        axes = tuple(sorted(varying_axes(leaf)))
        squares = jnp.sum(jnp.square(leaf.astype(jnp.float32)))  # this device's block
        by_axes[axes] = by_axes.get(axes, 0.0) + squares
    total = jnp.float32(0.0)
    for axes, squares in by_axes.items():
        if axes:
            squares = all_reduce(squares, axes, reason=_SQUARES)  # the whole arrays' Σ g²
        total = total + squares
    return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm(max_norm)`` with the norm of the global gradients
    (``global_norm``): every device scales its shards by the same ``min(1, max_norm / ‖g‖)``.

    Use it as any optax transform, e.g. in ``shardops_models.build(..., optimizer=
    optax.chain(shardops.clip_by_global_norm(1.0), optax.adamw(3e-4)))``.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be a positive number; got "
                         f"{max_norm!r}")  # fmt: skip

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        trigger = norm < max_norm  # optax's own formula: unchanged below max_norm, else scaled

        def clip(t):
            return lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


__all__ = ["clip_by_global_norm", "global_norm"]
