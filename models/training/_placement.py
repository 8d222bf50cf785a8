"""Where the arrays live: the model's shapes and the stored (padded) ones (``Padding``), the
optimizer state's specs, placing a full tree onto the mesh and gathering it back (across
processes too), and the checks that params (or a state) were laid out for this setup.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops import entry_axes
from shardops_models.strategies.plan import is_shape
from shardops_models.training._state import TrainState


def _is_spec(s) -> bool:
    return isinstance(s, P)


def _spec_leaves(specs):
    return jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))


def _layout_name(path) -> str:
    """``layer 0 w`` for the MLP's ``[0]['w']``; the key path otherwise."""
    keys = jax.tree_util.keystr(path)
    if len(path) == 2 and hasattr(path[0], "idx") and hasattr(path[1], "key"):
        return f"layer {path[0].idx} {path[1].key}"
    return keys


def opt_state_specs(optimizer: optax.GradientTransformation, padding: Padding, specs):
    """PartitionSpecs of ``optimizer``'s state: param-shaped leaves like the params, others P()."""
    state = jax.eval_shape(optimizer.init, padding.abstract(jnp.float32))
    return optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )


def shard_tree(tree, mesh: Mesh, specs):
    """Place a tree of full arrays on ``mesh`` with ``specs`` (a matching tree of PartitionSpecs)."""
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
    )
    return jax.device_put(tree, shardings)


def gather_tree(tree):
    """Full host copies (numpy) of a sharded tree: the inverse of ``shard_tree``, bit for bit.

    In a multi-process run every process calls it (it all-gathers what other processes hold)
    and every process gets the whole tree.
    """

    def get(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return multihost_utils.process_allgather(a, tiled=True)
        return a

    return jax.device_get(jax.tree.map(get, tree))


@functools.lru_cache(maxsize=64)
def _spans_processes(mesh: Mesh) -> bool:
    """Whether ``mesh`` has devices of other processes (a multi-process run)."""
    here = jax.process_index()
    return any(d.process_index != here for d in mesh.devices.flat)


@dataclasses.dataclass(frozen=True)
class Padding:
    """The model's parameter shapes (``logical``) and the stored ones (``stored``, trees of
    tuples): a dim split over the tp axis that its size does not divide (a vocabulary of 97 on
    4 devices, d_ff = 172 on 8) is stored padded with zeros up to a multiple of it
    (``shardops.padded_size``), and the layers are told the logical size, so the padding
    reaches no output, loss, metric or gradient (``models.strategies.parallel``). Budgets and
    memory count the stored bytes; ``Setup.gather`` and checkpoints see the logical shapes.

    ``order``: the leaves stored in another order along dim 0 (``{keystr(path): order}``,
    stored row r holds the model's row ``order[r]``): pp's circular chunks
    (``shardops.pipeline.stage_order``); ``pad`` and ``unpad`` permute them too."""

    logical: Any
    stored: Any
    order: dict = dataclasses.field(default_factory=dict)

    @property
    def padded(self) -> bool:
        """Whether any leaf is stored padded."""
        return jax.tree.leaves(self.logical, is_leaf=is_shape) != jax.tree.leaves(
            self.stored, is_leaf=is_shape)  # fmt: skip

    @property
    def converts(self) -> bool:
        """Whether any leaf is stored otherwise than the model holds it: padded or permuted."""
        return self.padded or bool(self.order)

    def _targets(self, shapes):
        """``shapes`` (``logical`` or ``stored``) as ``_Target`` leaves carrying each leaf's
        order."""
        return jax.tree_util.tree_map_with_path(
            lambda path, shape: _Target(tuple(shape), self.order.get(jax.tree_util.keystr(path))),
            shapes, is_leaf=is_shape,
        )  # fmt: skip

    def abstract(self, dtype):
        """The stored params as ``jax.ShapeDtypeStruct``s of ``dtype``."""
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), self.stored,
                            is_leaf=is_shape)  # fmt: skip

    def check_logical(self, params) -> None:
        """``params`` has the model's own tree and shapes (what ``model.init`` makes)."""
        want = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
            self.logical, is_leaf=is_shape)}  # fmt: skip
        got = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
        if want != got:
            raise ValueError(
                f"params are not the model's tree: missing {sorted(want - got)}, unknown "
                f"{sorted(got - want)} (pass what model.init makes)"
            )
        for (path, leaf), shape in zip(jax.tree_util.tree_leaves_with_path(params),
                                       jax.tree.leaves(self.logical, is_leaf=is_shape),
                                       strict=True):  # fmt: skip
            if tuple(leaf.shape) != shape:
                raise ValueError(f"params{jax.tree_util.keystr(path)} has shape "
                                 f"{tuple(leaf.shape)}; the model's is {shape} (pass the "
                                 f"model's own, unpadded parameters)")  # fmt: skip

    def check_stored(self, params, what: str, place: str) -> None:
        """``params`` has the stored tree and shapes (what ``Setup.shard(...).params`` holds),
        checked before ``shard_map`` sees them: a ``TrainState``, another model's params or
        this model's unpadded ones name the first leaf that differs and ``place``, the call
        that lays them out (``what``: the caller, for the message)."""
        if isinstance(params, TrainState):
            raise TypeError(f"{what}: params is a TrainState (params and optimizer state); "
                            f"pass state.params")  # fmt: skip
        paths = jax.tree_util.tree_leaves_with_path
        want = {jax.tree_util.keystr(p): s for p, s in paths(self.stored, is_leaf=is_shape)}
        got = {jax.tree_util.keystr(p): tuple(np.shape(a)) for p, a in paths(params)}
        if want.keys() != got.keys():
            missing, unknown = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
            raise ValueError(
                f"{what}: params are not this model's tree: missing {_first(missing)}, unknown "
                f"{_first(unknown)}. Pass the params of the model this was built for, laid out "
                f"by {place}"
            )
        logical = {jax.tree_util.keystr(p): s for p, s in paths(self.logical, is_leaf=is_shape)}
        for path, shape in want.items():
            if got[path] == shape:
                continue
            if got[path] == logical[path]:  # the model's own shape, not laid out
                raise ValueError(
                    f"{what}: params{path} has shape {got[path]}, the model's own; this layout "
                    f"stores it padded to {shape}. Lay the params out with {place}"
                )
            raise ValueError(
                f"{what}: params{path} has shape {got[path]}; this model's is {logical[path]} "
                f"(stored as {shape}): params of another model? Pass the params of the model "
                f"this was built for, laid out by {place}"
            )

    def pad(self, params):
        """Model-shaped leaves → stored ones, zero-padded and permuted (numpy in, numpy
        out)."""
        if not self.converts:
            return params
        return jax.tree.map(_pad_to, params, self._targets(self.stored), is_leaf=_is_array)

    def unpad(self, params):
        """Stored leaves → the model's shapes and order (any array type; a slice)."""
        if not self.converts:
            return params
        return jax.tree.map(_unpad_to, params, self._targets(self.logical), is_leaf=_is_array)

    def logical_shape(self, path) -> tuple[int, ...]:
        """The model's shape of the leaf at ``path`` (a key path of the params)."""
        node = self.logical
        for k in path:
            node = node[getattr(k, "key", getattr(k, "idx", None))]
        return tuple(node)

    def unpad_leaf(self, path, a):
        """The leaf at ``path`` (a key path of the params) from stored to the model's shape
        and order (``unpad`` of one leaf)."""
        order = self.order.get(jax.tree_util.keystr(path))
        return _unpad_to(a, _Target(self.logical_shape(path), order))

    def unpad_tree(self, tree, optimizer):
        """``unpad`` of a ``TrainState`` (its params and the optimizer state's param-shaped
        leaves), of an optimizer state, or of a params-shaped tree; anything else as it is."""
        return self._map_tree(tree, optimizer, _unpad_to, self.logical)

    def pad_tree(self, tree, optimizer):
        """``pad`` of a ``TrainState`` or a params-shaped tree (the inverse of ``unpad_tree``;
        any array type)."""
        return self._map_tree(tree, optimizer, _pad_to, self.stored)

    def _map_tree(self, tree, optimizer, fn, shapes):
        if not self.converts:
            return tree
        targets = self._targets(shapes)
        is_target = lambda x: isinstance(x, _Target)  # noqa: E731
        if isinstance(tree, TrainState):
            opt_state = optax.tree_map_params(optimizer, fn, tree.opt_state, targets,
                                              is_leaf=is_target)  # fmt: skip
            return TrainState(jax.tree.map(fn, tree.params, targets, is_leaf=_is_array),
                              opt_state)  # fmt: skip
        if jax.tree.structure(tree) == jax.tree.structure(shapes, is_leaf=is_shape):
            return jax.tree.map(fn, tree, targets, is_leaf=_is_array)
        opt_state = jax.eval_shape(optimizer.init, self.abstract(jnp.float32))
        if jax.tree.structure(tree) == jax.tree.structure(opt_state):
            return optax.tree_map_params(optimizer, fn, tree, targets, is_leaf=is_target)
        return tree

    def logical_specs(self, specs, mesh):
        """``specs`` (of the stored leaves) with the split dropped on each dim whose model
        size its mesh axes do not divide: a layout the model's own shapes can take (a
        checkpoint's arrays are written from it and read into it)."""
        return jax.tree.map(lambda spec, shape: logical_spec(spec, shape, mesh), specs,
                            self.logical, is_leaf=_is_spec)  # fmt: skip


def logical_spec(spec, shape, mesh) -> P:
    """``spec`` with the split dropped on each dim of ``shape`` its mesh axes do not divide."""
    entries = shardops.spec_entries(spec, len(shape))
    return P(*(e if n % math.prod(mesh.shape[a] for a in entry_axes(e)) == 0 else None
               for n, e in zip(shape, entries, strict=True)))  # fmt: skip


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _first(names: list[str], n: int = 4) -> str:
    """``names`` in a message: the first ``n`` and how many in all."""
    return str(names) if len(names) <= n else f"{names[:n]} … ({len(names)} in all)"


def _params_checked(fn, padding: Padding, what: str):
    """``fn(params, *batch)`` that first checks ``params`` against the stored tree and shapes
    (``Padding.check_stored``): it runs when the jitted function traces, i.e. for every new
    tree or shape, before ``shard_map`` compares them with its specs."""

    def run(params, *batch):
        padding.check_stored(params, what, "setup.shard(params).params")
        return fn(params, *batch)

    return run


def _state_checked(fn, padding: Padding, what: str):
    """``fn(state, *batch)`` that first checks that ``state`` is a ``TrainState`` (a pair of
    params and optimizer state) whose params have the stored tree and shapes."""

    def run(state, *batch):
        if not (isinstance(state, tuple) and len(state) == 2):
            raise TypeError(
                f"{what}: state must be a TrainState (params, opt_state); got "
                f"{type(state).__name__}. Start from setup.init(key) or setup.shard(params), "
                f"and pass what train_step returned"
            )
        padding.check_stored(state[0], what, "setup.shard(params)")
        return fn(state, *batch)

    return run


@dataclasses.dataclass(frozen=True)
class _Target:
    """A leaf's shape to pad (slice) to, and the order of its dim 0 (None: the model's)."""

    shape: tuple[int, ...]
    order: tuple[int, ...] | None


def _pad_to(a, target: _Target):
    if tuple(a.shape) != target.shape:
        widths = [(0, s - n) for n, s in zip(a.shape, target.shape, strict=True)]
        a = np.pad(np.asarray(a), widths) if isinstance(a, np.ndarray) else jnp.pad(a, widths)
    return a if target.order is None else a[np.asarray(target.order)]


def _unpad_to(a, target: _Target):
    if target.order is not None:
        a = a[np.argsort(target.order)]
    if tuple(a.shape) == target.shape:
        return a
    return a[tuple(slice(0, n) for n in target.shape)]
