"""The reference MLP: plain JAX, unsharded, any depth and widths.

The seed's recipe: layer sizes 784-512-10, Gaussian init × 0.01 for weights and biases, ReLU
hidden layers, log-softmax outputs and the loss ``-mean(one_hot * log_softmax(logits))`` (a mean
over batch *and* classes, as in the seed).

Every function takes a ``shardops.Precision`` policy (default ``FLOAT32``): the input is cast to
its compute dtype, each layer multiplies in compute dtype and accumulates in accum dtype, and
the loss and metrics are computed from the logits in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

import shardops
from shardops import FLOAT32, Precision

SEED_SIZES = (784, 512, 10)
"""The seed's layer sizes: 28×28 pixels → 512 hidden → 10 classes."""
INIT_SCALE = 0.01
"""The seed's init: weights and biases drawn from N(0, 1) × 0.01."""

Params = list[dict[str, jax.Array]]


def init_mlp(
    key: jax.Array, sizes: Sequence[int] = SEED_SIZES, *, scale: float = INIT_SCALE, dtype=None
) -> Params:
    """Full parameters ``[{"w": w[m, n], "b": b[n]}, ...]`` for consecutive ``(m, n)`` in ``sizes``.

    Drawn in float32 (the same numbers under every policy), then cast to ``dtype`` if given
    (e.g. ``precision.param_dtype``).
    """
    sizes = check_sizes(sizes)
    normal = jax.nn.initializers.normal(scale)
    keys = jax.random.split(key, len(sizes) - 1)
    params = [
        shardops.init_dense(k, m, n, w_init=normal, b_init=normal)
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]
    return params if dtype is None else jax.tree.map(lambda a: a.astype(dtype), params)


def dense_layer(layer: dict[str, jax.Array], x: jax.Array, precision: Precision) -> jax.Array:
    """One unsharded layer, ``x[B, D] · w[D, F] + b[F]``, as a ``(layer, x, precision)`` function."""
    return shardops.dense(x, **layer, precision=precision)


def mlp_apply(layer_fns, params: Params, x: jax.Array, precision: Precision = FLOAT32) -> jax.Array:
    """Cast ``x`` to the compute dtype, then run ``layer_fns[i](params[i], x, precision)`` in
    turn, with ReLU between layers (not after the last).

    Every strategy is this loop with its own per-layer functions (sharded kernels, gathers).
    """
    x = x.astype(precision.compute_dtype)  # (B, D)
    for i, (fn, layer) in enumerate(zip(layer_fns, params, strict=True)):
        x = fn(layer, x, precision)  # (B, width)
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x  # (B, C)


def mlp_forward(params: Params, x: jax.Array, precision: Precision = FLOAT32) -> jax.Array:
    """Logits ``[B, C]`` of the unsharded MLP, in ``precision.compute_dtype``."""
    return mlp_apply([dense_layer] * len(params), params, x, precision)


def cross_entropy_sum(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """``-Σ one_hot · log_softmax(logits)`` over batch and classes (the seed's loss × B·C), in
    float32 whatever the logits' dtype. Rows whose label is all zeros (padding) add nothing."""
    return -jnp.sum(labels * jax.nn.log_softmax(logits.astype(jnp.float32)))


def loss(params: Params, x: jax.Array, labels: jax.Array, precision: Precision = FLOAT32):
    """The seed's loss: ``-mean(one_hot * log_softmax(logits))``."""
    return cross_entropy_sum(mlp_forward(params, x, precision), labels) / labels.size


def accuracy(params: Params, x: jax.Array, labels: jax.Array, precision: Precision = FLOAT32):
    """Fraction of rows whose arg-max logit is the labelled class."""
    logits = mlp_forward(params, x, precision)
    return jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(labels, -1))


def check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    sizes = tuple(sizes)
    if len(sizes) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(
            f"sizes must list at least two positive layer widths (input, ..., classes), e.g. "
            f"{SEED_SIZES}; got {sizes}"
        )
    return sizes
