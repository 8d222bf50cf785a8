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
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import shardops
from models import dp, fsdp, fsdp_tp, ref, tp, two_d
from models._layout import COLUMN, gather_tree, opt_state_specs, shard_tree, tp_plan
from models._mlp import SEED_SIZES, check_sizes, cross_entropy_sum, init_mlp

STRATEGIES = {m.NAME: m for m in (ref, dp, tp, two_d, fsdp, fsdp_tp)}
"""Strategy name → module with AXES, BATCH_AXES, param_specs, forward, collective_budget."""

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
    params: list[dict[str, jax.Array]]
    opt_state: Any


class Metrics(NamedTuple):
    """Evaluation sums over the labelled rows of a global batch. A row whose label is all zeros
    is padding (how ``models.training.dataset_metrics`` evens out the last chunk of a set) and
    counts nowhere. Sums, not means, so that chunks of a set add up exactly."""

    loss_sum: jax.Array
    """Σ over labelled rows of ``-Σ_c one_hot · log_softmax / C`` (float32): the seed's loss × count."""
    correct: jax.Array
    """Labelled rows whose arg-max logit is the label (int32)."""
    count: jax.Array
    """Labelled rows (int32)."""

    @property
    def loss(self):
        """The seed's loss ``-mean(one_hot · log_softmax)`` over the labelled rows."""
        return self.loss_sum / self.count

    @property
    def accuracy(self):
        return self.correct / self.count


@dataclasses.dataclass(frozen=True)
class Setup:
    """What ``build`` returns. Arrays go in and out laid out by the specs below."""

    strategy: str
    mesh: Mesh | None
    sizes: tuple[int, ...]
    optimizer: optax.GradientTransformation
    remat: bool
    precision: shardops.Precision
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
    """``(params, x, y) → Metrics`` (loss and accuracy sums and the row count), jitted, global
    over the batch; all-zero label rows are padding and count nowhere."""
    logits: Callable
    """``(params, x) → logits[B, C]``, jitted, laid out like the batch."""

    def init(self, key: jax.Array) -> TrainState:
        """The reference init (``init_mlp``, in the policy's param dtype) sharded onto the mesh,
        with a fresh optimizer state."""
        return self.shard(init_mlp(key, self.sizes, dtype=self.precision.param_dtype))

    def shard(self, params) -> TrainState:
        """Place a full (reference) param tree for this strategy, with a fresh optimizer state.

        The state gets buffers of its own (the train step donates them), so ``params`` stays valid.
        Leaves must be in the policy's param dtype (``init_mlp(..., dtype=...)``).
        """
        for i, layer in enumerate(params):
            for name, leaf in layer.items():
                self.precision.check_param(f"params[{i}][{name!r}]", leaf.dtype)
        params = jax.device_get(params)  # host copies: never alias the caller's buffers
        opt_state = self.optimizer.init(params)
        if self.mesh is None:
            return TrainState(jax.device_put(params), jax.device_put(opt_state))
        return TrainState(
            shard_tree(params, self.mesh, self.param_specs),
            shard_tree(opt_state, self.mesh, self.opt_specs),
        )

    def gather(self, tree):
        """Full host (numpy) copies of a sharded tree: lossless inverse of ``shard``."""
        return gather_tree(tree)

    @property
    def batch_multiple(self) -> int:
        """Every batch size must be a multiple of this (the devices the batch is split over)."""
        axes = STRATEGIES[self.strategy].BATCH_AXES
        return math.prod(self.mesh.shape[a] for a in axes) if axes else 1

    def place_batch(self, x, y=None):
        """Put a global batch ``(x, y)`` (or ``x`` alone) on the mesh, split as the steps expect."""
        self.check_batch(x, y)
        arrays = (x,) if y is None else (x, y)
        if self.mesh is None:
            placed = tuple(jax.device_put(a) for a in arrays)
        else:
            placed = shard_tree(arrays, self.mesh, (self.batch_spec,) * len(arrays))
        return placed if y is not None else placed[0]

    def check_batch(self, x, y=None) -> None:
        check_batch(STRATEGIES[self.strategy], self.mesh, self.sizes, x, y)

    def weight_layouts(self) -> dict:
        """Layer name → (global weight shape, PartitionSpec): the input of
        ``shardops.layout_png`` for drawing this strategy's weight tiling."""
        if self.mesh is None:
            raise ValueError("the ref strategy has no mesh to draw")
        return {
            f"layer {i} w": ((m, n), spec["w"])
            for i, ((m, n), spec) in enumerate(
                zip(itertools.pairwise(self.sizes), self.param_specs, strict=True)
            )
        }

    def collective_budget(self, batch: int) -> dict:
        """Expected bytes V per (collective, mesh axes) of one train step (see each strategy)."""
        module = STRATEGIES[self.strategy]
        return module.collective_budget(
            self.sizes, batch, self.mesh, remat=self.remat, precision=self.precision
        )

    def cost_model(self, batch: int) -> dict[tuple[str, ...], float]:
        """The analytic bytes each device sends per step over each mesh axis: the ring formulas
        (``shardops.ring_bytes``) applied to ``collective_budget``."""
        out: dict[tuple[str, ...], float] = {}
        for (kind, axes), nbytes in self.collective_budget(batch).items():
            n = math.prod(self.mesh.shape[a] for a in axes)
            out[axes] = out.get(axes, 0.0) + shardops.ring_bytes(kind, nbytes, n)
        return out


def build(
    strategy: str,
    mesh: Mesh | None = None,
    *,
    optimizer: optax.GradientTransformation,
    sizes: Sequence[int] = SEED_SIZES,
    remat: bool = False,
    precision: shardops.Precision = shardops.FLOAT32,
) -> Setup:
    """Train step, eval step and sharding for ``strategy`` on ``mesh``.

    Arguments:
        strategy: one of ``STRATEGIES``: ``ref`` (no mesh), ``dp``, ``tp``, ``2d``, ``fsdp``,
            ``fsdp_tp``. Mesh axes a strategy does not use hold replicas.
        mesh: a mesh with the axes the strategy needs (``shardops.make_mesh``).
        optimizer: an optax optimizer, e.g. ``seed_sgd(steps_per_epoch)`` or ``optax.adam(1e-3)``.
        sizes: layer widths, input first, classes last.
        remat: ``fsdp``/``fsdp_tp`` only: re-gather weights in the backward pass.
        precision: ``shardops.FLOAT32``, ``MIXED_BFLOAT16`` (float32 params and optimizer,
            bfloat16 matmuls and activations) or ``BFLOAT16`` (bfloat16 params too). Matmuls
            accumulate, and gradients are reduced, in float32 under all three.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    module = STRATEGIES[strategy]
    sizes = check_sizes(sizes)
    if remat and strategy not in ("fsdp", "fsdp_tp"):
        raise ValueError(
            f"remat re-gathers FSDP weights: it applies to fsdp and fsdp_tp, not {strategy!r}"
        )
    if not isinstance(precision, shardops.Precision):
        raise TypeError(
            f"precision must be a shardops.Precision (FLOAT32, BFLOAT16 or MIXED_BFLOAT16); "
            f"got {precision!r}"
        )
    if strategy == "ref":
        mesh = None
    else:
        _check_mesh(strategy, module, mesh, sizes)
    specs = module.param_specs(sizes, mesh)
    opt_specs = None if mesh is None else opt_state_specs(optimizer, sizes, specs)
    batch_spec = P(shardops.spec_entry(*module.BATCH_AXES))
    body = _Body(module, specs, optimizer, remat, precision)

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

    def checked(fn):  # shapes are static: a bad batch fails when the function traces
        def run(state_or_params, x, *y):
            check_batch(module, mesh, sizes, x, *y)
            return fn(state_or_params, x, *y)

        return run

    # XLA:CPU expands optimization barriers before a late CSE pass, which then merges remat's
    # backward re-gather into the forward gather (keeping the full weights alive after all).
    # With remat, keep the barriers for these programs; other programs are unaffected.
    options = {"xla_disable_hlo_passes": "cse_barrier_expander"} if remat else None

    def jit(fn, name, **kwargs):
        return _DeviceChecked(jax.jit(checked(fn), compiler_options=options, **kwargs), mesh, name)

    return Setup(
        strategy=strategy,
        mesh=mesh,
        sizes=sizes,
        optimizer=optimizer,
        remat=remat,
        precision=precision,
        param_specs=specs,
        opt_specs=opt_specs,
        batch_spec=batch_spec,
        step=step,
        train_step=jit(step, "train_step", donate_argnums=0),
        loss_and_grads=jit(loss_and_grads, "loss_and_grads"),
        evaluate=jit(evaluate, "evaluate"),
        logits=jit(logits, "logits"),
    )


class _DeviceChecked:
    """A jitted function that first checks its concrete arguments live on the setup's mesh
    (``shardops.check_devices``), so a misplaced batch is a shardops error, not XLA's."""

    def __init__(self, jitted, mesh, name):
        self.jitted, self.mesh, self.name = jitted, mesh, name

    def __call__(self, state_or_params, x, *y):
        if self.mesh is not None:
            shardops.check_devices(self.mesh, self.name, state=state_or_params, x=x, y=y)
        return self.jitted(state_or_params, x, *y)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)


def check_batch(module, mesh, sizes, x, y=None) -> None:
    """A global batch ``x[B, sizes[0]]`` (and one-hot ``y[B, sizes[-1]]``) that splits evenly."""
    if x.ndim != 2 or x.shape[1] != sizes[0]:
        raise ValueError(f"x must have shape (batch, {sizes[0]}); got {tuple(x.shape)}")
    if y is not None and tuple(y.shape) != (x.shape[0], sizes[-1]):
        raise ValueError(
            f"labels must be one-hot of shape ({x.shape[0]}, {sizes[-1]}); got {tuple(y.shape)}"
        )
    if module.BATCH_AXES:
        shardops.check_divisible(
            argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh,
            axes=module.BATCH_AXES,
        )  # fmt: skip


class _Body:
    """The per-device step, eval and gradient functions shared by every strategy."""

    def __init__(self, module, specs, optimizer, remat, precision):
        self.module, self.specs, self.optimizer, self.remat = module, specs, optimizer, remat
        self.precision = precision
        self.batch_axes = module.BATCH_AXES

    def forward(self, params, x, *, remat=False):
        return self.module.forward(params, x, self.specs, remat=remat, precision=self.precision)

    def _global_batch(self, local: int) -> int:
        return local * math.prod(lax.axis_size(a) for a in self.batch_axes)

    def local_loss(self, params, x, y):
        logits = self.forward(params, x, remat=self.remat)  # (b, C)
        # This device's share of the global mean over B_global · C.
        return cross_entropy_sum(logits, y) / (self._global_batch(x.shape[0]) * y.shape[-1])

    def loss_and_grads(self, params, x, y):
        loss, grads = jax.value_and_grad(self.local_loss)(params, x, y)
        if self.batch_axes:
            loss = lax.psum(loss, self.batch_axes)  # the global loss: AllReduce of one f32
        return loss, grads

    def step(self, state: TrainState, x, y):
        loss, grads = self.loss_and_grads(state.params, x, y)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state), loss

    def logits(self, params, x):
        return self.forward(params, x)  # (b, C)

    def evaluate(self, params, x, y):
        logits = self.forward(params, x)  # (b, C)
        labelled = jnp.sum(y, -1) > 0  # (b,): all-zero labels are padding
        loss_sum = cross_entropy_sum(logits, y) / y.shape[-1]  # padding rows add 0
        hits = (jnp.argmax(logits, -1) == jnp.argmax(y, -1)) & labelled  # (b,)
        correct = jnp.sum(hits, dtype=jnp.int32)
        count = jnp.sum(labelled, dtype=jnp.int32)
        if self.batch_axes:  # this device's sums → the global batch's: AllReduce of 3 scalars
            loss_sum, correct, count = lax.psum((loss_sum, correct, count), self.batch_axes)
        return Metrics(loss_sum, correct, count)


def _check_mesh(strategy: str, module, mesh, sizes) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"strategy {strategy!r} needs a jax.sharding.Mesh with axes {module.AXES} (see "
            f"shardops.make_mesh); got {type(mesh).__name__}"
        )
    missing = [a for a in module.AXES if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"strategy {strategy!r} needs mesh axes {module.AXES}, but the mesh has "
            f"{tuple(mesh.axis_names)} (missing {tuple(missing)}); build it with "
            f"shardops.make_mesh({{{', '.join(f'{a!r}: n' for a in module.AXES)}}})"
        )
    if shardops.MODEL_AXIS in module.AXES:
        p = mesh.shape[shardops.MODEL_AXIS]
        for i, kind in enumerate(tp_plan(len(sizes) - 1)):
            if kind == COLUMN and sizes[i + 1] % p:
                raise ValueError(
                    f"sizes[{i + 1}] = {sizes[i + 1]} (the output width of layer {i}, "
                    f"column-parallel under {strategy!r}) is not divisible by mesh axis "
                    f"'model' (size {p}); choose a multiple of {p} or a smaller 'model' axis"
                )
