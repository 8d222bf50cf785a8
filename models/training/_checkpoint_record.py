"""A checkpoint's record of its model, and the comparison of two records: what identifies the
model of a setup (type, config field by field, every parameter's path, shape and dtype, its
plan role, the optimizer state's structure) and the readable differences that make
``Checkpoints.restore`` refuse another model before reading any array."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np

from shardops_models.strategies.plan import leaf_roles
from shardops_models.training._setup import Setup

SHOWN = 6  # differences listed per kind (params, plan, optimizer state)


def describe(setup: Setup) -> dict:
    """What identifies the model of ``setup`` (JSON): type, config, params, plan, optimizer;
    and the config's defaults (what a field added since a save is taken to have been)."""
    model = setup.model
    shapes = _param_shapes(setup)
    roles = leaf_roles(setup.plan, jax.tree.map(lambda a: tuple(a.shape), shapes))
    opt_state = jax.eval_shape(setup.optimizer.init, shapes)
    config = _config(model)
    return {
        "type": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": config,
        "defaults": _defaults(model),
        "params": {_key(p): [list(a.shape), str(a.dtype)] for p, a in _leaves(shapes)},
        "plan": {_key(p): r for p, r in _leaves(roles)},
        "optimizer_state": {_key(p): [list(a.shape), str(a.dtype)] for p, a in _leaves(opt_state)},
    }


# Model types as checkpoints written before the models moved into subpackages name them.
MOVED_TYPES = {
    "shardops_models.mlp.Mlp": "shardops_models.networks.mlp.Mlp",
    "shardops_models.gpt.Gpt": "shardops_models.networks.gpt.Gpt",
}


def differences(saved: dict, here: dict) -> list[str]:
    """Readable differences between two ``describe`` records (the checkpoint's, this setup's)."""
    out = []
    if MOVED_TYPES.get(saved["type"], saved["type"]) != here["type"]:
        out.append(f"model type {saved['type']} in the checkpoint, {here['type']} here")
        return out
    defaults = here.get("defaults", {})
    for field in sorted(set(saved["config"]) | set(here["config"])):
        a, b = saved["config"].get(field), here["config"].get(field)
        if field not in saved["config"] and field in defaults and b == defaults[field]:
            continue  # a field added since the save, at its default: the model it saved
        if field not in saved["config"] and isinstance(b, dict) and _TYPE in b:
            # saved before nested configs were recorded: its parameters still compare below
            warnings.warn(f"the checkpoint does not record the model's {field} (saved before "
                          f"nested configs were recorded): {_show_config(b)} cannot be compared "
                          f"with the one that trained it; save it again to record it",
                          UserWarning, stacklevel=2)  # fmt: skip
            continue
        if field not in saved["config"]:
            out.append(
                f"model config {field}: not recorded in the checkpoint, {_show_config(b)} here"
            )
            continue
        out += [f"model config {name}: {_show_config(x)} in the checkpoint, {_show_config(y)} here"
                for name, x, y in _config_differences(field, a, b)]  # fmt: skip
    for what, name in (("params", "params"), ("plan", "plan role of params"),
                       ("optimizer_state", "optimizer state")):  # fmt: skip
        a, b = saved[what], here[what]
        found = []
        for path in sorted(set(a) | set(b)):
            if path not in b:
                found.append(f"{name}{path}: in the checkpoint, not here")
            elif path not in a:
                found.append(f"{name}{path}: here, not in the checkpoint")
            elif a[path] != b[path]:
                found.append(
                    f"{name}{path}: {_show(a[path])} in the checkpoint, {_show(b[path])} here"
                )
        if what == "optimizer_state" and found and any(p.startswith("params") for p in out):
            found = [f"optimizer state: {len(found)} leaves differ, following the params"]
        if len(found) > SHOWN:
            found[SHOWN:] = [f"… and {len(found) - SHOWN} more differences in the {name}"]
        out += found
    if any(p.startswith("optimizer state") for p in out) and len(out) == sum(
        p.startswith("optimizer state") or p.startswith("…") for p in out
    ):
        out.append("the model matches: was the checkpoint trained with another optimizer?")
    return out


def _config_differences(name: str, a, b) -> list[tuple[str, Any, Any]]:
    """``(name, saved, here)`` of each config value that differs, a nested config (a model's
    ``Experts``) field by field as ``experts.k``."""
    if isinstance(a, dict) and isinstance(b, dict) and a.get(_TYPE) == b.get(_TYPE):
        return [d for key in sorted(set(a) | set(b)) if key != _TYPE
                for d in _config_differences(f"{name}.{key}", a.get(key), b.get(key))]  # fmt: skip
    return [] if a == b else [(name, a, b)]


def _param_shapes(setup: Setup):
    """The params' ``ShapeDtypeStruct``s, in the precision policy's param dtype."""
    dtype = setup.precision.param_dtype
    return jax.eval_shape(lambda key: setup.model.init(key, dtype=dtype), jax.random.key(0))


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def _key(path) -> str:
    return jax.tree_util.keystr(path)


def _config(model) -> dict:
    """The model's config: a dataclass's fields, else its public attributes that are plain
    numbers, strings or sequences of them (never a repr, which may hold an address)."""
    if dataclasses.is_dataclass(model):
        # a field outside the model's equality (compare=False: Llama.special_tokens, which the
        # forward never reads) is not what identifies it
        items = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.compare}
    else:
        items = {k: v for k, v in vars(model).items() if not k.startswith("_")}
    out = {}
    for name, value in items.items():
        value = _jsonable(value)
        if _plain(value):
            out[name] = value
    return out


def _defaults(model) -> dict:
    """The plain defaults of a dataclass model's config fields: a checkpoint saved before a
    field existed restores where the field is at its default (``differences``)."""
    if not dataclasses.is_dataclass(model):
        return {}
    out = {}
    for f in dataclasses.fields(model):
        if f.default is not dataclasses.MISSING and _plain(_jsonable(f.default)):
            out[f.name] = _jsonable(f.default)
    return out


_TYPE = "__type__"
"""A nested config's key for its type's name (``_jsonable``)."""


def _plain(value) -> bool:
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, bool | int | float | str)


def _jsonable(value: Any):
    """``value`` in JSON's types: a nested config (a dataclass instance such as a model's
    ``Experts``) as a dict of its fields and its type's name, so that a checkpoint records
    (and a restore compares) its every field."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {_TYPE: type(value).__qualname__, **fields}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _show_config(value) -> str:
    """A config value as the model's own constructor would print it."""
    if isinstance(value, dict) and _TYPE in value:
        fields = ", ".join(f"{k}={_show_config(v)}" for k, v in value.items() if k != _TYPE)
        return f"{value[_TYPE]}({fields})"
    return repr(value)


def _show(value) -> str:
    if isinstance(value, list) and len(value) == 2 and isinstance(value[1], str):
        return f"shape {tuple(value[0])} {value[1]}"
    return repr(value)
