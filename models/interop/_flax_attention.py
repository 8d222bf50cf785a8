"""The attention functions a Flax module calls, run by the strategy while ``FlaxModel`` runs it.

``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` and ``nnx.dot_product_attention``,
looked up by attribute when the module calls them, are replaced for the duration of the
module's call (``attention_by``; restored after, whatever happens) by one that runs
``shardops.layers.local_attention`` on the device's heads, the implementation ``build``'s
``attention=`` chose (blocked, splash on TPU, einsum). The replacement is process-wide while it
lasts: another thread tracing a model at the same moment would see it too.

Under context parallelism (a ``+ring``, ``+allgather`` or ``+ulysses`` strategy) each device's
queries attend over the whole sequence by the strategy's method
(``shardops.layers.local_attention(..., context=...)``); what the method does not compute (a
mask, a bias) is refused there, since JAX's own would see the device's block alone. The calls
are counted: a forward under cp that made none attends by code of its own, which is refused
(``FlaxModel``).

Each device holds whole heads under tp (the projections are split by head), so the attention
needs no collective, provided the device's query heads and KV heads are the same groups as the
model's: ``q[B, T, H/p, h]`` over ``k, v[B, T, KV/p, h]`` (or K/V repeated to ``H/p`` heads
first, as ``nnx.dot_product_attention`` takes them). That is checked against the heads the model declares (``FlaxModel(num_heads=,
num_kv_heads=)``, required under tp): K/V replicated while the query heads are split (a rule
leaving ``kv_heads`` unsplit) would pair each device's query heads with the wrong KV heads, and
is refused where the attention sees it (``jax.nn.dot_product_attention`` takes K/V as the
model's KV heads: a device's ``KV`` replicated heads are not its ``KV/p``). Where K/V are
repeated first (``nnx.dot_product_attention``), or the module writes its attention itself,
the replicated heads look like the repeated ones: its rules must split the KV heads with the
query heads (``docs/flax.md``).
"""

from __future__ import annotations

import contextlib
import math

import jax
from flax import nnx

import shardops
from shardops import MODEL_AXIS

ATTENTION_FUNCTIONS = ((jax.nn, "dot_product_attention"), (nnx, "dot_product_attention"))
"""The attention functions a module may call by attribute (``jax.nn.dot_product_attention(q, k,
v, is_causal=True)``, ``nnx.dot_product_attention``): during the module's call they run the
strategy's per-device attention (``build(attention=...)``: blocked, splash, einsum)."""


@contextlib.contextmanager
def attention_by(ctx, heads: tuple[int | None, int | None]):
    """``ATTENTION_FUNCTIONS`` replaced by ``ctx``'s per-device attention while the module runs
    (restored after, whatever happens); ``heads``: the model's declared ``(H, KV)``. Yields
    the list of the calls' names, one per call."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in ATTENTION_FUNCTIONS]
    calls: list[str] = []
    context = context_of(ctx)
    for owner, name, original in saved:
        where = f"{owner.__name__}.{name}"
        setattr(owner, name, _local_attention(ctx, where, original, heads, owner is nnx, context,
                                              calls))  # fmt: skip
    try:
        yield calls
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def context_of(ctx):
    """The context-parallel attention of ``ctx``'s strategy (``shardops.layers.ContextParallel``,
    as its kinds give it to an attention layer: ``Kind.attention_options``), or None."""
    options = {"positions": None, "segment_ids": None, "rope_theta": None}
    for kind in ctx.strategy.kinds:
        options = kind.attention_options(ctx, options)
    return options.get("context")


def check_local_heads(ctx, where: str, query_heads: int, kv_heads: int, declared,
                      repeated: bool) -> None:  # fmt: skip
    """The device's query and KV heads are the model's heads split alike over the tp axis
    (``declared``: ``(H, KV)``, ``KV`` defaulting to ``H``; ``repeated``: K/V may come repeated
    to the query heads, as ``nnx.dot_product_attention`` takes them), else a ValueError."""
    p = ctx.axis_size(MODEL_AXIS) if ctx.axis_name(MODEL_AXIS) is not None else 1
    if p == 1:
        return
    heads, kv = declared
    if heads is None:
        raise ValueError(
            f"{where} under tensor parallelism over {MODEL_AXIS!r} (size {p}): declare the "
            f"model's heads, FlaxModel(num_heads=..., num_kv_heads=...), so that shardops can "
            f"check that each device's query heads and KV heads are the same groups"
        )
    kv = kv or heads
    # K/V as the model splits them, or repeated to the query heads first (MHA form).
    allowed = (kv // p, heads // p) if repeated else (kv // p,)
    if query_heads != heads // p or kv_heads not in allowed or heads % p or kv % p:
        raise ValueError(
            f"{where}: this device holds {query_heads} query heads and {kv_heads} KV heads; "
            f"the model's {heads} and {kv} split over {MODEL_AXIS!r} (size {p}) give "
            f"{heads / p:g} and {kv / p:g}. Map the query heads' and the KV heads' logical "
            f"names both to {MODEL_AXIS!r} (K/V replicated while the query heads are split "
            f"would pair them wrongly), with a tp axis that divides both"
        )


def _local_attention(ctx, where: str, original, declared, repeated: bool, context, calls):
    """``where(query, key, value, ...)`` on this device's heads: ``q[B, T, N, h]`` over ``k,
    v[B, T, K, h]`` (K divides N: query head j reads KV head j // (N/K)), causal or not, by the
    layer context's attention core (``build(attention=...)``); ``o[B, T, N, h]`` in the query's
    dtype. Called with what the core does not compute (a mask, a bias, another scale, lengths,
    a window: ``nnx.dot_product_attention`` passes its mask on) it runs ``original``, JAX's own,
    on the device's heads: a mask or bias over all heads broadcasts (``[B, 1, T, S]``), one per
    head of the whole model does not fit the device's heads and fails there. Dropout is
    refused: each device would draw its own. Under context parallelism (``context``) the
    device's block of the sequence attends over the whole of it by the context method; JAX's
    own would see the block alone, so what the method does not compute is refused."""

    def attention(query, key, value, bias=None, mask=None, *args, is_causal=False, **options):
        if options.get("dropout_rate", 0.0) and not options.get("deterministic", False):
            raise ValueError(f"{where} with dropout: under FlaxModel each device would draw "
                             f"its own; train without attention dropout (deterministic=True)")  # fmt: skip
        check_local_heads(ctx, where, query.shape[-2], key.shape[-2], declared, repeated)
        given = [n for n, v in (("bias", bias), ("mask", mask), *options.items(),
                                *enumerate(args)) if not _default(n, v, query)]  # fmt: skip
        t, n = query.shape[1], query.shape[2]  # q[B, T, N, h]
        fits = query.ndim == 4 and key.shape[1] == t and not n % key.shape[2]
        if context is not None and (given or not fits):
            raise ValueError(
                f"{where} under context parallelism, called with "
                f"{', '.join(given) or f'q{tuple(query.shape)}, k{tuple(key.shape)}'}: each "
                f"device holds its block of the sequence, which shardops' context attention "
                f"sees whole; it computes q[B, T, N, h] over k, v[B, T, K, h] (K dividing N), "
                f"causal by is_causal=True, with no mask, bias or other scale"
            )
        calls.append(where)
        if given or not fits:
            return original(query, key, value, bias, mask, *args, is_causal=is_causal, **options)
        dtype = ctx.precision.compute_dtype
        q, k, v = (a.astype(dtype).transpose(0, 2, 1, 3) for a in (query, key, value))
        o = shardops.layers.local_attention(q, k, v, causal=bool(is_causal),
                                            precision=ctx.precision,
                                            implementation=ctx.attention_implementation,
                                            context=context)  # fmt: skip
        # o[B, N, T, h] in accum
        return o.transpose(0, 2, 1, 3).astype(query.dtype)  # o[B, T, N, h]

    attention.__wrapped__ = original
    return attention


def _default(name, value, query) -> bool:
    """Whether an attention option is at a value the core computes anyway."""
    if value is None or value is False:
        return True
    if name == "scale":
        return math.isclose(value, query.shape[-1] ** -0.5)
    # No dropout (refused above), so its options change nothing; the policy sets the dtypes.
    return name in ("broadcast_dropout", "deterministic", "promote_dtype", "dropout_rate", "dtype")
