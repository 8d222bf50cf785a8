"""Head-parallel self-attention (the Megatron attention block): per-device kernel, layer, specs.

The heads are split over mesh axis ``model``: each device holds ``H/p`` whole query heads. The
Q, K and V projections are column-parallel by heads, attention runs locally per head, and the
output projection is row-parallel:

    x[B, S, D] · wq[D, (H·hd)_model] + bq → q[B, S, H_model, hd]        (k, v: KV heads, below)
    rope(q), rope(k) at each token's position                          (optional, per head)
    softmax(q · kᵀ / √hd + mask, over keys) · v → o[B, S, H_model, hd]  (local, per head)
    o[B, S, (H·hd)_model] · wo[(H·hd)_model, D] → y[B, S, D]{U_model} → psum → + bo

One forward AllReduce over ``model`` per block (or, with sequence parallelism, the
AllGather/ReduceScatter pair), as in Megatron. ``x`` enters the model-parallel region *once*
(one ``copy_to_region`` or ``gather_to_region`` shared by Q, K and V), so the backward reduces
``dx`` once, not three times.

Grouped-query attention (``num_kv_heads`` = KV dividing H; multi-query is KV = 1): query head
``j`` reads KV head ``j // (H/KV)``, as in Hugging Face's ``repeat_kv``. When ``p`` divides KV,
``wk``/``wv`` split by KV head like ``wq`` (device ``i`` holds KV heads ``i·KV/p …``, exactly
the ones its query heads read). Otherwise (KV < p, or p not dividing KV) ``wk``/``wv`` are
stored replicated over ``model`` and each device projects only the KV heads its query heads
read: no forward collective, and in the backward the gradients of ``wk``, ``wv`` (``bk``,
``bv``) are AllReduced over ``model`` in ``accum_dtype``, the devices that do not read a head
adding zeros.

Rotary position embeddings (``rope_theta``) follow **Hugging Face's rotate-half convention**:
dims ``d`` and ``d + hd/2`` of a head form a pair rotated by ``position · θ^(−2d/hd)``. Meta's
original Llama code rotates interleaved pairs ``(2d, 2d+1)``; Hugging Face permutes the rows of
``q_proj``/``k_proj`` when it converts those checkpoints, so weights in Hugging Face's layout
are the ones that fit here. Positions are each token's *global* position (``positions[B, S]``,
default ``0 … S−1``, or, with ``segment_ids``, restarting at 0 at each document): under sequence
parallelism the rotation is applied after the AllGather of ``x``, to the whole sequence.

``segment_ids[B, S]`` (packed sequences): a query attends only to keys of its own segment
(and, with ``causal``, not after itself).

Precision (``shardops._precision``): every product, the attention's ``q·kᵀ`` and ``p·v``
included, multiplies compute-dtype operands and accumulates in ``accum_dtype``, forward and
backward (a custom VJP, like the dense matmul's: plain autodiff of a bf16 ``einsum`` would
accumulate its transposes in bf16). Scores, mask, rotation and softmax are float32. Under a bf16
policy the values are rounded to bf16 exactly where a product reads them (``q``, ``k``, ``v``
after the rotation, the probabilities, ``o``, and each cotangent a backward product reads) and
once more at the output; every sum (a KV head's gradient over its query heads included), and
every collective that reduces, runs in float32.

How each device computes its heads' softmax attention (``IMPLEMENTATIONS``: einsum, blocked,
splash) is ``shardops.layers._attention_core``; the argument checks are
``shardops.layers._attention_arguments``.

Notation (the JAX scaling book): ``w[D, F_model]`` is split over ``model`` along F;
``y[B, S, D]{U_model}`` holds partial sums not yet reduced over ``model``; ``p`` is the size of
``model``; ``H`` the number of query heads, ``KV`` of key/value heads, ``hd`` the head dim.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardops._axes import MODEL_AXIS, SEQUENCE_DIM
from shardops._mesh import axis_size, check_divisible, spec_entry
from shardops._precision import FLOAT32, Precision
from shardops.comm._mappings import (
    copy_to_region,
    gather_to_region,
    reduce_from_region,
    reduce_scatter_from_region,
)
from shardops.comm._reasons import Reason, because
from shardops.layers import _attention_core, _kv_heads, _rope
from shardops.layers._attention_arguments import (
    KV_KEYS,
    check_args,
    check_head_counts,
    check_kv_groups,
    check_local,
    check_tokens,
)
from shardops.layers._common import bound_axis_size, check_axes, run_layer, scoped
from shardops.layers._params import init_dense

# Why each collective of the kernel runs (``shardops.comm.because``; ``explain`` reads them).
_INPUT = Reason("attention_replicated_input", backward={
    "psum": "x is replicated over {axis} but each device projects it with its own heads: the "
            "partial dx are summed",
})  # fmt: skip
_GATHER = Reason("attention_sequence_gather", forward={
    "all_gather": "the input is split along the sequence over {axis} (sequence parallelism) and "
                  "every head needs all of it",
}, backward={
    "psum_scatter": "it is the transpose of the sequence-parallel gather: dx partial sums are "
                    "reduced and split back over {axis}",
})  # fmt: skip
PARTIAL_SUMS = Reason("attention_partial_sums", forward={
    "psum": "the heads are split over {axis}: the output projection's partial sums y{U} are "
            "reduced",
    "psum_scatter": "the heads are split over {axis}: the output projection's partial sums are "
                    "reduced and scattered along the sequence",
}, backward={
    "all_gather": "it is the transpose of the forward psum_scatter: each device needs all of dy",
})  # fmt: skip
_BIAS = Reason("attention_output_bias", backward={
    "psum": "the output bias is replicated but the output is split over {axis}: its gradient is "
            "summed",
})  # fmt: skip
_SHARED_KV = Reason("attention_shared_kv_heads", backward={
    "psum": "{axis} does not divide the key/value heads, so wk and wv are replicated over it and "
            "each device projects the KV heads its query heads read: their gradients are summed "
            "(zeros from the devices that do not read a head)",
})  # fmt: skip


class AttentionSpecs(NamedTuple):
    """PartitionSpecs of the attention block: input ``x``, the Q weight ``w_qkv`` and bias
    ``b_qkv`` (also K and V's when they split by KV head), the K/V weights ``w_kv`` and biases
    ``b_kv``, the output projection ``w_out`` and bias ``b_out``, the output ``y``, and the
    per-token integer inputs ``tokens`` (``positions``, ``segment_ids``: ``[B, S]``, the whole
    sequence on every device of ``model``, also under sequence parallelism)."""

    x: P
    w_qkv: P
    b_qkv: P
    w_out: P
    b_out: P
    y: P
    w_kv: P
    b_kv: P
    tokens: P

    @property
    def params(self) -> dict[str, P]:
        """The specs of the parameter dict (``init_attention``'s keys), for ``shard_params``."""
        return {"wq": self.w_qkv, "wk": self.w_kv, "wv": self.w_kv, "bq": self.b_qkv,
                "bk": self.b_kv, "bv": self.b_kv, "wo": self.w_out, "bo": self.b_out}  # fmt: skip


def splits_kv_heads(num_kv_heads: int, axis_size: int) -> bool:
    """Whether ``wk``/``wv`` split by KV head over a model axis of ``axis_size`` devices (it
    divides ``num_kv_heads``), or are stored replicated over it (``replicate_kv``)."""
    return num_kv_heads % axis_size == 0


def head_parallel_attention_specs(
    *,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    sequence_parallel: bool = False,
    replicate_kv: bool = False,
) -> AttentionSpecs:
    """Layout of ``head_parallel_attention``: ``x[B_batch, S, D] → y[B_batch, S, D]``.

    Weights ``w[D, (H·hd)_model]`` (Q, and K, V by KV head) and ``w[(H·hd)_model, D]``
    (output), biases ``b[(H·hd)_model]`` and ``b[D]`` (replicated). ``sequence_parallel`` splits
    ``x`` and ``y`` along S too: ``x[B_batch, S_model, D]``. ``replicate_kv``: ``wk, wv[D,
    KV·hd]`` and ``bk, bv`` replicated over ``axis_name``, as they must be when its size does not
    divide the KV heads (``not splits_kv_heads(num_kv_heads, p)``).
    """
    seq = axis_name if sequence_parallel else None
    x = P(spec_entry(batch_axis), seq, None)
    w_qkv, b_qkv = P(None, axis_name), P(axis_name)
    return AttentionSpecs(
        x=x, w_qkv=w_qkv, b_qkv=b_qkv, w_out=P(axis_name, None), b_out=P(None), y=x,
        w_kv=P(None, None) if replicate_kv else w_qkv, b_kv=P(None) if replicate_kv else b_qkv,
        tokens=P(spec_entry(batch_axis), None),
    )  # fmt: skip


def init_attention(
    key: jax.Array,
    d_model: int,
    num_heads: int,
    head_dim: int,
    *,
    num_kv_heads: int | None = None,
    use_bias: bool = True,
    dtype=jnp.float32,
) -> dict[str, jax.Array]:
    """Full parameters of an attention block, independent of any mesh.

    Returns ``{"wq": w[d_model, H·hd], "wk", "wv": w[d_model, KV·hd], "bq": b[H·hd], "bk",
    "bv": b[KV·hd], "wo": w[H·hd, d_model], "bo": b[d_model]}`` (``KV = num_kv_heads``, default
    H; biases zero, or absent without ``use_bias``), each projection initialised as
    ``shardops.init_dense``. Shard it with ``shard_params(params, mesh,
    head_parallel_attention_specs(replicate_kv=...).params)``.
    """
    kv = num_heads if num_kv_heads is None else num_kv_heads
    for name, n in (("d_model", d_model), ("num_heads", num_heads), ("head_dim", head_dim),
                    ("num_kv_heads", kv)):  # fmt: skip
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"init_attention: {name} must be a positive int; got {n!r}")
    check_kv_groups("init_attention", num_heads, kv)
    inner, kv_inner = num_heads * head_dim, kv * head_dim
    shapes = {"q": (d_model, inner), "k": (d_model, kv_inner), "v": (d_model, kv_inner),
              "o": (inner, d_model)}  # fmt: skip
    params = {}
    for k, (name, (d_in, d_out)) in zip(jax.random.split(key, 4), shapes.items(), strict=True):
        dense = init_dense(k, d_in, d_out, use_bias=use_bias, dtype=dtype)
        params[f"w{name}"] = dense["w"]
        if use_bias:
            params[f"b{name}"] = dense["b"]
    return params


@scoped("head_parallel_attention")
def head_parallel_attention_kernel(
    x,
    params,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    rope_theta: float | None = None,
    positions=None,
    segment_ids=None,
    axis_name: str = MODEL_AXIS,
    sequence_parallel: bool = False,
    context=None,
    precision: Precision = FLOAT32,
    implementation: str = "auto",
):
    """Head-parallel self-attention on local blocks: ``x[B, S, D] → y[B, S, D]``, ``H/p`` heads per device.

    Arguments (local blocks, ``p`` = size of ``axis_name``, ``H = num_heads``, ``KV =
    num_kv_heads``):
        x: ``x[B, S, D]`` replicated over ``axis_name``; with ``sequence_parallel`` the
            sequence shard ``x[B, S/p, D]`` (device ``i`` holds positions ``i·S/p …``).
        params: local shards ``{"wq": w[D, (H/p)·hd], "wo": w[(H/p)·hd, D]}``, ``"wk", "wv"``
            either split by KV head, ``w[D, (KV/p)·hd]`` (p must divide KV), or replicated,
            ``w[D, KV·hd]`` (any KV; the kernel tells them apart by whether they vary over
            ``axis_name``), and optionally ``"bq"``, ``"bk", "bv"`` (laid out like their
            weights) and the replicated ``"bo": b[D]``. Device ``i`` holds query heads
            ``i·H/p … (i+1)·H/p − 1`` (columns ``h·hd … h·hd + hd − 1`` of the full ``wq`` are
            head ``h``, and likewise for ``wk``, ``wv`` and KV heads).
        num_heads: the global H; it must divide by ``p``.
        num_kv_heads: the global KV (default H); it must divide H.
        causal: position ``i`` attends to keys ``j ≤ i`` only.
        rope_theta: rotary position embeddings of base ``θ`` on q and k (Hugging Face's
            rotate-half convention, module docstring), or None for none. hd must be even.
        positions: ``positions[B, S]`` integers, each token's global position (the whole
            sequence, also under ``sequence_parallel``; replicated over ``axis_name``). Default:
            ``segment_positions(segment_ids)`` with ``segment_ids``, else ``0 … S−1``.
        segment_ids: ``segment_ids[B, S]`` integers (same layout): a query attends only to
            keys of its own segment.
        context: a ``shardops.layers.ContextParallel``: the sequence is also split over its
            mesh axis, in the load-balanced layout (``shardops.layers._context_attention``),
            and attention runs by its method. ``x``, ``positions`` and ``segment_ids`` then
            hold this device's block of the sequence (``S`` above is the block's length);
            positions default to the tokens' global positions, and with RoPE and
            ``segment_ids`` they must be given (a document may begin on another device).
        implementation: how each device computes its heads' attention, one of
            ``IMPLEMENTATIONS``: ``"auto"`` (splash on TPU under bf16 where it fits, else blocked),
            ``"blocked"``, ``"splash"`` or ``"einsum"`` (the S×S reference).

    Returns:
        ``y[B, S, D]`` in ``precision.compute_dtype``, replicated over ``axis_name``; with
        ``sequence_parallel`` the shard ``y[B, S/p, D]``.

    Communication over ``axis_name``:
        forward: one AllReduce ``y[B, S, D]{U_model} → y`` in ``accum_dtype`` (Megatron's "g").
        ``sequence_parallel``: AllGather ``x[B, S_model, D] → x[B, S, D]`` (in ``x``'s dtype)
        and ReduceScatter ``y{U_model} → y[B, S_model, D]`` instead.
        backward: one AllReduce of ``dx[B, S, D]{U_model}`` (Megatron's "f": the three
        projections' ``dx`` are summed locally first), in ``accum_dtype``, then cast to ``x``'s
        dtype once. ``sequence_parallel``: ReduceScatter of ``dx`` and AllGather of ``dy``, both
        in ``accum_dtype``, and an AllReduce of ``dbo[D]`` (``bo`` is replicated, ``y`` is not).
        Replicated ``wk``, ``wv``: an AllReduce of each of their gradients (and ``bk``, ``bv``'s).
        Attention itself, and every other weight gradient, is local; with ``x`` split over a
        batch axis, the weight gradients are all-reduced over that axis (in ``accum_dtype``).
    """
    op = "head_parallel_attention_kernel"
    _attention_core.check_implementation(op, implementation)
    p = bound_axis_size(axis_name, op)
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    heads, head_dim, shared = check_local(op, x, params, num_heads, kv_heads, p, axis_name,
                                          sequence_parallel)  # fmt: skip
    seq = x.shape[SEQUENCE_DIM] * (p if sequence_parallel else 1)
    if context is not None:  # the sequence block and the heads Ulysses sends, before any move
        context.check_local(op, seq, num_heads, kv_heads, p, shared,
                            sequence_split=p if sequence_parallel else 1)  # fmt: skip
    tokens = check_tokens(op, positions, segment_ids, (x.shape[0], seq), axis_name, rope_theta,
                           context)  # fmt: skip
    _rope.check_rope(op, rope_theta, head_dim)
    accum = precision.accum_dtype
    if sequence_parallel:
        # x_block[B, S/p, D] → x[B, S, D] once for Q, K, V; backward: one ReduceScatter of dx.
        with because(_GATHER, axis_name):
            x = gather_to_region(x, axis_name, SEQUENCE_DIM, accum)  # x[B, S, D] in accum
    else:
        # Megatron's "f" once for Q, K, V: identity forward, one AllReduce of dx backward.
        with because(_INPUT, axis_name):
            x = copy_to_region(x, axis_name, accum)  # x[B, S, D] in accum
    if shared:
        params, kv = shared_kv_heads(params, num_heads, kv_heads, p, head_dim, axis_name, accum)
    else:
        kv = _kv_heads.KvHeads(kv_heads // p, None)
    positions, segment_ids = tokens
    core = _attention_core.core_for(kv, heads, causal, segment_ids, precision, implementation,
                                    context)  # fmt: skip
    positions = global_positions(positions, x.shape[SEQUENCE_DIM], rope_theta, context)
    y_partial = heads_attention(x, params, heads, kv, head_dim, rope_theta, positions, precision,
                                core)  # fmt: skip
    bo = params.get("bo")
    if sequence_parallel:
        with because(PARTIAL_SUMS, axis_name):  # y[B, S/p, D] in accum
            y = reduce_scatter_from_region(y_partial, axis_name, SEQUENCE_DIM)
        if bo is not None:
            # bo[D] is replicated but y is a sequence shard: dbo is all-reduced over model.
            with because(_BIAS, axis_name):
                bo = copy_to_region(bo, axis_name, accum)  # bo[D] in accum
    else:
        with because(PARTIAL_SUMS, axis_name):
            y = reduce_from_region(y_partial, axis_name)  # y[B, S, D] in accum
    return precision.finish(y, bo)  # + bo once, after the reduction; y in compute dtype


def shared_kv_heads(params, num_heads, kv_heads, p, head_dim, axis_name, accum):
    """Replicated ``wk``, ``wv`` (``bk``, ``bv``): this device's slice of the KV heads its query
    heads read, entered into the region (the backward AllReduces their gradients).

    Device ``i``'s query heads ``i·H/p + j`` read KV heads ``(i·H/p + j) // g`` (``g = H/KV``):
    a run of at most ``count`` consecutive heads (the longest run over the devices; 1 when KV
    divides p), sliced from ``first = min(lowest, KV − count)``.
    """
    local, group = num_heads // p, num_heads // kv_heads
    runs = [((i + 1) * local - 1) // group - (i * local) // group + 1 for i in range(p)]
    count = max(runs)
    i = lax.axis_index(axis_name)
    first = jnp.minimum((i * local) // group, kv_heads - count)  # first KV head it projects
    index = (i * local + jnp.arange(local)) // group - first  # [H/p]: local KV head per query
    sliced = dict(params)
    for name in KV_KEYS:
        if name in params:
            with because(_SHARED_KV, axis_name):
                w = copy_to_region(params[name], axis_name, accum)  # w[D, KV·hd] in accum
            dim = w.ndim - 1  # the heads × head_dim dim of w[D, KV·hd] and b[KV·hd]
            if count < kv_heads:
                w = lax.dynamic_slice_in_dim(w, first * head_dim, count * head_dim, axis=dim)
            sliced[name] = w  # w[D, count·hd] in accum
    return sliced, _kv_heads.KvHeads(count, None if count == 1 else index)


def heads_attention(x, params, heads: int, kv: _kv_heads.KvHeads, head_dim: int, rope_theta,
                    positions, precision: Precision, core):  # fmt: skip
    """The local heads' attention and output projection: ``x[B, S, D]`` → ``y[B, S, D]``, in
    ``accum_dtype``, a partial sum over heads when the heads are split (``y{U_model}``).

    ``core(q, k, v) → o``: the attention of ``q[B, H/p, S, hd]`` over the projected (and
    rotated) ``k, v[B, kv.count, S, hd]``, ``o[B, H/p, S, hd]`` in accum (``core_for``: this
    device's sequence, or the whole sequence by a context method). ``positions[B or 1, S]``:
    the tokens' global positions for the rotation (None: ``0 … S−1``)."""
    batch, seq, _ = x.shape
    q, k, v = projections(x, params, heads, kv.count, precision)  # q[B, H/p, S, hd], k, v
    if rope_theta is not None:
        cos, sin = _rope.rotation(positions, seq, head_dim, rope_theta)  # [B, 1, S, hd/2] each
        q, k = _rope.rotate(q, cos, sin), _rope.rotate(k, cos, sin)
    o = core(q, k, v)  # o[B, H/p, S, hd] in accum
    o = o.transpose(0, 2, 1, 3).reshape(batch, seq, heads * head_dim)  # o[B, S, (H/p)·hd]
    return precision.matmul(o, params["wo"])  # y[B, S, D] in accum


def attention(
    x,
    params,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = False,
    rope_theta: float | None = None,
    positions=None,
    segment_ids=None,
    precision: Precision = FLOAT32,
    implementation: str = "auto",
):
    """Unsharded multi-head self-attention: ``x[B, S, D] → y[B, S, D]``, no collectives.

    The same computation (and precision discipline) as ``head_parallel_attention_kernel`` with
    every head on one device: the reference it is checked against, and the attention of a
    strategy that does not split heads. ``params`` as ``init_attention`` makes them; the other
    arguments as the kernel's (``positions``, ``segment_ids``: ``[B, S]`` integers;
    ``implementation``: one of ``IMPLEMENTATIONS``, ``"einsum"`` for the S×S reference).
    """
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    op = "attention"
    _attention_core.check_implementation(op, implementation)
    check_args(op, x, params, num_heads, kv_heads, causal, precision, dtypes=False)
    head_dim = params["wq"].shape[1] // num_heads
    _rope.check_rope(op, rope_theta, head_dim)
    tokens = check_tokens(op, positions, segment_ids, x.shape[:2], None, rope_theta)
    x = x.astype(precision.accum_dtype)  # x[B, S, D] in accum, as the kernel's region entry
    kv = _kv_heads.KvHeads(kv_heads, None)
    positions, segment_ids = tokens
    core = _attention_core.core_for(kv, num_heads, causal, segment_ids, precision, implementation)
    y = heads_attention(x, params, num_heads, kv, head_dim, rope_theta, positions, precision, core)
    return precision.finish(y, params.get("bo"))  # y in compute dtype


def global_positions(positions, seq: int, rope_theta, context):
    """The rotation's positions: ``positions``, or under ``context`` (given none, with RoPE)
    this device's tokens' global positions ``[1, S]`` (``ContextParallel.positions``)."""
    if rope_theta is not None and positions is None and context is not None:
        return context.positions(seq)[None]  # [1, S]: the tokens' global positions
    return positions


def projections(x, params, heads: int, kv_heads: int, precision: Precision):
    """``q[B, H/p, S, hd]``, ``k, v[B, n, S, hd]`` in ``accum_dtype``: the three projections of
    ``x[B, S, D]``, one product per weight, ``x`` rounded once for all three
    (``Precision.matmuls``: the backward keeps one copy of it and sums their ``dx`` in accum)."""
    yq, yk, yv = precision.matmuls(x, (params["wq"], params["wk"], params["wv"]))
    q = _heads(yq, params.get("bq"), heads, precision)  # q[B, H/p, S, hd]
    k = _heads(yk, params.get("bk"), kv_heads, precision)  # k[B, n, S, hd]
    v = _heads(yv, params.get("bv"), kv_heads, precision)  # v[B, n, S, hd]
    return q, k, v


def _heads(y, b, heads: int, precision: Precision):
    """``y[B, S, n·hd] + b → [B, n, S, hd]`` in ``accum_dtype``: ``n`` heads.

    Column ``h·hd + d`` of the local ``w`` is dim ``d`` of local head ``h``. (The attention
    products are then batched over one leading dim, ``[B·H/p]``: XLA:CPU cannot run some
    layouts of a bf16 product with two batch dims, ``[B, H/p]``.)
    """
    if b is not None:
        y = y + b.astype(precision.accum_dtype)  # [B, S, n·hd]
    batch, seq, _ = y.shape
    return y.reshape(batch, seq, heads, -1).transpose(0, 2, 1, 3)  # [B, n, S, hd]


def head_parallel_attention(
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
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    sequence_parallel: bool = False,
    precision: Precision = FLOAT32,
    implementation: str = "auto",
):
    """Head-parallel self-attention on global arrays: ``x[B, S, D] → y[B, S, D]``, heads split over ``model``.

    Arguments:
        x: ``x[B, S, D]`` in ``precision.compute_dtype``, split over ``batch_axis`` (if given)
            along B; with ``sequence_parallel`` also over ``axis_name`` along S (S must divide).
        params: full-shape parameters as ``init_attention`` makes them, in
            ``precision.param_dtype``, laid out as ``head_parallel_attention_specs(...).params``
            (or left to ``shard_map`` to place): ``wq: w[D, H·hd]``, ``wk, wv: w[D, KV·hd]``,
            ``wo: w[H·hd, D]``, optional biases ``bq: b[H·hd]``, ``bk, bv: b[KV·hd]``,
            ``bo: b[D]``. K/V split by KV head when ``axis_name``'s size divides KV, else they
            are replicated (``replicate_kv``).
        mesh: the mesh (Auto or Explicit axes).
        num_heads: H; it must divide by the size of ``axis_name`` (each device holds whole
            heads), and ``wq.shape[1]`` by H (``hd = wq.shape[1] / H``).
        num_kv_heads: KV key/value heads (default H; 1 is multi-query attention); it must
            divide H. Query head ``j`` reads KV head ``j // (H/KV)``.
        causal: position ``i`` attends to keys ``j ≤ i`` only.
        rope_theta: rotary position embeddings of base ``θ`` (Hugging Face's rotate-half
            convention; module docstring), or None.
        positions: ``positions[B, S]`` integers, laid out as ``specs.tokens`` (the whole
            sequence, split over ``batch_axis`` only); default as the kernel's.
        segment_ids: ``segment_ids[B, S]`` integers (same layout): attention within a segment.
        sequence_parallel: take and return the sequence shard ``x[B, S_model, D]``.
        implementation: one of ``IMPLEMENTATIONS`` (``"auto"``: splash on TPU under bf16 where it fits,
            else the blocked online softmax; ``"einsum"``: the S×S reference).

    Returns:
        ``y[B, S, D]`` in ``precision.compute_dtype``, laid out as ``head_parallel_attention_specs(...).y``.

    Communication: see ``head_parallel_attention_kernel``. Forward one AllReduce of
    ``y[B, S, D]`` over ``axis_name``; backward one AllReduce of ``dx[B, S, D]`` (and, with
    replicated K/V, one of each of their gradients). With ``sequence_parallel``: AllGather ``x``
    and ReduceScatter ``y`` forward, AllGather ``dy`` and ReduceScatter ``dx`` (+ AllReduce of
    ``dbo[D]``) backward.
    """
    op = "head_parallel_attention"
    _attention_core.check_implementation(op, implementation)
    check_axes(mesh, axis_name, batch_axis)
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    check_args(op, x, params, num_heads, kv_heads, causal, precision)
    _rope.check_rope(op, rope_theta, params["wq"].shape[1] // num_heads)
    check_tokens(op, positions, segment_ids, x.shape[:2], None, rope_theta)
    p = axis_size(mesh, axis_name)
    check_head_counts(op, num_heads, kv_heads, axis_name, p)
    check_divisible(
        argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh, axes=(batch_axis,)
    )
    if sequence_parallel:
        check_divisible(argument="x", dim=SEQUENCE_DIM, dim_name="sequence", size=x.shape[1],
                        mesh=mesh, axes=(axis_name,))  # fmt: skip
    specs = head_parallel_attention_specs(
        axis_name=axis_name, batch_axis=batch_axis, sequence_parallel=sequence_parallel,
        replicate_kv=not splits_kv_heads(kv_heads, p),
    )  # fmt: skip
    param_specs = {name: specs.params[name] for name in params}
    kernel = functools.partial(
        head_parallel_attention_kernel,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        causal=causal,
        rope_theta=rope_theta,
        axis_name=axis_name,
        sequence_parallel=sequence_parallel,
        precision=precision,
        implementation=implementation,
    )
    args, in_specs = {"x": x, "params": params}, {"x": specs.x, "params": param_specs}
    for name, tokens in (("positions", positions), ("segment_ids", segment_ids)):
        if tokens is not None:
            args[name], in_specs[name] = tokens, specs.tokens
    names = tuple(args)

    def run(*values):
        given = dict(zip(names, values, strict=True))
        return kernel(given.pop("x"), given.pop("params"), **given)

    return run_layer(op, run, mesh, args, in_specs, specs.y)
