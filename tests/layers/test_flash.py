"""Blocked online-softmax attention (``shardops.layers.blocked_attention``): values and every
gradient against a float64 reference (causal, segments, GQA/MQA, a ragged last block, three
policies), the memory claim and the key block clipped to a short sequence read from the jaxpr,
the dtype flow, and clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _messages import refused
from jax.extend.core import ClosedJaxpr, Jaxpr

import shardops
from shardops.layers import BLOCK_K, _flash, blocked_attention
from shardops.testing import _subjaxprs, dtype_flow_violations

F32, MIXED, BF16 = shardops.FLOAT32, shardops.MIXED_BFLOAT16, shardops.BFLOAT16
# float32 results: every sum is over at most S + hd = 56 terms of float32 products, so the
# rounding is ≲ 56·eps(f32)·(terms) ≈ 7e-6 of the largest terms; measured ~3e-7 of max|ref|.
# A real bug (a missing rescale, a mask off by one, a dropped term) is O(1).
F32_RTOL = 1e-5


class Case:
    """One attention problem: q[B, H, S, hd], k, v[B, n, S, hd], masks, block_k, policy."""

    def __init__(self, name, heads=4, kv=4, seq=32, block_k=8, causal=False, segments=False,
                 precision=F32, batch=2, head_dim=8):  # fmt: skip
        self.name, self.heads, self.kv, self.seq = name, heads, kv, seq
        self.block_k, self.causal, self.segments, self.precision = (
            block_k,
            causal,
            segments,
            precision,
        )
        self.batch, self.head_dim = batch, head_dim

    def __repr__(self):
        return self.name


CASES = {
    c.name: c
    for c in [
        Case("plain"),
        Case("causal", causal=True),
        Case("segments", segments=True),
        Case("gqa_causal_segments", kv=2, causal=True, segments=True),
        Case("mqa_segments", kv=1, segments=True),
        Case("ragged_last_block", kv=2, seq=40, block_k=16),  # padded keys not hidden by causal
        Case("ragged_causal_segments", kv=2, seq=40, block_k=16, causal=True, segments=True),
        Case("one_block", kv=2, seq=40, block_k=512, causal=True),
    ]
}
BF16_CASES = {
    c.name: c
    for c in [
        Case(
            "mixed_bfloat16", kv=2, seq=40, block_k=16, causal=True, segments=True, precision=MIXED
        ),
        Case("bfloat16", kv=2, seq=40, block_k=16, causal=True, segments=True, precision=BF16),
    ]
}


def inputs(case: Case, seed=0):
    """q, k, v, a cotangent (float32 holding compute-dtype values) and segment ids or None.

    The segments are uneven and cross block boundaries, so a block holds rows that see none of
    its keys (and rows that have seen no key yet)."""
    rng = np.random.default_rng(seed)
    b, h, n, s, hd = case.batch, case.heads, case.kv, case.seq, case.head_dim
    compute = case.precision.compute_dtype

    def draw(*shape):  # values exact in the compute dtype: the reference checks arithmetic
        return np.asarray(jnp.asarray(rng.standard_normal(shape), compute), np.float32)

    q, k, v, ct = draw(b, h, s, hd), draw(b, n, s, hd), draw(b, n, s, hd), draw(b, h, s, hd)
    segments = None
    if case.segments:
        cuts = [[s // 3, s // 3 + 3], [2 * s // 3 + 1, s]]  # row b: segment 0 up to cuts[b][0], …
        segments = np.array([np.searchsorted(c, np.arange(s), side="right") for c in cuts])
        segments = segments.astype(np.int32)  # [B, S]
    return q, k, v, ct, segments


def reference(case: Case, q, k, v, ct, segments):
    """Exact float64 ``o`` and ``dq, dk, dv`` of ``sum(ct · o)``, the probabilities ``p`` and
    ``ds`` (for the bounds): the textbook softmax Jacobian, ``ds = p∘(dp − rowsum(p∘dp))``."""
    q, k, v, ct = (np.asarray(t, np.float64) for t in (q, k, v, ct))
    b, h, s, hd = q.shape
    g = h // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [B, H, S, hd]
    scale = 1 / np.sqrt(hd)
    scores = q @ kk.swapaxes(-1, -2) * scale  # [B, H, S, S]
    visible = np.ones((b, 1, s, s), bool)
    if case.causal:
        visible &= np.tril(np.ones((s, s), bool))
    if segments is not None:
        visible &= segments[:, None, :, None] == segments[:, None, None, :]
    scores = np.where(visible, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ vv
    dp = ct @ vv.swapaxes(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * scale
    dq = ds @ kk
    dk = (ds.swapaxes(-1, -2) @ q).reshape(b, -1, g, s, hd).sum(2)  # summed over each group
    dv = (p.swapaxes(-1, -2) @ ct).reshape(b, -1, g, s, hd).sum(2)
    return {"o": o, "dq": dq, "dk": dk, "dv": dv, "p": p, "ds": ds}


def run(fn, case: Case, q, k, v, ct, segments):
    """``o`` and its vjp with ``ct``, jitted, in the case's input dtype."""
    dtype = case.precision.param_dtype  # BFLOAT16 passes bf16 activations, the others float32
    q, k, v = (jnp.asarray(t, dtype) for t in (q, k, v))

    @jax.jit
    def go(q, k, v, ct, segments):
        def attend(q, k, v):
            return fn(q, k, v, causal=case.causal, segment_ids=segments, block_k=case.block_k,
                      precision=case.precision)  # fmt: skip

        o, vjp = jax.vjp(attend, q, k, v)
        return (o, *vjp(ct))

    return dict(zip(("o", "dq", "dk", "dv"), go(q, k, v, jnp.asarray(ct), segments), strict=True))


def bounds(case: Case, q, k, v, ct, want):
    """Elementwise error bounds, derived. Float32: ``F32_RTOL`` of the largest value. A bf16
    compute dtype (inputs and cotangent already exact in bf16, so q·kᵀ, dO·vᵀ are exact products
    summed in float32) rounds, with relative error ≤ u = eps/2 each:
      - the probabilities read by p·v: |Δo| ≤ u·(P·|v|);
      - the recomputed P read by Pᵀ·dO: |Δdv| ≤ u·(Pᵀ·|dO|);
      - dS = P∘(dP − D)/√hd, where D = rowsum(dO∘o) inherits o's error, |ΔD| ≤ |dO|·|Δo|, and
        dS is rounded: |ΔdS| ≤ P·|ΔD|/√hd + u·|dS|, read by dS·k and dSᵀ·q.
    We allow eps (2u) for each u, plus the float32 tolerance, plus eps(out)·|r| where a gradient
    is returned in bf16 (BFLOAT16's inputs)."""
    out = {name: F32_RTOL * np.abs(want[name]).max() for name in ("o", "dq", "dk", "dv")}
    if case.precision.compute_dtype == np.float32:
        return out
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    q, k, v, ct = (np.abs(np.asarray(t, np.float64)) for t in (q, k, v, ct))
    b, h, s, hd = q.shape
    g = h // k.shape[1]
    p = want["p"]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    bound_o = eps * (p @ vv)  # [B, H, S, hd]
    bound_d = (ct * bound_o).sum(-1, keepdims=True)  # [B, H, S, 1]: D's error
    bound_ds = p * bound_d / np.sqrt(hd) + eps * np.abs(want["ds"])  # [B, H, S, S]
    grouped = {
        "o": bound_o,
        "dq": bound_ds @ kk,
        "dk": (bound_ds.swapaxes(-1, -2) @ q).reshape(b, -1, g, s, hd).sum(2),
        "dv": eps * (p.swapaxes(-1, -2) @ ct).reshape(b, -1, g, s, hd).sum(2),
    }
    rounded = case.precision.param_dtype != np.float32  # gradients come back in bf16
    for name in out:
        out[name] = out[name] + grouped[name]
        if rounded and name != "o":
            out[name] = out[name] + eps * np.abs(want[name])
    return out


def check_against_reference(fn, case: Case):
    """``fn`` (``blocked_attention`` or a mutant's) matches the float64 reference within the
    derived bounds, values and gradients; raises ``AssertionError`` naming what is off."""
    q, k, v, ct, segments = inputs(case)
    want = reference(case, q, k, v, ct, segments)
    got = run(fn, case, q, k, v, ct, segments)
    bound = bounds(case, q, k, v, ct, want)
    expected_dtypes = {"o": case.precision.accum_dtype, **dict.fromkeys(("dq", "dk", "dv"),
                       case.precision.param_dtype)}  # fmt: skip
    for name, value in got.items():
        assert value.dtype == expected_dtypes[name], (name, value.dtype)
        error = np.abs(np.asarray(value, np.float64) - want[name])
        worst = float((error / bound[name]).max())
        assert worst <= 1, f"{case}: {name} is off by {worst:.3g}× its bound"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_values_and_gradients_match_float64(case):
    check_against_reference(blocked_attention, case)


@pytest.mark.parametrize("case", BF16_CASES.values(), ids=BF16_CASES)
def test_bfloat16_policies_within_the_derived_bound(case):
    check_against_reference(blocked_attention, case)


def test_the_bfloat16_bound_is_tight_enough_to_see_the_rounding():
    """The bf16 bound is not vacuous: MIXED_BFLOAT16's worst error on ``o`` and ``dv`` (the
    products whose rounding the bound models first-hand) is more than 1/20 of it, and more than
    the float32 tolerance (so the run does round). Measured: ~0.3 of the bound."""
    case = BF16_CASES["mixed_bfloat16"]
    q, k, v, ct, segments = inputs(case)
    want = reference(case, q, k, v, ct, segments)
    got = run(blocked_attention, case, q, k, v, ct, segments)
    bound = bounds(case, q, k, v, ct, want)
    for name in ("o", "dv"):
        error = np.abs(np.asarray(got[name], np.float64) - want[name])
        assert error.max() > F32_RTOL * np.abs(want[name]).max(), name
        assert 0.05 < (error / bound[name]).max() <= 1, name


def shapes_with_two_dims_of(jaxpr, size: int) -> list[tuple[str, tuple]]:
    """Every variable of ``jaxpr`` (and of the jaxprs nested in its equations' params: scan
    bodies, custom-VJP rules, jit) whose shape has two or more dims equal to ``size``."""
    found = []
    for var in (*jaxpr.invars, *jaxpr.outvars, *jaxpr.constvars):
        if list(getattr(var.aval, "shape", ())).count(size) >= 2:
            found.append(("argument", var.aval.shape))
    for eqn in jaxpr.eqns:
        for var in (*eqn.invars, *eqn.outvars):
            if list(getattr(var.aval, "shape", ())).count(size) >= 2:
                found.append((eqn.primitive.name, var.aval.shape))
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, ClosedJaxpr):
                    found += shapes_with_two_dims_of(item.jaxpr, size)
                elif isinstance(item, Jaxpr):
                    found += shapes_with_two_dims_of(item, size)
    return found


# S = 48 and no other dim of the problem is 48 (B=2, H=4, n=2, g=2, hd=8, block_k=16, 3 blocks).
MEMORY = Case("memory", kv=2, seq=48, block_k=16, causal=True, segments=True)


def loss_and_grads_jaxpr(fn):
    q, k, v, ct, segments = inputs(MEMORY)

    def loss(q, k, v):
        return (fn(q, k, v, causal=True, segment_ids=segments, block_k=16) * ct).sum()

    return jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def einsum_attention(q, k, v, *, causal, segment_ids, block_k):
    """The S×S einsum attention, for the check below to fail on."""
    del block_k
    g = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    seq = q.shape[2]
    visible = jnp.tril(jnp.ones((seq, seq), bool)) if causal else True
    visible = visible & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(jnp.where(visible, s, -jnp.inf)), v)


def test_forward_and_backward_never_hold_an_s_by_s_array():
    """The memory claim, read from the program: no value of the forward or the backward (scan
    bodies and the custom VJP included) has two dims of size S, while the einsum attention's
    program has them (so the check can fail), and the blocked one does scan over key blocks."""
    jaxpr = loss_and_grads_jaxpr(blocked_attention).jaxpr
    assert shapes_with_two_dims_of(jaxpr, MEMORY.seq) == []
    assert "scan" in str(jaxpr)
    einsum_shapes = shapes_with_two_dims_of(loss_and_grads_jaxpr(einsum_attention).jaxpr, 48)
    assert (2, 4, 48, 48) in [shape for _, shape in einsum_shapes]


# S = 64 under the layer's key block (BLOCK_K = 512): every other dim (B=2, H=4, n=2, g=2,
# hd=8) is smaller than S, so the largest dim of a product is its key block.
SHORT = Case("short", kv=2, seq=64, block_k=BLOCK_K, causal=True, segments=True)


def largest_product_dims(module=_flash) -> dict[str, int]:
    """The largest dim of any ``dot_general``'s operands or result (scan bodies and custom-VJP
    rules included) in the traced forward and backward of each entry point of the blocked
    core on ``SHORT``: ``blocked_attention`` with its default ``block_k`` (``attend``, which
    the layer calls with ``BLOCK_K``), and the ring steps' ``attention_with_lse`` and
    ``attention_backward`` with ``BLOCK_K``. Traced only: nothing runs."""
    q, k, v, ct, segments = inputs(SHORT)
    pos = jnp.arange(SHORT.seq, dtype=jnp.int32)
    tokens = dict(q_positions=pos, k_positions=pos, q_segments=segments, k_segments=segments,
                  causal=True, block_k=BLOCK_K, precision=F32)  # fmt: skip
    lse, delta = np.zeros(q.shape[:3], np.float32), np.zeros(q.shape[:3], np.float32)

    def attend(q, k, v):  # its gradient: the custom VJP's forward and backward
        return (module.blocked_attention(q, k, v, causal=True, segment_ids=segments) * ct).sum()

    def ring_forward(q, k, v):
        return module.attention_with_lse(q, k, v, **tokens)

    def ring_backward(q, k, v):
        return module.attention_backward(q, k, v, ct, lse, delta, **tokens)

    programs = {"blocked_attention": jax.grad(attend, argnums=(0, 1, 2)),
                "attention_with_lse": ring_forward, "attention_backward": ring_backward}  # fmt: skip
    out = {}
    for name, fn in programs.items():
        shapes = product_shapes(jax.make_jaxpr(fn)(q, k, v).jaxpr)
        out[name] = max(max(shape) for _, shape in shapes)
    return out


def product_shapes(jaxpr) -> list[tuple[str, tuple]]:
    """``("operand" or "result", shape)`` of every ``dot_general`` of ``jaxpr``, nested jaxprs
    included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found += [("operand", v.aval.shape) for v in eqn.invars]
            found += [("result", v.aval.shape) for v in eqn.outvars]
        for sub in _subjaxprs(eqn.params):
            found += product_shapes(sub)
    return found


def check_key_blocks_clipped(module=_flash) -> None:
    """The key block is clipped to the sequence: on S = 64 no product of the forward or the
    backward is wider than S. An unclipped block pads the keys to 512 and scores them all:
    the same values (the padding is masked), 8× the work and the score memory; so this is
    read from the program, not from the values."""
    for name, widest in largest_product_dims(module).items():
        assert widest == SHORT.seq, (
            f"{name}: a product has a dim of {widest} on S={SHORT.seq} with block_k={BLOCK_K}; "
            f"the key block is not clipped to the sequence"
        )


def test_the_key_block_is_clipped_to_a_short_sequence():
    check_key_blocks_clipped()


@pytest.mark.parametrize("policy", [F32, MIXED], ids=lambda p: p.name)
def test_every_product_and_sum_follows_the_policy(policy):
    """Forward and backward: matmuls of compute-dtype operands accumulating in float32 (full
    precision under FLOAT32), and every sum in float32 (``shardops.testing``'s dtype flow)."""
    q, k, v, ct, segments = inputs(MEMORY)

    def loss(q, k, v):
        o = blocked_attention(q, k, v, causal=True, segment_ids=segments, block_k=16,
                              precision=policy)  # fmt: skip
        return (o * ct).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))
    assert dtype_flow_violations(grads, q, k, v, policy=policy) == []


@pytest.mark.parametrize(
    ("block_k", "got"),
    [
        (0, "block_k=0"),
        (-4, "block_k=-4"),
        (16.0, "block_k=16.0"),
        (True, "block_k=True"),
    ],
)
def test_a_bad_block_k_is_refused(block_k, got):
    q, k, v, _, _ = inputs(CASES["plain"])
    with refused(ValueError, argument="block_k", got=got, expected="an integer ≥ 1",
                 fix="pass e.g. block_k=512"):  # fmt: skip
        blocked_attention(q, k, v, block_k=block_k)


def test_mismatched_heads_and_shapes_are_refused():
    q, k, v, _, _ = inputs(CASES["plain"])  # q[2, 4, 32, 8], k, v[2, 4, 32, 8]
    with refused(ValueError, argument="q has H=4 heads", got="n=3", expected="H % n == 0",
                 fix="pick n among the divisors of 4"):  # fmt: skip
        blocked_attention(q, k[:, :3], v[:, :3])
    with refused(ValueError, argument="k(2, 4, 16, 8)", got="v(2, 4, 16, 8)",
                 expected="[2, n, 32, 8]", fix="same batch, sequence and head dim"):  # fmt: skip
        blocked_attention(q, k[:, :, :16], v[:, :, :16])
    with refused(ValueError, argument="segment_ids", got="(2, 31)", expected="[2, 32]",
                 fix="one segment id per token"):  # fmt: skip
        blocked_attention(q, k, v, segment_ids=np.zeros((2, 31), np.int32))
    with refused(ValueError, argument="q has shape", got="(4, 32, 8)",
                 expected="4-D", fix=".transpose(0, 2, 1, 3)"):  # fmt: skip
        blocked_attention(q[0], k, v)
    with refused(TypeError, argument="precision='bf16'", got="not a Precision",
                 expected="shardops.FLOAT32", fix="pass shardops.FLOAT32"):  # fmt: skip
        blocked_attention(q, k, v, precision="bf16")


# (start, new tokens): a prefill, a step inside the second block, the last block clamped to
# the cache's end (S_max = 40 in blocks of 16: keys 24 … 39, of which 24 … 31 already folded
# in), and the last position.
CACHE_STEPS = [(0, 5), (20, 3), (37, 3), (39, 1)]


def cache_attention_reference(q, k, v, start):
    """float64: query ``i`` (position ``start + i``) over keys ``0 … start + i`` of the cache."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    visible = np.arange(k.shape[2])[None, :] <= start + np.arange(q.shape[2])[:, None]
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)


def check_cache_step(cache_attention, start: int, new: int) -> None:
    """``new`` queries at ``start`` over a cache of 40 in blocks of 16 against float64; the
    unwritten positions hold large finite garbage (masked, never read as keys)."""
    rng = np.random.default_rng(start)
    q = jnp.asarray(rng.normal(size=(2, 4, new, 8)), jnp.float32)
    k, v = (rng.normal(size=(2, 2, 40, 8)) for _ in range(2))
    want = cache_attention_reference(q, k[:, :, : start + new], v[:, :, : start + new], start)
    for t in (k, v):
        t[:, :, start + new :] = 1e4
    got = cache_attention(
        q, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
        q_positions=start + jnp.arange(new, dtype=jnp.int32), length=jnp.int32(start + new),
        block_k=16, precision=F32,
    )  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("start", "new"), CACHE_STEPS, ids=str)
def test_cache_attention_reads_only_the_written_blocks(start, new):
    """Decoding's blocked read of the cache: the blocks up to ``start + new`` only, a clamped
    last block not counted twice."""
    from shardops.layers._flash import cache_attention

    check_cache_step(cache_attention, start, new)


def test_cache_attention_mutants_are_caught():
    """A clamped last block's overlap counted twice, or the partly written last block skipped:
    some step of ``CACHE_STEPS`` fails on each."""
    from _mutants import mutant

    from shardops.layers import _flash

    lines = {
        "        real = key_positions >= i * block  # a clamped block's keys already folded in: "
        "masked": "        real = key_positions >= 0",
        "    carry = lax.fori_loop(0, (length + block - 1) // block, body, carry)":
        "    carry = lax.fori_loop(0, length // block, body, carry)",
    }  # fmt: skip
    for i, (line, replacement) in enumerate(lines.items()):
        module = mutant(_flash, f"cache_{i}", line, replacement)
        failed = []
        for start, new in CACHE_STEPS:
            try:
                check_cache_step(module.cache_attention, start, new)
            except AssertionError:
                failed.append((start, new))
        assert failed, f"mutant {replacement.strip()!r} passes every step"
    unmutated = mutant(_flash, "cache_copy", *[next(iter(lines))] * 2)
    for start, new in CACHE_STEPS:
        check_cache_step(unmutated.cache_attention, start, new)


@pytest.mark.parametrize(
    ("implementation", "seq"),
    [("einsum", 24), ("blocked", 24), ("auto", 24), ("blocked", BLOCK_K + 8)],
)
@pytest.mark.parametrize("causal", [True, False])
def test_local_attention_is_softmax_attention_in_float64(implementation, seq, causal):
    """``shardops.layers.local_attention``, each device's heads by an implementation, equals
    softmax(q·kᵀ/√hd)·v computed in float64 with grouped heads (query head j reads KV head
    j // (H/n)), causal or not; the blocked path over one key block and over two (the second
    padded). The bound: float32 products of hd = 8 and sums over at most S keys of weights
    that sum to 1, ~2e-7 relative, on outputs below 4: 2e-6."""
    rng = np.random.default_rng(3)
    q = rng.normal(size=(2, 4, seq, 8)).astype(np.float32)  # (B, H, S, hd)
    k, v = (rng.normal(size=(2, 2, seq, 8)).astype(np.float32) for _ in range(2))  # (B, n, S, hd)
    o = shardops.layers.local_attention(q, k, v, causal=causal, implementation=implementation)
    kh, vh = (np.repeat(t.astype(np.float64), 2, axis=1) for t in (k, v))  # (B, H, S, hd)
    scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), kh) / np.sqrt(8)
    if causal:
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bhqk,bhkd->bhqd", weights / weights.sum(-1, keepdims=True), vh)
    np.testing.assert_allclose(np.asarray(o), expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_local_attention_over_a_context_axis_is_the_whole_sequences(method):
    """``local_attention(..., context=)``: each device's block of the load-balanced layout
    attends over the whole sequence by the method, causal by global position, and equals the
    unsplit attention in float64 (the bound of the test above), grouped heads included."""
    from jax.sharding import PartitionSpec as P

    n, seq = 2, 16
    mesh = shardops.make_mesh({"context": n})
    rng = np.random.default_rng(4)
    q = rng.normal(size=(2, 4, seq, 8)).astype(np.float32)  # (B, H, S, hd)
    k, v = (rng.normal(size=(2, 2, seq, 8)).astype(np.float32) for _ in range(2))
    order = shardops.layers.balanced_order(seq, n)  # device-major: device i's chunks
    context = shardops.layers.ContextParallel("context", method)
    split = P(None, None, "context")
    run = jax.shard_map(
        lambda q, k, v: shardops.layers.local_attention(q, k, v, causal=True, context=context),
        mesh=mesh, in_specs=(split,) * 3, out_specs=split,
    )  # fmt: skip
    o = np.asarray(run(*(t[:, :, order] for t in (q, k, v))))[:, :, np.argsort(order)]
    kh, vh = (np.repeat(t.astype(np.float64), 2, axis=1) for t in (k, v))
    scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), kh) / np.sqrt(8)
    scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bhqk,bhkd->bhqd", weights / weights.sum(-1, keepdims=True), vh)
    np.testing.assert_allclose(o, expected, atol=2e-6, rtol=0)


def test_local_attention_refuses_heads_that_do_not_group():
    q, k = np.zeros((1, 3, 4, 2), np.float32), np.zeros((1, 2, 4, 2), np.float32)
    with pytest.raises(ValueError, match=r"q\[B, H, S, hd\] over k, v\[B, n, S, hd\] \(the same "
                                         r"B, S and hd; n ≥ 1 dividing H.*got q\(1, 3, 4, 2\)"):  # fmt: skip
        shardops.layers.local_attention(q, k, k)
