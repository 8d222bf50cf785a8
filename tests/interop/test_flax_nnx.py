"""Flax NNX modules as their authors wrote them (``examples/flax_llama.py``, an MLP here), trained
by ``FlaxModel`` under the strategies, each against the same module trained by Flax itself
(``nnx.jit``, ``nnx.Optimizer``) unsharded; the plan read from the annotations; the ledger by
hand; checkpoints; the example. The modules and the check are tests/_flax_checks.py's; the
refusals and the mutants test_flax_nnx_refusals.py's.

The reference shares nothing with shardops but the initial key: Flax builds the module, computes
the loss of its own ``__call__`` and applies optax's update. Five steps: the losses at every step
and the parameters after the last are held to ``_gpt_checks.TOL`` (sharding only reorders float32
sums), and every parameter must move ≥ 100× that bound, so a zeroed, doubled or dropped gradient
(or a layer left out of the swap) cannot hide under it.
"""

import json

import _foreign_checks
import jax
import optax
import pytest
from _flax_checks import (
    CASES,
    MAKE,
    ORIGINAL_ATTENTION,
    SGD_LR,
    STRATEGIES,
    FlaxModel,
    _check_attention_core,
    batches,
    check_trains_like_flax,
    flax_llama,
    flax_model,
    mesh_for,
)
from _lm_budgets import by_dtype
from _resume_checks import load_example, run_main
from flax import nnx

import shardops
import shardops_models as models
from shardops_models.interop import flax_nnx


@pytest.mark.parametrize(("name", "strategy", "opt_name"), CASES, ids=["-".join(c) for c in CASES])
def test_a_flax_module_trains_like_flax_trains_it(name, strategy, opt_name):
    # The traced budget equals the compiled step's collectives wherever a tp axis splits layers.
    check_trains_like_flax(flax_model(name), name, strategy, opt_name,
                           budget=STRATEGIES[strategy] is not None and "model" in STRATEGIES[strategy])  # fmt: skip


@pytest.mark.parametrize(
    ("name", "strategy", "opt_name"),
    [("llama-sdpa", "2d+ring", "sgd"), ("llama-general", "fsdp+allgather", "adam"),
     ("llama-nnx-sdpa", "dp+ulysses", "sgd"), ("llama-sdpa", "sp+ring", "adam")],
)  # fmt: skip
def test_context_parallelism_trains_like_flax(name, strategy, opt_name):
    """Each device's chunks of the sequence at their positions (``FlaxModel(positions=)``),
    its queries over the whole sequence by each context method, with tp, fsdp and sp."""
    check_trains_like_flax(flax_model(name), name, strategy, opt_name)


@pytest.mark.parametrize(
    ("name", "strategy", "attention", "remat"),
    [("llama-sdpa", "dp_sp", "einsum", False), ("llama-sdpa", "fsdp_tp", "blocked", "full"),
     ("llama-nnx-sdpa", "2d", "auto", "matmuls"), ("llama", "hsdp_tp", "auto", "full")],
    ids=["jax-sdpa-einsum-sp", "jax-sdpa-blocked-remat", "nnx-sdpa-remat", "einsum-remat"],
)  # fmt: skip
def test_attention_choices_and_remat_policies_reach_the_module(name, strategy, attention, remat):
    """A module calling ``jax.nn.dot_product_attention`` or ``nnx.dot_product_attention`` runs
    the attention ``build`` chose on each device's heads; each swapped layer is a remat unit.
    Both still train like Flax trains the module."""
    check_trains_like_flax(flax_model(name), name, strategy, "adam", attention=attention,
                           remat=remat)  # fmt: skip
    assert jax.nn.dot_product_attention is ORIGINAL_ATTENTION  # restored after the trace


@pytest.mark.parametrize("name", ["llama-sdpa", "llama-nnx-sdpa"])
def test_the_attention_runs_shardops_core_in_the_traced_step(name):
    _check_attention_core(flax_nnx, name)


@pytest.mark.parametrize(
    ("strategy", "opt_name"),
    [("tp", "sgd"), ("fsdp_tp", "adam"), ("hsdp_tp", "sgd"), ("zero1", "adam"), ("dp_sp", "sgd")],
)
def test_linear_general_and_einsum_layers_train_like_flax(strategy, opt_name):
    """``nnx.LinearGeneral`` to and from ``[heads, head_dim]`` and ``nnx.Einsum`` as dense
    layers: column-parallel by head, row-parallel over the heads, under tp, fsdp and sp."""
    plan = flax_model("llama-general").plan()["blocks"][0]
    assert (plan["attn"]["wq"]["kernel"], plan["attn"]["wo"]["kernel"]) == ("column", "row")
    assert (plan["mlp"]["up"]["bias"], plan["mlp"]["down"]["kernel"]) == ("column", "row")
    check_trains_like_flax(flax_model("llama-general"), "llama-general", strategy, opt_name,
                           budget=strategy != "zero1")  # fmt: skip


def test_norms_after_each_sublayer_keep_the_block_under_sp():
    """Gemma's norm of a sublayer's output (before the residual add) is not gathered: the
    residual stream stays this device's block, and the model trains like Flax under dp_sp."""
    check_trains_like_flax(flax_model("llama-sandwich"), "llama-sandwich", "dp_sp", "sgd")


@pytest.mark.parametrize(("strategy", "opt_name"), [("dp_sp", "adam"), ("fsdp_tp", "sgd")])
def test_flax_multi_head_attention_with_its_mask_trains_like_flax(strategy, opt_name):
    """``nnx.MultiHeadAttention``: its ``LinearGeneral`` projections swapped (by head), its
    masked attention Flax's own on each device's heads (a ``[B, 1, T, S]`` mask broadcasts)."""
    check_trains_like_flax(flax_model("mha"), "mha", strategy, opt_name)


def test_the_plan_is_read_from_the_annotations_and_the_rules():
    plan = flax_model("llama").plan()
    block = plan["blocks"][0]
    assert plan["embed"] == {"embedding": "vocab"} and plan["head"] == {"kernel": "column"}
    assert block["attn"]["wq"]["kernel"] == block["mlp"]["up"]["kernel"] == "column"
    assert block["attn"]["wo"]["kernel"] == block["mlp"]["down"]["kernel"] == "row"
    assert block["attn_norm"] == {"scale": "replicated"}
    # The same module with a rules table that splits nothing: every layer replicated.
    whole = FlaxModel(MAKE["llama"], rules=[(n, None) for n, _ in flax_llama.RULES])
    assert set(jax.tree.leaves(whole.plan())) == {"replicated"}


HAND = {
    # Mlp(24, 64, 8). Local parameters: LayerNorm scale+bias 2 × 24 × 4 = 192 bytes
    # (replicated), up kernel [24, 64/2] 3,072 and bias [32] 128 (column), down kernel [64/2, 8]
    # 1,024 (row) and bias [8] 32 (added after the row's AllReduce: replicated). Over data: one
    # AllReduce per leaf of its gradient, 6 leaves, 4,448 bytes, and the loss's one float32.
    # Over model: the row layer's output y[4, 8] forward (128) and the column layer's dx[4, 24]
    # backward (384).
    "mlp": {("all-reduce", ("data",), "f32"): (7, 4452),
            ("all-reduce", ("model",), "f32"): (2, 512)},
    # flax_llama.Config(): V = 256, D = 64, H = 4 and KV = 2 heads of 16, F = 128, L = 2, S = 16.
    # Over model, x[4, 16, 64] = 16,384 bytes: forward the vocab-parallel embedding's sum and
    # per block the two row layers' (wo, down); backward per block the five column layers' dx
    # (wq, wk, wv, gate, up) and the head's: 1 + 2 × 7 + 1 = 16 × 16,384; the vocab-parallel
    # loss's max, Σexp and target logit over [4, 16]: 3 × 256. Over data: the 21 leaves'
    # gradients, local bytes: embedding [128, 64] 32,768; per block 2 norms 2 × 256, wq [64, 32]
    # 8,192, wk, wv [64, 16] 2 × 4,096, wo [32, 64] 8,192, gate, up [64, 64], down [64, 64]
    # 3 × 16,384 (74,240); the final norm 256; the head [64, 128] 32,768: 214,272; and the loss.
    "llama": {("all-reduce", ("model",), "f32"): (19, 16 * 16384 + 3 * 256),
              ("all-reduce", ("data",), "f32"): (22, 214272 + 4)},
    # The same Llama under dp_sp (data = 4 × model = 2): over model, the whole x[4, 16, 64] =
    # 16,384 bytes AllGathered forward after each of the 5 norms (2 a block and the final one:
    # the sublayer's input, once for its column layers) and ReduceScattered forward by the
    # embedding and the 4 row layers, each transposed in the backward: 10 AllGathers and 10
    # ReduceScatters; AllReduces of the loss's 3 [4, 16] values (768) and of the 5 norm scales'
    # gradients (5 × 256: replicated, applied to sequence blocks). Over data as under 2d.
    "llama-sp": {("all-gather", ("model",), "f32"): (10, 10 * 16384),
                 ("reduce-scatter", ("model",), "f32"): (10, 10 * 16384),
                 ("all-reduce", ("model",), "f32"): (8, 3 * 256 + 5 * 256),
                 ("all-reduce", ("data",), "f32"): (22, 214272 + 4)},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(HAND))
def test_the_ledger_is_the_count_by_hand(case):
    """The traced step asks for ``HAND[case]`` (count and bytes) under 2d (``-sp``: dp_sp),
    and the compiled step moves those bytes."""
    name, sp = case.removesuffix("-sp"), case.endswith("-sp")
    strategy = "dp_sp" if sp else "2d"
    setup = models.build(strategy, mesh_for(STRATEGIES[strategy]), model=flax_model(name),
                         optimizer=optax.sgd(SGD_LR))  # fmt: skip
    xs, ys = batches(name)
    assert by_dtype(setup.budget(*xs.shape[1:]).requested) == HAND[case]
    state = setup.shard(setup.model.init(jax.random.key(0)))
    compiled = setup.train_step.lower(state, *setup.place_batch(xs[0], ys[0])).compile()
    moved = by_dtype(shardops.inspect.collectives(setup.mesh, compiled))
    assert {k: b for k, (_, b) in moved.items()} == {k: b for k, (_, b) in HAND[case].items()}


def test_a_checkpoint_saved_under_2d_restores_under_fsdp_and_into_the_flax_module(tmp_path):
    # Into Flax: the module holding the restored parameters computes the sharded run's logits.
    module, params = _foreign_checks.check_checkpoint(
        flax_model("llama"), STRATEGIES, batches("llama"), "flax_llama.Llama",
        lambda module, ids: module(ids), tmp_path, steps=2,
    )  # fmt: skip
    assert isinstance(module, flax_llama.Llama)
    assert nnx.to_pure_dict(nnx.state(module, nnx.Param)).keys() == params.keys()


def test_the_example_trains_the_flax_llama_like_its_unsharded_run(tmp_path):
    """``transformer_lm.py --model flax-llama`` on fsdp_sp 4×2 (fsdp, tp and sequence
    parallelism at once) with ``--compare-reference``: the final losses agree to the example's
    own limit, a sample is recomputed, no MFU."""
    metrics = tmp_path / "lm.json"
    out = run_main(load_example("transformer_lm"), [
        "--model", "flax-llama", "--strategy", "fsdp_sp", "--mesh", "4x2", "--compare-reference",
        "--text-source", "stdlib", "--steps", "4", "--layers", "2", "--width", "32", "--heads",
        "4", "--context", "16", "--batch-size", "8", "--eval-every", "0", "--eval-batches", "1",
        "--prompt-bytes", "8", "--sample-tokens", "4", "--metrics-json", str(metrics),
    ])  # fmt: skip
    result = json.loads(metrics.read_text())
    assert result["model"] == "flax llama L=2 D=32 H=4/2", result["model"]
    assert abs(result["final_loss"] - result["final_reference_loss"]) <= 4e-6, result
    assert "Decoding by recomputing the prefix" in out and "Model FLOPs utilisation" not in out


@pytest.mark.parametrize(
    ("flags", "says"),
    [(["--moe"], "without --moe"),
     (["--mesh", "1x8"], "num_heads=4 is not divisible by the tp axis 'model' (size 8)")],
    ids=["moe", "heads"],
)  # fmt: skip
def test_the_example_refuses_what_a_flax_module_cannot_honour(flags, says, capsys):
    """A usage error (exit status 2), before any step: flags, and a mesh the heads do not
    divide (the module's layout checks run in the step's trace, made at set-up)."""
    with pytest.raises(SystemExit) as stop:
        load_example("transformer_lm").main(["--model", "flax-llama", *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and says in err and "Traceback" not in err, err


def test_explain_names_each_collective_and_the_locator_compares_every_layer():
    """``explain`` reads the swapped layers' reasons from the step; ``locate`` compares every
    swapped layer of the Flax module (outputs, gradients, parameter gradients) with the
    unsharded run, each within its bound."""
    from shardops_models.training.locate import locate

    xs, ys = batches("llama")
    model = flax_model("llama")
    setup = models.build("2d", mesh_for(STRATEGIES["2d"]), model=model,
                         optimizer=optax.sgd(SGD_LR))  # fmt: skip
    state = setup.shard(model.init(jax.random.key(0)))
    lines = shardops.inspect.explain(setup.mesh, setup.train_step, state,
                                     *setup.place_batch(xs[0], ys[0]), traced=True)  # fmt: skip
    assert any(line.startswith("row_parallel_dense: psum over 'model'") for line in lines)
    assert any(line.startswith("vocab_parallel_embedding") for line in lines), lines
    report = locate(setup, state.params, xs[0], ys[0])
    assert report.first is None, report
    swapped = {"".join(f"[{k!r}]" for k in path) for path in model._layers}
    assert {row.layer for row in report.rows} == swapped | {"loss"}
