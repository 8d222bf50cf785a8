"""Plans: the role of every parameter, which names its dims, and the layouts derived from them.

A *plan* is a pytree whose structure is a prefix of the parameter tree; each of its leaves is
a role for the subtree under it (a per-layer role, or a per-leaf one). A role (``Role``) names
each dim of the leaves it lays out with a *logical* name, and one rules table (``rules``,
MaxText's ``logical_axis_rules``) maps each logical name to a mesh axis or to none. The roles
the library knows, and their split over the tp axis ``model`` by ``logical_rules("model")``:

    role         leaf dims (logical names)                  split over model
    column       w[embed, mlp], b[mlp]                      w[D, F_model], b[F_model]
    row          w[mlp, embed], b[embed]                    w[F_model, D], b[D]
    vocab        table[vocab, embed]                        table[V_model, D]
    head         wq[embed, heads], bq[heads],               by heads: wq[D, (H·hd)_model],
                 wk, wv[embed, kv_heads], bk, bv[kv_heads], bq[(H·hd)_model], wo[(H·hd)_model, D];
                 wo[heads, embed], bo[embed]                wk, wv, bk, bv by KV head, or
                                                            replicated when p ∤ KV
    replicated   any leaf, no dim named                     nothing

    logical_rules("model") = {"vocab": "model", "mlp": "model", "heads": "model",
                              "kv_heads": "model", "embed": None, "layers": None}

A plan names a role by the object (``COLUMN``, a ``Role`` of the user's) or by its name as a
shorthand (``"column"``); a role is equal to its name, so ``role == "column"`` and ``role in
(COLUMN, ROW)`` read either. ``column``, ``row`` and ``vocab`` lay out a leaf under another key
by its rank (``ctx.dense`` names a key it does not take); ``head`` and a user's roles refuse a
leaf they do not describe. Under ``stacked(...)`` every leaf carries a leading ``layers`` dim
(``StackedRole``), not split by these rules (a pipeline's rules map it to its stage axis).

    plan = {"embed": "vocab", "blocks": [{"attn": "head", "up": "column", "down": "row",
            "ln1": "replicated", "ln2": "replicated"}] * depth, "head": "column", ...}

    # a role of one's own, laid out by a rule of one's own (no library change):
    EXPERT_COLUMN = Role("expert_column", {"w": ("experts", "embed", "mlp")})
    model_specs(roles, shapes, "model", 2, rules={**logical_rules("model"), "experts": "data"})
    # w[E, D, F] → P("data", None, "model"): w[E_data, D, F_model]

PyTorch's ``parallelize_module(model, mesh, plan)`` is the model for the interface. The role
decides two things: the layout (``model_specs``, here) and the kernel that runs the layer
(``models.strategies.parallel.Parallel``, by the role's name). A data-axis strategy then adds
its own split on top (``fsdp_spec``: the FSDP rule).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from shardops import MODEL_AXIS, entry_axes

# The logical names of the library's roles (a rules table that omits one leaves it unsplit).
LOGICAL_NAMES = ("embed", "mlp", "vocab", "heads", "kv_heads", "layers", "experts")


def logical_rules(tp_axis: str | None = MODEL_AXIS) -> dict[str, str | tuple[str, ...] | None]:
    """The rules table of tensor parallelism over ``tp_axis``: each logical dim name → the
    mesh axis (or axes) that splits it, or ``None``. A strategy extends it with its own rows
    (``{**logical_rules("model"), "experts": "expert", "layers": "stage"}``)."""
    return {"vocab": tp_axis, "mlp": tp_axis, "heads": tp_axis, "kv_heads": tp_axis,
            "embed": None, "layers": None}  # fmt: skip


class Role(str):
    """A plan role: its ``name`` and, per leaf key, the logical names of that leaf's dims.

    Arguments:
        name: what the plan and the layer context call it (``"column"``; ``Parallel`` picks
            a layer's kernel by it). The role is equal to, hashes as and prints as this name,
            so ``role == "column"`` holds and a checkpoint records the name.
        dims: leaf key → one logical name (or ``None``: not split) per dim, e.g. ``{"w":
            ("embed", "mlp"), "b": ("mlp",)}`` for ``w[D, F]`` and ``b[F]``; ``None``: any
            leaf, no dim named (``REPLICATED``).
        by_rank: a leaf under a key ``dims`` does not name (or of another rank) takes the
            dims given for its rank (the dense roles: their kernels name a key they do not
            take); else such a leaf is an error naming it.

    Frozen and hashable. A rules table (``logical_rules``) turns a leaf's names into its
    PartitionSpec (``model_spec``)::

        Role("expert_column", {"w": ("experts", "embed", "mlp")})  # w[E, D, F]
    """

    def __new__(
        cls,
        name: str,
        dims: Mapping[str, Sequence[str | None]] | None = None,
        *,
        by_rank: bool = False,
    ) -> Role:
        if not isinstance(name, str) or not name:
            raise TypeError(f"Role: name must be a non-empty string (what the plan calls the "
                            f"role, e.g. 'expert_column'); got {name!r}")  # fmt: skip
        if dims is not None:
            dims = _checked_dims(str(name), dims)
        if by_rank and dims is not None:
            ranks = [len(d) for d in dims.values()]
            if len(set(ranks)) != len(ranks):
                raise ValueError(
                    f"Role {name!r}: by_rank=True lays out a leaf by its rank, so each leaf of "
                    f"dims must have a rank of its own; got ranks {dict(zip(dims, ranks, strict=True))}. "
                    f"Give by_rank=False, or one leaf per rank"
                )
        self = super().__new__(cls, str.__str__(name))
        object.__setattr__(self, "_dims", dims)
        object.__setattr__(self, "_by_rank", bool(by_rank))
        return self

    @property
    def name(self) -> str:
        """The role's name (a plain ``str``)."""
        return str.__str__(self)

    @property
    def dims(self) -> Mapping[str, tuple[str | None, ...]] | None:
        """Leaf key → the logical names of its dims (read-only); ``None``: any leaf, unnamed."""
        return self._dims

    @property
    def by_rank(self) -> bool:
        return self._by_rank

    def logical_dims(self, key: str, shape: tuple[int, ...], where: str = "a leaf"):
        """The logical names of the dims of the leaf under ``key`` with global ``shape``
        (``where`` names it in an error): a tuple of ``len(shape)`` names or ``None``s."""
        if self._dims is None:
            return (None,) * len(shape)
        names = self._dims.get(key)
        if names is not None and len(names) == len(shape):
            return names
        if self._by_rank:
            for names in self._dims.values():
                if len(names) == len(shape):
                    return names
        laid_out = ", ".join(f"{k}[{', '.join(map(str, v))}]" for k, v in self._dims.items())
        if key in self._dims:
            raise ValueError(
                f"{where}: role {self.name!r} lays out {laid_out} ({len(self._dims[key])} dims "
                f"for {key!r}); got shape {shape}. Give this leaf a role whose dims fit its "
                f"{len(shape)} dims (e.g. 'replicated'), or a Role naming them"
            )
        raise ValueError(
            f"{where}: role {self.name!r} lays out {laid_out}; it does not describe a leaf "
            f"{key!r} (shape {shape}). Give this leaf a role that describes it (e.g. "
            f"'replicated'), or name its dims in the role: Role({self.name!r}, {{..., "
            f"{key!r}: <one logical name or None per dim>}})"
        )

    def __setattr__(self, name, value):
        raise AttributeError(f"Role {self.name!r} is frozen; make a new Role instead")

    def __delattr__(self, name):
        raise AttributeError(f"Role {self.name!r} is frozen; make a new Role instead")

    def __reduce__(self):
        dims = None if self._dims is None else dict(self._dims)
        return (_role, (self.name, dims, self._by_rank))


def _role(name, dims, by_rank):
    """``Role(name, dims, by_rank=by_rank)`` (for pickle and copy)."""
    return Role(name, dims, by_rank=by_rank)


def _checked_dims(name: str, dims) -> types.MappingProxyType:
    """``dims`` as a read-only dict of tuples, else a TypeError naming the entry and the fix."""
    if not isinstance(dims, Mapping):
        raise TypeError(f"Role {name!r}: dims must be a dict of leaf key → logical dim names, "
                        f"e.g. {{'w': ('embed', 'mlp')}}; got {type(dims).__name__}")  # fmt: skip
    out = {}
    for key, names in dims.items():
        if (not isinstance(key, str) or isinstance(names, str) or not isinstance(names, Sequence)
                or not all(n is None or (isinstance(n, str) and n) for n in names)):  # fmt: skip
            raise TypeError(
                f"Role {name!r}: dims[{key!r}] must be a tuple of logical dim names (strings, or "
                f"None for a dim no rule splits), one per dim of the leaf under a string key; "
                f"got {names!r}. E.g. {{'w': ('embed', 'mlp'), 'b': ('mlp',)}}"
            )
        out[key] = tuple(names)
    return types.MappingProxyType(out)


COLUMN = Role("column", {"w": ("embed", "mlp"), "b": ("mlp",)}, by_rank=True)
ROW = Role("row", {"w": ("mlp", "embed"), "b": ("embed",)}, by_rank=True)
VOCAB = Role("vocab", {"table": ("vocab", "embed")}, by_rank=True)
HEAD = Role(
    "head",
    {"wq": ("embed", "heads"), "bq": ("heads",),
     "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
     "bk": ("kv_heads",), "bv": ("kv_heads",),
     "wo": ("heads", "embed"), "bo": ("embed",)},
)  # fmt: skip
REPLICATED = Role("replicated")
EXPERTS = Role(
    "experts",
    {"router": ("embed", None),
     "gate": ("experts", "embed", "mlp"), "up": ("experts", "embed", "mlp"),
     "down": ("experts", "mlp", "embed")},
)  # fmt: skip
"""A mixture of experts (``ctx.moe``): the router ``router[D, E]`` whole, each expert's SwiGLU
``gate, up[E, D, F]``, ``down[E, F, D]`` split by expert over the expert axis (``ep``) and by
hidden unit over the tp axis."""
ROLES = (COLUMN, ROW, VOCAB, HEAD, REPLICATED, EXPERTS)
_BY_NAME = {role.name: role for role in ROLES}


def as_role(role, where: str = "plan") -> Role:
    """``role`` as a ``Role``: itself, or the library's role of that name (the shorthand);
    else a ValueError naming ``where``, the role and the names there are."""
    if isinstance(role, Role):
        return role
    if isinstance(role, str) and role in _BY_NAME:
        return _BY_NAME[role]
    raise ValueError(
        f"{where}: unknown role {role!r}; choose one of {ROLES} or give a Role(name, dims) "
        f"that names the dims of its leaves"
    )


class StackedRole(Role):
    """The role of a leaf that stacks one layer per index of its dim 0 (run by ``ctx.scan``
    with ``lax.scan``): ``layer``'s dims behind a leading ``layers`` dim. Equal, as a name, to
    ``layer`` (the role of one layer's slice), so every test of a role reads it alike. The
    rules leave ``layers`` unsplit (``logical_rules``): the tp split is the layer's, one dim
    further, and FSDP splits another dim."""

    def __new__(cls, layer) -> StackedRole:
        layer = as_role(layer, "StackedRole")
        if isinstance(layer, StackedRole):
            raise ValueError(f"StackedRole({layer!r}): the layer's role is stacked already; "
                             f"one scan runs the layers stacked along one dim 0")  # fmt: skip
        dims = None if layer.dims is None else {k: ("layers", *v) for k, v in layer.dims.items()}
        self = super().__new__(cls, layer.name, dims, by_rank=layer.by_rank)
        object.__setattr__(self, "_layer", layer)
        return self

    @property
    def layer(self) -> Role:
        """The role of one layer."""
        return self._layer

    def logical_dims(self, key: str, shape: tuple[int, ...], where: str = "a leaf"):
        """``("layers", *`` the layer's names ``)``: dim 0 holds the layers."""
        if not shape:
            raise ValueError(f"{where}: a stacked leaf holds [L, …] (the layers along dim 0); "
                             f"got a scalar")  # fmt: skip
        return ("layers", *self._layer.logical_dims(key, shape[1:], where))

    def __reduce__(self):
        return (StackedRole, (self._layer,))


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A plan node for a subtree whose leaves stack layers along dim 0: ``plan`` is one
    layer's plan (``stacked``)."""

    plan: Any


def stacked(plan) -> Stacked:
    """The plan of layers stacked along dim 0 (``[L, …]`` leaves, for ``ctx.scan``), given as
    one layer's plan: ``{"blocks": stacked({"attn": "head", "mlp": …})}``."""
    return Stacked(plan)


def leaf_roles(plan, params):
    """The role of every leaf of ``params`` (a ``Role``; a name in the plan is its shorthand):
    ``plan``'s role broadcast over its subtree (a ``StackedRole`` under a ``stacked`` node).

    Raises a ValueError naming the path when the plan does not fit the tree or a role is
    unknown.
    """
    _check_prefix(plan, params, "")

    def broadcast(role, sub):
        if isinstance(role, Stacked):
            layer = jax.tree.map(lambda s: s[1:], sub, is_leaf=is_shape)
            inner = leaf_roles(role.plan, layer)
            if any(isinstance(r, StackedRole) for r in jax.tree.leaves(inner)):
                raise ValueError("stacked(...) inside stacked(...) is not supported: one "
                                 "scan runs the layers stacked along one dim 0")  # fmt: skip
            return jax.tree.map(StackedRole, inner)
        return jax.tree.map(lambda _: role, sub, is_leaf=is_shape)

    roles = jax.tree.map(broadcast, plan, params, is_leaf=lambda x: isinstance(x, Stacked))
    return jax.tree_util.tree_map_with_path(
        lambda path, role: as_role(role, f"plan{jax.tree_util.keystr(path)}"), roles
    )


def _check_prefix(plan, params, path: str) -> None:
    """``plan`` fits ``params`` as a prefix, else a ValueError naming the first path where it
    does not: a key the plan lacks or adds, a list of another length, a subtree for a leaf."""
    hint = "(one role per layer or per leaf)"
    where = f"plan{path}" if path else "plan (the top level)"
    if isinstance(plan, str) or plan is None:
        return  # a role (checked by the caller) for the whole subtree
    if isinstance(plan, Stacked):
        leaves = jax.tree.leaves(params, is_leaf=is_shape)
        if not leaves or any(not is_shape(s) or len(s) < 1 for s in leaves):
            raise ValueError(f"{where}: stacked(...) needs leaves [L, …] that stack the "
                             f"layers along dim 0")  # fmt: skip
        if len({s[0] for s in leaves}) != 1:
            raise ValueError(f"{where}: stacked(...) leaves hold different numbers of layers "
                             f"{sorted({s[0] for s in leaves})} along dim 0")  # fmt: skip
        layer = jax.tree.map(lambda s: s[1:], params, is_leaf=is_shape)
        _check_prefix(plan.plan, layer, path)
        return
    if is_shape(params):
        pass  # a leaf: only a role fits it (below)
    elif isinstance(plan, dict) and isinstance(params, dict):
        missing = sorted(set(params) - set(plan), key=str)
        extra = sorted(set(plan) - set(params), key=str)
        if missing or extra:
            said = [f"no role for {missing}"] if missing else []
            said += [f"roles for {extra}, which the parameters do not have"] if extra else []
            raise ValueError(
                f"{where}: {' and '.join(said)}; the parameters there "
                f"have keys {sorted(params, key=str)} {hint}"
            )
        for k in params:
            _check_prefix(plan[k], params[k], f"{path}[{k!r}]")
        return
    elif isinstance(plan, (list, tuple)) and type(plan) is type(params):
        if len(plan) != len(params):
            raise ValueError(f"{where}: {len(plan)} role(s) for {len(params)} parameter "
                             f"subtrees {hint}")  # fmt: skip
        for i, (q, sub) in enumerate(zip(plan, params, strict=True)):
            _check_prefix(q, sub, f"{path}[{i}]")
        return
    got = "a leaf" if is_shape(params) else type(params).__name__
    raise ValueError(f"{where}: a {type(plan).__name__} where the parameters have {got}; "
                     f"give a role (one of {ROLES}, or a Role) or a tree of them {hint}")  # fmt: skip


def model_spec(role, path, shape: tuple[int, ...], axis: str = MODEL_AXIS, *, rules=None) -> P:
    """The PartitionSpec of one leaf (global ``shape``) with ``role`` (a ``Role`` or its name);
    ``path`` names it: each dim's logical name (``Role.logical_dims``) mapped to mesh axes by
    ``rules`` (default ``logical_rules(axis)``: the tp split over ``axis``).

    A leaf whose rank or key its role does not describe, or a logical name that is neither in
    ``rules`` nor one of the library's (``LOGICAL_NAMES``, unsplit where a table omits them), is
    a ValueError naming the leaf, the role and the fix.
    """
    where = f"params{jax.tree_util.keystr(path)}"
    role = as_role(role, where)
    rules = logical_rules(axis) if rules is None else rules
    names = role.logical_dims(_last_key(path), tuple(shape), where)
    return P(*(_mesh_axes(name, rules, role, where) for name in names))


def _mesh_axes(name: str | None, rules, role: Role, where: str):
    """The mesh axes ``rules`` map the logical dim ``name`` to (``None``: not split)."""
    if name is None:
        return None
    if name in rules:
        return rules[name]
    if name in LOGICAL_NAMES:
        return None
    raise ValueError(
        f"{where}: role {role.name!r} names a dim {name!r}, which the rules do not map (they "
        f"map {sorted(rules)}). Add a row for it, e.g. rules={{**logical_rules(tp_axis), "
        f"{name!r}: <a mesh axis, or None>}}, or name the dim one of {list(LOGICAL_NAMES)}"
    )


def replicated(shape: tuple[int, ...]) -> P:
    """``P(None, …)``: one entry per dim, none split."""
    return P(*(None,) * len(shape))


def model_specs(roles, shapes, axis: str, axis_size: int, num_heads: int | None = None, *,
                rules=None):  # fmt: skip
    """PartitionSpecs of a tree of leaf ``shapes`` with leaf ``roles``: each leaf's logical
    dims through ``rules`` (default ``logical_rules(axis)``, ``axis`` the tp axis of
    ``axis_size`` devices; ``model_spec``).

    Under a role that names ``heads`` (the head role) every device holds whole heads:
    ``num_heads`` (the model's attribute) must be given and divide by ``axis_size`` whenever
    ``axis_size`` > 1, else a ValueError names the block. ``kv_heads`` dims (``wk``, ``wv``,
    ``bk``, ``bv``) split by KV head when ``axis_size`` divides the KV heads, and are
    replicated otherwise (grouped-query attention with fewer KV heads than devices:
    ``shardops.layers.head_parallel_attention_specs(replicate_kv=True)``), never mid-head. The
    KV heads are read off the shapes: ``KV = wk.shape[1] / hd`` with ``hd = wq.shape[1] /
    num_heads``.
    """
    rules = logical_rules(axis) if rules is None else rules

    def spec(path, role, shape):
        where = f"params{jax.tree_util.keystr(path)}"
        role = as_role(role, where)
        if _names_heads(role) and axis_size > 1:
            _check_whole_heads(path, shapes, axis, axis_size, num_heads)
        names = role.logical_dims(_last_key(path), shape, where)
        if "kv_heads" in names and _kv_replicated(path, shapes, axis, axis_size, num_heads):
            return model_spec(role, path, shape, axis, rules={**rules, "kv_heads": None})
        return model_spec(role, path, shape, axis, rules=rules)

    return jax.tree_util.tree_map_with_path(spec, roles, shapes, is_leaf=is_shape)


def _names_heads(role: Role) -> bool:
    """Whether ``role`` names a ``heads`` or ``kv_heads`` dim of any leaf (the head role)."""
    dims = role.dims or {}
    return any("heads" in names or "kv_heads" in names for names in dims.values())


def _attention_block(path, shapes):
    """The shapes of the attention block holding the leaf at ``path``."""
    block = shapes
    for key in path[:-1]:
        block = block[getattr(key, "key", getattr(key, "idx", None))]
    return block


def _check_whole_heads(path, shapes, axis, axis_size: int, num_heads) -> None:
    """The head role splits whole query heads over ``axis``: ``num_heads`` (the model's
    attribute), where known, divides by ``axis_size``. Without it, multi-head attention (``wk``
    as wide as ``wq``) is left to ``ctx.attention``, which checks the heads its call names
    before anything moves; grouped-query attention needs it (``_kv_replicated``). (K/V split
    only by whole KV heads: ``_kv_replicated`` replicates them otherwise.) Else a ValueError
    naming the block, the heads, the axis and the fix: a split of ``wq[D, H·hd]`` by columns
    alone would cut a head."""
    block = _attention_block(path, shapes)
    if "wq" not in block:
        return  # not an attention block (model_spec names the leaf)
    where = f"params{jax.tree_util.keystr(path[:-1])}"
    inner = block["wq"][-1]
    if num_heads is None and block.get("wk", block["wq"])[-1] == inner:
        return  # multi-head: ctx.attention(num_heads=...) checks num_heads % axis_size
    if num_heads is None:
        raise ValueError(
            f"{where}: the head role splits the attention over mesh axis {axis!r} (size "
            f"{axis_size}) by heads, and each device must hold whole heads, but the model has "
            f"no num_heads attribute to count them (wq[D, {inner}] holds num_heads × head_dim "
            f"columns, and a split of the columns alone may cut a head): give the model a "
            f"num_heads attribute (and num_kv_heads for grouped-query attention), or role "
            f"'replicated'"
        )
    if num_heads % axis_size:
        raise ValueError(
            f"{where}: num_heads={num_heads} is not divisible by mesh axis {axis!r} (size "
            f"{axis_size}); the head role gives each device whole query heads, and wq[D, "
            f"{inner}] split {axis_size} ways would cut a head of {inner // num_heads}. Choose "
            f"num_heads a multiple of {axis_size} (e.g. {-(-num_heads // axis_size) * axis_size}), "
            f"a smaller {axis!r} axis, or role 'replicated'"
        )


def _kv_replicated(path, shapes, axis, axis_size: int, num_heads) -> bool:
    """Whether the attention block at ``path[:-1]`` has fewer KV heads than ``axis_size``
    divides (its K/V are then replicated over ``axis``)."""
    block = _attention_block(path, shapes)
    if "wq" not in block or "wk" not in block:
        return False
    inner, kv_inner = block["wq"][-1], block["wk"][-1]
    if kv_inner == inner:
        return False  # multi-head: as many KV heads as query heads, split with them
    where = f"params{jax.tree_util.keystr(path[:-1])}"
    if num_heads is None:
        raise ValueError(
            f"{where}: wk is narrower than wq (grouped-query attention), so the head role must "
            f"know the query heads to count the KV heads: give the model a num_heads attribute"
        )
    head_dim = inner // num_heads
    kv_heads = kv_inner // head_dim
    if head_dim * num_heads != inner or kv_heads * head_dim != kv_inner:
        raise ValueError(
            f"{where}: wq[D, {inner}] and wk[D, {kv_inner}] do not hold whole heads of "
            f"{inner}/{num_heads} (num_heads={num_heads})"
        )
    return kv_heads % axis_size != 0


def split_over(spec: P, axis: str) -> bool:
    return any(axis in entry_axes(e) for e in spec)


def _last_key(path) -> str:
    key = path[-1] if path else None
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def is_shape(x) -> bool:
    """A leaf of a tree of shapes: a tuple of ints."""
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)
