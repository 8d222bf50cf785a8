"""Benchmark every strategy against GSPMD, jax.pmap and the single-device step.

    python benchmarks/strategies.py            # the full table (under 10 minutes on 2 cores)
    python benchmarks/strategies.py --quick    # a small end-to-end run (CI); its times mean nothing

For the seed's MLP (784-512-10, batch 256) and a wider one (784-2048-2048-10, batch 1024), and
for each strategy × mesh, it measures in one process:

- step time: the median of ≥ 50 timed steps after warm-up. shardops, GSPMD, the single-device
  step (and pmap for ``dp``) are timed in rotation, one step each, so that every ratio is a
  *paired* ratio from neighbouring steps on this noisy machine; it reports the median paired
  ratio and its interquartile range. One step is in flight at a time (the hang trap).
- GSPMD: the same unsharded train step under plain ``jax.jit`` with the same NamedShardings on
  the parameters, optimizer state and batch: what a user would write instead of shardops.
- collective bytes per step from the compiled programs (``shardops.ledger``), as ring bytes per
  device per mesh axis, next to the analytic model (``Setup.cost_model``). Both columns apply the
  same ring formulas (``shardops.ring_bytes``), so their agreement checks the bytes V of each
  collective, not the formulas; tests/test_ledger.py pins the formulas, and each strategy's V
  and ring bytes, to numbers worked out by hand.
- per-device bytes of parameters + optimizer state (from the shard shapes), and the compiled
  temp memory of both programs.

It writes ``benchmarks/results/strategies.json`` and ``benchmarks/results/strategies.md``. On a
machine without an accelerator it simulates 8 CPU devices (XLA_FLAGS, set before JAX starts).
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import json
import pathlib
import platform
import time

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
import shardops
from models import pmap

RESULTS = pathlib.Path(__file__).parent / "results"
MODELS = {"seed": ((784, 512, 10), 256), "wide": ((784, 2048, 2048, 10), 1024)}
QUICK_MODELS = {"seed": ((784, 64, 10), 64), "wide": ((784, 128, 128, 10), 64)}
CASES = [
    ("dp", (8, 1)),
    ("tp", (1, 8)),
    ("2d", (4, 2)),
    ("2d", (2, 4)),
    ("fsdp", (8, 1)),
    ("fsdp_tp", (4, 2)),
]


def devices_for(n):
    devices = jax.devices()
    return devices if len(devices) >= n else jax.devices("cpu")


def gspmd_step(setup, ref):
    """The unsharded train step under jit, with the strategy's shardings on its inputs/outputs."""
    mesh = setup.mesh

    def named(specs):
        return jax.tree.map(
            lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
        )

    state = named(models.TrainState(setup.param_specs, setup.opt_specs))
    batch = NamedSharding(mesh, setup.batch_spec)
    replicated = NamedSharding(mesh, P())
    return jax.jit(
        ref.step,
        in_shardings=(state, batch, batch),
        out_shardings=(state, replicated),
        donate_argnums=0,
    )


def state_bytes_per_device(state) -> int:
    per_device = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def temp_bytes(jitted, *args):
    analysis = jitted.lower(*args).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def axes_key(axes) -> str:
    return "×".join(axes) or "-"


def bench_case(strategy, mesh_shape, sizes, batch, *, steps, warmup, rng):
    n = mesh_shape[0] * mesh_shape[1]
    mesh = shardops.make_mesh(
        {"data": mesh_shape[0], "model": mesh_shape[1]}, devices=devices_for(n)
    )
    opt = optax.sgd(0.01)  # a small rate keeps thousands of benchmark steps finite
    setup = models.build(strategy, mesh, optimizer=opt, sizes=sizes)
    ref = models.build("ref", optimizer=opt, sizes=sizes)
    params = models.init_mlp(jax.random.key(0), sizes)
    x = rng.random((batch, sizes[0]), dtype=np.float32)
    y = np.eye(sizes[-1], dtype=np.float32)[rng.integers(0, sizes[-1], batch)]

    xs, ys = setup.place_batch(x, y)
    gspmd = gspmd_step(setup, ref)
    single_device = devices_for(1)[0]
    x1, y1 = jax.device_put((x, y), single_device)
    runs = {
        "shardops": [setup.train_step, setup.shard(params), (xs, ys)],
        "gspmd": [gspmd, setup.shard(params), (xs, ys)],
        "single": [ref.train_step, jax.device_put(ref.shard(params), single_device), (x1, y1)],
    }
    if strategy == "dp":
        pstep = pmap.pmap_train_step(opt, devices_for(n)[:n])
        runs["pmap"] = [
            lambda state, x, y: (pstep(*state, x, y)[:2], None),
            (pmap.replicate(params, n), pmap.replicate(opt.init(params), n)),
            (pmap.split_batch(x, n), pmap.split_batch(y, n)),
        ]

    # Communication and memory, from the compiled programs.
    shard_state = runs["shardops"][1]
    shard_ledger = shardops.ledger(mesh, setup.train_step, shard_state, xs, ys)
    gspmd_ledger = shardops.ledger(mesh, gspmd, runs["gspmd"][1], xs, ys)
    # The same shardops.ring_bytes turns both the ledger's V (compiled HLO) and the model's V
    # (the strategy's collective_budget) into ring bytes: agreement checks V, not the formulas.
    model_bytes = setup.cost_model(batch)
    row = {
        "strategy": strategy,
        "mesh": f"{mesh_shape[0]}x{mesh_shape[1]}",
        "ring_bytes_model": {axes_key(a): v for a, v in model_bytes.items()},
        "ring_bytes_shardops": {axes_key(a): v for a, v in shard_ledger.ring_bytes().items()},
        "ring_bytes_gspmd": {axes_key(a): v for a, v in gspmd_ledger.ring_bytes().items()},
        "gspmd_kinds": {f"{k} {axes_key(a)}": v for (k, a), v in gspmd_ledger.totals().items()},
        "state_bytes_per_device": state_bytes_per_device(shard_state),
        "single_device_state_bytes": state_bytes_per_device(runs["single"][1]),
        "temp_bytes_shardops": temp_bytes(setup.train_step, shard_state, xs, ys),
        "temp_bytes_gspmd": temp_bytes(gspmd, runs["gspmd"][1], xs, ys),
    }

    # Time in rotation: one step of each per round, each waited for.
    times = {name: [] for name in runs}
    for i in range(warmup + steps):
        for name, run in runs.items():
            step, state, batch_args = run
            start = time.perf_counter()
            out = jax.block_until_ready(step(state, *batch_args))
            elapsed = time.perf_counter() - start
            run[1] = out[0]  # the (donated) state is replaced by the new one
            if i >= warmup:
                times[name].append(elapsed)
    t = {k: np.array(v) for k, v in times.items()}

    def paired(a, b):
        r = t[a] / t[b]
        return {
            "median": float(np.median(r)),
            "q25": float(np.quantile(r, 0.25)),
            "q75": float(np.quantile(r, 0.75)),
        }

    row.update({
        "step_ms": {k: float(np.median(v) * 1e3) for k, v in t.items()},
        "vs_gspmd": paired("shardops", "gspmd"),
        "vs_single": paired("shardops", "single"),
        "gspmd_vs_single": paired("gspmd", "single"),
    })  # fmt: skip
    if "pmap" in t:
        row["vs_pmap"] = paired("shardops", "pmap")
    return row


def fmt_bytes(d: dict) -> str:
    return ", ".join(f"{k}: {v / 1e6:.3f}" for k, v in sorted(d.items())) or "0"


def markdown(results) -> str:
    lines = []
    for block in results["models"].values():
        sizes, batch = block["sizes"], block["batch"]
        lines += [
            f"### MLP {'-'.join(map(str, sizes))}, batch {batch}",
            "",
            "| strategy | mesh | step ms | ÷ GSPMD (IQR) | ÷ single device (IQR) | GSPMD ÷ single | ÷ pmap | ring MB/device: model | shardops | GSPMD | state MB/device |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in block["rows"]:

            def ratio(key, r=r):
                v = r[key]
                return f"{v['median']:.2f} ({v['q25']:.2f}–{v['q75']:.2f})"

            pm = ratio("vs_pmap") if "vs_pmap" in r else ""
            lines.append(
                f"| {r['strategy']} | {r['mesh']} | {r['step_ms']['shardops']:.2f} | {ratio('vs_gspmd')} | "
                f"{ratio('vs_single')} | {r['gspmd_vs_single']['median']:.2f} | {pm} | "
                f"{fmt_bytes(r['ring_bytes_model'])} | {fmt_bytes(r['ring_bytes_shardops'])} | "
                f"{fmt_bytes(r['ring_bytes_gspmd'])} | {r['state_bytes_per_device'] / 1e6:.2f} |"
            )
        lines.append(f"\nSingle-device step: {block['rows'][0]['step_ms']['single']:.2f} ms; state "
                     f"{block['rows'][0]['single_device_state_bytes'] / 1e6:.2f} MB.\n")  # fmt: skip
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps: checks it runs")
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps per program (default 60; quick 3)"
    )
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    steps = args.steps or (3 if args.quick else 60)
    warmup = 1 if args.quick else 5
    rng = np.random.default_rng(0)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].platform} ×{len(devices_for(8))}",
        "jax": jax.__version__,
        "steps": steps,
        "quick": args.quick,
        "models": {},
    }
    start = time.perf_counter()
    for name, (sizes, batch) in (QUICK_MODELS if args.quick else MODELS).items():
        rows = []
        for strategy, mesh_shape in CASES:
            row = bench_case(
                strategy, mesh_shape, sizes, batch, steps=steps, warmup=warmup, rng=rng
            )
            rows.append(row)
            print(f"{name:>5} {strategy:>8} {row['mesh']}: {row['step_ms']['shardops']:8.2f} ms, "
                  f"÷GSPMD {row['vs_gspmd']['median']:.2f}, ÷single {row['vs_single']['median']:.2f}"
                  + (f", ÷pmap {row['vs_pmap']['median']:.2f}" if "vs_pmap" in row else ""), flush=True)  # fmt: skip
        results["models"][name] = {"sizes": list(sizes), "batch": batch, "rows": rows}
    results["seconds"] = time.perf_counter() - start
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "strategies.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / "strategies.md").write_text(table + "\n")
    print(table)
    print(
        f"{results['seconds']:.0f} s; wrote {out / 'strategies.json'} and {out / 'strategies.md'}"
    )
    return results


if __name__ == "__main__":
    main()
