"""Pipeline parallelism: the stacked layers split into contiguous stages over one mesh axis, the
batch into microbatches that flow through them by a schedule (``shardops.pipeline``).

    layers         every stacked leaf [L, …] → [L_pipe, …]: stage s holds layers
                   s·L/P … (s+1)·L/P − 1 (the rules row ``layers`` → the axis); under the
                   circular schedule its V chunks s, s + P, … of L/(P·V) layers, the stack
                   stored in ``shardops.pipeline.stage_order`` (``Setup.shard`` and
                   ``gather``, checkpoints and the HF loader convert it)
    other params   replicated over the axis (the embedding, the final norm, the head): every
                   stage runs them on every microbatch, and only the first stage's embedding
                   and the last stage's head count; their gradients are summed over the axis
                   once per step
    the batch      replicated over the axis, split into ``microbatches`` (``build``'s)
    the step       ``shardops.pipeline.pipeline_value_and_grad`` by the strategy's schedule
                   (``gpipe``, ``1f1b``, ``circular``): activations sent forward and gradients backward
                   with ``ppermute``, each stage's backward an explicit ``jax.vjp`` of the
                   model's own forward
    a forward      (``setup.logits``, ``evaluate``) the whole batch through the P stages in
                   turn (P·V chunks: V laps), the last stage's output psummed to every stage

**The model is cut where its forward calls ``ctx.scan``**: what runs before (the embedding) is
the first stage's, the stacked layers are split, and what runs after (the norm, the head, the
loss) the last stage's. No model code changes: the stage's layer context
(``models.strategies._stage.StageContext``) runs the model's whole ``apply``, replacing the scan's input by the stage's
input on every stage but the first, running this stage's layers only, and masking what the head
sees on every stage but the last.

**Replicated embedding and head, and their cost.** Every stage holds (and its optimizer
updates) the embedding and the head, and computes them for every microbatch it runs, discarded
but on the first and last stage. Time: a round lasts as long as its busiest stage, and the last
stage computes the head anyway, so the step is no longer; memory: ``V·D`` (twice if untied) on
every stage, beside ``L·D²``-sized layers split P ways. Placing them on the first and last stage
only would need a stage-dependent program (a ``lax.cond`` around collectives) or uneven stages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import shardops
from shardops import entry_axes
from shardops.pipeline import SCHEDULES, pipeline_value_and_grad, schedule, stage_order
from shardops_models.strategies._param import values, wrap
from shardops_models.strategies.fsdp import GATHER_WEIGHTS
from shardops_models.strategies.kind import Kind, LayoutContext, is_spec, role_layout
from shardops_models.strategies.plan import is_shape

_LAST_STAGE = shardops.comm.Reason("pipeline_output", forward={
    "psum": "the last stage over {axis} holds the layers' output: every stage takes it (the "
            "others add 0)",
})  # fmt: skip
_STAGE_OUTPUTS = shardops.comm.Reason("pipeline_stage_outputs", forward={
    "all_gather": "each stage over {axis} holds its layers' outputs (a mixture of experts' "
                  "losses): the forward returns every layer's",
})  # fmt: skip
_NEXT_STAGE = shardops.comm.Reason("pipeline_stage", forward={
    "ppermute": "a stage's output over {axis} is the next stage's input",
})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PipeKind(Kind):
    """Pipeline parallelism over one axis by ``schedule`` (``shardops.pipeline.SCHEDULES``),
    with ``virtual`` stages per stage for the circular one (module docstring)."""

    schedule: str = "1f1b"
    virtual: int = 1

    name: ClassVar[str] = "pp"
    doc: ClassVar[str] = ("the stacked layers split into stages; microbatches sent stage to "
                          "stage by ppermute; other parameters replicated; schedule")  # fmt: skip

    def __post_init__(self):
        super().__post_init__()
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipeKind: schedule must be one of {SCHEDULES}; got "
                             f"{self.schedule!r}")  # fmt: skip
        v = self.virtual
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"PipeKind: virtual (the virtual stages per stage) must be a "
                             f"positive int; got {v!r}")  # fmt: skip
        if v > 1 and self.schedule != "circular":
            raise ValueError(f"PipeKind: virtual={v} with the {self.schedule!r} schedule, whose "
                             f"stages are contiguous; use schedule='circular'")  # fmt: skip

    @property
    def axis(self) -> str:
        return self.axes[0]

    def description(self) -> str:
        return f"{self.doc} {self.schedule}" + (f" (V={self.virtual})" if self.virtual > 1 else "")

    def logical_rules(self) -> dict[str, str]:
        return {"layers": self.axis}

    # --- the step and the forward

    def embed(self, ctx, p, ids):
        """The local lookup (asked last: where no other kind runs it) by ``_stage.lookup``,
        whose gradient each backward phase makes in that phase; None where ``ids`` vary over
        an axis the table does not (the lookup then is ``Parallel``'s own)."""
        from shardops_models.strategies._stage import lookup  # (a cycle)

        table = ctx._arrays(p, "table", "embed")  # table[V, D]
        if not shardops.varying_axes(ids) <= shardops.varying_axes(table):
            return None
        return lookup(table, ids).astype(ctx.precision.compute_dtype)  # x[b, S, D]

    def value_and_grad(self, body, params, x, y):
        """The step's local loss and gradients by the schedule (``shardops.pipeline``): the
        batch ``x, y[b, …]`` in ``body.microbatches`` parts, each a stage of ``body.local_loss`` (``StageContext``)."""
        from shardops_models.strategies._stage import (  # (a cycle)
            StageContext,
            StageExit,
            entry_type,
        )

        m = body.microbatches
        table = schedule(self.schedule, lax.axis_size(self.axis), m, self.virtual)
        inputs = tuple(a.reshape(m, a.shape[0] // m, *a.shape[1:]) for a in (x, y))
        activation = entry_type(body, params, inputs[0][0])
        # Every parameter made ready once for the step (fsdp's AllGather, dp's pcast), and its
        # gradient reduced once after the schedule (ReduceScatter, AllReduce), not per phase.
        ready, reduce = jax.vjp(functools.partial(_ready, body), params)
        stacked = jax.tree.map(lambda q: self.axis in shardops.varying_axes(q), ready)

        def stage_fn(ready, h, microbatch, first, last, with_loss, virtual):
            ctx = StageContext.of(body.ctx, h, first, last, stop=not with_loss, ready=True)
            x, y = microbatch
            try:
                tree, logits, aux = body.forward(ctx, ready, x)
            except StageExit:  # a forward phase: the layers' output is all it needs
                return ctx.outputs[0], None
            targets = body._global_batch(y.shape[0] * m) * math.prod(y.shape[1:])
            loss = body.model.loss_sum(ctx, tree, logits, ctx.local_tokens(y)) / targets
            if not aux:
                return ctx.outputs[0], loss
            _check_own(aux, self.axis)
            # this stage's layers' auxiliary losses (a mixture of experts'): its own share
            return ctx.outputs[0], loss, body._weighted(aux, own=(self.axis,)) / m

        loss, grads = pipeline_value_and_grad(stage_fn, ready, inputs, table,
                                              axis_name=self.axis, activation=activation,
                                              accum_dtype=body.precision.accum_dtype,
                                              chunks=stacked)  # fmt: skip
        (grads,) = reduce(grads)
        return loss, grads

    def scan(self, ctx, fn, params, x, outputs: bool):
        """A forward outside the step (``setup.logits``, ``evaluate``): ``x`` through the
        P·V chunks in turn, turn t's on stage t mod P (its chunk t div P), its output sent to
        the next stage, the last one's psummed to every stage (each stage computes in every
        turn; only its own turn counts)."""
        p, stage, v = lax.axis_size(self.axis), lax.axis_index(self.axis), self.virtual
        h = shardops.comm.copy_to_region(x, self.axis, x.dtype)  # h varying over pipe
        own = [None] * v  # per virtual stage, its layers' outputs
        for t in range(p * v):
            u, r = divmod(t, p)
            chunk = jax.tree.map(
                lambda q, u=u: q[u * (q.shape[0] // v) : (u + 1) * (q.shape[0] // v)], params
            )  # this stage's chunk u of its layers [V·L_c, …]
            y, outs = _pair(ctx.scan_layers(fn, chunk, h, outputs=outputs), outputs)
            if outputs:  # this stage's chunk's outputs are those of its own turn
                own[u] = outs if own[u] is None else jax.tree.map(
                    lambda o, n, r=r: jnp.where(stage == r, n, o), own[u], outs)  # fmt: skip
            if t < p * v - 1:
                h = shardops.comm.send(y, self.axis, [(r, (r + 1) % p)], reason=_NEXT_STAGE)
        y = shardops.comm.all_reduce(jnp.where(stage == p - 1, y, 0), self.axis,
                                     reason=_LAST_STAGE)  # fmt: skip
        if not outputs:
            return y
        order = np.argsort(stage_order(p * v, p, v))  # the chunks in the model's order
        own = jax.tree.map(lambda *chunks: jnp.stack(chunks), *own)  # [V, L_c, …]
        return y, jax.tree.map(  # [P·V, L_c, …] in the stored order → [L, …]
            lambda o: shardops.comm.all_gather(o, self.axis, axis=0, reason=_STAGE_OUTPUTS)
            [order].reshape(-1, *o.shape[2:]), own)  # fmt: skip

    def check_locate(self, strategy) -> None:
        raise ValueError(
            f"shardops.inspect.compare: strategy {strategy.name!r} pipelines the layers over "
            f"{self.axis!r} (pp), and the locator taps each layer inside one device's forward; "
            f"locate the divergence with the strategy without pp"
        )

    # --- checks

    def check_mesh(self, strategy, mesh, context: LayoutContext) -> None:
        """The model stacks its layers (``ctx.scan``), their number divides by the axis (× the
        virtual stages), and the schedule takes ``build``'s microbatches (circular: M
        divisible by P)."""
        schedule(self.schedule, mesh.shape[self.axis], context.microbatches, self.virtual)
        n, found = mesh.shape[self.axis] * self.virtual, False
        for (path, shape), spec in zip(
            jax.tree_util.tree_leaves_with_path(context.shapes, is_leaf=is_shape),
            jax.tree.leaves(role_layout(context), is_leaf=is_spec), strict=True,
        ):  # fmt: skip
            if not spec or self.axis not in entry_axes(spec[0]):
                continue
            found = True
            if shape[0] % n:
                stages = (f"{n} pipeline stages" if self.virtual == 1 else f"{n} chunks "
                          f"({mesh.shape[self.axis]} stages × {self.virtual} virtual stages)")  # fmt: skip
                raise ValueError(
                    f"params{jax.tree_util.keystr(path)}: {shape[0]} layers do not split into "
                    f"{stages} over mesh axis {self.axis!r} of strategy {strategy.name!r} (each "
                    f"holds whole layers). Use a number of layers {n} divides, or a smaller "
                    f"{self.axis!r} axis" + (" or fewer virtual stages" if self.virtual > 1 else "")
                )
        if not found:
            raise ValueError(
                f"strategy {strategy.name!r} pipelines the stacked layers over {self.axis!r} "
                f"(pp), and the model's plan stacks none (models.strategies.plan.stacked, run "
                f"by ctx.scan). Pipeline a model whose blocks are stacked (models.Llama, "
                f"models.Gpt(stacked=True), a Flax module's blocks stacked by nnx.vmap: "
                f"FlaxModel(stacked=...)), or use the strategy without pp"
            )

    def stored_order(self, specs, context: LayoutContext) -> dict[str, tuple[int, ...]]:
        """Under the circular schedule, each stacked leaf in ``stage_order``: stage s's
        contiguous block of dim 0 holds its chunks s, s + P, … in turn."""
        if self.virtual == 1:
            return {}
        p, orders = context.mesh.shape[self.axis], {}
        for (path, shape), spec in zip(
            jax.tree_util.tree_leaves_with_path(context.shapes, is_leaf=is_shape),
            jax.tree.leaves(specs, is_leaf=is_spec), strict=True,
        ):  # fmt: skip
            if not spec or self.axis not in entry_axes(spec[0]):
                continue
            if entry_axes(spec[0]) != (self.axis,):  # the kinds' layouts split dim 0 further
                raise ValueError(
                    f"params{jax.tree_util.keystr(path)}: dim 0 (the layers) is split over "
                    f"{entry_axes(spec[0])}; the circular schedule needs it split over "
                    f"{self.axis!r} alone (each stage's block its V chunks in turn). Keep the "
                    f"other kinds off the layers' dim, or use the 1f1b schedule"
                )
            orders[jax.tree_util.keystr(path)] = stage_order(shape[0], p, self.virtual)
        return orders


def _ready(body, params):
    """``params`` (this device's arrays) made ready for the layers, as ``ctx.unit`` would one
    unit at a time: AllGathered over fsdp's axes (whole weights, not moving activations),
    entered varying over the axes that sum gradients; in the accumulation dtype where gathered.
    Its vjp reduces the gradients (ReduceScatter, AllReduce in float32)."""
    ctx = dataclasses.replace(body.ctx, fsdp_dense=GATHER_WEIGHTS)
    return values(ctx._materialise_all(wrap(params, body.roles, body.specs, body.logical)))


def _check_own(aux, axis: str) -> None:
    """Each auxiliary loss is this stage's own: it comes from its layers' outputs (``ctx.scan
    (outputs=True)``), so it varies over the pipe axis. One that does not (a value every stage
    computes alike) would be counted once per stage."""
    for name, value in sorted(aux.items()):
        if axis not in shardops.varying_axes(value):
            raise ValueError(
                f"pp: the auxiliary loss {name!r} is the same on every pipeline stage over "
                f"{axis!r}, and each stage's auxiliary losses are counted as its own layers' "
                f"share. Compute auxiliary losses from the layers' outputs (ctx.scan(outputs="
                f"True)), or train the model without pp"
            )


def _pair(result, outputs: bool):
    """``scan``'s result as ``(x, outs or None)``."""
    return result if outputs else (result, None)
