"""The dropless MoE layer (tokens sorted by expert, grouped matmuls) against the capacity-padded
einsum dispatch, on one device: the forward and backward step time.

    python benchmarks/moe_dropless.py           # the realistic shape (a TPU; minutes)
    python benchmarks/moe_dropless.py --quick   # tiny shapes on CPU (CI); times mean nothing
    python benchmarks/moe_dropless.py --tables-only  # docs/moe.md's table from the stored JSON

The layer is ``shardops.layers.moe`` (the unsharded MoE, one device) with ``E = 8`` SwiGLU
experts, ``k = 2``, softmax scores, under ``shardops.MIXED_BFLOAT16`` (float32 parameters,
bfloat16 products accumulated in float32). ``SHAPE``: ``x[G = 16, S = 1024, D = 1024]`` (16384
tokens in 16 capacity groups of 1024), ``F = 2816``. The programs (``PROGRAMS``), each one
``jax.jit`` of ``jax.value_and_grad`` of ``Σ ct·y + 0.01·load_balance + 0.001·z_loss`` in the
parameters and ``x``, followed by an SGD update (the parameters are the donated state):

- ``dropless ragged_dot``: ``capacity_factor=None``, the experts by ``lax.ragged_dot``;
- ``dropless megablox``: the same by JAX's Pallas TPU kernels ``gmm``/``tgmm`` (a TPU only;
  elsewhere its row says so);
- ``capacity 1.25``: the capacity path at ``capacity_factor = 1.25`` (``C = 320`` slots per
  expert per group: drops);
- ``capacity E/k``: at ``capacity_factor = E / k = 4`` (``C = S``: nothing dropped, the same
  result as dropless, and four times the experts' rows of it).

They are timed in one rotation (``strategies.time_in_rotation``: one step of each per round,
every other round reversed, one step in flight), so each ratio is the median of paired
step-by-step ratios with its interquartile range. Per program: the median step, the experts'
useful TFLOP/s (``3 · 2 · T·k · D · F · 3``, the tokens' own products, forward and backward,
over the step), the temp and peak bytes of the compiled step (``memory_analysis``), and the
choices dropped at the initial weights. Checks: the dropless programs' ``y`` against
``capacity E/k``'s (the same choices, nothing dropped), as the largest difference over the
largest ``|y|``.

It writes ``benchmarks/results/moe_dropless.json`` and ``moe_dropless.md`` and, from that JSON,
the table between the ``moe-dropless:start``/``end`` markers of docs/moe.md
(tests/test_benchmark_moe_dropless.py checks they match); ``--quick`` writes to a temporary
folder unless ``--out`` is given.
"""

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from strategies import write_between_markers

RESULTS = pathlib.Path(__file__).parent / "results"
PAGE = pathlib.Path(__file__).parent.parent / "docs" / "moe.md"
START, END = "<!-- moe-dropless:start -->", "<!-- moe-dropless:end -->"
SHAPE = {"groups": 16, "seq": 1024, "d_model": 1024, "d_ff": 2816, "experts": 8, "k": 2}
QUICK_SHAPE = {"groups": 2, "seq": 32, "d_model": 16, "d_ff": 32, "experts": 8, "k": 2}
PROGRAMS = {  # label → moe's options
    "dropless ragged_dot": {"capacity_factor": None, "grouped_matmul": "ragged_dot"},
    "dropless megablox": {"capacity_factor": None, "grouped_matmul": "megablox"},
    "capacity 1.25": {"capacity_factor": 1.25},
    "capacity E/k": {"capacity_factor": "E/k"},
}
BASELINES = ("capacity 1.25", "capacity E/k")  # every program's paired ratio to each
LOAD_BALANCE_WEIGHT, Z_LOSS_WEIGHT, LR = 0.01, 0.001, 1e-3


def options_of(label: str, shape: dict) -> dict:
    options = dict(PROGRAMS[label])
    if options["capacity_factor"] == "E/k":
        options["capacity_factor"] = shape["experts"] / shape["k"]
    return options


def step_of(options: dict):
    """``step(params, x, ct) → (params', loss, stats)``: value_and_grad of the loss in the
    parameters and x, then SGD on the parameters (donated)."""
    import jax
    import jax.numpy as jnp

    import shardops
    from shardops.layers import moe

    def loss(params, x, ct):
        y, stats = moe(x, params, k=2, precision=shardops.MIXED_BFLOAT16, **options)
        total = jnp.sum(ct * y.astype(jnp.float32))
        return total + LOAD_BALANCE_WEIGHT * stats.load_balance + Z_LOSS_WEIGHT * stats.z_loss, (
            y,
            stats,
        )

    def step(params, x, ct):
        (value, (_, stats)), (dp, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            params, x, ct
        )
        new = jax.tree.map(lambda p, g: p - LR * g, params, dp)
        return new, value + 0.0 * jnp.sum(dx.astype(jnp.float32)), stats.dropped

    return jax.jit(step, donate_argnums=0), jax.jit(lambda p, x: moe(x, p, k=2, precision=shardops.MIXED_BFLOAT16, **options))  # fmt: skip


def run(quick: bool, steps: int, warmup: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from strategies import time_in_rotation

    from shardops.layers import init_moe, moe_capacity

    shape = QUICK_SHAPE if quick else SHAPE
    g, s, d, f, e, k = (shape[n] for n in ("groups", "seq", "d_model", "d_ff", "experts", "k"))
    device = jax.devices()[0]
    params = init_moe(jax.random.key(0), d, f, e)  # float32
    x = jax.random.normal(jax.random.key(1), (g, s, d), jnp.bfloat16)
    ct = jax.random.normal(jax.random.key(2), (g, s, d), jnp.float32) / (g * s)
    x, ct = jax.device_put((x, ct), device)
    rows, runs, forward = {}, {}, {}
    on_tpu = device.platform == "tpu"
    for label in PROGRAMS:
        options = options_of(label, shape)
        if options.get("grouped_matmul") == "megablox" and not on_tpu:
            rows[label] = {"label": label, "error": "no TPU (megablox's kernels are TPU kernels)"}
            continue
        step, fwd = step_of(options)
        state = jax.device_put(jax.tree.map(jnp.copy, params), device)
        try:
            compiled = step.lower(state, x, ct).compile()
            memory = compiled.memory_analysis()
            _, _, dropped = jax.block_until_ready(step(jax.tree.map(jnp.copy, state), x, ct))
            y = jax.block_until_ready(fwd(params, x)[0])
        except Exception as err:  # a program the backend cannot run is a row that says why
            rows[label] = {"label": label, "error": f"{type(err).__name__}: {str(err)[:300]}"}
            print(f"{label}: {rows[label]['error']}", flush=True)
            continue
        cf = options["capacity_factor"]
        rows[label] = {
            "label": label,
            "capacity": None if cf is None else moe_capacity(s, k, e, cf),
            "dropped": float(jnp.sum(dropped)),
            "temp_bytes": int(memory.temp_size_in_bytes),
            "peak_bytes": int(memory.temp_size_in_bytes + memory.argument_size_in_bytes
                              + memory.output_size_in_bytes - memory.alias_size_in_bytes),
        }  # fmt: skip
        forward[label] = np.asarray(y, np.float32)
        runs[label] = [step, state, (x, ct)]
        print(f"compiled {label}", flush=True)
    t = time_in_rotation(runs, warmup, steps)
    flops = 3 * 2 * g * s * k * d * f * 3  # the tokens' own expert products, forward + backward
    add_timings(rows, t, flops, forward)
    return {
        "shape": shape,
        "tokens": g * s,
        "steps": steps,
        "warmup": warmup,
        "device": f"{device.platform}: {device.device_kind}",
        "rows": list(rows.values()),
    }


def add_timings(rows: dict, t: dict, flops: float, forward: dict) -> None:
    """Each timed row's median step (ms), the experts' useful TFLOP/s (``flops`` a step), its
    paired ratios to ``BASELINES`` from the rotation's times ``t``, and a dropless row's ``y``
    against ``capacity E/k``'s (``forward``: label → y)."""
    import numpy as np
    from strategies import paired

    want = forward.get("capacity E/k")
    for label, row in rows.items():
        if label not in t:
            continue
        row["step_ms"] = float(np.median(t[label]) * 1e3)
        row["expert_tflops"] = flops / np.median(t[label]) / 1e12
        row["vs"] = {b: paired(t, label, b) for b in BASELINES if b in t and b != label}
        if want is not None and label.startswith("dropless"):
            row["y_vs_capacity_ek"] = float(np.max(np.abs(forward[label] - want)) / np.max(np.abs(want)))  # fmt: skip


def markdown(results) -> str:
    sh = results["shape"]
    lines = [
        f"Measured on {results['device']} ({results['machine']}), JAX {results['jax']}; the run "
        f"took {results['seconds']:.0f} s. `x[G={sh['groups']}, S={sh['seq']}, "
        f"D={sh['d_model']}]` ({results['tokens']} tokens), F = {sh['d_ff']}, E = "
        f"{sh['experts']}, k = {sh['k']}, MIXED_BFLOAT16; forward + backward + SGD, "
        f"{results['steps']} timed steps per program after {results['warmup']} warm-up, all "
        f"programs in one rotation.",
        "",
        "| program | slots C | dropped choices | step ms | expert TFLOP/s | ÷ capacity 1.25 (IQR) | ÷ capacity E/k (IQR) | temp MB | peak MB | y vs capacity E/k |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['label']} | not run: {r['error'][:120]} | | | | | | | | |")
            continue
        vs = r.get("vs", {})
        ratio = [_fmt_ratio(vs.get(b)) if b != r["label"] else "1" for b in BASELINES]
        cap = "—" if r["capacity"] is None else str(r["capacity"])
        check = f"{r['y_vs_capacity_ek']:.1e}" if "y_vs_capacity_ek" in r else ""
        lines.append(
            f"| {r['label']} | {cap} | {r['dropped']:.0f} | {r['step_ms']:.1f} | "
            f"{r['expert_tflops']:.1f} | {ratio[0]} | {ratio[1]} | {r['temp_bytes'] / 1e6:.0f} | "
            f"{r['peak_bytes'] / 1e6:.0f} | {check} |"
        )
    return "\n".join(lines)


def _fmt_ratio(v) -> str:
    return "" if v is None else f"{v['median']:.2f} ({v['q25']:.2f}–{v['q75']:.2f})"


def write_table(results, path=PAGE) -> None:
    """Replace the table between docs/moe.md's markers by ``markdown(results)``."""
    write_between_markers(path, START, END, markdown(results))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes on CPU: checks it runs")
    p.add_argument("--steps", type=int, default=None, help="timed rounds (default 20; quick 2)")
    p.add_argument("--out", default=None,
                   help=f"results folder (default {RESULTS}; with --quick a temporary folder)")  # fmt: skip
    p.add_argument("--tables-only", action="store_true",
                   help="rewrite docs/moe.md's table (and moe_dropless.md) from the stored JSON")  # fmt: skip
    args = p.parse_args(argv)
    if args.tables_only:
        results = json.loads((RESULTS / "moe_dropless.json").read_text())
        (RESULTS / "moe_dropless.md").write_text(markdown(results) + "\n")
        write_table(results)
        return results
    if args.quick:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="shardops_moe_dropless_") if args.quick else str(RESULTS)
    out = pathlib.Path(args.out)

    import jax

    start = time.perf_counter()
    steps = args.steps or (2 if args.quick else 20)
    results = run(args.quick, steps, 1 if args.quick else 3)
    results.update({
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "jax": jax.__version__,
        "quick": args.quick,
        "seconds": time.perf_counter() - start,
    })  # fmt: skip
    table = markdown(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_dropless.json").write_text(json.dumps(results, indent=1))
    (out / "moe_dropless.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'moe_dropless.json'} and {out / 'moe_dropless.md'}")
    if out.resolve() == RESULTS.resolve():  # docs/moe.md's table follows the committed JSON
        write_table(results)
    return results


if __name__ == "__main__":
    main()
