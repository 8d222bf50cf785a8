"""Building meshes and checking that arrays divide over them.

All sharding arithmetic of shardops (axis sizes, divisibility, PartitionSpec entries) lives in
this module, so that every layer reports a bad layout with the same words.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh
from jax.sharding import PartitionSpec as P

from shardops._axes import DATA_AXIS, MODEL_AXIS

_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def make_mesh(
    axis_sizes: Mapping[str, int],
    *,
    axis_types: str = "auto",
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Build a device mesh from named axis sizes, e.g. ``{"data": 4, "model": 2}``.

    Arguments:
        axis_sizes: mesh axis name → size, major axis first. The product is the number of
            devices used; it may be smaller than the number available (the first ones are used).
        axis_types: ``"auto"`` (default) or ``"explicit"``, applied to every axis. shardops'
            layers accept both. On an ``"auto"`` mesh, an input laid out differently from what a
            layer expects is moved into place by XLA at the layer boundary; on an
            ``"explicit"`` mesh (``jax.make_mesh``'s default since JAX 0.8) that is an error
            naming the fix.
        devices: the devices to use, defaulting to ``jax.devices()``.

    Returns:
        A ``jax.sharding.Mesh`` whose ``devices`` array has shape ``tuple(axis_sizes.values())``.
    """
    _check_axis_sizes(axis_sizes, axis_types)
    available = list(jax.devices() if devices is None else devices)
    needed = math.prod(axis_sizes.values())
    if needed > len(available):
        sizes = " × ".join(f"{n}={s}" for n, s in axis_sizes.items())
        platform = available[0].platform if available else "none"
        raise ValueError(
            f"mesh ({sizes}) needs {needed} devices but only {len(available)} are available "
            f"(platform {platform}). Use smaller axis sizes, or on CPU simulate devices by "
            f"setting XLA_FLAGS=--xla_force_host_platform_device_count={needed} (or "
            f"jax.config.update('jax_num_cpu_devices', {needed})) before JAX initialises."
        )
    grid = np.array(available[:needed], dtype=object).reshape(tuple(axis_sizes.values()))
    kind = _AXIS_TYPES[axis_types]
    return Mesh(grid, tuple(axis_sizes), axis_types=(kind,) * len(axis_sizes))


def parse_mesh(spec: str) -> dict[str, int]:
    """A mesh spec of the command line → axis sizes: ``"replica=2,data=2,model=2"`` (any
    number of named axes, major first), or ``"4x2"``, shorthand for ``data=4,model=2``.

    Raises ``ValueError`` with one line that says what was expected."""
    text = str(spec).strip().replace(" ", "")  # axis names keep their case
    if "=" in text:
        sizes: dict[str, int] = {}
        for part in text.split(","):
            name, _, size = part.partition("=")
            if not name or not size.isdigit() or int(size) < 1 or name in sizes:
                raise ValueError(
                    f"mesh {spec!r}: expected NAME=SIZE,... with distinct names and positive "
                    f"sizes, e.g. replica=2,data=2,model=2"
                )
            sizes[name] = int(size)
        return sizes
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) == 2 and all(p.isdigit() and int(p) >= 1 for p in parts):
        return {DATA_AXIS: int(parts[0]), MODEL_AXIS: int(parts[1])}
    raise ValueError(
        f"mesh {spec!r}: expected DATAxMODEL (e.g. 4x2) or named axes (e.g. "
        f"replica=2,data=2,model=2); more than two axes need their names"
    )


def format_mesh(axis_sizes: Mapping[str, int]) -> str:
    """Axis sizes as ``parse_mesh`` reads them back: ``4x2`` for ``data=4, model=2``,
    ``replica=2,data=4`` for any other axes."""
    if tuple(axis_sizes) == (DATA_AXIS, MODEL_AXIS):
        return f"{axis_sizes[DATA_AXIS]}x{axis_sizes[MODEL_AXIS]}"
    return ",".join(f"{name}={size}" for name, size in axis_sizes.items())


def abstract_mesh(axis_sizes: Mapping[str, int], *, axis_types: str = "auto") -> AbstractMesh:
    """A mesh of named axis sizes with no devices behind it (``jax.sharding.AbstractMesh``):
    programs trace against it at any size, e.g. ``{"data": 64, "model": 64}`` for 4,096
    devices on a laptop, but cannot compile or run. ``axis_types`` as for ``make_mesh``."""
    _check_axis_sizes(axis_sizes, axis_types)
    kind = _AXIS_TYPES[axis_types]
    return AbstractMesh(tuple(axis_sizes.values()), tuple(axis_sizes),
                        axis_types=(kind,) * len(axis_sizes))  # fmt: skip


def _check_axis_sizes(axis_sizes, axis_types: str) -> None:
    if not isinstance(axis_sizes, Mapping) or not axis_sizes:
        raise TypeError(
            f"axis_sizes must be a non-empty mapping of axis name to size, e.g. "
            f"{{'data': 4, 'model': 2}}; got {axis_sizes!r}"
        )
    for name, size in axis_sizes.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"mesh axis names must be non-empty strings; got {name!r}")
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have a positive integer size; got {size!r}")
    if axis_types not in _AXIS_TYPES:
        raise ValueError(f"axis_types must be one of {sorted(_AXIS_TYPES)}; got {axis_types!r}")


def axis_size(mesh: Mesh, axis_name: str | None, *, argument: str = "axis_name") -> int:
    """Size of mesh axis ``axis_name`` (1 for ``None``), with an error naming the mesh's axes."""
    if axis_name is None:
        return 1
    if axis_name not in mesh.shape:
        raise ValueError(
            f"{argument}={axis_name!r} is not an axis of the mesh; the mesh has axes "
            f"{tuple(mesh.axis_names)} with sizes {dict(mesh.shape)}. Pass one of those names, "
            f"or build the mesh with shardops.make_mesh({{..., {axis_name!r}: size}})."
        )
    return mesh.shape[axis_name]


def spec_entry(*axis_names: str | None) -> str | tuple[str, ...] | None:
    """One PartitionSpec entry for a dimension split over ``axis_names`` (major first).

    ``None`` names are dropped: ``spec_entry(None, "model") == "model"``,
    ``spec_entry("data", "model") == ("data", "model")``, ``spec_entry(None) is None``.
    """
    names = tuple(n for n in axis_names if n is not None)
    if not names:
        return None
    return names[0] if len(names) == 1 else names


def check_divisible(
    *,
    argument: str,
    dim: int,
    dim_name: str,
    size: int,
    mesh: Mesh,
    axes: Sequence[str | None],
    hint: str = "",
) -> None:
    """Raise a ``ValueError`` unless ``size`` divides evenly over the product of ``axes``."""
    names = tuple(a for a in axes if a is not None)
    parts = math.prod(mesh.shape[a] for a in names)
    if size % parts:
        over = " × ".join(f"{a!r} (size {mesh.shape[a]})" for a in names)
        multiple = f"a multiple of {parts}"
        raise ValueError(
            f"{argument} dim {dim} ({dim_name}) = {size} is not divisible by mesh axis {over}"
            f"{f' = {parts}' if len(names) > 1 else ''}; choose {multiple} or a mesh whose "
            f"{'axes divide' if len(names) > 1 else 'axis divides'} {size}{hint}"
        )


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: ``None`` → ``()``, ``"data"`` → ``("data",)``,
    ``("data", "model")`` → itself."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def spec_entries(spec: P, ndim: int) -> list:
    """The entries of a PartitionSpec, one per dimension of a rank-``ndim`` array (``None``
    for the dims it leaves out at the end)."""
    return list(spec) + [None] * (ndim - len(spec))


def normalized_spec(spec: P, ndim: int) -> tuple[tuple[str, ...], ...]:
    """A PartitionSpec as one tuple of axis names per dimension, padded to ``ndim``.

    ``P("data")`` and ``P(("data",), None)`` both become ``(("data",), ())`` for ndim 2, so
    specs that mean the same layout compare equal.
    """
    return tuple(entry_axes(e) for e in spec_entries(spec, ndim))


def varying_axes(x) -> frozenset:
    """The mesh axes a value inside ``jax.shard_map`` varies over (its ``check_vma`` type);
    empty outside ``shard_map``."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))
