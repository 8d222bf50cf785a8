"""The per-device step every strategy and model shares (``_Body``), run inside one
``jax.shard_map``:

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

import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
from shardops_models.networks import contract
from shardops_models.strategies.parallel import (
    Parallel,
    Strategy,
    wrap,
)
from shardops_models.training._state import Metrics, TrainState

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


class _Body:
    """The per-device step, eval and gradient functions shared by every strategy and model.

    ``local_loss`` is this device's share of the global mean: the model's loss summed over its
    targets, divided by the *global* number of targets, so that the shares add up to the mean
    and the gradients, reduced by the strategy's own collectives, are the mean's.
    """

    def __init__(self, model, strategy, roles, specs, optimizer, remat, precision, fsdp_dense,
                 collective_matmul, opt_param_specs, padding, attention="auto", aux_weights=None,
                 microbatches=1):  # fmt: skip
        self.model, self.strategy, self.optimizer = model, strategy, optimizer
        self.aux_weights, self.microbatches = dict(aux_weights or {}), microbatches
        # The layers mask what lies beyond the model's shapes (only where something is padded).
        self.logical = padding.logical if padding.padded else None
        self.roles, self.precision = roles, precision
        self.specs = specs if specs is not None else jax.tree.map(lambda _: P(), roles)
        self.update = _update_owner(strategy, opt_param_specs, precision)  # None: autodiff's
        self.batch_axes = strategy.batch_axes
        self.reduce_axes = strategy.reduce_axes  # the batch's and the sequence's
        options = {"fsdp_dense": fsdp_dense, "collective_matmul": collective_matmul,
                   "attention_implementation": attention}  # fmt: skip
        self.ctx = Parallel(strategy, precision, remat, **options, microbatches=microbatches)
        self.eval_ctx = Parallel(strategy, precision, remat=False, **options)

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
        contract.check_aux_names(self.aux_weights, aux, self.model, where)
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

    def _weighted(self, aux, own: tuple[str, ...] = ()):
        """Σ weight × auxiliary loss (float32) / the devices the step's loss sum adds over.

        Each loss is a device's value for its tokens; its global value is the mean over the
        devices it differs between (its varying axes) and the ones the loss is added over
        (``reduce_axes``, where a loss the same on every device is then counted once). Axes
        it varies over that the loss sum does not add over (sp's) are averaged here; but
        ``own`` axes, over which each device's value is its own part (a pipeline stage's
        layers' losses), which the caller adds."""
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
            varying = tuple(sorted(set(shardops.varying_axes(value)) - set(self.reduce_axes)
                                   - set(own)))  # fmt: skip
            if varying:
                value = shardops.comm.all_reduce(value, varying, reason=_AUX_LOSS)
            shares = math.prod(lax.axis_size(a) for a in (*self.reduce_axes, *varying))
            total = total + self.aux_weights[name] * value / shares
        return total

    def _value_and_grad(self, params, x, y):
        """The local loss and its gradients, over ``microbatches`` parts of the batch one at a
        time (a ``lax.scan``; the gradients summed in float32, then in the params' dtype)."""
        for kind in self.strategy.kinds:  # a kind that runs the backward itself (pp)
            out = kind.value_and_grad(self, params, x, y)
            if out is not None:
                return out
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
        for kind in reversed(self.strategy.kinds):  # what each kind split of them: tp's first
            logits = kind.gather_logits(logits, model=self.model, params=tree, ctx=self.eval_ctx)
        return logits

    def evaluate(self, params, x, y):
        contract.check_metrics(self.model)
        tree, logits, _ = self.forward(self.eval_ctx, params, x, "setup.evaluate")
        sums = self.model.metrics(self.eval_ctx, tree, logits, self.eval_ctx.local_tokens(y))
        if self.reduce_axes:  # this device's sums → the global batch's: AllReduce of 3 scalars
            sums = shardops.comm.all_reduce(sums, self.reduce_axes, reason=_METRICS)
        return Metrics(*sums)


def _update_owner(strategy: Strategy, opt_param_specs, precision):
    """The one kind's object that owns the step's update (ZeRO-1's), or None: the optimizer
    then updates the parameters from the gradients autodiff reduced."""
    owners = [u for k in strategy.kinds if (u := k.update(opt_param_specs, precision))]
    if len(owners) > 1:
        names = [k.name for k in strategy.kinds if k.update(opt_param_specs, precision)]
        raise ValueError(f"strategy {strategy.name!r}: kinds {names} each own the step's "
                         f"update; at most one may (drop all but one of them)")  # fmt: skip
    return owners[0] if owners else None
