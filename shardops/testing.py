"""Checking a sharded computation against an exact reference, and its dtype flow.

The error bound, in one place
-----------------------------
A split contraction only reorders a sum, so sharded and unsharded results differ by rounding,
and that difference grows with the contraction length K. A fixed ``rtol`` is therefore wrong
(at K ≥ 256 a float32 ``rtol=1e-5`` fails for correct code near cancellations). We compare each
result with an exact float64 reference and allow, elementwise,

    |r − r_ref| ≤ (K + 2) · eps(accum) · A  +  eps(out) · |r_ref|,      A = Σ_k |x_k||w_k| (+ |b|)

where ``A`` is the same contraction on absolute values, ``eps`` the machine epsilon (2u) of a
dtype, ``accum`` the accumulation dtype and ``out`` the dtype the result ``r`` is stored in
(compute dtype for ``y`` and ``dx``, param dtype for ``dw`` and ``db``). Reasoning: any summation
order of K products satisfies ``|fl(Σ) − Σ| ≤ γ_K · A ≈ K·u·A`` (Higham, *Accuracy and
Stability of Numerical Algorithms*, §3.1); the bias and the cross-device reduction add at most
two more terms. The policy (``shardops._precision``) keeps every partial sum, forward and
backward, in ``accum`` and rounds each result to ``out`` exactly once, which costs at most
``u(out) · |r|`` (plus ``u(out)`` times the accumulation error, absorbed by the factor 2 of
margin that ``eps = 2u`` leaves). Products of compute-dtype operands are exact in float32.

The rounding term is relative to the *result*, not to ``A``: this is what makes the bound tight
under bfloat16 (``eps(bf16) · |r|`` instead of ``eps(bf16) · A``, which at K=512 on unit-normal
data is about a quarter of ``|r|``). A partial sum rounded to bfloat16 before its reduction
costs up to ``u(bf16) · Σ_p |partial_p|``, which exceeds the bound wherever the partials cancel;
a float32 result is held to float32 rounding. For float32 the bound is ~1e-4·A at K=512, far below
the O(1) error of a real bug (a bias added p times, a missing or extra psum, a gradient scaled
by p). The reference rounds its inputs to the compute dtype first, so it checks the kernel's
arithmetic, not the policy's input rounding.

Dtype flow
----------
``dtype_flow_violations(fn, *args, policy=...)`` reads the jaxpr of ``fn`` (forward, and the
backward when ``fn`` takes gradients) and lists every place where the policy is not followed:
a matmul whose operands are not both in ``compute_dtype``, that does not accumulate in
``accum_dtype``, or (float32 compute) that does not ask for full precision (the default on GPU
would be TF32); and every sum (``psum``, autodiff's ``psum_invariant``, ``psum_scatter``, a local
``reduce_sum``) of floating values in another dtype than ``accum_dtype``. Numerics cannot show
these on a CPU (XLA:CPU computes bf16 all-reduces in f32 and has no TF32), the jaxpr does.

Communication
-------------
``expect_collectives(fn, *args, forward={(kind, axes): bytes}, backward=…, optimizer=…)``
compiles ``fn`` and asserts the bytes each pass moves (``shardops.inspect.ledger``'s V, per kind and
mesh axes; ``{}`` means none, ``None`` unchecked). A mismatch raises ``AssertionError`` with a
diff table: expected and compiled bytes, ``missing`` and ``unexpected`` rows (a reshard XLA
inserted), and the layer and ``dtype[shape]`` behind each row. It returns the ``Ledger``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

from shardops._precision import Precision
from shardops.inspect._expect import expect_collectives

__all__ = [
    "SUMS",
    "DenseReference",
    "dense_reference",
    "dtype_flow",
    "dtype_flow_violations",
    "error_bound",
    "expect_collectives",
    "worst_ratio",
]


def error_bound(abs_terms, k: int, precision: Precision, *, exact, out_dtype) -> np.ndarray:
    """The elementwise bound above for a K-term contraction whose absolute sum is ``abs_terms``,
    whose exact value is ``exact`` and whose result is stored in ``out_dtype``."""
    accum = float(jnp.finfo(precision.accum_dtype).eps)
    out = float(jnp.finfo(out_dtype).eps)
    return (
        (k + 2) * accum * np.asarray(abs_terms, np.float64)
        + out * np.abs(np.asarray(exact, np.float64))
        + np.finfo(np.float64).tiny
    )


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
    compute, param = precision.compute_dtype, precision.param_dtype

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
    dx, dw = ct64 @ w64.T, x64.T @ ct64
    db = None if b is None else ct64.sum(0)
    return DenseReference(
        y=y,
        dx=dx,
        dw=dw,
        db=db,
        bound_y=error_bound(abs_y, D + 1, precision, exact=y, out_dtype=compute),
        bound_dx=error_bound(act @ aw.T, F, precision, exact=dx, out_dtype=compute),
        bound_dw=error_bound(ax.T @ act, B, precision, exact=dw, out_dtype=param),
        bound_db=None
        if b is None
        else error_bound(act.sum(0), B, precision, exact=db, out_dtype=param),
    )


def worst_ratio(got, want, bound) -> float:
    """``max |got − want| / bound``: ≤ 1 means within the bound."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return float(np.max(err / bound)) if err.size else 0.0


# Primitives that add floating values: across devices, and locally.
SUMS = ("psum", "psum_invariant", "psum2", "reduce_scatter", "psum_scatter", "reduce_sum", "cumsum")


def dtype_flow(fn, *args, **kwargs) -> list[tuple[str, tuple, tuple, dict, str]]:
    """``(primitive, operand dtypes, result dtypes, params, where)`` for every matmul and every
    sum in the jaxpr of ``fn(*args, **kwargs)``, nested jaxprs (jit, shard_map, remat, scan,
    custom rules) included."""
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    out: list = []
    _walk(closed.jaxpr, out)
    return out


def dtype_flow_violations(fn, *args, policy: Precision, **kwargs) -> list[str]:
    """Every place where the jaxpr of ``fn(*args, **kwargs)`` breaks ``policy``'s dtype flow
    (see the module docstring); an empty list means it follows the policy. Also fails (one
    entry) if the program has no matmul at all, so a check cannot pass vacuously."""
    precision = policy
    compute, accum = np.dtype(precision.compute_dtype), np.dtype(precision.accum_dtype)
    full = lax.Precision.HIGHEST
    problems, matmuls = [], 0
    for name, ins, outs, params, where in dtype_flow(fn, *args, **kwargs):
        if name == "dot_general":
            matmuls += 1
            if ins != (compute, compute):
                problems.append(
                    f"dot_general at {where}: operands {_names(ins)}, expected "
                    f"{compute.name} × {compute.name} under {precision.name}"
                )
            if outs != (accum,) or params.get("preferred_element_type") != accum:
                problems.append(
                    f"dot_general at {where}: accumulates into {_names(outs)}, expected "
                    f"{accum.name} (preferred_element_type) under {precision.name}"
                )
            asked = params.get("precision")
            asked = asked if isinstance(asked, tuple) else (asked, asked)
            if compute == np.float32 and any(p != full for p in asked):
                problems.append(
                    f"dot_general at {where}: float32 matmul with precision={asked}; "
                    f"{precision.name} needs Precision.HIGHEST (else TF32 on GPU)"
                )
        elif any(jnp.issubdtype(d, jnp.floating) and d != accum for d in ins):
            problems.append(
                f"{name} at {where}: sums {_names(ins)}, expected {accum.name} under "
                f"{precision.name}"
            )
    if not matmuls:
        problems.append("no dot_general in the program: nothing was checked")
    return problems


def _names(dtypes) -> str:
    return "(" + ", ".join(np.dtype(d).name for d in dtypes) + ")"


def _walk(jaxpr, out: list) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general" or name in SUMS:
            ins = tuple(np.dtype(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype"))
            outs = tuple(np.dtype(v.aval.dtype) for v in eqn.outvars)
            out.append((name, ins, outs, dict(eqn.params), str(eqn.source_info.name_stack)))
        for sub in _subjaxprs(eqn.params):
            _walk(sub, out)


def _subjaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item
