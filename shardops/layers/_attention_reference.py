"""The einsum reference of the attention core: the whole ``[B, H, S, S]`` scores and
probabilities in float32 (memory O(S²) per head), and the attention products with the dense
matmul's backward discipline (a custom VJP).

Precision (``shardops._precision``): every product, ``q·kᵀ`` and ``p·v``, multiplies
compute-dtype operands and accumulates in ``accum_dtype``, forward and backward: plain autodiff
of a bf16 ``einsum`` would accumulate its transposes in bf16. Scores, mask and softmax are
float32. Local: no communication.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from shardops._precision import Precision, _reduce_to


def einsum_attention(q, k, v, visible, precision: Precision):
    """The reference: ``o[B, H, Sq, hd]`` in accum of ``q[B, H, Sq, hd]`` over ``k, v[B, H, Sk,
    hd]`` (one KV head per query head: ``_kv_heads.for_query_heads``), from the whole
    ``[B, H, Sq, Sk]`` scores and probabilities in float32 (kept for the backward), masked by
    ``visible[B or 1, 1, Sq, Sk]`` (``_masks.visible``; None: every key)."""
    batch, heads, sq, head_dim = q.shape
    sk = k.shape[2]
    q = q.reshape(batch * heads, sq, head_dim)  # [B·H, Sq, hd]
    k, v = (t.reshape(batch * heads, sk, head_dim) for t in (k, v))  # [B·H, Sk, hd]
    scores = product("nqd,nkd->nqk", q, k, precision)  # scores[B·H, Sq, Sk] in accum
    scores = scores * (1.0 / math.sqrt(head_dim))  # scores[B·H, Sq, Sk]
    if visible is not None:
        scores = scores.reshape(batch, heads, sq, sk)
        scores = jnp.where(visible, scores, -jnp.inf).reshape(batch * heads, sq, sk)
    probs = jax.nn.softmax(scores, axis=-1)  # probs[B·H, Sq, Sk] in accum, normalised over keys
    o = product("nqk,nkd->nqd", probs, v, precision)  # o[B·H, Sq, hd] in accum
    return o.reshape(batch, heads, sq, head_dim)  # o[B, H, Sq, hd]


def product(spec: str, a, b, precision: Precision):
    """``einsum(spec, a, b)`` of compute-dtype operands, accumulated and returned in ``accum_dtype``.

    ``a`` and ``b`` may come in either dtype; their cotangents keep it (see ``_einsum``).
    """
    compute, accum = np.dtype(precision.compute_dtype), np.dtype(precision.accum_dtype)
    return _einsum(spec, compute, accum, precision.matmul_precision, a, b)


def _einsum_of(spec, a, b, compute, accum, matmul_precision):
    """``einsum(spec, a, b)``: operands cast to ``compute``, accumulated in ``accum``."""
    return jnp.einsum(
        spec,
        a.astype(compute),
        b.astype(compute),
        preferred_element_type=accum,
        precision=matmul_precision,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _einsum(spec, compute, accum, matmul_precision, a, b):
    """The attention products (``q·kᵀ``, ``p·v``) with the dense matmul's backward discipline.

    For ``c = einsum("A,B->C", a, b)`` (every index in two of the three operands) the cotangents
    are ``da = einsum("C,B->A", g, b)`` and ``db = einsum("A,C->B", a, g)``: products of
    compute-dtype operands accumulated in ``accum``, returned in the primal's dtype. Plain
    autodiff would give bf16 × f32 products accumulated in bf16.
    """
    return _einsum_of(spec, a, b, compute, accum, matmul_precision)


def _einsum_fwd(spec, compute, accum, matmul_precision, a, b):
    a_c, b_c = a.astype(compute), b.astype(compute)  # residuals in compute_dtype
    out = _einsum_of(spec, a_c, b_c, compute, accum, matmul_precision)
    # Empty slices carry the primals' dtypes and varying mesh axes into the backward pass.
    return out, (a_c, b_c, a.reshape(-1)[:0], b.reshape(-1)[:0])


def _einsum_bwd(spec, compute, accum, matmul_precision, residuals, g):
    a_c, b_c, a_kind, b_kind = residuals
    inputs, out = spec.split("->")
    lhs, rhs = inputs.split(",")
    da = _einsum_of(f"{out},{rhs}->{lhs}", g, b_c, compute, accum, matmul_precision)  # in accum
    db = _einsum_of(f"{lhs},{out}->{rhs}", a_c, g, compute, accum, matmul_precision)  # in accum
    da, db = _reduce_to(da, a_kind), _reduce_to(db, b_kind)  # invariant primal: reduce, in accum
    return da.astype(a_kind.dtype), db.astype(b_kind.dtype)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)
