"""Layer norm and RMS norm on sequence-parallel activations: the parameter gradients are reduced
over ``model`` by ``check_vma`` (Megatron does it by hand), and without it they are partial sums.

Every check runs the norm and its gradients *inside* one ``jax.shard_map`` over
``x[B_data, S_model, D]`` with ``scale``/``bias`` replicated (``P()``), as a per-device training
step does, and compares ``y``, ``dx`` and the parameter gradients with the float64 reference
(``_attention_checks.norm_reference``, derived bound) and with the same body run unsharded.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_checks import (
    NORM_PARAMS,
    POLICIES,
    check_sequence_parallel_norm,
    mesh_for,
    norm_inputs,
    sequence_parallel_norm,
)
from _cover import cover_meshes
from _dense_checks import MESHES
from jax.sharding import PartitionSpec as P

import shardops
from shardops.layers._norms import layer_norm, rms_norm
from shardops.testing import dtype_flow

KINDS = sorted(NORM_PARAMS)


# Meshes as a data-axis and a model-axis factor, each value paired with the other factor's
# (tests/_cover.py); every mesh × value under SHARDOPS_FULL=1.
@pytest.mark.parametrize(("mesh_shape", "kind"), cover_meshes(MESHES, KINDS), ids=str)
def test_sequence_parallel_norm_matches_reference(kind, mesh_shape):
    check_sequence_parallel_norm(kind, mesh_shape, shardops.FLOAT32)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (8,)], ids=str)
@pytest.mark.parametrize("policy", ["BFLOAT16", "MIXED_BFLOAT16"])
@pytest.mark.parametrize("kind", KINDS)
def test_sequence_parallel_norm_under_bf16_policies(kind, policy, mesh_shape):
    """bf16 activations (and, under BFLOAT16, bf16 parameters): statistics in float32, ``y`` and
    ``dx`` rounded once to bf16, the parameter gradients reduced in float32 then rounded."""
    check_sequence_parallel_norm(kind, mesh_shape, POLICIES[policy])


@pytest.mark.parametrize("kind", KINDS)
def test_without_check_vma_parameter_gradients_are_one_devices_partial_sum(kind):
    """The classic sequence-parallel bug, observed: with ``check_vma=False`` nothing reduces the
    replicated parameters' gradients over ``model``. No error is raised; ``y`` and ``dx`` stay
    right, and ``dscale``/``dbias`` are each device's partial sum over its sequence shard, of
    which ``out_specs=P()`` returns one. With every shard alike that is exactly 1/p of the true
    gradient (p = 4 here): wrong by the factor p that Megatron's hand-written all-reduce of the
    sequence-parallel parameters' gradients restores."""
    p = 4
    x, ct, params = norm_inputs(np.random.default_rng(0), kind, 4, 16, 32, shardops.FLOAT32,
                                tiled_over=p)  # fmt: skip
    right, _ = sequence_parallel_norm(kind, (p,), x, ct, params, check_vma=True)
    wrong, _ = sequence_parallel_norm(kind, (p,), x, ct, params, check_vma=False)
    for name, good, bad in zip(("y", "dx"), right, wrong, strict=False):
        np.testing.assert_array_equal(bad, good, err_msg=name)
    for name, good, bad in zip(NORM_PARAMS[kind], right[2:], wrong[2:], strict=True):
        np.testing.assert_allclose(bad * p, good, rtol=1e-5, atol=1e-5, err_msg=name)
        assert np.max(np.abs(bad - good)) > 0.5 * np.max(np.abs(good)), name
    # The suite's own check sees it (on random data the share is not even a fixed fraction).
    with pytest.raises(AssertionError, match=r"dscale of sharded .*check_vma=False"):
        check_sequence_parallel_norm(kind, (2, 4), shardops.FLOAT32, check_vma=False)


def test_without_check_vma_the_partials_sum_to_the_gradient():
    """What is missing is exactly one AllReduce over ``model``: stacking the per-device partial
    gradients (``out_specs=P("model")``) and summing them gives the reference gradient."""
    mesh, _ = mesh_for((4,))
    x, ct, (scale, bias) = norm_inputs(np.random.default_rng(1), "layer_norm", 4, 16, 32,
                                       shardops.FLOAT32)  # fmt: skip

    def partials(x, ct, scale, bias):
        def loss(scale, bias):
            return jnp.sum(layer_norm(x, scale, bias) * ct)

        d_scale, d_bias = jax.grad(loss, argnums=(0, 1))(scale, bias)
        return d_scale[None], d_bias[None]  # [1, D] per device

    x_spec = P(None, "model", None)
    # check_vma=False on purpose: it returns each device's unreduced partial gradient, to show
    # that the partials sum to the true gradient (the reduction check_vma inserts).
    stacked = jax.jit(jax.shard_map(partials, mesh=mesh, in_specs=(x_spec, x_spec, P(), P()),
                                    out_specs=(P("model"), P("model")), check_vma=False))  # fmt: skip
    d_scale, d_bias = (np.asarray(a, np.float64) for a in stacked(x, ct, scale, bias))
    full = jax.grad(lambda s, b: jnp.sum(layer_norm(x, s, b) * ct), argnums=(0, 1))(scale, bias)
    assert not np.allclose(d_scale[0], d_scale[1])  # the shards' shares differ
    np.testing.assert_allclose(d_scale.sum(0), full[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_bias.sum(0), full[1], rtol=1e-5, atol=1e-5)


def test_grad_taken_outside_the_shard_map_is_right_either_way():
    """The trap is autodiff *inside* the per-device body (a train step in one ``shard_map``, as
    ``models/`` and Megatron run it). Differentiating *through* a ``shard_map`` is safe even
    with ``check_vma=False``: its transpose sums the cotangents of ``P()`` inputs itself."""
    mesh, _ = mesh_for((4,))
    x, ct, (scale, bias) = norm_inputs(np.random.default_rng(2), "layer_norm", 4, 16, 32,
                                       shardops.FLOAT32)  # fmt: skip
    x_spec = P(None, "model", None)
    grads = {}
    for check_vma in (True, False):
        norm = jax.shard_map(layer_norm, mesh=mesh, in_specs=(x_spec, P(), P()),
                             out_specs=x_spec, check_vma=check_vma)  # fmt: skip

        def loss(scale, bias, norm=norm):
            return jnp.sum(norm(x, scale, bias) * ct)

        grads[check_vma] = jax.jit(jax.grad(loss, argnums=(0, 1)))(scale, bias)
    full = jax.grad(lambda s, b: jnp.sum(layer_norm(x, s, b) * ct), argnums=(0, 1))(scale, bias)
    for got in grads.values():
        for g, want in zip(got, full, strict=True):
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_statistics_in_float32_and_result_in_x_dtype(kind):
    x = jnp.ones((2, 8, 16), jnp.bfloat16)
    params = [jnp.ones(16, jnp.bfloat16) for _ in NORM_PARAMS[kind]]
    fn = layer_norm if kind == "layer_norm" else rms_norm

    def loss(x, *params):
        return jnp.sum(fn(x, *params).astype(jnp.float32))

    assert fn(x, *params).dtype == jnp.bfloat16
    sums = [(name, ins) for name, ins, *_ in dtype_flow(jax.grad(loss, argnums=(0, 1)), x, *params)]
    assert sums, "no reduction found"
    for name, ins in sums:
        assert all(d == np.float32 for d in ins), (name, ins)


def test_bad_inputs():
    x = jnp.ones((2, 8, 16))
    with pytest.raises(ValueError, match=r"layer_norm: scale must have shape \(16,\) to match "
                                         r"x\(2, 8, 16\) .* got \(4,\)\. Inside shard_map pass it "
                                         r"replicated"):  # fmt: skip
        layer_norm(x, jnp.ones(4), None)
    with pytest.raises(ValueError, match=r"rms_norm: scale must have shape \(16,\)"):
        rms_norm(x, jnp.ones((16, 1)))
    with pytest.raises(TypeError, match=r"layer_norm: x must be a floating array; got dtype int32"):
        layer_norm(jnp.ones((2, 16), jnp.int32), None, None)
    with pytest.raises(ValueError, match=r"rms_norm: eps must be a positive number; got 0"):
        rms_norm(x, None, eps=0)
    with pytest.raises(ValueError, match=r"x must have rank ≥ 1"):
        layer_norm(jnp.float32(1.0), None, None)
