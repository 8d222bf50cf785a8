"""Mutation check: known pipeline bugs (circular ones among them), each one exact line of a copy of
shardops/pipeline/_executor.py or _schedule.py (``tests/_mutants.py``), are caught by
``check_pipeline`` (values against the unsharded gradients, the phases, the pipe collectives)
or refused by ``Schedule.check``; the unmutated copies pass the same cases."""

from __future__ import annotations

import pytest
from _mutants import mutant
from _pipeline_checks import check_pipeline

from shardops.pipeline import _executor, _schedule

BACKWARD_PAIRS = "        pairs = self._pairs(phase, -1)"
FORWARD_PAIRS = "        pairs = self._pairs(phase, +1)"
NEXT_SLOT_LINE = (
    "        h = lax.dynamic_index_in_dim(self.buffer, self._slot(i, v), 0, keepdims=False)"
)

# name → (line, replacement, (schedule, P, M, data[, V]))
MUTANTS = {
    # the input's gradient goes on to the next stage instead of back to the previous one
    "gradient_sent_forward": (
        BACKWARD_PAIRS,
        "        pairs = [(b, a) for a, b in self._pairs(phase, -1)]",
        ("gpipe", 2, 2, 2),
    ),
    # the gradient of stage s's input sent to stage s + 1 (the last stage's to stage 0)
    "gradient_sent_to_a_shifted_stage": (
        BACKWARD_PAIRS,
        "        pairs = [(a, (a + 1) % self.stages) for a, _ in self._pairs(phase, -1)]",
        ("1f1b", 4, 4, 2),
    ),
    # the activation skips a stage: stage s sends to s + 2 (the last stages' wrap around)
    "activation_sent_two_stages_on": (
        FORWARD_PAIRS,
        "        pairs = [(a, (a + 2) % self.stages) for a, _ in self._pairs(phase, +1)]",
        ("1f1b", 4, 4, 2),
    ),
    # circular: a lap's end (stage P − 1) not sent on to stage 0 for the next lap
    "lap_end_not_sent_on": (
        "            if not (edge and v == end):",
        "            if not edge:",
        ("circular", 2, 2, 2, 2),
    ),
    # circular: a stage runs its next chunk's layers (a neighbouring virtual stage's)
    "neighbouring_chunk_applied": (
        "        out = self.stage_fn(params, h, microbatch, first, last, with_loss, v)",
        "        out = self.stage_fn(params, h, microbatch, first, last, with_loss, "
        "(v + 1) % self.virtual)",
        ("circular", 4, 4, 2, 2),
    ),
    # circular, the executor cutting the chunks: the next virtual stage's chunk cut
    "executor_cuts_the_neighbouring_chunk": (
        "            return lax.dynamic_slice_in_dim(q, v * n + _tie(g), n, 0)",
        "            return lax.dynamic_slice_in_dim(q, (v + 1) % self.virtual * n + _tie(g), n, 0)",
        ("circular", 2, 2, 2, 2, "chunks"),
    ),
    # the table's last round (stage 0's backward of the last microbatch) never runs
    "last_round_skipped": (
        "    for forward, backward in schedule.rounds:",
        "    for forward, backward in schedule.rounds[:-1]:",
        ("1f1b", 2, 3, 1),
    ),
    # the last microbatch's backward masked out on every stage (its gradients not added)
    "last_microbatch_backward_masked": (
        NEXT_SLOT_LINE,
        NEXT_SLOT_LINE + "\n        runs = runs & (i < len(jax.tree.leaves(self.inputs)[0]) - 1)",
        ("gpipe", 4, 3, 2),
    ),
    # the gradients accumulated (and the replicated ones summed over pipe) in bfloat16
    "accumulation_in_bfloat16": (
        "                            activation, accum_dtype=jnp.float32, chunks=None):  # fmt: skip",
        "                            activation, accum_dtype=jnp.bfloat16, chunks=None):  # fmt: skip",
        ("1f1b", 2, 5, 4),
    ),
    # the backward recomputes the forward from another microbatch's stage input
    "backward_from_the_next_slot": (
        NEXT_SLOT_LINE,
        "        h = lax.dynamic_index_in_dim(self.buffer, self._slot(i + 1, v), 0, "
        "keepdims=False)",
        ("1f1b", 4, 9, 2),
    ),
    # circular: the backward recomputes from the other virtual stage's kept input
    "backward_from_the_other_chunk_slot": (
        NEXT_SLOT_LINE,
        "        h = lax.dynamic_index_in_dim(self.buffer, self._slot(i, (v + 1) % self.virtual), "
        "0, keepdims=False)",
        ("circular", 2, 4, 2, 2),
    ),
    # every stage's loss seeded in the backward: the non-last stages' (unmasked in the toy)
    # add their gradients
    "every_stage_loss_seeded": (
        "        seeds = [_like(self.returned, h_out), _seed(last & runs, loss)]",
        "        seeds = [_like(self.returned, h_out), _seed(runs, loss)]",
        ("1f1b", 4, 4, 2),
    ),
    # every stage's loss counted, not only the last one's (circular: the last stage's every
    # chunk's, not its last chunk's alone)
    "loss_of_every_stage": (
        "        counted = jnp.where(last & runs, loss.astype(accum), 0)",
        "        counted = jnp.where(runs, loss.astype(accum), 0)",
        ("gpipe", 2, 1, 4),
    ),
    "loss_of_every_chunk_of_the_last_stage": (
        "                (self.stage == self.stages - 1) & (v == self.virtual - 1))  # fmt: skip",
        "                (self.stage == self.stages - 1))  # fmt: skip",
        ("circular", 2, 2, 2, 2),
    ),
}


def _check(case, **modules):
    name, p, m, data, *rest = case
    virtual = rest[0] if rest else 1
    return check_pipeline(name, p, m, data, virtual=virtual, chunks="chunks" in rest, **modules)


@pytest.mark.parametrize("name", MUTANTS)
def test_executor_mutant_is_caught(name):
    line, replacement, case = MUTANTS[name]
    module = mutant(_executor, name, line, replacement)
    with pytest.raises(AssertionError):
        _check(case, executor=module)


def test_unmutated_executor_copy_passes():
    module = mutant(_executor, "unmutated", BACKWARD_PAIRS, BACKWARD_PAIRS)
    for case in {case for _, _, case in MUTANTS.values()}:
        _check(case, executor=module)


ONE_F_ONE_B = (
    '    return _table("1f1b", p, m, lambda i, u, s: i + s, lambda i, u, s: i + 2 * (p - 1) - s)'
)
CIRCULAR = (
    "                  lambda i, u, s: k_back(i, u) + (p - 1 - s) + (v * p - 1), v)  # fmt: skip"
)


def test_one_f_one_b_warm_up_one_round_short_is_refused():
    """1F1B's backward a round early: the last stage would run a microbatch backward in the
    round before its forward arrives; ``check`` refuses the table, so no program runs it."""
    module = mutant(_schedule, "warm_up_short", ONE_F_ONE_B, ONE_F_ONE_B[:-1] + " - 1)")
    for p, m in ((2, 1), (4, 4), (8, 17)):
        with pytest.raises(ValueError, match="runs backward on the last stage in round"):
            module.one_f_one_b(p, m)
    with pytest.raises(ValueError, match="before its forward"):
        check_pipeline("1f1b", 2, 2, 2, schedules=module)


def test_unmutated_schedule_copy_passes():
    module = mutant(_schedule, "unmutated", ONE_F_ONE_B, ONE_F_ONE_B)
    check_pipeline("1f1b", 2, 2, 2, schedules=module)


def test_circular_warm_up_one_round_short_is_refused():
    module = mutant(
        _schedule, "circular_short", CIRCULAR, CIRCULAR.replace("v * p - 1", "v * p - 2")
    )
    for p, m, v in ((2, 2, 2), (4, 8, 2), (2, 4, 3)):
        with pytest.raises(ValueError, match="runs backward on the last stage in round"):
            module.circular(p, m, v)
    module = mutant(_schedule, "unmutated", CIRCULAR, CIRCULAR)
    check_pipeline("circular", 2, 2, 2, virtual=2, schedules=module)
