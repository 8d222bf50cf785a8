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
and start from the same step. A Python SIGTERM handler would replace JAX's notifier (the last
handler installed wins), so none must be installed: ``Preemption`` refuses to start if one is.

**One process** (no ``jax.distributed``): ``Preemption`` installs its own SIGTERM handler,
which records the notice; ``reached`` is True at the next boundary. A second SIGTERM ends the
process at once (the handler that was there before is put back at the first). ``close`` (or
leaving the ``with`` block) restores the previous handler.
"""

from __future__ import annotations

import signal
import threading

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
        self._distributed = _coordination.key_value_store() is not None
        if self._distributed:
            handler = signal.getsignal(signal.SIGTERM)
            if callable(handler):
                raise RuntimeError(
                    f"Preemption: a Python SIGTERM handler is installed ({handler!r}); in a "
                    "run under jax.distributed it replaces JAX's preemption notifier, so the "
                    "processes cannot agree on a step to save at. Remove the handler "
                    "(signal.signal(signal.SIGTERM, signal.SIG_DFL)) before jax.distributed "
                    "starts, or leave SIGTERM to JAX"
                )
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "Preemption: construct it in the main thread (a single process installs a "
                "SIGTERM handler, which Python allows only there)"
            )
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, sig, frame) -> None:
        self._notice = sig
        signal.signal(signal.SIGTERM, self._previous)  # a second SIGTERM acts at once

    @property
    def noticed(self) -> bool:
        """Whether this process has received the notice itself (a single process only; in a
        run of many, JAX's service holds it)."""
        return self._notice is not None

    def reached(self, step: int) -> bool:
        """True at the step boundary where every process saves and stops: ``step`` steps are
        done. Call it at every boundary, on every process, with steps counted alike."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"Preemption.reached: step must be an int ≥ 0; got {step!r}")
        if self._distributed:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self._notice is not None

    def close(self) -> None:
        """Put back the SIGTERM handler that was there before (a single process)."""
        if self._previous is not None:
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
