"""Mutation check for the GPT under the strategies: a plan with one wrong role, a dropped
vocab-parallel reduction, a loss averaged locally and one that counts padded labels are each caught by the trajectory check
(tests/_gpt_checks.py) against the plain-jnp reference, while the unmutated copies pass; a
collective added or swapped and a reduction in bfloat16 pass the budget traced from the step
and are caught by the hand-written budget (tests/_lm_budgets.py)."""

import inspect
import sys
import types

import jax
import pytest
from _cover import FULL
from _gpt_checks import BATCH, GPT, MESHES, SEQ, check_budget, check_gpt_trajectory, optimizer
from _lm_budgets import check_hand_budget
from _model_checks import mesh_for
from _mutants import mutant as line_mutant
from _mutants import training

import shardops
import shardops_models as models
from shardops.layers import _cross_entropy, _dense_kernels
from shardops_models.networks import _lm, gpt
from shardops_models.strategies import parallel
from shardops_models.training import _train

LOCAL_TARGETS = (
    "        targets = self._global_batch(y.shape[0] * microbatches) * math.prod(y.shape[1:])\n"
)
SPLIT_LOSS = (
    "        losses = ctx.cross_entropy(logits, target, split=split, vocab_size=self.vocab_size)\n"
)
MASKED_SUM = "        return jnp.sum(self._losses(ctx, params, logits, labels)[0])\n"


def mutant(module, old: str, new: str):
    source = inspect.getsource(module)
    assert source.count(old) == 1, f"not found exactly once in {module.__name__}: {old!r}"
    copy = types.ModuleType(module.__name__ + "_mutant")
    sys.modules[copy.__name__] = copy  # dataclasses look their module up
    exec(compile(source.replace(old, new), f"<mutant of {module.__name__}>", "exec"), copy.__dict__)
    return copy


def gpt_build(old: str, new: str):
    """``build`` whose GPT's loss comes from a mutated copy of models/networks/_lm.py."""
    lm = mutant(_lm, old, new).LanguageModel
    cls = type("MutantGpt", (gpt.Gpt,), {"loss_sum": lm.loss_sum, "_losses": lm._losses})

    def build(*args, model, **kwargs):
        return _train.build(*args, model=cls(**{f: getattr(model, f) for f in FIELDS}), **kwargs)

    return build


FIELDS = ("vocab_size", "d_model", "num_heads", "num_layers", "context", "d_ff", "init_scale")


def wrong_role_plan():
    """The block's MLP roles swapped: up row-parallel, down column-parallel."""
    plan = GPT.plan()
    plan["blocks"][0] = {**plan["blocks"][0], "up": models.ROW, "down": models.COLUMN}
    return plan


CASES = [("fsdp_tp", "4x2"), ("2d", "2x4"), ("fsdp_sp", "4x2"), ("dp", "data8")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_unmutated_copies_pass(case):
    check_gpt_trajectory(*case, "sgd", build=training("local", LOCAL_TARGETS, LOCAL_TARGETS).build)
    check_gpt_trajectory(*case, "sgd", build=gpt_build(SPLIT_LOSS, SPLIT_LOSS))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_loss_averaged_locally_is_caught(case):
    wrong = LOCAL_TARGETS.replace("self._global_batch(y.shape[0] * microbatches)", "y.shape[0]")
    build = training("local", LOCAL_TARGETS, wrong).build
    with pytest.raises(AssertionError):
        check_gpt_trajectory(*case, "sgd", build=build)
    jax.clear_caches()


@pytest.mark.parametrize("case", [("dp", "data8"), ("2d", "2x4")], ids=lambda c: c[0])
def test_padding_labels_in_the_train_loss_are_caught(case):
    """The train loss summing every position, PAD_LABEL ones too (a label of −1 wraps to the
    last token unsplit and matches no device's columns split): the reference's padded
    positions add nothing, so the trajectory differs, under every layout."""
    unmasked = (
        "        split = ctx.is_split(self.output_layer(params))\n        return jnp.sum("
        "ctx.cross_entropy(logits, labels, split=split, vocab_size=self.vocab_size))\n"
    )
    with pytest.raises(AssertionError, match=r"max \|loss − reference\|"):
        check_gpt_trajectory(*case, "sgd", build=gpt_build(MASKED_SUM, unmasked))
    jax.clear_caches()


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "dp"], ids=lambda c: c[0])
def test_dropped_vocab_reduction_is_caught(case):
    """The loss computed as if each device held the whole vocabulary: the max, Σ exp and
    target-logit AllReduces over model are dropped. check_vma refuses it when the step traces
    (the loss varies over model but leaves the mesh as one value); only that verdict counts."""
    build = gpt_build(SPLIT_LOSS, SPLIT_LOSS.replace("split=split", "split=False"))
    with pytest.raises((AssertionError, ValueError)) as caught:
        check_gpt_trajectory(*case, "sgd", build=build)
    if isinstance(caught.value, ValueError):
        assert "out_specs" in str(caught.value), caught.value
    jax.clear_caches()


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "dp"], ids=lambda c: c[0])
def test_plan_with_one_wrong_role_is_caught(case):
    """A wrong role never trains silently: the kernels' shape checks refuse it, or the
    trajectory differs."""
    with pytest.raises((AssertionError, ValueError)):
        check_gpt_trajectory(*case, "sgd", plan=wrong_role_plan())
    jax.clear_caches()


# --- changes to the step that the budget traced from the step cannot see -------------------
# Each mutant changes what one train step communicates: a collective added, one pattern for
# another, a reduction in bfloat16. The comparison the suite made (the compiled step against
# the budget traced from the same step) passes under each; the hand-written budget
# (tests/_lm_budgets.py) does not.

SUM_EXP = (
    "    sum_exp = all_reduce(jnp.sum(jnp.exp(shifted), axis=-1), axis_name, reason=_LOSS)  # [...]"
)
TARGET = "    target = all_reduce(jnp.where(owns, picked, 0.0), axis_name, reason=_LOSS)  # [...]"
ROW_PSUM = "                y = reduce_from_region(y_partial, axis_name)  # y[B, D]"
GRAD_PSUM = (
    "                value = shardops.comm.copy_to_region(value, axes, self.precision.accum_dtype)"
)

# name → (module, line, replacement, strategy, mesh, in bfloat16)
BUDGET_MUTANTS = {
    # The target logit summed in two AllReduces (even and odd labels): the same numbers, one
    # AllReduce of [16, 16] float32 more.
    "loss_target_in_two_psums": (_cross_entropy, TARGET, (
        "    even = labels % 2 == 0  # [...]\n"
        "    target = (all_reduce(jnp.where(owns & even, picked, 0.0), axis_name, reason=_LOSS)\n"
        "              + all_reduce(jnp.where(owns & ~even, picked, 0.0), axis_name, reason=_LOSS))"
    ), "tp", "2x2x2", False),
    # The row-parallel AllReduce as a ReduceScatter then an AllGather: the same numbers and the
    # same ring bytes per device, other collectives.
    "row_psum_as_scatter_and_gather": (_dense_kernels, ROW_PSUM, (
        "                last = y_partial.ndim - 1  # the features: D divides by model\n"
        "                y = lax.all_gather(reduce_scatter_from_region(y_partial, axis_name, last),\n"
        "                                   axis_name, axis=last, tiled=True, to='invarying')"
    ), "tp", "2x2x2", False),
    # The vocab-parallel Σ exp reduced in bfloat16.
    "loss_sum_exp_in_bf16": (_cross_entropy, SUM_EXP, (
        "    sum_exp = all_reduce(jnp.sum(jnp.exp(shifted), axis=-1).astype(jnp.bfloat16),\n"
        "                         axis_name, reason=_LOSS).astype(jnp.float32)"
    ), "tp", "2x2x2", True),
    # The row-parallel layers' partial sums reduced in bfloat16.
    "row_psum_in_bf16": (_dense_kernels, ROW_PSUM, (
        "                y = reduce_from_region(y_partial.astype(jnp.bfloat16),\n"
        "                                       axis_name).astype(y_partial.dtype)"
    ), "tp", "2x2x2", True),
    # dp's gradient AllReduce (the transpose of copy_to_region) in bfloat16.
    "dp_grads_reduced_in_bf16": (parallel, GRAD_PSUM, (
        "                value = shardops.comm.copy_to_region(value, axes, jax.numpy.bfloat16).astype(\n"
        "                    value.dtype)"
    ), "dp", "data8", True),
}  # fmt: skip


@pytest.fixture
def swap_budget_mutant(monkeypatch):
    """Swap in the mutated (or the unmutated, ``replacement=None``) copy of a module's kernel
    where the strategies call it."""

    def swap(name, mutated: bool):
        module, line, new, *_ = BUDGET_MUTANTS[name]
        copy = line_mutant(module, name, line, new if mutated else line)
        if module is _cross_entropy:
            monkeypatch.setattr(shardops.layers, "vocab_parallel_cross_entropy_kernel",
                                copy.vocab_parallel_cross_entropy_kernel)  # fmt: skip
        elif module is _dense_kernels:
            for holder in (shardops.layers, shardops.layers._mlp):
                monkeypatch.setattr(holder, "row_parallel_dense_kernel",
                                    copy.row_parallel_dense_kernel)  # fmt: skip
        else:
            monkeypatch.setattr(parallel.Parallel, "_materialise", copy.Parallel._materialise)
        jax.clear_caches()

    yield swap
    jax.clear_caches()


def compiled_gpt_step(strategy, mesh_name):
    """The GPT's setup and its compiled train step (SGD, the suite's batch shape)."""
    setup = models.build(strategy, mesh_for(MESHES[mesh_name]), optimizer=optimizer("sgd"),
                         model=GPT)  # fmt: skip
    return setup, setup.train_step.lower(*setup.abstract_step_args(BATCH, SEQ)).compile()


def self_referential_budget_check(setup, compiled) -> None:
    """The comparison the suite made: the compiled step's bytes per (kind, axes) against the
    budget traced from that same step, as the backend runs it (``budget().totals()``: XLA:CPU
    runs a bfloat16 collective in float32; on GPU and TPU, and for any float32 program, it is
    ``collective_budget``, which ``check_budget`` reads)."""
    moved = shardops.inspect.Ledger(setup.mesh, tuple(shardops.inspect.collectives(
        setup.mesh, compiled)), ()).totals()  # fmt: skip
    assert moved == setup.budget(BATCH, SEQ).totals()


def budget_case(name):
    *_, strategy, mesh, _ = BUDGET_MUTANTS[name]
    return (GPT.name, strategy, mesh, "sgd", None, False)


@pytest.mark.parametrize(
    "names",
    [("loss_target_in_two_psums", "row_psum_as_scatter_and_gather"), ("dp_grads_reduced_in_bf16",)],
    ids=["tp", "dp"],
)  # every mutated module's copy; one compilation per case
def test_unmutated_copies_pass_the_hand_budget(swap_budget_mutant, names):
    for name in names:
        swap_budget_mutant(name, mutated=False)
    setup, compiled = compiled_gpt_step(*budget_case(names[0])[1:3])
    check_budget(setup, compiled, (BATCH, SEQ), budget_case(names[0]))


# By default one bfloat16 reduction per mutated module (the Llama's mutant reduces the row
# layer in bf16 too); every mutant under SHARDOPS_FULL=1.
DEFAULT_BUDGET_MUTANTS = [n for n in BUDGET_MUTANTS if FULL or n != "row_psum_in_bf16"]


@pytest.mark.parametrize("name", DEFAULT_BUDGET_MUTANTS)
def test_step_change_passes_the_traced_budget_but_not_the_hand_one(swap_budget_mutant, name):
    swap_budget_mutant(name, mutated=True)
    setup, compiled = compiled_gpt_step(*budget_case(name)[1:3])
    self_referential_budget_check(setup, compiled)  # the old comparison: passes
    bf16 = BUDGET_MUTANTS[name][-1]
    if bf16:  # check_budget's requested bytes differ only by XLA:CPU's promotion to float32
        with pytest.raises(AssertionError, match="the traced budget"):
            check_budget(setup, compiled, (BATCH, SEQ))
    else:
        check_budget(setup, compiled, (BATCH, SEQ))  # exactly the old check: passes
    with pytest.raises(AssertionError, match="bf16" if bf16 else "the traced step asks for"):
        check_hand_budget(budget_case(name), setup, compiled, (BATCH, SEQ))
