"""Splash attention (``shardops.layers._splash``, the Pallas TPU kernel, run here in Pallas's
interpreter): values and every gradient against a float64 reference (causal, segments, GQA,
MQA, two key blocks, a bf16 policy), inside ``jax.shard_map(check_vma=True)`` with replicated
projection weights against the unsharded run, the dtype of the backward's reductions under the
bf16 policies (traced), mutants of the wrapper, and clear errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _messages import refused
from _mutants import mutant
from jax import lax
from jax.sharding import PartitionSpec as P
from test_flash import Case, inputs, reference

import shardops
from shardops.layers import _splash
from shardops.layers._splash import splash_attention, splash_unsupported_reason

F32, MIXED = shardops.FLOAT32, shardops.MIXED_BFLOAT16
# float32: each result sums at most S + hd = 384 float32 products per term, so its rounding is
# ≲ 384·eps(f32)/2 ≈ 2.3e-5 of the sum of |terms|, in practice (random signs) ~√384·eps ≈ 2e-6
# of the largest value; measured ≤ 1e-6 (0.1 of the bound), and ≤ 9e-7 for the gradients of the
# projections under shard_map. A bug (scale dropped, a mask off, a missing sum) is O(1).
F32_RTOL = 1e-5


def case(name, **kw):
    """Splash's smallest shapes: S a multiple of 128 and hd = 128 (the TPU lane width)."""
    kw = {"seq": 128, "head_dim": 128, "block_k": 128, "batch": 1, **kw}
    return Case(name, **kw)


CASES = {
    c.name: c
    for c in [
        case("plain", heads=2, kv=2),
        # Two key blocks: the online softmax across blocks, and causal's skipped block.
        case("gqa_causal_segments", heads=4, kv=2, seq=256, causal=True, segments=True, batch=2),
        case("mqa_causal", heads=4, kv=1, seq=256, causal=True),
        case("mqa_segments", heads=2, kv=1, segments=True, batch=2),
        case("mixed_bfloat16", heads=2, kv=1, causal=True, segments=True, precision=MIXED, batch=2),
    ]
}


def scaled_queries(case, q):
    """The queries the kernel reads, times √hd: ``round_compute(q/√hd)·√hd`` in float64. The
    one rounding of the scaled queries is part of the function splash computes (it scales
    before the kernel), so the reference attends with these."""
    scale = 1 / np.sqrt(q.shape[-1])
    q_scaled = jnp.asarray(jnp.asarray(q, jnp.float32) * scale, case.precision.compute_dtype)
    return np.asarray(q_scaled, np.float64) / scale


def run(fn, case, q, k, v, ct, segments):
    """``o`` and its vjp with ``ct``, jitted, in the policy's parameter dtype."""
    dtype = case.precision.param_dtype
    q, k, v = (jnp.asarray(t, dtype) for t in (q, k, v))

    @jax.jit
    def go(q, k, v, ct, segments):
        def attend(q, k, v):
            return fn(q, k, v, causal=case.causal, segment_ids=segments, block=case.block_k,
                      precision=case.precision, interpret=True)  # fmt: skip

        o, vjp = jax.vjp(attend, q, k, v)
        return (o, *vjp(ct))

    return dict(zip(("o", "dq", "dk", "dv"), go(q, k, v, jnp.asarray(ct), segments), strict=True))


def bounds(case, q, k, v, ct, want):
    """Elementwise bounds, derived. Float32: ``F32_RTOL`` of the largest value. A bf16 compute
    dtype (q, k, v, ct exact in bf16) rounds, each with relative error ≤ u = eps/2:
      - o, returned by the kernel in bf16: |Δo| ≤ u·|o| (its p·v product is float32);
      - D = rowsum(dO∘o) reads that rounded o: |ΔD| ≤ |dO|·|Δo|;
      - dS = P∘(dP − D)/√hd, rounded before dS·k and dSᵀ·q: |ΔdS| ≤ P·|ΔD|/√hd + u·|dS|;
      - the recomputed P, rounded before Pᵀ·dO: |Δdv| ≤ u·(Pᵀ·|dO|);
      - dq, dk, dv, returned by the kernel in bf16: + u·|r|.
    We allow eps (2u) for each u, plus the float32 tolerance."""
    out = {name: F32_RTOL * np.abs(want[name]).max() for name in ("o", "dq", "dk", "dv")}
    if case.precision.compute_dtype == np.float32:
        return out
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    q, k, v, ct = (np.abs(np.asarray(t, np.float64)) for t in (q, k, v, ct))
    b, h, s, hd = q.shape
    g = h // k.shape[1]
    p, kk = want["p"], np.repeat(k, g, axis=1)
    bound_o = eps * np.abs(want["o"])  # [B, H, S, hd]
    bound_d = (ct * bound_o).sum(-1, keepdims=True)  # [B, H, S, 1]
    bound_ds = p * bound_d / np.sqrt(hd) + eps * np.abs(want["ds"])  # [B, H, S, S]
    grouped = {
        "o": bound_o,
        "dq": bound_ds @ kk,
        "dk": (bound_ds.swapaxes(-1, -2) @ q).reshape(b, -1, g, s, hd).sum(2),
        "dv": eps * (p.swapaxes(-1, -2) @ ct).reshape(b, -1, g, s, hd).sum(2),
    }
    for name in out:
        out[name] = out[name] + grouped[name] + (eps * np.abs(want[name]) if name != "o" else 0)
    return out


def check_against_reference(fn, case):
    """``fn`` (``splash_attention`` or a mutant's) matches float64 within the derived bounds,
    values and gradients, in the contract's dtypes; raises ``AssertionError`` naming what is off."""
    q, k, v, ct, segments = inputs(case)
    want = reference(case, scaled_queries(case, q), k, v, ct, segments)
    got = run(fn, case, q, k, v, ct, segments)
    bound = bounds(case, q, k, v, ct, want)
    for name, value in got.items():
        dtype = case.precision.accum_dtype if name == "o" else case.precision.param_dtype
        assert value.dtype == dtype, (name, value.dtype)
        error = np.abs(np.asarray(value, np.float64) - want[name])
        worst = float((error / bound[name]).max())
        assert worst <= 1, f"{case}: {name} is off by {worst:.3g}× its bound"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_values_and_gradients_match_float64(case):
    check_against_reference(splash_attention, case)


def test_the_bfloat16_bound_sees_the_rounding():
    """The bf16 bound is not vacuous: the worst error on ``o`` and ``dv`` is more than 1/20 of
    it and more than the float32 tolerance (so the run does round). Measured: 0.49 and 0.32."""
    case = CASES["mixed_bfloat16"]
    q, k, v, ct, segments = inputs(case)
    want = reference(case, scaled_queries(case, q), k, v, ct, segments)
    got = run(splash_attention, case, q, k, v, ct, segments)
    bound = bounds(case, q, k, v, ct, want)
    for name in ("o", "dv"):
        error = np.abs(np.asarray(got[name], np.float64) - want[name])
        assert error.max() > F32_RTOL * np.abs(want[name]).max(), name
        assert 0.05 < (error / bound[name]).max() <= 1, name


# --- inside shard_map(check_vma=True): heads split over model, projections replicated ---------

B, S, D, H, HD = 2, 128, 16, 4, 128


def projected_attention(fn, kv_heads: int, sharded: bool):
    """``loss(x, wq, wk, wv, ct) = Σ ct·attention(x·wq, x·wk, x·wv)``, causal, packed. Sharded:
    ``x``, ``ct`` split over ``data`` (batch), the weights replicated, every device projecting
    its batch rows and keeping its query heads (split over ``model``); its KV heads too when
    there are as many as devices on ``model``, else (MQA) the one KV head, replicated."""

    def loss(x, wq, wk, wv, ct, segments):  # x[b, S, D], w*[D, heads·HD], ct[b, h, S, HD]
        def heads(w, split: bool):  # [b, heads, S, HD]: x·w per head (this device's if split)
            t = jnp.einsum("bsd,dh->bsh", x, w).reshape(x.shape[0], S, -1, HD)
            if sharded and split:
                count = t.shape[2] // 2  # the heads of one of the 2 devices on model
                t = lax.dynamic_slice_in_dim(t, lax.axis_index("model") * count, count, axis=2)
            return t.transpose(0, 2, 1, 3)

        q = heads(wq, split=True)
        k, v = (heads(w, split=kv_heads > 1) for w in (wk, wv))
        o = fn(q, k, v, causal=True, segment_ids=segments, interpret=True)  # [b, h, S, HD]
        total = (o * ct).sum()
        return lax.psum(total, ("data", "model")) if sharded else total

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    if not sharded:
        return jax.jit(grad)
    mesh = shardops.make_mesh({"data": 2, "model": 2})
    rows = P("data")
    return jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(rows, P(), P(), P(), P("data", "model"),
                                 rows), out_specs=(rows, P(), P(), P()), check_vma=True))  # fmt: skip


def projected_inputs(kv_heads: int):
    rng = np.random.default_rng(1)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)  # noqa: E731
    x = jnp.asarray(rng.standard_normal((B, S, D)), jnp.float32)
    wq, wk, wv = draw(D, H * HD), draw(D, kv_heads * HD), draw(D, kv_heads * HD)
    ct = jnp.asarray(rng.standard_normal((B, H, S, HD)), jnp.float32)
    segments = jnp.asarray(np.arange(S)[None] >= np.array([[40], [90]]), jnp.int32)  # [B, S]
    return x, wq, wk, wv, ct, segments


def check_replicated_weights(fn, kv_heads: int):
    """The gradients of ``x`` and of the replicated ``wq``, ``wk``, ``wv`` under ``shard_map``
    equal the unsharded run's: the same kernel on the same per-head inputs, so only the order of
    the float32 sums (the projections' and the psums') differs."""
    args = projected_inputs(kv_heads)
    got = projected_attention(fn, kv_heads, sharded=True)(*args)
    want = projected_attention(fn, kv_heads, sharded=False)(*args)
    for name, a, b in zip(("x", "wq", "wk", "wv"), got, want, strict=True):
        error = float(jnp.abs(a - b).max() / jnp.abs(b).max())
        assert error <= F32_RTOL, f"kv_heads={kv_heads}: d{name} is off by {error:.3g} of its max"


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa_kv_split", "mqa_kv_replicated"])
def test_replicated_weights_get_the_unsharded_gradient(kv_heads):
    """GQA with the KV heads split over ``model``, and MQA with the one KV head replicated over
    ``model`` (its ``dk``, ``dv`` summed over the devices' query heads by the wrapper's psum)."""
    check_replicated_weights(splash_attention, kv_heads)


def test_a_plain_pallas_call_is_refused_under_check_vma():
    """Why the wrapper exists: the splash kernel called directly in ``shard_map(check_vma=True)``
    raises, because its ``out_shape`` carries no manual axis type."""
    q, k, *_ = inputs(CASES["plain"])
    kernel = _splash._kernel(128, 1, False, 128, True)
    mesh = shardops.make_mesh({"model": 2})
    direct = jax.shard_map(lambda q, k: kernel(q[0], k[0, 0], k[0, 0]), mesh=mesh,
                           in_specs=P(None, "model"), out_specs=P("model"), check_vma=True)  # fmt: skip
    with pytest.raises(ValueError, match="manual_axis_type"):
        jax.jit(direct)(q, k)


def test_the_unchecked_region_compiles_to_nothing():
    """The nested region and its ·1 (which drops the inputs' types) leave no op and no
    collective in the compiled program: only the body's own sine."""
    mesh = shardops.make_mesh({"model": 2})
    body = jax.shard_map(lambda x: _splash._unchecked(jnp.sin, x), mesh=mesh,
                         in_specs=P("model"), out_specs=P("model"))  # fmt: skip
    hlo = jax.jit(body).lower(jnp.ones(8)).compile().as_text()
    ops = {line.split("=")[1].split("(")[0].split()[-1] for line in hlo.splitlines()
           if " = " in line and "parameter(" not in line}  # fmt: skip
    assert ops <= {"sine", "fusion"}, ops


def wrapper_reductions(module, policy) -> list[tuple[str, tuple, tuple]]:
    """``(kind, mesh axes, dtypes)`` of each collective the wrapper asks for (its reason,
    ``splash_replicated_operand``, is in the op name) in the gradient of ``projected_attention``
    under ``policy``: MQA, its one KV head replicated over ``model`` while the query heads are
    split, so ``dk`` and ``dv`` are summed over ``model``. Traced only: the kernel neither runs
    nor is interpreted."""
    attend = functools.partial(module.splash_attention, precision=policy)
    grads = projected_attention(attend, 1, sharded=True)
    mesh = shardops.make_mesh({"data": 2, "model": 2})
    found = shardops.inspect.traced_collectives(mesh, grads, *projected_inputs(1))
    return [(c.kind, c.axes, c.dtypes) for c in found
            if "splash_replicated_operand" in c.op_name]  # fmt: skip


def check_wrapper_reductions(module) -> None:
    """Under both bf16 policies the kernel's ``dk`` and ``dv`` (bf16) are summed over
    ``model`` in float32, as the module docstring says: one AllReduce each. XLA:CPU sums a
    bf16 AllReduce in float32 anyway, so a bf16 one gives the same values here and rounds
    at every step of the ring on a TPU: only the program shows it."""
    for policy in (MIXED, shardops.BFLOAT16):
        got = wrapper_reductions(module, policy)
        assert got == [("all-reduce", ("model",), ("f32",))] * 2, (
            f"{policy.name}: the wrapper's reductions are {got}, not two AllReduces over "
            f"model in float32"
        )


def test_the_backward_sums_replicated_operands_in_float32():
    check_wrapper_reductions(_splash)


def test_under_remat_in_shard_map():
    """``jax.checkpoint`` around the attention (the forward re-run in the backward, the
    pullback rebuilt) gives the same gradients inside ``shard_map(check_vma=True)``."""

    def rematted(q, k, v, **kw):
        return jax.checkpoint(lambda q, k, v: splash_attention(q, k, v, **kw))(q, k, v)

    args = projected_inputs(1)
    got = projected_attention(rematted, 1, sharded=True)(*args)
    want = projected_attention(splash_attention, 1, sharded=True)(*args)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=F32_RTOL * float(jnp.abs(b).max()))


# --- mutants of the wrapper -------------------------------------------------------------------

SCALE = "    scale = 1.0 / math.sqrt(hd)  # splash does not scale the scores: q·(1/√hd) before it"
RETYPE = "    return _vary(o, varies), (pullback, kinds)  # o[B, n, g, S, hd] in compute"
EXTRA = "extra = tuple(sorted(varies - varying_axes(kind)))"
RETYPE_GRAD = "        grad = _vary(grad, varies)  # its value varies as o does"
REDUCE = "grad = all_reduce(grad.astype(jnp.float32), extra, reason=_REPLICATED_OPERAND)"
OFF = (AssertionError, "off by")  # a value beyond its bound
TYPED = (ValueError, "manual axis types do not match")  # check_vma refuses the program

REDUCED = (AssertionError, "not two AllReduces over model in float32")  # the program's dtypes

# name → (line, replacement, the check that catches it: "values", the kv_heads of the
# replicated-weights check or "reductions" (check_wrapper_reductions), and how it fails)
MUTANTS = {
    # The 1/√hd scale forgotten (splash does not apply it).
    "scale_dropped": (SCALE, "    scale = 1.0", "values", OFF),
    # o leaves the region typed invariant: autodiff then sums its cotangent over the devices.
    "output_left_invariant": (RETYPE, "    return o, (pullback, kinds)", 2, OFF),
    # The kernel's cotangents left typed invariant (dq of heads split over model returned as
    # if equal on every device): check_vma refuses it.
    "cotangent_left_invariant": (RETYPE_GRAD, "        grad = grad", 1, TYPED),
    # The cotangents psummed over every axis o varies over, not only where the primal is
    # replicated (dq summed over the devices' different heads): check_vma refuses it.
    "cotangents_psummed_over_every_axis": (EXTRA, "extra = tuple(sorted(varies))", 1, TYPED),
    # dk, dv summed in the kernel's bf16: right on CPU (which sums in float32 anyway).
    "replicated_gradients_summed_in_bfloat16": (
        REDUCE,
        REDUCE.replace("grad.astype(jnp.float32)", "grad"),
        "reductions",
        REDUCED,
    ),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(name):
    line, replacement, check, (error, message) = MUTANTS[name]
    module = mutant(_splash, name, line, replacement)
    with pytest.raises(error, match=message):
        if check == "values":
            check_against_reference(module.splash_attention, CASES["plain"])
        elif check == "reductions":
            check_wrapper_reductions(module)
        else:
            check_replicated_weights(module.splash_attention, check)


def test_an_unmutated_copy_passes():
    module = mutant(_splash, "unmutated", SCALE, SCALE)
    check_against_reference(module.splash_attention, CASES["plain"])
    check_replicated_weights(module.splash_attention, 1)
    check_wrapper_reductions(module)


# --- what splash cannot run, and the dispatcher's fallback reason -------------------------------


def test_unsupported_shapes_are_named_and_refused():
    q = jnp.zeros((1, 2, 128, 128))
    assert splash_unsupported_reason(q.shape, q.shape, interpret=True) is None
    assert "block=0" in splash_unsupported_reason(q.shape, q.shape, block=0, interpret=True)
    if jax.default_backend() != "tpu":
        with refused(ValueError, argument="splash attention is a TPU kernel",
                     got="the backend is 'cpu'", expected="TPU kernel",
                     fix="interpret=True"):  # fmt: skip
            splash_attention(q, q, q)
    with refused(ValueError, argument="the sequence length S=200", got="not a multiple of 128",
                 expected="multiple of 128", fix="pad the sequence to 256"):  # fmt: skip
        splash_attention(*(jnp.zeros((1, 2, 200, 128)),) * 3, interpret=True)
    with refused(ValueError, argument="the head dim hd=64", got="not a multiple of 128",
                 expected="multiple of 128", fix="heads of 128 dims"):  # fmt: skip
        splash_attention(*(jnp.zeros((1, 2, 128, 64)),) * 3, interpret=True)
    with refused(ValueError, argument="block=192", got="blocks of 192 for S=384",
                 expected="a multiple of 128 that divides S", fix="pass block=128"):  # fmt: skip
        splash_attention(*(jnp.zeros((1, 2, 384, 128)),) * 3, block=192, interpret=True)
    with refused(ValueError, argument="block=0", got="block=0", expected="an integer ≥ 1",
                 fix="pass e.g. block=512"):  # fmt: skip
        splash_attention(q, q, q, block=0, interpret=True)
    with refused(ValueError, argument="q has H=2 heads", got="n=3", expected="H % n == 0",
                 fix="pick n among the divisors of 2"):  # fmt: skip
        splash_attention(q, *(jnp.zeros((1, 3, 128, 128)),) * 2, interpret=True)
