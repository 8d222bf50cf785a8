"""Reading the collectives of a compiled program from its HLO text.

``collectives(mesh, fn, *args)`` compiles ``fn`` and returns one ``Collective`` per
collective op: its kind, result shapes and dtype, the mesh axes its replica groups span, and its
bytes. It parses:

- tuple-shaped collectives with many operands (XLA combines them; long tuples carry
  ``/*index=N*/`` comments);
- async ``-start``/``-done`` pairs, counted once (with the ``-done``'s result shapes);
- explicit (``{{0,1},{2,3}}``), iota (``[4,2]<=[8]``, ``[2,4]<=[4,2]T(1,0)``) and mesh-axes
  (``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``, sub-axes included) replica groups, in logical device ids (positions in ``mesh.devices.flat``), including non-contiguous groups
  such as ``data`` = {0,2,4,6} on a 4×2 mesh.

``bytes`` is the size V of the full tensor(s) the collective reduces or assembles: the result
for all-reduce, all-gather, collective-permute and all-to-all, and N × the result shard for
reduce-scatter (N = group size). A group of one device moves nothing: 0 bytes. Ring algorithms
send about V(N−1)/N per device for AllGather/ReduceScatter and twice that for AllReduce.

A collective inside a ``while`` loop (a ``lax.scan``) is listed once per iteration, by the trip
count XLA knows (``known_trip_count``).

Each collective also says which pass it belongs to (``Collective.pass_``: forward, backward or
optimizer), read from its ``op_name``, element by element for XLA's combined tuples
(``shardops.inspect._passes``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np
from jax.sharding import Mesh

from shardops.inspect._passes import MIXED, op_names, passes_of

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all-reduce", "all-gather", "reduce-scatter"
COLLECTIVE_PERMUTE, ALL_TO_ALL = "collective-permute", "all-to-all"
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, COLLECTIVE_PERMUTE, ALL_TO_ALL)
"""The collectives shardops reads from a compiled program, by their HLO names."""

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

    @property
    def element_bytes(self) -> tuple[int, ...]:
        """Each tuple element's share of ``bytes`` (they add up to ``bytes``)."""
        return tuple(_bytes(self.kind, [shape], self.group_size) for shape in self.shapes)

    @property
    def op_names(self) -> tuple[str, ...]:
        """One ``op_name`` per tuple element: XLA's combined ``common/(a:b:…)`` split apart."""
        return op_names(self.op_name, len(self.shapes))

    @property
    def passes(self) -> tuple[str, ...]:
        """The pass of each tuple element: ``"forward"``, ``"backward"`` or ``"optimizer"``
        (``shardops.inspect._passes``; ``"mixed"`` where a combined name cannot be split)."""
        return passes_of(self.op_name, len(self.shapes))

    @property
    def pass_(self) -> str:
        """The pass of the whole collective, or ``"mixed"`` when its elements belong to
        different passes (a combined tuple; ``passes`` and ``Ledger.totals(pass_=…)`` split it)."""
        found = set(self.passes)
        return found.pop() if len(found) == 1 else MIXED


def collectives(mesh: Mesh, fn, /, *args, **kwargs) -> list[Collective]:
    """List the collectives of ``fn(*args, **kwargs)`` compiled over ``mesh``.

    ``fn`` is a callable (jitted or not; it is lowered with the arguments and compiled), a
    ``jax.stages.Lowered`` or a ``jax.stages.Compiled``. ``shardops.inspect.ledger`` gives the same
    collectives with totals, ring bytes and the dtypes the program asked for.
    """
    import jax

    if isinstance(fn, jax.stages.Lowered):
        fn = fn.compile()
    if not isinstance(fn, jax.stages.Compiled):
        fn = lower(fn, *args, **kwargs).compile()
    return hlo_collectives(fn.as_text(), mesh)


def lower(fn, /, *args, **kwargs):
    """``fn`` (jitted or not) lowered with these arguments."""
    import jax

    if not callable(fn):
        raise TypeError(f"fn must be a callable, Lowered or Compiled; got {type(fn).__name__}")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs)


def hlo_collectives(hlo_text: str, mesh: Mesh) -> list[Collective]:
    """Parse the collectives out of compiled HLO text. See the module docstring.

    A collective inside a ``while`` loop is listed once per iteration (XLA's
    ``known_trip_count``, nested loops multiplied), so a ``lax.scan`` of L layers lists each
    layer's collectives L times, as the traced program does; a loop whose trip count XLA does
    not know is refused when it holds a collective."""
    runs = _runs_per_computation(hlo_text)
    found, starts, here = [], {}, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            here = header["name"]
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        if m["async"] == "-start":
            starts[m["name"]] = (m, here)
            continue
        attrs_from = m
        if m["async"] == "-done":
            start_name = m["operands"].strip().split()[-1].lstrip("%")
            attrs_from = starts.pop(start_name, (m, here))[0]
        collective = _collective(m["kind"], m["type"], attrs_from["attrs"], mesh)
        found += [collective] * _runs(runs, here, collective)
    for m, where in starts.values():  # a -start without a -done still runs
        collective = _collective(m["kind"], m["type"], m["attrs"], mesh)
        found += [collective] * _runs(runs, where, collective)
    return found


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(
    r"\b(?P<how>to_apply|calls|body|condition|true_computation|false_computation)=%?(?P<name>[\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _runs_per_computation(hlo_text: str) -> dict[str, int | None]:
    """How many times each computation runs per call of the entry: the product of the trip
    counts of the ``while`` loops around it (None: a loop XLA does not know the count of). A
    conditional counts its first branch once and its others not at all (the traced reader
    refuses branches that communicate differently); a computation reached by no edge read
    here counts once, as the program text shows it."""
    calls: dict[str, list[tuple[str, int | None]]] = {}
    order, entry, here = [], None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            here = header["name"]
            order.append(here)
            if line.startswith("ENTRY"):
                entry = here
            continue
        if here is None:
            continue
        trips = _TRIPS.search(line)
        for m in _CALLEE.finditer(line):
            loop = m["how"] in ("body", "condition") and " while(" in line
            factor = (int(trips[1]) if trips else None) if loop else 1
            factor = 0 if m["how"] == "false_computation" else factor  # one branch runs
            calls.setdefault(here, []).append((m["name"], factor))
        for m in _BRANCHES.finditer(line):
            for i, name in enumerate(m["names"].split(",")):
                calls.setdefault(here, []).append((name.strip().lstrip("%"), int(i == 0)))
    runs: dict[str, int | None] = {}
    runs[entry if entry is not None else (order[-1] if order else "")] = 1
    for name in reversed(order):  # callers are printed after their callees
        n = runs.get(name, 1)  # reached by no edge read here: once
        for callee, factor in calls.get(name, ()):
            add = None if n is None or factor is None else n * factor
            old = runs.get(callee, 0)
            runs[callee] = None if add is None or old is None else old + add
    return runs


def _runs(runs: dict, computation, collective: Collective) -> int:
    n = runs.get(computation, 1) if computation is not None else 1
    if n is None:
        raise ValueError(
            f"a while loop whose trip count XLA does not know runs a {collective.kind} over "
            f"{collective.axes} ({collective.op_name}): its bytes per step cannot be read from "
            f"the program. Use lax.scan or a fori_loop with static bounds."
        )
    return n


def _collective(kind: str, type_text: str, attrs: str, mesh: Mesh) -> Collective:
    shapes = tuple(
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(re.sub(r"/\*.*?\*/", "", type_text))
    )
    if kind == "collective-permute":
        groups = None
        pairs = _permute_pairs(attrs)
    else:
        groups, pairs = _replica_groups(attrs, mesh.devices.size), None
    op_name = _OP_NAME.search(attrs)
    return make_collective(kind, shapes, mesh, groups=groups, pairs=pairs,
                           op_name=op_name[1] if op_name else "")  # fmt: skip


def make_collective(kind, shapes, mesh: Mesh, *, groups=None, pairs=None, op_name="") -> Collective:
    """A ``Collective`` from its result shapes and its replica groups (or permute pairs)."""
    if kind == "collective-permute":
        axes, group_size = _axes_of_pairs(pairs, mesh)
    else:
        axes, group_size = _axes_of_groups(groups, mesh), max(len(g) for g in groups)
    return Collective(
        kind=kind, shapes=tuple(shapes), axes=axes, group_size=group_size,
        bytes=_bytes(kind, shapes, group_size), op_name=op_name,
    )  # fmt: skip


def _bytes(kind, shapes, group_size: int) -> int:
    """V of the module docstring for result ``shapes``: N × the result for reduce-scatter."""
    result_bytes = sum(_DTYPE_BYTES[d] * math.prod(s) for d, s in shapes)
    if group_size <= 1:
        return 0
    if kind == "reduce-scatter":
        return result_bytes * group_size
    return result_bytes


# --- the lowered (StableHLO) module: what the program asked for, before XLA combines or
# promotes anything. E.g.
#   %2 = "stablehlo.all_reduce"(%1) <{..., replica_groups = dense<[[0, 2], [1, 3]]> : tensor<2x2xi64>,
#   ...}> ({ ...region... }) : (tensor<4x4xbf16>) -> tensor<4x4xbf16>
_STABLEHLO_KINDS = {
    "all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
    "collective_permute": "collective-permute", "all_to_all": "all-to-all",
}  # fmt: skip
_STABLEHLO_OP = re.compile(r'"stablehlo\.(' + "|".join(_STABLEHLO_KINDS) + r')"\(')
_STABLEHLO_SIGNATURE = re.compile(r"\)\s*->\s*(\((?:[^()]|\([^()]*\))*\)|tensor<[^>]*>)")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z][a-z0-9]*)>")
_DENSE = re.compile(r"= dense<(.*?)> : tensor<([0-9x]+)xi64>")
_MLIR_DTYPES = {"i1": "pred", "i8": "s8", "i16": "s16", "i32": "s32", "i64": "s64",
                "ui8": "u8", "ui16": "u16", "ui32": "u32", "ui64": "u64"}  # fmt: skip


def lowered_collectives(stablehlo_text: str, mesh: Mesh) -> list[Collective]:
    """The collectives of a lowered (StableHLO) module, in the dtypes the program asked for."""
    found = []
    for m in _STABLEHLO_OP.finditer(stablehlo_text):
        rest = stablehlo_text[m.end() :]
        signature = _STABLEHLO_SIGNATURE.search(rest)
        attrs = rest[: signature.start()] if signature else rest
        shapes = tuple(
            (_MLIR_DTYPES.get(dtype, dtype), tuple(int(d) for d in dims.split("x") if d))
            for dims, dtype in _TENSOR.findall(signature[1] if signature else "")
        )
        kind = _STABLEHLO_KINDS[m[1]]
        table = _dense(
            attrs, "source_target_pairs" if kind == "collective-permute" else "replica_groups"
        )
        if kind == "collective-permute":
            found.append(make_collective(kind, shapes, mesh, pairs=[tuple(p) for p in table]))
        else:
            groups = [tuple(g) for g in table] if table is not None and table.size else None
            found.append(make_collective(kind, shapes, mesh,
                                         groups=groups or [tuple(range(mesh.devices.size))]))  # fmt: skip
    return found


def _dense(attrs: str, name: str):
    m = re.search(re.escape(name) + r"\s*" + _DENSE.pattern, attrs)
    if not m:
        return None
    shape = tuple(int(d) for d in m[2].split("x"))
    if m[1].startswith('"0x'):  # large tables print as little-endian hex: dense<"0x0000...">
        return np.frombuffer(bytes.fromhex(m[1][3:-1]), dtype="<i8").reshape(shape)
    values = [int(v) for v in re.findall(r"-?\d+", m[1])]
    if len(values) == 1 and math.prod(shape) != 1:  # a splat: dense<0> : tensor<8x1xi64>
        values = values * math.prod(shape)
    return np.array(values, dtype=np.int64).reshape(shape)


def _replica_groups(attrs: str, n_devices: int) -> list[tuple[int, ...]]:
    mesh_axes = _MESH_GROUPS.search(attrs)
    if mesh_axes:
        return _mesh_axes_groups(mesh_axes)
    iota = re.search(r"replica_groups=(\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)", attrs)
    if iota:
        return [tuple(int(i) for i in g) for g in _iota(iota[1])]
    explicit = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if explicit and explicit[1]:
        return [
            tuple(int(i) for i in g.split(",") if i)
            for g in re.findall(r"\{([0-9,]*)\}", explicit[1])
        ]
    return [tuple(range(n_devices))]  # replica_groups={} or absent: one group of all devices


# Shardy-style groups: replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, optionally with
# ", device_ids=(...)" after the mesh and sub-axes written 'axis_0':(pre_size)size.
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?"
    r"\s*\{(?P<group>[^}]*)\}"
)


def _iota(text: str) -> np.ndarray:
    """``[4,2]<=[8]`` or ``[2,4]<=[4,2]T(1,0)``: iota(reshape) transposed, then reshaped."""
    m = re.fullmatch(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text.strip())
    if not m:
        raise ValueError(f"cannot parse iota device list {text!r}")
    shape = [int(v) for v in m[1].split(",")]
    reshape = [int(v) for v in m[2].split(",")]
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if m[3]:
        ids = ids.transpose([int(v) for v in m[3].split(",")])
    return ids.reshape(shape)


def _device_ids(text: str) -> np.ndarray:
    """A mesh's device list: ``[4,2]T(1,0)`` (iota over [4,2], transposed), ``[8]<=[2,4]T(1,0)``
    or explicit ids."""
    compact = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    if compact:
        dims = [int(v) for v in compact[1].split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if compact[2]:
            ids = ids.transpose([int(v) for v in compact[2].split(",")])
        return ids.ravel()
    if "<=" in text:
        return _iota(text).ravel()
    return np.array([int(v) for v in re.findall(r"\d+", text)])


def _mesh_axes_groups(m: re.Match) -> list[tuple[int, ...]]:
    names, sizes = [], []
    for entry in m["axes"].split(","):
        name, size = entry.rsplit("=", 1)
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    if m["ids"]:
        device_ids = _device_ids(m["ids"].strip()).reshape(sizes)
    else:
        device_ids = np.arange(math.prod(sizes)).reshape(sizes)
    # Each grouped (sub-)axis is a digit of a device's mesh coordinate: devices that agree on
    # every other digit form one group. A sub-axis (pre_size)size of an axis of size n is the
    # digit (coord // (n // (pre_size*size))) % size.
    grouped = []
    for ref in filter(None, (r.strip() for r in m["group"].split(","))):
        sub = re.fullmatch(r"['\"]?([^'\":]+)['\"]?(?::\((\d+)\)(\d+))?", ref)
        axis = names.index(sub[1])
        pre, size = (int(sub[2]), int(sub[3])) if sub[2] else (1, sizes[axis])
        grouped.append((axis, sizes[axis] // (pre * size), size))
    groups: dict[tuple, list[int]] = {}
    for coord in np.ndindex(*sizes):
        key = list(coord)
        for axis, post, size in grouped:
            key[axis] -= (coord[axis] // post % size) * post  # drop this digit
        groups.setdefault(tuple(key), []).append(int(device_ids[coord]))
    return [tuple(g) for g in groups.values()]


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
