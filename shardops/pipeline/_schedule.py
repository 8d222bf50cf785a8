"""Pipeline schedules as tables: in each round, which microbatch each stage runs forward and
which it runs backward; the program (``shardops.pipeline.pipeline_value_and_grad``) follows the
table, one round after another, in one SPMD program.

A round has a forward phase and a backward phase. In the forward phase every stage that the
table names runs its layers on one microbatch and sends the output to the next stage; in the
backward phase every stage named runs the backward of one microbatch (the vjp of its layers,
recomputed from the stage input it kept) and sends the input's gradient to the previous stage.
A hop takes exactly one round: stage s + 1 runs microbatch i forward in the round after stage s
did, and stage s runs its backward in the round after stage s + 1 did. The last stage runs a
microbatch's backward in the same round as its forward at the earliest (the forward phase
comes first). A phase no stage runs in a round is not compiled, so the time steps are the
round phases that run (``steps``), each one slot of every stage.

With ``P`` stages and ``M`` microbatches (``F(i, s)``, ``B(i, s)``: the round of microbatch
``i``'s forward, backward on stage ``s``):

    gpipe     F(i, s) = i + s                B(i, s) = (M + P − 1) + i + (P − 1 − s)
              every forward, then every backward: stage s keeps M stage inputs
    1f1b      F(i, s) = i + s                B(i, s) = i + 2(P − 1) − s
              a microbatch's backward starts as soon as its forward ends: stage s keeps at most
              2(P − s) − 1 stage inputs, whatever M (one-forward-one-backward, in lockstep)

Both take 2(M + P − 1) time steps of which every stage is idle in 2(P − 1): the bubble
``(P − 1) / (M + P − 1)``. The asynchronous 1F1B of Megatron keeps P − s on stage s; in one
lockstep program a hop costs a whole round (a forward and a backward slot) each way, since the
stages that run a forward and those that run a backward in a slot would otherwise differ, which
needs a ``lax.cond`` around the layers' collectives.
"""

from __future__ import annotations

import dataclasses

SCHEDULES = ("gpipe", "1f1b")
"""The schedules ``schedule`` makes."""

Round = tuple[tuple[int | None, ...], tuple[int | None, ...]]
"""``(forward, backward)``: per stage, the microbatch it runs forward (backward) in the round, or
None."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``rounds[r] = (forward, backward)``, per stage the microbatch it
    runs forward (backward) in round ``r``, or None (the module docstring).

    Arguments:
        name: what tables and errors call it.
        stages: P, the pipeline's stages (the pipe axis's size).
        microbatches: M, the parts each device's batch is split into.
        rounds: the table; ``check`` is run on it.
    """

    name: str
    stages: int
    microbatches: int
    rounds: tuple[Round, ...]

    def __post_init__(self):
        self.check()

    # --- what the program needs

    def forward_round(self, microbatch: int, stage: int) -> int:
        """The round in which ``stage`` runs ``microbatch`` forward."""
        return self._rounds("forward")[microbatch, stage]

    def backward_round(self, microbatch: int, stage: int) -> int:
        """The round in which ``stage`` runs ``microbatch`` backward."""
        return self._rounds("backward")[microbatch, stage]

    def in_flight(self, stage: int) -> int:
        """The most stage inputs ``stage`` holds at once: microbatches whose forward has run
        (this round's included) and whose backward has not (this round's not yet)."""
        fwd, bwd = self._rounds("forward"), self._rounds("backward")
        return max(
            sum(fwd[i, stage] <= r <= bwd[i, stage] for i in range(self.microbatches))
            for r in range(len(self.rounds))
        )

    @property
    def buffer_slots(self) -> int:
        """The slots of every stage's buffer of stage inputs (the most any stage holds):
        microbatch i's input in slot ``i mod buffer_slots``."""
        return max(self.in_flight(s) for s in range(self.stages))

    # --- the table

    def steps(self) -> list[tuple[str, ...]]:
        """The time steps: per round, its forward phase then its backward phase where any
        stage runs one, each a tuple over the stages of ``"F<i>"``, ``"B<i>"`` or ``"."``."""
        steps = []
        for forward, backward in self.rounds:
            for tag, phase in (("F", forward), ("B", backward)):
                if any(i is not None for i in phase):
                    steps.append(tuple("." if i is None else f"{tag}{i}" for i in phase))
        return steps

    def idle_fraction(self) -> float:
        """The share of the table's stage-steps in which a stage runs nothing."""
        cells = [c for step in self.steps() for c in step]
        return cells.count(".") / len(cells)

    def bubble(self) -> float:
        """The analytic bubble of the schedule, ``(P − 1) / (M + P − 1)``."""
        return (self.stages - 1) / (self.microbatches + self.stages - 1)

    def render(self) -> str:
        """The table, one row per stage and one column per time step."""
        steps = self.steps()
        width = max(len(c) for step in steps for c in step)
        head = f"{self.name}: P={self.stages} stages, M={self.microbatches} microbatches"
        rows = [f"stage {s}: " + " ".join(f"{step[s]:>{width}}" for step in steps)
                for s in range(self.stages)]  # fmt: skip
        return "\n".join([head, *rows])

    # --- checks

    def check(self) -> None:
        """Every microbatch runs forward and backward once on every stage, a hop takes exactly
        one round each way, the last stage's backward comes no earlier than its forward, and
        no two microbatches held at once share a buffer slot; a ValueError naming the
        microbatch, the stage and the rounds otherwise."""
        p, m = self.stages, self.microbatches
        if p < 1 or m < 1:
            raise ValueError(f"Schedule {self.name!r}: needs stages >= 1 and microbatches >= 1; "
                             f"got {p} and {m}. Pass positive ints")  # fmt: skip
        for r, (forward, backward) in enumerate(self.rounds):
            if len(forward) != p or len(backward) != p:
                raise ValueError(f"Schedule {self.name!r}: round {r} names {len(forward)} and "
                                 f"{len(backward)} stages; the schedule has {p}. Give each "
                                 f"phase one entry per stage (None where it idles)")  # fmt: skip
        fwd, bwd = self._rounds("forward"), self._rounds("backward")
        for i in range(m):
            for s in range(p - 1):
                if fwd[i, s + 1] != fwd[i, s] + 1:
                    raise ValueError(
                        f"Schedule {self.name!r}: microbatch {i} runs forward on stage {s} in "
                        f"round {fwd[i, s]} and on stage {s + 1} in round {fwd[i, s + 1]}; a hop "
                        f"takes exactly one round. Run it forward on stage {s + 1} in round "
                        f"{fwd[i, s] + 1}"
                    )
                if bwd[i, s] != bwd[i, s + 1] + 1:
                    raise ValueError(
                        f"Schedule {self.name!r}: microbatch {i} runs backward on stage {s + 1} "
                        f"in round {bwd[i, s + 1]} and on stage {s} in round {bwd[i, s]}; a hop "
                        f"takes exactly one round. Run it backward on stage {s} in round "
                        f"{bwd[i, s + 1] + 1}"
                    )
            if bwd[i, p - 1] < fwd[i, p - 1]:
                raise ValueError(
                    f"Schedule {self.name!r}: microbatch {i} runs backward on the last stage in "
                    f"round {bwd[i, p - 1]}, before its forward (round {fwd[i, p - 1]}). Run "
                    f"its backward there in round {fwd[i, p - 1]} or later"
                )
        self._check_slots(fwd, bwd)

    def _check_slots(self, fwd, bwd) -> None:
        """No two microbatches that share a buffer slot (``i mod buffer_slots``) are held at
        once on a stage past the first (whose input the program never reads): a round's forward
        phase writes its slot before the backward phase reads, so one held from its forward's
        round to its backward's round inclusive would be overwritten (backwards out of the
        forwards' order can do it)."""
        k = self.buffer_slots
        for s in range(1, self.stages):
            for i in range(self.microbatches):
                for j in range(i + k, self.microbatches, k):  # the later ones in i's slot
                    if fwd[j, s] <= bwd[i, s] and fwd[i, s] <= bwd[j, s]:
                        raise ValueError(
                            f"Schedule {self.name!r}: microbatches {i} and {j} share buffer slot "
                            f"{i % k} of {k} on stage {s} and are held at once there (rounds "
                            f"{fwd[i, s]}–{bwd[i, s]} and {fwd[j, s]}–{bwd[j, s]}). Run the "
                            f"backwards in the order of the forwards"
                        )

    def _rounds(self, phase: str) -> dict[tuple[int, int], int]:
        """``{(microbatch, stage): round}`` of ``phase``; a ValueError where one runs twice
        or never."""
        index, seen = 0 if phase == "forward" else 1, {}
        for r, entry in enumerate(self.rounds):
            for s, i in enumerate(entry[index]):
                if i is None:
                    continue
                if not 0 <= i < self.microbatches or (i, s) in seen:
                    raise ValueError(
                        f"Schedule {self.name!r}: round {r} runs microbatch {i} {phase} on stage "
                        f"{s}, " + (f"which ran in round {seen[i, s]} already; each runs once. "
                                    f"Remove one of the two" if (i, s) in seen
                                    else f"not one of the {self.microbatches} microbatches "
                                    f"0..{self.microbatches - 1}. Name one of those")
                    )  # fmt: skip
                seen[i, s] = r
        missing = [(i, s) for i in range(self.microbatches) for s in range(self.stages)
                   if (i, s) not in seen]  # fmt: skip
        if missing:
            i, s = missing[0]
            raise ValueError(f"Schedule {self.name!r}: microbatch {i} never runs {phase} on "
                             f"stage {s} ({len(missing)} such pairs); each runs once on every "
                             f"stage. Add it to a round")  # fmt: skip
        return seen


def _table(name: str, p: int, m: int, forward_round, backward_round) -> Schedule:
    """The schedule whose stage s runs microbatch i forward in ``forward_round(i, s)`` and
    backward in ``backward_round(i, s)``."""
    last = max(backward_round(i, s) for i in range(m) for s in range(p))
    rounds = []
    for r in range(last + 1):
        phases = tuple(
            tuple(next((i for i in range(m) if at(i, s) == r), None) for s in range(p))
            for at in (forward_round, backward_round)
        )  # fmt: skip
        rounds.append(phases)
    return Schedule(name, p, m, tuple(rounds))


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every microbatch forward through every stage, then every one backward (stage s
    keeps all M stage inputs)."""
    p, m = _check_sizes("gpipe", stages, microbatches)
    return _table("gpipe", p, m, lambda i, s: i + s, lambda i, s: (m + p - 1) + i + (p - 1 - s))


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """One forward, one backward: microbatch i's backward leaves the last stage in the round
    its forward reaches it, so stage s keeps at most ``2(P − s) − 1`` stage inputs, not M."""
    p, m = _check_sizes("1f1b", stages, microbatches)
    return _table("1f1b", p, m, lambda i, s: i + s, lambda i, s: i + 2 * (p - 1) - s)


def schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule ``name`` (one of ``SCHEDULES``) for ``stages`` and ``microbatches``."""
    makers = {"gpipe": gpipe, "1f1b": one_f_one_b}
    if name not in makers:
        raise ValueError(f"schedule: unknown schedule {name!r}; choose one of {SCHEDULES}")
    return makers[name](stages, microbatches)


def _check_sizes(name: str, stages, microbatches) -> tuple[int, int]:
    for argument, value in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {argument} must be a positive int; got {value!r}. "
                             f"Pass an int >= 1")  # fmt: skip
    return stages, microbatches
