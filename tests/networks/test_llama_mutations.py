"""Mutants of the Llama's training path, each caught by the trajectory check against the
plain-jnp reference (tests/_gpt_checks.py), or refused by check_vma when the step traces (a
norm that varies over the mesh where the update needs one value): a tied head whose table gets
the gradient of one use only, and clipping by each device's norm of its own gradient shards."""

import jax
import pytest
from _gpt_checks import check_lm_trajectory
from _mutants import mutant
from test_llama import CLIP, GQA, SGD_LR, TIED_MQA

import shardops
from shardops import _clip
from shardops_models.strategies import parallel

TIED_LINE = "        w = table.T  # w[D, V(_model)]: the table's rows as output columns"
PSUM_LINE = "                squares = lax.psum(squares, axes)  # the whole arrays' sum of squares"
CASES = {"tied_head_counted_once": ("tp", "model8"), "clip_norm_per_shard": ("fsdp_tp", "4x2")}


@pytest.fixture
def swapped(monkeypatch):
    """Swap in a mutant: the tied head's method, or the clip transform."""

    def swap(name, mutated: bool):
        if name == "tied_head_counted_once":
            new = "        w = lax.stop_gradient(table).T  # the head's use adds no gradient"
            module = mutant(parallel, name, TIED_LINE, new if mutated else TIED_LINE)
            monkeypatch.setattr(parallel.Parallel, "tied_head", module.Parallel.tied_head)
        else:
            module = mutant(
                _clip, name, PSUM_LINE, "                pass" if mutated else PSUM_LINE
            )
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
