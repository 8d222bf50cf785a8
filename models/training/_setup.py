"""``Setup``: what ``build`` returns (sharded state, jitted train and eval steps, budgets, the cost
model), and the checks every call of its functions makes first (the devices, donated buffers,
the batch's shape).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops_models.strategies.parallel import (
    Strategy,
)
from shardops_models.strategies.remat import Remat
from shardops_models.training import _layer_order
from shardops_models.training._placement import (
    Padding,
    _is_spec,
    _layout_name,
    _spans_processes,
    _spec_leaves,
    gather_tree,
    shard_tree,
)
from shardops_models.training._state import TrainState
from shardops_models.training._tokens import (
    _check_tokens,
    _concrete_tokens,
    _vocabularies,
    model_batch,
)


def _renamed(name: str) -> str:
    """The error of ``setup.<name>``, a former name of ``setup.strategy``."""
    return (
        f"setup.{name} is gone: setup.{name} is now setup.strategy (the Strategy); its name is "
        f"setup.strategy.name (one word, one meaning: see docs/migration.md)"
    )


@dataclasses.dataclass(frozen=True)
class Setup:
    """What ``build`` returns. Arrays go in and out laid out by the specs below."""

    strategy: Strategy
    """The ``Strategy``: which mesh axes carry each kind of parallelism, and the mesh axes that
    split the batch; its name (``"dp"``, ``"fsdp_tp"``, …) is ``strategy.name``."""
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
    padding: Padding = None
    """The model's shapes and the stored ones: a dim the tp axis does not divide is stored
    padded with zeros (``Padding``); ``shard`` pads, ``gather`` and checkpoints see the
    model's own shapes."""
    _traces: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """``abstract_step_args``, ``step_jaxpr`` and ``budget`` per (batch, seq): each step is
    traced once."""

    @property
    def layer_order(self) -> tuple | None:
        """The order the stacked layers are stored in (None: the model's; a circular
        pipeline's permuted rows otherwise): arrays of another order are refused."""
        return _layer_order.order_key(self.padding.order) if self.padding else None

    @property
    def sizes(self) -> tuple[int, ...]:
        """The MLP's layer widths."""
        return self.model.sizes

    @property
    def layout(self):
        """Gone: ``setup.strategy`` is the ``Strategy`` (an AttributeError naming it)."""
        raise AttributeError(_renamed("layout"))

    @property
    def composition(self):
        """Gone: ``setup.strategy`` is the ``Strategy`` (an AttributeError naming it)."""
        raise AttributeError(_renamed("composition"))

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
        _layer_order.check(params, None, "setup.shard: params", "shard takes the model's "
                           "order: " + _layer_order.CONVERT)  # fmt: skip
        params = jax.device_get(params)  # host copies: never alias the caller's buffers
        params = self.padding.pad(params)  # the stored shapes (zeros in the padding)
        opt_state = self.optimizer.init(params)
        if self.mesh is None:
            state = TrainState(jax.device_put(params), jax.device_put(opt_state))
        else:
            state = TrainState(shard_tree(params, self.mesh, self.param_specs),
                               shard_tree(opt_state, self.mesh, self.opt_specs))  # fmt: skip
        return _layer_order.mark(state, self.layer_order)

    def gather(self, tree):
        """Full host (numpy) copies of a sharded tree: lossless inverse of ``shard``. A
        ``TrainState`` or a tree shaped like the params (gradients) comes back in the model's
        own shapes (the padding sliced off)."""
        _layer_order.check(tree, self.layer_order, "setup.gather: tree", "Gather it with the "
                           "setup it came from")  # fmt: skip
        return self.padding.unpad_tree(gather_tree(tree), self.optimizer)

    @property
    def batch_multiple(self) -> int:
        """Every batch size must be a multiple of this (the devices the batch is split over);
        a training batch, of this × ``microbatches``."""
        axes = self.strategy.batch_axes
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
                f"mesh axes {self.strategy.batch_axes} (strategy {self.strategy.name!r}); use a "
                f"multiple of {self.batch_multiple}"
            )

    def check_batch(self, x, y=None) -> None:
        """The batch's shapes (the model's own ``check_batch``, a batch the mesh splits), then,
        for a concrete batch (not traced), its token ids and labels inside the vocabulary the
        library knows of (``_check_tokens``): a ValueError naming the array, the token, where
        it is and the fix. ``place_batch`` calls it."""
        _check_batch(self.model, self.strategy, self.mesh, x, y)
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

    def __init__(self, jitted, mesh, name, layer_order=None, nested=None):
        self.jitted, self.mesh, self.name, self.layer_order = jitted, mesh, name, layer_order
        self.nested = jitted if nested is None else nested  # called inside another trace

    def __call__(self, state_or_params, x, *y):
        _check_concrete(self.mesh, self.name)
        first = "state" if self.name == "train_step" else "params"
        # XLA:CPU's Execute crashes the process on a donated buffer: name it first
        check_not_donated(self.name, STATE_DONATED, **{first: state_or_params, "x": x, "y": y})
        if self.mesh is not None:
            shardops.check_devices(self.mesh, self.name, state=state_or_params, x=x, y=y)
        _layer_order.check(state_or_params, self.layer_order, f"setup.{self.name}: {first}",
                           _layer_order.CONVERT)  # fmt: skip
        traced = self.nested is not self.jitted and (any(
            isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((state_or_params, x, y)))
            or _inside_a_trace())  # fmt: skip
        out = (self.nested if traced else self.jitted)(state_or_params, x, *y)
        if self.name in ("train_step", "loss_and_grads"):  # the state; the gradients
            _layer_order.mark(out[0] if self.name == "train_step" else out[1], self.layer_order)
        return out

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.jitted.trace(*args, **kwargs)


def _inside_a_trace() -> bool:
    """Whether JAX is tracing (a jit of closed-over arrays passes no tracer in): inside a
    trace every operation is staged, so a new array is a tracer. Outside, it costs one scalar
    made on a device (a few µs), and only programs compiled with options ask."""
    return isinstance(jnp.zeros((), jnp.int8), jax.core.Tracer)


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


def _check_batch(model, strategy: Strategy, mesh, x, y=None, *, microbatches: int = 1) -> None:
    """The model's own shape check, then a batch (and, under sp, a sequence) that splits."""
    model.check_batch(x, y)
    if strategy.batch_axes:
        shardops.check_divisible(
            argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh,
            axes=strategy.batch_axes,
        )  # fmt: skip
    shards = math.prod(mesh.shape[a] for a in strategy.batch_axes) if strategy.batch_axes else 1
    if (x.shape[0] // shards) % microbatches:
        raise ValueError(
            f"x: each device's batch of {x.shape[0] // shards} rows (batch {x.shape[0]} over "
            f"{shards} devices) does not split into microbatches={microbatches}; use a batch "
            f"size that is a multiple of {shards * microbatches}, or another microbatches"
        )
    for kind in strategy.kinds:
        kind.check_batch(strategy, mesh, x)
