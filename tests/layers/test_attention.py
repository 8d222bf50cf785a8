"""Head-parallel attention: forward and every gradient against the float64 reference (derived
bound, ``_attention_checks``) on every mesh and policy, a hypothesis property, the compiled
collectives in bytes, the dtype flow, and clear errors for bad input."""

import functools
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_checks import (
    POLICIES,
    attention_ledger,
    check_attention,
    check_attention_dtype_flow,
    requested_and_compiled,
)
from _cover import FULL, cover_meshes
from _dense_checks import MESHES
from _messages import refused
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops.layers._attention import (
    AttentionSpecs,
    head_parallel_attention,
    head_parallel_attention_kernel,
    head_parallel_attention_specs,
    init_attention,
    splits_kv_heads,
)
from shardops.layers._rope import segment_positions

F32, BF16 = shardops.FLOAT32, shardops.BFLOAT16


# Meshes as a data-axis and a model-axis factor, each value paired with the other factor's
# (tests/_cover.py); every mesh × value under SHARDOPS_FULL=1.
@pytest.mark.parametrize(
    ("mesh_shape", "sequence_parallel"),
    cover_meshes(MESHES, [False, True]),
    ids=lambda v: str(v) if isinstance(v, tuple) else ["replicated", "seq_parallel"][v],
)
def test_matches_reference_on_every_mesh(mesh_shape, sequence_parallel):
    """Causal attention, x replicated over model or split along S; batch over data."""
    check_attention(mesh_shape, F32, batch=8, seq=16, causal=True,
                    sequence_parallel=sequence_parallel)  # fmt: skip


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)], ids=str)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "seq_parallel"])
def test_non_causal_and_without_biases(mesh_shape, sequence_parallel):
    check_attention(mesh_shape, F32, batch=8, seq=16, sequence_parallel=sequence_parallel)
    check_attention(mesh_shape, F32, batch=8, seq=16, causal=True, use_bias=False,
                    sequence_parallel=sequence_parallel)  # fmt: skip


@pytest.mark.parametrize(
    ("mesh_shape", "policy"), cover_meshes(MESHES, ["BFLOAT16", "MIXED_BFLOAT16"]), ids=str
)
def test_bf16_policies_on_every_mesh(policy, mesh_shape):
    """Under bf16 many outputs must equal the rounded reference bit for bit (see the bound)."""
    sequence_parallel = len(mesh_shape) == 2  # both layouts, across the meshes
    check_attention(mesh_shape, POLICIES[policy], batch=8, seq=16, causal=True,
                    sequence_parallel=sequence_parallel)  # fmt: skip


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_larger_block(policy):
    """D = 128, 16 heads of 8, S = 64 (longer contractions, 4 heads per device)."""
    check_attention((2, 4), POLICIES[policy], batch=2, seq=64, d_model=128, num_heads=16,
                    head_dim=8, causal=True, sequence_parallel=True, temperature=4.0)  # fmt: skip


# RoPE × {MHA, GQA, MQA} × causal × packed × sequence parallel, on every mesh: a covering design
# (every pair of values of any two factors; the full product under SHARDOPS_FULL=1). KV = 8 is
# multi-head, 2 and 4 grouped-query, 1 multi-query: on model = 4 and 8, KV = 1 and 2 are fewer
# KV heads than devices (wk, wv replicated over model), KV = 4 on model = 8 too.
MODERN = cover_meshes(MESHES, [8, 4, 2, 1], [False, True], [1, 3], [False, True])
# ...and, beyond the pairs, KV = 1 and 2 on model = 4 and 8 both with and without sp.
MODERN += [
    (mesh, kv, True, 3, sp)
    for kv in (1, 2) for mesh in ((2, 4), (8,)) for sp in (False, True)
    if not any(m[-1] == mesh[-1] and k == kv and s == sp for m, k, _, _, s in MODERN)
]  # fmt: skip


def test_modern_cases_hold_the_hard_pairs():
    """The design puts KV = 1 and 2 on model = 4 and 8, each with and without sp."""
    for kv in (1, 2):
        for p in (4, 8):
            assert {sp for m, k, _, _, sp in MODERN if k == kv and m[-1] == p} == {False, True}


@pytest.mark.parametrize(
    ("mesh_shape", "num_kv_heads", "causal", "documents", "sequence_parallel"), MODERN,
    ids=lambda v: str(v),
)  # fmt: skip
def test_rope_gqa_packed_on_every_mesh(mesh_shape, num_kv_heads, causal, documents,
                                       sequence_parallel):  # fmt: skip
    check_attention(mesh_shape, F32, batch=8, seq=16, num_kv_heads=num_kv_heads, causal=causal,
                    rope_theta=10000.0, documents=documents,
                    sequence_parallel=sequence_parallel)  # fmt: skip


@pytest.mark.parametrize(
    ("mesh_shape", "policy", "num_kv_heads"),
    [((8,), "BFLOAT16", 1), ((2, 4), "BFLOAT16", 2), ((1, 4), "MIXED_BFLOAT16", 2),
     ((4, 2), "MIXED_BFLOAT16", 4)],
    ids=str,
)  # fmt: skip
def test_rope_gqa_packed_under_bf16(mesh_shape, policy, num_kv_heads):
    check_attention(mesh_shape, POLICIES[policy], batch=8, seq=16, num_kv_heads=num_kv_heads,
                    causal=True, rope_theta=10000.0, documents=3,
                    sequence_parallel=len(mesh_shape) == 2)  # fmt: skip


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "seq_parallel"])
def test_rope_at_given_positions(sequence_parallel):
    """Explicit positions (a continued sequence, as in decoding): every token rotated at
    offset + its index, under sp too (never restarted at 0 on a sequence shard)."""
    check_attention((2, 4), F32, batch=4, seq=16, num_kv_heads=2, causal=True,
                    rope_theta=500.0, position_offset=1000,
                    sequence_parallel=sequence_parallel)  # fmt: skip


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 3)], ids=str)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "seq_parallel"])
def test_kv_heads_misaligned_with_the_devices(mesh_shape, sequence_parallel):
    """6 query heads, 2 KV heads on model = 3: each device holds 2 query heads, and device 1's
    read KV heads 0 and 1 (a run as long as its query heads, but not their grouping)."""
    check_attention(mesh_shape, F32, batch=4, seq=12, d_model=24, num_heads=6, head_dim=4,
                    num_kv_heads=2, causal=True, rope_theta=10000.0, documents=2,
                    sequence_parallel=sequence_parallel)  # fmt: skip


def test_kv_heads_spanning_two_per_device():
    """12 query heads, 6 KV heads on model = 4: 3 query heads per device read KV heads that
    straddle devices (device 1 reads KV heads 1 and 2), so wk, wv are replicated and each
    device projects a run of 2 KV heads."""
    check_attention((4,), F32, batch=4, seq=8, d_model=48, num_heads=12, head_dim=4,
                    num_kv_heads=6, causal=True, rope_theta=10000.0, documents=2)  # fmt: skip


# --- hypothesis -------------------------------------------------------------------------------


def pairwise_menu(factors: dict, seed: int = 0, tries: int = 64) -> list[dict]:
    """A short list of configurations in which every pair of values of any two factors occurs
    (a covering array, built greedily as AETG does). Compiling costs ~0.5 s per configuration;
    the full product of the factors below is 18,720 programs, this menu is 65."""
    rng = random.Random(seed)
    names = list(factors)

    def pairs(config):
        return {((a, config[a]), (b, config[b])) for a, b in itertools.combinations(names, 2)}

    uncovered = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
                 for va in factors[a] for vb in factors[b]}  # fmt: skip
    menu = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=repr)
        best, gain = None, -1
        for _ in range(tries):
            config = {n: rng.choice(factors[n]) for n in names}
            config[a], config[b] = va, vb
            if len(pairs(config) & uncovered) > gain:
                best, gain = config, len(pairs(config) & uncovered)
        menu.append(best)
        uncovered -= pairs(best)
    return menu


FACTORS = {
    "mesh_shape": [(1,), (2,), (4,), (8,), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (1, 8),
                   (2, 4), (4, 2), (8, 1)],
    # (S, D, H, hd): heads divisible by every model axis, S by every model axis (for SP).
    "shape": [(8, 32, 8, 4), (16, 64, 16, 4), (16, 32, 8, 16)],
    # KV heads as a fraction of H: multi-head, grouped (H/2, H/4, H/8) and multi-query.
    "kv_ratio": [1, 2, 4, 8, "mqa"],
    "causal": [False, True],
    "sequence_parallel": [False, True],
    "policy": sorted(POLICIES),
    "use_bias": [False, True],
    "rope_theta": [None, 10000.0],
    "documents": [1, 3],
}  # fmt: skip
MENU = pairwise_menu(FACTORS)
# Every menu row once as an explicit example (its programs compile once), then drawn rows with
# drawn temperatures and inputs: 10 in the default run (65 + 10 examples, not 200: most of the
# test's time was the extra runs of rows already compiled), 600 under SHARDOPS_FULL=1.
EXAMPLES = 600 if FULL else 10
TEMPERATURES = (0.25, 1.0, 4.0)  # flat to peaked attention, no recompile


def every_menu_row(test):
    """``test`` with each menu row as an explicit example (temperatures in turn)."""
    for i, config in enumerate(MENU):
        test = example(config=config, temperature=TEMPERATURES[i % 3], seed=i)(test)
    return test


def test_menu_covers_every_pair():
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(c[a], c[b]) for c in MENU}
        assert seen == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)
    assert len(MENU) <= 80


@settings(max_examples=EXAMPLES)
@given(
    config=st.sampled_from(MENU),
    temperature=st.sampled_from(TEMPERATURES),
    seed=st.integers(0, 2**16),  # the inputs and the documents' boundaries
)
@every_menu_row
def test_sharded_attention_equals_reference(config, temperature, seed):
    seq, d_model, num_heads, head_dim = config["shape"]
    ratio = config["kv_ratio"]
    kv = 1 if ratio == "mqa" else num_heads // ratio
    check_attention(config["mesh_shape"], POLICIES[config["policy"]], batch=8, seq=seq,
                    d_model=d_model, num_heads=num_heads, head_dim=head_dim, num_kv_heads=kv,
                    causal=config["causal"], sequence_parallel=config["sequence_parallel"],
                    use_bias=config["use_bias"], rope_theta=config["rope_theta"],
                    documents=config["documents"], temperature=temperature,
                    seed=seed)  # fmt: skip


# --- communication ----------------------------------------------------------------------------

# data=2 × model=4, x[B=4, S=8, D=32], 8 heads of 4: local rows BL = 2, V = bytes of the full
# x[BL, S, D] (= of y and dx) in float32. Weight gradients are all-reduced over data: the local
# wq, wk, wv[D, H·hd/4], wo[H·hd/4, D], bq, bk, bv[H·hd/4], bo[D].
BL, S, D, INNER = 2, 8, 32, 32
V = BL * S * D * 4
GRADS = (4 * D * INNER // 4 + 3 * INNER // 4 + D) * 4
AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"
M, DT = ("model",), ("data",)
BUDGETS = {
    # One forward AllReduce of y (Megatron's "g"); one backward AllReduce of dx for Q, K and V
    # together (Megatron's "f"), not three.
    "replicated": (False, {(AR, M): V + V, (AR, DT): GRADS}),
    # Forward AllGather x + ReduceScatter y; backward AllGather dy + ReduceScatter dx, and the
    # AllReduce of the replicated bo's gradient dbo[D].
    "seq_parallel": (True, {(AG, M): V + V, (RS, M): V + V, (AR, M): D * 4, (AR, DT): GRADS}),
}


@pytest.mark.parametrize("case", BUDGETS)
def test_collectives_in_bytes(case):
    sequence_parallel, expected = BUDGETS[case]
    requested, compiled = requested_and_compiled((2, 4), F32, sequence_parallel=sequence_parallel)
    assert compiled == expected
    assert requested == expected


def test_bf16_requests_bf16_gathers_and_f32_reductions():
    """Under BFLOAT16 the forward AllGather of x moves bf16 (half of V); every reduction, and
    the backward AllGather of dy (the cotangent of an f32 reduction), is f32."""
    requested, _ = requested_and_compiled((2, 4), BF16, sequence_parallel=False)
    assert requested == BUDGETS["replicated"][1]
    requested, _ = requested_and_compiled((2, 4), BF16, sequence_parallel=True)
    assert requested == {(AG, M): V // 2 + V, (RS, M): V + V, (AR, M): D * 4, (AR, DT): GRADS}


# Grouped-query attention on data=2 × model=4 (and model=8 alone), per pass. Local K/V columns
# per device: split by KV head, KV/4 heads; replicated (KV < 4), the ``count`` heads this
# device's query heads read (1 here), sliced from the replicated wk[D, KV·hd] before the data
# axis meets it, so the data AllReduce moves only the slice. The model AllReduce of the
# replicated wk, wv (and bk, bv) gradients carries them whole: each device adds zeros for the
# heads it does not read.
HD = 4


def _gqa_budget(kv: int, p: int, *, batch_rows: int, sequence_parallel: bool, data: bool):
    y = batch_rows * S * D * 4  # y, dx[BL, S, D] in f32
    replicated = kv % p != 0
    kv_cols = (1 if replicated else kv // p) * HD  # K (and V) columns each device projects
    dense_model = {"forward": {}, "backward": {}}
    if sequence_parallel:
        dense_model["forward"] = {(AG, M): y, (RS, M): y}
        dense_model["backward"] = {(AG, M): y, (RS, M): y, (AR, M): D * 4}  # + dbo
    else:
        dense_model["forward"] = {(AR, M): y}
        dense_model["backward"] = {(AR, M): y}
    if replicated:  # dwk, dwv[D, KV·hd] and dbk, dbv[KV·hd], whole
        extra = 2 * (D * kv * HD + kv * HD) * 4
        back = dense_model["backward"]
        back[(AR, M)] = back.get((AR, M), 0) + extra
    if data:  # the local weight gradients, over data
        q_cols = INNER // p
        dense_model["backward"][(AR, DT)] = (
            (2 * D * q_cols + 2 * D * kv_cols) + q_cols + 2 * kv_cols + D
        ) * 4
    return dense_model


GQA_CASES = [  # (KV heads, mesh, sequence parallel)
    (4, (2, 4), False),  # split by KV head: 1 per device
    (2, (2, 4), False),  # replicated: 2 KV heads on 4 devices
    (1, (2, 4), True),  # multi-query, sequence parallel
    (2, (8,), False),  # replicated on model = 8
    (1, (8,), True),
]


@pytest.mark.parametrize(("kv", "mesh_shape", "sequence_parallel"), GQA_CASES, ids=str)
def test_grouped_query_collectives_per_pass(kv, mesh_shape, sequence_parallel):
    """Compiled and requested bytes per (kind, axes, pass) equal the formulas above: no
    forward collective for the KV heads, and their gradients' AllReduce over model."""
    led = attention_ledger(mesh_shape, F32, sequence_parallel=sequence_parallel,
                           num_kv_heads=kv, rope_theta=10000.0)  # fmt: skip
    rows = 4 // (mesh_shape[0] if len(mesh_shape) == 2 else 1)
    want = _gqa_budget(kv, mesh_shape[-1], batch_rows=rows, sequence_parallel=sequence_parallel,
                       data=len(mesh_shape) == 2)  # fmt: skip
    got = led.by_pass()
    assert {k: got[k] for k in want} == want
    assert not got["optimizer"] and set(got) <= {*want, "optimizer"}
    assert led.totals(requested=True) == led.totals()  # all float32: requested as run


def test_forward_alone_is_one_all_reduce_per_block():
    """Two stacked blocks, forward only, on model=8: exactly two AllReduces of y[B, S, D]."""
    mesh = shardops.make_mesh({"model": 8})
    specs = head_parallel_attention_specs()
    params = [shardops.shard_params(init_attention(jax.random.key(i), 32, 8, 4), mesh,
                                    specs.params) for i in range(2)]  # fmt: skip
    x = jnp.ones((4, 8, 32))

    def two_blocks(x, params):
        for p in params:
            x = x + head_parallel_attention(x, p, mesh=mesh, num_heads=8, causal=True)
        return x

    found = shardops.inspect.collectives(mesh, jax.jit(two_blocks), x, params)
    assert [(c.kind, c.axes, c.bytes) for c in found] == [(AR, M, 4 * 8 * 32 * 4)] * 2
    assert all("shardops.head_parallel_attention" in c.op_name for c in found)


@pytest.mark.parametrize("implementation", ["auto", "einsum"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "seq_parallel"])
def test_dtype_flow(policy, sequence_parallel, implementation):
    check_attention_dtype_flow((2, 4), POLICIES[policy], sequence_parallel=sequence_parallel,
                               implementation=implementation)  # fmt: skip


@pytest.mark.parametrize(
    ("mesh_shape", "policy"),
    [((1,), "FLOAT32"), ((2, 4), "BFLOAT16"), ((8,), "MIXED_BFLOAT16"), ((3,), "FLOAT32")],
    ids=str,
)
def test_the_einsum_reference_path(mesh_shape, policy):
    """``implementation="einsum"`` (the S×S scores, P rounded after its normalisation: the
    bound ``ring=0``) on replicated and sequence-parallel layouts, GQA, RoPE and documents;
    every other test runs the default, the blocked online softmax off TPU."""
    sequence_parallel = len(mesh_shape) == 2
    heads = {"num_heads": 6, "d_model": 24} if mesh_shape == (3,) else {}
    check_attention(mesh_shape, POLICIES[policy], batch=8, seq=16, causal=True,
                    sequence_parallel=sequence_parallel, implementation="einsum",
                    num_kv_heads=2, rope_theta=10000.0, documents=2, **heads)  # fmt: skip


@pytest.mark.parametrize(
    ("mesh_shape", "kv", "documents"), [((2,), 1, 1), ((2, 2), 2, 2)], ids=str
)  # fmt: skip
def test_the_splash_path(mesh_shape, kv, documents):
    """``implementation="splash"`` (Pallas's interpreter off TPU) in the head-parallel kernel,
    inside ``shard_map(check_vma=True)``: MQA with the KV head replicated over model (its
    gradient summed once over the devices' query heads), GQA split by KV head with packed
    documents; values and every gradient within the online softmax's bound."""
    check_attention(mesh_shape, F32, batch=2, seq=128, d_model=16, num_heads=4, head_dim=128,
                    num_kv_heads=kv, causal=True, documents=documents, implementation="splash",
                    sequence_parallel=len(mesh_shape) == 2)  # fmt: skip


def test_auto_picks_splash_on_tpu_for_bf16_only(monkeypatch):
    """``"auto"``: blocked off TPU; on TPU splash for a bf16 compute dtype where a block of a
    multiple of 128 divides S (the largest up to BLOCK_K), else blocked; an explicit
    ``"splash"`` on a GPU is refused (the interpreter is for CPU tests)."""
    from shardops.layers import _attention_core, _kv_heads

    q, k = jnp.zeros((1, 4, 768, 128)), jnp.zeros((1, 2, 768, 128))
    pick = functools.partial(_attention_core._local_implementation, "auto", q, k)
    assert pick(shardops.MIXED_BFLOAT16) == "blocked"  # this backend is not a TPU
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert pick(shardops.MIXED_BFLOAT16) == pick(BF16) == "splash"
    assert pick(F32) == "blocked"  # splash's products are not f32 × f32 at HIGHEST
    assert _attention_core._splash_block(768) == 384 and _attention_core._splash_block(1000) is None
    odd = jnp.zeros((1, 4, 1000, 128))
    assert _attention_core._local_implementation("auto", odd, odd, BF16) == "blocked"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    kv = _kv_heads.KvHeads(2, None)
    with refused(
        ValueError,
        argument="implementation='splash'",
        got="'gpu'",
        expected="on a TPU, or on CPU",
        fix="implementation='blocked'",
    ):
        _attention_core._core(q, k, k, kv, 4, True, None, BF16, "splash")


def test_the_implementation_is_checked(mesh, params):
    x = jnp.zeros((8, 16, 32))
    for wrong in ("flash", None, "Blocked"):
        with refused(
            ValueError,
            argument="implementation",
            got=repr(wrong),
            expected="'auto', 'einsum', 'blocked', 'splash'",
            fix="'auto' picks",
        ):
            shardops.head_parallel_attention(x, params, mesh=mesh, num_heads=8,
                                             implementation=wrong)  # fmt: skip


# --- layout, init and the kernel in a user's shard_map ----------------------------------------


def test_specs_and_init():
    assert head_parallel_attention_specs(batch_axis="data", sequence_parallel=True) == AttentionSpecs(
        x=P("data", "model", None), w_qkv=P(None, "model"), b_qkv=P("model"),
        w_out=P("model", None), b_out=P(None), y=P("data", "model", None),
        w_kv=P(None, "model"), b_kv=P("model"), tokens=P("data", None),
    )  # fmt: skip
    shared = head_parallel_attention_specs(replicate_kv=True)
    assert (shared.w_kv, shared.b_kv, shared.w_qkv) == (P(None, None), P(None), P(None, "model"))
    assert shared.params["wk"] == shared.params["wv"] == P(None, None)
    assert splits_kv_heads(4, 4) and splits_kv_heads(8, 4) and not splits_kv_heads(2, 4)
    assert not splits_kv_heads(6, 4)
    gqa = init_attention(jax.random.key(0), 32, 8, 4, num_kv_heads=2)
    assert {k: v.shape for k, v in gqa.items()} == {
        "wq": (32, 32), "wk": (32, 8), "wv": (32, 8), "wo": (32, 32),
        "bq": (32,), "bk": (8,), "bv": (8,), "bo": (32,),
    }  # fmt: skip
    params = init_attention(jax.random.key(0), 32, 8, 4)
    assert {k: v.shape for k, v in params.items()} == {
        "wq": (32, 32), "wk": (32, 32), "wv": (32, 32), "wo": (32, 32),
        "bq": (32,), "bk": (32,), "bv": (32,), "bo": (32,),
    }  # fmt: skip
    assert set(init_attention(jax.random.key(0), 32, 8, 4, use_bias=False)) == {"wq", "wk", "wv",
                                                                                 "wo"}  # fmt: skip
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    placed = shardops.shard_params(params, mesh, head_parallel_attention_specs().params)
    assert placed["wq"].sharding.shard_shape((32, 32)) == (32, 8)  # 2 whole heads per device
    assert placed["wo"].sharding.shard_shape((32, 32)) == (8, 32)


def test_kernel_in_a_users_shard_map_equals_the_layer():
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    specs = head_parallel_attention_specs(batch_axis="data", sequence_parallel=True)
    params = init_attention(jax.random.key(0), 32, 8, 4)
    x = jax.random.normal(jax.random.key(1), (4, 16, 32))

    def block(x, params):
        return head_parallel_attention_kernel(x, params, num_heads=8, causal=True,
                                              sequence_parallel=True)  # fmt: skip

    mine = jax.jit(jax.shard_map(block, mesh=mesh, in_specs=(specs.x, specs.params),
                                 out_specs=specs.y))(x, params)  # fmt: skip
    layer = head_parallel_attention(x, params, mesh=mesh, num_heads=8, causal=True,
                                    batch_axis="data", sequence_parallel=True)  # fmt: skip
    np.testing.assert_array_equal(mine, layer)


def test_explicit_mesh_axes():
    """On Explicit axes the layout is part of the type: placed inputs run, others are an error
    that names the fix."""
    mesh = shardops.make_mesh({"data": 2, "model": 4}, axis_types="explicit")
    specs = head_parallel_attention_specs(batch_axis="data", sequence_parallel=True)
    params = shardops.shard_params(init_attention(jax.random.key(0), 32, 8, 4), mesh, specs.params)
    x = jax.device_put(jnp.ones((4, 8, 32)), NamedSharding(mesh, specs.x))
    kwargs = dict(mesh=mesh, num_heads=8, batch_axis="data", sequence_parallel=True)
    y = jax.jit(lambda x, params: head_parallel_attention(x, params, **kwargs))(x, params)
    assert y.sharding.spec == specs.y
    with pytest.raises(ValueError, match=r"x is laid out as .* but this layer needs "
                                         r"P\('data', 'model', None\) on the Explicit .* "
                                         r"jax\.sharding\.reshard"):  # fmt: skip
        head_parallel_attention(jax.device_put(x, NamedSharding(mesh, P("data"))), params,
                                **kwargs)  # fmt: skip


# --- bad input --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    return shardops.make_mesh({"data": 2, "model": 4})


@pytest.fixture(scope="module")
def params():
    return init_attention(jax.random.key(0), 32, 8, 4)


def test_heads_not_divisible(mesh):
    params = init_attention(jax.random.key(0), 32, 6, 4)
    with pytest.raises(ValueError, match=r"num_heads=6 is not divisible by mesh axis 'model' "
                                         r"\(size 4\); each device must hold whole query heads "
                                         r"\(num_kv_heads=6\)\. Choose num_heads a multiple of 4 "
                                         r"\(e\.g\. 8\)"):  # fmt: skip
        head_parallel_attention(jnp.ones((4, 8, 32)), params, mesh=mesh, num_heads=6)


def test_sequence_not_divisible_under_sequence_parallelism(mesh, params):
    with pytest.raises(ValueError, match=r"x dim 1 \(sequence\) = 6 is not divisible by mesh "
                                         r"axis 'model' \(size 4\); choose a multiple of 4"):  # fmt: skip
        head_parallel_attention(jnp.ones((4, 6, 32)), params, mesh=mesh, num_heads=8,
                                sequence_parallel=True)  # fmt: skip
    head_parallel_attention(jnp.ones((4, 6, 32)), params, mesh=mesh, num_heads=8)  # fine without


def test_batch_not_divisible(mesh, params):
    with pytest.raises(ValueError, match=r"x dim 0 \(batch\) = 3 is not divisible by mesh axis "
                                         r"'data' \(size 2\)"):  # fmt: skip
        head_parallel_attention(jnp.ones((3, 8, 32)), params, mesh=mesh, num_heads=8,
                                batch_axis="data")  # fmt: skip


def test_mismatched_head_dims(mesh, params):
    bad = dict(params, wk=jnp.ones((32, 16)))
    with pytest.raises(ValueError, match=r"wk has shape \(32, 16\) but wq\(32, 32\) with "
                                         r"num_heads=8 means head_dim=4 and D=32, so wk must be "
                                         r"\(32, 32\) \(num_kv_heads=8\).* pass "
                                         r"num_kv_heads=4\."):  # fmt: skip
        head_parallel_attention(jnp.ones((4, 8, 32)), bad, mesh=mesh, num_heads=8)
    with pytest.raises(ValueError, match=r"wo has shape \(16, 32\) .* so wo must be \(32, 32\)"):
        head_parallel_attention(jnp.ones((4, 8, 32)), dict(params, wo=jnp.ones((16, 32))),
                                mesh=mesh, num_heads=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"wq dim 1 \(heads × head_dim\) = 30 is not divisible "
                                         r"by num_heads=8"):  # fmt: skip
        head_parallel_attention(jnp.ones((4, 8, 32)), dict(params, wq=jnp.ones((32, 30))),
                                mesh=mesh, num_heads=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"wq must have shape \(D, H·hd\) with D = x's features "
                                         r"= 16"):  # fmt: skip
        head_parallel_attention(jnp.ones((4, 8, 16)), params, mesh=mesh, num_heads=8)


def test_x_of_the_wrong_rank(mesh, params):
    with pytest.raises(ValueError, match=r"x must have rank 3 \(x\[B, S, D\]: batch, sequence, "
                                         r"features\); got shape \(4, 32\)"):  # fmt: skip
        head_parallel_attention(jnp.ones((4, 32)), params, mesh=mesh, num_heads=8)


def test_wrong_dtype_for_the_policy(mesh, params):
    with pytest.raises(TypeError, match=r"x has dtype float32 but precision policy BFLOAT16 "
                                        r"computes in bfloat16; cast it"):  # fmt: skip
        head_parallel_attention(jnp.ones((4, 8, 32)), params, mesh=mesh, num_heads=8,
                                precision=BF16)  # fmt: skip
    with pytest.raises(TypeError, match=r"params\['wq'\] has dtype float32 but precision policy "
                                        r"BFLOAT16 stores parameters in bfloat16"):  # fmt: skip
        head_parallel_attention(jnp.ones((4, 8, 32), jnp.bfloat16), params, mesh=mesh,
                                num_heads=8, precision=BF16)  # fmt: skip


def test_param_names(mesh, params):
    with pytest.raises(ValueError, match=r"params needs \['wq', 'wk', 'wv', 'wo'\] .* missing "
                                         r"\['wo'\], unknown \['w_out'\]"):  # fmt: skip
        bad = {("w_out" if k == "wo" else k): v for k, v in params.items()}
        head_parallel_attention(jnp.ones((4, 8, 32)), bad, mesh=mesh, num_heads=8)


def test_kernel_misuse(mesh, params):
    with pytest.raises(ValueError, match=r"head_parallel_attention_kernel is a per-device kernel"):
        head_parallel_attention_kernel(jnp.ones((4, 8, 32)), params, num_heads=8)
    specs = head_parallel_attention_specs(sequence_parallel=False)

    def sp_on_replicated_x(x, params):
        return head_parallel_attention_kernel(x, params, num_heads=8, sequence_parallel=True)

    with pytest.raises(ValueError, match=r"with sequence_parallel, x must be the sequence shard "
                                         r"x\[B, S/p, D\], split over mesh axis 'model'"):  # fmt: skip
        jax.shard_map(sp_on_replicated_x, mesh=mesh, in_specs=(specs.x, specs.params),
                      out_specs=specs.y)(jnp.ones((4, 8, 32)), params)  # fmt: skip
    replicated = {k: P() for k in params}

    def replicated_weights(x, params):
        return head_parallel_attention_kernel(x, params, num_heads=8)

    with pytest.raises(ValueError, match=r"wq must be the local shard of a weight split over "
                                         r"mesh axis 'model'"):  # fmt: skip
        jax.shard_map(replicated_weights, mesh=mesh, in_specs=(specs.x, replicated),
                      out_specs=specs.y)(jnp.ones((4, 8, 32)), params)  # fmt: skip


def test_grouped_query_errors_name_heads_kv_heads_and_the_axis(mesh):
    gqa = init_attention(jax.random.key(0), 32, 8, 4, num_kv_heads=2)
    x = jnp.ones((4, 8, 32))
    with pytest.raises(ValueError, match=r"num_kv_heads=3 does not divide num_heads=8; each "
                                         r"key/value head serves a group .* among \[1, 2, 4, 8\]"):  # fmt: skip
        head_parallel_attention(x, gqa, mesh=mesh, num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"num_heads=6 is not divisible by mesh axis 'model' "
                                         r"\(size 4\); each device must hold whole query heads "
                                         r"\(num_kv_heads=2\)"):  # fmt: skip
        head_parallel_attention(x, init_attention(jax.random.key(0), 32, 6, 4, num_kv_heads=2),
                                mesh=mesh, num_heads=6, num_kv_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"wk has shape \(32, 8\) .* so wk must be "
                                         r"\(32, 32\) \(num_kv_heads=8\).* pass num_kv_heads=2\."):  # fmt: skip
        head_parallel_attention(x, gqa, mesh=mesh, num_heads=8)  # KV heads not said
    with pytest.raises(ValueError, match=r"num_kv_heads must be a positive int; got 0"):
        init_attention(jax.random.key(0), 32, 8, 4, num_kv_heads=0)


def test_kv_split_by_head_where_the_axis_does_not_divide_them_is_refused(mesh):
    """A user's shard_map that splits wk over model = 4 with 2 KV heads: the kernel says to
    replicate them (the specs' replicate_kv)."""
    gqa = init_attention(jax.random.key(0), 32, 8, 4, num_kv_heads=2)
    specs = head_parallel_attention_specs()  # K/V split by head: wrong for KV = 2 on 4

    def body(x, params):
        return head_parallel_attention_kernel(x, params, num_heads=8, num_kv_heads=2)

    with pytest.raises(ValueError, match=r"num_kv_heads=2 is not divisible by mesh axis 'model' "
                                         r"\(size 4\), so wk and wv cannot split by KV head .*"
                                         r"\(replicate_kv=True\)"):  # fmt: skip
        jax.shard_map(body, mesh=mesh, in_specs=(specs.x, specs.params),
                      out_specs=specs.y)(jnp.ones((4, 8, 32)), gqa)  # fmt: skip
    mixed = dict(specs.params, wk=P(None, None))

    with pytest.raises(ValueError, match=r"wk, wv \(and bk, bv\) must all be split over mesh "
                                         r"axis 'model' or all replicated"):  # fmt: skip
        jax.shard_map(body, mesh=mesh, in_specs=(specs.x, mixed),
                      out_specs=specs.y)(jnp.ones((4, 8, 32)), gqa)  # fmt: skip


def test_rope_and_segment_errors(mesh, params):
    x = jnp.ones((4, 8, 32))
    kwargs = dict(mesh=mesh, num_heads=8)
    with pytest.raises(ValueError, match=r"rope_theta must be a number > 1 \(e.g. 10000.0\) or "
                                         r"None; got 'big'"):  # fmt: skip
        head_parallel_attention(x, params, rope_theta="big", **kwargs)
    odd = init_attention(jax.random.key(0), 24, 8, 3)
    with pytest.raises(ValueError, match=r"head_dim must be even; got head_dim=3"):
        head_parallel_attention(jnp.ones((4, 8, 24)), odd, rope_theta=1e4, **kwargs)
    with pytest.raises(ValueError, match=r"positions are given but rope_theta is None"):
        head_parallel_attention(x, params, positions=jnp.zeros((4, 8), jnp.int32), **kwargs)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(B, S\) = \(4, 8\), "
                                         r"one per token of the whole sequence \(also under "
                                         r"sequence parallelism\); got \(4, 2\)"):  # fmt: skip
        head_parallel_attention(x, params, segment_ids=jnp.zeros((4, 2), jnp.int32), **kwargs)
    with pytest.raises(TypeError, match=r"positions must be an integer array \[B, S\]; got "
                                        r"float32"):  # fmt: skip
        head_parallel_attention(x, params, rope_theta=1e4, positions=jnp.zeros((4, 8)), **kwargs)


def test_segment_positions_restart_at_each_document():
    ids = jnp.array([[7, 7, 7, 2, 2, 9, 9, 9], [0, 1, 1, 1, 1, 1, 5, 5]])
    np.testing.assert_array_equal(segment_positions(ids),
                                  [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 1]])  # fmt: skip
