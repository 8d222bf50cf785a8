"""The Mixtral-style Llama: shardops' step against GSPMD's, with and without expert parallelism.

    python benchmarks/moe.py           # the full table (about 6 minutes on 2 shared cores)
    python benchmarks/moe.py --quick   # a small end-to-end run (CI); times mean nothing
    python benchmarks/moe.py --tables-only  # docs/moe.md's table from the stored JSON

The model (``MODEL``) is ``models.Llama`` with a mixture of experts in every block: width 128,
4 layers (one scan), 8 heads sharing 2 KV heads, 8 SwiGLU experts of 256, each token routed to
k = 2 with capacity factor 1.25, vocabulary 256; batch 16 × 128 tokens, SGD. The rows:

- ``2d+ep`` on data = 2 × expert = 2 × model = 2: the batch over data × expert, each expert's
  hidden units over model, the experts over expert (two AllToAlls a layer, each way);
- ``ep_tp`` (``models.Strategy("ep_tp", ep="data", tp="model")``, GShard's) on data = 4 ×
  model = 2: the experts over the data axis, which also splits the batch;
- ``2d`` on data = 4 × model = 2, no expert parallelism: every expert on every device, its
  hidden units over model (no AllToAll).

Each row is paired with GSPMD on the same mesh: the ``ref`` setup's unsharded step (the
einsum dispatch of ``shardops.layers.moe``, no collectives) under plain ``jax.jit`` with the
row's NamedShardings on the parameters, optimizer state and batch (``strategies.gspmd_step``),
so XLA partitions the dispatch itself. All six programs are timed in one rotation
(``strategies.py``'s method: one step of each per round, every other round reversed, one step
in flight: the hang trap), so every ratio, ``2d+ep ÷ 2d`` included, is a median of paired
step-by-step ratios with its interquartile range. Per row: the AllToAll bytes each device
sends per step and all collective bytes per mesh-axis group (ring formulas,
``shardops.inspect.ring_bytes``, on the compiled programs), and the peak and temp memory of
each program (``memory_analysis``). For the example batch, over every layer: the fraction of
the k choices dropped at capacity and each expert's share of the choices (``routing_of``: the
reference forward's MoE inputs, routed by ``shardops.layers.moe_route``).

It writes ``benchmarks/results/moe.json`` and ``moe.md`` and, from that JSON, the table between
the ``moe-tables`` markers of docs/moe.md (tests/test_benchmark.py checks they match);
``--quick`` writes to a temporary folder unless ``--out`` is given. It simulates 8 CPU devices (XLA_FLAGS, set before JAX starts).
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
    gspmd_step,
    paired,
    random_batch,
    ring_bytes_per_group,
    start_platform,
    time_in_rotation,
    write_between_markers,
)

RESULTS = pathlib.Path(__file__).parent / "results"
PAGE = pathlib.Path(__file__).parent.parent / "docs" / "moe.md"
START, END = "<!-- moe-tables:start -->", "<!-- moe-tables:end -->"
ROWS = (  # (label, strategy, mesh)
    ("2d+ep", "2d+ep", {"data": 2, "expert": 2, "model": 2}),
    ("ep_tp", ("ep_tp", {"ep": "data", "tp": "model"}), {"data": 4, "model": 2}),
    ("2d", "2d", {"data": 4, "model": 2}),
)
PAIRS = (("2d+ep", "2d"), ("ep_tp", "2d"))  # shardops ÷ shardops, from the same rotation


def model_of(quick: bool):
    """The benchmark's Mixtral-style Llama (``--quick``: a tiny one)."""
    import shardops_models as models

    experts = models.Experts(num_experts=8, k=2, capacity_factor=1.25)
    if quick:
        return models.Llama(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, d_ff=32, context=16, experts=experts)  # fmt: skip
    return models.Llama(vocab_size=256, d_model=128, num_layers=4, num_heads=8, num_kv_heads=2,
                        d_ff=256, context=128, experts=experts)  # fmt: skip


def strategy_of(spec):
    import shardops_models as models

    return spec if isinstance(spec, str) else models.Strategy(spec[0], **spec[1])


def routing_of(model, params, ids) -> dict:
    """The routing of ``ids[B, S]`` in every layer: the fraction of the k choices dropped at
    capacity and each expert's share of the choices (before dropping) and of the kept ones.
    The reference forward (``model.reference_logits``, plain jax.numpy, run eagerly) hands each
    layer's MoE input and router to ``shardops.layers.moe_route``, whose decisions the
    reference's own routing equals (tests/networks/test_moe_llama.py)."""
    from unittest import mock

    import numpy as np

    from shardops.layers import moe_capacity, moe_route
    from shardops_models.networks import llama

    e, layers = model.experts, []
    original = llama._reference_experts

    def recording(experts, p, h, groups):  # h[B, S, D]: this layer's MoE input, one group a row
        routing = moe_route(h, p["router"], k=e.k, capacity_factor=e.capacity_factor,
                            score=e.score)  # fmt: skip
        chosen = np.asarray(routing.chosen).sum((0, 1))  # [E]: choices per expert
        kept = np.asarray(routing.dispatch).sum((0, 1, 3))  # [E]: choices that found a slot
        layers.append((chosen, kept))
        return original(experts, p, h, groups)

    with mock.patch.object(llama, "_reference_experts", recording):
        model.reference_logits(params, ids)
    assert len(layers) == model.num_layers, len(layers)
    chosen, kept = (np.sum([layer[i] for layer in layers], 0) for i in (0, 1))  # [E]
    return {
        "capacity": moe_capacity(ids.shape[1], e.k, e.num_experts, e.capacity_factor),
        "choices": int(chosen.sum()),
        "dropped": int(chosen.sum() - kept.sum()),
        "drop_rate": float(1 - kept.sum() / chosen.sum()),
        "drop_rate_per_layer": [float(1 - k.sum() / c.sum()) for c, k in layers],
        "share": (chosen / chosen.sum()).tolist(),
        "kept_share": (kept / kept.sum()).tolist(),
    }


def run(quick: bool, steps: int, warmup: int, devices) -> dict:
    """Every row's shardops and GSPMD programs: costs, then the timed rotation."""
    import jax
    import numpy as np
    import optax

    import shardops
    import shardops_models as models

    model, batch = model_of(quick), 8 if quick else 16
    opt = optax.sgd(0.01)
    params = model.init(jax.random.key(0))
    x, y = random_batch(model, batch, np.random.default_rng(0))
    ref = models.build("ref", None, model=model, optimizer=opt)
    runs, rows = {}, {}
    for label, spec, shape in ROWS:
        mesh = shardops.make_mesh(shape, devices=devices[: math.prod(shape.values())])
        setup = models.build(strategy_of(spec), mesh, model=model, optimizer=opt)
        gspmd = gspmd_step(setup, ref)
        xs, ys = setup.place_batch(x, y)
        runs[label] = [setup.train_step, setup.shard(params), (xs, ys)]
        runs[f"{label} gspmd"] = [gspmd, setup.shard(params), (xs, ys)]
        costs = {
            program: compiled_costs(mesh, step, runs[name][1], xs, ys)
            for program, name, step in (("shardops", label, setup.train_step),
                                        ("gspmd", f"{label} gspmd", gspmd))
        }  # fmt: skip
        rows[label] = {"label": label, "mesh": shardops.format_mesh(shape)}
        for program, (colls, memory) in costs.items():
            a2a = [c for c in colls if c.kind == "all-to-all"]
            rows[label][f"all_to_all_bytes_{program}"] = sum(
                shardops.inspect.ring_bytes(c.kind, c.bytes, c.group_size) for c in a2a
            )
            rows[label][f"ring_bytes_{program}"] = ring_bytes_per_group(colls)
            kinds: dict[str, float] = {}  # ring bytes per collective kind
            for c in colls:
                kinds[c.kind] = kinds.get(c.kind, 0.0) + shardops.inspect.ring_bytes(
                    c.kind, c.bytes, c.group_size
                )
            rows[label][f"kinds_{program}"] = kinds
            rows[label][f"memory_{program}"] = memory
        print(f"compiled {label} {rows[label]['mesh']}", flush=True)

    t = time_in_rotation(runs, warmup, steps)  # one rotation for every program
    for label, row in rows.items():
        row["step_ms"] = {"shardops": float(np.median(t[label]) * 1e3),
                          "gspmd": float(np.median(t[f"{label} gspmd"]) * 1e3)}  # fmt: skip
        row["vs_gspmd"] = paired(t, label, f"{label} gspmd")
        row["gspmd_vs_gspmd_2d"] = paired(t, f"{label} gspmd", "2d gspmd")
    return {
        "model": model.name,
        "batch": batch,
        "context": model.context,
        "steps": steps,
        "warmup": warmup,
        "rows": list(rows.values()),
        "pairs": {f"{a} ÷ {b}": paired(t, a, b) for a, b in PAIRS},
        "routing": routing_of(model, params, x),
    }


def fmt_kinds(kinds) -> str:
    return ", ".join(f"{k} {v / 1e6:.3f}" for k, v in sorted((kinds or {}).items()) if v) or "none"


def markdown(results) -> str:
    """The table, the paired shardops ratios and the routing of the example batch."""
    tokens = results["batch"] * results["context"]
    lines = [
        f"Measured on {results['machine']}, JAX {results['jax']}; load average "
        f"{results['load_average_at_start']:.1f} at the start, "
        f"{results['load_average_at_end']:.1f} at the end; the run took "
        f"{results['seconds']:.0f} s. {results['model']}, experts' capacity factor "
        f"{results['capacity_factor']}; batch {results['batch']} × {results['context']} "
        f"tokens; {results['steps']} timed steps per program after {results['warmup']} "
        f"warm-up, all six programs in one rotation.",
        "",
        "| strategy | mesh | step ms | tokens/s | ÷ GSPMD (IQR) | GSPMD ms | AllToAll MB/device: shardops | GSPMD | ring MB/device: shardops | GSPMD | peak MB: shardops | GSPMD | temp MB: shardops | GSPMD |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in results["rows"]:
        ms = r["step_ms"]
        lines.append(
            f"| {r['label']} | {r['mesh']} | {ms['shardops']:.1f} | "
            f"{tokens / ms['shardops'] * 1e3:,.0f} | {fmt_ratio(r['vs_gspmd'])} | "
            f"{ms['gspmd']:.1f} | {r['all_to_all_bytes_shardops'] / 1e6:.3f} | "
            f"{r['all_to_all_bytes_gspmd'] / 1e6:.3f} | {fmt_bytes(r['ring_bytes_shardops'])} | "
            f"{fmt_bytes(r['ring_bytes_gspmd'])} | {fmt_mb(r['memory_shardops']['peak'])} | "
            f"{fmt_mb(r['memory_gspmd']['peak'])} | {fmt_mb(r['memory_shardops']['temp'])} | "
            f"{fmt_mb(r['memory_gspmd']['temp'])} |"
        )  # fmt: skip
    kinds = "; ".join(
        f"`{r['label']}` shardops {fmt_kinds(r.get('kinds_shardops'))}, GSPMD "
        f"{fmt_kinds(r.get('kinds_gspmd'))}"
        for r in results["rows"]
    )
    pairs = "; ".join(f"`{k}` {fmt_ratio(v)}" for k, v in results["pairs"].items())
    rt = results["routing"]
    shares = ", ".join(f"{s:.3f}" for s in rt["share"])
    lines += [
        "",
        f"Paired shardops ratios (same rotation): {pairs}.",
        "",
        f"Ring MB per device per step by collective kind: {kinds}.",
        "",
        f"Routing of the example batch at the initial weights (every layer, capacity C = "
        f"{rt['capacity']} slots per expert per sequence): {rt['dropped']} of {rt['choices']} "
        f"choices dropped (drop rate {rt['drop_rate']:.3f}; by layer "
        f"{', '.join(f'{d:.3f}' for d in rt['drop_rate_per_layer'])}); each expert's share of "
        f"the choices: {shares}.",
    ]
    return "\n".join(lines)


def write_table(results, path=PAGE) -> None:
    """Replace the table between docs/moe.md's ``moe-tables`` markers by ``markdown(results)``."""
    write_between_markers(path, START, END, markdown(results))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps: checks it runs")
    p.add_argument("--steps", type=int, default=None, help="timed rounds (default 40; quick 3)")
    p.add_argument(
        "--out", default=None,
        help=f"results folder (default {RESULTS}; with --quick a temporary folder)",
    )  # fmt: skip
    p.add_argument("--tables-only", action="store_true",
                   help="rewrite docs/moe.md's table (and moe.md) from the stored JSON; run nothing")  # fmt: skip
    args = p.parse_args(argv)
    if args.tables_only:
        results = json.loads((RESULTS / "moe.json").read_text())
        (RESULTS / "moe.md").write_text(markdown(results) + "\n")
        write_table(results)
        return results
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="shardops_moe_") if args.quick else str(RESULTS)
    out = pathlib.Path(args.out)
    devices = start_platform("cpu")  # sets XLA_FLAGS before JAX starts its backend

    import jax

    start, load = time.perf_counter(), os.getloadavg()[0]
    steps = args.steps or (3 if args.quick else 40)
    results = run(args.quick, steps, 1 if args.quick else 3, devices)
    results.update({
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, cpu ×{len(devices)}",
        "jax": jax.__version__,
        "quick": args.quick,
        "capacity_factor": model_of(args.quick).experts.capacity_factor,
        "load_average_at_start": load,
        "load_average_at_end": os.getloadavg()[0],
        "seconds": time.perf_counter() - start,
    })  # fmt: skip
    table = markdown(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe.json").write_text(json.dumps(results, indent=1))
    (out / "moe.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'moe.json'} and {out / 'moe.md'}")
    if out.resolve() == RESULTS.resolve():  # docs/moe.md's table follows the committed JSON
        write_table(results)
    return results


if __name__ == "__main__":
    main()
