"""Precision policy: defined combinations only, f32 accumulation under bf16, no silent upcast."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardops
from shardops import BFLOAT16, FLOAT32, MIXED_BFLOAT16, Precision


def test_defined_policies():
    assert FLOAT32.name == "FLOAT32" and BFLOAT16.name == "BFLOAT16"
    assert MIXED_BFLOAT16.param_dtype == np.float32 and MIXED_BFLOAT16.compute_dtype == jnp.bfloat16
    assert Precision("bfloat16", "bfloat16", "float32") == BFLOAT16


@pytest.mark.parametrize(
    "dtypes",
    [
        (jnp.bfloat16, jnp.float32, jnp.float32),  # compute wider than params: a silent upcast
        (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),  # bf16 accumulation
        (jnp.float16, jnp.float16, jnp.float32),
        (jnp.float32, jnp.float32, jnp.bfloat16),
    ],
)
def test_undefined_combinations_are_errors(dtypes):
    with pytest.raises(ValueError, match="is not defined; use one of FLOAT32"):
        Precision(*dtypes)


def test_bf16_matmul_accumulates_in_f32():
    x = jnp.ones((2, 4096), jnp.bfloat16)
    w = jnp.full((4096, 1), 1.0 + 2.0**-7, jnp.bfloat16)  # exact in bf16
    jaxpr = jax.make_jaxpr(lambda x, w: shardops.dense(x, w, precision=BFLOAT16))(x, w)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots[0].params["preferred_element_type"] == jnp.float32
    y = shardops.dense(x, w, precision=BFLOAT16)
    assert y.dtype == jnp.bfloat16
    # 4096 · (1 + 2^-7) = 4128, exact in bf16; a bf16 accumulator stalls at 256 + ... long before.
    assert float(y[0, 0]) == 4128.0


@pytest.mark.parametrize("layer", ["column", "row"])
def test_dtypes_outside_the_policy_are_errors(layer):
    mesh = shardops.make_mesh({"model": 2})
    fn = getattr(shardops, f"{layer}_parallel_dense")
    x32, w32, b32 = jnp.ones((4, 8)), jnp.ones((8, 8)), jnp.ones(8)
    with pytest.raises(
        TypeError, match="x has dtype float32 but precision policy BFLOAT16 computes in bfloat16"
    ):
        fn(x32, w32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16), mesh=mesh, precision=BFLOAT16)
    with pytest.raises(
        TypeError,
        match=r"w has dtype bfloat16 but precision policy FLOAT32 stores parameters in float32.*w.astype\(jnp.float32\)",
    ):
        fn(x32, w32.astype(jnp.bfloat16), b32, mesh=mesh)
    with pytest.raises(TypeError, match="b has dtype float16 but precision policy MIXED_BFLOAT16"):
        fn(
            x32.astype(jnp.bfloat16),
            w32,
            b32.astype(jnp.float16),
            mesh=mesh,
            precision=MIXED_BFLOAT16,
        )
    with pytest.raises(TypeError, match="precision must be a shardops.Precision"):
        fn(x32, w32, b32, mesh=mesh, precision="bf16")
