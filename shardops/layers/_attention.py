"""Head-parallel self-attention (the Megatron attention block): per-device kernel, layer, specs.

The heads are split over mesh axis ``model``: each device holds ``H/p`` whole heads. The Q, K
and V projections are column-parallel by heads, attention runs locally per head, and the output
projection is row-parallel:

    x[B, S, D] · wq[D, (H·hd)_model] + bq → q[B, S, H_model, hd]          (and k, v alike)
    softmax(q · kᵀ / √hd, over keys) · v   → o[B, S, H_model, hd]          (local, per head)
    o[B, S, (H·hd)_model] · wo[(H·hd)_model, D] → y[B, S, D]{U_model} → psum → + bo

One forward AllReduce over ``model`` per block (or, with sequence parallelism, the
AllGather/ReduceScatter pair), as in Megatron. ``x`` enters the model-parallel region *once*
(one ``copy_to_region`` or ``gather_to_region`` shared by Q, K and V), so the backward reduces
``dx`` once, not three times.

Precision (``shardops._precision``): every product, the attention's ``q·kᵀ`` and ``p·v``
included, multiplies compute-dtype operands and accumulates in ``accum_dtype``, forward and
backward (a custom VJP, like the dense matmul's: plain autodiff of a bf16 ``einsum`` would
accumulate its transposes in bf16). Scores, mask and softmax are float32. Under a bf16 policy
the values are rounded to bf16 exactly where a product reads them (``q``, ``k``, ``v``, the
probabilities, ``o``, and each cotangent a backward product reads) and once more at the output;
every sum, and every collective that reduces, runs in float32.

Notation (the JAX scaling book): ``w[D, F_model]`` is split over ``model`` along F;
``y[B, S, D]{U_model}`` holds partial sums not yet reduced over ``model``; ``p`` is the size of
``model``; ``H`` the number of heads, ``hd`` the head dim.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardops._axes import MODEL_AXIS, SEQUENCE_DIM
from shardops._mesh import axis_size, check_divisible, spec_entry, varying_axes
from shardops._precision import FLOAT32, Precision, _reduce_to
from shardops.comm._mappings import (
    copy_to_region,
    gather_to_region,
    reduce_from_region,
    reduce_scatter_from_region,
)
from shardops.comm._reasons import Reason, because
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
_REDUCE = Reason("attention_partial_sums", forward={
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


class AttentionSpecs(NamedTuple):
    """PartitionSpecs of the attention block: input ``x``, the Q/K/V weights ``w_qkv`` and biases
    ``b_qkv``, the output projection ``w_out`` and bias ``b_out``, and the output ``y``."""

    x: P
    w_qkv: P
    b_qkv: P
    w_out: P
    b_out: P
    y: P

    @property
    def params(self) -> dict[str, P]:
        """The specs of the parameter dict (``init_attention``'s keys), for ``shard_params``."""
        qkv = {"wq": self.w_qkv, "wk": self.w_qkv, "wv": self.w_qkv}
        return {**qkv, "bq": self.b_qkv, "bk": self.b_qkv, "bv": self.b_qkv,
                "wo": self.w_out, "bo": self.b_out}  # fmt: skip


def head_parallel_attention_specs(
    *,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    sequence_parallel: bool = False,
) -> AttentionSpecs:
    """Layout of ``head_parallel_attention``: ``x[B_batch, S, D] → y[B_batch, S, D]``.

    Weights ``w[D, (H·hd)_model]`` (Q, K, V) and ``w[(H·hd)_model, D]`` (output), biases
    ``b[(H·hd)_model]`` and ``b[D]`` (replicated). ``sequence_parallel`` splits ``x`` and ``y``
    along S too: ``x[B_batch, S_model, D]``.
    """
    seq = axis_name if sequence_parallel else None
    x = P(spec_entry(batch_axis), seq, None)
    return AttentionSpecs(
        x=x, w_qkv=P(None, axis_name), b_qkv=P(axis_name), w_out=P(axis_name, None),
        b_out=P(None), y=x,
    )  # fmt: skip


def init_attention(
    key: jax.Array,
    d_model: int,
    num_heads: int,
    head_dim: int,
    *,
    use_bias: bool = True,
    dtype=jnp.float32,
) -> dict[str, jax.Array]:
    """Full parameters of an attention block, independent of any mesh.

    Returns ``{"wq", "wk", "wv": w[d_model, H·hd], "bq", "bk", "bv": b[H·hd],
    "wo": w[H·hd, d_model], "bo": b[d_model]}`` (biases zero, or absent without ``use_bias``),
    each projection initialised as ``shardops.init_dense``. Shard it with
    ``shard_params(params, mesh, head_parallel_attention_specs().params)``.
    """
    for name, n in (("d_model", d_model), ("num_heads", num_heads), ("head_dim", head_dim)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"init_attention: {name} must be a positive int; got {n!r}")
    inner = num_heads * head_dim
    shapes = {"q": (d_model, inner), "k": (d_model, inner), "v": (d_model, inner),
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
    causal: bool = False,
    axis_name: str = MODEL_AXIS,
    sequence_parallel: bool = False,
    precision: Precision = FLOAT32,
):
    """Head-parallel self-attention on local blocks: ``x[B, S, D] → y[B, S, D]``, ``H/p`` heads per device.

    Arguments (local blocks, ``p`` = size of ``axis_name``, ``H = num_heads``):
        x: ``x[B, S, D]`` replicated over ``axis_name``; with ``sequence_parallel`` the
            sequence shard ``x[B, S/p, D]`` (device ``i`` holds positions ``i·S/p …``).
        params: local shards ``{"wq", "wk", "wv": w[D, (H/p)·hd], "wo": w[(H/p)·hd, D]}`` and,
            optionally, ``"bq", "bk", "bv": b[(H/p)·hd]`` and the replicated ``"bo": b[D]``.
            Device ``i`` holds heads ``i·H/p … (i+1)·H/p − 1`` (columns ``h·hd … h·hd + hd − 1``
            of the full ``wq`` are head ``h``).
        num_heads: the global H; it must divide by ``p``.
        causal: position ``i`` attends to keys ``j ≤ i`` only.

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
        Attention itself, and every weight gradient, is local; with ``x`` split over a batch
        axis, the weight gradients are all-reduced over that axis (in ``accum_dtype``).
    """
    op = "head_parallel_attention_kernel"
    p = bound_axis_size(axis_name, op)
    heads, head_dim = _check_local(op, x, params, num_heads, p, axis_name, sequence_parallel)
    accum = precision.accum_dtype
    if sequence_parallel:
        # x_block[B, S/p, D] → x[B, S, D] once for Q, K, V; backward: one ReduceScatter of dx.
        with because(_GATHER, axis_name):
            x = gather_to_region(x, axis_name, SEQUENCE_DIM, accum)  # x[B, S, D] in accum
    else:
        # Megatron's "f" once for Q, K, V: identity forward, one AllReduce of dx backward.
        with because(_INPUT, axis_name):
            x = copy_to_region(x, axis_name, accum)  # x[B, S, D] in accum
    y_partial = _attend(x, params, heads, head_dim, causal, precision)  # y[B, S, D]{U_model}
    bo = params.get("bo")
    if sequence_parallel:
        with because(_REDUCE, axis_name):  # y[B, S/p, D] in accum
            y = reduce_scatter_from_region(y_partial, axis_name, SEQUENCE_DIM)
        if bo is not None:
            # bo[D] is replicated but y is a sequence shard: dbo is all-reduced over model.
            with because(_BIAS, axis_name):
                bo = copy_to_region(bo, axis_name, accum)  # bo[D] in accum
    else:
        with because(_REDUCE, axis_name):
            y = reduce_from_region(y_partial, axis_name)  # y[B, S, D] in accum
    return precision.finish(y, bo)  # + bo once, after the reduction; y in compute dtype


def _attend(x, params, heads: int, head_dim: int, causal: bool, precision: Precision):
    """The local heads' attention and output projection: ``x[B, S, D]`` → ``y[B, S, D]``, in
    ``accum_dtype``, a partial sum over heads when the heads are split (``y{U_model}``)."""
    batch, seq, _ = x.shape
    q = _project(x, params["wq"], params.get("bq"), heads, precision)  # q[B·H/p, S, hd]
    k = _project(x, params["wk"], params.get("bk"), heads, precision)  # k[B·H/p, S, hd]
    v = _project(x, params["wv"], params.get("bv"), heads, precision)  # v[B·H/p, S, hd]
    scores = _product("nqd,nkd->nqk", q, k, precision)  # scores[B·H/p, S_query, S_key] in accum
    scores = scores * (1.0 / math.sqrt(head_dim))  # scores[B·H/p, S, S]
    if causal:
        visible = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]  # [S, S]: key j ≤ query i
        scores = jnp.where(visible, scores, -jnp.inf)  # [B·H/p, S, S], the future masked
    probs = jax.nn.softmax(scores, axis=-1)  # probs[B·H/p, S, S] in accum, normalised over keys
    o = _product("nqk,nkd->nqd", probs, v, precision)  # o[B·H/p, S, hd] in accum
    o = o.reshape(batch, heads, seq, head_dim).transpose(0, 2, 1, 3)  # o[B, S, H/p, hd]
    o = o.reshape(batch, seq, heads * head_dim)  # o[B, S, (H/p)·hd]: the row-parallel input
    return precision.matmul(o, params["wo"])  # y[B, S, D] in accum


def attention(x, params, *, num_heads: int, causal: bool = False, precision: Precision = FLOAT32):
    """Unsharded multi-head self-attention: ``x[B, S, D] → y[B, S, D]``, no collectives.

    The same computation (and precision discipline) as ``head_parallel_attention_kernel`` with
    every head on one device: the reference it is checked against, and the attention of a
    strategy that does not split heads. ``params`` as ``init_attention`` makes them.
    """
    _check_args("attention", x, params, num_heads, causal, precision, dtypes=False)
    head_dim = params["wq"].shape[1] // num_heads
    x = x.astype(precision.accum_dtype)  # x[B, S, D] in accum, as the kernel's region entry
    y = _attend(x, params, num_heads, head_dim, causal, precision)  # y[B, S, D] in accum
    return precision.finish(y, params.get("bo"))  # y in compute dtype


def _project(x, w, b, heads: int, precision: Precision):
    """``x[B, S, D] · w[D, (H/p)·hd] + b → [B·H/p, S, hd]`` in ``accum_dtype``, one row per
    (example, local head): the attention products are batched over that one leading dim
    (XLA:CPU cannot run some layouts of a bf16 product with two batch dims, ``[B, H/p]``).

    Column ``h·hd + d`` of the local ``w`` is dim ``d`` of local head ``h``.
    """
    y = precision.matmul(x, w)  # [B, S, (H/p)·hd] in accum
    if b is not None:
        y = y + b.astype(precision.accum_dtype)  # [B, S, (H/p)·hd]
    batch, seq, _ = y.shape
    y = y.reshape(batch, seq, heads, -1).transpose(0, 2, 1, 3)  # [B, H/p, S, hd]
    return y.reshape(batch * heads, seq, -1)  # [B·H/p, S, hd]


def _product(spec: str, a, b, precision: Precision):
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


def head_parallel_attention(
    x,
    params,
    *,
    mesh: Mesh,
    num_heads: int,
    causal: bool = False,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    sequence_parallel: bool = False,
    precision: Precision = FLOAT32,
):
    """Head-parallel self-attention on global arrays: ``x[B, S, D] → y[B, S, D]``, heads split over ``model``.

    Arguments:
        x: ``x[B, S, D]`` in ``precision.compute_dtype``, split over ``batch_axis`` (if given)
            along B; with ``sequence_parallel`` also over ``axis_name`` along S (S must divide).
        params: full-shape parameters as ``init_attention`` makes them, in
            ``precision.param_dtype``, laid out as ``head_parallel_attention_specs(...).params`` (or left to
            ``shard_map`` to place): ``wq, wk, wv: w[D, H·hd]``, ``wo: w[H·hd, D]``, optional
            biases ``bq, bk, bv: b[H·hd]``, ``bo: b[D]``.
        mesh: the mesh (Auto or Explicit axes).
        num_heads: H; it must divide by the size of ``axis_name`` (each device holds whole
            heads), and ``wq.shape[1]`` by H (``hd = wq.shape[1] / H``).
        causal: position ``i`` attends to keys ``j ≤ i`` only.
        sequence_parallel: take and return the sequence shard ``x[B, S_model, D]``.

    Returns:
        ``y[B, S, D]`` in ``precision.compute_dtype``, laid out as ``head_parallel_attention_specs(...).y``.

    Communication: see ``head_parallel_attention_kernel``. Forward one AllReduce of
    ``y[B, S, D]`` over ``axis_name``; backward one AllReduce of ``dx[B, S, D]``. With
    ``sequence_parallel``: AllGather ``x`` and ReduceScatter ``y`` forward, AllGather ``dy`` and
    ReduceScatter ``dx`` (+ AllReduce of ``dbo[D]``) backward.
    """
    op = "head_parallel_attention"
    check_axes(mesh, axis_name, batch_axis)
    _check_args(op, x, params, num_heads, causal, precision)
    p = axis_size(mesh, axis_name)
    if num_heads % p:
        raise ValueError(
            f"{op}: num_heads={num_heads} is not divisible by mesh axis {axis_name!r} (size "
            f"{p}); each device must hold whole heads. Choose num_heads a multiple of {p} (e.g. "
            f"{-(-num_heads // p) * p}), or a mesh whose {axis_name!r} axis divides {num_heads}."
        )
    check_divisible(
        argument="x", dim=0, dim_name="batch", size=x.shape[0], mesh=mesh, axes=(batch_axis,)
    )
    if sequence_parallel:
        check_divisible(argument="x", dim=SEQUENCE_DIM, dim_name="sequence", size=x.shape[1],
                        mesh=mesh, axes=(axis_name,))  # fmt: skip
    specs = head_parallel_attention_specs(
        axis_name=axis_name, batch_axis=batch_axis, sequence_parallel=sequence_parallel
    )
    param_specs = {name: specs.params[name] for name in params}
    kernel = functools.partial(
        head_parallel_attention_kernel,
        num_heads=num_heads,
        causal=causal,
        axis_name=axis_name,
        sequence_parallel=sequence_parallel,
        precision=precision,
    )
    args, in_specs = {"x": x, "params": params}, {"x": specs.x, "params": param_specs}
    return run_layer(op, kernel, mesh, args, in_specs, specs.y)


# --- checks -----------------------------------------------------------------------------------


def _check_args(op: str, x, params, num_heads, causal, precision, *, dtypes=True) -> None:
    """Global shapes, dtypes (unless ``dtypes=False``: params may arrive in ``accum_dtype``,
    as a strategy's gathers give them) and names, before anything is traced."""
    check_precision(op, precision)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"{op}: num_heads must be a positive int; got {num_heads!r}")
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
    expected = {"wk": wq, "wv": wq, "wo": (inner, d_model), "bq": (inner,), "bk": (inner,),
                "bv": (inner,), "bo": (d_model,)}  # fmt: skip
    for name, want in expected.items():
        if name in shapes and shapes[name] != want:
            raise ValueError(
                f"{op}: {name} has shape {shapes[name]} but wq{wq} with num_heads={num_heads} "
                f"means head_dim={head_dim} and D={d_model}, so {name} must be {want}. Q, K and "
                f"V use the same heads × head_dim; wo maps them back to D."
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


def _check_local(op, x, params, num_heads, p, axis_name, sequence_parallel) -> tuple[int, int]:
    """Local blocks inside ``shard_map``: heads per device and head dim."""
    _check_param_names(op, params)
    if num_heads % p:
        raise ValueError(
            f"{op}: num_heads={num_heads} is not divisible by mesh axis {axis_name!r} (size {p})"
        )
    for name in PROJECTIONS:
        check_sharded_over(params[name], axis_name, name, op)
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
    return heads, wq.shape[1] // heads
