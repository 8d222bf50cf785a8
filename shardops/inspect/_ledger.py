"""The communication ledger: every collective of a compiled program, with its mesh axes and
bytes, totals per axis and kind, the ring-algorithm bytes each device sends, and what the
program asked for before XLA combined or promoted anything.

    ledger = shardops.inspect.ledger(mesh, train_step, state, x, y)
    print(ledger)                       # a table for humans (rich renders it in a terminal)
    ledger.totals()                     # {(kind, axes): bytes} for tests
    ledger.ring_bytes()                 # {axes: bytes each device sends per call}
    ledger.totals(pass_="backward")     # the same, for one pass
    ledger.by_pass()                    # {pass: {(kind, axes): bytes}}

Passes (forward, backward, optimizer) are read from each op's ``op_name``: autodiff's
``transpose(…)`` is the backward, a ``jax.named_scope("optimizer")`` the optimizer, the rest
the forward. A tuple that XLA combined from several passes is split element by element
(``shardops.inspect._passes``).

Bytes follow ``shardops.inspect.collectives``: V is the full tensor a collective reduces or assembles
(0 for single-device groups). A ring moves per device (N = group size, the JAX scaling book):
AllGather, ReduceScatter and AllToAll V·(N−1)/N; AllReduce 2·V·(N−1)/N; CollectivePermute V.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

from jax.sharding import Mesh

from shardops.inspect._hlo import Collective, hlo_collectives, lower, lowered_collectives
from shardops.inspect._passes import MIXED, PASSES, scopes_of, split_op_name


def ring_bytes(kind: str, nbytes: int, group_size: int) -> float:
    """Bytes one device sends for a collective of V = ``nbytes`` over ``group_size`` devices."""
    n = group_size
    if n <= 1 or not nbytes:
        return 0.0
    if kind == "all-reduce":
        return 2 * nbytes * (n - 1) / n
    if kind == "collective-permute":
        return float(nbytes)
    return nbytes * (n - 1) / n


@dataclasses.dataclass(frozen=True)
class Ledger:
    """The collectives of one compiled program over ``mesh``."""

    mesh: Mesh
    collectives: tuple[Collective, ...]
    """What the backend runs (compiled HLO, after XLA combined, split and promoted)."""
    requested: tuple[Collective, ...]
    """What the program asked for (the lowered StableHLO module), in its own dtypes."""

    def totals(
        self, *, requested: bool = False, pass_: str | None = None
    ) -> dict[tuple[str, tuple[str, ...]], int]:
        """``{(kind, axes): bytes}``, leaving out collectives that move nothing; with ``pass_``
        (``"forward"``, ``"backward"``, ``"optimizer"``), only that pass's bytes (the elements of
        a combined tuple are counted in their own passes)."""
        if pass_ is None:
            out: Counter = Counter()
            for c in self.requested if requested else self.collectives:
                if c.bytes:
                    out[(c.kind, c.axes)] += c.bytes
            return dict(out)
        if pass_ not in (*PASSES, MIXED):
            raise ValueError(f"pass_ must be one of {PASSES} (or {MIXED!r}); got {pass_!r}")
        if requested:
            raise ValueError(
                "totals: the requested (lowered) collectives carry no op_name, so they have no "
                "pass; call totals(pass_=...) without requested=True"
            )
        return self.by_pass().get(pass_, {})

    def by_pass(self) -> dict[str, dict[tuple[str, tuple[str, ...]], int]]:
        """``{pass: {(kind, axes): bytes}}`` for every pass in ``PASSES`` (``{}`` when a pass
        has no collectives), plus ``"mixed"`` if a combined tuple could not be split."""
        out: dict[str, Counter] = {p: Counter() for p in PASSES}
        for c in self.collectives:
            for pass_, nbytes in zip(c.passes, c.element_bytes, strict=True):
                if nbytes:
                    out.setdefault(pass_, Counter())[(c.kind, c.axes)] += nbytes
        return {p: dict(totals) for p, totals in out.items()}

    def per_axis(self, *, requested: bool = False) -> dict[tuple[str, ...], int]:
        out: Counter = Counter()
        for (_, axes), nbytes in self.totals(requested=requested).items():
            out[axes] += nbytes
        return dict(out)

    def per_kind(self, *, requested: bool = False) -> dict[str, int]:
        out: Counter = Counter()
        for (kind, _), nbytes in self.totals(requested=requested).items():
            out[kind] += nbytes
        return dict(out)

    def ring_bytes(self) -> dict[tuple[str, ...], float]:
        """Bytes each device sends per call on each mesh-axis group, by the ring formulas."""
        out: Counter = Counter()
        for c in self.collectives:
            if c.bytes:
                out[c.axes] += ring_bytes(c.kind, c.bytes, c.group_size)
        return dict(out)

    def promoted(self) -> dict[str, tuple[int, int]]:
        """Per kind, ``(bytes asked for, bytes moved)`` where the backend moves more, e.g.
        XLA:CPU running a bf16 all-reduce in f32."""
        asked, moved = self.per_kind(requested=True), self.per_kind()
        return {k: (asked.get(k, 0), v) for k, v in moved.items() if v > asked.get(k, 0)}

    def as_dict(self) -> dict:
        """Plain data (JSON-ready)."""
        return {
            "collectives": [
                {
                    "kind": c.kind,
                    "axes": list(c.axes or ()),
                    "dtypes": list(c.dtypes),
                    "shapes": [list(s) for _, s in c.shapes],
                    "bytes": c.bytes,
                    "group_size": c.group_size,
                    "op_name": c.op_name,
                    "passes": list(c.passes),
                }
                for c in self.collectives
            ],
            "totals": {f"{k} {'×'.join(a) or '-'}": v for (k, a), v in self.totals().items()},
            "requested": {
                f"{k} {'×'.join(a) or '-'}": v for (k, a), v in self.totals(requested=True).items()
            },
            "ring_bytes_per_device": {"×".join(a) or "-": v for a, v in self.ring_bytes().items()},
            "by_pass": {
                p: {f"{k} {'×'.join(a) or '-'}": v for (k, a), v in totals.items()}
                for p, totals in self.by_pass().items()
            },
        }

    def table(self):
        """A ``rich.table.Table``: one row per collective, then totals per axis."""
        from rich.table import Table

        table = Table(title=f"collectives on mesh {dict(self.mesh.shape)}", show_footer=False)
        for name, justify in (("pass", "left"), ("kind", "left"), ("axes", "left"),
                              (r"dtype\[shape]", "left"), ("bytes", "right"),
                              ("ring bytes/device", "right"), ("layer", "left")):  # fmt: skip
            table.add_column(name, justify=justify)
        for c in self.collectives:
            if not c.bytes:
                continue
            table.add_row(
                _passes_text(c), c.kind, _axes_text(c.axes), _shapes_text(c), f"{c.bytes:,}",
                f"{ring_bytes(c.kind, c.bytes, c.group_size):,.0f}", _layer(c.op_name),
            )  # fmt: skip
        asked = self.per_axis(requested=True)
        for axes, nbytes in sorted(self.per_axis().items()):
            note = "" if asked.get(axes, 0) == nbytes else f" (asked for {asked.get(axes, 0):,})"
            table.add_row("total", "", _axes_text(axes), "", f"{nbytes:,}{note}",
                          f"{self.ring_bytes()[axes]:,.0f}", "", style="bold")  # fmt: skip
        return table

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=140, record=True, file=_Null(), color_system=None)
        console.print(self.table())
        return console.export_text()


def ledger(mesh: Mesh, fn, /, *args, **kwargs) -> Ledger:
    """Compile ``fn(*args, **kwargs)`` (a callable, jitted or not) and return its ``Ledger``."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"ledger: mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    if not callable(fn):
        raise TypeError(f"ledger: fn must be callable; got {type(fn).__name__}")
    try:
        lowered = lower(fn, *args, **kwargs)
        compiled = lowered.compile()
    except Exception as e:
        raise ValueError(
            f"ledger: could not lower and compile {getattr(fn, '__name__', fn)!r} with these "
            f"arguments: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    text = compiled.as_text()
    partitions = re.search(r"num_partitions=(\d+)", text)
    n = int(partitions[1]) if partitions else 1
    if n != mesh.devices.size:
        raise ValueError(
            f"ledger: the program runs on {n} devices but the mesh {dict(mesh.shape)} has "
            f"{mesh.devices.size}; pass the mesh the program was built with"
        )
    result = Ledger(
        mesh,
        tuple(hlo_collectives(text, mesh)),
        tuple(lowered_collectives(lowered.as_text(), mesh)),
    )
    unmatched = [c for c in result.collectives if c.axes is None]
    if unmatched:
        raise ValueError(
            f"ledger: {len(unmatched)} collective(s) run over device groups that match no set of "
            f"the mesh's axes {tuple(mesh.axis_names)} (e.g. {unmatched[0].kind} of "
            f"{_shapes_text(unmatched[0])}); is this the mesh the program was built with?"
        )
    return result


def _axes_text(axes) -> str:
    return "×".join(axes) if axes else "-"


def _shapes_text(c: Collective) -> str:
    parts = [f"{d}[{','.join(map(str, s))}]" for d, s in c.shapes]
    return (
        ", ".join(parts) if len(parts) <= 3 else f"{len(parts)} tensors ({', '.join(parts[:2])}, …)"
    )


def _passes_text(c: Collective) -> str:
    """``backward``, or ``forward+backward`` for a combined tuple of both."""
    return "+".join(p for p in (*PASSES, MIXED) if p in c.passes)


def _layer(op_name: str) -> str:
    """The ``shardops.*`` layers an op ran in, else its named scopes (``optimizer``, yours)."""
    names = sorted(set(re.findall(r"shardops\.\w+", op_name)))
    if names:
        return ", ".join(n.removeprefix("shardops.") for n in names)
    scopes = dict.fromkeys("/".join(scopes_of(name)) for name in split_op_name(op_name))
    return ", ".join(s for s in scopes if s)


class _Null:
    def write(self, _):
        return 0

    def flush(self):
        pass
