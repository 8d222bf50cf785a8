"""Equinox modules as shardops models: an ``eqx.Module`` trained under the dense strategies as
its author wrote it.

    from shardops_models.interop.equinox import EquinoxModel
    model = EquinoxModel(lambda key: MyGpt(config, key=key), roles=ROLES, num_heads=4)
    setup = models.build("fsdp_tp", mesh, model=model, optimizer=optax.adam(3e-4))

``make(key)`` builds the module as its author does. Equinox has no axis metadata, so ``roles``
maps the dotted paths of its layers (``fnmatch`` patterns, ``"blocks.*.attn.query_proj"``;
a list's items by index) to plan roles, as a filter spec picks leaves by where they sit: an
``eqx.nn.Linear`` is ``"column"``, ``"row"`` or ``"replicated"``, an ``eqx.nn.Embedding``
``"vocab"`` or ``"replicated"``; the first pattern that matches a layer holds, a layer no
pattern matches is replicated, and a pattern that matches no layer is an error (a typo would
otherwise replicate what the user meant to split).

**How each layer runs.** At every forward each layer the module calls is swapped
(``eqx.tree_at``) for one that runs the strategy's kernel on the layer's own parameters (one
FSDP and remat unit each), so every collective is explicit, in the ledger and in ``explain``:

==============================  ==================================================================
Equinox layer                   shardops kernel
==============================  ==================================================================
``eqx.nn.Linear``               ``ctx.dense`` of ``weightᵀ`` (``weight[out, in]``: column splits
                                ``out``, row splits ``in``)
``eqx.nn.Embedding``            ``ctx.embed`` (``weight[vocab, features]``; vocab-parallel)
``eqx.nn.LayerNorm``,           ``ctx.layer_norm``, ``ctx.rms_norm`` (over the last dim; RMSNorm's
``eqx.nn.RMSNorm``              bias added after it)
``eqx.nn.MultiheadAttention``   its four ``Linear`` projections swapped as above (q, k, v column,
                                output row: each device holds whole heads), its ``num_heads`` the
                                device's count, its attention Equinox's own on those heads
==============================  ==================================================================

Equinox layers act on one example, most on one token: the module runs as its author's loss
runs it, ``jax.vmap(module)(x)``, and each swapped layer, called inside those vmaps, runs its
kernel once on the whole batch they hold (``_over_the_vmaps``). A parameter no swapped layer owns is an error naming
its path and class. Under sp and cp the sequence a layer would gather along is vmapped away
inside the module's own code, so they are refused, as are ep and pp (``NOT_YET``), and the
divergence locator (it compares layer outputs over the batch). ``explain``, the ledger and
budgets, checkpoints and ``module(params)`` (back into Equinox) work as for shardops' models.

**The task**, as ``FlaxModel``'s: ``task="lm"`` (the module maps ``ids[S]`` to ``logits[S,
V]``; the head is the ``Linear`` whose ``out_features`` is the embedding's vocabulary, its
logits left split over the vocabulary under tp) or ``"classify"`` (``x[...]`` to
``logits[C]``). **Precision**: the policy's dtypes; a layer built with another ``dtype`` is
refused.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
from jax._src import core as jax_core  # trace_ctx: the trace now (_mapped_now)
from jax._src.interpreters import batching  # BatchTracer: whether a vmap maps x
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap
from jax.sharding import PartitionSpec as P

import shardops
from shardops import MODEL_AXIS
from shardops_models.interop._foreign import (
    TASKS,
    ForeignModel,
    Refusing,
    at_dict,
    check_unpadded,
)
from shardops_models.strategies._param import is_param
from shardops_models.strategies.plan import REPLICATED, Role

__all__ = ["NOT_YET", "ROLES", "SWAPPED", "EquinoxModel"]

LINEAR, EMBED, LAYER_NORM, RMS_NORM = "linear", "embed", "layer_norm", "rms_norm"
SWAPPED = {eqx.nn.Linear: LINEAR, eqx.nn.Embedding: EMBED, eqx.nn.LayerNorm: LAYER_NORM,
           eqx.nn.RMSNorm: RMS_NORM}  # fmt: skip
"""The Equinox layers shardops runs with its kernels, by what each becomes."""
ROLES = {
    LINEAR: {"column": Role("column", {"weight": ("mlp", "embed"), "bias": ("mlp",)}),
             "row": Role("row", {"weight": ("embed", "mlp"), "bias": ("embed",)}),
             "replicated": REPLICATED},
    EMBED: {"vocab": Role("vocab", {"weight": ("vocab", "embed")}), "replicated": REPLICATED},
}  # fmt: skip
"""The roles each layer takes, by name: its ``weight[out, in]`` laid out by the dims it splits."""
NOT_YET = {
    "sp": "splits the activations along the sequence, which the module's own vmaps hide from "
          "its layers",
    "cp": "splits the sequence, which the module's own vmaps hide from its layers",
    "ep": "needs the experts as one ctx.moe layer",
    "pp": "needs the blocks stacked and run by ctx.scan",
}  # fmt: skip
"""The kinds an Equinox module cannot run under yet, and why."""
_HEAD_TAG = "shardops_equinox_head"


def _is_param(x) -> bool:
    """A parameter of the module: a floating array, or its shape (the abstract module's)."""
    return (eqx.is_inexact_array(x) or (isinstance(x, jax.ShapeDtypeStruct)
            and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)))  # fmt: skip


def _param_paths(module) -> list[tuple]:
    """The paths of ``module``'s parameters, in its pytree order."""
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(module, _is_param))[0]
    return [tuple(_key(k) for k in path) for path, _ in flat]


def _key(k):
    """A pytree path entry as a parameter dict's key: an attribute's name, an item's index."""
    for field in ("name", "idx", "key"):
        if hasattr(k, field):
            return getattr(k, field)
    raise TypeError(f"EquinoxModel: a module path entry {k!r} of no known kind")


def _dotted(path) -> str:
    return ".".join(map(str, path)) or "the module"


def _get(module, path):
    for key in path:
        module = module[key] if isinstance(key, int) else getattr(module, key)
    return module


def _leaves(module, kinds) -> dict[tuple, Any]:
    """Path → each node of ``module`` that is an instance of ``kinds`` (not looked into)."""
    flat = jax.tree_util.tree_flatten_with_path(module, is_leaf=lambda n: isinstance(n, kinds))[0]
    return {tuple(_key(k) for k in path): n for path, n in flat if isinstance(n, kinds)}


@dataclasses.dataclass(frozen=True, eq=False)
class EquinoxModel(ForeignModel):
    """An Equinox module as a shardops model (``models.Model``; the module docstring).

    Arguments:
        make: ``make(key) -> eqx.Module``, the module's constructor as its author calls it.
        roles: ``(path pattern, role)`` pairs (or a dict of them): each layer's role by its
            dotted path (``"blocks.*.mlp.up"``), the first match holding.
        task: ``"lm"`` (``ids[S]`` → ``logits[S, V]`` per example) or ``"classify"``.
        name: for messages.
        num_heads, num_kv_heads: the attention's head counts, if it has any (tp checks that
            its axis divides them).
        context: the longest sequence (``task="lm"``; default: unbounded).
        example_shape: one example's shape (``task="classify"``), for the abstract batch.
        head: the dotted path of the ``Linear`` making the logits (``task="lm"``; default: the
            one whose ``out_features`` is the largest embedding's size).
    """

    make: Callable[[jax.Array], eqx.Module]
    roles: Sequence[tuple[str, str]] | Mapping[str, str] = ()
    task: str = "lm"
    name: str = "equinox"
    num_heads: int | None = None
    num_kv_heads: int | None = None
    context: int = sys.maxsize
    example_shape: tuple[int, ...] | None = None
    head: str | None = None
    module_type: str = dataclasses.field(init=False, default="")
    """The module's class (``package.Class``), recorded in a checkpoint."""

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"EquinoxModel: task must be one of {TASKS}; got {self.task!r}")
        try:
            pairs = list(self.roles.items() if isinstance(self.roles, Mapping) else self.roles)
            pairs = [(str(pattern), str(role)) for pattern, role in pairs]
        except (TypeError, ValueError):
            raise TypeError(f"EquinoxModel: roles must be (path pattern, role) pairs, or a dict "
                            f"of them; got {self.roles!r}") from None  # fmt: skip
        object.__setattr__(self, "roles", tuple(pairs))
        module = eqx.filter_eval_shape(self.make, jax.random.key(0))
        if not isinstance(module, eqx.Module):
            raise TypeError(f"EquinoxModel: make(key) must return an eqx.Module; got "
                            f"{type(module).__name__}")  # fmt: skip
        kind = type(module)
        object.__setattr__(self, "module_type", f"{kind.__module__}.{kind.__qualname__}")
        object.__setattr__(self, "_abstract", module)
        object.__setattr__(self, "_layers", self._swappable(module))
        object.__setattr__(self, "_roles", self._layer_roles())
        object.__setattr__(self, "sequence", self.task == "lm")
        object.__setattr__(self, "_head", self._find_head())
        if self._head is not None:
            self._check_returns_head()

    # --- the module's layers

    def _swappable(self, module) -> dict[tuple, str]:
        """Path → the kind of each layer shardops swaps; every parameter is owned by one, else
        a ValueError naming the first that is not and its module's class."""
        layers = {path: SWAPPED[type(m)] for path, m in _leaves(module, tuple(SWAPPED)).items()}
        for keys in _param_paths(module):
            if keys[:-1] not in layers:
                owner = _get(module, keys[:-1])
                raise ValueError(
                    f"EquinoxModel: parameter {_dotted(keys)} belongs to "
                    f"{type(owner).__name__} at {_dotted(keys[:-1])}, which shardops cannot run "
                    f"with an explicit kernel (it runs "
                    f"{', '.join('eqx.nn.' + c.__name__ for c in SWAPPED)} and "
                    f"eqx.nn.MultiheadAttention). Write that computation with those layers, or "
                    f"as a models.Model of your own (ctx.dense, ctx.array: "
                    f"docs/strategies.md#any-model)"
                )
        for path, kind in layers.items():
            _check_layer(kind, _get(module, path), _dotted(path))
        for path, mha in _leaves(module, (eqx.nn.MultiheadAttention,)).items():
            if mha.dropout.p and not mha.dropout.inference:
                raise ValueError(f"{_dotted(path)}: MultiheadAttention with dropout_p="
                                 f"{mha.dropout.p}; each device would draw its own: build it "
                                 f"with dropout_p=0 (or inference=True)")  # fmt: skip
        return layers

    def _layer_roles(self) -> dict[tuple, str]:
        """Path → the role name of each swapped layer, from ``roles`` (module docstring)."""
        roles, used = {}, set()
        for path, kind in self._layers.items():
            dotted = _dotted(path)
            name = next(((p, r) for p, r in self.roles if fnmatch.fnmatchcase(dotted, p)), None)
            if name is None:
                roles[path] = "replicated"
                continue
            used.add(name[0])
            allowed = ROLES.get(kind, {"replicated": REPLICATED})
            if name[1] not in allowed:
                raise ValueError(
                    f"EquinoxModel: roles give {dotted} ({type(_get(self._abstract, path)).__name__}) "
                    f"the role {name[1]!r} (pattern {name[0]!r}); it takes one of "
                    f"{sorted(allowed)}"
                )
            roles[path] = name[1]
        unused = [p for p, _ in self.roles if p not in used]
        if unused:
            raise ValueError(
                f"EquinoxModel: the roles pattern {unused[0]!r} matches no layer not matched by "
                f"an earlier pattern (fnmatch: '*' crosses dots too); the layers are "
                f"{', '.join(_dotted(p) for p in self._layers)}"
            )
        return roles

    def _find_head(self):
        """``(path, vocabulary)`` of the layer whose output is the logits (``task="lm"``)."""
        if self.task != "lm":
            return None
        if self.head is not None:
            path = next((p for p, k in self._layers.items()
                         if k == LINEAR and _dotted(p) == self.head), None)  # fmt: skip
            if path is None:
                raise ValueError(
                    f"EquinoxModel: head={self.head!r} is not an eqx.nn.Linear of the module; "
                    f"its Linear layers are "
                    f"{', '.join(_dotted(p) for p, k in self._layers.items() if k == LINEAR)}"
                )
            return path, _get(self._abstract, path).out_features
        embeds = [p for p, k in self._layers.items() if k == EMBED]
        vocab = max((_get(self._abstract, p).num_embeddings for p in embeds), default=None)
        heads = [p for p, k in self._layers.items()
                 if k == LINEAR and _get(self._abstract, p).out_features == vocab]  # fmt: skip
        if len(heads) != 1:
            raise ValueError(
                f"EquinoxModel(task='lm'): the head is the one eqx.nn.Linear making the "
                f"vocabulary's {vocab} features (the largest embedding's); found "
                f"{[_dotted(p) for p in heads]}. Name it: EquinoxModel(head='path.to.head')"
            )
        return heads[0], vocab

    def _check_returns_head(self) -> None:
        """The module returns the head's logits unchanged (traced once, unsharded): under tp
        they are split over the vocabulary, so code of the module's own after the head (a
        log-softmax) would see each device's shard alone."""
        path = self._head[0]

        def tagged(key, ids):
            module = self.make(key)
            head = _get(module, path)
            module = eqx.tree_at(lambda m: _get(m, path), module,
                                 lambda x, **kw: checkpoint_name(head(x, **kw), _HEAD_TAG))  # fmt: skip
            return jax.vmap(module)(ids)

        ids = jax.ShapeDtypeStruct((1, min(self.context, 2)), jax.numpy.int32)
        jaxpr = jax.make_jaxpr(tagged)(jax.random.key(0), ids).jaxpr
        made = {v: e for e in jaxpr.eqns for v in e.outvars}
        out, perms = made.get(jaxpr.outvars[0]), []
        while out is not None and out.primitive.name == "transpose":  # vmap's batching moves
            perms.append(out.params["permutation"])  # the batch dims back to the front
            out = made.get(out.invars[0])
        tagged_out = (out is not None and out.primitive.name == "name"
                      and out.params.get("name") == _HEAD_TAG)  # fmt: skip
        if tagged_out:  # the vocabulary (the one dim of V: B = 1, S ≤ 2 < V) ends up last
            shape = out.outvars[0].aval.shape
            at = shape.index(self._head[1]) if shape.count(self._head[1]) == 1 else -1
            for perm in reversed(perms):
                at = list(perm).index(at) if at >= 0 else -1
            tagged_out = at == len(shape) - 1
        if not tagged_out:
            raise ValueError(
                f"EquinoxModel {self.name!r}: the module's output is not {_dotted(path)}'s (the "
                f"layer making the logits); return the head's logits unchanged (under tp they are "
                f"split over the vocabulary, which code after the head would not see; a head "
                f"called inside a jit or checkpoint of the module's own is not seen through)"
            )

    # --- models.Model

    def init(self, key, dtype=None):
        """The parameters ``make(key)`` initialises, as a nested dict by attribute name (a
        list's items by index); ``dtype``: cast to it."""
        params = {}
        arrays = eqx.filter(self.make(key), eqx.is_inexact_array)
        for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
            keys = [_key(k) for k in path]
            node = params
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = leaf if dtype is None else leaf.astype(dtype)
        return params

    def module(self, params) -> eqx.Module:
        """The Equinox module holding ``params`` (``init``'s dict, e.g. ``setup.gather(...)``)."""
        arrays, static = eqx.partition(self._abstract, _is_param)
        leaves = [jax.numpy.asarray(at_dict(params, p)) for p in _param_paths(self._abstract)]
        return eqx.combine(jax.tree.unflatten(jax.tree.structure(arrays), leaves), static)

    def plan(self):
        """Each swapped layer's role, as a tree over ``init``'s dict."""
        plan = jax.tree.map(lambda _: REPLICATED, self.init_shapes())
        for path, kind in self._layers.items():
            role = ROLES.get(kind, {}).get(self._roles[path], REPLICATED)
            sub = at_dict(plan, path)
            for k in sub:
                sub[k] = role
        return plan

    def init_shapes(self):
        return jax.eval_shape(self.init, jax.random.key(0))

    def apply(self, ctx, params, x):
        """``jax.vmap(module)(x)``, each swapped layer running the strategy's kernel on its
        parameters (``ctx.unit``)."""
        refused = [k.name for k in ctx.strategy.kinds if k.name in NOT_YET]
        if refused:
            raise ValueError(
                f"EquinoxModel {self.name!r} under {ctx.strategy.name!r}: {refused[0]} "
                f"{NOT_YET[refused[0]]}. Train it under dp, fsdp, hsdp, zero1, tp or their "
                f"compositions (2d, fsdp_tp, hsdp_tp)"
            )
        if shardops.inspect.tapping():
            raise ValueError(
                f"EquinoxModel {self.name!r}: the divergence locator compares each layer's "
                f"output over the batch, which the module's own vmaps hide from its layers (each "
                f"sees one example or token): not run yet for Equinox modules. Compare the "
                f"losses (--compare-reference) or train the layers as a models.Model"
            )
        self.check_heads(ctx)
        module, swapped = self._abstract, {}
        for path, kind in self._layers.items():
            p = at_dict(params, path)
            check_unpadded(p, _dotted(path), "EquinoxModel")
            _check_dtypes(_get(module, path), _dotted(path), ctx.precision)
            swapped[path] = _Swapped(ctx, kind, p, _get(module, path), _dotted(path))
        module = eqx.tree_at(
            lambda m: [_get(m, p) for p in swapped], module, list(swapped.values())
        )
        p = ctx.axis_size(MODEL_AXIS) if ctx.axis_name(MODEL_AXIS) is not None else 1
        attentions = _leaves(module, (eqx.nn.MultiheadAttention,))
        if attentions:
            module = eqx.tree_at(lambda m: [_get(m, q) for q in attentions], module,
                                 [self._local_heads(a, p, q) for q, a in attentions.items()])  # fmt: skip
        return jax.vmap(module)(x), {}

    def _local_heads(self, attention, p: int, path: tuple):
        """``attention`` (at ``path``) with this device's head count: its projections split
        by head."""
        where = _dotted(path)
        roles = [self._roles[(*path, name)]
                 for name in ("query_proj", "key_proj", "value_proj", "output_proj")]  # fmt: skip
        if p == 1 or roles == ["replicated"] * 4:
            return attention
        if roles != ["column", "column", "column", "row"] or attention.num_heads % p:
            raise ValueError(
                f"{where}: MultiheadAttention under tp over {MODEL_AXIS!r} (size {p}) with "
                f"roles {dict(zip(('query', 'key', 'value', 'output'), roles, strict=True))}; "
                f"each device holds whole heads when its q, k and v projections are column and "
                f"its output projection row, and the axis divides its {attention.num_heads} heads"
            )
        local = copy.copy(attention)
        object.__setattr__(local, "num_heads", attention.num_heads // p)  # a static field
        return local

    # --- the task

    @property
    def vocab_size(self) -> int | None:
        return None if self._head is None else self._head[1]

    def output_layer(self, params):
        """The head's parameters: its logits are split over the vocabulary under tp."""
        if self.task != "lm":
            return None
        path = self._head[0]
        return _dense_params(at_dict(params, path), None)


def _check_layer(kind: str, layer, where: str) -> None:
    """Refuse a layer shape or option the swapped layer would not honour."""
    if kind == LINEAR and "scalar" in (layer.in_features, layer.out_features):
        raise ValueError(f"{where}: eqx.nn.Linear with a 'scalar' side; shardops runs "
                         f"x[in] → y[out]")  # fmt: skip
    if kind in (LAYER_NORM, RMS_NORM) and len(layer.shape) != 1:
        raise ValueError(f"{where}: {type(layer).__name__}(shape={layer.shape}); shardops "
                         f"normalises over the last dim only: shape=(features,)")  # fmt: skip
    weight = getattr(layer, "weight", None)
    if weight is not None and weight.ndim != (1 if kind in (LAYER_NORM, RMS_NORM) else 2):
        raise ValueError(
            f"{where}: {type(layer).__name__} with weight of shape {tuple(weight.shape)}: "
            f"layers stacked by eqx.filter_vmap (scanned over with lax.scan) are not run yet; "
            f"keep the blocks in a list"
        )


def _over_the_vmaps(run):
    """``run`` (a layer's kernel on ``x[..., features]``) called as the module calls a layer, on
    one example or token inside its vmaps, but run once on every example and token they hold:
    each vmap's batching rule (``jax.custom_batching.custom_vmap``) hands its batch on, with the
    batch dim in front, to the next one out, and the outermost runs the kernel on the whole
    ``x[B, S, ..., features]``. Run under the vmaps instead, a kernel's own backward
    (``custom_vjp``) would compute each example's weight gradient and then sum them: a
    ``[B, S, D, F]`` temporary for a ``[D, F]`` weight."""

    @custom_vmap
    def layer(x):
        return run(x)

    @layer.def_vmap
    def rule(axis_size, in_batched, x):
        # Still mapped by the vmap one level out: its own rule takes the batch on (custom_vmap
        # has no reverse mode of its own, so the outermost level calls the kernel itself).
        inner = _over_the_vmaps(run) if _mapped_now(x) else run
        return inner(x), in_batched[0]

    return layer


def _mapped_now(x) -> bool:
    """Whether ``x`` is mapped by the vmap tracing now (its batch tracer is the current
    trace's; not one further out, behind a grad or a ``lax.map``/``scan``/``cond`` body)."""
    return isinstance(x, batching.BatchTracer) and x._trace is jax_core.trace_ctx.trace


def _check_dtypes(layer, where: str, precision) -> None:
    """A layer's parameters (as ``make`` builds them) in the policy's parameter dtype: a layer
    built with another ``dtype=`` computes otherwise than the sharded run would."""
    for key in ("weight", "bias"):
        value = getattr(layer, key, None)
        if _is_param(value) and value.dtype != precision.param_dtype:
            raise ValueError(
                f"{where}.{key} is {value.dtype}, but the precision policy keeps "
                f"parameters in {precision.param_dtype.name}; build the layer without dtype= "
                f"(the policy sets it) or give build the matching precision"
            )


def _dense_params(p: dict, ctx) -> dict:
    """A Linear's ``weight[out, in]`` (and ``bias``) as ``ctx.dense``'s ``w[in, out]`` (and
    ``b``): inside ``ctx.unit``, the transposed value of the ready weight, its spec the
    role's; outside (``ctx=None``), the Params as they are (for ``ctx.is_split``)."""
    weight = p["weight"]
    if ctx is None:
        return {"w": weight, **({"b": p["bias"]} if "bias" in p else {})}
    role, axis = weight.role, ctx.axis_name(MODEL_AXIS)
    spec = {"column": P(None, axis), "row": P(axis, None)}.get(role, P())
    flat = {"w": weight.replace(value=ctx.array(weight).T, spec=spec, pending=None,
                                logical=None)}  # fmt: skip
    if "bias" in p:
        flat["b"] = p["bias"].replace(value=ctx.array(p["bias"]), pending=None, logical=None,
                                      spec=P(axis) if role == "column" else P())  # fmt: skip
    return flat


class _Swapped(Refusing):
    """An Equinox layer's place in the module, run by ``ctx`` on the layer's ``Param``s (``p``:
    its dict, Equinox's keys), on one example or token: each kernel runs on ``x[None]``
    (its rank-2 form), inside the module's vmaps."""

    def __init__(self, ctx, kind: str, p, layer, where: str):
        self.ctx, self.kind, self.p, self.where = ctx, kind, p, where
        self.eps = getattr(layer, "eps", None)

    def __call__(self, x, *args, key=None, **kwargs):
        if args or kwargs:  # a norm's state, …
            raise ValueError(f"{self.where}: called with more than its input; under "
                             f"EquinoxModel a layer takes its input alone")  # fmt: skip
        if x.ndim != (0 if self.kind == EMBED else 1):
            raise ValueError(f"{self.where}: called on x{tuple(x.shape)}; an Equinox layer takes "
                             f"one example (one token): vmap it, as Equinox does")  # fmt: skip
        leaves = [q for q in jax.tree.leaves(self.p, is_leaf=is_param) if is_param(q)]
        self._uses = [(q, q.uses) for q in leaves]  # each trace of _run counts one use only
        return _over_the_vmaps(self._run)(x) if _mapped_now(x) else self._run(x)

    def _run(self, x):
        """The layer's kernel on ``x[..., features]`` (``ids[...]``): every example and token
        the module's vmaps hold, at once (``_over_the_vmaps``), or one (``x[None]``)."""
        for q, uses in self._uses:  # custom_vmap traces the body at every vmap level
            q.uses = uses
        ctx, kind = self.ctx, self.kind
        one = x.ndim == (0 if kind == EMBED else 1)
        x = x[None] if one else x
        if kind == LINEAR:
            y = ctx.unit(lambda q, x: ctx.dense(_dense_params(q, ctx), x), self.p, x)
        elif kind == EMBED:
            y = ctx.unit(lambda q, i: ctx.embed({"table": q["weight"]}, i), self.p, x)
        elif kind == LAYER_NORM:
            keys = {"weight": "scale", "bias": "bias"}
            y = ctx.unit(lambda q, x: ctx.layer_norm({keys[k]: v for k, v in q.items()}, x,
                                                     eps=self.eps), self.p, x)  # fmt: skip
        else:

            def rms(q, x):
                y = ctx.rms_norm({"scale": q["weight"]} if "weight" in q else {}, x,
                                 eps=self.eps)  # fmt: skip
                return y + ctx.array(q["bias"]) if "bias" in q else y

            y = ctx.unit(rms, self.p, x)
        return y[0] if one else y

    # A swapped layer's parameters are the strategy's: reading them (``self.embed.weight`` for
    # a tied head) is refused, naming the layer (``Refusing``).
    OWN = ("ctx", "kind", "p", "eps", "_uses")
    REFUSAL = (
        "{where}.{name}: the module's code reads an attribute of a layer EquinoxModel runs with "
        "shardops' kernel, whose parameters are laid out by the strategy; call the layer instead"
    )
