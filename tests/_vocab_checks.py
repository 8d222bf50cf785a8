"""Shared checks of the vocab-parallel embedding and cross-entropy against float64 numpy.

Used by the parametrized tests, the hypothesis properties and the mutation tests, so that a
mutant is judged by exactly the checks the suite runs. The layers are looked up in their modules
at trace time, so a mutation test can swap them.

The bounds, derived (u = eps/2 is the unit roundoff of a dtype; ``eps`` as in
``shardops.testing``; every bound is elementwise):

Embedding forward. Each output element is one table entry: the owning device contributes it
(cast to float32, exact), every other device contributes 0, and a sum of one nonzero term and
zeros is exact, in any order. The only rounding is the final cast to the compute dtype:
``|x − t| ≤ u(compute)·|t|``, and in fact ``x == t.astype(compute)`` bit for bit (asserted too).
Under FLOAT32 that is exact equality.

Embedding backward. ``dtable[v] = Σ_{positions with id v} ct``: a scatter-add of ``n_v`` terms
on the devices that hold the positions, then (batch split) a float32 all-reduce over the batch
axis. Adding zeros is exact, so at most ``n_v − 1`` roundings touch nonzero partial sums:
``|err| ≤ γ(n_v)·Σ|ct| + u(param)·|dtable|`` (Higham §3.1; the cotangents, in the compute dtype,
are exact in float32), which ``testing.error_bound(Σ|ct|, n_v, …)`` covers with its factor 2 of
margin. Rows no id reaches (padding, unused ids) must be exactly 0 (the bound is ``tiny``). A
scatter-add in bfloat16 costs ``u(bf16)`` per addition, far above ``(n_v + 2)·eps(f32)·Σ|ct|``
plus one final ``eps(bf16)·|dtable|`` wherever the terms cancel.

Cross-entropy forward, in float32 (u = 2⁻²⁴) with s_j = l_j − m (m the max), S = Σ_j e^{s_j}
over the V real columns, p_j = e^{s_j}/S and t the label: the shift rounds once, ``u|s_j|``, and
``exp`` turns that into a relative error ``u|s_j|`` of e_j (plus its own few ulps); the sum of
V positive terms, locally and then across devices, adds a relative ``(V − 1)·u``; ``log S``
then carries the relative error of S as an absolute one, plus its own ulps; the target logit
rounds once (``u|s_t|``) and the difference once (``u|loss|``). So

    |loss − loss_ref| ≤ eps(f32)·((V + 2) + Σ_j p_j|s_j| + |s_t| + |log S| + |loss_ref|)

(with eps = 2u the factor 2 absorbs the ulps of ``exp`` and ``log``). It grows with V and with
the spread of the logits (|s| up to 2·max|l|), as it must; it is ~1e-5 at V = 50 and |l| ~ 100,
while a missing global max, an unmasked target or a leaked padding column is off by O(1).

Cross-entropy backward, ``g_j = ct·(p_j − [j = t])``: autodiff computes ``(ct/S)·e_j`` (two
roundings), subtracts ``ct`` at the label (one) and casts to the logits' dtype (one):

    |g − g_ref| ≤ eps(f32)·|ct|·p_j·((V + 2) + Σ_k p_k|s_k| + |s_j|) + (eps(f32) + eps(out))·|g_ref|
                  + (|ct| + 2)·tiny(f32)

The last term is underflow: XLA:CPU flushes subnormal results to zero, so ``e_j`` (scaled by
``ct/S``, |ct/S| ≤ |ct|), the product and the cast (bfloat16 has float32's exponent range) can
each lose up to the smallest normal float32, 1.2e-38. It matters only where p_j < 1e-37 (logits
spread over ~85 and more), and it is 30 orders of magnitude below any bug.

Padded columns must be exactly 0. The argmax is compared exactly (first index of the maximum,
as ``np.argmax``; padded columns excluded).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from _dense_checks import ALL_MESHES, mesh_for
from jax.sharding import NamedSharding

from shardops.layers import _cross_entropy, _embedding
from shardops.layers._params import padded_size
from shardops.testing import SUMS, _subjaxprs, dtype_flow, error_bound, worst_ratio

# (kind, policy name) → (max |err| / bound, max |err|, where); for the report.
WORST: dict[tuple[str, str], tuple[float, float, str]] = {}

MESHES = ALL_MESHES
EMBEDDING_OPTIONS = [
    {"reduce": "psum"},
    {"reduce": "psum_scatter", "scatter_dimension": 1},
    {"reduce": "psum_scatter", "scatter_dimension": 0},
]
F32_EPS = float(jnp.finfo(jnp.float32).eps)
F32_TINY = float(jnp.finfo(jnp.float32).tiny)  # the smallest normal float32
PAD_LOGIT = 1e4  # what the padded logit columns hold in the tests: it would win everything


def _model_size(mesh_shape) -> int:
    return mesh_shape[-1]


def _record(kind: str, precision, ratio: float, abs_err: float, where: str) -> None:
    key = (kind, precision.name)
    if ratio > WORST.get(key, (-1.0,))[0]:
        WORST[key] = (ratio, abs_err, where)


def _check_within(name: str, got, want, bound, where: str) -> tuple[float, float]:
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    ratio = worst_ratio(got, want, bound)
    abs_err = float(np.max(np.abs(got - want))) if got.size else 0.0
    assert ratio <= 1.0, (
        f"{name} of {where}: max |err| = {abs_err:.3e} exceeds the bound by {ratio:.2f}×"
    )
    return ratio, abs_err


# --- embedding --------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("mesh", "options", "precision"))
def embedding_forward_and_grads(ids, table, ct, *, mesh, options, precision):
    """``x`` and ``d sum(ct·x) / d table`` through the sharded layer, in one program."""
    layer = _embedding.vocab_parallel_embedding  # looked up at trace time (mutation tests)

    def loss(table):
        x = layer(ids, table, mesh=mesh, precision=precision, **dict(options))
        return jnp.sum(x.astype(jnp.float32) * ct.astype(jnp.float32)), x

    dtable, x = jax.grad(loss, has_aux=True)(table)
    return x, dtable


def embedding_inputs(rng, ids_shape, vocab_size, d, p, precision, *, out_of_range=False):
    """ids in [0, vocab_size) (or, with ``out_of_range``, also −3, padding ids and ≥ the padded
    size), a table padded with zero rows to a multiple of ``p``, and a cotangent."""
    ids = rng.integers(0, vocab_size, ids_shape).astype(np.int32)
    if out_of_range:  # under jit these are not checked: a zero vector, no gradient
        bad = [-3, vocab_size, padded_size(vocab_size, p) + 5, -1]
        flat = ids.reshape(-1)
        where = rng.choice(flat.size, size=min(flat.size, 8), replace=False)
        flat[where] = np.resize(bad, where.size)
    table = rng.standard_normal((vocab_size, d)).astype(precision.param_dtype)
    extra = padded_size(vocab_size, p) - vocab_size
    table = np.concatenate([table, np.zeros((extra, d), table.dtype)])
    ct = rng.standard_normal((*ids_shape, d)).astype(precision.compute_dtype)
    return ids, table, ct


def embedding_reference(ids, table, ct, vocab_size, precision):
    """Exact x and dtable, and their bounds (module docstring)."""
    t64, ct64 = np.asarray(table, np.float64), np.asarray(ct, np.float64)
    valid = (ids >= 0) & (ids < vocab_size)
    x = np.where(valid[..., None], t64[np.clip(ids, 0, len(t64) - 1)], 0.0)
    x_rounded = np.where(
        valid[..., None], np.asarray(table)[np.clip(ids, 0, len(t64) - 1)], 0
    ).astype(precision.compute_dtype)
    rows = ids[valid]
    dtable, counts, abs_ct = np.zeros_like(t64), np.zeros(len(t64)), np.zeros_like(t64)
    np.add.at(dtable, rows, ct64[valid])
    np.add.at(abs_ct, rows, np.abs(ct64[valid]))
    np.add.at(counts, rows, 1)
    u_compute = float(jnp.finfo(precision.compute_dtype).eps) / 2
    bound_x = u_compute * np.abs(x) + np.finfo(np.float64).tiny
    bound_dtable = error_bound(
        abs_ct, counts[:, None], precision, exact=dtable, out_dtype=precision.param_dtype
    )
    return x, x_rounded, dtable, bound_x, bound_dtable


def check_embedding(
    mesh_shape,
    options,
    precision,
    *,
    ids_shape=(8, 16),
    vocab_size=50,
    d=16,
    seed=0,
    out_of_range=False,
) -> float:
    """Assert x and dtable of the sharded embedding are within their bounds; return the worst ratio."""
    mesh, batch_axis = mesh_for(mesh_shape)
    opts = dict(options, batch_axis=batch_axis, vocab_size=vocab_size)
    specs = _embedding.vocab_parallel_embedding_specs(
        ids_ndim=len(ids_shape),
        batch_axis=batch_axis,
        **{k: v for k, v in options.items() if k in ("reduce", "scatter_dimension")},
    )
    rng = np.random.default_rng(seed)
    ids, table, ct = embedding_inputs(
        rng, ids_shape, vocab_size, d, _model_size(mesh_shape), precision, out_of_range=out_of_range
    )
    x_ref, x_rounded, dt_ref, bound_x, bound_dt = embedding_reference(
        ids, table, ct, vocab_size, precision
    )

    def place(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    x, dtable = embedding_forward_and_grads(
        place(ids, specs.ids),
        place(table, specs.table),
        place(ct, specs.x),
        mesh=mesh,
        options=tuple(sorted(opts.items())),
        precision=precision,
    )
    where = f"embedding {mesh_shape} {options} ids{ids_shape} V={vocab_size} D={d} {precision.name}"
    assert x.dtype == precision.compute_dtype and dtable.dtype == precision.param_dtype, where
    rx, ax = _check_within("x", x, x_ref, bound_x, where)
    np.testing.assert_array_equal(np.asarray(x), x_rounded, err_msg=f"x not bit-exact: {where}")
    rd, ad = _check_within("dtable", dtable, dt_ref, bound_dt, where)
    assert not np.any(np.asarray(dtable, np.float64)[vocab_size:]), (
        f"padding rows got a gradient: {where}"
    )
    _record("embedding x", precision, rx, ax, where)
    _record("embedding dtable", precision, rd, ad, where)
    return max(rx, rd)


# --- cross-entropy ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("mesh", "batch_axis", "vocab_size", "precision"))
def cross_entropy_forward_and_grads(logits, labels, ct, *, mesh, batch_axis, vocab_size, precision):
    """``loss``, ``d sum(ct·loss) / d logits`` and the argmax through the sharded layers."""
    ce = _cross_entropy.vocab_parallel_cross_entropy  # looked up at trace time (mutation tests)
    argmax = _cross_entropy.vocab_parallel_argmax
    kwargs = dict(mesh=mesh, vocab_size=vocab_size, batch_axis=batch_axis)

    def loss(logits):
        per_example = ce(logits, labels, precision=precision, **kwargs)
        return jnp.sum(per_example * ct), per_example

    dlogits, per_example = jax.grad(loss, has_aux=True)(logits)
    return per_example, dlogits, argmax(logits, **kwargs)


def cross_entropy_inputs(rng, lead, vocab_size, p, precision, *, scale=1.0, bad_labels=False):
    """logits[*lead, V_padded] (N(0, scale²), padded columns PAD_LOGIT), labels, cotangent."""
    v_pad = padded_size(vocab_size, p)
    logits = scale * rng.standard_normal((*lead, v_pad))
    logits[..., vocab_size:] = PAD_LOGIT
    logits = logits.astype(precision.compute_dtype)
    labels = rng.integers(0, vocab_size, lead).astype(np.int32)
    if bad_labels:
        bad = np.array([-1, vocab_size, v_pad, v_pad + 7])
        flat = labels.reshape(-1)
        flat[: min(flat.size, 4)] = bad[: min(flat.size, 4)]
    ct = rng.standard_normal(lead).astype(np.float32)
    return logits, labels, ct


def cross_entropy_reference(logits, labels, ct, vocab_size):
    """Exact loss, dlogits and argmax, and the bounds of the module docstring (out = logits'
    dtype). A label outside [0, vocab_size) adds no target logit (the documented jit behaviour)."""
    out_eps = float(jnp.finfo(logits.dtype).eps)
    lg = np.asarray(logits, np.float64)
    v_pad = lg.shape[-1]
    real = lg[..., :vocab_size]
    m = real.max(-1, keepdims=True)
    s = real - m
    e = np.exp(s)
    big_s = e.sum(-1)
    prob = e / big_s[..., None]
    valid = (labels >= 0) & (labels < vocab_size)
    s_t = np.where(
        valid, np.take_along_axis(s, np.clip(labels, 0, vocab_size - 1)[..., None], -1)[..., 0], 0.0
    )
    loss = np.log(big_s) - s_t
    onehot = (np.arange(vocab_size) == labels[..., None]) & valid[..., None]
    ct64 = np.asarray(ct, np.float64)[..., None]
    grad = ct64 * (prob - onehot)
    spread = (prob * np.abs(s)).sum(-1)
    v = vocab_size
    bound_loss = F32_EPS * ((v + 2) + spread + np.abs(s_t) + np.abs(np.log(big_s)) + np.abs(loss))
    bound_grad = (
        F32_EPS * np.abs(ct64) * prob * ((v + 2) + spread[..., None] + np.abs(s))
        + (F32_EPS + out_eps) * np.abs(grad)
        + (np.abs(ct64) + 2) * F32_TINY
    )
    pad = np.zeros((*grad.shape[:-1], v_pad - v))
    tiny = np.finfo(np.float64).tiny
    return (
        loss,
        np.concatenate([grad, pad], -1),
        real.argmax(-1),
        bound_loss + tiny,
        np.concatenate([bound_grad, pad], -1) + tiny,
    )


def check_cross_entropy(
    mesh_shape,
    precision,
    *,
    lead=(8, 6),
    vocab_size=50,
    seed=0,
    scale=1.0,
    bad_labels=False,
) -> float:
    """Assert loss, dlogits (and the argmax, exactly) of the sharded layers; return the worst ratio."""
    mesh, batch_axis = mesh_for(mesh_shape)
    specs = _cross_entropy.vocab_parallel_cross_entropy_specs(
        ndim=len(lead) + 1, batch_axis=batch_axis
    )
    rng = np.random.default_rng(seed)
    logits, labels, ct = cross_entropy_inputs(
        rng,
        lead,
        vocab_size,
        _model_size(mesh_shape),
        precision,
        scale=scale,
        bad_labels=bad_labels,
    )
    loss_ref, grad_ref, argmax_ref, bound_loss, bound_grad = cross_entropy_reference(
        logits, labels, ct, vocab_size
    )

    def place(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    loss, dlogits, index = cross_entropy_forward_and_grads(
        place(logits, specs.logits),
        place(labels, specs.labels),
        place(ct, specs.loss),
        mesh=mesh,
        batch_axis=batch_axis,
        vocab_size=vocab_size,
        precision=precision,
    )
    where = f"cross-entropy {mesh_shape} logits{(*lead, logits.shape[-1])} V={vocab_size} scale={scale} {precision.name}"
    assert loss.dtype == np.float32 and dlogits.dtype == precision.compute_dtype, (
        f"dtypes: loss {loss.dtype} (want float32), dlogits {dlogits.dtype}: {where}"
    )
    rl, al = _check_within("loss", loss, loss_ref, bound_loss, where)
    rg, ag = _check_within("dlogits", dlogits, grad_ref, bound_grad, where)
    assert not np.any(np.asarray(dlogits, np.float64)[..., vocab_size:]), (
        f"padding got a gradient: {where}"
    )
    np.testing.assert_array_equal(np.asarray(index), argmax_ref, err_msg=f"argmax of {where}")
    assert index.dtype == np.int32, where
    _record("cross-entropy loss", precision, rl, al, where)
    _record("cross-entropy dlogits", precision, rg, ag, where)
    return max(rl, rg)


def check_argmax_ties() -> None:
    """Ties across devices go to the first index, as ``np.argmax``; padding never wins."""
    mesh = mesh_for((4,))[0]
    logits = np.zeros((3, 12), np.float32)
    logits[1, [2, 7, 11]] = 5.0  # the max on devices 0, 2 and 3 (11 is padding): index 2
    logits[2, [10, 5]] = 3.0  # on devices 3 and 1: index 5
    logits[0, 11] = 9.0  # only padding (vocab_size=11) beats the zeros of row 0: index 0
    got = _cross_entropy.vocab_parallel_argmax(logits, mesh=mesh, vocab_size=11)
    np.testing.assert_array_equal(got, [0, 2, 5])
    assert got.dtype == np.int32


# --- dtype flow -------------------------------------------------------------------------------

MAXIMA_AND_SCATTERS = ("scatter-add", "pmax", "reduce_max")  # not listed by testing.dtype_flow


def reductions(fn, *args, **kwargs) -> list[tuple[str, tuple[np.dtype, ...], str]]:
    """``(primitive, floating operand dtypes, where)`` of every sum (``testing.dtype_flow``:
    psum, psum_invariant, reduce-scatter, reduce_sum, …), scatter-add and max in the jaxpr of
    ``fn``, nested jaxprs included. (``dtype_flow_violations`` needs a matmul, which these
    layers do not have; ``dtype_flow`` does not list scatter-adds, which sum the table's
    gradient.)"""
    out = [
        (name, tuple(d for d in ins if jnp.issubdtype(d, jnp.floating)), where)
        for name, ins, _, _, where in dtype_flow(fn, *args, **kwargs)
        if name in SUMS
    ]
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in MAXIMA_AND_SCATTERS:
                floats = tuple(
                    np.dtype(v.aval.dtype)
                    for v in eqn.invars
                    if hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.floating)
                )
                out.append((eqn.primitive.name, floats, str(eqn.source_info.name_stack)))
            for sub in _subjaxprs(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return out


def check_reductions_in_accum(found, precision, required) -> None:
    """Every reduction sums floats in the accumulation dtype, and each ``required`` primitive
    occurs (so the check cannot pass vacuously)."""
    accum = np.dtype(precision.accum_dtype)
    bad = [
        f"{name} at {where}: {dts}" for name, dts, where in found if any(d != accum for d in dts)
    ]
    assert not bad, f"reductions not in {accum.name} under {precision.name}:\n" + "\n".join(bad)
    names = {name for name, *_ in found}
    assert set(required) <= names, (required, names)


def check_embedding_dtype_flow(mesh_shape, options, precision) -> None:
    mesh, batch_axis = mesh_for(mesh_shape)
    opts = dict(options, batch_axis=batch_axis, vocab_size=50)
    specs = _embedding.vocab_parallel_embedding_specs(batch_axis=batch_axis, **options)
    ids, table, ct = embedding_inputs(
        np.random.default_rng(0), (8, 16), 50, 16, _model_size(mesh_shape), precision
    )
    args = [jax.device_put(a, NamedSharding(mesh, s))
            for a, s in ((ids, specs.ids), (table, specs.table), (ct, specs.x))]  # fmt: skip
    found = reductions(
        embedding_forward_and_grads,
        *args,
        mesh=mesh,
        options=tuple(sorted(opts.items())),
        precision=precision,
    )
    cross_device = "psum_invariant" if options.get("reduce") == "psum" else "reduce_scatter"
    check_reductions_in_accum(found, precision, ("scatter-add", cross_device))


def check_cross_entropy_dtype_flow(mesh_shape, precision) -> None:
    mesh, batch_axis = mesh_for(mesh_shape)
    specs = _cross_entropy.vocab_parallel_cross_entropy_specs(batch_axis=batch_axis)
    logits, labels, ct = cross_entropy_inputs(
        np.random.default_rng(0), (8, 6), 50, _model_size(mesh_shape), precision
    )
    args = [jax.device_put(a, NamedSharding(mesh, s))
            for a, s in ((logits, specs.logits), (labels, specs.labels), (ct, specs.loss))]  # fmt: skip
    found = reductions(
        cross_entropy_forward_and_grads,
        *args,
        mesh=mesh,
        batch_axis=batch_axis,
        vocab_size=50,
        precision=precision,
    )
    check_reductions_in_accum(found, precision, ("pmax", "psum_invariant", "reduce_sum"))
