"""Which layer order a setup's arrays are in, so that params stored in one setup's order never
run silently in another's.

A circular pipeline (``Strategy(pp_schedule="circular")``) stores each stacked leaf ``[L, …]``
with its rows permuted (``Padding.order``: stage s's chunks s, s + P, … as one block), with the
model's shapes. Given raw to a setup that stores the layers in the model's order (or another
circular one), such params have the right tree, shapes and shardings, and would run the layers
in another order without an error. So every array a setup hands out (``init``, ``shard``, the
steps, a checkpoint's or a Hugging Face checkpoint's restore) is marked with its setup's order
(weakly: the mark goes with the array), and every setup entry point refuses arrays marked with
another order. Host (numpy) arrays carry no order at all: a setup that stores a permuted order
refuses them (they are most likely ``gather``'s copies, in the model's order), and takes them
only through ``shard``. Device arrays made elsewhere (a user's own ``jax.tree.map``) carry no
mark and are taken as they are.
"""

from __future__ import annotations

import weakref

import jax
import numpy as np

_MARKS: dict[int, tuple[weakref.ref, tuple | None]] = {}
"""``id(array)`` → (a weak reference to it, the layer order its setup stores; None: the
model's)."""


def order_key(order: dict) -> tuple | None:
    """The layer order of a setup's ``Padding.order`` (None: the model's order, unpermuted)."""
    return tuple(sorted(order.items())) or None


def mark(tree, order: tuple | None):
    """Mark every concrete array of ``tree`` as stored in ``order`` (``order_key``); returns
    ``tree``."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            key = id(leaf)
            _MARKS[key] = (weakref.ref(leaf, lambda _, key=key: _MARKS.pop(key, None)), order)
    return tree


def check(tree, order: tuple | None, what: str, fix: str) -> None:
    """A ``ValueError`` if an array of ``tree`` is marked with a layer order other than
    ``order`` (a circular setup's stored order given to another setup, or the reverse), or,
    where ``order`` permutes the layers, if a permuted leaf is a host array (no order known)."""
    if order is not None:
        permuted = [path for path, _ in order]  # keystr of the params' paths
        host = [k for k, leaf in jax.tree_util.tree_leaves_with_path(tree)
                if isinstance(leaf, np.ndarray)  # (a TrainState's paths end in the params')
                and any(jax.tree_util.keystr(k).endswith(p) for p in permuted)]  # fmt: skip
        if host:
            raise ValueError(
                f"{what}: {jax.tree_util.keystr(host[0])} is a host array, whose layer order "
                f"is unknown, but this setup stores it in {_describe(order)}; host params are "
                f"in the model's order (setup.gather's copies): place them with "
                f"setup.shard(params)"
            )
    if not _MARKS:
        return
    for i, leaf in enumerate(jax.tree.leaves(tree)):
        found = _MARKS.get(id(leaf))
        if found is None or found[0]() is not leaf or found[1] == order:
            continue
        path = jax.tree_util.keystr(jax.tree_util.tree_leaves_with_path(tree)[i][0])
        raise ValueError(
            f"{what}: these arrays ({path} among them) come from a setup that stores the "
            f"stacked layers in {_describe(found[1])}, but this setup stores them in "
            f"{_describe(order)}: its layers would run in another order. {fix}"
        )


def _describe(order: tuple | None) -> str:
    if order is None:
        return "the model's layer order"
    path, rows = order[0]
    return (f"a circular pipeline's stored order (the stacked layers' rows permuted: {path} row "
            f"r holds layer {list(rows)}[r])")  # fmt: skip


CONVERT = ("Convert between setups through the model's order: params = "
           "setup_it_came_from.gather(state).params, then setup.shard(params)")  # fmt: skip
"""The fix every refusal names."""
