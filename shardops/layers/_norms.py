"""Layer norm and RMS norm over the last dim, statistics in float32, for sharded activations.

Plain functions of local blocks: they run unchanged inside ``jax.shard_map``, on replicated
activations or on sequence-parallel ones ``x[B, S_model, D]`` (a norm mixes features only, so
splitting B or S needs no communication in the forward pass).

The gradient trap, and who closes it: on ``x[B, S_model, D]`` the parameters ``scale[D]`` and
``bias[D]`` are replicated over ``model`` while the activations are not, so each device holds
only its sequence shard's share of ``dscale`` and ``dbias``:

    dscale = Σ_{b,s} dy · x̂ = Σ_{devices} dscale_local{U_model}   → AllReduce over model

Megatron-LM sums them by hand (its ``sequence_parallel`` parameters are all-reduced over the
tensor-parallel group after the backward). Inside ``jax.shard_map`` with ``check_vma=True`` (the
default), JAX does it: multiplying the varying ``x̂`` by the invariant ``scale`` inserts a
``pcast`` to varying, whose transpose is that AllReduce (run in float32 here, since the
parameters are cast first). With ``check_vma=False`` there is no such ``pcast``: the gradient
stays each device's partial sum and ``out_specs=P()`` returns one device's share, a fraction of
the true gradient (exactly 1/p when the shards are alike). ``tests/layers/test_norms.py`` shows both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

STATS_DTYPE = jnp.float32
"""Mean, variance and the normalisation are computed in float32 whatever ``x``'s dtype."""


def layer_norm(x, scale, bias, eps: float = 1e-5):
    """Layer norm over the last dim: ``(x − mean) / √(var + eps) · scale + bias``.

    Arguments:
        x: ``x[..., D]`` (any leading dims: replicated, or a batch/sequence shard).
        scale: ``scale[D]`` or ``None`` (no scaling).
        bias: ``bias[D]`` or ``None`` (no shift).
        eps: added to the variance, > 0.

    Returns:
        ``y[..., D]`` in ``x``'s dtype: statistics, normalisation, scale and bias in float32,
        rounded once. Communication: none forward; inside ``shard_map`` on a sharded ``x``,
        ``dscale`` and ``dbias`` are all-reduced over the sharded axes (see the module docstring).
    """
    _check(x, {"scale": scale, "bias": bias}, eps, "layer_norm")
    return _recomputed(_layer_norm, x, scale, bias, eps=eps)


def _layer_norm(x, scale, bias, *, eps):
    x32 = x.astype(STATS_DTYPE)  # x[..., D] in f32
    mean = jnp.mean(x32, axis=-1, keepdims=True)  # [..., 1]
    centered = x32 - mean  # [..., D]
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)  # [..., 1]
    y = centered * lax.rsqrt(var + eps)  # x̂[..., D]
    return _affine(y, scale, bias).astype(x.dtype)  # y[..., D], one rounding


def rms_norm(x, scale, eps: float = 1e-6):
    """RMS norm over the last dim: ``x / √(mean(x²) + eps) · scale``.

    Arguments:
        x: ``x[..., D]``.
        scale: ``scale[D]`` or ``None``.
        eps: added to the mean square, > 0.

    Returns:
        ``y[..., D]`` in ``x``'s dtype, computed in float32 and rounded once. Communication as
        ``layer_norm``.
    """
    _check(x, {"scale": scale}, eps, "rms_norm")
    return _recomputed(_rms_norm, x, scale, eps=eps)


def _rms_norm(x, scale, *, eps):
    x32 = x.astype(STATS_DTYPE)  # x[..., D] in f32, squared below
    mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)  # [..., 1]
    y = x32 * lax.rsqrt(mean_square + eps)  # x̂[..., D]
    return _affine(y, scale, None).astype(x.dtype)  # y[..., D], one rounding


def _recomputed(norm, *args, eps):
    """``norm(*args, eps=eps)`` recomputed in the backward pass (``jax.checkpoint``): the
    backward keeps the input ``x`` in its own dtype instead of the norm's float32 copies of it
    (x, x², x̂: three ``[..., D]`` float32 arrays). Elementwise work and one row sum: cheaper
    to redo than to store, and the same values bit for bit. (With ``prevent_cse=False`` XLA
    merges the recomputation with the forward outside a scan, and keeps the forward's arrays
    after all.)"""
    return jax.checkpoint(functools.partial(norm, eps=eps))(*args)


def _affine(y, scale, bias):
    """``y · scale + bias`` in float32; the parameters' gradients are reduced where they are
    replicated and ``y`` is not (``check_vma``'s ``pcast``, inserted at the multiply/add)."""
    if scale is not None:
        y = y * scale.astype(STATS_DTYPE)  # [..., D]
    if bias is not None:
        y = y + bias.astype(STATS_DTYPE)  # [..., D]
    return y


def _check(x, params: dict, eps, op: str) -> None:
    if not hasattr(x, "shape") or len(x.shape) < 1:
        got = f"shape {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__
        raise ValueError(f"{op}: x must have rank ≥ 1 (x[..., D]); got {got}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{op}: x must be a floating array; got dtype {np.dtype(x.dtype).name}. Cast it "
            f"with x.astype(jnp.float32)."
        )
    d = x.shape[-1]
    for name, p in params.items():
        if p is not None and tuple(getattr(p, "shape", ())) != (d,):
            raise ValueError(
                f"{op}: {name} must have shape ({d},) to match x{tuple(x.shape)} (normalised "
                f"over its last dim); got {tuple(getattr(p, 'shape', ()))}. Inside shard_map "
                f"pass it replicated (in_specs P()), not split."
            )
    if isinstance(eps, bool) or not isinstance(eps, int | float | np.floating) or not eps > 0:
        raise ValueError(f"{op}: eps must be a positive number; got {eps!r}")
