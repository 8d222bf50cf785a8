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
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax


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
        """``x[..., K] · w[K, N]`` in ``compute_dtype``, accumulated and returned in ``accum_dtype``."""
        return jnp.matmul(
            x,
            w.astype(self.compute_dtype),
            precision=self.matmul_precision,
            preferred_element_type=self.accum_dtype,
        )

    def finish(self, y_acc: jnp.ndarray, b: jnp.ndarray | None) -> jnp.ndarray:
        """Add the bias in ``accum_dtype`` and cast once to ``compute_dtype``."""
        if b is not None:
            y_acc = y_acc + b.astype(self.accum_dtype)
        return y_acc.astype(self.compute_dtype)


_DEFINED = {
    (np.dtype(jnp.float32),) * 3: "FLOAT32",
    (np.dtype(jnp.bfloat16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)): "BFLOAT16",
    (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)): "MIXED_BFLOAT16",
}

FLOAT32 = Precision(jnp.float32, jnp.float32, jnp.float32)
BFLOAT16 = Precision(jnp.bfloat16, jnp.bfloat16, jnp.float32)
MIXED_BFLOAT16 = Precision(jnp.float32, jnp.bfloat16, jnp.float32)
