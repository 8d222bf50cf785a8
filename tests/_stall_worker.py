"""A process of a run that trains a small MLP (``2d`` on 4×2) under ``shardops.watchdog`` and,
in one process, stalls in Python between two steps (tests/test_resilience.py).

    python -m shardops.launch -n 2 -- tests/_stall_worker.py STALLED_PROCESS STALL_STEP TIMEOUT

Before training, every process writes a key to the coordination service's store
(``shardops._coordination``) and prints every process's keys as it reads them: the private JAX
API the watchdog stands on, checked on its own.
"""

import shardops.distributed

shardops.distributed.initialize()  # before any other JAX call

import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import shardops  # noqa: E402
import shardops_models as models  # noqa: E402
from shardops import _coordination  # noqa: E402
from shardops.watchdog import Watchdog  # noqa: E402
from shardops_models.training.loop import StepsInFlight  # noqa: E402

SIZES, BATCH = (16, 32, 8), 16


def main(stalled: int, stall_step: int, timeout_s: float) -> None:
    me = jax.process_index()
    store = _coordination.key_value_store()
    store.set(f"test/{me}", f"value of {me}")
    multihost_utils.sync_global_devices("keys written")
    print(f"store {sorted(store.dir('test/').items())}", flush=True)

    setup = models.build("2d", shardops.make_mesh({"data": 4, "model": 2}),
                         optimizer=optax.sgd(0.1), sizes=SIZES)  # fmt: skip
    state = setup.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
    y = np.eye(SIZES[-1], dtype=np.float32)[rng.integers(0, SIZES[-1], BATCH)]
    rows = setup.process_rows(BATCH)
    placed = setup.place_local_batch(x[rows], y[rows], batch=BATCH)
    inflight = StepsInFlight()
    with Watchdog(timeout_s) as watchdog:
        for step in range(100_000):
            watchdog.step(step)
            if me == stalled and step == stall_step:
                print(f"stalling at step {step}", flush=True)
                time.sleep(3600)  # stuck in Python: heartbeats still arrive
            state, loss = setup.train_step(state, *placed)
            inflight.add(loss)
    print("trained to the end: the stall was not caught", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
