"""Shared checks of head-parallel attention: an exact float64 reference with a derived error
bound, the sharded forward and gradients in one program, and its dtype flow and collectives.

Used by the parametrized tests, the hypothesis property and the mutation tests, so a mutant is
judged by exactly the checks the suite runs.

The error bound, derived
------------------------
The reference is plain numpy multi-head attention (causal mask, softmax, both projections) and
its hand-written backward, in float64. Next to every reference value ``v`` it carries an
elementwise bound ``e`` on ``|kernel − v|`` (``Bounded``), propagated through each step by rules
that hold for *any* data, with ``eps`` the machine epsilon (2u) of float32 (``accum``):

* **product** ``c = Σ_k a_k b_k`` (K terms, accumulated in float32 in any order, across devices
  included, plus an optional bias):
  ``e_c = e_a·|b| + |a|·e_b + e_a·e_b  +  (K + 2)·eps·Σ_k (|a|+e_a)(|b|+e_b)``.
  The first three terms carry the operands' errors (exactly, second order included); the last
  is the dense layers' bound (``shardops.testing``: Higham's γ_K with a factor-2 margin).
* **sum** of n float32 terms (bias gradients): ``Σ e + (n + 1)·eps·Σ (|t| + e)``.
* **scale** by ``1/√hd`` in float32: ``c·e + 2·eps·c·(|t| + e)`` (the constant's rounding and
  the product's).
* **softmax** over a row: perturbing the scores by at most ``e_j`` moves ``P_i`` by at most
  ``P_i·max(e^{e_i}/Σ_j P_j e^{−e_j} − 1, 1 − e^{−e_i}/Σ_j P_j e^{e_j})`` (exact, not
  linearised: ``P_i ∝ e^{s_i}``); evaluating it in float32 adds, relative to ``P_i``,
  ``eps·(|d_i| + C + Σ_j P_j(|d_j| + C) + S + 2)`` with ``d = s − max s`` (the rounding of the
  subtraction becomes a relative error ``|d|·u`` after ``exp``), ``C = 2`` ulps for ``exp``
  (XLA:CPU's float32 ``exp`` was measured within 1 ulp on [−87, 0]), S − 1 for the row sum and
  the rest for the division.
* **softmax backward** ``ds_i = P_i (dP_i − Σ_j P_j dP_j)``: the perturbation of P and dP
  carried exactly to first and second order, plus ``(S + 4)·eps·P_i(|dP_i| + Σ_j P_j|dP_j|)``
  for its float32 evaluation.
* **rounding to bfloat16** (under the bf16 policies; a no-op under float32, whose values are
  float32 throughout): the kernel rounds its float32 value ``a ∈ [v − e, v + e]`` to
  bfloat16, and rounding is monotone, so the result lies in ``[R(v − e), R(v + e)]``. The
  reference rounds too (``R(v)``, emulating the policy: bf16 exactly where a product reads a
  value, and at the outputs) and the new bound is ``max(R(v + e) − R(v), R(v) − R(v − e))``:
  zero where the interval cannot straddle a rounding boundary (then the kernel must match the
  rounded reference *bit for bit*), one ulp or more where it can.

Nothing is tuned: the constants are the ones above. The bound is tight where a bug hides. Under
float32 it is ~K·eps relative to the magnitudes (about 1e-5 of an O(1) error that a missing or
extra psum, wrong heads or a shifted mask make). Under bfloat16 most outputs must equal the
rounded reference exactly, so an extra rounding (a bf16 partial sum before the psum, a
cotangent rounded before its reduction) changes values that no propagated error excuses. The
policy's own roundings are part of the reference, so a kernel that rounds where the policy
does not, or skips a rounding the policy makes, fails here (and ``dtype_flow_violations``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import shardops
from shardops import _attention
from shardops.testing import dtype_flow, dtype_flow_violations

# Looked up at trace time, so the mutation tests can swap in a mutant module.
attention = _attention

POLICIES = {p.name: p for p in (shardops.FLOAT32, shardops.BFLOAT16, shardops.MIXED_BFLOAT16)}
EXP_ULPS = 2  # allowed error of float32 exp, in ulps (measured ≤ 1 on XLA:CPU)

# policy name → (max |err| / bound, max |err|, where); recorded by passing checks only.
WORST: dict[str, tuple[float, float, str]] = {}


# --- bounded float64 arithmetic -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bounded:
    """A float64 reference value ``v`` and an elementwise bound ``e`` on ``|kernel − v|``."""

    v: np.ndarray
    e: np.ndarray

    @property
    def mag(self) -> np.ndarray:
        """A bound on the magnitude of the kernel's value: ``|v| + e``."""
        return np.abs(self.v) + self.e

    def map(self, fn) -> Bounded:
        """A layout change (reshape, transpose): applied to both, no arithmetic."""
        return Bounded(fn(self.v), fn(self.e))


def exact(a) -> Bounded:
    a = np.asarray(a).astype(np.float64)
    return Bounded(a, np.zeros_like(a))


EPS = float(np.finfo(np.float32).eps)  # accum_dtype of every policy


def rounded(a: Bounded, dtype) -> Bounded:
    """The kernel's float32 value rounded to ``dtype`` (see the module docstring)."""
    if np.dtype(dtype) == np.float32:
        return a  # the kernel's values are float32 already

    def r(t):
        return t.astype(np.float32).astype(dtype).astype(np.float64)

    v = r(a.v)
    return Bounded(v, np.maximum(r(a.v + a.e) - v, v - r(a.v - a.e)))


def _contracted(spec: str, *shapes) -> int:
    inputs, out = spec.split("->")
    sizes = {}
    for term, shape in zip(inputs.split(","), shapes, strict=True):
        sizes.update(zip(term, shape, strict=True))
    return math.prod(n for i, n in sizes.items() if i not in out)


def products(spec: str, pairs, bias: Bounded | None = None) -> Bounded:
    """``Σ_pairs einsum(spec, a, b) (+ bias)`` accumulated in float32: one sum of all the terms."""
    v = e = mags = 0.0
    k = 0
    for a, b in pairs:
        v = v + np.einsum(spec, a.v, b.v)
        e = e + np.einsum(spec, a.e, np.abs(b.v)) + np.einsum(spec, a.mag, b.e)
        mags = mags + np.einsum(spec, a.mag, b.mag)
        k += _contracted(spec, a.v.shape, b.v.shape)
    if bias is not None:
        v, e, mags = v + bias.v, e + bias.e, mags + bias.mag
    return Bounded(v, e + (k + 2) * EPS * mags)


def product(spec: str, a: Bounded, b: Bounded, bias: Bounded | None = None) -> Bounded:
    return products(spec, [(a, b)], bias)


def total(a: Bounded, axes) -> Bounded:
    """A float32 sum over ``axes``."""
    n = math.prod(a.v.shape[i] for i in axes)
    return Bounded(a.v.sum(axes), a.e.sum(axes) + (n + 1) * EPS * a.mag.sum(axes))


def scaled(a: Bounded, c: float) -> Bounded:
    return Bounded(a.v * c, c * a.e + 2 * EPS * c * a.mag)


def softmax(s: Bounded, visible) -> Bounded:
    """Row softmax over the last dim of ``s[..., S]``; ``visible`` masks keys (or ``None``)."""
    vis = np.ones(s.v.shape, bool) if visible is None else np.broadcast_to(visible, s.v.shape)
    e_s = np.where(vis, s.e, 0.0)
    m = np.max(np.where(vis, s.v, -np.inf), axis=-1, keepdims=True)
    d = np.where(vis, s.v - m, 0.0)
    t = np.where(vis, np.exp(d), 0.0)
    p = t / t.sum(-1, keepdims=True)
    # The perturbation by the inputs' error, exactly (see the module docstring).
    up = 1 + np.sum(p * np.expm1(e_s), -1, keepdims=True)  # Σ P_j e^{e_j}
    down = 1 + np.sum(p * np.expm1(-e_s), -1, keepdims=True)  # Σ P_j e^{−e_j}
    pert = p * np.maximum(np.exp(e_s) / down - 1, 1 - np.exp(-e_s) / up)
    # The float32 evaluation on the perturbed inputs, relative to P'.
    p_hi = p + pert
    d_hi = np.abs(d) + e_s + np.max(e_s, -1, keepdims=True)  # |s' − max s'|
    each = np.where(vis, d_hi + EXP_ULPS, 0.0)
    rel = EPS * (each + np.sum(p_hi * each, -1, keepdims=True) + s.v.shape[-1] + 2)
    return Bounded(p, np.where(vis, pert + rel * p_hi, 0.0))


def softmax_backward(p: Bounded, dp: Bounded) -> Bounded:
    """``ds = P ⊙ (dP − Σ_j P_j dP_j)`` over the last dim (masked keys have P = 0 exactly)."""
    c = np.sum(p.v * dp.v, -1, keepdims=True)
    e_c = np.sum(p.e * np.abs(dp.v) + p.mag * dp.e, -1, keepdims=True)
    v = p.v * (dp.v - c)
    e = p.e * (np.abs(dp.v - c) + dp.e + e_c) + np.abs(p.v) * (dp.e + e_c)
    n = p.v.shape[-1]
    e = e + (n + 4) * EPS * p.mag * (dp.mag + np.sum(p.mag * dp.mag, -1, keepdims=True))
    return Bounded(v, e)


# --- the reference --------------------------------------------------------------------------


def attention_reference(x, params, ct, *, num_heads, causal, precision) -> dict[str, Bounded]:
    """Exact forward and gradients of ``sum(ct · attention(x))``, with bounds (module docstring).

    Returns ``{"y": ..., "x": dx, "wq": dwq, ...}``: each a ``Bounded`` in the dtype the kernel
    stores it in (compute dtype for ``y`` and ``dx``, param dtype for parameter gradients).
    """
    compute, param = precision.compute_dtype, precision.param_dtype
    batch, seq, _ = x.shape
    inner = params["wq"].shape[1]
    hd = inner // num_heads
    scale = 1.0 / math.sqrt(hd)
    visible = np.tril(np.ones((seq, seq), bool)) if causal else None  # key j ≤ query i

    def heads(t: Bounded) -> Bounded:  # [B, S, H·hd] → [B, H, S, hd]
        return t.map(lambda a: a.reshape(batch, seq, num_heads, hd).transpose(0, 2, 1, 3))

    def merged(t: Bounded) -> Bounded:  # [B, H, S, hd] → [B, S, H·hd]
        return t.map(lambda a: a.transpose(0, 2, 1, 3).reshape(batch, seq, inner))

    xs = exact(x)  # x[B, S, D], compute dtype
    p = {name: exact(a) for name, a in params.items()}
    w = {name: rounded(p[name], compute) for name in ("wq", "wk", "wv", "wo")}  # as multiplied

    # Forward: projections (accum), rounded where the attention products read them.
    proj = {n: product("bsd,df->bsf", xs, w[f"w{n}"], p.get(f"b{n}")) for n in "qkv"}
    qc, kc, vc = (rounded(heads(proj[n]), compute) for n in "qkv")  # [B, H, S, hd]
    scores = scaled(product("bhqd,bhkd->bhqk", qc, kc), scale)  # [B, H, S, S]
    probs = softmax(scores, visible)  # [B, H, S, S]
    pc = rounded(probs, compute)
    o = merged(product("bhqk,bhkd->bhqd", pc, vc))  # o[B, S, H·hd] in accum
    oc = rounded(o, compute)
    y = product("bsf,fd->bsd", oc, w["wo"], p.get("bo"))  # y[B, S, D] (psum'd) + bo
    out = {"y": rounded(y, compute)}

    # Backward of sum(ct · y): cotangents rounded where a backward product reads them.
    g = exact(ct)  # dy[B, S, D], compute dtype: exact in float32
    if "bo" in p:
        out["bo"] = rounded(total(g, (0, 1)), param)
    out["wo"] = rounded(product("bsf,bsd->fd", oc, g), param)
    do = rounded(heads(product("bsd,fd->bsf", g, w["wo"])), compute)  # do[B, H, S, hd]
    dp = product("bhqd,bhkd->bhqk", do, vc)  # dP[B, H, S, S]
    dv = product("bhqk,bhqd->bhkd", pc, do)  # dv[B, H, S, hd]
    ds = rounded(scaled(softmax_backward(probs, dp), scale), compute)  # d scores_raw
    dq = product("bhqk,bhkd->bhqd", ds, kc)
    dk = product("bhqk,bhqd->bhkd", ds, qc)
    grads = {n: merged(t) for n, t in (("q", dq), ("k", dk), ("v", dv))}  # [B, S, H·hd] accum
    grads_c = {n: rounded(t, compute) for n, t in grads.items()}
    out["x"] = rounded(
        products("bsf,df->bsd", [(grads_c[n], w[f"w{n}"]) for n in "qkv"]), compute
    )
    for n in "qkv":
        out[f"w{n}"] = rounded(product("bsd,bsf->df", xs, grads_c[n]), param)
        if f"b{n}" in p:
            out[f"b{n}"] = rounded(total(grads[n], (0, 1)), param)
    return out


# --- running the sharded layer ----------------------------------------------------------------


def mesh_for(shape: tuple[int, ...]):
    """(model,) or (data, model) sizes → a mesh and the batch axis to use on it."""
    if len(shape) == 1:
        return shardops.make_mesh({shardops.MODEL_AXIS: shape[0]}), None
    data, model = shape
    mesh = shardops.make_mesh({shardops.DATA_AXIS: data, shardops.MODEL_AXIS: model})
    return mesh, shardops.DATA_AXIS


@functools.partial(
    jax.jit,
    static_argnames=("mesh", "num_heads", "causal", "batch_axis", "sequence_parallel", "precision"),
)
def sharded_forward_and_grads(
    x, params, ct, *, mesh, num_heads, causal, batch_axis, sequence_parallel, precision
):
    """``y`` and ``d sum(ct·y) / d(x, params)`` through the sharded layer, in one program."""
    fn = attention.head_parallel_attention  # looked up at trace time (mutation tests)

    def loss(x, params):
        y = fn(x, params, mesh=mesh, num_heads=num_heads, causal=causal, batch_axis=batch_axis,
               sequence_parallel=sequence_parallel, precision=precision)  # fmt: skip
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    return y, grads


def random_inputs(rng, batch, seq, d_model, num_heads, head_dim, precision, use_bias=True):
    """``x[B, S, D]``, full params (weights ~ N(0, 1/fan_in): O(1) scores) and ``ct[B, S, D]``."""
    inner = num_heads * head_dim
    x = rng.standard_normal((batch, seq, d_model)).astype(precision.compute_dtype)
    shapes = {"wq": (d_model, inner), "wk": (d_model, inner), "wv": (d_model, inner),
              "wo": (inner, d_model)}  # fmt: skip
    params = {
        n: (rng.standard_normal(s) / math.sqrt(s[0])).astype(precision.param_dtype)
        for n, s in shapes.items()
    }
    if use_bias:
        for n, size in (("bq", inner), ("bk", inner), ("bv", inner), ("bo", d_model)):
            params[n] = (0.5 * rng.standard_normal(size)).astype(precision.param_dtype)
    ct = rng.standard_normal((batch, seq, d_model)).astype(precision.compute_dtype)
    return x, params, ct


def place(mesh, batch_axis, sequence_parallel, x, params, ct):
    specs = attention.attention_specs(batch_axis=batch_axis, sequence_parallel=sequence_parallel)
    x = jax.device_put(x, NamedSharding(mesh, specs.x))
    ct = jax.device_put(ct, NamedSharding(mesh, specs.y))
    return x, shardops.shard_params(params, mesh, specs.params), ct


def check_attention(
    mesh_shape: tuple[int, ...],
    precision,
    *,
    batch: int = 4,
    seq: int = 8,
    d_model: int = 32,
    num_heads: int = 8,
    head_dim: int = 4,
    causal: bool = False,
    sequence_parallel: bool = False,
    use_bias: bool = True,
    seed: int = 0,
) -> float:
    """Assert forward and every gradient are within the bound; return the worst ratio."""
    mesh, batch_axis = mesh_for(mesh_shape)
    rng = np.random.default_rng(seed)
    x, params, ct = random_inputs(rng, batch, seq, d_model, num_heads, head_dim, precision,
                                  use_bias)  # fmt: skip
    ref = attention_reference(x, params, ct, num_heads=num_heads, causal=causal,
                              precision=precision)  # fmt: skip
    y, (dx, dparams) = sharded_forward_and_grads(
        *place(mesh, batch_axis, sequence_parallel, x, params, ct),
        mesh=mesh, num_heads=num_heads, causal=causal, batch_axis=batch_axis,
        sequence_parallel=sequence_parallel, precision=precision,
    )  # fmt: skip
    assert y.dtype == precision.compute_dtype and dx.dtype == precision.compute_dtype
    assert all(g.dtype == precision.param_dtype for g in dparams.values())
    got = {"y": y, "x": dx, **dparams}
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    where = (
        f"mesh {mesh_shape} B={batch} S={seq} D={d_model} H={num_heads} hd={head_dim} "
        f"causal={causal} sp={sequence_parallel} bias={use_bias}"
    )
    worst, worst_abs, worst_name = 0.0, 0.0, ""
    for name, want in ref.items():
        have = np.asarray(got[name], np.float64)
        assert have.shape == want.v.shape, (name, have.shape, want.v.shape)
        err = np.abs(have - want.v)
        ratio = float(np.max(err / (want.e + np.finfo(np.float64).tiny)))
        assert ratio <= 1.0, (
            f"{'d' if name != 'y' else ''}{name} of {where} under {precision.name}: max |err| = "
            f"{err.max():.3e} exceeds the bound by {ratio:.3g}× (at "
            f"{np.unravel_index(np.argmax(err / (want.e + 1e-300)), err.shape)})"
        )
        if ratio > worst:
            worst, worst_abs, worst_name = ratio, float(err.max()), name
    if worst > WORST.get(precision.name, (-1.0,))[0]:
        WORST[precision.name] = (worst, worst_abs, f"{worst_name}: {where}")
    return worst


def check_attention_dtype_flow(mesh_shape, precision, *, causal=True, sequence_parallel=False):
    """The jaxpr of forward + gradients follows ``precision``: 3 projections, 2 attention products
    and the output projection forward, two products each backward, every sum in accum."""
    mesh, batch_axis = mesh_for(mesh_shape)
    x, params, ct = random_inputs(np.random.default_rng(0), 4, 8, 32, 8, 4, precision)
    args = place(mesh, batch_axis, sequence_parallel, x, params, ct)
    kwargs = dict(mesh=mesh, num_heads=8, causal=causal, batch_axis=batch_axis,
                  sequence_parallel=sequence_parallel, precision=precision)  # fmt: skip
    problems = dtype_flow_violations(sharded_forward_and_grads, *args, policy=precision, **kwargs)
    assert not problems, "\n".join(problems)
    flow = dtype_flow(sharded_forward_and_grads, *args, **kwargs)
    assert sum(name == "dot_general" for name, *_ in flow) == 18, flow  # 6 forward, 12 backward


def requested_and_compiled(mesh_shape, precision, *, sequence_parallel, causal=True):
    """``(requested, compiled)`` bytes per (kind, axes) of forward + gradients (``Ledger``)."""
    mesh, batch_axis = mesh_for(mesh_shape)
    x, params, ct = random_inputs(np.random.default_rng(0), 4, 8, 32, 8, 4, precision)
    args = place(mesh, batch_axis, sequence_parallel, x, params, ct)
    kwargs = dict(mesh=mesh, num_heads=8, causal=causal, batch_axis=batch_axis,
                  sequence_parallel=sequence_parallel, precision=precision)  # fmt: skip
    led = shardops.ledger(mesh, functools.partial(sharded_forward_and_grads, **kwargs), *args)
    return led.totals(requested=True), led.totals()

