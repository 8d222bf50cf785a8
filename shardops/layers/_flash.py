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

from shardops._mesh import varying_axes
from shardops._precision import FLOAT32, Precision, _reduce_to

# A masked score: finite, so that a row whose every key so far is masked gives exp(0) (then
# zeroed by the mask) rather than exp(−inf − (−inf)) = NaN.
MASKED = -0.7 * float(np.finfo(np.float32).max)


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
    positions = jnp.arange(q.shape[2], dtype=jnp.int32)  # [S]: the causal mask's order
    return attend(
        q,
        k,
        v,
        q_positions=positions,
        k_positions=positions,
        q_segments=segment_ids,
        k_segments=segment_ids,
        causal=causal,
        block_k=block_k,
        precision=precision,
    )


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


def _vary(x, *refs):
    """``x`` varying over every mesh axis any of ``refs`` varies over (a loop carry built from
    constants inside ``shard_map`` must have the type of what the loop adds to it)."""
    axes = frozenset().union(*(varying_axes(r) for r in refs if r is not None))
    axes = tuple(sorted(axes - varying_axes(x)))
    return lax.pcast(x, axes, to="varying") if axes else x


def _key_blocks(k, v, k_positions, k_segments, block: int):
    """The keys as ``nb`` blocks for ``lax.scan``: ``k, v[nb, B, n, block, hd]``, their
    positions ``[nb, block]``, whether each is a real key (not padding) ``[nb, block]`` and
    their segment ids ``[nb, B, block]`` (or None)."""
    batch, n, seq, hd = k.shape
    blocks = -(-seq // block)
    pad = blocks * block - seq
    if pad:
        k, v = (jnp.pad(t, ((0, 0), (0, 0), (0, pad), (0, 0))) for t in (k, v))
        k_positions = jnp.pad(k_positions, (0, pad))
        if k_segments is not None:
            k_segments = jnp.pad(k_segments, ((0, 0), (0, pad)))
    k, v = (t.reshape(batch, n, blocks, block, hd).transpose(2, 0, 1, 3, 4) for t in (k, v))
    real = (np.arange(blocks * block) < seq).reshape(blocks, block)  # [nb, block]
    segments = None
    if k_segments is not None:
        segments = k_segments.reshape(batch, blocks, block).transpose(1, 0, 2)  # [nb, B, block]
    return k, v, k_positions.reshape(blocks, block), jnp.asarray(real), segments


def _visible(causal: bool, q_positions, key_positions, real, q_segments, k_segments):
    """``visible[B or 1, 1, 1, Sq, block]``: the keys of one block each query may attend to."""
    visible = jnp.broadcast_to(real[None, :], (q_positions.shape[0], real.shape[0]))
    if causal:
        visible = visible & (key_positions[None, :] <= q_positions[:, None])  # key j ≤ query i
    visible = visible[None, None, None]  # [1, 1, 1, Sq, block]
    if q_segments is not None:
        same = q_segments[:, :, None] == k_segments[:, None, :]  # [B, Sq, block]
        visible = visible & same[:, None, None]  # [B, 1, 1, Sq, block]
    return visible


def _scores(q, k_block, visible, precision):
    """``s[B, n, g, Sq, block]`` in float32: ``q·kᵀ/√hd``, masked scores set to ``MASKED``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = _product("bngqd,bnkd->bngqk", q, k_block, precision) * scale  # [B, n, g, Sq, block]
    return jnp.where(visible, s.astype(jnp.float32), MASKED)


def attention_with_lse(q, k, v, *, q_positions, k_positions, q_segments=None, k_segments=None,
                       causal: bool, block_k: int, precision: Precision):  # fmt: skip
    """The forward alone, on any queries and keys: ``(o, lse)`` with ``o[B, H, Sq, hd]`` in
    accum and ``lse[B, H, Sq]`` (float32; ``MASKED`` where a query sees no key, its ``o`` 0).

    ``q[B, H, Sq, hd]``, ``k, v[B, n, Sk, hd]``; ``q_positions[Sq]``, ``k_positions[Sk]``:
    integer positions for the causal mask (key visible when its position ≤ the query's);
    ``q_segments[B, Sq]``, ``k_segments[B, Sk]``: both or neither. No VJP: ring attention
    uses it (it merges its steps with ``merge`` and has its own backward, ``attention_backward``;
    decoding reads its cache with ``cache_attention``)."""
    block = min(int(block_k), k.shape[2])
    return _forward(bool(causal), block, precision, q, k, v, q_positions, k_positions,
                    q_segments, k_segments)  # fmt: skip


def merge(o_a, lse_a, o_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys → the attention over both:
    ``o = o_a·e^(lse_a − lse) + o_b·e^(lse_b − lse)``, ``lse = log(e^lse_a + e^lse_b)``."""
    lse = jnp.logaddexp(lse_a, lse_b)  # [..., Sq]
    o = o_a * jnp.exp(lse_a - lse)[..., None] + o_b * jnp.exp(lse_b - lse)[..., None]
    return o, lse


def attention_backward(q, k, v, do, lse, delta, *, q_positions, k_positions, q_segments=None,
                       k_segments=None, causal: bool, block_k: int, precision: Precision):  # fmt: skip
    """``(dq, dk, dv)`` in accum of the attention of ``q`` over ``k, v`` given the cotangent
    ``do[B, H, Sq, hd]``, the *whole* attention's ``lse[B, H, Sq]`` and ``delta[B, H, Sq] =
    rowsum(dO∘O)`` (float32): the keys may be one part of what the queries attended to (a ring
    step). ``dk``, ``dv`` are summed over each KV head's query heads."""
    block = min(int(block_k), k.shape[2])
    return _backward(bool(causal), block, precision, q, k, v, do, lse, delta, q_positions,
                     k_positions, q_segments, k_segments)  # fmt: skip


def attend(q, k, v, *, q_positions, k_positions, q_segments=None, k_segments=None,
           causal: bool = False, block_k: int = 512, precision: Precision = FLOAT32):  # fmt: skip
    """``blocked_attention`` on any queries and keys (``attention_with_lse``'s arguments), with
    its custom VJP: ``o[B, H, Sq, hd]`` in accum. The kernels call it with the tokens' global
    positions (context parallelism, decoding)."""
    block = min(int(block_k), k.shape[2])
    with jax.named_scope("shardops.blocked_attention"):
        return _attend(bool(causal), block, precision, q, k, v, q_positions, k_positions,
                       q_segments, k_segments)  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attend(causal, block, precision, q, k, v, q_positions, k_positions, q_segments, k_segments):
    return _forward(causal, block, precision, q, k, v, q_positions, k_positions, q_segments,
                    k_segments)[0]  # fmt: skip


def _forward(causal, block, precision, q, k, v, q_positions, k_positions, q_segments,
             k_segments):  # fmt: skip
    """``o[B, H, Sq, hd]`` in accum and ``lse[B, H, Sq]`` in float32."""
    batch, heads, seq, hd = q.shape
    n = k.shape[1]
    qg = q.astype(precision.compute_dtype).reshape(batch, n, heads // n, seq, hd)  # [B,n,g,S,hd]
    xs = _key_blocks(k, v, k_positions, k_segments, block)

    def step(carry, x):
        k_block, v_block, key_positions, real, segments = x  # k, v[B, n, block, hd]
        visible = _visible(causal, q_positions, key_positions, real, q_segments, segments)
        return _fold(carry, qg, k_block, v_block, visible, precision), None

    init = _start(qg, precision, q, k, v, q_positions, k_positions, q_segments, k_segments)
    carry, _ = _scan(step, init, xs)
    return _finish(carry, q.shape)


def _scan(step, init, xs):
    """``lax.scan(step, init, xs)`` over the key blocks; one block (S ≤ block_k) runs the step
    once, without a loop, which XLA fuses and schedules as freely as the einsum's ops."""
    if jax.tree.leaves(xs)[0].shape[0] == 1:
        carry, y = step(init, jax.tree.map(lambda t: t[0], xs))
        return carry, jax.tree.map(lambda t: t[None], y)
    return lax.scan(step, init, xs)


def _start(qg, precision: Precision, *refs):
    """The online softmax's carry before any key: the running max ``m`` (``MASKED``), the sum
    ``l`` (0), both ``[B, n, g, Sq]`` float32, and ``acc[B, n, g, Sq, hd]`` (0) in accum, typed
    as varying over every mesh axis ``refs`` vary over."""
    shape = qg.shape[:-1]
    return (
        _vary(jnp.full(shape, MASKED, jnp.float32), *refs),
        _vary(jnp.zeros(shape, jnp.float32), *refs),
        _vary(jnp.zeros(qg.shape, precision.accum_dtype), *refs),
    )


def _fold(carry, qg, k_block, v_block, visible, precision: Precision):
    """One key block folded into the online softmax's carry ``(m, l, acc)``."""
    m, total, acc = carry  # m, total[B, n, g, Sq] float32; acc[B, n, g, Sq, hd] in accum
    s = _scores(qg, k_block, visible, precision)  # s[B, n, g, Sq, block] float32
    m_new = jnp.maximum(m, s.max(axis=-1))  # [B, n, g, Sq]
    alpha = jnp.exp(m - m_new)  # [B, n, g, Sq]: rescales what was summed under the old max
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)  # [B, n, g, Sq, block]
    total = alpha * total + p.sum(axis=-1)  # [B, n, g, Sq]: the running sum l
    acc = alpha[..., None] * acc  # [B, n, g, S, hd]: the running-max rescale
    acc = acc + _product("bngqk,bnkd->bngqd", p, v_block, precision)  # [B, n, g, Sq, hd]
    return m_new, total, acc


def _finish(carry, shape):
    """``o[B, H, Sq, hd]`` (0 where a query saw no key) and ``lse[B, H, Sq]`` of the carry."""
    m, total, acc = carry
    batch, heads, seq, hd = shape
    seen = total > 0  # [B, n, g, Sq]: False where a query sees no key at all (its o is 0)
    o = acc / jnp.where(seen, total, 1.0)[..., None]  # [B, n, g, Sq, hd] in accum
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), MASKED)  # [B, n, g, Sq]
    return o.reshape(batch, heads, seq, hd), lse.reshape(batch, heads, seq)


def cache_attention(q, k, v, *, q_positions, length, block_k: int, precision: Precision):
    """Causal attention of new queries over a decoding cache (forward only): ``o[B, H, s, hd]``
    in accum of ``q[B, H, s, hd]`` at positions ``q_positions[s]`` over ``k, v[B, n, S_max,
    hd]``, whose positions ``0 … length − 1`` are written (``length``: a traced int).

    The cache is read in place, block by block (``lax.dynamic_slice``: no relayout, no copy),
    and only the ``⌈length / block_k⌉`` blocks that hold written keys: a step's work grows with
    the position reached, not with ``S_max``. A last block that would run past ``S_max`` is
    clamped to end there, its keys already folded in masked."""
    batch, heads, seq, hd = q.shape
    n, size = k.shape[1], k.shape[2]
    block = min(int(block_k), size)
    qg = q.astype(precision.compute_dtype).reshape(batch, n, heads // n, seq, hd)
    offsets = jnp.arange(block, dtype=jnp.int32)  # [block]

    def body(i, carry):
        first = jnp.minimum(i * block, size - block)  # the block's first key (clamped at the end)
        k_block, v_block = (lax.dynamic_slice_in_dim(t, first, block, axis=2) for t in (k, v))
        key_positions = first + offsets  # [block]
        real = key_positions >= i * block  # a clamped block's keys already folded in: masked
        visible = _visible(True, q_positions, key_positions, real, None, None)
        return _fold(carry, qg, k_block, v_block, visible, precision)

    carry = _start(qg, precision, q, k, v, q_positions, length)
    carry = lax.fori_loop(0, (length + block - 1) // block, body, carry)
    return _finish(carry, q.shape)[0]


def _attend_fwd(causal, block, precision, q, k, v, q_positions, k_positions, q_segments,
                k_segments):  # fmt: skip
    o, lse = _forward(causal, block, precision, q, k, v, q_positions, k_positions, q_segments,
                      k_segments)  # fmt: skip
    compute = precision.compute_dtype
    # Empty slices of q, k and v carry their dtypes (and varying mesh axes) into the backward.
    kinds = tuple(t.reshape(-1)[:0] for t in (q, k, v))
    tokens = (q_positions, k_positions, q_segments, k_segments)
    residuals = (q.astype(compute), k.astype(compute), v.astype(compute), o, lse, tokens)
    return o, (residuals, kinds)


def _attend_bwd(causal, block, precision, saved, do):
    (q, k, v, o, lse, tokens), kinds = saved
    rounded = do.astype(precision.compute_dtype).astype(jnp.float32)  # dO as the products read it
    delta = (rounded * o.astype(jnp.float32)).sum(-1)  # D[B, H, Sq] = rowsum(dO∘O)
    dq, dk, dv = _backward(causal, block, precision, q, k, v, do, lse, delta, *tokens)
    grads = []
    for g, kind in zip((dq, dk, dv), kinds, strict=True):
        grads.append(_reduce_to(g, kind).astype(kind.dtype))  # an invariant primal: summed
    return (*grads, None, None, None, None)


def _backward(causal, block, precision, q, k, v, do, lse, delta, q_positions, k_positions,
              q_segments, k_segments):  # fmt: skip
    """``dq[B, H, Sq, hd]``, ``dk, dv[B, n, Sk, hd]`` in accum (module docstring)."""
    batch, heads, seq, hd = q.shape
    n, g, sk = k.shape[1], heads // k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(hd)
    qg = q.astype(precision.compute_dtype).reshape(batch, n, g, seq, hd)  # [B, n, g, Sq, hd]
    dog = do.reshape(batch, n, g, seq, hd)  # dO[B, n, g, Sq, hd]
    lse, delta = lse.reshape(batch, n, g, seq), delta.reshape(batch, n, g, seq)
    xs = _key_blocks(k, v, k_positions, k_segments, block)
    refs = (q, k, v, do, lse, delta, q_positions, k_positions, q_segments, k_segments)

    def step(dq, x):
        k_block, v_block, key_positions, real, segments = x  # k, v[B, n, block, hd]
        visible = _visible(causal, q_positions, key_positions, real, q_segments, segments)
        s = _scores(qg, k_block, visible, precision)  # [B, n, g, Sq, block] float32
        p = jnp.where(visible, jnp.exp(s - lse[..., None]), 0.0)  # P, recomputed from lse
        dv_block = _product("bngqk,bngqd->bnkd", p, dog, precision)  # dv[B, n, block, hd]
        dp = _product("bngqd,bnkd->bngqk", dog, v_block, precision)  # dP[B, n, g, Sq, block]
        ds = p * (dp - delta[..., None]) * scale  # dS[B, n, g, Sq, block] float32
        dq = dq + _product("bngqk,bnkd->bngqd", ds, k_block, precision)  # [B, n, g, Sq, hd]
        dk_block = _product("bngqk,bngqd->bnkd", ds, qg, precision)  # dk[B, n, block, hd]
        return dq, (dk_block, dv_block)  # dk, dv: summed over the g query heads of a KV head

    dq0 = _vary(jnp.zeros((batch, n, g, seq, hd), precision.accum_dtype), *refs)
    dq, (dk, dv) = _scan(step, dq0, xs)  # dk, dv[nb, B, n, block, hd]
    dk, dv = (t.transpose(1, 2, 0, 3, 4).reshape(batch, n, -1, hd)[:, :, :sk] for t in (dk, dv))
    return dq.reshape(batch, heads, seq, hd), dk, dv


_attend.defvjp(_attend_fwd, _attend_bwd)
