"""Every kernel option, on every mesh, equals the float64 reference: forward and gradients."""

import numpy as np
import pytest
from _cover import cover, cover_meshes
from _dense_checks import COLUMN_OPTIONS, MESHES, POLICIES, ROW_OPTIONS, check_dense

import shardops


def _id(options):
    return ",".join(f"{k}={v}" for k, v in options.items())


def _case_id(v):
    return str(v) if isinstance(v, tuple) else _id(v)


# Every option on every model-axis size and every data-axis size (tests/_cover.py); every
# mesh × option under SHARDOPS_FULL=1.
@pytest.mark.parametrize(
    ("mesh_shape", "options"), cover_meshes(MESHES, COLUMN_OPTIONS), ids=_case_id
)
def test_column_parallel_matches_reference_f32(mesh_shape, options):
    # K = d_in = 512: a fixed rtol would already be wrong here (see shardops.testing).
    check_dense("column", mesh_shape, options, shardops.FLOAT32, batch=32, d_in=512, d_out=256)


@pytest.mark.parametrize(("mesh_shape", "options"), cover_meshes(MESHES, ROW_OPTIONS), ids=_case_id)
def test_row_parallel_matches_reference_f32(mesh_shape, options):
    check_dense("row", mesh_shape, options, shardops.FLOAT32, batch=32, d_in=512, d_out=64)


# Every (policy, mesh), (policy, layer option) and (mesh, layer option) pair.
BF16_CASES = cover(
    ["BFLOAT16", "MIXED_BFLOAT16"],
    [(8,), (4, 2)],
    [("column", o) for o in COLUMN_OPTIONS] + [("row", o) for o in ROW_OPTIONS],
)


@pytest.mark.parametrize(
    ("policy", "mesh_shape", "layer_options"),
    BF16_CASES,
    ids=lambda v: (
        v
        if isinstance(v, str)
        else _case_id(v)
        if not isinstance(v[0], str)
        else f"{v[0]}-{_id(v[1])}"
    ),
)
def test_bf16_policies_match_reference(policy, mesh_shape, layer_options):
    layer, options = layer_options
    check_dense(layer, mesh_shape, options, POLICIES[policy], batch=32, d_in=256, d_out=128)


@pytest.mark.parametrize("layer", ["column", "row"])
def test_without_bias(layer):
    options = COLUMN_OPTIONS[0] if layer == "column" else ROW_OPTIONS[0]
    check_dense(
        layer, (4, 2), options, shardops.FLOAT32, batch=16, d_in=64, d_out=32, use_bias=False
    )


def test_bias_added_once_after_the_reduction():
    """A bias added before the psum would be counted p times: y would be off by (p−1)·b.

    With x = 0 the output is exactly the bias, so this fails loudly for that bug at any p > 1.
    """
    import jax.numpy as jnp
    import numpy as np

    mesh = shardops.make_mesh({shardops.MODEL_AXIS: 4})
    b = jnp.arange(1.0, 9.0)
    w = jnp.ones((16, 8))
    for options in ROW_OPTIONS:
        y = shardops.row_parallel_dense(jnp.zeros((8, 16)), w, b, mesh=mesh, **options)
        np.testing.assert_array_equal(np.asarray(y), np.broadcast_to(np.asarray(b), (8, 8)))


def test_shard_params_takes_the_specs_at_any_depth():
    """The layer's specs for a tree of layers: a nested dict and a list, each without a bias;
    the absent ``b`` is ignored at every depth, a leaf with no spec is an error naming its path."""
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    column = shardops.column_parallel_dense_specs().params  # {"w": P(None, model), "b": …}
    row = shardops.row_parallel_dense_specs().params
    params = {"mlp": {"up": {"w": np.ones((8, 4))}, "down": {"w": np.ones((4, 8))}},
              "layers": [{"w": np.ones((8, 4))}]}  # fmt: skip
    out = shardops.shard_params(params, mesh, {"mlp": {"up": column, "down": row},
                                               "layers": [column]})  # fmt: skip
    assert out["mlp"]["up"]["w"].sharding.spec == column["w"]
    assert out["mlp"]["down"]["w"].sharding.spec == row["w"]
    assert out["layers"][0]["w"].sharding.spec == column["w"]
    with pytest.raises(
        ValueError, match=r"no PartitionSpec for \['gain'\] in params\['mlp'\]\['up'\]"
    ):
        shardops.shard_params({"mlp": {"up": {"w": np.ones((8, 4)), "gain": np.ones(4)}}}, mesh,
                              {"mlp": {"up": column}})  # fmt: skip
