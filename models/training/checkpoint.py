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
import json
import os

import jax
import optax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from shardops_models.strategies.plan import is_shape
from shardops_models.training import _layer_order
from shardops_models.training._checkpoint_integrity import (
    _digest,
    _failed_processes,
    _listed,
    _read_error,
    _read_every_chunk,
    fingerprints,
)
from shardops_models.training._checkpoint_record import (
    _param_shapes,
    describe,
    differences,
)
from shardops_models.training._placement import logical_spec
from shardops_models.training._setup import Setup
from shardops_models.training._state import TrainState

__all__ = [
    "CheckpointDamaged",
    "CheckpointMismatch",
    "Checkpoints",
    "describe",
    "differences",
    "fingerprints",
    "waited_on_error",
]

FORMAT = 2  # 2: fingerprints of the leaves and a digest of the record
KEEP = 3
# What orbax writes into every step folder: its commit metadata and one folder per item (the
# state's tree metadata inside ``state``, the JSON inside ``record``).
STEP_ITEMS = ("_CHECKPOINT_METADATA", "record/metadata", "state/_METADATA")


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
