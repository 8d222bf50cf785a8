"""Start the processes of a multi-process run on this host, and stop them all if one fails.

Each process is ``sys.executable -u`` running the command after ``--``, with the ``SHARDOPS_*``
variables that ``shardops.distributed.initialize()`` reads (see ``shardops.distributed``). The
script calls ``initialize()`` first; ``jax.devices()`` then lists the devices of every process.

One machine, 8 simulated CPU devices split over the processes::

    python -m shardops.launch -n 2 -- train.py --steps 100      # 2 processes × 4 devices
    python -m shardops.launch -n 4 -- train.py --steps 100      # 4 processes × 2 devices
    python -m shardops.launch -n 2 --devices 16 -- -m mypkg.train   # 2 × 8, run as a module
    python -m shardops.launch -n 1 --devices real -- train.py   # the host's real devices

``--devices D`` is the total number of simulated CPU devices on this host; each process gets
``D / N`` of them through ``SHARDOPS_LOCAL_DEVICES`` and ``XLA_FLAGS``
(``--xla_force_host_platform_device_count``), and ``JAX_PLATFORMS=cpu`` unless it is already set.
``--devices real`` simulates nothing: the processes see the host's real devices (GPU hosts).

A cluster: run the launcher on every host, with the same ``--nnodes`` and ``--coordinator`` (an
address of node 0 that every host can reach) and that host's ``--node-rank``::

    host0$ python -m shardops.launch --nnodes 2 --node-rank 0 --coordinator host0:8476 \\
               -n 1 --devices real -- train.py
    host1$ python -m shardops.launch --nnodes 2 --node-rank 1 --coordinator host0:8476 \\
               -n 1 --devices real -- train.py

Process ``i`` of node ``R`` is global process ``R * N + i`` of ``K * N`` (``N = -n``,
``K = --nnodes``). With ``--devices real`` use one process per host (``-n 1``): it drives all
the host's accelerators. Alternatively skip the
launcher and let the cluster's job (Slurm, Kubernetes...) set ``SHARDOPS_COORDINATOR``,
``SHARDOPS_NUM_PROCESSES`` and ``SHARDOPS_PROCESS_ID`` for each process it starts.

Output: each process's stdout and stderr, merged, are printed line by line to the launcher's
stdout, prefixed ``[p{global id}] ``. gloo's start-up noise is dropped: the lines
``[Gloo] Rank 3 is connected to 7 peer ranks. Expected number...`` (one per device), and the
jumbles of them that gloo's threads print when they write at once (``GlooNoiseFilter``). The
launcher's own messages go to stderr, prefixed ``shardops.launch:``; at start it prints the
coordinator, the devices per process and one ``process {id} pid {pid}`` line per process.

When a process dies: the launcher notices the first of its processes that exits non-zero or is
killed by a signal, names it on stderr, sends SIGTERM to the others, SIGKILL to those still alive
after ``--failure-grace`` seconds (default 5), and exits with the failed process's code (128 + N
for signal N). JAX takes SIGTERM as a preemption notice (its preemption notifier logs "SIGTERM
caught" and the process runs on), and a run missing a process cannot save (a save is
collective), so a JAX process usually ends at the SIGKILL: the failure grace is short. A
process on another host (or any process, without a launcher) is noticed by JAX's coordination
service when its heartbeats stop: it aborts the survivors after ``--heartbeat-timeout`` seconds
("The following tasks are unhealthy (stopped sending heartbeats)"), and each host's launcher then
stops the rest of its processes. SIGINT or SIGTERM sent to the launcher (a cluster's
preemption notice, a job's cancellation) is forwarded to every process, which gets ``--grace``
seconds (default 30: the notice period of Kubernetes and of preemptible cloud VMs) to save a
checkpoint and exit (``shardops.preemption``) before SIGKILL; a second signal sends SIGKILL at
once, and the launcher exits with 128 + the signal's number. Each process runs in a session of
its own, so the launcher only ever signals the processes it started (and anything they
started).

Errors in the options (exit code 2) are reported before anything starts, including a coordinator
port that is already in use on node 0. POSIX only (process groups).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Literal

from shardops import distributed

REAL_DEVICES = "real"
# 8 simulated devices: enough for every 2-axis mesh the tests and examples use (2×4, 4×2, 8×1).
DEFAULT_DEVICES = 8
DEFAULT_HEARTBEAT_TIMEOUT_S = distributed.DEFAULT_HEARTBEAT_TIMEOUT_S
# Time for a script that handles SIGTERM (JAX takes it as a preemption notice) to save a
# checkpoint and exit; the launcher then sends SIGKILL. 30 s: the notice period of Kubernetes
# (terminationGracePeriodSeconds) and of preemptible cloud VMs.
DEFAULT_GRACE_S = 30.0
# After a process failed: the others cannot save (a save is collective), only clean up.
DEFAULT_FAILURE_GRACE_S = 5.0
DEFAULT_HOST = "127.0.0.1"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# How often the launcher checks its processes: the delay before a failure is noticed.
POLL_S = 0.05
# How long the output threads may drain a stopped process's pipe (a grandchild may hold it).
DRAIN_S = 5.0

_GLOO_NOISE = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
# The pieces gloo writes one at a time ("[Gloo] Rank ", 3, " is connected to ", 7, ...). Its
# threads (one per device) write at once, so a line can be a jumble of pieces of several messages,
# e.g. "[Gloo] Rank [Gloo] Rank 6 is connected to ... : 77".
_GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :"
)
_PREFIX = "shardops.launch:"
_HELP = "see python -m shardops.launch --help"


class LaunchError(ValueError):
    """Options that cannot start a run (a bad count, a busy port); ``main`` prints it and
    returns 2."""


# --------------------------------------------------------------------------------------------
# Pure helpers: the layout of a run and each process's environment.


def devices_per_process(devices: int | Literal["real"], nproc: int) -> int | None:
    """The simulated CPU devices of each of ``nproc`` processes sharing ``devices``; None for
    ``"real"`` (no simulation)."""
    if devices == REAL_DEVICES:
        return None
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise LaunchError(
            f"--devices must be a positive integer or {REAL_DEVICES!r}; got {devices!r}"
        )
    if devices % nproc:
        divisors = [k for k in range(1, devices + 1) if devices % k == 0]
        raise LaunchError(
            f"--devices {devices} does not split evenly over -n {nproc} processes; use a "
            f"multiple of {nproc} (e.g. --devices {nproc * max(1, devices // nproc)}) or an -n "
            f"that divides {devices} ({', '.join(map(str, divisors))})"
        )
    return devices // nproc


def xla_flags_with_device_count(xla_flags: str | None, count: int) -> str:
    """``xla_flags`` with its device-count flag (if any) replaced by ``count`` simulated host
    devices; every other flag is kept, in order."""
    kept = [
        flag
        for flag in (xla_flags or "").split()
        if flag != DEVICE_COUNT_FLAG and not flag.startswith(DEVICE_COUNT_FLAG + "=")
    ]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={count}"])


def child_env(
    base: Mapping[str, str],
    *,
    coordinator: str,
    num_processes: int,
    process_id: int,
    local_devices: int | None,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
) -> dict[str, str]:
    """The environment of global process ``process_id``: ``base`` plus the ``SHARDOPS_*``
    variables and ``PYTHONUNBUFFERED=1``. With ``local_devices`` set, also ``XLA_FLAGS`` with
    that device count and ``JAX_PLATFORMS=cpu`` (unless ``base`` sets it); with None, the real
    devices: ``SHARDOPS_LOCAL_DEVICES`` is removed and ``XLA_FLAGS`` left as it is."""
    env = dict(base)
    env[distributed.COORDINATOR] = coordinator
    env[distributed.NUM_PROCESSES] = str(num_processes)
    env[distributed.PROCESS_ID] = str(process_id)
    env[distributed.HEARTBEAT_TIMEOUT] = str(heartbeat_timeout_s)
    env["PYTHONUNBUFFERED"] = "1"
    if local_devices is None:
        env.pop(distributed.LOCAL_DEVICES, None)
    else:
        env[distributed.LOCAL_DEVICES] = str(local_devices)
        env["XLA_FLAGS"] = xla_flags_with_device_count(env.get("XLA_FLAGS"), local_devices)
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def parse_coordinator(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``host:port`` address (``[::1]:port`` for IPv6)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(
            f"--coordinator must be HOST:PORT with a port in [1, 65535], e.g. "
            f"{DEFAULT_HOST}:8476; got {address!r}"
        )
    return host, int(port)


def free_port() -> int:
    """A TCP port that is free now (the kernel's pick). Another program could take it before
    the coordinator binds it; a clash then fails at start-up, in ``jax.distributed``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raise ``LaunchError`` if ``port`` is in use. The coordinator (JAX's gRPC service) binds
    every interface, ``[::]:port``, so the check binds all interfaces too."""
    probes = [(socket.AF_INET, "")]
    if socket.has_ipv6:
        probes.append((socket.AF_INET6, "::"))
    for family, address in probes:
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with s:
            # gRPC also sets SO_REUSEADDR: a port whose old connections linger in TIME_WAIT is
            # free for it, so it is free here. No SO_REUSEPORT: a port another coordinator
            # listens on (gRPC would share it silently) counts as in use.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError as e:
                if family == socket.AF_INET6 and e.errno != errno.EADDRINUSE:
                    continue  # IPv6 present but unusable: says nothing about the port
                raise LaunchError(
                    f"port {port} on {host} is already in use; pass another --port, or omit "
                    f"--port to pick a free one ({e.strerror})"
                ) from None


def exit_code(returncode: int) -> int:
    """A process's exit status as a shell reports it: 128 + N when killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``'exited with code 3'`` or ``'was killed by SIGKILL'``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


def is_gloo_noise(line: str) -> bool:
    """True for gloo's ``[Gloo] Rank r is connected to p peer ranks...`` start-up lines, and for
    lines made only of pieces of them (numbers and the message's words), which is what gloo's
    threads print when they write at the same time."""
    if _GLOO_NOISE.match(line):
        return True
    rest, pieces = _GLOO_PIECES.subn("", line)
    return pieces > 0 and re.fullmatch(r"[\d\s]*", rest) is not None


class GlooNoiseFilter:
    """Drops one process's gloo noise, line by line: the lines ``is_gloo_noise`` flags, and the
    blank or number-only lines that follow them (the leftover pieces of jumbled messages, such as
    ``"7"``). Any other line ends the run of noise, so a script's own numbers are kept."""

    def __init__(self):
        self._in_noise = False

    def keep(self, line: str) -> bool:
        if is_gloo_noise(line):
            self._in_noise = True
            return False
        if self._in_noise and re.fullmatch(r"[\d\s]*", line):
            return False
        self._in_noise = False
        return True


# --------------------------------------------------------------------------------------------
# Running the processes.


def _say(message: str) -> None:
    print(f"{_PREFIX} {message}", file=sys.stderr, flush=True)


class _Process:
    """One started process: its global id, its ``Popen`` and the thread printing its output."""

    def __init__(self, global_id: int, popen: subprocess.Popen, out, lock: threading.Lock):
        self.global_id = global_id
        self.popen = popen
        self.thread = threading.Thread(
            target=self._forward_output, args=(out, lock), name=f"p{global_id}", daemon=True
        )
        self.thread.start()

    def _forward_output(self, out, lock: threading.Lock) -> None:
        prefix = f"[p{self.global_id}] "
        noise = GlooNoiseFilter()
        with self.popen.stdout as pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode(errors="replace").rstrip("\r\n")
                if not noise.keep(line):
                    continue
                with lock:
                    try:
                        out.write(prefix + line + "\n")
                        out.flush()
                    except (BrokenPipeError, ValueError):  # stdout closed: keep draining
                        pass

    def running(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to this process's group (it and what it started), while it runs. Its
        session is its own (``start_new_session``), so nothing else is in the group."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):  # exited since poll()
                os.killpg(self.popen.pid, sig)


class _Signals:
    """SIGINT/SIGTERM received by the launcher while its processes run (main thread only)."""

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, sig, frame):
        self.received.append(sig)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _stop(processes: Sequence[_Process], sig: int, grace_s: float, signals: _Signals) -> None:
    """Send ``sig`` to every running process, SIGKILL those alive after ``grace_s`` (or at a
    further SIGINT/SIGTERM to the launcher), then reap them all."""
    for p in processes:
        p.signal(sig)
    deadline = time.monotonic() + grace_s
    seen = len(signals.received)
    while (
        any(p.running() for p in processes)
        and time.monotonic() < deadline
        and len(signals.received) == seen
    ):
        time.sleep(POLL_S)
    for p in processes:
        p.signal(signal.SIGKILL)
    for p in processes:
        p.popen.wait()


def _supervise(processes: Sequence[_Process], grace_s: float, failure_grace_s: float,
               signals: _Signals) -> int:  # fmt: skip
    """Wait until every process exits 0 (→ 0), one fails, or the launcher is signalled; in the
    last two cases stop the others (``failure_grace_s``, ``grace_s``) and return the exit
    code."""
    while True:
        if signals.received:
            sig = signals.received[0]
            running = [p for p in processes if p.running()]
            _say(
                f"received {signal.Signals(sig).name}; forwarding it to {len(running)} process(es)"
            )
            _stop(processes, sig, grace_s, signals)
            return 128 + sig
        failed = None
        running = []
        for p in processes:
            returncode = p.popen.poll()
            if returncode is None:
                running.append(p)
            elif returncode != 0 and failed is None:
                failed = p
        if failed is not None:
            returncode = failed.popen.returncode
            _say(
                f"process {failed.global_id} (pid {failed.popen.pid}) "
                f"{describe_exit(returncode)}; stopping the other {len(running)} process(es)"
            )
            _stop(processes, signal.SIGTERM, failure_grace_s, signals)
            return exit_code(returncode)
        if not running:
            return 0
        time.sleep(POLL_S)


def _check_options(
    command: list[str],
    nproc: int,
    nnodes: int,
    node_rank: int,
    heartbeat_timeout: int,
    grace: float,
    failure_grace: float,
) -> None:
    """Refuse, with a ``LaunchError`` naming the option, a launch that cannot work: no command,
    a count below 1, a node rank outside ``[0, nnodes)``, a heartbeat that is not whole seconds
    ≥ 1, a negative grace."""
    if not command:
        raise LaunchError(
            "no command after --: give the Python script (or -m module) to run, e.g. "
            "python -m shardops.launch -n 2 -- train.py --steps 100"
        )
    for name, value, low in (("-n/--nproc", nproc, 1), ("--nnodes", nnodes, 1)):
        distributed.integer_at_least(name, value, low, LaunchError, text=False)
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise LaunchError(
            f"--node-rank {node_rank} is not in [0, --nnodes {nnodes}); number the nodes "
            f"0 to {nnodes - 1}, with the coordinator on node 0"
        )
    if isinstance(heartbeat_timeout, bool) or not isinstance(heartbeat_timeout, int):
        raise LaunchError(f"--heartbeat-timeout must be whole seconds; got {heartbeat_timeout!r}")
    if heartbeat_timeout < 1:
        raise LaunchError(f"--heartbeat-timeout must be ≥ 1 second; got {heartbeat_timeout}")
    for name, value in (("--grace", grace), ("--failure-grace", failure_grace)):
        if not value >= 0:
            raise LaunchError(f"{name} must be ≥ 0 seconds; got {value}")


def _coordinator_address(coordinator: str | None, nnodes: int, node_rank: int) -> str:
    """The coordinator's ``host:port``: the one given (checked, and on node 0 free to bind), or
    on a single node ``127.0.0.1`` and a free port."""
    if coordinator is not None:
        host, port = parse_coordinator(coordinator)
        if node_rank == 0:
            check_port_free(host, port)
        return coordinator
    if nnodes > 1:
        raise LaunchError(
            f"--nnodes {nnodes} needs --coordinator HOST:PORT, an address of node 0 that "
            "every node can reach (the same on every node), e.g. --coordinator host0:8476"
        )
    return f"{DEFAULT_HOST}:{free_port()}"


def _start_process(
    command: list[str],
    coordinator: str,
    num_processes: int,
    global_id: int,
    local_devices: int | None,
    heartbeat_timeout: int,
    out,
    lock: threading.Lock,
) -> _Process:
    """Start process ``global_id`` of the run (``sys.executable -u *command`` in its own session,
    with ``child_env``'s environment), its output forwarded to ``out`` under ``lock``."""
    env = child_env(
        os.environ,
        coordinator=coordinator,
        num_processes=num_processes,
        process_id=global_id,
        local_devices=local_devices,
        heartbeat_timeout_s=heartbeat_timeout,
    )
    popen = subprocess.Popen(
        [sys.executable, "-u", *command],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return _Process(global_id, popen, out, lock)


def launch(
    command: Sequence[str],
    *,
    nproc: int,
    devices: int | Literal["real"] = DEFAULT_DEVICES,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: str | None = None,
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
    grace: float = DEFAULT_GRACE_S,
    failure_grace: float = DEFAULT_FAILURE_GRACE_S,
) -> int:
    """Run ``sys.executable -u *command`` as ``nproc`` processes of a multi-process run and
    return the run's exit code (see the module doc).

    Arguments (the command-line options of the same names):
        command: the Python arguments, e.g. ``["train.py", "--steps", "100"]`` or
            ``["-m", "mypkg.train"]``.
        nproc: processes on this host (``-n``).
        devices: simulated CPU devices on this host, split evenly over the processes, or
            ``"real"`` for the host's real devices.
        nnodes, node_rank: hosts in the run, and this host's rank in ``[0, nnodes)``.
        coordinator: ``host:port`` of the coordinator, on node 0; required when
            ``nnodes > 1``. Default: ``127.0.0.1`` and a free port.
        heartbeat_timeout: seconds without a heartbeat before JAX declares a process dead.
        grace: seconds between the signal the launcher forwards (SIGINT, SIGTERM) and SIGKILL.
        failure_grace: seconds between SIGTERM and SIGKILL when a process has failed.

    Returns:
        0 when every process exits 0; else the first failed process's exit code (128 + N for
        signal N), or 128 + N when the launcher itself received signal N.

    Raises ``LaunchError`` (before starting anything) for options that cannot work.
    """
    command = list(command)
    _check_options(command, nproc, nnodes, node_rank, heartbeat_timeout, grace, failure_grace)
    local_devices = devices_per_process(devices, nproc)
    coordinator = _coordinator_address(coordinator, nnodes, node_rank)  # host:port

    num_processes = nnodes * nproc
    first = node_rank * nproc
    where = (
        "the real devices"
        if local_devices is None
        else f"{local_devices} simulated CPU device(s) per process ({devices} on this node)"
    )
    _say(
        f"coordinator {coordinator}; processes {first}..{first + nproc - 1} of {num_processes} "
        f"on node {node_rank} of {nnodes}; {where}"
    )
    out = sys.stdout
    lock = threading.Lock()
    processes: list[_Process] = []
    with _Signals() as signals:
        try:
            for i in range(nproc):
                global_id = first + i
                process = _start_process(command, coordinator, num_processes, global_id,
                                         local_devices, heartbeat_timeout, out, lock)  # fmt: skip
                processes.append(process)
                _say(f"process {global_id} pid {process.popen.pid}")
            return _supervise(processes, grace, failure_grace, signals)
        finally:
            # An exception (or a KeyboardInterrupt before the handlers) must not leave orphans.
            if any(p.running() for p in processes):
                _stop(processes, signal.SIGKILL, 0.0, signals)
            for p in processes:
                p.thread.join(DRAIN_S)


# --------------------------------------------------------------------------------------------
# Command line.


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise LaunchError(f"{message} ({_HELP})")


def _devices_arg(text: str) -> int | str:
    if text == REAL_DEVICES:
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        # argparse prefixes "argument --devices: ".
        raise argparse.ArgumentTypeError(
            f"must be a positive integer or {REAL_DEVICES!r}; got {text!r}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m shardops.launch",
        usage="python -m shardops.launch -n N [options] -- script.py [args...]",
        description="Start N processes of a multi-process JAX run on this host (see the "
        "shardops.launch module doc).",
    )
    p.add_argument("-n", "--nproc", type=int, required=True, help="processes on this host")
    p.add_argument(
        "--devices",
        type=_devices_arg,
        default=DEFAULT_DEVICES,
        metavar="D|real",
        help=f"simulated CPU devices on this host, split over the processes (default "
        f"{DEFAULT_DEVICES}); 'real' to use the host's real devices",
    )
    p.add_argument("--nnodes", type=int, default=1, help="hosts in the run (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's rank (default 0)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="node 0's coordinator address; required with --nnodes > 1 (default "
        f"{DEFAULT_HOST} and a free port)",
    )
    where.add_argument("--port", type=int, help=f"shorthand for --coordinator {DEFAULT_HOST}:PORT")
    p.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        metavar="S",
        help=f"seconds before a silent process is declared dead (default "
        f"{DEFAULT_HEARTBEAT_TIMEOUT_S})",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="S",
        help=f"seconds the processes get after the SIGINT/SIGTERM the launcher forwards, before "
        f"SIGKILL: a SIGTERM is a preemption notice, time to save a checkpoint (default "
        f"{DEFAULT_GRACE_S:g})",
    )
    p.add_argument(
        "--failure-grace",
        type=float,
        default=DEFAULT_FAILURE_GRACE_S,
        metavar="S",
        help=f"seconds between SIGTERM and SIGKILL for the other processes when one fails "
        f"(default {DEFAULT_FAILURE_GRACE_S:g})",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m shardops.launch [options] -- script.py args...``.
    Returns the run's exit code, or 2 for bad options (printed to stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        options, command = argv[:split], argv[split + 1 :]
    else:
        options, command = argv, []
    try:
        try:
            args, extra = _parser().parse_known_args(options)
        except SystemExit as e:  # --help
            return e.code if isinstance(e.code, int) else 0
        if extra:
            raise LaunchError(
                f"unrecognized arguments before --: {' '.join(extra)}; options go before --, "
                "the command after it, e.g. python -m shardops.launch -n 2 -- train.py "
                f"--steps 100 ({_HELP})"
            )
        coordinator = args.coordinator
        if args.port is not None:
            if not 0 < args.port < 65536:
                raise LaunchError(f"--port must be in [1, 65535]; got {args.port}")
            coordinator = f"{DEFAULT_HOST}:{args.port}"
        return launch(
            command,
            nproc=args.nproc,
            devices=args.devices,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            coordinator=coordinator,
            heartbeat_timeout=args.heartbeat_timeout,
            grace=args.grace,
            failure_grace=args.failure_grace,
        )
    except LaunchError as e:
        print(f"{_PREFIX} error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
