"""Context-parallel attention: the sequence of every activation split over a mesh axis
``context``, attention included (the context parallelism of MaxText, torchtitan and
Megatron-Core), in three ways: all-gather of K/V, ring attention and Ulysses.

The token layout (load-balanced, the same for the three)
---------------------------------------------------------
The ``S`` tokens are cut into ``2N`` chunks of ``c = S/(2N)`` (``N`` = size of ``context``);
device ``i`` holds chunks ``i`` and ``2N−1−i``, in that order, so ``x[B, S_context, D]`` is
``x[:, balanced_order(S, N)]`` split evenly over ``context``. Under a causal mask an early
chunk sees few keys and a late one many; pairing them gives every device the same work, and
with the ring every step the same work too (below). ``S`` must divide by ``2N``.
``balanced_order(S, N)[t]`` is the global position of the ``t``-th token of the device-major
layout; ``inverse_order`` undoes it (``y_natural = y_layout[:, inverse_order(S, N)]``). The
layers on global arrays permute in and out themselves; a model permutes its tokens once,
where they enter (``models.strategies``), and everything between attention calls is
position-wise. Rotary positions and the causal mask use each token's *global* position.

The attentions, on one device's projected blocks (``q[B, H, S/N, hd]``, ``k, v[B, KV, S/N, hd]``,
after the rotation, in ``accum_dtype``; ``H``, ``KV``: the heads on this device, after any
split over ``model``):

    allgather   k, v: AllGather over context → k[B, KV, S, hd]; this device's queries attend
                to every key. Backward: ReduceScatter of dk, dv (accum_dtype). The K/V
                blocks' memory is not divided: the attention part stays O(S) per device.
    ring        each device keeps its queries; the K/V blocks (only the KV heads; segment ids
                are gathered once) go round the ring with ppermute, N−1 steps, each step's scores
                combined by an online softmax (running max and sum in float32). Backward: a
                custom VJP passes K/V round again, the other way round the ring (the same
                ppermutes XLA would merge with the forward's, keeping every block alive), N−1
                steps, with dK/dV travelling beside them, then one more step returns dK/dV to
                their owners (N ppermutes of dK/dV in accum_dtype). Autodiff through the
                forward ring would keep every K/V block; this saves only q, k, v, the output
                and the log-sum-exp. At N = 2 both ways are the same swap (XLA would merge
                the two passes): the forward keeps the one block it received instead.
                Causal: at step t>0 device r holds the block of device j = r−t mod N. If j < r
                every local query sees chunk j of the block and none sees chunk 2N−1−j; if
                j > r only chunk 2N−1−r of the queries sees the block, all of it. Each is half
                the block: every step after the first computes exactly half of a full block
                (``lax.cond`` on j < r), on every device.
    ulysses     AllToAll q, k, v: [B, H, S/N, hd] → [B, H/N, S, hd] (heads split, sequence
                whole), local attention, AllToAll the output back. H and KV must divide by
                N. Backward: the same four AllToAlls (accum_dtype).

Every move of q, k, v or the output carries the values rounded to ``compute_dtype`` (the
products read them so); every gradient moves and reduces in ``accum_dtype``.

Notation (the JAX scaling book): ``x[B, S_context, D]`` is split along S over ``context``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardops._axes import CONTEXT_AXIS
from shardops._mesh import axis_size, check_divisible, spec_entry
from shardops._precision import FLOAT32, Precision
from shardops.comm._collectives import all_gather, all_to_all, reduce_scatter
from shardops.comm._reasons import Reason
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
from shardops.layers._common import bound_axis_size, check_axes, run_layer, scoped
from shardops.layers._ring_attention import _local_positions, _ring_attention

METHODS = ("allgather", "ring", "ulysses")
"""The context-parallel attentions (module docstring)."""

_GATHER_KV = Reason("context_kv_gather", forward={
    "all_gather": "the sequence is split over {axis} (context parallelism) and every query "
                  "needs every key and value",
}, backward={
    "psum_scatter": "it is the transpose of the K/V all_gather: each device's dk, dv partial "
                    "sums are reduced and split back over {axis}",
})  # fmt: skip
_ULYSSES = Reason("context_ulysses", forward={
    "all_to_all": "Ulysses over {axis}: the sequence split is traded for a head split around "
                  "attention, and back",
}, backward={
    "all_to_all": "the transpose of Ulysses' all_to_all over {axis}",
})  # fmt: skip
_SEGMENTS = Reason("context_segments", forward={
    "all_gather": "the keys' segment ids, split over {axis} with their tokens, are gathered",
})  # fmt: skip


def balanced_order(seq: int, n: int) -> np.ndarray:
    """``order[S]``: the global position of each token of the load-balanced layout over ``n``
    devices, device-major (device ``i`` holds chunks ``i`` and ``2n−1−i`` of ``seq/(2n)``)."""
    if seq < 1 or seq % (2 * n):
        raise ValueError(
            f"balanced_order: the sequence length {seq} must be a positive multiple of 2 × "
            f"the context size {n} = {2 * n} (each device holds two non-empty chunks); e.g. "
            f"{sequence_fit(seq, 2 * n)}"
        )
    chunks = np.arange(seq).reshape(2 * n, seq // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def inverse_order(seq: int, n: int) -> np.ndarray:
    """The permutation that undoes ``balanced_order``: ``t[:, balanced_order][:, inverse] == t``."""
    return np.argsort(balanced_order(seq, n))


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Attention over a sequence split over mesh axis ``axis_name`` by ``method`` (one of
    ``METHODS``): what ``head_parallel_attention_kernel(..., context=...)`` and
    ``context_parallel_attention_kernel`` take."""

    axis_name: str = CONTEXT_AXIS
    method: str = "ring"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"context-parallel attention method must be one of {METHODS}; got "
                             f"{self.method!r}")  # fmt: skip
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise TypeError(f"ContextParallel: axis_name must be a mesh axis name; got "
                            f"{self.axis_name!r}")  # fmt: skip

    def positions(self, seq: int):
        """``[seq]`` int32: the global positions of this device's ``seq`` tokens (inside
        ``shard_map``)."""
        n = lax.axis_size(self.axis_name)
        return _local_positions(lax.axis_index(self.axis_name), n, seq)

    def check_local(self, op: str, seq: int, num_heads: int, kv_heads: int, p: int = 1,
                    replicated_kv: bool = False, sequence_split: int = 1) -> None:  # fmt: skip
        """Inside ``shard_map``, before any collective: the local block of ``seq`` tokens fits
        the layout (two non-empty chunks) and, for Ulysses, the heads this device sends
        (``num_heads``, ``kv_heads`` global; ``p``: the model axis splitting them,
        ``replicated_kv``: K/V replicated over it) split over the context axis.
        ``sequence_split``: the model axis size under sequence parallelism, which splits the
        block further (the global S a multiple of ``N·lcm(2, p)``, as ``check_sequence``)."""
        n = lax.axis_size(self.axis_name)  # static inside shard_map
        if seq < 2 or seq % 2:
            multiple = n * math.lcm(2, sequence_split)
            raise ValueError(
                f"{op}: the local sequence block has {seq} tokens; the load-balanced layout "
                f"over mesh axis {self.axis_name!r} (size {n}) holds two equal non-empty "
                f"chunks per device, so the global S must be a positive multiple of 2 × {n} = "
                f"{2 * n}"
                + (
                    f" and, split {sequence_split} ways by sequence parallelism, of {multiple}"
                    if multiple != 2 * n
                    else ""
                )
                + f" (e.g. {sequence_fit(seq * n, multiple)})"
            )
        if self.method == "ulysses":
            heads, kv_sent = ulysses_heads_sent(num_heads, kv_heads, p, replicated_kv)
            check_ulysses_heads(op, heads, kv_sent, self.axis_name, n)

    def attend(self, q, k, v, kv, heads: int, causal: bool, segment_ids, precision: Precision,
               implementation: str = "auto"):  # fmt: skip
        """``o[B, H, s, hd]`` in ``accum_dtype`` of this device's queries over the whole
        sequence. ``q[B, H, s, hd]``, ``k, v[B, n, s, hd]`` (``kv``: the ``_KvHeads`` of the
        kernel), ``segment_ids[B, s]`` or None: this device's tokens. ``implementation``:
        ``"einsum"`` scores each local attention (allgather, Ulysses) at once and each ring
        step in one block; any other runs the blocked online softmax in blocks of
        ``BLOCK_K`` (the keys are in the load-balanced order, which splash's masks do not
        take)."""
        index = kv.index  # replicated K/V read by index: the KV heads move, then expand
        if index is not None and self.method == "ulysses":  # the heads split needs each
            k = _kv_heads.for_query_heads(k, kv, heads)  # query head's K/V: [B, H, s, hd]
            v = _kv_heads.for_query_heads(v, kv, heads)
            index = None
        group = heads // k.shape[1] if index is None else 1
        run = {"allgather": _allgather, "ring": _ring, "ulysses": _ulysses}[self.method]
        blocked = implementation != "einsum"
        return run(q, k, v, segment_ids, group, causal, self.axis_name, precision, index, blocked)


def ulysses_heads_sent(num_heads: int, kv_heads: int, p: int = 1,
                       replicated_kv: bool = False) -> tuple[int, int]:  # fmt: skip
    """``(query heads, key/value heads)`` one device sends through Ulysses' all-to-all, of
    ``num_heads`` and ``kv_heads`` split over a model axis of ``p`` devices: ``H/p`` and
    ``KV/p`` (K/V split by KV head), or with K/V replicated over it the KV heads its query
    heads read (``kv_cache_heads``), expanded to one per query head when that is more than
    one (they are read by index, ``ContextParallel.attend``)."""
    heads = num_heads // p
    if not replicated_kv:
        return heads, kv_heads // p
    count = _kv_heads.kv_cache_heads(num_heads, kv_heads, p)
    return heads, heads if count > 1 else count


def check_ulysses_heads(op: str, heads: int, kv_heads: int, axis_name: str, n: int) -> None:
    """Ulysses splits the (local) heads over the context axis: both counts must divide."""
    for name, count in (("query heads", heads), ("key/value heads", kv_heads)):
        if count % n:
            raise ValueError(
                f"{op}: Ulysses splits the heads over mesh axis {axis_name!r} (size {n}), but "
                f"the {name} on each device, {count} (query heads {heads}, key/value heads "
                f"{kv_heads}), do not divide by {n}. Use the 'ring' or 'allgather' method, or "
                f"a context size dividing both."
            )


# --- moving rounded values: forward in compute_dtype, backward in accum_dtype -----------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _moved(move, transpose, compute, x):
    """``move(x)`` of ``x`` rounded to ``compute`` (what the products read), returned in ``x``'s
    dtype; the backward runs ``transpose`` on the cotangent in ``x``'s (accum) dtype."""
    return move(x.astype(compute)).astype(x.dtype)


def _moved_fwd(move, transpose, compute, x):
    return _moved(move, transpose, compute, x), None


def _moved_bwd(move, transpose, compute, _, g):
    return (transpose(g),)


_moved.defvjp(_moved_fwd, _moved_bwd)


@dataclasses.dataclass(frozen=True)
class _Gather:
    axis_name: str
    dim: int
    reason: Reason

    def __call__(self, x):
        return all_gather(x, self.axis_name, axis=self.dim, reason=self.reason)


@dataclasses.dataclass(frozen=True)
class _ScatterSum:
    axis_name: str
    dim: int
    reason: Reason

    def __call__(self, g):
        return reduce_scatter(g, self.axis_name, scatter_dimension=self.dim, reason=self.reason)


@dataclasses.dataclass(frozen=True)
class _AllToAll:
    axis_name: str
    split: int
    concat: int
    reason: Reason

    def __call__(self, x):
        return all_to_all(x, self.axis_name, split_axis=self.split, concat_axis=self.concat,
                          reason=self.reason)  # fmt: skip


def _local(q, k, v, group: int, q_pos, k_pos, q_seg, k_seg, causal: bool, precision: Precision,
           blocked: bool):  # fmt: skip
    """One device's attention of ``q[B, H, sq, hd]`` over ``k, v[B, H/group, sk, hd]`` at
    global positions ``q_pos[sq]``, ``k_pos[sk]`` (segment ids ``[B, sq]``, ``[B, sk]`` or
    None): the blocked online softmax, or with ``blocked=False`` the S×S einsum."""
    if blocked:
        return _flash.attend(q, k, v, q_positions=q_pos, k_positions=k_pos, q_segments=q_seg,
                             k_segments=k_seg, causal=causal, block_k=_attention_core.BLOCK_K,
                             precision=precision)  # fmt: skip
    if group > 1:  # the reference reads one KV head per query head
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # [B, H, sk, hd]
    visible = _masks.visible(q_pos, k_pos, q_seg, k_seg, causal)  # [B or 1, 1, sq, sk]
    return _attention_reference.einsum_attention(q, k, v, visible, precision)


def _allgather(q, k, v, segment_ids, group, causal, axis, precision, index=None, blocked=True):
    """K/V AllGathered over ``axis``; this device's queries attend locally (module docstring).
    ``index[H]``: the KV head each query head reads, where not by contiguous groups."""
    n, s = lax.axis_size(axis), q.shape[2]
    compute = np.dtype(precision.compute_dtype)
    gather, scatter = _Gather(axis, 2, _GATHER_KV), _ScatterSum(axis, 2, _GATHER_KV)
    k_all = _moved(gather, scatter, compute, k)  # k[B, n, S, hd]; dk ReduceScattered
    v_all = _moved(gather, scatter, compute, v)
    if index is not None:  # [B, H, S, hd]: each query head's KV head (dk summed back)
        k_all, v_all = jnp.take(k_all, index, axis=1), jnp.take(v_all, index, axis=1)
    k_seg = None
    if segment_ids is not None:
        k_seg = all_gather(segment_ids, axis, axis=1, reason=_SEGMENTS)  # [B, S]
    q_pos = _local_positions(lax.axis_index(axis), n, s)  # [s]
    k_pos = jnp.asarray(balanced_order(s * n, n), jnp.int32)  # [S]: device-major
    return _local(q, k_all, v_all, group, q_pos, k_pos, segment_ids, k_seg, causal, precision,
                  blocked)  # fmt: skip


def _ulysses(q, k, v, segment_ids, group, causal, axis, precision, index=None, blocked=True):
    """AllToAll heads ↔ sequence around local attention (module docstring)."""
    n, s = lax.axis_size(axis), q.shape[2]
    compute = np.dtype(precision.compute_dtype)
    to_heads, to_seq = _AllToAll(axis, 1, 2, _ULYSSES), _AllToAll(axis, 2, 1, _ULYSSES)
    q, k, v = (_moved(to_heads, to_seq, compute, t) for t in (q, k, v))  # [B, h/N, S, hd]
    seg = None
    if segment_ids is not None:
        seg = all_gather(segment_ids, axis, axis=1, reason=_SEGMENTS)  # [B, S]
    pos = jnp.asarray(balanced_order(s * n, n), jnp.int32)  # [S]: device-major
    o = _local(q, k, v, group, pos, pos, seg, seg, causal, precision, blocked)
    return _moved(to_seq, to_heads, compute, o)  # o[B, H/N, S, hd] → o[B, H, S/N, hd]


# --- ring attention ---------------------------------------------------------------------------


def _ring(q, k, v, segment_ids, group, causal, axis, precision, index=None, blocked=True):
    del group  # the blocked core groups query heads by the KV heads it is given
    seg_all = None
    if segment_ids is not None:  # every device's ids, once: each step slices its owner's
        seg_all = all_gather(segment_ids, axis, axis=1, reason=_SEGMENTS)  # [B, S]
    block_k = _attention_core.BLOCK_K if blocked else q.shape[2]  # "einsum": one block per step
    return _ring_attention(axis, causal, precision, block_k, q, k, v, seg_all, index)


# --- the kernel without a model axis, the layer on global arrays, and its specs ---------------


def context_parallel_attention_specs(
    *,
    context_axis: str = CONTEXT_AXIS,
    model_axis: str | None = None,
    batch_axis: str | None = None,
    sequence_parallel: bool = False,
    replicate_kv: bool = False,
) -> _attention.AttentionSpecs:
    """Layout of ``context_parallel_attention``: ``x[B_batch, S_context, D] → y`` alike, in
    the load-balanced order; ``tokens`` (``positions``, ``segment_ids``) ``[B_batch,
    S_context]``. With ``model_axis`` the weights split by heads as
    ``head_parallel_attention_specs``'s (``replicate_kv`` likewise), and ``sequence_parallel``
    splits each context block of ``x`` and ``y`` further over ``model``:
    ``x[B, S_(context, model), D]``. Without it every weight is replicated."""
    if sequence_parallel and model_axis is None:
        raise ValueError("context_parallel_attention_specs: sequence_parallel splits the "
                         "sequence over the model axis; give model_axis")  # fmt: skip
    batch = spec_entry(batch_axis)
    seq = spec_entry(context_axis, model_axis if sequence_parallel else None)
    x = P(batch, seq, None)
    tokens = P(batch, context_axis)
    if model_axis is None:
        w, b = P(None, None), P(None)
        return _attention.AttentionSpecs(x=x, w_qkv=w, b_qkv=b, w_out=w, b_out=b, y=x, w_kv=w,
                                         b_kv=b, tokens=tokens)  # fmt: skip
    head = _attention.head_parallel_attention_specs(axis_name=model_axis,
                                                    replicate_kv=replicate_kv)  # fmt: skip
    return head._replace(x=x, y=x, tokens=tokens)


@scoped("context_parallel_attention")
def context_parallel_attention_kernel(
    x,
    params,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    rope_theta: float | None = None,
    positions=None,
    segment_ids=None,
    method: str = "ring",
    context_axis: str = CONTEXT_AXIS,
    model_axis: str | None = None,
    sequence_parallel: bool = False,
    precision: Precision = FLOAT32,
    implementation: str = "auto",
):
    """Self-attention of a sequence split over ``context_axis``, on local blocks:
    ``x[B, S_context, D] → y[B, S_context, D]`` (the load-balanced layout, module docstring).

    Arguments (local blocks; ``N`` = size of ``context_axis``, ``s = S/N``):
        x: ``x[B, s, D]``, this device's two chunks of the sequence (with ``model_axis`` and
            ``sequence_parallel``, its ``1/p`` of them along S, as head-parallel attention
            takes it).
        params: as ``attention``'s (every head here) or, with ``model_axis``, as
            ``head_parallel_attention_kernel``'s (heads split over ``model_axis``).
        positions, segment_ids: ``[B, s]`` integers, this device's tokens' (whole over
            ``model_axis``). Positions default to the tokens' global positions; with RoPE and
            ``segment_ids`` pass them (a document may begin on another device).
        method: ``"allgather"``, ``"ring"`` or ``"ulysses"`` (module docstring).
        implementation: ``"einsum"`` scores each local attention at once (each ring step in
            one block); ``"auto"``, ``"blocked"`` and ``"splash"`` run the blocked online
            softmax (``ContextParallel.attend``).
        Others as ``head_parallel_attention_kernel``'s.

    Returns:
        ``y[B, s, D]`` in ``precision.compute_dtype``, laid out as ``x``.

    Communication over ``context_axis`` (f32 bytes per device, ``b`` local rows, ``KV``/``H``
    the heads on this device, ``hd`` the head dim):
        allgather: forward AllGather of k and v, ``2·4·b·S·KV·hd·(N−1)/N``; backward
            ReduceScatter of dk, dv, the same bytes.
        ring: forward ``N−1`` ppermutes of the K/V block, ``2·4·b·s·KV·hd`` each; backward
            ``N−1`` of K/V (none at N = 2: the forward keeps its one) and ``N`` of dK/dV
            (the last returns them to their owners).
        ulysses: forward AllToAll of q, k, v and o, ``4·b·s·(2H + 2KV)·hd·(N−1)/N`` in all;
            backward the same.
        With ``segment_ids``, one AllGather of them (int32 ``[b, S]``; the ring slices each
        step's block from it, so no ids go round the ring). Over ``model_axis``:
        as ``head_parallel_attention_kernel``. The weights' gradients are reduced over
        ``context_axis`` in accum_dtype (they are replicated over it).
    """
    op = "context_parallel_attention_kernel"
    _attention_core.check_implementation(op, implementation)
    context = ContextParallel(context_axis, method)
    bound_axis_size(context_axis, op)
    if model_axis is not None:  # it checks the heads it sends (its own are split by model)
        return _attention.head_parallel_attention_kernel(
            x, params, num_heads=num_heads, num_kv_heads=num_kv_heads, causal=causal,
            rope_theta=rope_theta, positions=positions, segment_ids=segment_ids,
            axis_name=model_axis, sequence_parallel=sequence_parallel, context=context,
            precision=precision, implementation=implementation,
        )  # fmt: skip
    if sequence_parallel:
        raise ValueError(f"{op}: sequence_parallel splits the sequence over the model axis; "
                         f"give model_axis")  # fmt: skip
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _attention_arguments.check_args(
        op, x, params, num_heads, kv_heads, causal, precision, dtypes=False
    )
    context.check_local(op, x.shape[1], num_heads, kv_heads)  # before any all-to-all
    head_dim = params["wq"].shape[1] // num_heads
    _rope.check_rope(op, rope_theta, head_dim)
    tokens = _attention_arguments.check_tokens(op, positions, segment_ids, x.shape[:2], None,
                                               rope_theta, context)  # fmt: skip
    x = x.astype(precision.accum_dtype)  # x[B, s, D] in accum; no region over the context axis
    kv = _kv_heads.KvHeads(kv_heads, None)
    positions, segment_ids = tokens
    core = _attention_core.core_for(kv, num_heads, causal, segment_ids, precision,
                                    implementation, context)  # fmt: skip
    positions = _attention.global_positions(positions, x.shape[1], rope_theta, context)
    y = _attention.heads_attention(x, params, num_heads, kv, head_dim, rope_theta, positions,
                                   precision, core)  # fmt: skip
    return precision.finish(y, params.get("bo"))  # y[B, s, D] in compute dtype


def context_parallel_attention(
    x,
    params,
    *,
    mesh: Mesh,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    rope_theta: float | None = None,
    positions=None,
    segment_ids=None,
    method: str = "ring",
    context_axis: str = CONTEXT_AXIS,
    model_axis: str | None = None,
    batch_axis: str | None = None,
    sequence_parallel: bool = False,
    permute: bool = True,
    precision: Precision = FLOAT32,
    implementation: str = "auto",
):
    """Self-attention of ``x[B, S, D]`` with the sequence split over ``context_axis``: ``→ y[B, S, D]``.

    Arguments:
        x: ``x[B, S, D]`` in ``precision.compute_dtype``, in the natural token order (or, with
            ``permute=False``, already in the load-balanced layout, ``x[:, balanced_order(S,
            N)]``, and ``y`` is returned in it). ``S`` must divide by ``2N``.
        params: full parameters as ``init_attention`` makes them.
        positions, segment_ids: ``[B, S]`` integers of the whole sequence, in ``x``'s order;
            with RoPE, positions default to each token's position (restarting at each
            document of ``segment_ids``), computed on the whole sequence.
        method: ``"allgather"``, ``"ring"`` or ``"ulysses"``.
        model_axis: split the heads over this axis too (Megatron); ``sequence_parallel``
            splits each context block over it between layers.
        batch_axis: the axis splitting B, if any.
        implementation: as ``context_parallel_attention_kernel``'s.

    With ``permute`` the tokens are put into the layout and back by a gather along S outside
    the kernel (XLA moves them); a model does it once, where the tokens enter. Communication:
    ``context_parallel_attention_kernel``.
    """
    op = "context_parallel_attention"
    _attention_core.check_implementation(op, implementation)
    ContextParallel(context_axis, method)
    check_axes(mesh, context_axis, batch_axis)
    if model_axis is not None:
        check_axes(mesh, model_axis, None)
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _attention_arguments.check_args(op, x, params, num_heads, kv_heads, causal, precision)
    _rope.check_rope(op, rope_theta, params["wq"].shape[1] // num_heads)
    n = axis_size(mesh, context_axis)
    p = 1 if model_axis is None else axis_size(mesh, model_axis)
    check_sequence(op, "x", x.shape[1], context_axis, n,
                   model_axis if sequence_parallel else None, p)  # fmt: skip
    if not permute and rope_theta is not None and positions is None and segment_ids is not None:
        # the documents' positions, counted in token order (the ids are in the layout's)
        natural = jnp.asarray(segment_ids)[:, inverse_order(x.shape[1], n)]
        positions = _rope.segment_positions(natural)[:, balanced_order(x.shape[1], n)]
    positions, segment_ids = _attention_arguments.check_tokens(
        op, positions, segment_ids, x.shape[:2], None, rope_theta
    )
    replicate_kv = _replicate_kv_checked(op, num_heads, kv_heads, method, context_axis, n,
                                         model_axis, p)  # fmt: skip
    check_divisible(argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh,
                    axes=(batch_axis,))  # fmt: skip
    specs = context_parallel_attention_specs(
        context_axis=context_axis, model_axis=model_axis, batch_axis=batch_axis,
        sequence_parallel=sequence_parallel, replicate_kv=replicate_kv,
    )  # fmt: skip
    if permute:  # x[B, S, D] and the [B, S] tokens in the balanced layout
        x, positions, segment_ids = _in_balanced_order(x, positions, segment_ids, n)
    kernel = functools.partial(
        context_parallel_attention_kernel, num_heads=num_heads, num_kv_heads=kv_heads,
        causal=causal, rope_theta=rope_theta, method=method, context_axis=context_axis,
        model_axis=model_axis, sequence_parallel=sequence_parallel, precision=precision,
        implementation=implementation,
    )  # fmt: skip
    y = _run_with_tokens(op, kernel, mesh, specs, x, params, positions, segment_ids)
    return y[:, inverse_order(x.shape[1], n)] if permute else y


def _replicate_kv_checked(
    op: str,
    num_heads: int,
    kv_heads: int,
    method: str,
    context_axis: str,
    n: int,
    model_axis: str | None,
    p: int,
) -> bool:
    """Whether the K/V heads are replicated over ``model_axis`` (too few to split over its ``p``
    devices), once the head counts are checked: they fit ``model_axis``, and with Ulysses the
    heads each device sends split over the ``n`` devices of ``context_axis``."""
    if model_axis is not None:
        _attention_arguments.check_head_counts(op, num_heads, kv_heads, model_axis, p)
    replicate_kv = model_axis is not None and not _attention.splits_kv_heads(kv_heads, p)
    if method == "ulysses":
        heads, kv_sent = ulysses_heads_sent(num_heads, kv_heads, p, replicate_kv)
        check_ulysses_heads(op, heads, kv_sent, context_axis, n)
    return replicate_kv


def _in_balanced_order(x, positions, segment_ids, n: int):
    """``x[B, S, D]`` and the ``[B, S]`` positions and segment ids (each may be ``None``) put in
    the load-balanced layout of ``n`` devices, ``[:, balanced_order(S, n)]``."""
    order = balanced_order(x.shape[1], n)
    x = x[:, order]
    positions, segment_ids = (None if t is None else jnp.asarray(t)[:, order]
                              for t in (positions, segment_ids))  # fmt: skip
    return x, positions, segment_ids


def _run_with_tokens(op: str, kernel, mesh: Mesh, specs, x, params, positions, segment_ids):
    """``kernel(x, params, positions=..., segment_ids=...)`` under ``shard_map`` (``run_layer``),
    the token arrays passed (with ``specs.tokens``) only when given: ``y`` laid out as
    ``specs.y``."""
    args = {"x": x, "params": params}
    in_specs = {"x": specs.x, "params": {name: specs.params[name] for name in params}}
    for name, tokens in (("positions", positions), ("segment_ids", segment_ids)):
        if tokens is not None:
            args[name], in_specs[name] = tokens, specs.tokens
    names = tuple(args)

    def run(*values):
        given = dict(zip(names, values, strict=True))
        return kernel(given.pop("x"), given.pop("params"), **given)

    return run_layer(op, run, mesh, args, in_specs, specs.y)


def sequence_fit(seq: int, multiple: int) -> int:
    """The smallest positive multiple of ``multiple`` that is ≥ ``seq``: a length to suggest
    (never 0, also for ``seq`` < 1)."""
    return max(-(-seq // multiple), 1) * multiple


def check_sequence(op: str, argument: str, seq: int, axis_name: str, n: int,
                   model_axis: str | None = None, p: int = 1) -> None:  # fmt: skip
    """The load-balanced layout's condition: S a positive multiple of ``2N`` (and, with
    ``model_axis`` splitting each device's block further under sequence parallelism, ``S/N``
    of its size ``p``), else a ValueError naming the argument, the dim, the axes, both sizes
    and a valid length."""
    multiple = n * math.lcm(2, p if model_axis is not None else 1)
    if seq >= 1 and seq % multiple == 0:
        return
    need = f"2 × mesh axis {axis_name!r} (size {n}) = {2 * n}"
    why = "the load-balanced context layout gives each device two equal non-empty chunks"
    if model_axis is not None and multiple != 2 * n:
        need += (f" and, per device, by mesh axis {model_axis!r} (size {p}): a multiple of "
                 f"{multiple}")  # fmt: skip
        why += f", and sequence parallelism splits each device's block over {model_axis!r}"
    got = "is empty" if seq < 1 else "is not divisible by"
    raise ValueError(
        f"{op}: {argument} dim 1 (sequence) = {seq} {got}{'' if seq < 1 else ' ' + need}"
        f"{f'; it needs a positive multiple of {need}' if seq < 1 else ''}: {why}. Use a "
        f"sequence length that is a multiple of {multiple} (e.g. {sequence_fit(seq, multiple)}), "
        f"or a smaller context axis."
    )
