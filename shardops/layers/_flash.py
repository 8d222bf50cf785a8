"""Blocked online-softmax attention (FlashAttention-2 in plain JAX): never builds S×S scores.

    q[B, H, S, hd], k[B, n, S, hd], v[B, n, S, hd] → o[B, H, S, hd] = softmax(q·kᵀ/√hd + mask)·v

The keys are visited in blocks of ``block_k`` (a ``lax.scan``), all queries at once. Each step
scores one block, ``s[B, n, g, S, block_k]``, and folds it into a running maximum ``m``, a
running sum ``l`` and an accumulator ``acc`` (the online softmax, rescaling both by
``exp(m_old − m_new)`` whenever the maximum grows). The backward (a custom VJP) recomputes each
block's probabilities from the saved log-sum-exp ``lse = m + log l`` and follows
FlashAttention-2: ``D = rowsum(dO∘O)``, ``dS = P∘(dP − D)/√hd``. No backend-specific code: it
runs wherever JAX does, and is the core a Pallas kernel is checked against.

Grouped-query attention (``H = n·g``): query head ``j`` reads KV head ``j // g``. The queries are
viewed as ``q[B, n, g, S, hd]`` instead of repeating K and V, so ``dk`` and ``dv`` come out
already summed over each KV head's ``g`` query heads.

Precision (``shardops._precision``): like the einsum attention, every product multiplies
compute-dtype operands and accumulates in ``accum_dtype`` (``q``, ``k``, ``v``, the block's
probabilities, ``dO`` and ``dS`` are rounded to the compute dtype where a product reads them);
scores, masks, ``m``, ``l``, ``lse`` and ``D`` are float32.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardops._precision import FLOAT32, Precision

# A masked score: finite, so that a row whose every key so far is masked gives exp(0) (then
# zeroed by the mask) rather than exp(−inf − (−inf)) = NaN.
_MASKED = -0.7 * float(np.finfo(np.float32).max)


def blocked_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    segment_ids=None,
    block_k: int = 512,
    precision: Precision = FLOAT32,
):
    """Softmax attention over key blocks (online softmax), never materialising the S×S scores.

    Computes ``o = softmax(q·kᵀ/√hd, masked)·v`` per head: a query ``i`` sees key ``j`` when
    ``j ≤ i`` (``causal``) and ``segment_ids[b, j] == segment_ids[b, i]`` (packed sequences).

    Memory: the keys are scanned in blocks, so the forward and the backward hold one score
    block ``[B, n, H/n, S, block_k]`` at a time: ``O(S·block_k)`` per head, not ``O(S²)``. The
    backward's residuals are ``q``, ``k``, ``v`` (in the compute dtype), ``o`` and the per-row
    log-sum-exp ``lse[B, H, S]`` (float32), not the probabilities: each block's probabilities
    are recomputed from ``lse``.

    Arguments:
        q: the queries, shape ``(B, H, S, hd)``.
        k: the keys, shape ``(B, n, S, hd)`` with ``H % n == 0`` (grouped-query: query head
            ``j`` reads KV head ``j // (H/n)``; ``n = 1`` is multi-query).
        v: the values, shape ``(B, n, S, hd)``.
        causal: mask keys after each query.
        segment_ids: optional integer ``(B, S)``: a query sees only keys of its own segment.
            No gradient flows to it.
        block_k: keys per block (clipped to ``S``); when it does not divide ``S`` the keys are
            padded with masked positions.
        precision: products in ``compute_dtype``, accumulated in ``accum_dtype``.

    Returns:
        ``o`` of shape ``(B, H, S, hd)`` in ``precision.accum_dtype``. Gradients come back in
        the dtypes of ``q``, ``k`` and ``v``.
    """
    _check(q, k, v, segment_ids, block_k, precision)
    block = min(int(block_k), q.shape[2])
    with jax.named_scope("shardops.blocked_attention"):
        return _blocked(bool(causal), block, precision, q, k, v, segment_ids)


def _check(q, k, v, segment_ids, block_k, precision) -> None:
    """Shapes, head counts and ``block_k``, before anything is traced."""
    if isinstance(block_k, bool) or not isinstance(block_k, numbers.Integral) or block_k < 1:
        raise ValueError(
            f"block_k={block_k!r} must be an integer ≥ 1 (the number of keys per block); "
            f"pass e.g. block_k=512, or block_k=S for a single block."
        )
    if not isinstance(precision, Precision):
        raise TypeError(
            f"precision={precision!r} is not a Precision; pass shardops.FLOAT32, "
            f"shardops.MIXED_BFLOAT16 or shardops.BFLOAT16."
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if np.ndim(t) != 4:
            raise ValueError(
                f"{name} has shape {np.shape(t)} but must be 4-D ({name}[B, heads, S, hd]); "
                f"reshape [B, S, heads, hd] with .transpose(0, 2, 1, 3)."
            )
    (b, h, s, hd), kv_shape = q.shape, k.shape
    if k.shape != v.shape or (kv_shape[0], kv_shape[2], kv_shape[3]) != (b, s, hd):
        raise ValueError(
            f"k{tuple(k.shape)} and v{tuple(v.shape)} must both be [B, n, S, hd] = "
            f"[{b}, n, {s}, {hd}] to match q{tuple(q.shape)}; pass keys and values of the "
            f"same batch, sequence and head dim as the queries."
        )
    if h % kv_shape[1]:
        raise ValueError(
            f"q has H={h} heads but k, v have n={kv_shape[1]}, which does not divide it; "
            f"grouped-query attention needs H % n == 0 (pick n among the divisors of {h})."
        )
    if segment_ids is not None and np.shape(segment_ids) != (b, s):
        raise ValueError(
            f"segment_ids has shape {np.shape(segment_ids)} but must be [B, S] = [{b}, {s}]; "
            f"pass one segment id per token of q."
        )


def _product(spec: str, a, b, precision: Precision):
    """``einsum(spec, a, b)`` of compute-dtype operands, accumulated and returned in accum."""
    return jnp.einsum(
        spec,
        a.astype(precision.compute_dtype),
        b.astype(precision.compute_dtype),
        preferred_element_type=precision.accum_dtype,
        precision=precision.matmul_precision,
    )


def _key_blocks(k, v, segment_ids, block: int):
    """The keys as ``num_blocks`` blocks for ``lax.scan``: ``k, v[nb, B, n, block, hd]``, key
    positions ``[nb, block]`` (those ≥ S are padding) and segment ids ``[nb, B, block]``."""
    batch, n, seq, hd = k.shape
    blocks = -(-seq // block)
    pad = blocks * block - seq
    if pad:
        k, v = (jnp.pad(t, ((0, 0), (0, 0), (0, pad), (0, 0))) for t in (k, v))
    k, v = (t.reshape(batch, n, blocks, block, hd).transpose(2, 0, 1, 3, 4) for t in (k, v))
    positions = jnp.arange(blocks * block).reshape(blocks, block)  # [nb, block]
    segments = None
    if segment_ids is not None:
        segments = jnp.pad(segment_ids, ((0, 0), (0, pad)))  # [B, S + pad]
        segments = segments.reshape(batch, blocks, block).transpose(1, 0, 2)  # [nb, B, block]
    return k, v, positions, segments


def _visible(seq: int, causal: bool, key_positions, q_segments, k_segments):
    """``visible[B or 1, 1, 1, S, block]``: the keys of one block each query may attend to."""
    q_positions = jnp.arange(seq)  # [S]
    visible = jnp.broadcast_to(key_positions[None, :] < seq, (seq, key_positions.shape[0]))
    if causal:
        visible = visible & (key_positions[None, :] <= q_positions[:, None])  # key j ≤ query i
    visible = visible[None, None, None]  # [1, 1, 1, S, block]
    if q_segments is not None:
        same = q_segments[:, :, None] == k_segments[:, None, :]  # [B, S, block]
        visible = visible & same[:, None, None]  # [B, 1, 1, S, block]
    return visible


def _scores(q, k_block, visible, precision):
    """``s[B, n, g, S, block]`` in float32: ``q·kᵀ/√hd``, masked scores set to ``_MASKED``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = _product("bngqd,bnkd->bngqk", q, k_block, precision) * scale  # [B, n, g, S, block]
    return jnp.where(visible, s.astype(jnp.float32), _MASKED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _blocked(causal, block, precision, q, k, v, segment_ids):
    return _forward(causal, block, precision, q, k, v, segment_ids)[0]


def _forward(causal, block, precision, q, k, v, segment_ids):
    """``o[B, H, S, hd]`` in accum and ``lse[B, n, g, S]`` in float32."""
    batch, heads, seq, hd = q.shape
    n = k.shape[1]
    qg = q.astype(precision.compute_dtype).reshape(batch, n, heads // n, seq, hd)  # [B,n,g,S,hd]
    xs = _key_blocks(k, v, segment_ids, block)

    def step(carry, x):
        m, total, acc = carry  # m, total[B, n, g, S] float32; acc[B, n, g, S, hd] in accum
        k_block, v_block, key_positions, k_segments = x  # k, v[B, n, block, hd]
        visible = _visible(seq, causal, key_positions, segment_ids, k_segments)
        s = _scores(qg, k_block, visible, precision)  # s[B, n, g, S, block] float32
        m_new = jnp.maximum(m, s.max(axis=-1))  # [B, n, g, S]
        alpha = jnp.exp(m - m_new)  # [B, n, g, S]: rescales what was summed under the old max
        p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)  # [B, n, g, S, block]
        total = alpha * total + p.sum(axis=-1)  # [B, n, g, S]: the running sum l
        acc = alpha[..., None] * acc  # [B, n, g, S, hd]: the running-max rescale
        acc = acc + _product("bngqk,bnkd->bngqd", p, v_block, precision)  # [B, n, g, S, hd]
        return (m_new, total, acc), None

    shape = (batch, n, heads // n, seq)
    init = (
        jnp.full(shape, _MASKED, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, hd), precision.accum_dtype),
    )
    (m, total, acc), _ = lax.scan(step, init, xs)
    seen = total > 0  # [B, n, g, S]: False where a query sees no key at all (its o is 0)
    o = acc / jnp.where(seen, total, 1.0)[..., None]  # [B, n, g, S, hd] in accum
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), _MASKED)  # [B, n, g, S]
    return o.reshape(batch, heads, seq, hd), lse


def _blocked_fwd(causal, block, precision, q, k, v, segment_ids):
    o, lse = _forward(causal, block, precision, q, k, v, segment_ids)
    compute = precision.compute_dtype
    # Empty slices of q, k and v carry their dtypes (and varying mesh axes) into the backward.
    kinds = tuple(t.reshape(-1)[:0] for t in (q, k, v))
    residuals = (q.astype(compute), k.astype(compute), v.astype(compute), o, lse, segment_ids)
    return o, (residuals, kinds)


def _blocked_bwd(causal, block, precision, saved, do):
    (q, k, v, o, lse, segment_ids), kinds = saved
    batch, heads, seq, hd = q.shape
    n, g = k.shape[1], heads // k.shape[1]
    scale = 1.0 / math.sqrt(hd)
    qg = q.reshape(batch, n, g, seq, hd)  # [B, n, g, S, hd] in compute
    dog = do.reshape(batch, n, g, seq, hd)  # dO[B, n, g, S, hd]
    delta = (dog.astype(jnp.float32) * o.reshape(dog.shape).astype(jnp.float32)).sum(-1)
    # delta = D[B, n, g, S] = rowsum(dO∘O), float32
    xs = _key_blocks(k, v, segment_ids, block)

    def step(dq, x):
        k_block, v_block, key_positions, k_segments = x  # k, v[B, n, block, hd]
        visible = _visible(seq, causal, key_positions, segment_ids, k_segments)
        s = _scores(qg, k_block, visible, precision)  # [B, n, g, S, block] float32
        p = jnp.where(visible, jnp.exp(s - lse[..., None]), 0.0)  # P, recomputed from lse
        dv_block = _product("bngqk,bngqd->bnkd", p, dog, precision)  # dv[B, n, block, hd]
        dp = _product("bngqd,bnkd->bngqk", dog, v_block, precision)  # dP[B, n, g, S, block]
        ds = p * (dp - delta[..., None]) * scale  # dS[B, n, g, S, block] float32
        dq = dq + _product("bngqk,bnkd->bngqd", ds, k_block, precision)  # [B, n, g, S, hd]
        dk_block = _product("bngqk,bngqd->bnkd", ds, qg, precision)  # dk[B, n, block, hd]
        return dq, (dk_block, dv_block)  # dk, dv: summed over the g query heads of a KV head

    dq0 = jnp.zeros((batch, n, g, seq, hd), precision.accum_dtype)
    dq, (dk, dv) = lax.scan(step, dq0, xs)  # dk, dv[nb, B, n, block, hd]
    dk, dv = (t.transpose(1, 2, 0, 3, 4).reshape(batch, n, -1, hd)[:, :, :seq] for t in (dk, dv))
    q_kind, k_kind, v_kind = kinds
    dq = dq.reshape(batch, heads, seq, hd)
    return dq.astype(q_kind.dtype), dk.astype(k_kind.dtype), dv.astype(v_kind.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
