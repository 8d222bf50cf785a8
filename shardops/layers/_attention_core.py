"""How each device computes its heads' softmax attention: the implementations (einsum, blocked,
splash), the choice ``"auto"`` makes between them, and the core that runs one.

``core_for`` hands ``heads_attention`` (``shardops.layers._attention``) its ``core(q, k, v) →
o``: the attention of this device's query heads ``q[B, H/p, S, hd]`` over its projected (and
rotated) ``k, v[B, n, S, hd]``, ``o[B, H/p, S, hd]`` in ``accum_dtype``, over this device's own
sequence (``_core``), or by a context-parallel method. No communication here: every collective
of the attention block is in its kernel, or in the context method's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from shardops._precision import FLOAT32, Precision
from shardops.layers import _attention_reference, _flash, _kv_heads, _masks

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


def local_attention(q, k, v, *, causal: bool = False, segment_ids=None,
                    precision: Precision = FLOAT32, implementation: str = "auto",
                    context=None):  # fmt: skip
    """Softmax attention of one device's query heads over its keys, by ``implementation``:
    what each device computes inside head-parallel attention, for attention code of one's own
    (a foreign model's ``dot_product_attention``). No communication, unless ``context``.

    Arguments:
        q: the queries, shape ``(B, H, S, hd)``.
        k, v: the keys and values, shape ``(B, n, S, hd)`` with ``H % n == 0`` (query head
            ``j`` reads KV head ``j // (H/n)``).
        causal: mask the keys after each query.
        segment_ids: optional ``(B, S)``: a query sees only keys of its own segment.
        precision: the policy (products in its compute dtype, accumulated in its accum dtype).
        implementation: one of ``IMPLEMENTATIONS`` (``"auto"``: splash on TPU under a bf16
            compute dtype where it fits, else blocked).
        context: a ``ContextParallel`` (inside ``shard_map``, its axis bound): ``q``, ``k``,
            ``v`` and ``segment_ids`` are this device's block ``S = S_global / N`` of the
            load-balanced layout (``balanced_order``), and each query attends over the whole
            sequence by the context method (K/V gathered, passed round a ring, or Ulysses'
            all-to-all), causal by the tokens' global positions.

    Returns:
        ``o[B, H, S, hd]`` in ``precision.accum_dtype``.
    """
    check_implementation("local_attention", implementation)
    fits = (q.ndim == k.ndim == v.ndim == 4 and k.shape == v.shape and k.shape[1] > 0
            and (k.shape[0], k.shape[2], k.shape[3]) == (q.shape[0], q.shape[2], q.shape[3])
            and q.shape[1] % k.shape[1] == 0)  # fmt: skip
    if not fits:
        raise ValueError(
            f"local_attention: q[B, H, S, hd] over k, v[B, n, S, hd] (the same B, S and hd; "
            f"n ≥ 1 dividing H: query head j reads KV head j // (H/n)); got q{tuple(q.shape)}, "
            f"k{tuple(k.shape)}, v{tuple(v.shape)}. Transpose [B, S, heads, hd] inputs to "
            f"[B, heads, S, hd], or repeat K/V to a head count dividing H"
        )
    if context is not None:
        context.check_local("local_attention", q.shape[2], q.shape[1], k.shape[1])
    core = core_for(_kv_heads.KvHeads(k.shape[1], None), q.shape[1], causal, segment_ids,
                    precision, implementation, context)  # fmt: skip
    with jax.named_scope("shardops.local_attention"):
        return core(q, k, v)


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
