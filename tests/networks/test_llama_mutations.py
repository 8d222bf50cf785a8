"""Mutants of the Llama's training path, each caught by the trajectory check against the
plain-jnp reference (tests/_gpt_checks.py), or refused by check_vma when the step traces (a
norm that varies over the mesh where the update needs one value): a tied head whose table gets
the gradient of one use only, and clipping by each device's norm of its own gradient shards.
The gated MLP's reduction in bfloat16 passes the budget traced from the step and is caught by
the hand-written one (tests/_lm_budgets.py)."""

import jax
import pytest
from _gpt_checks import (
    BATCH,
    SEQ,
    check_budget,
    check_gpt_trajectory,
    check_lm_trajectory,
    optimizer,
)
from _lm_budgets import check_hand_budget
from _mutants import mutant, training
from test_llama import CLIP, GQA, SGD_LR, TIED_MQA

import shardops
import shardops_models as models
from shardops import _clip
from shardops.layers import _dense_kernels
from shardops_models.strategies import _layers, parallel

TIED_LINE = "        w = table.T  # w[D, V(_model)]: the table's rows as output columns"
PSUM_LINE = (
    "            squares = all_reduce(squares, axes, reason=_SQUARES)  # the whole arrays' Σ g²"
)
CASES = {"tied_head_counted_once": ("tp", "model8"), "clip_norm_per_shard": ("fsdp_tp", "4x2")}


@pytest.fixture
def swapped(monkeypatch):
    """Swap in a mutant: the tied head's method, or the clip transform."""

    def swap(name, mutated: bool):
        if name == "tied_head_counted_once":
            new = "        w = lax.stop_gradient(table).T  # the head's use adds no gradient"
            module = mutant(_layers, name, TIED_LINE, new if mutated else TIED_LINE)
            monkeypatch.setattr(parallel.Parallel, "tied_head", module.Layers.tied_head)
        else:
            module = mutant(_clip, name, PSUM_LINE, "            pass" if mutated else PSUM_LINE)
            monkeypatch.setattr(shardops, "clip_by_global_norm", module.clip_by_global_norm)
        jax.clear_caches()

    yield swap
    jax.clear_caches()


def _check(name):
    strategy, mesh = CASES[name]
    model = TIED_MQA if name == "tied_head_counted_once" else GQA
    check_lm_trajectory(model, strategy, mesh, "sgd", clip=CLIP, sgd_lr=SGD_LR)


@pytest.mark.parametrize("name", CASES)
def test_unmutated_copy_passes(swapped, name):
    swapped(name, mutated=False)
    _check(name)


@pytest.mark.parametrize("name", CASES)
def test_mutant_is_caught(swapped, name):
    swapped(name, mutated=True)
    with pytest.raises((AssertionError, ValueError)) as caught:
        _check(name)
    if isinstance(caught.value, ValueError):  # check_vma's verdict on a varying norm
        assert "vma" in str(caught.value) or "out_specs" in str(caught.value), caught.value


# The gated MLP's row-parallel AllReduce in bfloat16 (inside the scan over the stacked blocks):
# the budget traced from the step passes it (as XLA:CPU runs it, in float32); the hand-written
# budget (tests/_lm_budgets.py) sees the bf16 collectives.
ROW_PSUM = "                y = reduce_from_region(y_partial, axis_name)  # y[B, D]"
ROW_PSUM_BF16 = (
    "                y = reduce_from_region(y_partial.astype(jnp.bfloat16),\n"
    "                                       axis_name).astype(y_partial.dtype)"
)
BUDGET_CASE = (GQA.name, "tp", "model8", "sgd", CLIP, False)


def _compiled_gqa_step(monkeypatch, line):
    copy = mutant(_dense_kernels, "gated_mlp_row_psum_in_bf16", ROW_PSUM, line)
    for holder in (shardops.layers, shardops.layers._mlp):
        monkeypatch.setattr(holder, "row_parallel_dense_kernel", copy.row_parallel_dense_kernel)
    jax.clear_caches()
    setup = models.build("tp", shardops.make_mesh({"model": 8}), model=GQA,
                         optimizer=optimizer("sgd", CLIP, sgd_lr=SGD_LR))  # fmt: skip
    return setup, setup.train_step.lower(*setup.abstract_step_args(BATCH, SEQ)).compile()


@pytest.mark.parametrize("mutated", [False, True], ids=["unmutated", "mutated"])
def test_gated_mlp_reduced_in_bf16_is_caught_by_the_hand_budget(monkeypatch, mutated):
    setup, compiled = _compiled_gqa_step(monkeypatch, ROW_PSUM_BF16 if mutated else ROW_PSUM)
    moved = shardops.inspect.Ledger(
        setup.mesh, tuple(shardops.inspect.collectives(setup.mesh, compiled)), ()
    ).totals()
    assert moved == setup.budget(BATCH, SEQ).totals()  # the old comparison: passes either way
    if mutated:
        with pytest.raises(AssertionError, match="bf16"):
            check_hand_budget(BUDGET_CASE, setup, compiled, (BATCH, SEQ))
    else:
        check_budget(setup, compiled, (BATCH, SEQ), BUDGET_CASE)
    jax.clear_caches()


SCALE_LINE = "        loss, grads = self._value_and_grad(params, x, y)"


def test_a_gradient_scaled_as_a_whole_is_caught_unclipped_or_by_the_raw_gradients():
    """Mutant: every gradient doubled (a reduction summed twice over an axis of 2). A clipping
    that binds rescales it away, so the clipped Llama's parameters and the gradients read back
    from its steps equal the reference's; ``raw_grads`` (setup.loss_and_grads against the
    unclipped reference) sees it, as the unclipped GPT's read-back does (why every strategy
    trains the GPT with unclipped SGD, tests/networks/test_gpt.py)."""
    doubled = SCALE_LINE + "; grads = jax.tree.map(lambda g: 2 * g, grads)"
    build = training("gradients_doubled", SCALE_LINE, doubled).build
    with pytest.raises(AssertionError, match="grads"):
        check_lm_trajectory(GQA, "2d", "4x2", "sgd", clip=CLIP, sgd_lr=SGD_LR, build=build,
                            raw_grads=True)  # fmt: skip
    with pytest.raises(AssertionError):  # by the second step's loss, and the read-back
        check_gpt_trajectory("2d", "4x2", "sgd", build=build)
    unmutated = training("gradients_doubled", SCALE_LINE, SCALE_LINE).build
    check_lm_trajectory(GQA, "2d", "4x2", "sgd", clip=CLIP, sgd_lr=SGD_LR, build=unmutated,
                        raw_grads=True)  # fmt: skip
