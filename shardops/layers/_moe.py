"""Mixture of experts (top-k routing, capacity per group or dropless, SwiGLU experts): per-device
kernel, layer, specs and the unsharded reference.

Shapes: ``G`` groups (sequences) of ``S`` tokens, model width ``D``, ``E`` experts of hidden
width ``F``, ``k`` experts per token, ``C`` slots per expert per group, ``N`` devices on the
expert axis, ``p`` on the model axis.

    logits = x[G, S, D] · router[D, E]                  → logits[G, S, E] (float32, replicated w)
    top-k of probs = softmax(logits) (or sigmoid)       → chosen experts, weights renormalised
    dispatch[G, S, E, C]: token s fills expert e's next free slot (rank-major, then by s)
    xe[E_X, N·G·C, D] ← AllToAll over X ← xe[E, G·C, D] = dispatch · x          (expert parallel)
    ye = down(silu(xe · gate) ⊙ (xe · up))              → ye[E_X, N·G·C, D]{U_model}
    ye[E, G·C, D] ← AllToAll back;  y[G, S, D] = Σ_{e,c} combine · ye → psum over model

The parts, one file each: the routing rule, its slots and auxiliary losses in
``_moe_routing.py``; the capacity path's dispatch, AllToAlls and combine in
``_moe_dispatch.py``; the dropless path's grouped matmuls in ``_moe_dropless.py``; the options
and argument checks in ``_moe_arguments.py``. This file runs them: ``moe_kernel`` (the
per-device body), ``moe`` (no mesh) and ``expert_parallel_moe`` (the ``shard_map``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardops._axes import DATA_AXIS
from shardops._mesh import check_divisible, spec_entry
from shardops._precision import FLOAT32, Precision
from shardops.comm._collectives import all_reduce
from shardops.comm._mappings import (
    REPLICATED_INPUT,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_from_region,
)
from shardops.comm._reasons import Reason, because
from shardops.layers._common import check_precision, run_layer, scoped
from shardops.layers._moe_arguments import (
    GROUPED_MATMULS,
    LOAD_BALANCE,
    PARAMS,
    SCORES,
    _axes_tuple,
    _check_dropless,
    _check_kernel_args,
    _check_layer_axes,
    _check_local,
    _check_options,
    _check_params,
)
from shardops.layers._moe_dispatch import _capacity
from shardops.layers._moe_dropless import _dropless
from shardops.layers._moe_routing import (
    MoeRouting,
    MoeStats,
    _stats,
    _top_k,
    moe_capacity,
    route,
    routing_hook,
)

_SEQUENCE_GATHER = Reason("moe_sequence_gather", forward={
    "all_gather": "sequence parallelism splits x along S over {axis}; each group is routed whole "
                  "(its capacity is the sequence's)",
})  # fmt: skip
_EXPERT_PARTIAL_SUMS = Reason("moe_expert_partial_sums", forward={
    "psum": "each expert's hidden units are split over {axis}: the combined y[G, S, D] holds "
            "partial sums (reduced after the combine, fewer bytes than the slots)",
    "psum_scatter": "each expert's hidden units are split over {axis}: the combined y[G, S, D] "
                    "holds partial sums, reduced and split along S (sequence parallelism)",
})  # fmt: skip
_COMBINE_WEIGHTS = Reason("moe_combine_weights", backward={
    "psum": "the combine weights are replicated over {axis} but multiply partial sums of the "
            "experts' outputs: their gradients are summed",
})  # fmt: skip
_STATS = Reason("moe_layer_stats", forward={
    "psum": "the layer's statistics (tokens per expert, drops, per-group losses) over the batch "
            "split over {axis}",
})  # fmt: skip


class MoeSpecs(NamedTuple):
    """PartitionSpecs of the MoE layer: ``x``, ``router``, the gate and up weights ``w_in``,
    the down weight ``w_out`` and ``y``."""

    x: P
    router: P
    w_in: P
    w_out: P
    y: P

    @property
    def params(self) -> dict:
        """The specs of ``init_moe``'s tree, for ``shard_params``."""
        return {"router": self.router, "gate": self.w_in, "up": self.w_in, "down": self.w_out}


def moe_specs(
    *,
    expert_axis: str | None = DATA_AXIS,
    model_axis: str | None = None,
    batch_axes: Sequence[str] = (DATA_AXIS,),
) -> MoeSpecs:
    """Layout of ``expert_parallel_moe``: ``x[G_batch, S, D] → y[G_batch, S, D]``,
    ``router[D, E]`` replicated, gate and up ``w[E_expert, D, F_model]``, down
    ``w[E_expert, F_model, D]``. The model axis must be none of the others (a ``ValueError``
    naming them, not JAX's duplicate-spec error when the specs are used)."""
    batch_axes = _axes_tuple(batch_axes)
    if model_axis is not None and (model_axis == expert_axis or model_axis in batch_axes):
        raise ValueError(
            f"moe_specs: model_axis={model_axis!r} splits each expert's hidden units; it cannot "
            f"also be expert_axis={expert_axis!r} or one of batch_axes={batch_axes} (one mesh "
            f"axis splits one dim of a weight). Use another mesh axis for model_axis, or "
            f"model_axis=None"
        )
    x = P(spec_entry(*batch_axes), None, None)
    return MoeSpecs(x=x, router=P(None, None), w_in=P(expert_axis, None, model_axis),
                    w_out=P(expert_axis, model_axis, None), y=x)  # fmt: skip


def init_moe(key: jax.Array, d_model: int, d_ff: int, num_experts: int, dtype=jnp.float32) -> dict:
    """Full parameters ``{"router": w[D, E], "gate", "up": w[E, D, F], "down": w[E, F, D]}``,
    each LeCun-normal over its input features like ``init_gated_mlp``'s weights (every expert
    one gated MLP). Shard with ``shard_params(params, mesh, moe_specs(...).params)``."""
    for name, n in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"init_moe: {name} must be a positive int; got {n!r}")
    k_router, k_gate, k_up, k_down = jax.random.split(key, 4)
    expert = jax.nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    e, d, f = num_experts, d_model, d_ff
    return {
        "router": jax.nn.initializers.lecun_normal()(k_router, (d, e), dtype),
        "gate": expert(k_gate, (e, d, f), dtype),
        "up": expert(k_up, (e, d, f), dtype),
        "down": expert(k_down, (e, f, d), dtype),
    }


@scoped("moe")
def moe_kernel(
    x,
    params,
    *,
    k: int,
    capacity_factor: float | None,
    score: str = "softmax",
    load_balance: str = "global",
    expert_axis: str | None = None,
    model_axis: str | None = None,
    batch_axes: Sequence[str] = (),
    activation: Callable = jax.nn.silu,
    precision: Precision = FLOAT32,
    grouped_matmul: str = "ragged_dot",
    sequence_parallel: bool = False,
) -> tuple[jax.Array, MoeStats]:
    """The MoE layer on local blocks: ``x[G, S, D] → y[G, S, D]`` and ``MoeStats``.

    Arguments (local blocks, ``N`` = size of ``expert_axis``, ``p`` = size of ``model_axis``):
        x: ``x[G, S, D]`` (G capacity groups of S tokens) or ``x[T, D]`` (one group), in
            compute dtype, replicated over ``model_axis``; it may differ over ``expert_axis``
            (normally the data axis).
        params: ``{"router": w[D, E]`` whole (replicated over ``model_axis``; over the batch
            axes a training step may enter it typed varying), ``"gate", "up":
            w[E/N, D, F/p]``, ``"down": w[E/N, F/p, D]}``: this device's experts, each's
            hidden units split over ``model_axis``.
        k: experts per token, in [1, E]. capacity_factor: > 0; ``C`` as ``moe_capacity`` says;
            ``None``: dropless (every choice computed by its expert; ``expert_axis`` must then
            be None or of size 1).
        score: one of ``SCORES``. load_balance: one of ``LOAD_BALANCE``.
        batch_axes: the mesh axes the tokens are split over, summed by ``"global"``: the
            batch's, and under context parallelism the sequence's (each device's chunk of a
            sequence is then its own capacity group).
        grouped_matmul: the dropless path's grouped matmul, one of ``GROUPED_MATMULS``:
            ``"ragged_dot"`` (``lax.ragged_dot``, any backend) or ``"megablox"`` (the Pallas
            TPU kernels ``gmm``/``tgmm``, outside ``shard_map`` only: ``moe`` on one device;
            interpreted off a TPU, for tests only).
        sequence_parallel: ``x[G, S_model, D]`` and ``y`` split along S over ``model_axis``
            (Megatron's sequence parallelism): ``x`` is AllGathered along S first (each group
            routed whole, as without it), and ``y{U_model}`` ReduceScattered along S instead
            of AllReduced.

    Returns:
        ``y`` shaped like ``x``, in compute dtype, replicated over ``model_axis``, and
        ``MoeStats`` (counts of this device's groups).

    Communication (V = bytes of ``xe[E, G·C, D]`` in compute dtype, ``G·C·E·D·bytes``):
        ``expert_axis``: forward one AllToAll of ``xe`` and one of ``ye`` (in accum dtype),
        each ``V·(N−1)/N`` per device; backward the two AllToAlls of their cotangents.
        ``model_axis``: forward one AllReduce of ``y[G, S, D]{U_model}`` after the combine (in
        accum; the slots ``ye[E, G·C, D]`` are ``k·capacity_factor`` times bigger); backward
        the AllReduce of ``dx`` for gate and up together (``copy_to_region``) and one of the
        combine weights' gradient ``[G, S, E]`` (float32; dropless ``[G, S, k]``).
        ``load_balance="global"``: an AllReduce of ``2E + 1`` floats over ``batch_axes``.
        Expert weights' gradients are local to their devices on ``expert_axis``; the router's
        (replicated) are summed by autodiff over the axes ``x`` varies over. Dropless: no
        AllToAll (no expert split); the experts' weights' gradients are summed over the axes
        ``x`` varies over, as the router's.
    """
    batch_axes = _axes_tuple(batch_axes)
    _check_kernel_args(x, params, k, capacity_factor, score, load_balance, expert_axis,
                       model_axis, batch_axes, grouped_matmul, sequence_parallel)  # fmt: skip
    router = params["router"]
    e = router.shape[-1]
    groups = x if x.ndim == 3 else x[None]  # x[G, S, D] (sp: x[G, S_model, D])
    if sequence_parallel:  # whole groups, invariant over model: dx is each device's slice
        with because(_SEQUENCE_GATHER, model_axis):
            groups = gather_from_region(groups, model_axis, axis=1)  # x[G, S, D]
    accum, compute = precision.accum_dtype, precision.compute_dtype
    if capacity_factor is None:  # dropless: the top-k alone, no slots
        logits, probs, top_i, combine = _top_k(groups, router, k, score)  # combine[G, S, k]
        chosen = jnp.sum(jax.nn.one_hot(top_i, e, dtype=jnp.float32), axis=2)  # [G, S, E]
        routing = MoeRouting(None, combine, chosen, logits, probs)
    else:
        routing = route(groups, router, k=k, capacity_factor=capacity_factor, score=score)
    stats = _stats(routing, k, load_balance, batch_axes)
    if model_axis is None:
        x_region = groups.astype(accum)
        weights = routing.combine  # [G, S, E] (dropless [G, S, k]) in float32
    else:  # one dx AllReduce for gate and up (Megatron's f), one for the combine weights
        with because(REPLICATED_INPUT, model_axis):
            x_region = copy_to_region(groups, model_axis, accum)  # x[G, S, D] in accum
        with because(_COMBINE_WEIGHTS, model_axis):
            weights = copy_to_region(routing.combine, model_axis, accum)  # [G, S, E]
    if capacity_factor is None:
        y = _dropless(x_region, top_i, weights, params, activation, precision, grouped_matmul)
    else:
        y = _capacity(x_region, routing.dispatch, weights, params, expert_axis, activation,
                      precision)  # y[G, S, D] in accum {U_model}  # fmt: skip
    if sequence_parallel:
        with because(_EXPERT_PARTIAL_SUMS, model_axis):
            y = reduce_scatter_from_region(y, model_axis, dim=1)  # y[G, S_model, D]
    elif model_axis is not None:
        with because(_EXPERT_PARTIAL_SUMS, model_axis):
            y = reduce_from_region(y, model_axis)  # y[G, S, D], replicated over model
    return y.astype(compute).reshape(x.shape), stats


def moe(
    x,
    params,
    *,
    k: int,
    capacity_factor: float | None,
    score: str = "softmax",
    load_balance: str = "global",
    activation: Callable = jax.nn.silu,
    precision: Precision = FLOAT32,
    grouped_matmul: str = "ragged_dot",
) -> tuple[jax.Array, MoeStats]:
    """Unsharded MoE: ``moe_kernel`` with no mesh axes, ``x[G, S, D] → y[G, S, D]`` (or
    ``x[T, D]``, one group) and ``MoeStats`` over all of ``x``'s groups;
    ``capacity_factor=None``: dropless."""
    check_precision("moe", precision)
    return moe_kernel(x, params, k=k, capacity_factor=capacity_factor, score=score,
                      load_balance=load_balance, activation=activation, precision=precision,
                      grouped_matmul=grouped_matmul)  # fmt: skip


def expert_parallel_moe(
    x,
    params,
    *,
    mesh: Mesh,
    k: int,
    capacity_factor: float | None,
    score: str = "softmax",
    load_balance: str = "global",
    expert_axis: str | None = DATA_AXIS,
    model_axis: str | None = None,
    batch_axes: Sequence[str] = (DATA_AXIS,),
    activation: Callable = jax.nn.silu,
    precision: Precision = FLOAT32,
    grouped_matmul: str = "ragged_dot",
) -> tuple[jax.Array, MoeStats]:
    """The MoE layer on global arrays: experts split over ``expert_axis``, their hidden units
    over ``model_axis``, the groups over ``batch_axes``.

    Arguments:
        x: ``x[G, S, D]`` in compute dtype, G split over ``batch_axes`` (which must hold
            ``expert_axis``: each device dispatches its own groups' tokens).
        params: full-shape parameters as ``init_moe`` makes them, laid out as
            ``moe_specs(...).params`` (or left to ``shard_map``). E must divide by the expert
            axis size and F by the model axis size.
        capacity_factor: as the kernel's; ``None`` is dropless and needs ``expert_axis=None``
            (every expert on every device; a split of the experts would need a ragged
            AllToAll): ``moe_specs(expert_axis=None, ...)``.
        grouped_matmul: the dropless path's grouped matmul (the kernel's); ``"megablox"`` is
            refused over any mesh axis (its kernels declare no varying axes): use ``moe``.

    Returns ``y[G, S, D]`` laid out as the specs' ``y``, and ``MoeStats`` replicated: counts
    summed over the whole batch, the losses of the whole batch (``"group"``: the mean over
    all groups). Communication: see the kernel, plus one AllReduce of the statistics.
    """
    op = "expert_parallel_moe"
    batch_axes = _axes_tuple(batch_axes)
    _check_layer_axes(op, mesh, expert_axis, model_axis, batch_axes)
    check_precision(op, precision)
    _check_params(op, params)
    e = params["router"].shape[-1] if params["router"].ndim == 2 else 0
    _check_options(op, k, capacity_factor, score, load_balance, e)
    _check_dropless(op, capacity_factor, grouped_matmul, expert_axis,
                    1 if expert_axis is None else mesh.shape[expert_axis])  # fmt: skip
    _check_local(op, x, params, 1, None)
    if x.ndim != 3:
        raise ValueError(f"{op}: x must be x[G, S, D] (groups of S tokens) on global arrays; got "
                         f"x{tuple(x.shape)}; reshape x[T, D] to x[1, T, D]")  # fmt: skip
    precision.check_activation("x", x.dtype)
    for name in PARAMS:
        precision.check_param(f"params[{name!r}]", params[name].dtype)
    check_divisible(argument="x", dim=0, dim_name="groups", size=x.shape[0], mesh=mesh,
                    axes=batch_axes)  # fmt: skip
    check_divisible(argument="params['router']", dim=1, dim_name="experts", size=e, mesh=mesh,
                    axes=(expert_axis,))  # fmt: skip
    check_divisible(argument="params['gate']", dim=2, dim_name="hidden", size=params["gate"].shape[2],
                    mesh=mesh, axes=(model_axis,))  # fmt: skip
    specs = moe_specs(expert_axis=expert_axis, model_axis=model_axis, batch_axes=batch_axes)
    kernel = functools.partial(
        _layer_body, k=k, capacity_factor=capacity_factor, score=score,
        load_balance=load_balance, expert_axis=expert_axis, model_axis=model_axis,
        batch_axes=batch_axes, activation=activation, precision=precision,
        grouped_matmul=grouped_matmul,
    )  # fmt: skip
    replicated = MoeStats(P(), P(), P(), P())
    return run_layer(op, kernel, mesh, {"x": x, "params": params},
                     {"x": specs.x, "params": specs.params}, (specs.y, replicated))  # fmt: skip


def _layer_body(x, params, *, load_balance, batch_axes, **options):
    """``moe_kernel``, then the statistics of the whole batch (replicated)."""
    y, stats = moe_kernel(x, params, load_balance=load_balance, batch_axes=batch_axes, **options)
    if not batch_axes:
        return y, stats
    counts = all_reduce((stats.tokens_per_expert, stats.dropped), batch_axes, reason=_STATS)
    if load_balance == "group":  # every device holds as many groups: the mean of the means
        devices = math.prod(lax.axis_size(a) for a in batch_axes)
        losses = all_reduce((stats.load_balance, stats.z_loss), batch_axes, reason=_STATS)
        stats = stats._replace(load_balance=losses[0] / devices, z_loss=losses[1] / devices)
    return y, stats._replace(tokens_per_expert=counts[0], dropped=counts[1])


__all__ = [
    "GROUPED_MATMULS",
    "LOAD_BALANCE",
    "SCORES",
    "MoeRouting",
    "MoeSpecs",
    "MoeStats",
    "expert_parallel_moe",
    "init_moe",
    "moe",
    "moe_capacity",
    "moe_kernel",
    "moe_specs",
    "route",
    "routing_hook",
]
