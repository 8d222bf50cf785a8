"""FSDP: which dim of each leaf splits over ``data`` (the rule), and, per dense layer, whether to
gather the weight or move the activations (the route).

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

Under sequence parallelism the dense kernels gather along S themselves; there the weight is
always gathered.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import shardops
from shardops import DATA_AXIS, entry_axes, spec_entries, spec_entry
from shardops_models.strategies.plan import StackedRole

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

# Why each collective of dense_moving_activations runs (shardops.comm.because; explain reads them).
_WHY = "FSDP moves this layer's activations instead of gathering its weight (they are smaller)"
_EXCHANGE = shardops.comm.Reason("moving_exchange", forward={
    "all_to_all": f"{_WHY}: activations are exchanged over {{axis}} between the batch layout "
                  f"and a layout split along features",
}, backward={
    "all_to_all": "it is the transpose of the forward all_to_all: the gradient returns to the "
                  "other layout",
})  # fmt: skip
_PARTIAL_ROWS = shardops.comm.Reason("moving_partial_rows", forward={
    "psum_scatter": f"{_WHY}: each device multiplied the whole batch by its block of the "
                    f"contraction, so the output's partial sums are reduced and each device "
                    f"keeps its rows",
}, backward={
    "all_gather": "it is the transpose of the forward psum_scatter: each device needs dy for "
                  "the whole batch",
})  # fmt: skip
_WHOLE_BATCH = shardops.comm.Reason("moving_whole_batch", forward={
    "all_gather": f"{_WHY}: each device needs the whole batch's input for its block of output "
                  f"features",
}, backward={
    "psum_scatter": "it is the transpose of the input's all_gather: the dx partial sums are "
                    "reduced and split back over {axis} along the batch",
})  # fmt: skip
_COLUMN_INPUT = shardops.comm.Reason("moving_column_input", backward={
    "psum": "the layer is also column-parallel: x is replicated over {axis} but each device "
            "multiplies it by its own columns of w, so the partial dx are summed (Megatron's f)",
})  # fmt: skip
_ROW_SUMS = shardops.comm.Reason("moving_row_partial_sums", forward={
    "psum": "the layer's contraction is also split over {axis} (tensor parallelism): its "
            "partial sums are reduced",
})  # fmt: skip
_REPLICA_WEIGHT = shardops.comm.Reason("moving_replica_weight", backward={
    "psum": "the weight block is replicated over {axis} while the batch splits over it (HSDP): "
            "each replica's dw is summed",
})  # fmt: skip
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


def dense_moving_activations(
    x,
    w,
    b,
    *,
    split_dim: int,
    role: str,
    precision,
    data_axes=(DATA_AXIS,),
    model_axis=None,
    replicated_over=(),
):
    """``x[B_data, ..., K] · w + b → y[B_data, ..., F]`` with ``w`` left split over ``data``.

    Per device, inside ``jax.shard_map`` (``check_vma=True``). ``w``: the local block
    ``w[K_data, F']`` (``split_dim=0``) or ``w[K', F_data]`` (``split_dim=1``), where ``'``
    marks a ``model`` split under tp or sp (``role`` column: F/p; row: K/p, and ``x`` is then the
    column layer's ``x[..., K/p]``). ``b``: the bias as the layer sees it (already gathered
    over ``data``), added once after every reduction. ``data_axes``: the fsdp axes (``data``
    above); ``model_axis``: the tp axis, or None; ``replicated_over``: HSDP's replica axes, over
    which ``dw`` is AllReduced in float32.
    """
    with jax.named_scope("shardops.dense_moving_activations"):  # named in explain and profiles
        return _dense_moving_activations(x, w, b, split_dim=split_dim, role=role, precision=precision,
                                         data=tuple(data_axes), model=model_axis,
                                         replicas=tuple(replicated_over))  # fmt: skip


def _dense_moving_activations(x, w, b, *, split_dim: int, role: str, precision, data, model,
                              replicas):  # fmt: skip
    accum = precision.accum_dtype
    column, row = model is not None and role == "column", model is not None and role == "row"
    last = x.ndim - 1
    because = shardops.comm.because
    if replicas:  # w[..] replicated over the replicas: dw AllReduced over them in accum
        with because(_REPLICA_WEIGHT, replicas):
            w = shardops.comm.copy_to_region(w, replicas, accum)
    if split_dim == 0:
        # x[B_data, ..., K] → x[B, ..., K_data]: one block of K to each device, in compute dtype.
        with because(_EXCHANGE, data):
            x = lax.all_to_all(x, data, last, 0, tiled=True)
        if column:  # replicated over model: dx[B, ..., K_data]{U_model} AllReduced in accum
            with because(_COLUMN_INPUT, model):
                x = shardops.comm.copy_to_region(x, model, accum)
        y = precision.matmul(x, w)  # y[B, ..., F']{U_data} in accum
        with because(_PARTIAL_ROWS, data):  # y[B_data, .., F']
            y = lax.psum_scatter(y, data, scatter_dimension=0, tiled=True)
        if row:
            with because(_ROW_SUMS, model):  # y[B_data, ..., D]: the row layer's own reduction
                y = lax.psum(y, model)
    else:
        # x[B_data, ..., K'] → x[B, ..., K']; backward: ReduceScatter of dx in accum.
        with because(_WHOLE_BATCH, data):
            x = shardops.comm.gather_to_region(x, data, 0, accum)  # x[B, ..., K'] in accum
        if column:
            with because(_COLUMN_INPUT, model):
                x = shardops.comm.copy_to_region(x, model, accum)
        y = precision.matmul(x, w)  # y[B, ..., F_data]{U_model if row} in accum
        if row:
            with because(_ROW_SUMS, model):
                y = lax.psum(y, model)
        with because(_EXCHANGE, data):  # y[B_data, ..., F'] in accum
            y = lax.all_to_all(y, data, 0, last, tiled=True)
    return precision.finish(y, b)
