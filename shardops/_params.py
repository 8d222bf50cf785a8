"""Dense-layer parameters: full (unsharded) init, the unsharded reference layer, and sharding.

Init builds the *full* weights exactly as an unsharded model would, then ``shard_params``
places them, so a sharded and an unsharded run start from the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardops._precision import FLOAT32, Precision

Initializer = Callable[..., jax.Array]
LECUN_NORMAL: Initializer = jax.nn.initializers.lecun_normal()


def init_dense(
    key: jax.Array,
    in_features: int,
    out_features: int,
    *,
    use_bias: bool = True,
    w_init: Initializer = LECUN_NORMAL,
    b_init: Initializer = jax.nn.initializers.zeros,
    dtype=jnp.float32,
) -> dict[str, jax.Array]:
    """Full parameters of a dense layer: ``{"w": w[in_features, out_features], "b": b[out_features]}``.

    The result does not depend on any mesh. Shard it with ``shard_params(params, mesh,
    column_parallel_specs().params)`` (or the row-parallel specs).
    """
    for name, n in (("in_features", in_features), ("out_features", out_features)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int; got {n!r}")
    w_key, b_key = jax.random.split(key)
    params = {"w": w_init(w_key, (in_features, out_features), dtype)}
    if use_bias:
        params["b"] = b_init(b_key, (out_features,), dtype)
    return params


def dense(x, w, b=None, *, precision: Precision = FLOAT32):
    """The unsharded reference layer: ``x[B, D] · w[D, F] + b[F] → y[B, F]`` under ``precision``."""
    return precision.finish(precision.matmul(x, w), b)


def shard_params(params, mesh: Mesh, specs):
    """Place a full parameter tree on ``mesh``: each leaf with ``NamedSharding(mesh, spec)``.

    ``specs`` is a tree with the structure of ``params`` (leaves ``PartitionSpec``), or a prefix
    of it. Leaves absent from ``params`` (e.g. ``"b"`` when ``use_bias=False``) are ignored.
    """
    if isinstance(specs, dict) and isinstance(params, dict):
        unknown = set(params) - set(specs)
        if unknown:
            raise ValueError(
                f"shard_params: no PartitionSpec for {sorted(unknown)}; specs has {sorted(specs)}"
            )
        specs = {k: specs[k] for k in params}
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
    )
    return jax.device_put(params, shardings)
