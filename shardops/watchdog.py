"""A stuck-process watchdog: when the others have passed a step that process k has not reached
within a timeout, every process exits with an error naming k and the step.

JAX's coordination service notices a process that *dies* (its heartbeats stop). A process that
is alive but stuck between two steps, in Python or in I/O, still sends heartbeats, and every
other process waits for it in its next collective forever. With a
``Watchdog`` each process reports every step boundary it reaches to the coordination service's
key-value store (a thread writes the latest, once per poll), and the same thread reads the
others' reports::

    with shardops.watchdog.Watchdog(timeout_s=600) as watchdog:   # every process
        for step in range(start, steps):
            watchdog.step(step)        # `step` steps are done: a boundary reached
            state, loss = setup.train_step(state, *batch)

Process k is **stuck** at boundary s + 1 when it has reported s, another process has reported
s + 1 or more, and ``timeout_s`` seconds have passed since this process first saw that. The
first process to see it writes the verdict to the store, and every process (k too: its
watchdog thread runs while its main thread is stuck) prints the same message on stderr and
exits with ``EXIT_CODE`` through ``os._exit`` (the main thread may be blocked in a collective,
where no exception can reach it), process 0 last (it holds the coordination service the others
need). A step reaches the store within one poll (``poll_s``) and every process reads the store
once per poll, so all exit within about ``timeout_s + 3 · poll_s`` of k falling behind.

**The default timeout** is ``DEFAULT_TIMEOUT_S`` = 600 s (PyTorch's default collective
timeout): a process may lag the others by up to a step, a checkpoint save and any work of its
own between steps (an evaluation, a log), and must not be called stuck for it. A timeout is the
longest such lag you expect; lower it to stop a stuck run sooner.

**What it cannot see.** A step is reported when the loop reaches it, and a step is dispatched
asynchronously: a stall *inside* the device program (a host callback that never returns, a
collective one process never joins) holds every process at the same boundary, in the same
wait, and no process lags. No lag rule can name the process there; JAX's collective timeouts
(or the job's own) are the answer.

A single process (no ``jax.distributed``) has no peer to compare with: the watchdog is off
(``active`` is False). ``step`` costs an assignment either way: the store is written and
read only by the thread, once per poll each, so the coordination service sees two requests
per poll per process, whatever the step rate. The private JAX API this needs is in
``shardops._coordination``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping

from shardops import _coordination

DEFAULT_TIMEOUT_S = 600.0
# The exit code of every process of a stuck run (as ``timeout`` exits when its command
# times out).
EXIT_CODE = 124
_PREFIX = "shardops/watchdog"
# Watchdogs of one run are numbered in the order they are made, the same on every process: each
# has keys of its own in the store.
_instances = itertools.count()


@dataclasses.dataclass(frozen=True)
class Stuck:
    """Process ``process`` has reported ``step`` steps, and ``ahead`` has reported ``passed``
    > ``step`` for at least ``seconds``."""

    process: int
    step: int | None  # None: it has not reported a step yet
    ahead: int
    passed: int
    seconds: float

    def message(self, timeout_s: float) -> str:
        at = (
            "has not reported its first step"
            if self.step is None
            else f"has done {self.step} steps and has not reached step {self.step + 1}"
        )
        return (
            f"shardops.watchdog: process {self.process} is stuck: it {at} within "
            f"{timeout_s:g} s of process {self.ahead} passing it (process {self.ahead} has done "
            f"{self.passed} steps). It is alive (its heartbeats arrive) but blocked between "
            f"steps, in Python or in I/O; its stack shows where. Every process "
            f"exits with code {EXIT_CODE}. If a step can lag this long, raise timeout_s."
        )


def find_stuck(
    reported: Mapping[int, int | None], lagging_since: dict, now: float, timeout_s: float
) -> Stuck | None:
    """The process stuck for ``timeout_s`` furthest behind, from the steps each process reported
    (``None``: none yet). ``lagging_since`` maps ``(process, step)`` to when that lag was first
    seen, and is updated: a lag that ended is forgotten, a new one starts at ``now``."""
    known = [s for s in reported.values() if s is not None]
    if not known:
        return None
    top = max(known)
    ahead = min(k for k, s in reported.items() if s == top)
    lagging = {(k, s) for k, s in reported.items() if s is None or s < top}
    for key in list(lagging_since):
        if key not in lagging:
            del lagging_since[key]
    for key in lagging:
        lagging_since.setdefault(key, now)
    # The one furthest behind first (none reported, then the lowest step): the others behind
    # may only be waiting for it in a collective, a step or two ahead of it.
    for process, step in sorted(lagging, key=lambda key: (key[1] is not None, key[1] or 0, key[0])):
        seconds = now - lagging_since[(process, step)]
        if seconds >= timeout_s:
            return Stuck(process, step, ahead, top, seconds)
    return None


def _exit(message: str) -> None:
    os._exit(EXIT_CODE)


class Watchdog:
    """Report step boundaries and watch the other processes' (see the module doc).

    Arguments:
        timeout_s: how long a process may stay behind a boundary another has passed (None:
            the watchdog is off).
        poll_s: how often the store is read (default ``timeout_s / 10``, within [0.2, 10] s).
        on_stuck: called with the verdict (once printed) instead of exiting (tests).
    """

    def __init__(self, timeout_s: float | None = DEFAULT_TIMEOUT_S, *,
                 poll_s: float | None = None, on_stuck: Callable[[str], None] | None = None):  # fmt: skip
        self._stop = threading.Event()
        self._thread = None
        self._store = None
        self._latest: int | None = None  # the last step boundary reported by ``step``
        if timeout_s is None:  # off
            return
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not (
            timeout_s > 0
        ):  # fmt: skip
            raise ValueError(f"Watchdog: timeout_s must be a number of seconds > 0 (None: "
                             f"off); got {timeout_s!r}")  # fmt: skip
        if poll_s is None:
            poll_s = min(max(timeout_s / 10, 0.2), 10.0)
        if not poll_s > 0:
            raise ValueError(f"Watchdog: poll_s must be > 0 seconds; got {poll_s!r}")
        self.timeout_s, self.poll_s = float(timeout_s), float(poll_s)
        self._on_stuck = on_stuck or _exit
        self._store = _coordination.key_value_store()
        if self._store is None:
            return
        import jax

        self._count, self._me = jax.process_count(), jax.process_index()
        if self._count == 1:
            self._store = None
            return
        self._prefix = f"{_PREFIX}/{next(_instances)}/"
        self._thread = threading.Thread(target=self._watch, name="shardops.watchdog",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    @property
    def active(self) -> bool:
        """Whether it watches (a timeout, and a run of more than one process)."""
        return self._thread is not None

    def step(self, step: int) -> None:
        """``step`` steps are done on this process: report the boundary. It costs an
        assignment: the watchdog's thread writes the latest step to the store at its next poll
        (a stuck main thread stops advancing it, which is what the others see)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"Watchdog.step: step must be an int ≥ 0; got {step!r}")
        self._latest = step

    def _publish(self, published: int | None) -> int | None:
        latest = self._latest
        if latest is not None and latest != published:
            self._store.set(f"{self._prefix}step/{self._me}", str(latest))
        return latest

    def _reported(self) -> tuple[dict[int, int | None], str | None]:
        found = self._store.dir(self._prefix)
        steps = {k: None for k in range(self._count)}
        for key, value in found.items():
            if key.startswith(f"{self._prefix}step/"):
                steps[int(key.rsplit("/", 1)[1])] = int(value)
        return steps, found.get(f"{self._prefix}verdict")

    def _watch(self) -> None:
        lagging_since: dict = {}
        published = None
        while not self._stop.wait(self.poll_s):
            try:
                published = self._publish(published)
                steps, verdict = self._reported()
            except Exception:  # the service is gone (the run is ending): JAX reports that
                return
            if verdict is None:
                stuck = find_stuck(steps, lagging_since, time.monotonic(), self.timeout_s)
                if stuck is None:
                    continue
                try:  # the first process to see it writes the verdict; every one prints it
                    verdict = self._store.set_once(
                        f"{self._prefix}verdict", stuck.message(self.timeout_s)
                    )
                except Exception:
                    verdict = stuck.message(self.timeout_s)
            print(verdict, file=sys.stderr, flush=True)
            self._leave()
            self._on_stuck(verdict)
            return

    def _leave(self) -> None:
        """Say this process has the verdict, and wait (two polls at most) until every process
        has it: one that exited first would break the others' collectives, and they would die
        of that before they could say why. Process 0, which holds the coordination service,
        leaves last: a process that loses the service aborts with a stack trace."""
        try:
            self._store.set(f"{self._prefix}leaving/{self._me}", "1")
            deadline = time.monotonic() + 2 * self.poll_s + 2.0
            while time.monotonic() < deadline:
                leaving = [k for k in self._store.dir(self._prefix) if "/leaving/" in k]
                if len(leaving) == self._count:
                    break
                time.sleep(0.05)
            if self._me == 0:
                time.sleep(0.5)
        except Exception:  # the service is gone: nothing to wait for
            pass

    def close(self) -> None:
        """Stop watching (the loop is over), and write the last step reported: the others
        still watching see where this process left, not a step a poll older."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
            with contextlib.suppress(Exception):  # the service is gone: the run is over
                self._publish(None)
        self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
