"""The pipeline's per-device program: a schedule's table (``shardops.pipeline.Schedule``) run
round by round inside one ``jax.shard_map``, with explicit per-stage ``jax.vjp`` calls.

    stage s = axis_index(pipe); P = stages, M = microbatches, V = virtual stages,
    K = schedule.buffer_slots
    for each round r of the table (unrolled: the table is static):
      forward phase (where a stage runs one):
        (i, v) = forward[r][s]; keep h_in in slot (v, i mod K) of the buffer h[V·K, ...]
        h_out = stage_fn(params, h_in, inputs[i], virtual=v)   (chunk 0 starts from inputs[i])
        h_in ← send h_out over pipe, s → s + 1 (mod P: a lap's end starts the next lap on
               stage 0), for each stage that ran and not on the last chunk
      backward phase (where a stage runs one):
        (i, v) = backward[r][s]; h = the buffer's slot (v, i mod K)
        (dparams, dh) = vjp(stage_fn at params, h)(dh_out, dloss)   (recomputes the forward)
        dparams accumulated in float32; dh_out ← send dh over pipe, s → s − 1 (mod P), not
        from the first chunk
    loss = psum over pipe of the last stage's losses; dparams of a parameter replicated over
    pipe (the embedding, the head) psummed over it once, in float32

Every device runs every phase of a round that any stage runs (one SPMD program): a stage the
table leaves idle in it computes on a placeholder and its result is masked out (``jnp.where``),
so no collective of the stage's layers sits inside a ``lax.cond`` on the stage index, and the
round takes no longer than its busiest stage. The ``send`` of a phase names only the stages
that ran: each microbatch's activation crosses the P − 1 stage boundaries forward and its
gradient P − 1 backward, and no placeholder is sent.

Memory: each stage keeps the stage inputs of the microbatches in flight (``K`` slots: M under
GPipe, at most 2P − 1 under 1F1B; circular ``V·K`` slots, K = min(M, 2P) a chunk, of which at
most V·P + P − 1 hold inputs at once on stage 0), not the layers' activations: a backward
recomputes its stage's (chunk's) forward (the cost of one more forward per microbatch, as full
rematerialisation). Each phase reads its slot and its microbatch at an index tied to the phase
before it (``_tied``: plus a zero XLA cannot compute before that phase's output), so XLA runs
the phases in the table's order: free, it recomputed every GPipe backward's forward at once
(M microbatches' logits alive) and read each microbatch's labels at the program's start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardops._after import zero_after
from shardops._mesh import varying_axes
from shardops.comm._collectives import all_reduce, send
from shardops.comm._mappings import copy_to_region
from shardops.comm._reasons import Reason
from shardops.pipeline._schedule import Schedule

_FORWARD = Reason("pipeline_forward", forward={
    "ppermute": "each pipeline stage's output over {axis} is the next stage's input",
}, backward={
    "ppermute": "the gradient of a stage's input returns to the stage before it over {axis}",
})  # fmt: skip
_BACKWARD = Reason("pipeline_backward", forward={
    "ppermute": "the gradient of a stage's input goes back to the stage before it over {axis} "
                "(the schedule's backward, run by explicit vjp calls)",
})  # fmt: skip
_LOSS = Reason("pipeline_loss", forward={
    "psum": "only the last stage over {axis} computes each microbatch's loss (every stage its "
            "own layers' auxiliary losses): the stages' shares are added",
})  # fmt: skip
_REPLICATED = Reason("pipeline_replicated_gradients", forward={
    "psum": "parameters replicated over {axis} (the embedding, the head) get gradient "
            "contributions on the first and last stages: summed once per step, in float32",
})  # fmt: skip

FORWARD_SCOPE, BACKWARD_SCOPE = "shardops.pipeline.forward", "shardops.pipeline.backward"
"""The named scopes of each round's forward and backward phase (tests/pipeline counts them)."""


def pipeline_value_and_grad(stage_fn, params, inputs, schedule: Schedule, *, axis_name: str,
                            activation, accum_dtype=jnp.float32, chunks=None):  # fmt: skip
    """One step's loss and gradients by ``schedule``, per device inside ``jax.shard_map`` over
    ``axis_name`` (module docstring).

    Arguments:
        stage_fn: ``stage_fn(params, h, inputs_i, first, last, with_loss, virtual) → (h_out,
            loss)``, one stage's forward of microbatch i: ``h`` the stage's input (``first``, a
            traced bool: the first chunk, which starts from ``inputs_i`` instead), ``h_out``
            what the next stage takes, and ``loss`` the microbatch's share of the objective
            (``last``: the last chunk, whose loss alone counts; the others' and their gradients
            must be finite: a zero seed times an infinite derivative is NaN). A forward phase
            passes ``with_loss=False`` and needs ``h_out`` alone (``loss`` may be None): what
            lies past the layers need not be traced there. It may return a third value,
            ``own``: a share of the objective that every stage computes from its own layers
            (a mixture of experts' auxiliary losses), counted on every stage. ``virtual``: the
            virtual stage v (a traced int32, 0 without virtual stages): the stage runs its
            layers of chunk ``v·P + s`` (a ``circular`` schedule's).
        params: this device's parameters (a pytree): leaves varying over ``axis_name`` are its
            stage's own (its layers ``[L_pipe, …]``: with virtual stages, its V chunks in
            turn, stored in the order ``stage_order`` gives); the others are replicated over
            it.
        inputs: a pytree of ``[M, …]`` arrays, microbatch i at index i (replicated over the
            pipe axis: every stage reads the microbatch it runs).
        schedule: the table (``gpipe``, ``one_f_one_b``, ``circular``), for
            ``lax.axis_size(axis_name)`` stages.
        activation: the type of ``h`` (``jax.typeof`` of one: its shape, dtype and the axes
            it varies over).
        accum_dtype: the gradients' accumulation dtype (float32).
        chunks: with virtual stages, a tree like ``params`` of bools: the leaves that stack
            the stage's V chunks along dim 0 (``[V·L_c, …]``: its layers). ``stage_fn`` of
            virtual stage v then gets chunk v of each (``[L_c, …]``) and the others whole
            (default: every leaf whole, for a ``stage_fn`` that cuts them itself, at the memory
            cost below). Each phase's cut reads its index from the gradients accumulated so
            far, so XLA cannot compute every phase's cut at the program's start and keep them
            all (a chunk's weights per phase: the memory would grow with M); the cut's
            gradient is widened to the whole leaf inside the accumulation's ``lax.cond``, for
            the same reason.

    Returns:
        ``(loss, grads)``: Σ of the microbatches' losses (the same on every stage) and the
        gradients of ``params``, laid out like them (each in its parameter's dtype).
    """
    _check_program(schedule, axis_name, inputs, params, chunks)
    stage = lax.axis_index(axis_name)
    own = jax.tree.map(lambda q: axis_name in varying_axes(q), params)
    params = jax.tree.map(lambda q, o: q if o else copy_to_region(q, axis_name, q.dtype),
                          params, own)  # fmt: skip
    run = _Run(stage_fn, params, inputs, schedule, axis_name, stage, accum_dtype,
               _zeros_like(activation, axis_name), chunks)  # fmt: skip
    for forward, backward in schedule.rounds:
        if any(i is not None for i in forward):
            with jax.named_scope(FORWARD_SCOPE):
                run.forward(forward)
        if any(i is not None for i in backward):
            with jax.named_scope(BACKWARD_SCOPE):
                run.backward(backward)
    loss = run.loss if run.own is None else run.loss + run.own
    loss = all_reduce(loss, axis_name, reason=_LOSS)
    grads = jax.tree.map(
        lambda g, q, o: (g if o else all_reduce(g, axis_name, reason=_REPLICATED)).astype(q.dtype),
        run.grads, params, own,
    )  # fmt: skip
    return loss, grads


class _Run:
    """One device's state between the phases of the rounds: the buffer of stage inputs
    ``h[V·K, ...]``, what the last forward phase sent it (``received``) and the last backward
    phase (``returned``), the gradients (``accum_dtype``) and the loss so far."""

    def __init__(self, stage_fn, params, inputs, schedule, axis_name, stage, accum_dtype, zero,
                 chunks):  # fmt: skip
        self.stage_fn, self.params, self.inputs, self.chunks = stage_fn, params, inputs, chunks
        self.axis_name, self.accum_dtype, self.schedule = axis_name, accum_dtype, schedule
        self.stages, self.slots, self.virtual = (schedule.stages, schedule.buffer_slots,
                                                 schedule.virtual)  # fmt: skip
        self.stage = stage
        self.zero, self.received, self.returned = zero, zero, zero  # h of the activation's type
        self.after = 0  # a zero XLA cannot compute before the last phase's output (``_tie``)
        slots = self.virtual * self.slots
        self.buffer = jnp.zeros((slots, *zero.shape), zero.dtype) + zero[None]  # h[V·K, ...]
        self.grads = jax.tree.map(lambda q: jnp.zeros(q.shape, accum_dtype) + _vary(q, accum_dtype),
                                  params)  # fmt: skip
        self.loss = self.own = None  # their types are stage_fn's
        self.phases = 0  # the phases run so far: each one's barrier is its own

    def _operands(self, h, i):
        """``(params, h, microbatch i)`` behind an optimization barrier: XLA may not merge a
        phase's work (a weight's gather, say) with another phase's, so the compiled program
        runs each phase the table lists, and its collectives are the traced ones."""
        microbatch = jax.tree.map(lambda a: a[self._tied(i, a)], self.inputs)
        self.phases += 1
        return _barrier((self.params, h, microbatch), self.phases)

    def _chunk(self, params, v):
        """``params`` with each leaf ``chunks`` names cut to virtual stage ``v``'s chunk, the
        cut's index tied to that leaf's gradients so far (``_tie``)."""
        if self.chunks is None or self.virtual == 1:
            return params

        def cut(q, g, stacked):
            if not stacked:
                return q
            n = q.shape[0] // self.virtual
            return lax.dynamic_slice_in_dim(q, v * n + _tie(g), n, 0)

        return jax.tree.map(cut, params, self.grads, self.chunks)

    def _ends(self, v):
        """``(first, last)``: whether this stage's chunk on virtual stage ``v`` is the
        pipeline's first (stage 0, v = 0) or last (stage P − 1, v = V − 1)."""
        return ((self.stage == 0) & (v == 0),
                (self.stage == self.stages - 1) & (v == self.virtual - 1))  # fmt: skip

    def _slot(self, i, v):
        """The buffer's slot (v, i mod K), its index tied to the phase before (``_tied``)."""
        return self._tied(v * self.slots + i % self.slots, self.buffer)

    def _tied(self, index, a):
        """``index`` plus ``after`` (a zero XLA cannot compute before the last phase's output,
        ``_tie``), for reading ``a`` at it: the phase's reads, and so all its work, come after
        the phase before it. Not where ``after`` varies over an axis that neither does (under
        sp the ids, replicated over the axis the activations split): that read stays free."""
        if varying_axes(self.after) <= varying_axes(a) | varying_axes(index):
            return index + self.after
        return index

    def _apply(self, params, h, microbatch, v, with_loss: bool = True):
        first, last = self._ends(v)
        out = self.stage_fn(params, h, microbatch, first, last, with_loss, v)
        if with_loss and len(out) == 3:  # ``own`` varying where the loss varies, as ``loss + own``
            # would (its transpose sums ``own``'s gradient over the devices the loss sums)
            h_out, loss, own = out
            out = (h_out, loss, _like(own, loss))
        return out

    def forward(self, phase) -> None:
        """Each stage ``phase`` names keeps its input and runs its layers; the outputs go on."""
        i, v, runs = _entry(self.schedule, phase, self.stage)
        slot = self._slot(i, v)
        old = lax.dynamic_index_in_dim(self.buffer, slot, 0, keepdims=False)
        kept = jnp.where(runs, self.received, old)  # h: what the layers run on (``after``)
        self.buffer = lax.dynamic_update_index_in_dim(self.buffer, kept, slot, 0)
        params, h, microbatch = self._operands(kept, i)
        h_out, _ = self._apply(self._chunk(params, v), h, microbatch, v, with_loss=False)
        self.after = _tie(h_out)
        pairs = self._pairs(phase, +1)
        self.received = (send(h_out, self.axis_name, pairs, reason=_FORWARD) if pairs
                         else self.zero)  # fmt: skip

    def backward(self, phase) -> None:
        """Each stage ``phase`` names runs the vjp of its layers (the forward recomputed from
        the input it kept) and adds the gradients; its input's gradient goes back."""
        i, v, runs = _entry(self.schedule, phase, self.stage)
        h = lax.dynamic_index_in_dim(self.buffer, self._slot(i, v), 0, keepdims=False)
        params, h, microbatch = self._operands(h, i)
        chunk, widen = jax.vjp(lambda q: self._chunk(q, v), params)  # this chunk's parameters
        out, vjp = jax.vjp(lambda q, h: self._apply(q, h, microbatch, v), chunk, h)
        last = self._ends(v)[1]
        h_out, loss, own = (*out, None)[:3]
        seeds = [_like(self.returned, h_out), _seed(last & runs, loss)]
        if own is not None:  # every stage's own share, seeded where it runs
            seeds.append(_seed(runs, own))
            counted = jnp.where(runs, own.astype(self.accum_dtype), 0)
            self.own = counted if self.own is None else self.own + counted
        d_chunk, d_h = vjp(tuple(seeds))
        self.after = _tie(d_h)
        accum = self.accum_dtype
        # Added under a cond on ``runs`` (no collective inside): a fusion boundary, so XLA
        # does not fuse the accumulation across phases and keep each phase's gradients alive;
        # the chunk's gradient is widened to the parameters' shapes inside it.
        self.grads = lax.cond(
            runs,
            lambda g, d: jax.tree.map(lambda a, b: a + b.astype(accum), g, widen(d)[0]),
            lambda g, d: g,
            self.grads, d_chunk,
        )  # fmt: skip
        counted = jnp.where(last & runs, loss.astype(accum), 0)
        self.loss = counted if self.loss is None else self.loss + counted
        pairs = self._pairs(phase, -1)
        self.returned = (send(d_h, self.axis_name, pairs, reason=_BACKWARD) if pairs
                         else self.zero)  # fmt: skip

    def _pairs(self, phase, step: int) -> list[tuple[int, int]]:
        """The sends of ``phase``, a forward's (``step`` +1) or a backward's (−1): from each
        stage that runs to its neighbour s + step mod P, but from the pipeline's last chunk
        forward and its first backward (whose chunk has no neighbour)."""
        p, end = self.stages, (self.virtual - 1 if step > 0 else 0)
        pairs = []
        for s, e in enumerate(phase):
            if e is None:
                continue
            _, v = self.schedule.entry(e)
            edge = s == (p - 1 if step > 0 else 0)  # the lap's end: the wrap to the next lap
            if not (edge and v == end):
                pairs.append((s, (s + step) % p))
        return pairs


def _tie(g):
    """A zero that XLA cannot compute before ``g`` (``shardops._after.zero_after``): the cuts
    and the phases' reads tied to it wait for it."""
    return zero_after(g)


def _barrier(tree, phase: int):
    """``lax.optimization_barrier`` of ``tree``'s leaves, one barrier per set of leaves that
    vary over the same axes (a barrier's outputs vary over the union of its operands' axes),
    each with the ``phase``'s number among its operands: two phases' barriers of the same
    parameters are not one instruction that XLA's CSE could merge."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[frozenset, list[int]] = {}
    for n, leaf in enumerate(leaves):
        groups.setdefault(varying_axes(leaf), []).append(n)
    out = list(leaves)
    for members in groups.values():
        values, _ = lax.optimization_barrier(([leaves[n] for n in members], np.int32(phase)))
        for n, value in zip(members, values, strict=True):
            out[n] = value
    return treedef.unflatten(out)


def _entry(schedule: Schedule, phase, stage):
    """``(i, v, runs)``: the microbatch this device's stage runs in ``phase`` and its virtual
    stage (0 where it runs none), and whether it runs one, each looked up by the traced stage
    index."""
    entries = [schedule.entry(e) or (-1, 0) for e in phase]
    table = jnp.asarray(np.array(entries, np.int32))[stage]  # [2]
    return jnp.maximum(table[0], 0), table[1], table[0] >= 0


def _zeros_like(activation, axis_name: str):
    """Zeros of ``activation``'s shape and dtype, varying over its axes and the pipe axis."""
    zeros = jnp.zeros(activation.shape, activation.dtype)
    manual = getattr(activation, "manual_axis_type", None)
    axes = tuple(sorted({*getattr(manual, "varying", ()), axis_name}))
    return lax.pcast(zeros, axes, to="varying")


def _vary(q, dtype):
    """A scalar zero of ``dtype`` varying over the axes ``q`` varies over (a gradient's
    type)."""
    axes = tuple(sorted(varying_axes(q)))
    zero = jnp.zeros((), dtype)
    return lax.pcast(zero, axes, to="varying") if axes else zero


def _seed(where, value):
    """The cotangent 1 (0 where ``where`` is False) of the scalar ``value``, of its type."""
    return _like(jnp.where(where, 1.0, 0.0).astype(value.dtype), value)


def _like(value, ref):
    """``value`` varying over the axes ``ref`` varies over (a cotangent's type)."""
    missing = tuple(sorted(varying_axes(ref) - varying_axes(value)))
    return lax.pcast(value, missing, to="varying") if missing else value


def _check_program(schedule: Schedule, axis_name: str, inputs, params, chunks) -> None:
    """The pipe axis has the schedule's stages, every input holds its microbatches, and
    ``chunks`` names leaves of ``params`` whose dim 0 splits into the virtual stages."""
    n = lax.axis_size(axis_name)
    if n != schedule.stages:
        raise ValueError(f"pipeline_value_and_grad: schedule {schedule.name!r} has "
                         f"{schedule.stages} stages; mesh axis {axis_name!r} has {n} devices. "
                         f"Make the schedule for {n} stages")  # fmt: skip
    for path, leaf in jax.tree_util.tree_leaves_with_path(inputs):
        if not leaf.shape or leaf.shape[0] != schedule.microbatches:
            raise ValueError(
                f"pipeline_value_and_grad: inputs{jax.tree_util.keystr(path)} has shape "
                f"{leaf.shape}; each input holds the {schedule.microbatches} microbatches "
                f"along dim 0 ([M, ...]). Reshape the batch to [M, b / M, ...]"
            )
    if chunks is None:
        return
    if jax.tree.structure(chunks) != jax.tree.structure(params):
        raise ValueError(f"pipeline_value_and_grad: chunks must be a tree like params (a bool "
                         f"per leaf); got {jax.tree.structure(chunks)} for params' "
                         f"{jax.tree.structure(params)}. Mark each leaf True or False")  # fmt: skip
    for (path, leaf), stacked in zip(jax.tree_util.tree_leaves_with_path(params),
                                     jax.tree.leaves(chunks), strict=True):  # fmt: skip
        if stacked and (not leaf.shape or leaf.shape[0] % schedule.virtual):
            raise ValueError(
                f"pipeline_value_and_grad: params{jax.tree_util.keystr(path)} has shape "
                f"{leaf.shape}; chunks marks it as the stage's {schedule.virtual} chunks stacked "
                f"along dim 0, which must divide by {schedule.virtual}. Stack whole chunks "
                f"([V·L_c, …]), or mark it False"
            )
