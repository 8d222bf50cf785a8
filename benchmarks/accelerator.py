"""shardops on one accelerator against plain-JAX programs of the same Llama: step time,
tokens/s, MFU, memory, the largest batch and sequence that fit, and a 10-step loss check.

    python benchmarks/accelerator.py                  # the 254M and 470M Llamas (a TPU or GPU)
    python benchmarks/accelerator.py --model 254m     # one of them
    python benchmarks/accelerator.py --quick          # a tiny Llama on CPU (CI, well under a minute)

The models (``MODELS``) are the issue's: a 254M Llama (D = 1024, 16 layers, 8 query and 4 KV
heads of 128, SwiGLU 2816, vocabulary 32000) and a 470M one (D = 2048, 8 layers, 16 / 4 heads
of 128, SwiGLU 5632), the blocks under one ``lax.scan``, trained with Adam; every program
stores float32 parameters and multiplies in bfloat16 with float32 accumulation
(``shardops.MIXED_BFLOAT16``), the loss the mean next-token cross-entropy. The programs, all
compiled for one device and fed the same parameters (``Llama.init``) and batches:

- ``plain einsum``: the model written here in plain JAX (``plain_logits``: RMSNorm, rotate-half
  RoPE, grouped-query attention by einsum, SwiGLU), ``optax.adam``, one ``jax.jit``;
- ``plain flash`` and ``plain splash`` (TPU only): the same, attention by JAX's Pallas TPU
  kernels ``flash_attention`` and splash attention (``make_splash_mqa_single_device`` over each
  KV head's group of query heads, blocks of 512);
- ``shardops ref``: ``models.build("ref", model=Llama(...), precision=MIXED_BFLOAT16)``;
- ``shardops fsdp_tp``: the same model through ``fsdp_tp``'s per-device path on a 1×1 mesh
  (data = 1, model = 1): shard_map and every collective of the strategy, each over one device.

``build``'s ``attention=`` (``--attention``) and ``remat=`` (``--remat``) options are passed
where the installed ``models.build`` accepts them (``build_options``): before the attention
option exists the shardops rows run the library's only attention, and before ``remat`` is a
policy (``models.Remat``) it is a bool that only fsdp strategies accept (``shardops ref`` then
has no remat row). A row whose program the installed build cannot make says why.

For each shape ``batch × seq`` (``SHAPES``; the last with remat: every program recomputes its
blocks in the backward pass) every program is compiled, its temp bytes read from
``compiled.memory_analysis()``, and it is run unless it does not fit: XLA's
``RESOURCE_EXHAUSTED`` at compile or run time, or a peak (arguments + outputs − donated + temp)
above the device's memory (``memory_stats()["bytes_limit"]``, or ``--memory-limit``). The
programs that fit are timed in rotation (one step each per round, every other round reversed,
``block_until_ready`` each step) after ``--warmup`` rounds; the step time is the median of
``--steps``. MFU = the model's FLOPs per step (``Llama.train_flops_per_token``, PaLM's count:
remat's recomputation is not counted) / step time / peak: the bf16 matmul peak measured in the
same run (``measured_peak``: a large bf16 matmul, timed) and the specification's
(``SPEC_PEAK_FLOPS`` by ``device_kind``; n/a for a device not in it).

The largest fitting shapes (where the device reports its memory, unless ``--no-search``):
per program, with and without remat, the largest power-of-two batch at ``SEARCH_SEQ`` and the
longest power-of-two sequence at batch 1, from the compiled programs' memory analysis (compiled,
not run).

Loss check: 10 steps from the same init on the same batches; every program's losses against
``plain einsum``'s, within ``LOSS_RTOL`` relative (a bfloat16 bound, see there). ``--quick``
fails (exit 1) when they disagree; a full run records and prints it.

Time and memory on one chip: each program's train state is 12 bytes a parameter (3 GB for
the 254M model, 5.9 GB for the 470M, which has 491.8M parameters); when the programs' states do
not fit the device together they wait on the host between steps (``bench_shape``), moved
outside the timed calls, which makes a round slower but not a step. Every program is compiled once per shape (the search adds
a few compiles a program); ``--model 254m``, ``--steps``, ``--attention`` and ``--no-search``
shorten a run on a chip lent for minutes.

Its parts, beside it: benchmarks/_plain_llama.py (the plain-JAX Llama),
benchmarks/_accelerator_programs.py (the programs, ``build_options``) and
benchmarks/_accelerator_report.py (the markdown).

It writes ``benchmarks/results/accelerator.json`` and ``accelerator.md`` (both models:
``accelerator_254m.*`` and ``accelerator_470m.*``; ``--quick``: a temporary folder unless
``--out``). Without a TPU or GPU JAX runs on CPU, where the figures are
no accelerator's (the JSON names the platform and device kind).
"""

import argparse
import json
import pathlib
import platform as host_platform
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import shardops_models as models

# The parts beside this script (Python puts a script's folder on sys.path; the tests load it by
# its path, so it is put there too). Names that tests and benchmarks/residuals.py read through
# this module are re-exported ("X as X").
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _accelerator_programs import Program as Program
from _accelerator_programs import Runner as Runner
from _accelerator_programs import Unsupported, attention_choices, programs_for
from _accelerator_programs import plain_program as plain_program
from _accelerator_report import COLUMNS as COLUMNS
from _accelerator_report import markdown
from _plain_llama import PLAIN_REMAT
from _plain_llama import einsum_attention as einsum_attention
from _plain_llama import flash_attention as flash_attention
from _plain_llama import plain_logits as plain_logits
from _plain_llama import splash_attention as splash_attention

RESULTS = pathlib.Path(__file__).parent / "results"

MODELS = {
    "254m": dict(vocab_size=32000, d_model=1024, num_layers=16, num_heads=8, num_kv_heads=4,
                 d_ff=2816),
    "470m": dict(vocab_size=32000, d_model=2048, num_layers=8, num_heads=16, num_kv_heads=4,
                 d_ff=5632),
}  # fmt: skip
QUICK_MODEL = dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=176)
CONTEXT = 32768  # the longest sequence the models accept (RoPE has no table: a check only)

# (batch, seq, remat): the shapes; the last recomputes the blocks in the backward pass
# (``--remat``'s policy, "full" by default).
SHAPES = ((4, 1024, False), (8, 1024, False), (2, 2048, False), (1, 8192, False),
          (16, 1024, True))  # fmt: skip
QUICK_SHAPES = ((1, 64, False), (1, 64, True))
SEARCH_SEQ, SEARCH_MAX_BATCH = 1024, 256

SPEC_PEAK_FLOPS = {
    # Dense bfloat16 matmul FLOP/s per chip (per GPU) by jax.Device.device_kind, from the
    # vendors' specification sheets. A device not listed gets n/a, not a guess.
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM, dense (no sparsity)
    "NVIDIA H200": 989e12,
}

LOSS_STEPS = 10
# bfloat16 keeps 8 significant bits: one rounding of a value v moves it by up to 2⁻⁸·|v|.
# The two programs round their activations at different points (plain JAX where its ops
# round, shardops once per layer output), so their logits differ by a few such roundings,
# and 10 Adam steps (each moving a weight by up to the learning rate whatever the gradient's
# size) carry that difference forward. The mean loss over B·S tokens averages the per-token
# differences, so one bfloat16 rounding of the loss itself, 2⁻⁸ relative, bounds it (the quick
# run's programs differ by about 5e-5). At a small init the loss stays near ln V whatever the
# model computes, so this checks the programs train alike; tests/test_benchmark.py checks the
# plain program's logits against ``Llama.reference_logits``.
LOSS_RTOL = 2.0**-8


def model_of(sizes: dict):
    return models.Llama(**sizes, context=CONTEXT)


# --- measuring


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def memory_of(compiled) -> dict | None:
    """Per-device bytes of a compiled program: arguments, outputs, donated (aliased), temp and
    the peak = arguments + outputs − aliased + temp."""
    a = compiled.memory_analysis()
    if a is None:
        return None
    out = {"argument": int(a.argument_size_in_bytes), "output": int(a.output_size_in_bytes),
           "alias": int(a.alias_size_in_bytes), "temp": int(a.temp_size_in_bytes)}  # fmt: skip
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


_COMPILED = {}  # (program, model, batch, seq, remat, limit) → compile_program's answer


def compile_program(program, model, batch, seq, remat, limit):
    """``(runner, compiled, memory, status)`` of ``program`` at ``batch × seq`` under the
    remat policy ``remat`` (None: none): status "fits", "OOM" (XLA's RESOURCE_EXHAUSTED
    at compile time), "OOM (predicted)" (the peak above ``limit``) or "n/a: <why>". Each
    program is compiled once per shape in a run (the timed rows, the search and the loss check
    share it)."""
    key = (program.label, model, batch, seq, remat, limit)
    if key not in _COMPILED:
        _COMPILED[key] = _compile(program, model, batch, seq, remat, limit)
    return _COMPILED[key]


def _compile(program, model, batch, seq, remat, limit):
    try:
        runner = program.runner(model, batch, seq, remat)
    except Unsupported as e:
        return None, None, None, f"n/a: {e}"
    try:
        compiled = runner.step.lower(*runner.abstract_args).compile()
    except Exception as e:  # XlaRuntimeError's type moves between JAX versions
        if is_out_of_memory(e):
            return runner, None, None, "OOM"
        raise
    memory = memory_of(compiled)
    if limit is not None and memory is not None and memory["peak"] > limit:
        return runner, compiled, memory, "OOM (predicted)"
    return runner, compiled, memory, "fits"


def measured_peak(size: int, repeats: int = 20) -> float:
    """bf16 matmul FLOP/s of the first device: ``a[size, size] @ b`` (float32 accumulation),
    the median of ``repeats`` timed runs after one warm-up, 8 products per call so that the
    dispatch is amortised."""
    key_a, key_b = jax.random.split(jax.random.key(1))
    a = jax.random.normal(key_a, (size, size), jnp.bfloat16)
    b = jax.random.normal(key_b, (size, size), jnp.bfloat16) / size

    @jax.jit
    def chain(a, b):
        for _ in range(8):  # each product feeds the next: none can be skipped
            a = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return a

    jax.block_until_ready(chain(a, b))
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(chain(a, b))
        times.append(time.perf_counter() - begin)
    return 8 * 2 * size**3 / float(np.median(times))


def device_memory_limit():
    """The first device's memory in bytes (``memory_stats()["bytes_limit"]``), or None."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # some backends raise rather than return None
        return None
    return None if not stats else stats.get("bytes_limit")


def random_batch(model, batch, seq, rng):
    tokens = rng.integers(0, model.vocab_size, (batch, seq + 1), dtype=np.int32)
    return tokens[:, :-1], tokens[:, 1:]  # ids, labels: the next tokens


def bench_shape(
    programs, model, batch, seq, remat, *, steps, warmup, limit, peaks, rng, offload="auto"
):
    """One row per program at ``batch × seq``: every program that fits timed in one rotation.

    Each program's train state (parameters and Adam's two moments: 12 bytes a parameter, 3 GB
    for the 254M model) stays on the device between its steps unless the states of all the
    programs and the largest program's own buffers would not fit ``limit`` together
    (``offload="auto"``; ``"always"``, ``"never"``): then a program's state waits on the host
    while the others run and is put back before its step, outside the timed call."""
    params = jax.device_get(model.init(jax.random.key(0)))  # host: each program places its own
    x, y = random_batch(model, batch, seq, rng)
    flops = model.train_flops_per_token(seq) * batch * seq
    rows, runs = [], {}
    for program in programs:
        runner, compiled, memory, status = compile_program(program, model, batch, seq, remat,
                                                           limit)  # fmt: skip
        row = {"program": program.label, "batch": batch, "seq": seq, "remat": remat,
               "status": status, "memory": memory, "flops_per_step": flops}  # fmt: skip
        rows.append(row)
        if status == "fits":
            runs[program.label] = [compiled, runner, runner.place(x, y), row]
    memories = [run[3]["memory"] for run in runs.values() if run[3]["memory"]]
    together = sum(m["argument"] for m in memories) + max(
        (m["peak"] - m["argument"] for m in memories), default=0
    )
    host = offload == "always" or (offload == "auto" and limit is not None and together > limit)
    shardings = {}
    for label, run in runs.items():  # the states, made one at a time
        run[1] = run[1].state_of(params)
        run[3]["state_on_host"] = host
        if host:  # the state waits on the host, its device buffers freed
            shardings[label] = jax.tree.map(lambda a: a.sharding, run[1])
            run[1] = jax.device_get(run[1])
    times = time_in_rotation(runs, host, shardings, warmup=warmup, steps=steps)
    for label, run in runs.items():
        if run is None:
            continue
        row = run[3]
        ms = float(np.median(times[label]) * 1e3)
        row.update(step_ms=ms, tokens_per_s=batch * seq / ms * 1e3, steps=len(times[label]))
        for name, peak in peaks.items():
            row[f"mfu_{name}"] = None if peak is None else flops / (ms / 1e3) / peak
    del runs
    return rows


def time_in_rotation(runs, host, shardings, *, warmup, steps) -> dict:
    """Each program's step times in seconds, the ``warmup`` rounds left out: one step of each
    per round, every other round in reverse order, ``block_until_ready`` each step. ``runs``:
    label → ``[compiled, state, placed batch, row]``; with ``host`` each state waits on the host
    and is put back with its ``shardings`` before its step, outside the timed call. A program
    out of memory at run time gets the status "OOM" and its run None."""
    times = {label: [] for label in runs}
    for i in range(warmup + steps):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for label in order:
            run = runs[label]
            if run is None:
                continue
            state = run[1]
            if host:
                state = jax.block_until_ready(jax.device_put(state, shardings[label]))
            begin = time.perf_counter()
            try:
                state, _ = jax.block_until_ready(run[0](state, *run[2]))
            except Exception as e:  # the device's out-of-memory error, at run time
                if not is_out_of_memory(e):
                    raise
                run[3]["status"] = "OOM"
                runs[label] = None
                continue
            elapsed = time.perf_counter() - begin
            run[1] = jax.device_get(state) if host else state
            del state
            if i >= warmup:
                times[label].append(elapsed)
    return times


def largest_fitting(programs, model, limit, *, seq, max_batch, max_seq, policy="full", starts=None):
    """Per program, without remat and under the remat ``policy``: the largest power-of-two
    batch at ``seq`` and the longest power-of-two sequence at batch 1 whose compiled step fits
    ``limit`` (compiled, not run). ``starts``: remat → (batch, sequence) to search from (a
    shape already compiled for the timed rows costs nothing; default (1, ``seq``))."""
    out = []
    for program in programs:
        for remat in (None, policy):
            start_batch, start_seq = (starts or {}).get(remat, (1, seq))
            found = {"program": program.label, "remat": remat, "seq": seq}
            for what, start, stop, shape in (
                ("batch", start_batch, max_batch, lambda n: (n, seq)),
                ("seq_at_batch_1", max(start_seq, seq), max_seq, lambda n: (1, n)),
            ):  # fmt: skip

                def status(n, shape=shape, remat=remat, program=program):
                    return compile_program(program, model, *shape(n), remat, limit)[3]

                found[what], found[f"{what}_stopped"] = _largest(status, start, stop,
                                                                 floor=1 if what == "batch"
                                                                 else seq)  # fmt: skip
                if found[f"{what}_stopped"].startswith("n/a"):
                    break
            out.append(found)
            print(f"largest fitting: {program.label}{f' remat {remat}' if remat else ''}: batch "
                  f"{found['batch']} at S={seq}, S {found.get('seq_at_batch_1')} at batch 1",
                  flush=True)  # fmt: skip
    return out


def _largest(status, start: int, stop: int, floor: int = 1):
    """``(n, why)``: the largest power of two ``n`` in [floor, stop] whose ``status(n)`` is
    "fits", searched from ``start``: doubling while it fits, else halving until it does;
    ``why`` the status that ended the search ("searched to the end" at ``stop``). A status
    "n/a: …" (a program the build cannot make) ends it at once, with no ``n``."""
    first = status(start)
    if first.startswith("n/a"):
        return None, first
    if first != "fits":
        n = start // 2
        while n >= floor:
            if status(n) == "fits":
                return n, first
            n //= 2
        return None, first
    best, n = start, start * 2
    while n <= stop:
        why = status(n)
        if why != "fits":
            return best, why
        best, n = n, n * 2
    return best, "searched to the end"


def loss_check(programs, model, batch, seq, rng, limit=None) -> dict:
    """``LOSS_STEPS`` steps of every program from the same init on the same batches; each
    program's losses against the first's (``plain einsum``)."""
    params = jax.device_get(model.init(jax.random.key(0)))
    batches = [random_batch(model, batch, seq, rng) for _ in range(LOSS_STEPS)]
    losses = {}
    for program in programs:
        runner, compiled, _, status = compile_program(program, model, batch, seq, None, limit)
        if status != "fits":
            continue
        state, out = runner.state_of(params), []
        for x, y in batches:
            state, loss = compiled(state, *runner.place(x, y))
            out.append(float(loss))  # one step in flight
        losses[program.label] = out
        del state  # one program's state on the device at a time
    anchor = next(iter(losses))
    ref = np.asarray(losses[anchor])
    rtol = {label: float(np.max(np.abs(np.asarray(v) - ref) / np.abs(ref)))
            for label, v in losses.items() if label != anchor}  # fmt: skip
    return {"batch": batch, "seq": seq, "steps": LOSS_STEPS, "anchor": anchor, "losses": losses,
            "max_relative_diff": rtol, "bound": LOSS_RTOL,
            "agree": all(r <= LOSS_RTOL for r in rtol.values())}  # fmt: skip


def argument_parser() -> argparse.ArgumentParser:
    """The command line (the commands of the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny Llama and shapes: checks it runs")
    p.add_argument("--model", choices=sorted(MODELS), nargs="+", default=sorted(MODELS))
    p.add_argument("--steps", type=int, default=None, help="timed steps per program (20; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (3; quick 1)")
    p.add_argument("--attention", nargs="+", default=None,
                   help="build's attention= values for the shardops rows (default auto; "
                        "ignored by a build without the option)")  # fmt: skip
    p.add_argument("--remat", default="full", choices=sorted(PLAIN_REMAT), metavar="POLICY",
                   help="the remat rows' policy: full (recompute each block) or matmuls (keep "
                        "the dense layers' outputs); build's remat= of the same name")  # fmt: skip
    p.add_argument("--memory-limit", type=float, default=None, metavar="BYTES",
                   help="device memory in bytes (default: the device's bytes_limit)")  # fmt: skip
    p.add_argument("--no-search", action="store_true", help="skip the largest-fitting search")
    p.add_argument("--offload-states", choices=("auto", "always", "never"), default=None,
                   help="keep the programs' train states on the host between their steps: "
                        "auto (when they do not fit the device together; the default), "
                        "always (quick's, so CI runs the round trip), never")  # fmt: skip
    p.add_argument("--out", default=None, help=f"results folder (default {RESULTS})")
    return p


def chosen_programs(p, attention, platform: str) -> tuple[list[Program], bool]:
    """The programs to run (``programs_for``) with ``--attention``'s values, each one the
    installed build accepts (else ``p.error``), and whether build has the ``attention=``
    option."""
    choices = attention_choices()
    attentions = [None] if choices is None else (attention or ["auto"])
    for a in attentions:
        if choices is not None and a not in choices:
            p.error(f"--attention {a!r}: the installed build accepts {', '.join(choices)}")
    programs = programs_for(platform, attentions)
    if choices is None:
        print("models.build has no attention= option here: the shardops rows run its only "
              "attention", flush=True)  # fmt: skip
    return programs, choices is not None


def peaks_of(device, quick: bool) -> dict:
    """The bf16 matmul peaks of ``device`` in FLOP/s: the measured one (``measured_peak``) and
    the specification's (None for a device not in ``SPEC_PEAK_FLOPS``)."""
    peaks = {
        "measured": measured_peak(256 if quick else 8192),
        "spec": SPEC_PEAK_FLOPS.get(device.device_kind),
    }
    print(f"{device.device_kind}: bf16 matmul peak {peaks['measured'] / 1e12:.3g} TFLOP/s measured",
          flush=True)  # fmt: skip
    return peaks


def timed_rows(programs, model, args, *, steps, warmup, limit, peaks, rng) -> list[dict]:
    """``bench_shape``'s rows at every shape (``SHAPES``; ``--quick``: ``QUICK_SHAPES``), each
    printed as it comes."""
    quick = args.quick
    rows = []
    for batch, seq, with_remat in QUICK_SHAPES if quick else SHAPES:
        remat = args.remat if with_remat else None
        rows += bench_shape(programs, model, batch, seq, remat, steps=steps, warmup=warmup,
                            limit=limit, peaks=peaks, rng=rng,
                            offload=args.offload_states or ("always" if quick else "auto"))  # fmt: skip
        for r in rows[-len(programs) :]:
            timing = f"{r['step_ms']:.1f} ms" if "step_ms" in r else r["status"]
            print(f"{r['program']:>24} {batch} × {seq}{f' remat {remat}' if remat else ''}: "
                  f"{timing}",
                  flush=True)  # fmt: skip
    return rows


def largest_of(programs, model, args, limit) -> list[dict] | None:
    """``largest_fitting``'s shapes, or None (``--no-search``, or a device that reports no
    memory)."""
    if args.no_search or limit is None:
        return None
    quick = args.quick
    # quick: the timed shape's programs only (compiled already), so it costs nothing
    # from shapes the timed rows compiled (quick: only those, so it costs nothing)
    starts = {None: (1, 64), args.remat: (1, 64)} if quick else {
        None: (8, 8192), args.remat: (16, 8192)}  # fmt: skip
    return largest_fitting(programs, model, limit, seq=64 if quick else SEARCH_SEQ,
                           max_batch=1 if quick else SEARCH_MAX_BATCH,
                           max_seq=64 if quick else CONTEXT, policy=args.remat,
                           starts=starts)  # fmt: skip


def write_results(out: pathlib.Path, stem: str, results: dict) -> None:
    """``STEM.json`` and ``STEM.md`` (``markdown``) in ``out``; the markdown printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out / f"{stem}.md").write_text(table)
    print(table, flush=True)


def main(argv=None):
    p = argument_parser()
    args = p.parse_args(argv)
    quick = args.quick
    steps = args.steps or (3 if quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    out = pathlib.Path(args.out or (tempfile.mkdtemp() if quick else RESULTS))
    device = jax.devices()[0]
    limit = args.memory_limit or device_memory_limit()
    if quick and limit is None:
        limit = 64 * 2**20  # CPU reports none: a small budget exercises the search
    programs, attention_option = chosen_programs(p, args.attention, device.platform)
    began = time.perf_counter()
    peaks = peaks_of(device, quick)
    rng = np.random.default_rng(0)
    named = {"quick": QUICK_MODEL} if quick else {k: MODELS[k] for k in args.model}
    exit_code = 0
    for name, sizes in named.items():
        model = model_of(sizes)
        rows = timed_rows(programs, model, args, steps=steps, warmup=warmup, limit=limit,
                          peaks=peaks, rng=rng)  # fmt: skip
        largest = largest_of(programs, model, args, limit)
        check = loss_check(programs, model, *(QUICK_SHAPES if quick else SHAPES)[0][:2], rng, limit)
        for label, losses in check["losses"].items():
            print(f"loss {label:>24}: " + " ".join(f"{v:.5f}" for v in losses), flush=True)
        results = {
            "model": model.name, "model_key": name, "platform": device.platform,
            "device_kind": device.device_kind, "jax": jax.__version__,
            "host": host_platform.platform(), "memory_limit": limit, "peaks": peaks,
            "attention_option": attention_option, "rows": rows, "largest": largest,
            "loss_check": check, "seconds": time.perf_counter() - began,
        }  # fmt: skip
        write_results(out, "accelerator" if len(named) == 1 else f"accelerator_{name}", results)
        if not check["agree"]:
            print(f"the losses disagree beyond {LOSS_RTOL:.2g} relative: "
                  f"{check['max_relative_diff']}", file=sys.stderr, flush=True)  # fmt: skip
            if quick:
                exit_code = 1
    print(f"wrote {out} in {time.perf_counter() - began:.0f} s")
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
