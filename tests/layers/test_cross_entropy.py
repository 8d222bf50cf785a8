"""Vocab-parallel cross-entropy and argmax: loss, gradient and argmax against float64 on every
mesh and policy, large logits, padded vocabularies, compiled collectives, dtype flow, the kernel
in a user's shard_map (replicated logits are an error), bad input, an embedding → tied head →
loss composition, and a hypothesis property.

Bounds: ``tests/_vocab_checks.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cover import cover_meshes
from _dense_checks import POLICIES
from _vocab_checks import (
    MESHES,
    check_argmax_ties,
    check_cross_entropy,
    check_cross_entropy_dtype_flow,
    cross_entropy_reference,
)
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops.layers._cross_entropy import (
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_kernel,
    vocab_parallel_cross_entropy_specs,
)
from shardops.layers._embedding import vocab_parallel_embedding, vocab_parallel_embedding_specs

POLICY_LIST = [POLICIES[n] for n in sorted(POLICIES)]
# A second shape for every mesh, alternating: logits[B, V] with 10 classes (padded to 12 on 4
# devices, 16 on 8: three devices hold only padding), and logits[B, S, K, V] with 13.
SIDES = [dict(lead=(8,), vocab_size=10), dict(lead=(8, 2, 3), vocab_size=13)]


def _ids(mesh_shape):
    return "x".join(map(str, mesh_shape))


def _side(mesh_shape):
    return SIDES[MESHES.index(mesh_shape) % 2]


# Meshes as a data-axis and a model-axis factor, each value paired with the other factor's
# (tests/_cover.py); every mesh × value under SHARDOPS_FULL=1.
@pytest.mark.parametrize(
    ("mesh_shape", "policy"),
    cover_meshes(MESHES, sorted(POLICIES)),
    ids=lambda v: _ids(v) if isinstance(v, tuple) else v,
)
def test_cross_entropy_matches_reference(mesh_shape, policy):
    """logits[8, 6, V], vocab 50 (padded to 52 on 4 devices, 56 on 8); also |logits| ~ 100,
    where exp overflows float32 unless the global max is subtracted first."""
    check_cross_entropy(mesh_shape, POLICIES[policy])
    check_cross_entropy(mesh_shape, POLICIES[policy], scale=100.0, seed=1)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=_ids)
def test_other_ranks_and_uneven_class_counts(mesh_shape):
    policy = POLICY_LIST[MESHES.index(mesh_shape) % 3]
    check_cross_entropy(mesh_shape, policy, **_side(mesh_shape))
    check_cross_entropy(mesh_shape, policy, scale=100.0, seed=1, **_side(mesh_shape))


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 4), (1, 8)], ids=_ids)
def test_out_of_range_labels_under_jit_add_no_target_logit(mesh_shape):
    """-1, vocab_size (padding), the padded size and beyond: not checkable under jit; documented
    to give loss = log Σ exp(l − max) and gradient = softmax (no one-hot)."""
    for policy in POLICY_LIST:
        check_cross_entropy(mesh_shape, policy, bad_labels=True)


def test_argmax_takes_the_first_maximum_across_devices():
    check_argmax_ties()


def test_kernel_in_a_user_shard_map():
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    specs = vocab_parallel_cross_entropy_specs(ndim=2, batch_axis="data")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 16)).astype(np.float32)
    labels = rng.integers(0, 14, (4,)).astype(np.int32)
    body = jax.jit(
        jax.shard_map(
            lambda z, y: vocab_parallel_cross_entropy_kernel(z, y, vocab_size=14),
            mesh=mesh,
            in_specs=(specs.logits, specs.labels),
            out_specs=specs.loss,
        )
    )
    want, _, _, bound, _ = cross_entropy_reference(logits, labels, np.ones(4), 14)
    assert np.all(np.abs(np.asarray(body(logits, labels), np.float64) - want) <= bound)


def test_kernel_refuses_replicated_logits_instead_of_a_loss_off_by_log_p():
    """Megatron-LM issue 7452: logits the same on every device are not an error there, and the
    loss is off by log(p). Here the kernel sees (vma) that they do not vary over 'model'."""
    mesh = shardops.make_mesh({"model": 4})
    replicated = jax.shard_map(
        vocab_parallel_cross_entropy_kernel, mesh=mesh, in_specs=(P(), P()), out_specs=P()
    )
    with pytest.raises(
        ValueError,
        match=r"logits must be split over mesh axis 'model' along the vocabulary, but they are the same on every device of that axis.*log\(4\)",
    ):
        replicated(jnp.ones((2, 8)), jnp.zeros((2,), jnp.int32))
    varying_labels = jax.shard_map(
        vocab_parallel_cross_entropy_kernel,
        mesh=mesh,
        in_specs=(P(None, "model"), P("model")),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match="labels must be replicated over mesh axis 'model'"):
        varying_labels(jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match=r"per-device kernel.*vocab_parallel_cross_entropy"):
        vocab_parallel_cross_entropy_kernel(jnp.ones((2, 8)), jnp.zeros((2,), jnp.int32))


# --- composition: embedding → tied output layer → loss --------------------------------------


def test_embedding_tied_head_and_loss_compose():
    """GPT-style ends of a model, vocab 50 on data=2 × model=4 (table padded to 52 rows): the
    embedding's table[V_model, D] transposed is the head's w[D, V_model], no resharding. Loss and
    gradient equal the unsharded computation; every matmul and sum follows the policy; the
    compiled program moves exactly the layers' own collectives."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    vocab, d, b, s = 50, 16, 8, 4
    rng = np.random.default_rng(0)
    table_np = (rng.standard_normal((vocab, d)) * 0.5).astype(np.float32)
    specs = vocab_parallel_embedding_specs(batch_axis="data")
    table = shardops.shard_params({"table": table_np}, mesh, specs.params)["table"]  # 52 rows
    ids_np = rng.integers(0, vocab, (b, s))
    labels_np = rng.integers(0, vocab, (b * s,)).astype(np.int32)
    ids = jax.device_put(ids_np, NamedSharding(mesh, P("data")))
    labels = jax.device_put(labels_np, NamedSharding(mesh, P("data")))

    def loss(table, ids, labels):
        x = vocab_parallel_embedding(ids, table, mesh=mesh, vocab_size=vocab, batch_axis="data")
        logits = shardops.column_parallel_dense(
            x.reshape(b * s, d), table.T, mesh=mesh, batch_axis="data"
        )
        per_token = vocab_parallel_cross_entropy(
            logits, labels, mesh=mesh, vocab_size=vocab, batch_axis="data"
        )
        return jnp.mean(per_token)

    step = jax.jit(jax.value_and_grad(loss))
    value, grad = step(table, ids, labels)

    def unsharded(table):
        logits = table[ids_np].reshape(b * s, d) @ table.T
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(b * s), labels_np])

    want, want_grad = jax.value_and_grad(unsharded)(jnp.asarray(table_np))
    np.testing.assert_allclose(value, want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad)[:vocab], want_grad, atol=1e-7)
    assert not np.asarray(grad)[vocab:].any()
    # Forward, over model: the embedding's x[4, 4, 16] (1,024 B) and the loss's three [16]
    # values (192 B). Backward: the head's dx[16, 16] (1,024 B) over model; over data, the two
    # halves of the tied table's gradient, dtable[13, 16] and dw[16, 13] (832 B each), and the
    # mean's scalar (4 B). Nothing [.., V]-sized crosses 'model'.
    got = shardops.inspect.ledger(mesh, step, table, ids, labels).totals()
    assert got == {
        ("all-reduce", ("model",)): 1024 + 192 + 1024,
        ("all-reduce", ("data",)): 2 * 832 + 4,
    }


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_embedding_tied_head_and_loss_follow_the_policy(policy):
    """The composed step has matmuls, so ``dtype_flow_violations`` applies: every matmul in the
    compute dtype accumulating in f32, every sum (both layers' psums, the head's dx all-reduce,
    the data-parallel gradient reduction) in f32."""
    precision = POLICIES[policy]
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    table = jnp.ones((52, 16), precision.param_dtype)
    ids, labels = jnp.zeros((8, 4), jnp.int32), jnp.zeros((32,), jnp.int32)

    def loss(table):
        kw = dict(mesh=mesh, batch_axis="data", precision=precision)
        x = vocab_parallel_embedding(ids, table, vocab_size=50, **kw)
        logits = shardops.column_parallel_dense(x.reshape(32, 16), table.T, **kw)
        return jnp.mean(vocab_parallel_cross_entropy(logits, labels, vocab_size=50, **kw))

    problems = shardops.testing.dtype_flow_violations(jax.grad(loss), table, policy=precision)
    assert not problems, "\n".join(problems)


# --- compiled collectives -----------------------------------------------------------------

F32, S32 = 4, 4
B, S, VOCAB = 8, 6, 50
DATA, MODEL = 2, 4
AR = "all-reduce"
M = ("model",)
ROWS = B // DATA * S  # [B/2, S] per device: 24 values


def _ledgers(mesh_axes, *, vocab=VOCAB, precision=shardops.FLOAT32):
    """Moved bytes of (forward, forward + backward, argmax); asserts each program asked for
    the same (float32 and int32, nothing for XLA to promote)."""
    mesh = shardops.make_mesh(
        {"data": mesh_axes[0], "model": mesh_axes[1]}
        if len(mesh_axes) == 2
        else {"model": mesh_axes[0]}
    )
    batch_axis = "data" if len(mesh_axes) == 2 else None
    specs = vocab_parallel_cross_entropy_specs(batch_axis=batch_axis)
    p = mesh.shape["model"]
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((B, S, -(-vocab // p) * p)).astype(precision.compute_dtype)
    labels = rng.integers(0, vocab, (B, S)).astype(np.int32)
    logits = jax.device_put(logits, NamedSharding(mesh, specs.logits))
    labels = jax.device_put(labels, NamedSharding(mesh, specs.labels))
    kw = dict(mesh=mesh, vocab_size=vocab, batch_axis=batch_axis)

    def forward(logits, labels):
        return vocab_parallel_cross_entropy(logits, labels, precision=precision, **kw)

    def forward_and_backward(logits, labels):
        def loss(logits):
            per_example = forward(logits, labels)
            return jnp.sum(jnp.sin(per_example)), per_example

        return jax.grad(loss, has_aux=True)(logits)  # the scalar is not returned

    out = []
    for fn, args in (
        (forward, (logits, labels)),
        (forward_and_backward, (logits, labels)),
        (lambda logits: vocab_parallel_argmax(logits, **kw), (logits,)),
    ):
        led = shardops.inspect.ledger(mesh, fn, *args)
        assert led.totals(requested=True) == led.totals(), led
        out.append(led.totals())
    return out


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_collectives(policy):
    """Forward: AllReduce(max), AllReduce(sum) of Σexp, AllReduce(sum) of the target, each of
    [B/2, S] float32 over model; backward: nothing; argmax: f32 max + int32 min. Never a
    [..., V]-sized collective, and no bf16 one even when the logits are bf16."""
    fwd, both, argmax = _ledgers((DATA, MODEL), precision=POLICIES[policy])
    assert fwd == both == {(AR, M): 3 * ROWS * F32}
    assert argmax == {(AR, M): ROWS * (F32 + S32)}


def test_collectives_on_a_model_only_mesh_and_without_padding():
    fwd, both, argmax = _ledgers((8,), vocab=64)
    assert fwd == both == {(AR, M): 3 * B * S * F32}
    assert argmax == {(AR, M): B * S * (F32 + S32)}


def test_compiled_hlo_names_the_layers():
    mesh = shardops.make_mesh({"model": 4})
    logits, labels = jnp.ones((2, 8)), jnp.zeros((2,), jnp.int32)
    ce = shardops.inspect.collectives(
        mesh, lambda z, y: vocab_parallel_cross_entropy(z, y, mesh=mesh), logits, labels
    )
    am = shardops.inspect.collectives(mesh, lambda z: vocab_parallel_argmax(z, mesh=mesh), logits)
    assert ce and all("shardops.vocab_parallel_cross_entropy" in c.op_name for c in ce)
    assert am and all("shardops.vocab_parallel_argmax" in c.op_name for c in am)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_dtype_flow(policy):
    """The max, both psums, the local sums and the gradient's scatter-add all in float32."""
    check_cross_entropy_dtype_flow((2, 4), POLICIES[policy])


# --- bad input ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    return shardops.make_mesh({"data": 2, "model": 4})


def _ce(mesh, logits, labels, **kw):
    return vocab_parallel_cross_entropy(logits, labels, mesh=mesh, **kw)


def test_labels_of_the_wrong_shape(mesh):
    with pytest.raises(
        ValueError,
        match=r"labels must have the logits' leading shape \(4, 6\) \(logits\(4, 6, 8\) minus the vocabulary dim\); got \(4,\)",
    ):
        _ce(mesh, jnp.ones((4, 6, 8)), jnp.zeros((4,), jnp.int32))


def test_labels_of_the_wrong_dtype(mesh):
    with pytest.raises(
        TypeError, match=r"labels must be integer class ids; got dtype float32.*one-hot"
    ):
        _ce(mesh, jnp.ones((4, 8)), jnp.zeros((4,)))


@pytest.mark.parametrize("bad", [-1, 10])
def test_labels_out_of_range(mesh, bad):
    with pytest.raises(
        ValueError, match=r"labels must lie in \[0, vocab_size=10\); got min .*Under jit"
    ):
        _ce(mesh, jnp.ones((4, 12)), jnp.array([0, 3, bad, 9]), vocab_size=10)


def test_vocab_not_divisible(mesh):
    with pytest.raises(
        ValueError,
        match=r"logits dim 1 \(vocabulary\) = 10 is not divisible by mesh axis 'model' \(size 4\); pad the vocabulary to 12 .*vocab_size=10",
    ):
        _ce(mesh, jnp.ones((4, 10)), jnp.zeros((4,), jnp.int32))


def test_vocab_size_larger_than_the_logits(mesh):
    with pytest.raises(ValueError, match=r"vocab_size=13 must be an int in 1..12: logits dim 1"):
        _ce(mesh, jnp.ones((4, 12)), jnp.zeros((4,), jnp.int32), vocab_size=13)


def test_logits_of_the_wrong_dtype_for_the_policy(mesh):
    with pytest.raises(
        TypeError,
        match=r"logits has dtype float32 but precision policy MIXED_BFLOAT16 computes in bfloat16",
    ):
        _ce(mesh, jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32), precision=shardops.MIXED_BFLOAT16)
    with pytest.raises(TypeError, match="logits must be floating; got dtype int32"):
        _ce(mesh, jnp.ones((4, 8), jnp.int32), jnp.zeros((4,), jnp.int32))


def test_logits_of_rank_one(mesh):
    with pytest.raises(ValueError, match=r"logits must have rank ≥ 2 .*logits\[None\]"):
        _ce(mesh, jnp.ones((8,)), jnp.zeros((), jnp.int32))


def test_batch_not_divisible(mesh):
    with pytest.raises(
        ValueError,
        match=r"logits dim 0 \(batch\) = 3 is not divisible by mesh axis 'data' \(size 2\)",
    ):
        _ce(mesh, jnp.ones((3, 8)), jnp.zeros((3,), jnp.int32), batch_axis="data")


def test_argmax_vocab_not_divisible(mesh):
    with pytest.raises(
        ValueError, match=r"vocab_parallel_argmax: logits dim 1 \(vocabulary\) = 10"
    ):
        vocab_parallel_argmax(jnp.ones((4, 10)), mesh=mesh)


# --- hypothesis ---------------------------------------------------------------------------

CASES = [{}, *SIDES]  # the shapes of the tests above, so most programs are already compiled


@given(
    mesh_shape=st.sampled_from(MESHES),
    policy=st.sampled_from(sorted(POLICIES)),
    side=st.booleans(),
    scale=st.sampled_from([1.0, 3.0, 100.0]),
    bad_labels=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_cross_entropy_property(mesh_shape, policy, side, scale, bad_labels, seed):
    case = _side(mesh_shape) if side else {}
    check_cross_entropy(
        mesh_shape, POLICIES[policy], seed=seed, scale=scale, bad_labels=bad_labels, **case
    )
