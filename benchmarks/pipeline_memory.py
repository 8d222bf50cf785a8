"""Pipeline memory: the temp memory per device of ``shardops.pipeline.pipeline_value_and_grad``
under GPipe and 1F1B as the microbatch count M grows at a fixed microbatch size.

    python benchmarks/pipeline_memory.py          # pipe = 2 and 4, M = 2 … 32 (a few minutes)
    python benchmarks/pipeline_memory.py --quick  # pipe = 2, M = 4, 8, 16, tiny sizes (the test)

The claim (``shardops/pipeline/_schedule.py``): a stage keeps the input of every microbatch in
flight, K = ``schedule.buffer_slots`` of them: M under GPipe (every forward runs before any
backward), at most 2P − 1 under 1F1B (a microbatch's backward starts as soon as its forward
ends). So GPipe's temp grows by one stage input per microbatch, and 1F1B's stops growing at
M = 2P − 1.

The stage: Llama-like widths without attention, ``L`` residual MLP blocks
``h ← h + tanh(h · W1[D, F]) · W2[F, D]`` stacked ``[L, …]`` and split over pipe, the input
``x[M, b, S, D]`` entering stage 0 as it is, and a head ``w[D, 8]`` with a squared loss on the
last stage. One stage input is ``h[b, S, D]`` in float32 (``act`` below): 1 MiB by default
(a stage's weights: 4 MiB at P = 2). Each stage's blocks run as a Python loop (``unrolled``)
or as one ``lax.scan`` over its ``[L/P, …]`` slice (``scan``, as the models do; at P = 4 the
scan has one step and XLA removes it). The figures are XLA's own
``compiled.memory_analysis()`` of the step compiled on XLA:CPU with simulated devices (nothing
is run): ``temp`` (the buffers the program allocates, the stage inputs among them), the
arguments (the parameters and ``x``, which holds all M microbatches) and the outputs (the
gradients). Memory analysis is deterministic: the figures are the same on every run.

What XLA:CPU makes of it (jax 0.10.2). With the stage unrolled, 1F1B's temp is flat in M
from M = 2P − 1 on, and GPipe's grows by its stage inputs alone (the quick rows: 16 KiB a
microbatch). Before each phase's reads were tied to the phase before it (issue 55), GPipe's
grew by more: XLA recomputed the forwards of the backward phases early (a recompute needs only
its kept input) and held their residuals; ``results/`` still shows that. The gradients are accumulated under ``lax.cond(runs, …)``: added
by ``g + where(runs, d, 0)``, XLA fused the adds of every backward phase into one fusion that
kept each phase's weight gradients alive to the end (a stage's weights' worth per microbatch),
and 1F1B grew like GPipe (tests/test_benchmark_pipeline_memory.py keeps that as a mutant).
With the stage as a ``lax.scan``, both still grow with M on XLA:CPU: the scan's stacked
residual buffers of every backward phase are zero-initialised by copies that XLA schedules at
the program's start.

It prints the table and writes ``pipeline_memory.json`` and ``pipeline_memory.md`` to
``benchmarks/results`` (``--quick``: a temporary folder unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import platform
import tempfile

RESULTS = pathlib.Path(__file__).parent / "results"
FULL = {"stages": (2, 4), "microbatches": (2, 4, 8, 16, 32), "forms": ("unrolled", "scan"),
        "rows": 4, "seq": 256, "d_model": 256, "d_ff": 1024, "layers": 4}  # fmt: skip
QUICK = {"stages": (2,), "microbatches": (4, 8, 16), "forms": ("unrolled",),
         "rows": 2, "seq": 32, "d_model": 64, "d_ff": 128, "layers": 4}  # fmt: skip
HEAD = 8  # the head's outputs
SCHEDULES = ("gpipe", "1f1b", "circular")
VIRTUAL = 2  # the circular schedule's virtual stages


def step_of(
    sizes: dict, stages: int, name: str, microbatches: int, *, scan: bool = False, devices=None
):
    """The pipeline step (``jax.jit`` of a ``jax.shard_map`` over ``pipe``) and abstract
    arguments for it: ``(step, (params, x))``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardops
    from shardops.pipeline import pipeline_value_and_grad, schedule

    pipe = shardops.PIPE_AXIS
    b, s, d, f, layers = (sizes[k] for k in ("rows", "seq", "d_model", "d_ff", "layers"))
    v = VIRTUAL if name == "circular" else 1
    sched = schedule(name, stages, microbatches, v)
    mesh = shardops.make_mesh({pipe: stages}, axis_types="explicit", devices=devices)
    specs = {"w1": P(pipe), "w2": P(pipe), "head": P()}

    def blocks(q, h):  # h[b, S, D]; q["w1"][L/(P·V), D, F], q["w2"][L/(P·V), F, D]
        def block(h, w):
            w1, w2 = w
            return h + jnp.tanh(h @ w1) @ w2, None  # [b, S, F] → [b, S, D]

        if scan:
            return jax.lax.scan(block, h, (q["w1"], q["w2"]))[0]
        for n in range(layers // (stages * v)):
            h, _ = block(h, (q["w1"][n], q["w2"][n]))
        return h

    def body(params, x):  # x[M, b, S, D], replicated over pipe
        def stage_fn(q, h, x_i, first, last, with_loss=True, virtual=0):  # h[b, S, D]
            h = blocks(q, jnp.where(first, x_i, h))
            if not with_loss:  # a forward phase needs h alone
                return h, None
            y = jnp.where(last, h, 0) @ q["head"]  # [b, S, HEAD]
            return h, jnp.sum(y * y) / (microbatches * b * s)

        act = jax.typeof(jax.lax.pcast(jnp.zeros((b, s, d)), pipe, to="varying"))
        return pipeline_value_and_grad(stage_fn, params, x, sched, axis_name=pipe,
                                       activation=act, chunks={"w1": True, "w2": True, "head": False})  # fmt: skip

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), specs)))
    shaped = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32,  # noqa: E731
                                                      sharding=NamedSharding(mesh, spec))  # fmt: skip
    params = {"w1": shaped((layers, d, f), specs["w1"]), "w2": shaped((layers, f, d), specs["w2"]),
              "head": shaped((d, HEAD), specs["head"])}  # fmt: skip
    return step, (params, shaped((microbatches, b, s, d), P())), sched


def measure(sizes: dict) -> list[dict]:
    act = sizes["rows"] * sizes["seq"] * sizes["d_model"] * 4  # h[b, S, D] f32
    rows = []
    for form, stages, name in itertools.product(sizes["forms"], sizes["stages"], SCHEDULES):
        for m in sizes["microbatches"]:
            if name == "circular" and m % stages:  # groups of P microbatches
                continue
            step, args, sched = step_of(sizes, stages, name, m, scan=form == "scan")
            memory = step.lower(*args).compile().memory_analysis()
            row = {
                "form": form, "stages": stages, "schedule": name, "microbatches": m,
                "slots": sched.buffer_slots, "virtual": sched.virtual, "act": act,
                "temp": memory.temp_size_in_bytes,
                "argument": memory.argument_size_in_bytes,
                "output": memory.output_size_in_bytes,
                "alias": memory.alias_size_in_bytes,
            }  # fmt: skip
            row["peak"] = row["argument"] + row["output"] - row["alias"] + row["temp"]
            rows.append(row)
            print(f"{form} P={stages} {name:5} M={m:2}: K={row['slots']:2} "
                  f"temp {row['temp'] / 2**20:8.2f} MiB", flush=True)  # fmt: skip
    return rows


def markdown(results: dict) -> str:
    """One row per (stage form, P, schedule, M): the stage inputs kept (K), their bytes, and
    XLA's temp, argument and output bytes per device, with temp's growth over the row of the
    smallest M."""
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    lines = [
        "| layers | P | schedule | M | buffer slots K (a chunk's) | V·K × act MiB | temp MiB "
        "| temp − temp(M₀) MiB | arguments MiB | outputs MiB |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    first = {}
    for r in results["rows"]:
        base = first.setdefault((r["form"], r["stages"], r["schedule"]), r["temp"])
        lines.append(
            f"| {r['form']} | {r['stages']} | {r['schedule']} | {r['microbatches']} | {r['slots']} | "
            f"{mib(r['slots'] * r.get('virtual', 1) * r['act'])} | {mib(r['temp'])} | "
            f"{mib(r['temp'] - base)} | "
            f"{mib(r['argument'])} | {mib(r['output'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="pipe = 2, tiny sizes (the test)")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {RESULTS}; --quick: a temporary one)")  # fmt: skip
    args = parser.parse_args(argv)
    flag = "--xla_force_host_platform_device_count=8"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    sizes = QUICK if args.quick else FULL
    results = {"sizes": sizes, "quick": args.quick, "rows": measure(sizes), "jax": jax.__version__,
               "machine": f"{platform.machine()}, XLA:{jax.default_backend()}"}  # fmt: skip
    out = pathlib.Path(args.out or (tempfile.mkdtemp(prefix="shardops_pipeline_memory_")
                                    if args.quick else RESULTS))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    (out / "pipeline_memory.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "pipeline_memory.md").write_text(table)
    print(table)
    print(f"wrote {out / 'pipeline_memory.json'} and {out / 'pipeline_memory.md'}")
    return results


if __name__ == "__main__":
    main()
