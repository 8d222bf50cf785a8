"""Strategies for any model: a data-axis strategy composed with a model-axis strategy, and the
per-device layer context through which a model's forward runs.

    data axis    none · dp (params replicated, gradients AllReduced)
                 · fsdp (params split, AllGathered just in time, gradients ReduceScattered)
    model axis   none · tp (Megatron: each layer's plan role picks its kernel)
                 · sp (tp with sequence parallelism: activations split along S between layers)

    ref = none × none   dp, fsdp = data only   tp, sp = model only
    2d = dp × tp        fsdp_tp = fsdp × tp    dp_sp = dp × sp     fsdp_sp = fsdp × sp

A model's forward is written once against ``Parallel`` (the context): it runs each group of
parameters (a *stage*: a layer, a transformer block) through ``ctx.stage(fn, params, x)``,
which materialises them for the data axis (``pcast`` or AllGather over ``data``, recomputed in
the backward pass under remat), and calls layers as ``ctx.dense(p, x)``, ``ctx.embed``,
``ctx.attention``, ``ctx.layer_norm``, ``ctx.cross_entropy``. The *plan* (``models.strategies.plan``)
gives each parameter its role, and the role picks the kernel: a ``column`` dense under ``tp``
is ``shardops.layers.column_parallel_dense_kernel``, under ``dp`` it is ``shardops.dense``. The
same context, in recording mode (``Recorder``), derives the collective budget of any model from
its plan and its shapes, layer by layer, without compiling anything.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
from shardops import (
    DATA_AXIS,
    FLOAT32,
    MODEL_AXIS,
    SEQUENCE_DIM,
    Precision,
    entry_axes,
    spec_entries,
    varying_axes,
)
from shardops.inspect import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, REDUCE_SCATTER
from shardops_models.strategies.fsdp import (
    AUTO,
    GATHER_WEIGHTS,
    dense_moving_activations,
    moves_activations,
)
from shardops_models.strategies.plan import (
    COLUMN,
    HEAD,
    REPLICATED,
    ROW,
    VOCAB,
    is_shape,
    split_over,
)

AR, AG, RS, A2A, CP = ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, COLLECTIVE_PERMUTE
F32 = 4


class Strategy(NamedTuple):
    """A data-axis strategy (``None``, ``"dp"``, ``"fsdp"``) composed with a model-axis one
    (``None``, ``"tp"``, ``"sp"``)."""

    name: str
    data: str | None
    model: str | None

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes the strategy needs."""
        return (DATA_AXIS,) * bool(self.data) + (MODEL_AXIS,) * bool(self.model)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over (dim 0)."""
        return (DATA_AXIS,) if self.data else ()


STRATEGIES = {
    s.name: s
    for s in (
        Strategy("ref", None, None),
        Strategy("dp", "dp", None),
        Strategy("fsdp", "fsdp", None),
        Strategy("tp", None, "tp"),
        Strategy("sp", None, "sp"),
        Strategy("2d", "dp", "tp"),
        Strategy("fsdp_tp", "fsdp", "tp"),
        Strategy("dp_sp", "dp", "sp"),
        Strategy("fsdp_sp", "fsdp", "sp"),
    )
}
"""Every composition, by name (``2d`` is dp × tp, the seed's name for it)."""

ALIASES = {"dp_tp": "2d"}


def strategies_for(model) -> list[str]:
    """The strategy names that apply to ``model``: all, or without sp for a model that has no
    sequence dimension (the MLP)."""
    sequence = getattr(model, "sequence", False)
    return sorted(n for n, s in STRATEGIES.items() if sequence or s.model != "sp")


def strategy_named(name: str) -> Strategy:
    name = ALIASES.get(name, name)
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name]


@jax.tree_util.register_pytree_node_class
class Param:
    """One parameter as a model's forward sees it: the local array, its plan role and layout.

    ``ready`` is False until ``Parallel.stage`` has materialised it for the data axis; layers
    refuse a parameter that is not ready (a forward that skipped ``ctx.stage`` would compute
    with an FSDP shard)."""

    __slots__ = ("path", "pending", "ready", "role", "spec", "value")

    def __init__(self, value, role: str, spec, path: str, ready: bool = False, pending=None):
        self.value, self.role, self.spec, self.path, self.ready = value, role, spec, path, ready
        self.pending = pending
        """The dim still split over ``data`` (a dense weight whose gather waits for the layer
        to choose its route, ``models.strategies.fsdp``), or None."""

    def tree_flatten(self):
        return (self.value,), (self.role, self.spec, self.path, self.ready, self.pending)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def shape(self):
        return self.value.shape

    def __repr__(self):
        return f"Param({self.path}, role={self.role}, spec={self.spec}, shape={self.shape})"


def is_param(x) -> bool:
    return isinstance(x, Param)


def wrap(params, roles, specs):
    """The parameter tree as ``Param`` leaves (not yet materialised)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, v, role, spec: Param(v, role, spec, jax.tree_util.keystr(path)),
        params,
        roles,
        specs,
    )


def values(tree):
    """The arrays of a tree of ``Param`` leaves."""
    return jax.tree.map(lambda p: p.value, tree, is_leaf=is_param)


@dataclasses.dataclass(frozen=True)
class Parallel:
    """The per-device layer context of one strategy (inside ``jax.shard_map``, or unsharded for
    ``ref``). See the module docstring."""

    strategy: Strategy
    precision: Precision = FLOAT32
    remat: bool = False
    fsdp_dense: str = AUTO
    """fsdp: per dense layer, gather the weight or move the activations (``models.strategies.fsdp``)."""
    collective_matmul: str | None = None
    """The tensor-parallel dense kernels' ``collective_matmul`` option (None, "ring",
    "bidirectional")."""

    @property
    def model_parallel(self) -> bool:
        """Whether the model axis splits the weights: under tp and under sp."""
        return self.strategy.model is not None

    @property
    def sequence_parallel(self) -> bool:
        return self.strategy.model == "sp"

    # --- stages: the data axis

    def stage(self, fn: Callable, params, *args):
        """``fn(params, *args)`` with ``params`` (a tree of ``Param``) materialised for the data
        axis: AllGathered over ``data`` where split (fsdp; the backward ReduceScatters the
        gradient), ``pcast`` to varying where replicated (dp; the backward AllReduces it). With
        remat the stage is ``jax.checkpoint``-ed: the backward pass gathers again."""

        def run(params, *args):
            return fn(self._materialise_all(params), *args)

        return jax.checkpoint(run)(params, *args) if self.remat else run(params, *args)

    def _materialise_all(self, params):
        """Every ``Param`` of a stage, ready. Without remat, the split leaves that share a dtype
        and varying axes travel together: one AllGather over ``data`` (one ReduceScatter back)
        instead of one per leaf (``shardops.comm.gather_many_to_region``); XLA:CPU does not combine
        gathers by itself. (It does combine the replicated leaves' gradient AllReduces, so those
        stay one ``copy_to_region`` each: bundling them by hand only adds copies.) With remat
        each leaf is gathered alone, so the backward re-gathers only what it reads."""
        leaves, tree = jax.tree.flatten(params, is_leaf=is_param)
        if not self.strategy.data or self.remat:
            return tree.unflatten([self._materialise(p) for p in leaves])
        ready: list = [None] * len(leaves)
        gather = {}
        for i, p in enumerate(leaves):
            dim = data_split_dim(p.spec)
            if dim is None or self._may_move_activations(p):
                ready[i] = self._materialise(p)  # replicated, or a dense weight: alone
                continue
            gather.setdefault((np.dtype(p.value.dtype), varying_axes(p.value)), []).append((i, dim))
        accum = self.precision.accum_dtype
        for group in gather.values():
            values = [leaves[i].value for i, _ in group]
            dims = [d for _, d in group]
            for (i, _), value in zip(group, shardops.comm.gather_many_to_region(
                    values, DATA_AXIS, dims, accum), strict=True):  # fmt: skip
                ready[i] = Param(value, leaves[i].role, leaves[i].spec, leaves[i].path, True)
        return tree.unflatten(ready)

    def _materialise(self, p: Param) -> Param:
        value = p.value
        if self.strategy.data:
            dim = data_split_dim(p.spec)
            if dim is not None and self._may_move_activations(p):
                return Param(value, p.role, p.spec, p.path, ready=True, pending=dim)
            if dim is not None:
                value = self._gather(value, dim)
            else:
                value = shardops.comm.copy_to_region(value, DATA_AXIS, self.precision.accum_dtype)
        return Param(value, p.role, p.spec, p.path, ready=True)

    def _gather(self, value, dim: int):
        return shardops.comm.gather_to_region(value, DATA_AXIS, dim, self.precision.accum_dtype)

    def _may_move_activations(self, p: Param) -> bool:
        """A dense weight (``...['w']``, rank 2) that ``dense`` may use without gathering it."""
        return (self.fsdp_dense != GATHER_WEIGHTS and not self.sequence_parallel
                and p.path.endswith("['w']") and p.value.ndim == 2)  # fmt: skip

    # --- layers: the kernels

    def _dense(self, p, x):
        """``x[..., D] · w + b`` by the role of ``p["w"]``: column-parallel, row-parallel or
        local. Under sp, ``x[B, S_model, D]`` is gathered along S by a column layer and a row
        layer's output is reduce-scattered back along S."""
        role, pending = p["w"].role, getattr(p.get("w"), "pending", None)
        if pending is not None:
            w = p["w"].value  # w[K_data, F'] or w[K', F_data]: this device's block
            n = lax.axis_size(DATA_AXIS)
            seen = tuple(d * n if i == pending else d for i, d in enumerate(w.shape))
            if moves_activations(self.fsdp_dense, seen, pending, x.shape, n, self.precision):
                return dense_moving_activations(
                    x, w, self._optional(p, "b"), split_dim=pending, role=role, model_parallel=self.model_parallel,
                    precision=self.precision,
                )  # fmt: skip
        w, b = self._arrays(p, "w", "dense"), self._optional(p, "b")
        sp = self.sequence_parallel and x.ndim > 2
        ring = self.collective_matmul
        if self.model_parallel and role == COLUMN:
            return shardops.layers.column_parallel_dense_kernel(
                x, w, b, gather_input=sp, gather_dimension=SEQUENCE_DIM, precision=self.precision,
                collective_matmul=ring,
            )  # fmt: skip
        if self.model_parallel and role == ROW:
            reduce = "psum_scatter" if sp else "psum"
            # a ring splits y along S (or along the batch when y has no sequence)
            scatter = SEQUENCE_DIM if x.ndim > 2 else 0
            return shardops.layers.row_parallel_dense_kernel(
                x, w, b, reduce=reduce, scatter_dimension=scatter, precision=self.precision,
                collective_matmul=ring,
            )  # fmt: skip
        if role not in (COLUMN, ROW, REPLICATED):
            raise ValueError(f"{p['w'].path}: a dense layer takes role column, row or "
                             f"replicated; the plan says {role!r}")  # fmt: skip
        return shardops.dense(x, w, b, precision=self.precision)

    def _embed(self, p, ids):
        """``table[ids]``: vocab-parallel under tp (the AllReduce, or under sp the
        ReduceScatter along S, of the rows each device holds), else a local lookup."""
        table, role = self._arrays(p, "table", "embed"), p["table"].role
        if self.model_parallel and role == VOCAB:
            reduce = "psum_scatter" if self.sequence_parallel else "psum"
            return shardops.layers.vocab_parallel_embedding_kernel(
                ids, table, reduce=reduce, scatter_dimension=SEQUENCE_DIM,
                precision=self.precision,
            )  # fmt: skip
        if role not in (VOCAB, REPLICATED):
            raise ValueError(f"{p['table'].path}: an embedding takes role vocab or replicated; "
                             f"the plan says {role!r}")  # fmt: skip
        x = jnp.take(table, ids, axis=0).astype(self.precision.compute_dtype)  # x[B, S, D]
        if self.sequence_parallel:  # keep this device's part of S; dx AllReduced over model
            x = shardops.comm.copy_to_region(x, MODEL_AXIS, self.precision.accum_dtype)
            x = _sequence_block(x).astype(self.precision.compute_dtype)  # x[B, S/p, D]
        return x

    def _attention(self, p, x, *, num_heads: int, causal: bool = True):
        """Self-attention: head-parallel under tp (sp: x gathered along S once), else local."""
        params = {k: self._arrays(p, k, "attention") for k in p}
        roles = {q.role for q in p.values()}
        if self.model_parallel and roles == {HEAD}:
            return shardops.layers.head_parallel_attention_kernel(
                x, params, num_heads=num_heads, causal=causal,
                sequence_parallel=self.sequence_parallel, precision=self.precision,
            )  # fmt: skip
        if roles - {HEAD, REPLICATED} or len(roles) > 1:
            raise ValueError(f"attention parameters take one role, head or replicated; the plan "
                             f"says {sorted(roles)}")  # fmt: skip
        if self.sequence_parallel:
            raise ValueError(
                "under sequence parallelism attention must have the head role (it sees the "
                "whole sequence): set the plan's attention role to 'head'"
            )
        return shardops.attention(
            x, params, num_heads=num_heads, causal=causal, precision=self.precision
        )

    def _layer_norm(self, p, x):
        return shardops.layer_norm(
            x, self._optional(p, "scale"), self._optional(p, "bias")
        )  # same layout as x; under sp dscale, dbias are AllReduced over model (check_vma)

    def _rms_norm(self, p, x):
        return shardops.rms_norm(x, self._optional(p, "scale"))

    # --- layers, each tapped for shardops.inspect.compare (the identity outside it)

    def dense(self, p, x):
        """``x[..., D] · w + b`` by the role of ``p["w"]``: column-parallel, row-parallel or
        local. Under sp, ``x[B, S_model, D]`` is gathered along S by a column layer and a row
        layer's output is reduce-scattered back along S."""
        p_model = lax.axis_size(MODEL_AXIS) if self.model_parallel and p["w"].role == ROW else 1
        k = x.shape[-1] * p_model  # D: a row layer's x holds D/p of it
        return self._tap(self._dense(p, x), p, k=k, features_split=self.is_split(p))

    def embed(self, p, ids):
        """``table[ids]``: vocab-parallel under tp (the AllReduce, or under sp the
        ReduceScatter along S, of the rows each device holds), else a local lookup."""
        return self._tap(self._embed(p, ids), p, k=1)

    def attention(self, p, x, *, num_heads: int, causal: bool = True):
        """Self-attention: head-parallel under tp (sp: x gathered along S once), else local."""
        y = self._attention(p, x, num_heads=num_heads, causal=causal)
        seq = x.shape[SEQUENCE_DIM] * (lax.axis_size(MODEL_AXIS) if self.sequence_parallel else 1)
        return self._tap(y, p, k=max(x.shape[-1], seq))  # K: D (projections), S (p · v)

    def layer_norm(self, p, x):
        return self._tap(self._layer_norm(p, x), p, k=x.shape[-1])

    def rms_norm(self, p, x):
        return self._tap(self._rms_norm(p, x), p, k=x.shape[-1])

    def _tap(self, y, p, *, k: int, features_split: bool = False):
        """``shardops.inspect.tap`` of a layer's output, named by its parameters' path, with the layout
        of the strategy: the batch over ``data``, and over ``model`` the features (a column
        layer) or the sequence (between layers under sp) when ``y`` varies over it."""
        leaf = next(q for q in jax.tree.leaves(p, is_leaf=is_param) if is_param(q))
        name = leaf.path[: leaf.path.rfind("[")]
        spec = None
        if self.strategy.axes:
            varying = varying_axes(y)
            entries: list = [None] * y.ndim
            if DATA_AXIS in varying:
                entries[0] = DATA_AXIS
            if MODEL_AXIS in varying:
                entries[-1 if features_split else SEQUENCE_DIM] = MODEL_AXIS
            spec = P(*entries)
        return shardops.inspect.tap(y, name, spec=spec, k=k)

    def is_split(self, p) -> bool:
        """Whether ``dense(p, ·)``'s output is split along its features (a column layer)."""
        return self.model_parallel and p["w"].role == COLUMN

    def cross_entropy(self, logits, labels, *, split: bool):
        """Per-position loss ``[...]`` in float32 of integer ``labels``; ``split``: the logits
        are ``logits[..., V_model]`` (a column head) and the loss is vocab-parallel."""
        _check_logits_cover_labels(self, logits, labels)
        if split:
            return shardops.layers.vocab_parallel_cross_entropy_kernel(
                logits, labels, precision=self.precision
            )
        logits = logits.astype(jnp.float32)  # [..., V] in f32
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    def argmax(self, logits, *, split: bool):
        if split:
            return shardops.layers.vocab_parallel_argmax_kernel(logits)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

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
                    f"{leaf.path} reached {layer} without ctx.stage: run each group of "
                    f"parameters through ctx.stage(fn, params, x) so the strategy can gather it"
                )
            if leaf.pending is not None:  # not a dense layer's weight after all: gather it
                return self._gather(leaf.value, leaf.pending)
            return leaf.value
        return leaf


def _check_logits_cover_labels(ctx, logits, labels) -> None:
    if logits.shape[:-1] != labels.shape:
        hint = (
            " Under sequence parallelism the output layer gathers the sequence only as a "
            "column-parallel layer: give it the plan's role 'column'."
            if ctx.sequence_parallel
            else ""
        )
        raise ValueError(
            f"cross_entropy: logits{tuple(logits.shape)} do not cover labels"
            f"{tuple(labels.shape)} (the logits' leading dims must equal the labels' shape).{hint}"
        )


def data_split_dim(spec) -> int | None:
    """The dim of a leaf split over ``data`` (by its PartitionSpec), or None."""
    return next((d for d, e in enumerate(spec) if DATA_AXIS in entry_axes(e)), None)


def _sequence_block(x):
    """This device's block of ``x[B, S, D]`` along S: ``x[B, S/p, D]``."""
    p = lax.axis_size(MODEL_AXIS)
    s = x.shape[SEQUENCE_DIM] // p
    return lax.dynamic_slice_in_dim(x, lax.axis_index(MODEL_AXIS) * s, s, axis=SEQUENCE_DIM)


# --- the collective budget of any model, from its plan and shapes


class Recorder(Parallel):
    """A ``Parallel`` that computes nothing and records, layer by layer, the collectives the
    strategy's kernels issue: bytes V per (kind, mesh axes), V the size in bytes of the
    (gathered or reduced) full operand, the convention of ``shardops.inspect.collectives``.

    It runs the model's forward under ``jax.eval_shape`` on the *local* shapes of one device
    (the batch shard, each parameter's ``model`` shard), so every size is what that device
    moves. A layer input that is the model's own input (the data) needs no gradient; every
    other activation does. ``reads`` collects the parameters the backward pass reads, which
    remat gathers a second time.

    Remat: a stage's backward first recomputes the stage's forward, as far as the backward
    needs it. A layer whose output a later layer of the same stage consumes is recomputed
    whole: its parameters are gathered again and its forward collectives run again. The
    stage's *tail* (the layers after the last one that consumes another's output: the block's
    ``down`` projection, the head, the embedding lookups) is recomputed only as far as its own
    backward reads: the parameters it reads (a weight, when its input needs a gradient; a
    norm's scale) and its input's gather under sequence parallelism, not its output's
    reduction.
    """

    def __init__(self, strategy, precision, mesh_shape: dict[str, int], inputs, remat=False,
                 fsdp_dense=AUTO, collective_matmul=None):  # fmt: skip
        super().__init__(strategy, precision, remat=remat, fsdp_dense=fsdp_dense,
                         collective_matmul=collective_matmul)  # fmt: skip
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "budget", {})
        object.__setattr__(self, "reads", set())
        object.__setattr__(self, "moved", set())
        object.__setattr__(self, "_inputs", {id(a) for a in jax.tree.leaves(inputs)})
        object.__setattr__(self, "_frame", None)

    @property
    def p(self) -> int:
        return self.mesh_shape[MODEL_AXIS] if self.model_parallel else 1

    def add(self, kind: str, nbytes: int, axes=(MODEL_AXIS,)) -> None:
        if nbytes and all(self.mesh_shape[a] > 1 for a in axes):
            key = (kind, tuple(axes))
            self.budget[key] = self.budget.get(key, 0) + int(nbytes)

    def needs_grad(self, x) -> bool:
        return id(x) not in self._inputs

    def stage(self, fn, params, *args):
        frame = _Frame(stage_inputs={id(a) for a in args})
        object.__setattr__(self, "_frame", frame)
        out = fn(jax.tree.map(lambda q: Param(q.value, q.role, q.spec, q.path, True), params,
                              is_leaf=is_param), *args)  # fmt: skip
        object.__setattr__(self, "_frame", None)
        consumed = max((i for i, c in enumerate(frame.calls) if c.consumes), default=0)
        for i, call in enumerate(frame.calls):
            self.reads.update(call.reads)
            if not self.remat:
                continue
            recomputed = call.params if i < consumed else call.reads
            self.reads.update(recomputed)
            again = call.forward if i < consumed else call.input_side
            for kind, nbytes, axes in again:
                self.add(kind, nbytes, axes)
        return out

    def _call(self, x, params, *, consumes=True) -> _Call:
        """Open the record of one layer call on input ``x`` with these ``Param`` leaves."""
        call = _Call([q.path for q in jax.tree.leaves(params, is_leaf=is_param)])
        frame = self._frame
        if frame is not None:
            call.consumes = consumes and id(x) not in frame.stage_inputs
            frame.calls.append(call)
        return call

    def _forward(self, call, kind, nbytes, *, input_side=False, axes=(MODEL_AXIS,)) -> None:
        self.add(kind, nbytes, axes)
        call.forward.append((kind, nbytes, axes))
        if input_side:
            call.input_side.append((kind, nbytes, axes))

    def _model_split_reduced(self, p: Param) -> None:
        """A parameter replicated over ``model`` used on an activation split over ``model``
        (sequence parallelism): check_vma AllReduces its gradient over ``model``."""
        if self.sequence_parallel and not split_over(p.spec, MODEL_AXIS):
            self.add(AR, math.prod(p.shape) * F32)

    def dense(self, p, x):
        w, role = p["w"], p["w"].role
        b = p.get("b")
        call = self._call(x, p)
        sp = self.sequence_parallel and x.ndim > 2
        grad = self.needs_grad(x)
        split = data_split_dim(w.spec) if self.strategy.data else None
        n = self.mesh_shape[DATA_AXIS] if self.strategy.data else 1
        if (split is not None and self._may_move_activations(w)
                and moves_activations(self.fsdp_dense, w.shape, split, x.shape, n,
                                      self.precision)):  # fmt: skip
            return self._dense_moving_activations(call, w, x, split, grad)
        if grad:
            call.reads.append(w.path)
        full_x = _repeat(x, self.p) if sp and self.model_parallel and role == COLUMN else x
        y = jnp.zeros((*full_x.shape[:-1], w.shape[1]), self.precision.compute_dtype)
        # A ring (collective_matmul) moves a gather's or a scatter's bytes as p − 1
        # collective-permutes of one block each (per direction: half blocks, twice as many).
        ring = self.collective_matmul is not None
        gather = CP if ring else AG
        scatter = CP if ring else RS

        def to_ring(nbytes):  # V(p−1)/p: the bytes of p − 1 blocks
            return nbytes // self.p * (self.p - 1) if ring else nbytes

        if self.model_parallel and role == COLUMN:
            if sp:  # x gathered along S; dw reads it, so remat gathers it again
                nbytes = full_x.size * full_x.dtype.itemsize
                self._forward(call, gather, to_ring(nbytes), input_side=True)
                if grad:
                    self.add(scatter, to_ring(full_x.size * F32))  # dx reduce-scattered along S
            elif grad:
                self.add(AR, x.size * F32)  # dx[..., D]{U_model}
            return y
        if self.model_parallel and role == ROW:
            if sp or ring:
                # y{U_model} → y[B, S_model, D] (a ring without sp: along the batch)
                self._forward(call, scatter, to_ring(y.size * F32))
                if not sp:  # the reduced blocks → y, replicated; dy is already whole
                    self._forward(call, AG, y.size * F32)
                    return y
                self.add(gather, to_ring(y.size * F32))  # its transpose: dy gathered along S
                if b is not None:
                    self.add(AR, math.prod(b.shape) * F32)  # db: b replicated, y split
                return _block(y, self.p)
            self._forward(call, AR, y.size * F32)  # y[..., D]{U_model} → y
            return y
        for q in (w, b):
            if q is not None:
                self._model_split_reduced(q)
        return y

    def _dense_moving_activations(self, call, w, x, split: int, grad: bool):
        """The collectives of ``models.strategies.fsdp.dense_moving_activations`` (its docstring
        has the algebra); ``w.shape`` is ``w[K, F']`` gathered over data, split over model."""
        self.moved.add(w.path)
        if grad:
            call.reads.append(w.path)
        data, n = (DATA_AXIS,), self.mesh_shape[DATA_AXIS]
        column, row = (
            self.model_parallel and w.role == COLUMN,
            self.model_parallel and w.role == ROW,
        )
        c = np.dtype(self.precision.compute_dtype).itemsize
        rows = math.prod(x.shape[:-1])  # this device's rows
        k, f = w.shape
        y = jnp.zeros((*x.shape[:-1], f), self.precision.compute_dtype)  # y[B_data, ..., F']
        if split == 0:
            self._forward(call, A2A, rows * k * c, input_side=True, axes=data)  # x → x[B, K_data]
            if grad:
                self.add(A2A, rows * k * c, data)  # dx back to x[B_data, K]
                if column:
                    self.add(AR, rows * k * F32)  # dx[B, K_data]{U_model}
            self._forward(call, RS, rows * n * f * F32, axes=data)  # y[B, F']{U_data}
            self.add(AG, rows * n * f * F32, data)  # its transpose: dy gathered
            if row:
                self._forward(call, AR, rows * f * F32)  # y[B_data, D]{U_model}
        else:
            self._forward(call, AG, rows * n * k * c, input_side=True, axes=data)  # x[B, K']
            if grad:
                self.add(RS, rows * n * k * F32, data)  # dx[B, K']{...} → dx[B_data, K']
                if column:
                    self.add(AR, rows * n * k * F32)  # dx[B, K']{U_model}
            if row:
                self._forward(call, AR, rows * f * F32)  # y[B, D_data]{U_model}
            self._forward(call, A2A, rows * f * F32, axes=data)  # y[B, F_data] → y[B_data, F]
            self.add(A2A, rows * f * F32, data)  # its transpose: dy
        return y

    def embed(self, p, ids):
        table = p["table"]
        call = self._call(ids, p, consumes=False)  # ids are data: nothing to recompute
        x = jnp.zeros((*ids.shape, table.shape[1]), self.precision.compute_dtype)  # x[B, S, D]
        if self.model_parallel and table.role == VOCAB:
            if self.sequence_parallel:
                self._forward(call, RS, x.size * F32)  # x{U_model} → x[B, S_model, D]
                self.add(AG, x.size * F32)  # its transpose: dx gathered along S
                return _block(x, self.p)
            self._forward(call, AR, x.size * F32)  # x{U_model} → x
            return x
        if self.sequence_parallel:
            self.add(AR, x.size * F32)  # dx of the replicated lookup, before the S slice
            return _block(x, self.p)
        return x

    def attention(self, p, x, *, num_heads: int, causal: bool = True):
        call = self._call(x, p)
        grad = self.needs_grad(x)
        call.reads.append(p["wo"].path)
        if grad:
            call.reads.extend(p[k].path for k in ("wq", "wk", "wv"))
        roles = {q.role for q in p.values()}
        y = jnp.zeros(x.shape, self.precision.compute_dtype)
        if not (self.model_parallel and roles == {HEAD}):
            if self.sequence_parallel:
                raise ValueError("under sequence parallelism attention must have the head role")
            return y
        if self.sequence_parallel:
            full = _repeat(x, self.p)  # x[B, S, D]
            self._forward(call, AG, full.size * full.dtype.itemsize, input_side=True)
            if grad:
                self.add(RS, full.size * F32)  # dx reduce-scattered along S
            self._forward(call, RS, full.size * F32)  # y{U_model} → y[B, S_model, D]
            self.add(AG, full.size * F32)  # its transpose: dy gathered along S
            if p.get("bo") is not None:
                self.add(AR, math.prod(p["bo"].shape) * F32)  # dbo: bo replicated, y split
            return y
        if grad:
            self.add(AR, x.size * F32)  # dx[B, S, D]{U_model}, once for Q, K and V
        self._forward(call, AR, x.size * F32)  # y[B, S, D]{U_model} → y
        return y

    def layer_norm(self, p, x):
        call = self._call(x, p)
        if self.needs_grad(x) and p.get("scale") is not None:
            call.reads.append(p["scale"].path)
        for q in p.values():
            if q is not None:
                self._model_split_reduced(q)
        return jnp.zeros(x.shape, x.dtype)

    def rms_norm(self, p, x):
        return self.layer_norm(p, x)

    def cross_entropy(self, logits, labels, *, split: bool):
        _check_logits_cover_labels(self, logits, labels)
        if split and self.model_parallel:
            self.add(AR, 3 * labels.size * F32)  # max, Σ exp, target logit: [...] each
        return jnp.zeros(labels.shape, jnp.float32)

    def argmax(self, logits, *, split: bool):
        return jnp.zeros(logits.shape[:-1], jnp.int32)


@dataclasses.dataclass
class _Call:
    params: list[str]
    consumes: bool = False
    reads: list[str] = dataclasses.field(default_factory=list)
    forward: list = dataclasses.field(default_factory=list)
    input_side: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Frame:
    stage_inputs: set
    calls: list = dataclasses.field(default_factory=list)


def _repeat(x, p: int):
    return jnp.concatenate([x] * p, axis=SEQUENCE_DIM) if p > 1 else x


def _block(x, p: int):
    return x[:, : x.shape[SEQUENCE_DIM] // p] if p > 1 else x


def data_axis_budget(specs, shapes, mesh_shape, *, reads=(), remat=False, param_bytes=F32,
                     moved=()):  # fmt: skip
    """Per leaf, with V its bytes after the ``data`` gather (its ``model`` shard) in float32:
    split over data → AllGather forward in the param dtype (V · param_bytes / 4; again in the
    backward, with remat, if the backward reads it) + ReduceScatter V of the float32
    gradient; replicated over data → AllReduce V of the float32 gradient. Leaves in ``moved``
    (dense weights whose layer moves activations instead) are never gathered: nothing."""
    budget: dict = {}

    def add(kind, nbytes):
        if nbytes and mesh_shape[DATA_AXIS] > 1:
            budget[(kind, (DATA_AXIS,))] = budget.get((kind, (DATA_AXIS,)), 0) + int(nbytes)

    flat_specs = jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda s: isinstance(s, P))
    flat_shapes = jax.tree.leaves(shapes, is_leaf=is_shape)
    for (path, spec), shape in zip(flat_specs, flat_shapes, strict=True):
        entries = spec_entries(spec, len(shape))
        model_split = math.prod(
            mesh_shape[a] for e in entries for a in entry_axes(e) if a != DATA_AXIS
        )
        v = math.prod(shape) // model_split * F32
        if jax.tree_util.keystr(path) in moved:
            continue
        if split_over(spec, DATA_AXIS):
            regather = remat and jax.tree_util.keystr(path) in reads
            add(AG, v // F32 * param_bytes * (2 if regather else 1))
            add(RS, v)
        else:
            add(AR, v)
    return budget


def local_shape(shape, spec, mesh_shape, axes) -> tuple[int, ...]:
    """The shape of one device's block of a leaf split by ``spec`` over ``axes`` only."""
    entries = spec_entries(spec, len(shape))
    return tuple(
        d // math.prod(mesh_shape[a] for a in entry_axes(e) if a in axes)
        for d, e in zip(shape, entries, strict=True)
    )


def merge(*budgets: dict) -> dict:
    out: dict = {}
    for b in budgets:
        for k, v in b.items():
            out[k] = out.get(k, 0) + v
    return out


__all__ = [
    "ALIASES",
    "STRATEGIES",
    "Parallel",
    "Param",
    "Recorder",
    "Strategy",
    "data_axis_budget",
    "strategies_for",
    "strategy_named",
    "values",
    "wrap",
]
