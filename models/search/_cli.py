"""``python -m shardops_models.search``: rank every strategy × mesh for a model, a batch and a
device count, and print the table (``--compile-top N``: with the compiled ledgers of the best).

    python -m shardops_models.search --model gpt --batch 16 --devices 8 --compile-top 3
    python -m shardops_models.search --model wide --batch 1024 --devices 64 --hardware h100-ib
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys

import shardops
from shardops_models.search._hardware import HARDWARE, calibrate
from shardops_models.search._search import (
    MODELS,
    OPTIMIZERS,
    PRECISIONS,
    Search,
    _simulated_env,
    _worker,
    search,
)  # fmt: skip
from shardops_models.search._table import _compiled_table
from shardops_models.strategies.remat import POLICIES


def _parser() -> argparse.ArgumentParser:
    """The command line's arguments: the model, batch and devices (or a mesh) to search, the
    options ``search`` takes, and what to write."""
    p = argparse.ArgumentParser(
        prog="python -m shardops_models.search", description=__doc__.split("\n\n")[0],
    )  # fmt: skip
    p.add_argument("--model", choices=sorted(MODELS), default="seed",
                   help="; ".join(f"{k}: {v}" for k, v in MODELS.items()))  # fmt: skip
    p.add_argument("--batch", type=int, help="global batch (examples)")
    p.add_argument("--devices", type=int, help="how many devices to search over")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (GPT)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="float32")
    p.add_argument("--hardware", default="h100-nvlink",
                   help=f"a preset ({', '.join(sorted(HARDWARE))}) or 'calibrate' (measure this "
                        f"machine's devices)")  # fmt: skip
    p.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory per device; candidates that need more are ruled out",
    )
    p.add_argument("--strategies", nargs="*", default=None,
                   help="presets or composite names (2d+1f1b, fsdp+ring, 2d+ep) instead of "
                        "every one that applies")  # fmt: skip
    p.add_argument("--microbatches", nargs="*", type=int, default=None, metavar="M",
                   help="the microbatch counts a pipeline candidate is traced at (default P, "
                        "2P and 4P on a mesh of P pipe stages)")  # fmt: skip
    p.add_argument("--remat", nargs="*", default=None, metavar="POLICY",
                   help="trace each candidate under each of these remat policies (none, full, "
                        "matmuls, offload); default: none, then matmuls and full where a "
                        "candidate does not fit the memory")  # fmt: skip
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="search this mesh only, e.g. replica=2,data=2,model=2 or 4x2 (default: "
                        "every data×model of --devices)")  # fmt: skip
    p.add_argument(
        "--compile-top",
        type=int,
        default=0,
        metavar="K",
        help="compile (never run) the best K candidates and show their ledgers",
    )
    p.add_argument("--recount", action="store_true",
                   help="rank the compiled candidates again, their latency counting the "
                        "collectives the compiled program runs (XLA combines all-reduces)")  # fmt: skip
    p.add_argument("--json", default=None, metavar="PATH", help="write the ranking as JSON")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    return p


def _checked_meshes(p: argparse.ArgumentParser, args) -> list[dict[str, int]] | None:
    """The meshes ``--mesh`` asks for (None: every ``data × model`` of ``--devices``), with
    ``args.devices`` set from it; an inconsistent or missing size exits through ``p.error``."""
    meshes = None
    if args.mesh is not None:
        try:
            shape = shardops.parse_mesh(args.mesh)
        except ValueError as e:
            p.error(f"--{e}")
        n = math.prod(shape.values())
        if args.devices is not None and args.devices != n:
            p.error(f"--mesh {args.mesh} has {n} devices but --devices is {args.devices}")
        args.devices, meshes = n, [shape]
    if args.batch is None or args.devices is None:
        p.error("--batch and --devices (or --mesh) are required")
    if args.devices < 1:
        p.error(f"--devices must be a positive integer; got {args.devices}")
    if args.batch < 1:
        p.error(f"--batch must be a positive integer; got {args.batch}")
    if args.microbatches is not None and not all(m > 0 for m in args.microbatches or [0]):
        p.error(f"--microbatches needs positive integers; got {args.microbatches}")
    if args.remat is not None and not all(r in POLICIES for r in args.remat or ["-"]):
        p.error(f"--remat needs policies among {', '.join(POLICIES)}; got {args.remat}")
    if args.compile_top < 0:
        p.error(f"--compile-top must be ≥ 0; got {args.compile_top}")
    if args.hardware != "calibrate" and args.hardware not in HARDWARE:
        p.error(f"unknown --hardware {args.hardware!r}; choose one of "
                f"{sorted(HARDWARE)} or 'calibrate'")  # fmt: skip
    return meshes


def _print_result(result: Search, args) -> None:
    """The ranking (and the compiled ledgers of ``--compile-top``) as tables on stdout, and the
    JSON file of ``--json``."""
    from rich.console import Console

    console = Console(width=200)
    console.print(result.table())
    if args.compile_top:
        console.print(_compiled_table(result))
    console.print(f"searched in {result.seconds:.1f} s; bytes are the traced step's, a scanned "
                  f"layer's collectives once per layer (Ledger.totals()); times use "
                  f"{result.hardware.source or result.hardware.name}")  # fmt: skip
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result.as_dict(), indent=1))
        console.print(f"wrote {args.json}")


def main(argv=None) -> Search | None:
    """``python -m shardops_models.search``: search, print the ranking and return it (None in a
    ``--worker`` subprocess). Any device count is traced in this process (on an
    ``AbstractMesh``); with ``--compile-top`` or ``--hardware calibrate`` and more devices than
    this process has, the same command re-runs in a subprocess on simulated CPU devices, and
    this process exits with its status."""
    p = _parser()
    args = p.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return None
    meshes = _checked_meshes(p, args)

    import jax

    if (args.compile_top or args.hardware == "calibrate") and args.devices > jax.device_count():
        # Compiling and calibrating need the devices: re-run this command where JAX simulates
        # enough CPU devices; it compiles, never runs. (A search alone traces on an
        # AbstractMesh.)
        print(f"searching {args.devices} devices on simulated CPU devices (this process has "
              f"{jax.device_count()})", file=sys.stderr, flush=True)  # fmt: skip
        argv = sys.argv[1:] if argv is None else list(argv)
        proc = subprocess.run([sys.executable, "-m", "shardops_models.search", *argv],
                              env=_simulated_env(args.devices))  # fmt: skip
        sys.exit(proc.returncode)
    hardware = calibrate() if args.hardware == "calibrate" else args.hardware
    memory = None if args.memory_gb is None else args.memory_gb * 1e9
    try:
        result = search(args.model, args.batch, args.devices, seq=args.seq,
                      optimizer=args.optimizer, precision=PRECISIONS[args.precision],
                      hardware=hardware, memory_limit=memory, strategies=args.strategies,
                      compile_top=args.compile_top, recount=args.recount,
                      meshes=meshes, microbatches=args.microbatches,
                      remat=args.remat)  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    _print_result(result, args)
    return result
