"""The seed's own tool: data parallelism with ``jax.pmap``, for comparison with ``dp``.

Parameters and optimizer state are per-device copies stacked on a leading axis, the batch is
``[devices, B/devices, D]``, and the gradients are reduced with an explicit AllReduce
(``shardops.comm.all_reduce``: pmap's copies are independent values, so autodiff reduces nothing
for us).
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from shardops.comm import Reason, all_reduce
from shardops_models.networks._mlp import cross_entropy_sum, mlp_forward

AXIS = "batch"

_GRADIENTS = Reason("pmap_gradients", forward={
    "psum": "pmap's per-device copies are independent values: each device's gradient of its "
            "batch shard is summed over {axis} by hand",
})  # fmt: skip
_LOSS = Reason("pmap_loss", forward={
    "psum": "each device's loss covers its shard of the batch over {axis}: the loss is their sum",
})  # fmt: skip


def pmap_train_step(optimizer: optax.GradientTransformation, devices):
    """``(params, opt_state, x, y) → (params, opt_state, loss)``, pmapped over ``devices``."""
    n = len(devices)

    def step(params, opt_state, x, y):  # x: (B/n, D); params: this device's copy
        def local_loss(p):
            logits = mlp_forward(p, x)  # (B/n, C)
            return cross_entropy_sum(logits, y) / (x.shape[0] * n * y.shape[-1])

        loss, grads = jax.value_and_grad(local_loss)(params)
        grads = all_reduce(grads, AXIS, reason=_GRADIENTS)  # AllReduce of every gradient
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, all_reduce(loss, AXIS, reason=_LOSS)

    return jax.pmap(step, axis_name=AXIS, devices=devices, donate_argnums=(0, 1))


def replicate(tree, n: int):
    """One copy per device, stacked on a leading axis (host arrays; pmap places them)."""
    return jax.tree.map(lambda a: np.stack([np.asarray(a)] * n), tree)


def split_batch(array, n: int):
    """``[B, ...] → [n, B/n, ...]``."""
    return array.reshape(n, -1, *array.shape[1:])
