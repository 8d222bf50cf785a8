"""Plans: the tensor-parallel role of every parameter, and the layouts derived from them.

A *plan* is a pytree whose structure is a prefix of the parameter tree; each of its leaves is
a role naming how the subtree under it is split over mesh axis ``model`` (a per-layer role, or
a per-leaf one):

    role         leaves (global shapes)                          split over model
    column       w[D, F], b[F]                                  w[D, F_model], b[F_model]
    row          w[F, D], b[D]                                  w[F_model, D], b[D]
    vocab        table[V, D]                                    table[V_model, D]
    head         wq[D, H·hd], bq[H·hd], wk, wv[D, KV·hd],       by heads: w[D, (H·hd)_model],
                 bk, bv[KV·hd], wo[H·hd, D], bo[D]              b[(H·hd)_model], wo[(H·hd)_model, D];
                                                                wk, wv, bk, bv by KV head, or
                                                                replicated when p ∤ KV
    replicated   anything                                       nothing

    plan = {"embed": "vocab", "blocks": [{"attn": "head", "up": "column", "down": "row",
            "ln1": "replicated", "ln2": "replicated"}] * depth, "head": "column", ...}

PyTorch's ``parallelize_module(model, mesh, plan)`` is the model for the interface. The role
decides two things: the layout (``model_specs``, here) and the kernel that runs the layer
(``models.strategies.parallel.Parallel``). A data-axis strategy then adds its own split on top
(``fsdp_spec``: the FSDP rule).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from shardops import MODEL_AXIS, entry_axes

COLUMN, ROW, VOCAB, HEAD, REPLICATED = "column", "row", "vocab", "head", "replicated"
ROLES = (COLUMN, ROW, VOCAB, HEAD, REPLICATED)

# head role: which attention leaves are split like a column layer, which like a row layer
_HEAD_COLUMN = ("wq", "wk", "wv", "bq", "bk", "bv")
_HEAD_ROW = ("wo",)
_HEAD_REPLICATED = ("bo",)
_HEAD_KV = ("wk", "wv", "bk", "bv")  # split by KV head, or replicated (``model_specs``)


class StackedRole(str):
    """The role of a leaf that stacks one layer per index of its dim 0 (run by ``ctx.scan``
    with ``lax.scan``): equal, as a string, to ``layer``, the role of one layer's slice, so
    every test of a role reads it alike. Dim 0 is never split: the tp split is the layer's,
    one dim further, and FSDP splits another dim."""

    __slots__ = ()

    @property
    def layer(self) -> str:
        """The role of one layer (a plain ``str``)."""
        return str.__str__(self)


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
    """The role of every leaf of ``params``: ``plan``'s role broadcast over its subtree (a
    ``StackedRole`` under a ``stacked`` node).

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
    for path, role in jax.tree_util.tree_leaves_with_path(roles):
        if role not in ROLES:
            raise ValueError(
                f"plan{jax.tree_util.keystr(path)}: unknown role {role!r}; choose one of {ROLES}"
            )
    return roles


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
                     f"give a role (one of {ROLES}) or a tree of them {hint}")  # fmt: skip


def model_spec(role: str, path, shape: tuple[int, ...], axis: str = MODEL_AXIS) -> P:
    """The split over ``axis`` (the tp axis, ``model`` by default) of one leaf (global
    ``shape``) with ``role``; ``path`` names it.

    Every leaf a role splits must have the shape the role expects; the error names the leaf,
    the role and both shapes.
    """
    if isinstance(role, StackedRole):  # [L, …]: dim 0 holds the layers, never split
        return P(None, *model_spec(role.layer, path, shape[1:], axis))
    name = _last_key(path)
    where = f"params{jax.tree_util.keystr(path)}"
    if role == REPLICATED:
        return replicated(shape)
    if role in (COLUMN, ROW):
        if len(shape) not in (1, 2):
            raise ValueError(f"{where}: a {role} layer holds w[D, F] and b; got shape {shape}")
        if len(shape) == 2:
            return P(None, axis) if role == COLUMN else P(axis, None)
        return P(axis) if role == COLUMN else P(None)
    if role == VOCAB:
        if len(shape) != 2:
            raise ValueError(f"{where}: the vocab role splits table[V, D]; got shape {shape}")
        return P(axis, None)
    # HEAD
    if name in _HEAD_COLUMN:
        return P(None, axis) if len(shape) == 2 else P(axis)
    if name in _HEAD_ROW:
        return P(axis, None)
    if name in _HEAD_REPLICATED:
        return replicated(shape)
    raise ValueError(
        f"{where}: the head role splits attention parameters {_HEAD_COLUMN + _HEAD_ROW + _HEAD_REPLICATED} "
        f"(shardops.init_attention's keys); got a leaf named {name!r}"
    )


def replicated(shape: tuple[int, ...]) -> P:
    """``P(None, …)``: one entry per dim, none split."""
    return P(*(None,) * len(shape))


def model_specs(roles, shapes, axis: str, axis_size: int, num_heads: int | None = None):
    """PartitionSpecs over ``axis`` (the tp axis) of a tree of leaf ``shapes`` with leaf ``roles``.

    Under the head role every device holds whole heads: ``num_heads`` (the model's attribute)
    must be given and divide by ``axis_size`` whenever ``axis_size`` > 1, else a ValueError
    names the block. ``wk``, ``wv`` (``bk``, ``bv``) split by KV head when ``axis_size``
    divides the KV heads, and are replicated otherwise (grouped-query attention with fewer KV
    heads than devices: ``shardops.layers.head_parallel_attention_specs(replicate_kv=True)``),
    never mid-head. The KV heads are read off the shapes: ``KV = wk.shape[1] / hd`` with ``hd
    = wq.shape[1] / num_heads``.
    """

    def spec(path, role, shape):
        if role == HEAD and axis_size > 1:
            _check_whole_heads(path, shapes, axis, axis_size, num_heads)
        if role == HEAD and _last_key(path) in _HEAD_KV and _kv_replicated(
                path, shapes, axis, axis_size, num_heads):  # fmt: skip
            return replicated(shape)
        return model_spec(role, path, shape, axis)

    return jax.tree_util.tree_map_with_path(spec, roles, shapes, is_leaf=is_shape)


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
