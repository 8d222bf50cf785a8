"""Seeing shardings: per-leaf layouts in the terminal, and weight tilings as a PNG.

``layout_table(tree)`` lists, for each array of a tree (parameters, optimizer state, a batch),
its global shape, PartitionSpec, per-device shard shape and bytes, and how many distinct tiles
the devices hold. ``show_layout`` prints it with rich, followed by
``jax.debug.visualize_array_sharding``'s device grid for each 1-D or 2-D array. ``layout_png``
draws each weight matrix of a model as a rectangle tiled by device, one panel per layer.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """The layout of one array over the devices."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    shard_shape: tuple[int, ...]
    shard_bytes: int
    tiles: dict[tuple, tuple[int, ...]]
    """Each distinct block (as ``((start, stop), ...)`` per dimension) → the device ids holding it."""

    @property
    def replication(self) -> int:
        """How many devices hold each block."""
        return len(next(iter(self.tiles.values())))


def tiles_of(shape, sharding) -> dict[tuple, tuple[int, ...]]:
    """Block ``((start, stop), ...)`` → ids of the devices that hold it, for any sharding."""
    out: dict[tuple, list[int]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        block = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        out.setdefault(block, []).append(device.id)
    return {block: tuple(sorted(ids)) for block, ids in sorted(out.items())}


def layouts(tree) -> list[LeafLayout]:
    """``LeafLayout`` of every array leaf of ``tree`` (arrays must be placed: jax.Array)."""
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, jax.Array):
            continue
        sharding = leaf.sharding
        spec = (
            str(sharding.spec) if isinstance(sharding, NamedSharding) else type(sharding).__name__
        )
        shard_shape = sharding.shard_shape(leaf.shape)
        out.append(
            LeafLayout(
                path=jax.tree_util.keystr(path) or "array",
                shape=tuple(leaf.shape),
                dtype=leaf.dtype.name,
                spec=spec,
                shard_shape=tuple(shard_shape),
                shard_bytes=math.prod(shard_shape) * leaf.dtype.itemsize,
                tiles=tiles_of(leaf.shape, sharding),
            )
        )
    return out


def layout_table(tree, title: str = "layout"):
    """A ``rich.table.Table`` of ``layouts(tree)``, with the per-device total."""
    from rich.table import Table

    table = Table(title=title)
    for name in (
        "leaf",
        "global shape",
        "PartitionSpec",
        "shard shape",
        "bytes/device",
        "tiles × copies",
    ):
        table.add_column(name, justify="right" if name in ("bytes/device",) else "left")
    total = 0
    for leaf in layouts(tree):
        total += leaf.shard_bytes
        table.add_row(
            leaf.path, f"{leaf.dtype}{list(leaf.shape)}", leaf.spec, str(list(leaf.shard_shape)),
            f"{leaf.shard_bytes:,}", f"{len(leaf.tiles)} × {leaf.replication}",
        )  # fmt: skip
    table.add_row("total", "", "", "", f"{total:,}", "", style="bold")
    return table


def show_layout(tree, *, title: str = "layout", grids: bool = True, console=None) -> None:
    """Print the layout table of ``tree`` and, for 1-D/2-D leaves, their device grids."""
    from rich.console import Console

    console = console or Console(width=120)
    console.print(layout_table(tree, title))
    if grids:
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(leaf, jax.Array) and leaf.ndim in (1, 2):
                console.print(
                    f"{jax.tree_util.keystr(path) or 'array'}: {leaf.dtype.name}{list(leaf.shape)}"
                )
                jax.debug.visualize_array_sharding(leaf, use_color=False)


def layout_png(path, weights: dict[str, tuple[tuple[int, int], P]], mesh: Mesh, *, title: str = ""):
    """Draw weight matrices tiled by device, one panel each, and save a PNG at ``path``.

    Arguments:
        weights: panel name → (global shape ``(rows, cols)``, PartitionSpec on ``mesh``).

    Returns:
        panel name → ``tiles_of`` that panel (the drawing as data: what tests check).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colors = plt.get_cmap("tab10" if mesh.devices.size <= 10 else "tab20")
    fig, axes = plt.subplots(1, len(weights), figsize=(4.2 * len(weights), 4.4), squeeze=False)
    drawn = {}
    for ax, (name, (shape, spec)) in zip(axes[0], weights.items(), strict=True):
        tiles = tiles_of(shape, NamedSharding(mesh, spec))
        drawn[name] = tiles
        rows, cols = shape
        for ((r0, r1), (c0, c1)), ids in tiles.items():
            ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=colors(ids[0] % colors.N),
                                   edgecolor="black", linewidth=1.0, alpha=0.85))  # fmt: skip
            label = (
                "dev " + ",".join(map(str, ids))
                if len(ids) <= 4
                else f"dev {ids[0]}…{ids[-1]} ({len(ids)})"
            )
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=7)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_aspect("auto")
        ax.set_title(f"{name}: [{rows}, {cols}]\n{spec}", fontsize=9)
        ax.set_xlabel("columns")
        ax.set_ylabel("rows")
    fig.suptitle(title or f"mesh {dict(mesh.shape)}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn


def grid_sharding(grid, *, devices=None) -> NamedSharding:
    """The removed ``PositionalSharding``, in today's JAX: lay devices out by position.

    ``grid`` is a nested list (or array) of device ids, e.g. the seed's ``[[0, 1], [2, 3]]``: an
    array placed with the result is split into ``len(grid)`` blocks along dim 0 and
    ``len(grid[0])`` along dim 1, and block (i, j) lives on device ``grid[i][j]``.

    ``PositionalSharding(devices).reshape(2, 2)`` becomes ``grid_sharding([[0, 1], [2, 3]])``,
    which is ``NamedSharding(Mesh(devices.reshape(2, 2), ("grid0", "grid1")),
    P("grid0", "grid1"))``: a mesh whose axes follow the grid's dimensions, and a spec that
    splits array dimension k over grid axis k. (Replicating along a grid axis, PositionalSharding's
    ``.replicate(k)``, is leaving that axis out of the spec.)
    """
    ids = np.asarray(grid)
    if ids.dtype.kind not in "iu" or ids.size == 0:
        raise TypeError(
            f"grid must be a nested list of device ids, e.g. [[0, 1], [2, 3]]; got {grid!r}"
        )
    by_id = {d.id: d for d in (devices or jax.devices())}
    missing = sorted(set(ids.ravel().tolist()) - set(by_id))
    if missing:
        raise ValueError(f"grid names device ids {missing} that do not exist; have {sorted(by_id)}")
    if len(set(ids.ravel().tolist())) != ids.size:
        raise ValueError(f"grid lists a device twice: {ids.tolist()}")
    names = tuple(f"grid{k}" for k in range(ids.ndim))
    mesh = Mesh(np.vectorize(by_id.__getitem__, otypes=[object])(ids), names)
    return NamedSharding(mesh, P(*names))
