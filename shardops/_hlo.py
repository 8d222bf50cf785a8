"""Reading the collectives of a compiled program from its HLO text.

``collectives(fn, *args, mesh=mesh)`` compiles ``fn`` and returns one ``Collective`` per
collective op: its kind, result shapes and dtype, the mesh axes its replica groups span, and its
bytes. It parses:

- tuple-shaped collectives with many operands (XLA combines them; long tuples carry
  ``/*index=N*/`` comments);
- async ``-start``/``-done`` pairs, counted once (with the ``-done``'s result shapes);
- explicit (``{{0,1},{2,3}}``) and iota (``[4,2]<=[8]``, ``[2,4]<=[4,2]T(1,0)``) replica groups,
  in logical device ids (positions in ``mesh.devices.flat``), including non-contiguous groups
  such as ``data`` = {0,2,4,6} on a 4×2 mesh.

``bytes`` is the size V of the full tensor(s) the collective reduces or assembles: the result
for all-reduce, all-gather, collective-permute and all-to-all, and N × the result shard for
reduce-scatter (N = group size). A group of one device moves nothing: 0 bytes. Ring algorithms
send about V(N−1)/N per device for AllGather/ReduceScatter and twice that for AllReduce.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np
from jax.sharding import Mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
}
_KIND_ALT = "|".join(re.escape(k) for k in KINDS)
_INSTR = re.compile(
    rf"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    rf"(?P<kind>{_KIND_ALT})(?P<async>-start|-done)?\((?P<operands>[^)]*)\)(?P<attrs>.*)$"
)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program."""

    kind: str
    """One of ``KINDS``."""
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """Result ``(dtype, dims)`` per tuple element (one element for a plain array)."""
    axes: tuple[str, ...] | None
    """Mesh axes the groups span, in mesh order; ``()`` for single-device groups, ``None`` if
    the groups match no set of mesh axes."""
    group_size: int
    bytes: int
    """Size of the full tensor(s) reduced or assembled; 0 for single-device groups."""
    op_name: str
    """The ``op_name`` metadata: the jit, ``named_scope`` and primitive path."""

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.shapes)


def collectives(fn, *args, mesh: Mesh, **kwargs) -> list[Collective]:
    """Compile ``fn(*args, **kwargs)`` (a jitted function, or any callable) and list its collectives."""
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return hlo_collectives(jitted.lower(*args, **kwargs).compile().as_text(), mesh)


def hlo_collectives(hlo_text: str, mesh: Mesh) -> list[Collective]:
    """Parse the collectives out of compiled HLO text. See the module docstring."""
    found, starts = [], {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        if m["async"] == "-start":
            starts[m["name"]] = m
            continue
        attrs_from = m
        if m["async"] == "-done":
            start_name = m["operands"].strip().split()[-1].lstrip("%")
            attrs_from = starts.pop(start_name, m)
        found.append(_collective(m["kind"], m["type"], attrs_from["attrs"], mesh))
    for m in starts.values():  # a -start without a -done still runs once
        found.append(_collective(m["kind"], m["type"], m["attrs"], mesh))
    return found


def _collective(kind: str, type_text: str, attrs: str, mesh: Mesh) -> Collective:
    shapes = tuple(
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(re.sub(r"/\*.*?\*/", "", type_text))
    )
    if kind == "collective-permute":
        axes, group_size = _axes_of_pairs(_permute_pairs(attrs), mesh)
    else:
        groups = _replica_groups(attrs, mesh.devices.size)
        axes, group_size = _axes_of_groups(groups, mesh), max(len(g) for g in groups)
    result_bytes = sum(_DTYPE_BYTES[d] * math.prod(s) for d, s in shapes)
    if group_size <= 1:
        nbytes = 0
    elif kind == "reduce-scatter":
        nbytes = result_bytes * group_size
    else:
        nbytes = result_bytes
    op_name = _OP_NAME.search(attrs)
    return Collective(
        kind=kind,
        shapes=shapes,
        axes=axes,
        group_size=group_size,
        bytes=nbytes,
        op_name=op_name[1] if op_name else "",
    )


def _replica_groups(attrs: str, n_devices: int) -> list[tuple[int, ...]]:
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if iota:
        group_shape = [int(v) for v in iota[1].split(",")]
        reshape = [int(v) for v in iota[2].split(",")]
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if iota[3]:
            ids = ids.transpose([int(v) for v in iota[3].split(",")])
        return [tuple(int(i) for i in g) for g in ids.reshape(group_shape)]
    explicit = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if explicit and explicit[1]:
        return [
            tuple(int(i) for i in g.split(",") if i)
            for g in re.findall(r"\{([0-9,]*)\}", explicit[1])
        ]
    return [tuple(range(n_devices))]  # replica_groups={} or absent: one group of all devices


def _permute_pairs(attrs: str) -> list[tuple[int, int]]:
    pairs = re.search(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}", attrs)
    if not pairs:
        return []
    return [(int(a), int(b)) for a, b in re.findall(r"\{([0-9]+),([0-9]+)\}", pairs[1])]


def _coords(mesh: Mesh) -> np.ndarray:
    shape = mesh.devices.shape
    return np.array(np.unravel_index(np.arange(math.prod(shape)), shape)).T  # [n_devices, ndim]


def _axes_of_pairs(pairs, mesh: Mesh) -> tuple[tuple[str, ...], int]:
    """Mesh axes along which a collective-permute's source and target differ, and their size."""
    coords = _coords(mesh)
    moved = sorted({i for a, b in pairs for i in np.flatnonzero(coords[a] != coords[b])})
    names = tuple(mesh.axis_names[i] for i in moved)
    return names, math.prod(mesh.devices.shape[i] for i in moved)


def _axes_of_groups(groups, mesh: Mesh) -> tuple[str, ...] | None:
    """The mesh axes whose devices (all other coordinates fixed) form exactly these groups."""
    shape = mesh.devices.shape
    names = tuple(mesh.axis_names)
    if all(len(g) <= 1 for g in groups):
        return ()
    coords = _coords(mesh)
    wanted = {frozenset(g) for g in groups}
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), r):
            if any(shape[i] == 1 for i in subset):
                continue  # the same groups without that axis come first
            others = [i for i in range(len(names)) if i not in subset]
            blocks: dict[tuple, set] = {}
            for dev, c in enumerate(coords):
                blocks.setdefault(tuple(c[others]), set()).add(dev)
            if wanted == {frozenset(b) for b in blocks.values()}:
                return tuple(names[i] for i in subset)
    return None
