"""``python -m shardops.launch``: processes started with the right environment (process ids
over several processes on several nodes, the caller's own variables kept), their output
prefixed, the signal the launcher forwards and the grace period a child's shutdown handler
gets, a failed or killed process stopping the run, and bad options refused before anything
starts. Also JAX's own heartbeat abort, without the launcher. Mutants of the launcher (a copy
of its module with one line replaced, its ``main`` run in this process) are caught.

Every multi-process run is a subprocess in its own session, under a timeout; at the end of each
test, whatever it started and is still alive is SIGKILLed by its PID (never by name). A copy of
the launcher run in this process starts its probes in sessions of their own too, and a
watchdog SIGKILLs them by PID if the copy runs past the timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from _mutants import mutant

from shardops import distributed, launch

WORKER = Path(__file__).with_name("_launch_worker.py")
PROBE = WORKER.with_name("_launch_probe.py")  # no JAX: its environment and its signals
ROOT = WORKER.parent.parent
# Generous bound on any one run (each JAX process starts in ~2-3 s here, on 2 cores).
RUN_TIMEOUT_S = 60
# A dead process is noticed well within this, with the launcher or by JAX's heartbeats (10 s).
STOP_WITHIN_S = 60
_PID_LINE = re.compile(r"^shardops\.launch: process (\d+) pid (\d+)$")


class Run:
    """A command started in its own session; threads read its stdout and stderr into lists."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.args = args
        self.popen = subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._changed = threading.Condition()
        self._threads = [
            threading.Thread(target=self._read, args=(pipe, lines), daemon=True)
            for pipe, lines in ((self.popen.stdout, self.out), (self.popen.stderr, self.err))
        ]
        for t in self._threads:
            t.start()

    def _read(self, pipe, lines: list[str]) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                with self._changed:
                    lines.append(raw.decode(errors="replace").rstrip("\n"))
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def report(self) -> str:
        return (
            f"$ {' '.join(self.args)}\n--- stdout\n"
            + "\n".join(self.out[-60:])
            + "\n--- stderr\n"
            + "\n".join(self.err[-60:])
        )

    def wait_for(self, predicate, what: str, timeout: float = RUN_TIMEOUT_S) -> None:
        """Wait until ``predicate(self)``; fail if the command ends first or time runs out."""
        with self._changed:
            ok = self._changed.wait_for(
                lambda: predicate(self) or self.popen.poll() is not None, timeout
            )
        if not ok or not predicate(self):
            raise AssertionError(f"no {what} within {timeout} s:\n{self.report()}")

    def finish(self, timeout: float = RUN_TIMEOUT_S) -> int:
        """The exit code, once the command and its output have ended."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.report()}") from None
        for t in self._threads:
            t.join(timeout)
        return code

    def child_pids(self) -> dict[int, int]:
        """Global process id → PID, from the launcher's ``process I pid P`` lines."""
        found = (_PID_LINE.match(line) for line in list(self.err))
        return {int(m[1]): int(m[2]) for m in found if m}

    def kill(self) -> None:
        """SIGKILL this command's session and, by PID, the workers it reported (each in a
        session of its own) that are still alive."""
        for pid in [p for p in self.child_pids().values() if worker_alive(p)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        for t in self._threads:
            t.join(10)


def worker_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) ``_launch_worker.py`` or ``_launch_probe.py``
    process: a reused PID is somebody else's and does not count."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    ours = WORKER.name.encode() in cmdline or PROBE.name.encode() in cmdline
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and ours


@pytest.fixture
def start():
    """``start(args, env=None) -> Run``; every run is killed (if still alive) at teardown."""
    runs: list[Run] = []

    def _start(args: list[str], env: dict[str, str] | None = None) -> Run:
        runs.append(Run(args, env))
        return runs[-1]

    yield _start
    for r in runs:
        r.kill()


def launcher(*options: str, mode: str = "ok") -> list[str]:
    return [sys.executable, "-m", "shardops.launch", *options, "--", str(WORKER), mode]


def first_lines_printed(nproc: int, first: int = 0):
    """A predicate: every process's first worker line is on the launcher's stdout."""

    def printed(r: Run) -> bool:
        text = "\n".join(r.out)
        return all(f"[p{i}] process {i}/" in text for i in range(first, first + nproc))

    return printed


def worker_line(i: int, n: int, local: int, total: int = 8) -> str:
    return f"[p{i}] process {i}/{n}: {local} local of {total} devices, sum ok"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Runs under the launcher.


@pytest.mark.parametrize("nproc", [2, 4])
def test_launch_splits_8_devices_over_processes(start, nproc):
    r = start(launcher("-n", str(nproc)))
    assert r.finish() == 0, r.report()
    for i in range(nproc):
        assert worker_line(i, nproc, 8 // nproc) in r.out, r.report()
    assert all(line.startswith("[p") for line in r.out), r.report()
    assert not any("Gloo" in line or "peer ranks" in line for line in r.out), r.report()
    assert sorted(r.child_pids()) == list(range(nproc)), r.report()
    assert any(f"{8 // nproc} simulated CPU device(s) per process" in e for e in r.err)


def test_launch_returns_the_exit_code_of_the_failed_process(start):
    # Through the programmatic entry point, launch().
    code = (
        "import sys; from shardops.launch import launch; "
        f"sys.exit(launch([{str(WORKER)!r}, 'exit3'], nproc=2, devices=8))"
    )
    r = start([sys.executable, "-c", code])
    assert r.finish() == 3, r.report()
    pids = r.child_pids()
    assert re.search(rf"process 1 \(pid {pids[1]}\) exited with code 3", "\n".join(r.err)), (
        r.report()
    )
    assert worker_line(1, 2, 4) in r.out, r.report()
    assert not any(worker_alive(p) for p in pids.values())


def test_launch_stops_the_run_when_a_process_is_killed(start):
    # A heartbeat timeout far above the bound below: the launcher, not JAX, must stop the run.
    r = start(launcher("-n", "2", "--heartbeat-timeout", "30", mode="loop"))
    r.wait_for(first_lines_printed(2), "first step on every process")
    pids = r.child_pids()
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    code = r.finish(STOP_WITHIN_S)
    elapsed = time.monotonic() - killed_at
    print(f"launcher: SIGKILL of process 1 → launcher exit in {elapsed:.2f} s")
    assert code == 128 + signal.SIGKILL, r.report()
    assert elapsed < 20, f"stopped {elapsed:.1f} s after the kill:\n{r.report()}"
    assert re.search(
        rf"process 1 \(pid {pids[1]}\) was killed by SIGKILL; stopping the other 1 process",
        "\n".join(r.err),
    ), r.report()
    assert not any(worker_alive(p) for p in pids.values()), r.report()


def test_sigterm_to_the_launcher_is_forwarded_to_every_process(start):
    r = start(launcher("-n", "2", "--grace", "1", mode="loop"))
    r.wait_for(first_lines_printed(2), "first step on every process")
    os.kill(r.popen.pid, signal.SIGTERM)
    assert r.finish() == 128 + signal.SIGTERM, r.report()
    assert "shardops.launch: received SIGTERM; forwarding it to 2 process(es)" in r.err
    assert not any(worker_alive(p) for p in r.child_pids().values()), r.report()


def test_two_launchers_as_two_nodes_share_one_run(start):
    """Two nodes of two processes each: one JAX run of 4 processes × 2 devices."""
    coordinator = ["--coordinator", f"127.0.0.1:{free_port()}"]
    nodes = []
    for rank in (0, 1):
        options = ["--nnodes", "2", "--node-rank", str(rank), *coordinator]
        nodes.append(start(launcher(*options, "-n", "2", "--devices", "4")))
    for node in nodes:
        assert node.finish() == 0, node.report()
    for i in range(4):
        assert worker_line(i, 4, 2) in nodes[i // 2].out, nodes[i // 2].report()
    assert sorted(nodes[1].child_pids()) == [2, 3]


# ---------------------------------------------------------------------------------------------
# What each process gets (ids, environment) and receives (signals, a grace period), with probes
# that import no JAX. Each check runs the launcher's command line in a subprocess, or, given a
# mutant of shardops/launch.py, that module's main() in this process (a JAX import saved per
# run; a helper thread sends the signal once the probes are ready).

CALLER_ENV = {
    "SHARDOPS_TEST_CALLER": "chosen by the caller",
    "JAX_PLATFORMS": "cuda",  # the platform the caller chose (the probes import no JAX)
    "XLA_FLAGS": "--xla_dump_to=/tmp/shardops-dump --xla_force_host_platform_device_count=1",
}
NODES, PER_NODE = 2, 3  # unequal: node_rank · nnodes ≠ node_rank · nproc


@dataclasses.dataclass
class Outcome:
    """A finished probe run: exit code, stdout and stderr lines, seconds from the signal (if
    one was sent) to the launcher's exit."""

    code: int
    out: list[str]
    err: list[str]
    after_signal: float | None

    def report(self) -> str:
        return (
            "--- stdout\n"
            + "\n".join(self.out[-60:])
            + "\n--- stderr\n"
            + "\n".join(self.err[-60:])
        )

    def child_pids(self) -> dict[int, int]:
        found = (_PID_LINE.match(line) for line in self.err)
        return {int(m[1]): int(m[2]) for m in found if m}


def probe_runs(start, runs, *, env=None, module=None, monkeypatch=None,
               timeout=RUN_TIMEOUT_S) -> list[Outcome]:  # fmt: skip
    """Run ``shardops.launch OPTIONS -- tests/_launch_probe.py MODE`` for each ``(options, mode,
    signal_when_ready)`` of ``runs`` to its end: as subprocesses started together, or, given
    ``module`` (a copy of the launch module), its ``main`` here, one run after the other.
    ``signal_when_ready = (n, sig)``: send ``sig`` to the launcher once ``n`` probes are
    ready; ``(n, sig, "twice")``: and again once ``n`` probes got it (``after_signal`` counts
    from the second)."""
    if module is not None:
        for key, value in (env or {}).items():
            if os.environ.get(key) != value:
                monkeypatch.setenv(key, value)
        return [_run_here(module, *run, timeout) for run in runs]
    started = [
        (start([sys.executable, "-m", "shardops.launch", *options, "--", str(PROBE), *mode],
               env), when)
        for options, mode, when in runs
    ]  # fmt: skip
    outcomes = []
    for r, when in started:
        sent = None
        if when:
            n, sig, *twice = when
            r.wait_for(lambda r, n=n: sum(x.endswith("] ready") for x in r.out) == n, "ready")
            sent = time.monotonic()
            os.kill(r.popen.pid, sig)
            if twice:
                got = f"] got {signal.Signals(sig).name}"
                r.wait_for(lambda r, n=n, got=got: sum(x.endswith(got) for x in r.out) == n, got)
                sent = time.monotonic()
                os.kill(r.popen.pid, sig)
        code = r.finish(timeout)
        elapsed = None if sent is None else time.monotonic() - sent
        outcomes.append(Outcome(code, list(r.out), list(r.err), elapsed))
    return outcomes


def probe_run(start, options, mode=("env",), *, signal_when_ready=None, **kwargs) -> Outcome:
    return probe_runs(start, [(options, mode, signal_when_ready)], **kwargs)[0]


def _run_here(module, options, mode, when, timeout) -> Outcome:
    """``module.main`` in this process, its output captured; a thread sends the signal once the
    probes are ready (never after ``main`` returned: a late one is dropped, not pytest's), and
    a watchdog SIGKILLs the probes it started (by PID) if ``main`` runs past ``timeout``."""
    out, err, sent, done = io.StringIO(), io.StringIO(), [], threading.Event()

    def signal_once_ready(n, sig, *twice):
        deadline = time.monotonic() + timeout
        for seen in ["] ready\n"] + [f"] got {signal.Signals(sig).name}\n"] * len(twice):
            while out.getvalue().count(seen) < n and time.monotonic() < deadline:
                if done.wait(0.01):
                    return
            sent.append(time.monotonic())
            os.kill(os.getpid(), sig)  # handled by the launcher's own handler, in the main thread

    helper = threading.Thread(target=signal_once_ready, args=when or (0, 0), daemon=True)
    if when:
        helper.start()

    def watchdog():  # a copy that never stops its processes must not hang the suite
        if not done.wait(timeout):
            found = (_PID_LINE.match(line) for line in err.getvalue().splitlines())
            for pid in [int(m[2]) for m in found if m]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)

    threading.Thread(target=watchdog, daemon=True).start()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = module.main([*options, "--", str(PROBE), *mode])
    finally:
        done.set()
        for sig in previous:
            signal.signal(sig, lambda *_: None)  # a signal sent as main returned goes nowhere
        if when:
            helper.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    elapsed = time.monotonic() - sent[-1] if sent else None
    return Outcome(code, out.getvalue().splitlines(), err.getvalue().splitlines(), elapsed)


def check_ids_and_environment(start, module=None, monkeypatch=None) -> None:
    """2 nodes × 3 processes: global process ``R · 3 + i`` for process ``i`` of node ``R``, all
    6 with the same coordinator and count and 2 simulated devices each (``--devices 6`` per
    node); the caller's own variables, its platform and its other XLA flags, reach every
    process unchanged. (The probes join no run: in this process the nodes run in turn.)"""
    coordinator = f"127.0.0.1:{free_port()}"
    runs = [
        (["--nnodes", str(NODES), "--node-rank", str(rank), "--coordinator", coordinator, "-n",
          str(PER_NODE), "--devices", "6"], ("env",), None)
        for rank in range(NODES)
    ]  # fmt: skip
    nodes = probe_runs(start, runs, env={**os.environ, **CALLER_ENV}, module=module,
                       monkeypatch=monkeypatch)  # fmt: skip
    seen = {}
    for rank, node in enumerate(nodes):
        assert node.code == 0, node.report()
        for line in node.out:
            m = re.fullmatch(r"\[p(\d+)\] env (\{.*\})", line)
            assert m, f"not a probe's line: {line!r}\n{node.report()}"
            assert int(m[1]) not in seen, f"process {m[1]} twice:\n{node.report()}"
            seen[int(m[1])] = rank, json.loads(m[2])
        pids = node.child_pids()
        assert sorted(pids) == list(range(rank * PER_NODE, (rank + 1) * PER_NODE)), pids
    assert sorted(seen) == list(range(NODES * PER_NODE)), sorted(seen)
    flags = CALLER_ENV["XLA_FLAGS"].replace("device_count=1", "device_count=2")
    for i, (rank, got) in seen.items():
        assert rank == i // PER_NODE, (i, rank)
        assert got == {
            "SHARDOPS_COORDINATOR": coordinator, "SHARDOPS_NUM_PROCESSES": str(NODES * PER_NODE),
            "SHARDOPS_PROCESS_ID": str(i), "SHARDOPS_LOCAL_DEVICES": "2",
            "SHARDOPS_HEARTBEAT_TIMEOUT": str(launch.DEFAULT_HEARTBEAT_TIMEOUT_S),
            "JAX_PLATFORMS": "cuda", "XLA_FLAGS": flags, "PYTHONUNBUFFERED": "1",
            "SHARDOPS_TEST_CALLER": "chosen by the caller",
        }, f"process {i} (node {rank}) got {got}"  # fmt: skip


def check_sigint_and_a_shutdown_that_fits_the_grace(start, module=None, monkeypatch=None):
    """SIGINT to the launcher reaches every process as SIGINT (not SIGTERM); a handler that
    needs 0.5 s of the 5 s grace finishes (``saved``) and the launcher exits as soon as its
    processes have, with 128 + SIGINT."""
    r = probe_run(start, ["-n", "2", "--grace", "5"], ("signals", "0.5"),
                  signal_when_ready=(2, signal.SIGINT), module=module)  # fmt: skip
    assert r.code == 128 + signal.SIGINT and r.after_signal is not None, r.report()
    for i in range(2):
        assert f"[p{i}] got SIGINT" in r.out, r.report()
        assert f"[p{i}] saved" in r.out, f"process {i}'s handler was cut short:\n{r.report()}"
    assert r.after_signal < 4, f"exited {r.after_signal:.1f} s after SIGINT:\n{r.report()}"


def check_a_shutdown_longer_than_the_grace_is_killed(start, module=None, monkeypatch=None):
    """SIGTERM reaches every process as SIGTERM; a handler that would take 5 s gets the 1 s
    grace, then SIGKILL: the launcher exits with 128 + SIGTERM after about a second."""
    r = probe_run(start, ["-n", "2", "--grace", "1"], ("signals", "5"),
                  signal_when_ready=(2, signal.SIGTERM), module=module)  # fmt: skip
    assert r.code == 128 + signal.SIGTERM and r.after_signal is not None, r.report()
    assert all(f"[p{i}] got SIGTERM" in r.out for i in range(2)), r.report()
    assert not any(line.endswith("] saved") for line in r.out), r.report()
    assert 1 <= r.after_signal < 4, f"ended {r.after_signal:.2f} s after SIGTERM (grace 1 s)"
    assert not any(worker_alive(p) for p in r.child_pids().values()), r.report()


def check_a_failure_stops_the_others_with_sigterm_and_grace(start, module=None,
                                                            monkeypatch=None):  # fmt: skip
    """Process 1 exits with code 3 (once process 0 can take a signal): process 0 gets SIGTERM
    and the grace to finish its handler; the launcher exits with 3."""
    with tempfile.TemporaryDirectory() as marks:
        env = {**os.environ, "SHARDOPS_TEST_READY_DIR": marks}
        r = probe_run(start, ["-n", "2", "--grace", "0", "--failure-grace", "5"], ("fail", "0.5"),
                      env=env,
                      module=module, monkeypatch=monkeypatch)  # fmt: skip
    assert r.code == 3, r.report()  # the failure grace, not --grace 0, held the SIGKILL
    assert "[p0] got SIGTERM" in r.out and "[p0] saved" in r.out, r.report()


def check_a_second_signal_kills_at_once(start, module=None, monkeypatch=None) -> None:
    """Processes that ignore SIGTERM hold the first signal's 30 s grace; a second SIGTERM to the
    launcher sends SIGKILL at once: it exits with 128 + SIGTERM within 1.5 s of it (0.1 s
    here), every process dead. (Run here, the probes are killed 4 s after the launcher starts:
    a copy that waits out the grace ends then, 2 s or more after the second signal.)"""
    r = probe_run(start, ["-n", "2", "--grace", "30"], ("ignore",),
                  signal_when_ready=(2, signal.SIGTERM, "twice"), module=module,
                  timeout=4 if module is not None else RUN_TIMEOUT_S)  # fmt: skip
    assert r.code == 128 + signal.SIGTERM and r.after_signal is not None, r.report()
    assert all(f"[p{i}] got SIGTERM" in r.out for i in range(2)), r.report()
    assert r.after_signal < 1.5, f"ended {r.after_signal:.2f} s after the second SIGTERM"
    assert not any(worker_alive(p) for p in r.child_pids().values()), r.report()


def test_a_second_signal_to_the_launcher_kills_at_once(start, monkeypatch):
    """The launcher's own main, in this process (no JAX start-up for it: 0.2 s)."""
    check_a_second_signal_kills_at_once(start, launch, monkeypatch)


def test_process_ids_and_the_callers_environment_over_two_nodes_of_three(start):
    check_ids_and_environment(start)


def test_sigint_is_forwarded_as_sigint_and_a_handler_gets_its_grace(start):
    check_sigint_and_a_shutdown_that_fits_the_grace(start)


def test_a_handler_longer_than_the_grace_is_killed_at_its_end(start):
    check_a_shutdown_longer_than_the_grace_is_killed(start)


def test_a_failed_process_stops_the_others_with_sigterm_and_grace(start):
    check_a_failure_stops_the_others_with_sigterm_and_grace(start)


FIRST = "    first = node_rank * nproc\n"
SUPERVISE_STOP = "            _stop(processes, sig, grace_s, signals)\n"
FAILURE_STOP = "            _stop(processes, signal.SIGTERM, failure_grace_s, signals)\n"
# name → (old line, new line, the check that catches it)
LAUNCH_MUTANTS = {
    # Global ids from the node rank alone: node 1's processes are 1, 2, 3, not 3, 4, 5.
    "ids_ignore_the_processes_per_node": (FIRST, "    first = node_rank\n",
                                          check_ids_and_environment),
    # Each node tells its processes that the run has only its own processes.
    "run_size_of_one_node": ("    num_processes = nnodes * nproc\n",
                             "    num_processes = nproc\n", check_ids_and_environment),
    # The caller's platform replaced by cpu whenever devices are simulated.
    "platform_overridden": ('        env.setdefault("JAX_PLATFORMS", "cpu")\n',
                            '        env["JAX_PLATFORMS"] = "cpu"\n', check_ids_and_environment),
    # SIGINT forwarded as SIGTERM.
    "sigint_forwarded_as_sigterm": (
        SUPERVISE_STOP, SUPERVISE_STOP.replace("sig,", "signal.SIGTERM,"),
        check_sigint_and_a_shutdown_that_fits_the_grace,
    ),
    # No grace: SIGKILL right after the signal.
    "no_grace": ("    deadline = time.monotonic() + grace_s\n", "    deadline = time.monotonic()\n",
                 check_sigint_and_a_shutdown_that_fits_the_grace),
    # No SIGKILL at the end of the grace: a slow handler holds the run.
    "no_kill_after_the_grace": ("    for p in processes:\n        p.signal(signal.SIGKILL)\n", "",
                                check_a_shutdown_longer_than_the_grace_is_killed),
    # A failure stops the others with the forwarded signal's grace (0 in the check), not its own.
    "failure_with_the_signal_grace": (FAILURE_STOP, FAILURE_STOP.replace("failure_grace_s", "grace_s"),
                                      check_a_failure_stops_the_others_with_sigterm_and_grace),
    # A failure stops the others with SIGKILL, no handler run.
    "failure_kills_at_once": (FAILURE_STOP, FAILURE_STOP.replace("SIGTERM", "SIGKILL"),
                              check_a_failure_stops_the_others_with_sigterm_and_grace),
    # A second signal ignored: processes that ignore the first hold the run for the whole grace.
    "second_signal_waits_out_the_grace": ("        and len(signals.received) == seen\n",
                                          "        and True\n", check_a_second_signal_kills_at_once),
}  # fmt: skip


@pytest.mark.parametrize("check", sorted({c for *_, c in LAUNCH_MUTANTS.values()},
                                         key=lambda c: c.__name__), ids=lambda c: c.__name__)  # fmt: skip
def test_a_copy_of_the_launcher_run_here_passes(start, monkeypatch, check):
    """The harness: an unmutated copy of shardops/launch.py, its main() run in this process,
    passes every check its mutants face."""
    check(start, mutant(launch, "copy", FIRST, FIRST), monkeypatch)


@pytest.mark.parametrize("name", LAUNCH_MUTANTS)
def test_launch_mutant_is_caught(start, monkeypatch, name):
    old, new, check = LAUNCH_MUTANTS[name]
    bad = mutant(launch, name, old, new)  # outside raises: a line not found is no catch
    with pytest.raises(AssertionError):
        check(start, bad, monkeypatch)


# ---------------------------------------------------------------------------------------------
# Without the launcher: JAX's coordination service aborts the survivors.


def test_without_launcher_a_dead_peer_aborts_the_others_by_heartbeat(start):
    env = {
        **os.environ,
        distributed.COORDINATOR: f"127.0.0.1:{free_port()}",
        distributed.NUM_PROCESSES: "2",
        distributed.LOCAL_DEVICES: "4",
        distributed.HEARTBEAT_TIMEOUT: "10",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "PYTHONUNBUFFERED": "1",
    }
    workers = [
        start([sys.executable, str(WORKER), "loop"], {**env, distributed.PROCESS_ID: str(i)})
        for i in range(2)
    ]
    for i, w in enumerate(workers):
        w.wait_for(lambda r, i=i: any(f"process {i}/2" in line for line in r.out), "first step")
    killed_at = time.monotonic()
    os.kill(workers[1].popen.pid, signal.SIGKILL)
    code = workers[0].finish(STOP_WITHIN_S)
    elapsed = time.monotonic() - killed_at
    print(f"heartbeat: SIGKILL of process 1 → process 0 exit in {elapsed:.2f} s")
    assert code != 0, workers[0].report()
    assert elapsed < STOP_WITHIN_S
    said = "\n".join(workers[0].out + workers[0].err)
    assert re.search(r"unhealthy|stopped sending heartbeats", said), workers[0].report()


# ---------------------------------------------------------------------------------------------
# Bad options: exit code 2 and a message, before anything starts.


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "8", "-n", "3", "--", "w.py"],
         r"--devices 8 does not split evenly over -n 3 processes; use a multiple of 3"),
        (["-n", "2"], r"no command after --"),
        (["-n", "2", "--"], r"no command after --"),
        (["-n", "2", "w.py"], r"unrecognized arguments before --: w.py; options go before --"),
        (["--nnodes", "2", "-n", "1", "--", "w.py"], r"--nnodes 2 needs --coordinator HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1", "-n", "1", "--", "w.py"],
         r"--node-rank 2 is not in \[0, --nnodes 2\)"),
        (["--devices", "many", "-n", "2", "--", "w.py"],
         r"argument --devices: must be a positive integer or 'real'; got 'many'"),
        (["--coordinator", "localhost", "-n", "2", "--", "w.py"],
         r"--coordinator must be HOST:PORT"),
        (["--heartbeat-timeout", "0", "-n", "2", "--", "w.py"],
         r"--heartbeat-timeout must be ≥ 1 second; got 0"),
        (["--failure-grace", "-1", "-n", "2", "--", "w.py"],
         r"--failure-grace must be ≥ 0 seconds; got -1"),
        (["--grace", "nan", "-n", "2", "--", "w.py"], r"--grace must be ≥ 0 seconds; got nan"),
        (["--", "w.py"], r"the following arguments are required: -n/--nproc"),
        (["-n", "0", "--", "w.py"], r"-n/--nproc must be an integer ≥ 1; got 0"),
    ],
)  # fmt: skip
def test_bad_options_exit_2_with_a_message(capsys, argv, message):
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert re.match(r"shardops\.launch: error: " + message, err), err


@pytest.mark.parametrize("spelling", ["--port", "--coordinator"])
def test_a_port_in_use_is_refused_before_anything_starts(capsys, spelling):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        value = str(port) if spelling == "--port" else f"127.0.0.1:{port}"
        assert launch.main(["-n", "2", spelling, value, "--", str(WORKER), "ok"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"shardops.launch: error: port {port} on 127.0.0.1 is already in use; pass another "
        "--port, or omit --port to pick a free one"
    ), err
    assert "process 0 pid" not in err


def test_the_command_line_reports_errors_with_exit_code_2(start):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = start(launcher("-n", "2", "--port", str(port)))
        assert r.finish() == 2, r.report()
    assert r.err[0].startswith(f"shardops.launch: error: port {port} on 127.0.0.1"), r.report()
    assert not r.out


def test_launch_raises_launch_error():
    with pytest.raises(launch.LaunchError, match=r"-n/--nproc must be an integer ≥ 1; got 0"):
        launch.launch(["w.py"], nproc=0)
    with pytest.raises(launch.LaunchError, match=r"-n/--nproc must be an integer ≥ 1; got '2'"):
        launch.launch(["w.py"], nproc="2")
    with pytest.raises(launch.LaunchError, match=r"--nnodes must be an integer ≥ 1; got '1'"):
        launch.launch(["w.py"], nproc=2, nnodes="1")
    with pytest.raises(launch.LaunchError, match=r"--devices 6 does not split evenly over -n 4"):
        launch.launch(["w.py"], nproc=4, devices=6)
    with pytest.raises(launch.LaunchError, match=r"no command after --"):
        launch.launch([], nproc=2)


# ---------------------------------------------------------------------------------------------
# Pure helpers: the environment of each process, and what it reads back.


def test_xla_flags_replace_the_device_count_and_keep_other_flags():
    old = (
        "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8 --xla_dump_to=/d"
    )
    assert launch.xla_flags_with_device_count(old, 2) == (
        "--xla_cpu_enable_fast_math=false --xla_dump_to=/d --xla_force_host_platform_device_count=2"
    )
    assert launch.xla_flags_with_device_count(None, 4) == (
        "--xla_force_host_platform_device_count=4"
    )
    twice = "--xla_force_host_platform_device_count=8 --xla_force_host_platform_device_count=1"
    assert launch.xla_flags_with_device_count(twice, 2).count("device_count") == 1


def test_child_env_round_trips_through_from_env():
    base = {
        "PATH": "/bin",
        "XLA_FLAGS": "--xla_dump_to=/d --xla_force_host_platform_device_count=8",
    }
    env = launch.child_env(
        base, coordinator="10.0.0.1:8476", num_processes=4, process_id=3, local_devices=2
    )
    assert env["PATH"] == "/bin" and env["PYTHONUNBUFFERED"] == "1"
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/d --xla_force_host_platform_device_count=2"
    assert base["XLA_FLAGS"].endswith("=8")  # not modified in place
    assert distributed.from_env(env) == distributed.Launch("10.0.0.1:8476", 4, 3, 2, 10)


def test_child_env_with_real_devices_simulates_nothing():
    base = {"XLA_FLAGS": "--xla_dump_to=/d", distributed.LOCAL_DEVICES: "4"}
    env = launch.child_env(
        base,
        coordinator="h:1",
        num_processes=2,
        process_id=0,
        local_devices=None,
        heartbeat_timeout_s=30,
    )
    assert env["XLA_FLAGS"] == "--xla_dump_to=/d"
    assert distributed.LOCAL_DEVICES not in env and "JAX_PLATFORMS" not in env
    assert distributed.from_env(env) == distributed.Launch("h:1", 2, 0, None, 30)


def test_devices_per_process():
    assert launch.devices_per_process(8, 2) == 4
    assert launch.devices_per_process(8, 4) == 2
    assert launch.devices_per_process("real", 3) is None
    with pytest.raises(launch.LaunchError, match=r"an -n that divides 8 \(1, 2, 4, 8\)"):
        launch.devices_per_process(8, 3)


def test_exit_codes_and_their_descriptions():
    assert launch.exit_code(3) == 3
    assert launch.exit_code(-signal.SIGKILL) == 137
    assert launch.describe_exit(3) == "exited with code 3"
    assert launch.describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"


def test_gloo_noise_is_dropped_and_other_lines_kept():
    lines = [
        "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7",
        # Seen here: gloo's threads writing at once.
        "[Gloo] Rank [Gloo] Rank 6 is connected to 7 peer ranks. Expected number of connected "
        "peer ranks is : 77",
        " is connected to 7 peer ranks. Expected number of connected peer ranks is : 7",
        "",
        "7",
        "process 0/2: 4 local of 8 devices, sum ok",
        "7",
        "[Gloo] Rank 0 failed to connect",
    ]
    noise = launch.GlooNoiseFilter()
    assert [line for line in lines if noise.keep(line)] == lines[-3:]


def test_a_free_port_passes_the_port_check():
    launch.check_port_free("127.0.0.1", launch.free_port())


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"SHARDOPS_NUM_PROCESSES": "2"},
         r"SHARDOPS_NUM_PROCESSES is set but SHARDOPS_COORDINATOR and SHARDOPS_PROCESS_ID not"),
        ({"SHARDOPS_NUM_PROCESSES": "two", "SHARDOPS_COORDINATOR": "h:1",
          "SHARDOPS_PROCESS_ID": "0"},
         r"SHARDOPS_NUM_PROCESSES must be an integer ≥ 1; got 'two'"),
        ({"SHARDOPS_NUM_PROCESSES": "2", "SHARDOPS_COORDINATOR": "h:1",
          "SHARDOPS_PROCESS_ID": "2"},
         r"SHARDOPS_PROCESS_ID = 2 is not in \[0, SHARDOPS_NUM_PROCESSES = 2\)"),
        ({"SHARDOPS_NUM_PROCESSES": "2", "SHARDOPS_COORDINATOR": "localhost",
          "SHARDOPS_PROCESS_ID": "0"},
         r"SHARDOPS_COORDINATOR must be host:port; got 'localhost'"),
        ({"SHARDOPS_NUM_PROCESSES": "2", "SHARDOPS_COORDINATOR": "h:1",
          "SHARDOPS_PROCESS_ID": "0", "SHARDOPS_LOCAL_DEVICES": "0"},
         r"SHARDOPS_LOCAL_DEVICES must be an integer ≥ 1; got 0"),
        ({"SHARDOPS_NUM_PROCESSES": "2", "SHARDOPS_COORDINATOR": "h:1",
          "SHARDOPS_PROCESS_ID": "0", "SHARDOPS_HEARTBEAT_TIMEOUT": "1.5"},
         r"SHARDOPS_HEARTBEAT_TIMEOUT must be an integer ≥ 1; got '1.5'"),
    ],
)  # fmt: skip
def test_from_env_errors(environ, message):
    with pytest.raises(ValueError, match=message):
        distributed.from_env(environ)


def test_from_env_without_a_run_is_none():
    assert distributed.from_env({}) is None
