"""Checking a sharded dense computation against an exact reference.

The error bound, in one place
-----------------------------
A split contraction only reorders a sum, so sharded and unsharded results differ by rounding,
and that difference grows with the contraction length K. A fixed ``rtol`` is therefore wrong
(at K ≥ 256 a float32 ``rtol=1e-5`` fails for correct code near cancellations). We compare each
result with an exact float64 reference and allow, elementwise,

    |y − y_ref| ≤ (K + 2) · eps(accum) · A  +  2 · eps(out) · A,      A = |x| · |w| (+ |b|)

where ``A`` is the same product on absolute values (``Σ_k |x_k||w_k|``), ``eps`` is the machine
epsilon (2u) of a dtype, ``accum`` the accumulation dtype and ``out`` the dtype the result is
stored in (the compute dtype). Reasoning: any summation order of K products satisfies
``|fl(Σ) − Σ| ≤ γ_K · Σ|terms| ≈ K·u·A`` (Higham, *Accuracy and Stability of Numerical
Algorithms*, §3.1); the bias and the cross-device psum add at most two more terms; rounding the
result (and, under bfloat16, a partial sum before its reduction) to ``out`` costs at most
``u(out)·A`` each. Using ``eps = 2u`` leaves a factor 2 of margin. Since ``A ≤ K·max|x|·max|w|``
this is tighter than, and implies, the form ``c · eps · K · max|x| · max|w|``.

For float32 this is ~1e-2 absolute at K=512 on unit-normal data, far below the O(1) error of any
real bug (a bias added p times, a missing or extra psum, a gradient scaled by p). The reference
rounds its inputs to the compute dtype first, so it checks the kernel's arithmetic, not the
policy's input rounding.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from shardops._precision import Precision


def error_bound(abs_terms, k: int, precision: Precision) -> np.ndarray:
    """The elementwise bound above for a K-term contraction whose absolute sum is ``abs_terms``.

    ``out`` is the compute dtype: the coarsest rounding on any path, forward or backward (a
    float32 parameter's gradient under ``MIXED_BFLOAT16`` passes through bfloat16).
    """
    accum = float(jnp.finfo(precision.accum_dtype).eps)
    out = float(jnp.finfo(precision.compute_dtype).eps)
    return ((k + 2) * accum + 2 * out) * np.asarray(abs_terms, np.float64) + np.finfo(
        np.float64
    ).tiny


@dataclasses.dataclass
class DenseReference:
    """Exact (float64) forward and gradients of ``sum(ct · (x·w + b))``, plus their bounds."""

    y: np.ndarray
    dx: np.ndarray
    dw: np.ndarray
    db: np.ndarray | None
    bound_y: np.ndarray
    bound_dx: np.ndarray
    bound_dw: np.ndarray
    bound_db: np.ndarray | None


def dense_reference(x, w, b, ct, precision: Precision) -> DenseReference:
    """Reference for ``y = x·w + b`` and the gradients of ``sum(ct · y)``, in float64 numpy.

    ``x`` and ``ct`` are in the compute dtype, ``w`` and ``b`` in the param dtype; ``w`` and
    ``b`` are rounded to the compute dtype as the layer does, then everything is exact.
    """
    compute = precision.compute_dtype

    def f64(a, round_to=None):
        a = np.asarray(a)
        return (a.astype(round_to) if round_to is not None else a).astype(np.float64)

    x64, w64, ct64 = f64(x), f64(w, compute), f64(ct)
    b64 = None if b is None else f64(b)  # the bias is added in accum_dtype, unrounded
    ax, aw, act = np.abs(x64), np.abs(w64), np.abs(ct64)
    B, D = x64.shape
    F = w64.shape[1]
    y = x64 @ w64 + (0 if b64 is None else b64)
    abs_y = ax @ aw + (0 if b64 is None else np.abs(b64))
    return DenseReference(
        y=y,
        dx=ct64 @ w64.T,
        dw=x64.T @ ct64,
        db=None if b is None else ct64.sum(0),
        bound_y=error_bound(abs_y, D + 1, precision),
        bound_dx=error_bound(act @ aw.T, F, precision),
        bound_dw=error_bound(ax.T @ act, B, precision),
        bound_db=None if b is None else error_bound(act.sum(0), B, precision),
    )


def worst_ratio(got, want, bound) -> float:
    """``max |got − want| / bound``: ≤ 1 means within the bound."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return float(np.max(err / bound)) if err.size else 0.0
