"""FSDP: the kind (``FsdpKind``), which dim of each leaf splits over ``data`` (the rule), and,
per dense layer, whether to gather the weight or move the activations (the route).

    x[B_data, …]    w[K_data, F] stored; AllGathered per unit just in time    dw ReduceScattered

The kind lays the parameters out by the rule, after the kinds that split each layer by its
plan role (tp); ``ctx.unit`` gathers a unit's split leaves (one AllGather per dtype, whose
transpose ReduceScatters the gradients) and enters the rest varying over the axes like dp.

The rule (``fsdp_spec``, applied to a whole tree by ``with_fsdp``) is below; the route follows.

Under fsdp a dense weight is split over ``data`` (N devices) along one of its dims, and the
batch is split over ``data`` too. There are two ways to compute ``x · w`` (scaling-book
notation; ``w[K, F]`` as the layer sees it, i.e. after any ``model`` split):

- **gather the weight** (the FSDP default): AllGather ``w[K_data, F] → w[K, F]`` (param
  dtype), a local matmul on ``x[B_data, K]``, and ReduceScatter of ``dw`` (float32) in the
  backward pass. Bytes V_w each way, whatever the batch.
- **move the activations**, with ``w`` split along K (``w[K_data, F]``):
  AllToAll ``x[B_data, K] → x[B, K_data]`` (compute dtype), ``y[B, F]{U_data}`` = local matmul,
  ReduceScatter ``y{U_data} → y[B_data, F]`` (float32, before the bias and the one cast).
  Backward: AllGather of ``dy`` (float32), ``dw[K_data, F] = x[B, K_data]ᵀ · dy[B, F]`` is
  already this device's shard (no reduction), and AllToAll of ``dx`` back.
  With ``w`` split along F (``w[K, F_data]``): AllGather ``x[B_data, K] → x[B, K]``,
  ``y[B, F_data]`` local, AllToAll ``y[B, F_data] → y[B_data, F]`` (float32); backward:
  AllToAll of ``dy``, ReduceScatter of ``dx`` (float32), ``dw`` local.

The rule (``moves_activations``): per device, a ring moves V(N−1)/N for AllGather,
ReduceScatter and AllToAll alike (V: the full tensor; for AllToAll, this device's block), so
the common factor drops and the layer moves its activations when

    K split:  2·|x_block|·c + 2·|y_full|·4     <  |w|·(p + 4)
    F split:  |x_full|·(c + 4) + 2·|y_block|·4 <  |w|·(p + 4)

with ``c`` the compute dtype's bytes, ``p`` the param dtype's, ``|x_block|`` this device's
``x`` and ``|y_full|`` the output over the whole batch. That is: move activations when the
batch's activations are smaller than the weight (wide layers, small batches), which is what
XLA's GSPMD chooses for the same sharding. The rule counts ``dx``'s move even for the model's
own input (whose ``dx`` is never computed), and leaves remat's re-gather out: it is a rule of
thumb in bytes, and the benchmark (``benchmarks/strategies.py``) is its check in time. The
collective budget (``Setup.budget``, read from the traced step) follows the choice exactly.

The activation route's kernel is ``shardops.layers.dense_moving_activations``
(``shardops/layers/_fsdp_dense.py``); this module decides which layers take it.

Under sequence parallelism the dense kernels gather along S themselves; there the weight is
always gathered.
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import shardops
from shardops import DATA_AXIS, entry_axes, spec_entries, spec_entry, varying_axes
from shardops.layers import dense_moving_activations
from shardops_models.strategies.kind import Kind, LayoutContext, split_dim
from shardops_models.strategies.plan import StackedRole

_FSDP_GATHER = shardops.comm.Reason("fsdp_gather", forward={
    "all_gather": "weights stored split over {axis} (FSDP) are gathered just before use",
}, backward={
    "psum_scatter": "it is the transpose of the weights' all_gather: gradients are summed and "
                    "each device keeps its shard over {axis}",
})  # fmt: skip


class FsdpKind(Kind):
    """Fully sharded data parallelism over ``axes`` (``Strategy(fsdp=...)``)."""

    name: ClassVar[str] = "fsdp"
    doc: ClassVar[str] = ("the batch split; parameters split, AllGathered just in time; "
                          "gradients ReduceScattered")  # fmt: skip
    splits_batch: ClassVar[bool] = True
    sums_gradients: ClassVar[bool] = True
    regathers: ClassVar[bool] = True
    splits_parameters: ClassVar[bool] = True

    def layout(self, specs, stored, context: LayoutContext):
        return with_fsdp(specs, stored, context.mesh, self.axes, context.roles), stored

    # --- what ``ctx.unit`` does with the leaves it splits

    def replicas(self, ctx, varying=()) -> tuple[str, ...]:
        """The axes a split parameter is replicated over (its shard's gradient is AllReduced
        over them): the other kinds' that sum gradients (dp's: HSDP; the context axis), but
        for those it ``varying`` over already (ep's experts, split over its axis)."""
        return tuple(a for a in ctx.strategy.gradient_axes
                     if a not in self.axes and a not in varying)  # fmt: skip

    def materialise(self, ctx, leaves, used, ready) -> None:
        """The unit's leaves split over the axes, ready (``ready[i]``, in place). Those that
        share a dtype and varying axes travel together: one AllGather over the axes (one
        ReduceScatter back) instead of one per leaf (``shardops.comm.gather_many_to_region``);
        XLA:CPU does not combine gathers by itself. (It does combine the replicated leaves'
        gradient AllReduces, so those stay one ``copy_to_region`` each: bundling them by hand
        only adds copies.) Under remat the backward re-gathers the whole bundle, the leaves its
        backward does not read (a bias, an embedding table) included: a few more bytes than one
        gather per leaf, and on the GPT 45 collectives a step instead of 190 (``fsdp remat``
        1.29× → 0.96× GSPMD's step, ``docs/benchmarks.md``). A dense weight that may move the
        activations instead stays split, ``pending`` its layer's choice (``dense``). A leaf an
        earlier unit of this forward used (``used``: a tied embedding's table, in the head) is
        gathered anew, through an optimization barrier numbered by the use, which XLA's CSE
        cannot merge with the earlier gather (``ctx.unit``)."""
        gather = {}
        for i, p in enumerate(leaves):
            dim = split_dim(p.spec, self.axes)
            if ready[i] is not None or dim is None:
                continue
            if self._may_move_activations(ctx, p):  # a dense weight: its layer chooses
                ready[i] = p if p.ready else p.replace(ready=True, pending=dim)
                continue
            gather.setdefault((np.dtype(p.value.dtype), varying_axes(p.value)), []).append((i, dim))
        accum = ctx.precision.accum_dtype
        for (_, varying), group in gather.items():
            values = [leaves[i].value for i, _ in group]
            uses = max(used[i] for i, _ in group)
            if uses:  # used by an earlier unit: gathered anew (see ``unit``)
                values, _ = lax.optimization_barrier((values, jnp.int32(uses)))
            dims = [d for _, d in group]
            with shardops.comm.because(_FSDP_GATHER, self.axes):
                gathered = shardops.comm.gather_many_to_region(values, self.axes, dims,
                                                               accum, self.replicas(ctx, varying))  # fmt: skip
            for (i, _), value in zip(group, gathered, strict=True):
                ready[i] = leaves[i].replace(value=value, ready=True)

    def gather(self, ctx, value, dim: int):
        """``value``, split along ``dim`` over the axes → whole (its gradient ReduceScattered
        back, then AllReduced over ``replicas``)."""
        with shardops.comm.because(_FSDP_GATHER, self.axes):
            return shardops.comm.gather_to_region(value, self.axes, dim,
                                                  ctx.precision.accum_dtype,
                                                  self.replicas(ctx, varying_axes(value)))  # fmt: skip

    def _may_move_activations(self, ctx, p) -> bool:
        """A dense weight (``...['w']``, rank 2) that ``dense`` may use without gathering it."""
        split_s = any(k.sequence_axes for k in ctx.strategy.kinds)  # sp: the layers gather S
        return (ctx.fsdp_dense != GATHER_WEIGHTS and not split_s
                and p.path.endswith("['w']") and p.value.ndim == 2)  # fmt: skip

    def pending_dense(self, ctx, p, x):
        """``x · w + b`` of a dense weight left split (``pending``) by the activation route,
        where the rule picks it for these shapes (``moves_activations``), else None (the layer
        then gathers the weight)."""
        w, pending = p["w"].value, p["w"].pending  # w[K_data, F'] or w[K', F_data]: this block
        n = lax.axis_size(self.axes)
        seen = tuple(d * n if i == pending else d for i, d in enumerate(w.shape))
        if not moves_activations(ctx.fsdp_dense, seen, pending, x.shape, n, ctx.precision):
            return None
        return dense_moving_activations(
            x, w, ctx._optional(p, "b"), split_dim=pending, role=p["w"].role,
            data_axes=self.axes, model_axis=ctx.axis_name(),
            replicated_over=self.replicas(ctx, varying_axes(w)),
            precision=ctx.precision,
        )  # fmt: skip


# --- the rule: which dim of a leaf splits over data


def with_fsdp(specs, shapes, mesh: Mesh, axes=(DATA_AXIS,), roles=None):
    """Add sharding over ``axes`` (the fsdp axes; or zero1's, for the optimizer state) to every
    leaf that can take it (the FSDP rule, ``fsdp_spec``). With the plan's ``roles``, a leaf of
    stacked layers (``StackedRole``) is never split along its layer dim 0."""
    axes = tuple(axes)
    n = math.prod(mesh.shape[a] for a in axes)
    if roles is None:
        roles = jax.tree.map(lambda _: None, specs, is_leaf=lambda s: isinstance(s, P))
    return jax.tree.map(
        lambda spec, shape, role: fsdp_spec(shape, spec, mesh, n, axes,
                                            stacked=isinstance(role, StackedRole)),
        specs,
        shapes,
        roles,
        is_leaf=lambda s: isinstance(s, P),
    )  # fmt: skip


def fsdp_spec(shape: tuple[int, ...], spec: P, mesh: Mesh, n: int, axes=(DATA_AXIS,), *,
              stacked: bool = False) -> P:  # fmt: skip
    """The FSDP rule for one leaf: split the largest dimension whose size (after any ``model``
    split) divides by ``n`` (the size of the fsdp ``axes``), preferring dimensions not split
    over ``model``; on a ``model``-split dimension the fsdp axes become the minor ones, so
    gathering over them rebuilds exactly the ``model`` shard. A leaf that no dimension lets us
    split (e.g. ``b2[10]`` over 4 or 8 devices) stays replicated over them; its gradient is
    all-reduced. ``stacked``: dim 0 holds stacked layers and is not a candidate (each layer is
    gathered inside the scan).
    """
    entries = spec_entries(spec, len(shape))

    def local(d):
        return shape[d] // math.prod(mesh.shape[a] for a in entry_axes(entries[d]))

    first = 1 if stacked else 0
    free = sorted((d for d in range(first, len(shape)) if entries[d] is None),
                  key=lambda d: -shape[d])  # fmt: skip
    split = sorted(
        (d for d in range(len(shape)) if entries[d] is not None), key=lambda d: -local(d)
    )
    for d in free + split:
        if local(d) % n == 0:
            entries[d] = spec_entry(*entry_axes(entries[d]), *axes)
            return P(*entries)
    return P(*entries)


# --- the route: per dense layer, gather the weight or move the activations

AUTO, GATHER_WEIGHTS, MOVE_ACTIVATIONS = "auto", "gather_weights", "move_activations"
ROUTES = (AUTO, GATHER_WEIGHTS, MOVE_ACTIVATIONS)

F32 = 4


def check_route(route: str) -> str:
    if route not in ROUTES:
        raise ValueError(
            f"fsdp_dense must be one of {ROUTES}; got {route!r}. 'auto' lets the cost rule "
            f"choose per layer (models/strategies/fsdp.py)"
        )
    return route


def route_bytes(w_shape, split_dim: int, x_shape, n: int, precision) -> dict[str, float]:
    """Ring bytes per device of both routes for one layer (the rule's two sides, × (N−1)/N).

    ``w_shape``: ``w[K, F]`` as the layer sees it (gathered over ``data``, split over
    ``model``); ``split_dim``: the dim of ``w`` split over ``data``; ``x_shape``: this
    device's ``x[B_data, ..., K]``; ``n``: the size of ``data``.
    """
    c = np.dtype(precision.compute_dtype).itemsize
    p = np.dtype(precision.param_dtype).itemsize
    rows = math.prod(x_shape[:-1])  # this device's rows of x
    k, f = w_shape
    if split_dim == 0:
        moved = 2 * rows * k * c + 2 * rows * n * f * F32
    else:
        moved = rows * n * k * (c + F32) + 2 * rows * f * F32
    ring = (n - 1) / n
    return {GATHER_WEIGHTS: k * f * (p + F32) * ring, MOVE_ACTIVATIONS: moved * ring}


def moves_activations(route: str, w_shape, split_dim, x_shape, n: int, precision) -> bool:
    """Whether a dense layer takes the activation route (see the module docstring)."""
    if split_dim is None or n == 1 or route == GATHER_WEIGHTS:
        return False
    if route == MOVE_ACTIVATIONS:
        return True
    cost = route_bytes(w_shape, split_dim, x_shape, n, precision)
    return cost[MOVE_ACTIVATIONS] < cost[GATHER_WEIGHTS]
