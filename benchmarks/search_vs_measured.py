"""Check the layout search against measurement: Spearman ρ between predicted and measured step
times of every layout it lists, on 8 simulated CPU devices.

    python benchmarks/search_vs_measured.py            # about 6 minutes on 2 cores
    python benchmarks/search_vs_measured.py --quick    # tiny models, a few steps: checks it runs

For the seed MLP (784-512-10, batch 256), the wide MLP (784-2048-2048-10, batch 1024) and the GPT
(``models.Gpt()``, batch 16 × 128 tokens), the configurations of ``benchmarks/strategies.py``,
with ``optax.sgd(0.01)`` as there:

1. ``shardops_models.search.calibrate()`` measures this machine's devices (a matmul, an elementwise
   chain, collectives of a few sizes: microbenchmarks that know nothing of the models), once,
   before any layout runs. Nothing is fitted to the layouts' times.
2. ``shardops_models.search.search(model, batch, 8, hardware=that)`` lists and ranks the layouts.
3. Every listed layout's train step is timed: one step of each in turn, every other round in
   reverse order, each step waited for (one in flight: XLA:CPU's collectives deadlock with 8
   simulated devices on 2 cores otherwise), warm-up rounds left out; the median per layout.
4. Spearman ρ (average ranks for ties) of predicted against measured, per model and over all
   layouts of the three models, and the same without the layouts that hold replicas.

Writes ``benchmarks/results/search_vs_measured.json`` and ``.md``.
"""

import argparse
import json
import os
import pathlib
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from strategies import random_batch  # noqa: E402

import shardops  # noqa: E402
import shardops_models as models  # noqa: E402
import shardops_models.search  # noqa: E402
from shardops.inspect import hlo_collectives, lowered_collectives  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
DEVICES = 8


def benches(quick: bool):
    """name → (model, batch, timed rounds, warm-up rounds)."""
    if quick:
        return {
            "seed": (models.Mlp((784, 64, 10)), 64, 3, 1),
            "gpt": (models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=1, context=16),
                    8, 3, 1),
        }  # fmt: skip
    return {
        "seed": (models.Mlp(models.SEED_SIZES), 256, 40, 3),
        "wide": (models.Mlp((784, 2048, 2048, 10)), 1024, 10, 2),
        "gpt": (models.Gpt(), 16, 10, 2),
    }


def spearman(a, b) -> float:
    """Spearman's ρ: Pearson's correlation of the ranks (ties get their average rank)."""

    def ranks(x):
        x = np.asarray(x, float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(1, len(x) + 1)
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def measure(model, batch, layouts, *, rounds, warmup, rng):
    """Median step time (s) of each layout, timed in rotation (see the module docstring), and
    whether the compiled program asks for exactly the bytes the search predicted."""
    x, y = random_batch(model, batch, rng)
    runs, matches = {}, {}
    for lay in layouts:
        d, m = lay.mesh
        mesh = shardops.make_mesh({"data": d, "model": m})
        setup = models.build(lay.strategy, mesh, optimizer=shardops_models.search._search._optimizer("sgd"),
                             model=model)  # fmt: skip
        state = setup.init(jax.random.key(0))
        xb, yb = setup.place_batch(x, y)
        lowered = setup.train_step.lower(state, xb, yb)
        step = lowered.compile()
        requested = shardops.inspect.Ledger(
            mesh,
            tuple(hlo_collectives(step.as_text(), mesh)),
            tuple(lowered_collectives(lowered.as_text(), mesh)),
        ).totals(requested=True)  # the ledger of the program timed: the search's bytes?
        matches[lay.name] = requested == lay.budget
        runs[lay.name] = [step, state, (xb, yb)]
    times = {name: [] for name in runs}
    for i in range(warmup + rounds):
        for name in list(runs) if i % 2 == 0 else reversed(list(runs)):
            run = runs[name]
            start = time.perf_counter()
            out = jax.block_until_ready(run[0](run[1], *run[2]))
            elapsed = time.perf_counter() - start
            run[1] = out[0]  # the donated state is replaced by the new one
            if i >= warmup:
                times[name].append(elapsed)
    return {name: float(np.median(t)) for name, t in times.items()}, matches


def markdown(results) -> str:
    lines = [
        f"Measured on {results['machine']}, JAX {results['jax']}; load average "
        f"{results['load_average_at_start']:.1f} at the start, "
        f"{results['load_average_at_end']:.1f} at the end; {results['seconds']:.0f} s.",
        "",
        f"Calibrated hardware: {results['hardware_text']}.",
        "",
        f"Predicted bytes equal to the compiled ledger (requested) of the program timed: "
        f"{sum(r['bytes_equal_ledger'] for b in results['models'].values() for r in b['rows'])}"
        f" of {sum(len(b['rows']) for b in results['models'].values())} layouts.",
        "",
        "| model | layouts | Spearman ρ | ρ, compiled counts | without replicas | ρ | ρ, compiled counts |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, s in results["spearman"].items():
        lines.append(f"| {name} | {s['n_all']} | {s['all']:.3f} | {s['recounted_all']:.3f} | "
                     f"{s['n_no_replicas']} | {s['no_replicas']:.3f} | "
                     f"{s['recounted_no_replicas']:.3f} |")  # fmt: skip
    for name, block in results["models"].items():
        lines += [
            "",
            f"### {name}: {block['title']}, batch {block['batch']}",
            "",
            "| predicted rank | measured rank | layout | replicas | predicted ms | compute ms | comm ms | compiled counts ms | measured ms | measured ÷ predicted |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for r in block["rows"]:
            lines.append(
                f"| {r['predicted_rank']} | {r['measured_rank']} | {r['layout']} | "
                f"{r['replicas']} | {r['predicted_ms']:.2f} | {r['compute_ms']:.2f} | "
                f"{r['comm_ms']:.2f} | {r['recounted_ms']:.2f} | {r['measured_ms']:.2f} | "
                f"{r['measured_ms'] / r['predicted_ms']:.2f} |"
            )
    return "\n".join(lines)


def hardware_text(hardware) -> str:
    """The calibrated hardware in a line (the table's heading)."""
    return (
        f"matmul {hardware.flops['float32'] / 1e9:.1f} GFLOP/s per device, elementwise "
        f"{hardware.memory_bandwidth / 1e9:.2f} GB/s (counted bytes), all-reduce "
        f"{hardware.bandwidth['data'] / 1e9:.2f} GB/s ring bytes, latency "
        f"{hardware.latency * 1e6:.0f} µs, efficiency "
        + ", ".join(f"{k} {v:.2f}" for k, v in hardware.efficiency.items())
    )


def layout_rows(planned, measured, matches, recounted) -> list[dict]:
    """One row per searched layout: its predicted and measured ranks and times, whether the
    compiled ledger asks for the bytes predicted, and its collectives."""
    order = sorted(planned.candidates, key=lambda lay: measured[lay.name])
    measured_rank = {lay.name: i + 1 for i, lay in enumerate(order)}
    return [{
        "layout": lay.name, "strategy": lay.strategy, "mesh": list(lay.mesh),
        "replicas": lay.replicas, "predicted_rank": lay.rank,
        "measured_rank": measured_rank[lay.name], "predicted_ms": lay.step_time * 1e3,
        "compute_ms": lay.compute_time * 1e3, "comm_ms": sum(lay.comm_time.values()) * 1e3,
        "measured_ms": measured[lay.name] * 1e3, "bytes_equal_ledger": matches[lay.name],
        "recounted_ms": recounted[lay.name].step_time * 1e3,
        "collectives": {"×".join(a): n for a, n in lay.collectives.items()},
    } for lay in planned.candidates]  # fmt: skip


def rank_correlations(rows, pooled) -> dict:
    """Spearman's ρ of predicted and of recounted against measured times, over all the rows and
    over those without replicas (NaN for two rows or fewer), with the counts; each subset's
    times are added to ``pooled`` (subset → predicted, measured, recounted)."""
    stats = {}
    for subset, keep in (
        ("all", lambda r: True),
        ("no_replicas", lambda r: r["replicas"] == 1),
    ):
        chosen = [r for r in rows if keep(r)]
        pred = [r["predicted_ms"] for r in chosen]
        meas = [r["measured_ms"] for r in chosen]
        recount = [r["recounted_ms"] for r in chosen]
        stats[subset] = spearman(pred, meas) if len(chosen) > 2 else float("nan")
        stats[f"recounted_{subset}"] = spearman(recount, meas) if len(chosen) > 2 else float("nan")
        stats[f"n_{subset}"] = len(chosen)
        pooled[subset][0].extend(pred)
        pooled[subset][1].extend(meas)
        pooled[subset][2].extend(recount)
    return stats


def pooled_correlations(pooled) -> dict:
    """``rank_correlations``' figures over every model's rows together."""
    return {
        "all": spearman(*pooled["all"][:2]), "n_all": len(pooled["all"][0]),
        "no_replicas": spearman(*pooled["no_replicas"][:2]),
        "n_no_replicas": len(pooled["no_replicas"][0]),
        "recounted_all": spearman(pooled["all"][2], pooled["all"][1]),
        "recounted_no_replicas": spearman(pooled["no_replicas"][2], pooled["no_replicas"][1]),
    }  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if len(jax.devices()) < DEVICES:
        raise RuntimeError(f"needs {DEVICES} CPU devices; JAX started with {len(jax.devices())}")
    start = time.perf_counter()
    load = os.getloadavg()[0]
    hardware = shardops_models.search.calibrate()
    print(hardware, flush=True)
    rng = np.random.default_rng(0)
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, cpu ×{DEVICES}",
        "jax": jax.__version__, "quick": args.quick, "load_average_at_start": load,
        "hardware": {k: v for k, v in vars(hardware).items()},
        "hardware_text": hardware_text(hardware),
        "models": {}, "spearman": {},
    }  # fmt: skip
    pooled = {"all": ([], [], []), "no_replicas": ([], [], [])}
    for name, (model, batch, rounds, warmup) in benches(args.quick).items():
        t0 = time.perf_counter()
        planned = shardops_models.search.search(model, batch, DEVICES, optimizer="sgd", hardware=hardware,
                                     compile_top=100)  # fmt: skip
        recounted = {lay.name: shardops_models.search.recounted(lay, hardware) for lay in planned}
        measured, matches = measure(model, batch, planned.candidates, rounds=rounds, warmup=warmup,
                                    rng=rng)  # fmt: skip
        rows = layout_rows(planned, measured, matches, recounted)
        stats = rank_correlations(rows, pooled)
        results["spearman"][name] = stats
        results["models"][name] = {
            "title": getattr(model, "name", name), "batch": batch, "rounds": rounds,
            "warmup": warmup, "rows": rows, "seconds": time.perf_counter() - t0,
        }  # fmt: skip
        print(f"{name}: ρ = {stats['all']:.3f} over {stats['n_all']} layouts, "
              f"{stats['no_replicas']:.3f} without replicas "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    results["spearman"]["all three models"] = pooled_correlations(pooled)
    results["seconds"] = time.perf_counter() - start
    results["load_average_at_end"] = os.getloadavg()[0]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "search_vs_measured_quick" if args.quick else "search_vs_measured"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    table = markdown(results)
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    main()
