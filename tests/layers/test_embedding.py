"""The vocab-parallel embedding: forward and table gradient against float64 on every mesh and
policy, sequence parallelism, uneven (padded) vocabularies, compiled collectives, dtype flow,
the kernel in a user's shard_map, bad input, and a hypothesis property.

Bounds: ``tests/_vocab_checks.py`` (x is bit-exact up to one rounding to the compute dtype).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cover import cover_meshes
from _dense_checks import POLICIES
from _vocab_checks import (
    EMBEDDING_OPTIONS,
    MESHES,
    check_embedding,
    check_embedding_dtype_flow,
)
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops.layers._embedding import (
    vocab_parallel_embedding,
    vocab_parallel_embedding_kernel,
    vocab_parallel_embedding_specs,
)

POLICY_LIST = [POLICIES[n] for n in sorted(POLICIES)]
SCATTER_OPTIONS = EMBEDDING_OPTIONS[1:]
# A second shape for every mesh: ids[B, S, K] of rank 3, and 13 tokens, which 2, 4 and 8 do not
# divide (on 8 devices the last block is all padding).
SIDE = dict(ids_shape=(8, 8, 2), vocab_size=13, d=8)


def shard_table(table, mesh):
    """The full table placed as the layer needs it, zero-padded to a multiple of 'model'."""
    specs = vocab_parallel_embedding_specs()
    return shardops.shard_params({"table": table}, mesh, specs.params)["table"]


def _ids(mesh_shape):
    return "x".join(map(str, mesh_shape))


# Meshes as a data-axis and a model-axis factor, each value paired with the other factor's
# (tests/_cover.py); every mesh × value under SHARDOPS_FULL=1.
@pytest.mark.parametrize(
    ("mesh_shape", "policy"),
    cover_meshes(MESHES, sorted(POLICIES)),
    ids=lambda v: _ids(v) if isinstance(v, tuple) else v,
)
def test_embedding_matches_reference(mesh_shape, policy):
    """ids[8, 16], vocab 50 (padded to 52 on 4 devices, 56 on 8), psum."""
    check_embedding(mesh_shape, {"reduce": "psum"}, POLICIES[policy])


@pytest.mark.parametrize(
    ("mesh_shape", "option"),
    cover_meshes(MESHES, range(len(SCATTER_OPTIONS))),
    ids=lambda v: _ids(v) if isinstance(v, tuple) else ["sequence", "batch"][v],
)
def test_sequence_parallel_embedding(mesh_shape, option):
    """psum_scatter along the sequence (x[B, S_model, D]) or the batch; the policy cycles."""
    policy = POLICY_LIST[(MESHES.index(mesh_shape) + option) % 3]
    check_embedding(mesh_shape, SCATTER_OPTIONS[option], policy)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=_ids)
def test_rank_three_ids_and_a_vocab_no_axis_divides(mesh_shape):
    i = MESHES.index(mesh_shape)
    check_embedding(mesh_shape, EMBEDDING_OPTIONS[i % 3], POLICY_LIST[i % 3], **SIDE)


@pytest.mark.parametrize("mesh_shape", [(1,), (4,), (2, 4)], ids=_ids)
def test_rank_one_ids(mesh_shape):
    check_embedding(mesh_shape, {"reduce": "psum"}, shardops.FLOAT32, ids_shape=(8,), d=8)
    check_embedding(
        mesh_shape, SCATTER_OPTIONS[1], shardops.BFLOAT16, ids_shape=(8,), vocab_size=13, d=8
    )


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 4), (8, 1)], ids=_ids)
def test_out_of_range_ids_under_jit_get_a_zero_vector_and_no_gradient(mesh_shape):
    """Negative ids, padding ids (vocab_size … padded size) and ids past the table: not
    checkable under jit, documented to give a zero vector; the padding rows get no gradient."""
    for policy in POLICY_LIST:
        check_embedding(mesh_shape, {"reduce": "psum"}, policy, out_of_range=True)


def test_padding_rows_are_never_looked_up_even_if_they_hold_garbage():
    mesh = shardops.make_mesh({"model": 4})
    table = np.arange(50 * 4, dtype=np.float32).reshape(50, 4)
    padded = shard_table(table, mesh)
    assert padded.shape == (52, 4) and padded.sharding.spec == P("model", None)
    garbage = jax.device_put(padded.at[50:].set(1e6), padded.sharding)
    ids = jnp.array([[0, 49, 13, 26]])

    def loss(t):
        return jnp.sum(vocab_parallel_embedding(ids, t, mesh=mesh, vocab_size=50))

    x = vocab_parallel_embedding(ids, garbage, mesh=mesh, vocab_size=50)
    np.testing.assert_array_equal(x, table[np.asarray(ids)])
    grad = np.asarray(jax.jit(jax.grad(loss))(garbage))
    assert not grad[50:].any()
    np.testing.assert_array_equal(grad[[0, 49, 13, 26]], 1.0)


def test_shard_params_pads_the_vocabulary():
    """The layer's specs drive shard_params, which zero-pads the vocabulary (50257 tokens on 2
    devices: 50258 rows, Megatron-LM issue 1754); with pad=False it is an error."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    assert shardops.padded_size(50257, 2) == 50258 and shardops.padded_size(50, 4) == 52
    out = shard_table(np.ones((10, 3), np.float32), mesh)
    assert out.shape == (12, 3) and not np.asarray(out)[10:].any()
    assert out.sharding.spec == vocab_parallel_embedding_specs().table
    assert shard_table(np.ones((8, 3)), mesh).shape == (8, 3)  # already divisible: unchanged
    with pytest.raises(
        ValueError,
        match=r"params\['table'\] dim 0 \(split\) = 10 is not divisible by mesh axis 'model' \(size 4\).*pad=True",
    ):
        shardops.shard_params(
            {"table": np.ones((10, 3))}, mesh, vocab_parallel_embedding_specs().params, pad=False
        )


def test_kernel_in_a_user_shard_map():
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    specs = vocab_parallel_embedding_specs(batch_axis="data")
    table = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    ids = np.random.default_rng(1).integers(0, 64, (4, 8))
    body = jax.jit(
        jax.shard_map(
            vocab_parallel_embedding_kernel,
            mesh=mesh,
            in_specs=(specs.ids, specs.table),
            out_specs=specs.x,
        )
    )
    np.testing.assert_array_equal(body(ids, table), table[ids])


def test_kernel_outside_shard_map_and_with_a_replicated_table():
    with pytest.raises(ValueError, match=r"per-device kernel.*shardops.vocab_parallel_embedding"):
        vocab_parallel_embedding_kernel(jnp.zeros((2, 2), jnp.int32), jnp.ones((4, 3)))
    mesh = shardops.make_mesh({"model": 2})
    replicated = jax.shard_map(
        vocab_parallel_embedding_kernel, mesh=mesh, in_specs=(P(), P()), out_specs=P()
    )
    with pytest.raises(ValueError, match="table must be the local shard of a weight split over"):
        replicated(jnp.zeros((2, 2), jnp.int32), jnp.ones((4, 3)))
    varying_ids = jax.shard_map(
        vocab_parallel_embedding_kernel,
        mesh=mesh,
        in_specs=(P(None, "model"), P("model")),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match="ids must be replicated over mesh axis 'model'"):
        varying_ids(jnp.zeros((2, 2), jnp.int32), jnp.ones((4, 3)))


def test_explicit_mesh():
    mesh = shardops.make_mesh({"data": 2, "model": 4}, axis_types="explicit")
    specs = vocab_parallel_embedding_specs(batch_axis="data")
    table = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    ids = np.random.default_rng(1).integers(0, 16, (4, 8))
    t = shard_table(table, mesh)
    i = jax.device_put(ids, NamedSharding(mesh, specs.ids))
    x = vocab_parallel_embedding(i, t, mesh=mesh, batch_axis="data")
    np.testing.assert_array_equal(x, table[ids])
    assert x.sharding.spec == specs.x
    with pytest.raises(
        ValueError,
        match=r"table is laid out as P\(None, None\) but this layer needs P\(.model., None\).*jax.sharding.reshard",
    ):
        replicated = jax.device_put(table, NamedSharding(mesh, P()))
        vocab_parallel_embedding(i, replicated, mesh=mesh, batch_axis="data")


# --- compiled collectives -----------------------------------------------------------------

F32 = 4
B, S, D, V = 8, 16, 32, 64
DATA, MODEL = 2, 4
AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"
M, Dt = ("model",), ("data",)
X_LOCAL = B // DATA * S * D * F32  # x[B/2, S, D] in f32: 8,192 bytes


def _budgets(mesh_axes, options, *, vocab=V, precision=shardops.FLOAT32):
    """(forward, forward + backward) of the layer: moved bytes per (kind, axes); also asserts
    that what the program asked for (before XLA's bf16 promotion) is the same, i.e. f32."""
    sizes = dict(zip(("data", "model"), mesh_axes, strict=False)) if len(mesh_axes) == 2 else None
    mesh = shardops.make_mesh(sizes or {"model": mesh_axes[0]})
    batch_axis = "data" if sizes else None
    specs = vocab_parallel_embedding_specs(batch_axis=batch_axis, **options)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocab, D)).astype(precision.param_dtype)
    table = shard_table(table, mesh)
    ids = jax.device_put(rng.integers(0, vocab, (B, S)), NamedSharding(mesh, specs.ids))
    kw = dict(mesh=mesh, vocab_size=vocab, batch_axis=batch_axis, precision=precision, **options)

    def forward(ids, table):
        return vocab_parallel_embedding(ids, table, **kw)

    def forward_and_backward(ids, table):
        def loss(table):
            x = vocab_parallel_embedding(ids, table, **kw)
            return jnp.sum(jnp.sin(x.astype(jnp.float32))), x

        return jax.grad(loss, has_aux=True)(table)  # (dtable, x): the scalar is not returned

    out = []
    for fn in (forward, forward_and_backward):
        led = shardops.inspect.ledger(mesh, fn, ids, table)
        assert led.totals(requested=True) == led.totals(), led
        out.append(led.totals())
    return out


# x[B/2, S, D] f32 = 8,192 bytes; dtable[V/4, D] f32 = 2,048 bytes, all-reduced over data only.
DTABLE = V // MODEL * D * F32
COLLECTIVE_CASES = {
    # psum: one AllReduce of x over model forward; backward only dtable over data.
    "psum": ({"reduce": "psum"}, {(AR, M): X_LOCAL}, {(AR, Dt): DTABLE}),
    # Sequence parallel: ReduceScatter of x forward; AllGather of dx backward (then local).
    "sequence": (
        {"reduce": "psum_scatter", "scatter_dimension": 1},
        {(RS, M): X_LOCAL},
        {(AG, M): X_LOCAL, (AR, Dt): DTABLE},
    ),
    "batch": (
        {"reduce": "psum_scatter", "scatter_dimension": 0},
        {(RS, M): X_LOCAL},
        {(AG, M): X_LOCAL, (AR, Dt): DTABLE},
    ),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("case", COLLECTIVE_CASES)
def test_collectives_forward_and_backward(case, policy):
    """Every reduction moves float32 under every policy (asked for, not promoted by XLA)."""
    options, forward, backward = COLLECTIVE_CASES[case]
    fwd, both = _budgets((DATA, MODEL), options, precision=POLICIES[policy])
    assert fwd == forward
    assert both == _plus(forward, backward)


def _plus(a, b):
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


def test_table_gradient_needs_no_collective_when_the_batch_is_not_split():
    fwd, both = _budgets((8,), {"reduce": "psum"})
    assert fwd == both == {(AR, M): B * S * D * F32}


def test_padded_vocab_collectives():
    """vocab 50 on model=4: the table is 52 rows, so dtable[13, D] is all-reduced over data."""
    fwd, both = _budgets((DATA, MODEL), {"reduce": "psum"}, vocab=50)
    assert fwd == {(AR, M): X_LOCAL}
    assert both == {(AR, M): X_LOCAL, (AR, Dt): 13 * D * F32}


def test_compiled_hlo_names_the_layer():
    mesh = shardops.make_mesh({"model": 4})
    cs = shardops.inspect.collectives(
        mesh,
        lambda i, t: vocab_parallel_embedding(i, t, mesh=mesh),
        jnp.zeros((2, 4), jnp.int32),
        jnp.ones((8, 2)),
    )
    assert cs and all("shardops.vocab_parallel_embedding" in c.op_name for c in cs)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("option", range(3), ids=["psum", "sequence", "batch"])
def test_dtype_flow(option, policy):
    """The psum / reduce-scatter and the table's scatter-add (forward and backward) in f32."""
    check_embedding_dtype_flow((2, 4), EMBEDDING_OPTIONS[option], POLICIES[policy])


# --- bad input ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    return shardops.make_mesh({"data": 2, "model": 4})


def test_non_integer_ids(mesh):
    with pytest.raises(
        TypeError, match=r"ids must be integer token ids; got dtype float32.*astype"
    ):
        vocab_parallel_embedding(jnp.zeros((2, 4)), jnp.ones((8, 4)), mesh=mesh)


@pytest.mark.parametrize("bad", [-1, 50])
def test_ids_out_of_range(mesh, bad):
    table = shard_table(np.ones((50, 4), np.float32), mesh)
    ids = jnp.array([[0, 3, bad, 7]])
    with pytest.raises(
        ValueError,
        match=rf"ids must lie in \[0, vocab_size=50\); got min {min(bad, 0)}, max {max(bad, 7)}.*Under jit",
    ):
        vocab_parallel_embedding(ids, table, mesh=mesh, vocab_size=50)


def test_vocab_not_divisible(mesh):
    with pytest.raises(
        ValueError,
        match=r"vocab_parallel_embedding: table dim 0 \(vocabulary\) = 50 is not divisible by mesh axis 'model' \(size 4\); pad it with zero rows to 52 .*shard_params.*vocab_size=50",
    ):
        vocab_parallel_embedding(
            jnp.zeros((2, 4), jnp.int32), np.ones((50, 4), np.float32), mesh=mesh
        )


def test_vocab_size_larger_than_the_table(mesh):
    with pytest.raises(ValueError, match=r"vocab_size=60 must be an int in 1..52: table dim 0"):
        vocab_parallel_embedding(
            jnp.zeros((2, 4), jnp.int32), jnp.ones((52, 4)), mesh=mesh, vocab_size=60
        )


@pytest.mark.parametrize("shape", [(8,), (8, 4, 2)])
def test_table_of_the_wrong_rank(mesh, shape):
    with pytest.raises(ValueError, match=r"table must have rank 2 \(table\[V, D\]\); got shape"):
        vocab_parallel_embedding(jnp.zeros((2, 4), jnp.int32), jnp.ones(shape), mesh=mesh)


def test_table_of_the_wrong_dtype_for_the_policy(mesh):
    with pytest.raises(
        TypeError,
        match=r"table has dtype float32 but precision policy BFLOAT16 stores parameters in bfloat16",
    ):
        vocab_parallel_embedding(
            jnp.zeros((2, 4), jnp.int32), jnp.ones((8, 4)), mesh=mesh, precision=shardops.BFLOAT16
        )


def test_sequence_not_divisible_under_sequence_parallelism(mesh):
    with pytest.raises(
        ValueError,
        match=r"ids dim 1 \(sequence\) = 6 is not divisible by mesh axis 'model' \(size 4\), so reduce='psum_scatter' cannot split x",
    ):
        vocab_parallel_embedding(
            jnp.zeros((2, 6), jnp.int32), jnp.ones((8, 4)), mesh=mesh, reduce="psum_scatter"
        )
    with pytest.raises(
        ValueError,
        match=r"ids dim 0 \(batch\) = 4 is not divisible by mesh axis 'data' \(size 2\) × 'model' \(size 4\)",
    ):
        vocab_parallel_embedding(
            jnp.zeros((4, 8), jnp.int32),
            jnp.ones((8, 4)),
            mesh=mesh,
            batch_axis="data",
            reduce="psum_scatter",
            scatter_dimension=0,
        )


def test_batch_not_divisible(mesh):
    with pytest.raises(
        ValueError, match=r"ids dim 0 \(batch\) = 3 is not divisible by mesh axis 'data' \(size 2\)"
    ):
        vocab_parallel_embedding(
            jnp.zeros((3, 4), jnp.int32), jnp.ones((8, 4)), mesh=mesh, batch_axis="data"
        )


def test_bad_options(mesh):
    ids, table = jnp.zeros((2, 4), jnp.int32), jnp.ones((8, 4))
    with pytest.raises(ValueError, match=r"reduce must be one of \('psum', 'psum_scatter'\)"):
        vocab_parallel_embedding(ids, table, mesh=mesh, reduce="sum")
    with pytest.raises(ValueError, match=r"scatter_dimension must be a dim of ids .* got 2"):
        vocab_parallel_embedding(ids, table, mesh=mesh, reduce="psum_scatter", scatter_dimension=2)
    with pytest.raises(ValueError, match=r"ids must have rank ≥ 1"):
        vocab_parallel_embedding(jnp.int32(3), table, mesh=mesh)
    with pytest.raises(ValueError, match="batch_axis and axis_name are both 'model'"):
        vocab_parallel_embedding(ids, table, mesh=mesh, batch_axis="model")


# --- hypothesis ---------------------------------------------------------------------------

CASES = [{}, SIDE]  # the shapes of the tests above, so most programs are already compiled


@given(
    mesh_shape=st.sampled_from(MESHES),
    policy=st.sampled_from(sorted(POLICIES)),
    option=st.sampled_from(range(3)),
    case=st.sampled_from(range(2)),
    out_of_range=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_embedding_property(mesh_shape, policy, option, case, out_of_range, seed):
    check_embedding(
        mesh_shape,
        EMBEDDING_OPTIONS[option],
        POLICIES[policy],
        seed=seed,
        out_of_range=out_of_range,
        **CASES[case],
    )
