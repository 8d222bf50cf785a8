"""The mixture of experts' routing: each token's top-k experts, the slots they take and the
auxiliary losses of what was decided (``route``, ``moe_capacity``, ``MoeRouting``,
``MoeStats``, ``routing_hook``). Local, except the ``"global"`` load balance's one AllReduce
over the batch axes.

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
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from shardops.comm._collectives import all_reduce
from shardops.comm._reasons import Reason
from shardops.layers._moe_arguments import _check_options

_GLOBAL_BATCH = Reason("moe_global_batch", forward={
    "psum": "load_balance='global': expert counts, probability sums and z-loss sums of the "
            "whole batch, whose tokens are split over {axis}",
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
