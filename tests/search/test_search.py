"""The strategy search (``shardops_models.search._search``): its byte predictions equal the compiled ledger of every
candidate it lists, on this process's 8 devices and on 64 simulated ones; it rules out what cannot
run, with the reason; it ranks by the predicted step time; the command line prints a table."""

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from _gpt_checks import GPT
from _processes import ROOT
from _search_checks import (
    check_flop_rates,
    check_loop_flops,
    check_peak_keeps_outputs_and_arguments,
)
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models
import shardops_models.search
from shardops_models.search._program_cost import program_cost

SEED = models.Mlp(models.SEED_SIZES)
FREE_LINKS = shardops_models.search.Hardware(
    "free links", {"data": 1e30, "model": 1e30}, {"float32": 1e10}, 1e10, 0.0, 1e12
)
SLOW_LINKS = shardops_models.search.Hardware(
    "slow links", {"data": 1e3, "model": 1e3}, {"float32": 1e30}, 1e30, 0.0, 1e12
)


# The GPT's jaxpr peak against XLA:CPU's compiled peak. While attention's S×S arrays set the
# step's peak the jaxpr's stayed above the compiled one on every layout. With the blocked
# attention and the recomputed norms (issue 43) the jaxpr holds far less, and at these tiny
# shapes (16 tokens) XLA's buffers hardly shrink: the compiled peak is up to 22.6 % above the
# jaxpr's (sp 1×8: 335,816 against 259,912 bytes). A known gap of the memory model, bounded
# here; the MLP tests still hold the strict bound.
GPT_PEAK_GAP = 0.25


def check_predictions_equal_the_ledger(planned, peak_gap: float = 0.0, loops=False) -> None:
    """``loops``: the model scans its layers, and the lowered module lists a loop's collectives
    once (the compiled one, by XLA's trip counts, once per iteration): only what the compiled
    program runs is compared."""
    for lay in planned:
        c = lay.compiled
        assert c is not None, f"{lay.name} was not compiled"
        assert loops or c.requested == lay.budget, (
            f"{lay.name}: the compiled program asks for {c.requested}, the search predicted "
            f"{lay.budget}"
        )
        assert c.totals == lay.budget, (  # FLOAT32: XLA:CPU runs what was asked for
            f"{lay.name}: the compiled program runs {c.totals}, the search predicted {lay.budget}"
        )
        assert c.ring_bytes == pytest.approx(lay.ring_bytes, rel=1e-12), lay.name
        if c.peak_bytes is not None:  # the outputs (the new state) stay live to the end
            assert lay.peak_bytes >= (1 - peak_gap) * c.peak_bytes, (
                f"{lay.name}: predicted peak {lay.peak_bytes} < compiled {c.peak_bytes} bytes"
            )


def test_seed_predictions_equal_the_compiled_ledger_for_every_candidate():
    planned = shardops_models.search.search(SEED, 64, 8, hardware="cpu-sim", compile_top=100)
    assert len(planned) == 13  # 5 strategies × 4 meshes, less 7 duplicates
    check_predictions_equal_the_ledger(planned)


def test_a_named_three_axis_mesh_is_searched_with_the_presets_it_has():
    """``meshes=[replica=2,data=2,model=2]``: every preset whose axes the mesh has (HSDP's
    included), each prediction equal to its compiled ledger."""
    planned = shardops_models.search.search(SEED, 64, 8, hardware="cpu-sim", compile_top=100,
                                            meshes=["replica=2,data=2,model=2"])  # fmt: skip
    assert {lay.strategy for lay in planned} == {"dp", "fsdp", "tp", "2d", "fsdp_tp", "hsdp",
                                                 "hsdp_tp"}  # fmt: skip
    assert {lay.mesh_text for lay in planned} == {"replica=2,data=2,model=2"}
    assert {lay.strategy: lay.replicas for lay in planned}["2d"] == 2  # replica holds copies
    check_predictions_equal_the_ledger(planned)


def test_the_planner_takes_a_mesh_spec_on_its_command_line(capsys):
    shardops_models.search.main(["--batch", "64", "--mesh", "replica=2,data=4", "--hardware",
                                 "cpu-sim", "--strategies", "hsdp", "dp"])  # fmt: skip
    out = capsys.readouterr().out
    assert "hsdp" in out and "replica=2,data=4" in out
    with pytest.raises(SystemExit):
        shardops_models.search.main(["--batch", "64", "--mesh", "2x2x2"])
    assert "more than two axes need their names" in capsys.readouterr().err


def test_gpt_predictions_equal_the_compiled_ledger_for_every_candidate():
    """The test GPT (8 heads, 1 layer), which every mesh of 8 divides: sp, fsdp_tp and
    fsdp_sp on every mesh they are listed for (8 candidates; all 32 take ~50 s on 2 busy cores).
    Between them they use every GPT kernel under tp and sp and both data-axis routes."""
    planned = shardops_models.search.search(GPT, 16, 8, hardware="cpu-sim", compile_top=100,
                                 strategies=["sp", "fsdp_tp", "fsdp_sp"])  # fmt: skip
    assert {lay.strategy for lay in planned} == {"sp", "fsdp_tp", "fsdp_sp"}
    check_predictions_equal_the_ledger(planned, peak_gap=GPT_PEAK_GAP)


@pytest.mark.parametrize("devices", [64, 256])
def test_simulated_devices_predictions_equal_a_compile_only_ledger(devices):
    """A subprocess with 64 (256) simulated devices plans and compiles (never runs) the
    candidates. (At 256 the lowered module prints its replica groups as hex.)"""
    planned = shardops_models.search.search("seed", 256, devices, strategies=["dp", "2d", "fsdp_tp"],
                                 hardware="h100-ib", compile_top=3, timeout=120)  # fmt: skip
    assert planned.devices == devices
    assert {lay.mesh[0] * lay.mesh[1] for lay in planned} == {devices}
    assert sum(lay.compiled is not None for lay in planned) == 3
    check_predictions_equal_the_ledger([lay for lay in planned if lay.compiled is not None])


# What a candidate predicts per device that depends only on its local shapes.
LOCAL = ("budget", "collectives", "flops", "elementwise_bytes", "state_bytes", "peak_bytes")


@pytest.mark.parametrize(("strategy", "model_axis"), [("2d", 4), ("dp", 1)])
def test_thousands_of_devices_are_traced_here_as_64_are(strategy, model_axis, monkeypatch):
    """A search of 4,096 devices traces on an AbstractMesh in this process (no subprocess, no
    simulated devices), and each candidate's per-device program is the one 64 devices trace where
    the local shapes agree (4 rows a device; the tests above hold predictions at 8 and 64
    devices to the compiled ledger): the same bytes per collective, collectives, FLOPs, state
    and peak. Only what the rings send grows with the data axis."""

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"the search started a subprocess: {args}")

    monkeypatch.setattr(shardops_models.search._search.subprocess, "run", no_subprocess)
    data = 4096 // model_axis
    (big,) = shardops_models.search.search(
        "gpt", 4 * data, 4096, strategies=[strategy], meshes=[{"data": data, "model": model_axis}]
    ).candidates
    small = shardops_models.search.predict(models.Gpt(), strategy,
                                           {"data": 16, "model": model_axis}, 64)  # fmt: skip
    assert big.mesh == (data, model_axis) and big.budget, big
    assert {f: getattr(big, f) for f in LOCAL} == {f: getattr(small, f) for f in LOCAL}
    grow = {axes: big.ring_bytes[axes] / small.ring_bytes[axes] for axes in small.ring_bytes}
    assert grow[("data",)] > 1 and all(g == 1 for axes, g in grow.items() if "data" not in axes)


def test_the_command_line_traces_64_devices_in_its_own_process(capsys, monkeypatch):
    """Without --compile-top (or calibrating) the command line searches more devices than the
    process has without a subprocess."""

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"the command line started a subprocess: {args}")

    monkeypatch.setattr(shardops_models.search._cli.subprocess, "run", no_subprocess)
    result = shardops_models.search.main(["--model", "seed", "--batch", "256", "--devices", "64",
                                          "--strategies", "dp", "2d"])  # fmt: skip
    assert result.devices == 64 and {lay.strategy for lay in result} == {"dp", "2d"}
    assert "searched in" in capsys.readouterr().out


def test_ruled_out_candidates_say_why():
    gpt = models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=1, context=16)
    planned = shardops_models.search.search(gpt, 16, 8, hardware="cpu-sim")
    reasons = {(r.strategy, r.mesh): r.reason for r in planned.ruled_out}
    assert "num_heads=4 is not divisible by mesh axis 'model' (size 8)" in reasons["tp", (1, 8)]
    assert reasons["2d", (8, 1)].startswith("same program as dp 8×1")
    assert reasons["dp", (1, 8)].startswith("no parallelism")
    assert ("tp", (1, 8)) not in {lay.mesh for lay in planned}

    # fsdp on 1,024 devices of this GPT: no dimension divides 1,024, so no parameter splits
    # and the program is dp's (listed, it ranked as a candidate of its own)
    wide = shardops_models.search.search(models.Gpt(), 1024, 1024, strategies=["dp", "fsdp"],
                                         meshes=[{"data": 1024, "model": 1}])  # fmt: skip
    assert [lay.name for lay in wide] == ["dp 1024×1"]
    assert {(r.strategy, r.reason) for r in wide.ruled_out} == {("fsdp", (
        "same program as dp 1024×1: no parameter has a dimension fsdp can split over data = "
        "1024, so every one stays replicated"))}  # fmt: skip
    # ... but hsdp splitting nothing is dp over replica × data, which no preset is: it stays
    small = models.Mlp((30, 10))  # neither 30 nor 10 divides data = 4
    hsdp = shardops_models.search.search(small, 8, 8, strategies=["hsdp", "dp"],
                                         meshes=["replica=2,data=4"])  # fmt: skip
    assert {lay.name for lay in hsdp} == {"hsdp replica=2,data=4", "dp replica=2,data=4"}

    mlp = models.Mlp((64, 30, 10))
    planned = shardops_models.search.search(mlp, 12, 8, hardware="cpu-sim")
    reasons = {(r.strategy, r.mesh): r.reason for r in planned.ruled_out}
    assert reasons["dp", (8, 1)] == "batch 12 does not split over data = 8; use a multiple of 8"
    assert {lay.name for lay in planned} >= {"dp 4×2", "2d 4×2"}  # 30 and 12 split by 2 and 4
    assert "2d 2×4" in {lay.name for lay in planned}  # 30 hidden units padded to 32 on model = 4


def test_a_memory_limit_rules_out_what_does_not_fit():
    full = shardops_models.search.search(SEED, 64, 8, hardware="cpu-sim")
    peaks = sorted(lay.peak_bytes for lay in full)
    limit = (peaks[0] + peaks[-1]) / 2
    limited = shardops_models.search.search(SEED, 64, 8, hardware="cpu-sim", memory_limit=limit)
    assert {lay.name for lay in limited} == {lay.name for lay in full if lay.peak_bytes <= limit}
    over = [r for r in limited.ruled_out if "limit" in r.reason]
    assert len(over) == sum(p > limit for p in peaks)
    assert all(f"{limit / 1e9:.3g} GB limit" in r.reason for r in over)
    with pytest.raises(
        ValueError, match=r"no strategy and mesh of 8 devices works for batch 64: .*limit"
    ):
        shardops_models.search.search(SEED, 64, 8, hardware="cpu-sim", memory_limit=1)


def check_ranked(planned) -> None:
    times = [lay.step_time for lay in planned]
    assert times == sorted(times), f"not ranked by predicted step time: {times}"
    assert [lay.rank for lay in planned] == list(range(1, len(planned) + 1))
    for lay in planned:
        assert lay.step_time == pytest.approx(lay.compute_time + sum(lay.comm_time.values()))


def test_candidates_rank_by_predicted_step_time(monkeypatch):
    check_ranked(shardops_models.search.search(SEED, 64, 8, hardware="cpu-sim"))
    # Free links: the least compute per device wins (no replicas); slow links: the fewest bytes.
    free = shardops_models.search.search(SEED, 64, 8, hardware=FREE_LINKS)
    assert free[0].replicas == 1 and free[-1].replicas == 8 // 2
    slow = shardops_models.search.search(SEED, 64, 8, hardware=SLOW_LINKS)
    least = min(slow, key=lambda lay: sum(lay.ring_bytes.values()))
    assert slow[0].name == least.name and least.strategy == "tp"  # an all-reduce of logits
    # Mutants of the sort key are caught: bytes only, and reversed.
    monkeypatch.setattr(
        shardops_models.search._search, "rank_key", lambda lay: sum(lay.ring_bytes.values())
    )
    with pytest.raises(AssertionError, match="not ranked"):
        check_ranked(shardops_models.search.search(SEED, 64, 8, hardware="cpu-sim"))
    monkeypatch.setattr(shardops_models.search._search, "rank_key", lambda lay: -lay.step_time)
    with pytest.raises(AssertionError, match="not ranked"):
        check_ranked(shardops_models.search.search(SEED, 64, 8, hardware="cpu-sim"))


def test_recount_ranks_by_the_collectives_the_compiled_program_runs():
    """A dp step asks for one all-reduce per gradient leaf and XLA:CPU runs them combined;
    with recount the latency term counts what runs, and the ranking follows the new times."""
    slow = dataclasses.replace(FREE_LINKS, name="latency", latency=1e-3)
    planned = shardops_models.search.search(SEED, 64, 8, hardware=slow, strategies=["dp", "2d", "fsdp"],
                                 compile_top=100)  # fmt: skip
    again = shardops_models.search.search(SEED, 64, 8, hardware=slow, strategies=["dp", "2d", "fsdp"],
                               compile_top=100, recount=True)  # fmt: skip
    check_ranked(again)
    dp = next(lay for lay in planned if lay.name == "dp 8×1")
    assert dp.collectives[("data",)] > dp.compiled.collectives[("data",)]  # combined by XLA
    for lay in again:
        runs = sum(lay.compiled.collectives.values())
        assert lay.step_time == pytest.approx(lay.compute_time + runs * slow.latency), lay.name


def test_program_cost_counts_matmul_flops_and_collectives():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
    assert program_cost(jax.make_jaxpr(jnp.dot)(x, w).jaxpr, {}).flops == 2 * 4 * 8 * 16
    grad = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w))))(w)
    assert program_cost(grad.jaxpr, {}).flops == 2 * (2 * 4 * 8 * 16)  # forward, dw (x needs none)
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    f = jax.shard_map(lambda a: jax.lax.psum(a, "data") + jax.lax.psum(a, "model"), mesh=mesh,
                      in_specs=P("data"), out_specs=P("data"))  # fmt: skip
    cost = program_cost(jax.make_jaxpr(f)(jnp.ones((8, 4))).jaxpr, dict(mesh.shape))
    assert cost.collectives == {("data",): 1, ("model",): 1}


def test_program_cost_counts_the_flops_inside_loops_as_xla_counts_them_unrolled():
    check_loop_flops()


def test_program_cost_peak_keeps_outputs_and_held_arguments_live_to_the_end():
    check_peak_keeps_outputs_and_arguments()


def test_compute_time_uses_the_flop_rate_of_each_policys_compute_dtype():
    check_flop_rates()


def test_bad_inputs_are_errors():
    with pytest.raises(ValueError, match=r"devices must be a positive integer; got 0"):
        shardops_models.search.search(SEED, 64, 0)
    with pytest.raises(ValueError, match=r"unknown hardware preset 'tpu'; choose one of"):
        shardops_models.search.search(SEED, 64, 8, hardware="tpu")
    with pytest.raises(ValueError, match=r"unknown model 'big'; choose one of"):
        shardops_models.search.search("big", 64, 8)
    with pytest.raises(ValueError, match=r"unknown strategy 'pp'"):
        shardops_models.search.search(SEED, 64, 8, strategies=["pp"])
    with pytest.raises(ValueError, match=r"dp 8×1: batch 7 does not split over data = 8"):
        shardops_models.search.search(SEED, 7, 8, strategies=["dp"])
    with pytest.raises(ValueError, match=r"bandwidth needs a positive bytes/s for mesh axis"):
        dataclasses.replace(FREE_LINKS, bandwidth={"data": 1.0})


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "shardops_models.search", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)  # fmt: skip


def test_the_command_line_prints_the_ranked_table_and_the_compiled_ledger():
    proc = run_cli("--model", "seed", "--batch", "128", "--devices", "8", "--compile-top", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "mlp 784-512-10, batch 128, 8 devices, hardware h100-nvlink" in out
    assert "ruled out: same program as dp 8×1" in out
    assert "compiled ledger of the top candidates" in out
    for bad, message in ((("--devices", "0"), "--devices must be a positive integer"),
                         (("--hardware", "tpu"), "unknown --hardware 'tpu'")):  # fmt: skip
        args = {"--model": "seed", "--batch": "128", "--devices": "8"}
        args.update(dict([bad]))
        proc = run_cli(*[s for kv in args.items() for s in kv])
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# --- pipeline, expert and context layouts (``_candidates``): a small Llama and its Mixtral
LLAMA = models.Llama(vocab_size=64, d_model=32, num_layers=4, num_heads=4, num_kv_heads=4,
                     d_ff=64, context=16)  # fmt: skip
MIXTRAL = dataclasses.replace(LLAMA, experts=models.Experts(num_experts=4, k=2))
COMPOSED = {
    "pipe": (LLAMA, "pipe=2,data=2,model=2", ["2d+1f1b", "fsdp+gpipe", "ref+circular"]),
    "expert": (MIXTRAL, "data=2,expert=2,model=2", ["2d+ep", "fsdp_tp+ep"]),
    "context": (LLAMA, "data=2,context=2,model=2", ["2d+ring", "fsdp+allgather", "tp+ulysses"]),
}


@pytest.mark.parametrize("axis", sorted(COMPOSED))
def test_pipeline_expert_and_context_predictions_equal_the_compiled_ledger(axis):
    """Each kind a mesh's ``pipe``, ``expert`` or ``context`` axis names, composed with
    presets: the bytes traced on an AbstractMesh equal the compiled program's on 8 devices
    (pipelines at 2 microbatches: 1F1B's, GPipe's and circular's phases)."""
    model, mesh, strategies = COMPOSED[axis]
    planned = shardops_models.search.search(model, 8, 8, hardware="cpu-sim", meshes=[mesh],
                                            strategies=strategies, microbatches=(2,),
                                            compile_top=100)  # fmt: skip
    assert sorted(lay.label for lay in planned) == sorted(
        f"{s} M=2" if axis == "pipe" else s for s in strategies
    ), planned.ruled_out
    check_predictions_equal_the_ledger(planned, peak_gap=GPT_PEAK_GAP, loops=True)
    if axis == "pipe":  # the microbatches reach the traced step: twice as many sends
        two, four = (shardops_models.search.predict(model, "2d+1f1b", {"pipe": 2, "data": 2,
                                                    "model": 2}, 8, microbatches=m)
                     for m in (2, 4))  # fmt: skip
        assert four.collectives[("pipe",)] > two.collectives[("pipe",)], (two, four)


def test_pipeline_expert_and_context_layouts_compiled_on_64_devices_equal_their_predictions():
    """A subprocess with 64 simulated devices compiles (never runs) 2d+1f1b, 2d+ep and 2d+ring
    of the Mixtral (its load balance per group: a pipeline's microbatches refuse the global
    one), each on a mesh of its own; every other pairing is ruled out for the axis it lacks."""
    mixtral = dataclasses.replace(MIXTRAL, experts=models.Experts(num_experts=4, k=2,
                                                                  load_balance="group"))  # fmt: skip
    meshes = ["pipe=2,data=8,model=4", "data=8,expert=4,model=2", "data=8,context=4,model=2"]
    planned = shardops_models.search.search(mixtral, 128, 64, hardware="cpu-sim", meshes=meshes,
                                            strategies=["2d+1f1b", "2d+ep", "2d+ring"],
                                            microbatches=(2,), compile_top=3, timeout=600)  # fmt: skip
    assert sorted(lay.name for lay in planned) == [
        "2d+1f1b M=2 pipe=2,data=8,model=4", "2d+ep data=8,expert=4,model=2",
        "2d+ring data=8,context=4,model=2",
    ]  # fmt: skip
    assert {r.reason.split(" '")[0] for r in planned.ruled_out} == {"the mesh has no axis"}
    check_predictions_equal_the_ledger(planned, peak_gap=GPT_PEAK_GAP, loops=True)


def test_a_meshs_pipe_expert_and_context_axes_compose_with_every_preset():
    """Without ``strategies``: every preset on the plain axes, each with every schedule at P,
    2P and 4P microbatches (``pipe``), expert parallelism (``expert``) or every context
    attention (``context``); ``ref`` composed alone on a mesh of ``pipe``; the axis always used."""
    from shardops_models.search._candidates import strategy_meshes

    def names(mesh, model=LLAMA):
        return {(s, m) for s, _, m in strategy_meshes(model, 8, meshes=[mesh])}

    presets = set(models.strategies_for(LLAMA, ("data", "model"))) - {"zero1", "zero1_tp"}
    pipe = names("pipe=2,data=2,model=2")
    assert pipe == {(f"{p}+{s}", m) for p in presets for s in ("gpipe", "1f1b", "circular")
                    for m in (2, 4, 8)}  # fmt: skip
    assert names("pipe=8") == {(f"ref+{s}", m) for s in ("gpipe", "1f1b", "circular")
                               for m in (8, 16, 32)}  # fmt: skip
    assert names("data=4,expert=2", MIXTRAL) == {("dp+ep", 1), ("fsdp+ep", 1), ("ref+ep", 1)}
    assert names("data=4,context=2") == {(f"{p}+{c}", 1) for p in ("dp", "fsdp", "ref")
                                         for c in ("allgather", "ring", "ulysses")}  # fmt: skip


def test_composed_candidates_ruled_out_say_why():
    from shardops_models.search._candidates import reason_ruled_out

    mesh = {"pipe": 2, "data": 4, "model": 1}
    assert reason_ruled_out(LLAMA, "2d+1f1b", mesh, 16, None, 2).startswith(
        "same program as dp+1f1b pipe=2,data=4,model=1"
    )
    assert reason_ruled_out(LLAMA, "dp+1f1b", mesh, 16, None, 2) is None
    assert reason_ruled_out(LLAMA, "dp+1f1b", mesh, 16, None, 8) == (
        "a device's 4 rows do not split into 8 microbatches; use a batch that is a multiple of 32"
    )
    assert reason_ruled_out(LLAMA, "dp+1f1b", {"pipe": 1, "data": 8}, 16, None, 2) == (
        "the 'pipe' axis it would pipeline has size 1"
    )
    assert reason_ruled_out(SEED, "dp+ring", {"data": 4, "context": 2}, 16, None) == (
        "context parallelism splits the sequence; this model has none"
    )
    with pytest.raises(ValueError, match=r"ref\+circular M=8 pipe=8: .*layers"):
        shardops_models.search.search(LLAMA, 8, 8, meshes=["pipe=8"],
                                      strategies=["ref+circular"], microbatches=(8,))  # fmt: skip


def test_remat_policies_predict_the_compiled_bytes_and_trade_flops_for_memory():
    """Each remat policy traced: the bytes equal the compiled program's (tp's forward
    all-reduces run again where their outputs are not saved), the peak falls and the FLOPs
    grow from none to matmuls to full."""
    planned = shardops_models.search.search(LLAMA, 16, 8, hardware="cpu-sim", strategies=["2d"],
                                            meshes=["data=2,model=4"], compile_top=100,
                                            remat=("none", "matmuls", "full"))  # fmt: skip
    check_predictions_equal_the_ledger(planned, peak_gap=GPT_PEAK_GAP, loops=True)
    by = {lay.remat: lay for lay in planned}
    assert by["none"].peak_bytes > by["matmuls"].peak_bytes > by["full"].peak_bytes, by
    assert by["none"].flops < by["matmuls"].flops < by["full"].flops, by
    assert by["full"].label == "2d remat=full"


def test_a_candidate_that_does_not_fit_is_traced_again_under_remat():
    """By default a candidate over the memory limit is traced under "matmuls", then "full",
    and listed under the first that fits; past both it is ruled out, naming the last."""
    peaks = {policy: shardops_models.search.predict(LLAMA, "2d", {"data": 2, "model": 4}, 16,
                                                    remat=policy).peak_bytes
             for policy in ("none", "matmuls", "full")}  # fmt: skip

    def listed(limit):
        planned = shardops_models.search.search(LLAMA, 16, 8, strategies=["2d"],
                                                meshes=["data=2,model=4"], memory_limit=limit)  # fmt: skip
        return [lay.label for lay in planned]

    assert listed(peaks["none"]) == ["2d"]
    assert listed((peaks["none"] + peaks["matmuls"]) // 2) == ["2d remat=matmuls"]
    assert listed((peaks["matmuls"] + peaks["full"]) // 2) == ["2d remat=full"]
    with pytest.raises(ValueError, match=r"2d 2×4: needs .* GB per device under remat 'full'"):
        listed(peaks["full"] - 1)


def test_microbatches_and_remat_are_checked(capsys):
    """A bad count or policy list is one clear error, not every candidate ruled out; one
    policy alone is a policy, not its letters."""
    for microbatches in ([0], [], [2.0]):
        with pytest.raises(ValueError, match="microbatches must be positive integers"):
            shardops_models.search.search(LLAMA, 8, 8, meshes=["pipe=8"],
                                          microbatches=microbatches)  # fmt: skip
    for remat in ([], ["full", None]):
        with pytest.raises(ValueError, match="remat must be None"):
            shardops_models.search.search(SEED, 64, 8, strategies=["dp"], remat=remat)
    result = shardops_models.search.search(SEED, 64, 8, strategies=["dp"], meshes=["8x1"],
                                           remat="full")  # fmt: skip
    assert [lay.label for lay in result] == ["dp remat=full"]
    written = json.loads(json.dumps(result.as_dict()))["candidates"][0]  # --json's content
    assert (written["remat"], written["microbatches"]) == ("full", 1), written
    for flag in (["--remat", "fulll"], ["--remat"], ["--microbatches", "0"]):
        with pytest.raises(SystemExit):
            shardops_models.search.main(["--batch", "64", "--devices", "8", *flag])
        assert "needs" in capsys.readouterr().err
