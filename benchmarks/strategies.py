"""Benchmark every strategy and its variants against GSPMD, jax.pmap and the single-device step.

    python benchmarks/strategies.py                # the full tables (about 23 minutes on 2 cores)
    python benchmarks/strategies.py --quick        # a small end-to-end run (CI); times mean nothing
    python benchmarks/strategies.py --tables-only  # docs/benchmarks.md's tables from the stored JSON
    python benchmarks/strategies.py --platform gpu # the same tables on the GPUs present
    python benchmarks/strategies.py --only gpt --strategy hsdp_tp --mesh replica=2,data=2,model=2
                                                   # one case, on a mesh of named axes

For the seed's MLP (784-512-10, batch 256), a wider one (784-2048-2048-10, batch 1024), a
GPT (``models.Gpt()``: 4 layers, width 128, 4 heads, vocabulary 256; batch 16 × 128 tokens) and
a Llama (``LLAMA``: the same sizes, 8 heads sharing 2 KV heads, the blocks under one scan; every
strategy), and for each strategy × mesh, it measures in one process (tokens/s for the
language models: the global batch's tokens over the step time):

- the cases: every strategy on a data × model mesh, and HSDP (``hsdp``, ``hsdp_tp``) on named
  axes ``replica × data (× model)``; ``--strategy`` (with ``--mesh``, one case on any mesh, a
  temporary results folder) picks.
- variant rows: the same strategy and mesh with one option of ``models.build`` changed:
  ``collective_matmul="ring"`` / ``"bidirectional"`` (``tp ring``), ``fsdp_dense=
  "gather_weights"`` (the behaviour before the per-layer choice) and ``remat=True``.
- step time: the median of the timed steps after warm-up (60 per program for the MLPs, 20 for
  the GPT and the Llama). One (model, strategy, mesh) group's programs (the plain step, its variants, GSPMD,
  the single-device step and, for the MLP's ``dp``, pmap) are timed in rotation, one step each
  (every other round in reverse order), so that every ratio is a *paired* ratio from
  neighbouring steps on this noisy machine; it reports the median paired ratio and its
  interquartile range, a variant's also against its plain row (``÷ plain``). One step is in
  flight at a time (the hang trap: XLA:CPU's collectives deadlock with 8 simulated devices on
  2 cores otherwise).
- GSPMD: the same unsharded train step (the ``ref`` setup's ``step``, which runs the model's
  own code with no collectives) under plain ``jax.jit`` with the same NamedShardings on the
  parameters, optimizer state and batch: what a user would write instead of shardops.
- collective bytes per step from the compiled programs (``shardops.inspect.collectives``), as ring
  bytes per device per mesh axis (``groups of N``: GSPMD's groups that span part of an axis,
  which ``shardops.inspect.ledger`` refuses), next to the analytic model (``Setup.cost_model``). Both
  columns apply the same ring formulas (``shardops.inspect.ring_bytes``), so their agreement checks the
  bytes V of each collective, not the formulas; tests/inspect/test_ledger.py pins the formulas, and
  each strategy's V and ring bytes, to numbers worked out by hand.
- memory per device: parameters + optimizer state (from the shard shapes; ``state ÷ dp`` is its
  ratio to dp's, which holds the whole state), and from each compiled program's
  ``memory_analysis()`` the peak = arguments + outputs − aliased (donated) + temp, and the temp
  buffers alone, with a variant's temp saved against its plain row.

It writes ``benchmarks/results/strategies.json`` and ``strategies.md`` and, from that JSON, the
tables between the ``benchmark-tables`` markers in docs/benchmarks.md (tests/test_benchmark.py checks
they match), rewriting both files as each table finishes (``"finished": false`` until the last), so
a crash loses one table at most. ``--quick``, ``--only`` and ``--strategy`` write to a temporary
folder unless ``--out`` is given. On CPU it
simulates 8 devices (XLA_FLAGS, set before JAX starts its backend); ``--platform gpu`` does not,
maps each case's mesh onto the GPUs present (``mesh_for``) and writes ``strategies_gpu.*``.
The markdown and the block of docs/benchmarks.md are benchmarks/_strategies_report.py's.
"""

import argparse
import dataclasses
import json
import math
import os
import pathlib
import platform
import sys
import tempfile
import time
from typing import NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models
from shardops_models.strategies import pmap

# The report beside this script (Python puts a script's folder on sys.path; the tests load it by
# its path, so it is put there too). The names that the tests and the other benchmarks (moe.py,
# moe_dropless.py, pipeline.py) read through this module are re-exported ("X as X").
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _strategies_report import TABLES_END as TABLES_END
from _strategies_report import TABLES_START as TABLES_START
from _strategies_report import fmt_bytes as fmt_bytes
from _strategies_report import fmt_mb as fmt_mb
from _strategies_report import fmt_ratio as fmt_ratio
from _strategies_report import markdown, write_tables
from _strategies_report import tables_block as tables_block
from _strategies_report import write_between_markers as write_between_markers

RESULTS = pathlib.Path(__file__).parent / "results"
SIMULATED_DEVICES = 8


class Case(NamedTuple):
    """A strategy on a mesh (``(data, model)``, or named axis sizes such as ``{"replica": 2,
    "data": 4}``), with its variants: ``(label, build options)`` pairs timed in the same
    rotation as the plain step."""

    strategy: str
    mesh: tuple[int, int] | dict
    variants: tuple = ()

    @property
    def shape(self) -> dict[str, int]:
        """The mesh as axis sizes."""
        if isinstance(self.mesh, dict):
            return dict(self.mesh)
        return {"data": self.mesh[0], "model": self.mesh[1]}


mesh_text = shardops.format_mesh  # 4x2, or replica=2,data=4: --mesh's spelling


RING = ("ring", {"collective_matmul": "ring"})
BIDIRECTIONAL = ("bidirectional", {"collective_matmul": "bidirectional"})
GATHER_WEIGHTS = ("gather_weights", {"fsdp_dense": "gather_weights"})  # before "auto"
REMAT = ("remat", {"remat": True})

MLP_CASES = [
    Case("dp", (8, 1)),
    Case("tp", (1, 8), (RING, BIDIRECTIONAL)),
    Case("2d", (4, 2), (RING, BIDIRECTIONAL)),
    Case("2d", (2, 4)),
    Case("fsdp", (8, 1), (GATHER_WEIGHTS, REMAT)),
    Case("fsdp_tp", (4, 2), (RING, BIDIRECTIONAL, GATHER_WEIGHTS)),
    Case("hsdp", {"replica": 2, "data": 4}),
    Case("hsdp_tp", {"replica": 2, "data": 2, "model": 2}),
]
# The GPT's 4 heads allow a model axis of at most 4. Model-only strategies run on 1×4 (the batch
# is not split, so a data axis would only hold replicas computing the same step); the others on
# 2×4, and the data-only ones on 8×1.
GPT_CASES = [
    Case("dp", (8, 1)),
    Case("fsdp", (8, 1), (REMAT,)),
    Case("tp", (1, 4), (RING,)),
    Case("sp", (1, 4), (RING, BIDIRECTIONAL)),
    Case("2d", (2, 4)),
    Case("fsdp_tp", (2, 4)),
    Case("dp_sp", (2, 4)),
    Case("fsdp_sp", (2, 4), (RING, BIDIRECTIONAL, REMAT)),
    Case("hsdp", {"replica": 2, "data": 4}, (REMAT,)),
    Case("hsdp_tp", {"replica": 2, "data": 2, "model": 2}),
]
# Every strategy on the Llama (8 heads: a model axis up to 8; 2 KV heads, replicated over model =
# 4 and 8): model-only strategies on 1×8, the others on 2×4 or named axes, data-only on 8×1.
LLAMA_CASES = [
    Case("dp", (8, 1)),
    Case("fsdp", (8, 1), (REMAT,)),
    Case("zero1", (8, 1)),
    Case("tp", (1, 8)),
    Case("sp", (1, 8)),
    Case("2d", (2, 4)),
    Case("fsdp_tp", (2, 4)),
    Case("dp_sp", (2, 4)),
    Case("fsdp_sp", (2, 4), (REMAT,)),
    Case("zero1_tp", (2, 4)),
    Case("hsdp", {"replica": 2, "data": 4}),
    Case("hsdp_tp", {"replica": 2, "data": 2, "model": 2}),
    Case("hsdp_sp", {"replica": 2, "data": 2, "model": 2}),
]
PLAIN_MLP_CASES = [case._replace(variants=()) for case in MLP_CASES]  # the quick wide MLP
# Both axes and every GPT kernel, a ring, a remat; CI-fast.
QUICK_GPT_CASES = [Case("tp", (1, 4), (RING,)), Case("fsdp_sp", (2, 4), (REMAT,))]
QUICK_LLAMA_CASES = [Case("fsdp_tp", (2, 4))]  # replicated KV heads, the scan, FSDP's gathers


class Bench(NamedTuple):
    """One table: a model, a global batch, the cases and the steps to time."""

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


def llama(model, batch, steps, warmup, cases=LLAMA_CASES):
    title = (f"Llama: {model.num_layers} layers (one scan), width {model.d_model}, "
             f"{model.num_heads} heads sharing {model.num_kv_heads} KV heads, SwiGLU {model.d_ff}, "
             f"vocabulary {model.vocab_size}; batch {batch} × {model.context} tokens")  # fmt: skip
    return Bench(title, model, batch, cases, steps, warmup)


def benches(quick: bool, steps: int | None) -> dict[str, Bench]:
    if quick:
        n = steps or 3
        tiny_gpt = models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=2, context=16)
        tiny_llama = models.Llama(vocab_size=64, d_model=32, num_layers=2, num_heads=8,
                                  num_kv_heads=2, context=16)  # fmt: skip
        return {
            "seed": mlp((784, 64, 10), 64, n, 1),
            "wide": mlp((784, 128, 128, 10), 64, n, 1)._replace(cases=PLAIN_MLP_CASES),
            "gpt": gpt(tiny_gpt, 8, n, 1, QUICK_GPT_CASES),
            "llama": llama(tiny_llama, 8, n, 1, QUICK_LLAMA_CASES),
        }
    return {
        "seed": mlp((784, 512, 10), 256, steps or 60, 5),
        "wide": mlp((784, 2048, 2048, 10), 1024, steps or 60, 5),
        "gpt": gpt(models.Gpt(), 16, steps or 20, 3),
        "llama": llama(LLAMA, 16, steps or 20, 3),
    }


LLAMA = models.Llama(vocab_size=256, d_model=128, num_layers=4, num_heads=8, num_kv_heads=2,
                     context=128)  # fmt: skip
"""The benchmark's Llama: the GPT's width, depth and batch, 8 heads sharing 2 KV heads."""


def model_axis_limit(model) -> int:
    """A number every model-axis size must divide: the GPT's heads (and its vocabulary,
    sequence and width), the MLP's hidden widths."""
    if getattr(model, "sequence", False):
        return math.gcd(model.num_heads, model.vocab_size, model.context, model.d_model,
                        model.d_ff)  # fmt: skip
    return math.gcd(*model.sizes[1:-1])


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is at most ``at_most`` (at least 1)."""
    return max(d for d in range(1, max(at_most, 1) + 1) if n % d == 0)


def mesh_for(case_mesh, n_devices: int, *, batch: int, model_limit: int) -> tuple[int, int]:
    """The (data, model) mesh that stands for ``case_mesh`` (written for 8 devices) on
    ``n_devices``: data-only cases get D×1 and model-only ones 1×D, each axis cut to a divisor of
    what it splits (the batch; ``model_limit``); 2-axis cases keep a model axis of 2 (data-heavy
    cases such as 4×2) or up to their own size (2×4) and at most D/2, and fill the rest with
    data. With 8 devices (and the benchmark's models) every case keeps its mesh; with 1, every
    case runs on 1×1."""
    data, model = case_mesh
    if n_devices < 1:
        raise ValueError(f"n_devices must be at least 1; got {n_devices}")
    if model == 1:
        return largest_divisor(batch, n_devices), 1
    if data == 1:
        return 1, largest_divisor(model_limit, n_devices)
    wanted = min(model, 2 if data >= model else n_devices // 2) if n_devices >= 4 else n_devices
    m = largest_divisor(model_limit, wanted)
    return largest_divisor(batch, n_devices // m), m


def cases_on(bench, n_devices: int) -> tuple[list[Case], list[str]]:
    """``bench``'s cases with their meshes mapped onto ``n_devices`` (``mesh_for``), and a line
    for each case left out because an earlier one of its strategy already has that mesh."""
    limit = model_axis_limit(bench.model)
    cases, skipped, seen = [], [], {}
    for case in bench.cases:
        if isinstance(case.mesh, dict):  # named axes: run as written, where the devices fit
            if math.prod(case.mesh.values()) == n_devices:
                cases.append(case)
            else:
                skipped.append(f"{case.strategy} {mesh_text(case.shape)}: needs "
                               f"{math.prod(case.mesh.values())} devices")  # fmt: skip
            continue
        mapped = mesh_for(case.mesh, n_devices, batch=bench.batch, model_limit=limit)
        where = f"{case.strategy} {case.mesh[0]}x{case.mesh[1]} → {mapped[0]}x{mapped[1]}"
        if (case.strategy, mapped) in seen:
            skipped.append(f"{where}: the same mesh as {seen[case.strategy, mapped]}")
            continue
        seen[case.strategy, mapped] = where
        cases.append(case._replace(mesh=mapped))
    return cases, skipped


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


def memory_of(compiled) -> dict | None:
    """Per-device bytes of a compiled program: its arguments, outputs, the outputs aliased to
    (donated) arguments, temp buffers, and the peak = arguments + outputs − aliased + temp."""
    a = compiled.memory_analysis()
    if a is None:
        return None
    out = {
        "argument": int(a.argument_size_in_bytes),
        "output": int(a.output_size_in_bytes),
        "alias": int(a.alias_size_in_bytes),
        "temp": int(a.temp_size_in_bytes),
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def compiled_costs(mesh, jitted, *args):
    """The collectives (``shardops.inspect.collectives``) and memory (``memory_of``) of one program."""
    compiled = jitted.lower(*args).compile()
    return shardops.inspect.collectives(mesh, compiled), memory_of(compiled)


def group_key(c) -> str:
    """The mesh axes a collective's groups span, or, for groups that match no set of mesh axes
    (GSPMD may split an axis into smaller groups), ``groups of N``."""
    return axes_key(c.axes) if c.axes is not None else f"groups of {c.group_size}"


def ring_bytes_per_group(collectives) -> dict[str, float]:
    """``shardops.inspect.ring_bytes`` summed per ``group_key``: what ``Ledger.ring_bytes`` gives, but
    also for groups the ledger refuses."""
    out: dict[str, float] = {}
    for c in collectives:
        if c.bytes:
            key = group_key(c)
            out[key] = out.get(key, 0.0) + shardops.inspect.ring_bytes(
                c.kind, c.bytes, c.group_size
            )
    return out


def axes_key(axes) -> str:
    return "×".join(axes) or "-"


def paired(t, a, b) -> dict:
    """Median and interquartile range of the step-by-step ratios ``t[a] / t[b]``."""
    r = t[a] / t[b]
    return {
        "median": float(np.median(r)),
        "q25": float(np.quantile(r, 0.25)),
        "q75": float(np.quantile(r, 0.75)),
    }


def time_in_rotation(runs: dict, warmup: int, steps: int) -> dict:
    """Each program's step times in seconds (``np.ndarray``, the ``warmup`` rounds left out),
    timed in rotation: one step of each per round, each waited for (one step in flight: the
    hang trap), every other round in reverse order, so that no program always follows the same
    neighbour. ``runs``: name → ``[step, state, batch_args]``; each state is replaced by its
    step's new one (the old one is donated)."""
    times = {name: [] for name in runs}
    for i in range(warmup + steps):
        for name in list(runs) if i % 2 == 0 else reversed(list(runs)):
            run = runs[name]
            step, state, batch_args = run
            start = time.perf_counter()
            out = jax.block_until_ready(step(state, *batch_args))
            elapsed = time.perf_counter() - start
            run[1] = out[0]  # the (donated) state is replaced by the new one
            if i >= warmup:
                times[name].append(elapsed)
    return {k: np.array(v) for k, v in times.items()}


def bench_group(case, model, batch, *, steps, warmup, rng, devices):
    """One row per shardops program of ``case`` (plain, then each variant), every program of
    the group timed in one rotation."""
    strategy, shape = case.strategy, case.shape
    n = math.prod(shape.values())
    mesh = shardops.make_mesh(shape, devices=devices[:n])
    opt = optax.sgd(0.01)  # a small rate keeps thousands of benchmark steps finite
    variants = [(strategy, {})] + [(f"{strategy} {name}", opts) for name, opts in case.variants]
    setups = {label: models.build(strategy, mesh, optimizer=opt, model=model, **opts)
              for label, opts in variants}  # fmt: skip
    setup = setups[strategy]
    ref = models.build("ref", optimizer=opt, model=model)
    params = model.init(jax.random.key(0))
    x, y = random_batch(model, batch, rng)
    seq = x.shape[1] if getattr(model, "sequence", False) else None

    xs, ys = setup.place_batch(x, y)
    gspmd = gspmd_step(setup, ref)
    runs = group_runs(setups, gspmd, ref, params, (x, y), (xs, ys), devices[0])
    if strategy == "dp" and isinstance(model, models.Mlp):  # pmap's step is the MLP's
        pstep = pmap.pmap_train_step(opt, devices[:n])
        runs["pmap"] = [
            lambda state, x, y: (pstep(*state, x, y)[:2], None),
            (pmap.replicate(params, n), pmap.replicate(opt.init(params), n)),
            (pmap.split_batch(x, n), pmap.split_batch(y, n)),
        ]

    # Communication and memory, from the compiled programs.
    gspmd_colls, gspmd_memory = compiled_costs(mesh, gspmd, runs["gspmd"][1], xs, ys)
    gspmd_costs = (gspmd_colls, bytes_by_kind(gspmd_colls), gspmd_memory)
    single_state = state_bytes_per_device(runs["single"][1])
    rows = {}
    for label, s in setups.items():
        rows[label] = costs_row(label, s, runs[label][1], case, dict(variants)[label], mesh=mesh,
                                batch_seq=(batch, seq), batch_args=(xs, ys), gspmd=gspmd_costs,
                                single_state=single_state)  # fmt: skip
    plain_temp = rows[strategy]["temp_bytes_shardops"]
    for label, row in rows.items():
        if label != strategy and plain_temp is not None and row["temp_bytes_shardops"] is not None:
            row["temp_saved_vs_plain_bytes"] = plain_temp - row["temp_bytes_shardops"]

    t = time_in_rotation(runs, warmup, steps)
    add_step_times(rows, t, strategy)
    return list(rows.values())


def group_runs(setups, gspmd, ref, params, batch, placed, single_device) -> dict:
    """A group's programs for ``time_in_rotation`` (name → ``[step, state, batch_args]``): each
    setup's step on its mesh, ``gspmd`` with the plain setup's (the first's) shardings, and the
    unsharded ``ref`` step on ``single_device``. ``batch``: the global ``(x, y)``; ``placed``:
    it placed as the setups take it."""
    setup = next(iter(setups.values()))
    x1, y1 = jax.device_put(batch, single_device)
    runs = {label: [s.train_step, s.shard(params), placed] for label, s in setups.items()}
    runs["gspmd"] = [gspmd, setup.shard(params), placed]
    runs["single"] = [ref.train_step, jax.device_put(ref.shard(params), single_device), (x1, y1)]
    return runs


def bytes_by_kind(collectives) -> dict[str, int]:
    """The bytes V of the collectives per kind and ``group_key`` (``"all-gather data"``)."""
    kinds: dict[str, int] = {}
    for c in collectives:
        if c.bytes:
            key = f"{c.kind} {group_key(c)}"
            kinds[key] = kinds.get(key, 0) + c.bytes
    return kinds


def costs_row(
    label, setup, state, case, options, *, mesh, batch_seq, batch_args, gspmd, single_state
):
    """The row of one shardops program of ``case`` (``setup``'s step, with ``options``):
    communication and memory, its compiled collectives as ring bytes beside the analytic
    model's, its state and compiled memory per device, and GSPMD's (``gspmd``: its collectives,
    their bytes by kind, its memory). ``batch_seq``: ``(batch, seq)``."""
    strategy, shape = case.strategy, case.shape
    gspmd_colls, gspmd_kinds, gspmd_memory = gspmd
    colls, memory = compiled_costs(mesh, setup.train_step, state, *batch_args)
    stray = [c for c in colls if c.axes is None]
    if stray:  # shardops' collectives always run over mesh axes (shardops.inspect.ledger checks it)
        raise AssertionError(f"{label} {shape}: collectives over no mesh axes: {stray}")
    # The same shardops.inspect.ring_bytes turns both the compiled HLO's V and the model's V (the
    # strategy's collective_budget) into ring bytes: agreement checks V, not the formulas.
    model_bytes = setup.cost_model(*batch_seq)
    state_bytes = state_bytes_per_device(state)
    return {
        "label": label,
        "strategy": strategy,
        "mesh": mesh_text(shape),
        "options": options,
        "ring_bytes_model": {axes_key(a): v for a, v in model_bytes.items()},
        "ring_bytes_shardops": ring_bytes_per_group(colls),
        "ring_bytes_gspmd": ring_bytes_per_group(gspmd_colls),
        "gspmd_kinds": gspmd_kinds,
        "state_bytes_per_device": state_bytes,
        "single_device_state_bytes": single_state,
        "state_vs_dp": state_bytes / single_state,  # dp holds the whole state
        "memory_shardops": memory,
        "memory_gspmd": gspmd_memory,
        "temp_bytes_shardops": None if memory is None else memory["temp"],
        "temp_bytes_gspmd": None if gspmd_memory is None else gspmd_memory["temp"],
    }


def add_step_times(rows: dict, t: dict, strategy: str) -> None:
    """Each row's median step times (ms) and its paired ratios, from ``time_in_rotation``'s
    times ``t``: to GSPMD, to the single device, GSPMD's to the single device, and a variant's
    to its plain row (the plain ``dp`` row's to pmap)."""
    for label, row in rows.items():
        row["step_ms"] = {"shardops": float(np.median(t[label]) * 1e3)}
        row["step_ms"].update(
            {k: float(np.median(t[k]) * 1e3) for k in ("gspmd", "single", "pmap") if k in t}
        )
        row["vs_gspmd"] = paired(t, label, "gspmd")
        row["vs_single"] = paired(t, label, "single")
        row["gspmd_vs_single"] = paired(t, "gspmd", "single")
        if label != strategy:
            row["vs_plain"] = paired(t, label, strategy)
        elif "pmap" in t:
            row["vs_pmap"] = paired(t, label, "pmap")


def run_table(name: str, bench: Bench, devices, rng, *, cpu: bool) -> dict:
    """One table: every case of ``bench`` timed (``bench_group``), its rows printed as they come."""
    block_start = time.perf_counter()
    rows, cases = [], bench.cases
    if not cpu:
        cases, skipped = cases_on(bench, len(devices))
        for line in skipped:
            print(f"{name:>5} skip {line}")
    for case in cases:
        try:
            group = bench_group(
                case, bench.model, bench.batch,
                steps=bench.steps, warmup=bench.warmup, rng=rng, devices=devices,
            )  # fmt: skip
        except ValueError as e:  # a mapped mesh the model cannot split
            if cpu:
                raise
            print(f"{name:>5} skip {case.strategy} {mesh_text(case.shape)}: {e}")
            continue
        for row in group:
            rows.append(row)
            print(f"{name:>5} {row['label']:>22} {row['mesh']}: {row['step_ms']['shardops']:8.2f} ms, "
                  f"÷GSPMD {row['vs_gspmd']['median']:.2f}, ÷single {row['vs_single']['median']:.2f}"
                  + (f", ÷pmap {row['vs_pmap']['median']:.2f}" if "vs_pmap" in row else "")
                  + (f", ÷plain {row['vs_plain']['median']:.2f}" if "vs_plain" in row else ""),
                  flush=True)  # fmt: skip
    block = {"title": bench.title, "batch": bench.batch, "steps": bench.steps,
             "warmup": bench.warmup, "rows": rows}  # fmt: skip
    if isinstance(bench.model, models.Mlp):
        block["sizes"] = list(bench.model.sizes)
    else:  # a language model's config (the tokens per step: batch × context)
        block["gpt" if name == "gpt" else "lm"] = dataclasses.asdict(bench.model)
    block["seconds"] = time.perf_counter() - block_start
    return block


def save_results(out: pathlib.Path, stem: str, results: dict, *, finished: bool = False) -> str:
    """Write ``STEM.json`` and ``STEM.md`` in ``out`` (each replaced whole, through a temporary
    file, so a crash mid-write leaves the previous version), with ``finished`` recorded; returns
    the markdown."""
    results["finished"] = finished
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    for suffix, text in ((".json", json.dumps(results, indent=1)), (".md", table + "\n")):
        tmp = out / f".{stem}{suffix}.partial"
        tmp.write_text(text)
        tmp.replace(out / f"{stem}{suffix}")
    return table


def start_platform(name: str) -> list:
    """The devices to run on. For ``cpu``, 8 simulated devices (set before JAX starts its
    backend); for ``gpu``, the GPUs present, with no simulated-device flag."""
    if name == "cpu":
        flag = f"--xla_force_host_platform_device_count={SIMULATED_DEVICES}"
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        devices = jax.devices("cpu")
        if len(devices) < SIMULATED_DEVICES:
            raise RuntimeError(
                f"--platform cpu needs {SIMULATED_DEVICES} CPU devices; JAX started with "
                f"{len(devices)} (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}). Run the script "
                f"in a fresh process, or set --xla_force_host_platform_device_count=8."
            )
        return devices[:SIMULATED_DEVICES]
    try:
        return jax.devices("gpu")
    except RuntimeError as e:
        raise RuntimeError(
            f"--platform gpu found no GPU ({e}). Install jax with CUDA support "
            f"(pip install 'jax[cuda12]') or run with --platform cpu."
        ) from e


def argument_parser() -> argparse.ArgumentParser:
    """The command line (the commands of the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps: checks it runs")
    p.add_argument(
        "--steps", type=int, default=None,
        help="timed steps per program (default 60 for the MLPs, 20 for the GPT; quick 3)",
    )  # fmt: skip
    p.add_argument(
        "--only", nargs="*", default=None, help="run only these tables (seed, wide, gpt, llama)"
    )
    p.add_argument(
        "--strategy",
        default=None,
        help="run only this strategy's cases (with --mesh: this one case, plain)",
    )
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="with --strategy: its mesh, e.g. replica=2,data=2,model=2 or 4x2")  # fmt: skip
    p.add_argument(
        "--out", default=None,
        help=f"results folder (default {RESULTS}; with --quick a temporary folder)",
    )  # fmt: skip
    p.add_argument(
        "--platform", choices=("cpu", "gpu"), default="cpu",
        help="cpu: 8 simulated devices; gpu: the GPUs present, each case's mesh mapped onto them",
    )  # fmt: skip
    p.add_argument(
        "--tables-only", action="store_true",
        help="rewrite docs/benchmarks.md's tables (and strategies.md) from the stored JSON; run nothing",
    )  # fmt: skip
    return p


def run_tables(args, devices, out: pathlib.Path, stem: str) -> dict:
    """Every table the arguments pick (``--only``, ``--strategy`` and ``--mesh``), each saved
    (``save_results``) as it finishes; the results, with the run's seconds and its load average
    at the end."""
    rng = np.random.default_rng(0)
    kind = devices[0].device_kind
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {devices[0].platform} ×{len(devices)}"
                   + ("" if args.platform == "cpu" else f" ({kind})"),
        "platform": devices[0].platform,
        "device_kind": kind,
        "devices": len(devices),
        "jax": jax.__version__,
        "quick": args.quick,
        "load_average_at_start": os.getloadavg()[0],  # other processes share the cores
        "models": {},
    }  # fmt: skip
    start = time.perf_counter()
    for name, bench in benches(args.quick, args.steps).items():
        if args.only is not None and name not in args.only:
            continue
        if args.strategy is not None:
            bench = bench._replace(cases=(
                [Case(args.strategy, shardops.parse_mesh(args.mesh))] if args.mesh
                else [c for c in bench.cases if c.strategy == args.strategy]))  # fmt: skip
        results["models"][name] = run_table(name, bench, devices, rng, cpu=args.platform == "cpu")
        # Each table is written as it finishes: a crash later (the process once died in XLA's
        # teardown after its last row, before any file was written) loses one table at most.
        save_results(out, stem, results)
    results["seconds"] = time.perf_counter() - start
    results["load_average_at_end"] = os.getloadavg()[0]
    return results


def main(argv=None):
    p = argument_parser()
    args = p.parse_args(argv)
    if args.mesh is not None and args.strategy is None:
        p.error("--mesh needs --strategy")
    if args.mesh is not None:
        try:
            shardops.parse_mesh(args.mesh)
            models.STRATEGIES[args.strategy].check_mesh(shardops.parse_mesh(args.mesh))
        except (ValueError, KeyError) as e:
            p.error(f"--mesh {args.mesh}: {e}")
    picked = args.strategy is not None or args.only is not None  # part of the tables
    stem = "strategies" if args.platform == "cpu" else f"strategies_{args.platform}"
    if args.out is None:  # a run of picked tables or cases never overwrites the committed ones
        args.out = (tempfile.mkdtemp(prefix="shardops_bench_") if args.quick or picked
                    else str(RESULTS))  # fmt: skip
    out = pathlib.Path(args.out)
    committed = out.resolve() == RESULTS.resolve() and args.platform == "cpu"
    if args.tables_only:
        if args.platform != "cpu":
            p.error("--tables-only writes the CPU tables into docs/benchmarks.md; drop --platform")
        results = json.loads((out / f"{stem}.json").read_text())
        (out / f"{stem}.md").write_text(markdown(results) + "\n")
        write_tables(results)
        return results

    devices = start_platform(args.platform)
    results = run_tables(args, devices, out, stem)
    table = save_results(out, stem, results, finished=True)
    print(table)
    print(f"{results['seconds']:.0f} s; wrote {out / stem}.json and {out / stem}.md")
    if committed:  # docs/benchmarks.md's tables follow the committed JSON (tests/test_benchmark.py)
        write_tables(results)
    return results


if __name__ == "__main__":
    main()
