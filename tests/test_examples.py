"""The examples, run as a user runs them: in a subprocess (a training loop that hung or aborted
would take the test process with it), on small data."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

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


def test_mlp_data_parallel_pmap_gives_the_same_numbers():
    out = run(
        "mlp_data_parallel.py",
        "--with-pmap",
        "--dataset",
        "sample",
        "--train-size",
        "1024",
        "--epochs",
        "1",
    )
    diffs = [float(v) for v in re.findall(r"max \|Δparam\| vs shard_map (\S+)", out)]
    assert diffs and max(diffs) <= 1e-6, out
    accs = re.findall(r"test accuracy ([0-9.]+)", out)
    assert len(accs) == 2 and accs[0] == accs[1], out


def test_custom_model_agrees_with_its_unsharded_version():
    out = run("custom_model.py")
    forward = float(re.search(r"forward: +max \|sharded − unsharded\| = (\S+)", out)[1])
    grads = float(re.search(r"gradients: max \|sharded − unsharded\| = (\S+)", out)[1])
    params = float(re.search(r"SGD steps: .* max \|Δparam\| = (\S+)", out)[1])
    assert forward <= 1e-5 and grads <= 1e-6 and params <= 1e-6, out
    # One psum per block forward and one dx all-reduce per block backward, over model.
    assert out.count("forward: all-reduce over 'model'") == 2
    assert out.count("backward: all-reduce over 'model'") == 2
