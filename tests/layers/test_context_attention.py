"""Context-parallel attention (all-gather K/V, ring, Ulysses): forward and every gradient against
the float64 reference (derived bound, ``_attention_checks``) on context sizes 1, 2, 4, 8 and
3-axis meshes, a hypothesis property over fixed shape buckets, the ledger's bytes against
formulas written here, and clear errors for bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _context_checks import CONTEXT, check_context_attention, context_ledger, mesh_of
from _cover import FULL, cover
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardops
from shardops.inspect._ledger import ring_bytes
from shardops.layers import (
    CONTEXT_METHODS,
    ContextParallel,
    _context_attention,
    balanced_order,
    context_parallel_attention,
    context_parallel_attention_kernel,
    context_parallel_attention_specs,
    init_attention,
    inverse_order,
)

F32, BF16 = shardops.FLOAT32, shardops.BFLOAT16
C, DT, M = (CONTEXT,), ("data",), ("model",)


def test_balanced_order_by_hand():
    # S = 8 over 2 devices: chunks of 2; device 0 holds chunks 0 and 3, device 1 chunks 1, 2.
    assert balanced_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert balanced_order(8, 1).tolist() == list(range(8))
    for seq, n in ((16, 4), (48, 8), (12, 3)):
        order = balanced_order(seq, n)
        assert sorted(order.tolist()) == list(range(seq))
        assert (order[inverse_order(seq, n)] == np.arange(seq)).all()
        # Under a causal mask every device's queries see the same number of keys.
        work = [order[d * seq // n:(d + 1) * seq // n].sum() + seq // n for d in range(n)]  # fmt: skip
        assert len(set(work)) == 1, work


def test_local_positions_are_the_layout():
    """The positions a device computes inside ``shard_map`` are its block of the layout."""
    mesh = mesh_of(((CONTEXT, 4),))
    context = ContextParallel(CONTEXT, "ring")

    def body(dummy):
        return context.positions(dummy.shape[1])[None]

    got = jax.shard_map(body, mesh=mesh, in_specs=P(None, CONTEXT), out_specs=P(None, CONTEXT))(
        jnp.zeros((1, 16))
    )
    assert np.asarray(got)[0].tolist() == balanced_order(16, 4).tolist()


# --- forward and gradients against the reference ----------------------------------------------

MESHES = [
    ((CONTEXT, 1),),
    ((CONTEXT, 2),),
    ((CONTEXT, 4),),
    ((CONTEXT, 8),),
    (("data", 2), (CONTEXT, 2), ("model", 2)),
    (("data", 2), (CONTEXT, 4)),
    ((CONTEXT, 2), ("model", 4)),
    ((CONTEXT, 4), ("model", 2)),
]
HEADS = 8
KV = [8, 2, 1]  # multi-head, grouped (H/4), multi-query


def _valid(method, axes, kv, sequence_parallel, *_):
    sizes = dict(axes)
    n, p = sizes[CONTEXT], sizes.get("model", 1)
    if sequence_parallel and p == 1:
        return False
    if method == "ulysses":  # the local query heads and the KV heads sent divide by N
        return (HEADS // p) % n == 0 and kv % (p * n) == 0
    return True


# Every pair of values of any two factors (tests/_cover.py); every triple under
# SHARDOPS_FULL=1 (the full product is ~1,900 programs). S = 32 divides by 2N and, with
# sequence parallelism, by N·p.
CASES = cover(
    CONTEXT_METHODS, MESHES, KV, [False, True], [False, True], [F32, BF16], [None, 10000.0], [1, 3],
    valid=_valid, t=3 if FULL else 2, full=False,
)  # fmt: skip


def _case_id(case):
    method, axes, kv, sp, causal, precision, rope, docs = case
    mesh = "x".join(f"{k[0]}{v}" for k, v in axes)
    return (f"{method}-{mesh}-kv{kv}{'-sp' if sp else ''}{'-causal' if causal else ''}-"
            f"{precision.name}{'-rope' if rope else ''}-docs{docs}")  # fmt: skip


def _check(case, temperature=1.0, seed=0):
    method, axes, kv, sp, causal, precision, rope, docs = case
    return check_context_attention(
        axes, method, precision, seq=32, num_heads=HEADS, num_kv_heads=kv, causal=causal,
        rope_theta=rope, documents=docs, sequence_parallel=sp, temperature=temperature,
        seed=seed,
    )  # fmt: skip


def test_cases_hold_every_method_on_every_context_size():
    seen = {(c[0], dict(c[1])[CONTEXT]) for c in CASES}
    assert seen == {(m, n) for m in CONTEXT_METHODS for n in (1, 2, 4, 8)}
    three_axis = {c[0] for c in CASES if len(c[1]) == 3}
    assert three_axis == set(CONTEXT_METHODS)
    for method in CONTEXT_METHODS:  # causal and not, MHA/GQA/MQA where the method takes them
        assert {c[4] for c in CASES if c[0] == method} == {False, True}
        assert {c[2] for c in CASES if c[0] == method} == set(KV)


def _property(case, temperature, seed):
    _check(case, temperature, seed)


# Every case of the covering design runs first (``example``), then hypothesis draws ≥ 200 more
# from the same compiled programs with new inputs, documents and temperatures.
_property = settings(max_examples=600 if FULL else 200)(
    given(
        case=st.sampled_from(CASES),
        temperature=st.sampled_from([0.25, 1.0, 4.0]),  # flat to peaked attention
        seed=st.integers(0, 2**16),  # the inputs and the documents' boundaries
    )(_property)
)
for _case in CASES:
    _property = example(case=_case, temperature=1.0, seed=0)(_property)
test_context_attention_equals_reference = _property


def test_sequence_parallel_and_bias_free_on_three_axes():
    for method in CONTEXT_METHODS:
        check_context_attention(MESHES[4], method, seq=32, num_kv_heads=4, causal=True,
                                rope_theta=10000.0, documents=2, sequence_parallel=True,
                                use_bias=False)  # fmt: skip


def test_kv_heads_read_by_index():
    """12 heads, 2 KV heads on model = 3: K/V replicated over model, and device 1's 4 query heads
    read both KV heads (by index, not by contiguous groups). The ring and the all-gather move
    the 2 KV heads and expand them after; Ulysses sends each query head's."""
    axes = ((CONTEXT, 2), ("model", 3))
    for method, precision in (("ring", F32), ("allgather", BF16), ("ring", BF16),
                              ("ulysses", F32)):  # fmt: skip
        check_context_attention(axes, method, precision, seq=32, num_heads=12, num_kv_heads=2,
                                causal=True, rope_theta=10000.0, documents=2)  # fmt: skip
    led = context_ledger(axes, "ring", num_heads=12, num_kv_heads=2)
    block = 2 * 4 * B * (S // 2) * 2 * HD  # k, v[B, 2 KV heads, S/2, hd]: not 4 query heads'
    assert led.by_pass()["forward"][("collective-permute", C)] == block


# --- the ledger against formulas written here ----------------------------------------------------

B, S, D, HD = 4, 16, 32, 4  # context_ledger's shapes: x[B, S, D], 8 heads of 4


def _weights(h, kv, d=D, hd=HD):
    """Bytes of the (local) weight gradients: wq, wo[D, h·hd], wk, wv[D, kv·hd] and biases."""
    return 4 * (2 * d * h * hd + 2 * d * kv * hd + h * hd + 2 * kv * hd + d)


def _expected(method, n, *, b, h, kv, documents):
    """``{pass: {(kind, axes): V}}`` over context, and ``{pass: bytes each device sends}``."""
    s = S // n
    seg = documents > 1
    if method == "allgather":
        kv_all = 2 * 4 * b * S * kv * HD  # k and v gathered to [b, kv, S, hd], f32
        fwd = {("all-gather", C): kv_all + (4 * b * S if seg else 0)}
        bwd = {("reduce-scatter", C): kv_all}
        sent = {"forward": 8 * b * S * kv * HD * (n - 1) / n + (4 * b * S * (n - 1) / n if seg else 0),
                "backward": 8 * b * S * kv * HD * (n - 1) / n}  # fmt: skip
    elif method == "ring":
        block = 2 * 4 * b * s * kv * HD  # this device's k and v blocks
        fwd = {("collective-permute", C): (n - 1) * block}
        # K/V (and segment ids) round again the other way, N − 1 steps; dK/dV N steps (the
        # last goes home). At N = 2 both ways are the same swap: the forward keeps the peer's
        # block instead.
        again = n - 1 if n > 2 else 0
        bwd = {("collective-permute", C): (again + n) * block}
        sent = {"forward": fwd[("collective-permute", C)] + (4 * b * S * (n - 1) / n if seg else 0),
                "backward": bwd[("collective-permute", C)]}  # fmt: skip
        if seg:  # the segment ids gathered once (each step slices its block)
            fwd[("all-gather", C)] = 4 * b * S
    else:
        a2a = 4 * b * s * (2 * h + 2 * kv) * HD  # q, o[b, s, h, hd]; k, v[b, s, kv, hd]
        fwd = {("all-to-all", C): a2a}
        if seg:
            fwd[("all-gather", C)] = 4 * b * S
        bwd = {("all-to-all", C): a2a}
        sent = {"forward": a2a * (n - 1) / n + (4 * b * S * (n - 1) / n if seg else 0),
                "backward": a2a * (n - 1) / n}  # fmt: skip
    return {"forward": fwd, "backward": bwd}, sent


LEDGER_CASES = cover(CONTEXT_METHODS, [2, 4, 8], [8, 4], [1, 3], t=2)


@pytest.mark.parametrize(("method", "n", "kv", "documents"), LEDGER_CASES, ids=str)
def test_ledger_bytes_per_pass(method, n, kv, documents):
    """Context-only meshes: every collective over context, per pass, equals the formulas; the
    weight gradients (replicated over context) AllReduce in the backward."""
    if method == "ulysses" and kv % n:
        kv = HEADS
    led = context_ledger(((CONTEXT, n),), method, num_kv_heads=kv, documents=documents)
    want, sent = _expected(method, n, b=B, h=HEADS, kv=kv, documents=documents)
    want["backward"][("all-reduce", C)] = _weights(HEADS, kv)
    got = led.by_pass()
    assert {p: got[p] for p in want} == want
    assert not got["optimizer"]
    for pass_, nbytes in sent.items():
        moved = sum(
            ring_bytes(c.kind, e, c.group_size)
            for c in led.collectives if c.kind != "all-reduce"
            for p, e in zip(c.passes, c.element_bytes, strict=True) if p == pass_
        )  # fmt: skip
        assert moved == pytest.approx(nbytes), (pass_, moved, nbytes)
    assert led.totals(requested=True) == led.totals()  # all float32: as requested


@pytest.mark.parametrize("method", CONTEXT_METHODS)
def test_ledger_on_three_axes(method):
    """data=2 × context=2 × model=2, 4 KV heads split over model: the context collectives move
    the local heads of the local rows; the weight gradients AllReduce over (data, context);
    the heads' partial sums over model as head-parallel attention's."""
    axes = (("data", 2), (CONTEXT, 2), ("model", 2))
    led = context_ledger(axes, method, num_kv_heads=4)
    want, _ = _expected(method, 2, b=B // 2, h=HEADS // 2, kv=2, documents=1)
    y = (B // 2) * (S // 2) * D * 4  # y, dx[b, s, D] in f32 over model
    want["forward"][("all-reduce", M)] = y
    want["backward"][("all-reduce", M)] = y
    want["backward"][("all-reduce", ("data", CONTEXT))] = _weights(HEADS // 2, 2)
    got = led.by_pass()
    assert {p: got[p] for p in want} == want


@pytest.mark.parametrize("method", CONTEXT_METHODS)
def test_bf16_moves_rounded_values_forward_and_f32_gradients(method):
    """Under BFLOAT16 q, k, v, o move in bfloat16 (what the products read); every gradient in
    float32: the requested bytes are half the f32 forward's plus the f32 backward's."""
    kv = HEADS if method == "ulysses" else 2
    led = context_ledger(((CONTEXT, 4),), method, num_kv_heads=kv, precision=BF16)
    want, _ = _expected(method, 4, b=B, h=HEADS, kv=kv, documents=1)
    requested = led.totals(requested=True)
    for key, fwd in want["forward"].items():
        bwd = want["backward"].get(key, 0)
        if method == "ring":  # the backward ring's K/V move rounded too; dK/dV in f32
            block = 2 * 4 * B * (S // 4) * kv * HD
            assert requested[key] == fwd // 2 + 3 * block // 2 + 4 * block
        else:
            assert requested[key] == fwd // 2 + bwd, (key, requested)


# --- errors ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
    return init_attention(jax.random.key(0), 32, HEADS, 4, num_kv_heads=2)


def test_sequence_not_divisible_by_twice_the_context(params):
    mesh = mesh_of(((CONTEXT, 4),))
    x = jnp.zeros((2, 12, 32))
    with pytest.raises(ValueError, match=r"x dim 1 \(sequence\) = 12 is not divisible by 2 × "
                       r"mesh axis 'context' \(size 4\) = 8: .* Use a sequence length that is a "
                       r"multiple of 8 \(e\.g\. 16\), or a smaller context axis\."):  # fmt: skip
        context_parallel_attention(x, params, mesh=mesh, num_heads=HEADS, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"length 12 must be a positive multiple of 2 × the "
                       r"context size 4 = 8 \(each device holds two non-empty chunks\); e\.g\. 16"):  # fmt: skip
        balanced_order(12, 4)


def test_ulysses_heads_not_divisible_names_both(params):
    mesh = mesh_of(((CONTEXT, 4),))
    x = jnp.zeros((2, 16, 32))
    with pytest.raises(ValueError, match=r"query heads 8, key/value heads 2\), do not divide by 4"):
        context_parallel_attention(x, params, mesh=mesh, num_heads=HEADS, num_kv_heads=2,
                                   method="ulysses")  # fmt: skip


def test_bad_method_and_axis(params):
    with pytest.raises(ValueError, match="must be one of"):
        ContextParallel(CONTEXT, "rings")
    with pytest.raises(TypeError, match="axis_name must be a mesh axis name"):
        ContextParallel("", "ring")
    mesh = mesh_of(((CONTEXT, 2),))
    with pytest.raises(ValueError, match="must be one of"):
        context_parallel_attention(jnp.zeros((2, 8, 32)), params, mesh=mesh, num_heads=HEADS,
                                   num_kv_heads=2, method="ulysses2")  # fmt: skip


def test_sequence_parallel_needs_a_model_axis(params):
    with pytest.raises(ValueError, match="give model_axis"):
        context_parallel_attention_specs(sequence_parallel=True)
    mesh = mesh_of(((CONTEXT, 2),))

    def body(x):
        return context_parallel_attention_kernel(x, params, num_heads=HEADS, num_kv_heads=2,
                                                 sequence_parallel=True)  # fmt: skip

    with pytest.raises(ValueError, match="give model_axis"):
        jax.shard_map(body, mesh=mesh, in_specs=P(None, CONTEXT), out_specs=P(None, CONTEXT))(
            jnp.zeros((2, 8, 32))
        )


def test_rope_with_segments_needs_global_positions_in_the_kernel(params):
    mesh = mesh_of(((CONTEXT, 2),))

    def body(x, seg):
        return context_parallel_attention_kernel(x, params, num_heads=HEADS, num_kv_heads=2,
                                                 rope_theta=10000.0, segment_ids=seg)  # fmt: skip

    with pytest.raises(ValueError, match="pass positions: a document may begin on another"):
        jax.shard_map(body, mesh=mesh, in_specs=(P(None, CONTEXT), P(None, CONTEXT)),
                      out_specs=P(None, CONTEXT))(jnp.zeros((2, 8, 32)),
                                                  jnp.zeros((2, 8), jnp.int32))  # fmt: skip


def test_tokens_already_in_the_layout(params):
    """``permute=False``: x, positions and segment ids given in the layout's order give the
    layout's y; RoPE's default positions still restart at each document in token order."""
    mesh = mesh_of(((CONTEXT, 2),))
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    seg = jnp.asarray(np.repeat([[0, 1]], 8, axis=1).reshape(1, 16).repeat(2, 0))  # 2 documents
    order = balanced_order(16, 2)
    options = {"mesh": mesh, "num_heads": HEADS, "num_kv_heads": 2, "causal": True,
               "rope_theta": 10000.0}  # fmt: skip
    y = context_parallel_attention(x, params, segment_ids=seg, **options)
    y_layout = context_parallel_attention(x[:, order], params, segment_ids=seg[:, order],
                                          permute=False, **options)  # fmt: skip
    np.testing.assert_allclose(np.asarray(y_layout), np.asarray(y)[:, order], rtol=1e-6,
                               atol=1e-6)  # fmt: skip


def test_kernel_in_a_users_shard_map_equals_the_layer(params):
    """A user's ``shard_map`` over the layout runs the kernel; the layer (permuting in and out
    itself) gives the same y."""
    mesh = mesh_of(((CONTEXT, 4),))
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    order = balanced_order(16, 4)
    specs = context_parallel_attention_specs()

    def body(x):
        return context_parallel_attention_kernel(x, params, num_heads=HEADS, num_kv_heads=2,
                                                 causal=True, rope_theta=10000.0)  # fmt: skip

    y_layout = jax.shard_map(body, mesh=mesh, in_specs=specs.x, out_specs=specs.y)(x[:, order])
    y = context_parallel_attention(x, params, mesh=mesh, num_heads=HEADS, num_kv_heads=2,
                                   causal=True, rope_theta=10000.0)  # fmt: skip
    np.testing.assert_allclose(np.asarray(y_layout)[:, inverse_order(16, 4)], y, rtol=1e-6,
                               atol=1e-6)  # fmt: skip


# --- sizes checked before tracing: an empty sequence, suggested lengths, Ulysses' heads ----------
# Each check takes the module it checks, so the mutation module runs it on copies with a check
# lost (test_context_attention_mutations.py).

EMPTY = (r"x dim 1 \(sequence\) = 0 is empty; it needs a positive multiple of 2 × mesh axis "
         r"'context' \(size 4\) = 8: .* Use a sequence length that is a multiple of 8 "
         r"\(e\.g\. 8\), or a smaller context axis\.")  # fmt: skip


def check_an_empty_sequence_is_refused(layer, params):
    """S = 0 (it divides by anything) is refused, by the layer and by the kernel in a user's
    ``shard_map``, not a ZeroDivisionError from inside the trace."""
    mesh = mesh_of(((CONTEXT, 4),))
    x = jnp.zeros((2, 0, 32))
    for method in CONTEXT_METHODS:
        with pytest.raises(ValueError, match="context_parallel_attention: " + EMPTY):
            layer.context_parallel_attention(x, params, mesh=mesh, num_heads=HEADS,
                                             num_kv_heads=2, method=method)  # fmt: skip

        def body(x, method=method):
            return layer.context_parallel_attention_kernel(x, params, num_heads=HEADS,
                                                           num_kv_heads=2, method=method)  # fmt: skip

        with pytest.raises(ValueError, match=r"context_parallel_attention_kernel: the local "
                           r"sequence block has 0 tokens; .* mesh axis 'context' \(size 4\) .* "
                           r"the global S must be a positive multiple of 2 × 4 = 8 \(e\.g\. 8\)"):  # fmt: skip
            jax.shard_map(body, mesh=mesh, in_specs=P(None, CONTEXT), out_specs=P(None, CONTEXT))(x)
    with pytest.raises(ValueError, match=r"length 0 must be a positive multiple of 2 × the "
                       r"context size 4 = 8 .*; e\.g\. 8"):  # fmt: skip
        layer.balanced_order(0, 4)


def check_suggested_lengths_are_positive_and_valid(layer):
    """The length a sequence error suggests is positive and passes the check itself: below
    the multiple (3 on context 4 → 8), empty (0 → 8), and under sequence parallelism, where
    each device's block S/N must also split over model (context 2 × model 3: S a multiple of
    lcm(4, 6) = 12; 8 divides by 4 but 8/2 = 4 not by 3)."""
    cases = [(3, 4, None, 1, 8, 8), (0, 4, None, 1, 8, 8), (13, 2, None, 1, 4, 16),
             (8, 2, "model", 3, 12, 12), (4, 2, "model", 2, 4, 4), (6, 2, "model", 2, 4, 8)]  # fmt: skip
    for seq, n, model_axis, p, multiple, fit in cases:
        if fit != seq:
            with pytest.raises(ValueError, match=rf"= {seq} .*a multiple of {multiple} "
                               rf"\(e\.g\. {fit}\), or a smaller context axis"):  # fmt: skip
                layer.check_sequence("op", "x", seq, CONTEXT, n, model_axis, p)
        layer.check_sequence("op", "x", fit, CONTEXT, n, model_axis, p)  # the suggestion fits
    with pytest.raises(ValueError, match=r"by 2 × mesh axis 'context' \(size 2\) = 4 and, per "
                       r"device, by mesh axis 'model' \(size 3\): a multiple of 12"):  # fmt: skip
        layer.check_sequence("op", "x", 8, CONTEXT, 2, "model", 3)


ULYSSES = (r"Ulysses splits the heads over mesh axis 'context' \(size 4\), but the "
           r"key/value heads on each device, 2 \(query heads 8, key/value heads 2\), do not "
           r"divide by 4\. Use the 'ring' or 'allgather' method, or a context size dividing "
           r"both\.")  # fmt: skip


def check_ulysses_heads_in_a_users_shard_map(layer, params):
    """The kernels, called from a user's ``shard_map``, refuse heads Ulysses cannot split
    with shardops' error before JAX's all-to-all sees them: the context kernel (8 query, 2
    KV heads on context 4), and the head-parallel kernel with a context (8 heads, KV
    replicated over model 2: each device sends 4 query heads and, read by index, 4 K/V; on
    context 8 neither divides)."""
    mesh = mesh_of(((CONTEXT, 4),))

    def body(x):
        return layer.context_parallel_attention_kernel(x, params, num_heads=HEADS, num_kv_heads=2,
                                                       method="ulysses")  # fmt: skip

    with pytest.raises(ValueError, match="context_parallel_attention_kernel: " + ULYSSES):
        jax.shard_map(body, mesh=mesh, in_specs=P(None, CONTEXT), out_specs=P(None, CONTEXT))(
            jnp.zeros((2, 16, 32))
        )
    mesh = mesh_of(((CONTEXT, 4), ("model", 2)))
    specs = context_parallel_attention_specs(model_axis="model", replicate_kv=True)
    context = layer.ContextParallel(CONTEXT, "ulysses")

    def head_body(x, p):
        return shardops.layers.head_parallel_attention_kernel(
            x, p, num_heads=HEADS, num_kv_heads=1, axis_name="model", context=context)  # fmt: skip

    mqa = init_attention(jax.random.key(0), 32, HEADS, 4, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"head_parallel_attention_kernel: Ulysses splits the "
                       r"heads over mesh axis 'context' \(size 4\), but the key/value heads on "
                       r"each device, 1 \(query heads 4, key/value heads 1\), do not divide by "
                       r"4\. Use the 'ring' or 'allgather' method"):  # fmt: skip
        jax.shard_map(head_body, mesh=mesh, in_specs=(specs.x, {k: specs.params[k] for k in mqa}),
                      out_specs=specs.y)(jnp.zeros((2, 16, 32)), mqa)  # fmt: skip


def test_an_odd_block_under_sequence_parallelism_suggests_a_length_that_fits():
    check_an_odd_block_under_sequence_parallelism_suggests_a_length_that_fits(
        shardops.layers._context_attention
    )


def check_an_odd_block_under_sequence_parallelism_suggests_a_length_that_fits(layer):
    """The head-parallel kernel with a context and sequence parallelism, in a user's
    shard_map: 6 tokens on context 2 × model 3 give each device a block of 3, not two equal
    chunks; the length suggested fits both splits (a multiple of 2 · lcm(2, 3) = 12), not
    only 2 × 2 (8 would not split over model 3)."""
    mesh = mesh_of(((CONTEXT, 2), ("model", 3)))
    specs = context_parallel_attention_specs(model_axis="model", sequence_parallel=True)
    context = layer.ContextParallel(CONTEXT, "ring")
    full = init_attention(jax.random.key(0), 24, 6, 4)

    def body(x, p):
        return shardops.layers.head_parallel_attention_kernel(
            x, p, num_heads=6, axis_name="model", sequence_parallel=True, context=context)  # fmt: skip

    with pytest.raises(ValueError, match=r"head_parallel_attention_kernel: the local sequence "
                       r"block has 3 tokens; .* a positive multiple of 2 × 2 = 4 and, split 3 "
                       r"ways by sequence parallelism, of 12 \(e\.g\. 12\)"):  # fmt: skip
        jax.shard_map(body, mesh=mesh, in_specs=(specs.x, {k: specs.params[k] for k in full}),
                      out_specs=specs.y)(jnp.zeros((2, 6, 24)), full)  # fmt: skip


def check_ulysses_heads_sent_by_hand(layer):
    """The heads one device sends through Ulysses' all-to-all, counted by hand: split by
    model, H/p and KV/p; K/V replicated over model, the KV heads its query heads read (H = 8,
    KV = 2 on p = 4: device i's heads 2i, 2i+1 read KV head i // 2, one), expanded to one per
    query head when that is more than one (H = 6, KV = 3 on p = 2: device 0's heads 0, 1, 2
    read KV heads 0, 0, 1, so it sends 3 and 3)."""
    sent = layer.ulysses_heads_sent
    assert sent(8, 2) == (8, 2) and sent(8, 4, 2) == (4, 2)
    assert sent(8, 2, 4, replicated_kv=True) == (2, 1)
    assert sent(6, 3, 2, replicated_kv=True) == (3, 3)


def test_ulysses_heads_sent_by_hand():
    check_ulysses_heads_sent_by_hand(_context_attention)


def test_an_empty_sequence_is_refused(params):
    check_an_empty_sequence_is_refused(_context_attention, params)


def test_suggested_lengths_are_positive_and_valid():
    check_suggested_lengths_are_positive_and_valid(_context_attention)


def test_ulysses_heads_in_a_users_shard_map(params):
    check_ulysses_heads_in_a_users_shard_map(_context_attention, params)
