"""benchmarks/moe_dropless.py: the ``--quick`` run end to end on CPU (every program compiled,
timed in one rotation, its figures consistent), the committed figures are a TPU's, and
docs/moe.md's table is the one the committed JSON makes."""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent
_spec = importlib.util.spec_from_file_location(
    "benchmark_moe_dropless", ROOT / "benchmarks" / "moe_dropless.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_docs_table_is_the_committed_tpu_run():
    committed = json.loads((bench.RESULTS / "moe_dropless.json").read_text())
    block = (ROOT / "docs" / "moe.md").read_text().split(bench.START, 1)[1].split(bench.END, 1)[0]
    assert block == "\n" + bench.markdown(committed) + "\n", (
        "docs/moe.md's dropless table differs from the committed JSON: run "
        "`python benchmarks/moe_dropless.py --tables-only`"
    )
    assert committed["device"].startswith("tpu") and not committed["quick"]
    assert committed["shape"] == bench.SHAPE
    assert [r["label"] for r in committed["rows"]] == list(bench.PROGRAMS)
    assert not [r for r in committed["rows"] if "error" in r]


def test_quick_run(tmp_path):
    """Tiny shapes on CPU (megablox's row says it needs a TPU): nothing dropped but at
    capacity 1.25, C as ``moe_capacity`` says, dropless's y the capacity path's at E / k within
    a few bfloat16 roundings (2⁻⁶ of its scale), paired ratios ordered, memory positive."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "moe_dropless.py"), "--quick", "--out",
         str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "moe_dropless.json").read_text())
    sh = results["shape"]
    assert sh == bench.QUICK_SHAPE and results["tokens"] == sh["groups"] * sh["seq"]
    rows = {r["label"]: r for r in results["rows"]}
    assert list(rows) == list(bench.PROGRAMS)
    assert "TPU" in rows["dropless megablox"]["error"]
    s, k, e = sh["seq"], sh["k"], sh["experts"]
    assert rows["capacity 1.25"]["capacity"] == math.ceil(1.25 * s * k / e)
    assert rows["capacity E/k"]["capacity"] == s
    assert rows["dropless ragged_dot"]["capacity"] is None
    for label in ("dropless ragged_dot", "capacity E/k"):
        assert rows[label]["dropped"] == 0
    assert rows["dropless ragged_dot"]["y_vs_capacity_ek"] <= 2.0**-6
    for label in ("dropless ragged_dot", "capacity 1.25", "capacity E/k"):
        r = rows[label]
        assert r["step_ms"] > 0 and r["peak_bytes"] >= r["temp_bytes"] > 0
        for v in r["vs"].values():
            assert v["q25"] <= v["median"] <= v["q75"]
    assert set(rows["dropless ragged_dot"]["vs"]) == set(bench.BASELINES)
    assert "| dropless ragged_dot | — | 0 |" in (tmp_path / "moe_dropless.md").read_text()
