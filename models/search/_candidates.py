"""Which candidates the search traces (``_search.search``), and which it rules out before
tracing, with the reason.

Every preset (``models.strategies_for``) on every mesh: by default each ``data × model``
factorisation of the devices; with ``meshes``, each mesh's own axes. A mesh's ``pipe``,
``expert`` and ``context`` axes each name a kind that composes with the presets on its other
axes (``models.strategy_named``):

- ``pipe``: every pipeline schedule (``+gpipe``, ``+1f1b``, ``+circular``), each at every
  count of ``microbatches`` (default P, 2P and 4P on P stages);
- ``expert``: expert parallelism (``+ep``, composed for every model; one without experts is
  ruled out by its build);
- ``context``: every context-parallel attention (``+allgather``, ``+ring``, ``+ulysses``).

Such an axis is always used: a preset alone would leave it to replicas. On a mesh of ``pipe``
alone the candidates are pure pipelines (``ref+1f1b``).
"""

from __future__ import annotations

import itertools
import math

from shardops import CONTEXT_AXIS, DATA_AXIS, MODEL_AXIS, PIPE_AXIS
from shardops.layers import CONTEXT_METHODS
from shardops.pipeline import SCHEDULES
from shardops_models.networks.contract import declared
from shardops_models.search._table import _mesh_text
from shardops_models.strategies.kind import axes_of
from shardops_models.strategies.layout import EXPERT_AXIS

# The axes that name a kind composed with the presets, with the name parts each adds.
COMPOSED = {
    PIPE_AXIS: tuple(f"+{schedule}" for schedule in SCHEDULES),
    EXPERT_AXIS: ("+ep",),
    CONTEXT_AXIS: tuple(f"+{method}" for method in CONTEXT_METHODS),
}
WHAT = {"pp": "pipeline", "ep": "split the experts over", "cp": "split the sequence over"}


def strategy_meshes(model, devices: int, strategies=None, meshes=None,
                    microbatches=None) -> list[tuple[str, dict, int]]:  # fmt: skip
    """Every (strategy, mesh shape, microbatches) to trace (the module docstring).
    ``strategies``: names, presets or composite (``"2d+1f1b"``), instead of the presets the
    model and each mesh take; ``microbatches``: the counts a pipeline is tried at."""
    import shardops_models as models

    meshes = _meshes(devices, meshes)
    if isinstance(microbatches, int):
        microbatches = (microbatches,)
    if microbatches is not None and (not microbatches or not all(
            isinstance(m, int) and not isinstance(m, bool) and m > 0 for m in microbatches)):  # fmt: skip
        raise ValueError(f"microbatches must be positive integers (or None: P, 2P and 4P on P "
                         f"stages); got {microbatches!r}")  # fmt: skip
    for name in strategies or ():
        models.strategy_named(name)  # an unknown name raises, naming the choices
    out = []
    for shape in meshes:
        names = _names(model, shape) if strategies is None else list(strategies)
        for name in names:
            stages = shape.get(models.strategy_named(name).pp, 1)
            # No pipe axis (or one of size 1): one candidate, which is ruled out for it.
            counts = (1,) if stages == 1 else microbatches or (stages, 2 * stages, 4 * stages)
            out += [(name, shape, m) for m in counts]
    return out


def _meshes(devices: int, meshes) -> list[dict]:
    import shardops

    if meshes is None:
        return [{DATA_AXIS: devices // m, MODEL_AXIS: m}
                for m in range(1, devices + 1) if devices % m == 0]  # fmt: skip
    meshes = [shardops.parse_mesh(m) if isinstance(m, str) else dict(m) for m in meshes]
    for shape in meshes:
        if math.prod(shape.values()) != devices:
            raise ValueError(f"mesh {_mesh_text(tuple(shape), tuple(shape.values()))} has "
                             f"{math.prod(shape.values())} devices, not {devices}")  # fmt: skip
    return meshes


def _names(model, shape: dict) -> list[str]:
    """The presets on ``shape``'s plain axes, each composed with every kind its ``pipe``,
    ``expert`` and ``context`` axes name."""
    import shardops_models as models

    composed = [axis for axis in COMPOSED if axis in shape]
    plain = tuple(axis for axis in shape if axis not in composed)
    # ZeRO-1 is searched on request only: its compiled step holds a few hundred bytes more
    # than the jaxpr's peak (program_cost), which the memory rule does not model.
    presets = [n for n in models.strategies_for(model, plain)
               if not models.STRATEGIES[n].zero1 and (n != "ref" or composed)]  # fmt: skip
    suffixes = ["".join(p) for p in itertools.product(*(COMPOSED[a] for a in composed))]
    return [preset + suffix for preset in presets for suffix in suffixes]


def _effective(strategy, shape: dict) -> dict:
    """The kinds of ``strategy`` on the axes of ``shape`` that hold more than one device, each
    kind's axes in the mesh's order."""
    order = list(shape)
    out = {}
    for kind, axes in strategy.rules.items():
        kept = tuple(sorted((a for a in axes if shape.get(a, 1) > 1), key=order.index))
        if kept:
            out[kind] = kept
    return out


def _same_program(strategy, kinds: dict, shape: dict) -> str | None:
    """The first preset, composed as ``strategy`` is (``"+1f1b"``, ``"+ep"`` …), whose kinds on
    ``shape`` are ``kinds``: the name the search lists that program under."""
    import shardops_models as models

    suffix = strategy.name[len(strategy.name.split("+")[0]) :]
    for preset in models.STRATEGIES.values():
        if set(preset.axes) <= set(shape):
            composed = models.strategy_named(preset.name + suffix)
            if _effective(composed, shape) == kinds:
                return composed.name
    return None


def reason_ruled_out(model, strategy: str, shape: dict, batch, seq, microbatches=1) -> str | None:
    """Why ``strategy`` on the mesh ``shape`` is not worth tracing, or None (checks that need
    no build: the mesh's axes, duplicates, the batch, the microbatches and the sequence)."""
    import shardops_models as models

    s = models.strategy_named(strategy)
    missing = [a for a in s.axes if a not in shape]
    if missing:
        return f"the mesh has no axis {', '.join(map(repr, missing))}"
    for kind in ("pp", "ep", "cp"):
        axis = getattr(s, kind)
        if axis is not None and shape[axis] == 1:
            return f"the {axis!r} axis it would {WHAT[kind]} has size 1"
    mine = _effective(s, shape)
    same = _same_program(s, mine, shape)
    if same is not None and same != s.name:  # (a Strategy of the user's own is no preset's)
        if not mine:
            return "no parallelism: every device runs the whole single-device step"
        unused = [a for a in s.axes if shape[a] == 1]
        where = _mesh_text(tuple(shape), tuple(shape.values()))
        return (f"same program as {same} {where} (the {', '.join(map(repr, unused))} axis it "
                f"would split has size 1)")  # fmt: skip
    if (s.sp or s.cp) and not declared(model).sequence:
        return f"{'sp' if s.sp else 'context parallelism'} splits the sequence; this model has none"
    n = math.prod(shape[a] for a in s.batch_axes)
    if s.batch_axes and batch % n:
        return (f"batch {batch} does not split over {' × '.join(s.batch_axes)} = {n}; use a "
                f"multiple of {n}")  # fmt: skip
    if s.pp and (batch // n) % microbatches:
        return (f"a device's {batch // n} rows do not split into {microbatches} microbatches; "
                f"use a batch that is a multiple of {n * microbatches}")  # fmt: skip
    if s.sp:
        tokens = model.context if seq is None else seq
        if tokens % shape[s.tp]:
            return f"sequence {tokens} does not split over {s.tp} = {shape[s.tp]} (sp splits it)"
    return None


def check_fsdp_splits(setup, strategy, shape: dict) -> None:
    """A ``ValueError`` (the candidate is ruled out) when ``strategy``'s fsdp axes (of more than
    one device) split no parameter and a preset runs that program: ``fsdp_spec`` keeps a leaf
    with no dimension it can split replicated, so the step is the one with those axes under dp
    (``fsdp`` → ``dp``, ``fsdp_tp`` → ``2d``). Without such a preset (``hsdp``: dp over replica
    × data) the candidate stays listed."""
    import jax
    from jax.sharding import PartitionSpec

    axes = tuple(a for a in strategy.fsdp or () if shape.get(a, 1) > 1)
    if not axes:
        return
    specs = jax.tree.leaves(setup.param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    used = {a for spec in specs for e in spec for a in axes_of(e, "a PartitionSpec entry")}
    if used & set(axes):
        return
    as_dp = _effective(strategy, shape)
    as_dp.pop("fsdp")
    order = list(shape)
    as_dp["dp"] = tuple(sorted((*as_dp.get("dp", ()), *axes), key=order.index))
    same = _same_program(strategy, as_dp, shape)
    if same is not None:
        n = math.prod(shape[a] for a in axes)
        raise ValueError(f"same program as {same} {_mesh_text(tuple(shape), tuple(shape.values()))}: "
                         f"no parameter has a dimension fsdp can split over {' × '.join(axes)} = "
                         f"{n}, so every one stays replicated")  # fmt: skip
