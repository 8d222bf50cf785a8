"""The per-device layer context through which a model's forward runs, for any strategy (a
layout of kinds of parallelism over named mesh axes, ``models.strategies.layout``).

A model's forward is written once against ``Parallel`` (the context): it runs each group of
parameters (a *unit*: a layer, a transformer block) through ``ctx.unit(fn, params, x)``,
which materialises them for the data-parallel axes (``pcast`` over the dp axes, AllGather over
the fsdp axes, recomputed in the backward pass under remat; zero1's parameters arrive varying
already), and calls layers as ``ctx.dense(p, x)``, ``ctx.embed``,
``ctx.attention``, ``ctx.layer_norm``, ``ctx.cross_entropy``. The *plan* (``models.strategies.plan``)
gives each parameter its role, and the role picks the kernel: a ``column`` dense under ``tp``
is ``shardops.layers.column_parallel_dense_kernel``, under ``dp`` it is ``shardops.dense``. The
collective budget of any model is read from its traced step (``Setup.budget``): the kernels'
own collectives are the only record of what a layer moves.

Under context parallelism (``Strategy.cp``) every activation holds this device's tokens,
``x[b, S_context, D]`` in the load-balanced layout (``shardops.layers.balanced_order``): token
ids, positions and segment ids enter whole (``[b, S]``) and ``ctx.embed`` and ``ctx.attention``
take this device's themselves. A layer of your own that mixes tokens (a convolution along S, an
attention of your own) sees only this device's block, out of order: take its per-token inputs
with ``ctx.local_tokens``, and gather what it needs with ``ctx.gather(..., axis=1,
kind="context")`` (in token order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
from shardops import FLOAT32, Precision, entry_axes
from shardops_models.strategies._axes import Axes
from shardops_models.strategies._layers import Layers, _layer_path
from shardops_models.strategies._param import Param, is_param, values, wrap
from shardops_models.strategies.fsdp import AUTO
from shardops_models.strategies.kind import split_dim
from shardops_models.strategies.layout import (
    ALIASES,
    STRATEGIES,
    Strategy,
    strategies_for,
    strategy_named,
    with_context,
)
from shardops_models.strategies.plan import StackedRole
from shardops_models.strategies.remat import Remat

# Why the strategy's own collectives run (shardops.comm.because; explain reads them).
_REPLICATED = shardops.comm.Reason("replicated_parameters", backward={
    "psum": "parameters replicated over {axis} meet a batch split over {axis}: their gradients "
            "are summed",
})  # fmt: skip


_RENAMED = {
    "stage": "ctx.stage is now ctx.unit: an FSDP and remat unit (stage names a pipeline "
             "stage); rename the call",
    "tp": "the tp axis is ctx.axis_name('model') (None without one)",
    "model_parallel": "whether a tp axis splits the layers is ctx.axis_name('model') is not None",
    "sequence_parallel": "under sp the activations between layers vary over "
                         "ctx.axis_name('model') along S (shardops.varying_axes says so)",
    "context": "the context-parallel attention is the context kind's (Kind.attention); its axis "
               "is ctx.axis_name('context')",
}  # fmt: skip
"""The layer context's former names, each with the name to use now."""


@dataclasses.dataclass(frozen=True)
class Parallel(Layers, Axes):
    """The per-device layer context of one strategy (inside ``jax.shard_map``, or unsharded for
    ``ref``). See the module docstring."""

    strategy: Strategy
    precision: Precision = FLOAT32
    remat: Remat | bool | str | tuple = False
    """The activation-checkpoint policy of each unit (``models.strategies.remat``)."""
    fsdp_dense: str = AUTO
    """fsdp: per dense layer, gather the weight or move the activations (``models.strategies.fsdp``)."""
    collective_matmul: str | None = None
    """The tensor-parallel dense kernels' ``collective_matmul`` option (None, "ring",
    "bidirectional")."""
    attention_implementation: str = "auto"
    """How each device computes attention (``shardops.layers.IMPLEMENTATIONS``: ``"auto"``,
    ``"blocked"``, ``"splash"``, ``"einsum"``)."""
    microbatches: int = 1
    """The parts the step splits each device's batch into (``build``'s ``microbatches``; 1 for
    ``setup.logits`` and ``evaluate``): the forward sees one part at a time."""

    def __getattr__(self, name: str):
        """The names the layer context had before its kernels moved into the kinds, each
        refused with its rename (``docs/migration.md``)."""
        if name in _RENAMED:
            raise AttributeError(f"ctx.{name} is gone: {_RENAMED[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def local_tokens(self, tokens):
        """This device's tokens of ``tokens[b, S, ...]`` (the whole sequence): under context
        parallelism its block of the load-balanced layout, ``tokens[b, S_context, ...]``
        (``shardops.layers.balanced_order``: chunks i and 2N−1−i of 2N); else ``tokens``.
        ``ctx.embed`` and ``ctx.attention`` take their tokens whole and call it; call it on
        any other per-token input of your own (labels, masks). Each kind that splits the
        sequence takes its block (``Kind.local_tokens``)."""
        for kind in self.strategy.kinds:
            tokens = kind.local_tokens(tokens)
        return tokens

    # --- units: the data-parallel axes

    def unit(self, fn: Callable, params, *args):
        """``fn(params, *args)`` with ``params`` (a tree of ``Param``) materialised for the
        data-parallel axes: AllGathered over the fsdp axes where split (the backward
        ReduceScatters the gradient, then AllReduces its shard over the dp axes: HSDP),
        ``pcast`` to varying over the dp (and fsdp) axes where replicated (the backward
        AllReduces it), but not over an axis the leaf is split over (ep's experts: each
        device's are its own). Under zero1 the parameters arrive varying over its axes already
        (``models.training``): their gradients leave the step unreduced, for the optimizer's
        ReduceScatter. Under a remat policy (``models.strategies.remat``) the unit is
        ``jax.checkpoint``-ed with it: the backward pass gathers again and recomputes what the
        policy does not save."""

        # A leaf an earlier unit of this forward used (a tied embedding's table, in the head)
        # is gathered again for this use: its gather reads it through an optimization barrier
        # numbered by the use, which XLA's CSE cannot merge with an earlier use's gather (the
        # steps compile with ``KEEP_REMAT``), so the whole table is not kept alive in between.
        leaves = jax.tree.leaves(params, is_leaf=is_param)
        used = [q.uses if is_param(q) else 0 for q in leaves]
        for q in leaves:
            if is_param(q):
                q.uses += 1

        def run(params, *args):
            return fn(self._materialise_all(params, used), *args)

        return Remat.of(self.remat).checkpoint(run)(params, *args)

    def _materialise_all(self, params, used=None):
        """Every ``Param`` of a unit, ready: the leaves a kind splits (fsdp's) by that kind
        (``Kind.materialise``), after the others (``_materialise``); ``used``: per leaf, how
        many earlier units of this forward used it."""
        leaves, tree = jax.tree.flatten(params, is_leaf=is_param)
        used = used or [0] * len(leaves)
        ready = [None if self.split_dim(p.spec) is not None else self._materialise(p)
                 for p in leaves]  # fmt: skip
        for kind in self.strategy.kinds:
            kind.materialise(self, leaves, used, ready)
        missing = [leaves[i].path for i, p in enumerate(ready) if p is None]
        assert not missing, f"no kind of {self.strategy.name!r} materialised {missing}"
        return tree.unflatten(ready)

    def _materialise(self, p: Param) -> Param:
        """A leaf no kind splits, ready: entered varying over the axes whose kinds sum its
        gradient (``Strategy.gradient_axes``: the backward AllReduces it, in float32), but for
        those its own layout splits it over (ep's experts: each device's are its own)."""
        if p.ready:  # entered the region already (a stacked leaf, by ``scan``)
            return p
        value, split = p.value, {a for e in p.spec for a in entry_axes(e)}
        if any(a not in split for a in self.strategy.gradient_axes):  # dx AllReduced
            axes = tuple(a for a in self.strategy.gradient_axes if a not in split)
            with shardops.comm.because(_REPLICATED, axes):
                value = shardops.comm.copy_to_region(value, axes, self.precision.accum_dtype)
        return p.replace(value=value, ready=True)

    def split_dim(self, spec) -> int | None:
        """The dim of a leaf split over the axes of a kind that splits parameters (fsdp's), by
        its PartitionSpec, or None."""
        return split_dim(spec, self.strategy.parameter_axes)

    @property
    def _splitter(self):
        """The kind that splits parameters (fsdp), or None."""
        return next((k for k in self.strategy.kinds if k.splits_parameters), None)

    def scan(self, fn: Callable, params, x, *, outputs: bool = False):
        """``x = fn(layer, x)`` for each layer of ``params``, whose leaves stack the layers
        along dim 0 (the plan's ``stacked`` roles), with ``lax.scan``: one compiled block
        whatever the depth. Each layer runs as a unit (``ctx.unit``: FSDP gathers one
        layer's weights at a time, inside the loop; remat re-gathers them in the backward).
        With ``outputs``, ``fn(layer, x)`` returns ``(x, out)`` and ``scan`` returns ``(x,
        outs)``, each leaf of ``outs`` stacked over the layers ``[L, …]`` (a mixture of
        experts' losses). A kind that splits the layers dim (pp) runs it (``Kind.scan``);
        else ``scan_layers``."""
        for kind in self.strategy.kinds:
            y = kind.scan(self, fn, params, x, outputs)
            if y is not None:
                return y
        return self.scan_layers(fn, params, x, outputs=outputs)

    def scan_layers(self, fn: Callable, params, x, *, outputs: bool = False,
                    unroll: bool | int = 1):  # fmt: skip
        """``scan`` over this device's stacked layers (under pp, its stage's), asking no kind;
        ``unroll``: ``lax.scan``'s (a pipeline stage unrolls its layers)."""
        leaves = [q for q in jax.tree.leaves(params, is_leaf=is_param) if is_param(q)]
        if not leaves or any(not isinstance(q.role, StackedRole) for q in leaves):
            raise ValueError(
                "ctx.scan runs layers stacked along dim 0: give their subtree the plan role "
                "models.strategies.plan.stacked(...) (every leaf "
                f"{'is' if leaves else 'must be'} a stacked leaf; got "
                f"{sorted({str(q.path) for q in leaves if not isinstance(q.role, StackedRole)})})"
            )
        layers = {q.value.shape[0] for q in leaves}
        if len(layers) != 1:
            raise ValueError(f"ctx.scan: the stacked leaves hold different numbers of layers "
                             f"{sorted(layers)}; every leaf stacks the same layers on dim 0")  # fmt: skip
        # A leaf replicated over the batch axes enters the region once, stacked: its gradient
        # is AllReduced once after the backward loop, not layer by layer inside it (the same
        # bytes in one collective instead of L). A split one is gathered layer by layer.
        params = jax.tree.map(
            lambda q: self._materialise(q) if self.split_dim(q.spec) is None else q, params,
            is_leaf=is_param,
        )  # fmt: skip
        per_layer = one_layer(params)  # each leaf: the layer's role, spec and shape; stacked

        if shardops.inspect.tapping():  # the locator: each layer tapped under its own name
            root, outs = _layer_path([q.path for q in leaves]), []  # "['blocks']"
            for i in range(layers.pop()):
                layer = jax.tree.map(
                    lambda q, i=i: q.replace(value=q.value[i], path=q.path.replace(
                        root, f"{root}[{i}]", 1)), per_layer, is_leaf=is_param)  # fmt: skip
                x, out = _split_output(self.unit(fn, layer, x), outputs)
                outs.append(out)
            return (x, jax.tree.map(lambda *o: jnp.stack(o), *outs)) if outputs else x

        def body(x, layer):
            y, out = _split_output(self.unit(fn, layer, x), outputs)
            if jax.typeof(y) != jax.typeof(x):
                raise ValueError(
                    f"ctx.scan: each layer must return what it takes (a residual stream), "
                    f"{jax.typeof(x)}; the layer of {_layer_path([q.path for q in leaves])} "
                    f"returned {jax.typeof(y)}"
                )
            return y, out

        x, outs = lax.scan(body, x, per_layer, unroll=unroll)
        return (x, outs) if outputs else x

    # --- helpers

    def _arrays(self, p, key: str, layer: str):
        if key not in p:
            raise KeyError(f"{layer} needs parameter {key!r}; got {sorted(p)}")
        return self._value(p[key], layer)

    def _optional(self, p, key: str):
        return self._value(p[key], key) if p.get(key) is not None else None

    def _value(self, leaf, layer: str):
        if isinstance(leaf, Param):
            if not leaf.ready:
                raise ValueError(
                    f"{leaf.path} reached {layer} without ctx.unit: run each group of "
                    f"parameters through ctx.unit(fn, params, x) so the strategy can gather it"
                )
            if leaf.pending is not None:  # not a dense layer's weight after all: gather it
                return self._splitter.gather(self, leaf.value, leaf.pending)
            return leaf.value
        return leaf


def _split_output(y, outputs: bool):
    """A layer's ``(x, out)`` (``outputs``) or ``x`` as ``(x, out or None)``."""
    if not outputs:
        return y, None
    if not (isinstance(y, tuple) and len(y) == 2):
        length = f" of length {len(y)}" if isinstance(y, tuple) else ""
        raise ValueError(f"ctx.scan(outputs=True): each layer returns a pair (x, out); got a "
                         f"{type(y).__name__}{length}")  # fmt: skip
    return y


def one_layer(params):
    """Stacked ``Param`` leaves ``[L, ...]`` as one layer of them sees them: each leaf's role,
    PartitionSpec and logical shape without the layers dim; the values still stacked (for
    ``lax.scan`` to slice)."""
    return jax.tree.map(
        lambda q: q.replace(role=q.role.layer, spec=P(*q.spec[1:]),
                            logical=None if q.logical is None else q.logical[1:]),
        params, is_leaf=is_param,
    )  # fmt: skip


__all__ = [
    "ALIASES",
    "STRATEGIES",
    "Parallel",
    "Param",
    "Strategy",
    "strategies_for",
    "strategy_named",
    "values",
    "with_context",
    "wrap",
]
