"""Damaged checkpoints are never restored silently wrong: a truncated or missing array file, a
garbled, removed or edited record, a step folder another tool half wrote, and bytes changed
inside an array file that tensorstore reads without error (the fingerprints) each raise
``CheckpointDamaged`` naming the step, the file or leaf, and the steps left; and
``restore_latest_intact`` falls back to the newest intact step, saying so.
"""

import atexit
import functools
import json
import os
import pathlib
import re
import shutil
import tempfile

import jax
import numpy as np
import optax
import pytest
from jax._src.sharding_impls import GSPMDSharding
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models
from shardops_models.training import _checkpoint_integrity, checkpoint
from shardops_models.training.checkpoint import CheckpointDamaged, CheckpointMismatch, Checkpoints

STEPS = (2, 4, 6)


@functools.cache
def saved_setup():
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    return models.build("2d", mesh, optimizer=optax.adam(1e-3), sizes=(16, 64, 8))


def state_of(step: int) -> models.TrainState:
    """Step ``step``'s host state: drawn leaves, and ``params[0]['w']`` of random bits (zstd
    cannot compress them, so they lie verbatim in an array file)."""
    setup = saved_setup()
    rng = np.random.default_rng(step)
    params = setup.model.init(jax.random.key(step))
    params[0]["w"] = rng.integers(0, 2**32, params[0]["w"].shape, np.uint32).view(np.float32)
    opt_state = jax.tree.map(
        lambda a: rng.integers(1, 99, a.shape).astype(a.dtype), setup.optimizer.init(params)
    )
    return jax.device_get(models.TrainState(params, opt_state))


@functools.cache
def pristine_folder() -> pathlib.Path:
    """A checkpoint folder with steps 2, 4 and 6, made once per process and never written to:
    each test damages a copy (the mutants of test_checkpoint.py too)."""
    setup = saved_setup()
    directory = pathlib.Path(tempfile.mkdtemp(prefix="shardops-pristine-")) / "ckpt"
    atexit.register(shutil.rmtree, directory.parent, ignore_errors=True)
    with Checkpoints(directory) as ckpt:
        for step in STEPS:
            ckpt.save(step, setup, place(setup, state_of(step)), extra={"step": step})
    return directory


@pytest.fixture
def pristine():
    return pristine_folder()


def place(setup, state):
    return models.TrainState(
        models.shard_tree(state.params, setup.mesh, setup.param_specs),
        models.shard_tree(state.opt_state, setup.mesh, setup.opt_specs),
    )


def copy_of(pristine, tmp_path) -> str:
    directory = tmp_path / "ckpt"
    shutil.copytree(pristine, directory)
    return str(directory)


def array_files(directory: str, step: int) -> list[str]:
    """The files holding step ``step``'s arrays (orbax's OCDBT data files), largest first."""
    folder = os.path.join(directory, str(step), "state", "d")
    return sorted((os.path.join(folder, n) for n in os.listdir(folder)), key=os.path.getsize,
                  reverse=True)  # fmt: skip


def damage(directory: str, step: int, message_part: str, module=checkpoint) -> str:
    """Restore ``step``: ``CheckpointDamaged`` whose message holds ``message_part`` and names
    the step, the directory and the steps left. Returns the message."""
    with module.Checkpoints(directory) as ckpt:
        try:
            ckpt.restore(saved_setup(), step)
        except module.CheckpointDamaged as e:
            error = e
        except Exception as e:  # a mutant's error: fail, naming it
            pytest.fail(f"step {step} raised {type(e).__name__}, not CheckpointDamaged: {e}")
        else:
            pytest.fail(f"the damaged step {step} restored")
    text = str(error)
    assert text.startswith(f"checkpoint step {step} in {directory} is damaged: "), text
    assert message_part in text, text
    others = [s for s in STEPS if s != step]
    assert f"steps {others} are in {directory}" in text, text
    assert f"or delete the folder {os.path.join(directory, str(step))}." in text, text
    assert (error.step, error.directory) == (step, directory)
    return text


def assert_restores(ckpt, step: int) -> None:
    setup = saved_setup()
    state, extra = ckpt.restore(setup, step)
    assert extra == {"step": step}
    for a, b in zip(jax.tree.leaves(setup.gather(state)), jax.tree.leaves(state_of(step)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)


# --- each kind of damage: the error names the step, the file or leaf, what is wrong, the fix


def check_a_truncated_array_file_is_damaged(tmp_path, module=checkpoint, pristine=None) -> str:
    directory = copy_of(pristine, tmp_path)
    file = array_files(directory, 6)[0]
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    return damage(directory, 6, f"cannot read the file {file}", module)


def test_a_truncated_array_file_is_damaged_naming_the_file(pristine, tmp_path):
    text = check_a_truncated_array_file_is_damaged(tmp_path, pristine=pristine)
    directory = str(tmp_path / "ckpt")
    assert re.search(r": it is cut short \(OUT_OF_RANGE: .*is not valid for value of size \d+\)\. ",
                     text), text  # fmt: skip
    with Checkpoints(directory) as ckpt, pytest.raises(CheckpointDamaged) as e:
        ckpt.restore(saved_setup())
    assert isinstance(e.value.__cause__, ValueError)  # tensorstore's own error
    assert "tensorstore_spec" not in str(e.value)
    with Checkpoints(directory) as ckpt:
        assert_restores(ckpt, 4)


def test_a_missing_array_file_is_damaged_naming_the_file(pristine, tmp_path):
    directory = copy_of(pristine, tmp_path)
    file = array_files(directory, 4)[0]
    os.remove(file)
    damage(directory, 4, f"cannot read the file {file}")
    damage(directory, 4, ": it is missing. Restore another step: steps [2, 6] are in ")


def check_an_edited_record_is_damaged(tmp_path, module=checkpoint, pristine=None) -> None:
    """A record edited into other valid JSON (the data position in ``extra``) is damaged."""
    directory = copy_of(pristine, tmp_path)
    path = os.path.join(directory, "6", "record", "metadata")
    with open(path) as f:
        record = json.load(f)
    record["extra"]["step"] = 5
    with open(path, "w") as f:
        json.dump(record, f)
    damage(directory, 6, f"its record {path} changed after the save (its digest does not "
                         f"match)", module)  # fmt: skip


def test_a_garbled_removed_or_edited_record_is_damaged(pristine, tmp_path):
    directory = copy_of(pristine, tmp_path / "garbled")
    path = os.path.join(directory, "6", "record", "metadata")
    with open(path, "r+") as f:
        f.truncate(40)
    damage(directory, 6, f"its record {path} is unreadable (JSONDecodeError: Unterminated string")
    with Checkpoints(directory) as ckpt, pytest.raises(CheckpointDamaged, match="unreadable"):
        ckpt.record(6)
    os.remove(path)
    damage(directory, 6, f"the folder {os.path.join(directory, '6')} is not a whole checkpoint: "
                         f"it lacks record/metadata (orbax writes them all")  # fmt: skip
    check_an_edited_record_is_damaged(tmp_path / "edited", pristine=pristine)


def test_a_step_folder_half_written_by_another_tool_is_listed_and_damaged(pristine, tmp_path):
    """``steps`` lists what orbax lists (an empty ``8/`` too); restoring it names what it
    lacks; a folder without orbax's commit metadata alone is damaged as well."""
    directory = copy_of(pristine, tmp_path)
    os.makedirs(os.path.join(directory, "8"))
    with Checkpoints(directory) as ckpt:
        assert ckpt.steps() == [2, 4, 6, 8] and ckpt.latest_step() == 8
        with pytest.raises(CheckpointDamaged) as e:
            ckpt.restore(saved_setup())
    folder = os.path.join(directory, "8")
    assert str(e.value) == (
        f"checkpoint step 8 in {directory} is damaged: the folder {folder} is not a whole "
        f"checkpoint: it lacks _CHECKPOINT_METADATA, record/metadata, state/_METADATA (orbax "
        f"writes them all before the commit; another tool wrote it, or a copy of it was cut "
        f"short). Restore an earlier step: steps [2, 4, 6] are in {directory} "
        f"(restore_latest_intact takes the newest intact one), or delete the folder {folder}."
    )
    shutil.rmtree(folder)
    os.remove(os.path.join(directory, "6", "_CHECKPOINT_METADATA"))
    damage(directory, 6, "it lacks _CHECKPOINT_METADATA (orbax writes them all")


def check_a_step_folder_of_another_step_is_damaged(tmp_path, module=checkpoint,
                                                   pristine=None) -> None:  # fmt: skip
    """Step 6's folder renamed to 8, and step 4's copied to 5: each record names the step it
    belongs to, so restoring 8 or 5 is damaged (not step 6's or 4's state resumed as 8 or 5),
    naming both steps and the fix, and ``restore_latest_intact`` passes over 8 to 5, then 4."""
    directory = copy_of(pristine, tmp_path)
    os.rename(os.path.join(directory, "6"), os.path.join(directory, "8"))
    shutil.copytree(os.path.join(directory, "4"), os.path.join(directory, "5"))
    for step, of in ((8, 6), (5, 4)):
        with module.Checkpoints(directory) as ckpt, pytest.raises(module.CheckpointDamaged) as e:
            ckpt.restore(saved_setup(), step)
        record = os.path.join(directory, str(step), "record", "metadata")
        others = [s for s in (2, 4, 5, 8) if s != step]
        assert str(e.value) == (
            f"checkpoint step {step} in {directory} is damaged: its record {record} is step "
            f"{of}'s: the folder was renamed or copied from step {of} (restoring it as step "
            f"{step} would resume at the wrong step). Restore {'an earlier' if step == 8 else 'another'} "
            f"step: steps {others} are in {directory} (restore_latest_intact takes the newest "
            f"intact one), or delete the folder {os.path.join(directory, str(step))}."
        ), str(e.value)
        assert (e.value.step, e.value.directory) == (step, directory)
    lines = []
    with module.Checkpoints(directory) as ckpt:
        _, extra, step = ckpt.restore_latest_intact(saved_setup(), log=lines.append)
    assert (step, extra) == (4, {"step": 4}), (step, extra)
    assert [line.split(" is damaged (its record ")[0] for line in lines] == [
        f"Checkpoint step 8 in {directory}",
        f"Checkpoint step 5 in {directory}",
    ], lines


def test_a_step_folder_renamed_or_copied_from_another_step_is_damaged(pristine, tmp_path):
    check_a_step_folder_of_another_step_is_damaged(tmp_path, pristine=pristine)


def flip_a_bit_of_the_random_leaf(directory: str, step: int) -> str:
    """Flip one bit of ``params[0]['w'][0, 0]`` in its array file (found by its bytes, which
    zstd left verbatim); the file."""
    needle = state_of(step).params[0]["w"][0, :4].tobytes()
    for file in array_files(directory, step):
        with open(file, "rb") as f:
            data = bytearray(f.read())
        at = data.find(needle)
        if at >= 0:
            data[at + 1] ^= 0x10
            with open(file, "wb") as f:
                f.write(data)
            return file
    raise AssertionError(f"the bytes of params[0]['w'] are in no array file of step {step}")


def test_a_bit_flipped_inside_an_array_file_fails_its_checksum(pristine, tmp_path):
    """orbax's OCDBT files carry checksums: a flipped bit is a read error, named."""
    directory = copy_of(pristine, tmp_path)
    file = flip_a_bit_of_the_random_leaf(directory, 6)
    damage(directory, 6, f"cannot read the file {file}")
    damage(directory, 6, ": its bytes fail their checksum (DATA_LOSS: expected=")


def change_a_value_through_tensorstore(directory: str, step: int) -> None:
    """Flip one bit of ``params[0]['w'][0, 0]`` by writing it through tensorstore, which
    writes a new array file and checksums of its own: the checkpoint reads without error and
    holds another value (what a value changed before it reached the disk leaves, e.g. by a
    write that read the state while the next step overwrote it)."""
    import tensorstore as ts

    folder = os.path.join(directory, str(step), "state")
    leaf = ts.open({"driver": "zarr", "path": "params.0.w",
                    "kvstore": {"driver": "ocdbt", "base": f"file://{folder}/"}}).result()  # fmt: skip
    value = np.asarray(leaf[0, 0].read().result())
    leaf[0, 0].write((value.view(np.uint32) ^ np.uint32(0x10)).view(np.float32)).result()


def check_changed_values_are_caught(tmp_path, module=checkpoint, pristine=None) -> None:
    directory = copy_of(pristine, tmp_path)
    change_a_value_through_tensorstore(directory, 6)
    state_dir = os.path.join(directory, "6", "state")
    text = damage(directory, 6, "params[0]['w'] differ(s) from what was saved (fingerprint ",
                  module)  # fmt: skip
    assert f"saved): a data file under {state_dir} changed after the save" in text, text
    assert "opt_state" not in text.split(". Restore")[0], text  # that leaf alone


def test_values_that_read_without_error_but_changed_are_caught_by_the_fingerprint(
    pristine, tmp_path
):
    check_changed_values_are_caught(tmp_path, pristine=pristine)


def test_a_checkpoint_of_record_format_1_restores_without_the_check(pristine, tmp_path):
    """Checkpoints saved before the fingerprints (no digest, no fingerprints) still restore."""
    directory = copy_of(pristine, tmp_path)
    path = os.path.join(directory, "4", "record", "metadata")
    with open(path) as f:
        record = json.load(f)
    record = {k: v for k, v in record.items() if k not in ("digest", "fingerprints")}
    with open(path, "w") as f:
        json.dump({**record, "format": 1}, f)
    with Checkpoints(directory) as ckpt:
        assert_restores(ckpt, 4)


# --- falling back to the newest intact step


def check_fallback_newest_first(tmp_path, module=checkpoint, pristine=None) -> None:
    """Step 6 damaged: ``restore_latest_intact`` logs one line and restores step 4 (not 2)."""
    directory = copy_of(pristine, tmp_path)
    os.remove(array_files(directory, 6)[0])
    lines = []
    with module.Checkpoints(directory) as ckpt:
        state, extra, step = ckpt.restore_latest_intact(saved_setup(), log=lines.append)
    assert (step, extra) == (4, {"step": 4}), step
    assert len(lines) == 1 and lines[0].startswith(
        f"Checkpoint step 6 in {directory} is damaged (cannot read the file "
    ), lines
    assert lines[0].endswith("; falling back to step 4"), lines
    for a, b in zip(jax.tree.leaves(saved_setup().gather(state)), jax.tree.leaves(state_of(4)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)


def test_restore_latest_intact_falls_back_to_the_newest_intact_step(pristine, tmp_path):
    check_fallback_newest_first(tmp_path, pristine=pristine)


def test_restore_latest_intact_with_no_intact_step_lists_every_reason(pristine, tmp_path):
    directory = copy_of(pristine, tmp_path)
    os.remove(array_files(directory, 6)[0])
    change_a_value_through_tensorstore(directory, 4)
    with open(os.path.join(directory, "2", "record", "metadata"), "w") as f:
        f.write("{")
    lines = []
    with Checkpoints(directory) as ckpt, pytest.raises(CheckpointDamaged) as e:
        ckpt.restore_latest_intact(saved_setup(), log=lines.append)
    assert [line.split(" is damaged")[0] for line in lines] == [
        f"Checkpoint step 6 in {directory}",
        f"Checkpoint step 4 in {directory}",
    ]
    text = str(e.value)
    assert text.startswith(f"no intact checkpoint in {directory}: every step is damaged:\n"
                           f"  - step 2: its record "), text  # fmt: skip
    assert "\n  - step 4: params[0]['w'] differ(s) from what was saved" in text, text
    assert "\n  - step 6: cannot read the file " in text, text
    assert text.endswith("Restore the step folders from a copy, or delete them and start the "
                         "run afresh."), text  # fmt: skip
    (tmp_path / "none").mkdir()
    with (
        Checkpoints(tmp_path / "none") as ckpt,
        pytest.raises(
            FileNotFoundError, match=f"no checkpoint in {tmp_path / 'none'}: the folder holds no "
        ),
    ):
        ckpt.restore_latest_intact(saved_setup())


def test_another_model_is_refused_not_passed_over(pristine, tmp_path):
    """``CheckpointMismatch`` is no damage: the fallback raises it at the newest step."""
    directory = copy_of(pristine, tmp_path)
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    other = models.build("2d", mesh, optimizer=optax.adam(1e-3), sizes=(16, 32, 8))
    lines = []
    with Checkpoints(directory) as ckpt, pytest.raises(CheckpointMismatch, match="step 6 holds"):
        ckpt.restore_latest_intact(other, log=lines.append)
    assert lines == []


def check_a_step_another_process_failed_is_damaged_here(tmp_path, module=checkpoint,
                                                        pristine=None):  # fmt: skip
    """Two processes, process 1 failing to read step 6 (a shard only it reads): process 0,
    which read it, passes it over too (the agreement of ``_failed_processes``)."""
    directory = copy_of(pristine, tmp_path)
    attempts = []

    def failed_processes(ok: bool) -> list[int]:
        attempts.append(ok)
        return ([] if ok else [0]) + ([1] if len(attempts) == 1 else [])  # step 6 only

    lines = []
    with pytest.MonkeyPatch.context() as patch, module.Checkpoints(directory) as ckpt:
        patch.setattr(module, "_failed_processes", failed_processes)
        _, _, step = ckpt.restore_latest_intact(saved_setup(), log=lines.append)
    assert step == 4 and attempts == [True, True], (step, attempts)
    assert lines == [f"Checkpoint step 6 in {directory} is damaged (process(es) [1] could not "
                     f"read it (their error names the file)); falling back to step 4"]  # fmt: skip


def test_a_step_another_process_could_not_read_is_passed_over_here_too(pristine, tmp_path):
    check_a_step_another_process_failed_is_damaged_here(tmp_path, pristine=pristine)


# --- the fingerprints: exact, the same on every layout, changed by any element


def numpy_fingerprint(x: np.ndarray) -> str:
    """The fingerprint's definition on the host: Σ_i mix(word_i ^ mix(i·φ + seed)) mod 2^32."""

    def mix(v):
        v = v ^ (v >> np.uint32(16))
        v = v * np.uint32(0x7FEB352D)
        v = v ^ (v >> np.uint32(15))
        v = v * np.uint32(0x846CA68B)
        return v ^ (v >> np.uint32(16))

    x = np.asarray(x)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    words = (x.astype(np.uint32) if x.dtype == bool else x.view(unsigned)).astype(np.uint32)
    words = words.reshape(-1)
    index = np.arange(words.size, dtype=np.uint32)
    with np.errstate(over="ignore"):
        sums = [np.sum(mix(words ^ mix(index * np.uint32(0x9E3779B9) + np.uint32(seed))),
                       dtype=np.uint32) for seed in _checkpoint_integrity.SEEDS]  # fmt: skip
    return "".join(f"{int(s):08x}" for s in sums)


def check_fingerprints_on_every_layout(module=checkpoint) -> None:
    """A leaf of each dtype on one device and in 6 layouts of a 4×2 mesh (replicated ones, one
    dimension split over both axes, and a split by XLA's own sharding included): the numpy
    definition's fingerprint each time; one element changed, or two swapped, changes it."""
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    rng = np.random.default_rng(0)
    for dtype in (np.float32, jax.numpy.bfloat16, np.int32, np.int8, np.bool_):
        x = (rng.normal(size=(8, 4)) * 10).astype(dtype)
        want = numpy_fingerprint(x)
        leaves = [jax.device_put(x)] + [
            jax.device_put(x, NamedSharding(mesh, spec))
            for spec in (
                P(),
                P("data"),
                P("data", "model"),
                P("model", "data"),
                P(("model", "data")),
            )
        ]
        # Split by a sharding of another kind (XLA's own, as some compiled outputs carry).
        named = NamedSharding(mesh, P("model", "data"))
        gspmd = GSPMDSharding(tuple(mesh.devices.flat), named._to_xla_hlo_sharding(2))
        leaves.append(jax.device_put(x, gspmd))
        for leaf in leaves:
            got = module.fingerprints(models.TrainState({"x": leaf}, ()))
            assert got == {"params['x']": want}, (dtype, leaf.sharding, got, want)
        changed, swapped = np.array(x), np.array(x)
        changed[3, 1] = np.logical_not(x[3, 1]) if dtype == np.bool_ else x[3, 1] + 1
        swapped[0, 0], swapped[5, 2] = x[5, 2], x[0, 0]
        for other in (changed, swapped):
            if not np.array_equal(other, x):
                assert numpy_fingerprint(other) != want
                got = module.fingerprints(models.TrainState({"x": leaves[3]}, ()))
                sharded = jax.device_put(other, leaves[3].sharding)
                assert module.fingerprints(models.TrainState({"x": sharded}, ())) != got


def test_fingerprints_are_exact_on_every_layout_and_change_with_any_element():
    check_fingerprints_on_every_layout()
