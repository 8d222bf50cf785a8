"""The reference MLP: plain JAX, unsharded, any depth and widths.

The seed's recipe: layer sizes 784-512-10, Gaussian init × 0.01 for weights and biases, ReLU
hidden layers, log-softmax outputs and the loss ``-mean(one_hot * log_softmax(logits))`` (a mean
over batch *and* classes, as in the seed).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

import shardops

SEED_SIZES = (784, 512, 10)
"""The seed's layer sizes: 28×28 pixels → 512 hidden → 10 classes."""
INIT_SCALE = 0.01
"""The seed's init: weights and biases drawn from N(0, 1) × 0.01."""

Params = list[dict[str, jax.Array]]


def init_mlp(
    key: jax.Array, sizes: Sequence[int] = SEED_SIZES, *, scale: float = INIT_SCALE
) -> Params:
    """Full parameters ``[{"w": w[m, n], "b": b[n]}, ...]`` for consecutive ``(m, n)`` in ``sizes``."""
    sizes = check_sizes(sizes)
    normal = jax.nn.initializers.normal(scale)
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        shardops.init_dense(k, m, n, w_init=normal, b_init=normal)
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def dense_layer(layer: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """One unsharded layer, ``x[B, D] · w[D, F] + b[F]``, as a ``(layer, x)`` function."""
    return shardops.dense(x, **layer)


def mlp_apply(layer_fns, params: Params, x: jax.Array) -> jax.Array:
    """Run ``layer_fns[i](params[i], x)`` in turn, with ReLU between layers (not after the last).

    Every strategy is this loop with its own per-layer functions (sharded kernels, gathers).
    """
    for i, (fn, layer) in enumerate(zip(layer_fns, params, strict=True)):
        x = fn(layer, x)  # (B, width)
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x  # (B, C)


def mlp_forward(params: Params, x: jax.Array) -> jax.Array:
    """Logits ``[B, C]`` of the unsharded MLP."""
    return mlp_apply([dense_layer] * len(params), params, x)


def predict(params: Params, x: jax.Array) -> jax.Array:
    """The seed's ``predict``: log-probabilities ``[B, C]``."""
    return jax.nn.log_softmax(mlp_forward(params, x))


def cross_entropy_sum(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """``-Σ one_hot · log_softmax(logits)`` over batch and classes (the seed's loss × B·C)."""
    return -jnp.sum(labels * jax.nn.log_softmax(logits))


def loss(params: Params, x: jax.Array, labels: jax.Array) -> jax.Array:
    """The seed's loss: ``-mean(one_hot * log_softmax(logits))``."""
    return cross_entropy_sum(mlp_forward(params, x), labels) / labels.size


def accuracy(params: Params, x: jax.Array, labels: jax.Array) -> jax.Array:
    """Fraction of rows whose arg-max logit is the labelled class."""
    return jnp.mean(jnp.argmax(mlp_forward(params, x), -1) == jnp.argmax(labels, -1))


def check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    sizes = tuple(sizes)
    if len(sizes) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(
            f"sizes must list at least two positive layer widths (input, ..., classes), e.g. "
            f"{SEED_SIZES}; got {sizes}"
        )
    return sizes
