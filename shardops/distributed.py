"""Join a multi-process run: JAX's multi-controller runtime, set up from the environment.

Every process of a run calls ``initialize()`` first, before any other JAX call::

    import shardops.distributed
    shardops.distributed.initialize()  # a no-op when the script runs alone
    import jax  # jax.devices() now lists the devices of every process

``python -m shardops.launch`` (``shardops.launch``) starts the processes and sets, for each:

=============================  ==========================================================
``SHARDOPS_COORDINATOR``       ``host:port`` of process 0's coordination service
``SHARDOPS_NUM_PROCESSES``     N, the processes of the run (all hosts)
``SHARDOPS_PROCESS_ID``        this process, in ``[0, N)``
``SHARDOPS_LOCAL_DEVICES``     simulated CPU devices of this process (unset: the real ones)
``SHARDOPS_HEARTBEAT_TIMEOUT`` seconds without a heartbeat before a peer is declared dead
=============================  ==========================================================

On a cluster, set the same variables in each host's job (or run ``shardops.launch`` on every
host with ``--nnodes``/``--node-rank``/``--coordinator``). The engine is JAX's own:
``jax.distributed.initialize`` and its coordination service; CPU collectives go over gloo.

A peer that dies is noticed by the coordination service when its heartbeats stop: every other
process then aborts ("The following tasks are unhealthy (stopped sending heartbeats)") after
``SHARDOPS_HEARTBEAT_TIMEOUT`` seconds (default 10), rather than waiting forever in a collective.
"""

from __future__ import annotations

import dataclasses
import os

COORDINATOR = "SHARDOPS_COORDINATOR"
NUM_PROCESSES = "SHARDOPS_NUM_PROCESSES"
PROCESS_ID = "SHARDOPS_PROCESS_ID"
LOCAL_DEVICES = "SHARDOPS_LOCAL_DEVICES"
HEARTBEAT_TIMEOUT = "SHARDOPS_HEARTBEAT_TIMEOUT"

DEFAULT_HEARTBEAT_TIMEOUT_S = 10
# How long process 0 waits for every peer to connect (a peer that never starts, a wrong port).
INITIALIZATION_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process's place in a run, as the launcher (or the cluster's job) set it."""

    coordinator: str
    num_processes: int
    process_id: int
    local_devices: int | None
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S


def integer_at_least(
    name: str, value, low: int, error: type[Exception] = ValueError, *, text: bool = True
) -> int:
    """``value`` (an int, or with ``text`` the text of one, as the environment gives it) as an
    int ≥ ``low``; else ``error`` naming ``name``. The one check of the launcher's options and
    the variables it sets."""
    if text and isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise error(f"{name} must be an integer ≥ {low}; got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise error(f"{name} must be an integer ≥ {low}; got {value!r}")
    return value


def _int(environ, name: str, low: int) -> int:
    return integer_at_least(name, environ[name], low)


def from_env(environ=None) -> Launch | None:
    """The launch read from ``environ`` (default ``os.environ``); None when no
    ``SHARDOPS_NUM_PROCESSES`` is set (a single-process run)."""
    environ = os.environ if environ is None else environ
    if NUM_PROCESSES not in environ:
        return None
    missing = [v for v in (COORDINATOR, PROCESS_ID) if v not in environ]
    if missing:
        raise ValueError(
            f"{NUM_PROCESSES} is set but {' and '.join(missing)} not: a multi-process run needs "
            f"all of {COORDINATOR}, {NUM_PROCESSES} and {PROCESS_ID} (python -m shardops.launch "
            "sets them)"
        )
    num = _int(environ, NUM_PROCESSES, 1)
    pid = _int(environ, PROCESS_ID, 0)
    if pid >= num:
        raise ValueError(f"{PROCESS_ID} = {pid} is not in [0, {NUM_PROCESSES} = {num})")
    coordinator = environ[COORDINATOR]
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{COORDINATOR} must be host:port; got {coordinator!r}")
    local = _int(environ, LOCAL_DEVICES, 1) if environ.get(LOCAL_DEVICES) else None
    heartbeat = (
        _int(environ, HEARTBEAT_TIMEOUT, 1)
        if environ.get(HEARTBEAT_TIMEOUT)
        else DEFAULT_HEARTBEAT_TIMEOUT_S
    )
    return Launch(coordinator, num, pid, local, heartbeat)


_LAUNCH: Launch | None = None


def initialize(environ=None) -> Launch | None:
    """Join the run described by the environment (see the module doc); a no-op returning None
    when there is none. Call it before any other JAX call: JAX fixes its devices when its
    backend starts."""
    global _LAUNCH
    launch = from_env(environ)
    if launch is None or launch == _LAUNCH:
        return launch
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "shardops.distributed.initialize() must run before any other JAX call (JAX's "
            "backend has already started, with this process's devices only); move it to the "
            "top of the script"
        )
    if launch.local_devices is not None:
        jax.config.update("jax_num_cpu_devices", launch.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=launch.coordinator,
        num_processes=launch.num_processes,
        process_id=launch.process_id,
        initialization_timeout=INITIALIZATION_TIMEOUT_S,
        heartbeat_timeout_seconds=launch.heartbeat_timeout_s,
    )
    _LAUNCH = launch
    return launch


def process_index() -> int:
    """This process's index (0 when not distributed), without starting JAX's backend early."""
    if _LAUNCH is not None:
        return _LAUNCH.process_id
    import jax

    return jax.process_index()


def is_main() -> bool:
    """True on process 0: the one that prints and writes files in the examples."""
    return process_index() == 0
