"""Flax NNX modules as shardops models: a module trained under any strategy as its author wrote it.

    from shardops_models.interop.flax_nnx import FlaxModel
    model = FlaxModel(lambda rngs: MyLlama(config, rngs=rngs), rules=RULES)  # the one call
    setup = models.build("fsdp_tp", mesh, model=model, optimizer=optax.adam(3e-4))

``make(rngs)`` builds the module (``nnx.Module``) with its parameters annotated by logical axis
names (``nnx.with_partitioning(init, ("embed", "mlp"))``, Flax's ``out_sharding`` metadata);
``rules``, MaxText's ``logical_axis_rules`` table, maps each name to the tensor-parallel axis
``"model"`` or to ``None``. The module is built with Flax's eager sharding off
(``nnx.use_eager_sharding(False)``): shardops lays the parameters out itself, by strategy.

**How each layer runs.** At every forward the module is rebuilt from its graph and each layer
it calls is swapped (``nnx`` attribute assignment) for one that calls the strategy's kernel on
the layer's own parameters, so every collective is explicit, in the ledger and in ``explain``:

=================================  ===========================================================
Flax layer                         shardops kernel (role from the annotations and ``rules``)
=================================  ===========================================================
``nnx.Linear``                     ``ctx.dense``: ``kernel[in, out]`` with ``out`` → model is
                                   column-parallel, ``in`` → model row-parallel, neither
                                   replicated (FSDP, ZeRO-1 and the data axes by the strategy)
``nnx.LinearGeneral``,             ``ctx.dense`` of the flattened kernel ``k[*in, *out]``:
``nnx.Einsum``                     split on the first out dim (column: a projection to
                                   ``[heads, head_dim]``) or the first in dim (row: back from
                                   them); ``_flax_dense``
``nnx.Embed`` (and ``.attend``)    ``ctx.embed`` / ``ctx.tied_head``: ``embedding[vocab,
                                   features]``, ``vocab`` → model vocab-parallel
``nnx.RMSNorm``, ``nnx.LayerNorm``  ``ctx.rms_norm``, ``ctx.layer_norm`` (features unsplit)
``jax.nn.dot_product_attention``,  the strategy's per-device attention core on each device's
``nnx.dot_product_attention``      heads (``build(attention=...)``: blocked, splash, einsum);
                                   with a mask or bias, JAX's or Flax's own on those heads
                                   (``nnx.MultiHeadAttention``'s masked attention)
=================================  ===========================================================

A module swap, not the ``dot_general`` hook that ``nnx.Linear`` takes: the hook sees the kernel
as an array already sliced by the caller, so it cannot gather an FSDP shard or choose column
against row, and ``nnx.Embed`` and the norms have no hook. Code of the user's own between the
layers (activations, residuals, attention written with ``jnp.einsum`` over the heads the
projections produced) runs per device as written: under tp each device holds its heads, which
the attention needs no collective for. A parameter that no swapped layer owns (a module calling
``jnp.dot`` on its own ``nnx.Param``, ``nnx.Conv``, a layer with another ``dot_general``) is an
error naming its path and class before anything is traced: shardops never replicates or gathers
a weight it cannot see used.

**A mixture of experts** the module writes itself (its experts stacked in ``nnx.Param``s, its
own routing) is declared, ``FlaxModel(moe={"blocks.*.moe": FlaxExperts(...)})``, and its
sub-module swapped whole for ``ctx.moe`` (``_flax_experts``): under ep its experts split over
the expert axis, under tp each one's hidden units.

**Stacked blocks** (``FlaxModel(stacked="blocks")``): blocks stacked by ``nnx.vmap`` (each
``Param`` ``[L, …]``) and scanned by ``nnx.scan`` in the forward run by ``ctx.scan``, a block
at a time, and under pp by stage (``_flax_stacked``).

**A split sequence.** Under sp each norm's output is gathered along S once
(``ctx.gather_sequence``), so a sublayer's own code sees the whole sequence and its column
layers read that one gather; row layers and the embedding return the residual stream's block
(``SequenceSplit``). Under cp the module takes its positions from ``FlaxModel(positions=)``
and its attention runs by the context method (``_flax_attention``); a module that cannot honour
either is refused (``docs/flax.md``).

**The task.** ``task="lm"``: ``ids[B, S]`` → ``logits[B, S, V]``, next-token labels, the loss,
metrics and batch checks of ``models.Gpt`` (``PAD_LABEL`` skipped); the head is the ``nnx.Linear``
whose ``out_features`` is the vocabulary (or the embedding's ``attend``), its logits left split
over the vocabulary under tp. ``task="classify"``: ``x[B, ...]`` → ``logits[B, C]`` and integer
labels ``y[B]``, the mean softmax cross-entropy.

**Precision.** shardops' policy (``build(precision=...)``) sets every dtype; a layer built with
a ``dtype`` (compute) or ``param_dtype`` other than the policy's is refused, so that the sharded
run computes what the module's own does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardops import MODEL_AXIS
from shardops_models.interop._flax_attention import attention_by
from shardops_models.interop._flax_experts import (
    FlaxExperts,
    SwappedExperts,
    declared_at,
    parameters,
)
from shardops_models.interop._flax_experts import role as experts_role
from shardops_models.interop._flax_layers import (
    EMBED,
    EXPERTS,
    GENERAL,
    LINEAR,
    NORM,
    SWAPPED,
    SequenceSplit,
    Swapped,
    as_shardops,
    at,
    geometry,
    set_at,
)
from shardops_models.interop._flax_stacked import (
    StackedBlocks,
    check_sizes,
    one_block,
    scanned_by,
    unseen_scan,
)
from shardops_models.interop._foreign import TASKS, ForeignModel, at_dict, check_unpadded
from shardops_models.strategies.plan import COLUMN, REPLICATED, ROW, VOCAB
from shardops_models.strategies.plan import stacked as stacked_plan

__all__ = ["SWAPPED", "FlaxExperts", "FlaxModel"]


@dataclasses.dataclass(frozen=True)
class _Stack:
    """The stacked blocks (``FlaxModel(stacked=...)``): where they sit, one block's graph and
    abstract parameters (``one_block``), the layers swapped in it and the number of layers."""

    path: tuple
    graphdef: Any
    state: Any
    layers: dict
    count: int


def _axis_of(rules: Mapping[str, Any], name, where: str):
    """The mesh axis ``rules`` maps the logical dim ``name`` to: the tp axis or None."""
    axis = rules.get(name) if name is not None else None
    if axis not in (None, MODEL_AXIS):
        raise ValueError(
            f"{where}: rules map {name!r} to {axis!r}; shardops splits parameters over the data "
            f"axes by the strategy (fsdp, hsdp, zero1), so a parameter's logical dim maps to "
            f"{MODEL_AXIS!r} (tensor parallelism) or None. Give ({name!r}, None) or "
            f"({name!r}, {MODEL_AXIS!r})"
        )
    return axis


def _names(variable, ndim: int):
    """A parameter's logical dim names (Flax's ``out_sharding`` metadata), or all None."""
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names is not None else (None,) * ndim


def _role(kind: str, layer, state, rules, where: str):
    """The plan role of one swapped layer (module docstring's table), from its annotations."""
    if kind == LINEAR:
        kernel = layer.kernel
        if kernel.ndim != 2:  # e.g. layers stacked by nnx.vmap: [L, in, out]
            raise ValueError(f"{where}.kernel has shape {tuple(kernel.shape)}; an nnx.Linear "
                             f"shardops runs holds kernel[in, out] (layers stacked by nnx.vmap: "
                             f"name their sub-module, FlaxModel(stacked=...))")  # fmt: skip
        split = [_axis_of(rules, n, f"{where}.kernel") is not None
                 for n in _names(kernel, 2)]  # fmt: skip
        if all(split):
            raise ValueError(f"{where}.kernel: both dims map to {MODEL_AXIS!r}; a dense layer is "
                             f"column- or row-parallel, not both")  # fmt: skip
        return COLUMN if split[1] else ROW if split[0] else REPLICATED
    if kind == GENERAL:
        names = _names(layer.kernel, layer.kernel.ndim)
        split = [_axis_of(rules, n, f"{where}.kernel") is not None for n in names]
        bias = getattr(layer, "bias", None)
        return geometry(layer, where).role(split, None if bias is None else bias.ndim)
    if kind == EMBED:
        vocab, features = (_axis_of(rules, n, f"{where}.embedding") is not None
                           for n in _names(layer.embedding, 2))  # fmt: skip
        if features:
            raise ValueError(f"{where}.embedding: its features dim maps to {MODEL_AXIS!r}; "
                             f"shardops splits an embedding over the vocabulary only")  # fmt: skip
        return VOCAB if vocab else REPLICATED
    for name, variable in state.items():  # a norm: its scale and bias whole
        if any(_axis_of(rules, n, f"{where}.{name}") for n in _names(variable, 1)):
            raise ValueError(f"{where}.{name}: a norm's features are not split; map its dim to "
                             f"None")  # fmt: skip
    return REPLICATED


def _experts_role(sub, paths: dict, rules, where: str):
    """The role of a mixture of experts' parameters (``_flax_experts.role``): its hidden dim
    ``F`` split over the tp axis where its logical name maps to it, in all three experts'
    parameters alike; no other dim of them but the experts' (the strategy's) split."""
    flat = dict(nnx.to_flat_state(nnx.state(sub, nnx.Param)))
    hidden = {"gate": 2, "up": 2, "down": 1}
    split = {}
    for key, path in paths.items():
        variable = flat[path]
        for dim, name in enumerate(_names(variable, variable.ndim)):
            if key != "router" and dim == 0:
                continue  # the experts dim: ep's axis, by the strategy
            axis = _axis_of(rules, name, f"{where}.{_path(path)}")
            if dim == hidden.get(key):
                split[key] = axis is not None
            elif axis is not None:
                raise ValueError(
                    f"{where}.{_path(path)}: dim {dim} ({name!r}) maps to {MODEL_AXIS!r}; of a "
                    f"mixture of experts shardops splits the experts' hidden dim F over it "
                    f"(and the experts over ep's axis), nothing else"
                )
    if len(set(split.values())) != 1:
        raise ValueError(f"{where}: the experts' hidden dim F maps to {MODEL_AXIS!r} in some of "
                         f"gate, up and down but not all ({split}); map it alike in all three")  # fmt: skip
    return experts_role(paths, split["gate"], where)


def _check_layer(kind: str, layer, where: str, precision=None) -> None:
    """Refuse a layer option the swapped layer would not honour (module docstring)."""
    if kind in (LINEAR, GENERAL):
        options = {"dot_general": getattr(layer, "dot_general", None),
                   "dot_general_cls": getattr(layer, "dot_general_cls", None),
                   "einsum_op": getattr(layer, "einsum_op", None),
                   "precision": layer.precision,
                   "preferred_element_type": layer.preferred_element_type}  # fmt: skip
        defaults = (None, jax.lax.dot_general, jnp.einsum)
        own = [f"{k}={v!r}" for k, v in options.items() if not any(v is d for d in defaults)]
        if own:
            raise ValueError(
                f"{where}: {type(layer).__name__} with {', '.join(own)}; shardops runs dense "
                f"layers with its kernels and its precision policy (build(precision=...)). "
                f"Build the layer without it"
            )
    if kind == GENERAL:
        geometry(layer, where)  # a layout shardops runs, else a ValueError naming it
    if kind == NORM:
        axes = (getattr(layer, "reduction_axes", -1), getattr(layer, "feature_axes", -1))
        if any(a not in (-1, (-1,)) for a in axes) or getattr(layer, "axis_name", None):
            raise ValueError(f"{where}: {type(layer).__name__} over the last axis only (no "
                             f"reduction_axes, feature_axes or axis_name of its own)")  # fmt: skip
    if precision is None:
        return
    for field, want, role in (("dtype", precision.compute_dtype, "computes in"),
                              ("param_dtype", precision.param_dtype, "keeps parameters in")):  # fmt: skip
        got = getattr(layer, field, None)
        if got is not None and jnp.dtype(got) != jnp.dtype(want):
            raise ValueError(
                f"{where}: {type(layer).__name__}({field}={jnp.dtype(got).name}) but the "
                f"precision policy {role} {jnp.dtype(want).name}; build the layer with the "
                f"policy's dtypes (dtype=None: the policy sets it) or give build the matching "
                f"precision"
            )


def _path(keys) -> str:
    return ".".join(map(str, keys)) or "the module"


def _swap(ctx, kind: str, p, layer, where: str, split, unit: bool) -> Swapped:
    """The layer ``layer`` (of ``kind``) swapped for the strategy's kernel on ``p``, its
    options checked first; ``unit``: each call a unit of its own (else inside one already)."""
    _check_layer(kind, layer, where, ctx.precision)
    check_unpadded(p, where, "FlaxModel")
    return Swapped(ctx, kind, p, layer, where, split, unit=unit)


def _layers_of(module, owned=(), prefix=()) -> dict[tuple, str]:
    """Path → kind of each layer of ``module`` shardops swaps, but for those under ``owned``
    (the experts', the stacked blocks'); a ValueError naming the first parameter none owns and
    its module's class. ``prefix``: the module's own path, for messages."""

    def inside(path) -> bool:
        return any(path[: len(e)] == e for e in owned)

    layers = {path: SWAPPED[type(m)] for path, m in nnx.iter_modules(module)
              if type(m) in SWAPPED and not inside(path)}  # fmt: skip
    for path, _ in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        owner = path[:-1]
        if owner not in layers and not inside(path):
            cls = type(at(module, owner)).__name__
            raise ValueError(
                f"FlaxModel: parameter {_path(prefix + path)} belongs to {cls} at "
                f"{_path(prefix + owner)}, which shardops cannot run with an explicit kernel (it "
                f"runs {', '.join('nnx.' + c.__name__ for c in SWAPPED)}). Write that "
                f"computation with those layers, or as a models.Model of your own "
                f"(ctx.dense, ctx.array: docs/strategies.md#any-model)"
            )
    return layers


@dataclasses.dataclass(frozen=True, eq=False)
class FlaxModel(ForeignModel):
    """A Flax NNX module as a shardops model (``models.Model``; the module docstring).

    Arguments:
        make: ``make(rngs) -> nnx.Module``, the module's constructor as its author calls it.
        rules: ``(logical name, "model" or None)`` pairs (or a dict): MaxText's
            ``logical_axis_rules`` for the parameters; a name no rule names is not split.
        task: ``"lm"`` (``ids[B, S]`` → ``logits[B, S, V]``) or ``"classify"``.
        name: for messages.
        num_heads, num_kv_heads: the attention's head counts, if it has any (tp checks that
            its axis divides them: each device's projections then hold whole heads).
        context: the longest sequence (``task="lm"``; default: unbounded).
        positions: the keyword by which the module's ``__call__`` takes each token's position,
            ``positions[B, S]`` int32 (MaxText's ``decoder_positions``, gemma's ``positions``):
            given, it is passed under every strategy, under context parallelism each device's
            own (its chunks of the load-balanced layout, ``ctx.local_tokens``). Required under
            cp, where the module cannot compute them from its block.
        example_shape: one example's shape (``task="classify"``), for the abstract batch the
            budget and the cost model trace (``setup.collective_budget``).
        moe: ``(path pattern, FlaxExperts)`` pairs (or a dict): the sub-modules that are
            mixtures of experts (``fnmatch`` patterns over dotted paths, ``"blocks.*.moe"``;
            the first match wins), each run whole as ``ctx.moe`` (``_flax_experts``). Their
            load-balancing and router z losses are ``apply``'s auxiliary losses.
        aux_weights: the weight of each auxiliary loss (``"load_balance"``, ``"z_loss"``;
            default 0: the module's own objective, the cross-entropy alone).
        stacked: the dotted path of a sub-module whose blocks are stacked by ``nnx.vmap``
            (every ``Param`` ``[L, …]``) and run by ``nnx.scan`` over them in the forward
            (``_flax_stacked``): its layers run one unit a layer by ``ctx.scan``, and under pp
            they split into stages.
    """

    make: Callable[[nnx.Rngs], nnx.Module]
    rules: Sequence[tuple[str, Any]] | Mapping[str, Any] = ()
    task: str = "lm"
    name: str = "flax"
    num_heads: int | None = None
    num_kv_heads: int | None = None
    context: int = sys.maxsize
    positions: str | None = None
    example_shape: tuple[int, ...] | None = None
    moe: Sequence[tuple[str, FlaxExperts]] | Mapping[str, FlaxExperts] = ()
    aux_weights: Mapping[str, float] | None = dataclasses.field(default=None, compare=False)
    stacked: str | None = None
    module_type: str = dataclasses.field(init=False, default="")
    """The module's class (``package.Class``): with the parameters' paths and shapes, what a
    checkpoint records of the model."""

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"FlaxModel: task must be one of {TASKS}; got {self.task!r}")
        try:
            pairs = list(self.rules.items() if isinstance(self.rules, Mapping) else self.rules)
            rules = {}
            for name, axis in pairs:  # the first rule for a name holds (Flax's, MaxText's)
                rules.setdefault(name, axis)
        except (TypeError, ValueError):
            raise TypeError(f"FlaxModel: rules must be (logical name, mesh axis or None) pairs, "
                            f"or a dict of them; got {self.rules!r}") from None  # fmt: skip
        object.__setattr__(self, "rules", rules)  # a parameter's names are checked by plan()
        try:
            experts = list(self.moe.items() if isinstance(self.moe, Mapping) else self.moe)
        except TypeError:
            experts = [None]
        if not all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str)
                   and isinstance(e[1], FlaxExperts) for e in experts):  # fmt: skip
            raise TypeError(f"FlaxModel: moe must be (path pattern, FlaxExperts) pairs, or a "
                            f"dict of them; got {self.moe!r}")  # fmt: skip
        object.__setattr__(self, "moe", tuple(experts))
        if experts or self.aux_weights:  # the loss's weights, not the model's identity
            weights = {"load_balance": 0.0, "z_loss": 0.0} if experts else {}
            object.__setattr__(self, "aux_weights", {**weights, **(self.aux_weights or {})})
        graphdef, abstract = self._abstract()
        kind = type(nnx.merge(graphdef, abstract))
        object.__setattr__(self, "module_type", f"{kind.__module__}.{kind.__qualname__}")
        object.__setattr__(self, "_graphdef", graphdef)
        object.__setattr__(self, "_state", abstract)
        module = nnx.merge(graphdef, abstract)
        object.__setattr__(self, "_stack", self._stacked_blocks(module))
        object.__setattr__(self, "_layers", self._swappable(module))
        object.__setattr__(self, "sequence", self.task == "lm")
        object.__setattr__(self, "_head_layer", self._find_head())

    # --- building the module

    def _module(self, key) -> nnx.Module:
        with nnx.use_eager_sharding(False):
            module = self.make(nnx.Rngs(key))
        if not isinstance(module, nnx.Module):
            raise TypeError(f"FlaxModel: make(rngs) must return an nnx.Module; got "
                            f"{type(module).__name__}")  # fmt: skip
        return module

    def _abstract(self):
        """The module's graph and its parameters' shapes (nothing allocated)."""
        with nnx.use_eager_sharding(False):
            module = nnx.eval_shape(lambda: self._module(jax.random.key(0)))
        others = nnx.state(module, nnx.Not(nnx.Param))
        if jax.tree.leaves(others):
            where = _path(next(iter(nnx.to_flat_state(others)))[0])
            raise ValueError(
                f"FlaxModel: {where} holds a variable that is not an nnx.Param (e.g. stored "
                f"rngs, batch statistics or a cache); shardops trains parameters only. Build the "
                f"module without it (e.g. without rngs kept for dropout)"
            )
        return nnx.split(module)

    def _swappable(self, module) -> dict[tuple, str]:
        """Module path → the kind of each layer shardops swaps (a declared mixture of experts
        whole, ``_experts``: its declaration and parameters; the stacked blocks' are
        ``_stack``'s); every parameter is owned by one (``_layers_of``)."""
        declared = declared_at(module, self.moe, _path)
        stack = () if self._stack is None else (self._stack.path,)
        inside = [p for p in declared if any(p[: len(q)] == q for q in stack)]
        if inside:
            raise ValueError(f"FlaxModel: the mixture of experts {_path(inside[0])} sits in the "
                             f"stacked blocks {self.stacked!r}; a mixture of experts in "
                             f"stacked blocks is not run yet (unstack them)")  # fmt: skip
        experts = {path: (d, parameters(at(module, path), d, _path(path)))
                   for path, d in declared.items()}  # fmt: skip
        object.__setattr__(self, "_experts", experts)
        layers = _layers_of(module, owned=(*experts, *stack))
        layers.update(dict.fromkeys(experts, EXPERTS))
        return layers

    def _stacked_blocks(self, module) -> _Stack | None:
        """The stacked blocks ``stacked`` names, or None."""
        if self.stacked is None:
            return None
        path = tuple(int(k) if k.isdigit() else k for k in self.stacked.split("."))
        try:
            blocks = at(module, path)
        except (AttributeError, IndexError, KeyError, TypeError):
            blocks = None
        if not isinstance(blocks, nnx.Module) or type(blocks) in SWAPPED:
            names = [_path(p) for p, m in nnx.iter_modules(module) if p and type(m) not in SWAPPED]
            raise ValueError(f"FlaxModel(stacked={self.stacked!r}): no sub-module of blocks "
                             f"there; the module's are {names[:12]}")  # fmt: skip
        graphdef, state = one_block(blocks, self.stacked)
        count = next(iter(nnx.to_flat_state(nnx.state(blocks, nnx.Param))))[1].shape[0]
        block = nnx.merge(graphdef, state)
        layers = _layers_of(block, prefix=path)
        check_sizes(block, layers, self.stacked)
        return _Stack(path, graphdef, state, layers, count)

    # --- models.Model

    def init(self, key, dtype=None):
        """The parameters ``make`` initialises from ``key`` (``nnx.Rngs(key)``), as a plain
        nested dict (``nnx.State.to_pure_dict``); ``dtype``: cast to it."""
        params = nnx.to_pure_dict(nnx.state(self._module(key), nnx.Param))
        return params if dtype is None else jax.tree.map(lambda a: a.astype(dtype), params)

    def module(self, params) -> nnx.Module:
        """The Flax module holding ``params`` (``init``'s dict: ``setup.gather(state.params)``,
        or a checkpoint's restored onto ``ref``), to run or save with Flax itself."""
        state = nnx.clone(self._state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self._graphdef, state)

    def plan(self):
        """Each swapped layer's role (module docstring), as a tree over ``init``'s dict; the
        stacked blocks' one block's, ``stacked(...)``."""
        module = nnx.merge(self._graphdef, self._state)
        plan = self._plan_of(module, self._layers)
        if self._stack is not None:
            s = self._stack
            block = self._plan_of(nnx.merge(s.graphdef, s.state), s.layers, s.path)
            at_dict(plan, s.path[:-1])[s.path[-1]] = stacked_plan(block)
        return plan

    def _plan_of(self, module, layers: dict, prefix=()):
        """The roles of ``module``'s ``layers`` (``prefix``: its path, for messages)."""
        plan = jax.tree.map(lambda _: REPLICATED, nnx.to_pure_dict(nnx.state(module, nnx.Param)))
        for path, kind in layers.items():
            layer, where = at(module, path), _path(prefix + path)
            if kind == EXPERTS:
                role = _experts_role(layer, self._experts[path][1], self.rules, where)
                for key_path in self._experts[path][1].values():
                    at_dict(plan, path + key_path[:-1])[key_path[-1]] = role
                continue
            _check_layer(kind, layer, where)
            sub = at_dict(plan, path)
            role = _role(kind, layer, dict(nnx.state(layer, nnx.Param).items()), self.rules, where)
            for k in sub:
                sub[k] = role
        return plan

    def apply(self, ctx, params, x):
        """The module's own ``__call__`` on ``x``, each swapped layer running the strategy's
        kernel on its ``Param``s (``ctx.unit``: one FSDP and remat unit per layer)."""
        context = [k.name for k in ctx.strategy.kinds if k.splits_sequence]
        split = SequenceSplit.of(ctx, ctx.local_tokens(x)) if self.task == "lm" else None
        self._check_strategy(ctx, context, split)
        kwargs = {}
        if self.positions is not None:
            whole = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
            kwargs[self.positions] = ctx.local_tokens(whole)  # positions[B, S(_context)]
        stats = []  # each mixture of experts' MoeStats
        module, swapped = self._swapped(ctx, params, split, stats)
        scans = scanned_by() if self._stack is not None else contextlib.nullcontext()
        with attention_by(ctx, (self.num_heads, self.num_kv_heads)) as calls, scans:
            try:
                logits = module(x, **kwargs)
            except (TypeError, ValueError) as e:
                if self._stack is not None and "StackedBlocks" in str(e):  # JAX's, not ours
                    raise unseen_scan(_path(self._stack.path), e) from e
                if not isinstance(e, TypeError) or split is None or "incompatible" not in str(e):
                    raise
                raise ValueError(
                    f"FlaxModel {self.name!r} under sequence parallelism: {e}. The residual "
                    f"stream is this device's block of the sequence and a sublayer's input (a "
                    f"norm's output) the whole of it, as in a pre-norm block (x + f(norm(x))); a "
                    f"post-norm block (norm(x + f(x))), or a norm of the embedding kept as the "
                    f"residual stream (BLOOM's), mixes the two. Train it under tp"
                ) from e
        self._check_forward(ctx, bool(context and not calls), logits, swapped)
        if not self._experts:
            return logits, {}
        return logits, {name: sum(getattr(s, name) for s in stats)
                        for name in ("load_balance", "z_loss")}  # fmt: skip

    def _check_forward(self, ctx, no_attention: bool, logits, swapped: dict) -> None:
        """Refuse a forward shardops cannot vouch for: cp with no attention it runs, logits
        not the head's, a declared mixture of experts or stacked blocks the forward never ran."""
        if no_attention:
            raise ValueError(
                f"FlaxModel {self.name!r} under {ctx.strategy.name!r}: the module called no "
                f"attention shardops runs (jax.nn.dot_product_attention or "
                f"nnx.dot_product_attention), so its own attention would see this device's "
                f"block of the sequence alone. Under context parallelism call one of them with "
                f"is_causal=True"
            )
        if self._head_layer is not None and logits is not swapped[self._head_layer[0]].output:
            raise ValueError(
                f"FlaxModel {self.name!r}: the module's output is not {_path(self._head_layer[0])}"
                f"'s (the layer making {self._head_layer[1]} features, taken as the head); "
                f"return the head's logits unchanged, from the one layer that makes them"
            )
        if self._stack is not None and not swapped[self._stack.path].calls:
            raise ValueError(
                f"FlaxModel {self.name!r}: the stacked blocks {_path(self._stack.path)} that "
                f"stacked= names were not run by the module's forward; scan them with "
                f"nnx.scan(f, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, blocks) inside "
                f"its __call__"
            )
        uncalled = [s.where for s in swapped.values()
                    if isinstance(s, SwappedExperts) and not s.calls]  # fmt: skip
        if uncalled:
            raise ValueError(f"FlaxModel {self.name!r}: the mixture of experts {uncalled[0]} that "
                             f"moe= declares was not called by the module's forward; declare "
                             f"the sub-modules it calls")  # fmt: skip

    def _check_strategy(self, ctx, context: list, split) -> None:
        """Refuse a strategy the module cannot run under as written (heads tp does not divide;
        cp without its positions; experts on a split sequence), naming the reason and the fix.
        (pp without stacked blocks is refused as the step is built: ``PipeKind.check_mesh``.)"""
        self.check_heads(ctx)
        if context and self.positions is None:
            raise ValueError(
                f"FlaxModel {self.name!r} under {ctx.strategy.name!r}: context parallelism "
                f"gives each device chunks i and 2N−1−i of the sequence, whose positions the "
                f"module cannot compute from its block (an arange over x.shape would restart at "
                f"0). Take them as an argument of the module's __call__ (MaxText's "
                f"decoder_positions) and name it: FlaxModel(positions='positions')"
            )
        if self._experts and (split is not None or context):
            raise ValueError(
                f"FlaxModel {self.name!r} under {ctx.strategy.name!r}: its mixture of experts "
                f"(ctx.moe) is not run on a split sequence yet; train it under dp, fsdp, hsdp, "
                f"zero1, tp, ep or their compositions (2d+ep, fsdp+ep, fsdp_tp+ep)"
            )

    def _swapped(self, ctx, params, split, stats: list):
        """``(module, swapped)``: the module rebuilt from its graph with each layer (and each
        mixture of experts, whose statistics go to ``stats``) swapped for one running the
        strategy's kernel on its ``params``; ``swapped``: path → that object."""
        module = nnx.merge(self._graphdef, self._state)
        swapped = {}
        for path, kind in self._layers.items():
            layer, p = at(module, path), at_dict(params, path)
            if kind == EXPERTS:  # its router's options (a Linear's dtype) are refused too
                for inner, m in nnx.iter_modules(layer):
                    if type(m) in SWAPPED:
                        _check_layer(SWAPPED[type(m)], m, _path(path + inner), ctx.precision)
                declared, paths = self._experts[path]
                swapped[path] = SwappedExperts(ctx, declared, paths, p, _path(path), stats)
            else:
                swapped[path] = _swap(ctx, kind, p, layer, _path(path), split, unit=True)
            set_at(module, path, swapped[path])
        if self._stack is not None:
            s = self._stack
            block = functools.partial(self._block, ctx, split)
            swapped[s.path] = StackedBlocks(ctx, at_dict(params, s.path), block, _path(s.path),
                                            s.count)  # fmt: skip
            set_at(module, s.path, swapped[s.path])
        return module, swapped

    def _block(self, ctx, split, p):
        """One of the stacked blocks, rebuilt from its graph, its layers swapped for the
        strategy's kernels on ``p`` (that layer's parameters, ready: ``ctx.scan``'s unit)."""
        s = self._stack
        block = nnx.merge(s.graphdef, s.state)
        for path, kind in s.layers.items():
            layer, q = at(block, path), at_dict(p, path)
            set_at(block, path, _swap(ctx, kind, q, layer, _path(s.path + path), split, False))
        return block

    # --- the task's loss, metrics and batch checks

    @property
    def vocab_size(self) -> int | None:
        return None if self._head_layer is None else self._head_layer[1]

    def _find_head(self):
        """``(path, vocabulary)`` of the layer whose output is the logits (``task="lm"``)."""
        if self.task != "lm":
            return None
        module = nnx.merge(self._graphdef, self._state)
        embeds = [(p, at(module, p).num_embeddings) for p, k in self._layers.items() if k == EMBED]
        if len(embeds) != 1:
            raise ValueError(f"FlaxModel(task='lm'): the module needs one nnx.Embed (the "
                             f"tokens'); it has {len(embeds)}")  # fmt: skip
        vocab = embeds[0][1]
        heads = [p for p, k in self._layers.items()
                 if k == LINEAR and at(module, p).out_features == vocab]  # fmt: skip
        if len(heads) > 1:
            raise ValueError(f"FlaxModel(task='lm'): several nnx.Linear make {vocab} features "
                             f"(the vocabulary): {[_path(p) for p in heads]}")  # fmt: skip
        return (heads[0] if heads else embeds[0][0]), vocab

    def output_layer(self, params):
        """The head's parameters: its logits are split over the vocabulary under tp."""
        if self.task != "lm":
            return None
        path = self._head_layer[0]
        return as_shardops(self._layers[path], at_dict(params, path))
