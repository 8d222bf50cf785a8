"""benchmarks/pipeline_memory.py --quick: the pipeline step compiled for GPipe, 1F1B and
circular (V = 2) on pipe = 2 at M = 4, 8, 16 (XLA's memory analysis, deterministic: nothing is
timed). The stage inputs each schedule keeps, the argument and output bytes against counts by
hand, and the claim of shardops/pipeline/_schedule.py: GPipe's temp grows by at least a stage
input per microbatch, 1F1B's and circular's stay bounded (``2P − 1`` stage inputs; ``2P`` a
chunk)."""

import importlib.util
import json
import pathlib

import pytest
from _mutants import mutant

ROOT = pathlib.Path(__file__).parent.parent
_spec = importlib.util.spec_from_file_location(
    "benchmark_pipeline_memory", ROOT / "benchmarks" / "pipeline_memory.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_memory")
    results = bench.main(["--quick", "--out", str(out)])
    assert json.loads(json.dumps(results)) == json.loads((out / "pipeline_memory.json").read_text())
    assert (out / "pipeline_memory.md").read_text() == bench.markdown(results)
    return results


def _temps(results, name: str) -> dict[int, int]:
    return {r["microbatches"]: r["temp"] for r in results["rows"] if r["schedule"] == name}


def test_quick_rows_and_the_bytes_by_hand(quick):
    sizes = bench.QUICK
    (p,) = sizes["stages"]
    b, s, d, f, layers = (sizes[k] for k in ("rows", "seq", "d_model", "d_ff", "layers"))
    act = b * s * d * 4  # one stage input h[b, S, D], f32
    params = (2 * layers // p * d * f + d * bench.HEAD) * 4  # a stage's w1, w2 and the head
    rows = {(r["schedule"], r["microbatches"]): r for r in quick["rows"]}
    assert set(rows) == {(n, m) for n in bench.SCHEDULES for m in sizes["microbatches"]}
    for (name, m), r in rows.items():
        slots = {"gpipe": m, "1f1b": min(m, 2 * p - 1), "circular": min(m, 2 * p)}[name]
        assert r["slots"] == slots, (name, m)
        assert r["act"] == act
        assert r["argument"] == params + m * act  # x[M, b, S, D] holds every microbatch
        # the gradients and the loss, and on XLA:CPU the output tuple's table of 4 pointers
        assert r["output"] in (params + 4, params + 4 + 4 * 8)
        assert r["peak"] == r["argument"] + r["output"] - r["alias"] + r["temp"] > 0


def check_claim(results, bounded=("1f1b", "circular")) -> None:
    """GPipe's temp grows by at least a stage input per microbatch from M = 2P to the largest M;
    each of ``bounded`` stays below it and grows by under a tenth of GPipe's growth."""
    (p,) = bench.QUICK["stages"]
    gpipe = _temps(results, "gpipe")
    small, large = 2 * p, max(bench.QUICK["microbatches"])
    act = results["rows"][0]["act"]
    gpipe_growth = gpipe[large] - gpipe[small]
    assert gpipe_growth >= (large - small) * act
    for name in bounded:
        temp = _temps(results, name)
        assert temp[large] < gpipe[large], name
        assert temp[large] - temp[small] <= 0.1 * gpipe_growth, name


def test_one_f_one_b_temp_stays_bounded_while_gpipe_grows(quick):
    check_claim(quick)


ACCUMULATION = """        self.grads = lax.cond(
            runs,
            lambda g, d: jax.tree.map(lambda a, b: a + b.astype(accum), g, widen(d)[0]),
            lambda g, d: g,
            self.grads, d_chunk,
        )  # fmt: skip"""
CUT = "            return lax.dynamic_slice_in_dim(q, v * n + _tie(g), n, 0)"


def test_accumulation_fused_across_phases_breaks_the_claim(tmp_path, monkeypatch):
    """Mutant: the gradients accumulated by ``g + where(runs, d, 0)`` (no fusion boundary):
    XLA:CPU fuses the adds of every backward phase into one fusion that keeps each phase's
    gradients alive to the end, and 1F1B's temp grows with M like GPipe's."""
    from shardops.pipeline import _executor

    fused = mutant(_executor, "fused_accumulation", ACCUMULATION,
                   "        self.grads = jax.tree.map(lambda g, d: g + jnp.where(runs, "
                   "d.astype(accum), 0), self.grads, widen(d_chunk)[0])")  # fmt: skip
    _check_claim_breaks(fused, "1f1b", tmp_path, monkeypatch)


def test_a_chunk_cut_at_an_index_known_in_advance_breaks_the_claim(tmp_path, monkeypatch):
    """Mutant: the executor cuts each virtual stage's chunk at ``v · n`` alone (``v`` read
    from the table): XLA:CPU computes every phase's cut at the program's start and keeps them
    all, a chunk's weights per phase, and circular's temp grows with M."""
    from shardops.pipeline import _executor

    untied = mutant(_executor, "untied_cut", CUT, CUT.replace(" + _tie(g)", ""))
    _check_claim_breaks(untied, "circular", tmp_path, monkeypatch)


def _check_claim_breaks(executor, schedule: str, tmp_path, monkeypatch) -> None:
    """The quick benchmark run with ``executor``'s ``pipeline_value_and_grad`` (GPipe and
    ``schedule`` only, the claim's two) fails ``check_claim`` for ``schedule``."""
    import shardops.pipeline

    monkeypatch.setattr(shardops.pipeline, "pipeline_value_and_grad",
                        executor.pipeline_value_and_grad)  # fmt: skip
    monkeypatch.setattr(bench, "SCHEDULES", ("gpipe", schedule))
    results = bench.main(["--quick", "--out", str(tmp_path)])
    with pytest.raises(AssertionError):
        check_claim(results, bounded=(schedule,))
