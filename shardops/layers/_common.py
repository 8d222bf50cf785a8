"""What every layer family shares: the checks of a kernel's arguments inside ``shard_map``, the
checks of a layer's mesh and options, and ``run_layer``, which builds the ``shard_map``."""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from shardops._devices import check_devices
from shardops._mesh import axis_size, normalized_spec, varying_axes
from shardops._precision import Precision

REDUCTIONS = ("psum", "psum_scatter")
"""How a row-parallel result (or an embedding's lookup) is reduced: replicated or scattered."""


# --- inside shard_map: a kernel's arguments


def bound_axis_size(axis_name: str, op: str) -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{op} is a per-device kernel: call it inside jax.shard_map over a mesh with axis "
            f"{axis_name!r}. For global arrays use the layer of the same name without "
            f"'_kernel' (e.g. shardops.{op.removesuffix('_kernel')})."
        ) from None


def check_sharded_over(w, axis_name: str, argument: str, op: str) -> None:
    if axis_name not in varying_axes(w):
        raise ValueError(
            f"{op}: {argument} must be the local shard of a weight split over mesh axis "
            f"{axis_name!r}, but it is the same on every device of that axis. Give shard_map an "
            f"in_spec that splits it over {axis_name!r}; and keep check_vma=True (the default), "
            f"which autodiff needs to reduce gradients correctly."
        )


def check_replicated_over(x, axis_name: str, argument: str, op: str) -> None:
    if axis_name in varying_axes(x):
        raise ValueError(
            f"{op}: {argument} must be replicated over mesh axis {axis_name!r}, but it varies "
            f"over it. Reduce it first (shardops.comm.all_reduce), or use the option that takes a sharded input."
        )


def check_reduce(reduce: str, result: str) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(
            f"reduce must be one of {REDUCTIONS}; got {reduce!r}. 'psum' gives a "
            f"replicated {result}, 'psum_scatter' one split along scatter_dimension."
        )


def check_even_block(op: str, collective_matmul, block: int, where: str, fix: str) -> None:
    """``"bidirectional"`` sends half of each block each way round the ring: the block must be even.
    ``where`` says which block (and its size), ``fix`` what to choose instead."""
    if collective_matmul == "bidirectional" and block % 2:
        raise ValueError(
            f"{op}: collective_matmul='bidirectional' sends half of each block each way round "
            f"the ring, but {where} (odd); choose {fix} or collective_matmul='ring'"
        )


# --- on global arrays: a layer's options and mesh, and running its kernel


def check_precision(op: str, precision) -> None:
    if not isinstance(precision, Precision):
        raise TypeError(
            f"{op}: precision must be a shardops.Precision (FLOAT32, BFLOAT16 or "
            f"MIXED_BFLOAT16); got {precision!r}"
        )


def check_axes(mesh: Mesh, axis_name: str, batch_axis: str | None) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (see shardops.make_mesh); got {type(mesh).__name__}"
        )
    axis_size(mesh, axis_name, argument="axis_name")
    axis_size(mesh, batch_axis, argument="batch_axis")
    if batch_axis == axis_name:
        raise ValueError(
            f"batch_axis and axis_name are both {axis_name!r}; the batch and the weights must be "
            f"split over different mesh axes"
        )


def scoped(layer: str):
    """Run the kernel under ``jax.named_scope("shardops.<layer>")``, so that profiles, the ledger
    and ``explain`` name its collectives also when it is called from a user's own shard_map."""

    def wrap(kernel):
        @functools.wraps(kernel)
        def run(*args, **kwargs):
            with jax.named_scope(f"shardops.{layer}"):
                return kernel(*args, **kwargs)

        return run

    return wrap


def run_layer(op: str, kernel, mesh: Mesh, args: dict, in_specs: dict, out_specs):
    """``kernel(*args.values())`` under ``jax.shard_map`` (``check_vma=True``) inside
    ``jax.named_scope("shardops.<op>")``, the way every shardops layer runs its kernel.

    First, every argument (and every leaf of a dict argument) must live on ``mesh``'s devices
    (``check_devices``) and, on Explicit mesh axes, be laid out as its spec says.
    """
    check_devices(mesh, op, **args)
    for name, arg in args.items():
        spec = in_specs[name]
        leaves = arg.items() if isinstance(arg, dict) else [(None, arg)]
        for key, leaf in leaves:
            where = name if key is None else f"{name}[{key!r}]"
            check_explicit_layout(op, where, leaf, spec if key is None else spec[key], mesh)

    def region(*values):
        with jax.named_scope(f"shardops.{op}"):
            return jax.shard_map(
                kernel,
                mesh=mesh,
                in_specs=tuple(in_specs[name] for name in args),
                out_specs=out_specs,
                check_vma=True,
            )(*values)

    if not any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(list(args.values()))):
        # Called eagerly: one compiled program, not the body op by op (an eager shard_map
        # dispatches each of its operations as a program of its own: 444 compiles for one
        # context-parallel attention of 2 × 16 tokens, 8.7 s against 0.9 s). Traced afresh
        # each call, as the eager body was: what a kernel reads while it traces (a routing
        # hook, the locator's taps) is read again.
        region = jax.jit(region)
    return region(*args.values())


def check_explicit_layout(op: str, name: str, arg, spec: P, mesh: Mesh) -> None:
    """On Explicit mesh axes, an argument's sharding is part of its type: it must match."""
    explicit = {
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    }
    if not explicit:
        return
    sharding = getattr(jax.typeof(arg), "sharding", None)
    got = getattr(sharding, "spec", P())
    ndim = len(arg.shape)

    def explicit_only(s):
        return tuple(tuple(a for a in e if a in explicit) for e in normalized_spec(s, ndim))

    if explicit_only(got) != explicit_only(spec):
        raise ValueError(
            f"{op}: {name} is laid out as {got} but this layer needs {spec} on the Explicit "
            f"mesh {dict(mesh.shape)}. Reshard it deliberately with "
            f"jax.sharding.reshard({name}, {spec}) (or place it with jax.device_put and "
            f"NamedSharding(mesh, {spec})), or use a mesh with Auto axes to let XLA move it."
        )
