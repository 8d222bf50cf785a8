"""Context parallelism: memory per device and step time of all-gather, ring and Ulysses attention
against GSPMD with the sequence sharded.

    python benchmarks/context_parallel.py                # the full tables (about 10 minutes)
    python benchmarks/context_parallel.py --quick        # a small end-to-end run (CI)
    python benchmarks/context_parallel.py --tables-only  # docs/context-parallelism.md's tables

The model is a Llama (``MODEL``: width 128, 2 blocks, 8 heads each with its own K/V, so that
Ulysses splits them over 8 devices; rotary positions, so no table grows with S), batch 1, SGD.
Strategy ``ref+<method>``: context parallelism alone, on a mesh ``context = N``. Nothing here
runs out of memory: the memory figures are XLA's own ``memory_analysis()`` of the compiled
programs (compiled, not run).

1. **Temp memory at fixed S** (``S = 4096``; the quick run 256), per device, for N = 1, 2, 4, 8:
   the whole training step (``Setup.train_step``), and the attention layer alone (forward and
   gradients of ``shardops.layers.context_parallel_attention`` with x in the layout), each
   method and GSPMD (the unsharded step under ``jax.jit`` with the token ids sharded along S
   over ``context``: what a user would write instead).
2. **The longest S under a budget**: the largest power-of-two S whose step fits ``BUDGET``
   bytes per device (peak = arguments + outputs − donated + temp), on one device without
   context parallelism and on context = 8 for each method and GSPMD.
3. **Step time**, paired: on context = 8 at ``S = 2048`` the three methods and GSPMD are timed
   in rotation, one step each per round (one step in flight: the hang trap), and each ratio
   is the median of step-by-step ratios against the ring, with its interquartile range.

It writes ``benchmarks/results/context_parallel.json`` and ``.md`` and, from that JSON, the tables
between the ``context-tables`` markers of docs/context-parallelism.md (tests/test_benchmark.py
checks they match).
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
from strategies import memory_of, paired, start_platform

RESULTS = pathlib.Path(__file__).parent / "results"
PAGE = pathlib.Path(__file__).parent.parent / "docs" / "context-parallelism.md"
START, END = "<!-- context-tables:start -->", "<!-- context-tables:end -->"
METHODS = ("allgather", "ring", "ulysses")
SIZES = (1, 2, 4, 8)
BUDGET = 256 * 2**20  # bytes per device for the longest-S search


def model_of(seq: int, layers: int = 2):
    import shardops_models as models

    return models.Llama(vocab_size=256, d_model=128, num_layers=layers, num_heads=8,
                        num_kv_heads=8, d_ff=352, context=seq)  # fmt: skip


def compiled_step(label: str, n: int, seq: int, devices, layers: int):
    """The compiled train step of ``label`` (a method, ``gspmd`` or ``single``) on context = n."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardops
    import shardops_models as models

    model, opt = model_of(seq, layers), optax.sgd(0.01)
    ids = jax.ShapeDtypeStruct((1, seq), jax.numpy.int32)
    if label == "single":
        setup = models.build("ref", model=model, optimizer=opt)
        state = jax.eval_shape(setup.init, jax.random.key(0))
        return jax.jit(setup.step, donate_argnums=0).lower(state, ids, ids).compile()
    mesh = shardops.make_mesh({"context": n}, devices=devices[:n])
    if label == "gspmd":
        ref = models.build("ref", model=model, optimizer=opt)
        state = jax.eval_shape(ref.init, jax.random.key(0))
        whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "context"))
        step = jax.jit(ref.step, in_shardings=(jax.tree.map(lambda _: whole, state), split, split),
                       out_shardings=(jax.tree.map(lambda _: whole, state), whole),
                       donate_argnums=0)  # fmt: skip
        return step.lower(state, ids, ids).compile()
    setup = models.build(f"ref+{label}", mesh, model=model, optimizer=opt)
    return setup.train_step.lower(*setup.abstract_step_args(1, seq)).compile()


def attention_temp(method: str, n: int, seq: int, devices) -> int:
    """Temp bytes per device of the attention layer's forward and gradients (x in the layout)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardops
    from shardops.layers import context_parallel_attention, init_attention

    mesh = shardops.make_mesh({"context": n}, devices=devices[:n], axis_types="auto")
    params = jax.eval_shape(lambda: init_attention(jax.random.key(0), 128, 8, 16))
    x = jax.ShapeDtypeStruct((1, seq, 128), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "context")))  # fmt: skip

    def loss(x, params):
        y = context_parallel_attention(x, params, mesh=mesh, num_heads=8, causal=True,
                                       rope_theta=10000.0, method=method, permute=False)  # fmt: skip
        return jnp.sum(y)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def fixed_s(seq: int, devices, layers: int, sizes=SIZES) -> list[dict]:
    rows = []
    for n in sizes:
        for label in (*METHODS, "gspmd"):
            memory = memory_of(compiled_step(label, n, seq, devices, layers))
            attention = attention_temp(label, n, seq, devices) if label in METHODS else None
            rows.append({"label": label, "n": n, "seq": seq, "step": memory,
                         "attention_temp": attention})  # fmt: skip
            print(f"S={seq} context={n} {label:>9}: step temp {memory['temp'] / 2**20:8.2f} MiB"
                  + ("" if attention is None else f", attention temp "
                     f"{attention / 2**20:8.2f} MiB"), flush=True)  # fmt: skip
    return rows


def longest_s(start: int, limit: int, devices, layers: int, budget: int, n_cp: int = 8):
    rows = []
    for label, n in (("single", 1), *((m, n_cp) for m in METHODS), ("gspmd", n_cp)):
        fits, seq, peak = None, start, None
        while seq <= limit:
            memory = memory_of(compiled_step(label, n, seq, devices, layers))
            if memory["peak"] > budget:
                break
            fits, peak, seq = seq, memory["peak"], seq * 2
        rows.append({"label": label, "n": n, "longest_seq": fits, "peak": peak,
                     "budget": budget, "searched_to": limit})  # fmt: skip
        print(
            f"longest S under {budget / 2**20:.0f} MiB: {label} on context={n}: {fits}", flush=True
        )
    return rows


def timed(seq: int, devices, layers: int, steps: int, warmup: int, n: int = 8) -> dict:
    import jax
    import numpy as np
    import optax

    import shardops
    import shardops_models as models

    model, opt = model_of(seq, layers), optax.sgd(0.01)
    mesh = shardops.make_mesh({"context": n}, devices=devices[:n])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (1, seq + 1), dtype=np.int32)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    params = model.init(jax.random.key(0))
    runs = {}
    for method in METHODS:
        setup = models.build(f"ref+{method}", mesh, model=model, optimizer=opt)
        runs[method] = [setup.train_step, setup.shard(params), setup.place_batch(ids, labels)]
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "context"))
    ref = models.build("ref", model=model, optimizer=opt)
    state = jax.device_put(ref.shard(params), whole)
    gspmd = jax.jit(ref.step, in_shardings=(jax.tree.map(lambda _: whole, state), split, split),
                    out_shardings=(jax.tree.map(lambda _: whole, state), whole),
                    donate_argnums=0)  # fmt: skip
    runs["gspmd"] = [gspmd, state, jax.device_put((ids, labels), split)]
    times = {k: [] for k in runs}
    for i in range(warmup + steps):
        for name in list(runs) if i % 2 == 0 else reversed(list(runs)):
            run = runs[name]
            begin = time.perf_counter()
            out = jax.block_until_ready(run[0](run[1], *run[2]))
            elapsed = time.perf_counter() - begin
            run[1] = out[0]
            if i >= warmup:
                times[name].append(elapsed)
    t = {k: np.array(v) for k, v in times.items()}
    out = {"seq": seq, "n": n, "steps": steps,
           "step_ms": {k: float(np.median(v) * 1e3) for k, v in t.items()},
           "vs_ring": {k: paired(t, k, "ring") for k in t if k != "ring"}}  # fmt: skip
    print(f"step time on context={n}, S={seq}: "
          + ", ".join(f"{k} {v:.0f} ms" for k, v in out["step_ms"].items()), flush=True)  # fmt: skip
    return out


def mib(n) -> str:
    return "—" if n is None else f"{n / 2**20:.2f}"


def markdown(results: dict) -> str:
    fixed = results["fixed_s"]
    seq = fixed[0]["seq"]
    sizes = sorted({r["n"] for r in fixed})
    lines = [f"Temp memory per device (MiB, XLA's memory analysis) at S = {seq}, batch 1, "
             f"against context = 1 of the same method:", "",
             "| program | method | " + " | ".join(f"context = {n}" for n in sizes) + " |",
             "|---|---|" + "---:|" * len(sizes)]  # fmt: skip
    for program, key in (("training step", "step"), ("attention layer", "attention_temp")):
        for label in (*METHODS, "gspmd"):
            row = {r["n"]: r for r in fixed if r["label"] == label}
            if key == "attention_temp" and label == "gspmd":
                continue
            value = {n: (row[n][key]["temp"] if key == "step" else row[n][key]) for n in row}
            cells = [f"{mib(value[n])} ({value[n] / value[1]:.2f}×)" for n in sizes]
            lines.append(f"| {program} | {label} | " + " | ".join(cells) + " |")
    longest = results["longest_s"]
    budget = longest[0]["budget"]
    lines += ["", f"The longest power-of-two S whose training step fits {budget / 2**20:.0f} MiB "
              f"per device (peak = arguments + outputs − donated + temp), batch 1:", "",
              "| program | devices | longest S | its peak (MiB) |", "|---|---:|---:|---:|"]  # fmt: skip
    for r in longest:
        name = "one device, no context parallelism" if r["label"] == "single" else r["label"]
        s = "—" if r["longest_seq"] is None else f"{r['longest_seq']:,}"
        if r["longest_seq"] == r["searched_to"]:
            s = f"≥ {s}"
        lines.append(f"| {name} | {r['n']} | {s} | {mib(r['peak'])} |")
    t = results["timing"]
    lines += ["", f"Step time on context = {t['n']}, S = {t['seq']}, batch 1 ({t['steps']} "
              f"paired steps; CPU, 8 simulated devices on 2 cores: ratios, not speeds):", "",
              "| program | step (ms) | ÷ ring, median [IQR] |", "|---|---:|---:|"]  # fmt: skip
    for k, ms in t["step_ms"].items():
        ratio = t["vs_ring"].get(k)
        cell = "1" if ratio is None else (f"{ratio['median']:.2f} [{ratio['q25']:.2f}, "
                                          f"{ratio['q75']:.2f}]")  # fmt: skip
        lines.append(f"| {k} | {ms:.0f} | {cell} |")
    return "\n".join(lines) + "\n"


def write_tables(results: dict, page: pathlib.Path = PAGE) -> None:
    text = page.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{page} needs the markers {START} and {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{START}\n{markdown(results)}{END}{tail}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks it runs")
    p.add_argument("--tables-only", action="store_true", help="the docs' tables from the JSON")
    p.add_argument("--out", default=None, help=f"results folder (default {RESULTS})")
    args = p.parse_args(argv)
    if args.tables_only:
        write_tables(json.loads((RESULTS / "context_parallel.json").read_text()))
        return 0
    out = pathlib.Path(args.out or (tempfile.mkdtemp() if args.quick else RESULTS))
    devices = start_platform("cpu")
    # layers, S at fixed S, the longest-S search's first and last S, the budget, the context
    # sizes, timed steps and warm-up, S of the timed steps
    if args.quick:  # one compile per program: it only checks the script end to end
        config = (1, 64, 64, 64, 2**30, (1, 2), 1, 0, 64)
    else:
        config = (2, 4096, 256, 131072, BUDGET, SIZES, 10, 2, 2048)
    layers, seq, start, limit, budget, sizes, steps, warmup, time_seq = config
    n = sizes[-1]
    began = time.perf_counter()
    results = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "model": model_of(seq, layers).name,
        "fixed_s": fixed_s(seq, devices, layers, sizes),
        "longest_s": longest_s(start, limit, devices, layers, budget, n),
        "timing": timed(time_seq, devices, layers, steps, warmup, n),
    }
    results["seconds"] = time.perf_counter() - began
    out.mkdir(parents=True, exist_ok=True)
    (out / "context_parallel.json").write_text(json.dumps(results, indent=1))
    (out / "context_parallel.md").write_text(markdown(results))
    if not args.quick and args.out is None:
        write_tables(results)
    print(f"wrote {out / 'context_parallel.json'} in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
