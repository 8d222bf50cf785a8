"""Dense-layer parameters: full (unsharded) init, the unsharded reference layer, and sharding.

Init builds the *full* weights exactly as an unsharded model would, then ``shard_params``
places them, so a sharded and an unsharded run start from the same numbers.

Uneven sizes: a dimension split over mesh axes of total size p must divide by p. ``pad_params``
appends zeros up to the next multiple (``padded_size``), and the layers take the logical size
(``out_features``, ``in_features``, ``vocab_size``) and mask the padding, so it never reaches an
output, a gradient, an optimizer update or a loss: padded weights start at zero, receive exactly
zero gradient, and stay zero. ``unpad`` slices a tree back to its logical shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardops._mesh import check_divisible, normalized_spec
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
    column_parallel_dense_specs().params)`` (or the row-parallel specs).
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


def padded_size(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ≥ ``n``, e.g. ``padded_size(100, 8) == 104``."""
    return -(-n // multiple) * multiple


def pad_params(params, mesh: Mesh, specs):
    """Full arrays padded with zeros so that every split dimension divides by its mesh axes.

    ``specs`` as in ``shard_params``. E.g. a column weight ``w[784, 100]`` with
    ``P(None, "model")`` on ``model=8`` becomes ``w[784, 104]``, its last 4 columns zero. Extra
    bytes: ``(104 − 100) · 784 · 4`` per copy, and they show in ``shardops.inspect.ledger`` wherever the
    padded array is communicated (an FSDP gather, ``gather_output``).
    """
    specs = _matching_specs(params, specs)

    def pad(leaf, spec):
        widths = []
        for dim, axes in enumerate(normalized_spec(spec, leaf.ndim)):
            p = math.prod(mesh.shape[a] for a in axes)
            widths.append((0, padded_size(leaf.shape[dim], p) - leaf.shape[dim]))
        return jnp.pad(leaf, widths) if any(w for _, w in widths) else leaf

    return jax.tree.map(pad, params, specs, is_leaf=lambda s: isinstance(s, P))


def unpad(tree, like):
    """``tree`` sliced back to the shapes of ``like`` (a tree of arrays or shapes): the inverse of
    ``pad_params`` for comparing with an unsharded model."""

    def cut(leaf, ref):
        shape = tuple(getattr(ref, "shape", ref))
        return leaf[tuple(slice(0, n) for n in shape)]

    return jax.tree.map(cut, tree, like, is_leaf=lambda x: isinstance(x, tuple))


def shard_params(params, mesh: Mesh, specs, *, pad: bool = True):
    """Place a full parameter tree on ``mesh``: each leaf with ``NamedSharding(mesh, spec)``.

    ``specs`` is a tree with the structure of ``params`` (leaves ``PartitionSpec``), or a prefix
    of it. Leaves absent from ``params`` (e.g. ``"b"`` when ``use_bias=False``) are ignored.
    A dimension that its mesh axes do not divide is zero-padded (``pad_params``; pass the
    logical size to the layer); with ``pad=False`` it is an error naming the leaf, the dim, the
    axes and both sizes.
    """
    specs = _matching_specs(params, specs)
    if pad:
        params = pad_params(params, mesh, specs)
    else:
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            spec = _spec_at(specs, path)
            for dim, axes in enumerate(normalized_spec(spec, leaf.ndim)):
                check_divisible(argument=f"params{jax.tree_util.keystr(path)}", dim=dim,
                                dim_name="split", size=leaf.shape[dim], mesh=mesh, axes=axes,
                                hint="; or shard_params(..., pad=True) to zero-pad it")  # fmt: skip
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
    )
    return jax.device_put(params, shardings)


def _spec_at(specs, path):
    for key in path:
        specs = specs[getattr(key, "key", getattr(key, "idx", None))]
    return specs


def _matching_specs(params, specs, path: str = ""):
    """``specs`` cut to ``params``' structure at every depth: a key of ``specs`` that
    ``params`` lacks (an absent bias) is dropped; a key of ``params`` that ``specs`` lacks is an
    error naming its path. A ``PartitionSpec`` (or ``None``) applies to the whole subtree."""
    if isinstance(specs, dict) and isinstance(params, dict):
        unknown = set(params) - set(specs)
        if unknown:
            raise ValueError(
                f"shard_params: no PartitionSpec for {sorted(unknown, key=str)} in "
                f"params{path or ' (the top level)'}; specs{path} has keys {sorted(specs, key=str)}"
            )
        return {k: _matching_specs(params[k], specs[k], f"{path}[{k!r}]") for k in params}
    if isinstance(specs, (list, tuple)) and not isinstance(specs, P) and (
            type(specs) is type(params) and len(specs) == len(params)):  # fmt: skip
        return type(specs)(_matching_specs(p, s, f"{path}[{i}]")
                           for i, (p, s) in enumerate(zip(params, specs, strict=True)))  # fmt: skip
    return specs
