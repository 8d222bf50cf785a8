"""Subprocesses for the multi-process tests: started in their own session, watched under a
timeout, and ended by their PIDs only (a dead peer could otherwise hang the suite)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).parent.parent


class Run:
    """A command started in the background, its output in files under ``workdir``."""

    def __init__(self, args: list[str], workdir: pathlib.Path, name: str, env=None, cwd=ROOT):
        self.out = workdir / f"{name}.out"
        self.err = workdir / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=err, cwd=cwd, start_new_session=True,
                env={**os.environ, **(env or {})},
            )  # fmt: skip

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"timed out after {timeout} s:\n{self.output()}") from None

    def output(self) -> str:
        return f"--- stdout\n{self.out.read_text()}\n--- stderr\n{self.err.read_text()[-6000:]}"

    def worker_pids(self) -> dict[int, int]:
        """Process id → PID, from the launcher's ``shardops.launch: process I pid P`` lines."""
        found = re.findall(r"shardops\.launch: process (\d+) pid (\d+)", self.err.read_text())
        return {int(i): int(p) for i, p in found}

    def kill(self) -> None:
        """SIGKILL this command's session (the launcher and, by PID, its workers)."""
        pids = [self.proc.pid, *self.worker_pids().values()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def launcher(n: int, *args: str, devices: int = 8) -> list[str]:
    """``python -m shardops.launch -n N --devices D -- ARGS``."""
    return python("-m", "shardops.launch", "-n", str(n), "--devices", str(devices), "--", *args)


def run(args: list[str], workdir: pathlib.Path, name: str, timeout: float = 300) -> str:
    """Run to completion; the stdout, after asserting exit code 0."""
    r = Run(args, workdir, name)
    try:
        code = r.wait(timeout)
    finally:
        r.kill()  # a no-op when it ended; ends stragglers otherwise
    assert code == 0, f"{' '.join(args)} exited with {code}:\n{r.output()}"
    return r.out.read_text()


def wait_for(predicate, timeout: float, what: str, run: Run | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(f"ended before {what}:\n{run.output()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s" + (
                f":\n{run.output()}" if run else ""))  # fmt: skip
        time.sleep(0.02)


def killed_script(source: str, workdir: pathlib.Path, *args: str, timeout: float = 120):
    """Run the Python ``source`` (a script that ends by killing itself) as ``script.py ARGS``
    under a timeout; ``(exit code, stdout, Run)``."""
    script = workdir / "killer.py"
    script.write_text(source)
    r = Run([sys.executable, str(script), *args], workdir, "killer")
    try:
        code = r.wait(timeout)
    finally:
        r.kill()
    return code, r.out.read_text(), r
