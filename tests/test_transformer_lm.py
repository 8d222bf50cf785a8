"""examples/transformer_lm.py, run as a user runs it: in a subprocess (a training loop that hung
on XLA:CPU's collectives would take the test process with it), briefly, offline."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
from _cover import FULL
from _resume_checks import LM_ARGS, check_lm_resume_report, load_example, run_main

ROOT = pathlib.Path(__file__).parent.parent
SCRIPT = ROOT / "examples" / "transformer_lm.py"
# The suite's own XLA_FLAGS (tests/conftest.py): 8 simulated devices and, but under
# SHARDOPS_FULL=1, the default run's compiler (tests/_cover.py), which halves these runs' time.
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(*args, timeout=150):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV,
    )  # fmt: skip


# CI time: both run under SHARDOPS_FULL=1. By default the getting-started page's command runs
# fsdp_tp on 4 × 2 for 30 steps with the same checks (tests/test_doc_commands.py's
# check_lm_run), and the multi-process page's runs sp on 2 × 4 to its end (the GPT's tests hold
# sp to the reference: tests/networks/test_gpt.py).
@pytest.mark.parametrize(
    ("strategy", "mesh", "source"),
    [pytest.param("fsdp_tp", "4x2", "stdlib", marks=pytest.mark.skipif(
        not FULL, reason="CI time: SHARDOPS_FULL=1 (tests/test_doc_commands.py's check_lm_run "
                         "runs the getting-started page's fsdp_tp command with these checks)")),
     *[("sp", "2x4", "auto")] * FULL],
)  # fmt: skip
def test_trains_like_the_reference_and_samples(tmp_path, strategy, mesh, source):
    metrics_path, plot_path = tmp_path / "lm.json", tmp_path / "lm.png"
    # 30 steps of 8×128 bytes at the default LR: the loss falls from ln 256 ≈ 5.5 to about 3.2,
    # and the sharded and unsharded runs are still far from the chaotic divergence that Adam
    # reaches over hundreds of steps (a 1e-7 perturbation of the init grows to ~1e-3 by ~step 50
    # to 100 at this LR; at step 50 sharded vs reference is ~1e-5).
    proc = run(
        "--strategy", strategy, "--mesh", mesh, "--text-source", source, "--steps", "30",
        "--batch-size", "8", "--log-every", "10", "--eval-every", "15", "--eval-batches", "2",
        "--sample-tokens", "24", "--compare-reference", "--plot", str(plot_path),
        "--metrics-json", str(metrics_path),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    assert out.startswith("text: "), out  # the corpus message comes first
    if source == "stdlib":
        assert out.startswith("text: Python "), out
    assert "step    10/30: loss " in out and "(reference " in out  # --log-every lines
    assert "  validation at step 15: loss " in out
    record = json.loads(metrics_path.read_text())
    assert record["strategy"] == strategy and record["steps"] == list(range(1, 31))
    assert record["corpus_message"] in out
    losses = record["losses"]
    assert losses[0] > math.log(256) - 0.2, losses[:3]  # the init predicts ~uniform bytes
    assert record["final_loss"] < 0.7 * losses[0], losses
    assert record["valid"][-1]["step"] == 30 and record["final_valid_loss"] < 0.7 * losses[0]
    assert len(record["reference_losses"]) == 30
    assert record["final_relative_diff"] < 1e-3, record["final_relative_diff"]
    assert record["timing"]["train_seconds"] > 0
    sample = record["sample"]
    assert len(sample["prompt"]) > 0 and f"{sample['prompt']}⟦" in out
    assert "Sample (24 bytes, temperature 0.8)" in out
    rows = 8 // int(mesh.split("x")[1])  # the decoder: the model axis splits heads, rows the rest
    assert f"KV-cache decoding: {rows} × 24 bytes in " in out, out
    assert plot_path.read_bytes()[:8] == PNG_MAGIC


def test_the_llama_trains_like_the_reference_and_reports_its_flops(tmp_path):
    """``--model llama`` (tied, MQA, clipped by default) on a 3-axis mesh: the sharded and
    unsharded runs agree, and the MFU line's figures are the model's FLOPs over a measured
    peak: FLOP/s = the model's FLOPs per token × tokens/s."""
    metrics_path = tmp_path / "llama.json"
    proc = run(
        "--model", "llama", "--kv-heads", "1", "--tie-embeddings", "--strategy", "hsdp_tp",
        "--mesh", "replica=2,data=2,model=2", "--text-source", "stdlib", "--steps", "20",
        "--log-every", "10", "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "8",
        "--compare-reference", "--compare-decoding", "--metrics-json", str(metrics_path),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    record = json.loads(metrics_path.read_text())
    assert record["model"].startswith("llama L=4 D=128 H=4/1 F=352 V=256 tied")
    assert record["args"]["clip"] == 1.0  # the Llama's default
    assert record["final_relative_diff"] < 1e-3, record["final_relative_diff"]
    assert record["final_loss"] < 0.8 * record["losses"][0]
    timing = record["timing"]
    import shardops_models as models

    llama = models.Llama(vocab_size=256, d_model=128, num_layers=4, num_heads=4, num_kv_heads=1,
                         context=128, tie_embeddings=True)  # fmt: skip
    assert timing["model_flops_per_second"] == pytest.approx(
        llama.train_flops_per_token(128) * timing["tokens_per_second"]
    )
    assert 0 < timing["mfu"] < 1
    assert timing["mfu"] == pytest.approx(
        timing["model_flops_per_second"] / timing["peak_flops_per_second"]
    )
    assert "Model FLOPs utilisation" in proc.stdout and "tokens/s" in proc.stdout
    # The sample comes from the KV-cache decoder on the 8 devices (model = 2 splits the heads,
    # 4 rows over the rest), timed against recomputing the prefix for every byte.
    assert "KV-cache decoding: 4 × 8 bytes in " in proc.stdout, proc.stdout
    assert "Greedy, 8 bytes: full recompute " in proc.stdout
    assert timing["decode_rows"] == 4 and timing["decode_tokens_per_second"] > 0
    assert timing["recompute_seconds"] > 0
    assert len(record["sample"]["generated"].encode("utf-8", "surrogateescape")) >= 1


@pytest.mark.parametrize(
    ("model", "precision", "attention", "remat", "strategy", "mesh"),
    [("llama", "mixed_bfloat16", "blocked", "full", "fsdp_tp", "4x2"),
     *[("gpt", "bfloat16", "einsum", "matmuls", "tp", "1x2")] * FULL],  # CI time: one run
)  # fmt: skip
def test_precision_attention_and_remat_reach_the_run(tmp_path, monkeypatch, model, precision,
                                                     attention, remat, strategy, mesh):  # fmt: skip
    """``--precision``, ``--attention`` and ``--remat`` are build's options for the sharded
    run and the reference alike (the bfloat16 runs agree as the float32 ones do), the
    parameters are stored in the policy's dtype, and the MFU's peak is measured in the
    compute dtype."""
    metrics_path = tmp_path / "lm.json"
    proc = run(
        "--model", model, "--precision", precision, "--attention", attention, "--remat", remat,
        "--strategy", strategy, "--mesh", mesh, "--layers", "2", "--text-source", "stdlib",
        "--steps", "6", "--log-every", "3", "--eval-every", "0", "--eval-batches", "1",
        "--sample-tokens", "4", "--compare-reference", "--metrics-json", str(metrics_path),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    record = json.loads(metrics_path.read_text())
    args = record["args"]
    assert (args["precision"], args["attention"], args["remat"]) == (precision, attention, remat)
    assert record["final_relative_diff"] < 1e-3, record["final_relative_diff"]
    assert "(bfloat16 matmuls on all" in proc.stdout, proc.stdout
    lm = load_example("transformer_lm")
    made = {}

    def build(*a, **kw):  # what the example asks of models.build, the run itself not run
        made[a[0]] = kw
        raise ValueError("stop here")

    monkeypatch.setattr(lm.models, "build", build)
    with pytest.raises(SystemExit):
        lm.main(["--model", model, "--precision", precision, "--attention", attention,
                 "--remat", remat, "--strategy", strategy, "--mesh", mesh])  # fmt: skip
    options = made[strategy]  # the sharded run's (it fails first: the reference is not built)
    assert options["precision"] is lm.PRECISIONS[precision]
    assert (options["attention"], options["remat"]) == (attention, remat)


@pytest.mark.parametrize(("platforms", "simulated"),
                         [("cpu", True), ("tpu", False), ("cuda,cpu", False)])  # fmt: skip
def test_simulated_cpu_devices_only_without_an_accelerator(platforms, simulated):
    """The example sets XLA_FLAGS' simulated devices (before JAX starts) only where JAX will
    not find a TPU or GPU: ``JAX_PLATFORMS`` naming one first keeps the real devices alone."""
    code = ("import importlib.util, os, sys; "
            "sys.path.insert(0, os.path.dirname(sys.argv[1])); "  # as Python does for a script
            "spec = importlib.util.spec_from_file_location('lm', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.ACCELERATOR, repr(os.environ.get('XLA_FLAGS', '')))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": platforms}
    proc = subprocess.run([sys.executable, "-c", code, str(SCRIPT)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    flag = "'--xla_force_host_platform_device_count=8'"
    assert proc.stdout.split() == ([str(not simulated), flag] if simulated else ["True", "''"])


@pytest.mark.parametrize(("model", "method"), [("gpt", "ring"), ("llama", "ulysses")])
def test_context_parallel_trains_like_the_reference(tmp_path, model, method):
    """``--context-parallel`` on data=2 × context=2 × model=2: the sequence split over context
    (``STRATEGY+METHOD``) trains as the unsharded model does, and samples."""
    metrics_path = tmp_path / "cp.json"
    extra = ("--heads", "8", "--kv-heads", "4") if model == "llama" else ()  # GQA, 2 per device
    proc = run(
        "--model", model, *extra, "--strategy", "2d", "--mesh", "data=2,context=2,model=2",
        "--context-parallel", method, "--context", "64", "--text-source", "stdlib",
        "--steps", "8", "--log-every", "4", "--eval-every", "0", "--eval-batches", "2",
        "--sample-tokens", "4", "--prompt-bytes", "16", "--compare-reference",
        "--metrics-json", str(metrics_path),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    record = json.loads(metrics_path.read_text())
    assert record["strategy"] == f"2d+{method}", record["strategy"]
    assert record["final_relative_diff"] < 1e-5, record["final_relative_diff"]
    assert f"strategy 2d+{method} on data=2 × context=2 × model=2" in proc.stdout


def test_llama_flops_per_token_by_hand():
    """PaLM's count for L=2, D=8, H=4 (hd 2), KV=2, F=16, V=10, S=6: per block the Q, K, V,
    O projections 8·(4+2+2)·2 + 4·2·8 = 192 and the MLP 3·8·16 = 384; the head 80; so
    6·(2·576 + 80) = 7392, plus attention 12·2·4·2·6 = 1152."""
    import shardops_models as models

    llama = models.Llama(vocab_size=10, d_model=8, num_layers=2, num_heads=4, num_kv_heads=2,
                         d_ff=16)  # fmt: skip
    assert llama.train_flops_per_token(6) == 7392 + 1152
    gpt = models.Gpt(vocab_size=10, d_model=8, num_heads=2, num_layers=2, d_ff=16)
    assert gpt.train_flops_per_token(6) == 6 * (2 * (4 * 64 + 2 * 128) + 80) + 12 * 2 * 8 * 6


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        ("abc", "argument --mesh: mesh 'abc': expected DATAxMODEL (e.g. 4x2) or named axes"),
        ("4x0", "argument --mesh: mesh '4x0': expected DATAxMODEL"),
        ("2x2x2", "more than two axes need their names"),
        ("3x2", "--batch-size 8 must be a multiple of 3"),
        ("4x4", "--mesh 4x4 needs 16 devices; this process has 8"),
        ("1x8", "num_heads=4 is not divisible by mesh axis 'model' (size 8)"),
    ],
)
def test_a_bad_mesh_is_a_one_line_error(mesh, message, capsys):
    """argparse's usage error (exit status 2), one line, no traceback: in this process (the
    script as a user runs it, below)."""
    with pytest.raises(SystemExit) as stop:
        load_example("transformer_lm").main(["--mesh", mesh])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert re.match(r"\S+: error: ", last) and message in last, err


def test_a_bad_mesh_run_as_a_script_is_a_one_line_error():
    proc = run("--mesh", "4x4", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr  # argparse's usage error
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("transformer_lm.py: error: --mesh 4x4 needs 16 devices; this "
                           "process has 8 (on CPU, simulate more with XLA_FLAGS="), last  # fmt: skip


def test_locate_finds_every_layer_within_bound_on_the_full_model():
    """``--locate`` on the example's GPT (4 blocks, width 128, 128 tokens): one gradient step,
    every layer within bound. Its taps are large enough that reading them inside the device's
    callback (before the program finished) deadlocked XLA:CPU's collectives."""
    proc = run("--locate", "--strategy", "fsdp_sp", "--mesh", "2x4", timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "within bound" in proc.stdout and "['blocks'][3]['attn']" in proc.stdout


def test_a_resumed_run_reports_only_the_steps_and_tokens_it_trained(straight_checkpoints, tmp_path):
    straight = straight_checkpoints("transformer_lm")
    check_lm_resume_report(load_example("transformer_lm"), straight, tmp_path)


def test_a_preemption_notice_saves_that_step_and_the_resumed_run_ends_like_the_straight_one(
    straight_checkpoints, tmp_path, monkeypatch
):
    """A real SIGTERM to this process while step 1 of 4 runs (sent as the loop reports
    boundary 0): the single-process handler takes it, the run saves step 1 (with its one loss)
    at the next boundary and exits 143; ``--resume`` trains steps 2–4 and ends with the
    straight run's state and losses, bit for bit."""
    import os
    import signal

    import jax
    import numpy as np

    import shardops.preemption
    import shardops.watchdog
    import shardops_models as models
    from shardops_models.training.checkpoint import Checkpoints

    asked, reached = [], shardops.preemption.Preemption.reached

    def asking(self, step):
        asked.append(step)
        return reached(self, step)

    def step_then_notice(self, step):
        if step == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    directory = tmp_path / "preempted"
    with monkeypatch.context() as patch:
        patch.setattr(shardops.preemption.Preemption, "reached", asking)
        patch.setattr(shardops.watchdog.Watchdog, "step", step_then_notice)
        with pytest.raises(SystemExit) as stop:
            run_main(load_example("transformer_lm"), [*LM_ARGS, "--checkpoint-dir", str(directory)])
    assert stop.value.code == shardops.preemption.EXIT_CODE == 143
    assert asked == [0, 1]  # every boundary asked, from the first
    with Checkpoints(directory) as ckpt:
        assert ckpt.steps() == [1] and len(ckpt.record()["extra"]["losses"]) == 1
    run_main(load_example("transformer_lm"),
             [*LM_ARGS, "--checkpoint-dir", str(directory), "--resume"])  # fmt: skip
    example = load_example("transformer_lm")
    _, args = example.parse_args(LM_ARGS)
    setup = models.build("ref", model=example.make_model(args),
                         optimizer=example.make_optimizer(args))  # fmt: skip
    got = {}
    for name, folder in (("straight", straight_checkpoints("transformer_lm")),
                         ("resumed", directory)):  # fmt: skip
        with Checkpoints(folder) as ckpt:
            state, extra = ckpt.restore(setup)
            got[name] = (jax.tree.leaves(setup.gather(state)), extra["losses"], ckpt.steps()[-1])
    assert got["straight"][2] == got["resumed"][2] == 4
    assert got["straight"][1] == got["resumed"][1]
    for a, b in zip(got["straight"][0], got["resumed"][0], strict=True):
        np.testing.assert_array_equal(a, b)


def test_stop_on_non_finite_names_the_first_step_whose_loss_is_nan_and_the_layer(tmp_path):
    """A learning rate of 1e30 makes the loss NaN within a few steps: the run stops naming
    the first step whose logged loss is NaN, and the replay names a layer."""
    import contextlib
    import io
    import re

    out = io.StringIO()
    args = [*LM_ARGS[: LM_ARGS.index("--steps")], "--steps", "8",
            *LM_ARGS[LM_ARGS.index("--steps") + 2 :], "--lr", "1e30", "--stop-on-non-finite",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]  # fmt: skip
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        load_example("transformer_lm").main(args)
    said = str(stop.value.code)
    first_nan = re.search(r"^step +(\d+)/8: loss nan", out.getvalue(), re.M)
    assert first_nan, out.getvalue()
    assert said.startswith(f"Stopped: step {first_nan[1]}: the loss is nan; "), said
    assert re.search(r"the first non-finite value is the output of layer \['\w+'\]", said), said
    assert "step     8/8" not in out.getvalue()  # it stopped
    # Every step saved was checked first: no checkpoint holds the NaN (the last one is waited for).
    saved = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert saved and saved[-1] == int(first_nan[1]) - 1, (saved, said)


def test_resume_passes_over_a_damaged_step_says_so_and_ends_like_the_straight_run(
    straight_checkpoints, tmp_path
):
    """Step 4 of the straight run's checkpoints cut short (its largest array file, halved):
    ``--resume`` names it, falls back to step 2, trains steps 3–4 and ends with the straight
    run's losses and state, bit for bit."""
    import re
    import shutil

    import jax
    import numpy as np

    import shardops_models as models
    from shardops_models.training.checkpoint import Checkpoints

    straight = straight_checkpoints("transformer_lm")
    directory = tmp_path / "damaged"
    shutil.copytree(straight, directory)
    files = [f for f in (directory / "4" / "state").rglob("*") if f.is_file()]
    largest = max(files, key=lambda f: f.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    out = run_main(load_example("transformer_lm"),
                   [*LM_ARGS, "--checkpoint-dir", str(directory), "--resume"])  # fmt: skip
    assert re.search(rf"^Checkpoint step 4 in {re.escape(str(directory))} is damaged \(.+\); "
                     r"falling back to step 2$", out, re.M), out  # fmt: skip
    assert re.search(r"^Resume: step 2 from ", out, re.M), out
    example = load_example("transformer_lm")
    _, args = example.parse_args(LM_ARGS)
    setup = models.build("ref", model=example.make_model(args),
                         optimizer=example.make_optimizer(args))  # fmt: skip
    got = {}
    for name, folder in (("straight", straight), ("resumed", directory)):
        with Checkpoints(folder) as ckpt:
            state, extra = ckpt.restore(setup, 4)
            got[name] = (jax.tree.leaves(setup.gather(state)), extra["losses"])
    assert got["straight"][1] == got["resumed"][1]
    for a, b in zip(got["straight"][0], got["resumed"][0], strict=True):
        np.testing.assert_array_equal(a, b)


SMALL = ["--text-source", "stdlib", "--steps", "1", "--layers", "1", "--width", "16", "--heads",
         "2", "--eval-batches", "1", "--sample-tokens", "0"]  # fmt: skip
CP = ["--strategy", "2d", "--mesh", "data=2,context=2,model=2", "--context-parallel", "ring"]
USAGE_ERRORS = [
    ([*CP, "--context", "18"],
     r"--context 18 does not fit strategy 2d\+ring on data=2 × context=2 × model=2: the batch: "
     r"x dim 1 \(sequence\) = 18 is not divisible by 2 × mesh axis 'context' \(size 2\) = 4: .* "
     r"Use a sequence length that is a multiple of 4 \(e\.g\. 20\), or a smaller context axis\."),
    ([*CP, "--context", "2"], r"--context 2 does not fit .* = 2 is not divisible by 2 × mesh "
     r"axis 'context' \(size 2\) = 4: .* a multiple of 4 \(e\.g\. 4\), or a smaller context axis\."),
    (["--strategy", "sp", "--mesh", "4x2", "--context", "17"],
     r"--context 17 does not fit strategy sp on data=4 × model=2: x dim 1 \(sequence\) = 17 is "
     r"not divisible by mesh axis 'model' \(size 2\); choose a multiple of 2 or a mesh whose "
     r"axis divides 17"),
    (["--context", "100000"],
     r"--batch-size 8 × --context 100000 bytes do not fit the validation text of python_stdlib "
     r"\(\d+ bytes\): .*fewer than batch_size=8.*; lower batch_size or context"),
    (["--checkpoint-dir", "unused", "--checkpoint-every", "0"],
     r"--checkpoint-every must be at least 1 step; got 0 \(leave it out to save at the end only\)"),
    (["--watchdog-timeout", "-1"], r"--watchdog-timeout must be ≥ 0; got -1\.0"),
]  # fmt: skip


# What the library raises from inside the run when the example's own check is lost.
LIBRARY_ERRORS = {
    0: r"the batch: x dim 1 \(sequence\) = 18 is not divisible by 2 × mesh axis 'context'",
    5: r"Watchdog: timeout_s must be a number of seconds > 0 \(None: off\); got -1\.0",
}


def check_usage_error(example, args, message, capsys) -> None:
    """``main(args)`` stops with argparse's usage error (exit status 2): one line naming the
    flag, the sizes and a valid value, no traceback."""
    with pytest.raises(SystemExit) as stop:
        example.main([*SMALL, *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"\S+: error: " + message, last), last


@pytest.mark.parametrize(("args", "message"), USAGE_ERRORS,
                         ids=["cp-18", "cp-2", "sp-17", "text", "checkpoint-every", "watchdog"])  # fmt: skip
def test_a_size_the_library_refuses_is_a_usage_error(args, message, capsys):
    """Sizes the library would refuse with a traceback from inside the run (a --context the
    context or sequence-parallel axis does not split, a window the text cannot fill, a
    checkpoint interval or watchdog timeout out of range) are usage lines, checked up front."""
    check_usage_error(load_example("transformer_lm"), args, message, capsys)


@pytest.mark.parametrize(("old", "new", "case"), [  # the check lost, a case that needs it
    ("        setup.check_batch(np.zeros((args.batch_size, args.context), np.int32))",
     "        pass", 0),
    ('    for name in ("warmup", "eval_every", "sample_tokens", "watchdog_timeout"):',
     '    for name in ("warmup", "eval_every", "sample_tokens"):', 5),
], ids=["batch-shape", "watchdog"])  # fmt: skip
def test_usage_checks_lost_are_caught(old, new, case, capsys):
    """Mutants of the example without a check: the run reaches the library's error as a
    traceback (not SystemExit 2), which the usage test refuses."""
    example = load_example("transformer_lm", old, new)  # outside raises: a line not found
    with pytest.raises(ValueError, match=LIBRARY_ERRORS[case]):  # the library's, not a usage line
        check_usage_error(example, *USAGE_ERRORS[case], capsys)


def parser_of(example):
    """The ``argparse`` parser an example builds, caught as it parses (nothing trains)."""
    import argparse

    class Built(Exception):
        pass

    def catch(self, args=None, namespace=None):
        raise Built(self)

    real = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch
    try:
        example.parse_args([])
    except Built as built:
        return built.args[0]
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError(f"{example.__name__}.parse_args built no parser")


def documented_flags(page: str) -> dict[str, set[str]]:
    """Example → the flags a page lists for it, in its paragraphs ``Flags of `NAME.py`: …``."""
    found = {}
    for name, paragraph in re.findall(r"^Flags of `(\w+)\.py`:(.*?)(?:\n\n|\Z)", page, re.M | re.S):
        found[name] = set(re.findall(r"`(--[a-z][a-z0-9-]*)", paragraph))
    return found


def flag_mismatches(page: str) -> list[str]:
    """Where a page's flag lists differ from their examples' parsers (missing or stale)."""
    listed = documented_flags(page)
    wrong = [f"no flag list for {sorted({'mlp_2d', 'transformer_lm'} - set(listed))}"]
    wrong = wrong if {"mlp_2d", "transformer_lm"} - set(listed) else []
    for name, flags in listed.items():
        parser = parser_of(load_example(name))
        actual = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        actual.discard("--help")
        if flags != actual:
            wrong.append(f"{name}.py: the page misses {sorted(actual - flags)} and lists "
                         f"{sorted(flags - actual)}, which it does not take")  # fmt: skip
    return wrong


GETTING_STARTED = ROOT / "docs" / "getting-started.md"


def test_getting_started_lists_every_flag_of_the_examples():
    """Every flag list on docs/getting-started.md equals its example's parser's flags (none
    missing, none stale); both training examples have one."""
    assert flag_mismatches(GETTING_STARTED.read_text()) == []


@pytest.mark.parametrize(("old", "new"), [
    ("`--context-parallel\n{allgather,ring,ulysses}`", "`{allgather,ring,ulysses}`"),  # missing
    ("`--remat`,", "`--remat`, `--rematerialise`,"),  # stale
    ("Flags of `transformer_lm.py`:", "Flags:"),  # a list no longer tied to its example
])  # fmt: skip
def test_a_flag_list_out_of_date_is_caught(old, new):
    page = GETTING_STARTED.read_text()
    assert page.count(old) == 1, old
    assert flag_mismatches(page.replace(old, new)) != []


def test_moe_with_expert_parallelism_trains_like_the_reference_and_logs_its_experts(tmp_path):
    """``--moe --expert-parallel`` on data=2 × expert=2 × model=2 (``2d+ep``) trains as the
    unsharded model does; each logging step prints the auxiliary losses and, per expert, its
    share of the choices (they sum to 100 %) and its drop rate. The trained experts decode
    (gathered from 2d+ep, tp over model = 2 and 4 rows): greedy, the KV cache's bytes are the
    dropless recompute's, every one."""
    metrics_path = tmp_path / "moe.json"
    proc = run(
        "--model", "llama", "--moe", "--experts", "4", "--expert-parallel", "--strategy", "2d",
        "--mesh", "data=2,expert=2,model=2", "--context", "32", "--text-source", "stdlib",
        "--steps", "4", "--log-every", "2", "--eval-every", "0", "--eval-batches", "1",
        "--layers", "2", "--width", "32", "--compare-reference",
        "--metrics-json", str(metrics_path), "--sample-tokens", "8", "--prompt-bytes", "16",
        "--temperature", "0", "--compare-decoding",
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert "KV-cache decoding: 4 × 8 bytes in " in proc.stdout, proc.stdout
    assert re.search(r"Greedy, 8 bytes: full recompute .* 8 of 8 bytes the same", proc.stdout)
    record = json.loads(metrics_path.read_text())
    assert record["strategy"] == "2d+ep" and record["final_relative_diff"] < 1e-5, record
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("aux:")]
    assert len(lines) == 2, proc.stdout
    share = [int(v[:-1]) for v in lines[0].split("share ")[1].split(";")[0].split()]
    assert len(share) == 4 and abs(sum(share) - 100) <= 2, lines[0]  # rounded percentages
    assert "load balance" in lines[0] and "dropped" in lines[0]


MOE_CP = ["--model", "llama", "--moe", "--experts", "4", "--layers", "1", "--width", "32",
          "--strategy", "2d", "--mesh", "data=2,context=2,model=2", "--context-parallel", "ring",
          "--context", "16", "--text-source", "stdlib"]  # fmt: skip


def test_moe_with_context_parallelism_trains_like_the_reference_and_logs_its_groups(tmp_path):
    """``--moe --context-parallel ring`` on data=2 × context=2 × model=2 (``2d+ring``): each
    device's 8 tokens of a sequence are one capacity group, and the reference routes the same
    groups (``grouped_reference``: ``Llama.reference_loss(context_shards=2)``), so every
    step's loss and the validation loss agree to 1e-5 relative (a reference routing the whole
    sequences is off by 5e-5 at step 1 and 1.5e-4 in validation). Step 1's expert line (the
    warm-up's LR is 0 at step 1, so the line routes the init) is ``Llama.expert_stats`` with
    ``context_shards=2`` on the first batch, whose drops differ from the whole sequences'."""
    metrics_path = tmp_path / "moe_cp.json"
    proc = run(
        *MOE_CP, "--steps", "3", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
        "--compare-reference", "--sample-tokens", "0", "--metrics-json", str(metrics_path),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    record = json.loads(metrics_path.read_text())
    assert record["strategy"] == "2d+ring" and record["final_relative_diff"] < 1e-5, record
    pairs = [*zip(record["losses"], record["reference_losses"], strict=True),
             (record["valid"][-1]["loss"], record["valid"][-1]["ref_loss"])]  # fmt: skip
    assert max(abs(a - b) / b for a, b in pairs) < 1e-5, pairs
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("aux:")]
    assert len(lines) == 3, proc.stdout
    import jax

    from shardops_models.data import text

    example = load_example("transformer_lm")
    _, args = example.parse_args(MOE_CP)
    model = example.make_model(args)
    ids, _ = next(example.train_batches(text.load_corpus("stdlib").train, args.batch_size,
                                        args.context, args.seed, slice(0, args.batch_size)))  # fmt: skip
    params = model.init(jax.random.key(args.seed))
    groups, whole = (example.expert_line(model, params, ids, n).strip() for n in (2, 1))
    assert groups != whole, "the first batch drops the same under cp's groups as under S's"
    assert lines[0] == groups, (lines[0], groups)


@pytest.mark.parametrize(("args", "message"), [
    (("--model", "llama", "--moe", "--experts", "2", "--top-k", "3"),
     r"--experts/--top-k/--capacity-factor: Experts: k=3 > num_experts=2: .*"),
    (("--moe",), r"--moe replaces the Llama's MLPs: add --model llama"),
    (("--model", "llama", "--moe", "--microbatches", "2"),
     r"--moe with --microbatches 2: the global load balance .* add --load-balance group .*"),
], ids=["k>E", "gpt", "global-microbatches"])  # fmt: skip
def test_moe_options_the_run_cannot_honour_are_usage_errors(args, message, capsys):
    check_usage_error(load_example("transformer_lm"), args, message, capsys)


@pytest.mark.parametrize(("schedule", "name"), [
    (("--schedule", "1f1b", "--layers", "2"), "2d+1f1b"),
    (("--schedule", "circular", "--virtual", "2", "--layers", "4"), "2d+circular"),
], ids=["1f1b", "circular"])  # fmt: skip
def test_pipeline_trains_like_the_reference(tmp_path, schedule, name):
    """``--schedule 1f1b --microbatches 4`` on pipe=2 × data=2 × model=2 (``2d+1f1b``): the
    Llama's layers split into 2 stages train as the unsharded model does; ``--schedule
    circular --virtual 2``: 4 layers in 2 stages × 2 virtual stages."""
    metrics_path = tmp_path / "pp.json"
    proc = run(
        "--model", "llama", "--strategy", "2d", *schedule, "--microbatches", "4",
        "--mesh", "pipe=2,data=2,model=2", "--context", "32", "--text-source", "stdlib",
        "--steps", "4", "--log-every", "2", "--eval-every", "0", "--eval-batches", "1",
        "--width", "32", "--compare-reference", "--sample-tokens", "0",
        "--metrics-json", str(metrics_path),
    )  # fmt: skip
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    record = json.loads(metrics_path.read_text())
    assert record["strategy"] == name and record["final_relative_diff"] < 1e-5, record
    assert f"strategy {name} on pipe=2 × data=2 × model=2" in proc.stdout


@pytest.mark.parametrize(("args", "message"), [
    (("--schedule", "1f1b", "--locate"),
     r"--schedule: --locate taps the layers of one device's forward; .*"),
    (("--model", "llama", "--schedule", "gpipe", "--microbatches", "3", "--mesh",
      "pipe=2,data=2,model=2", "--strategy", "2d", "--layers", "2"),
     r"--batch-size 8 must be a multiple of 6 .*"),
    (("--model", "llama", "--schedule", "gpipe", "--mesh", "pipe=2,data=2,model=2",
      "--strategy", "2d", "--layers", "3"),
     r"params\['blocks'\]\S+: 3 layers do not split into 2 pipeline stages .*"),
    (("--microbatches", "0",), r"--microbatches must be a positive int; got 0"),
    (("--schedule", "1f1b", "--virtual", "2"),
     r"--virtual 2: virtual stages are the circular schedule's; add --schedule circular"),
    (("--model", "llama", "--schedule", "circular", "--mesh", "pipe=2,data=2,model=2",
      "--strategy", "2d", "--layers", "2", "--microbatches", "2"),
     r"params\['blocks'\]\S+: 2 layers do not split into 4 chunks \(2 stages × 2 virtual .*"),
    (("--model", "llama", "--schedule", "circular", "--mesh", "pipe=2,data=2,model=2",
      "--strategy", "2d", "--layers", "4", "--microbatches", "3", "--batch-size", "12"),
     r"circular: 3 microbatches do not split into groups of 2 \(one per stage\).*"),
], ids=["locate", "batch", "layers", "zero", "virtual", "chunks", "groups"])  # fmt: skip
def test_pipeline_options_the_run_cannot_honour_are_usage_errors(args, message, capsys):
    check_usage_error(load_example("transformer_lm"), args, message, capsys)


def check_the_reference_follows_the_sharded_choices(lm) -> None:
    """One fsdp_tp step on data=4 × model=2 of a 1-layer Llama with 4 experts, and the
    unsharded reference's, each under its ``RoutingFollower`` hook: at the shared init the
    choices put together from the 8 devices are the reference's own (no flip) and the losses
    agree; made to follow other choices (each token's experts shifted by one), the reference's
    loss moves and the follower calls it a different routing, not a tie."""
    import jax
    import numpy as np
    import optax

    import shardops

    _, args = lm.parse_args(["--model", "llama", "--moe", "--experts", "4", "--layers", "1",
                             "--width", "32", "--heads", "2", "--context", "16"])  # fmt: skip
    model, mesh = lm.make_model(args), lm.mesh_for("fsdp_tp", "4x2")
    setup = lm.models.build("fsdp_tp", mesh, model=model, optimizer=optax.sgd(0.1))
    ref = lm.models.build("ref", model=model, optimizer=optax.sgd(0.1))
    params = model.init(jax.random.key(0))
    x = np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, 256), np.int32)
    follower = lm.RoutingFollower(args.layers, setup)
    with shardops.layers.moe_routing_hook(follower.record):
        _, loss = setup.train_step(setup.shard(params), *setup.place_batch(x, x))
    follower.choices()
    with shardops.layers.moe_routing_hook(follower.follow):
        _, ref_loss = ref.train_step(ref.shard(params), *ref.place_batch(x, x))
    assert follower.count(1) is None and follower.flips == {}, follower.flips
    np.testing.assert_allclose(float(ref_loss), float(loss), rtol=1e-6)
    follower.forced, follower.calls = [(f + 1) % 4 for f in follower.forced], 0
    _, other = ref.train_step(ref.shard(params), *ref.place_batch(x, x))  # (traced: the hook)
    assert abs(float(other) - float(loss)) > 1e-5 * float(loss), (float(other), float(loss))
    assert "a different routing, not a tie" in follower.count(2)
    assert follower.flips == {2: 8 * 16}, follower.flips


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (None, None),  # the example as it is
        pytest.param(  # the rows put together in the wrong order: flips at the init
            "                row = row * self.mesh.shape[a] + int(where[a])",
            "                row = row * self.mesh.shape[a] + self.mesh.shape[a] - 1 - int(where[a])",
            marks=pytest.mark.skipif(not FULL, reason="mutant: SHARDOPS_FULL=1"),
        ),
        pytest.param(  # the reference routed by its own choices: the shifted ones change nothing
            "        return jax.pure_callback(self._next, jax.ShapeDtypeStruct(top_i.shape, "
            "top_i.dtype),",
            "        return top_i if True else jax.pure_callback(self._next, jax.ShapeDtypeStruct("
            "top_i.shape, top_i.dtype),",
            marks=pytest.mark.skipif(not FULL, reason="mutant: SHARDOPS_FULL=1"),
        ),
    ],
    ids=["example", "rows-reversed", "own-choices"],
)
def test_the_moe_reference_follows_the_sharded_runs_expert_choices(old, new):
    """``--moe --compare-reference``'s reference routes by the sharded run's choices
    (``check_the_reference_follows_the_sharded_choices``); under ``SHARDOPS_FULL=1`` each
    mutant of the follower fails that check."""
    if old is None:
        check_the_reference_follows_the_sharded_choices(load_example("transformer_lm"))
        return
    with pytest.raises(AssertionError):
        check_the_reference_follows_the_sharded_choices(load_example("transformer_lm", old, new))
