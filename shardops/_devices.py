"""Device-mismatch errors: arrays that live on devices (or a mesh) other than the one a shardops
function was given get a shardops error naming both device sets and the fix, instead of XLA's
"incompatible devices"."""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding


class DeviceMismatchError(ValueError):
    """An argument lives on other devices, or another mesh, than the one the function uses."""


def _ids(devices) -> list[int]:
    return sorted(d.id for d in devices)


def _ranges(ids: list[int]) -> str:
    if ids and ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2:
        return f"{ids[0]}–{ids[-1]}"
    return ", ".join(map(str, ids))


def check_devices(mesh: Mesh, op: str, **arguments) -> None:
    """Raise ``DeviceMismatchError`` unless every concrete, committed array in ``arguments``
    (name → array or tree) lives on ``mesh``'s devices, laid out on ``mesh`` itself if it carries
    a ``NamedSharding``. Tracers (inside ``jit``) and uncommitted arrays are left to JAX."""
    mesh_ids = _ids(mesh.devices.flat)
    for name, tree in arguments.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
                continue
            if not getattr(leaf, "committed", True):
                continue
            where = f"{name}{jax.tree_util.keystr(path)}"
            ids = _ids(leaf.sharding.device_set)
            if ids != mesh_ids:
                raise DeviceMismatchError(
                    f"{op}: {where} lives on devices {_ranges(ids)} but the mesh "
                    f"{dict(mesh.shape)} uses devices {_ranges(mesh_ids)}. Move it onto the "
                    f"mesh (jax.device_put({name}, NamedSharding(mesh, spec))) or build every "
                    f"array and layer on one mesh."
                )
            sharding = leaf.sharding
            if isinstance(sharding, NamedSharding) and not _same_mesh(sharding.mesh, mesh):
                raise DeviceMismatchError(
                    f"{op}: {where} is laid out on mesh {dict(sharding.mesh.shape)} (devices "
                    f"{_order(sharding.mesh)}) but this function was built for mesh "
                    f"{dict(mesh.shape)} (devices {_order(mesh)}). Reshard it onto this mesh "
                    f"(jax.device_put({name}, NamedSharding(mesh, spec))) or use one mesh."
                )


def _same_mesh(a, b: Mesh) -> bool:
    return (
        tuple(a.axis_names) == tuple(b.axis_names)
        and tuple(a.devices.shape) == tuple(b.devices.shape)
        and [d.id for d in a.devices.flat] == [d.id for d in b.devices.flat]
    )


def _order(mesh) -> str:
    return str([[d.id for d in row] for row in mesh.devices.reshape(mesh.devices.shape[0], -1)])
