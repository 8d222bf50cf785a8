"""The shard-dependent pieces a layer of your own uses, by kind of parallelism (``ctx.axis_name``,
``ctx.axis_index``, ``ctx.axis_size``, ``ctx.psum``, ``ctx.gather``, ``ctx.array``): ``Axes``, a
base of ``models.strategies.parallel.Parallel``.

A kind of axis is ``"model"`` (the axes of the kind that splits the layers: tp's),
``"context"`` (of the kind that splits the sequence: cp's), ``"data"`` (the batch axes) or a
kind's own name; where the strategy has none, each piece is the identity (an index of 0, a size
of 1), so one layer runs under every strategy.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

import shardops
from shardops import entry_axes
from shardops_models.strategies._param import Param

_CTX_PSUM = shardops.comm.Reason("ctx_psum", forward={
    "psum": "the layer's partial sums over {axis} are reduced (ctx.psum)",
})  # fmt: skip


_CTX_GATHER = shardops.comm.Reason("ctx_gather", forward={
    "all_gather": "the layer asks for all of a value whose blocks are split over {axis} "
                  "(ctx.gather)",
})  # fmt: skip


_SPLITS = {"model": "splits_layers", "context": "splits_sequence"}
"""``ctx.axis_name``'s kinds of axis that are the axes of the kind that splits so."""


class Axes:
    """The pieces (module docstring). A base of ``Parallel``, whose ``strategy`` they read."""

    def _split_size(self, p: Param, dim: int) -> int:
        """How many blocks of ``p``'s dim ``dim`` the layers' axis splits (its devices' count
        where the plan role splits the dim over it, else 1)."""
        axis = self.axis_name("model")
        return lax.axis_size(axis) if _entries_over(p.spec, axis, dim + 1)[dim] else 1

    def axis_name(self, kind: str = "model"):
        """The mesh axis or axes that carry ``kind`` under this strategy, or None where it has
        none: ``"model"``, the tp axis (tp and sp); ``"data"``, the batch axes (dp, ep, zero1,
        fsdp and the batch kinds you add); ``"context"``, the cp axis (the sequence split); or
        a kind's own name (``Strategy.rules``: ``"fsdp"``, a kind of your own), its axis (a
        tuple where it has several)."""
        if kind in _SPLITS:  # the axes of the kind that splits the layers (the sequence)
            of = next((k for k in self.strategy.kinds if getattr(k, _SPLITS[kind])), None)
            return None if of is None else of.axes[0] if len(of.axes) == 1 else of.axes
        if kind == "data":
            return self.strategy.batch_axes or None
        rules = self.strategy.rules
        if kind in rules:
            return rules[kind][0] if len(rules[kind]) == 1 else rules[kind]
        raise ValueError(
            f"ctx.axis_name: kind must be 'model', 'data', 'context' or one of the strategy's "
            f"kinds {sorted(rules)}; got {kind!r}. Name one of them"
        )

    def axis_index(self, kind: str = "model"):
        """This device's position along ``kind``'s mesh axis (``lax.axis_index``), 0 where
        the strategy has none: e.g. ``ctx.axis_index() * f_local``, the first feature of this
        device's block of a column-parallel layer."""
        axis = self.axis_name(kind)
        return lax.axis_index(axis) if axis else jnp.int32(0)

    def axis_size(self, kind: str = "model") -> int:
        """The number of devices along ``kind``'s mesh axes (1 where the strategy has none)."""
        axis = self.axis_name(kind)
        return lax.axis_size(axis) if axis else 1

    def psum(self, y_partial, kind: str = "model"):
        """``y{U_model}`` (this device's partial sum, e.g. of a row-parallel matmul) → ``y``,
        replicated: AllReduce over ``kind``'s axis (``shardops.comm.reduce_from_region``);
        the identity where the strategy has no such axis."""
        axis = self.axis_name(kind)
        if not axis:
            return y_partial
        with shardops.comm.because(_CTX_PSUM, axis):
            return shardops.comm.reduce_from_region(y_partial, axis)

    def gather(self, y_block, *, axis: int = -1, kind: str = "model"):
        """``y[.., F_model]`` (this device's block along ``axis``) → ``y[.., F]``, replicated:
        AllGather over ``kind``'s axis (``shardops.comm.gather_from_region``; the backward
        slices ``dy``, no communication); the identity where the strategy has no such axis.
        ``kind="context"``: this device's tokens ``y[b, S_context, ..]`` (``axis=1``) → every
        token's, in token order (the load-balanced layout undone)."""
        mesh_axis = self.axis_name(kind)
        if mesh_axis is None:
            return y_block
        axis = axis % y_block.ndim
        with shardops.comm.because(_CTX_GATHER, mesh_axis):
            y = shardops.comm.gather_from_region(y_block, mesh_axis, axis)
        if kind == "context":
            order = shardops.layers.inverse_order(y.shape[axis], lax.axis_size(mesh_axis))
            y = jnp.take(y, order, axis=axis)
        return y

    def array(self, param):
        """The local array of a parameter inside ``ctx.unit``: its block over ``model`` (by
        its plan role) and, for an expert leaf, over the ep axis (this device's experts);
        whole over the axes ``ctx.unit`` gathers (fsdp's). A parameter stored padded (a dim
        the tp axis does not divide) is refused: its block would hold padding that no layer of
        yours masks."""
        value = self._value(param, "array")
        if isinstance(param, Param) and param.logical is not None:
            gathered = set(self.strategy.parameter_axes)  # whole inside the unit
            entries = list(param.spec) + [None] * (value.ndim - len(param.spec))
            stored = tuple(n * math.prod(lax.axis_size(a) for a in entry_axes(e)
                                         if a not in gathered)
                           for n, e in zip(value.shape, entries, strict=True))  # fmt: skip
            if stored != tuple(param.logical):
                raise ValueError(
                    f"ctx.array: {param.path} is stored padded, {stored} for the model's "
                    f"{tuple(param.logical)} (its plan role {param.role!r} splits a dim the tp "
                    f"axis {self.axis_name()!r} does not divide): the padding would reach your layer "
                    f"unmasked. Use a size the axis divides, role 'replicated', or a shardops "
                    f"layer (ctx.dense, ctx.embed, ctx.gated_mlp), which mask it."
                )
        return value


def _entries_over(spec, axis, ndim: int):
    """``spec``'s entries with only ``axis`` kept (a unit's value is whole over the rest)."""
    entries = list(spec) + [None] * (ndim - len(spec))
    return [axis if axis is not None and axis in entry_axes(e) else None for e in entries]
