"""The per-device kernels inside a user's own shard_map body."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
from shardops.testing import dense_reference, worst_ratio


def mlp_block_body(x, w1, b1, w2, b2):
    """A user's Megatron MLP block: column → gelu → row, with one psum forward."""
    h = shardops.layers.column_parallel_dense_kernel(x, w1, b1)  # h[B, H/p]
    h = jax.nn.gelu(h)
    return shardops.layers.row_parallel_dense_kernel(h, w2, b2)  # y[B, D]


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_kernels_in_a_user_shard_map_match_the_unsharded_block(p):
    mesh = shardops.make_mesh({"model": p})
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (8, 32))
    p1 = shardops.init_dense(keys[1], 32, 64, b_init=jax.nn.initializers.normal(1.0))
    p2 = shardops.init_dense(keys[2], 64, 32, b_init=jax.nn.initializers.normal(1.0))
    col, row = shardops.column_parallel_dense_specs(), shardops.row_parallel_dense_specs()
    block = jax.jit(
        jax.shard_map(
            mlp_block_body,
            mesh=mesh,
            in_specs=(col.x, col.w, col.b, row.w, row.b),
            out_specs=row.y,
        )
    )

    def reference(x, p1, p2):
        return shardops.dense(jax.nn.gelu(shardops.dense(x, **p1)), **p2)

    def loss(fn):
        return lambda x, p1, p2: jnp.sum(jnp.sin(fn(x, p1, p2)))

    sharded = lambda x, p1, p2: block(x, p1["w"], p1["b"], p2["w"], p2["b"])  # noqa: E731
    np.testing.assert_allclose(sharded(x, p1, p2), reference(x, p1, p2), atol=1e-5)
    g = jax.grad(loss(sharded), argnums=(0, 1, 2))(x, p1, p2)
    g_ref = jax.grad(loss(reference), argnums=(0, 1, 2))(x, p1, p2)
    jax.tree.map(functools.partial(np.testing.assert_allclose, atol=1e-5), g, g_ref)


def test_kernel_outside_shard_map_says_where_to_call_it():
    with pytest.raises(
        ValueError,
        match=r"per-device kernel: call it inside jax.shard_map.*shardops.row_parallel_dense",
    ):
        shardops.layers.row_parallel_dense_kernel(jnp.ones((4, 4)), jnp.ones((4, 4)))


def test_kernel_rejects_an_unsharded_weight_and_check_vma_false():
    mesh = shardops.make_mesh({"model": 2})
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    replicated_w = jax.shard_map(
        shardops.layers.column_parallel_dense_kernel,
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=P(None, "model"),
    )
    with pytest.raises(
        ValueError, match="w must be the local shard of a weight split over mesh axis 'model'"
    ):
        replicated_w(x, w)
    # check_vma=False on purpose: the kernel must refuse to run without it.
    no_vma = jax.shard_map(
        shardops.layers.column_parallel_dense_kernel,
        mesh=mesh,
        in_specs=(P(), P(None, "model")),
        out_specs=P(None, "model"),
        check_vma=False,
    )
    with pytest.raises(ValueError, match="keep check_vma=True"):
        no_vma(x, w)


def test_column_kernel_rejects_an_input_that_varies_over_model():
    mesh = shardops.make_mesh({"model": 2})

    def body(x, w):
        x = lax.pcast(x, "model", to="varying")  # no longer known to be replicated
        return shardops.layers.column_parallel_dense_kernel(x, w)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "model")), out_specs=P(None, "model"))
    with pytest.raises(
        ValueError, match="x must be replicated over mesh axis 'model', but it varies"
    ):
        f(jnp.ones((4, 8)), jnp.ones((8, 8)))


def test_sliced_row_kernel_checks_the_replicated_width():
    mesh = shardops.make_mesh({"model": 2})
    f = jax.shard_map(
        functools.partial(shardops.layers.row_parallel_dense_kernel, input_is_parallel=False),
        mesh=mesh,
        in_specs=(P(), P("model", None)),
        out_specs=P(),
    )
    with pytest.raises(
        ValueError,
        match=r"replicated x\[\.\.\., F\] has F=6 but the weight shard has 4 rows × 2 devices",
    ):
        f(jnp.ones((4, 6)), jnp.ones((8, 8)))


def test_reference_helper_bound_catches_a_doubled_bias():
    """The bound of shardops.testing is tight enough to see an O(1) bug in float32."""
    rng = np.random.default_rng(0)
    x, w, b, ct = (
        rng.standard_normal(s).astype(np.float32) for s in ((16, 512), (512, 64), (64,), (16, 64))
    )
    ref = dense_reference(x, w, b, ct, shardops.FLOAT32)
    good = np.asarray(shardops.dense(x, w, b), np.float64)
    assert worst_ratio(good, ref.y, ref.bound_y) <= 1.0
    assert worst_ratio(good + b, ref.y, ref.bound_y) > 10.0
