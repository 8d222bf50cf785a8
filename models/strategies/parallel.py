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
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import shardops
from shardops import (
    FLOAT32,
    SEQUENCE_DIM,
    Precision,
    entry_axes,
    spec_entry,
    varying_axes,
)
from shardops_models.strategies.fsdp import (
    AUTO,
)
from shardops_models.strategies.kind import split_dim
from shardops_models.strategies.layout import (
    ALIASES,
    STRATEGIES,
    Strategy,
    strategies_for,
    strategy_named,
    with_context,
)
from shardops_models.strategies.plan import (
    COLUMN,
    HEAD,
    REPLICATED,
    ROW,
    VOCAB,
    StackedRole,
    is_shape,
)
from shardops_models.strategies.remat import (
    ATTENTION_OUTPUT,
    MLP_INPUT,
    MLP_OUTPUT,
    Remat,
)

# Why the strategy's own collectives run (shardops.comm.because; explain reads them).
_REPLICATED = shardops.comm.Reason("replicated_parameters", backward={
    "psum": "parameters replicated over {axis} meet a batch split over {axis}: their gradients "
            "are summed",
})  # fmt: skip
_CTX_PSUM = shardops.comm.Reason("ctx_psum", forward={
    "psum": "the layer's partial sums over {axis} are reduced (ctx.psum)",
})  # fmt: skip
_CTX_GATHER = shardops.comm.Reason("ctx_gather", forward={
    "all_gather": "the layer asks for all of a value whose blocks are split over {axis} "
                  "(ctx.gather)",
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
_SPLITS = {"model": "splits_layers", "context": "splits_sequence"}
"""``ctx.axis_name``'s kinds of axis that are the axes of the kind that splits so."""


@jax.tree_util.register_pytree_node_class
class Param:
    """One parameter as a model's forward sees it: the local array, its plan role and layout.

    ``ready`` is False until ``Parallel.unit`` has materialised it for the data axis; layers
    refuse a parameter that is not ready (a forward that skipped ``ctx.unit`` would compute
    with an FSDP shard)."""

    __slots__ = ("logical", "path", "pending", "ready", "role", "spec", "uses", "value")

    def __init__(self, value, role: str, spec, path: str, ready: bool = False, pending=None,
                 logical=None):  # fmt: skip
        self.value, self.role, self.spec, self.path, self.ready = value, role, spec, path, ready
        self.uses = 0
        """How many units of this forward have used it so far (not part of the pytree: each
        trace wraps fresh ``Param`` objects)."""
        self.pending = pending
        """The dim still split over ``data`` (a dense weight whose gather waits for the layer
        to choose its route, ``models.strategies.fsdp``), or None."""
        self.logical = logical
        """The model's own (global) shape: the stored one pads a dim the tp axis does not
        divide (``models.training``); the layers mask what lies beyond it."""

    def tree_flatten(self):
        aux = (self.role, self.spec, self.path, self.ready, self.pending, self.logical)
        return (self.value,), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def replace(self, **changes) -> Param:
        """A copy with some fields changed (``value``, ``ready``, ``pending``, …)."""
        fields = {k: getattr(self, k) for k in self.__slots__ if k != "uses"}
        return Param(**{**fields, **changes})

    @property
    def shape(self):
        return self.value.shape

    def __repr__(self):
        return f"Param({self.path}, role={self.role}, spec={self.spec}, shape={self.shape})"


def is_param(x) -> bool:
    return isinstance(x, Param)


def wrap(params, roles, specs, logical=None):
    """The parameter tree as ``Param`` leaves (not yet materialised); ``logical``: the model's
    own shapes (a tree of tuples) where they differ from the stored ones (padding)."""
    if logical is None:
        logical = jax.tree.map(lambda _: None, roles)

    def param(path, value, role, spec, shape):
        return Param(value, role, spec, jax.tree_util.keystr(path), logical=shape)

    return jax.tree_util.tree_map_with_path(
        param, params, roles, specs, logical, is_leaf=lambda x: x is None or is_shape(x)
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
        AllReduces it). Under zero1 the parameters arrive varying over its axes already
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
        gradient (``Strategy.gradient_axes``: the backward AllReduces it, in float32)."""
        if p.ready:  # entered the region already (a stacked leaf, by ``scan``)
            return p
        value = p.value
        if self.strategy.gradient_axes:  # dx AllReduced
            axes = self.strategy.gradient_axes
            with shardops.comm.because(_REPLICATED, axes):
                value = shardops.comm.copy_to_region(value, axes, self.precision.accum_dtype)
        return p.replace(value=value, ready=True)

    def _split_size(self, p: Param, dim: int) -> int:
        """How many blocks of ``p``'s dim ``dim`` the layers' axis splits (its devices' count
        where the plan role splits the dim over it, else 1)."""
        axis = self.axis_name("model")
        return lax.axis_size(axis) if _entries_over(p.spec, axis, dim + 1)[dim] else 1

    def split_dim(self, spec) -> int | None:
        """The dim of a leaf split over the axes of a kind that splits parameters (fsdp's), by
        its PartitionSpec, or None."""
        return split_dim(spec, self.strategy.parameter_axes)

    @property
    def _splitter(self):
        """The kind that splits parameters (fsdp), or None."""
        return next((k for k in self.strategy.kinds if k.splits_parameters), None)

    # --- layers: the kernels

    def _layer_kernel(self, hook: str, *args):
        """The first answer of the kinds' layer hook ``hook`` (``Kind.dense``, …), asked from
        the innermost kind (tensor) out, or None where none runs the layer."""
        for kind in reversed(self.strategy.kinds):
            y = getattr(kind, hook)(self, *args)
            if y is not None:
                return y
        return None

    def _dense(self, p, x):
        """``x[..., D] · w + b``: by the kind that runs ``p["w"]``'s role (tp's column and
        row kernels), else local. A weight a kind left split (``pending``: fsdp's route) is
        that kind's first."""
        role = p["w"].role
        if role not in (COLUMN, ROW, REPLICATED):
            raise ValueError(f"{p['w'].path}: a dense layer takes role column, row or "
                             f"replicated; the plan says {role!r}")  # fmt: skip
        if getattr(p["w"], "pending", None) is not None:  # a weight left split (fsdp's route)
            y = self._splitter.pending_dense(self, p, x)
            if y is not None:
                return y
        y = self._layer_kernel("dense", p, x)
        if y is not None:
            return y
        w, b = self._arrays(p, "w", "dense"), self._optional(p, "b")
        return shardops.dense(x, w, b, precision=self.precision)

    def _embed(self, p, ids):
        """``table[ids]``: by the kind that runs the table's role (tp's vocab-parallel lookup),
        else local. ``ids`` hold the whole sequence; each device looks up its own tokens
        (``local_tokens``)."""
        table, role = self._arrays(p, "table", "embed"), p["table"].role
        if role not in (VOCAB, REPLICATED):
            raise ValueError(f"{p['table'].path}: an embedding takes role vocab or replicated; "
                             f"the plan says {role!r}")  # fmt: skip
        ids = self.local_tokens(ids)  # ids[b, S_context] under cp
        x = self._layer_kernel("embed", p, ids)
        if x is not None:
            return x
        return jnp.take(table, ids, axis=0).astype(self.precision.compute_dtype)  # x[B, S, D]

    def _attention(self, p, x, **options):
        """Self-attention: by the kind that runs it (tp's head-parallel kernel, cp's by its
        method), each kind having made the options its own (``Kind.attention_options``: cp's
        positions), else local."""
        params = {k: self._arrays(p, k, "attention") for k in p}
        roles = {q.role for q in p.values()}
        if roles - {HEAD, REPLICATED} or len(roles) > 1:
            raise ValueError(f"attention parameters take one role, head or replicated; the plan "
                             f"says {sorted(roles)}")  # fmt: skip
        for kind in self.strategy.kinds:
            options = kind.attention_options(self, options)
        options["implementation"] = self.attention_implementation
        y = self._layer_kernel("attention", p, x, options)
        if y is not None:
            return y
        return shardops.attention(x, params, precision=self.precision, **options)

    def _layer_norm(self, p, x, eps):
        return shardops.layer_norm(
            x, self._optional(p, "scale"), self._optional(p, "bias"), eps=eps
        )  # same layout as x; under sp dscale, dbias are AllReduced over model (check_vma)

    def _rms_norm(self, p, x, eps):
        return shardops.rms_norm(x, self._optional(p, "scale"), eps=eps)

    # --- layers, each tapped for shardops.inspect.compare (the identity outside it)

    def dense(self, p, x):
        """``x[..., D] · w + b`` by the role of ``p["w"]``: column-parallel, row-parallel or
        local. Under sp, ``x[B, S_model, D]`` is gathered along S by a column layer and a row
        layer's output is reduce-scattered back along S. Keys: ``w``, optionally ``b``."""
        _check_keys(p, "dense", LAYER_KEYS["dense"])
        k = x.shape[-1] * self._split_size(p["w"], 0)  # D: a row layer's x holds D/p of it
        return self._tap(
            self._dense(p, x),
            p,
            k=k,
            features_split=self.is_split(p),
            features=_logical(p["w"], 1) if self.is_split(p) else None,
        )

    def embed(self, p, ids):
        """``table[ids]``: vocab-parallel under tp (the AllReduce, or under sp the
        ReduceScatter along S, of the rows each device holds), else a local lookup. Keys:
        ``table``."""
        _check_keys(p, "embed", LAYER_KEYS["embed"])
        return self._tap(self._embed(p, ids), p, k=1)

    def attention(self, p, x, *, num_heads: int, num_kv_heads: int | None = None,
                  causal: bool = True, rope_theta: float | None = None, positions=None,
                  segment_ids=None):  # fmt: skip
        """Self-attention of ``x[b, S, D]`` (sp: ``x[b, S_model, D]``): head-parallel under tp
        (sp: x gathered along S once), else local. ``num_kv_heads`` < ``num_heads`` is
        grouped-query attention; ``rope_theta`` rotary positions at ``positions[b, S]`` (each
        token's global position; default ``0 … S−1``, restarting at each document of
        ``segment_ids[b, S]``, which keep attention within a document). ``positions`` and
        ``segment_ids`` cover the whole sequence, also under sp and cp (under cp, ``x`` is
        this device's block ``x[b, S_context, D]`` and attention runs by the layout's
        ``cp_method``, ``shardops.layers.context_parallel_attention_kernel``). Keys: ``wq``,
        ``wk``, ``wv``, ``wo``, optionally ``bq``, ``bk``, ``bv``, ``bo`` (``shardops.init_attention``)."""
        _check_keys(p, "attention", LAYER_KEYS["attention"])
        y = self._attention(p, x, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal,
                            rope_theta=rope_theta, positions=positions,
                            segment_ids=segment_ids)  # fmt: skip
        y = checkpoint_name(y, ATTENTION_OUTPUT)  # what remat=("attention_output",) saves
        model = self.axis_name("model")  # x[b, S_model, D] varies over it under sp
        seq = x.shape[SEQUENCE_DIM] * (lax.axis_size(model) if model in varying_axes(x) else 1)
        return self._tap(y, p, k=max(x.shape[-1], seq))  # K: D (projections), S (p · v)

    def gated_mlp(self, p, x, *, activation: Callable = jax.nn.silu):
        """``down(activation(gate(x)) ⊙ up(x))`` of ``x[b, S, D]`` (SwiGLU by default): under
        tp gate and up column-parallel and down row-parallel, ``x`` entering the region once
        for both (``shardops.layers.tensor_parallel_gated_mlp_kernel``), else local. Keys:
        ``gate``, ``up``, ``down``, each a dense layer's ``w`` and optional ``b``
        (``shardops.init_gated_mlp``)."""
        _check_keys(p, "gated_mlp", LAYER_KEYS["gated_mlp"])
        for name in ("gate", "up", "down"):
            _check_keys(p[name], "gated_mlp", LAYER_KEYS["dense"])
        x = checkpoint_name(x, MLP_INPUT)  # names for remat (the hidden's: shardops'; ``remat``)
        y = self._layer_kernel("gated_mlp", p, x, activation)
        if y is None:
            params = {k: {n: self._value(q, "gated_mlp") for n, q in p[k].items()} for k in p}
            y = shardops.gated_mlp(x, params, activation=activation, precision=self.precision)
        y = checkpoint_name(y, MLP_OUTPUT)
        return self._tap(y, p, k=p["down"]["w"].shape[0] * self._split_size(p["down"]["w"], 0))

    def layer_norm(self, p, x, *, eps: float = 1e-5):
        """``shardops.layer_norm`` of ``x[..., D]``. Keys, both optional: ``scale``, ``bias``."""
        _check_keys(p, "layer_norm", LAYER_KEYS["layer_norm"])
        return self._tap(self._layer_norm(p, x, eps), p, k=x.shape[-1])

    def rms_norm(self, p, x, *, eps: float = 1e-6):
        """``shardops.rms_norm`` of ``x[..., D]``. Keys, optional: ``scale``."""
        _check_keys(p, "rms_norm", LAYER_KEYS["rms_norm"])
        return self._tap(self._rms_norm(p, x, eps), p, k=x.shape[-1])

    def _tap(self, y, p, *, k: int, features_split: bool = False, features: int | None = None,
             suffix: str = ""):  # fmt: skip
        """``shardops.inspect.tap`` of a layer's output, named by its parameters' path, with the layout
        of the strategy: the batch over its batch axes, and over the tp axis the features (a
        column layer) or the sequence (between layers under sp) when ``y`` varies over it."""
        paths = [q.path for q in jax.tree.leaves(p, is_leaf=is_param) if is_param(q)]
        if not paths:  # a layer without parameters (a norm with no scale): no name to tap by
            return y
        name = _layer_path(paths) + suffix
        if shardops.inspect.tapping():
            for kind in self.strategy.kinds:
                kind.check_locate(self.strategy)
        spec, model = None, self.axis_name("model")
        if self.strategy.axes:
            varying = varying_axes(y)
            entries: list = [None] * y.ndim
            batch = [a for a in self.strategy.batch_axes if a in varying]
            if batch:
                entries[0] = spec_entry(*batch)
            if model in varying:
                entries[-1 if features_split else SEQUENCE_DIM] = model
            spec = P(*entries)
        shape = None if features is None else (*(None,) * (y.ndim - 1), features)
        return shardops.inspect.tap(y, name, spec=spec, k=k, shape=shape)  # padding cut off

    def is_split(self, p) -> bool:
        """Whether ``dense(p, ·)``'s (or ``tied_head(p, ·)``'s) output is split along its
        features: a column layer (a vocab table) under tp (``Kind.splits_output``)."""
        return any(kind.splits_output(p) for kind in self.strategy.kinds)

    def tied_head(self, p, x):
        """Logits ``x[b, S, D] · table[V, D]ᵀ`` of the embedding's own table (tied input and
        output embeddings): under tp vocab-parallel, ``logits[b, S, V_model]`` never gathered,
        ``x`` entering the region as a column layer's input (sp: gathered along S), so
        ``dx`` is AllReduced (sp: ReduceScattered) over the tp axis; else a local product.
        The table's gradient is the sum of both uses (autodiff adds them; under FSDP each use
        gathers it and ReduceScatters its part). Keys: ``table``."""
        _check_keys(p, "tied_head", LAYER_KEYS["embed"])
        table, role = self._arrays(p, "table", "tied_head"), p["table"].role
        if role not in (VOCAB, REPLICATED):
            raise ValueError(f"{p['table'].path}: a tied head takes role vocab or replicated; "
                             f"the plan says {role!r}")  # fmt: skip
        w = table.T  # w[D, V(_model)]: the table's rows as output columns
        y = self._layer_kernel("tied_head", p, w, x)
        if y is None:
            y = shardops.dense(x, w, precision=self.precision)
        return self._tap(
            y,
            p,
            k=x.shape[-1],
            features_split=self.is_split(p),
            features=_logical(p["table"], 0) if self.is_split(p) else None,
            suffix=" (tied head)",  # the embedding's own tap has the plain name
        )

    def cross_entropy(self, logits, labels, *, split: bool, vocab_size: int | None = None):
        """Per-position loss ``[...]`` in float32 of integer ``labels``; ``split``: the logits
        are ``logits[..., V_model]`` (a column head) and the loss is vocab-parallel.
        ``vocab_size``: the logical V when the logits hold padded columns (masked out)."""
        _check_logits_cover_labels(logits, labels)
        if split:
            return self._split_loss("cross_entropy", logits, labels, vocab_size)
        logits = logits.astype(jnp.float32)  # [..., V] in f32
        return optax.softmax_cross_entropy_with_integer_labels(logits[..., :vocab_size], labels)

    def argmax(self, logits, *, split: bool, vocab_size: int | None = None):
        """The arg-max over the vocabulary (int32), padded columns (from ``vocab_size`` on)
        excluded."""
        if split:
            return self._split_loss("argmax", logits, vocab_size)
        return jnp.argmax(logits[..., :vocab_size], axis=-1).astype(jnp.int32)

    def _split_loss(self, hook: str, logits, *args):
        """``hook`` (``cross_entropy``, ``argmax``) of logits split along the vocabulary, by
        the kind that split them."""
        y = self._layer_kernel(hook, logits, *args)
        if y is None:
            raise ValueError(
                f"ctx.{hook}(split=True): no kind of strategy {self.strategy.name!r} splits the "
                f"vocabulary; pass split=ctx.is_split(head_params), which says whether it is"
            )
        return y

    def scan(self, fn: Callable, params, x):
        """``x = fn(layer, x)`` for each layer of ``params``, whose leaves stack the layers
        along dim 0 (the plan's ``stacked`` roles), with ``lax.scan``: one compiled block
        whatever the depth. Each layer runs as a unit (``ctx.unit``: FSDP gathers one
        layer's weights at a time, inside the loop; remat re-gathers them in the backward)."""
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
        per_layer = jax.tree.map(  # each leaf: the layer's role, spec and shape; values stacked
            lambda q: q.replace(role=q.role.layer, spec=P(*q.spec[1:]),
                                logical=None if q.logical is None else q.logical[1:]),
            params, is_leaf=is_param,
        )  # fmt: skip

        if shardops.inspect.tapping():  # the locator: each layer tapped under its own name
            root = _layer_path([q.path for q in leaves])  # "['blocks']"
            for i in range(layers.pop()):
                layer = jax.tree.map(
                    lambda q, i=i: q.replace(value=q.value[i], path=q.path.replace(
                        root, f"{root}[{i}]", 1)), per_layer, is_leaf=is_param)  # fmt: skip
                x = self.unit(fn, layer, x)
            return x

        def body(x, layer):
            y = self.unit(fn, layer, x)
            if jax.typeof(y) != jax.typeof(x):
                raise ValueError(
                    f"ctx.scan: each layer must return what it takes (a residual stream), "
                    f"{jax.typeof(x)}; the layer of {_layer_path([q.path for q in leaves])} "
                    f"returned {jax.typeof(y)}"
                )
            return y, None

        return lax.scan(body, x, per_layer)[0]

    # --- for a layer of your own: the shard-dependent pieces, by kind of parallelism

    def axis_name(self, kind: str = "model"):
        """The mesh axis or axes that carry ``kind`` under this strategy, or None where it has
        none: ``"model"``, the tp axis (tp and sp); ``"data"``, the batch axes (dp, zero1,
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
        its plan role), whole over ``data`` (gathered under fsdp). A parameter stored padded
        (a dim the tp axis does not divide) is refused: its block would hold padding that no
        layer of yours masks."""
        value = self._value(param, "array")
        if isinstance(param, Param) and param.logical is not None:
            stored = tuple(n * math.prod(lax.axis_size(a) for a in entry_axes(e))
                           for n, e in zip(value.shape, _entries_over(param.spec, self.axis_name(),
                                                                     value.ndim), strict=True))  # fmt: skip
            if stored != tuple(param.logical):
                raise ValueError(
                    f"ctx.array: {param.path} is stored padded, {stored} for the model's "
                    f"{tuple(param.logical)} (its plan role {param.role!r} splits a dim the tp "
                    f"axis {self.axis_name()!r} does not divide): the padding would reach your layer "
                    f"unmasked. Use a size the axis divides, role 'replicated', or a shardops "
                    f"layer (ctx.dense, ctx.embed, ctx.gated_mlp), which mask it."
                )
        return value

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


LAYER_KEYS = {
    "dense": (("w",), ("b",)),
    "embed": (("table",), ()),
    "attention": (("wq", "wk", "wv", "wo"), ("bq", "bk", "bv", "bo")),
    "layer_norm": ((), ("scale", "bias")),
    "rms_norm": ((), ("scale",)),
    "gated_mlp": (("gate", "up", "down"), ()),
}
"""Each ``ctx`` layer's parameter keys: (required, optional)."""

_HINTS = {
    "weight": "Hugging Face's norm 'weight' is 'scale' here; its Linear 'weight[out, in]' is "
              "'w[in, out]' (transposed)",
    "kernel": "Flax's 'kernel' is 'w' here, 'bias' is 'b'",
    "embedding": "Flax's 'embedding' is 'table' here",
}  # fmt: skip


def _check_keys(p, layer: str, keys) -> None:
    """Refuse a parameter dict that lacks a key ``layer`` needs or holds one it does not use,
    naming the layer, the parameters' path, the keys expected and the keys given."""
    required, optional = keys
    if not isinstance(p, dict):
        raise TypeError(f"ctx.{layer} takes a dict of parameters (keys {list(required + optional)}); "
                        f"got {type(p).__name__}")  # fmt: skip
    missing = [k for k in required if k not in p]
    unknown = sorted(set(p) - set(required) - set(optional), key=str)
    if not (missing or unknown):
        return
    leaf = next((q for q in jax.tree.leaves(p, is_leaf=is_param) if is_param(q)), None)
    where = f" at {leaf.path[: leaf.path.rfind('[')] or 'the top'}" if leaf is not None else ""
    what = [f"missing {missing}"] if missing else []
    what += [f"unknown {unknown}"] if unknown else []
    hints = [_HINTS[k] for k in unknown if k in _HINTS]
    expected = f"{list(required)}" + (f", optionally {list(optional)}" if optional else "")
    raise ValueError(
        f"ctx.{layer}{where}: expects parameter keys {expected}; got {sorted(p, key=str)} "
        f"({', '.join(what)})." + (f" {'; '.join(hints)}." if hints else "")
    )


def _entries_over(spec, axis, ndim: int):
    """``spec``'s entries with only ``axis`` kept (a unit's value is whole over the rest)."""
    entries = list(spec) + [None] * (ndim - len(spec))
    return [axis if axis is not None and axis in entry_axes(e) else None for e in entries]


def _logical(p: Param, dim: int) -> int | None:
    """The model's own size of ``p``'s dim ``dim`` (None where nothing is padded)."""
    return None if p.logical is None else p.logical[dim]


def _layer_path(paths) -> str:
    """The path of the layer whose parameters have ``paths`` (``"['blocks'][0]['up']"`` for
    ``…['up']['w']`` and ``…['up']['b']``): their common prefix, to a whole key."""
    if len(paths) == 1:
        return paths[0][: paths[0].rfind("[")]
    n = 0
    while all(len(q) > n and q[n] == paths[0][n] for q in paths):
        n += 1
    prefix = paths[0][:n]
    return prefix[: prefix.rfind("]") + 1]


def _check_logits_cover_labels(logits, labels) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"cross_entropy: logits{tuple(logits.shape)} do not cover labels"
            f"{tuple(labels.shape)} (the logits' leading dims must equal the labels' shape). "
            f"Under sequence parallelism the output layer gathers the sequence only as a "
            f"column-parallel layer: give it the plan's role 'column'."
        )


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
