"""``expect_collectives``: assert, in a test, the bytes each pass of a compiled program moves.

    # fsdp on data=8 (fsdp_dense="gather_weights") of the 784-512-10 MLP
    led = shardops.testing.expect_collectives(
        setup.train_step, state, x, y,
        forward={("all-gather", ("data",)): 1_628_160, ("all-reduce", ("data",)): 4},
        backward={("reduce-scatter", ("data",)): 1_628_160, ("all-reduce", ("data",)): 40},
        optimizer={},
    )

On a mismatch it raises ``AssertionError`` with a diff table: one row per (pass, kind, axes),
with the expected and compiled bytes, their difference, a status (``differs``, ``missing``:
expected but not compiled, ``unexpected``: compiled but not expected, such as a reshard XLA
inserted) and the layers (named scopes) and ``dtype[shape]`` of the compiled collectives behind
it, followed by the compiled bytes written as arguments to paste.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import jax
from jax.sharding import Mesh, NamedSharding

from shardops.inspect._hlo import KINDS
from shardops.inspect._ledger import Ledger, ledger
from shardops.inspect._passes import MIXED, PASSES, op_names, scopes_of

_STATUS_OK = "ok"


def expect_collectives(
    fn,
    /,
    *args,
    forward: Mapping | None = None,
    backward: Mapping | None = None,
    optimizer: Mapping | None = None,
    mesh: Mesh | None = None,
    **kwargs,
) -> Ledger:
    """Compile ``fn(*args, **kwargs)`` and assert that each pass moves exactly the bytes given.

    Arguments:
        fn: a callable (jitted or not), e.g. a ``shard_map``-ed layer, ``jax.value_and_grad``
            of a loss, or a ``train_step``; or a ``shardops.inspect.Ledger`` already compiled (then no
            arguments).
        forward, backward, optimizer: ``{(kind, axes): bytes}`` per pass, like
            ``Ledger.totals()``: ``kind`` one of ``shardops.inspect.KINDS``, ``axes`` a tuple of
            the mesh's axis names in mesh order, ``bytes`` the size V of the tensor(s) one group
            of devices reduces or assembles (the result of an all-reduce or all-gather, N × the
            result shard of a reduce-scatter; a tensor also split over another mesh axis counts
            one block; not the ring bytes each device sends). ``None`` (the default)
            leaves a pass unchecked; ``{}`` asserts that it has no collectives at all.
            Passes are read from each op's ``op_name``: autodiff's transpose is the backward,
            a ``jax.named_scope(shardops.inspect.OPTIMIZER_SCOPE)`` the optimizer, the rest forward.
        mesh: the mesh ``fn`` runs on; by default the mesh of the arguments' ``NamedSharding``s
            (pass it when the arguments are not placed, e.g. ``jax.ShapeDtypeStruct``s).

    Returns:
        The ``Ledger`` of the compiled program, for further checks.

    Raises:
        AssertionError: the compiled bytes differ; the message is the diff table.
        ValueError, TypeError: bad expectations or no mesh, naming what is wrong.
    """
    if isinstance(fn, Ledger):
        if args or kwargs or mesh is not None:
            raise TypeError(
                "expect_collectives: fn is a Ledger (already compiled); pass no arguments and "
                "no mesh with it, or pass the function itself"
            )
        mesh = fn.mesh
    else:
        mesh = _mesh_of(mesh, args, kwargs)
    expected = {
        name: _checked_pass(name, given, mesh)
        for name, given in (("forward", forward), ("backward", backward), ("optimizer", optimizer))
        if given is not None
    }
    led = fn if isinstance(fn, Ledger) else ledger(mesh, fn, *args, **kwargs)
    compiled = led.by_pass()
    rows = []
    for pass_ in (*PASSES, MIXED):
        if pass_ not in expected and not (pass_ == MIXED and compiled.get(MIXED) and expected):
            continue
        want, got = expected.get(pass_, {}), compiled.get(pass_, {})
        for key in sorted(want.keys() | got.keys()):
            rows.append((pass_, *key, want.get(key), got.get(key, 0)))
    if any(_status(*row) != _STATUS_OK for row in rows):
        raise AssertionError(_diff(fn, led, rows, expected, compiled))
    return led


def _mesh_of(mesh, args, kwargs) -> Mesh:
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"expect_collectives: mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}"
            )
        return mesh
    meshes = list(dict.fromkeys(
        leaf.sharding.mesh for leaf in jax.tree.leaves((args, kwargs))
        if isinstance(getattr(leaf, "sharding", None), NamedSharding)
        and isinstance(leaf.sharding.mesh, Mesh)
    ))  # fmt: skip
    if len(meshes) == 1:
        return meshes[0]
    if not meshes:
        raise ValueError(
            "expect_collectives: no argument is placed with a NamedSharding, so the mesh is "
            "unknown; pass mesh=... (the mesh fn runs on)"
        )
    raise ValueError(
        f"expect_collectives: the arguments live on {len(meshes)} different meshes "
        f"({', '.join(str(dict(m.shape)) for m in meshes)}); pass mesh=... (the mesh fn runs on)"
    )


def _checked_pass(name: str, given, mesh: Mesh) -> dict:
    """``given`` as ``{(kind, axes): bytes}``, or a ValueError/TypeError naming the problem."""
    if not isinstance(given, Mapping):
        raise TypeError(
            f"expect_collectives: {name} must be a dict {{(kind, axes): bytes}} (or None to "
            f"leave the {name} pass unchecked, {{}} for no collectives); got {type(given).__name__}"
        )
    axis_names = tuple(mesh.axis_names)
    out = {}
    for key, nbytes in given.items():
        where = f"expect_collectives: {name}[{key!r}]"
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(
                f"{where}: a key must be a (kind, axes) pair, e.g. ('all-reduce', "
                f"({axis_names[0]!r},)); got {key!r}"
            )
        kind, axes = key
        if kind not in KINDS:
            raise ValueError(f"{where}: kind must be one of {KINDS}; got {kind!r}")
        if isinstance(axes, str):
            raise TypeError(
                f"{where}: axes must be a tuple of mesh axis names; got the string {axes!r}. "
                f"Write ({axes!r},)"
            )
        if not isinstance(axes, tuple) or not axes:
            raise TypeError(
                f"{where}: axes must be a non-empty tuple of the mesh's axis names "
                f"{axis_names}; got {axes!r}"
            )
        unknown = [a for a in axes if a not in axis_names]
        if unknown:
            raise ValueError(
                f"{where}: axes {axes!r} name {', '.join(map(repr, unknown))}, not an axis of the "
                f"mesh {dict(mesh.shape)}; use names from {axis_names}"
            )
        in_order = tuple(a for a in axis_names if a in axes)
        if axes != in_order:
            raise ValueError(
                f"{where}: axes {axes!r} must be distinct and in mesh order, as the ledger keys "
                f"them; write {in_order!r}"
            )
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
            raise TypeError(
                f"{where}: bytes must be an int ≥ 0 (V, the full tensor's bytes); got "
                f"{nbytes!r} ({type(nbytes).__name__})"
            )
        if nbytes < 0:
            raise ValueError(
                f"{where}: bytes must be an int ≥ 0 (V, the full tensor's bytes); got {nbytes}"
            )
        if nbytes:  # 0 bytes expected: none, like a ledger that leaves zero-byte groups out
            out[(kind, axes)] = int(nbytes)
    return out


def _status(pass_, kind, axes, want, got) -> str:
    if pass_ == MIXED:
        return "mixed"
    if want is None:
        return "unexpected"
    if not got:
        return "missing"
    return _STATUS_OK if want == got else "differs"


def _diff(fn, led: Ledger, rows, expected, compiled) -> str:
    name = "the ledger" if isinstance(fn, Ledger) else getattr(fn, "__name__", type(fn).__name__)
    table = [("pass", "kind", "axes", "expected", "compiled", "difference", "status",
              "layer: dtype[shape] of the compiled collectives")]  # fmt: skip
    for pass_, kind, axes, want, got in rows:
        table.append((
            pass_, kind, "×".join(axes) or "-",
            "-" if want is None else f"{want:,}", f"{got:,}",
            f"{got - (want or 0):+,}" if got != want else "0",
            _status(pass_, kind, axes, want, got), _layers(led, pass_, kind, axes),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    numbers_at = (3, 4, 5)  # right-aligned; the last column (layers) is not padded
    lines = []
    for r in table:
        cells = [c.rjust(w) if i in numbers_at else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r[:-1], widths[:-1], strict=True))]  # fmt: skip
        lines.append("  " + "  ".join([*cells, r[-1]]))
    bad = sum(_status(*row) != _STATUS_OK for row in rows)
    checked = ", ".join(expected)
    out = [
        f"expect_collectives: {name} moves other bytes than expected ({bad} of {len(rows)} "
        f"rows; passes checked: {checked}; bytes are V, the full tensor reduced or assembled):",
        *lines,
    ]
    if any(_status(*row) == "mixed" for row in rows):
        out.append(
            "  mixed: XLA combined collectives of several passes into one tuple whose op_name "
            "cannot be split by element; its bytes belong to no single pass."
        )
    unchecked = [p for p in PASSES if p not in expected and compiled.get(p)]
    for p in unchecked:
        out.append(f"  not checked: {p} ({sum(compiled[p].values()):,} bytes)")
    out.append("compiled, as arguments:")
    for p in PASSES:
        if p in expected or compiled[p]:
            items = ", ".join(f"({k!r}, {a!r}): {v:_}" for (k, a), v in compiled[p].items())
            out.append(f"  {p}={{{items}}},")
    return "\n".join(out)


def _layers(led: Ledger, pass_, kind, axes) -> str:
    """``row_parallel_dense: f32[4,8]; backward scope: f32[8,16], f32[1,16]`` for the compiled
    elements of this pass, kind and axes."""
    by_scope: dict[str, list[str]] = {}
    for c in led.collectives:
        if (c.kind, c.axes) != (kind, axes):
            continue
        names = op_names(c.op_name, len(c.shapes))
        for (dtype, dims), p, name, nbytes in zip(c.shapes, c.passes, names, c.element_bytes,
                                                   strict=True):  # fmt: skip
            if p == pass_ and nbytes:
                scope = "/".join(s.removeprefix("shardops.") for s in scopes_of(name))
                scope = scope or f"({name.rsplit('/', 1)[-1] or 'no op_name'})"  # the primitive
                by_scope.setdefault(scope, []).append(f"{dtype}[{','.join(map(str, dims))}]")
    parts = []
    for scope, shapes in by_scope.items():
        shown = ", ".join(shapes[:3]) + (f", … ({len(shapes)} tensors)" if len(shapes) > 3 else "")
        parts.append(f"{scope}: {shown}")
    return "; ".join(parts) or "-"
