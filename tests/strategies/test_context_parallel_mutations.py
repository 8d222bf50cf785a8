"""Mutation check for context parallelism in the strategies: a loss summed over the batch shards
but not the sequence's, tokens taken in contiguous blocks instead of the load-balanced layout,
and logits not put back in token order are each caught by the suite's checks (the trajectory
against the plain-jnp reference, evaluation and logits against it), while the unmutated copies
pass."""

import pytest
from _gpt_checks import check_lm_trajectory
from _mutants import mutant, training
from test_context_parallel import (
    LMS,
    test_an_empty_or_short_sequence_is_refused_with_a_length_that_fits,
    test_evaluate_and_logits_equal_the_reference_with_padding,
)

import shardops_models as models
from shardops_models.strategies import context, layout, parallel
from shardops_models.training import _train

MUTANTS = {
    # The loss and metrics summed over the batch axes only: each device's share of the sequence.
    "loss_not_summed_over_the_sequence": (
        _train,
        "        self.reduce_axes = strategy.reduce_axes  # the batch's and the sequence's",
        "        self.reduce_axes = strategy.batch_axes  # the batch's and the sequence's",
    ),
    # Each device's tokens as one contiguous block, while attention assumes the balanced layout.
    "contiguous_tokens": (
        context,
        "        return jnp.take(tokens, context.positions(seq // n), axis=SEQUENCE_DIM)",
        "        return lax.dynamic_slice_in_dim(tokens, lax.axis_index(context.axis_name) * (seq "
        "// n), seq // n, axis=SEQUENCE_DIM)",
    ),
    # The logits gathered over context but left in the layout's order.
    "logits_not_in_token_order": (
        context,
        "        return logits[:, shardops.layers.inverse_order(logits.shape[1], n)]",
        "        return logits",
    ),
}


def build_with(name, mutated: bool = True, monkeypatch=None):
    """``build`` from copies of the modules, ``name``'s line replaced (or, unmutated, kept); a
    line of the context kind (``models/strategies/context.py``) reaches ``build`` through the
    strategies' ``ContextKind``, swapped with ``monkeypatch``."""
    module, line, replacement = MUTANTS[name]
    replacement = replacement if mutated else line
    if module is context:
        monkeypatch.setattr(
            layout, "ContextKind", mutant(context, name, line, replacement).ContextKind
        )
        return models.build
    if module is _train:  # a line of one of models/training's modules
        return training(name, line, replacement).build
    mutated = mutant(parallel, name, line, replacement)
    return training(name, Parallel=mutated.Parallel, wrap=mutated.wrap).build


def test_unmutated_copies_pass(monkeypatch):
    for name in ("loss_not_summed_over_the_sequence", "contiguous_tokens"):
        check_lm_trajectory(LMS["gpt"], "2d+ring", "2x2x2c", "sgd",
                            build=build_with(name, mutated=False, monkeypatch=monkeypatch))  # fmt: skip


# A loss left varying over context fails shard_map's check of the step's outputs when it traces
# (check_vma); contiguous tokens train to a different loss than the reference's.
@pytest.mark.parametrize(("name", "error", "match"), [
    ("loss_not_summed_over_the_sequence", ValueError, "possibly varying over {context}"),
    ("contiguous_tokens", AssertionError, "reference"),
])  # fmt: skip
def test_trajectory_catches(monkeypatch, name, error, match):
    build = build_with(name, monkeypatch=monkeypatch)
    with pytest.raises(error, match=match):
        check_lm_trajectory(LMS["gpt"], "2d+ring", "2x2x2c", "sgd", build=build)


def test_logits_in_the_token_order_pass_with_the_unmutated_context_kind(monkeypatch):
    monkeypatch.setattr(models, "build", build_with("logits_not_in_token_order", mutated=False,
                                                    monkeypatch=monkeypatch))  # fmt: skip
    test_evaluate_and_logits_equal_the_reference_with_padding("ring")


def test_logits_in_the_layouts_order_are_caught(monkeypatch):
    monkeypatch.setattr(models, "build", build_with("logits_not_in_token_order",
                                                    monkeypatch=monkeypatch))  # fmt: skip
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        test_evaluate_and_logits_equal_the_reference_with_padding("ring")


def test_the_batch_check_without_sequence_parallelism_is_caught(monkeypatch):
    """The batch check of sp+cp asking only 2 × context of the sequence: 12 tokens on 2 × 4
    pass it (and fail later, inside a layer, naming neither the batch nor a length that fits).
    The check is the context kind's (``models/strategies/context.py``)."""
    line = "            inner, mesh.shape[inner] if inner else 1,\n"
    kind = mutant(context, "cp_check_without_sp", line, "            None, 1,\n").ContextKind
    monkeypatch.setattr(layout, "ContextKind", kind)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_an_empty_or_short_sequence_is_refused_with_a_length_that_fits()


def test_the_unmutated_context_kind_refuses_the_short_sequence(monkeypatch):
    line = "            inner, mesh.shape[inner] if inner else 1,\n"
    kind = mutant(context, "cp_check_unmutated", line, line).ContextKind
    monkeypatch.setattr(layout, "ContextKind", kind)
    test_an_empty_or_short_sequence_is_refused_with_a_length_that_fits()
