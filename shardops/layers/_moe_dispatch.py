"""The mixture of experts' capacity path: the slots ``dispatch[G, S, E, C]`` gather each
expert's tokens, an AllToAll over the expert axis takes them to the devices holding their
experts, every local expert applies its SwiGLU to its slots, a second AllToAll brings the
outputs back and the combine weights sum them into ``y[G, S, D]``:

    xe[E, G·C, D] = dispatch · x                        (0/1 operand: exact at any precision)
    xe[E_X, N·G·C, D] ← AllToAll over X ← xe[E, G·C, D]                      (expert parallel)
    ye = down(silu(xe · gate) ⊙ (xe · up))              → ye[E_X, N·G·C, D]{U_model}
    ye[E, G·C, D] ← AllToAll back;  y[G, S, D] = Σ_{e,c} combine · ye        (float32)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from shardops._precision import Precision
from shardops.comm._collectives import all_to_all
from shardops.comm._reasons import Reason
from shardops.layers._mlp import _hidden

_DISPATCH = Reason("moe_dispatch", forward={
    "all_to_all": "each device's tokens go to the devices holding their experts (experts are "
                  "split over {axis}): block j of xe[E, G·C, D] to device j",
}, backward={
    "all_to_all": "the transpose of the dispatch: the tokens' gradients return to their devices",
})  # fmt: skip
_RETURN = Reason("moe_return", forward={
    "all_to_all": "the experts' outputs return over {axis} to the devices their tokens came from",
}, backward={
    "all_to_all": "the transpose of the return: dy's slots go to the devices of their experts",
})  # fmt: skip


def _experts(xe, params, activation, precision: Precision):
    """Every local expert's SwiGLU on its slots: ``xe[E', T, D] → ye[E', T, D]`` in accum
    (partial sums over the model axis when F is split), batched over the experts."""
    hidden = functools.partial(_hidden, activation=activation, precision=precision)
    h = jax.vmap(hidden)(xe, {"gate": {"w": params["gate"]}, "up": {"w": params["up"]}})
    return jax.vmap(precision.matmul)(h, params["down"])  # ye[E', T, D] in accum


def _capacity(x_region, dispatch, weights, params, expert_axis, activation, precision: Precision):
    """``y[G, S, D]`` (accum, ``{U_model}`` when F is split) by the capacity-padded dispatch
    ``dispatch[G, S, E, C]``, the AllToAlls over ``expert_axis`` and the combine ``weights[G,
    S, E]``."""
    g, _, d = x_region.shape
    e, c = dispatch.shape[2:]
    accum, compute = precision.accum_dtype, precision.compute_dtype
    mm = precision.matmul_precision
    dispatch = dispatch.astype(accum)  # [G, S, E, C]: 0/1, so the einsum is exact
    xe = jnp.einsum("gsec,gsd->egcd", dispatch, x_region, precision=mm)  # xe[E, G, C, D]
    xe = xe.astype(compute).reshape(e, g * c, d)  # xe[E, G·C, D]
    if expert_axis is not None:  # block j (experts j·E/N…) to device j; sources concatenated
        xe = all_to_all(xe, expert_axis, split_axis=0, concat_axis=1, reason=_DISPATCH)
    ye = _experts(xe, params, activation, precision)  # ye[E/N, N·G·C, D] in accum {U_model}
    if expert_axis is not None:  # each source's slots back, the experts in order
        ye = all_to_all(ye, expert_axis, split_axis=1, concat_axis=0, reason=_RETURN)
    ye = ye.reshape(e, g, c, d)  # ye[E, G, C, D]
    combine = dispatch * weights[..., None]  # [G, S, E, C]
    # in float32 on every backend (a TPU's DEFAULT would round the weights and ye to bf16)
    return jnp.einsum("gsec,egcd->gsd", combine, ye, precision=lax.Precision.HIGHEST)
