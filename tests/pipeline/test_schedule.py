"""shardops.pipeline's schedules as tables: GPipe and 1F1B on P ∈ {2, 4, 8} stages and
M ∈ {1, P, 2P + 1} microbatches take 2(M + P − 1) time steps, idle (P − 1)/(M + P − 1) of
them, run every (microbatch, stage) forward and backward once in dependency order, and hold the
stage inputs each schedule promises (GPipe M, 1F1B min(M, 2(P − s) − 1) on stage s), each
counted here from the table's time steps, not from the schedule's own formulas; the circular
schedule's 2(V·M + P − 1) steps, idle (P − 1)/(V·M + P − 1), chunk-to-chunk order and bounded
inputs, and ``stage_order``; ``render``'s text; and ``check``'s refusals of broken tables."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from _messages import refused

from shardops.pipeline import (
    SCHEDULES,
    Schedule,
    circular,
    gpipe,
    one_f_one_b,
    schedule,
    stage_order,
)
from shardops.pipeline._schedule import _table

CONTIGUOUS = ("gpipe", "1f1b")
CASES = [(name, p, m) for name in CONTIGUOUS for p in (2, 4, 8) for m in (1, p, 2 * p + 1)]
# circular: (P, M, V), M a multiple of P
CIRCULAR = [(p, m, v) for p in (2, 4, 8) for m in (p, 2 * p, 5 * p) for v in (2, 3, 4)]
_CELL = re.compile(r"^([FB])(\d+)(?:\.(\d+))?$")


def _events(sched: Schedule) -> dict[tuple, list[int]]:
    """``{(phase, microbatch, stage): [time steps]}`` read from ``steps()``'s cells
    (``(phase, microbatch, chunk)``, chunk ``v·P + s``, where they name virtual stages)."""
    found: dict[tuple, list[int]] = {}
    for t, step in enumerate(sched.steps()):
        assert len(step) == sched.stages, (t, step)
        for s, cell in enumerate(step):
            if cell == ".":
                continue
            phase, i, v = _CELL.match(cell).groups()
            where = s if v is None else int(v) * sched.stages + s
            found.setdefault((phase, int(i), where), []).append(t)
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
    assert schedule("circular", 4, 8, 3) == circular(4, 8, 3)
    assert gpipe(4, 5) != one_f_one_b(4, 5)


# --- circular: chunk c = v·P + s of the P·V on stage s


@pytest.mark.parametrize("p, m, v", CIRCULAR)
def test_circular_bubble_steps_and_dependencies(p, m, v):
    """2(V·M + P − 1) time steps, idle (P − 1)/(V·M + P − 1), every (microbatch, chunk) once
    each way, a hop one step on from chunk to chunk (the lap's end, stage P − 1, to stage 0),
    and each stage's microbatches in order on each of its chunks."""
    sched = circular(p, m, v)
    steps = sched.steps()
    assert len(steps) == 2 * (v * m + p - 1)
    cells = [c for step in steps for c in step]
    bubble = Fraction(p - 1, v * m + p - 1)
    assert Fraction(cells.count("."), len(cells)) == bubble
    assert sched.idle_fraction() == pytest.approx(sched.bubble()) and sched.bubble() == float(
        bubble
    )
    assert all([step[s] for step in steps].count(".") == 2 * (p - 1) for s in range(p))
    events = _events(sched)
    chunks = p * v
    assert set(events) == {(f, i, c) for f in "FB" for i in range(m) for c in range(chunks)}
    assert all(len(ts) == 1 for ts in events.values()), "a (microbatch, chunk) ran twice"
    at = {k: ts[0] for k, ts in events.items()}
    for i in range(m):
        for c in range(chunks - 1):
            assert at["F", i, c] < at["F", i, c + 1]
            assert at["B", i, c + 1] < at["B", i, c]
        assert at["F", i, chunks - 1] < at["B", i, chunks - 1]
    for c in range(chunks):
        for f in "FB":
            assert [at[f, i, c] for i in range(m)] == sorted(at[f, i, c] for i in range(m))


def test_circular_holds_a_bounded_number_of_stage_inputs():
    """Each chunk holds at most min(M, 2P) inputs, stage 0 V·P + P − 1 in all, whatever M
    (counted from the table's rounds); GPipe's grow with M."""
    for p, v in ((2, 2), (4, 2), (2, 4), (8, 3)):
        for m in (2 * p, 8 * p):
            sched = circular(p, m, v)
            per_chunk = [sched.in_flight(s, u) for s in range(p) for u in range(v)]
            assert max(per_chunk) == min(m, 2 * p)
            assert sched.in_flight(0) == v * p + p - 1 < gpipe(p, m).in_flight(0) * v
            assert sched.buffer_slots == 2 * p


def test_entry_reads_a_cell_as_microbatch_and_virtual_stage():
    assert [one_f_one_b(2, 1).entry(e) for e in (None, 3, (3, 1))] == [None, (3, 0), (3, 1)]


def test_circular_with_one_virtual_stage_is_1f1b():
    for p in (2, 4, 8):
        for m in (p, 3 * p):
            assert circular(p, m, 1).rounds == one_f_one_b(p, m).rounds


def test_circular_render_pins_the_table():
    assert circular(2, 2, 2).render() == (
        "circular: P=2 stages, M=2 microbatches, V=2 virtual stages\n"
        "stage 0: F0.0 F1.0 F0.1 F1.1    .    . B0.1 B1.1 B0.0 B1.0\n"
        "stage 1:    . F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0    ."
    )


def test_circular_microbatches_not_divisible_by_stages_are_refused():
    with refused(ValueError, argument="circular: 6 microbatches", got="6 microbatches",
                 expected="groups of 4 (one per stage)",
                 fix="Use a number of microbatches 4 divides (8, say), or the 1f1b schedule"):  # fmt: skip
        circular(4, 6, 2)


def test_virtual_stages_of_a_contiguous_schedule_are_refused():
    with refused(ValueError, argument="'1f1b' runs contiguous stages", got="virtual=2",
                 expected="virtual=1", fix="the 'circular' schedule for virtual stages"):  # fmt: skip
        schedule("1f1b", 2, 4, 2)
    with refused(ValueError, argument="virtual must be", got="got 0", expected="positive int",
                 fix="Pass an int >= 1"):  # fmt: skip
        circular(2, 4, 0)


def test_a_hop_from_the_lap_end_of_two_rounds_is_refused():
    """circular(2, 2, 2) with stage 0's second lap a round late: microbatch 0 leaves stage 1's
    first chunk in round 1 and would reach stage 0's second in round 3."""
    good = circular(2, 2, 2)
    with refused(ValueError, argument="microbatch 0 runs forward on stage 1 (virtual stage 0)",
                 got="on stage 0 (virtual stage 1) in round 3",
                 expected="a hop takes exactly one round",
                 fix="Run it forward on stage 0 (virtual stage 1) in round 2"):  # fmt: skip
        _table("late lap", 2, 2,
               lambda i, u, s: good.forward_round(i, s, u) + ((u, s) == (1, 0)),
               lambda i, u, s: good.backward_round(i, s, u) + 1, 2)  # fmt: skip


def test_stage_order_gives_each_stage_its_chunks():
    """Stored row r = s·L/P + v·L/(P·V) + j holds layer (v·P + s)·L/(P·V) + j: stage s's
    contiguous block is its chunks s, s + P, … in turn."""
    assert stage_order(8, 2, 2) == (0, 1, 4, 5, 2, 3, 6, 7)
    assert stage_order(6, 3, 1) == tuple(range(6))
    for layers, p, v in ((8, 2, 2), (12, 2, 3), (16, 4, 2), (8, 8, 1)):
        order, chunk = stage_order(layers, p, v), layers // (p * v)
        assert sorted(order) == list(range(layers))
        for s in range(p):
            block = order[s * layers // p : (s + 1) * layers // p]
            want = [c * chunk + j for c in range(s, p * v, p) for j in range(chunk)]
            assert list(block) == want


def test_stage_order_of_layers_the_chunks_do_not_divide_is_refused():
    with refused(ValueError, argument="stage_order: 6 layers", got="6 layers",
                 expected="2 stages × 2 virtual stages (4 chunks of whole layers)",
                 fix="Use a number of layers 4 divides"):  # fmt: skip
        stage_order(6, 2, 2)


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
    with refused(ValueError, argument="needs stages, microbatches and virtual >= 1",
                 got="got 2, 0 and 1", expected=">= 1", fix="Pass positive ints"):  # fmt: skip
        Schedule("empty", 2, 0, ())


@pytest.mark.parametrize("maker", [gpipe, one_f_one_b, circular])
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
