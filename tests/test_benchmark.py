"""benchmarks/strategies.py: docs/benchmarks.md's tables are generated from the stored JSON, the meshes the
GPU path maps each case onto, and a quick end-to-end run with its variant rows and columns; the
other benchmarks' quick runs; benchmarks/accelerator.py's plain-JAX Llama and TPU kernels."""

import contextlib
import functools
import importlib.util
import json
import pathlib
import subprocess
import sys

import _cover
import jax
import jax.numpy as jnp
import optax
import pytest
from _mutants import mutant

import shardops
import shardops_models as models

ROOT = pathlib.Path(__file__).parent.parent
_spec = importlib.util.spec_from_file_location(
    "benchmark_strategies", ROOT / "benchmarks" / "strategies.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

FULL = bench.benches(quick=False, steps=None)
VARIANT_COLUMNS = ("÷ plain (IQR)", "state ÷ dp", "peak MB/device: shardops", "temp saved MB")


def test_readme_tables_are_the_json_s_markdown():
    """A hand-edited table fails: regenerate with `python benchmarks/strategies.py --tables-only`."""
    results = json.loads((bench.RESULTS / "strategies.json").read_text())
    readme = (ROOT / "docs" / "benchmarks.md").read_text()
    assert bench.tables_block(readme) == bench.markdown(results).strip("\n")


def test_write_readme_replaces_only_the_block(tmp_path):
    results = json.loads((bench.RESULTS / "strategies.json").read_text())
    readme = tmp_path / "benchmarks.md"
    before, after = "# Title\n\nprose\n", "\nmore prose\n"
    readme.write_text(f"{before}{bench.TABLES_START}\n| old | table |\n{bench.TABLES_END}{after}")
    bench.write_tables(results, readme)
    text = readme.read_text()
    assert text.startswith(before + bench.TABLES_START + "\n")
    assert text.endswith(bench.TABLES_END + after)
    assert bench.tables_block(text) == bench.markdown(results).strip("\n")
    assert "| old | table |" not in text


def test_readme_without_markers_is_an_error():
    with pytest.raises(
        ValueError, match="docs/benchmarks.md needs the markers <!-- benchmark-tables:start"
    ):
        bench.tables_block("## Benchmark\n\n| a | b |\n")
    with pytest.raises(ValueError, match="in that order"):
        bench.tables_block(f"{bench.TABLES_END}\n{bench.TABLES_START}\n")


def test_markdown_of_old_results_leaves_new_columns_empty():
    """Results from before the variant rows (no label, options or memory) still render."""
    results = json.loads((bench.RESULTS / "strategies.json").read_text())
    for block in results["models"].values():
        for row in block["rows"]:
            for key in ("label", "options", "memory_shardops", "memory_gspmd", "vs_plain"):
                row.pop(key, None)
    text = bench.markdown(results)
    for column in VARIANT_COLUMNS:
        assert column in text


@pytest.mark.parametrize("n_devices", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("name", list(FULL))
def test_mesh_for_fits_every_case_on_the_devices(name, n_devices):
    b = FULL[name]
    limit = bench.model_axis_limit(b.model)
    for case in b.cases:
        if isinstance(case.mesh, dict):  # named axes run as written (cases_on)
            continue
        data, model = bench.mesh_for(case.mesh, n_devices, batch=b.batch, model_limit=limit)
        assert data * model <= n_devices
        assert b.batch % data == 0 and limit % model == 0
        if n_devices == 1:
            assert (data, model) == (1, 1)
        if n_devices == 8:  # the CPU tables' meshes
            assert (data, model) == case.mesh
        if case.mesh[1] == 1:  # data-only stays data-only, on every device it can split over
            assert model == 1 and data == bench.largest_divisor(b.batch, n_devices)
        elif case.mesh[0] == 1:  # model-only: 1×D, within the model's limit
            assert data == 1 and model == bench.largest_divisor(limit, n_devices)
        elif n_devices >= 4:  # 2-axis cases keep both axes
            assert data >= 2 and model >= 2


@pytest.mark.parametrize(
    ("n_devices", "meshes"),
    [
        (1, {"dp": (1, 1), "tp": (1, 1), "2d": (1, 1), "fsdp": (1, 1), "fsdp_tp": (1, 1)}),
        (2, {"dp": (2, 1), "tp": (1, 2), "2d": (1, 2), "fsdp": (2, 1), "fsdp_tp": (1, 2)}),
        (4, {"dp": (4, 1), "tp": (1, 4), "2d": (2, 2), "fsdp": (4, 1), "fsdp_tp": (2, 2)}),
    ],
)
def test_cases_on_fewer_devices_drop_duplicate_meshes(n_devices, meshes):
    """The MLP's 2d 4×2 and 2×4 both map onto one mesh below 8 devices: the second is skipped,
    with the reason, and the first keeps its variants."""
    cases, skipped = bench.cases_on(FULL["seed"], n_devices)
    assert {c.strategy: c.mesh for c in cases} == meshes
    assert [c.strategy for c in cases].count("2d") == 1
    assert next(c for c in cases if c.strategy == "2d").variants  # 4x2's ring rows
    m = meshes["2d"]
    assert skipped == [
        f"2d 2x4 → {m[0]}x{m[1]}: the same mesh as 2d 4x2 → {m[0]}x{m[1]}",
        "hsdp replica=2,data=4: needs 8 devices",  # named axes run as written, or not at all
        "hsdp_tp replica=2,data=2,model=2: needs 8 devices",
    ]


def test_cases_on_8_devices_are_the_cpu_cases():
    for b in FULL.values():
        assert bench.cases_on(b, 8) == (list(b.cases), [])


def test_mesh_for_needs_a_device():
    with pytest.raises(ValueError, match="n_devices must be at least 1; got 0"):
        bench.mesh_for((8, 1), 0, batch=16, model_limit=4)


def test_gpu_platform_without_a_gpu_is_an_error():
    with pytest.raises(RuntimeError, match="--platform gpu found no GPU"):
        bench.start_platform("gpu")


def test_quick_mode_runs_end_to_end(tmp_path):
    """CI's run of every table: the variant rows, memory columns and paired ratios exist, the
    compiled bytes equal the analytic model's, and the committed results are left alone."""
    committed = [
        (p, p.read_bytes())
        for p in (ROOT / "docs" / "benchmarks.md", bench.RESULTS / "strategies.json")
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "strategies.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(p.read_bytes() == content for p, content in committed)
    results = json.loads((tmp_path / "strategies.json").read_text())
    assert results["platform"] == "cpu" and results["devices"] == 8
    labels = {
        name: [r["label"] for r in block["rows"]] for name, block in results["models"].items()
    }
    assert labels == {
        "seed": ["dp", "tp", "tp ring", "tp bidirectional", "2d", "2d ring", "2d bidirectional",
                 "2d", "fsdp", "fsdp gather_weights", "fsdp remat", "fsdp_tp", "fsdp_tp ring",
                 "fsdp_tp bidirectional", "fsdp_tp gather_weights", "hsdp", "hsdp_tp"],
        "wide": ["dp", "tp", "2d", "2d", "fsdp", "fsdp_tp", "hsdp", "hsdp_tp"],
        "gpt": ["tp", "tp ring", "fsdp_sp", "fsdp_sp remat"],
        "llama": ["fsdp_tp"],
    }  # fmt: skip
    for block in results["models"].values():
        for row in block["rows"]:
            assert row["ring_bytes_shardops"] == pytest.approx(row["ring_bytes_model"])
            assert row["step_ms"]["shardops"] > 0 and row["state_bytes_per_device"] > 0
            assert (
                row["state_vs_dp"]
                == row["state_bytes_per_device"] / row["single_device_state_bytes"]
            )
            for program in ("shardops", "gspmd"):
                m = row[f"memory_{program}"]
                assert m["peak"] == m["argument"] + m["output"] - m["alias"] + m["temp"] > 0
            for key in ("vs_gspmd", "vs_single", "gspmd_vs_single"):
                assert row[key]["q25"] <= row[key]["median"] <= row[key]["q75"]
            variant = row["label"] != row["strategy"]
            assert ("vs_plain" in row) == variant == ("temp_saved_vs_plain_bytes" in row)
            assert bool(row["options"]) == variant
    seed = {r["label"]: r for r in results["models"]["seed"]["rows"]}
    assert seed["fsdp"]["state_vs_dp"] == pytest.approx(1 / 8, rel=0.01)
    assert "vs_pmap" in seed["dp"]
    table = (tmp_path / "strategies.md").read_text()
    assert all(column in table for column in VARIANT_COLUMNS)
    assert "| tp ring | 1x8 |" in table and "**Per-layer FSDP choice**" in table


def test_profile_prints_both_programs_side_by_side():
    """The profile behind the README's account: the seed MLP's fsdp step, compiled only. Layer
    0 moves activations (an all-to-all and the output's reduce-scatter) in shardops' program;
    GSPMD's is listed next to it."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_collectives.py"), "fsdp", "8x1",
         "--model", "seed"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shardops_part, gspmd_part = proc.stdout.split("== GSPMD")
    assert "== shardops: temp" in shardops_part and "collectives" in gspmd_part
    # x[32, 784] → x[256, 98]: eight [32, 98] blocks exchanged
    assert "all-to-all         data" in shardops_part and "f32[32, 98]" in shardops_part
    assert "reduce-scatter     data            0.524 MB  f32[32, 512]" in shardops_part


def quick_run(name: str, out) -> dict:
    """``python benchmarks/NAME.py --quick --out OUT`` (it must succeed); the JSON it wrote."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / f"{name}.json").read_text())


def test_context_parallel_quick_run_and_the_docs_tables(tmp_path):
    """benchmarks/context_parallel.py end to end (tiny sizes): every method and GSPMD on context
    1 and 2, memory from XLA's analysis, paired ratios; and docs/context-parallelism.md's tables
    are the ones the committed JSON makes."""
    spec = importlib.util.spec_from_file_location(
        "benchmark_context_parallel", ROOT / "benchmarks" / "context_parallel.py"
    )
    cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cp)
    page = (ROOT / "docs" / "context-parallelism.md").read_text()
    committed = json.loads((cp.RESULTS / "context_parallel.json").read_text())
    block = page.split(cp.START, 1)[1].split(cp.END, 1)[0]
    assert block == "\n" + cp.markdown(committed), (
        "docs/context-parallelism.md's tables differ from the committed JSON: run "
        "`python benchmarks/context_parallel.py --tables-only`"
    )
    results = quick_run("context_parallel", tmp_path)
    labels = {(r["label"], r["n"]) for r in results["fixed_s"]}
    assert labels == {(m, n) for m in ("allgather", "ring", "ulysses", "gspmd") for n in (1, 2)}
    for r in results["fixed_s"]:
        m = r["step"]
        assert m["peak"] == m["argument"] + m["output"] - m["alias"] + m["temp"] > 0
        assert (r["attention_temp"] is None) == (r["label"] == "gspmd")
    assert {r["label"] for r in results["longest_s"]} == {"single", "allgather", "ring",
                                                          "ulysses", "gspmd"}  # fmt: skip
    for ratio in results["timing"]["vs_ring"].values():
        assert ratio["q25"] <= ratio["median"] <= ratio["q75"]


def test_foreign_models_quick_run_beside_gspmd(tmp_path):
    """benchmarks/foreign_models.py end to end (tiny sizes): the Flax Llama and the Equinox GPT
    under shardops and under GSPMD from the same rules and the same start train to the same
    loss; shardops' traced ledger is the bytes its compiled step moves; the committed results
    are the full run's and docs/benchmarks.md shows their table."""
    results = quick_run("foreign_models", tmp_path)
    assert [(r["framework"], r["strategy"]) for r in results["rows"]] == [
        ("flax", "2d"), ("equinox", "2d"), ("equinox", "fsdp_tp")]  # fmt: skip
    for r in results["rows"]:
        assert r["loss"]["shardops"] == pytest.approx(r["loss"]["gspmd"], abs=1e-5), r
        assert r["ledger_bytes"] == sum(r["bytes"]["shardops"].values()), r
        assert r["ratio"]["q25"] <= r["ratio"]["median"] <= r["ratio"]["q75"]
    spec = importlib.util.spec_from_file_location("foreign_models",
                                                  ROOT / "benchmarks" / "foreign_models.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = json.loads((module.RESULTS / "foreign_models.json").read_text())
    assert committed["config"] == module.FULL
    assert module.table(committed) in (ROOT / "docs" / "benchmarks.md").read_text()


@pytest.mark.skipif(not _cover.FULL, reason="CI time: SHARDOPS_FULL=1 (the asynchronous "
                    "save itself is tests/training/test_checkpoint_async.py's)")  # fmt: skip
def test_checkpoint_async_quick_run(tmp_path):
    """benchmarks/checkpoint_async.py end to end (a tiny MLP): the paired step times of no
    save, a synchronous and an asynchronous one, and a peak-memory process for each mode and
    layout."""
    results = quick_run("checkpoint_async", tmp_path)
    steps = results["timing"]["ms"]["save_step"]
    assert set(steps) == {"none", "sync", "async"}
    for figure in steps.values():
        assert 0 < figure["q25"] <= figure["median"] <= figure["q75"]
    rows = {(r["strategy"], r["mode"]) for r in results["memory"]}
    assert rows == {(s, m) for s in ("2d", "fsdp") for m in ("none", "sync", "async")}
    for r in results["memory"]:
        assert r["rounds_peak_rss"] >= r["rounds_start_rss"] > 0
    assert (tmp_path / "checkpoint_async.md").read_text().startswith("MLP 64-256-64")


def test_each_table_is_written_as_it_finishes(tmp_path, monkeypatch):
    """A crash in the second table (the process once died after its last row, before any file
    was written) leaves the first one on disk, marked unfinished; the committed results are
    untouched by a run of some tables (``--only``)."""
    stored_path = bench.RESULTS / "strategies.json"
    stored, committed = json.loads(stored_path.read_text()), stored_path.read_bytes()
    tables = []

    def run_table(name, *args, **kwargs):
        tables.append(name)
        if len(tables) == 2:
            raise RuntimeError("the second table crashed")
        return stored["models"][name]  # real rows, as the benchmark wrote them

    monkeypatch.setattr(bench, "run_table", run_table)
    with pytest.raises(RuntimeError, match="the second table crashed"):
        bench.main(["--only", "seed", "gpt", "--out", str(tmp_path)])
    assert tables == ["seed", "gpt"]
    saved = json.loads((tmp_path / "strategies.json").read_text())
    assert saved["finished"] is False and list(saved["models"]) == ["seed"]
    assert saved["models"]["seed"] == stored["models"]["seed"]
    assert (tmp_path / "strategies.md").read_text() == bench.markdown(saved) + "\n"
    assert not list(tmp_path.glob(".*partial"))

    tables.clear()
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "default")  # where a full run would write
    monkeypatch.setattr(bench.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "picked"))
    results = bench.main(["--only", "seed"])
    assert results["finished"] is True and tables == ["seed"]
    assert json.loads((tmp_path / "picked" / "strategies.json").read_text()) == results
    assert not (tmp_path / "default").exists()
    assert stored_path.read_bytes() == committed


def test_remat_table_is_the_json_s_markdown():
    """docs/strategies.md's activation-checkpointing table is benchmarks/remat.py's JSON, and
    its figures say what the page says: every policy below "none", "full" ≤ "matmuls" (a
    hand-edited table fails: regenerate with `python benchmarks/remat.py --tables-only`)."""
    spec = importlib.util.spec_from_file_location(
        "benchmark_remat", ROOT / "benchmarks" / "remat.py"
    )
    remat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(remat)
    results = json.loads((remat.RESULTS / "remat.json").read_text())
    assert remat.tables_block(remat.DOCS.read_text()) == remat.markdown(results).strip("\n")
    temp = {
        (r["model"], r["strategy"], json.dumps(r["policy"])): r["temp"] for r in results["rows"]
    }
    for (model, strategy, policy), t in temp.items():
        none = temp[(model, strategy, '"none"')]
        assert policy == '"none"' or t < none, (model, strategy, policy)
        assert temp[(model, strategy, '"full"')] <= temp[(model, strategy, '"matmuls"')] <= none


# --- benchmarks/accelerator.py: shardops on one accelerator against plain-JAX Llama programs

_acc_spec = importlib.util.spec_from_file_location(
    "benchmark_accelerator", ROOT / "benchmarks" / "accelerator.py"
)
acc = importlib.util.module_from_spec(_acc_spec)
_acc_spec.loader.exec_module(acc)


def test_accelerator_quick_run_has_the_columns_and_the_losses_agree(tmp_path):
    """benchmarks/accelerator.py --quick (a tiny Llama on CPU): every program gets a row per
    shape with the table's columns, MFU = the model's FLOPs / step time / the measured peak,
    and the 10-step losses of shardops (ref, fsdp_tp on 1×1) agree with the plain program's."""
    results = quick_run("accelerator", tmp_path)
    programs = [r["program"] for r in results["rows"]]
    # "shardops ref auto" once build takes attention= (the default value is named)
    assert [p.removesuffix(" auto") for p in programs[:3]] == ["plain einsum", "shardops ref",
                                                               "shardops fsdp_tp"]  # fmt: skip
    shapes = {(r["batch"], r["seq"], bool(r["remat"])) for r in results["rows"]}
    assert shapes == set(acc.QUICK_SHAPES)
    assert {r["remat"] for r in results["rows"]} == {None, "full"}
    model = acc.model_of(acc.QUICK_MODEL)
    peak = results["peaks"]["measured"]
    for r in results["rows"]:
        assert r["flops_per_step"] == model.train_flops_per_token(r["seq"]) * r["batch"] * r["seq"]
        if r["status"] != "fits":
            assert r["status"].startswith("n/a: ") and r["remat"], r  # only the old build's remat
            continue
        assert r["memory"]["temp"] > 0 and r["steps"] == 3
        assert r["state_on_host"]  # quick runs the states' host round trip between steps
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / r["step_ms"] * 1e3)
        assert r["mfu_measured"] == pytest.approx(r["flops_per_step"] / (r["step_ms"] / 1e3) / peak)
        assert r["mfu_spec"] is None  # a CPU has no specification peak
    table = (tmp_path / "accelerator.md").read_text()
    assert "| " + " | ".join(acc.COLUMNS) + " |" in table
    check = results["loss_check"]
    assert check["anchor"] == "plain einsum" and len(check["losses"]) == 3
    assert all(len(v) == acc.LOSS_STEPS for v in check["losses"].values())
    assert check["agree"] and all(d <= acc.LOSS_RTOL for d in check["max_relative_diff"].values())
    assert all(r["batch"] == 1 for r in results["largest"] if r["batch"] is not None)


def _logits_error(module, model, params, ids, reference):
    logits = jax.jit(lambda p, i: module.plain_logits(model, p, i))(params, ids)
    return float(jnp.max(jnp.abs(logits - reference)) / jnp.max(jnp.abs(reference)))


@pytest.fixture(scope="module")
def llama_logits():
    """A tiny Llama at a large init (so attention and RoPE shape the logits), its float32
    reference logits, and how far shardops' own MIXED_BFLOAT16 logits are from them."""
    model = models.Llama(**acc.QUICK_MODEL, context=64, init_scale=0.1)
    params = model.init(jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (2, 64), 0, model.vocab_size)
    reference = model.reference_logits(params, ids)
    setup = models.build("ref", model=model, optimizer=optax.adam(1e-3),
                         precision=shardops.MIXED_BFLOAT16)  # fmt: skip
    shardops_logits = setup.logits(params, ids).astype(jnp.float32)
    shardops_error = float(jnp.max(jnp.abs(shardops_logits - reference))
                           / jnp.max(jnp.abs(reference)))  # fmt: skip
    return model, params, ids, reference, shardops_error


# The plain-JAX Llama is benchmarks/_plain_llama.py, the module beside the benchmark that acc
# imports: its mutants replace lines there.
plain_llama = sys.modules[acc.plain_logits.__module__]
_PLAIN_MUTANTS = {
    "strided_groups": ("    q = q.reshape(b, s, n, h // n, hd)  # (B, S, n, G, hd)",
                       "    q = q.reshape(b, s, h // n, n, hd).swapaxes(2, 3)"),
    "interleaved_rope": (
        "    rotated = jnp.concatenate([-t[..., hd // 2 :], t[..., : hd // 2]], -1)",
        "    rotated = jnp.stack([-t[..., 1::2], t[..., ::2]], -1).reshape(t.shape)"),
    "not_causal": (
        "    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)  # (B, n, G, S, S)",
        "    weights = jax.nn.softmax(scores, axis=-1)"),
    "no_rope_on_keys": (
        "        k = _rope(_dot(y, a[\"wk\"]).reshape(b, s, n, hd), model.rope_theta)  # (B, S, n, hd)",
        "        k = _dot(y, a[\"wk\"]).reshape(b, s, n, hd)"),
}  # fmt: skip


@pytest.mark.parametrize("name", [None, *_PLAIN_MUTANTS])
def test_plain_llama_is_the_reference_model(llama_logits, name):
    """The benchmark's plain-JAX Llama computes ``Llama.reference_logits`` (float32, Hugging
    Face's conventions): under bf16 it is no further from them than shardops' own
    MIXED_BFLOAT16 logits are (at most twice as far), and a grouping, RoPE or mask bug is
    far outside that."""
    model, params, ids, reference, shardops_error = llama_logits
    module = acc if name is None else mutant(plain_llama, name, *_PLAIN_MUTANTS[name])
    error = _logits_error(module, model, params, ids, reference)
    if name is None:
        assert error <= 2 * shardops_error, (error, shardops_error)
    else:
        assert error > 4 * shardops_error, (name, error, shardops_error)


@pytest.mark.parametrize("kernel", ["flash", "splash"])
def test_tpu_attention_kernels_are_einsum_attention(kernel):
    """The plain programs' Pallas TPU kernels (run here in Pallas' TPU interpret mode) are
    wired as einsum attention is, forward and backward: GQA groups, the scale, the causal
    mask, the layouts."""
    from jax.experimental.pallas import tpu as pltpu

    keys = jax.random.split(jax.random.key(0), 3)
    b, s, h, n, hd = 1, 128, 4, 2, 128
    q = jax.random.normal(keys[0], (b, s, h, hd)).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, n, hd)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, n, hd)).astype(jnp.bfloat16)
    expected = acc.einsum_attention(q, k, v).astype(jnp.float32)
    if kernel == "splash":  # its own interpret flag (the forced mode fails on its grid)
        attend = functools.partial(acc.splash_attention, interpret=True)
    else:
        attend = acc.flash_attention
    interpret = pltpu.force_tpu_interpret_mode() if kernel == "flash" else contextlib.nullcontext()

    def loss(attend, q):  # the gradients flow through the kernels' own backward passes
        return jnp.sum(jnp.square(attend(q, k, v).astype(jnp.float32)))

    with interpret:
        got = attend(q, k, v).astype(jnp.float32)
        got_grad = jax.grad(functools.partial(loss, attend))(q).astype(jnp.float32)
    grad = jax.grad(functools.partial(loss, acc.einsum_attention))(q).astype(jnp.float32)
    # bf16 gradients of a sum over S·H·hd squares: 2⁻⁵ of the largest (about 1% here)
    assert float(jnp.max(jnp.abs(got_grad - grad))) <= 2.0**-5 * float(jnp.max(jnp.abs(grad)))
    # Both round o to bf16 once (2⁻⁸ relative) after float32 accumulation; |o| ≤ max |v|.
    bound = 2 * 2.0**-8 * float(jnp.max(jnp.abs(v.astype(jnp.float32))))
    assert float(jnp.max(jnp.abs(got - expected))) <= bound
    # the same check catches a kernel fed KV heads in the wrong order
    swapped = acc.einsum_attention(q, k[:, :, ::-1], v[:, :, ::-1]).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(got - swapped))) > 10 * bound


def test_largest_fitting_stops_at_the_first_shape_that_does_not_fit(monkeypatch):
    """The search doubles the batch, then the sequence at batch 1, until a program does not
    fit, and says why it stopped; a program the build cannot make is n/a, not searched."""
    fits = {(1, 64): "fits", (2, 64): "fits", (4, 64): "OOM (predicted)", (1, 128): "fits",
            (1, 256): "OOM"}  # fmt: skip

    def compile_program(program, model, batch, seq, remat, limit):
        if program.label == "made" and remat:
            return None, None, None, "n/a: no remat here"
        return None, None, None, fits[(batch, seq)]

    monkeypatch.setattr(acc, "compile_program", compile_program)
    program = acc.Program("made", None)
    found = acc.largest_fitting([program], None, 1, seq=64, max_batch=8, max_seq=512)
    assert found[0] == {"program": "made", "remat": None, "seq": 64, "batch": 2,
                        "batch_stopped": "OOM (predicted)", "seq_at_batch_1": 128,
                        "seq_at_batch_1_stopped": "OOM"}  # fmt: skip
    assert found[1]["batch"] is None and found[1]["batch_stopped"] == "n/a: no remat here"
    # from a shape that does not fit (the timed rows' 8 × 1024 on a smaller chip) it halves
    down = acc.largest_fitting([program], None, 1, seq=64, max_batch=8, max_seq=512,
                               starts={None: (4, 64)})[0]  # fmt: skip
    assert (down["batch"], down["batch_stopped"]) == (2, "OOM (predicted)")
    assert acc._largest(lambda n: "OOM", 8, 64) == (None, "OOM")  # nothing fits


def test_residuals_quick_run_lists_what_each_program_keeps(tmp_path):
    """``benchmarks/residuals.py --quick``: every program's residuals listed by source, and the
    blocked attention keeps less than the einsum (it holds no S×S array)."""
    spec = importlib.util.spec_from_file_location(
        "benchmark_residuals", ROOT / "benchmarks" / "residuals.py"
    )
    residuals = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(residuals)
    results = residuals.main(["--quick", "--out", str(tmp_path)])
    assert set(results) == {"plain einsum", "shardops ref einsum", "shardops ref blocked"}
    for r in results.values():
        assert r["total"] == sum(n for n, *_ in r["by_source"]) > 0
    seq = 192  # the quick shape: no other dim of the model is 192
    squares = [a for _, _, a, _ in results["shardops ref einsum"]["by_source"]
               if f"{seq},{seq}]" in a]  # fmt: skip
    assert squares, "the einsum keeps its S×S probabilities"
    assert not [a for _, _, a, _ in results["shardops ref blocked"]["by_source"]
                if f"{seq},{seq}]" in a]  # fmt: skip
    blocked, einsum = (results[f"shardops ref {a}"]["total"] for a in ("blocked", "einsum"))
    assert blocked < einsum
    assert json.loads((tmp_path / "residuals_quick.json").read_text())["totals"]


def test_moe_quick_run_and_the_docs_table(tmp_path):
    """benchmarks/moe.py --quick (a 2-layer Mixtral-style Llama): each row's AllToAll bytes per
    device are the dispatch and return of every layer, forward and backward, by the ring formula
    (``4 · L · E · C · G · D · 4 bytes · (N − 1)/N``; none for ``2d``, which holds every
    expert), the ratios are paired, the routing figures (every layer's) add up; and docs/moe.md's table is the
    one the committed JSON makes."""
    import math

    spec = importlib.util.spec_from_file_location("benchmark_moe", ROOT / "benchmarks" / "moe.py")
    moe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe)
    committed = json.loads((moe.RESULTS / "moe.json").read_text())
    block = (ROOT / "docs" / "moe.md").read_text().split(moe.START, 1)[1].split(moe.END, 1)[0]
    assert block == "\n" + moe.markdown(committed) + "\n", (
        "docs/moe.md's benchmark table differs from the committed JSON: run "
        "`python benchmarks/moe.py --tables-only`"
    )
    results = quick_run("moe", tmp_path)
    model, rt = moe.model_of(quick=True), results["routing"]
    e = model.experts
    assert rt["capacity"] == math.ceil(e.capacity_factor * model.context * e.k / e.num_experts)
    assert rt["choices"] == results["batch"] * model.context * e.k * model.num_layers
    assert len(rt["drop_rate_per_layer"]) == model.num_layers
    assert rt["drop_rate"] == pytest.approx(rt["dropped"] / rt["choices"])
    assert sum(rt["share"]) == pytest.approx(1) and sum(rt["kept_share"]) == pytest.approx(1)
    rows = {r["label"]: r for r in results["rows"]}
    assert list(rows) == ["2d+ep", "ep_tp", "2d"]
    ep_axis = {"2d+ep": 2, "ep_tp": 4, "2d": 1}  # N: devices the experts are split over
    groups = {"2d+ep": 2, "ep_tp": 2, "2d": 2}  # G: sequences per device (batch 8 over 4)
    for label, n in ep_axis.items():
        buffer = e.num_experts * rt["capacity"] * groups[label] * model.d_model * 4
        want = 4 * model.num_layers * buffer * (n - 1) / n
        assert rows[label]["all_to_all_bytes_shardops"] == pytest.approx(want), label
        r = rows[label]
        assert r["vs_gspmd"]["q25"] <= r["vs_gspmd"]["median"] <= r["vs_gspmd"]["q75"]
        for program in ("shardops", "gspmd"):
            m = r[f"memory_{program}"]
            assert m["peak"] == m["argument"] + m["output"] - m["alias"] + m["temp"] > 0
    assert set(results["pairs"]) == {"2d+ep ÷ 2d", "ep_tp ÷ 2d"}
    assert "| 2d+ep | data=2,expert=2,model=2 |" in (tmp_path / "moe.md").read_text()
