"""Benchmark every strategy against GSPMD, jax.pmap and the single-device step.

    python benchmarks/strategies.py            # the full tables (about 12 minutes on 2 cores)
    python benchmarks/strategies.py --quick    # a small end-to-end run (CI); its times mean nothing

For the seed's MLP (784-512-10, batch 256), a wider one (784-2048-2048-10, batch 1024) and a
GPT (``models.Gpt()``: 4 layers, width 128, 4 heads, vocabulary 256; batch 16 × 128 tokens),
and for each strategy × mesh, it measures in one process:

- step time: the median of the timed steps after warm-up (60 per program for the MLPs, 20 for
  the GPT, to keep the full run near 12 minutes). shardops, GSPMD, the single-device step (and pmap
  for the MLP's ``dp``) are timed in rotation, one step each, so that every ratio is a *paired*
  ratio from neighbouring steps on this noisy machine; it reports the median paired ratio and
  its interquartile range. One step is in flight at a time (the hang trap).
- GSPMD: the same unsharded train step (the ``ref`` setup's ``step``, which runs the model's
  own code with no collectives) under plain ``jax.jit`` with the same NamedShardings on the
  parameters, optimizer state and batch: what a user would write instead of shardops.
- collective bytes per step from the compiled programs (``shardops.collectives``), as ring
  bytes per device per mesh axis (``groups of N``: GSPMD's groups that span part of an axis,
  which ``shardops.ledger`` refuses), next to the analytic model (``Setup.cost_model``). Both
  columns apply the same ring formulas (``shardops.ring_bytes``), so their agreement checks the
  bytes V of each collective, not the formulas; tests/test_ledger.py pins the formulas, and
  each strategy's V and ring bytes, to numbers worked out by hand.
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
import dataclasses
import json
import pathlib
import platform
import time
from typing import NamedTuple

import jax
import numpy as np
import optax
import shardops_models as models
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from shardops_models import pmap

import shardops

RESULTS = pathlib.Path(__file__).parent / "results"
MLP_CASES = [
    ("dp", (8, 1)),
    ("tp", (1, 8)),
    ("2d", (4, 2)),
    ("2d", (2, 4)),
    ("fsdp", (8, 1)),
    ("fsdp_tp", (4, 2)),
]
# The GPT's 4 heads allow a model axis of at most 4. Model-only strategies run on 1×4 (the batch
# is not split, so a data axis would only hold replicas computing the same step); the others on
# 2×4, and the data-only ones on 8×1.
GPT_CASES = [
    ("dp", (8, 1)),
    ("fsdp", (8, 1)),
    ("tp", (1, 4)),
    ("sp", (1, 4)),
    ("2d", (2, 4)),
    ("fsdp_tp", (2, 4)),
    ("dp_sp", (2, 4)),
    ("fsdp_sp", (2, 4)),
]
QUICK_GPT_CASES = [("tp", (1, 4)), ("fsdp_sp", (2, 4))]  # both axes, every GPT kernel; CI-fast


class Bench(NamedTuple):
    """One table: a model, a global batch, the strategy × mesh cases and the steps to time."""

    title: str
    model: object
    batch: int
    cases: list
    steps: int
    warmup: int


def mlp(sizes, batch, steps, warmup):
    title = f"MLP {'-'.join(map(str, sizes))}, batch {batch}"
    return Bench(title, models.Mlp(sizes), batch, MLP_CASES, steps, warmup)


def gpt(model, batch, steps, warmup, cases=GPT_CASES):
    title = (f"GPT: {model.num_layers} layers, width {model.d_model}, {model.num_heads} heads, "
             f"vocabulary {model.vocab_size}; batch {batch} × {model.context} tokens")  # fmt: skip
    return Bench(title, model, batch, cases, steps, warmup)


def benches(quick: bool, steps: int | None) -> dict[str, Bench]:
    if quick:
        n = steps or 3
        tiny_gpt = models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=2, context=16)
        return {
            "seed": mlp((784, 64, 10), 64, n, 1),
            "wide": mlp((784, 128, 128, 10), 64, n, 1),
            "gpt": gpt(tiny_gpt, 8, n, 1, QUICK_GPT_CASES),
        }
    return {
        "seed": mlp((784, 512, 10), 256, steps or 60, 5),
        "wide": mlp((784, 2048, 2048, 10), 1024, steps or 60, 5),
        "gpt": gpt(models.Gpt(), 16, steps or 20, 3),
    }


def random_batch(model, batch, rng):
    """A global batch: the MLP's ``x[B, D]`` and one-hot ``y[B, C]``, or the GPT's token
    ``ids[B, S]`` and next tokens ``labels[B, S]``."""
    if getattr(model, "sequence", False):
        tokens = rng.integers(0, model.vocab_size, (batch, model.context + 1), dtype=np.int32)
        return tokens[:, :-1], tokens[:, 1:]
    sizes = model.sizes
    x = rng.random((batch, sizes[0]), dtype=np.float32)
    y = np.eye(sizes[-1], dtype=np.float32)[rng.integers(0, sizes[-1], batch)]
    return x, y


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


def compiled_costs(mesh, jitted, *args):
    """The collectives (``shardops.collectives``) and temp bytes of one compiled program."""
    compiled = jitted.lower(*args).compile()
    analysis = compiled.memory_analysis()
    temp = None if analysis is None else int(analysis.temp_size_in_bytes)
    return shardops.collectives(mesh, compiled), temp


def group_key(c) -> str:
    """The mesh axes a collective's groups span, or, for groups that match no set of mesh axes
    (GSPMD may split an axis into smaller groups), ``groups of N``."""
    return axes_key(c.axes) if c.axes is not None else f"groups of {c.group_size}"


def ring_bytes_per_group(collectives) -> dict[str, float]:
    """``shardops.ring_bytes`` summed per ``group_key``: what ``Ledger.ring_bytes`` gives, but
    also for groups the ledger refuses."""
    out: dict[str, float] = {}
    for c in collectives:
        if c.bytes:
            key = group_key(c)
            out[key] = out.get(key, 0.0) + shardops.ring_bytes(c.kind, c.bytes, c.group_size)
    return out


def axes_key(axes) -> str:
    return "×".join(axes) or "-"


def bench_case(strategy, mesh_shape, model, batch, *, steps, warmup, rng):
    n = mesh_shape[0] * mesh_shape[1]
    mesh = shardops.make_mesh(
        {"data": mesh_shape[0], "model": mesh_shape[1]}, devices=devices_for(n)
    )
    opt = optax.sgd(0.01)  # a small rate keeps thousands of benchmark steps finite
    setup = models.build(strategy, mesh, optimizer=opt, model=model)
    ref = models.build("ref", optimizer=opt, model=model)
    params = model.init(jax.random.key(0))
    x, y = random_batch(model, batch, rng)
    seq = x.shape[1] if getattr(model, "sequence", False) else None

    xs, ys = setup.place_batch(x, y)
    gspmd = gspmd_step(setup, ref)
    single_device = devices_for(1)[0]
    x1, y1 = jax.device_put((x, y), single_device)
    runs = {
        "shardops": [setup.train_step, setup.shard(params), (xs, ys)],
        "gspmd": [gspmd, setup.shard(params), (xs, ys)],
        "single": [ref.train_step, jax.device_put(ref.shard(params), single_device), (x1, y1)],
    }
    if strategy == "dp" and isinstance(model, models.Mlp):  # pmap's step is the MLP's
        pstep = pmap.pmap_train_step(opt, devices_for(n)[:n])
        runs["pmap"] = [
            lambda state, x, y: (pstep(*state, x, y)[:2], None),
            (pmap.replicate(params, n), pmap.replicate(opt.init(params), n)),
            (pmap.split_batch(x, n), pmap.split_batch(y, n)),
        ]

    # Communication and memory, from the compiled programs.
    shard_state = runs["shardops"][1]
    shard_colls, shard_temp = compiled_costs(mesh, setup.train_step, shard_state, xs, ys)
    gspmd_colls, gspmd_temp = compiled_costs(mesh, gspmd, runs["gspmd"][1], xs, ys)
    stray = [c for c in shard_colls if c.axes is None]
    if stray:  # shardops' collectives always run over mesh axes (shardops.ledger checks it)
        raise AssertionError(f"{strategy} {mesh_shape}: collectives over no mesh axes: {stray}")
    # The same shardops.ring_bytes turns both the compiled HLO's V and the model's V (the
    # strategy's collective_budget) into ring bytes: agreement checks V, not the formulas.
    model_bytes = setup.cost_model(batch, seq)
    gspmd_kinds: dict[str, int] = {}
    for c in gspmd_colls:
        if c.bytes:
            key = f"{c.kind} {group_key(c)}"
            gspmd_kinds[key] = gspmd_kinds.get(key, 0) + c.bytes
    row = {
        "strategy": strategy,
        "mesh": f"{mesh_shape[0]}x{mesh_shape[1]}",
        "ring_bytes_model": {axes_key(a): v for a, v in model_bytes.items()},
        "ring_bytes_shardops": ring_bytes_per_group(shard_colls),
        "ring_bytes_gspmd": ring_bytes_per_group(gspmd_colls),
        "gspmd_kinds": gspmd_kinds,
        "state_bytes_per_device": state_bytes_per_device(shard_state),
        "single_device_state_bytes": state_bytes_per_device(runs["single"][1]),
        "temp_bytes_shardops": shard_temp,
        "temp_bytes_gspmd": gspmd_temp,
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


def fmt_mb(n) -> str:
    return "" if n is None else f"{n / 1e6:.2f}"


def markdown(results) -> str:
    lines = []
    for block in results["models"].values():
        lines += [
            f"### {block['title']}",
            "",
            "| strategy | mesh | step ms | ÷ GSPMD (IQR) | ÷ single device (IQR) | GSPMD ÷ single | ÷ pmap | ring MB/device: model | shardops | GSPMD | state MB/device | temp MB: shardops | GSPMD |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for r in block["rows"]:

            def ratio(key, r=r):
                v = r[key]
                return f"{v['median']:.2f} ({v['q25']:.2f}–{v['q75']:.2f})"

            pm = ratio("vs_pmap") if "vs_pmap" in r else ""
            lines.append(
                f"| {r['strategy']} | {r['mesh']} | {r['step_ms']['shardops']:.2f} | {ratio('vs_gspmd')} | "
                f"{ratio('vs_single')} | {r['gspmd_vs_single']['median']:.2f} | {pm} | "
                f"{fmt_bytes(r['ring_bytes_model'])} | {fmt_bytes(r['ring_bytes_shardops'])} | "
                f"{fmt_bytes(r['ring_bytes_gspmd'])} | {fmt_mb(r['state_bytes_per_device'])} | "
                f"{fmt_mb(r['temp_bytes_shardops'])} | {fmt_mb(r['temp_bytes_gspmd'])} |"
            )  # fmt: skip
        single = block["rows"][0]
        lines.append(
            f"\nSingle-device step: {single['step_ms']['single']:.2f} ms; state "
            f"{fmt_mb(single['single_device_state_bytes'])} MB. {block['steps']} timed steps "
            f"per program after {block['warmup']} warm-up.\n"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps: checks it runs")
    p.add_argument(
        "--steps", type=int, default=None,
        help="timed steps per program (default 60 for the MLPs, 20 for the GPT; quick 3)",
    )  # fmt: skip
    p.add_argument(
        "--only", nargs="*", default=None, help="run only these tables (seed, wide, gpt)"
    )
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].platform} ×{len(devices_for(8))}",
        "jax": jax.__version__,
        "quick": args.quick,
        "load_average_at_start": os.getloadavg()[0],  # other processes share the cores
        "models": {},
    }  # fmt: skip
    start = time.perf_counter()
    for name, bench in benches(args.quick, args.steps).items():
        if args.only is not None and name not in args.only:
            continue
        block_start = time.perf_counter()
        rows = []
        for strategy, mesh_shape in bench.cases:
            row = bench_case(
                strategy, mesh_shape, bench.model, bench.batch,
                steps=bench.steps, warmup=bench.warmup, rng=rng,
            )  # fmt: skip
            rows.append(row)
            print(f"{name:>5} {strategy:>8} {row['mesh']}: {row['step_ms']['shardops']:8.2f} ms, "
                  f"÷GSPMD {row['vs_gspmd']['median']:.2f}, ÷single {row['vs_single']['median']:.2f}"
                  + (f", ÷pmap {row['vs_pmap']['median']:.2f}" if "vs_pmap" in row else ""), flush=True)  # fmt: skip
        block = {"title": bench.title, "batch": bench.batch, "steps": bench.steps,
                 "warmup": bench.warmup, "rows": rows}  # fmt: skip
        if isinstance(bench.model, models.Mlp):
            block["sizes"] = list(bench.model.sizes)
        else:
            block["gpt"] = dataclasses.asdict(bench.model)
        block["seconds"] = time.perf_counter() - block_start
        results["models"][name] = block
    results["seconds"] = time.perf_counter() - start
    results["load_average_at_end"] = os.getloadavg()[0]
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
