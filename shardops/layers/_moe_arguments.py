"""The mixture of experts' options and argument checks: the option tuples (``SCORES``,
``LOAD_BALANCE``, ``GROUPED_MATMULS``), the parameter names, and the checks ``moe_kernel``,
``expert_parallel_moe``, ``route`` and ``moe_capacity`` run before they trace anything. Each
error names the argument, what arrived and the fix."""

from __future__ import annotations

import math

from jax.sharding import Mesh

from shardops._mesh import axis_size, varying_axes
from shardops.layers._common import bound_axis_size, check_replicated_over, check_sharded_over

SCORES = ("softmax", "sigmoid")
"""How router logits become probabilities: ``softmax`` over the experts, or each expert's own
``sigmoid``."""
LOAD_BALANCE = ("global", "group")
"""The load-balance loss over the whole batch (``batch_axes`` summed first) or per group."""
GROUPED_MATMULS = ("ragged_dot", "megablox")
"""The dropless path's grouped matmul: ``lax.ragged_dot`` (any backend), or the Pallas TPU
kernels of ``jax.experimental.pallas.ops.tpu.megablox`` (a TPU; interpreted elsewhere)."""
PARAMS = ("router", "gate", "up", "down")


def _check_kernel_args(
    x,
    params,
    k,
    capacity_factor,
    score,
    load_balance,
    expert_axis,
    model_axis,
    batch_axes: tuple,
    grouped_matmul: str,
    sequence_parallel: bool = False,
) -> None:
    """``moe_kernel``'s arguments: the axes bound, the parameters' shapes and layouts, the
    options, ``x`` replicated over the model axis (split along S over it: sequence
    parallelism)."""
    op = "moe_kernel"
    n = 1 if expert_axis is None else bound_axis_size(expert_axis, op)
    for axis in (model_axis, *batch_axes):
        if axis is not None:
            bound_axis_size(axis, op)
    _check_params(op, params)
    router = params["router"]
    e = router.shape[-1] if router.ndim == 2 else 0
    _check_options(op, k, capacity_factor, score, load_balance, e)
    _check_dropless(op, capacity_factor, grouped_matmul, expert_axis, n)
    axes = {a for a in (expert_axis, model_axis, *batch_axes) if a is not None}
    axes |= set().union(*(varying_axes(v) for v in (x, *params.values())))
    if grouped_matmul == "megablox" and axes:
        raise ValueError(
            f"{op}: grouped_matmul='megablox' runs outside shard_map only (its Pallas kernels "
            f"declare no varying mesh axes, which shard_map's check_vma needs), but the layer "
            f"runs over mesh axes {sorted(axes)}; pass grouped_matmul='ragged_dot' (or call "
            f"moe on one device)"
        )
    if model_axis is not None:  # (over the expert axis the router may vary: in a training
        # step it enters varying over the batch axes, where its gradient is summed)
        check_replicated_over(router, model_axis, "params['router']", op)
    for axis in (expert_axis, model_axis):
        if axis is not None:
            for name in ("gate", "up", "down"):
                check_sharded_over(params[name], axis, f"params[{name!r}]", op)
    _check_local(op, x, params, n, expert_axis)
    if sequence_parallel and (model_axis is None or x.ndim != 3):
        raise ValueError(
            f"{op}: sequence_parallel=True splits x[G, S, D] along S over model_axis; got "
            f"model_axis={model_axis!r} and x of shape {x.shape}. Pass the model axis and "
            f"x[G, S_model, D], or sequence_parallel=False"
        )
    if model_axis is not None and not sequence_parallel:
        check_replicated_over(x, model_axis, "x", op)


def _check_layer_axes(op: str, mesh, expert_axis, model_axis, batch_axes: tuple) -> None:
    """The global layer's mesh and axes: each on the mesh, the expert axis one of the batch's,
    the model axis none of them."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{op}: mesh must be a jax.sharding.Mesh (see shardops.make_mesh); got "
                        f"{type(mesh).__name__}")  # fmt: skip
    axis_size(mesh, expert_axis, argument="expert_axis")
    axis_size(mesh, model_axis, argument="model_axis")
    for axis in batch_axes:
        axis_size(mesh, axis, argument="batch_axes")
    if expert_axis is not None and expert_axis not in batch_axes:
        raise ValueError(
            f"{op}: expert_axis={expert_axis!r} must be one of batch_axes={batch_axes}: each "
            f"device on it dispatches its own groups' tokens; pass batch_axes="
            f"{(*batch_axes, expert_axis)} (x split over it along G)"
        )
    if model_axis is not None and (model_axis in batch_axes or model_axis == expert_axis):
        raise ValueError(
            f"{op}: model_axis={model_axis!r} splits the experts' hidden units and must differ "
            f"from expert_axis={expert_axis!r} and batch_axes={batch_axes}; use another mesh axis"
        )


def _axes_tuple(batch_axes) -> tuple:
    return (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)


def _check_options(op: str, k, capacity_factor, score, load_balance, e: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(f"{op}: k={k!r} experts per token must be an int in [1, E = {e}] (the "
                         f"router's experts); choose k between 1 and {e}")  # fmt: skip
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, int | float)
        or not (capacity_factor > 0 and math.isfinite(capacity_factor))
    ):
        raise ValueError(f"{op}: capacity_factor={capacity_factor!r} must be a finite number > 0 "
                         f"(C = ceil(capacity_factor · S · k / E) slots per expert per group) "
                         f"or None (dropless); use 1.0 to 2.0 (1.25 is common), or None")  # fmt: skip
    if score not in SCORES:
        raise ValueError(f"{op}: score={score!r} is not one of {SCORES}; pass 'softmax' "
                         f"(probabilities over the experts) or 'sigmoid'")  # fmt: skip
    if load_balance not in LOAD_BALANCE:
        raise ValueError(f"{op}: load_balance={load_balance!r} is not one of {LOAD_BALANCE}; pass "
                         f"'global' (the whole batch) or 'group' (per group)")  # fmt: skip


def _check_dropless(op: str, capacity_factor, grouped_matmul, expert_axis, n: int) -> None:
    """The grouped matmul is one of ``GROUPED_MATMULS``; dropless experts are not split."""
    if grouped_matmul not in GROUPED_MATMULS:
        raise ValueError(f"{op}: grouped_matmul={grouped_matmul!r} is not one of "
                         f"{GROUPED_MATMULS}; pass 'ragged_dot' (any backend) or 'megablox' "
                         f"(a TPU)")  # fmt: skip
    if capacity_factor is None and n > 1:
        raise ValueError(
            f"{op}: capacity_factor=None (dropless) needs the experts unsplit, but expert_axis="
            f"{expert_axis!r} has size {n}: sending each expert a ragged number of tokens needs "
            f"a ragged AllToAll (lax.ragged_all_to_all), which XLA:CPU, where shardops is "
            f"tested, does not implement; pass expert_axis=None (every expert on every device, "
            f"moe_specs(expert_axis=None)) or a capacity_factor (the capacity path: e.g. 1.25, "
            f"or E / k, which drops nothing)"
        )


def _check_params(op: str, params) -> None:
    if not isinstance(params, dict) or set(params) != set(PARAMS):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"{op}: params must be {{'router', 'gate', 'up', 'down'}} "
                         f"(shardops.init_moe); got {got}")  # fmt: skip


def _check_local(op: str, x, params, n: int, expert_axis) -> None:
    """``x[G, S, D]`` or ``x[T, D]``, ``router[D, E]``, gate and up ``[E/N, D, F']``, down
    ``[E/N, F', D]`` with ``E/N · N = E``."""
    router, gate, up, down = (params[name] for name in PARAMS)
    if x.ndim not in (2, 3):
        raise ValueError(f"{op}: x must be x[G, S, D] (groups) or x[T, D] (one group); got "
                         f"x{tuple(x.shape)}")  # fmt: skip
    d = x.shape[-1]
    if router.ndim != 2 or router.shape[0] != d:
        raise ValueError(f"{op}: params['router'] must be w[D, E] with D = x's features = {d}; "
                         f"got {tuple(router.shape)}")  # fmt: skip
    e = router.shape[1]
    if gate.ndim != 3 or gate.shape != up.shape or gate.shape[1] != d:
        raise ValueError(f"{op}: params['gate'] and params['up'] must both be w[E, D, F] with D "
                         f"= {d}; got gate {tuple(gate.shape)}, up {tuple(up.shape)}")  # fmt: skip
    if gate.shape[0] * n != e:
        where = "" if expert_axis is None else f" per device × {n} devices on {expert_axis!r}"
        raise ValueError(
            f"{op}: params['gate'] holds {gate.shape[0]} experts{where} = {gate.shape[0] * n}, "
            f"but params['router'] has E = {e}; give every projection E/N experts per device "
            f"(split over expert_axis along dim 0: moe_specs(...).params)"
        )
    want = (gate.shape[0], gate.shape[2], d)
    if tuple(down.shape) != want:
        raise ValueError(f"{op}: params['down'] must be w[E, F, D] = {want} to match the gate's "
                         f"{tuple(gate.shape)}; got {tuple(down.shape)}")  # fmt: skip
