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

Notation (the JAX scaling book): ``w[D, F_model]`` is split over ``model`` along F;
``y[B, S, D]{U_model}`` holds partial sums not yet reduced over ``model``; ``p`` is the size of
``model``; ``H`` the number of query heads, ``KV`` of key/value heads, ``hd`` the head dim.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardops._axes import MODEL_AXIS, SEQUENCE_DIM
from shardops._mesh import axis_size, check_divisible, spec_entry, varying_axes
from shardops._precision import FLOAT32, Precision
from shardops.comm._mappings import (
    copy_to_region,
    gather_to_region,
    reduce_from_region,
    reduce_scatter_from_region,
)
from shardops.comm._reasons import Reason, because
from shardops.layers import _attention_reference, _flash, _kv_heads, _masks, _rope
from shardops.layers._common import (
    bound_axis_size,
    check_axes,
    check_precision,
    check_replicated_over,
    check_sharded_over,
    run_layer,
    scoped,
)
from shardops.layers._params import init_dense

PROJECTIONS = ("wq", "wk", "wv", "wo")
BIASES = ("bq", "bk", "bv", "bo")
KV_KEYS = ("wk", "wv", "bk", "bv")

IMPLEMENTATIONS = ("auto", "einsum", "blocked", "splash")
"""How each device computes its heads' softmax attention (``implementation=``):

- ``"einsum"``: the ``[B, H, S, S]`` scores and probabilities in float32, kept for the backward
  (the reference: memory O(S²) per head);
- ``"blocked"``: ``shardops.layers.blocked_attention``'s online softmax over key blocks of
  ``BLOCK_K``, in plain JAX on any backend (memory O(S·BLOCK_K); the backward recomputes the
  blocks from the log-sum-exp);
- ``"splash"``: JAX's Pallas splash-attention kernel (``shardops.layers._splash``), for
  head-parallel attention over the whole sequence; S and hd multiples of 128. Asked for
  explicitly on CPU it runs in Pallas's interpreter (slow: for tests); on a GPU it is refused.
  Context-parallel attention (its keys are in the load-balanced order, its ring steps merge
  partial results) and decoding (one query against a cache) run the blocked path instead;
- ``"auto"`` (the default): ``"splash"`` on TPU under a bf16 compute dtype where its shapes
  fit, else ``"blocked"``.
"""

BLOCK_K = 512
"""Keys per block of the blocked path (``shardops.layers.blocked_attention``'s ``block_k``)."""

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
    _check_groups("init_attention", num_heads, kv)
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
    check_implementation(op, implementation)
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
    core = core_for(kv, heads, causal, segment_ids, precision, implementation, context)
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


def check_implementation(op: str, implementation, argument: str = "implementation") -> str:
    """``implementation`` if it is one of ``IMPLEMENTATIONS``, else a ValueError naming them
    (and ``argument``, the caller's name for it)."""
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{op}: {argument}={implementation!r} is not an attention implementation; "
            f"expected one of {IMPLEMENTATIONS} ('auto' picks 'splash' on TPU, else 'blocked'; "
            f"'einsum' is the S×S reference)."
        )
    return implementation


def _splash_block(seq: int) -> int | None:
    """The largest block splash can take for ``seq`` tokens: a multiple of 128 up to
    ``BLOCK_K`` that divides ``seq`` (None: none does)."""
    return next((b for b in range(BLOCK_K, 0, -128) if seq % b == 0), None)


def _local_implementation(implementation: str, q, k, precision: Precision) -> str:
    """The implementation one device runs for ``q[B, H, S, hd]`` over ``k[B, n, S, hd]``:
    ``"auto"`` is splash on TPU for a bf16 compute dtype where the kernel takes the shapes
    (its products are not float32 × float32 at ``Precision.HIGHEST``: under ``FLOAT32`` the
    blocked path keeps the policy), else blocked."""
    if implementation != "auto":
        return implementation
    if jax.default_backend() != "tpu" or precision.compute_dtype != np.dtype(jnp.bfloat16):
        return "blocked"
    from shardops.layers import _splash  # Pallas TPU: imported only where it can run

    block = _splash_block(q.shape[2])
    if block is None or _splash.splash_unsupported_reason(q.shape, k.shape, block=block):
        return "blocked"
    return "splash"


def _core(q, k, v, kv: _kv_heads.KvHeads, heads: int, causal: bool, segment_ids,
          precision: Precision, implementation: str):  # fmt: skip
    """``o[B, H/p, S, hd]`` in accum: softmax attention of ``q[B, H/p, S, hd]`` over ``k, v[B,
    n, S, hd]`` (the whole sequence on this device) by ``implementation``: the blocked core
    (``_flash.attend``), splash, or the einsum reference."""
    if implementation == "einsum":  # the S×S reference
        k, v = _kv_heads.for_query_heads(k, kv, heads), _kv_heads.for_query_heads(v, kv, heads)
        positions = jnp.arange(q.shape[2], dtype=jnp.int32)  # [S]
        visible = _masks.visible(positions, positions, segment_ids, segment_ids, causal)
        return _attention_reference.einsum_attention(q, k, v, visible, precision)
    if kv.index is not None:  # replicated K/V read by index: each query head's own KV head
        k, v = _kv_heads.for_query_heads(k, kv, heads), _kv_heads.for_query_heads(v, kv, heads)
    if _local_implementation(implementation, q, k, precision) == "splash":
        from shardops.layers import _splash

        backend = jax.default_backend()
        if backend not in ("tpu", "cpu"):
            raise ValueError(
                f"implementation='splash' runs JAX's Pallas TPU kernel: on a TPU, or on CPU in "
                f"Pallas's interpreter (for tests); this backend is {backend!r}. Use "
                f"implementation='blocked' (or 'auto', which picks it here)."
            )
        block = _splash_block(q.shape[2]) or BLOCK_K  # none fits: splash names the problem
        return _splash.splash_attention(q, k, v, causal=causal, segment_ids=segment_ids,
                                        precision=precision, block=block,
                                        interpret=backend == "cpu")  # fmt: skip
    positions = jnp.arange(q.shape[2], dtype=jnp.int32)  # [S]
    return _flash.attend(q, k, v, q_positions=positions, k_positions=positions,
                         q_segments=segment_ids, k_segments=segment_ids, causal=causal,
                         block_k=BLOCK_K, precision=precision)  # fmt: skip


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
    check_implementation(op, implementation)
    check_args(op, x, params, num_heads, kv_heads, causal, precision, dtypes=False)
    head_dim = params["wq"].shape[1] // num_heads
    _rope.check_rope(op, rope_theta, head_dim)
    tokens = check_tokens(op, positions, segment_ids, x.shape[:2], None, rope_theta)
    x = x.astype(precision.accum_dtype)  # x[B, S, D] in accum, as the kernel's region entry
    kv = _kv_heads.KvHeads(kv_heads, None)
    positions, segment_ids = tokens
    core = core_for(kv, num_heads, causal, segment_ids, precision, implementation)
    y = heads_attention(x, params, num_heads, kv, head_dim, rope_theta, positions, precision, core)
    return precision.finish(y, params.get("bo"))  # y in compute dtype


def core_for(kv: _kv_heads.KvHeads, heads: int, causal: bool, segment_ids, precision: Precision,
             implementation: str, context=None):  # fmt: skip
    """``core(q, k, v) → o`` for ``heads_attention``: this device's heads over its own sequence
    (``_core``), or with ``context`` (a ``ContextParallel``) its block's queries over the
    whole sequence by the context method (``ContextParallel.attend``)."""
    if context is None:
        return functools.partial(_core, kv=kv, heads=heads, causal=causal,
                                 segment_ids=segment_ids, precision=precision,
                                 implementation=implementation)  # fmt: skip
    return functools.partial(context.attend, kv=kv, heads=heads, causal=causal,
                             segment_ids=segment_ids, precision=precision,
                             implementation=implementation)  # fmt: skip


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
    check_implementation(op, implementation)
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


# --- checks -----------------------------------------------------------------------------------


def check_head_counts(op: str, num_heads: int, num_kv_heads: int, axis_name: str, p: int):
    """Heads that can be split over ``axis_name`` (size ``p``), else a ValueError naming the
    heads, the KV heads and the axis."""
    _check_groups(op, num_heads, num_kv_heads)
    if num_heads % p:
        raise ValueError(
            f"{op}: num_heads={num_heads} is not divisible by mesh axis {axis_name!r} (size "
            f"{p}); each device must hold whole query heads (num_kv_heads={num_kv_heads}). "
            f"Choose num_heads a multiple of {p} (e.g. {-(-num_heads // p) * p}), or a mesh "
            f"whose {axis_name!r} axis divides {num_heads}."
        )


def _check_groups(op: str, num_heads, num_kv_heads) -> None:
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"{op}: num_kv_heads must be a positive int; got {num_kv_heads!r}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{op}: num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}; each "
            f"key/value head serves a group of num_heads/num_kv_heads query heads. Choose "
            f"num_kv_heads among {[d for d in range(1, num_heads + 1) if num_heads % d == 0]}."
        )


def check_tokens(op: str, positions, segment_ids, shape, axis_name, rope_theta, context=None):
    """``positions`` and ``segment_ids``: ``[B, S]`` integers (replicated over ``axis_name``
    inside the kernel); returns them with the default positions filled in (None without RoPE,
    or under ``context``, where the kernel fills in the tokens' global positions)."""
    if positions is not None and rope_theta is None:
        raise ValueError(
            f"{op}: positions are given but rope_theta is None; positions only place the rotary "
            f"embeddings. Pass rope_theta (e.g. 10000.0), or drop positions."
        )
    for name, tokens in (("positions", positions), ("segment_ids", segment_ids)):
        if tokens is None:
            continue
        if not hasattr(tokens, "shape") or not jnp.issubdtype(tokens.dtype, jnp.integer):
            got = getattr(tokens, "dtype", type(tokens).__name__)
            raise TypeError(f"{op}: {name} must be an integer array [B, S]; got {got}")
        if tuple(tokens.shape) != tuple(shape):
            raise ValueError(
                f"{op}: {name} must have shape (B, S) = {tuple(shape)}, one per token of the "
                f"whole sequence (also under sequence parallelism); got {tuple(tokens.shape)}"
            )
        if axis_name is not None:
            check_replicated_over(tokens, axis_name, name, op)
    if rope_theta is not None and positions is None and segment_ids is not None:
        if context is not None:
            raise ValueError(
                f"{op}: with rotary embeddings, segment_ids and a sequence split over "
                f"{context.axis_name!r}, pass positions: a document may begin on another "
                f"device. Compute segment_positions(segment_ids) on the whole sequence and "
                f"give each device its tokens' (context_parallel_attention does)."
            )
        positions = _rope.segment_positions(segment_ids)  # restart at each document
    return positions, segment_ids


def check_args(op: str, x, params, num_heads, num_kv_heads, causal, precision, *,
                dtypes=True) -> None:  # fmt: skip
    """Global shapes, dtypes (unless ``dtypes=False``: params may arrive in ``accum_dtype``,
    as a strategy's gathers give them) and names, before anything is traced."""
    check_precision(op, precision)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"{op}: num_heads must be a positive int; got {num_heads!r}")
    _check_groups(op, num_heads, num_kv_heads)
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool; got {causal!r}")
    if not hasattr(x, "shape") or len(x.shape) != 3:
        got = f"shape {tuple(x.shape)}" if hasattr(x, "shape") else type(x).__name__
        raise ValueError(
            f"{op}: x must have rank 3 (x[B, S, D]: batch, sequence, features); got {got}. "
            f"A single sequence is x[None]; a batch of vectors is x[:, None, :]."
        )
    _check_param_names(op, params)
    for name, arg in params.items():
        if not hasattr(arg, "shape") or not hasattr(arg, "dtype"):
            raise TypeError(f"{op}: params[{name!r}] must be an array; got {type(arg).__name__}")
    shapes = {name: tuple(a.shape) for name, a in params.items()}
    d_model = x.shape[-1]
    wq = shapes["wq"]
    if len(wq) != 2 or wq[0] != d_model:
        raise ValueError(
            f"{op}: wq must have shape (D, H·hd) with D = x's features = {d_model}; got wq{wq}"
        )
    inner = wq[1]
    if inner % num_heads:
        raise ValueError(
            f"{op}: wq dim 1 (heads × head_dim) = {inner} is not divisible by "
            f"num_heads={num_heads}; wq must be w[D, num_heads · head_dim]"
        )
    head_dim = inner // num_heads
    kv_inner = num_kv_heads * head_dim
    expected = {"wk": (d_model, kv_inner), "wv": (d_model, kv_inner), "wo": (inner, d_model),
                "bq": (inner,), "bk": (kv_inner,), "bv": (kv_inner,), "bo": (d_model,)}  # fmt: skip
    for name, want in expected.items():
        if name in shapes and shapes[name] != want:
            hint = ""
            cols = shapes[name][-1]
            if (
                name in ("wk", "wv")
                and cols % head_dim == 0
                and num_heads % (cols // head_dim) == 0
            ):
                hint = (f" For grouped-query attention with {cols // head_dim} KV heads pass "
                        f"num_kv_heads={cols // head_dim}.")  # fmt: skip
            raise ValueError(
                f"{op}: {name} has shape {shapes[name]} but wq{wq} with num_heads={num_heads} "
                f"means head_dim={head_dim} and D={d_model}, so {name} must be {want}"
                f"{f' (num_kv_heads={num_kv_heads})' if name in KV_KEYS else ''}. Q uses "
                f"heads × head_dim, K and V "
                f"KV heads × head_dim; wo maps the heads back to D.{hint}"
            )
    if dtypes:
        precision.check_activation("x", x.dtype)
        for name, arg in params.items():
            precision.check_param(f"params[{name!r}]", arg.dtype)


def _check_param_names(op: str, params) -> None:
    if not isinstance(params, dict):
        raise TypeError(
            f"{op}: params must be a dict like init_attention's; got {type(params).__name__}"
        )
    missing = [n for n in PROJECTIONS if n not in params]
    unknown = sorted(set(params) - set(PROJECTIONS) - set(BIASES))
    if missing or unknown:
        raise ValueError(
            f"{op}: params needs {list(PROJECTIONS)} and may hold {list(BIASES)}; "
            f"missing {missing}, unknown {unknown}"
        )


def check_local(op, x, params, num_heads, num_kv_heads, p, axis_name, sequence_parallel):
    """Local blocks inside ``shard_map``: heads per device, head dim, and whether K/V are
    replicated over ``axis_name`` (shared KV heads)."""
    _check_param_names(op, params)
    check_head_counts(op, num_heads, num_kv_heads, axis_name, p)
    for name in ("wq", "wo"):
        check_sharded_over(params[name], axis_name, name, op)
    kv_split = {name: axis_name in varying_axes(params[name]) for name in KV_KEYS if name in params}
    if len(set(kv_split.values())) > 1:
        raise ValueError(
            f"{op}: wk, wv (and bk, bv) must all be split over mesh axis {axis_name!r} or all "
            f"replicated over it; split: {sorted(k for k, s in kv_split.items() if s)}, "
            f"replicated: {sorted(k for k, s in kv_split.items() if not s)}"
        )
    shared = not kv_split["wk"]
    if not shared and num_kv_heads % p:
        raise ValueError(
            f"{op}: num_kv_heads={num_kv_heads} is not divisible by mesh axis {axis_name!r} "
            f"(size {p}), so wk and wv cannot split by KV head (num_heads={num_heads}). Give "
            f"them (and bk, bv) replicated in_specs, head_parallel_attention_specs("
            f"replicate_kv=True): each device then projects the KV heads its query heads read."
        )
    if x.ndim != 3:
        raise ValueError(f"{op}: x must be the local block x[B, S, D]; got shape {x.shape}")
    if sequence_parallel:
        if axis_name not in varying_axes(x):
            raise ValueError(
                f"{op}: with sequence_parallel, x must be the sequence shard x[B, S/p, D], "
                f"split over mesh axis {axis_name!r}; it is replicated over it. Split S in "
                f"shard_map's in_specs, or pass sequence_parallel=False."
            )
    else:
        check_replicated_over(x, axis_name, "x", op)
    heads = num_heads // p
    wq = params["wq"]
    if wq.ndim != 2 or wq.shape[0] != x.shape[-1] or wq.shape[1] % heads:
        raise ValueError(
            f"{op}: local wq{tuple(wq.shape)} must be w[D, (H/p)·hd] with D = {x.shape[-1]} "
            f"and H/p = {num_heads}/{p} = {heads} heads on this device"
        )
    head_dim = wq.shape[1] // heads
    kv_local = num_kv_heads if shared else num_kv_heads // p
    for name in ("wk", "wv"):
        w = params[name]
        if tuple(w.shape) != (x.shape[-1], kv_local * head_dim):
            how = "replicated" if shared else "split by KV head"
            raise ValueError(
                f"{op}: local {name}{tuple(w.shape)} must be w[D, {kv_local}·hd] = "
                f"{(x.shape[-1], kv_local * head_dim)}: num_kv_heads={num_kv_heads} {how} over "
                f"{axis_name!r} (size {p}), hd={head_dim}"
            )
    return heads, head_dim, shared
