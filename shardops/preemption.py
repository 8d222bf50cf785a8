"""Save on a preemption notice: every process of a run stops at the same step boundary.

A cluster that takes a machine back sends its processes SIGTERM (so does
``python -m shardops.launch`` when it is stopped) and kills them a grace period later.
``Preemption`` turns the notice into a step: call ``reached(step)`` at every step boundary,
on every process, with the number of steps done; it returns True at the same step on every
process, and the loop saves a checkpoint there and exits with ``EXIT_CODE``::

    preemption = shardops.preemption.Preemption()     # before the loop, on every process
    for step in range(start, steps):
        if preemption.reached(step):                  # `step` steps are done
            ckpt.save(step, setup, state, extra=...)  # every process: a collective save
            ckpt.wait()
            raise SystemExit(shardops.preemption.EXIT_CODE)
        state, loss = setup.train_step(state, *batch)

**Many processes** (``jax.distributed`` initialized, e.g. by ``shardops.distributed``): JAX's
own preemption service. Its notifier catches SIGTERM in whichever process receives it (one or
all), tells the coordination service, and the service picks the step every process will stop
at: one past the largest step any process has reported (``multihost_utils.
reached_preemption_sync_point``). Every process must therefore call ``reached`` at every step
and start from the same step. JAX counts from 0 and takes 0 for a process that has not asked
yet, so ``Preemption`` hands it the steps counted from the first boundary asked: a resumed
run (first boundary 37) noticed before its loop starts stops at its second boundary, where
absolute steps would have set the stop at step 1, long passed. A Python SIGTERM handler would replace JAX's notifier (the last
handler installed wins), so none must be installed after ``jax.distributed`` starts:
``Preemption`` warns if Python has one.

**One process** (no ``jax.distributed``): ``Preemption`` installs its own SIGTERM handler,
which records the notice; ``reached`` is True at the next boundary. A second SIGTERM ends the
process at once (the handler that was there before is put back at the first). ``close`` (or
leaving the ``with`` block) restores the previous handler. A handler the user installs while
it is open would take the notice from it: ``reached`` raises ``RuntimeError`` saying so (install
it before, and it acts at the second SIGTERM), and ``close`` leaves it in place.
"""

from __future__ import annotations

import signal
import threading
import warnings

from shardops import _coordination

# A preempted run exits as a process ended by SIGTERM would (128 + 15): a scheduler that
# requeues preempted jobs sees what it expects, and it is never mistaken for a finished run.
EXIT_CODE = 128 + signal.SIGTERM


class Preemption:
    """Whether the run has been told to stop, as the same step on every process.

    Construct it before the training loop on every process (in the main thread when the run
    is a single process: it installs a SIGTERM handler), then call ``reached(step)`` at every
    step boundary.
    """

    def __init__(self):
        self._notice: int | None = None  # the signal a single process received
        self._previous = None
        self._installed = False
        self._first: int | None = None  # the first step asked: JAX counts from it
        self._last: int | None = None
        self._distributed = _coordination.key_value_store() is not None
        if self._distributed:
            handler = signal.getsignal(signal.SIGTERM)
            if callable(handler):  # Python cannot tell whether it was installed before JAX's
                warnings.warn(
                    f"Preemption: a Python SIGTERM handler is installed ({handler!r}). If it "
                    "was installed after jax.distributed started, it replaced JAX's preemption "
                    "notifier and no process will ever stop at a step; leave SIGTERM to JAX "
                    "(signal.signal(signal.SIGTERM, signal.SIG_DFL) before jax.distributed "
                    "starts)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "Preemption: construct it in the main thread (a single process installs a "
                "SIGTERM handler, which Python allows only there)"
            )
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, sig, frame) -> None:
        self._notice = sig
        signal.signal(signal.SIGTERM, self._restorable())  # a second SIGTERM acts at once

    def _restorable(self):
        """The handler found, or the default where it was not installed from Python."""
        return signal.SIG_DFL if self._previous is None else self._previous

    @property
    def noticed(self) -> bool:
        """Whether this process has received the notice itself (a single process only; in a
        run of many, JAX's service holds it)."""
        return self._notice is not None

    def reached(self, step: int) -> bool:
        """True at the step boundary where every process saves and stops: ``step`` steps are
        done. Call it once at every boundary, on every process, with steps counted alike: each
        call's step is the last one's + 1 (``ValueError`` otherwise, a step asked twice
        included). In a single process, ``RuntimeError`` if SIGTERM's handler was replaced
        while the ``Preemption`` is open (the notice would never reach it)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"Preemption.reached: step must be an int ≥ 0; got {step!r}")
        if self._last is not None and step != self._last + 1:
            again = "asked twice" if step == self._last else f"after step {self._last}"
            raise ValueError(
                f"Preemption.reached: step {step} {again}; expected step {self._last + 1}: ask "
                f"once at every step boundary, the steps going up by one per call (every "
                f"process alike: they agree on a step by counting)"
            )
        if self._installed and self._notice is None and signal.getsignal(signal.SIGTERM) != (
            self._handle
        ):  # fmt: skip
            raise RuntimeError(
                f"Preemption.reached: SIGTERM's handler was replaced while this Preemption was "
                f"open (it is now {signal.getsignal(signal.SIGTERM)!r}), so a preemption notice "
                f"would never reach it and the run would be killed unsaved. Install your own "
                f"handler before constructing Preemption (it then acts at a second SIGTERM), "
                f"or close the Preemption before installing it"
            )
        if self._first is None:
            self._first = step
        self._last = step
        if self._distributed:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step - self._first)
        return self._notice is not None

    def close(self) -> None:
        """Put back the SIGTERM handler that was there before (a single process). A handler
        installed while it was open is left in place: it is the one the user wants now."""
        if self._installed:
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, self._restorable())
            self._installed = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
