"""A mixture of experts under context parallelism: each device routes its own tokens, every
sequence's chunks i and 2N−1−i of 2N on it (S/N tokens, in order of position) one capacity group
(``C = ceil(capacity_factor · S/N · k / E)``), the global load balance and z-loss summed over
the context axis too (``ContextKind.moe_options``). The reference groups the positions itself
(``Llama._reference(context_shards=N)``: chunk c of 2N in group min(c, 2N−1−c)), so its
capacity rule is written apart from the layout the strategy uses. Trained like it (losses,
gradients, parameters) under cp alone and cp with ep and tp, the group form and dropless too;
the groups are seen (the whole sequence as one group, or N contiguous blocks, give other
logits); the global loss left unsummed over the context axis fails."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from _cover import FULL
from _gpt_checks import (
    CP_MESHES,
    EP_MESHES,
    PP_MESHES,
    TOL,
    check_lm_trajectory,
    lm_batches,
    mesh_for,
)

import shardops_models as models
from shardops_models import Experts, Llama

# Capacity 1.5, not test_moe_llama's 1.0: a group under cp holds S/N tokens, and at 1.0 the
# smaller groups drop so many choices (21 % at N = 4) that the reference's mlp_norm scales move
# less in 5 steps than the check needs to see a zeroed gradient (3.3e-4 < 100 × tol). At 1.5
# they still drop (test_capacity_drops_choices_under_cp).
MOE = Llama(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=32,
            context=16, experts=Experts(num_experts=4, k=2, capacity_factor=1.5))  # fmt: skip
GROUP = dataclasses.replace(MOE, experts=dataclasses.replace(MOE.experts, load_balance="group"))
DROPLESS = dataclasses.replace(MOE, experts=dataclasses.replace(MOE.experts, capacity_factor=None))
MESHES = {**CP_MESHES, **EP_MESHES, **PP_MESHES}


def _shards(strategy, mesh: str) -> int:
    """The devices of the strategy's context axis on the mesh: the reference's groups."""
    return MESHES[mesh][models.strategy_named(strategy).cp]


# cp alone (the global load balance summed over data × context) and cp with ep and tp on a
# 3-axis mesh (the group form; the tokens over expert × context), each under both optimizers;
# dropless under cp with Adam. Under SHARDOPS_FULL=1 also dropless with SGD, the group form
# beside dp and tp, sp inside each context block, the all-gather attention and the stages of a
# pipeline (one microbatch), each under both.
MAIN = [(MOE, "dp+ring", "2x4c"), (GROUP, "tp+ep+ring", "e2c2m2")]
EXTRA = [(DROPLESS, "2d+ring", "2x2x2c"), (GROUP, "2d+ring", "2x2x2c"),
         (MOE, "dp_sp+ring", "2x2x2c"), (MOE, "tp+ep+allgather", "e2c2m2"),
         (GROUP, "tp+1f1b+ring", "p2c2m2")]  # fmt: skip
CASES = [(case, opt) for case in MAIN + EXTRA for opt in ("sgd", "adam")
         if case in MAIN or FULL or (case is EXTRA[0] and opt == "adam")]  # fmt: skip


def _case_id(case) -> str:
    """``<load balance or dropless>-<strategy>-<mesh>`` of a case, or the optimizer."""
    if not isinstance(case, tuple):
        return case
    model, strategy, mesh = case
    form = "dropless" if model.experts.capacity_factor is None else model.experts.load_balance
    return f"{form}-{strategy}-{mesh}"


@pytest.mark.parametrize(("case", "opt"), CASES, ids=_case_id)
def test_experts_under_context_parallelism_train_like_the_reference(case, opt):
    """(As tests/networks/test_moe_llama.py: SGD at 2, gradients held to 1e-5.) The compiled
    step's collectives equal the traced budget: the ring's permutes, ep's AllToAlls and the
    global load balance's AllReduce over the batch and context axes."""
    model, strategy, mesh = case
    tol = {**TOL[opt], "grads": 1e-5}
    check_lm_trajectory(model, strategy, mesh, opt, tol=tol, budget=True, sgd_lr=2.0,
                        context_shards=_shards(strategy, mesh))  # fmt: skip


def test_the_cases_cover_cp_alone_and_with_ep_under_both_optimizers():
    pairs = {(c[0][1], c[1]) for c in CASES}
    assert {("dp+ring", "sgd"), ("dp+ring", "adam"), ("tp+ep+ring", "sgd"),
            ("tp+ep+ring", "adam")} <= pairs  # fmt: skip
    assert {c[0][0].experts.load_balance for c in CASES} == {"global", "group"}
    assert any(c[0][0].experts.capacity_factor is None for c in CASES)


def _contiguous_reference():
    """The reference whose capacity groups are N contiguous blocks of S/N positions (a layout
    that is not cp's): ``Llama`` of a mutated ``models/networks/llama.py``."""
    from _mutants import mutant

    from shardops_models.networks import llama

    line = "    return np.minimum(chunk, 2 * n - 1 - chunk).astype(np.int32)\n"
    copy = mutant(llama, "contiguous_groups", line, "    return (chunk // 2).astype(np.int32)\n")
    fields = {f.name: getattr(MOE, f.name) for f in dataclasses.fields(MOE)}
    return copy.Llama(**{**fields, "experts": copy.Experts(**dataclasses.asdict(MOE.experts))})


def test_capacity_drops_choices_under_cp():
    """At the checks' inputs, each device's groups drop choices (else the groups could not be
    seen), and other ones than the whole sequences would (the same params and tokens)."""
    params, ids = MOE.init(jax.random.key(0)), lm_batches(MOE)[0][0]
    dropped = {n: np.asarray(jax.jit(functools.partial(MOE.expert_stats, context_shards=n))(
        params, ids)["dropped"]) for n in (1, 2, 4)}  # dropped[L, E]  # fmt: skip
    assert dropped[4].max() > 0 and dropped[2].max() > 0, dropped
    assert not np.array_equal(dropped[4], dropped[1]), "cp's groups drop what S's would"


def test_each_devices_chunks_are_its_capacity_groups():
    """``setup.logits`` under dp+ring (context 4) are the reference's with 4 groups of cp's
    load-balanced chunks per sequence, and differ by far more from the reference's whole
    sequence as one group (a layer that gathered the sequence, as sp does) and from N
    contiguous blocks (chunks not balanced)."""
    setup = models.build("dp+ring", mesh_for(CP_MESHES["2x4c"]), model=MOE,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    params, ids = MOE.init(jax.random.key(0)), lm_batches(MOE)[0][0]
    logits = np.asarray(setup.logits(setup.shard(params).params, setup.place_batch(ids)))
    want = np.asarray(MOE.reference_logits(params, ids, context_shards=4))
    np.testing.assert_allclose(logits, want, rtol=0, atol=2e-6)
    others = {"whole": MOE.reference_logits(params, ids),
              "contiguous": _contiguous_reference().reference_logits(params, ids, context_shards=4)}  # fmt: skip
    for name, other in others.items():
        assert np.max(np.abs(logits - np.asarray(other))) > 1e-3, f"{name} groups: the same"


def test_the_global_load_balance_not_summed_over_the_context_axis_fails(monkeypatch):
    """Mutant: ``ContextKind.moe_options`` leaves the batch axes as they are, so each
    device's global load balance and z-loss count only its chunk of the sequences (the mean
    over the context axis of per-chunk losses, not the whole batch's): the loss is off."""
    from _mutants import mutant

    from shardops_models.strategies import context, layout

    line = '        return {**options, "batch_axes": (*options["batch_axes"], self.axis)}\n'
    copy = mutant(context, "moe_unsummed_over_cp", line, "        return options\n")
    monkeypatch.setattr(layout, "ContextKind", copy.ContextKind)
    with pytest.raises(AssertionError, match=r"max \|loss − reference\|"):
        check_lm_trajectory(MOE, "dp+ring", "2x4c", "sgd", tol={**TOL["sgd"], "grads": 1e-5},
                            sgd_lr=2.0, context_shards=4)  # fmt: skip


@pytest.mark.parametrize(("n", "got", "expected", "fix"), [
    (0, "context_shards=0", "a positive int", "Pass 1 (no context parallelism)"),
    (3, "S = 16 does not divide by 6", "2 × 3 = 6 equal chunks", "a multiple of 6 tokens"),
], ids=["not-positive", "chunks-not-dividing-S"])  # fmt: skip
def test_the_reference_refuses_groups_the_sequence_cannot_hold(n, got, expected, fix):
    from _messages import refused

    params, ids = MOE.init(jax.random.key(0)), np.zeros((2, 16), np.int32)
    with refused(ValueError, argument="context_shards", got=got, expected=expected, fix=fix):
        MOE.reference_logits(params, ids, context_shards=n)
