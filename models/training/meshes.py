"""The mesh of a run, from its command line: ``--mesh replica=2,data=2,model=2`` (or ``4x2``,
shorthand for ``data=4,model=2``) checked against the strategy and the devices, in one line.

    mesh = mesh_for("hsdp_tp", "replica=2,data=2,model=2")   # a Mesh, or None for ref
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh

import shardops
from shardops_models.strategies.layout import Strategy, strategy_named


def mesh_for(strategy: str | Strategy, spec: str) -> Mesh | None:
    """The mesh ``spec`` describes (``shardops.parse_mesh``), for ``strategy``: None for one
    that names no axis (``ref``). On a machine with fewer accelerators than the mesh needs, the
    simulated CPU devices when there are enough of them.

    Raises ``ValueError`` with one line when the spec does not parse, lacks an axis the
    strategy names, or needs more devices than there are (in a multi-process run: other than
    all of them)."""
    layout = strategy_named(strategy)
    if not layout.axes:
        if jax.process_count() > 1:
            raise ValueError(
                f"--strategy {layout.name} runs on one device: run it without the launcher"
            )
        return None
    try:
        sizes = shardops.parse_mesh(spec)
        layout.check_mesh(sizes)
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    needed = math.prod(sizes.values())
    devices = jax.devices()
    if jax.process_count() > 1 and len(devices) != needed:
        raise ValueError(
            f"--mesh {spec} needs {needed} devices, but the {jax.process_count()} processes of this "
            f"run have {len(devices)} ({jax.local_device_count()} each); a multi-process mesh "
            f"uses every device: launch {needed} devices in all"
        )
    if len(devices) < needed and len(jax.devices("cpu")) >= needed:
        devices = jax.devices("cpu")
    if len(devices) < needed:
        raise ValueError(
            f"--mesh {spec} needs {needed} devices; this process has {len(devices)} (on CPU, "
            f"simulate more with XLA_FLAGS=--xla_force_host_platform_device_count={needed})"
        )
    return shardops.make_mesh(sizes, devices=devices)


def mesh_text(mesh: Mesh | None) -> str:
    """``replica=2 × data=2 × model=2``, or ``one device``."""
    return "one device" if mesh is None else " × ".join(f"{k}={v}" for k, v in mesh.shape.items())
