"""shardops.pipeline's schedules as tables: GPipe and 1F1B on P ∈ {2, 4, 8} stages and
M ∈ {1, P, 2P + 1} microbatches take 2(M + P − 1) time steps, idle (P − 1)/(M + P − 1) of
them, run every (microbatch, stage) forward and backward once in dependency order, and hold the
stage inputs each schedule promises (GPipe M, 1F1B min(M, 2(P − s) − 1) on stage s), each
counted here from the table's time steps, not from the schedule's own formulas; ``render``'s
text; and ``check``'s refusals of broken tables."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from _messages import refused

from shardops.pipeline import SCHEDULES, Schedule, gpipe, one_f_one_b, schedule

CASES = [(name, p, m) for name in SCHEDULES for p in (2, 4, 8) for m in (1, p, 2 * p + 1)]
_CELL = re.compile(r"^([FB])(\d+)$")


def _events(sched: Schedule) -> dict[tuple[str, int, int], list[int]]:
    """``{(phase, microbatch, stage): [time steps]}`` read from ``steps()``'s cells."""
    found: dict[tuple[str, int, int], list[int]] = {}
    for t, step in enumerate(sched.steps()):
        assert len(step) == sched.stages, (t, step)
        for s, cell in enumerate(step):
            if cell == ".":
                continue
            phase, i = _CELL.match(cell).groups()
            found.setdefault((phase, int(i), s), []).append(t)
    return found


def _held(sched: Schedule, stage: int) -> int:
    """The most stage inputs ``stage`` holds at once, by walking its row of the time steps: an
    input is held from its forward to the end of its backward."""
    held, most = set(), 0
    for step in sched.steps():
        cell = step[stage]
        if cell.startswith("F"):
            held.add(cell)
        most = max(most, len(held))
        if cell.startswith("B"):
            held.remove("F" + cell[1:])
    assert not held
    return most


@pytest.mark.parametrize("name, p, m", CASES)
def test_bubble_steps_and_dependencies(name, p, m):
    sched = schedule(name, p, m)
    assert (sched.name, sched.stages, sched.microbatches) == (name, p, m)
    steps = sched.steps()
    assert len(steps) == 2 * (m + p - 1)
    cells = [c for step in steps for c in step]
    bubble = Fraction(p - 1, m + p - 1)
    assert Fraction(cells.count("."), len(cells)) == bubble
    assert sched.idle_fraction() == sched.bubble() == float(bubble)
    # every stage is idle in exactly 2(P − 1) steps
    assert all([step[s] for step in steps].count(".") == 2 * (p - 1) for s in range(p))
    events = _events(sched)
    assert set(events) == {(f, i, s) for f in "FB" for i in range(m) for s in range(p)}
    assert all(len(ts) == 1 for ts in events.values()), "a (microbatch, stage) ran twice"
    at = {k: ts[0] for k, ts in events.items()}
    for i in range(m):
        for s in range(p - 1):
            assert at["F", i, s] < at["F", i, s + 1]  # the activation goes on …
            assert at["B", i, s + 1] < at["B", i, s]  # … and its gradient comes back
        assert at["F", i, p - 1] < at["B", i, p - 1]  # the loss's backward after its forward
    for s in range(p):  # each stage runs its microbatches in order, in each phase
        for f in "FB":
            assert [at[f, i, s] for i in range(m)] == sorted(at[f, i, s] for i in range(m))


@pytest.mark.parametrize("name, p, m", CASES)
def test_stage_inputs_held(name, p, m):
    sched = schedule(name, p, m)
    promised = [m if name == "gpipe" else min(m, 2 * (p - s) - 1) for s in range(p)]
    assert [_held(sched, s) for s in range(p)] == promised
    assert [sched.in_flight(s) for s in range(p)] == promised
    assert sched.buffer_slots == max(promised)


def test_one_f_one_b_holds_fewer_than_gpipe_once_m_exceeds_2p_minus_1():
    for p in (2, 4, 8):
        m = 4 * p
        assert one_f_one_b(p, m).buffer_slots == 2 * p - 1 < gpipe(p, m).buffer_slots == m


def test_render_pins_the_table():
    assert gpipe(2, 3).render() == (
        "gpipe: P=2 stages, M=3 microbatches\n"
        "stage 0: F0 F1 F2  .  . B0 B1 B2\n"
        "stage 1:  . F0 F1 F2 B0 B1 B2  ."
    )
    assert one_f_one_b(3, 4).render() == (
        "1f1b: P=3 stages, M=4 microbatches\n"
        "stage 0: F0 F1 F2  . F3  .  . B0  . B1 B2 B3\n"
        "stage 1:  . F0 F1  . F2 B0 F3 B1  . B2 B3  .\n"
        "stage 2:  .  . F0 B0 F1 B1 F2 B2 F3 B3  .  ."
    )
    wide = one_f_one_b(2, 11).render().splitlines()
    assert wide[1].startswith("stage 0:  F0  F1 ") and wide[1].endswith(" B9 B10")


def test_schedule_by_name_is_the_maker():
    assert schedule("gpipe", 4, 5) == gpipe(4, 5)
    assert schedule("1f1b", 4, 5) == one_f_one_b(4, 5)
    assert gpipe(4, 5) != one_f_one_b(4, 5)


# --- refusals of broken tables: P = 2 stages, M = 1 or 2 microbatches, rounds written out


def _round(forward, backward):
    return (tuple(forward), tuple(backward))


N = None
GOOD = (_round((0, N), (N, N)), _round((N, 0), (N, 0)), _round((N, N), (0, N)))  # 1f1b(2, 1)


def test_the_written_out_table_is_1f1b():
    assert Schedule("1f1b", 2, 1, GOOD) == one_f_one_b(2, 1)


def test_forward_hop_of_two_rounds_is_refused():
    rounds = (_round((0, N), (N, N)), _round((N, N), (N, N)), _round((N, 0), (N, 0)),
              _round((N, N), (0, N)))  # fmt: skip
    with refused(ValueError, argument="microbatch 0 runs forward on stage 0 in round 0",
                 got="on stage 1 in round 2", expected="a hop takes exactly one round",
                 fix="Run it forward on stage 1 in round 1"):  # fmt: skip
        Schedule("late", 2, 1, rounds)


def test_backward_hop_of_two_rounds_is_refused():
    rounds = (*GOOD[:2], _round((N, N), (N, N)), _round((N, N), (0, N)))
    with refused(ValueError, argument="microbatch 0 runs backward on stage 1 in round 1",
                 got="on stage 0 in round 3", expected="a hop takes exactly one round",
                 fix="Run it backward on stage 0 in round 2"):  # fmt: skip
        Schedule("late", 2, 1, rounds)


def test_microbatch_run_twice_is_refused():
    rounds = (*GOOD, _round((0, N), (N, N)))
    with refused(ValueError, argument="round 3 runs microbatch 0 forward on stage 0",
                 got="which ran in round 0 already", expected="each runs once",
                 fix="Remove one of the two"):  # fmt: skip
        Schedule("twice", 2, 1, rounds)


def test_microbatch_never_run_is_refused():
    # microbatch 1 of 2 runs forward everywhere but never backward on stage 0
    rounds = (_round((0, N), (N, N)), _round((1, 0), (N, 0)), _round((N, 1), (0, 1)))
    with refused(ValueError, argument="microbatch 1 never runs backward on stage 0",
                 got="(1 such pairs)", expected="each runs once on every stage",
                 fix="Add it to a round"):  # fmt: skip
        Schedule("missing", 2, 2, rounds)


def test_microbatch_out_of_range_is_refused():
    rounds = (*GOOD, _round((N, N), (N, 5)))
    with refused(ValueError, argument="round 3 runs microbatch 5 backward on stage 1",
                 got="microbatch 5", expected="not one of the 1 microbatches 0..0",
                 fix="Name one of those"):  # fmt: skip
        Schedule("range", 2, 1, rounds)


def test_backward_before_forward_on_the_last_stage_is_refused():
    # the hops are one round each way, but the last stage's backward precedes its forward
    rounds = (_round((0, N), (N, 0)), _round((N, 0), (0, N)))
    with refused(ValueError, argument="microbatch 0 runs backward on the last stage",
                 got="in round 0", expected="before its forward (round 1)",
                 fix="Run its backward there in round 1 or later"):  # fmt: skip
        Schedule("early", 2, 1, rounds)


def test_wrong_stage_count_is_refused():
    rounds = (_round((0, N, N), (N, N, N)), *GOOD[1:])
    with refused(ValueError, argument="round 0 names 3 and 3 stages", got="3 and 3 stages",
                 expected="the schedule has 2",
                 fix="Give each phase one entry per stage (None where it idles)"):  # fmt: skip
        Schedule("wide", 2, 1, rounds)


def test_empty_schedule_is_refused():
    with refused(ValueError, argument="needs stages >= 1 and microbatches >= 1",
                 got="got 2 and 0", expected="microbatches >= 1", fix="Pass positive ints"):  # fmt: skip
        Schedule("empty", 2, 0, ())


@pytest.mark.parametrize("maker", [gpipe, one_f_one_b])
@pytest.mark.parametrize("stages, microbatches, argument, got", [
    (0, 4, "stages", "0"), (2, 0, "microbatches", "0"), (2.0, 4, "stages", "2.0"),
    (True, 4, "stages", "True"), (2, -1, "microbatches", "-1"),
])  # fmt: skip
def test_sizes_are_refused(maker, stages, microbatches, argument, got):
    with refused(ValueError, argument=f"{argument} must be", got=f"got {got}",
                 expected="a positive int", fix="Pass an int >= 1"):  # fmt: skip
        maker(stages, microbatches)


def test_unknown_schedule_is_refused():
    with refused(ValueError, argument="schedule:", got="unknown schedule 'nope'",
                 expected=repr(SCHEDULES), fix="choose one of"):  # fmt: skip
        schedule("nope", 2, 4)


def test_microbatches_held_at_once_in_one_buffer_slot_are_refused():
    """Backwards out of the forwards' order (the last stage's: 1, 2, 3, 0, 4) hold 4 stage
    inputs at most, so microbatches 0 and 4 share slot 0 of 4, and 4's forward (round 5) would
    overwrite 0's input before 0's backward reads it in the same round."""
    p, last = 2, {1: 2, 2: 3, 3: 4, 0: 5, 4: 6}
    rounds = []
    for r in range(8):
        forward = tuple(next((i for i in range(5) if i + s == r), None) for s in range(p))
        backward = tuple(next((i for i in range(5) if last[i] + (p - 1 - s) == r), None)
                         for s in range(p))  # fmt: skip
        rounds.append((forward, backward))
    with refused(ValueError, argument="microbatches 0 and 4", got="held at once",
                 expected="share buffer slot 0 of 4 on stage 1",
                 fix="Run the backwards in the order of the forwards"):  # fmt: skip
        Schedule("out of order", p, 5, tuple(rounds))
