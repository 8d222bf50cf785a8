"""Training across processes (``python -m shardops.launch``, JAX's multi-controller runtime,
gloo on loopback) computes what one process computes, and its checkpoints resume exactly.

Every multi-process run is a subprocess under a timeout (``_processes``): a dead peer or a
deadlocked collective fails the test instead of hanging the suite.
"""

import functools
import json
import math
import os
import re
import signal

import jax
import numpy as np
import pytest
from _model_checks import (
    TOL,
    batches,
    max_diff,
    optimizer,
    reference_trajectory,
    sharded_trajectory,
)
from _processes import Run, launcher, python, run, wait_for

import shardops
import shardops_models as models
from shardops_models.training.checkpoint import Checkpoints

RUNS = ["dp:8x1", "fsdp:8x1", "tp:1x8", "2d:4x2", "fsdp_tp:2x4"]
SIZES, BATCH, SCALE = (24, 32, 16), 16, 0.1  # as in tests/_distributed_worker.py


@functools.cache
def _reference():
    params = models.init_mlp(jax.random.key(0), SIZES, scale=SCALE)
    xs, ys = batches(SIZES, BATCH)
    return params, xs, ys, reference_trajectory(params, xs, ys, optimizer("sgd"))


def check_numbers(got, spec: str) -> None:
    """The multi-process run ``spec`` of the worker equals one process and the reference."""
    params, xs, ys, (ref_losses, _, ref_params) = _reference()
    tol = TOL["sgd"]
    strategy, mesh_text = spec.split(":")
    data, model = (int(v) for v in mesh_text.split("x"))
    setup = models.build(strategy, shardops.make_mesh({"data": data, "model": model}),
                         optimizer=optimizer("sgd"), sizes=SIZES)  # fmt: skip
    one_losses, _, one_params = sharded_trajectory(setup, params, xs, ys)
    mp_params = [
        {name: got[f"{spec}/[{i}]['{name}']"] for name in layer}
        for i, layer in enumerate(ref_params)
    ]
    mp_losses = got[f"{spec}/loss"]
    assert np.max(np.abs(mp_losses - ref_losses)) <= tol["loss"], spec
    assert max_diff(mp_params, ref_params) <= tol["params"], spec
    assert max_diff(mp_params, one_params) <= tol["params"], spec
    assert np.max(np.abs(mp_losses - one_losses)) <= tol["loss"], spec


@pytest.mark.parametrize("processes", [2, 4])
def test_every_strategy_across_processes_trains_like_one_process(tmp_path, processes):
    out = tmp_path / "params.npz"
    log = run(launcher(processes, "tests/_distributed_worker.py", str(out), *RUNS), tmp_path,
              "launch", timeout=240)  # fmt: skip
    got = np.load(out)
    for spec in RUNS:
        strategy, mesh_text = spec.split(":")
        data, model = (int(v) for v in mesh_text.split("x"))
        # Every process fed only its rows: those of the data indices of its devices (the
        # mesh is laid out process by process, each holding 8 / processes devices).
        per_process = 8 // processes
        for p in range(processes):
            indices = {k // model for k in range(p * per_process, (p + 1) * per_process)}
            rows = re.search(rf"\[p{p}\] process {p}: {strategy} on {mesh_text}, rows \[(\d+), "
                             rf"(\d+)\) of {BATCH}", log)  # fmt: skip
            assert rows, f"process {p} did not report {spec}:\n{log}"
            block = BATCH // data
            expected = (block * min(indices), block * (max(indices) + 1))
            assert (int(rows[1]), int(rows[2])) == expected, (spec, p, rows[0])
        check_numbers(got, spec)
    # Each process's own rows are checked for tokens outside the vocabulary (the global
    # array is not all readable by any one process).
    for p in range(processes):
        assert re.search(rf"^\[p{p}\] process {p}: refused: ids hold 1 token\(s\) outside "
                         rf"\[0, 16\) .* e\.g\. 16 at ids\[0, 1\]", log, re.M), log  # fmt: skip


def test_every_process_feeding_the_first_rows_is_caught(tmp_path):
    """Mutant: ``Setup.process_rows`` gives every process rows ``[0, n)`` (each feeds the
    batch's first block): the numbers no longer match, whatever the rows printed say. In the
    same run, ``place_local_batch`` without the check of each process's own tokens passes a
    token outside the vocabulary."""
    out = tmp_path / "params.npz"
    runs = ["2d:4x2", "fsdp_tp:2x4"]
    log = run(launcher(2, "tests/_distributed_worker.py", str(out), *runs, "--mutant",
                       "first-rows"), tmp_path, "mutant")  # fmt: skip
    assert re.search(r"^\[p1\] process 1: token 16 not refused$", log, re.M), log
    got = np.load(out)
    for spec in runs:
        with pytest.raises(AssertionError):
            check_numbers(got, spec)


def _accuracy_lines(out: str) -> list[str]:
    return re.findall(r"^(?:\[p0\] )?((?:Training|Test) set accuracy \d\.\d{4})$", out, re.M)


def test_mlp_2d_prints_the_same_accuracies_under_the_launcher(tmp_path):
    args = ["examples/mlp_2d.py", "--dataset", "sample", "--epochs", "2"]
    one = run(python(*args, "--metrics-json", str(tmp_path / "one.json")), tmp_path, "one")
    two = run(launcher(2, *args, "--metrics-json", str(tmp_path / "two.json")), tmp_path, "two")
    assert len(_accuracy_lines(one)) == 4, one
    assert _accuracy_lines(two) == _accuracy_lines(one), f"{one}\n{two}"
    assert "in 2 processes" in two
    # Process 0 alone prints the figures; process 1 prints nothing of them.
    assert not re.search(r"^\[p1\] .*accuracy", two, re.M), two
    predictions = [json.loads((tmp_path / f"{n}.json").read_text())["test_predictions"]
                   for n in ("one", "two")]  # fmt: skip
    assert predictions[0] == predictions[1]


def _restored(directory, step=None):
    """The checkpoint's state as host arrays (restored onto the ref strategy, one device)."""
    setup = models.build("ref", optimizer=models.seed_sgd(40), sizes=(784, 512, 10))
    with Checkpoints(directory) as ckpt:
        state, extra = ckpt.restore(setup, step)
        return setup.gather(state), extra, ckpt.steps()


def _steps_in(directory) -> list[int]:
    return sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())


def test_a_checkpoint_moves_through_every_layout_and_keeps_training(tmp_path):
    """2d 4×2 → fsdp_tp 2×4 (2 processes) → dp 8×1 → tp 1×8 → ref on one device, one epoch
    each, ends within the suite's tolerance of the reference trained without a stop."""
    base = ["examples/mlp_2d.py", "--dataset", "sample", "--train-size", "640", "--batch-size",
            "64", "--checkpoint-dir"]  # 10 steps per epoch  # fmt: skip
    chain = [("2d", "4x2", 1), ("fsdp_tp", "2x4", 2), ("dp", "8x1", 1), ("tp", "1x8", 1),
             ("ref", "1x1", 1)]  # fmt: skip
    moved = tmp_path / "moved"
    for epochs, (strategy, mesh, processes) in enumerate(chain, start=1):
        args = [*base, str(moved), "--strategy", strategy, "--mesh", mesh, "--epochs",
                str(epochs), "--resume"]  # fmt: skip
        out = run(python(*args) if processes == 1 else launcher(processes, *args), tmp_path,
                  f"{epochs}-{strategy}")  # fmt: skip
        if epochs > 1:
            assert f"Resume: step {10 * (epochs - 1)} " in out, out
    straight = tmp_path / "straight"
    run(python(*base, str(straight), "--strategy", "ref", "--epochs", "5"), tmp_path, "ref")
    moved_state, moved_extra, _ = _restored(moved)
    ref_state, ref_extra, _ = _restored(straight)
    assert max_diff(moved_state.params, ref_state.params) <= 1e-5
    for a, b in zip(moved_extra["history"], ref_extra["history"], strict=True):
        assert abs(a["test_accuracy"] - b["test_accuracy"]) < 1e-4, (a, b)


def test_ref_and_mismatched_meshes_under_the_launcher_are_clear_errors(tmp_path):
    ref = Run(launcher(2, "examples/mlp_2d.py", "--dataset", "sample", "--strategy", "ref"),
              tmp_path, "ref")  # fmt: skip
    small = Run(launcher(3, "examples/mlp_2d.py", "--dataset", "sample", "--mesh", "4x2",
                         devices=6), tmp_path, "small")  # fmt: skip
    try:
        assert ref.wait(120) != 0 and small.wait(120) != 0
    finally:
        ref.kill()
        small.kill()
    assert "--strategy ref runs on one device: run it without the launcher" in ref.output()
    assert ("--mesh 4x2 needs 8 devices, but the 3 processes of this run have 6 (2 each)"
            in small.output())  # fmt: skip


def test_transformer_lm_across_processes_then_resumed_on_another_layout(tmp_path):
    """The GPT example under the launcher prints the losses of one process; killed after its
    step-4 checkpoint, it resumes in one process as ``sp`` on 2×4 and ends where the
    uninterrupted run ends."""
    args = ["examples/transformer_lm.py", "--text-source", "stdlib", "--steps", "12", "--layers",
            "1", "--width", "32", "--heads", "4", "--context", "32", "--log-every", "2",
            "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "0"]  # fmt: skip
    straight = run(python(*args, "--metrics-json", str(tmp_path / "straight.json")), tmp_path,
                   "straight")  # fmt: skip
    directory = tmp_path / "ckpt"
    r = Run(launcher(2, *args, "--checkpoint-dir", str(directory), "--checkpoint-every", "4"),
            tmp_path, "launched")  # fmt: skip
    try:
        wait_for(lambda: 4 in _steps_in(directory), 180, "the step-4 checkpoint", r)
        os.kill(r.worker_pids()[1], signal.SIGKILL)
        assert r.proc.wait(60) != 0
    finally:
        r.kill()
    launched = r.out.read_text()
    assert _steps_in(directory)[-1] < 12, f"the run finished before the kill:\n{r.output()}"
    lines = re.findall(r"^step +(\d+)/12: loss (\d\.\d{4})$", straight, re.M)
    launched_lines = re.findall(r"^\[p0\] step +(\d+)/12: loss (\d\.\d{4})$", launched, re.M)
    assert len(launched_lines) >= 2 and launched_lines == lines[: len(launched_lines)], launched
    resumed = run(python(*args, "--strategy", "sp", "--mesh", "2x4", "--checkpoint-dir",
                         str(directory), "--resume", "--metrics-json", str(tmp_path / "resumed.json")),
                  tmp_path, "resumed")  # fmt: skip
    assert re.search(r"Resume: step \d+ from .* saved by fsdp_tp on \{'data': 4, 'model': 2\}",
                     resumed), resumed  # fmt: skip
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("straight", "resumed"))
    assert len(b["losses"]) == 12
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=1e-5)
    assert abs(b["final_valid_loss"] - a["final_valid_loss"]) <= 1e-5 * a["final_valid_loss"]


def test_resuming_with_another_data_order_is_refused(tmp_path):
    base = ["examples/mlp_2d.py", "--dataset", "sample", "--train-size", "640", "--batch-size",
            "64", "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    run(python(*base, "--epochs", "1"), tmp_path, "first")
    r = Run(python(*base, "--epochs", "2", "--seed", "1", "--resume"), tmp_path, "second")
    try:
        assert r.wait(120) != 0
    finally:
        r.kill()
    assert ("--resume: the checkpoint in " in r.output()
            and "was trained with seed = 0, this run has 1" in r.output()), r.output()  # fmt: skip


def test_in_one_process_a_local_batch_is_the_global_batch():
    setup = models.build("2d", shardops.make_mesh({"data": 4, "model": 2}),
                         optimizer=optimizer("sgd"), sizes=SIZES)  # fmt: skip
    xs, ys = batches(SIZES, BATCH)
    assert setup.process_rows(BATCH) == slice(0, BATCH)
    local = setup.place_local_batch(xs[0], ys[0], batch=BATCH)
    for a, b in zip(local, setup.place_batch(xs[0], ys[0]), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"x has 8 rows; process 0 feeds rows \[0, 16\)"):
        setup.place_local_batch(xs[0][:8], ys[0][:8], batch=BATCH)


# --- the multi-process pages' scripts and commands, which the docs' tests do not run


def check_train_py(out: str) -> None:
    """The multi-process page's ``train.py`` (a no-run block there), run by test_doc_commands on
    two "hosts" as the page shows it: ``import shardops`` reaches ``shardops.distributed``,
    process 0 alone prints its 100 finite losses, and no step hangs (each process waits for its
    loss: without that, 2 runs of 3 hung here)."""
    steps = re.findall(r"^\[p0\] (\d+) (\S+)$", out, re.M)
    assert [int(step) for step, _ in steps] == list(range(100)), out
    assert all(math.isfinite(float(loss)) for _, loss in steps), out
    assert not re.search(r"^\[p1\] \d+ ", out, re.M), out


def test_every_module_the_package_doc_names_is_reachable_after_import_shardops():
    """``shardops``'s docstring names ``shardops.distributed``, ``.preemption``, ``.watchdog``
    …: each is imported by the package (in ``__all__``, which ruff checks is bound), so
    ``import shardops`` reaches it. ``shardops.launch`` is a command (``python -m``): importing
    it with the package would make runpy warn."""
    named = set(re.findall(r"``shardops\.([a-z_]+)``", shardops.__doc__)) - {"launch"}
    assert {"distributed", "preemption", "watchdog", "comm", "inspect"} <= named, named
    assert named <= set(shardops.__all__), named - set(shardops.__all__)
