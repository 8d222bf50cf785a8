"""Mutation check for the GPT under the strategies: a plan with one wrong role, a dropped
vocab-parallel reduction and a loss averaged locally are each caught by the trajectory check
(tests/_gpt_checks.py) against the plain-jnp reference, while the unmutated copies pass."""

import inspect
import sys
import types

import jax
import pytest
from _gpt_checks import GPT, check_gpt_trajectory

import shardops_models as models
from shardops_models.networks import _lm, gpt
from shardops_models.training import _train

LOCAL_TARGETS = "        targets = self._global_batch(y.shape[0]) * math.prod(y.shape[1:])\n"
SPLIT_LOSS = (
    "        return jnp.sum(ctx.cross_entropy(logits, labels, split=split, "
    "vocab_size=self.vocab_size))\n"
)


def mutant(module, old: str, new: str):
    source = inspect.getsource(module)
    assert source.count(old) == 1, f"not found exactly once in {module.__name__}: {old!r}"
    copy = types.ModuleType(module.__name__ + "_mutant")
    sys.modules[copy.__name__] = copy  # dataclasses look their module up
    exec(compile(source.replace(old, new), f"<mutant of {module.__name__}>", "exec"), copy.__dict__)
    return copy


def gpt_build(old: str, new: str):
    """``build`` whose GPT's loss comes from a mutated copy of models/networks/_lm.py."""
    cls = type("MutantGpt", (gpt.Gpt,), {"loss_sum": mutant(_lm, old, new).LanguageModel.loss_sum})

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
    check_gpt_trajectory(*case, "sgd", build=mutant(_train, LOCAL_TARGETS, LOCAL_TARGETS).build)
    check_gpt_trajectory(*case, "sgd", build=gpt_build(SPLIT_LOSS, SPLIT_LOSS))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_loss_averaged_locally_is_caught(case):
    build = mutant(_train, LOCAL_TARGETS, LOCAL_TARGETS.replace("self._global_batch(y.shape[0])",
                                                               "y.shape[0]")).build  # fmt: skip
    with pytest.raises(AssertionError):
        check_gpt_trajectory(*case, "sgd", build=build)
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
