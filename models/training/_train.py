"""One entry point: ``build(strategy, mesh, ...)`` → sharded state, train step and eval step.

Every strategy shares this step; it differs only in its per-device ``forward`` (which holds its
collectives) and its PartitionSpecs. The step runs entirely inside one ``jax.shard_map``:

    local_loss = Σ −one_hot·log_softmax(logits) / (B_global · C)   # this device's share
    loss, grads = value_and_grad(local_loss)                       # grads already reduced*
    loss = psum(loss, batch axes)                                  # the global loss (4 bytes)
    params, opt_state = optax update on local shards

Under a ``precision`` policy the batch is cast to the compute dtype inside the step, matmuls
accumulate in float32, every gradient reduction runs in float32 and the loss and metrics are
computed from float32 logits (``shardops.testing.dtype_flow_violations`` checks all of it).

*Each strategy's forward materialises its parameters with an explicit collective whose transpose
reduces the gradient: ``pcast`` to varying (→ AllReduce over data), ``all_gather`` (→
ReduceScatter), or the TP kernels' own. No further ``psum`` of the gradients is needed, and one
would double-count. The loss is divided by the *global* batch, so the local shares sum to the
seed's mean.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops import entry_axes
from shardops_models.networks import contract
from shardops_models.networks._lm import LanguageModel, check_token_range
from shardops_models.networks._mlp import SEED_SIZES
from shardops_models.networks.contract import check_model
from shardops_models.networks.mlp import Mlp
from shardops_models.strategies.fsdp import check_route
from shardops_models.strategies.kind import LayoutContext
from shardops_models.strategies.parallel import (
    Parallel,
    Strategy,
    strategy_named,
    wrap,
)
from shardops_models.strategies.plan import is_shape, leaf_roles, replicated
from shardops_models.strategies.remat import Remat, check_names, names_made

COLLECTIVE_MATMULS = shardops.layers.COLLECTIVE_MATMULS

# Why the step's own collectives run (shardops.comm.because; explain reads them).
_Reason = shardops.comm.Reason
_GLOBAL_LOSS = _Reason("global_loss", forward={
    "psum": "each device's loss covers its shard of the batch (and of the sequence) over "
            "{axis}: the global loss is their sum",
})  # fmt: skip
_METRICS = _Reason("global_metrics", forward={
    "psum": "each device's metric sums cover its shard of the batch (and of the sequence) over "
            "{axis}: they are added",
})  # fmt: skip
_AUX_LOSS = _Reason("auxiliary_loss_mean", forward={
    "psum": "an auxiliary loss differs between devices that hold different tokens over {axis} "
            "(sequence parallelism): the objective takes their mean",
})  # fmt: skip

INIT_LR = 1.0
DECAY_RATE = 0.95
DECAY_STEPS = 5


def seed_schedule(
    steps_per_epoch: int, *, init_lr=INIT_LR, decay_rate=DECAY_RATE, decay_steps=DECAY_STEPS
) -> optax.Schedule:
    """The seed's ``lr = init_lr · decay_rate^(epoch / decay_steps)``, constant within an epoch.

    As an optax staircase decay: one transition per epoch, each by ``decay_rate^(1/decay_steps)``.
    """
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be ≥ 1; got {steps_per_epoch}")
    return optax.exponential_decay(
        init_lr,
        transition_steps=steps_per_epoch,
        decay_rate=decay_rate ** (1 / decay_steps),
        staircase=True,
    )


def seed_sgd(steps_per_epoch: int, **schedule_kwargs) -> optax.GradientTransformation:
    """The seed's optimizer: plain SGD with ``seed_schedule``."""
    return optax.sgd(seed_schedule(steps_per_epoch, **schedule_kwargs))


class TrainState(NamedTuple):
    params: Any
    opt_state: Any


class Metrics(NamedTuple):
    """Evaluation sums over the labelled targets of a global batch (rows of the MLP, positions
    of the GPT). A padding target (an all-zero one-hot row; a ``PAD_LABEL`` token) counts
    nowhere. Sums, not means, so that chunks of a set add up exactly."""

    loss_sum: jax.Array
    """Σ over labelled targets of the model's loss (float32): the mean loss × count."""
    correct: jax.Array
    """Labelled targets whose arg-max logit is the label (int32)."""
    count: jax.Array
    """Labelled targets (int32)."""

    @property
    def loss(self):
        """The mean loss over the labelled targets (the seed's loss for the MLP)."""
        return self.loss_sum / self.count

    @property
    def accuracy(self):
        return self.correct / self.count


@dataclasses.dataclass(frozen=True)
class Setup:
    """What ``build`` returns. Arrays go in and out laid out by the specs below."""

    strategy: str
    mesh: Mesh | None
    model: Any
    """The model (``models.Mlp``, ``models.Gpt`` or your own): init, plan, apply, loss."""
    plan: Any
    """The plan in use: the tensor-parallel role of every parameter (``models.strategies.plan``)."""
    optimizer: optax.GradientTransformation
    remat: Remat
    """The activation-checkpoint policy of each unit (``build``'s ``remat``, read as a
    ``models.Remat``)."""
    precision: shardops.Precision
    fsdp_dense: str
    """fsdp: per dense layer, gather the weight or move the activations (``build``)."""
    collective_matmul: str | None
    """The tensor-parallel dense kernels' ring option (``build``)."""
    attention: str
    """How each device computes attention (``build``'s ``attention``)."""
    param_specs: Any
    """PartitionSpec tree of the params (None for ``ref``)."""
    opt_specs: Any
    """PartitionSpec tree of the optimizer state, sharded like the params."""
    batch_spec: P
    step: Callable
    """``(state, x, y) → (state, loss)``, not jitted: for ``lax.scan`` inside your own jit."""
    train_step: Callable
    """``step`` jitted, donating ``state``. Every jitted function checks the batch shape when
    it traces, so a bad batch is a ValueError, not an XLA error."""
    loss_and_grads: Callable
    """``(params, x, y) → (loss, grads)``, jitted; ``grads`` laid out like the params."""
    evaluate: Callable
    """``(params, x, y) → Metrics`` (loss and accuracy sums and the target count), jitted,
    global over the batch; padding targets count nowhere."""
    logits: Callable
    """``(params, x) → logits``, jitted, laid out like the batch (the full vocabulary or
    classes: a strategy that splits them gathers the logits at the end)."""
    aux_weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """The weight of each auxiliary loss the model returns (``build``)."""
    microbatches: int = 1
    """The parts each device's batch is split into for the gradient (``build``)."""
    layout: Strategy = None
    """The strategy's layout: which mesh axes carry each kind of parallelism."""
    padding: Padding = None
    """The model's shapes and the stored ones: a dim the tp axis does not divide is stored
    padded with zeros (``Padding``); ``shard`` pads, ``gather`` and checkpoints see the
    model's own shapes."""
    _traces: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """``abstract_step_args``, ``step_jaxpr`` and ``budget`` per (batch, seq): each step is
    traced once."""

    @property
    def sizes(self) -> tuple[int, ...]:
        """The MLP's layer widths."""
        return self.model.sizes

    @property
    def composition(self) -> Strategy:
        """The ``Strategy`` (the layout) that ``strategy`` names: which mesh axes carry each
        kind of parallelism, and the mesh axes that split the batch."""
        return self.layout

    def init(self, key: jax.Array) -> TrainState:
        """The model's reference init (in the policy's param dtype) sharded onto the mesh,
        with a fresh optimizer state."""
        return self.shard(self.model.init(key, dtype=self.precision.param_dtype))

    def shard(self, params) -> TrainState:
        """Place a full (reference) param tree for this strategy, with a fresh optimizer state.

        The state gets buffers of its own (the train step donates them), so ``params`` stays valid.
        Leaves must be in the policy's param dtype (``model.init(key, dtype=...)``).
        """
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            self.precision.check_param(f"params{jax.tree_util.keystr(path)}", leaf.dtype)
        _check_concrete(self.mesh, "shard")
        self.padding.check_logical(params)
        params = jax.device_get(params)  # host copies: never alias the caller's buffers
        params = self.padding.pad(params)  # the stored shapes (zeros in the padding)
        opt_state = self.optimizer.init(params)
        if self.mesh is None:
            return TrainState(jax.device_put(params), jax.device_put(opt_state))
        return TrainState(
            shard_tree(params, self.mesh, self.param_specs),
            shard_tree(opt_state, self.mesh, self.opt_specs),
        )

    def gather(self, tree):
        """Full host (numpy) copies of a sharded tree: lossless inverse of ``shard``. A
        ``TrainState`` or a tree shaped like the params (gradients) comes back in the model's
        own shapes (the padding sliced off)."""
        return self.padding.unpad_tree(gather_tree(tree), self.optimizer)

    @property
    def batch_multiple(self) -> int:
        """Every batch size must be a multiple of this (the devices the batch is split over);
        a training batch, of this × ``microbatches``."""
        axes = self.composition.batch_axes
        return math.prod(self.mesh.shape[a] for a in axes) if axes else 1

    def place_batch(self, x, y=None):
        """Put a global batch ``(x, y)`` (or ``x`` alone) on the mesh, split as the steps expect.

        In a multi-process run every process passes the same global batch and transfers only
        its rows (``process_rows``); ``place_local_batch`` avoids reading the others at all.
        """
        self.check_batch(x, y)
        if self.mesh is not None and _spans_processes(self.mesh):
            rows = self.process_rows(len(x))
            local = (x[rows],) if y is None else (x[rows], y[rows])
            return self.place_local_batch(*local, batch=len(x))
        arrays = (x,) if y is None else (x, y)
        if self.mesh is None:
            placed = tuple(jax.device_put(a) for a in arrays)
        else:
            placed = shard_tree(arrays, self.mesh, (self.batch_spec,) * len(arrays))
        return placed if y is not None else placed[0]

    def process_rows(self, batch: int) -> slice:
        """The rows of a global batch of ``batch`` examples that this process's devices hold.

        ``slice(0, batch)`` in a single process, and wherever the batch is not split (``tp``,
        ``sp``: every device holds it whole). On a data axis spread over processes each
        process feeds its own contiguous block: read only those rows, then
        ``place_local_batch``. Example: data=4 × model=2 over 2 processes of 4 devices →
        process 0 holds rows ``[0, B/2)``, process 1 ``[B/2, B)``.
        """
        if self.mesh is None or not _spans_processes(self.mesh):
            return slice(0, batch)
        self.check_batch_size(batch)
        sharding = NamedSharding(self.mesh, P(*self.batch_spec[:1]))
        blocks = sorted({(i[0].start or 0, batch if i[0].stop is None else i[0].stop)
                         for i in sharding.addressable_devices_indices_map((batch,)).values()})  # fmt: skip
        start, stop = blocks[0][0], blocks[-1][1]
        if sum(b - a for a, b in blocks) != stop - start:
            raise ValueError(
                f"process {jax.process_index()}'s devices hold rows {blocks} of the batch, "
                f"not one contiguous block: order the mesh's devices by process "
                f"(shardops.make_mesh does)"
            )
        return slice(start, stop)

    def place_local_batch(self, x, y=None, *, batch: int):
        """Build the global batch of ``batch`` examples from this process's rows only.

        ``x`` (and ``y``) hold rows ``process_rows(batch)`` of the global batch; the result is
        laid out as ``place_batch``'s (``jax.make_array_from_process_local_data``). In a
        single process ``x`` is the whole batch.
        """
        rows = self.process_rows(batch)
        if len(x) != rows.stop - rows.start:
            raise ValueError(
                f"x has {len(x)} rows; process {jax.process_index()} feeds rows "
                f"[{rows.start}, {rows.stop}) of the global batch of {batch} "
                f"(Setup.process_rows), i.e. {rows.stop - rows.start}"
            )
        if self.mesh is None or not _spans_processes(self.mesh):
            return self.place_batch(x, y)
        # This process's rows, read here: the global arrays below are not all addressable,
        # so the token checks cannot read them (the ids' positions are this process's rows).
        local = tuple(None if a is None else np.asarray(a) for a in (x, y))
        self.model.check_batch(*local)
        self._check_token_range(*local)
        sharding = NamedSharding(self.mesh, self.batch_spec)
        placed = tuple(
            jax.make_array_from_process_local_data(sharding, np.asarray(a), (batch, *a.shape[1:]))
            for a in ((x,) if y is None else (x, y))
        )
        self.check_batch(*placed)
        return placed if y is not None else placed[0]

    def check_batch_size(self, batch: int) -> None:
        if batch % self.batch_multiple:
            raise ValueError(
                f"batch size {batch} does not split over the {self.batch_multiple} devices of "
                f"mesh axes {self.composition.batch_axes} (strategy {self.strategy!r}); use a "
                f"multiple of {self.batch_multiple}"
            )

    def check_batch(self, x, y=None) -> None:
        """The batch's shapes (the model's own ``check_batch``, a batch the mesh splits), then,
        for a concrete batch (not traced), its token ids and labels inside the vocabulary the
        library knows of (``_check_tokens``): a ValueError naming the array, the token, where
        it is and the fix. ``place_batch`` calls it."""
        _check_batch(self.model, self.composition, self.mesh, x, y)
        self._check_token_range(x, y)

    def _check_token_range(self, x, y=None) -> None:
        """``_check_tokens`` of concrete ``x``, ``y`` against the vocabularies found once per
        Setup and batch shape (an abstract trace; one that fails finds none, for that shape)."""
        if any(_concrete_tokens(a) for a in (x, y)):
            key = ("vocabularies", *(None if a is None else (a.shape, a.dtype) for a in (x, y)))
            if key not in self._traces:
                self._traces[key] = _vocabularies(self.model, self.plan, self.precision, x, y)
            _check_tokens(self._traces[key], x=x, y=y)

    def weight_layouts(self) -> dict:
        """Weight name → (global shape, PartitionSpec) of every matrix: the input of
        ``shardops.inspect.layout_png`` for drawing this strategy's weight tiling."""
        if self.mesh is None:
            raise ValueError("the ref strategy has no mesh to draw")
        shapes = jax.eval_shape(self.model.init, jax.random.key(0))
        out = {}
        for (path, leaf), spec in zip(
            jax.tree_util.tree_leaves_with_path(shapes), _spec_leaves(self.param_specs),
            strict=True,
        ):  # fmt: skip
            if leaf.ndim == 2:
                out[_layout_name(path)] = (tuple(leaf.shape), spec)
        return out

    def collective_budget(self, batch: int, seq: int | None = None) -> dict:
        """Bytes V per (collective, mesh axes) that one train step on a global batch of
        ``batch`` examples (of ``seq`` tokens for a sequence model; default its context) asks
        for: ``budget(batch, seq).totals(requested=True)``."""
        if self.mesh is None:
            return {}
        return self.budget(batch, seq).totals(requested=True)

    def budget(self, batch: int, seq: int | None = None) -> shardops.inspect.Ledger:
        """The collectives of one train step, read from its trace (``shardops.inspect.
        traced_ledger``; nothing is compiled, and ``mesh`` may be an ``AbstractMesh``):
        ``requested`` as the program asks, ``collectives`` as XLA:CPU runs them, per pass with
        ``by_pass()``. Every kernel's collectives, the data axis's gathers and reductions, a
        layer of your own and remat's recomputation are all in it, because they are all in the
        program."""
        if self.mesh is None:
            raise ValueError("the ref strategy has no mesh: its step moves nothing")
        key = ("budget", batch, seq)
        if key not in self._traces:
            found = shardops.inspect.jaxpr_collectives(self.step_jaxpr(batch, seq), self.mesh)
            self._traces[key] = shardops.inspect.Ledger(
                self.mesh, shardops.inspect.runs_as(found, "cpu"), tuple(found)
            )
        return self._traces[key]

    def step_jaxpr(self, batch: int, seq: int | None = None):
        """The ``ClosedJaxpr`` of one train step (``abstract_step_args``), traced once."""
        key = ("jaxpr", batch, seq)
        if key not in self._traces:
            self._traces[key] = jax.make_jaxpr(self.step)(*self.abstract_step_args(batch, seq))
        return self._traces[key]

    def abstract_step_args(self, batch: int, seq: int | None = None):
        """``(state, x, y)`` of ``train_step`` as ``jax.ShapeDtypeStruct`` with their
        NamedShardings: what tracing and lowering need, with no array allocated (made once
        per (batch, seq))."""
        key = ("args", batch, seq)
        if key not in self._traces:
            self._traces[key] = self._abstract_step_args(batch, seq)
        return self._traces[key]

    def _abstract_step_args(self, batch: int, seq: int | None):
        self.check_batch_size(batch)
        mesh = self.mesh

        def placed(a, spec):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))

        params = self.padding.abstract(self.precision.param_dtype)  # the stored shapes
        opt_state = jax.eval_shape(self.optimizer.init, params)
        if mesh is None:  # ref: one device, nothing to lay out
            return TrainState(params, opt_state), *model_batch(self.model, batch, seq)
        params = jax.tree.map(lambda s, a: placed(a, s), self.param_specs, params, is_leaf=_is_spec)
        opt_state = jax.tree.map(lambda s, a: placed(a, s), self.opt_specs, opt_state,
                                 is_leaf=_is_spec)  # fmt: skip
        x, y = model_batch(self.model, batch, seq)
        return TrainState(params, opt_state), placed(x, self.batch_spec), placed(y, self.batch_spec)

    def temp_bytes(self, batch: int, seq: int | None = None) -> int:
        """The bytes of temporaries per device of the compiled train step on a global batch of
        ``batch`` examples (of ``seq`` tokens; default the model's context): XLA's
        ``memory_analysis().temp_size_in_bytes``, activations kept for the backward pass
        included, arguments and outputs not. What a ``remat`` policy saves is the difference
        between two Setups' figures. The step is compiled here (once per (batch, seq))."""
        key = ("temp", batch, seq)
        if key not in self._traces:
            compiled = self.train_step.lower(*self.abstract_step_args(batch, seq)).compile()
            self._traces[key] = int(compiled.memory_analysis().temp_size_in_bytes)
        return self._traces[key]

    def cost_model(self, batch: int, seq: int | None = None) -> dict[tuple[str, ...], float]:
        """The analytic bytes each device sends per step over each mesh axis: the ring formulas
        (``shardops.inspect.ring_bytes``) applied to ``collective_budget``."""
        out: dict[tuple[str, ...], float] = {}
        for (kind, axes), nbytes in self.collective_budget(batch, seq).items():
            n = math.prod(self.mesh.shape[a] for a in axes)
            out[axes] = out.get(axes, 0.0) + shardops.inspect.ring_bytes(kind, nbytes, n)
        return out


def build(
    strategy: str | Strategy,
    mesh: Mesh | None = None,
    *,
    optimizer: optax.GradientTransformation,
    model=None,
    sizes: Sequence[int] | None = None,
    plan=None,
    remat: Remat | bool | str | tuple | Callable = False,
    precision: shardops.Precision = shardops.FLOAT32,
    fsdp_dense: str = "auto",
    collective_matmul: str | None = None,
    attention: str = "auto",
    aux_weights: Mapping[str, float] | None = None,
    microbatches: int = 1,
) -> Setup:
    """Train step, eval step and sharding of ``model`` under ``strategy`` on ``mesh``.

    Arguments:
        strategy: a ``Strategy`` (which mesh axes carry each kind of parallelism,
            ``models.strategies.layout``) or a preset's name: ``ref`` (no mesh), ``dp``,
            ``fsdp``, ``tp``, ``sp``, ``2d`` (dp × tp), ``fsdp_tp``, ``dp_sp``, ``fsdp_sp`` on
            ``data × model``; ``hsdp``, ``hsdp_tp``, ``hsdp_sp`` on ``replica × data (× model)``;
            ``zero1``, ``zero1_tp``. Mesh axes a strategy does not name hold replicas.
        mesh: a mesh with the axes the strategy needs (``shardops.make_mesh``), or an
            ``AbstractMesh`` (``shardops.abstract_mesh``) for a Setup that only traces: its
            ``budget`` and ``step_jaxpr`` at any number of devices.
        optimizer: an optax optimizer, e.g. ``seed_sgd(steps_per_epoch)`` or ``optax.adam(1e-3)``.
        model: ``models.Mlp(sizes)`` (the default), ``models.Gpt(...)``, or any object with
            ``init``, ``plan``, ``apply``, ``loss_sum``, ``metrics`` and ``check_batch``.
        sizes: the MLP's layer widths, input first, classes last (shorthand for
            ``model=Mlp(sizes)``).
        plan: the tensor-parallel role of every parameter (a prefix of the parameter tree;
            ``models.strategies.plan``); default ``model.plan()``.
        remat: the activation-checkpoint policy of each unit (``models.Remat``, every
            strategy): ``"none"`` (``False``, the default) keeps every activation; ``"full"``
            (``True``) recomputes the whole unit in the backward pass, and under fsdp
            gathers its weights again; ``"matmuls"`` keeps the dense layers' outputs only; a
            tuple of names (``models.strategies.remat.NAMES``) keeps those activations;
            ``"offload"`` moves the matmul outputs to the host; or a ``jax.checkpoint``
            policy. Under fsdp every policy but ``"none"`` re-gathers the weights.
        precision: ``shardops.FLOAT32``, ``MIXED_BFLOAT16`` (float32 params and optimizer,
            bfloat16 matmuls and activations) or ``BFLOAT16`` (bfloat16 params too). Matmuls
            accumulate, and gradients are reduced, in float32 under all three.
        fsdp_dense: strategies with fsdp: per dense layer, ``"gather_weights"`` (AllGather the
            weight, ReduceScatter its gradient), ``"move_activations"`` (AllToAll the input,
            ReduceScatter the output: the weight never moves), or ``"auto"`` (the default):
            whichever moves fewer bytes for the layer's shapes (``models.strategies.fsdp``).
        collective_matmul: strategies with tp or sp: ``"ring"`` or ``"bidirectional"`` runs
            each dense layer's collective as a ring of ``ppermute`` steps interleaved with
            blocks of the matmul (``shardops.layers.column_parallel_dense_kernel``); None (the
            default) uses XLA's collectives.
        attention: how each device computes attention (``shardops.layers.IMPLEMENTATIONS``):
            ``"auto"`` (the default: Pallas splash on TPU under bf16 where it fits, else the
            blocked online softmax, which never builds the S×S scores), ``"blocked"``,
            ``"splash"``, or ``"einsum"`` (the S×S reference). Context-parallel attention runs
            the blocked path (or the einsum), and so does decoding.
        aux_weights: the weight of each auxiliary loss the model's ``apply`` returns (a
            mixture of experts' load balancing), over the model's own ``aux_weights``; the
            step minimises the mean loss plus each weight × the loss, averaged over the
            devices that hold different tokens (``models.Model``).
        microbatches: the train step and ``loss_and_grads`` split each device's batch into
            this many microbatches, one forward and backward at a time (``lax.scan``), and
            sum their gradients in float32: one pass's gradient to float rounding, with the
            activations of one microbatch alive at a time. Each microbatch's gradients are
            reduced across devices as its backward makes them (k reductions a step). A
            training batch must be a multiple of ``setup.batch_multiple`` × ``microbatches``.
    """
    parallel = strategy_named(strategy)
    model, declared = _model_of(model, sizes)
    weights = contract.aux_weights(declared, aux_weights)
    remat = Remat.of(remat)
    _check_options(parallel, declared, model.name, attention=attention, fsdp_dense=fsdp_dense,
                   collective_matmul=collective_matmul, precision=precision,
                   microbatches=microbatches)  # fmt: skip
    shapes = _shapes(model)
    plan = model.plan() if plan is None else plan
    roles = leaf_roles(plan, shapes)
    context = None
    if not parallel.axes:
        mesh = None
    else:
        context = LayoutContext(mesh, roles, shapes, declared)
        _check_mesh(parallel, mesh, context)
    if remat.names:  # names no layer of the model makes are refused
        check_names(remat, _names_made(model, plan, precision), model.name)
    padding, specs, opt_param_specs = _layout(parallel, shapes, context)
    opt_specs = None if mesh is None else opt_state_specs(optimizer, padding, opt_param_specs)
    batch_spec = P(shardops.spec_entry(*parallel.batch_axes))
    body = _Body(model, parallel, roles, specs, optimizer, remat, precision, fsdp_dense,
                 collective_matmul, opt_param_specs, padding, attention, weights,
                 microbatches)  # fmt: skip

    if mesh is None:
        step, loss_and_grads, evaluate = body.step, body.loss_and_grads, body.evaluate
        logits = body.logits
    else:

        def smap(fn, in_specs, out_specs):
            return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

        state_specs = TrainState(specs, opt_specs)
        step = smap(body.step, (state_specs, batch_spec, batch_spec), (state_specs, P()))
        loss_and_grads = smap(body.loss_and_grads, (specs, batch_spec, batch_spec), (P(), specs))
        evaluate = smap(body.evaluate, (specs, batch_spec, batch_spec), Metrics(P(), P(), P()))
        logits = smap(body.logits, (specs, batch_spec), batch_spec)

    def checked(fn, parts=1):  # shapes are static: a bad batch fails when the function traces
        def run(state_or_params, x, *y):
            _check_batch(model, parallel, mesh, x, *y, microbatches=parts)
            return fn(state_or_params, x, *y)

        return run

    # XLA:CPU expands optimization barriers before a late CSE pass, which then merges remat's
    # backward re-gather into the forward gather, and a second unit's gather of one weight (a
    # tied table) into the first's, keeping the full weights alive after all. With remat keep
    # the barriers in these programs, and under fsdp in the train step (``Parallel.unit``
    # puts one before a weight's second gather); other programs are unaffected.
    # XLA:TPU cannot compile an optimization barrier left in the program ("HLO opt-barrier is
    # not implemented on TPU", measured on a v5e): there the barriers are XLA's own business.
    keep = None if _platform(mesh) == "tpu" else shardops.inspect.KEEP_REMAT
    options = keep if remat else None
    step_options = keep if remat or parallel.fsdp else None

    def jit(fn, name, compiler_options=options, **kwargs):
        parts = microbatches if name in ("train_step", "loss_and_grads") else 1  # split batches
        jitted = jax.jit(checked(fn, parts), compiler_options=compiler_options, **kwargs)
        return _DeviceChecked(jitted, mesh, name)

    # Each checks the params (or state) it is given when it traces, before shard_map does.
    step_of_state = _state_checked(step, padding, "setup.train_step")
    loss_and_grads = _params_checked(loss_and_grads, padding, "setup.loss_and_grads")
    evaluate = _params_checked(evaluate, padding, "setup.evaluate")
    logits = _params_checked(logits, padding, "setup.logits")
    return Setup(
        strategy=parallel.name,
        mesh=mesh,
        model=model,
        plan=plan,
        optimizer=optimizer,
        remat=remat,
        precision=precision,
        fsdp_dense=fsdp_dense,
        collective_matmul=collective_matmul,
        attention=attention,
        aux_weights=weights,
        microbatches=microbatches,
        layout=parallel,
        padding=padding,
        param_specs=specs,
        opt_specs=opt_specs,
        batch_spec=batch_spec,
        step=step,
        train_step=jit(step_of_state, "train_step", step_options, donate_argnums=0),
        loss_and_grads=jit(loss_and_grads, "loss_and_grads"),
        evaluate=jit(evaluate, "evaluate"),
        logits=jit(logits, "logits"),
    )


def _model_of(model, sizes):
    """The model (the MLP of ``sizes`` by default) and what it declares, checked."""
    if model is None:
        model = Mlp(SEED_SIZES if sizes is None else sizes)
    elif sizes is not None:
        raise ValueError("pass either model= or sizes= (the MLP's widths), not both")
    return model, check_model(model)


def _check_options(parallel: Strategy, declared, name: str, *, attention, fsdp_dense,
                   collective_matmul, precision, microbatches) -> None:  # fmt: skip
    """``build``'s options, each valid and fitting the strategy and the model."""
    shardops.layers.check_implementation("build", attention, "attention")
    check_route(fsdp_dense)
    if collective_matmul not in COLLECTIVE_MATMULS:
        raise ValueError(
            f"collective_matmul must be one of {COLLECTIVE_MATMULS}; got {collective_matmul!r}"
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            f"models.build: microbatches must be a positive int (how many parts each "
            f"device's batch is split into, 1 for none); got {microbatches!r}"
        )
    if not isinstance(precision, shardops.Precision):
        raise TypeError(
            f"precision must be a shardops.Precision (FLOAT32, BFLOAT16 or MIXED_BFLOAT16); "
            f"got {precision!r}"
        )
    for kind in parallel.kinds:
        kind.check_model(parallel, declared, name)


def _check_concrete(mesh, what: str) -> None:
    if isinstance(mesh, AbstractMesh):
        raise ValueError(
            f"{what}: this Setup was built on an AbstractMesh {dict(mesh.shape)}, which has no "
            f"devices: it traces (budget, step_jaxpr, abstract_step_args) but cannot run. "
            f"Build it on shardops.make_mesh(...) to run it"
        )


class _DeviceChecked:
    """A jitted function that first checks its concrete arguments live on the setup's mesh
    (``shardops.check_devices``), so a misplaced batch is a shardops error, not XLA's."""

    def __init__(self, jitted, mesh, name):
        self.jitted, self.mesh, self.name = jitted, mesh, name

    def __call__(self, state_or_params, x, *y):
        _check_concrete(self.mesh, self.name)
        first = "state" if self.name == "train_step" else "params"
        # XLA:CPU's Execute crashes the process on a donated buffer: name it first
        check_not_donated(self.name, STATE_DONATED, **{first: state_or_params, "x": x, "y": y})
        if self.mesh is not None:
            shardops.check_devices(self.mesh, self.name, state=state_or_params, x=x, y=y)
        return self.jitted(state_or_params, x, *y)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.jitted.trace(*args, **kwargs)


STATE_DONATED = (
    "train_step donates the state it is given, so the arrays of a state already stepped are "
    "gone. Pass the state (or state.params) the latest train_step returned: state, loss = "
    "setup.train_step(state, x, y); to keep an old one, copy it before the step: "
    "jax.tree.map(jnp.copy, state)"
)


def check_not_donated(op: str, fix: str, **arguments) -> None:
    """A ValueError naming the first array of ``arguments`` (name → array or tree) that was
    deleted or donated to an earlier call, with ``fix``; XLA would be given its freed buffer
    (on CPU that ends the process)."""
    for name, tree in arguments.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            concrete = isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
            if concrete and leaf.is_deleted():
                raise ValueError(
                    f"{op}: {name}{jax.tree_util.keystr(path)} has been deleted or donated to "
                    f"an earlier call. {fix}"
                )


def _check_batch(model, parallel: Strategy, mesh, x, y=None, *, microbatches: int = 1) -> None:
    """The model's own shape check, then a batch (and, under sp, a sequence) that splits."""
    model.check_batch(x, y)
    if parallel.batch_axes:
        shardops.check_divisible(
            argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh,
            axes=parallel.batch_axes,
        )  # fmt: skip
    shards = math.prod(mesh.shape[a] for a in parallel.batch_axes) if parallel.batch_axes else 1
    if (x.shape[0] // shards) % microbatches:
        raise ValueError(
            f"x: each device's batch of {x.shape[0] // shards} rows (batch {x.shape[0]} over "
            f"{shards} devices) does not split into microbatches={microbatches}; use a batch "
            f"size that is a multiple of {shards * microbatches}, or another microbatches"
        )
    for kind in parallel.kinds:
        kind.check_batch(parallel, mesh, x)


def _concrete_tokens(a) -> bool:
    """Whether ``a`` is an integer array whose values can be read here (not a tracer)."""
    return (isinstance(a, np.ndarray | jax.Array) and not isinstance(a, jax.core.Tracer)
            and jnp.issubdtype(a.dtype, jnp.integer))  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class _VocabularyProbe(Parallel):
    """The unsharded layer context, noting the vocabulary of each batch array (``x``, ``y``)
    that reaches ``ctx.embed`` (as the ids) or ``ctx.cross_entropy`` (as the labels) unchanged."""

    inputs: dict = dataclasses.field(default_factory=dict)  # "x", "y" → the traced array
    seen: dict = dataclasses.field(default_factory=dict)  # "x", "y" → [(size, where from)]

    def _note(self, array, size: int, source: str, grow: str) -> None:
        for name, a in self.inputs.items():
            if array is a:
                self.seen.setdefault(name, []).append((int(size), source, grow))

    def embed(self, p, ids):
        table = self._arrays(p, "table", "embed")  # table[V, D], whole (unsharded)
        path = f"params{getattr(p['table'], 'path', '')}"
        self._note(ids, table.shape[0], f"the rows of {path}, the table ctx.embed reads",
                   f"{path} of {{n}} rows")  # fmt: skip
        return super().embed(p, ids)

    def cross_entropy(self, logits, labels, *, split: bool, vocab_size: int | None = None):
        source = (f"the vocab_size={vocab_size} the model passes to ctx.cross_entropy" if vocab_size
                  else "the logits' columns that ctx.cross_entropy reads")  # fmt: skip
        self._note(labels, vocab_size or logits.shape[-1], source, "logits of {n} columns")
        return super().cross_entropy(logits, labels, split=split, vocab_size=vocab_size)


def _vocabularies(model, plan, precision, x, y) -> dict[str, tuple[int, str, str]]:
    """Per batch array (``"x"``, ``"y"``): the vocabulary its values must lie in, as
    ``(size, where it comes from, how to grow it)``; arrays it is not known for are absent.

    A model that declares ``vocab_size`` gets it for both. Else the model's unsharded forward
    and loss are traced abstractly (no compilation) with a context that notes the arrays that
    reach ``ctx.embed`` or ``ctx.cross_entropy`` unchanged. ``models.Gpt`` and ``models.Llama``
    check their own batches (``LanguageModel.check_batch``): nothing more here.
    """
    if isinstance(model, LanguageModel):
        return {}
    declared = contract.declared(model).vocab_size
    if isinstance(declared, int | np.integer) and not isinstance(declared, bool):
        known = (int(declared), f"{type(model).__name__}.vocab_size", "vocab_size={n}")
        return {"x": known, "y": known}
    probe = _VocabularyProbe(strategy_named("ref"), precision)
    roles = leaf_roles(plan, _shapes(model))
    params = jax.eval_shape(functools.partial(model.init, dtype=precision.param_dtype),
                            jax.random.key(0))  # fmt: skip

    def run(params, x, y):
        probe.inputs.update(x=x) if y is None else probe.inputs.update(x=x, y=y)
        tree = wrap(params, roles, jax.tree.map(lambda _: P(), roles))
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(precision.compute_dtype)  # as the step casts it
        logits, _ = model.apply(probe, tree, x)
        return logits if y is None else model.loss_sum(probe, tree, logits, y)

    abstract = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, y)]
    try:
        jax.eval_shape(run, params, *abstract)
    except Exception:  # the train step's own trace reports the model's errors
        return {}
    return {name: min(seen) for name, seen in probe.seen.items()}  # the smallest, if several


def _names_made(model, plan, precision) -> set[str]:
    """The activation names (``checkpoint_name``) the model's unsharded forward makes, read
    from its trace (abstract: nothing is compiled); a remat policy may save these."""
    roles = leaf_roles(plan, _shapes(model))
    params = jax.eval_shape(functools.partial(model.init, dtype=precision.param_dtype),
                            jax.random.key(0))  # fmt: skip
    ctx = Parallel(strategy_named("ref"), precision)
    x, _ = model_batch(model, 1, None)

    def run(params, x):
        tree = wrap(params, roles, jax.tree.map(lambda _: P(), roles))
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(precision.compute_dtype)  # as the step casts it
        return model.apply(ctx, tree, x)

    return names_made(jax.make_jaxpr(run)(params, x))


def _check_tokens(vocabularies: dict, **arrays) -> None:
    """Each concrete integer array of ``arrays`` inside its vocabulary (``_vocabularies``)."""
    for name, a in arrays.items():
        if name in vocabularies and _concrete_tokens(a):
            size, source, grow = vocabularies[name]
            check_token_range(size, vocabulary=source, grow=grow, **{name: a})


def _shapes(model):
    """The parameter tree's global shapes (tuples), from ``model.init`` traced abstractly."""
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    return jax.tree.map(lambda a: tuple(a.shape), abstract)


def _layout(parallel: Strategy, shapes, context: LayoutContext | None) -> tuple[Padding, Any, Any]:
    """The stored shapes (``Padding``), the PartitionSpecs of the params and those of the
    optimizer state's parameter-shaped leaves: each kind's split in turn, the kinds that split
    each layer by its plan role first (tp: a dim its axis does not divide padded up to a
    multiple of it), then the others on the stored shapes (``None`` specs for ``ref``)."""
    if context is None:  # ref: no mesh
        return Padding(shapes, shapes), None, None
    specs = jax.tree.map(replicated, shapes, is_leaf=is_shape)
    stored = shapes
    for kind in sorted(parallel.kinds, key=lambda k: not k.splits_layers):
        specs, stored = kind.layout(specs, stored, context)
    opt_specs = specs
    for kind in parallel.kinds:
        opt_specs = kind.optimizer_layout(opt_specs, stored, context)
    return Padding(shapes, stored), specs, opt_specs


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


def _platform(mesh) -> str:
    """The platform ``mesh``'s devices are on (the default backend's for no or an abstract
    mesh): ``"cpu"``, ``"tpu"``, ``"gpu"``."""
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform
    return jax.default_backend()


@functools.lru_cache(maxsize=64)
def _spans_processes(mesh: Mesh) -> bool:
    """Whether ``mesh`` has devices of other processes (a multi-process run)."""
    here = jax.process_index()
    return any(d.process_index != here for d in mesh.devices.flat)


class _Body:
    """The per-device step, eval and gradient functions shared by every strategy and model.

    ``local_loss`` is this device's share of the global mean: the model's loss summed over its
    targets, divided by the *global* number of targets, so that the shares add up to the mean
    and the gradients, reduced by the strategy's own collectives, are the mean's.
    """

    def __init__(self, model, parallel, roles, specs, optimizer, remat, precision, fsdp_dense,
                 collective_matmul, opt_param_specs, padding, attention="auto", aux_weights=None,
                 microbatches=1):  # fmt: skip
        self.model, self.composition, self.optimizer = model, parallel, optimizer
        self.aux_weights, self.microbatches = dict(aux_weights or {}), microbatches
        # The layers mask what lies beyond the model's shapes (only where something is padded).
        self.logical = padding.logical if padding.padded else None
        self.roles, self.precision = roles, precision
        self.specs = specs if specs is not None else jax.tree.map(lambda _: P(), roles)
        self.update = _update_owner(parallel, opt_param_specs, precision)  # None: autodiff's
        self.batch_axes = parallel.batch_axes
        self.reduce_axes = parallel.reduce_axes  # the batch's and the sequence's
        options = {"fsdp_dense": fsdp_dense, "collective_matmul": collective_matmul,
                   "attention_implementation": attention}  # fmt: skip
        self.ctx = Parallel(parallel, precision, remat, **options)
        self.eval_ctx = Parallel(parallel, precision, remat=False, **options)

    def _inputs(self, x):
        # Features enter in compute dtype; token ids stay integers.
        return (
            x.astype(self.precision.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
        )

    def forward(self, ctx, params, x, where: str = "the loss"):
        """``(tree, logits, aux)``: the wrapped params, and what the model's ``apply`` returns
        (``where``: the caller, for errors)."""
        tree = wrap(params, self.roles, self.specs, self.logical)
        out = self.model.apply(ctx, tree, self._inputs(x))
        logits, aux = contract.split_output(out, self.model, where)
        return tree, logits, aux

    def _global_batch(self, local: int) -> int:
        return local * math.prod(lax.axis_size(a) for a in self.batch_axes)

    def local_loss(self, params, x, y, microbatches: int = 1):
        """This device's share of the objective, for one of ``microbatches`` parts of its
        batch: the loss summed over its targets / the global batch's targets, plus each
        auxiliary loss × its weight / (the devices holding different tokens × microbatches)."""
        tree, logits, aux = self.forward(self.ctx, params, x)
        targets = self._global_batch(y.shape[0] * microbatches) * math.prod(y.shape[1:])
        loss = self.model.loss_sum(self.ctx, tree, logits, self.ctx.local_tokens(y)) / targets
        if aux:
            loss = loss + self._weighted(aux) / microbatches
        return loss

    def _weighted(self, aux):
        """Σ weight × auxiliary loss (float32) / the devices the step's loss sum adds over.

        Each loss is a device's value for its tokens; its global value is the mean over the
        devices it differs between (its varying axes) and the ones the loss is added over
        (``reduce_axes``, where a loss the same on every device is then counted once). Axes
        it varies over that the loss sum does not add over (sp's) are averaged here."""
        total = 0.0
        for name, value in sorted(aux.items()):
            if name not in self.aux_weights:
                raise ValueError(
                    f"the loss: {type(self.model).__name__}.apply returned the auxiliary "
                    f"loss {name!r}, which has no weight (weights given: "
                    f"{sorted(self.aux_weights) or 'none'}); pass models.build(aux_weights="
                    f"{{{name!r}: w}}) or declare it in the model's aux_weights"
                )
            if jnp.shape(value) != () or not jnp.issubdtype(jnp.result_type(value), jnp.floating):
                raise ValueError(
                    f"the loss: auxiliary loss {name!r} must be a float scalar (this "
                    f"device's value); got {jnp.result_type(value)}{tuple(jnp.shape(value))}"
                )
            value = jnp.asarray(value, jnp.float32)
            varying = tuple(sorted(set(shardops.varying_axes(value)) - set(self.reduce_axes)))
            if varying:
                value = shardops.comm.all_reduce(value, varying, reason=_AUX_LOSS)
            shares = math.prod(lax.axis_size(a) for a in (*self.reduce_axes, *varying))
            total = total + self.aux_weights[name] * value / shares
        return total

    def _value_and_grad(self, params, x, y):
        """The local loss and its gradients, over ``microbatches`` parts of the batch one at a
        time (a ``lax.scan``; the gradients summed in float32, then in the params' dtype)."""
        k = self.microbatches
        grad = jax.value_and_grad(functools.partial(self.local_loss, microbatches=k))
        if k == 1:
            return grad(params, x, y)
        parts = [a.reshape(k, a.shape[0] // k, *a.shape[1:]) for a in (x, y)]
        accum = self.precision.accum_dtype

        def one(total, xy):
            loss, g = grad(params, *xy)
            return jax.tree.map(lambda t, gi: t + gi.astype(accum), total, g), loss

        # zeros_like keeps each parameter's varying axes, which its gradient has too
        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=accum), params)
        grads, losses = lax.scan(one, zeros, parts)
        return jnp.sum(losses), jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    def _loss_and_grads(self, params, x, y):
        if self.update:  # zero1: the gradients leave the backward as f32 partial sums
            params = self.update.varying(params)
        loss, grads = self._value_and_grad(params, x, y)
        if self.reduce_axes:  # AllReduce of one f32
            loss = shardops.comm.all_reduce(loss, self.reduce_axes, reason=_GLOBAL_LOSS)
        return loss, grads

    def loss_and_grads(self, params, x, y):
        loss, grads = self._loss_and_grads(params, x, y)
        if self.update:  # the partial sums (f32) → the gradients, laid out like params
            grads = self.update.whole(grads, params)
        return loss, grads

    def step(self, state: TrainState, x, y):
        loss, grads = self._loss_and_grads(state.params, x, y)
        # The optimizer's own collectives (if any) count as the "optimizer" pass in a ledger.
        with jax.named_scope(shardops.inspect.OPTIMIZER_SCOPE):
            if self.update:
                params, opt_state = self.update.update(self.optimizer, state.params,
                                                      state.opt_state, grads)  # fmt: skip
                return TrainState(params, opt_state), loss
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state), loss

    def logits(self, params, x):
        tree, logits, _ = self.forward(self.eval_ctx, params, x, "setup.logits")
        for kind in self.composition.kinds:  # what each kind split of them, gathered
            logits = kind.gather_logits(logits, model=self.model, params=tree, ctx=self.eval_ctx)
        return logits

    def evaluate(self, params, x, y):
        contract.check_metrics(self.model)
        tree, logits, _ = self.forward(self.eval_ctx, params, x, "setup.evaluate")
        sums = self.model.metrics(self.eval_ctx, tree, logits, self.eval_ctx.local_tokens(y))
        if self.reduce_axes:  # this device's sums → the global batch's: AllReduce of 3 scalars
            sums = shardops.comm.all_reduce(sums, self.reduce_axes, reason=_METRICS)
        return Metrics(*sums)


def _update_owner(parallel: Strategy, opt_param_specs, precision):
    """The one kind's object that owns the step's update (ZeRO-1's), or None: the optimizer
    then updates the parameters from the gradients autodiff reduced."""
    owners = [u for k in parallel.kinds if (u := k.update(opt_param_specs, precision))]
    if len(owners) > 1:
        names = [k.name for k in parallel.kinds if k.update(opt_param_specs, precision)]
        raise ValueError(f"strategy {parallel.name!r}: kinds {names} each own the step's "
                         f"update; at most one may (drop all but one of them)")  # fmt: skip
    return owners[0] if owners else None


@dataclasses.dataclass(frozen=True)
class Padding:
    """The model's parameter shapes (``logical``) and the stored ones (``stored``, trees of
    tuples): a dim split over the tp axis that its size does not divide (a vocabulary of 97 on
    4 devices, d_ff = 172 on 8) is stored padded with zeros up to a multiple of it
    (``shardops.padded_size``), and the layers are told the logical size, so the padding
    reaches no output, loss, metric or gradient (``models.strategies.parallel``). Budgets and
    memory count the stored bytes; ``Setup.gather`` and checkpoints see the logical shapes."""

    logical: Any
    stored: Any

    @property
    def padded(self) -> bool:
        """Whether any leaf is stored padded."""
        return jax.tree.leaves(self.logical, is_leaf=is_shape) != jax.tree.leaves(
            self.stored, is_leaf=is_shape)  # fmt: skip

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
        """Model-shaped leaves → stored ones, zero-padded (numpy in, numpy out)."""
        if not self.padded:
            return params
        return jax.tree.map(_pad_to, params, self.stored, is_leaf=_is_array)

    def unpad(self, params):
        """Stored leaves → the model's shapes (any array type; a slice)."""
        if not self.padded:
            return params
        return jax.tree.map(_unpad_to, params, self.logical, is_leaf=_is_array)

    def unpad_tree(self, tree, optimizer):
        """``unpad`` of a ``TrainState`` (its params and the optimizer state's param-shaped
        leaves), of an optimizer state, or of a params-shaped tree; anything else as it is."""
        return self._map_tree(tree, optimizer, _unpad_to, self.logical)

    def pad_tree(self, tree, optimizer):
        """``pad`` of a ``TrainState`` or a params-shaped tree (the inverse of ``unpad_tree``;
        any array type)."""
        return self._map_tree(tree, optimizer, _pad_to, self.stored)

    def _map_tree(self, tree, optimizer, fn, shapes):
        if not self.padded:
            return tree
        if isinstance(tree, TrainState):
            opt_state = optax.tree_map_params(optimizer, fn, tree.opt_state, shapes,
                                              is_leaf=is_shape)  # fmt: skip
            return TrainState(jax.tree.map(fn, tree.params, shapes, is_leaf=_is_array),
                              opt_state)  # fmt: skip
        if jax.tree.structure(tree) == jax.tree.structure(shapes, is_leaf=is_shape):
            return jax.tree.map(fn, tree, shapes, is_leaf=_is_array)
        opt_state = jax.eval_shape(optimizer.init, self.abstract(jnp.float32))
        if jax.tree.structure(tree) == jax.tree.structure(opt_state):
            return optax.tree_map_params(optimizer, fn, tree, shapes, is_leaf=is_shape)
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


def _pad_to(a, shape):
    if tuple(a.shape) == tuple(shape):
        return a
    widths = [(0, s - n) for n, s in zip(a.shape, shape, strict=True)]
    return np.pad(np.asarray(a), widths) if isinstance(a, np.ndarray) else jnp.pad(a, widths)


def _unpad_to(a, shape):
    if tuple(a.shape) == tuple(shape):
        return a
    return a[tuple(slice(0, n) for n in shape)]


def model_batch(model, batch: int, seq: int | None):
    """Abstract ``(x, y)`` of one batch: the MLP's ``x[b, D], y[b, C]``; a sequence model's
    ``ids[b, S], labels[b, S]`` (S: ``seq`` or the model's context)."""
    if contract.declared(model).sequence:
        s = model.context if seq is None else seq
        ids = jax.ShapeDtypeStruct((batch, s), jnp.int32)
        return ids, ids
    sizes = model.sizes
    return (jax.ShapeDtypeStruct((batch, sizes[0]), jnp.float32),
            jax.ShapeDtypeStruct((batch, sizes[-1]), jnp.float32))  # fmt: skip


def _check_mesh(parallel: Strategy, mesh, context: LayoutContext) -> None:
    """A mesh with the strategy's axes, on which each kind can split the model."""
    strategy = parallel.name
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(
            f"strategy {strategy!r} needs a jax.sharding.Mesh with axes {parallel.axes} (see "
            f"shardops.make_mesh; an AbstractMesh traces only); got {type(mesh).__name__}"
        )
    missing = [a for a in parallel.axes if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"strategy {strategy!r} needs mesh axes {parallel.axes}, but the mesh has "
            f"{tuple(mesh.axis_names)} (missing {tuple(missing)}); build it with "
            f"shardops.make_mesh({{{', '.join(f'{a!r}: n' for a in parallel.axes)}}})"
        )
    for kind in parallel.kinds:
        kind.check_mesh(parallel, mesh, context)
