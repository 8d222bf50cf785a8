"""A worker for tests/test_launch.py that imports no JAX: it reports what the launcher gave it
(its environment) and what the launcher sends it (signals), so those tests take a second, not a
JAX start-up per process.

    python -m shardops.launch -n 3 -- tests/_launch_probe.py env
    python -m shardops.launch -n 2 --grace 5 -- tests/_launch_probe.py signals 0.5

``env``      print one line ``env {json}`` of the launcher's variables and those the tests set
``signals W`` print ``ready``, then wait; on SIGINT or SIGTERM print ``got SIGINT`` (or
             ``got SIGTERM``), spend ``W`` seconds as a shutdown handler saving a checkpoint
             would, print ``saved`` and exit 0
``fail``     as ``signals``, but process 1 exits with code 3 once every process is ready
``ignore``   print ``ready``, then wait; on SIGINT or SIGTERM print ``got SIGINT`` (or
             ``got SIGTERM``) and carry on waiting: a process that ignores the notice

With ``SHARDOPS_TEST_READY_DIR`` set, each process also marks itself ready there (a file per
process), which is how process 1 of ``fail`` knows the others can take a signal.
"""

import json
import os
import pathlib
import signal
import sys
import time

REPORTED = (
    "SHARDOPS_COORDINATOR", "SHARDOPS_NUM_PROCESSES", "SHARDOPS_PROCESS_ID",
    "SHARDOPS_LOCAL_DEVICES", "SHARDOPS_HEARTBEAT_TIMEOUT", "JAX_PLATFORMS", "XLA_FLAGS",
    "PYTHONUNBUFFERED", "SHARDOPS_TEST_CALLER",
)  # fmt: skip


def wait_for_signals(work_s: float | None, fail: bool) -> int:
    """``work_s`` None: ignore the signals (say so, and carry on)."""

    def handler(sig, frame):
        print(f"got {signal.Signals(sig).name}", flush=True)
        if work_s is None:
            return
        time.sleep(work_s)  # the shutdown work the grace period is for
        print("saved", flush=True)
        sys.exit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    me, n = os.environ.get("SHARDOPS_PROCESS_ID"), int(os.environ["SHARDOPS_NUM_PROCESSES"])
    marks = os.environ.get("SHARDOPS_TEST_READY_DIR")
    if marks:
        pathlib.Path(marks, f"{me}.ready").touch()
    print("ready", flush=True)
    if fail and me == "1":
        if not marks:
            sys.exit("fail mode needs SHARDOPS_TEST_READY_DIR")
        deadline = time.monotonic() + 30
        while not all(pathlib.Path(marks, f"{i}.ready").exists() for i in range(n)):
            if time.monotonic() > deadline:
                sys.exit("the other processes never became ready")
            time.sleep(0.02)
        return 3
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "env" and len(sys.argv) == 2:
        print("env " + json.dumps({k: os.environ.get(k) for k in REPORTED}), flush=True)
        sys.exit(0)
    if mode in ("signals", "fail") and len(sys.argv) == 3:
        sys.exit(wait_for_signals(float(sys.argv[2]), mode == "fail"))
    if mode == "ignore" and len(sys.argv) == 2:
        sys.exit(wait_for_signals(None, fail=False))
    sys.exit(f"usage: {sys.argv[0]} env | signals SECONDS | fail SECONDS | ignore; got "
             f"{sys.argv[1:]}")  # fmt: skip
