"""The examples, run as a user runs them: in a subprocess (a training loop that hung or aborted
would take the test process with it), on small data."""

import json
import pathlib
import re
import subprocess
import sys

import pytest
from _resume_checks import check_mlp_resume_report, load_example

ROOT = pathlib.Path(__file__).parent.parent


def run(script, *args, timeout=300):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize(("strategy", "mesh"), [("2d", "4x2"), ("fsdp_tp", "2x4"), ("fsdp", "8x1")])
def test_mlp_2d_matches_the_reference_on_small_data(tmp_path, strategy, mesh):
    metrics = tmp_path / "metrics.json"
    plot = tmp_path / "curves.png"
    # 1,024 images in batches of 32 for 2 epochs: 64 steps at the seed's LR 1.0.
    out = run(
        "mlp_2d.py", "--dataset", "sample", "--train-size", "1024", "--batch-size", "32",
        "--epochs", "2", "--strategy", strategy, "--mesh", mesh, "--compare-reference",
        "--metrics-json", str(metrics), "--plot", str(plot),
    )  # fmt: skip
    for line in (
        "Epoch 1 in ",
        "Training set loss ",
        "Training set accuracy ",
        "Test set accuracy ",
    ):
        assert line in out
    assert "  epoch 0: step 8/32, loss" in out  # plain progress lines when not on a terminal
    summary = json.loads(metrics.read_text())["summary"]
    assert summary["max_param_diff"] <= 1e-5, summary
    assert summary["max_accuracy_diff"] == 0.0 and summary["prediction_disagreement"] == 0.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def check_pmap_gives_the_same_numbers(out: str) -> None:
    """``mlp_data_parallel.py --with-pmap`` (run by test_doc_commands as the getting-started page
    shows it): jax.pmap's parameters and accuracy equal shard_map's."""
    diffs = [float(v) for v in re.findall(r"max \|Δparam\| vs shard_map (\S+)", out)]
    assert diffs and max(diffs) <= 1e-6, out
    shard_map = re.findall(r"test accuracy ([0-9.]+) \(shard_map dp\)", out)
    pmap = re.findall(r"jax\.pmap: test accuracy ([0-9.]+)", out)
    assert shard_map and pmap == shard_map, out  # every epoch's


def test_custom_gpt_under_sp_agrees_with_its_unsharded_twin():
    """``custom_model.py`` as the getting-started page shows it (tp) runs in test_doc_commands."""
    check_custom_gpt(run("custom_model.py", "--sequence-parallel"), sequence_parallel=True)


def check_custom_gpt(out: str, sequence_parallel: bool) -> None:
    """``custom_model.py``'s sharded GPT equals its unsharded twin, with Megatron's collectives."""
    forward = float(re.search(r"forward: +max \|sharded − unsharded\| logits = (\S+)", out)[1])
    grads = float(re.search(r"gradients: max \|sharded − unsharded\| = ([^;]+);", out)[1])
    padding = float(re.search(r"on the vocabulary padding: (\S+)", out)[1])
    params = float(re.search(r"SGD steps: .* max \|Δparam\| = (\S+)", out)[1])
    assert forward <= 1e-5 and grads <= 2e-6 and params <= 1e-6, out
    assert padding == 0.0, out  # the padded vocabulary rows/columns get exactly no gradient

    def line(where, kind, count, layer):
        return re.search(rf"{where} +{kind} +over 'model' +{count} × +[\d,]+ bytes +← {layer}$", out,
                         flags=re.M)  # fmt: skip

    # Megatron's counts for 2 blocks: one forward collective per attention block and per MLP.
    if not sequence_parallel:
        assert line("forward", "all-reduce", 1, "vocab_parallel_embedding"), out
        assert line("forward", "all-reduce", 2, "head_parallel_attention"), out
        assert line("forward", "all-reduce", 2, "row_parallel_dense"), out
        assert line("backward", "all-reduce", 2, "head_parallel_attention"), out
        assert line("backward", "all-reduce", 3, "column_parallel_dense"), out  # 2 MLPs + head
    else:
        assert line("forward", "reduce-scatter", 1, "vocab_parallel_embedding"), out
        assert line("forward", "all-gather", 2, "head_parallel_attention"), out
        assert line("forward", "reduce-scatter", 2, "head_parallel_attention"), out
        assert line("forward", "reduce-scatter", 2, "row_parallel_dense"), out
        assert line("backward", "reduce-scatter", 3, "column_parallel_dense"), out
        assert "gradients of the norms" in out, out
    # The loss never gathers the logits: max, then Σexp and the target logit, [B, S] each.
    assert line("forward", "all-reduce", 2, "vocab_parallel_cross_entropy"), out
    assert not re.search(r"all-gather .* ← vocab_parallel_cross_entropy", out), out


def check_mlp_2d_locate(out: str) -> None:
    """``mlp_2d.py --locate`` (the diagnostics page's command, run by test_doc_commands)."""
    assert "within bound" in out and "gradient at [0]" in out


def test_a_resumed_epoch_reports_only_the_steps_it_trained(straight_checkpoints, tmp_path):
    straight = straight_checkpoints("mlp_2d")
    check_mlp_resume_report(load_example("mlp_2d"), straight, tmp_path)
