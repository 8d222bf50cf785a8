"""Splash attention (JAX's Pallas TPU kernel) as a per-device op, usable inside ``shard_map``.

    q[B, H, S, hd], k[B, n, S, hd], v[B, n, S, hd] → o[B, H, S, hd] = softmax(q·kᵀ/√hd + mask)·v

The same contract as ``blocked_attention`` (``shardops/layers/_flash.py``): grouped-query
heads (query head ``j`` reads KV head ``j // (H/n)``), ``causal``, packed ``segment_ids``,
products of compute-dtype operands accumulated in float32, ``o`` in ``accum_dtype`` and
gradients in the dtypes of ``q``, ``k`` and ``v``. The work is done by
``jax.experimental.pallas.ops.tpu.splash_attention``: an MQA kernel of ``g = H/n`` query heads
(``make_splash_mqa``), vmapped over the batch and the ``n`` KV heads, with a
``MultiHeadMask`` of ``CausalMask`` or ``FullMask`` and the segment ids as ``SegmentIds``.
Splash does not scale the scores, so ``q`` is multiplied by ``1/√hd`` (in float32, then rounded
once to the compute dtype) before the kernel.

**Why a plain call fails inside ``jax.shard_map(check_vma=True)``.** With ``check_vma`` on,
every ``pallas_call`` output's ``jax.ShapeDtypeStruct`` must say over which mesh axes it varies
(its ``manual_axis_type``, JAX 0.10's name for the vma); ``pallas_call`` raises
``ValueError: When check_vma=True on jax.shard_map, manual_axis_type on jax.ShapeDtypeStruct
must not be None``. Splash builds its ``out_shape`` itself (forward, dq and dkv kernels) without
one, so no argument of ours can fix it, and turning ``check_vma`` off for a whole layer would
drop the checks that catch the gradient trap everywhere else.

**The escape: a ``check_vma=False`` region around the kernel only, typed again at its edge.**
``_unchecked`` runs the kernel in a nested ``jax.shard_map(..., axis_names=set(),
check_vma=False)`` over the current (all-manual) mesh: it makes no axis manual and moves no
data, it only switches the check off while the ``pallas_call`` is traced. Inside it no op is
typed, so every input is first multiplied by 1 (XLA removes it): the inputs keep their
``{V:…}`` types across the region's edge while what is computed from them has none, and two
JAX checks trip on the mix (the interpreter's grid ``while_loop`` carries, and ``jax.vjp``'s
cotangent type). The region's outputs come back typed *invariant* (``out_specs=P()``) though
they differ per device, so a ``custom_vjp`` owns both edges of the region:

- forward: ``o`` is ``pcast`` to varying over the union of the axes ``q``, ``k``, ``v`` and
  ``segment_ids`` vary over (the axes its value does vary over);
- backward: the kernel's ``dq``, ``dk``, ``dv`` are ``pcast`` to that same union (their values
  vary as ``o`` does), then ``psum``-ed (in float32) over the axes their primal is invariant
  over, as ``shardops._precision._reduce_to`` does: an MQA ``k`` replicated over ``model``
  while the query heads are split over it gets ``dk`` summed over every device's heads, once.

Autodiff never differentiates through the ``pcast`` (it sits inside the ``custom_vjp``), so the
invariant-to-varying cast does not become a second ``psum`` in the backward. The kernel's own
VJP (splash's ``custom_vjp``: a dq and a dkv kernel from the saved log-sum-exp) runs in a
second unchecked region, its pullback carried between the two as the residual; the residuals
cross the outer program typed invariant, which is harmless because only that region reads them.

Under ``shard_map(check_vma=False)`` nothing is typed, so nothing is ``psum``-ed: as for any
op there, reducing the gradient of a replicated input is the caller's.

Also tried: JAX's private switch ``jax._src.config._check_vma(False)`` around the call works
the same way but is internal, and the nested ``shard_map`` is public API. The TPU interpreter
(``interpret=pltpu.InterpretParams()``) cannot run the batch ``vmap`` in JAX 0.10.2 (its grid
gains a dimension the kernel's ``dimension_semantics`` do not list), so ``interpret=True`` here
is the generic Pallas interpreter.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from shardops._mesh import varying_axes
from shardops._precision import FLOAT32, Precision
from shardops.comm._collectives import all_reduce
from shardops.comm._reasons import Reason
from shardops.layers._flash import _check

# The TPU vector lane width: splash's key blocks (block_kv_compute) must be multiples of it,
# and its head dim tiles the lanes.
LANES = 128


def splash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    segment_ids=None,
    precision: Precision = FLOAT32,
    block: int = 512,
    interpret: bool = False,
):
    """Softmax attention by the Pallas splash kernel, per device (callable inside ``shard_map``).

    Computes ``o = softmax(q·kᵀ/√hd, masked)·v`` per head, exactly what ``blocked_attention``
    computes: a query ``i`` sees key ``j`` when ``j ≤ i`` (``causal``) and
    ``segment_ids[b, j] == segment_ids[b, i]``. No communication, forward or backward, except
    in the backward where a primal is invariant over a mesh axis that ``o`` varies over:
    ``psum`` of its cotangent over that axis (``{U_model}`` → replicated).

    Arguments:
        q: the queries, shape ``(B, H, S, hd)``.
        k: the keys, shape ``(B, n, S, hd)`` with ``H % n == 0`` (query head ``j`` reads KV
            head ``j // (H/n)``; ``n = 1`` is multi-query).
        v: the values, shape ``(B, n, S, hd)``.
        causal: mask keys after each query.
        segment_ids: optional integer ``(B, S)``: a query sees only keys of its own segment.
        precision: ``q``, ``k``, ``v`` go to the kernel in ``compute_dtype`` (``q`` already
            scaled by ``1/√hd``); its products accumulate in float32.
        block: query and key block of the kernel, forward and backward (clipped to ``S``); a
            multiple of 128 that divides ``S``.
        interpret: run the kernel in Pallas's generic interpreter (any backend, slow: for tests).

    Returns:
        ``o`` of shape ``(B, H, S, hd)`` in ``precision.accum_dtype`` (the kernel returns it
        rounded to ``compute_dtype``). Gradients come back in the dtypes of ``q``, ``k``, ``v``.

    Raises ``ValueError`` where ``splash_unsupported_reason`` gives a reason.
    """
    if (bad_block := _bad_block(block)) is not None:
        raise ValueError(bad_block)
    _check(q, k, v, segment_ids, block, precision)
    reason = splash_unsupported_reason(q.shape, k.shape, block=block, interpret=interpret)
    if reason is not None:
        raise ValueError(reason)
    batch, heads, seq, hd = q.shape
    n = k.shape[1]
    compute, accum = precision.compute_dtype, precision.accum_dtype
    scale = 1.0 / math.sqrt(hd)  # splash does not scale the scores: q·(1/√hd) before it
    q_scaled = (q.astype(accum) * scale).astype(compute)  # [B, H, S, hd] in compute
    q_grouped = q_scaled.reshape(batch, n, heads // n, seq, hd)  # [B, n, g, S, hd]
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)  # [B, S]
    key = (seq, heads // n, bool(causal), min(int(block), seq), bool(interpret))
    with jax.named_scope("shardops.splash_attention"):
        o = _splash(key, q_grouped, k.astype(compute), v.astype(compute), segment_ids)
    return o.reshape(batch, heads, seq, hd).astype(accum)  # [B, H, S, hd] in accum


def splash_unsupported_reason(
    q_shape, k_shape, *, block: int = 512, interpret: bool = False
) -> str | None:
    """Why ``splash_attention`` cannot run on these shapes here, or ``None`` when it can.

    A dispatcher falls back to ``blocked_attention`` on a reason instead of raising. The
    reasons: not on a TPU (unless ``interpret``), ``S`` or ``hd`` not a multiple of 128, or a
    ``block`` (clipped to ``S``) that is not a multiple of 128 dividing ``S``. Each reason is
    an error message: the argument, what arrived, what the kernel needs and the fix.
    """
    seq, hd = q_shape[2], q_shape[3]
    if (bad_block := _bad_block(block)) is not None:
        return bad_block
    if not interpret and jax.default_backend() != "tpu":
        return (
            f"splash attention is a TPU kernel but the backend is {jax.default_backend()!r}; "
            f"use blocked_attention, or interpret=True to run the kernel in Pallas's "
            f"interpreter (slow: for tests)."
        )
    if seq % LANES:
        return (
            f"the sequence length S={seq} of q{tuple(q_shape)} is not a multiple of {LANES}, "
            f"which splash attention's key blocks need; pad the sequence to "
            f"{-(-seq // LANES) * LANES} (masked by segment ids) or use blocked_attention."
        )
    if hd % LANES:
        return (
            f"the head dim hd={hd} of q{tuple(q_shape)} and k{tuple(k_shape)} is not a "
            f"multiple of {LANES}, which splash attention's TPU tiles need; use "
            f"blocked_attention, or heads of {-(-hd // LANES) * LANES} dims."
        )
    clipped = min(int(block), seq)
    if clipped % LANES or seq % clipped:
        fits = max(
            (b for b in range(LANES, min(block, seq) + 1, LANES) if seq % b == 0), default=LANES
        )
        return (
            f"block={block} gives blocks of {clipped} for S={seq}, but splash attention needs "
            f"a multiple of {LANES} that divides S; pass block={fits}."
        )
    return None


def _bad_block(block) -> str | None:
    if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1:
        return (
            f"block={block!r} must be an integer ≥ 1 (the query and key block of the splash "
            f"kernel); pass e.g. block=512."
        )
    return None


@functools.lru_cache(maxsize=64)
def _kernel(seq: int, g: int, causal: bool, block: int, interpret: bool):
    """The splash MQA kernel for ``g`` query heads of one KV head: ``q[g, S, hd]``,
    ``k, v[S, hd]`` → ``o[g, S, hd]``, forward and backward blocks of ``block``."""
    head_mask = splash.CausalMask((seq, seq)) if causal else splash.FullMask((seq, seq))
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # The kernel holds its mask tables as arrays: built concrete, never as tracers of the trace
    # that first asks for it, since it is cached.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mqa(
            splash.MultiHeadMask([head_mask] * g),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,  # True: the generic Pallas interpreter (module docstring)
        )


def _grouped(key, q, k, v, segment_ids):
    """``o[B, n, g, S, hd]``: the MQA kernel vmapped over the batch and the ``n`` KV heads."""
    kernel = _kernel(*key)

    def one_kv_head(q, k, v, segments):  # q[g, S, hd], k, v[S, hd], segments[S] or None
        ids = None if segments is None else splash.SegmentIds(q=segments, kv=segments)
        return kernel(q, k, v, segment_ids=ids)  # [g, S, hd]

    over_heads = jax.vmap(one_kv_head, in_axes=(0, 0, 0, None))  # segments shared by heads
    return jax.vmap(over_heads)(q, k, v, segment_ids)  # [B, n, g, S, hd]


def _unchecked(f, *args):
    """``f(*args)`` with ``check_vma`` off: a nested ``shard_map`` that makes no axis manual
    (outside ``shard_map``, a plain call). Its outputs come back typed invariant."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.manual_axes:
        return f(*args)

    def untyped(*args):
        # No op is typed in the region, so the first one drops the inputs' varying types:
        # ·1 makes them match what the region computes from them. XLA removes it.
        return f(*jax.tree.map(lambda x: x * jnp.ones((), x.dtype), args))

    # check_vma off for the kernel alone: splash's pallas_call gives its outputs no type (the
    # module docstring); _splash_fwd/_splash_bwd type both edges again, and
    # tests/layers/test_splash.py checks replicated weights' gradients against the unsharded run.
    region = jax.shard_map(
        untyped, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=frozenset(), check_vma=False
    )
    return region(*args)


def _vary(x, axes: frozenset):
    """``x`` typed as varying over ``axes`` (``pcast`` over those it is not typed with)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _splash(key, q, k, v, segment_ids):
    return _splash_fwd(key, q, k, v, segment_ids)[0]


def _splash_fwd(key, q, k, v, segment_ids):
    # q[B, n, g, S, hd], k, v[B, n, S, hd] in compute, segment_ids[B, S] int32 or None
    def attend(q, k, v):
        return _grouped(key, q, k, v, segment_ids)

    o, pullback = _unchecked(lambda q, k, v: jax.vjp(attend, q, k, v), q, k, v)
    # Empty slices of the inputs carry their dtypes and varying axes into the backward.
    kinds = tuple(t.reshape(-1)[:0] for t in (q, k, v))
    if segment_ids is not None:
        kinds += (segment_ids.reshape(-1)[:0],)
    varies = frozenset().union(*map(varying_axes, kinds))  # the axes o's value varies over
    return _vary(o, varies), (pullback, kinds)  # o[B, n, g, S, hd] in compute


_REPLICATED_OPERAND = Reason("splash_replicated_operand", backward={
    "psum": "q, k or v is replicated over {axis} but splash's output varies over it: its "
            "gradient is summed, in float32",
})  # fmt: skip


def _splash_bwd(key, saved, do):
    pullback, kinds = saved
    varies = frozenset().union(*map(varying_axes, kinds))
    grads = _unchecked(lambda pullback, do: pullback(do), pullback, do)  # dq, dk, dv
    out = []
    for grad, kind in zip(grads, kinds, strict=False):
        grad = _vary(grad, varies)  # its value varies as o does
        extra = tuple(sorted(varies - varying_axes(kind)))  # where its primal is replicated
        if extra:  # {U_extra} → replicated, once, summed in float32 (every policy's accum)
            grad = all_reduce(grad.astype(jnp.float32), extra, reason=_REPLICATED_OPERAND)
        out.append(grad.astype(kind.dtype))
    return (*out, None)


_splash.defvjp(_splash_fwd, _splash_bwd)
