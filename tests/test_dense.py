"""Every kernel option, on every mesh, equals the float64 reference: forward and gradients."""

import pytest
from _dense_checks import COLUMN_OPTIONS, MESHES, POLICIES, ROW_OPTIONS, check_dense

import shardops


def _id(options):
    return ",".join(f"{k}={v}" for k, v in options.items())


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("options", COLUMN_OPTIONS, ids=_id)
def test_column_parallel_matches_reference_f32(mesh_shape, options):
    # K = d_in = 512: a fixed rtol would already be wrong here (see shardops.testing).
    check_dense("column", mesh_shape, options, shardops.FLOAT32, batch=32, d_in=512, d_out=256)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("options", ROW_OPTIONS, ids=_id)
def test_row_parallel_matches_reference_f32(mesh_shape, options):
    check_dense("row", mesh_shape, options, shardops.FLOAT32, batch=32, d_in=512, d_out=64)


@pytest.mark.parametrize("policy", ["BFLOAT16", "MIXED_BFLOAT16"])
@pytest.mark.parametrize("mesh_shape", [(8,), (4, 2)], ids=str)
@pytest.mark.parametrize(
    ("layer", "options"),
    [("column", o) for o in COLUMN_OPTIONS] + [("row", o) for o in ROW_OPTIONS],
    ids=lambda v: v if isinstance(v, str) else _id(v),
)
def test_bf16_policies_match_reference(policy, mesh_shape, layer, options):
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
