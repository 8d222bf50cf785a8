"""Layouts of the MLP strategies: the Megatron layer plan, PartitionSpecs, the FSDP rule,
sharding a reference parameter tree onto a mesh and gathering it back, and the collective
budget arithmetic shared by the strategies.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops import DATA_AXIS, MODEL_AXIS, spec_entry

COLUMN, ROW, DENSE = "column", "row", "dense"
AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"
F32 = 4


def tp_plan(n_layers: int) -> list[str]:
    """Megatron pairs: column, row, column, row, …; an odd last layer stays replicated.

    A column→activation→row pair needs one AllReduce forward. The unpaired last layer (the
    classifier of an odd-depth MLP) is small, so every ``model`` device computes it in full
    rather than paying a collective for it; a depth-1 MLP therefore has no tensor parallelism.
    """
    plan = [COLUMN, ROW] * (n_layers // 2)
    return [*plan, DENSE] if n_layers % 2 else plan


def replicated_specs(sizes: Sequence[int]) -> list[dict[str, P]]:
    return [{"w": P(None, None), "b": P(None)} for _ in sizes[1:]]


def tp_specs(sizes: Sequence[int]) -> list[dict[str, P]]:
    """Column: ``w[D, F_model], b[F_model]``; row: ``w[F_model, D], b[D]``; dense: replicated."""
    by_kind = {
        COLUMN: shardops.column_parallel_specs().params,
        ROW: shardops.row_parallel_specs().params,
        DENSE: {"w": P(None, None), "b": P(None)},
    }
    return [dict(by_kind[kind]) for kind in tp_plan(len(sizes) - 1)]


def with_fsdp(specs: list[dict[str, P]], sizes: Sequence[int], mesh: Mesh) -> list[dict[str, P]]:
    """Add ``data``-axis sharding to every leaf that can take it (the FSDP rule).

    Rule: split the largest dimension whose size (after any ``model`` split) divides by the
    ``data`` size, preferring dimensions not split over ``model``; on a ``model``-split
    dimension ``data`` becomes the minor axis, so gathering over ``data`` rebuilds exactly the
    ``model`` shard. A leaf that no dimension lets us split (e.g. ``b2[10]`` over 4 or 8
    devices) stays replicated over ``data`` and its gradient is all-reduced instead.
    """
    n = mesh.shape[DATA_AXIS]
    out = []
    for layer_specs, shape in zip(specs, param_shapes(sizes), strict=True):
        out.append({k: fsdp_spec(shape[k], layer_specs[k], mesh, n) for k in layer_specs})
    return out


def fsdp_spec(shape: tuple[int, ...], spec: P, mesh: Mesh, n: int) -> P:
    entries = list(spec) + [None] * (len(shape) - len(spec))

    def local(d):
        return shape[d] // math.prod(mesh.shape[a] for a in _names(entries[d]))

    free = sorted((d for d in range(len(shape)) if entries[d] is None), key=lambda d: -shape[d])
    split = sorted(
        (d for d in range(len(shape)) if entries[d] is not None), key=lambda d: -local(d)
    )
    for d in free + split:
        if local(d) % n == 0:
            entries[d] = spec_entry(*_names(entries[d]), DATA_AXIS)
            return P(*entries)
    return P(*entries)


def _names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def param_shapes(sizes: Sequence[int]) -> list[dict[str, tuple[int, ...]]]:
    return [{"w": (m, n), "b": (n,)} for m, n in itertools.pairwise(sizes)]


def gather_over_data(leaf: jax.Array, spec: P, accum_dtype=np.float32) -> jax.Array:
    """The stored leaf as the computation needs it, in ``accum_dtype``, with the collective
    whose transpose reduces its gradient over ``data`` (in ``accum_dtype``):

    - split over ``data``: AllGather now, in the leaf's own dtype (FSDP's just-in-time gather);
      its backward is the ReduceScatter of the gradient;
    - replicated over ``data``: ``pcast`` to varying (no communication); its transpose is the
      AllReduce of the gradient over ``data`` (data parallelism).
    """
    for dim, entry in enumerate(spec):
        if DATA_AXIS in _names(entry):
            return shardops.gather_to_region(leaf, DATA_AXIS, dim, accum_dtype)
    return shardops.copy_to_region(leaf, DATA_AXIS, accum_dtype)


def opt_state_specs(optimizer: optax.GradientTransformation, sizes, specs):
    """PartitionSpecs of ``optimizer``'s state: param-shaped leaves like the params, others P()."""
    shapes = [
        {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in layer.items()}
        for layer in param_shapes(sizes)
    ]
    state = jax.eval_shape(optimizer.init, shapes)
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
    """Full host copies (numpy) of a sharded tree: the inverse of ``shard_tree``, bit for bit."""
    return jax.device_get(tree)


# --- collective budgets (bytes V per (kind, mesh axes), the convention of shardops.collectives)


def add(budget: dict, kind: str, axes: tuple[str, ...], nbytes: int, mesh: Mesh) -> None:
    if nbytes and all(mesh.shape[a] > 1 for a in axes):
        budget[(kind, axes)] = budget.get((kind, axes), 0) + nbytes


def data_axis_budget(
    specs, sizes, mesh: Mesh, *, remat: bool = False, param_bytes: int = F32
) -> dict:
    """Per leaf, with V its bytes after the ``data`` gather (its ``model`` shard) in float32:
    split over data → AllGather forward in the param dtype (V · param_bytes / 4) + ReduceScatter
    V of the float32 gradient; replicated over data → AllReduce V of the float32 gradient. With
    remat, the backward gathers again each weight it needs: ``w`` of every layer whose input
    needs a gradient (all but the first; biases are not needed). Plus the loss: AllReduce of one
    f32 over data."""
    budget: dict = {}
    for i, (layer_specs, shapes) in enumerate(zip(specs, param_shapes(sizes), strict=True)):
        for k, spec in layer_specs.items():
            entries = list(spec) + [None] * (len(shapes[k]) - len(spec))
            model_split = math.prod(
                mesh.shape[a] for e in entries for a in _names(e) if a != DATA_AXIS
            )
            v = math.prod(shapes[k]) // model_split * F32
            if any(DATA_AXIS in _names(e) for e in entries):
                regather = remat and k == "w" and i > 0
                gathered = v // F32 * param_bytes
                add(budget, AG, (DATA_AXIS,), gathered * (2 if regather else 1), mesh)
                add(budget, RS, (DATA_AXIS,), v, mesh)
            else:
                add(budget, AR, (DATA_AXIS,), v, mesh)
    add(budget, AR, (DATA_AXIS,), F32, mesh)
    return budget


def model_axis_budget(sizes, local_batch: int, mesh: Mesh) -> dict:
    """Forward: one AllReduce of each row layer's output ``y[b, D]``. Backward: one AllReduce of
    ``dx[b, D]`` per column layer whose input needs a gradient, i.e. every one but the first (its
    input is the data): one fewer than the pairs."""
    budget: dict = {}
    for i, kind in enumerate(tp_plan(len(sizes) - 1)):
        if kind == ROW:
            add(budget, AR, (MODEL_AXIS,), local_batch * sizes[i + 1] * F32, mesh)
        if kind == COLUMN and i > 0:
            add(budget, AR, (MODEL_AXIS,), local_batch * sizes[i] * F32, mesh)
    return budget


def merge(*budgets: dict) -> dict:
    out: dict = {}
    for b in budgets:
        for k, v in b.items():
            out[k] = out.get(k, 0) + v
    return out
