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

**Virtual stages (circular, interleaved).** With ``V`` virtual stages each device holds V
non-contiguous chunks of ``L / (P·V)`` layers: chunk ``c = v·P + s`` (virtual stage v of stage
s), so a microbatch goes round the P devices V times (the last stage's output of one lap is the
first stage's input of the next). A table entry is then ``(i, v)``: microbatch i on virtual
stage v; the hop rule holds from chunk to chunk. Microbatches go in groups of P
(``i = g·P + j``), each group through one chunk on every device before the next chunk:

    circular  k = g·V·P + v·P + j            F(i, v, s) = k + s
              k' = g·V·P + (V − 1 − v)·P + j   B(i, v, s) = k' + (P − 1 − s) + (V·P − 1)

a chunk's forward reaches the next device in the next round (the group of P fills the P
devices exactly, so the wrap from stage P − 1 to stage 0 also takes one round: hence M
divisible by P), and a microbatch's backward starts as soon as its forward leaves the last
chunk, as in 1F1B (V = 1 is 1F1B). It takes ``2(V·M + P − 1)`` time steps, each a chunk's work
(1/V of a stage's), idle in ``2(P − 1)``: the bubble ``(P − 1) / (V·M + P − 1)``, V times
smaller, for ``2(V·M + P − 2)`` activations sent per device instead of ``2(M + P − 2)``. Each
chunk keeps its own inputs, at most ``min(M, 2P)``, and stage 0 at most ``V·P + P − 1`` in all,
whatever M (``in_flight``): bounded like 1F1B's ``2P − 1``.
"""

from __future__ import annotations

import dataclasses

SCHEDULES = ("gpipe", "1f1b", "circular")
"""The schedules ``schedule`` makes."""

Entry = int | tuple[int, int] | None
"""What a stage runs in a phase: microbatch ``i`` (on virtual stage 0), ``(i, v)`` (microbatch
i on virtual stage v), or None."""
Round = tuple[tuple[Entry, ...], tuple[Entry, ...]]
"""``(forward, backward)``: per stage, what it runs forward (backward) in the round."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``rounds[r] = (forward, backward)``, per stage what it runs forward
    (backward) in round ``r`` (an ``Entry``; the module docstring).

    Arguments:
        name: what tables and errors call it.
        stages: P, the pipeline's stages (the pipe axis's size).
        microbatches: M, the parts each device's batch is split into.
        rounds: the table; ``check`` is run on it.
        virtual: V, the virtual stages each stage holds (chunk ``v·P + s`` of the ``P·V``);
            1 for contiguous stages.
    """

    name: str
    stages: int
    microbatches: int
    rounds: tuple[Round, ...]
    virtual: int = 1

    def __post_init__(self):
        self.check()

    # --- what the program needs

    def forward_round(self, microbatch: int, stage: int, virtual: int = 0) -> int:
        """The round in which ``stage`` runs ``microbatch`` forward (on ``virtual``)."""
        return self._rounds("forward")[microbatch, virtual * self.stages + stage]

    def backward_round(self, microbatch: int, stage: int, virtual: int = 0) -> int:
        """The round in which ``stage`` runs ``microbatch`` backward (on ``virtual``)."""
        return self._rounds("backward")[microbatch, virtual * self.stages + stage]

    def in_flight(self, stage: int, virtual: int | None = None) -> int:
        """The most stage inputs ``stage`` holds at once (of its ``virtual`` stage; default
        all of them): microbatches whose forward has run (this round's included) and whose
        backward has not (this round's not yet)."""
        fwd, bwd = self._rounds("forward"), self._rounds("backward")
        chunks = [v * self.stages + stage for v in
                  (range(self.virtual) if virtual is None else (virtual,))]  # fmt: skip
        return max(
            sum(fwd[i, c] <= r <= bwd[i, c] for i in range(self.microbatches) for c in chunks)
            for r in range(len(self.rounds))
        )

    @property
    def buffer_slots(self) -> int:
        """The slots of each virtual stage's buffer of stage inputs (the most any holds):
        microbatch i's input in slot ``i mod buffer_slots``."""
        return max(self.in_flight(s, v) for s in range(self.stages) for v in range(self.virtual))

    def entry(self, entry: Entry) -> tuple[int, int] | None:
        """``entry`` as ``(microbatch, virtual stage)``, or None."""
        if entry is None or isinstance(entry, tuple):
            return entry
        return entry, 0

    # --- the table

    def steps(self) -> list[tuple[str, ...]]:
        """The time steps: per round, its forward phase then its backward phase where any
        stage runs one, each a tuple over the stages of ``"F<i>"``, ``"B<i>"`` (with virtual
        stages ``"F<i>.<v>"``, ``"B<i>.<v>"``) or ``"."``."""
        steps = []
        for forward, backward in self.rounds:
            for tag, phase in (("F", forward), ("B", backward)):
                if any(e is not None for e in phase):
                    steps.append(tuple(self._cell(tag, e) for e in phase))
        return steps

    def _cell(self, tag: str, entry: Entry) -> str:
        if entry is None:
            return "."
        i, v = self.entry(entry)
        return f"{tag}{i}" if self.virtual == 1 else f"{tag}{i}.{v}"

    def idle_fraction(self) -> float:
        """The share of the table's stage-steps in which a stage runs nothing."""
        cells = [c for step in self.steps() for c in step]
        return cells.count(".") / len(cells)

    def bubble(self) -> float:
        """The analytic bubble of the schedule, ``(P − 1) / (V·M + P − 1)``."""
        return (self.stages - 1) / (self.virtual * self.microbatches + self.stages - 1)

    def render(self) -> str:
        """The table, one row per stage and one column per time step."""
        steps = self.steps()
        width = max(len(c) for step in steps for c in step)
        head = f"{self.name}: P={self.stages} stages, M={self.microbatches} microbatches"
        head += f", V={self.virtual} virtual stages" if self.virtual > 1 else ""
        rows = [f"stage {s}: " + " ".join(f"{step[s]:>{width}}" for step in steps)
                for s in range(self.stages)]  # fmt: skip
        return "\n".join([head, *rows])

    # --- checks

    def check(self) -> None:
        """Every microbatch runs forward and backward once on every (virtual) stage, a hop
        takes exactly one round each way (from chunk to chunk), the last chunk's backward
        comes no earlier than its forward, and no two microbatches held at once share a
        buffer slot; a ValueError naming the microbatch, the stage and the rounds otherwise."""
        p, m, v = self.stages, self.microbatches, self.virtual
        if p < 1 or m < 1 or v < 1:
            raise ValueError(f"Schedule {self.name!r}: needs stages, microbatches and virtual "
                             f">= 1; got {p}, {m} and {v}. Pass positive ints")  # fmt: skip
        for r, (forward, backward) in enumerate(self.rounds):
            if len(forward) != p or len(backward) != p:
                raise ValueError(f"Schedule {self.name!r}: round {r} names {len(forward)} and "
                                 f"{len(backward)} stages; the schedule has {p}. Give each "
                                 f"phase one entry per stage (None where it idles)")  # fmt: skip
        fwd, bwd = self._rounds("forward"), self._rounds("backward")
        for i in range(m):
            for c in range(p * v - 1):
                here, there = self._where(c), self._where(c + 1)
                if fwd[i, c + 1] != fwd[i, c] + 1:
                    raise ValueError(
                        f"Schedule {self.name!r}: microbatch {i} runs forward on {here} in "
                        f"round {fwd[i, c]} and on {there} in round {fwd[i, c + 1]}; a hop "
                        f"takes exactly one round. Run it forward on {there} in round "
                        f"{fwd[i, c] + 1}"
                    )
                if bwd[i, c] != bwd[i, c + 1] + 1:
                    raise ValueError(
                        f"Schedule {self.name!r}: microbatch {i} runs backward on {there} "
                        f"in round {bwd[i, c + 1]} and on {here} in round {bwd[i, c]}; a hop "
                        f"takes exactly one round. Run it backward on {here} in round "
                        f"{bwd[i, c + 1] + 1}"
                    )
            last = p * v - 1
            if bwd[i, last] < fwd[i, last]:
                raise ValueError(
                    f"Schedule {self.name!r}: microbatch {i} runs backward on the last stage in "
                    f"round {bwd[i, last]}, before its forward (round {fwd[i, last]}). Run "
                    f"its backward there in round {fwd[i, last]} or later"
                )
        self._check_slots(fwd, bwd)

    def _where(self, chunk: int) -> str:
        """Chunk ``v·P + s`` in a message: ``stage s`` (``(virtual stage v)``)."""
        v, s = divmod(chunk, self.stages)
        return f"stage {s}" if self.virtual == 1 else f"stage {s} (virtual stage {v})"

    def _check_slots(self, fwd, bwd) -> None:
        """No two microbatches that share a buffer slot (``i mod buffer_slots``) are held at
        once on a chunk past the first (whose input the program never reads): a round's
        forward phase writes its slot before the backward phase reads, so one held from its
        forward's round to its backward's round inclusive would be overwritten (backwards out
        of the forwards' order can do it)."""
        k = self.buffer_slots
        for c in range(1, self.stages * self.virtual):
            for i in range(self.microbatches):
                for j in range(i + k, self.microbatches, k):  # the later ones in i's slot
                    if fwd[j, c] <= bwd[i, c] and fwd[i, c] <= bwd[j, c]:
                        raise ValueError(
                            f"Schedule {self.name!r}: microbatches {i} and {j} share buffer slot "
                            f"{i % k} of {k} on {self._where(c)} and are held at once there "
                            f"(rounds {fwd[i, c]}–{bwd[i, c]} and {fwd[j, c]}–{bwd[j, c]}). Run "
                            f"the backwards in the order of the forwards"
                        )

    def _rounds(self, phase: str) -> dict[tuple[int, int], int]:
        """``{(microbatch, chunk): round}`` of ``phase`` (chunk ``v·P + s``); a ValueError
        where one runs twice or never."""
        index, seen, p = 0 if phase == "forward" else 1, {}, self.stages
        for r, entry in enumerate(self.rounds):
            for s, e in enumerate(entry[index]):
                if e is None:
                    continue
                i, v = self.entry(e)
                c = v * p + s
                if not (0 <= i < self.microbatches and 0 <= v < self.virtual) or (i, c) in seen:
                    raise ValueError(
                        f"Schedule {self.name!r}: round {r} runs microbatch {i} {phase} on stage "
                        f"{s}" + (f" (virtual stage {v})" if v or self.virtual > 1 else "") + ", "
                        + (f"which ran in round {seen[i, c]} already; each runs once. "
                           f"Remove one of the two" if (i, c) in seen
                           else f"not one of the {self.microbatches} microbatches "
                           f"0..{self.microbatches - 1} (on virtual stages 0.."
                           f"{self.virtual - 1}). Name one of those")
                    )  # fmt: skip
                seen[i, c] = r
        missing = [(i, c) for i in range(self.microbatches) for c in range(p * self.virtual)
                   if (i, c) not in seen]  # fmt: skip
        if missing:
            i, c = missing[0]
            raise ValueError(f"Schedule {self.name!r}: microbatch {i} never runs {phase} on "
                             f"{self._where(c)} ({len(missing)} such pairs); each runs once on "
                             f"every stage. Add it to a round")  # fmt: skip
        return seen


def _table(name: str, p: int, m: int, forward_round, backward_round, v: int = 1) -> Schedule:
    """The schedule whose stage s runs microbatch i forward on virtual stage u in
    ``forward_round(i, u, s)`` and backward in ``backward_round(i, u, s)``."""
    work = [(i, u) for i in range(m) for u in range(v)]
    last = max(backward_round(i, u, s) for i, u in work for s in range(p))
    rounds = []
    for r in range(last + 1):
        phases = tuple(
            tuple(next(((i, u) if v > 1 else i for i, u in work if at(i, u, s) == r), None)
                  for s in range(p))
            for at in (forward_round, backward_round)
        )  # fmt: skip
        rounds.append(phases)
    return Schedule(name, p, m, tuple(rounds), v)


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every microbatch forward through every stage, then every one backward (stage s
    keeps all M stage inputs)."""
    p, m = _check_sizes("gpipe", stages, microbatches)
    return _table("gpipe", p, m, lambda i, u, s: i + s,
                  lambda i, u, s: (m + p - 1) + i + (p - 1 - s))  # fmt: skip


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """One forward, one backward: microbatch i's backward leaves the last stage in the round
    its forward reaches it, so stage s keeps at most ``2(P − s) − 1`` stage inputs, not M."""
    p, m = _check_sizes("1f1b", stages, microbatches)
    return _table("1f1b", p, m, lambda i, u, s: i + s, lambda i, u, s: i + 2 * (p - 1) - s)


def circular(stages: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Circular (interleaved 1F1B): each stage holds ``virtual`` chunks of layers, chunk
    ``v·P + s`` on stage s, and microbatches go round the stages V times in groups of P; the
    bubble ``(P − 1) / (V·M + P − 1)``. M must divide by P (the module docstring)."""
    p, m = _check_sizes("circular", stages, microbatches)
    (v,) = _check_sizes("circular", virtual=virtual)
    if m % p:
        raise ValueError(
            f"circular: {m} microbatches do not split into groups of {p} (one per stage): the "
            f"circular schedule sends each group of P round the {p} stages together. Use a "
            f"number of microbatches {p} divides ({p * -(-m // p)}, say), or the 1f1b schedule"
        )

    def k(i, u):  # the forward's position in each stage's order of (group, chunk, member)
        g, j = divmod(i, p)
        return g * v * p + u * p + j

    def k_back(i, u):  # the backward's: the chunks in reverse
        return k(i, v - 1 - u)

    return _table("circular", p, m, lambda i, u, s: k(i, u) + s,
                  lambda i, u, s: k_back(i, u) + (p - 1 - s) + (v * p - 1), v)  # fmt: skip


def schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule ``name`` (one of ``SCHEDULES``) for ``stages`` and ``microbatches``, with
    ``virtual`` stages per stage (circular's; 1 for the others)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule: unknown schedule {name!r}; choose one of {SCHEDULES}")
    if name == "circular":
        return circular(stages, microbatches, virtual)
    if virtual != 1:
        raise ValueError(f"schedule: {name!r} runs contiguous stages; got virtual={virtual!r}. "
                         f"Pass virtual=1, or the 'circular' schedule for virtual stages")  # fmt: skip
    return {"gpipe": gpipe, "1f1b": one_f_one_b}[name](stages, microbatches)


def _check_sizes(name: str, *values, **named) -> tuple[int, ...]:
    named = {**dict(zip(("stages", "microbatches"), values, strict=False)), **named}
    for argument, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {argument} must be a positive int; got {value!r}. "
                             f"Pass an int >= 1")  # fmt: skip
    return tuple(named.values())


def stage_order(layers: int, stages: int, virtual: int = 1) -> tuple[int, ...]:
    """The stored order of ``layers`` stacked layers for ``stages`` stages of ``virtual``
    chunks each: stored row ``r`` holds layer ``order[r]``, so that splitting the stored stack
    ``[L, …]`` into P contiguous blocks gives stage s its chunks ``s, s + P, …, s + (V − 1)·P``
    in turn (``L / (P·V)`` layers each; the identity for V = 1)::

        r = s·(L/P) + v·(L/(P·V)) + j   holds layer   (v·P + s)·(L/(P·V)) + j

    A ValueError where P·V does not divide L."""
    for argument, value in (("layers", layers), ("stages", stages), ("virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"stage_order: {argument} must be a positive int; got {value!r}")
    if layers % (stages * virtual):
        raise ValueError(
            f"stage_order: {layers} layers do not split into {stages} stages × {virtual} virtual "
            f"stages ({stages * virtual} chunks of whole layers). Use a number of layers "
            f"{stages * virtual} divides, or fewer stages or virtual stages"
        )
    chunk = layers // (stages * virtual)
    return tuple((v * stages + s) * chunk + j
                 for s in range(stages) for v in range(virtual) for j in range(chunk))  # fmt: skip
