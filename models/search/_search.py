"""Strategy search: every strategy × mesh ``data × model`` for a model, a batch and a device
count, ranked by an analytic cost model, with the compiled ledger of the best ones.

    python -m shardops_models.search --model gpt --batch 16 --devices 8 --compile-top 3   # _cli

    import shardops_models.search
    result = shardops_models.search.search(models.Gpt(), 16, 8, hardware="cpu-sim")
    best = result[0]                              # a Candidate: strategy, mesh, bytes, times
    shardops_models.search.compiled_ledger(best)           # compile (never run) and read its ledger

Per candidate, without compiling anything:

- bytes V per (collective, mesh axes): ``Setup.collective_budget``, read from the traced step
  (``shardops.inspect.traced_ledger``), a scanned layer's collectives once per layer. Under
  FLOAT32 they equal what XLA:CPU runs (``Ledger.totals()``); for a model that does not scan
  its layers, also what the lowered module asks for (``Ledger.totals(requested=True)``, which
  lists a loop's collectives once). Under bf16 policies XLA:CPU promotes bf16 collectives to
  f32.
- ring bytes per device per axis: ``shardops.inspect.ring_bytes`` of those.
- per device, from the jaxpr of the train step (``shardops_models.search._program_cost``): matmul FLOPs,
  bytes written by the other ops, the number of collectives per axis and the peak of live bytes.
- time: ``compute = flops / flops_rate + elementwise_bytes / memory_bandwidth``;
  ``comm = Σ ring_bytes / (bandwidth[axis] · efficiency[kind]) + latency · collectives``;
  ``step = compute + comm`` (``shardops_models.search._hardware``). Candidates are ranked by ``step``.

Which candidates (``_candidates``): for every strategy that applies to the model
(``models.strategies_for``) and every ``d × m = devices``; on given meshes, their ``pipe``,
``expert`` and ``context`` axes compose the presets with every pipeline schedule (at several
microbatch counts), expert parallelism and every context-parallel attention. A candidate is *ruled out*, with the reason, when the model does not
split over it (features, heads, vocabulary, sequence under sp), the batch does not split over
``data``, it is the same program as a simpler strategy (``2d`` on ``8×1`` is ``dp``; ``tp``
on ``8×1`` is the single-device step on every device; fsdp whose axes no parameter dimension
divides keeps every parameter replicated: ``fsdp`` is then ``dp``), or its peak memory exceeds
``memory_limit``. A strategy that leaves an axis of size > 1 unused (``dp`` on ``4×2``)
is listed, with ``replicas`` = that axis's size: those devices compute the same step again.

Any number of devices: each candidate is traced on a ``jax.sharding.AbstractMesh`` of its axis
sizes (``shardops.abstract_mesh``), so planning for thousands of devices simulates none. Only
compiling (``compile_top``) needs devices: with more than this process has, the search re-runs
in a subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` on
simulated CPU devices; it compiles for them, and runs nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import pickle
import subprocess
import sys
import tempfile
import time
from typing import Any

from shardops import BFLOAT16, DATA_AXIS, FLOAT32, MIXED_BFLOAT16, MODEL_AXIS, Precision
from shardops.inspect import ring_bytes
from shardops_models.search._candidates import (
    check_fsdp_splits,
    reason_ruled_out,
    strategy_meshes,
)
from shardops_models.search._hardware import Hardware, hardware_named
from shardops_models.search._program_cost import program_cost
from shardops_models.search._table import _axes, _keyed, _mesh_text, _render, _table

MODELS = {
    "seed": "MLP 784-512-10 (the seed's)",
    "wide": "MLP 784-2048-2048-10 (benchmarks/strategies.py's wide MLP)",
    "gpt": "GPT: 4 layers, width 128, 4 heads, vocabulary 256, context 128 (models.Gpt())",
    "llama": "Llama: 4 stacked layers, width 128, 8 heads (2 K/V), vocabulary 256, context 128 "
    "(models.Llama())",
    "mixtral": "the Llama with 8 experts a block, 2 a token (models.Llama(experts=models.Experts()))",
}
OPTIMIZERS = ("sgd", "adam", "adamw")
PRECISIONS = {"float32": FLOAT32, "mixed_bfloat16": MIXED_BFLOAT16, "bfloat16": BFLOAT16}


def model_named(name):
    """A name of ``MODELS`` (``"seed"``, ``"wide"``, ``"gpt"``, ``"llama"``, ``"mixtral"``) →
    the model; a model object as is."""
    if not isinstance(name, str):
        return name
    import shardops_models as models

    if name == "seed":
        return models.Mlp(models.SEED_SIZES)
    if name == "wide":
        return models.Mlp((784, 2048, 2048, 10))
    if name == "gpt":
        return models.Gpt()
    if name == "llama":
        return models.Llama()
    if name == "mixtral":
        return models.Llama(experts=models.Experts())
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)} or pass a model")


def _optimizer(optimizer):
    if not isinstance(optimizer, str):
        return optimizer
    import optax

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {OPTIMIZERS} or pass "
                         f"an optax.GradientTransformation")  # fmt: skip
    return {"sgd": optax.sgd(0.01), "adam": optax.adam(1e-3), "adamw": optax.adamw(1e-3)}[optimizer]


@dataclasses.dataclass(frozen=True)
class CompiledLedger:
    """What the compiled train step of a candidate moves and holds (compiled, never run)."""

    totals: dict
    """``Ledger.totals()``: bytes per (kind, axes) that the backend runs."""
    requested: dict
    """``Ledger.totals(requested=True)``: what the program asked for."""
    ring_bytes: dict
    collectives: dict
    """Mesh axes → collectives the compiled program runs (after XLA combined them)."""
    peak_bytes: int | None
    """``memory_analysis()``: arguments + outputs − aliased + temp, per device."""
    seconds: float
    """Lower + compile time."""

    def matches(self, candidate: Candidate) -> bool:
        """Whether the program asks for exactly the bytes the search predicted (the lowered
        module's request), or runs them (the compiled program's: the lowered module lists a
        scanned layer's collectives once, the compiled one once per iteration, by XLA's trip
        counts)."""
        return candidate.budget in (self.requested, self.totals)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One strategy on one mesh, with its predicted costs (per device, one train step)."""

    strategy: str
    mesh: tuple[int, ...]
    """The mesh's axis sizes, e.g. ``(data, model)``; ``axes`` names them."""
    replicas: int
    """Devices computing the same step: the size of an axis the strategy leaves unused."""
    budget: dict
    """Bytes V per ``(kind, axes)``: ``Setup.collective_budget``, i.e. the requested ledger."""
    ring_bytes: dict
    """Bytes each device sends per mesh axes (``shardops.inspect.ring_bytes``)."""
    collectives: dict
    """Mesh axes → collectives the program issues over them."""
    comm_time: dict
    """Mesh axes → seconds: ring bytes / (bandwidth · efficiency) + latency · collectives."""
    flops: int
    elementwise_bytes: int
    compute_time: float
    state_bytes: int
    """Parameters + optimizer state held by one device (its shards)."""
    peak_bytes: int
    """Peak live bytes of the per-device program (state, batch, activations, gradients)."""
    fits: bool
    step_time: float
    rank: int = 0
    compiled: CompiledLedger | None = None
    microbatches: int = 1
    """A pipeline's microbatches (1 for every other strategy)."""
    remat: Any = "none"
    """The activation-checkpoint policy (``models.build``'s ``remat``)."""
    model: Any = dataclasses.field(default=None, repr=False, compare=False)
    options: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """What ``compiled_ledger`` needs to rebuild the step: batch, seq, optimizer, precision."""
    axes: tuple[str, ...] = (DATA_AXIS, MODEL_AXIS)
    """The mesh's axis names."""

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(zip(self.axes, self.mesh, strict=True))

    @property
    def mesh_text(self) -> str:
        return _mesh_text(self.axes, self.mesh)

    @property
    def label(self) -> str:
        """The strategy, with a pipeline's microbatches and a remat policy: ``2d+1f1b M=4``,
        ``fsdp remat=full``."""
        return _label(self.strategy, self.microbatches, self.remat)

    @property
    def name(self) -> str:
        return f"{self.label} {self.mesh_text}"

    def as_dict(self) -> dict:
        out = {
            "rank": self.rank, "strategy": self.strategy, "microbatches": self.microbatches,
            "remat": str(self.remat),
            "mesh": list(self.mesh),
            "axes": list(self.axes),
            "replicas": self.replicas, "budget": _keyed(self.budget),
            "ring_bytes": {_axes(a): v for a, v in self.ring_bytes.items()},
            "collectives": {_axes(a): v for a, v in self.collectives.items()},
            "comm_time": {_axes(a): v for a, v in self.comm_time.items()},
            "flops": self.flops, "elementwise_bytes": self.elementwise_bytes,
            "compute_time": self.compute_time, "state_bytes": self.state_bytes,
            "peak_bytes": self.peak_bytes, "fits": self.fits, "step_time": self.step_time,
        }  # fmt: skip
        if self.compiled is not None:
            c = self.compiled
            out["compiled"] = {
                "totals": _keyed(c.totals), "requested": _keyed(c.requested),
                "ring_bytes": {_axes(a): v for a, v in c.ring_bytes.items()},
                "collectives": {_axes(a): v for a, v in c.collectives.items()},
                "peak_bytes": c.peak_bytes, "seconds": c.seconds, "matches": c.matches(self),
            }  # fmt: skip
        return out


@dataclasses.dataclass(frozen=True)
class RuledOut:
    strategy: str
    mesh: tuple[int, ...]
    reason: str
    axes: tuple[str, ...] = (DATA_AXIS, MODEL_AXIS)
    microbatches: int = 1
    remat: Any = "none"

    @property
    def label(self) -> str:
        return _label(self.strategy, self.microbatches, self.remat)

    @property
    def mesh_text(self) -> str:
        return _mesh_text(self.axes, self.mesh)


def _label(strategy: str, microbatches: int, remat="none") -> str:
    parts = [strategy] + [f"M={microbatches}"] * (microbatches > 1)
    return " ".join(parts + [f"remat={remat}"] * (remat not in ("none", False)))


@dataclasses.dataclass(frozen=True)
class Search:
    """The ranked candidates (``search[0]`` is the best) and those ruled out, with why."""

    candidates: list[Candidate]
    ruled_out: list[RuledOut]
    model_name: str
    batch: int
    devices: int
    hardware: Hardware
    seconds: float

    def __iter__(self):
        return iter(self.candidates)

    def __len__(self):
        return len(self.candidates)

    def __getitem__(self, i):
        return self.candidates[i]

    def as_dict(self) -> dict:
        return {
            "model": self.model_name, "batch": self.batch, "devices": self.devices,
            "hardware": dataclasses.asdict(self.hardware), "seconds": self.seconds,
            "candidates": [candidate.as_dict() for candidate in self.candidates],
            "ruled_out": [{"strategy": r.strategy, "microbatches": r.microbatches,
                           "remat": str(r.remat),
                           "mesh": list(r.mesh), "axes": list(r.axes), "reason": r.reason}
                          for r in self.ruled_out],
        }  # fmt: skip

    def table(self):
        """A ``rich.table.Table`` of the candidates, then the ruled-out ones."""
        return _table(self)

    def __str__(self) -> str:
        return _render(self.table())


def rank_key(candidate: Candidate):
    """Candidates rank by predicted step time, then by peak memory."""
    return (candidate.step_time, candidate.peak_bytes)


def search(
    model,
    batch: int,
    devices: int,
    *,
    seq: int | None = None,
    optimizer="adam",
    precision: Precision = FLOAT32,
    hardware="h100-nvlink",
    memory_limit: float | None = None,
    strategies=None,
    compile_top: int = 0,
    recount: bool = False,
    timeout: float = 1800,
    meshes=None,
    microbatches=None,
    remat=None,
) -> Search:
    """Every strategy × mesh factorisation of ``devices`` for ``model``, ranked by the cost model.

    Arguments:
        model: ``"seed"``, ``"wide"``, ``"gpt"`` (``MODELS``) or a model object as
            ``models.build`` takes it (``models.Mlp``, ``models.Gpt``, your own).
        batch: the global batch (examples; sequences for a sequence model).
        devices: how many devices. Every candidate is traced on an ``AbstractMesh``, so
            any count is searched in this process; with ``compile_top`` and more devices than
            this process has, the search runs in a subprocess on simulated CPU devices
            (``model`` must then be a name or picklable, ``optimizer`` a name).
        seq: a sequence model's tokens per example (default its context).
        optimizer: ``"sgd"``, ``"adam"``, ``"adamw"`` or an optax transformation.
        precision: ``shardops.FLOAT32``, ``MIXED_BFLOAT16`` or ``BFLOAT16``.
        hardware: a preset name (``HARDWARE``) or a ``Hardware`` (e.g. ``calibrate()``).
        memory_limit: bytes per device; a candidate whose peak exceeds it is ruled out. Default:
            ``hardware.memory``.
        strategies: the strategy names to consider, presets or composite (``"2d+1f1b"``,
            ``"fsdp+ring"``, ``"2d+ep"``); default all that apply to the model and the mesh.
        meshes: the meshes to consider, as axis sizes (``{"replica": 2, "data": 2, "model":
            2}`` or a spec, ``shardops.parse_mesh``), each of ``devices`` devices; default every
            ``data × model`` factorisation of ``devices``. On a mesh of other axes every preset
            whose axes it has is a candidate (``models.strategies_for(model, axes)``); its
            ``pipe``, ``expert`` and ``context`` axes compose each with every pipeline
            schedule, expert parallelism and every context-parallel attention
            (``shardops_models.search._candidates``).
        microbatches: the microbatch counts each pipeline candidate is traced at (default P,
            2P and 4P on P stages).
        remat: the activation-checkpoint policies (``models.build``'s ``remat``: ``"none"``,
            ``"full"``, ``"matmuls"``, ``"offload"``, a ``Remat``; a tuple of activation names
            is one policy, so pass it inside a list) each candidate is traced under, each listed; default: without remat, and a candidate whose peak exceeds the memory
            limit again under ``"matmuls"``, then ``"full"``, listed under the first that fits.
        compile_top: compile the best this many candidates (``compiled_ledger``), never run them.
        recount: re-time the compiled candidates with the number of collectives the compiled
            program runs instead of the number the jaxpr asks for (XLA combines independent
            all-reduces: a dp step asks for one per gradient and runs one), and rank again.
            With ``compile_top`` ≥ the number of candidates, every candidate is ranked this way.

    Returns:
        A ``Search``: ``result.candidates`` ranked by predicted step time, ``result.ruled_out``.
    """
    import jax

    _check_positive("devices", devices)
    _check_positive("batch", batch)
    hw = hardware_named(hardware)
    if not isinstance(precision, Precision):
        raise TypeError(f"precision must be a shardops.Precision; got {precision!r}")
    if compile_top and devices > jax.device_count():  # compiling needs the devices
        return _search_in_subprocess(
            model, batch, devices, seq=seq, optimizer=optimizer, precision=precision,
            hardware=hw, memory_limit=memory_limit, strategies=strategies,
            compile_top=compile_top, recount=recount, timeout=timeout, meshes=meshes,
            microbatches=microbatches, remat=remat,
        )  # fmt: skip
    remat = _remat_policies(remat)
    start = time.perf_counter()
    model = model_named(model)
    limit = hw.memory if memory_limit is None else memory_limit
    candidates, ruled_out = [], []
    options = {"seq": seq, "optimizer": optimizer, "precision": precision, "hardware": hw,
               "memory_limit": limit}  # fmt: skip
    for strategy, mesh_shape, m in strategy_meshes(model, devices, strategies, meshes,
                                                   microbatches):  # fmt: skip
        for policy in (None,) if remat is None else remat:
            got = _traced(model, strategy, mesh_shape, batch, m, policy, options)
            if isinstance(got, Candidate):
                candidates.append(got)
            else:
                ruled_out.append(RuledOut(strategy, tuple(mesh_shape.values()), got,
                                          tuple(mesh_shape), m, policy or "none"))  # fmt: skip
    if not candidates:
        why = "; ".join(f"{r.label} {r.mesh_text}: {r.reason}" for r in ruled_out)
        raise ValueError(
            f"no strategy and mesh of {devices} devices works for batch {batch}: {why}"
        )
    candidates = _ranked(candidates, hw, compile_top, recount)
    name = getattr(model, "name", type(model).__name__)
    return Search(candidates, ruled_out, name, batch, devices, hw, time.perf_counter() - start)


def _remat_policies(remat) -> tuple | None:
    """``search``'s ``remat``: None (automatic), or a non-empty tuple of policies (one policy
    alone is a tuple of it)."""
    from shardops_models.strategies.remat import Remat

    if remat is None:
        return None
    if isinstance(remat, (str, bool, Remat)) or callable(remat):
        return (remat,)
    remat = tuple(remat)
    if not remat or any(policy is None for policy in remat):
        raise ValueError(f"remat must be None (none, then matmuls and full where a candidate "
                         f"does not fit), a policy, or policies (e.g. ('none', 'full')); got "
                         f"{remat!r}")  # fmt: skip
    return remat


AUTO_REMAT = ("none", "matmuls", "full")
"""The policies ``search(remat=None)`` tries in turn until a candidate's peak fits."""


def _traced(model, strategy, mesh_shape, batch, m, policy, options) -> Candidate | str:
    """``strategy`` on ``mesh_shape`` at ``m`` microbatches predicted (``predict``) under the
    remat ``policy``, or why it is ruled out. ``policy=None``: each of ``AUTO_REMAT`` in turn,
    the first whose peak fits the memory limit."""
    reason = reason_ruled_out(model, strategy, mesh_shape, batch, options["seq"], m)
    if reason is not None:
        return reason
    for tried in (policy,) if policy is not None else AUTO_REMAT:
        try:
            got = predict(model, strategy, mesh_shape, batch, microbatches=m,
                          remat=tried, **options)  # fmt: skip
        except ValueError as e:  # the model does not split over this mesh
            if tried in (policy, AUTO_REMAT[0]):
                return str(e)
            break  # the last policy that traced says how much it needs
        candidate = got
        if candidate.fits:
            return candidate
    limit, tried = options["memory_limit"], candidate.remat
    return (f"needs {candidate.peak_bytes / 1e9:.3g} GB per device"
            f"{' under remat ' + repr(tried) if tried != 'none' else ''}, more than the "
            f"{limit / 1e9:.3g} GB limit")  # fmt: skip


def _ranked(candidates: list[Candidate], hw: Hardware, compile_top: int, recount: bool):
    """``candidates`` sorted by ``rank_key`` and numbered from 1, the best ``compile_top`` with
    their ``compiled_ledger``; with ``recount``, re-timed by the collectives their compiled
    programs run (``recounted``) and ranked again."""
    candidates = sorted(candidates, key=rank_key)
    candidates = [dataclasses.replace(lay, rank=i + 1) for i, lay in enumerate(candidates)]
    candidates = [
        dataclasses.replace(lay, compiled=compiled_ledger(lay)) if i < compile_top else lay
        for i, lay in enumerate(candidates)
    ]
    if recount:
        candidates = sorted((recounted(lay, hw) for lay in candidates), key=rank_key)
        candidates = [dataclasses.replace(lay, rank=i + 1) for i, lay in enumerate(candidates)]
    return candidates


def recounted(candidate: Candidate, hardware) -> Candidate:
    """``candidate`` with its latency term counting the collectives its compiled program runs
    (``candidate.compiled.collectives``) instead of those its jaxpr asks for; as is when it was
    not compiled."""
    if candidate.compiled is None:
        return candidate
    hw = hardware_named(hardware)
    comm = dict(candidate.comm_time)
    for axes, count in candidate.collectives.items():
        comm[axes] = comm.get(axes, 0.0) - hw.latency * count
    for axes, count in candidate.compiled.collectives.items():
        comm[axes] = comm.get(axes, 0.0) + hw.latency * count
    return dataclasses.replace(candidate, comm_time=comm,
                               step_time=candidate.compute_time + sum(comm.values()))  # fmt: skip


def predict(model, strategy: str, mesh_shape, batch: int, *, seq=None, optimizer="adam",
            precision=FLOAT32, hardware="h100-nvlink", memory_limit=None, microbatches: int = 1,
            remat="none") -> Candidate:  # fmt: skip
    """The predicted costs of one candidate (it traces the step on an ``AbstractMesh``;
    compiles nothing, and needs no devices: any ``mesh_shape`` traces in this process).
    ``strategy``: a preset's name or a composite one (``"2d+1f1b"``, ``"fsdp_tp+ring"``,
    ``"2d+ep"``: ``models.strategy_named``); ``mesh_shape``: axis sizes (a dict), or
    ``(data, model)``; ``microbatches`` and ``remat`` as ``models.build`` takes them.

    Raises ``ValueError`` when the model does not split over the mesh (from ``models.build``)
    or its fsdp axes split no parameter and a preset runs that program (``dp`` for ``fsdp``)."""
    import jax

    import shardops_models as models
    from shardops import abstract_mesh

    hw = hardware_named(hardware)
    shape = _shape(mesh_shape)
    mesh = abstract_mesh(shape)  # traced only: any number of devices, none of them simulated
    s = models.strategy_named(strategy)
    options = {"batch": batch, "seq": seq, "optimizer": optimizer, "precision": precision,
               "microbatches": microbatches, "remat": remat}  # fmt: skip
    setup = _setup(model, s, mesh, options)
    check_fsdp_splits(setup, s, shape)
    budget = setup.collective_budget(batch, seq)
    args = setup.abstract_step_args(batch, seq)
    # The train step donates the state (argument 0): its buffers may be freed once read.
    donated = range(len(jax.tree.leaves(args[0])))
    cost = program_cost(setup.step_jaxpr(batch, seq).jaxpr, dict(mesh.shape), donated=donated)
    ring: dict = {}
    comm: dict = {}
    for (kind, axes), nbytes in budget.items():
        sent = ring_bytes(kind, nbytes, math.prod(mesh.shape[a] for a in axes))
        ring[axes] = ring.get(axes, 0.0) + sent
        rate = hw.axes_bandwidth(axes) * hw.efficiency.get(kind, 1.0)
        comm[axes] = comm.get(axes, 0.0) + sent / rate
    for axes, count in cost.collectives.items():
        comm[axes] = comm.get(axes, 0.0) + hw.latency * count
    compute = (cost.flops / hw.flops_for(_dtype_name(precision.compute_dtype))
               + cost.elementwise_bytes / hw.memory_bandwidth)  # fmt: skip
    replicas = math.prod(n for a, n in shape.items() if a not in s.axes)  # axes it leaves unused
    state = _state_bytes_per_device(args[0])
    limit = hw.memory if memory_limit is None else memory_limit
    return Candidate(
        strategy=strategy, mesh=tuple(shape.values()), axes=tuple(shape), replicas=replicas,
        budget=budget, ring_bytes=ring,
        collectives=cost.collectives, comm_time=comm, flops=cost.flops,
        elementwise_bytes=cost.elementwise_bytes, compute_time=compute, state_bytes=state,
        peak_bytes=cost.peak_bytes, fits=cost.peak_bytes <= limit,
        step_time=compute + sum(comm.values()), model=model, microbatches=microbatches, remat=remat,
        options=options,
    )  # fmt: skip


def _setup(model, strategy, mesh, options: dict):
    """``models.build`` of ``strategy`` on ``mesh`` with a candidate's ``options``."""
    import shardops_models as models

    return models.build(strategy, mesh, optimizer=_optimizer(options["optimizer"]), model=model,
                        precision=options["precision"], remat=options.get("remat", "none"),
                        microbatches=options.get("microbatches", 1))  # fmt: skip


def _shape(mesh_shape) -> dict[str, int]:
    if isinstance(mesh_shape, dict):
        return dict(mesh_shape)
    d, m = mesh_shape
    return {DATA_AXIS: d, MODEL_AXIS: m}


def _dtype_name(dtype) -> str:
    import numpy as np

    return np.dtype(dtype).name


def _state_bytes_per_device(state) -> int:
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(state):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


def compiled_ledger(candidate: Candidate) -> CompiledLedger:
    """Lower and compile ``candidate``'s train step for abstract inputs (nothing is allocated or
    run) and read what it moves (``shardops.inspect.ledger``) and holds (``memory_analysis``)."""
    import shardops_models as models
    from shardops import make_mesh
    from shardops.inspect import Ledger, hlo_collectives, lowered_collectives

    o = candidate.options
    mesh = make_mesh(candidate.mesh_shape)
    setup = _setup(candidate.model, models.strategy_named(candidate.strategy), mesh, o)
    args = setup.abstract_step_args(o["batch"], o["seq"])
    start = time.perf_counter()
    lowered = setup.train_step.lower(*args)
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    # shardops.inspect.ledger's own reading of the two programs, without compiling a second time
    led = Ledger(mesh, tuple(hlo_collectives(compiled.as_text(), mesh)),
                 tuple(lowered_collectives(lowered.as_text(), mesh)))  # fmt: skip
    if any(c.axes is None for c in led.collectives):
        raise AssertionError(f"{candidate.name}: a collective over no set of mesh axes: {led}")
    counts: dict = {}
    for c in led.collectives:
        if c.bytes:
            counts[c.axes] = counts.get(c.axes, 0) + 1
    analysis = compiled.memory_analysis()
    peak = None
    if analysis is not None:
        peak = int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                   - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)  # fmt: skip
    return CompiledLedger(led.totals(), led.totals(requested=True), led.ring_bytes(), counts,
                          peak, seconds)  # fmt: skip


def _check_positive(name: str, n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be a positive integer; got {n!r}")


# --- more devices than this process has: a subprocess with simulated CPU devices


def _search_in_subprocess(model, batch, devices, *, timeout, **kwargs) -> Search:
    if not isinstance(kwargs["optimizer"], str):
        raise TypeError(
            f"searching {devices} devices runs in a subprocess: pass optimizer by name "
            f"({', '.join(OPTIMIZERS)}), not {type(kwargs['optimizer']).__name__}"
        )
    with tempfile.TemporaryDirectory(prefix="shardops_search_") as tmp:
        request, result = pathlib.Path(tmp, "request.pkl"), pathlib.Path(tmp, "result.pkl")
        try:
            request.write_bytes(pickle.dumps((model, batch, devices, kwargs)))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(
                f"searching {devices} devices runs in a subprocess, so the model must be a "
                f"name ({', '.join(MODELS)}) or picklable (a dataclass defined at module "
                f"level): {e}"
            ) from e
        env = _simulated_env(devices)
        proc = subprocess.run(
            [sys.executable, "-m", "shardops_models.search", "--worker", str(request), str(result)],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if proc.returncode:
            raise RuntimeError(
                f"the search on {devices} simulated devices failed (exit {proc.returncode}):\n"
                f"{proc.stderr[-4000:]}"
            )
        return pickle.loads(result.read_bytes())


def _simulated_env(devices: int) -> dict:
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)  # fmt: skip
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip()}  # fmt: skip


def _worker(request: str, result: str) -> None:
    import shardops_models.search as module  # not __main__'s copy: the result unpickles as shardops_models.search's

    model, batch, devices, kwargs = pickle.loads(pathlib.Path(request).read_bytes())
    out = module.search(model, batch, devices, **kwargs)
    out = dataclasses.replace(out, candidates=[dataclasses.replace(lay, model=None)
                                            for lay in out.candidates])  # fmt: skip
    pathlib.Path(result).write_bytes(pickle.dumps(out))
