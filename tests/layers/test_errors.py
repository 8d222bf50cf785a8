"""Bad input to the layers gets a clear error before anything is traced or run."""

import jax.numpy as jnp
import pytest

import shardops


@pytest.fixture(scope="module")
def mesh():
    return shardops.make_mesh({"data": 2, "model": 4})


def test_out_features_not_divisible(mesh):
    with pytest.raises(
        ValueError,
        match=r"w dim 1 \(out features\) = 30 is not divisible by mesh axis 'model' \(size 4\)\. Pad it to 32 with shardops\.pad_params .* and pass out_features=30",
    ):
        shardops.column_parallel_dense(jnp.ones((8, 16)), jnp.ones((16, 30)), mesh=mesh)


def test_in_features_not_divisible_for_row(mesh):
    with pytest.raises(
        ValueError,
        match=r"w dim 0 \(in features\) = 30 is not divisible by mesh axis 'model' \(size 4\)",
    ):
        shardops.row_parallel_dense(jnp.ones((8, 30)), jnp.ones((30, 16)), mesh=mesh)


def test_batch_not_divisible_over_both_axes(mesh):
    # Sequence parallelism splits the batch over data × model = 8.
    with pytest.raises(
        ValueError,
        match=r"x dim 0 \(batch\) = 12 is not divisible by mesh axis 'data' \(size 2\) × 'model' \(size 4\) = 8",
    ):
        shardops.column_parallel_dense(
            jnp.ones((12, 16)), jnp.ones((16, 32)), mesh=mesh, batch_axis="data", gather_input=True
        )


def test_feature_scatter_needs_divisible_out_features(mesh):
    with pytest.raises(ValueError, match=r"w dim 1 \(out features\) = 10 is not divisible"):
        shardops.row_parallel_dense(
            jnp.ones((8, 16)),
            jnp.ones((16, 10)),
            mesh=mesh,
            reduce="psum_scatter",
            scatter_dimension=1,
        )


@pytest.mark.parametrize("argument", ["axis_name", "batch_axis"])
def test_unknown_axis(mesh, argument):
    with pytest.raises(
        ValueError, match=rf"{argument}='tensor' is not an axis of the mesh.*\('data', 'model'\)"
    ):
        shardops.column_parallel_dense(
            jnp.ones((8, 16)), jnp.ones((16, 32)), mesh=mesh, **{argument: "tensor"}
        )


def test_batch_and_model_on_one_axis(mesh):
    with pytest.raises(ValueError, match="batch_axis and axis_name are both 'model'"):
        shardops.column_parallel_dense(
            jnp.ones((8, 16)), jnp.ones((16, 32)), mesh=mesh, batch_axis="model"
        )


@pytest.mark.parametrize("layer", ["column", "row"])
def test_mismatched_inner_dimensions(mesh, layer):
    fn = getattr(shardops, f"{layer}_parallel_dense")
    with pytest.raises(
        ValueError,
        match=r"inner dimensions differ: x\(8, 16\) has 16 features but w\(24, 32\) has 24 rows",
    ):
        fn(jnp.ones((8, 16)), jnp.ones((24, 32)), mesh=mesh)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "match"),
    [
        ((16,), (16, 32), r"x must have rank ≥ 2 \(x\[B, \.\.\., D\]\); got shape \(16,\)"),
        ((8, 16), (16, 32, 1), r"w must have rank 2 \(w\[D, F\]\)"),
    ],
)
def test_wrong_rank(mesh, x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        shardops.column_parallel_dense(jnp.ones(x_shape), jnp.ones(w_shape), mesh=mesh)


@pytest.mark.parametrize("layer", ["column", "row"])
@pytest.mark.parametrize("b_shape", [(16,), (1, 32), ()])
def test_bias_of_the_wrong_shape_is_not_broadcast(mesh, layer, b_shape):
    fn = getattr(shardops, f"{layer}_parallel_dense")
    with pytest.raises(
        ValueError, match=r"b must have shape \(32,\) to match w\(16, 32\).*No broadcasting"
    ):
        fn(jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones(b_shape), mesh=mesh)


def test_bad_reduce_options(mesh):
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    with pytest.raises(
        ValueError, match=r"reduce must be one of \('psum', 'psum_scatter'\); got 'sum'"
    ):
        shardops.row_parallel_dense(x, w, mesh=mesh, reduce="sum")
    with pytest.raises(
        ValueError,
        match=r"scatter_dimension must be one of the 2 dims it may split \(0 = batch, -1 = last\); got 2",
    ):
        shardops.row_parallel_dense(x, w, mesh=mesh, reduce="psum_scatter", scatter_dimension=2)


def test_not_a_mesh():
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        shardops.column_parallel_dense(jnp.ones((8, 16)), jnp.ones((16, 32)), mesh={"model": 2})


def test_explicit_mesh_rejects_a_misplaced_input_with_the_fix():
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = shardops.make_mesh({"data": 2, "model": 4}, axis_types="explicit")
    w = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("model", None)))  # row layout
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P()))
    with pytest.raises(
        ValueError,
        match=r"w is laid out as P\('model', None\) but this layer needs P\(None, 'model'\).*jax.sharding.reshard",
    ):
        shardops.column_parallel_dense(x, w, mesh=mesh)
