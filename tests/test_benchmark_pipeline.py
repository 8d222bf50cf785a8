"""benchmarks/pipeline.py: the ``--quick`` run end to end (a pipeline row and the ``2d`` row it
is divided by, each with its GSPMD twin, timed in one rotation), its figures against ones worked
out by hand, and docs/pipeline.md's table is the one the committed JSON makes."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parent.parent
_spec = importlib.util.spec_from_file_location(
    "benchmark_pipeline", ROOT / "benchmarks" / "pipeline.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_docs_table_is_the_committed_run():
    committed = json.loads((bench.RESULTS / "pipeline.json").read_text())
    block = (
        (ROOT / "docs" / "pipeline.md").read_text().split(bench.START, 1)[1].split(bench.END, 1)[0]
    )
    assert block == "\n" + bench.markdown(committed) + "\n", (
        "docs/pipeline.md's benchmark table differs from the committed JSON: run "
        "`python benchmarks/pipeline.py --tables-only`"
    )
    assert not committed["quick"]
    assert [r["label"] for r in committed["rows"]] == [row[0] for row in bench.ROWS]
    # The four 2d+pp rows share one GSPMD program; pipe = 8 and data × model have their own.
    assert len(committed["programs"]) == len(bench.ROWS) + 3


def test_quick_run(tmp_path):
    """Tiny Llama: the bubble is (P − 1)/(M + P − 1); the pipeline's collective-permutes over
    pipe carry a microbatch ``[B/(data·M), S, D]`` in float32 in each of the M + P − 2 phases
    that some stage sends in, each way (for P = 2: the device's whole batch once each way);
    its AllReduce over pipe is the replicated parameters' gradients (the embedding and the head,
    each split over model, and the final norm) and the loss; ``2d`` has no pipe axis; the ratios are paired
    and the memory adds up."""
    results = bench.main(["--quick", "--out", str(tmp_path)])
    assert results == json.loads((tmp_path / "pipeline.json").read_text())
    model = bench.model_of(quick=True)
    rows = {r["label"]: r for r in results["rows"]}
    assert list(rows) == [row[0] for row in bench.QUICK_ROWS]
    (label, strategy, shape, m), _ = bench.QUICK_ROWS
    pp, base = rows[label], rows[bench.BASELINE]
    p = shape["pipe"]
    assert pp["stages"] == p and pp["microbatches"] == m
    assert pp["bubble"] == pytest.approx((p - 1) / (m + p - 1))
    assert pp["idle_fraction"] == pytest.approx(pp["bubble"])
    assert pp["loss_model_vs_2d"] == pytest.approx(4 / 3 * (m + p - 1) / m)

    d, v, f32 = model.d_model, model.vocab_size, 4
    microbatch = results["batch"] // shape["data"] // m * model.context * d * f32  # [b, S, D]
    sends = 2 * (m + p - 2)  # the phases in which some stage sends, forward and backward
    assert pp["kinds_shardops"]["collective-permute pipe"] == sends * microbatch
    # the gradients of the embedding and the head (each split over model) and of the final
    # norm, and the last stage's loss
    replicated = (2 * v * d // shape["model"] + d + 1) * f32
    assert pp["kinds_shardops"]["all-reduce pipe"] == pytest.approx(replicated * 2 * (p - 1) / p)
    assert pp["ring_bytes_shardops"]["pipe"] == pytest.approx(sends * microbatch + replicated)
    assert "pipe" not in base["ring_bytes_shardops"] and "pipe" not in base["ring_bytes_gspmd"]

    assert results["programs"] == [label, f"gspmd {pp['mesh']}", bench.BASELINE,
                                   f"gspmd {base['mesh']}"]  # fmt: skip
    assert base["vs_2d"] is None
    for r in rows.values():
        ratios = [r["vs_gspmd"], r["gspmd_vs_gspmd_2d"]] + ([r["vs_2d"]] if r["vs_2d"] else [])
        for ratio in ratios:
            assert 0 < ratio["q25"] <= ratio["median"] <= ratio["q75"]
        for program in ("shardops", "gspmd"):
            mem = r[f"memory_{program}"]
            assert mem["peak"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] > 0
    assert base["gspmd_vs_gspmd_2d"]["median"] == 1.0
    text = (tmp_path / "pipeline.md").read_text()
    assert f"| {strategy} | {pp['mesh']} | {m} | {pp['bubble']:.3f} |" in text
    assert f"| 2d | {base['mesh']} | — | 0 |" in text
