"""The seed's own tool: data parallelism with ``jax.pmap``, for comparison with ``dp``.

Parameters and optimizer state are per-device copies stacked on a leading axis, the batch is
``[devices, B/devices, D]``, and the gradients are reduced with an explicit ``lax.psum``
(pmap's copies are independent values, so autodiff reduces nothing for us).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax import lax

from shardops_models.networks._mlp import cross_entropy_sum, mlp_forward

AXIS = "batch"


def pmap_train_step(optimizer: optax.GradientTransformation, devices):
    """``(params, opt_state, x, y) → (params, opt_state, loss)``, pmapped over ``devices``."""
    n = len(devices)

    def step(params, opt_state, x, y):  # x: (B/n, D); params: this device's copy
        def local_loss(p):
            logits = mlp_forward(p, x)  # (B/n, C)
            return cross_entropy_sum(logits, y) / (x.shape[0] * n * y.shape[-1])

        loss, grads = jax.value_and_grad(local_loss)(params)
        grads = lax.psum(grads, AXIS)  # AllReduce of every gradient
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.psum(loss, AXIS)

    return jax.pmap(step, axis_name=AXIS, devices=devices, donate_argnums=(0, 1))


def replicate(tree, n: int):
    """One copy per device, stacked on a leading axis (host arrays; pmap places them)."""
    return jax.tree.map(lambda a: np.stack([np.asarray(a)] * n), tree)


def split_batch(array, n: int):
    """``[B, ...] → [n, B/n, ...]``."""
    return array.reshape(n, -1, *array.shape[1:])
