"""A strategy is a layout: which mesh axes carry each kind of parallelism, for a mesh of any
number of axes with any names (MaxText's ``logical_axis_rules``, as one table).

    kind    mesh axes        the batch  parameters                  gradients
    dp      e.g. replica     split      replicated                  AllReduced (autodiff's, of pcast)
    fsdp    e.g. data        split      split, AllGathered per      ReduceScattered
                                        unit just in time
    zero1   e.g. data        split      replicated; the optimizer   ReduceScattered; parameters
                                        state split                 AllGathered after the update
    tp      one axis, model  —          split by each layer's plan  the kernels' own
                                        role (Megatron)
    sp      on tp's axis     —          as tp; activations split    the kernels' own
                                        along S between layers
    cp      one axis,        —          replicated                  AllReduced (autodiff's, of
            context                                                 pcast)
            every activation split along S in load-balanced chunks (x[B, S_context, D]); the
            token ids enter whole and each device takes its tokens; attention by the layout's
            ``cp_method``: all-gather of K/V, ring, or Ulysses (shardops.layers.
            context_parallel_attention_kernel); the loss and metrics sum over the shards

    Context × data × tensor on data=2 × context=2 × model=2:
        Strategy("2d+ring", dp=("data",), tp="model", cp="context", cp_method="ring"),
        or with_context("2d", "ring"), or strategy_named("2d+ring").

    HSDP × TP on replica=2 × data=2 × model=2:
        Strategy("hsdp_tp", dp=("replica",), fsdp=("data",), tp="model")
        the batch over (replica, data); parameters replicated over replica, split over data,
        tensor-parallel over model; a gradient is ReduceScattered over data, then its shard
        AllReduced over replica.

Mesh axes a strategy does not name hold replicas (every device along them runs the same step).
Today's nine strategies are presets (``STRATEGIES``) on the axes ``data`` and ``model``;
``hsdp``, ``hsdp_tp`` and ``hsdp_sp`` add ``replica``, and ``zero1`` and ``zero1_tp`` put
ZeRO-1 on ``data``. Each kind is an object in a file of its own (``models.strategies.kind``);
a kind defined elsewhere joins a strategy through ``extra`` (``docs/adding-a-kind.md``). Any
preset composes with context parallelism: ``<preset>+<method>`` (``with_context``).
"""

from __future__ import annotations

import dataclasses
import re

from shardops import CONTEXT_AXIS, DATA_AXIS, MODEL_AXIS, PIPE_AXIS, REPLICA_AXIS
from shardops.layers import CONTEXT_METHODS
from shardops.pipeline import SCHEDULES
from shardops_models.networks.contract import declared
from shardops_models.strategies.context import ContextKind
from shardops_models.strategies.data import DataKind
from shardops_models.strategies.expert import ExpertKind
from shardops_models.strategies.fsdp import FsdpKind
from shardops_models.strategies.kind import Kind, axes_of
from shardops_models.strategies.pipe import PipeKind
from shardops_models.strategies.tensor import TensorKind
from shardops_models.strategies.zero1 import Zero1Kind

EXPERT_AXIS = "expert"
"""The mesh axis ``with_experts`` (``"<preset>+ep"``) puts expert parallelism on."""

BATCH_KINDS = ("dp", "zero1", "fsdp")
"""The built-in kinds that split the batch, in the order the batch splits over them (major
first)."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Which mesh axes carry each kind of parallelism (see the module docstring): the fields
    name the built-in kinds' axes, ``extra`` adds kinds defined elsewhere, and ``kinds`` is
    the tuple of kind objects (``models.strategies.kind``) the rest of the library asks.

    Arguments:
        name: what tables and errors call it.
        dp: axes over which parameters are replicated and gradients AllReduced.
        fsdp: axes over which parameters are split (the FSDP rule picks the dim) and gathered
            just in time; gradients ReduceScattered.
        zero1: axes over which the optimizer state is split; parameters stay replicated.
        ep: the axis of expert parallelism: the batch split over it (as dp's), the experts of
            every mixture-of-experts layer split over it (``models.strategies.expert``).
        tp: the axis of tensor parallelism (each parameter's plan role splits it).
        sp: sequence parallelism on the ``tp`` axis.
        cp: the axis of context parallelism (the sequence of every activation split over it).
        cp_method: context-parallel attention, one of ``shardops.layers.CONTEXT_METHODS``:
            ``"allgather"`` (K/V gathered), ``"ring"`` (K/V passed round a ring) or
            ``"ulysses"`` (all-to-all between a sequence and a head split).
        pp: the axis of pipeline parallelism (the stacked layers split into stages over it,
            the batch into ``build``'s microbatches; ``models.strategies.pipe``).
        pp_schedule: the pipeline's schedule, one of ``shardops.pipeline.SCHEDULES``
            (``"gpipe"``, ``"1f1b"``, ``"circular"``).
        pp_virtual: the circular schedule's virtual stages per stage (V; default 2): the
            stacked layers in P·V chunks, chunk ``v·P + s`` on stage s.
        extra: kinds of parallelism of your own (``Kind`` instances, ``docs/adding-a-kind.md``);
            a kind that splits the batch splits it after the built-in ones.
    """

    name: str
    dp: tuple[str, ...] = ()
    fsdp: tuple[str, ...] = ()
    zero1: tuple[str, ...] = ()
    ep: str | None = None
    tp: str | None = None
    sp: bool = False
    cp: str | None = None
    cp_method: str = "ring"
    pp: str | None = None
    pp_schedule: str = "1f1b"
    pp_virtual: int | None = None
    extra: tuple[Kind, ...] = ()

    def __post_init__(self):
        for kind in BATCH_KINDS:
            object.__setattr__(self, kind, axes_of(getattr(self, kind), kind))
        if self.tp is not None and (not isinstance(self.tp, str) or not self.tp):
            raise TypeError(f"Strategy {self.name!r}: tp takes one mesh axis name; got {self.tp!r}")
        if self.ep is not None and (not isinstance(self.ep, str) or not self.ep):
            raise TypeError(f"Strategy {self.name!r}: ep takes one mesh axis name; got {self.ep!r}")
        if self.cp is not None and (not isinstance(self.cp, str) or not self.cp):
            raise TypeError(f"Strategy {self.name!r}: cp takes one mesh axis name; got {self.cp!r}")
        if self.pp is not None and (not isinstance(self.pp, str) or not self.pp):
            raise TypeError(f"Strategy {self.name!r}: pp takes one mesh axis name; got {self.pp!r}")
        if self.pp is None and self.pp_schedule != "1f1b":
            raise ValueError(f"Strategy {self.name!r}: pp_schedule={self.pp_schedule!r} without "
                             f"a pp axis; name it, e.g. pp={PIPE_AXIS!r}")  # fmt: skip
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"Strategy {self.name!r}: pp_schedule must be one of {SCHEDULES}; "
                             f"got {self.pp_schedule!r}")  # fmt: skip
        if self.pp_virtual is not None and self.pp_schedule != "circular":
            raise ValueError(f"Strategy {self.name!r}: pp_virtual={self.pp_virtual!r} with the "
                             f"{self.pp_schedule!r} schedule, whose stages are contiguous; "
                             f"pass pp_schedule='circular' for virtual stages")  # fmt: skip
        v = self.pp_virtual
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"Strategy {self.name!r}: pp_virtual (the circular schedule's "
                             f"virtual stages per stage) must be a positive int; got {v!r}. "
                             f"Pass an int >= 1, e.g. pp_virtual=2")  # fmt: skip
        if self.pp_schedule == "circular" and v is None:  # its default, stored
            object.__setattr__(self, "pp_virtual", 2)
        if self.cp is None and self.cp_method != "ring":
            raise ValueError(f"Strategy {self.name!r}: cp_method={self.cp_method!r} without a "
                             f"cp axis; name it, e.g. cp={CONTEXT_AXIS!r}")  # fmt: skip
        if self.cp_method not in CONTEXT_METHODS:
            raise ValueError(f"Strategy {self.name!r}: cp_method must be one of "
                             f"{CONTEXT_METHODS}; got {self.cp_method!r}. Pass one of them, "
                             f"e.g. cp_method='ring'")  # fmt: skip
        if self.sp and self.tp is None:
            raise ValueError(
                f"Strategy {self.name!r}: sp splits activations over the tp axis; name it, "
                f"e.g. tp={MODEL_AXIS!r}"
            )
        if self.zero1 and (self.fsdp or self.dp):
            raise ValueError(
                f"Strategy {self.name!r}: zero1 keeps parameters replicated and splits only the "
                f"optimizer state; it composes with tp, not with dp or fsdp (for parameters "
                f"split over one axis and replicated over another use fsdp with dp: HSDP)"
            )
        object.__setattr__(self, "extra", _extra_kinds(self.name, self.extra))
        seen: dict[str, str] = {}
        for kind in sorted(self.kinds, key=lambda k: k.splits_sequence):  # cp's axis named last
            for axis in kind.axes:
                if axis in seen:
                    raise ValueError(
                        f"Strategy {self.name!r}: mesh axis {axis!r} carries both {seen[axis]} "
                        f"and {kind.name}; each axis carries one kind of parallelism: give "
                        f"{kind.name} an axis of its own (a mesh of more axes)"
                    )
                seen[axis] = kind.name
        self._check_kinds()

    # --- the kinds, as objects

    def _check_kinds(self) -> None:
        """Kinds of distinct names; one that splits parameters at most."""
        names = [k.name for k in self.kinds]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"Strategy {self.name!r}: two kinds named {twice}; each kind has a "
                             f"name of its own (give your kind another name)")  # fmt: skip
        if sum(k.splits_parameters for k in self.kinds) > 1:
            raise ValueError(f"Strategy {self.name!r}: more than one kind splits the parameters "
                             f"({[k.name for k in self.kinds if k.splits_parameters]}); keep one")  # fmt: skip

    @property
    def kinds(self) -> tuple[Kind, ...]:
        """The strategy's kinds of parallelism: pipeline, then in the batch's order (dp, ep,
        zero1, fsdp, the extra kinds), then context, then tensor."""
        virtual = self.pp_virtual if self.pp_schedule == "circular" else 1
        kinds: list[Kind] = [PipeKind((self.pp,), self.pp_schedule, virtual)] if self.pp else []
        kinds += [cls(axes) for cls, axes in ((DataKind, self.dp),
                             (ExpertKind, self.ep), (Zero1Kind, self.zero1), (FsdpKind, self.fsdp))
                             if axes]  # fmt: skip
        kinds += self.extra
        if self.cp:
            kinds.append(ContextKind((self.cp,), self.cp_method))
        if self.tp:
            kinds.append(TensorKind((self.tp,), self.sp))
        return tuple(kinds)

    # --- what the rest of the library asks

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the strategy names: the batch's, the sequence's, then the rest."""
        rest = tuple(a for k in self.kinds if not (k.splits_batch or k.splits_sequence)
                     for a in k.axes)  # fmt: skip
        return self.reduce_axes + rest

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over (dim 0), major first."""
        return tuple(a for k in self.kinds if k.splits_batch for a in k.axes)

    @property
    def reduce_axes(self) -> tuple[str, ...]:
        """The axes a loss or metric sum is added over: the batch's and the sequence's."""
        return self.batch_axes + tuple(a for k in self.kinds if k.splits_sequence for a in k.axes)

    @property
    def parameter_axes(self) -> tuple[str, ...]:
        """The axes parameters are split over by a kind that splits them (fsdp's)."""
        return tuple(a for k in self.kinds if k.splits_parameters for a in k.axes)

    @property
    def gradient_axes(self) -> tuple[str, ...]:
        """The axes over which a parameter not split over them meets different tokens, so its
        gradient is summed over them (``ctx.unit`` enters it varying): the batch's kinds that
        sum gradients, then the sequence's."""
        first = [k for k in self.kinds if k.sums_gradients and not k.splits_sequence]
        last = [k for k in self.kinds if k.sums_gradients and k.splits_sequence]
        return tuple(a for k in first + last for a in k.axes)

    @property
    def rules(self) -> dict[str, tuple[str, ...]]:
        """Kind → mesh axes, for the kinds the strategy uses."""
        return {k.name: k.axes for k in self.kinds}

    @property
    def logical_rules(self) -> dict[str, str]:
        """Logical dim name (``mlp``, ``heads``, ``vocab``, …) → mesh axis: each kind's rows."""
        return {dim: axis for k in self.kinds for dim, axis in k.logical_rules().items()}

    def table(self) -> str:
        """The layout as a table: kind, mesh axes, what it does."""
        width = max([6, *(len(k.name) for k in self.kinds)])
        rows = [f"{self.name}:"] + [
            f"  {k.name:<{width}} {' × '.join(k.axes):<16} {k.description()}" for k in self.kinds
        ]
        if len(rows) == 1:
            rows.append("  (no parallelism: one device's step)")
        return "\n".join(rows)

    def check_mesh(self, shape: dict[str, int]) -> None:
        """A one-line ValueError when the mesh lacks an axis the strategy names."""
        missing = [a for a in self.axes if a not in shape]
        if missing:
            spec = ",".join(f"{a}=N" for a in self.axes)
            raise ValueError(
                f"mesh {','.join(f'{k}={v}' for k, v in shape.items())}: strategy {self.name!r} "
                f"needs mesh axes {self.axes} (missing {tuple(missing)}); e.g. {spec}"
            )


def _extra_kinds(name: str, extra) -> tuple[Kind, ...]:
    """``extra`` as a tuple of kinds defined outside the library; a TypeError for anything
    else, a built-in kind (named by its own field) or a kind asking what the core does only for
    the built-in ones (a sequence split, a layout by role)."""
    kinds = (extra,) if isinstance(extra, Kind) else extra
    if not isinstance(kinds, tuple | list):
        raise TypeError(f"Strategy {name!r}: extra takes a tuple of kinds of parallelism "
                        f"(Kind instances, e.g. (MyKind('data'),)); got {extra!r}")  # fmt: skip
    for kind in kinds:
        if not isinstance(kind, Kind):
            raise TypeError(
                f"Strategy {name!r}: extra takes kinds of parallelism "
                f"(models.strategies.kind.Kind instances, e.g. MyKind('data')); got {kind!r}"
            )
        builtin = {DataKind: "dp", FsdpKind: "fsdp", Zero1Kind: "zero1", TensorKind: "tp",
                   ContextKind: "cp", ExpertKind: "ep", PipeKind: "pp"}.get(type(kind))  # fmt: skip
        if builtin:
            raise TypeError(f"Strategy {name!r}: {type(kind).__name__} is a built-in kind: name "
                            f"its axes with the field {builtin}= instead of extra")  # fmt: skip
        if kind.splits_sequence or kind.splits_layers:
            raise ValueError(
                f"Strategy {name!r}: kind {kind.name!r} splits the "
                f"{'sequence' if kind.splits_sequence else 'layers by role'}, which the layer "
                f"context does only for the built-in kinds (cp, tp) today; use those fields"
            )
    return tuple(kinds)


STRATEGIES = {
    s.name: s
    for s in (
        Strategy("ref"),
        Strategy("dp", dp=DATA_AXIS),
        Strategy("fsdp", fsdp=DATA_AXIS),
        Strategy("tp", tp=MODEL_AXIS),
        Strategy("sp", tp=MODEL_AXIS, sp=True),
        Strategy("2d", dp=DATA_AXIS, tp=MODEL_AXIS),
        Strategy("fsdp_tp", fsdp=DATA_AXIS, tp=MODEL_AXIS),
        Strategy("dp_sp", dp=DATA_AXIS, tp=MODEL_AXIS, sp=True),
        Strategy("fsdp_sp", fsdp=DATA_AXIS, tp=MODEL_AXIS, sp=True),
        Strategy("hsdp", dp=REPLICA_AXIS, fsdp=DATA_AXIS),
        Strategy("hsdp_tp", dp=REPLICA_AXIS, fsdp=DATA_AXIS, tp=MODEL_AXIS),
        Strategy("hsdp_sp", dp=REPLICA_AXIS, fsdp=DATA_AXIS, tp=MODEL_AXIS, sp=True),
        Strategy("zero1", zero1=DATA_AXIS),
        Strategy("zero1_tp", zero1=DATA_AXIS, tp=MODEL_AXIS),
    )
}
"""The presets, by name (``2d`` is dp × tp, the seed's name for it)."""

ALIASES = {"dp_tp": "2d"}


def strategies_for(model, axes=None) -> list[str]:
    """The preset names that apply to ``model``: all, or without sp for a model that has no
    sequence dimension (the MLP); with ``axes``, only those whose mesh axes are among them
    (``axes=("data", "model")``: the presets of a 2-axis mesh)."""
    sequence = declared(model).sequence
    fits = (lambda s: True) if axes is None else (lambda s: set(s.axes) <= set(axes))
    return sorted(n for n, s in STRATEGIES.items() if (sequence or not s.sp) and fits(s))


def strategy_named(name) -> Strategy:
    """A preset by name (or a ``Strategy``, returned as it is), followed by any of, each after a
    ``+``: ``ep`` (expert parallelism on ``expert``, ``with_experts``), a context-parallel
    attention (``ring``, ``allgather``, ``ulysses``: on ``context``, ``with_context``) and a
    pipeline schedule (``gpipe``, ``1f1b``, ``circular``, or ``circular<V>`` for V virtual
    stages a device: on ``pipe``, ``with_pipeline``). E.g. ``"2d+ep"``, ``"fsdp_tp+ring"``,
    ``"2d+1f1b"``, ``"2d+circular2"``."""
    if isinstance(name, Strategy):
        return name
    if isinstance(name, str) and "+" in name:
        base, *added = name.split("+")
        strategy = strategy_named(base)
        for part in added:
            if part == "ep":
                strategy = with_experts(strategy)
            elif part in SCHEDULES:
                strategy = with_pipeline(strategy, part)
            elif re.fullmatch(r"circular\d+", part):  # circular with V virtual stages
                strategy = with_pipeline(strategy, "circular", virtual=int(part[8:]))
            elif part in CONTEXT_METHODS:
                strategy = with_context(strategy, part)
            else:
                raise ValueError(
                    f"unknown strategy {name!r}: after '+' name 'ep' (expert parallelism), "
                    f"a context-parallel attention, one of {CONTEXT_METHODS}, or a pipeline "
                    f"schedule, one of {SCHEDULES} ('circular<V>': V virtual stages); e.g. "
                    f"'{base}+ring', '{base}+ep' or '{base}+1f1b'"
                )
        return strategy
    name = ALIASES.get(name, name)
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}, and "
                         f"add '+ep' for expert parallelism, '+ring', '+allgather' or '+ulysses' "
                         f"for context parallelism, '+gpipe', '+1f1b', '+circular' or "
                         f"'+circular<V>' for pipeline parallelism (e.g. '2d+ep', '2d+1f1b')")  # fmt: skip
    return STRATEGIES[name]


def with_experts(strategy, axis: str = EXPERT_AXIS) -> Strategy:
    """``strategy`` (a preset's name or a ``Strategy``) with expert parallelism on mesh axis
    ``axis`` (the batch split over it too), named ``"<name>+ep"``."""
    base = strategy_named(strategy)
    if base.ep is not None:
        raise ValueError(f"strategy {base.name!r} already splits experts over {base.ep!r}; "
                         f"pass the strategy without it")  # fmt: skip
    return dataclasses.replace(base, name=f"{base.name}+ep", ep=axis)


def with_pipeline(strategy, schedule: str = "1f1b", axis: str = PIPE_AXIS, *,
                  virtual: int | None = None) -> Strategy:  # fmt: skip
    """``strategy`` (a preset's name or a ``Strategy``) with pipeline parallelism on mesh axis
    ``axis`` by ``schedule`` (``shardops.pipeline.SCHEDULES``), named ``"<name>+<schedule>"``
    (``"<name>+circular<V>"`` for the circular schedule's ``virtual`` stages other than 2)."""
    base = strategy_named(strategy)
    if base.pp is not None:
        raise ValueError(f"strategy {base.name!r} already pipelines over {base.pp!r}; pass the "
                         f"strategy without it")  # fmt: skip
    if schedule not in SCHEDULES:
        raise ValueError(f"with_pipeline: schedule must be one of {SCHEDULES}; got {schedule!r}")
    if virtual is not None and schedule != "circular":
        raise ValueError(f"with_pipeline: virtual={virtual!r} with the {schedule!r} schedule, "
                         f"whose stages are contiguous; pass schedule='circular' for virtual "
                         f"stages")  # fmt: skip
    part = schedule if virtual in (None, 2) else f"{schedule}{virtual}"
    return dataclasses.replace(base, name=f"{base.name}+{part}", pp=axis, pp_schedule=schedule,
                               pp_virtual=virtual)  # fmt: skip


def with_context(strategy, method: str = "ring", axis: str = CONTEXT_AXIS) -> Strategy:
    """``strategy`` (a preset's name or a ``Strategy``) with context parallelism on mesh axis
    ``axis`` by attention ``method``, named ``"<name>+<method>"``."""
    base = strategy_named(strategy)
    if base.cp is not None:
        plain = base.name.split("+")[0]
        without = (repr(plain) if base.name == f"{plain}+{base.cp_method}" and plain in STRATEGIES
                   else "dataclasses.replace(strategy, cp=None)")  # fmt: skip
        raise ValueError(f"strategy {base.name!r} already splits the sequence over {base.cp!r}; "
                         f"pass the strategy without it, e.g. with_context({without}, "
                         f"{method!r})")  # fmt: skip
    name = f"{base.name}+{method}"
    return dataclasses.replace(base, name=name, cp=axis, cp_method=method)
