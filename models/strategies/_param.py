"""A parameter as a model's forward sees it inside the layer context (``Param``): its local
array, its plan role, its PartitionSpec and whether ``ctx.unit`` has made it ready."""

from __future__ import annotations

import jax

from shardops_models.strategies.plan import is_shape


@jax.tree_util.register_pytree_node_class
class Param:
    """One parameter as a model's forward sees it: the local array, its plan role and layout.

    ``ready`` is False until ``Parallel.unit`` has materialised it for the data axis; layers
    refuse a parameter that is not ready (a forward that skipped ``ctx.unit`` would compute
    with an FSDP shard)."""

    __slots__ = ("logical", "path", "pending", "ready", "role", "spec", "uses", "value")

    def __init__(self, value, role: str, spec, path: str, ready: bool = False, pending=None,
                 logical=None):  # fmt: skip
        self.value, self.role, self.spec, self.path, self.ready = value, role, spec, path, ready
        self.uses = 0
        """How many units of this forward have used it so far (not part of the pytree: each
        trace wraps fresh ``Param`` objects)."""
        self.pending = pending
        """The dim still split over ``data`` (a dense weight whose gather waits for the layer
        to choose its route, ``models.strategies.fsdp``), or None."""
        self.logical = logical
        """The model's own (global) shape: the stored one pads a dim the tp axis does not
        divide (``models.training``); the layers mask what lies beyond it."""

    def tree_flatten(self):
        aux = (self.role, self.spec, self.path, self.ready, self.pending, self.logical)
        return (self.value,), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def replace(self, **changes) -> Param:
        """A copy with some fields changed (``value``, ``ready``, ``pending``, …)."""
        fields = {k: getattr(self, k) for k in self.__slots__ if k != "uses"}
        return Param(**{**fields, **changes})

    @property
    def shape(self):
        return self.value.shape

    def __repr__(self):
        return f"Param({self.path}, role={self.role}, spec={self.spec}, shape={self.shape})"


def is_param(x) -> bool:
    return isinstance(x, Param)


def wrap(params, roles, specs, logical=None):
    """The parameter tree as ``Param`` leaves (not yet materialised); ``logical``: the model's
    own shapes (a tree of tuples) where they differ from the stored ones (padding)."""
    if logical is None:
        logical = jax.tree.map(lambda _: None, roles)

    def param(path, value, role, spec, shape):
        return Param(value, role, spec, jax.tree_util.keystr(path), logical=shape)

    return jax.tree_util.tree_map_with_path(
        param, params, roles, specs, logical, is_leaf=lambda x: x is None or is_shape(x)
    )


def values(tree):
    """The arrays of a tree of ``Param`` leaves."""
    return jax.tree.map(lambda p: p.value, tree, is_leaf=is_param)
