"""Pipeline parallelism: each schedule against the same model without pipelining and against
GSPMD on the same mesh.

    python benchmarks/pipeline.py               # the full table (4 to 10 minutes on 2 shared cores)
    python benchmarks/pipeline.py --quick       # a small end-to-end run (CI); times mean nothing
    python benchmarks/pipeline.py --tables-only # docs/pipeline.md's table from the stored JSON

The model (``model_of``) is ``models.Llama`` with its blocks stacked ``[L, …]`` under one scan:
width 128, 8 layers, 8 heads sharing 2 KV heads, SwiGLU 256, vocabulary 256; batch 16 × 128
tokens, SGD. The rows (``ROWS``), all on the same 8 simulated CPU devices:

- ``2d+gpipe``, ``2d+1f1b`` and ``2d+circular`` on pipe = 2 × data = 2 × model = 2, M = 4
  and M = 8 microbatches: the 8 layers in 2 stages of 4 (``w[L_pipe, D, F_model]``; circular:
  2 chunks of 2 per stage), each stage's batch ``[B_data, S]`` (replicated over pipe) cut into
  M microbatches;
- ``ref+1f1b`` on pipe = 8, M = 8: one layer a stage, nothing else split;
- ``2d`` on data = 4 × model = 2: the same devices without pipelining (every layer on every
  device, the batch over data), the row every other one is divided by.

Each row is paired with GSPMD on the same mesh (``strategies.gspmd_step``): the ``ref`` setup's
unsharded step under plain ``jax.jit`` with the row's NamedShardings on the parameters,
optimizer state and batch. GSPMD takes the pp layout (the stacked layers split over pipe on
dim 0, the batch replicated over pipe) but has no schedule: it runs the scan over all L layers
on every device, gathering the layers it lacks over pipe. The rows of one mesh share one GSPMD
program (the schedule and M do not change the shardings). Every program is timed in one
rotation (``strategies.time_in_rotation``: one step of each per round, every other round
reversed, one step in flight: the hang trap), so every ratio is the median of paired
step-by-step ratios with its interquartile range.

Per row: the step time; ``÷ 2d`` and ``÷ GSPMD`` (paired); the schedule's bubble
``(P − 1)/(V·M + P − 1)`` (``Schedule.bubble``) and the ratio to ``2d`` that the bubble and the
recomputed forward predict when nothing overlaps (``loss_model``); collective ring bytes per
device per mesh-axis group and per collective kind on the compiled programs
(``shardops.inspect.ring_bytes``); the peak and temp memory of each program
(``memory_analysis``).

It writes ``benchmarks/results/pipeline.json`` and ``pipeline.md`` and, from that JSON, the
table between the ``pipeline-tables`` markers of docs/pipeline.md
(tests/test_benchmark_pipeline.py checks they match); ``--quick`` writes to a temporary folder
unless ``--out`` is given. It simulates 8 CPU devices (XLA_FLAGS, set before JAX starts).
"""

import argparse
import json
import math
import os
import pathlib
import platform
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from strategies import (
    compiled_costs,
    fmt_bytes,
    fmt_mb,
    fmt_ratio,
    group_key,
    gspmd_step,
    paired,
    random_batch,
    ring_bytes_per_group,
    start_platform,
    time_in_rotation,
    write_between_markers,
)

RESULTS = pathlib.Path(__file__).parent / "results"
PAGE = pathlib.Path(__file__).parent.parent / "docs" / "pipeline.md"
START, END = "<!-- pipeline-tables:start -->", "<!-- pipeline-tables:end -->"
PP_MESH = {"pipe": 2, "data": 2, "model": 2}
BASELINE = "2d"
ROWS = (  # (label, strategy, mesh, microbatches or None)
    ("2d+gpipe M=4", "2d+gpipe", PP_MESH, 4),
    ("2d+1f1b M=4", "2d+1f1b", PP_MESH, 4),
    ("2d+gpipe M=8", "2d+gpipe", PP_MESH, 8),
    ("2d+1f1b M=8", "2d+1f1b", PP_MESH, 8),
    ("2d+circular M=4", "2d+circular", PP_MESH, 4),
    ("2d+circular M=8", "2d+circular", PP_MESH, 8),
    ("ref+1f1b M=8", "ref+1f1b", {"pipe": 8}, 8),
    (BASELINE, "2d", {"data": 4, "model": 2}, None),
)
QUICK_ROWS = (("2d+1f1b M=2", "2d+1f1b", PP_MESH, 2), ROWS[-1])  # one pipeline and the baseline
PAIRS = (  # shardops ÷ shardops, from the same rotation
    ("2d+1f1b M=4", "2d+gpipe M=4"),
    ("2d+1f1b M=8", "2d+gpipe M=8"),
    ("2d+gpipe M=8", "2d+gpipe M=4"),
    ("2d+1f1b M=8", "2d+1f1b M=4"),
    ("2d+circular M=4", "2d+1f1b M=4"),
    ("2d+circular M=8", "2d+1f1b M=8"),
)
RECOMPUTE = 4 / 3
"""A backward recomputes its stage's forward (full rematerialisation): forward + backward ≈
1 + 2 forwards becomes 1 + 1 + 2, ×4/3 the compute of a step that keeps its activations."""


def model_of(quick: bool):
    """The benchmark's Llama, its blocks stacked under one scan (``--quick``: a tiny one)."""
    import shardops_models as models

    if quick:
        return models.Llama(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, d_ff=32, context=16)  # fmt: skip
    return models.Llama(vocab_size=256, d_model=128, num_layers=8, num_heads=8, num_kv_heads=2,
                        d_ff=256, context=128)  # fmt: skip


def loss_model(bubble: float) -> float:
    """The step time ÷ ``2d``'s that a pipeline takes when nothing overlaps and the per-device
    compute is the same (it is here: ``2d+pp`` holds half the layers and twice the batch of
    ``2d``'s devices, ``ref+1f1b`` on pipe = 8 an eighth of the layers and the whole batch):
    the busy share ``1 − bubble`` of the phases does ``RECOMPUTE`` times the work."""
    return RECOMPUTE / (1 - bubble)


def run(quick: bool, steps: int, warmup: int, devices) -> dict:
    """Every row's shardops program and its mesh's GSPMD program: costs, then the rotation."""
    import jax
    import numpy as np
    import optax

    import shardops
    import shardops_models as models

    model, batch = model_of(quick), 8 if quick else 16
    opt = optax.sgd(0.01)  # a small rate keeps the benchmark's steps finite
    params = model.init(jax.random.key(0))
    x, y = random_batch(model, batch, np.random.default_rng(0))
    ref = models.build("ref", None, model=model, optimizer=opt)
    runs, rows, twins = {}, {}, {}  # twins: mesh text → its GSPMD program's shardings, costs
    for label, strategy, shape, microbatches in QUICK_ROWS if quick else ROWS:
        mesh = shardops.make_mesh(shape, devices=devices[: math.prod(shape.values())])
        extra = {} if microbatches is None else {"microbatches": microbatches}
        setup = models.build(strategy, mesh, model=model, optimizer=opt, **extra)
        xs, ys = setup.place_batch(x, y)
        where = shardops.format_mesh(shape)
        twin = f"gspmd {where}"
        programs = [("shardops", label, setup.train_step)]
        shardings = (setup.param_specs, setup.opt_specs, setup.batch_spec)
        if where not in twins:  # one GSPMD program per mesh: its shardings are the rows' own
            twins[where] = {"shardings": shardings}
            programs.append(("gspmd", twin, gspmd_step(setup, ref)))
        elif shardings != twins[where]["shardings"]:
            raise AssertionError(f"{label}: its shardings differ from the first row on {where}")
        row = {"label": label, "strategy": strategy, "mesh": where, "gspmd": twin,
               "microbatches": microbatches}  # fmt: skip
        if microbatches is not None:
            row.update(schedule_of(setup, shape, microbatches))
        for program, name, step in programs:
            runs[name] = [step, setup.shard(params), (xs, ys)]
            costs = costs_of(mesh, step, runs[name][1], xs, ys)
            if program == "shardops":
                row.update({f"{k}_shardops": v for k, v in costs.items()})
            else:
                twins[where]["costs"] = costs
        rows[label] = row
        print(f"compiled {label} {where}", flush=True)
    for row in rows.values():  # each row carries its mesh's GSPMD costs
        row.update({f"{k}_gspmd": v for k, v in twins[row["mesh"]]["costs"].items()})

    t = time_in_rotation(runs, warmup, steps)  # one rotation for every program
    add_step_times(rows, t)
    return {
        "model": model.name,
        "layers": model.num_layers,
        "batch": batch,
        "context": model.context,
        "steps": steps,
        "warmup": warmup,
        "programs": list(runs),
        "rows": list(rows.values()),
        "pairs": {f"{a} ÷ {b}": paired(t, a, b) for a, b in PAIRS if a in rows and b in rows},
    }


def schedule_of(setup, shape: dict, microbatches: int) -> dict:
    """A pipeline row's schedule (``shardops.pipeline.schedule`` of ``setup``'s strategy on
    ``shape`` at ``microbatches``): its name, stages, bubble, idle fraction, buffer slots and
    the ratio to ``2d`` that ``loss_model`` predicts."""
    import shardops

    table = shardops.pipeline.schedule(setup.strategy.pp_schedule,
                                       shape[setup.strategy.pp], microbatches,
                                       setup.strategy.kinds[0].virtual)  # fmt: skip
    return {"schedule": table.name, "stages": table.stages,
            "bubble": table.bubble(), "idle_fraction": table.idle_fraction(),
            "buffer_slots": table.buffer_slots,
            "loss_model_vs_2d": loss_model(table.bubble())}  # fmt: skip


def costs_of(mesh, step, state, xs, ys) -> dict:
    """A compiled program's ring bytes per mesh-axis group, its ring bytes per collective kind
    and group, and its memory (``compiled_costs``)."""
    import shardops

    colls, memory = compiled_costs(mesh, step, state, xs, ys)
    kinds: dict[str, float] = {}  # ring bytes per collective kind and group
    for c in colls:
        if c.bytes:
            key = f"{c.kind} {group_key(c)}"
            kinds[key] = kinds.get(key, 0.0) + shardops.inspect.ring_bytes(
                c.kind, c.bytes, c.group_size
            )
    return {"ring_bytes": ring_bytes_per_group(colls), "kinds": kinds, "memory": memory}


def add_step_times(rows: dict, t: dict) -> None:
    """Each row's median step times (ms) and its paired ratios, from the rotation's times ``t``:
    to its mesh's GSPMD program, to ``2d`` (None for ``2d``), and its GSPMD's to ``2d``'s."""
    import numpy as np

    base = rows[BASELINE]
    for label, row in rows.items():
        row["step_ms"] = {"shardops": float(np.median(t[label]) * 1e3),
                          "gspmd": float(np.median(t[row["gspmd"]]) * 1e3)}  # fmt: skip
        row["vs_gspmd"] = paired(t, label, row["gspmd"])
        row["vs_2d"] = None if label == BASELINE else paired(t, label, BASELINE)
        row["gspmd_vs_gspmd_2d"] = paired(t, row["gspmd"], base["gspmd"])


def fmt_kinds(kinds) -> str:
    return ", ".join(f"{k} {v / 1e6:.3f}" for k, v in sorted((kinds or {}).items()) if v) or "none"


def markdown(results) -> str:
    """The table, the paired shardops ratios and the bytes by collective kind."""
    tokens = results["batch"] * results["context"]
    lines = [
        f"Measured on {results['machine']}, JAX {results['jax']}, shardops at "
        f"{results.get('commit') or 'an unknown commit'}; load average "
        f"{results['load_average_at_start']:.1f} at the start, "
        f"{results['load_average_at_end']:.1f} at the end; the run took "
        f"{results['seconds']:.0f} s. {results['model']} ({results['layers']} layers, one "
        f"scan); batch {results['batch']} × {results['context']} tokens; {results['steps']} "
        f"timed steps per program after {results['warmup']} warm-up, all "
        f"{len(results['programs'])} programs in one rotation.",
        "",
        "| strategy | mesh | M | bubble | step ms | tokens/s | ÷ 2d (IQR) | bubble model ÷ 2d | ÷ GSPMD (IQR) | GSPMD ms | GSPMD ÷ GSPMD 2d | ring MB/device: shardops | GSPMD | peak MB: shardops | GSPMD | temp MB: shardops | GSPMD |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in results["rows"]:
        ms, pp = r["step_ms"], r["microbatches"] is not None
        m, bubble, model = ((r["microbatches"], f"{r['bubble']:.3f}", f"{r['loss_model_vs_2d']:.2f}")
                            if pp else ("—", "0", "1"))  # fmt: skip
        lines.append(
            f"| {r['strategy']} | {r['mesh']} | {m} | {bubble} | {ms['shardops']:.1f} | "
            f"{tokens / ms['shardops'] * 1e3:,.0f} | {fmt_ratio(r['vs_2d']) or '1'} | {model} | "
            f"{fmt_ratio(r['vs_gspmd'])} | {ms['gspmd']:.1f} | "
            f"{r['gspmd_vs_gspmd_2d']['median']:.2f} | {fmt_bytes(r['ring_bytes_shardops'])} | "
            f"{fmt_bytes(r['ring_bytes_gspmd'])} | {fmt_mb(r['memory_shardops']['peak'])} | "
            f"{fmt_mb(r['memory_gspmd']['peak'])} | {fmt_mb(r['memory_shardops']['temp'])} | "
            f"{fmt_mb(r['memory_gspmd']['temp'])} |"
        )  # fmt: skip
    kinds = "; ".join(f"`{r['label']}` {fmt_kinds(r['kinds_shardops'])}" for r in results["rows"])
    gspmd, seen = [], set()
    for r in results["rows"]:
        if r["mesh"] not in seen:
            seen.add(r["mesh"])
            gspmd.append(f"GSPMD {r['mesh']} {fmt_kinds(r['kinds_gspmd'])}")
    pairs = "; ".join(f"`{k}` {fmt_ratio(v)}" for k, v in results["pairs"].items())
    lines += [
        "",
        f"Paired shardops ratios (same rotation): {pairs or 'none'}.",
        "",
        f"Ring MB per device per step by collective kind and mesh-axis group: {kinds}; "
        f"{'; '.join(gspmd)}.",
    ]
    return "\n".join(lines)


def commit_of() -> str | None:
    """The commit measured: ``SHARDOPS_COMMIT`` (a run from an exported tree), else this
    checkout's HEAD with ``+modified`` where shardops/ or models/ differ from it (other work in
    the tree is measured too), else None."""
    import subprocess

    if os.environ.get("SHARDOPS_COMMIT"):
        return os.environ["SHARDOPS_COMMIT"]
    root = pathlib.Path(__file__).parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "shardops", "models"],
                               cwd=root, capture_output=True, text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+modified" if dirty.strip() else "")


def write_table(results, path=PAGE) -> None:
    """Replace the table between docs/pipeline.md's ``pipeline-tables`` markers by
    ``markdown(results)``."""
    write_between_markers(path, START, END, markdown(results))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps: checks it runs")
    p.add_argument("--steps", type=int, default=None, help="timed rounds (default 20; quick 2)")
    p.add_argument(
        "--out", default=None,
        help=f"results folder (default {RESULTS}; with --quick a temporary folder)",
    )  # fmt: skip
    p.add_argument("--tables-only", action="store_true",
                   help="rewrite docs/pipeline.md's table (and pipeline.md) from the stored "
                        "JSON; run nothing")  # fmt: skip
    args = p.parse_args(argv)
    if args.tables_only:
        results = json.loads((RESULTS / "pipeline.json").read_text())
        (RESULTS / "pipeline.md").write_text(markdown(results) + "\n")
        write_table(results)
        return results
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="shardops_pipeline_") if args.quick else str(RESULTS)
    out = pathlib.Path(args.out)
    devices = start_platform("cpu")  # sets XLA_FLAGS before JAX starts its backend

    import jax

    start, load = time.perf_counter(), os.getloadavg()[0]
    steps = args.steps or (2 if args.quick else 20)
    results = run(args.quick, steps, 1 if args.quick else 2, devices)
    results.update({
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, cpu ×{len(devices)}",
        "jax": jax.__version__,
        "commit": commit_of(),
        "quick": args.quick,
        "load_average_at_start": load,
        "load_average_at_end": os.getloadavg()[0],
        "seconds": time.perf_counter() - start,
    })  # fmt: skip
    table = markdown(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps(results, indent=1))
    (out / "pipeline.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'pipeline.json'} and {out / 'pipeline.md'}")
    if out.resolve() == RESULTS.resolve():  # docs/pipeline.md's table follows the committed JSON
        write_table(results)
    return results


if __name__ == "__main__":
    main()
