"""Precision policy: the dtypes of parameters, of the matmul inputs and of accumulation.

Three policies are defined; any other combination is an error rather than a silent upcast.

| policy           | param_dtype | compute_dtype | accum_dtype |
|------------------|-------------|---------------|-------------|
| `FLOAT32`        | float32     | float32       | float32     |
| `BFLOAT16`       | bfloat16    | bfloat16      | float32     |
| `MIXED_BFLOAT16` | float32     | bfloat16      | float32     |

A dense layer under a policy computes
``y = cast_compute(dot(x, cast_compute(w), preferred_element_type=accum) + b)``:
activations ``x`` and outputs ``y`` are in ``compute_dtype``, the matmul accumulates in
``accum_dtype``, and partial sums of a split contraction are reduced in ``accum_dtype`` before
the single cast back (so ``psum`` of a row-parallel layer carries float32 under bfloat16; XLA's
CPU backend would promote a bf16 all-reduce to f32 anyway).

The backward pass keeps the same discipline. ``matmul`` has a custom VJP: its cotangents
``dx = g · wᵀ`` and ``dw = xᵀ · g`` are again compute-dtype products accumulated in
``accum_dtype``, and are returned in ``accum_dtype`` whenever the primal input was (kernels pass
``x`` in ``accum_dtype`` where its gradient is reduced across devices), so no partial sum is
rounded to bfloat16 before a reduction. Plain autodiff would round ``dx`` to bfloat16 first and
reduce it in bfloat16. Every output is rounded to its own dtype exactly once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardops._mesh import varying_axes
from shardops.comm._collectives import all_reduce
from shardops.comm._mappings import REPLICATED_GRADIENT


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes a layer stores, multiplies and accumulates in. See the module docstring."""

    param_dtype: np.dtype
    compute_dtype: np.dtype
    accum_dtype: np.dtype

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "accum_dtype"):
            object.__setattr__(self, field, np.dtype(getattr(self, field)))
        key = (self.param_dtype, self.compute_dtype, self.accum_dtype)
        if key not in _DEFINED:
            defined = ", ".join(
                f"{name} ({'/'.join(d.name for d in k)})" for k, name in _DEFINED.items()
            )
            raise ValueError(
                f"precision policy param={self.param_dtype.name}, "
                f"compute={self.compute_dtype.name}, accum={self.accum_dtype.name} is not "
                f"defined; use one of {defined} (param/compute/accum). A compute dtype wider "
                f"than the params would be a silent upcast."
            )

    @property
    def name(self) -> str:
        return _DEFINED[(self.param_dtype, self.compute_dtype, self.accum_dtype)]

    @property
    def matmul_precision(self) -> lax.Precision:
        """Full-precision float32 matmuls (no TF32 / bf16 passes on accelerators)."""
        if self.compute_dtype == np.float32:
            return lax.Precision.HIGHEST
        return lax.Precision.DEFAULT

    def check_param(self, argument: str, dtype) -> None:
        """Raise ``TypeError`` unless a parameter has this policy's ``param_dtype``."""
        self._check(argument, dtype, self.param_dtype, "stores parameters in", "parameters")

    def check_activation(self, argument: str, dtype) -> None:
        """Raise ``TypeError`` unless an activation has this policy's ``compute_dtype``."""
        self._check(argument, dtype, self.compute_dtype, "computes in", "activations")

    def _check(self, argument, dtype, expected, verb, what) -> None:
        if np.dtype(dtype) != expected:
            raise TypeError(
                f"{argument} has dtype {np.dtype(dtype).name} but precision policy {self.name} "
                f"{verb} {expected.name}; cast it with {argument}.astype(jnp.{expected.name}) "
                f"or pick the policy that matches your {what}."
            )

    def matmul(self, x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
        """``x[..., K] · w[K, N]`` in ``compute_dtype``, accumulated and returned in ``accum_dtype``.

        ``x`` may come in ``compute_dtype`` or ``accum_dtype`` (cast here; its cotangent keeps
        that dtype, so an ``accum_dtype`` input gets an unrounded ``dx``). The backward products
        are computed like the forward one (see the module docstring).
        """
        return _matmul(self.compute_dtype, self.accum_dtype, self.matmul_precision, x, w)

    def matmuls(self, x: jnp.ndarray, ws) -> tuple:
        """``tuple(self.matmul(x, w) for w in ws)`` with ``x`` rounded to ``compute_dtype`` once:
        the backward keeps one copy of it (not one per product, as separate calls would) and
        sums the products' ``dx`` in ``accum_dtype``. For projections of one input (Q, K, V;
        a gated MLP's gate and up)."""
        return _matmuls(self.compute_dtype, self.accum_dtype, self.matmul_precision, x,
                        tuple(ws))  # fmt: skip

    def finish(self, y_acc: jnp.ndarray, b: jnp.ndarray | None) -> jnp.ndarray:
        """Add the bias in ``accum_dtype`` and cast once to ``compute_dtype``."""
        if b is not None:
            y_acc = y_acc + b.astype(self.accum_dtype)
        return y_acc.astype(self.compute_dtype)


def _dot(a, b, contract, compute, accum, precision):
    """``a · b`` contracting ``contract`` dims, operands cast to ``compute``, result in ``accum``."""
    return lax.dot_general(
        a.astype(compute),
        b.astype(compute),
        (contract, ((), ())),
        precision=precision,
        preferred_element_type=accum,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _matmul(compute, accum, precision, x, w):
    return _dot(x, w, ((x.ndim - 1,), (0,)), compute, accum, precision)  # y[..., N] in accum


def _matmul_fwd(compute, accum, precision, x, w):
    x_c, w_c = x.astype(compute), w.astype(compute)  # residuals in compute_dtype
    y = _dot(x_c, w_c, ((x.ndim - 1,), (0,)), compute, accum, precision)
    # Empty slices of x and w carry their dtypes and varying mesh axes into the backward pass.
    return y, (x_c, w_c, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _matmul_bwd(compute, accum, precision, residuals, g):
    x_c, w_c, x_kind, w_kind = residuals
    lead = tuple(range(x_c.ndim - 1))
    dx = _dot(g, w_c, ((g.ndim - 1,), (1,)), compute, accum, precision)  # dx[..., K] in accum
    dw = _dot(x_c, g, (lead, lead), compute, accum, precision)  # dw[K, N] in accum
    # Where w (or x) is invariant over a mesh axis its cotangent varies over, reduce it, in
    # accum_dtype (what autodiff does by itself for ordinary ops: the gradient trap).
    dx, dw = _reduce_to(dx, x_kind), _reduce_to(dw, w_kind)
    return dx.astype(x_kind.dtype), dw.astype(w_kind.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _matmuls(compute, accum, precision, x, ws):
    contract = ((x.ndim - 1,), (0,))
    return tuple(_dot(x, w, contract, compute, accum, precision) for w in ws)  # y_i in accum


def _matmuls_fwd(compute, accum, precision, x, ws):
    x_c = x.astype(compute)  # one residual for every product
    ws_c = tuple(w.astype(compute) for w in ws)
    ys = tuple(_dot(x_c, w, ((x.ndim - 1,), (0,)), compute, accum, precision) for w in ws_c)
    kinds = (x.reshape(-1)[:0], tuple(w.reshape(-1)[:0] for w in ws))
    return ys, (x_c, ws_c, kinds)


def _matmuls_bwd(compute, accum, precision, residuals, gs):
    x_c, ws_c, (x_kind, w_kinds) = residuals
    lead = tuple(range(x_c.ndim - 1))
    # Each product's dx varies over the axes its own weight (and g) vary over: parts of equal
    # type are added in accum, then each sum is reduced over the axes x is invariant over (a
    # part invariant over an axis must not be added to a varying one before the reduction:
    # the add would cast it to varying and the psum count it once per device).
    by_type, dws = {}, []
    for g, w_c, w_kind in zip(gs, ws_c, w_kinds, strict=True):
        part = _dot(g, w_c, ((g.ndim - 1,), (1,)), compute, accum, precision)  # in accum
        kind = varying_axes(part)
        by_type[kind] = part if kind not in by_type else by_type[kind] + part
        dw = _dot(x_c, g, (lead, lead), compute, accum, precision)  # dw[K, N] in accum
        dws.append(_reduce_to(dw, w_kind).astype(w_kind.dtype))
    dx = sum(_reduce_to(part, x_kind) for part in by_type.values())  # in accum
    return dx.astype(x_kind.dtype), tuple(dws)


_matmuls.defvjp(_matmuls_fwd, _matmuls_bwd)


def _reduce_to(ct, primal):
    extra = varying_axes(ct) - varying_axes(primal)
    if not extra:
        return ct
    return all_reduce(ct, tuple(sorted(extra)), reason=REPLICATED_GRADIENT)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


_DEFINED = {
    (np.dtype(jnp.float32),) * 3: "FLOAT32",
    (np.dtype(jnp.bfloat16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)): "BFLOAT16",
    (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)): "MIXED_BFLOAT16",
}

FLOAT32 = Precision(jnp.float32, jnp.float32, jnp.float32)
BFLOAT16 = Precision(jnp.bfloat16, jnp.bfloat16, jnp.float32)
MIXED_BFLOAT16 = Precision(jnp.float32, jnp.bfloat16, jnp.float32)
