"""Precision policy: defined combinations only, f32 accumulation under bf16, no silent upcast."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cover import cover
from _dense_checks import COLUMN_OPTIONS, ROW_OPTIONS, check_dtype_flow
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
from shardops import BFLOAT16, FLOAT32, MIXED_BFLOAT16, Precision
from shardops.testing import dtype_flow, dtype_flow_violations


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
    flow = dtype_flow(lambda x, w: shardops.dense(x, w, precision=BFLOAT16), x, w)
    assert [(n, i, o) for n, i, o, *_ in flow] == [
        ("dot_general", (np.dtype(jnp.bfloat16),) * 2, (np.dtype(np.float32),))
    ]
    y = shardops.dense(x, w, precision=BFLOAT16)
    assert y.dtype == jnp.bfloat16
    # 4096 · (1 + 2^-7) = 4128, exact in bf16; a bf16 accumulator stalls at 256 + ... long before.
    assert float(y[0, 0]) == 4128.0


POLICIES = [FLOAT32, BFLOAT16, MIXED_BFLOAT16]


def _flow_id(v):
    if isinstance(v, Precision):
        return v.name
    if isinstance(v, tuple) and v and isinstance(v[0], str):
        return f"{v[0]}-" + "-".join(f"{k}={w}" for k, w in v[1].items())
    return str(v)


# Every (layer option, mesh), (layer option, policy) and (mesh, policy) pair; the full product
# under SHARDOPS_FULL=1 (tests/_cover.py).
FLOW_CASES = cover(
    [("column", o) for o in COLUMN_OPTIONS] + [("row", o) for o in ROW_OPTIONS],
    [(4,), (2, 4)],
    POLICIES,
)


@pytest.mark.parametrize(("layer_options", "mesh_shape", "precision"), FLOW_CASES, ids=_flow_id)
def test_layers_follow_the_dtype_flow_of_their_policy(layer_options, mesh_shape, precision):
    """Forward and backward: matmuls in compute dtype into accum dtype, every reduction (the
    row psum, psum_scatter, and autodiff's dx/db all-reduces and reduce-scatters) in accum."""
    layer, options = layer_options
    check_dtype_flow(layer, mesh_shape, options, precision)


def test_dtype_flow_checker_sees_each_kind_of_violation():
    x16, w16 = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
    x32, w32 = x16.astype(jnp.float32), w16.astype(jnp.float32)

    def violations(fn, *args, precision):
        return "\n".join(dtype_flow_violations(fn, *args, policy=precision))

    # A float32 weight left un-cast under the mixed policy.
    assert "operands (bfloat16, float32)" in violations(
        lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32),
        x16, w32, precision=MIXED_BFLOAT16,
    )  # fmt: skip
    # bf16 accumulation.
    assert "accumulates into (bfloat16)" in violations(jnp.matmul, x16, w16, precision=BFLOAT16)
    # A float32 matmul at default precision (TF32 on GPU).
    assert "needs Precision.HIGHEST" in violations(jnp.matmul, x32, w32, precision=FLOAT32)
    assert not violations(
        lambda x, w: jnp.matmul(x, w, precision="highest"), x32, w32, precision=FLOAT32
    )
    # A reduction in bf16, across devices (autodiff's, inside shard_map) and local.
    mesh = shardops.make_mesh({"model": 4})
    col = shardops.column_parallel_dense_specs()

    def bf16_dx_all_reduce(x, w):
        def body(x, w):  # Megatron's "f" applied to the bf16 activation: dx reduced in bf16
            y = lax.pcast(x, "model", to="varying") @ w.astype(jnp.bfloat16)
            return lax.psum(y.astype(jnp.float32).sum(), "model")

        f = jax.shard_map(body, mesh=mesh, in_specs=(col.x, col.w), out_specs=P())
        return jax.grad(f)(x, w)

    text = violations(bf16_dx_all_reduce, x16, jnp.ones((8, 8), jnp.bfloat16), precision=BFLOAT16)
    assert "psum_invariant" in text and "sums (bfloat16)" in text

    def bf16_sum(x, w):  # jnp.sum upcasts bf16 by itself; a raw lax reduction does not
        y = shardops.dense(x, w, precision=BFLOAT16)
        return lax.reduce(y, np.array(0, jnp.bfloat16), lax.add, (0, 1))

    assert "reduce_sum at" in violations(bf16_sum, x16, w16, precision=BFLOAT16)
    assert "no dot_general" in violations(lambda x: x.sum(), x32, precision=FLOAT32)


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


@pytest.mark.parametrize("precision", [FLOAT32, MIXED_BFLOAT16], ids=lambda p: p.name)
def test_matmuls_share_one_rounded_input(precision):
    """``Precision.matmuls`` equals separate ``matmul`` calls (values and gradients, dx summed
    in f32), follows the policy's dtype flow, and keeps one compute-dtype copy of x for the
    backward where separate calls keep one each; inside shard_map a replicated x gets its dx
    reduced once."""
    from jax._src.ad_checkpoint import saved_residuals

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 6, 8)), jnp.float32)  # accum dtype: dx unrounded
    ws = tuple(jnp.asarray(rng.normal(size=(8, n)), precision.param_dtype) for n in (5, 4, 2))

    def fused(x, ws):
        return sum(jnp.sum(y * (i + 1)) for i, y in enumerate(precision.matmuls(x, ws)))

    def separate(x, ws):
        return sum(jnp.sum(precision.matmul(x, w) * (i + 1)) for i, w in enumerate(ws))

    got, want = (jax.value_and_grad(f, argnums=(0, 1))(x, ws) for f in (fused, separate))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
    assert not dtype_flow_violations(jax.grad(fused, argnums=(0, 1)), x, ws, policy=precision)

    def x_copies(f):
        return sum(aval.shape == x.shape for aval, _ in saved_residuals(f, x, ws))

    rounded = precision.compute_dtype != x.dtype  # under FLOAT32 every call keeps x itself
    assert (x_copies(fused), x_copies(separate)) == (1, 3 if rounded else 1)

    mesh = shardops.make_mesh({"model": 2})

    def sharded(x, ws):  # x replicated over model, each weight split by columns
        ys = precision.matmuls(x, ws)
        return lax.psum(sum(jnp.sum(y) for y in ys), "model")

    dx = jax.jit(jax.shard_map(jax.grad(sharded), mesh=mesh, in_specs=(P(), P(None, "model")),
                               out_specs=P(), check_vma=True))(x, ws[1:])  # fmt: skip
    want_dx = jax.grad(lambda x, ws: sum(jnp.sum(precision.matmul(x, w)) for w in ws))(x, ws[1:])
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5)  # summed over the devices once

    # Weights of different types: wq split over model, wk replicated. Each product's dx is
    # reduced over model by its own type: wq's partial sums once, wk's (whole on every
    # device) not multiplied by the device count.
    def mixed(x, wq, wk):
        yq, yk = precision.matmuls(x, (wq, wk))
        return lax.psum(jnp.sum(yq), "model") + jnp.sum(yk)

    dx = jax.jit(jax.shard_map(jax.grad(mixed), mesh=mesh,
                               in_specs=(P(), P(None, "model"), P()), out_specs=P(),
                               check_vma=True))(x, ws[1], ws[2])  # fmt: skip
    want_dx = jax.grad(lambda x: jnp.sum(precision.matmul(x, ws[1]))
                       + jnp.sum(precision.matmul(x, ws[2])))(x)  # fmt: skip
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5)
