"""Runs that survive: a preemption notice saves at the next step and resumes bit-identically
(``shardops.preemption``), a kill resumes from the last checkpoint, and a stuck process stops
every process with its name (``shardops.watchdog``).

The runs are examples/mlp_2d.py (and tests/_stall_worker.py for a stall) in subprocesses under a
timeout (``_processes``). One uninterrupted run per process count is shared by the tests that
resume: it is also the watchdog's false-alarm check (120 steps, a 5 s timeout, a checkpoint
every 5 steps).
"""

import os
import re
import signal
import threading
import time

import jax
import numpy as np
import pytest
from _cover import FULL
from _mutants import mutant
from _processes import Run, launcher, python, run, wait_for

import shardops_models as models
from shardops import launch, preemption, watchdog
from shardops_models.training.checkpoint import Checkpoints

STEPS = 120  # 3 epochs of 40 (CI time: 5 before, the same checks)
MLP_ARGS = ["examples/mlp_2d.py", "--dataset", "sample", "--train-size", "2560", "--batch-size",
            "64", "--epochs", "3", "--checkpoint-every", "5"]  # fmt: skip
WATCHDOG_TIMEOUT_S = 5
STOPPED_WITHIN_S = WATCHDOG_TIMEOUT_S + 10  # the bound for a stuck run


def command(processes: int, directory, *extra) -> list[str]:
    """mlp_2d under the launcher, ``processes`` sharing 8 devices."""
    return launcher(processes, *MLP_ARGS, "--checkpoint-dir", str(directory), *extra)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """``get(processes)``: the checkpoint folder of a run never stopped (made once)."""
    made = {}

    def get(processes: int):
        if processes not in made:
            workdir = tmp_path_factory.mktemp(f"straight-{processes}")
            out = run(command(processes, workdir / "ckpt", "--watchdog-timeout",
                              str(WATCHDOG_TIMEOUT_S)), workdir, "straight")  # fmt: skip
            # No false alarm over 120 steps and 24 checkpoint saves.
            last = f"Checkpoints: steps [{STEPS - 10}, {STEPS - 5}, {STEPS}]"
            assert "watchdog" not in out and last in out, out
            made[processes] = workdir / "ckpt"
        return made[processes]

    return get


def restored(directory):
    """The latest checkpoint's state (host arrays, restored onto ``ref``), extra and steps."""
    setup = models.build("ref", optimizer=models.seed_sgd(40), sizes=(784, 512, 10))
    with Checkpoints(directory) as ckpt:
        state, extra = ckpt.restore(setup)
        return setup.gather(state), extra, ckpt.steps()


def steps_in(directory) -> list[int]:
    return sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())


def check_resumed_like_straight(straight_dir, resumed_dir) -> None:
    """Params, optimizer state and metric history end as the run never stopped ends."""
    straight_state, straight_extra, _ = restored(straight_dir)
    resumed_state, resumed_extra, steps = restored(resumed_dir)
    assert steps[-1] == STEPS
    for a, b in zip(jax.tree.leaves(straight_state), jax.tree.leaves(resumed_state), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(straight_extra["history"], resumed_extra["history"], strict=True):
        # Everything but the time and steps of the epoch the resumed run trained only in part.
        assert {k: v for k, v in a.items() if k not in ("seconds", "steps")} == {
            k: v for k, v in b.items() if k not in ("seconds", "steps")
        }
    assert len(straight_extra["history"]) == len(resumed_extra["history"])


# CI time: 2 processes by default (one process's preemption save is also the transformer_lm
# example's test); both under SHARDOPS_FULL=1
@pytest.mark.parametrize("processes", [1, 2] if FULL else [2])
def test_sigterm_saves_at_the_next_step_exits_in_the_grace_and_resumes_bit_identically(
    tmp_path, straight, processes
):
    """SIGTERM to the launcher once epoch 0 has ended: every process saves the same step
    boundary (JAX's preemption sync point), exits 143 within the launcher's grace, and
    ``--resume`` ends bit-identical to the run never stopped."""
    directory = tmp_path / "ckpt"
    r = Run(command(processes, directory), tmp_path, "preempted")
    try:
        wait_for(lambda: "Epoch 0 in" in r.out.read_text(), 120, "epoch 0", r)
        saved_before = steps_in(directory)
        sent = time.monotonic()
        r.proc.send_signal(signal.SIGTERM)
        code = r.proc.wait(launch.DEFAULT_GRACE_S + 10)
        took = time.monotonic() - sent
    finally:
        r.kill()
    out = r.out.read_text()
    assert code == preemption.EXIT_CODE, r.output()
    assert took < launch.DEFAULT_GRACE_S, f"exited {took:.1f} s after SIGTERM:\n{r.output()}"
    print(f"{processes} process(es): SIGTERM → launcher exit in {took:.2f} s")
    found = re.search(r"Preempted at step (\d+) \(epoch \d+, batch \d+\): saved it in ", out)
    assert found, r.output()
    at = int(found[1])
    # The step saved is a boundary after the notice: after what was saved before it, before
    # the end; every process saved the same one (one step folder, committed).
    assert steps_in(directory)[-1] == at and saved_before and saved_before[-1] <= at < STEPS, (
        saved_before, at, r.output())  # fmt: skip
    resumed = run(command(processes, directory, "--resume"), tmp_path, "resumed")
    assert re.search(rf"Resume: step {at} ", resumed), resumed
    check_resumed_like_straight(straight(processes), directory)


@pytest.mark.parametrize("processes", [2])
def test_a_run_killed_mid_training_resumes_bit_identically(tmp_path, straight, processes):
    """SIGKILL to the last process once a checkpoint of step ≥ 10 exists; ``--resume`` ends
    where a run never stopped ends, bit for bit (params, optimizer state and history). One
    process resuming is the preemption test's."""
    killed = tmp_path / "killed"
    r = Run(command(processes, killed), tmp_path, "killed")
    try:
        wait_for(lambda: any(s >= 10 for s in steps_in(killed)), 120, "checkpoint ≥ 10", r)
        victim = r.worker_pids()[processes - 1]
        os.kill(victim, signal.SIGKILL)
        code = r.proc.wait(60)
    finally:
        r.kill()
    assert code != 0, r.output()
    interrupted_at = steps_in(killed)[-1]
    assert interrupted_at < STEPS, f"the run finished before the kill:\n{r.output()}"
    resumed = run(command(processes, killed, "--resume"), tmp_path, "resumed")
    assert re.search(rf"Resume: step {interrupted_at} ", resumed), resumed
    check_resumed_like_straight(straight(processes), killed)


@pytest.mark.parametrize("processes", [2, 4])
def test_a_process_stuck_in_python_stops_every_process_naming_it(tmp_path, processes):
    """One process sleeps between steps 20 and 21 (alive: its heartbeats arrive). Every process
    prints the same verdict naming it and the step, and exits 124, within the timeout + 10 s
    (the launcher's failure grace is 30 s: the processes end themselves)."""
    stalled = processes - 1
    args = ["-m", "shardops.launch", "-n", str(processes), "--failure-grace", "30", "--",
            "tests/_stall_worker.py", str(stalled), "20", str(WATCHDOG_TIMEOUT_S)]  # fmt: skip
    r = Run(python(*args), tmp_path, "stall")
    try:
        wait_for(lambda: "stalling at step 20" in r.out.read_text(), 120, "the stall", r)
        stalled_at = time.monotonic()
        code = r.proc.wait(STOPPED_WITHIN_S + 30)
        took = time.monotonic() - stalled_at
    finally:
        r.kill()
    out = r.out.read_text()
    print(f"{processes} processes: stall → every process out in {took:.1f} s")
    assert code == watchdog.EXIT_CODE, r.output()
    assert took < STOPPED_WITHIN_S, f"stopped {took:.1f} s after the stall:\n{r.output()}"
    verdict = (f"shardops.watchdog: process {stalled} is stuck: it has done 20 steps and has not "
               f"reached step 21 within {WATCHDOG_TIMEOUT_S} s")  # fmt: skip
    for k in range(processes):
        assert f"[p{k}] {verdict}" in out, f"process {k} did not say it:\n{r.output()}"
        # The coordination store (shardops._coordination) holds every process's key. Looked
        # for in the process's lines, not at their start: Gloo's C++ log line can be written
        # around it ("[p1] [Gloo] Rank 1 is connected to store [...]1 peer ranks. ...").
        keys = ", ".join(f"('test/{j}', 'value of {j}')" for j in range(processes))
        mine = [line for line in out.splitlines() if line.startswith(f"[p{k}] ")]
        assert any(f"store [{keys}]" in line for line in mine), r.output()
    assert "trained to the end" not in out and "SetError" not in out, r.output()


def test_a_resumed_run_noticed_before_its_loop_stops_at_its_second_boundary(tmp_path):
    """SIGTERM reaches process 0 of 2 before either asks ``reached`` (JAX then takes 0 for
    both): a run whose first boundary is 40 stops at 41 on both processes, not never."""
    out = run(launcher(2, "tests/_preemption_worker.py", "40"), tmp_path, "early", timeout=120)
    assert "[p0] stops at boundary 41" in out and "[p1] stops at boundary 41" in out, out


# --- the watchdog's rule, without processes


def test_a_lag_is_stuck_only_after_the_timeout_and_a_caught_up_lag_is_forgotten():
    since: dict = {}
    find = watchdog.find_stuck
    assert find({0: 5, 1: 5}, since, 0.0, 3.0) is None and since == {}
    assert find({0: 6, 1: 5}, since, 1.0, 3.0) is None  # process 1 lags from t = 1
    assert since == {(1, 5): 1.0}
    assert find({0: 7, 1: 5}, since, 3.9, 3.0) is None  # 2.9 s: not yet
    stuck = find({0: 7, 1: 5}, since, 4.0, 3.0)
    assert stuck == watchdog.Stuck(process=1, step=5, ahead=0, passed=7, seconds=3.0)
    # Process 1 catches up to 6 while 0 is at 8: a new lag, timed from now.
    assert find({0: 8, 1: 6}, since, 4.5, 3.0) is None and since == {(1, 6): 4.5}
    assert find({0: 8, 1: 8}, since, 9.0, 3.0) is None and since == {}


def test_the_process_furthest_behind_is_named_and_one_that_never_reported_counts():
    """The others behind may only wait for it in a collective, a step or two ahead: process 1
    (at 21, waiting) is not named while process 3 (at 20, stalled) lags longer."""
    since: dict = {}
    find = watchdog.find_stuck
    assert find({0: 22, 1: 21, 2: 22, 3: 20}, since, 0.0, 1.0) is None
    stuck = find({0: 22, 1: 21, 2: 22, 3: 20}, since, 1.0, 1.0)  # both lag 1 s
    assert (stuck.process, stuck.step, stuck.ahead, stuck.passed) == (3, 20, 0, 22)
    assert stuck.message(1.0).startswith(
        "shardops.watchdog: process 3 is stuck: it has done 20 steps and has not reached step "
        "21 within 1 s of process 0 passing it (process 0 has done 22 steps)"
    )
    since = {}
    reported = {0: 4, 1: 9, 2: None, 3: 2}
    assert find(reported, since, 0.0, 1.0) is None
    stuck = find(reported, since, 1.0, 1.0)
    assert (stuck.process, stuck.step, stuck.ahead) == (2, None, 1)
    assert "process 2 is stuck: it has not reported its first step" in stuck.message(1.0)
    assert find({0: None, 1: None}, {}, 5.0, 1.0) is None  # nobody started: no lag


def test_one_process_has_no_watchdog_and_bad_timeouts_are_refused():
    with watchdog.Watchdog(1.0) as w:
        assert not w.active
        w.step(3)  # costs nothing
    assert not watchdog.Watchdog(None).active
    for bad in (0, -1, float("nan"), "5", True):
        with pytest.raises(ValueError, match="timeout_s must be a number of seconds > 0"):
            watchdog.Watchdog(bad)
    with pytest.raises(TypeError, match=r"step must be an int ≥ 0; got -1"):
        watchdog.Watchdog(None).step(-1)


def test_one_process_takes_sigterm_as_a_notice_and_a_second_one_acts_at_once():
    """Without jax.distributed, ``Preemption`` installs its own SIGTERM handler: the notice
    makes ``reached`` True, and puts back the previous handler for a second SIGTERM."""
    got = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: got.append(sig))
    try:
        with preemption.Preemption() as p:
            assert not p.reached(0) and not p.noticed
            os.kill(os.getpid(), signal.SIGTERM)
            assert p.noticed and p.reached(1) and got == []
            os.kill(os.getpid(), signal.SIGTERM)  # the second: the previous handler's
            assert got == [signal.SIGTERM]
        with preemption.Preemption():
            pass  # leaving restores the handler it found
        assert signal.getsignal(signal.SIGTERM) is not None
        os.kill(os.getpid(), signal.SIGTERM)
        assert got == [signal.SIGTERM, signal.SIGTERM]
        with (
            preemption.Preemption() as p,
            pytest.raises(TypeError, match=r"step must be an int ≥ 0; got -1"),
        ):
            p.reached(-1)
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_a_boundary_asked_twice_or_skipped_is_refused(module=preemption) -> None:
    """``reached`` at every boundary, once: the same step twice, a step skipped and a step
    back are each ``ValueError`` naming the step, the one expected and the rule."""
    rule = (r"ask once at every step boundary, the steps going up by one per call \(every "
            r"process alike: they agree on a step by counting\)")  # fmt: skip
    for steps, bad, got in (((4, 5), 5, "asked twice"), ((4,), 6, "after step 4"),
                            ((4, 5), 3, "after step 5")):  # fmt: skip
        with module.Preemption() as p:
            for step in steps:
                assert not p.reached(step)
            with pytest.raises(ValueError, match=rf"Preemption\.reached: step {bad} {got}; "
                               rf"expected step {steps[-1] + 1}: {rule}"):  # fmt: skip
                p.reached(bad)


def test_a_boundary_asked_twice_or_skipped_is_refused():
    check_a_boundary_asked_twice_or_skipped_is_refused()


def check_a_handler_installed_while_open_is_refused_and_kept(module=preemption) -> None:
    """A SIGTERM handler the user installs while ``Preemption`` is open would take the notice:
    the next ``reached`` is a ``RuntimeError`` naming it and the fix, and ``close`` leaves it
    installed (never the handler found before it)."""
    got = []

    def users(sig, frame):
        got.append(sig)

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with module.Preemption() as p:
            assert not p.reached(0)
            signal.signal(signal.SIGTERM, users)
            with pytest.raises(RuntimeError, match=(
                rf"Preemption\.reached: SIGTERM's handler was replaced while this Preemption was "
                rf"open \(it is now {re.escape(repr(users))}\), so a preemption notice would never "
                rf"reach it and the run would be killed unsaved\. Install your own handler before "
                rf"constructing Preemption \(it then acts at a second SIGTERM\), or close the "
                rf"Preemption before installing it"
            )):  # fmt: skip
                p.reached(1)
        assert signal.getsignal(signal.SIGTERM) is users, "close clobbered the user's handler"
        os.kill(os.getpid(), signal.SIGTERM)
        assert got == [signal.SIGTERM]
        # Installed before it: ours takes the first notice, the user's the second.
        with module.Preemption() as p:
            os.kill(os.getpid(), signal.SIGTERM)
            assert p.reached(0) and got == [signal.SIGTERM]
            assert p.reached(1)  # after the notice, the user's handler is the one expected
            os.kill(os.getpid(), signal.SIGTERM)
            assert got == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_handler_installed_while_open_is_refused_and_close_keeps_it():
    check_a_handler_installed_while_open_is_refused_and_kept()


def check_the_default_poll_follows_the_timeout_within_its_bounds(module=watchdog) -> None:
    """``poll_s`` defaults to ``timeout_s / 10`` within [0.2, 10] s: both bounds and both
    sides of each (one process: the thread is not started, the interval is still set)."""
    for timeout_s, poll_s in ((0.5, 0.2), (2, 0.2), (2.5, 0.25), (30, 3.0), (99, 9.9),
                              (100, 10.0), (600, 10.0)):  # fmt: skip
        with module.Watchdog(timeout_s) as w:
            assert w.poll_s == poll_s, (timeout_s, w.poll_s, poll_s)
    with module.Watchdog(600, poll_s=0.5) as w:
        assert w.poll_s == 0.5


def test_the_default_poll_is_a_tenth_of_the_timeout_within_0_2_and_10_s():
    check_the_default_poll_follows_the_timeout_within_its_bounds()


ASKED_ONCE = "        if self._last is not None and step != self._last + 1:\n"
REPLACED = ("        if self._installed and self._notice is None and signal.getsignal(signal.SIGTERM)"
            " != (\n")  # fmt: skip
CLOSED = "            if signal.getsignal(signal.SIGTERM) == self._handle:\n"
POLL = "            poll_s = min(max(timeout_s / 10, 0.2), 10.0)\n"
# name → (module, old line, new line, the check that catches it)
MUTANTS = {
    # The same boundary asked twice passes (the old rule): a loop asking twice goes unnoticed.
    "boundary_asked_twice_allowed": (
        preemption, ASKED_ONCE,
        "        if self._last is not None and step not in (self._last, self._last + 1):\n",
        check_a_boundary_asked_twice_or_skipped_is_refused,
    ),
    # A handler installed while open takes the notice silently: the run is killed unsaved.
    "replaced_handler_unnoticed": (
        preemption, REPLACED, "        if False and signal.getsignal(signal.SIGTERM) != (\n",
        check_a_handler_installed_while_open_is_refused_and_kept,
    ),
    # close puts back the handler found before, clobbering the one the user installed since.
    "close_clobbers_the_user_s_handler": (
        preemption, CLOSED, "            if True:\n",
        check_a_handler_installed_while_open_is_refused_and_kept,
    ),
    # The poll's floor at 0.1 s: twice the store requests for a short timeout.
    "poll_floor_0_1_s": (watchdog, POLL, POLL.replace("0.2", "0.1"),
                         check_the_default_poll_follows_the_timeout_within_its_bounds),
    # No ceiling: a 600 s timeout polls once a minute, the verdict a minute late.
    "poll_ceiling_60_s": (watchdog, POLL, POLL.replace("10.0", "60.0"),
                          check_the_default_poll_follows_the_timeout_within_its_bounds),
    # A fifth of the timeout, not a tenth.
    "poll_a_fifth_of_the_timeout": (watchdog, POLL, POLL.replace("/ 10", "/ 5"),
                                    check_the_default_poll_follows_the_timeout_within_its_bounds),
}  # fmt: skip


@pytest.mark.parametrize("name", MUTANTS)
def test_resilience_mutant_is_caught(name):
    module, old, new, check = MUTANTS[name]
    check(mutant(module, "copy", old, old))  # an unmutated copy passes the check
    with pytest.raises((AssertionError, pytest.fail.Exception)):  # pytest.raises' DID NOT RAISE
        check(mutant(module, name, old, new))


def test_a_preemption_made_outside_the_main_thread_is_refused():
    errors = []

    def make():
        try:
            preemption.Preemption()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert errors and "construct it in the main thread" in errors[0]


def test_checkpoint_saves_leave_jax_s_preemption_step_to_the_loop(tmp_path, monkeypatch):
    """orbax's manager asks JAX's ``reached_preemption_sync_point`` with the step it saves, also
    from the thread finishing an asynchronous save while the loop is steps ahead, which would
    move the step JAX takes as this process's back: ``Checkpoints`` never asks it."""
    from jax.experimental import multihost_utils

    import shardops

    asked = []
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                        lambda step: asked.append(step) or False)  # fmt: skip
    setup = models.build("2d", shardops.make_mesh({"data": 4, "model": 2}),
                         optimizer=models.seed_sgd(10), sizes=(8, 16, 4))  # fmt: skip
    state = setup.init(jax.random.key(0))
    with Checkpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(3, setup, state)
        ckpt.save(4, setup, state)
        ckpt.wait()
        assert ckpt.steps() == [3, 4]
    assert asked == []
