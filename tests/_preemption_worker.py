"""A process of a run whose preemption notice arrives before its loop starts (a resumed run,
SIGTERM while it loads and compiles): tests/test_resilience.py.

    python -m shardops.launch -n 2 -- tests/_preemption_worker.py FIRST_STEP

Process 0 sends itself SIGTERM (JAX's notifier takes it), waits for the coordination service
to spread it, then every process runs boundaries FIRST_STEP, FIRST_STEP + 1, … asking
``Preemption.reached`` at each, and prints the boundary where it is True.
"""

import shardops.distributed

shardops.distributed.initialize()  # before any other JAX call

import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from shardops.preemption import Preemption  # noqa: E402


def main(first: int) -> None:
    if jax.process_index() == 0:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(2)  # the notice reaches the coordination service before any boundary is asked
    multihost_utils.sync_global_devices("noticed")
    with Preemption() as preemption:
        for step in range(first, first + 50):
            if preemption.reached(step):
                print(f"stops at boundary {step}", flush=True)
                return
            time.sleep(0.02)
    print("never stopped", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
