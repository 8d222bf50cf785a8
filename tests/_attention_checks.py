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

Nothing is tuned: the constants are the ones above. How tight it is, measured over the suite:
under float32 the worst ``|err|/bound`` is ~0.015, the bound is 1e-4 to 1e-2 of the values
(loosest for gradients through the softmax backward, whose terms cancel), and the bugs it must
catch (wrong heads, a shifted mask, a missing or extra psum, a bias counted p times) move the
results by O(1): the mutants exceed it 3·10³ to 2·10⁴ times. Under bfloat16 a third to a half of
the outputs ``y`` must equal the rounded reference bit for bit, and the rest may be the
neighbouring bf16 value that their rounding interval allows (an ``|err|/bound`` of exactly 1).
An extra rounding (a bf16 partial sum before the psum, ``dx`` reduced in bf16) changes values
that had to match exactly, and fails. The policy's own roundings are part of the reference, so
a kernel that rounds where the policy does not, or skips a rounding it makes, fails here too.

Norms (``norm_reference``): the same rules, with elementwise ``plus``/``times``, row sums and
``rsqrt`` (XLA:CPU: within 1.7 ulps, 2 allowed), applied to layer norm and RMS norm in the order
autodiff runs them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from _dense_checks import mesh_for
from jax.sharding import NamedSharding

import shardops
from shardops.layers import _attention, _attention_core, _norms
from shardops.testing import dtype_flow, dtype_flow_violations

# Looked up at trace time, so the mutation tests can swap in a mutant module.
attention = _attention

POLICIES = {p.name: p for p in (shardops.FLOAT32, shardops.BFLOAT16, shardops.MIXED_BFLOAT16)}
EXP_ULPS = 2  # allowed error of float32 exp, in ulps (measured ≤ 1 on XLA:CPU)
# Allowed absolute error of float32 cos and sin, in eps: measured ≤ 0.28 eps on XLA:CPU over
# 2·10⁶ angles in [0, 200] and the RoPE angles of positions 0 … 4095.
TRIG_EPS = 1.0

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


def ratio_to_bound(have, want: Bounded) -> np.ndarray:
    """``|have − v| / e`` elementwise: ≤ 1 within the bound; ``inf`` where the bound is zero
    (the value had to match exactly) and it does not; ``nan`` where ``have`` is not finite."""
    err = np.abs(np.asarray(have, np.float64) - want.v)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where(err == 0, 0.0, err / want.e)


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


def softmax(s: Bounded, visible, ring: int = 0) -> Bounded:
    """Row softmax over the last dim of ``s[..., S]``; ``visible`` masks keys (or ``None``).

    ``ring = N > 0``: evaluated as ring attention does (``RING_DOCS``): the bound gains
    ``eps·(N·(C + 3) + max|s| + max|d| + 3·ln S)`` relative to ``P``."""
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
    if ring:
        s_max = np.max(np.where(vis, np.abs(s.v) + s.e, 0.0), -1, keepdims=True)
        d_max = np.max(np.where(vis, d_hi, 0.0), -1, keepdims=True)
        rel = rel + EPS * (ring * (EXP_ULPS + 3) + s_max + d_max + 3 * math.log(s.v.shape[-1]))
    return Bounded(p, np.where(vis, pert + rel * p_hi, 0.0))


RING_DOCS = """Ring attention's softmax, and its bound. The forward keeps a running max m and sum l
over the N key blocks: each block's terms are exp(s − m_t) (the subtraction's rounding, |d|·u,
and C ulps of exp, as one-pass), and each of the N rescales exp(m_old − m_new) · (o, l) adds C
ulps, the subtraction's rounding (≤ |Δm|·u, Σ|Δm| ≤ max|d|) and two products: N·(C + 3)·eps
+ max|d|·eps relative to P. The backward recomputes P = exp(s − lse), lse = m + ln l: the
argument's rounding (|s − lse| ≤ |d| + ln S) and lse's own (|m|·u ≤ max|s|·u, ln l's ≤ 2·ln
S·u, l's relative error already counted) add max|s|·eps + 3·ln S·eps. Under bfloat16 the ring
rounds the unnormalised exp(s − m_t) where the product reads it, not P, so the reference
cannot emulate that rounding bit for bit: P carries a relative error of u(bf16) = 2⁻⁸ there
instead (``loosely_rounded``), and the backward's Σ_j P_j dP_j is the ring's Σ_d dO_d·O_d (a
product of hd terms, ``product``)."""


def loosely_rounded(a: Bounded, dtype) -> Bounded:
    """``a`` rounded to ``dtype`` at a point the reference does not see (a relative error of
    half an ulp of ``dtype``, u = 2⁻⁸ for bfloat16); float32: unchanged."""
    if np.dtype(dtype) == np.float32:
        return a
    u = float(np.finfo(dtype).eps) / 2
    return Bounded(a.v, a.e + u * a.mag)


def softmax_backward(p: Bounded, dp: Bounded, c: Bounded | None = None) -> Bounded:
    """``ds = P ⊙ (dP − Σ_j P_j dP_j)`` over the last dim (masked keys have P = 0 exactly);
    ``c[..., 1]``: the row sums ``Σ_j P_j dP_j`` as the kernel computes them, if not so."""
    if c is None:
        c = Bounded(np.sum(p.v * dp.v, -1, keepdims=True),
                    np.sum(p.e * np.abs(dp.v) + p.mag * dp.e, -1, keepdims=True))  # fmt: skip
    c, e_c = c.v, c.e
    v = p.v * (dp.v - c)
    e = p.e * (np.abs(dp.v - c) + dp.e + e_c) + np.abs(p.v) * (dp.e + e_c)
    n = p.v.shape[-1]
    e = e + (n + 4) * EPS * p.mag * (dp.mag + np.sum(p.mag * dp.mag, -1, keepdims=True))
    return Bounded(v, e)


# --- the reference --------------------------------------------------------------------------


def document_positions(segment_ids) -> np.ndarray:
    """``positions[B, S]``: each token's index within its document (a run of equal segment
    ids), by a plain loop: the reference's own count, not the kernel's ``cummax``."""
    seg = np.asarray(segment_ids)
    out = np.zeros(seg.shape, np.int64)
    for b in range(seg.shape[0]):
        for s in range(1, seg.shape[1]):
            out[b, s] = 0 if seg[b, s] != seg[b, s - 1] else out[b, s - 1] + 1
    return out


def rotation(positions, head_dim: int, theta: float) -> tuple[Bounded, Bounded]:
    """``cos, sin[B, 1, S, hd/2]`` of the angles ``position · θ^(−2d/hd)`` in float64, with the
    bound on the kernel's float32 values: its frequency is rounded to float32 and multiplied by
    the position in float32 (two relative roundings: ``|Δangle| ≤ angle·(eps + eps²)``), then
    cos and sin are evaluated in float32 (``TRIG_EPS``)."""
    freqs = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.asarray(positions, np.float64)[:, None, :, None] * freqs  # [B, 1, S, hd/2]
    e = angles * (EPS + EPS**2) + TRIG_EPS * EPS  # |cos(a + δ) − cos(a)| ≤ |δ|
    return Bounded(np.cos(angles), e), Bounded(np.sin(angles), e)


def negated(a: Bounded) -> Bounded:
    return Bounded(-a.v, a.e)


def halves(t: Bounded) -> tuple[Bounded, Bounded]:
    half = t.v.shape[-1] // 2
    return t.map(lambda a: a[..., :half]), t.map(lambda a: a[..., half:])


def joined(a: Bounded, b: Bounded) -> Bounded:
    return Bounded(np.concatenate([a.v, b.v], -1), np.concatenate([a.e, b.e], -1))


def rotated(t: Bounded, cos: Bounded, sin: Bounded) -> Bounded:
    """Hugging Face's rotate-half: dims ``d`` and ``d + hd/2`` form a pair, rotated by the
    angle: ``(t1·cos − t2·sin, t2·cos + t1·sin)``, in float32."""
    t1, t2 = halves(t)
    return joined(plus(times(t1, cos), negated(times(t2, sin))),
                  plus(times(t2, cos), times(t1, sin)))  # fmt: skip


def unrotated(g: Bounded, cos: Bounded, sin: Bounded) -> Bounded:
    """The transpose of ``rotated`` applied to a cotangent: ``(g1·cos + g2·sin,
    g2·cos − g1·sin)``, in float32."""
    g1, g2 = halves(g)
    return joined(plus(times(g1, cos), times(g2, sin)),
                  plus(times(g2, cos), negated(times(g1, sin))))  # fmt: skip


def attention_reference(x, params, ct, *, num_heads, causal, precision, num_kv_heads=None,
                        rope_theta=None, positions=None, segment_ids=None,
                        kv_devices: int = 1, ring: int = 0) -> dict[str, Bounded]:  # fmt: skip
    """Exact forward and gradients of ``sum(ct · attention(x))``, with bounds (module docstring).

    Grouped-query attention: query head ``j`` reads KV head ``j // (H / KV)``. Rotary
    embeddings (``rope_theta``) rotate q and k at ``positions`` (default: each token's index
    within its document when ``segment_ids`` are given, else ``0 … S−1``); ``segment_ids``
    keep attention within a document. ``kv_devices = p`` when ``wk``, ``wv`` are replicated over
    a model axis of ``p`` devices: device ``d`` then computes the KV cotangent of its own query
    heads only, and the partial sums meet in the weight gradients and ``dx`` (each rounded
    before its product, as the kernel rounds it), so the bound follows the kernel's order.
    ``ring = N``: the softmax as ring attention over N devices computes it (``RING_DOCS``).

    Returns ``{"y": ..., "x": dx, "wq": dwq, ...}``: each a ``Bounded`` in the dtype the kernel
    stores it in (compute dtype for ``y`` and ``dx``, param dtype for parameter gradients).
    """
    compute, param = precision.compute_dtype, precision.param_dtype
    batch, seq, _ = x.shape
    kv = num_heads if num_kv_heads is None else num_kv_heads
    group = num_heads // kv
    hd = params["wq"].shape[1] // num_heads
    scale = 1.0 / math.sqrt(hd)
    visible = np.ones((1, 1, seq, seq), bool)
    if causal:
        visible = visible & np.tril(np.ones((seq, seq), bool))  # key j ≤ query i
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        visible = visible & (seg[:, None, :, None] == seg[:, None, None, :])  # [B, 1, S, S]
    visible = None if visible.all() else visible

    def heads(t: Bounded, n: int) -> Bounded:  # [B, S, n·hd] → [B, n, S, hd]
        return t.map(lambda a: a.reshape(batch, seq, n, hd).transpose(0, 2, 1, 3))

    def merged(t: Bounded) -> Bounded:  # [B, n, S, hd] → [B, S, n·hd]
        return t.map(lambda a: a.transpose(0, 2, 1, 3).reshape(batch, seq, -1))

    def grouped(t: Bounded) -> Bounded:  # [B, H, ...] → [B, KV, H/KV, ...]: query j → KV j // g
        return t.map(lambda a: a.reshape(batch, kv, group, *a.shape[2:]))

    def for_queries(t: Bounded) -> Bounded:  # [B, KV, S, hd] → [B, H, S, hd]
        return t.map(lambda a: np.repeat(a, group, axis=1))

    xs = exact(x)  # x[B, S, D], compute dtype
    p = {name: exact(a) for name, a in params.items()}
    w = {name: rounded(p[name], compute) for name in ("wq", "wk", "wv", "wo")}  # as multiplied
    n_heads = {"q": num_heads, "k": kv, "v": kv}

    # Forward: projections (accum), rotated, rounded where the attention products read them.
    proj = {n: heads(product("bsd,df->bsf", xs, w[f"w{n}"], p.get(f"b{n}")), n_heads[n])
            for n in "qkv"}  # fmt: skip
    if rope_theta is not None:
        if positions is None:
            positions = (document_positions(segment_ids) if segment_ids is not None
                         else np.broadcast_to(np.arange(seq), (batch, seq)))  # fmt: skip
        cos, sin = rotation(positions, hd, rope_theta)
        proj["q"], proj["k"] = rotated(proj["q"], cos, sin), rotated(proj["k"], cos, sin)
    qc, kc, vc = (rounded(proj[n], compute) for n in "qkv")  # [B, H or KV, S, hd]
    scores = scaled(product("bhqd,bhkd->bhqk", qc, for_queries(kc)), scale)  # [B, H, S, S]
    probs = softmax(scores, visible, ring)  # [B, H, S, S]
    pc = loosely_rounded(probs, compute) if ring else rounded(probs, compute)
    o_heads = product("bhqk,bhkd->bhqd", pc, for_queries(vc))  # o[B, H, S, hd] in accum
    o = merged(o_heads)  # o[B, S, H·hd]
    oc = rounded(o, compute)
    y = product("bsf,fd->bsd", oc, w["wo"], p.get("bo"))  # y[B, S, D] (psum'd) + bo
    out = {"y": rounded(y, compute)}

    # Backward of sum(ct · y): cotangents rounded where a backward product reads them.
    g = exact(ct)  # dy[B, S, D], compute dtype: exact in float32
    if "bo" in p:
        out["bo"] = rounded(total(g, (0, 1)), param)
    out["wo"] = rounded(product("bsf,bsd->fd", oc, g), param)
    do = rounded(heads(product("bsd,fd->bsf", g, w["wo"]), num_heads), compute)  # [B, H, S, hd]
    dp = product("bhqd,bhkd->bhqk", do, for_queries(vc))  # dP[B, H, S, S]
    c = None
    if ring:  # the ring's Σ_j P_j dP_j: Σ_d dO_d · O_d, O before its rounding
        c = product("bhqd,bhqd->bhq", do, o_heads).map(lambda a: a[..., None])
    ds = rounded(scaled(softmax_backward(probs, dp, c), scale), compute)  # d scores_raw
    dq = product("bhqk,bhkd->bhqd", ds, for_queries(kc))  # [B, H, S, hd]
    # dk, dv: each KV head's sum over its group's query heads (and the queries), as the
    # partial sums of each device's query heads when K/V are replicated over kv_devices.
    dk, dv = [], []
    per_device = num_heads // kv_devices
    for d in range(kv_devices):
        mine = np.zeros((1, num_heads, 1, 1))
        mine[:, d * per_device : (d + 1) * per_device] = 1.0  # this device's query heads
        ds_d, do_d = (Bounded(t.v * mine, t.e * mine) for t in (ds, do))
        dk.append(product("bngqk,bngqd->bnkd", grouped(ds_d), grouped(qc)))  # [B, KV, S, hd]
        dv.append(product("bngqk,bngqd->bnkd", grouped(pc), grouped(do_d)))
    if rope_theta is not None:
        dq = unrotated(dq, cos, sin)
        dk = [unrotated(t, cos, sin) for t in dk]
    grads = {"q": [merged(dq)], "k": [merged(t) for t in dk], "v": [merged(t) for t in dv]}
    grads_c = {n: [rounded(t, compute) for t in ts] for n, ts in grads.items()}
    out["x"] = rounded(products("bsf,df->bsd", [(t, w[f"w{n}"]) for n in "qkv"
                                                for t in grads_c[n]]), compute)  # fmt: skip
    for n in "qkv":
        out[f"w{n}"] = rounded(products("bsd,bsf->df", [(xs, t) for t in grads_c[n]]), param)
        if f"b{n}" in p:
            stacked = Bounded(np.stack([t.v for t in grads[n]]), np.stack([t.e for t in grads[n]]))
            out[f"b{n}"] = rounded(total(stacked, (0, 1, 2)), param)
    return out


def softmax_blocks(implementation: str, keys: int) -> int:
    """The reference's ``ring`` argument for an attention ``implementation`` over ``keys`` keys:
    0 for the einsum (one softmax, P rounded), else the number of key blocks the online softmax
    folds in (``"auto"`` is the blocked path off TPU), evaluated as ``RING_DOCS`` says."""
    if implementation == "auto":
        implementation = "splash" if jax.default_backend() == "tpu" else "blocked"
    return 0 if implementation == "einsum" else -(-keys // _attention_core.BLOCK_K)


# --- running the sharded layer ----------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=("mesh", "num_heads", "num_kv_heads", "causal", "rope_theta", "batch_axis",
                     "sequence_parallel", "precision", "implementation"),
)  # fmt: skip
def sharded_forward_and_grads(
    x, params, ct, positions=None, segment_ids=None, *, mesh, num_heads, causal, batch_axis,
    sequence_parallel, precision, num_kv_heads=None, rope_theta=None, implementation="auto",
):  # fmt: skip
    """``y`` and ``d sum(ct·y) / d(x, params)`` through the sharded layer, in one program."""
    fn = attention.head_parallel_attention  # looked up at trace time (mutation tests)

    def loss(x, params):
        y = fn(x, params, mesh=mesh, num_heads=num_heads, num_kv_heads=num_kv_heads,
               causal=causal, rope_theta=rope_theta, positions=positions,
               segment_ids=segment_ids, batch_axis=batch_axis,
               sequence_parallel=sequence_parallel, precision=precision,
               implementation=implementation)  # fmt: skip
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    return y, grads


def random_inputs(rng, batch, seq, d_model, num_heads, head_dim, precision, use_bias=True,
                  temperature=1.0, num_kv_heads=None):  # fmt: skip
    """``x[B, S, D]``, full params and ``ct[B, S, D]``. Weights ~ N(0, 1/fan_in), so scores are
    O(1); ``temperature`` scales wq and wk by its square root: scores × temperature (peaked or
    flat attention). ``wk``, ``wv`` have ``num_kv_heads`` heads (default H)."""
    inner = num_heads * head_dim
    kv_inner = (num_heads if num_kv_heads is None else num_kv_heads) * head_dim
    x = rng.standard_normal((batch, seq, d_model)).astype(precision.compute_dtype)
    shapes = {"wq": (d_model, inner), "wk": (d_model, kv_inner), "wv": (d_model, kv_inner),
              "wo": (inner, d_model)}  # fmt: skip
    params = {
        n: (rng.standard_normal(s) / math.sqrt(s[0])).astype(precision.param_dtype)
        for n, s in shapes.items()
    }
    if use_bias:
        for n, size in (("bq", inner), ("bk", kv_inner), ("bv", kv_inner), ("bo", d_model)):
            params[n] = (0.5 * rng.standard_normal(size)).astype(precision.param_dtype)
    for n in ("wq", "wk"):
        params[n] = (params[n].astype(np.float64) * math.sqrt(temperature)).astype(params[n].dtype)
    ct = rng.standard_normal((batch, seq, d_model)).astype(precision.compute_dtype)
    return x, params, ct


def random_segments(rng, batch: int, seq: int, documents: int) -> np.ndarray:
    """``segment_ids[B, S]`` (int32): each row packs up to ``documents`` documents, cut at
    random places (a document of one token included), numbered from a random start."""
    out = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=min(documents, seq) - 1, replace=False))
        out[b] = rng.integers(0, 100) + np.searchsorted(cuts, np.arange(seq), side="right")
    return out


def place(mesh, batch_axis, sequence_parallel, x, params, ct, *tokens, replicate_kv=False):
    specs = attention.head_parallel_attention_specs(
        batch_axis=batch_axis, sequence_parallel=sequence_parallel, replicate_kv=replicate_kv
    )
    x = jax.device_put(x, NamedSharding(mesh, specs.x))
    ct = jax.device_put(ct, NamedSharding(mesh, specs.y))
    tokens = [None if t is None else jax.device_put(t, NamedSharding(mesh, specs.tokens))
              for t in tokens]  # fmt: skip
    return x, shardops.shard_params(params, mesh, specs.params), ct, *tokens


def check_attention(
    mesh_shape: tuple[int, ...],
    precision,
    *,
    batch: int = 4,
    seq: int = 8,
    d_model: int = 32,
    num_heads: int = 8,
    head_dim: int = 4,
    num_kv_heads: int | None = None,
    causal: bool = False,
    sequence_parallel: bool = False,
    use_bias: bool = True,
    temperature: float = 1.0,
    rope_theta: float | None = None,
    documents: int = 1,
    position_offset: int | None = None,
    seed: int = 0,
    implementation: str = "auto",
) -> float:
    """Assert forward and every gradient are within the bound; return the worst ratio.

    ``documents > 1`` packs that many documents per row (``segment_ids``); with ``rope_theta``
    their positions restart at each document, unless ``position_offset`` gives every row the
    explicit positions ``offset … offset + S − 1`` (a continued sequence)."""
    mesh, batch_axis = mesh_for(mesh_shape)
    kv = num_heads if num_kv_heads is None else num_kv_heads
    replicate_kv = not attention.splits_kv_heads(kv, mesh_shape[-1])
    rng = np.random.default_rng(seed)
    x, params, ct = random_inputs(rng, batch, seq, d_model, num_heads, head_dim, precision,
                                  use_bias, temperature, num_kv_heads)  # fmt: skip
    segment_ids = random_segments(rng, batch, seq, documents) if documents > 1 else None
    positions = None
    if position_offset is not None:
        positions = np.broadcast_to(position_offset + np.arange(seq, dtype=np.int32), (batch, seq))
    tokens = dict(num_kv_heads=num_kv_heads, rope_theta=rope_theta, positions=positions,
                  segment_ids=segment_ids)  # fmt: skip
    ref = attention_reference(x, params, ct, num_heads=num_heads, causal=causal,
                              precision=precision, **tokens,
                              kv_devices=mesh_shape[-1] if replicate_kv else 1,
                              ring=softmax_blocks(implementation, seq))  # fmt: skip
    y, (dx, dparams) = sharded_forward_and_grads(
        *place(mesh, batch_axis, sequence_parallel, x, params, ct, positions, segment_ids,
               replicate_kv=replicate_kv),
        mesh=mesh, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal,
        rope_theta=rope_theta, batch_axis=batch_axis, sequence_parallel=sequence_parallel,
        precision=precision, implementation=implementation,
    )  # fmt: skip
    assert y.dtype == precision.compute_dtype and dx.dtype == precision.compute_dtype
    assert all(g.dtype == precision.param_dtype for g in dparams.values())
    got = {"y": y, "x": dx, **dparams}
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    where = (
        f"{implementation} on mesh {mesh_shape} B={batch} S={seq} D={d_model} H={num_heads} "
        f"KV={kv} hd={head_dim} "
        f"causal={causal} sp={sequence_parallel} bias={use_bias} T={temperature} "
        f"rope={rope_theta} docs={documents} offset={position_offset} seed={seed}"
    )
    return assert_within_bounds(got, ref, where, precision)


def assert_within_bounds(got: dict, ref: dict, where: str, precision, key: str | None = None):
    """Every ``got[name]`` within its ``ref[name]`` bound, else an AssertionError naming the
    value, the case and the worst element; records the worst ratio in ``WORST[key]`` (default
    the policy's name) and returns it."""
    worst, worst_abs, worst_name = 0.0, 0.0, ""
    for name, want in ref.items():
        have = np.asarray(got[name], np.float64)
        assert have.shape == want.v.shape, (name, have.shape, want.v.shape)
        err = np.abs(have - want.v)
        ratios = ratio_to_bound(have, want)
        ratio = float(np.max(ratios))
        if not ratio <= 1.0:
            at = np.unravel_index(np.argmax(np.nan_to_num(ratios, nan=np.inf)), err.shape)
            if want.e[at] == 0:
                how = f"at {at} the bound is 0: it had to equal the rounded reference exactly"
            else:
                how = f"{ratio:.3g}× the bound at {at}"
            raise AssertionError(
                f"{'d' if name != 'y' else ''}{name} of {where} under {precision.name}: max "
                f"|err| = {err.max():.3e}; {how} ({int(np.sum(~(ratios <= 1)))} of {err.size} "
                f"elements outside the bound)"
            )
        if ratio > worst:
            worst, worst_abs, worst_name = ratio, float(err.max()), name
    key = precision.name if key is None else key
    if worst > WORST.get(key, (-1.0,))[0]:
        WORST[key] = (worst, worst_abs, f"{worst_name}: {where}")
    return worst


def _fixed_case(
    mesh_shape,
    precision,
    *,
    causal,
    sequence_parallel,
    num_kv_heads=None,
    rope_theta=None,
    documents=1,
):
    """Placed arguments and static options of the fixed case the dtype-flow and collective
    checks read: x[B=4, S=8, D=32], 8 query heads of 4 (``num_kv_heads`` KV heads)."""
    mesh, batch_axis = mesh_for(mesh_shape)
    kv = 8 if num_kv_heads is None else num_kv_heads
    replicate_kv = not attention.splits_kv_heads(kv, mesh_shape[-1])
    rng = np.random.default_rng(0)
    x, params, ct = random_inputs(rng, 4, 8, 32, 8, 4, precision, num_kv_heads=num_kv_heads)
    segment_ids = random_segments(rng, 4, 8, documents) if documents > 1 else None
    args = place(mesh, batch_axis, sequence_parallel, x, params, ct, None, segment_ids,
                 replicate_kv=replicate_kv)  # fmt: skip
    kwargs = dict(mesh=mesh, num_heads=8, num_kv_heads=num_kv_heads, causal=causal,
                  rope_theta=rope_theta, batch_axis=batch_axis,
                  sequence_parallel=sequence_parallel, precision=precision)  # fmt: skip
    return args, kwargs


def check_attention_dtype_flow(mesh_shape, precision, *, causal=True, sequence_parallel=False,
                               implementation="auto", **options):  # fmt: skip
    """The jaxpr of forward + gradients follows ``precision``: 3 projections, 2 attention products
    and the output projection forward, two products each backward (the blocked path's backward
    recomputes the scores: one more), every sum in accum."""
    args, kwargs = _fixed_case(mesh_shape, precision, causal=causal,
                               sequence_parallel=sequence_parallel, **options)  # fmt: skip
    kwargs["implementation"] = implementation
    problems = dtype_flow_violations(sharded_forward_and_grads, *args, policy=precision, **kwargs)
    assert not problems, "\n".join(problems)
    flow = dtype_flow(sharded_forward_and_grads, *args, **kwargs)
    products = 18 if softmax_blocks(implementation, 8) == 0 else 19  # 6 forward, 12 (13) backward
    assert sum(name == "dot_general" for name, *_ in flow) == products, flow


def attention_ledger(mesh_shape, precision, *, sequence_parallel, causal=True, **options):
    """The ``Ledger`` of forward + gradients of the fixed case (``_fixed_case``)."""
    args, kwargs = _fixed_case(mesh_shape, precision, causal=causal,
                               sequence_parallel=sequence_parallel, **options)  # fmt: skip
    mesh = kwargs["mesh"]
    return shardops.inspect.ledger(
        mesh, functools.partial(sharded_forward_and_grads, **kwargs), *args
    )


def requested_and_compiled(mesh_shape, precision, *, sequence_parallel, causal=True, **options):
    """``(requested, compiled)`` bytes per (kind, axes) of forward + gradients (``Ledger``)."""
    led = attention_ledger(mesh_shape, precision, sequence_parallel=sequence_parallel,
                           causal=causal, **options)  # fmt: skip
    return led.totals(requested=True), led.totals()


# --- norms on sequence-parallel activations ---------------------------------------------------

norms = _norms  # looked up at call time (mutation tests)
NORM_PARAMS = {"layer_norm": ("scale", "bias"), "rms_norm": ("scale",)}
NORM_WORST: dict[str, float] = {}  # kind → max |err| / bound of passing checks


def norm_forward_and_grads(kind: str, x, ct, *params):
    """``y = norm(x, *params)`` and the gradients of ``sum(ct · y)`` w.r.t. ``x`` and each param,
    taken where this runs: inside a ``shard_map`` body, the local shard's sum."""
    fn = getattr(norms, kind)

    def loss(x, *params):
        y = fn(x, *params)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    argnums = tuple(range(1 + len(params)))
    (_, y), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(x, *params)
    return (y, *grads)


def norm_inputs(rng, kind, batch, seq, d, precision, *, tiled_over=1):
    """``x[B, S, D]``, ``ct`` in compute dtype and the params in param dtype. ``tiled_over=p``
    repeats one sequence block p times along S, so every device's shard is the same."""
    block = (batch, seq // tiled_over, d)
    x = np.tile(rng.standard_normal(block) * 2 + 1, (1, tiled_over, 1))
    ct = np.tile(rng.standard_normal(block), (1, tiled_over, 1))
    params = [rng.standard_normal(d).astype(precision.param_dtype) for _ in NORM_PARAMS[kind]]
    return x.astype(precision.compute_dtype), ct.astype(precision.compute_dtype), params


def sequence_parallel_norm(kind, mesh_shape, x, ct, params, *, check_vma=True):
    """The norm and its gradients inside one ``shard_map`` over ``x[B_data, S_model, D]`` with
    replicated params (``P()``), next to the same body run unsharded."""
    mesh, batch_axis = mesh_for(mesh_shape)
    x_spec = jax.sharding.PartitionSpec(batch_axis, shardops.MODEL_AXIS, None)
    replicated = jax.sharding.PartitionSpec()
    body = functools.partial(norm_forward_and_grads, kind)
    n = len(params)
    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=(x_spec, x_spec, *[replicated] * n),
        out_specs=(x_spec, x_spec, *[replicated] * n), check_vma=check_vma,
    )  # fmt: skip
    args = (jax.device_put(x, NamedSharding(mesh, x_spec)),
            jax.device_put(ct, NamedSharding(mesh, x_spec)),
            *[jax.device_put(p, NamedSharding(mesh, replicated)) for p in params])  # fmt: skip
    got = jax.jit(sharded)(*args)
    want = jax.jit(body)(x, ct, *params)  # unsharded: one device, the whole sequence
    return [np.asarray(a, np.float64) for a in got], [np.asarray(a, np.float64) for a in want]


def plus(a: Bounded, b: Bounded) -> Bounded:
    """``a + b`` in float32 (broadcasting)."""
    v = a.v + b.v
    e = a.e + b.e
    return Bounded(v, e + EPS * (np.abs(v) + e))


def times(a: Bounded, b: Bounded) -> Bounded:
    """``a · b`` in float32 (broadcasting)."""
    return Bounded(a.v * b.v, a.e * np.abs(b.v) + a.mag * b.e + EPS * a.mag * b.mag)


def row_sum(a: Bounded) -> Bounded:
    """A float32 sum over the last dim, keeping it (size 1)."""
    n = a.v.shape[-1]
    s = a.v.sum(-1, keepdims=True)
    return Bounded(s, a.e.sum(-1, keepdims=True) + (n + 1) * EPS * a.mag.sum(-1, keepdims=True))


def row_mean(a: Bounded) -> Bounded:
    return scaled(row_sum(a), 1.0 / a.v.shape[-1])


def rsqrt_and_slope(t: Bounded) -> tuple[Bounded, Bounded]:
    """``t^(−1/2)`` and ``t^(−3/2)`` (``rsqrt(t)/t``, its derivative's factor) in float32:
    both decrease, so the worst perturbation is at ``t − e``; XLA:CPU's rsqrt was measured
    within 1.7 ulps, we allow 2 (2·eps), and the division one more rounding."""
    low = t.v - t.e
    assert np.all(low > 0), "rsqrt of a value the bound cannot keep positive"
    r = t.v**-0.5
    r_e = (low**-0.5 - r) + 2 * EPS * low**-0.5
    slope = t.v**-1.5
    slope_e = (low**-1.5 - slope) + 3 * EPS * low**-1.5
    return Bounded(r, r_e), Bounded(slope, slope_e)


def norm_reference(kind, x, ct, params, precision, eps) -> dict[str, Bounded]:
    """Exact (float64) ``y`` and gradients of ``sum(ct · norm(x))``, each with its bound: the
    rules above applied to the kernel's float32 operations in the order autodiff runs them
    (rsqrt's derivative is ``−½·rsqrt(t)/t``, square's ``2x``, mean's transpose ``g/D``)."""
    compute, param = precision.compute_dtype, precision.param_dtype
    xs, g = exact(x), exact(ct)
    p = [exact(a) for a in params]
    d = x.shape[-1]
    if kind == "layer_norm":
        mean = row_mean(xs)
        c = plus(xs, Bounded(-mean.v, mean.e))  # x − mean
    else:
        c = xs
    t = plus(row_mean(times(c, c)), exact(np.float32(eps)))  # var (or mean square) + eps
    r, slope = rsqrt_and_slope(t)
    x_hat = times(c, r)
    y = times(x_hat, p[0])
    if kind == "layer_norm":
        y = plus(y, p[1])
    out = {"y": rounded(y, compute), "scale": rounded(total(times(g, x_hat), (0, 1)), param)}
    if kind == "layer_norm":
        out["bias"] = rounded(total(g, (0, 1)), param)
    # Backward, as autodiff runs it.
    g_hat = times(g, p[0])
    g_c = times(g_hat, r)
    g_t = scaled(times(row_sum(times(g_hat, c)), slope), 0.5)  # −½·Σ(g_hat·c)·t^(−3/2), sign
    g_t = Bounded(-g_t.v, g_t.e)
    g_sq = scaled(g_t, 1.0 / d)  # mean's transpose
    g_c = plus(g_c, scaled(times(g_sq, c), 2.0))  # square's derivative 2c
    if kind == "layer_norm":
        g_mean = scaled(row_sum(g_c), 1.0 / d)
        g_c = plus(g_c, Bounded(-g_mean.v, g_mean.e))
    out["x"] = rounded(g_c, compute)
    return out


def check_sequence_parallel_norm(kind, mesh_shape, precision, *, check_vma=True, seed=0,
                                 batch=8, seq=16, d=32, tiled_over=1):  # fmt: skip
    """Assert the norm inside a ``shard_map`` over ``x[B_data, S_model, D]`` (params ``P()``),
    and the same body unsharded, both equal the float64 reference within its bound: ``y``,
    ``dx`` and the parameter gradients (summed over every row of every device); and that every
    sum in its jaxpr, forward and backward, runs in float32."""
    eps = 1e-5 if kind == "layer_norm" else 1e-6  # the functions' defaults
    x, ct, params = norm_inputs(np.random.default_rng(seed), kind, batch, seq, d, precision,
                                tiled_over=tiled_over)  # fmt: skip
    got, unsharded = sequence_parallel_norm(kind, mesh_shape, x, ct, params, check_vma=check_vma)
    ref = norm_reference(kind, x, ct, params, precision, eps)
    names = ("y", "x", *NORM_PARAMS[kind])
    for run, values in (("sharded", got), ("unsharded", unsharded)):
        for name, have in zip(names, values, strict=True):
            want = ref[name]
            err = np.abs(have - want.v)
            ratio = float(np.max(ratio_to_bound(have, want)))
            assert ratio <= 1.0, (
                f"{'d' if name != 'y' else ''}{name} of {run} {kind} on {mesh_shape} "
                f"(check_vma={check_vma}) under {precision.name}: max |err| = {err.max():.3e}, "
                f"{ratio:.3g}× the bound"
            )
            NORM_WORST[kind] = max(NORM_WORST.get(kind, 0.0), ratio)
    sums = dtype_flow(functools.partial(norm_forward_and_grads, kind), x, ct, *params)
    assert sums and all(d == np.float32 for _, ins, *_ in sums for d in ins), (
        f"{kind}: statistics and gradient sums must run in float32: {[s[:2] for s in sums]}"
    )
