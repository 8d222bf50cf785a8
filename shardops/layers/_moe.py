"""Mixture of experts (top-k routing, capacity per group or dropless, SwiGLU experts): per-device
kernel, layer, specs, the unsharded reference and the routing it decides.

Shapes: ``G`` groups (sequences) of ``S`` tokens, model width ``D``, ``E`` experts of hidden
width ``F``, ``k`` experts per token, ``C`` slots per expert per group, ``N`` devices on the
expert axis, ``p`` on the model axis.

    logits = x[G, S, D] · router[D, E]                  → logits[G, S, E] (float32, replicated w)
    top-k of probs = softmax(logits) (or sigmoid)       → chosen experts, weights renormalised
    dispatch[G, S, E, C]: token s fills expert e's next free slot (rank-major, then by s)
    xe[E_X, N·G·C, D] ← AllToAll over X ← xe[E, G·C, D] = dispatch · x          (expert parallel)
    ye = down(silu(xe · gate) ⊙ (xe · up))              → ye[E_X, N·G·C, D]{U_model}
    ye[E, G·C, D] ← AllToAll back;  y[G, S, D] = Σ_{e,c} combine · ye → psum over model

**The routing rule** (``route``). Each row ``g`` of ``x[G, S, D]`` is one capacity group; a
2-D ``x[T, D]`` is one group of T tokens. An expert takes at most
``C = min(S, ceil(capacity_factor · S · k / E))`` tokens of a group (``moe_capacity``; the cap at S
changes nothing: a token chooses an expert at most once). Slots are filled by choice rank,
then by position: every token's first choice before any second choice, and within a rank in
the order of s. A choice that finds its expert's C slots full is dropped (its combine weight
is 0; the residual connection around the layer carries the token). Routing and capacity are
per group, so the result does not depend on the mesh.

**Auxiliary losses** (``MoeStats``). Load balance ``E · Σ_i f_i · P_i`` (Switch/GShard), with
``f_i = count_i / (T·k)`` (``count_i``: assignments to expert i before dropping, T tokens)
and ``P_i`` the mean router probability of expert i. ``load_balance="global"`` (Megatron's
global-batch form): counts, probability sums and T are summed over ``batch_axes`` first, so
every device gets one value for the whole batch. ``"group"`` (GShard): the loss of each group,
averaged over this device's groups, with no communication. The router z-loss (ST-MoE) is the
mean over tokens of ``logsumexp(logits)²``, over the same tokens as the load balance (the
whole batch under ``"global"``, this device's under ``"group"``).

**Dropless** (``capacity_factor=None``): no slots and nothing dropped. This device's T·k
choices are sorted by expert (a stable argsort), each expert applies its SwiGLU to exactly its
rows by grouped matmuls (``lax.ragged_dot``, or the Pallas TPU kernels of megablox with
``grouped_matmul="megablox"``; group sizes = tokens per expert), the outputs return to token
order and are combined with the renormalised weights:

    xs[T·k, D] = x[token of each sorted choice];  group_sizes[E] = choices per expert
    ys = down(silu(xs · gate) ⊙ (xs · up)) by grouped matmuls  → ys[T·k, D]{U_model}
    y[G, S, D] = Σ_k weights[G, S, k] · ys[unsorted] → psum over model

It equals the capacity path at ``capacity_factor ≥ E / k`` (``C = S``) without its padding.
The experts are not split: with an expert axis of size > 1 the tokens per device and expert
are ragged, which needs ``lax.ragged_all_to_all``, not implemented on XLA:CPU where this
library is tested; that combination is refused (``docs/moe.md``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardops._axes import DATA_AXIS
from shardops._mesh import axis_size, check_divisible, spec_entry, varying_axes
from shardops._precision import FLOAT32, Precision, _reduce_to
from shardops.comm._collectives import all_reduce, all_to_all
from shardops.comm._mappings import (
    REPLICATED_INPUT,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_from_region,
)
from shardops.comm._reasons import Reason, because
from shardops.layers._common import (
    bound_axis_size,
    check_precision,
    check_replicated_over,
    check_sharded_over,
    run_layer,
    scoped,
)
from shardops.layers._mlp import _gated, _hidden

SCORES = ("softmax", "sigmoid")
"""How router logits become probabilities: ``softmax`` over the experts, or each expert's own
``sigmoid``."""
LOAD_BALANCE = ("global", "group")
"""The load-balance loss over the whole batch (``batch_axes`` summed first) or per group."""
GROUPED_MATMULS = ("ragged_dot", "megablox")
"""The dropless path's grouped matmul: ``lax.ragged_dot`` (any backend), or the Pallas TPU
kernels of ``jax.experimental.pallas.ops.tpu.megablox`` (a TPU; interpreted elsewhere)."""
PARAMS = ("router", "gate", "up", "down")

_DISPATCH = Reason("moe_dispatch", forward={
    "all_to_all": "each device's tokens go to the devices holding their experts (experts are "
                  "split over {axis}): block j of xe[E, G·C, D] to device j",
}, backward={
    "all_to_all": "the transpose of the dispatch: the tokens' gradients return to their devices",
})  # fmt: skip
_RETURN = Reason("moe_return", forward={
    "all_to_all": "the experts' outputs return over {axis} to the devices their tokens came from",
}, backward={
    "all_to_all": "the transpose of the return: dy's slots go to the devices of their experts",
})  # fmt: skip
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
_GLOBAL_BATCH = Reason("moe_global_batch", forward={
    "psum": "load_balance='global': expert counts, probability sums and z-loss sums of the "
            "whole batch, whose tokens are split over {axis}",
})  # fmt: skip
_STATS = Reason("moe_layer_stats", forward={
    "psum": "the layer's statistics (tokens per expert, drops, per-group losses) over the batch "
            "split over {axis}",
})  # fmt: skip


class MoeStats(NamedTuple):
    """What routing did and its auxiliary losses (a pytree).

    ``load_balance``: ``E · Σ_i f_i · P_i`` (float32 scalar; 1 when balanced);
    ``z_loss``: mean of ``logsumexp(logits)²`` (float32 scalar);
    ``tokens_per_expert[E]``: assignments before dropping; ``dropped[E]``: assignments
    dropped at capacity (float32 counts over this device's groups in the kernel, over the
    whole batch from ``expert_parallel_moe``)."""

    load_balance: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped: jax.Array


class MoeRouting(NamedTuple):
    """``route``'s decisions for ``x[G, S, D]``: ``dispatch[G, S, E, C]`` (bool: token s of
    group g sits in slot c of expert e), ``combine[G, S, E]`` (the renormalised weight of each
    kept choice, 0 elsewhere), ``chosen[G, S, E]`` (1.0 per choice, before dropping), and the
    float32 ``logits`` and ``probs[G, S, E]``."""

    dispatch: jax.Array
    combine: jax.Array
    chosen: jax.Array
    logits: jax.Array
    probs: jax.Array


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


def moe_capacity(group_size: int, k: int, num_experts: int, capacity_factor: float | None) -> int:
    """Slots per expert per group: ``C = min(S, ceil(capacity_factor · S · k / E))``; ``S`` for
    ``capacity_factor=None`` (dropless: every choice kept). Always ≥ 1: the arguments the layer
    refuses (``k`` outside ``[1, E]``, a factor ≤ 0 or not finite, a group of no tokens) raise
    the layer's ``ValueError``."""
    for name, n, what in (("group_size", group_size, "the tokens of a capacity group"),
                          ("num_experts", num_experts, "the router's experts")):  # fmt: skip
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(
                f"moe_capacity: {name}={n!r} must be a positive int ({what}); pass at least 1"
            )
    _check_options("moe_capacity", k, capacity_factor, "softmax", "global", num_experts)
    if capacity_factor is None:
        return group_size
    return min(group_size, math.ceil(capacity_factor * group_size * k / num_experts))


def _top_k(groups, router, k: int, score: str):
    """``(logits, probs[G, S, E]`` float32, ``top_i[G, S, k]``, ``weights[G, S, k])``: each
    token's k best experts, best first, and their probabilities renormalised over the k."""
    logits = jnp.einsum("gsd,de->gse", groups.astype(jnp.float32), router.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST)  # logits[G, S, E] in float32  # fmt: skip
    probs = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    top_p, top_i = lax.top_k(probs, k)  # [G, S, k]: best first
    hook = getattr(_ROUTING_HOOK, "fn", None)
    if hook is not None:  # routing_hook: the choices seen, or replaced
        chosen = hook(probs, top_i)  # [G, S, k] int32
        if jax.typeof(chosen) != jax.typeof(top_i):
            raise ValueError(f"routing_hook: the hook must return the choices as it got them, "
                             f"{jax.typeof(top_i)}; got {jax.typeof(chosen)}: return int32 "
                             f"expert indices of top_i's shape, e.g. lax.top_k(probs, k)[1]")  # fmt: skip
        top_i, top_p = chosen, jnp.take_along_axis(probs, chosen, axis=-1)  # [G, S, k]
    weights = top_p / jnp.sum(top_p, axis=-1, keepdims=True)  # [G, S, k], renormalised over k
    return logits, probs, top_i, weights


_ROUTING_HOOK = threading.local()


@contextlib.contextmanager
def routing_hook(fn: Callable):
    """While active, every MoE layer traced (``route``, ``moe_kernel`` and the layers over
    them) hands its choices to ``fn(probs, top_i) → top_i`` and routes by what ``fn`` returns:
    ``probs[G, S, E]`` float32 and ``top_i[G, S, k]`` int32 (best first), inside ``shard_map``
    this device's groups. The weights are then ``probs`` at the returned experts, renormalised;
    slots and drops follow from the returned choices as from the router's own.

    For instruments, not for training: ``fn`` may record the choices (``jax.debug.callback``)
    or replace them, e.g. route an unsharded reference by a sharded run's choices so that a
    float near-tie that one run breaks the other way cannot flip an expert
    (``examples/transformer_lm.py --moe --compare-reference``). Read when a function is
    traced: a jitted function traced before (or after) the ``with`` keeps its own routing."""
    previous = getattr(_ROUTING_HOOK, "fn", None)
    _ROUTING_HOOK.fn = fn
    try:
        yield
    finally:
        _ROUTING_HOOK.fn = previous


def route(
    x, router, *, k: int, capacity_factor: float | None, score: str = "softmax"
) -> MoeRouting:
    """The routing of ``x[G, S, D]`` (or ``x[T, D]``, one group) by ``router[D, E]``: top-k
    experts per token, slots by choice rank then position (module docstring);
    ``capacity_factor=None``: ``C = S``, nothing dropped (the dropless layer's decisions).
    Local: no communication. Returns ``MoeRouting`` with a leading G (1 for a 2-D ``x``)."""
    _check_options("route", k, capacity_factor, score, "global", router.shape[-1])
    groups = x if x.ndim == 3 else x[None]  # x[G, S, D]
    g, s, _ = groups.shape
    e = router.shape[-1]
    c = moe_capacity(s, k, e, capacity_factor)
    logits, probs, top_i, weights = _top_k(groups, router, k, score)
    choice = jax.nn.one_hot(top_i, e, dtype=jnp.int32)  # [G, S, k, E]
    rank_major = (0, 2, 1, 3)  # [G, S, k, E] ↔ [G, k, S, E]: all first choices, then seconds
    queue = jnp.transpose(choice, rank_major)  # [G, k, S, E], in the order slots are filled
    position = jnp.cumsum(queue.reshape(g, k * s, e), axis=1).reshape(queue.shape) - 1
    position = jnp.transpose(position, rank_major)  # [G, S, k, E]: each choice's place in line
    kept = (choice == 1) & (position < c)  # [G, S, k, E]
    slot = jax.nn.one_hot(jnp.sum(position * choice, axis=-1), c)  # [G, S, k, C] (full: 0)
    dispatch = jnp.einsum("gske,gskc->gsec", kept.astype(jnp.float32), slot,
                          precision=lax.Precision.HIGHEST) > 0  # [G, S, E, C]  # fmt: skip
    combine = jnp.sum(kept * weights[..., None], axis=2)  # [G, S, E]: exact, not a matmul
    chosen = jnp.sum(choice, axis=2).astype(jnp.float32)  # [G, S, E]
    return MoeRouting(dispatch, combine, chosen, logits, probs)


def _stats(routing: MoeRouting, k: int, load_balance: str, batch_axes: tuple) -> MoeStats:
    """``MoeStats`` of this device's groups; ``"global"`` sums over ``batch_axes`` first. A
    routing without ``dispatch`` (None: the dropless layer's) dropped nothing."""
    _, s, e = routing.chosen.shape
    tokens_per_expert = jnp.sum(routing.chosen, axis=(0, 1))  # [E], before dropping
    if routing.dispatch is None:  # dropless
        dropped = jnp.zeros_like(tokens_per_expert)  # [E]
    else:
        dropped = tokens_per_expert - jnp.sum(routing.dispatch, axis=(0, 1, 3))  # [E]
    z = jax.nn.logsumexp(routing.logits, axis=-1) ** 2  # [G, S]
    if load_balance == "global":
        counts, prob_sums, z_sum = tokens_per_expert, jnp.sum(routing.probs, (0, 1)), jnp.sum(z)
        if batch_axes:  # the whole batch's counts: every device gets the same loss
            sums = all_reduce((counts, prob_sums, z_sum), batch_axes, reason=_GLOBAL_BATCH)
            counts, prob_sums, z_sum = sums
        tokens = jnp.sum(counts) / k  # T: each token makes k choices
        balance = e * jnp.sum((counts / (tokens * k)) * (prob_sums / tokens))
        z_loss = z_sum / tokens
    else:  # per group (GShard), averaged over this device's groups
        f = jnp.sum(routing.chosen, axis=1) / (s * k)  # f[G, E]
        balance = jnp.mean(e * jnp.sum(f * jnp.mean(routing.probs, axis=1), axis=-1))
        z_loss = jnp.mean(z)
    return MoeStats(balance, z_loss, tokens_per_expert, dropped)


def _experts(xe, params, activation, precision: Precision):
    """Every local expert's SwiGLU on its slots: ``xe[E', T, D] → ye[E', T, D]`` in accum
    (partial sums over the model axis when F is split), batched over the experts."""
    hidden = functools.partial(_hidden, activation=activation, precision=precision)
    h = jax.vmap(hidden)(xe, {"gate": {"w": params["gate"]}, "up": {"w": params["up"]}})
    return jax.vmap(precision.matmul)(h, params["down"])  # ye[E', T, D] in accum


# --- the dropless path: tokens sorted by expert, grouped matmuls --------------------------------


def _grouped_dot(how: str, x_c, w_c, group_sizes, accum, precision):
    """``y[M, N]``: rows ``x_c[M, K]`` of group i (``group_sizes[i]`` rows, in order) times
    ``w_c[i, K, N]``, accumulated in ``accum``."""
    if how == "megablox":
        return _megablox().gmm(x_c, w_c, group_sizes, accum, _tiling(x_c.shape[0], *w_c.shape[1:]),
                                interpret=_interpret())  # fmt: skip
    return lax.ragged_dot(x_c, w_c, group_sizes, precision=precision, preferred_element_type=accum)


def _grouped_dot_rhs_t(how: str, g_c, w_c, group_sizes, accum, precision):
    """``dx[M, K]``: rows ``g_c[M, N]`` of group i times ``w_c[i, K, N]ᵀ``."""
    if how == "megablox":
        return _megablox().gmm(g_c, w_c, group_sizes, accum, _tiling(g_c.shape[0], *w_c.shape[2:0:-1]),
                                transpose_rhs=True, interpret=_interpret())  # fmt: skip
    return lax.ragged_dot(g_c, jnp.swapaxes(w_c, 1, 2), group_sizes, precision=precision,
                          preferred_element_type=accum)  # fmt: skip


def _grouped_outer(how: str, x_c, g_c, group_sizes, accum, precision):
    """``dw[E, K, N]``: ``dw[i] = x_c[rows of i]ᵀ · g_c[rows of i]`` (the contraction ragged)."""
    e = group_sizes.shape[0]
    if how == "megablox":
        m, k_dim, n = x_c.shape[0], x_c.shape[1], g_c.shape[1]
        return _megablox().tgmm(x_c.swapaxes(0, 1), g_c, group_sizes, accum, _tiling(m, k_dim, n),
                                 num_actual_groups=e, interpret=_interpret())  # fmt: skip
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[])  # fmt: skip
    return lax.ragged_dot_general(x_c, g_c, group_sizes, dims, precision=precision,
                                  preferred_element_type=accum)  # fmt: skip


def _megablox():
    """JAX's Pallas TPU grouped matmuls (imported when asked for)."""
    import importlib  # the package's name ``gmm`` is a function: the module by its path

    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _tiling(m: int, k_dim: int, n: int) -> tuple[int, int, int]:
    """megablox's tiles: rows by 512, features by the largest of 1024, 512, 256, 128 that
    divides them (MaxText's sizes), or a whole dimension that none divides (small tests)."""

    def tile(dim, sizes):
        return next((t for t in sizes if dim % t == 0), dim)

    features = (1024, 512, 256, 128)
    return tile(m, (512, 256, 128)), tile(k_dim, features), tile(n, features)


def _interpret() -> bool:
    """megablox's Pallas kernels compile for a TPU; elsewhere they run interpreted (tests)."""
    return jax.default_backend() != "tpu"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _grouped_matmul(how, compute, accum, precision, x, w, group_sizes):
    """``y[M, N]`` = rows of ``x[M, K]`` grouped by ``group_sizes[E]`` times ``w[E, K, N]``:
    operands in ``compute``, accumulated and returned in ``accum``; the backward's products
    in ``compute`` too (as ``Precision.matmul``'s)."""
    return _grouped_dot(how, x.astype(compute), w.astype(compute), group_sizes, accum, precision)


def _grouped_matmul_fwd(how, compute, accum, precision, x, w, group_sizes):
    x_c, w_c = x.astype(compute), w.astype(compute)  # residuals in compute_dtype
    y = _grouped_dot(how, x_c, w_c, group_sizes, accum, precision)
    # empty slices carry x's and w's dtypes and varying mesh axes into the backward pass
    return y, (x_c, w_c, group_sizes, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _grouped_matmul_bwd(how, compute, accum, precision, residuals, g):
    x_c, w_c, group_sizes, x_kind, w_kind = residuals
    g_c = g.astype(compute)  # g[M, N]
    dx = _grouped_dot_rhs_t(how, g_c, w_c, group_sizes, accum, precision)  # dx[M, K] in accum
    dw = _grouped_outer(how, x_c, g_c, group_sizes, accum, precision)  # dw[E, K, N] in accum
    dx, dw = _reduce_to(dx, x_kind), _reduce_to(dw, w_kind)  # over axes only g varies over
    return dx.astype(x_kind.dtype), dw.astype(w_kind.dtype), None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _grouped_experts(xs, group_sizes, params, activation, precision: Precision, how: str):
    """Every expert's SwiGLU on its rows of ``xs[M, D]`` (grouped by expert, ``group_sizes[E]``
    rows each): ``ys[M, D]`` in accum, partial sums over the model axis when F is split."""
    mm = functools.partial(_grouped_matmul, how, precision.compute_dtype, precision.accum_dtype,
                           precision.matmul_precision)  # fmt: skip
    gate = mm(xs, params["gate"], group_sizes)  # gate[M, F/p] in accum
    up = mm(xs, params["up"], group_sizes)  # up[M, F/p] in accum
    h = jax.checkpoint(_gated, static_argnums=(2, 3))(gate, up, activation, precision)  # h[M, F/p]
    return mm(h, params["down"], group_sizes)  # ys[M, D] in accum {U_model}


def _dropless(x_region, top_i, weights, params, activation, precision: Precision, how: str):
    """``y[G, S, D]`` (accum, ``{U_model}`` when F is split): each of the T·k choices of
    ``top_i[G, S, k]`` sorted by expert, the experts applied by grouped matmuls (every choice
    its expert, none dropped), the outputs put back in token order and combined with
    ``weights[G, S, k]``."""
    g, s, d = x_region.shape
    k, e = top_i.shape[-1], params["gate"].shape[0]
    expert = top_i.reshape(g * s * k)  # [T·k]: each choice's expert, token-major
    order = jnp.argsort(expert, stable=True)  # [T·k]: the choices sorted by expert
    group_sizes = jnp.bincount(expert, length=e).astype(jnp.int32)  # [E]: tokens per expert
    xs = x_region.reshape(g * s, d)[order // k]  # xs[T·k, D] in accum, grouped by expert
    ys = _grouped_experts(xs, group_sizes, params, activation, precision, how)  # ys[T·k, D]
    unsort = jnp.argsort(order)  # [T·k]: where each choice sits among the sorted
    ye = ys[unsort].reshape(g, s, k, d)  # ye[G, S, k, D]: choice j of token s back in place
    # in float32 on every backend, as the capacity path's combine
    return jnp.einsum("gsk,gskd->gsd", weights, ye, precision=lax.Precision.HIGHEST)


def _capacity(x_region, dispatch, weights, params, expert_axis, activation, precision: Precision):
    """``y[G, S, D]`` (accum, ``{U_model}`` when F is split) by the capacity-padded dispatch
    ``dispatch[G, S, E, C]``, the AllToAlls over ``expert_axis`` and the combine ``weights[G,
    S, E]``."""
    g, _, d = x_region.shape
    e, c = dispatch.shape[2:]
    accum, compute = precision.accum_dtype, precision.compute_dtype
    mm = precision.matmul_precision
    dispatch = dispatch.astype(accum)  # [G, S, E, C]: 0/1, so the einsum is exact
    xe = jnp.einsum("gsec,gsd->egcd", dispatch, x_region, precision=mm)  # xe[E, G, C, D]
    xe = xe.astype(compute).reshape(e, g * c, d)  # xe[E, G·C, D]
    if expert_axis is not None:  # block j (experts j·E/N…) to device j; sources concatenated
        xe = all_to_all(xe, expert_axis, split_axis=0, concat_axis=1, reason=_DISPATCH)
    ye = _experts(xe, params, activation, precision)  # ye[E/N, N·G·C, D] in accum {U_model}
    if expert_axis is not None:  # each source's slots back, the experts in order
        ye = all_to_all(ye, expert_axis, split_axis=1, concat_axis=0, reason=_RETURN)
    ye = ye.reshape(e, g, c, d)  # ye[E, G, C, D]
    combine = dispatch * weights[..., None]  # [G, S, E, C]
    # in float32 on every backend (a TPU's DEFAULT would round the weights and ye to bf16)
    return jnp.einsum("gsec,egcd->gsd", combine, ye, precision=lax.Precision.HIGHEST)


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


# --- checks -----------------------------------------------------------------------------------


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
