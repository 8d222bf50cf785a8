"""Sharded checkpoints of a train state that restore onto any strategy and mesh (orbax).

    ckpt = Checkpoints("runs/mlp", every=100)         # a save every 100 steps, 3 kept
    ckpt.save(step, setup, state, extra={"epoch": 3})  # every process calls it
    state, extra = ckpt.restore(other_setup)           # any strategy, any mesh, or ref
    state, extra, step = ckpt.restore_latest_intact(setup)  # skips damaged steps, saying so

A checkpoint holds the train state (params and optimizer state) as global arrays, each
process writing the shards it owns (orbax-checkpoint's ``StandardSave`` over tensorstore),
and a JSON record: the model's type and config, every parameter's path, shape and dtype, the
plan's role of every parameter, the optimizer state's structure, the step, a fingerprint of
every leaf, and ``extra`` (the examples keep their data position, seed and metric history
there).

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

**Asynchronous saves** (the default; ``asynchronous=False`` saves synchronously). ``save``
returns once every array it writes is on the host, and the write and commit run in a
background thread while training goes on; ``wait`` waits for them. Every other method waits
for an in-flight save first (``steps``, ``latest_step``, ``record``, ``restore``, the next
``save``, ``close``), so the caller sees what a synchronous save would give. The train step
may donate the saved state: on an accelerator orbax has copied the arrays to the host; on CPU
its host copy of a shard it writes whole is a view of the device buffer, and while the view is
held XLA skips the donation (the step writes new buffers), so the saved bytes never change,
at a cost in memory until the write ends: benchmarks/checkpoint_async.py measured about twice
the state more than a synchronous save for a state sharded with no replicas, and no more for
one replicated over data (orbax writes slices of replicas, which are copies). ``close`` (or
leaving the ``with`` block) waits for the last save; a process that ends without it may lose
that save, never an earlier one.

**Atomic.** orbax writes a step into a temporary directory and renames it when every process
has finished (a rename is atomic on a POSIX file system): a process killed mid-save, or
while an asynchronous save is being written, leaves the previous steps intact and the
partial one invisible (``steps``, ``latest_step`` and ``restore`` ignore it).

**Never a silently wrong restore.** At save, every leaf of the state gets a 64-bit fingerprint
computed on device (each element's bits mixed with its flat index through an integer hash and
summed mod 2^32, under two seeds: exact, and the same on any layout and every process), and the
record gets a digest of its own text. ``restore`` checks the step folder's items, the record's
digest and that the record is this step's (a folder renamed or copied from another step is
damaged: it would resume at the wrong step), reads every stored chunk (tensorstore checks each
file's length and checksums), restores, and compares the restored arrays' fingerprints with the
saved ones: a file missing, cut short or failing its checksum, or a value that reads without
error but is not the one saved (changed before it reached the disk, or rewritten by another
tool), raises ``CheckpointDamaged`` naming the step, the file or the leaves, and the steps left
to restore (tensorstore's error as its ``__cause__``). ``restore_latest_intact`` tries the
newest step first and falls back, one logged line per damaged step, to the newest intact one.
In a run of several processes they agree after every attempt (a read error may reach only the
process reading the damaged shard): a step one process could not read is damaged for all of
them.
``steps`` lists what orbax lists, a step folder another tool half wrote included: hiding it
would let ``latest_step`` pass over it silently and a later save of that step collide with
it; restoring it raises ``CheckpointDamaged`` naming what is missing, and
``restore_latest_intact`` passes over it, saying so. Checkpoints written before the
fingerprints (record format 1) restore without the check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from shardops_models.strategies.plan import is_shape, leaf_roles
from shardops_models.training import _layer_order
from shardops_models.training._placement import logical_spec
from shardops_models.training._setup import Setup
from shardops_models.training._state import TrainState

FORMAT = 2  # 2: fingerprints of the leaves and a digest of the record
KEEP = 3
SHOWN = 6  # differences listed per kind (params, plan, optimizer state)
# What orbax writes into every step folder: its commit metadata and one folder per item (the
# state's tree metadata inside ``state``, the JSON inside ``record``).
STEP_ITEMS = ("_CHECKPOINT_METADATA", "record/metadata", "state/_METADATA")
SEEDS = (0x9E3779B9, 0x85EBCA6B)  # two fingerprints of 32 bits each
# tensorstore's error code and the files it names ("... local file "/ckpt/8/state/d/ab12"")
_STATUS = re.compile(r"^([A-Z_]+): ")
_FILE = re.compile(r'local file "([^"]+)"')
_ARRAY = re.compile(r'Error reading "([^"/]+)/')


class CheckpointMismatch(ValueError):
    """The checkpoint holds another model (or optimizer) than the setup it is restored into."""


class CheckpointDamaged(ValueError):
    """A checkpoint step that cannot be restored as it was saved: a file missing, cut short or
    changed since the save, or a step folder that another tool half wrote.

    ``step``, ``directory`` and ``reason`` (what is wrong, one line) are attributes.
    """

    def __init__(self, message: str, *, step: int | None = None,
                 directory: str | None = None, reason: str | None = None):  # fmt: skip
        super().__init__(message)
        self.step, self.directory, self.reason = step, directory, reason


class _Manager(ocp.CheckpointManager):
    """orbax's manager without its own look at JAX's preemption sync point.

    orbax asks ``reached_preemption_sync_point(step)`` with the step it saves, also from the
    thread that finishes an asynchronous save, while training is steps ahead. JAX's preemption
    service takes the step of the latest call as this process's: a notice arriving then would
    set the stop one past that old step, which the loop has already passed, and no process
    would ever stop. ``shardops.preemption.Preemption`` is the one caller, once per step.
    """

    def reached_preemption(self, step: int) -> bool:
        return False


class Checkpoints:
    """The checkpoints of one run, in ``directory`` (created by the first ``save``; reading
    creates nothing).

    Arguments:
        directory: a local or shared path every process can reach. ``steps`` of a folder that
            does not exist is ``[]``; ``restore``, ``record`` and ``restore_latest_intact``
            raise ``FileNotFoundError`` naming it.
        every: save every this many steps (``should_save``); None: only when asked.
        keep: how many recent steps to keep (None: all).
        asynchronous: ``save`` returns once the arrays are on the host and writes them in the
            background (see the module doc); False: it returns once the step is committed.
    """

    def __init__(self, directory: str | os.PathLike, *, every: int | None = None,
                 keep: int | None = KEEP, asynchronous: bool = True):  # fmt: skip
        if every is not None and every < 1:
            raise ValueError(f"every must be ≥ 1 step (or None); got {every}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.every = every
        self.asynchronous = asynchronous
        self._manager = _Manager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=asynchronous,
                create=False,  # ``save`` creates the folder: reading one creates nothing
                cleanup_tmp_directories=True,
            ),
        )
        # Restores read through the handlers, which hold no barrier: a process that fails to
        # read a step must still reach the agreement every process meets after an attempt.
        self._state_reader = ocp.StandardCheckpointHandler()
        self._record_reader = ocp.JsonCheckpointHandler()

    def wait(self) -> None:
        """Wait until the save in flight (if any) is committed; raise its error if it failed."""
        self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        """The committed steps, oldest first (a save in flight is waited for)."""
        self.wait()  # an in-flight save is listed once committed
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None (a save in flight is waited for)."""
        self.wait()  # an in-flight save is the latest once committed
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is one of every ``every`` steps."""
        return self.every is not None and step % self.every == 0

    def save(self, step: int, setup: Setup, state: TrainState, *, extra: dict | None = None
             ) -> None:  # fmt: skip
        """Save ``state`` (laid out by ``setup``) as ``step``, with ``extra`` (JSON) beside it.

        Every process of a multi-process run must call it with the same arguments. It returns
        once the arrays are on the host (asynchronous) or the step is committed; the train
        step may then donate ``state``. ``extra`` is copied at the call. Saving a step that
        exists replaces it.
        """
        self.wait()  # one save in flight at a time; the replace below sees the committed steps
        _layer_order.check(state, setup.layer_order, "Checkpoints.save: state",
                           "Save it with the setup it came from")  # fmt: skip
        state = _logical_state(setup, state)  # the model's own shapes, padding cut off
        record = {
            "format": FORMAT,
            "step": int(step),
            "strategy": setup.strategy.name,
            "mesh": None if setup.mesh is None else dict(setup.mesh.shape),
            "model": describe(setup),
            "fingerprints": fingerprints(state),
            "extra": extra or {},
        }
        record = json.loads(json.dumps(record))  # a copy of extra, as JSON reads it back
        record["digest"] = _digest(record)
        os.makedirs(self.directory, exist_ok=True)  # every process: a shared path or its own
        if step in self._manager.all_steps():
            self._manager.delete(step)
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": state.params, "opt_state": state.opt_state}),
                record=ocp.args.JsonSave(record),
            ),
            force=True,
        )
        if not self.asynchronous:
            self.wait()

    def record(self, step: int | None = None) -> dict:
        """The JSON record of ``step`` (default the latest): model, strategy, mesh, extra.

        Raises ``CheckpointDamaged`` when the step folder or the record is damaged.
        """
        self.wait()  # the record of an in-flight save is read once committed
        step = self._step(step)
        return self._read_record(step)

    def restore(self, setup: Setup, step: int | None = None) -> tuple[TrainState, dict]:
        """``(state, extra)`` of ``step`` (default the latest), laid out for ``setup``.

        The state's arrays are read directly into ``setup``'s shardings (any strategy and mesh
        of the same model; see the module doc). Raises ``CheckpointMismatch`` naming every
        difference when the checkpoint holds another model, plan or optimizer state,
        ``CheckpointDamaged`` when the step is damaged (a file missing, cut short or changed;
        see ``restore_latest_intact``), and ``FileNotFoundError`` when there is no such step.
        """
        self.wait()  # an in-flight save of this step commits first
        return self._restore_step(setup, self._step(step))

    def restore_latest_intact(self, setup: Setup, *, log=print) -> tuple[TrainState, dict, int]:
        """``(state, extra, step)`` of the newest step that restores intact, laid out for
        ``setup``.

        Tries the newest step first; for each damaged one (``CheckpointDamaged``) it calls
        ``log`` with one line, ``Checkpoint step 8 in DIR is damaged (…); falling back to step
        6``, and tries the next older step. ``CheckpointMismatch`` (another model) is raised
        at once: an older step of the same run holds the same model. Raises
        ``CheckpointDamaged`` listing every step's reason when none is intact, and
        ``FileNotFoundError`` when there is no step at all. Every process of a multi-process
        run must call it; they restore the same step (and each calls ``log``: pass one that
        prints on process 0 only).
        """
        steps = self.steps()
        if not steps:
            raise self._none_found()
        reasons = {}
        for step in reversed(steps):
            try:
                state, extra = self._restore_step(setup, step)
            except CheckpointDamaged as e:
                reasons[step] = e.reason
                older = [s for s in steps if s < step]
                if older:
                    log(f"Checkpoint step {step} in {self.directory} is damaged ({e.reason}); "
                        f"falling back to step {older[-1]}")  # fmt: skip
                continue
            return state, extra, step
        listed = "\n  - ".join(f"step {s}: {r}" for s, r in sorted(reasons.items()))
        raise CheckpointDamaged(
            f"no intact checkpoint in {self.directory}: every step is damaged:\n  - {listed}\n"
            f"Restore the step folders from a copy, or delete them and start the run afresh.",
            directory=self.directory, reason="every step is damaged",
        )  # fmt: skip

    def _step(self, step: int | None) -> int:
        steps = sorted(self._manager.all_steps())
        if not steps:
            raise self._none_found()
        if step is None:
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint of step {step} in {self.directory}; it has steps {steps}"
            )
        return step

    def _none_found(self) -> FileNotFoundError:
        """The error of a restore from a folder with no step, or with no folder at all."""
        if not os.path.isdir(self.directory):
            return FileNotFoundError(
                f"no checkpoint folder {self.directory}: it does not exist (reading creates "
                f"nothing; the first save creates it). Check the path, or start the run "
                f"afresh without restoring (e.g. when ckpt.steps() is [])"
            )
        return FileNotFoundError(
            f"no checkpoint in {self.directory}: the folder holds no committed step; start "
            f"the run afresh without restoring (e.g. when ckpt.steps() is [])"
        )

    def _folder(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _damaged(self, step: int, reason: str) -> CheckpointDamaged:
        """``CheckpointDamaged`` for ``step``: what is wrong, and the steps left to restore."""
        others = [s for s in sorted(self._manager.all_steps()) if s != step]
        fix = (
            f"Restore {'an earlier' if max(others) < step else 'another'} step: steps {others} "
            f"are in {self.directory} "
            f"(restore_latest_intact takes the newest intact one), or delete the folder "
            f"{self._folder(step)}."
            if others
            else f"No other step is in {self.directory}: delete the folder {self._folder(step)} "
            f"(or put it back from a copy) and start the run afresh."
        )
        return CheckpointDamaged(
            f"checkpoint step {step} in {self.directory} is damaged: {reason}. {fix}",
            step=step, directory=self.directory, reason=reason,
        )  # fmt: skip

    def _read_record(self, step: int) -> dict:
        """The record of ``step``, after checking the step folder's items and the record's
        digest; ``CheckpointDamaged`` otherwise."""
        folder = self._folder(step)
        missing = [item for item in STEP_ITEMS if not os.path.exists(os.path.join(folder, item))]
        if missing:
            raise self._damaged(
                step, f"the folder {folder} is not a whole checkpoint: it lacks "
                f"{', '.join(missing)} (orbax writes them all before the commit; another tool "
                f"wrote it, or a copy of it was cut short)",
            )  # fmt: skip
        path = os.path.join(folder, "record", "metadata")
        try:
            record = self._record_reader.restore(
                epath.Path(folder) / "record", args=ocp.args.JsonRestore()
            )
        except (OSError, ValueError, TypeError) as e:
            raise self._damaged(
                step, f"its record {path} is unreadable ({type(e).__name__}: {e})"
            ) from e
        fields = {"format", "step", "model", "extra"}
        if not (isinstance(record, dict) and fields <= set(record)
                and isinstance(record["format"], int)):  # fmt: skip
            raise self._damaged(step, f"its record {path} is not a checkpoint record")
        if record["format"] >= 2 and record.get("digest") != _digest(record):
            raise self._damaged(
                step, f"its record {path} changed after the save (its digest does not match)"
            )
        if record["step"] != step:
            raise self._damaged(
                step, f"its record {path} is step {record['step']}'s: the folder was renamed or "
                f"copied from step {record['step']} (restoring it as step {step} would resume "
                f"at the wrong step)",
            )  # fmt: skip
        return record

    def _restore_step(self, setup: Setup, step: int) -> tuple[TrainState, dict]:
        """``restore`` of a committed step; every process ends it the same way."""
        local_error = None
        try:
            record = self._read_record(step)
            problems = differences(record["model"], describe(setup))
            if problems:
                raise CheckpointMismatch(
                    f"the checkpoint {self.directory} step {step} holds another model than "
                    f"this setup's ({len(problems)} difference(s)):\n  - " + "\n  - ".join(problems)
                )
            state = self._read_state(setup, step)
        except CheckpointDamaged as e:
            local_error = e
        failed = _failed_processes(local_error is None)
        if local_error is not None:
            raise local_error
        if failed:
            raise self._damaged(step, f"process(es) {failed} could not read it (their error "
                                      f"names the file)")  # fmt: skip
        saved = record.get("fingerprints")
        if saved is not None:
            here = fingerprints(state)
            changed = [path for path in saved if here.get(path) != saved[path]]
            if changed:
                raise self._damaged(
                    step, f"{_listed(changed)} differ(s) from what was saved (fingerprint "
                    f"{here.get(changed[0])} read, {saved[changed[0]]} saved): a data file "
                    f"under {os.path.join(self._folder(step), 'state')} changed after the save",
                )  # fmt: skip
        return _layer_order.mark(_stored_state(setup, state), setup.layer_order), record["extra"]

    def _read_state(self, setup: Setup, step: int) -> TrainState:
        """The state of ``step`` in the model's own shapes, laid out for ``setup``; tensorstore's
        read errors as ``CheckpointDamaged`` naming the file."""
        folder = epath.Path(self._folder(step)) / "state"
        try:
            _read_every_chunk(str(folder))
            restored = self._state_reader.restore(
                folder, args=ocp.args.StandardRestore(_abstract_state(setup))
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise self._damaged(step, _read_error(e)) from e
        return TrainState(restored["params"], restored["opt_state"])

    def close(self) -> None:
        """Wait for the save in flight, then release orbax's resources."""
        self.wait()
        self._manager.close()
        self._state_reader.close()
        self._record_reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def waited_on_error(ckpt: Checkpoints | None):
    """A training loop's block: when it ends by an error (``NonFiniteError``, Ctrl-C), close
    ``ckpt`` (None: nothing), which waits for the save in flight, so every step saved before
    the error is committed. On a normal end it does nothing: the loop goes on using ``ckpt``.

        with checkpoint.waited_on_error(ckpt):
            for step in ...:
                ...
    """
    try:
        yield
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise


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
    if setup.mesh is None or not setup.padding.converts:
        return TrainState(setup.param_specs, setup.opt_specs)
    padding, mesh = setup.padding, setup.mesh
    opt = optax.tree_map_params(
        setup.optimizer, lambda spec, shape: logical_spec(spec, shape, mesh),
        setup.opt_specs, padding.logical, is_leaf=lambda x: isinstance(x, P) or is_shape(x),
    )  # fmt: skip
    return TrainState(padding.logical_specs(setup.param_specs, mesh), opt)


def _logical_state(setup: Setup, state: TrainState) -> TrainState:
    """``state`` in the model's own shapes (the padding sliced off), laid out for saving."""
    if setup.mesh is None or not setup.padding.converts:
        return state
    shardings = _shardings(setup, _logical_specs(setup))
    return jax.jit(lambda s: setup.padding.unpad_tree(s, setup.optimizer),
                   out_shardings=shardings)(state)  # fmt: skip


def _stored_state(setup: Setup, state: TrainState) -> TrainState:
    """A restored (model-shaped) state padded to the setup's stored shapes and layout."""
    if setup.mesh is None or not setup.padding.converts:
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


# --- integrity: fingerprints of the leaves, a digest of the record, readable read errors


def fingerprints(state: TrainState) -> dict[str, str]:
    """A 64-bit fingerprint (16 hex digits) of every leaf of ``state``, keyed by its path
    (``params[0]['w']``, ``opt_state[0].mu[0]['w']``), computed on device.

    Each element's bits (widened to uint32; two words for a 64-bit type) are mixed with its
    flat index through an integer hash and the results summed mod 2^32, under each of two
    seeds: integer arithmetic, so the sums are exact, and a changed, moved or swapped element
    changes them (but for a chance of 2^-64). Each block of a leaf (one shard per replica
    group) is summed on its device by one jitted program per block shape, which any layout
    reuses; the block sums are added on the host and, in a multi-process run, over the
    processes (every process must call it), so every process and every layout of a leaf get
    the same fingerprint.
    """
    tree = {"params": state.params, "opt_state": state.opt_state}
    leaves = _leaves(tree)
    blocks = []  # (leaf, uint32[2] on a device), dispatched before any is read
    for n, (_, leaf) in enumerate(leaves):
        leaf = jnp.asarray(leaf)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        strides = np.array([int(np.prod(leaf.shape[d + 1 :], dtype=np.uint64) % 2**32)
                            for d in range(leaf.ndim)], np.uint32)  # fmt: skip
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:  # each block once over every process
                offsets = np.array([s.start or 0 for s in shard.index], np.uint32)
                blocks.append((n, _block_sums(shard.data, offsets, strides)))
    sums = np.zeros((len(leaves), len(SEEDS)), np.uint32)
    for n, block in blocks:
        sums[n] += np.asarray(block)  # mod 2^32
    if jax.process_count() > 1:  # the blocks other processes hold
        sums = np.sum(multihost_utils.process_allgather(sums), axis=0, dtype=np.uint32)
    return {f"{path[0].key}{_key(path[1:])}": f"{a:08x}{b:08x}"
            for (path, _), (a, b) in zip(leaves, sums.tolist(), strict=True)}  # fmt: skip


@jax.jit
def _block_sums(block: jax.Array, offsets: jax.Array, strides: jax.Array) -> jax.Array:
    """uint32[2]: Σ mix(word ^ mix(i·φ + seed)) mod 2^32 over the words of ``block`` for each
    seed, i the word's flat index in the whole leaf (``offsets``: the block's start in the
    leaf, ``strides``: the leaf's row-major strides in elements)."""
    words = _as_words(block)  # uint32[*block.shape, w]: w words an element
    w = words.shape[-1]
    index = lax.broadcasted_iota(jnp.uint32, words.shape, block.ndim)  # the word in its element
    for d in range(block.ndim):  # + the element's flat index in the leaf, · w (mod 2^32)
        element = lax.broadcasted_iota(jnp.uint32, words.shape, d) + offsets[d]
        index = index + element * strides[d] * jnp.uint32(w)
    return jnp.stack([
        jnp.sum(_mix(words ^ _mix(index * jnp.uint32(0x9E3779B9) + jnp.uint32(seed))),
                dtype=jnp.uint32)
        for seed in SEEDS
    ])  # fmt: skip


def _as_words(a: jax.Array) -> jax.Array:
    """The bits of every element as uint32 words, ``[*a.shape, w]``: 8- and 16-bit types
    widened to one word, 64-bit types as two, complex numbers as their parts' words."""
    if a.dtype == jnp.bool_:
        return a.astype(jnp.uint32)[..., None]
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        parts = _as_words(jnp.stack([jnp.real(a), jnp.imag(a)], axis=-1))  # [*shape, 2, w]
        return parts.reshape(*a.shape, -1)
    if a.dtype.itemsize == 8:
        return lax.bitcast_convert_type(a, jnp.uint32)  # [*shape, 2]
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    return lax.bitcast_convert_type(a, unsigned).astype(jnp.uint32)[..., None]


def _mix(x: jax.Array) -> jax.Array:
    """A bijective integer hash of uint32 (Wellons' lowbias32): every input bit moves about
    half the output bits."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _digest(record: dict) -> str:
    """A digest of the record's JSON (its own ``digest`` left out)."""
    text = json.dumps({k: v for k, v in record.items() if k != "digest"}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _failed_processes(ok: bool) -> list[int]:
    """The processes whose attempt failed, the same list on every process: a collective in a
    multi-process run (each process passes whether its own attempt succeeded)."""
    if jax.process_count() == 1:
        return [] if ok else [0]
    flags = multihost_utils.process_allgather(np.array([0 if ok else 1], np.int32))
    return [int(i) for i in np.flatnonzero(np.asarray(flags).reshape(-1))]


def _read_every_chunk(folder: str, batch: int = 64) -> None:
    """Read every stored chunk of the arrays in ``folder`` (orbax's OCDBT database) with
    tensorstore, which checks each file's presence, length and checksums; raise the first
    failure (it names the file).

    orbax reads the arrays in tasks of a fresh event loop and closes it at the first failure:
    the reads still running then call back into the closed loop ("Event loop is closed",
    printed and, under pytest, an error). Reading every chunk first, each read awaited here,
    turns a damaged file into one error before orbax reads it (the second read comes from the
    page cache). Its cost is measured in benchmarks/checkpoint_async.py.
    """
    import tensorstore as ts

    base = folder if "://" in folder else f"file://{folder}"
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"{base}/"}).result()
    keys = store.list().result()
    for first in range(0, len(keys), batch):
        reads = [store.read(key) for key in keys[first : first + batch]]
        failures = []
        for read in reads:  # every read ends before any error is raised
            try:
                read.result()
            except ValueError as e:
                failures.append(e)
        if failures:
            raise failures[0]


def _read_error(e: Exception) -> str:
    """What a read error of orbax or tensorstore says, in one line: the file it names, what is
    wrong with it, and tensorstore's status (its spec, a long JSON, left out)."""
    text = str(e).split(" [tensorstore_spec")[0].strip()
    files = [f for f in _FILE.findall(text) if not f.endswith("/")]
    if not files:
        first = text.splitlines()[0] if text else ""
        return f"cannot read its arrays ({type(e).__name__}: {first})"
    status = _STATUS.match(text)
    code = status.group(1) if status else type(e).__name__
    array = _ARRAY.search(text)
    where = f" (while reading {array.group(1)})" if array else ""
    hint = {"DATA_LOSS": "its bytes fail their checksum", "OUT_OF_RANGE": "it is cut short"}
    detail = f"{code}: {text.rsplit(': ', 1)[-1]}"
    what = ("it is missing" if not os.path.exists(files[-1])
            else f"{hint[code]} ({detail})" if code in hint else detail)  # fmt: skip
    return f"cannot read the file {files[-1]}{where}: {what}"


def _listed(paths: list[str]) -> str:
    shown = ", ".join(paths[:SHOWN])
    return shown + (f" and {len(paths) - SHOWN} more leaves" if len(paths) > SHOWN else "")
