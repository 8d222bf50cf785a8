"""Sharded checkpoints of a train state that restore onto any strategy and mesh (orbax).

    ckpt = Checkpoints("runs/mlp", every=100)         # a save every 100 steps, 3 kept
    ckpt.save(step, setup, state, extra={"epoch": 3})  # every process calls it
    state, extra = ckpt.restore(other_setup)           # any strategy, any mesh, or ref

A checkpoint holds the train state (params and optimizer state) as global arrays, each
process writing the shards it owns (orbax-checkpoint's ``StandardSave`` over tensorstore),
and a JSON record: the model's type and config, every parameter's path, shape and dtype, the
plan's role of every parameter, the optimizer state's structure, the step, and ``extra`` (the
examples keep their data position, seed and metric history there).

**Resharding.** ``restore`` reads each array straight into the target setup's layout: the
target's ``NamedSharding`` of every leaf (``setup.param_specs``, ``setup.opt_specs``) is the
restore target, so a checkpoint of ``2d`` on 4×2 restores as ``fsdp_tp`` on 2×4, ``tp`` on
1×8, or ``ref`` on one device, and every value is bit-identical to the saved one.

**Another model is refused**, before any array is read, with every difference named: the model
type or a config field (``sizes``, ``d_model`` …), a parameter that is missing, extra, or of
another shape or dtype, a parameter whose plan role differs, or another optimizer state.

**The model's own shapes.** A dim the tp axis does not divide is stored padded
(``models.training``'s ``Padding``); a checkpoint holds the arrays without the padding, so it
restores onto a mesh that pads differently (a vocabulary of 97: 100 on model = 4, 104 on 8).

**Atomic.** orbax writes a step into a temporary directory and renames it when every process
has finished (a rename is atomic on a POSIX file system): a process killed mid-save leaves the
previous steps intact and the partial one invisible (``steps``, ``latest_step`` and
``restore`` ignore it). Saves are synchronous: ``save`` returns once the step is committed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from shardops_models.strategies.plan import is_shape, leaf_roles
from shardops_models.training._train import Setup, TrainState, logical_spec

FORMAT = 1
KEEP = 3
SHOWN = 6  # differences listed per kind (params, plan, optimizer state)


class CheckpointMismatch(ValueError):
    """The checkpoint holds another model (or optimizer) than the setup it is restored into."""


class Checkpoints:
    """The checkpoints of one run, in ``directory`` (created if missing).

    Arguments:
        directory: a local or shared path every process can reach (orbax also takes
            ``gs://…`` paths).
        every: save every this many steps (``should_save``); None: only when asked.
        keep: how many recent steps to keep (None: all).
    """

    def __init__(self, directory: str | os.PathLike, *, every: int | None = None,
                 keep: int | None = KEEP):  # fmt: skip
        if every is not None and every < 1:
            raise ValueError(f"every must be ≥ 1 step (or None); got {every}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.every = every
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=False,
                create=True,
                cleanup_tmp_directories=True,
            ),
        )

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is one of every ``every`` steps."""
        return self.every is not None and step % self.every == 0

    def save(self, step: int, setup: Setup, state: TrainState, *, extra: dict | None = None
             ) -> None:  # fmt: skip
        """Save ``state`` (laid out by ``setup``) as ``step``, with ``extra`` (JSON) beside it.

        Every process of a multi-process run must call it with the same arguments; it returns
        when the step is committed. Saving a step that exists replaces it.
        """
        record = {
            "format": FORMAT,
            "step": int(step),
            "strategy": setup.strategy,
            "mesh": None if setup.mesh is None else dict(setup.mesh.shape),
            "model": describe(setup),
            "extra": extra or {},
        }
        if step in self._manager.all_steps():
            self._manager.delete(step)
        state = _logical_state(setup, state)  # the model's own shapes, padding cut off
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": state.params, "opt_state": state.opt_state}),
                record=ocp.args.JsonSave(record),
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def record(self, step: int | None = None) -> dict:
        """The JSON record of ``step`` (default the latest): model, strategy, mesh, extra."""
        step = self._step(step)
        return self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))[
            "record"
        ]

    def restore(self, setup: Setup, step: int | None = None) -> tuple[TrainState, dict]:
        """``(state, extra)`` of ``step`` (default the latest), laid out for ``setup``.

        The state's arrays are read directly into ``setup``'s shardings (any strategy and mesh
        of the same model; see the module doc). Raises ``CheckpointMismatch`` naming every
        difference when the checkpoint holds another model, plan or optimizer state, and
        ``FileNotFoundError`` when there is no such step.
        """
        step = self._step(step)
        record = self.record(step)
        problems = differences(record["model"], describe(setup))
        if problems:
            raise CheckpointMismatch(
                f"the checkpoint {self.directory} step {step} holds another model than this "
                f"setup's ({len(problems)} difference(s)):\n  - " + "\n  - ".join(problems)
            )
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract_state(setup)))
        )["state"]
        state = TrainState(restored["params"], restored["opt_state"])
        return _stored_state(setup, state), record["extra"]

    def _step(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint of step {step} in {self.directory}; it has steps {steps}"
            )
        return step

    def close(self) -> None:
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def describe(setup: Setup) -> dict:
    """What identifies the model of ``setup`` (JSON): type, config, params, plan, optimizer."""
    model = setup.model
    shapes = _param_shapes(setup)
    roles = leaf_roles(setup.plan, jax.tree.map(lambda a: tuple(a.shape), shapes))
    opt_state = jax.eval_shape(setup.optimizer.init, shapes)
    config = _config(model)
    return {
        "type": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": config,
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
    for field in sorted(set(saved["config"]) | set(here["config"])):
        a, b = saved["config"].get(field), here["config"].get(field)
        if a != b:
            out.append(f"model config {field}: {a} in the checkpoint, {b} here")
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


def _param_shapes(setup: Setup):
    """The params' ``ShapeDtypeStruct``s, in the precision policy's param dtype."""
    dtype = setup.precision.param_dtype
    return jax.eval_shape(lambda key: setup.model.init(key, dtype=dtype), jax.random.key(0))


def _abstract_state(setup: Setup) -> dict:
    """The restore target: params and optimizer state in the model's own shapes, as
    ``ShapeDtypeStruct``s carrying the setup's sharding of every leaf (the logical layout,
    where the setup pads a dim)."""
    params = _param_shapes(setup)
    opt_state = jax.eval_shape(setup.optimizer.init, params)
    specs = _logical_specs(setup)
    return {
        "params": _with_shardings(params, setup, specs.params),
        "opt_state": _with_shardings(opt_state, setup, specs.opt_state),
    }


def _logical_specs(setup: Setup) -> TrainState:
    """The setup's specs of params and optimizer state, for the model's own shapes."""
    if setup.mesh is None or not setup.padding.padded:
        return TrainState(setup.param_specs, setup.opt_specs)
    padding, mesh = setup.padding, setup.mesh
    opt = optax.tree_map_params(
        setup.optimizer, lambda spec, shape: logical_spec(spec, shape, mesh),
        setup.opt_specs, padding.logical, is_leaf=lambda x: isinstance(x, P) or is_shape(x),
    )  # fmt: skip
    return TrainState(padding.logical_specs(setup.param_specs, mesh), opt)


def _logical_state(setup: Setup, state: TrainState) -> TrainState:
    """``state`` in the model's own shapes (the padding sliced off), laid out for saving."""
    if setup.mesh is None or not setup.padding.padded:
        return state
    shardings = _shardings(setup, _logical_specs(setup))
    return jax.jit(lambda s: setup.padding.unpad_tree(s, setup.optimizer),
                   out_shardings=shardings)(state)  # fmt: skip


def _stored_state(setup: Setup, state: TrainState) -> TrainState:
    """A restored (model-shaped) state padded to the setup's stored shapes and layout."""
    if setup.mesh is None or not setup.padding.padded:
        return state
    shardings = _shardings(setup, TrainState(setup.param_specs, setup.opt_specs))
    return jax.jit(lambda s: setup.padding.pad_tree(s, setup.optimizer),
                   out_shardings=shardings)(state)  # fmt: skip


def _shardings(setup: Setup, specs: TrainState) -> TrainState:
    return jax.tree.map(lambda s: NamedSharding(setup.mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))  # fmt: skip


def _with_shardings(shapes, setup: Setup, specs):
    """``ShapeDtypeStruct`` leaves carrying the setup's sharding of each leaf (the restore
    target): the mesh's ``NamedSharding``, or one device for ``ref``."""
    if setup.mesh is None:
        device = SingleDeviceSharding(jax.local_devices()[0])
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            shapes)  # fmt: skip
    return jax.tree.map(
        lambda spec, a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(setup.mesh, spec)
        ),
        specs,
        shapes,
        is_leaf=lambda s: isinstance(s, P),
    )


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def _key(path) -> str:
    return jax.tree_util.keystr(path)


def _config(model) -> dict:
    """The model's config: a dataclass's fields, else its public attributes that are plain
    numbers, strings or sequences of them (never a repr, which may hold an address)."""
    if dataclasses.is_dataclass(model):
        items = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    else:
        items = {k: v for k, v in vars(model).items() if not k.startswith("_")}
    out = {}
    for name, value in items.items():
        value = _jsonable(value)
        if _plain(value):
            out[name] = value
    return out


def _plain(value) -> bool:
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str)


def _jsonable(value: Any):
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _show(value) -> str:
    if isinstance(value, list) and len(value) == 2 and isinstance(value[1], str):
        return f"shape {tuple(value[0])} {value[1]}"
    return repr(value)
