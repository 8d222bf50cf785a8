"""The search's result as tables: the ranked candidates, those ruled out and why, and the
compiled ledgers of the best (``Search.table``, ``str(search)``, the command line)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import shardops
from shardops import DATA_AXIS, MODEL_AXIS

if TYPE_CHECKING:
    from shardops_models.search._search import Search


def _mesh_text(axes, sizes) -> str:
    """``4×2`` on data × model; ``replica=2,data=2,model=2`` (``--mesh``'s spelling) on any
    other axes."""
    text = shardops.format_mesh(dict(zip(axes, sizes, strict=True)))
    return text.replace("x", "×") if tuple(axes) == (DATA_AXIS, MODEL_AXIS) else text


def _keyed(d: dict) -> dict:
    return {f"{k} {_axes(a)}": v for (k, a), v in d.items()}


def _axes(axes) -> str:
    return "×".join(axes) or "-"


def _mb(n) -> str:
    return f"{n / 1e6:,.2f}"


def _ms(t) -> str:
    return f"{t * 1e3:,.3f}"


def _per_axis(d: dict, fmt) -> str:
    return ", ".join(f"{_axes(a)}: {fmt(v)}" for a, v in sorted(d.items())) or "-"


def _table(p: Search):
    from rich.table import Table

    hw = p.hardware
    title = (f"{p.model_name}, batch {p.batch}, {p.devices} devices, hardware {hw.name} "
             f"(ranked by predicted step time)")  # fmt: skip
    table = Table(title=title)
    for name, justify in (("rank", "right"), ("strategy", "left"), ("mesh", "left"),
                          ("replicas", "right"), ("ring MB/device", "left"),
                          ("collectives", "left"), ("comm ms", "right"),
                          ("compute ms", "right"), ("peak MB/device", "right"),
                          ("fits", "left"), ("step ms", "right")):  # fmt: skip
        table.add_column(name, justify=justify)
    for lay in p.candidates:
        table.add_row(
            str(lay.rank), lay.label, lay.mesh_text, str(lay.replicas),
            _per_axis(lay.ring_bytes, _mb), _per_axis(lay.collectives, str),
            _ms(sum(lay.comm_time.values())), _ms(lay.compute_time), _mb(lay.peak_bytes),
            "yes" if lay.fits else "no", _ms(lay.step_time),
        )  # fmt: skip
    for r in p.ruled_out:
        table.add_row("-", r.label, r.mesh_text, "", f"ruled out: {r.reason}",
                      "", "", "", "", "", "", style="dim")  # fmt: skip
    return table


def _compiled_table(p: Search):
    from rich.table import Table

    table = Table(title="compiled ledger of the top candidates (lowered and compiled, not run)")
    for name in ("rank", "candidate", "kind axes", "predicted bytes", "requested", "compiled",
                 "collectives (compiled)", "peak MB: predicted", "compiled", "compile s"):  # fmt: skip
        table.add_column(name)
    for lay in p.candidates:
        c = lay.compiled
        if c is None:
            continue
        keys = sorted(set(lay.budget) | set(c.totals) | set(c.requested))
        for i, key in enumerate(keys or [("-", ())]):
            first = i == 0
            table.add_row(
                str(lay.rank) if first else "", lay.name if first else "",
                f"{key[0]} {_axes(key[1])}", f"{lay.budget.get(key, 0):,}",
                f"{c.requested.get(key, 0):,}", f"{c.totals.get(key, 0):,}",
                _per_axis(c.collectives, str) if first else "",
                _mb(lay.peak_bytes) if first else "",
                (_mb(c.peak_bytes) if c.peak_bytes is not None else "?") if first else "",
                f"{c.seconds:.2f}" if first else "",
                style=None if c.matches(lay) else "bold red",
            )  # fmt: skip
    return table


def _render(table) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.export_text()
