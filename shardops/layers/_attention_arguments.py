"""The attention block's argument checks: global shapes, dtypes and names before anything is
traced (``check_args``), local blocks inside ``shard_map`` (``check_local``), head counts that
split over a mesh axis, and the per-token ``positions`` and ``segment_ids`` (``check_tokens``).

Each raises a ``ValueError`` or ``TypeError`` that names the argument, the sizes and the fix.
"""

from __future__ import annotations

import jax.numpy as jnp

from shardops._mesh import varying_axes
from shardops.layers import _rope
from shardops.layers._common import check_precision, check_replicated_over, check_sharded_over

PROJECTIONS = ("wq", "wk", "wv", "wo")
BIASES = ("bq", "bk", "bv", "bo")
KV_KEYS = ("wk", "wv", "bk", "bv")


def check_head_counts(op: str, num_heads: int, num_kv_heads: int, axis_name: str, p: int):
    """Heads that can be split over ``axis_name`` (size ``p``), else a ValueError naming the
    heads, the KV heads and the axis."""
    check_kv_groups(op, num_heads, num_kv_heads)
    if num_heads % p:
        raise ValueError(
            f"{op}: num_heads={num_heads} is not divisible by mesh axis {axis_name!r} (size "
            f"{p}); each device must hold whole query heads (num_kv_heads={num_kv_heads}). "
            f"Choose num_heads a multiple of {p} (e.g. {-(-num_heads // p) * p}), or a mesh "
            f"whose {axis_name!r} axis divides {num_heads}."
        )


def check_kv_groups(op: str, num_heads, num_kv_heads) -> None:
    """``num_kv_heads`` a positive int dividing ``num_heads`` (each KV head serves a group of
    query heads), else a ValueError listing the divisors."""
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
    check_kv_groups(op, num_heads, num_kv_heads)
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
