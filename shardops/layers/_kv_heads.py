"""Grouped-query attention's bookkeeping: which KV heads a device holds and which one each of
its query heads reads (Hugging Face's ``repeat_kv``: query head ``j`` reads KV head ``j //
(H/KV)``). Local: no communication."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def kv_cache_heads(num_heads: int, num_kv_heads: int, axis_size: int) -> int:
    """KV heads a device projects, and caches when decoding, under head parallelism over
    ``axis_size`` devices: ``KV/p`` when ``p`` divides KV (K/V split by KV head), else the
    longest run of KV heads a device's query heads read (K/V replicated; 1 when KV divides
    p). The decoding cache holds ``[B, that, S_max, hd]`` per device and layer."""
    if num_kv_heads % axis_size == 0:
        return num_kv_heads // axis_size
    local, group = num_heads // axis_size, num_heads // num_kv_heads
    return max(((i + 1) * local - 1) // group - (i * local) // group + 1
               for i in range(axis_size))  # fmt: skip


class KvHeads(NamedTuple):
    """Which KV heads a device projects and which one each of its query heads reads."""

    count: int
    """KV heads this device projects."""
    index: jax.Array | None
    """``index[H_local]``: the local KV head of each local query head (a traced array) where
    K/V are replicated and this device reads more than one KV head (the run need not align
    with the grouping: H = 6, KV = 2 on 3 devices gives device 1 the query heads 2, 3 of KV
    heads 0, 1); None where every local query head reads local KV head ``j // (H_local /
    count)`` (K/V split by KV head, or one KV head per device)."""


def for_query_heads(t, kv: KvHeads, heads: int):
    """``t[B, n, S, hd]`` (the KV heads) → ``[B, H/p, S, hd]``, the KV head of each query head;
    the backward sums each KV head's cotangent over its query heads (in ``t``'s dtype)."""
    n = t.shape[1]
    if kv.index is not None:  # replicated K/V: each query head's own KV head, by index
        return jnp.take(t, kv.index, axis=1)
    if n == heads:
        return t
    return jnp.repeat(t, heads // n, axis=1)  # contiguous groups: query head j reads j // g
