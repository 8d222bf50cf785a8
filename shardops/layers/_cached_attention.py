"""Decoding: causal head-parallel attention of new tokens against a KV cache, on local blocks.

The projections, the KV heads each device holds and the output projection are the training
kernel's (``shardops.layers._attention``); the attention reads the cache in place, block by
block (``_flash.cache_attention``), or with ``implementation="einsum"`` scores every cached
key at once (the reference). One forward AllReduce of the output over ``model``; the cache
never moves.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from shardops._axes import MODEL_AXIS
from shardops._precision import FLOAT32, Precision
from shardops.comm._collectives import all_reduce
from shardops.layers import (
    _attention,
    _attention_arguments,
    _attention_core,
    _attention_reference,
    _flash,
    _kv_heads,
    _masks,
    _rope,
)
from shardops.layers._common import bound_axis_size, scoped


@scoped("cached_attention")
def cached_attention_kernel(
    x,
    params,
    cache,
    start,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    rope_theta: float | None = None,
    axis_name: str = MODEL_AXIS,
    precision: Precision = FLOAT32,
    implementation: str = "auto",
):
    """Causal head-parallel attention of new tokens against a KV cache (decoding), on local
    blocks: ``x[B, s, D]`` at positions ``start … start+s−1`` → ``y[B, s, D]`` and the cache
    with their keys and values written in.

    The prompt's prefill is one call (``start`` = 0, ``s`` = its length), each generated token
    another (``s`` = 1). Every row of the batch is at the same position.

    Arguments (``p`` = size of ``axis_name``):
        x: ``x[B, s, D]`` replicated over ``axis_name``.
        params: as ``head_parallel_attention_kernel``'s (``wk``, ``wv`` split by KV head or
            replicated; biases optional).
        cache: ``(k, v)``, each ``[B, n, S_max, hd]`` in ``precision.compute_dtype`` with
            ``n = kv_cache_heads(H, KV, p)``: this device's KV heads (the ones its query heads
            read; where K/V are replicated, devices that read the same KV head each cache it).
            Positions ``≥ start`` are overwritten or masked (finite values: see ``start``).
        start: int32 scalar (may be traced), the position of ``x``'s first token; rotary
            positions continue from it. ``start + s ≤ S_max``: the caller checks it
            (``lax.dynamic_update_slice`` would clamp a write past the end). Positions
            ``≥ start + s`` must hold finite values (``init_cache``'s zeros, or earlier
            steps'): they are masked, but a masked NaN key or value still makes a NaN.
        implementation: ``"einsum"`` scores ``[B, H/p, s, S_max]`` at once; any other
            (``"auto"``, ``"blocked"``, ``"splash"``) runs the blocked online softmax over
            the written part of the cache in place, in blocks of ``BLOCK_K`` (splash has no
            one-query kernel).

    Returns:
        ``(y, (k, v))``: ``y[B, s, D]`` in ``precision.compute_dtype`` replicated over
        ``axis_name``, and the cache with positions ``start … start+s−1`` written.

    Communication over ``axis_name``: one AllReduce ``y[B, s, D]{U_model} → y`` in
    ``accum_dtype``, as the training kernel's forward; nothing else (the cache never moves).
    """
    op = "cached_attention_kernel"
    _attention_core.check_implementation(op, implementation)
    p = bound_axis_size(axis_name, op)
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    heads, head_dim, shared = _attention_arguments.check_local(op, x, params, num_heads,
                                                               kv_heads, p, axis_name,
                                                               False)  # fmt: skip
    _rope.check_rope(op, rope_theta, head_dim)
    k_cache, v_cache = cache
    batch, seq, _ = x.shape
    _check_cache(op, k_cache, v_cache, batch, head_dim, num_heads, kv_heads, p, precision)
    accum = precision.accum_dtype
    x = x.astype(accum)  # replicated over model: no region entry is needed without a backward
    if shared:
        params, kv = _attention.shared_kv_heads(
            params, num_heads, kv_heads, p, head_dim, axis_name, accum
        )
    else:
        kv = _kv_heads.KvHeads(kv_heads // p, None)
    q, k, v = _attention.projections(
        x, params, heads, kv.count, precision
    )  # q[B, H/p, s, hd], k, v
    positions = start + jnp.arange(seq, dtype=jnp.int32)  # [s]: the tokens' global positions
    if rope_theta is not None:
        cos, sin = _rope.rotation(positions[None], seq, head_dim, rope_theta)  # [1, 1, s, hd/2]
        q, k = _rope.rotate(q, cos, sin), _rope.rotate(k, cos, sin)
    compute = precision.compute_dtype
    at = (0, 0, start, 0)
    k_cache = lax.dynamic_update_slice(k_cache, k.astype(compute), at)  # [B, n, S_max, hd]
    v_cache = lax.dynamic_update_slice(v_cache, v.astype(compute), at)
    o = _attention_over_cache(  # o[B, H/p, s, hd] in accum
        q, k_cache, v_cache, kv, heads, positions, start, seq, implementation, precision
    )
    o = o.transpose(0, 2, 1, 3)  # o[B, s, H/p, hd] in accum
    y_partial = precision.matmul(o.reshape(batch, seq, heads * head_dim), params["wo"])
    y = all_reduce(y_partial, axis_name, reason=_attention.PARTIAL_SUMS)  # y[B, s, D] in accum
    return precision.finish(y, params.get("bo")), (k_cache, v_cache)


def _check_cache(
    op: str,
    k_cache,
    v_cache,
    batch: int,
    head_dim: int,
    num_heads: int,
    kv_heads: int,
    p: int,
    precision: Precision,
) -> None:
    """Each of ``(k, v)`` must be ``[B, n, S_max, hd]`` in ``precision.compute_dtype``, with
    ``n = kv_cache_heads(H, KV, p)`` (the KV heads this device's query heads read)."""
    want = (batch, _kv_heads.kv_cache_heads(num_heads, kv_heads, p), k_cache.shape[2], head_dim)
    for name, c in (("k", k_cache), ("v", v_cache)):
        if tuple(c.shape) != want or c.dtype != np.dtype(precision.compute_dtype):
            raise ValueError(
                f"{op}: the {name} cache must be [B, n, S_max, hd] = {want} in "
                f"{np.dtype(precision.compute_dtype)} (n = kv_cache_heads({num_heads}, "
                f"{kv_heads}, {p})); got {c.dtype}{tuple(c.shape)}"
            )


def _attention_over_cache(
    q,
    k_cache,
    v_cache,
    kv,
    heads: int,
    positions,
    start,
    seq: int,
    implementation: str,
    precision: Precision,
):
    """Causal attention of ``q[B, H/p, s, hd]`` at ``positions`` (``start … start+s−1``) over
    the cache ``[B, n, S_max, hd]`` just written: ``o[B, H/p, s, hd]`` in ``accum_dtype``.

    ``implementation="einsum"`` scores ``[B, H/p, s, S_max]`` at once (the reference); any other
    runs the blocked online softmax over the first ``start + s`` positions, in place. ``kv``
    says which cached KV head each query head reads.
    """
    size = k_cache.shape[2]
    if implementation != "einsum":  # blocks of the cache, never [s, S_max] at once
        keys, values = k_cache, v_cache  # [B, n, S_max, hd]
        if kv.index is not None:  # replicated K/V read by index: each query head's own
            keys, values = (
                _kv_heads.for_query_heads(keys, kv, heads),
                _kv_heads.for_query_heads(values, kv, heads),
            )
        o = _flash.cache_attention(q, keys, values, q_positions=positions, length=start + seq,
                                   block_k=_attention_core.BLOCK_K,
                                   precision=precision)  # fmt: skip
    else:  # the reference: scores [B, H/p, s, S_max] at once
        keys = _kv_heads.for_query_heads(k_cache, kv, heads)  # [B, H/p, S_max, hd]
        values = _kv_heads.for_query_heads(v_cache, kv, heads)
        key_positions = jnp.arange(size)  # [S_max]
        visible = _masks.visible(positions, key_positions, None, None, True)  # [1, 1, s, S_max]
        o = _attention_reference.einsum_attention(q, keys, values, visible, precision)
    return o
