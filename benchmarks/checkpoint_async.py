"""Checkpoint saves, synchronous against asynchronous: the step time a save costs, the extra
peak memory an asynchronous save needs, and the cost of the integrity checks.

    python benchmarks/checkpoint_async.py           # the full run (about 2 minutes on 2 cores)
    python benchmarks/checkpoint_async.py --quick   # a small end-to-end run (CI); figures mean nothing

The model: an MLP 512-2048-2048-2048-512 under ``2d`` on data = 4 × model = 2 (8 simulated CPU
devices), Adam, batch 64: its train state (params and both moments) is 126 MB (120 MiB); under
``2d`` the weights are replicated over data, so the 8 devices hold 4 copies of each. The quick
run uses an MLP 64-256-64.

1. **Step time**, paired. One process trains three copies of the state in rotation, a round
   of ``K`` steps each (every other round in reverse order): ``none`` (no save), ``sync``
   (``Checkpoints(asynchronous=False)``) and ``async`` (the default), the last two saving at the
   first step of their round. Each step is timed to its loss being ready (one step in flight:
   the hang trap of XLA:CPU's collectives on 8 simulated devices); the save's call is part of
   its step. It reports the step that saves and the round (K steps, plus the wait for an
   asynchronous write still running at the round's end), each against the ``none`` round of
   the same rotation: medians with the interquartile range of the paired ratios. The
   asynchronous write competes with training for the 2 cores, so the round shows what it costs
   beyond its own step.
2. **Peak memory**, in separate processes (``none``, ``sync``, ``async`` for ``2d`` and
   ``fsdp`` on 8 × 1, whose state is sharded over all 8 devices with no copy), started before
   this process starts JAX (Linux keeps the parent's peak in a child's ``ru_maxrss``): each
   trains a first round that compiles and saves once, then ``R`` rounds of ``K`` steps with a
   save per round, and reports the peak RSS over those rounds (sampled every millisecond from
   /proc/self/statm) and its whole life's (``getrusage(RUSAGE_SELF).ru_maxrss``, the
   compiler's peak included); the extra peak of a save is the difference from the ``none``
   process, in MiB and against the state's size. On CPU orbax's host copy of a shard
   it writes whole is a view of the device buffer, and XLA skips the donation of a buffer
   while a view of it is held: the process counts the bytes of the saved state the next step
   could not donate (still alive after it), the device memory an asynchronous save keeps.
3. **Integrity**: the fingerprints of the state (``checkpoint.fingerprints``, computed at every
   save and restore) against a synchronous save; the read of every stored chunk before a
   restore (``checkpoint._read_every_chunk``) against the whole restore.

It writes ``benchmarks/results/checkpoint_async.json`` and ``.md``.
"""

import argparse
import json
import os
import pathlib
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from strategies import paired, start_platform

RESULTS = pathlib.Path(__file__).parent / "results"
MODES = ("none", "sync", "async")
FULL = {"sizes": (512, 2048, 2048, 2048, 512), "batch": 64, "rounds": 16, "steps": 4,
        "memory_rounds": 4, "repeats": 5}  # fmt: skip
QUICK = {"sizes": (64, 256, 64), "batch": 32, "rounds": 2, "steps": 3, "memory_rounds": 1,
         "repeats": 1}  # fmt: skip
LAYOUTS = {"2d": {"data": 4, "model": 2}, "fsdp": {"data": 8, "model": 1}}


def build(config: dict, strategy: str = "2d"):
    """The setup, a fresh state and a placed batch."""
    import jax
    import numpy as np
    import optax

    import shardops
    import shardops_models as models

    sizes = tuple(config["sizes"])
    setup = models.build(strategy, shardops.make_mesh(LAYOUTS[strategy]),
                         optimizer=optax.adam(1e-4), sizes=sizes)  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.normal(size=(config["batch"], sizes[0])).astype(np.float32)
    y = np.eye(sizes[-1], dtype=np.float32)[rng.integers(0, sizes[-1], config["batch"])]
    params = setup.model.init(jax.random.key(0))
    return setup, params, setup.place_batch(x, y)


def state_bytes(setup, state) -> dict:
    """The state's own size (each leaf once) and the bytes its shards take on the devices."""
    import jax

    leaves = jax.tree.leaves(state)
    logical = sum(a.nbytes for a in leaves)
    on_devices = sum(s.data.nbytes for a in leaves for s in a.addressable_shards)
    return {"logical": int(logical), "on_devices": int(on_devices)}


def run_round(setup, state, batch, ckpt, step: int, steps: int):
    """``steps`` train steps, the first one saving (``ckpt`` not None); the step times, the
    wait for an asynchronous write still running, the state, and the saved state's bytes the
    next step could not donate."""
    import jax

    times, kept = [], 0
    for i in range(steps):
        begin = time.perf_counter()
        state, loss = setup.train_step(state, *batch)
        if i == 0 and ckpt is not None:
            ckpt.save(step, setup, state)
            saved = jax.tree.leaves(state)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - begin)
        if i == 1 and ckpt is not None:
            kept = sum(a.nbytes for a in saved if not a.is_deleted())
    begin = time.perf_counter()
    if ckpt is not None:
        ckpt.wait()
    return times, time.perf_counter() - begin, state, kept


def timing(config: dict, workdir: pathlib.Path) -> dict:
    """Part 1: the paired rotation of none, sync and async rounds."""
    import jax
    import numpy as np

    from shardops_models.training import checkpoint

    setup, params, batch = build(config)
    ckpts = {"none": None,
             "sync": checkpoint.Checkpoints(workdir / "sync", asynchronous=False, keep=2),
             "async": checkpoint.Checkpoints(workdir / "async", keep=2)}  # fmt: skip
    states = {mode: setup.shard(params) for mode in MODES}
    sizes = state_bytes(setup, states["none"])
    steps, rounds = config["steps"], config["rounds"]
    save_step = {m: [] for m in MODES}  # the first step of each round (the save's)
    later = {m: [] for m in MODES}  # the mean of the round's other steps
    round_time = {m: [] for m in MODES}
    tail = []
    for r in range(-1, rounds):  # round -1: warm-up (compiles, orbax's first save)
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            times, wait, states[mode], _ = run_round(setup, states[mode], batch, ckpts[mode],
                                                     step=r + 2, steps=steps)  # fmt: skip
            if r < 0:
                continue
            save_step[mode].append(times[0])
            later[mode].append(float(np.mean(times[1:])))
            round_time[mode].append(sum(times) + wait)
            if mode == "async":
                tail.append(wait)
        if r >= 0:
            print(f"round {r}: " + ", ".join(f"{m} {round_time[m][-1] * 1e3:.0f} ms"
                                             for m in MODES), flush=True)  # fmt: skip
    t = {k: {m: np.array(v) for m, v in d.items()} for k, d in
         (("save_step", save_step), ("later", later), ("round", round_time))}  # fmt: skip
    extra = {m: t["round"][m] - t["round"]["none"] for m in ("sync", "async")}  # paired
    out = {
        "state": sizes,
        "steps_per_round": steps,
        "rounds": rounds,
        "ms": {k: {m: quartiles(v * 1e3) for m, v in d.items()} for k, d in t.items()},
        "save_step_vs_plain": {m: paired(t["save_step"], m, "none") for m in ("sync", "async")},
        "round_vs_none": {m: paired(t["round"], m, "none") for m in ("sync", "async")},
        "async_vs_sync": {k: paired(t[k], "async", "sync") for k in ("save_step", "round")},
        "save_cost_ms": {m: quartiles(v * 1e3) for m, v in extra.items()},
        "async_tail_ms": quartiles(np.array(tail) * 1e3),
    }
    out["integrity"] = integrity(setup, states["sync"], ckpts["sync"], config["repeats"])
    for ckpt in ckpts.values():
        if ckpt is not None:
            ckpt.close()
    del jax
    return out


def integrity(setup, state, ckpt, repeats: int) -> dict:
    """Part 3: fingerprints against a synchronous save; the read of every chunk against a
    restore."""
    import jax
    import numpy as np

    from shardops_models.training import checkpoint

    logical = checkpoint._logical_state(setup, state)
    fingerprint, save, check, restore = [], [], [], []
    checkpoint.fingerprints(logical)  # compiled
    for i in range(repeats):
        begin = time.perf_counter()
        checkpoint.fingerprints(logical)
        fingerprint.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        ckpt.save(1000 + i, setup, state)
        save.append(time.perf_counter() - begin)
        folder = os.path.join(ckpt.directory, str(1000 + i), "state")
        begin = time.perf_counter()
        checkpoint._read_every_chunk(folder)
        check.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        restored, _ = ckpt.restore(setup, 1000 + i)
        jax.block_until_ready(restored)
        restore.append(time.perf_counter() - begin)
    f, s, c, r = (np.array(v) for v in (fingerprint, save, check, restore))
    return {
        "fingerprint_ms": quartiles(f * 1e3),
        "sync_save_ms": quartiles(s * 1e3),
        "fingerprint_vs_save": quartiles(f / s),
        "read_every_chunk_ms": quartiles(c * 1e3),
        "restore_ms": quartiles(r * 1e3),
        "read_every_chunk_vs_restore": quartiles(c / r),
    }


def memory_child(config: dict, strategy: str, mode: str, workdir: pathlib.Path) -> dict:
    """Part 2, in a process of its own: the peak RSS over ``memory_rounds`` rounds with a save
    each (sampled every millisecond from /proc/self/statm), after a first round that compiles
    and saves once (the compiler's peak and orbax's one-time start left out), and
    ``ru_maxrss``, the whole process's."""
    from shardops_models.training import checkpoint

    setup, params, batch = build(config, strategy)
    state = setup.shard(params)
    sizes = state_bytes(setup, state)
    ckpt = None
    if mode != "none":
        ckpt = checkpoint.Checkpoints(workdir, keep=1, asynchronous=mode == "async")
    # compiled, and orbax's one-time start (its first save) before the sampling
    _, _, state, _ = run_round(setup, state, batch, ckpt, 0, 2)
    sampler = RssSampler()
    kept = []
    with sampler:
        for r in range(config["memory_rounds"]):
            _, _, state, held = run_round(setup, state, batch, ckpt, r + 1, config["steps"])
            kept.append(held)
    if ckpt is not None:
        ckpt.close()
    return {"strategy": strategy, "mode": mode, "state": sizes, "rounds_peak_rss": sampler.peak,
            "rounds_start_rss": sampler.first, "peak_rss": peak_rss(),
            "kept_by_next_step": max(kept)}  # fmt: skip


class RssSampler:
    """The largest resident set size seen while the block runs, read every millisecond."""

    def __enter__(self):
        self.first = self.peak = current_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, current_rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def memory(config: dict, quick: bool, workdir: pathlib.Path) -> list[dict]:
    rows = []
    for strategy in LAYOUTS:
        for mode in MODES:
            out = workdir / f"memory-{strategy}-{mode}.json"
            args = [sys.executable, __file__, "--memory-child", strategy, mode, "--out", str(out)]
            if quick:
                args.append("--quick")
            subprocess.run(args, check=True, timeout=900)
            row = json.loads(out.read_text())
            rows.append(row)
            print(f"memory {strategy} {mode}: peak RSS over the rounds "
                  f"{mib(row['rounds_peak_rss'])} MiB (ru_maxrss {mib(row['peak_rss'])} MiB), "
                  f"kept by the next step {mib(row['kept_by_next_step'])} MiB", flush=True)  # fmt: skip
    for row in rows:
        none = next(r for r in rows if r["strategy"] == row["strategy"] and r["mode"] == "none")
        row["extra_peak"] = row["rounds_peak_rss"] - none["rounds_peak_rss"]
        row["extra_peak_vs_state"] = row["extra_peak"] / row["state"]["logical"]
        row["extra_maxrss"] = row["peak_rss"] - none["peak_rss"]
        sync = next(r for r in rows if r["strategy"] == row["strategy"] and r["mode"] == "sync")
        row["extra_peak_vs_sync"] = row["rounds_peak_rss"] - sync["rounds_peak_rss"]
    return rows


def quartiles(v) -> dict:
    import numpy as np

    return {"median": float(np.median(v)), "q25": float(np.quantile(v, 0.25)),
            "q75": float(np.quantile(v, 0.75))}  # fmt: skip


def mib(n) -> str:
    return f"{n / 2**20:.1f}"


def cell(q: dict, digits: int = 2) -> str:
    return f"{q['median']:.{digits}f} [{q['q25']:.{digits}f}, {q['q75']:.{digits}f}]"


def markdown(results: dict) -> str:
    t = results["timing"]
    state = t["state"]
    lines = [
        f"MLP {'-'.join(map(str, results['config']['sizes']))}, Adam, batch "
        f"{results['config']['batch']}, 2d on data = 4 × model = 2 (8 simulated CPU devices, "
        f"{results['machine']['cpus']} cores): state {mib(state['logical'])} MiB "
        f"({mib(state['on_devices'])} MiB on the devices). {t['rounds']} rotations of a round "
        f"of {t['steps_per_round']} steps each: no save, a synchronous save, an asynchronous "
        f"one, each at the round's first step. Medians [interquartile range]:",
        "",
        "| | no save | sync | async | async ÷ sync (paired) |",
        "|---|---:|---:|---:|---:|",
        f"| the step that saves (ms) | {cell(t['ms']['save_step']['none'], 0)} | "
        f"{cell(t['ms']['save_step']['sync'], 0)} | {cell(t['ms']['save_step']['async'], 0)} | "
        f"{cell(t['async_vs_sync']['save_step'])} |",
        f"| … ÷ the same step without a save (paired) | 1 | "
        f"{cell(t['save_step_vs_plain']['sync'])} | {cell(t['save_step_vs_plain']['async'])} | |",
        f"| the round's other steps, mean (ms) | {cell(t['ms']['later']['none'], 0)} | "
        f"{cell(t['ms']['later']['sync'], 0)} | {cell(t['ms']['later']['async'], 0)} | |",
        f"| the round, with the wait for the write (ms) | {cell(t['ms']['round']['none'], 0)} | "
        f"{cell(t['ms']['round']['sync'], 0)} | {cell(t['ms']['round']['async'], 0)} | "
        f"{cell(t['async_vs_sync']['round'])} |",
        f"| … the save's cost: round − no-save round (ms) | 0 | "
        f"{cell(t['save_cost_ms']['sync'], 0)} | {cell(t['save_cost_ms']['async'], 0)} | |",
        "",
        f"The asynchronous write still running at the round's end: "
        f"{cell(t['async_tail_ms'], 0)} ms.",
        "",
        f"Peak memory, one process per row, {results['config']['memory_rounds']} rounds of "
        f"{results['config']['steps']} steps with a save at the first step of each, after a "
        f"first round that compiles and saves once: the peak RSS over the rounds (sampled "
        f"every ms), its excess over the same layout without saves (the extra peak), and the "
        f"whole process's `ru_maxrss` (the compiler's peak included):",
        "",
        "| layout | saves | state (MiB) | on the devices (MiB) | peak RSS, rounds (MiB) | "
        "extra peak (MiB) | ÷ state | − sync's (MiB) | ru_maxrss (MiB) | saved bytes the next "
        "step could not donate (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["memory"]:
        lines.append(
            f"| {row['strategy']} | {row['mode']} | {mib(row['state']['logical'])} | "
            f"{mib(row['state']['on_devices'])} | {mib(row['rounds_peak_rss'])} | "
            f"{mib(row['extra_peak'])} | {row['extra_peak_vs_state']:.2f} | "
            f"{mib(row['extra_peak_vs_sync']) if row['mode'] == 'async' else ''} | "
            f"{mib(row['peak_rss'])} | {mib(row['kept_by_next_step'])} |"
        )
    i = t["integrity"]
    lines += [
        "",
        f"Integrity: the fingerprints of the state take {cell(i['fingerprint_ms'], 0)} ms, "
        f"{cell(i['fingerprint_vs_save'])} of a synchronous save "
        f"({cell(i['sync_save_ms'], 0)} ms); reading every stored chunk before a restore takes "
        f"{cell(i['read_every_chunk_ms'], 0)} ms, {cell(i['read_every_chunk_vs_restore'])} of "
        f"the restore ({cell(i['restore_ms'], 0)} ms, fingerprints included).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks it runs")
    p.add_argument("--out", default=None, help=f"results folder (default {RESULTS})")
    p.add_argument("--memory-child", nargs=2, metavar=("STRATEGY", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    config = QUICK if args.quick else FULL
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="checkpoint-async-"))
    try:
        if args.memory_child:
            start_platform("cpu")
            strategy, mode = args.memory_child
            row = memory_child(config, strategy, mode, workdir / "ckpt")
            pathlib.Path(args.out).write_text(json.dumps(row))
            return 0
        out = pathlib.Path(args.out or (tempfile.mkdtemp() if args.quick else RESULTS))
        began = time.perf_counter()
        rows = memory(config, args.quick, workdir)  # before this process starts JAX
        start_platform("cpu")
        results = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "config": config,
            "timing": timing(config, workdir / "timing"),
            "memory": rows,
        }
        results["seconds"] = time.perf_counter() - began
        out.mkdir(parents=True, exist_ok=True)
        (out / "checkpoint_async.json").write_text(json.dumps(results, indent=1))
        (out / "checkpoint_async.md").write_text(markdown(results))
        print(markdown(results))
        print(f"wrote {out / 'checkpoint_async.json'} in {results['seconds']:.0f} s")
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
