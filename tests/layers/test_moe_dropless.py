"""The dropless mixture of experts (``capacity_factor=None``: choices sorted by expert, grouped
matmuls, unsorted and combined) against the independent loop reference with no capacity
(``tests/_moe_checks.py``) and against the capacity path where that drops nothing
(``capacity_factor = E / k``: ``C = S``), on meshes with batch axes and a model axis inside
the experts; where the capacity path drops, dropless differs; megablox's kernels (interpreted
on CPU) equal ``lax.ragged_dot``; an expert split is refused with the fix; mutants of the sort
are caught.

The bound (``_moe_checks.TOLERANCE`` = 2⁻¹⁶ of an array's largest magnitude): both layers and
the reference are float32 with full-precision products over at most ``max(D, F, k)`` terms,
so any two differ by a few ``n·eps`` of that magnitude; a wrong group size, order or weight
moves an entry by O(1) of it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _messages import refused
from _moe_checks import TOLERANCE, check_moe, close, inputs, moe_mutant, sharded_loss_and_grads
from jax.sharding import PartitionSpec as P

import shardops
from shardops.layers import _moe


@pytest.mark.parametrize("mesh_name", ["data2_model2_no_expert_axis", "model4_only", "expert1"])
def test_dropless_matches_the_loop_reference_with_no_capacity(mesh_name):
    """Output, statistics (nothing dropped) and every gradient, on a batch axis with a model
    axis inside the experts, a model axis alone, and an expert axis of one device (the
    other tests add two batch axes with a model axis)."""
    got = check_moe(mesh_name, capacity_factor=None, expect_drops=False, seq=12, e=4)
    stats = got["layer"][1]
    assert float(jnp.sum(stats.dropped)) == 0.0


@pytest.mark.parametrize(
    "mesh_name", ["data2_model2_no_expert_axis", "data2_expert2_model2_unsplit"]
)
def test_dropless_equals_the_capacity_path_where_it_drops_nothing(mesh_name):
    """``capacity_factor = E / k`` gives every expert ``C = S`` slots: the capacity path drops
    nothing and computes what dropless computes (outputs and the gradients of x, the router
    and the experts) to the same float32 bound."""
    e, k = 8, 2
    dropless = check_moe(mesh_name, capacity_factor=None, e=e, k=k)["layer"]
    capacity = check_moe(mesh_name, capacity_factor=e / k, e=e, k=k, expect_drops=False)["layer"]
    (y, stats, dx, dp), (y_c, stats_c, dx_c, dp_c) = dropless, capacity
    np.testing.assert_array_equal(stats.tokens_per_expert, stats_c.tokens_per_expert)
    np.testing.assert_array_equal(stats.dropped, stats_c.dropped)
    close("y", y, y_c, mesh_name)
    close("dx", dx, dx_c, mesh_name)
    for name in _moe.PARAMS:
        # the router's gradient cancels over the k renormalised weights: its scale is dx's
        terms = np.max(np.abs(np.asarray(dp_c[name]))) if name != "router" else 1.0
        close(f"d{name}", dp[name], dp_c[name], mesh_name, terms)


def test_where_the_capacity_path_drops_dropless_differs():
    """capacity_factor = 1 with k = 2 drops choices: the capacity layer's ``y`` then differs
    from dropless's by O(1) on the tokens it dropped (a dropless path that applied a capacity
    would equal it), while dropless matches the reference with no capacity."""
    common = {"mesh_name": "data2_model2_no_expert_axis", "e": 8, "k": 2, "seq": 16}
    capacity = check_moe(capacity_factor=1.0, expect_drops=True, **common)
    dropless = check_moe(capacity_factor=None, expect_drops=False, **common)
    y_c, stats_c = capacity["layer"][:2]
    y, stats = dropless["layer"][:2]
    assert float(jnp.sum(stats_c.dropped)) == capacity["dropped"].sum() > 0
    assert float(jnp.sum(stats.dropped)) == 0.0
    gap = float(jnp.max(jnp.abs(y - y_c))) / float(jnp.max(jnp.abs(y)))
    assert gap > 1000 * TOLERANCE, gap


def test_megablox_equals_ragged_dot():
    """The Pallas TPU kernels (interpreted here) on one device: y and every gradient equal
    ``lax.ragged_dot``'s to the float32 bound."""
    x, params, ct, _ = inputs(3, 2, 16, 16, 16, 4, 2)

    def loss(grouped_matmul, x, params):
        y, stats = _moe.moe(x, params, k=2, capacity_factor=None, grouped_matmul=grouped_matmul)
        return jnp.sum(ct * y) + stats.load_balance, y

    grads = {}
    for how in _moe.GROUPED_MATMULS:
        f = jax.jit(jax.value_and_grad(functools.partial(loss, how), (0, 1), has_aux=True))
        grads[how] = f(x, params)
    (_, y_m), (dx_m, dp_m) = grads["megablox"]
    (_, y_r), (dx_r, dp_r) = grads["ragged_dot"]
    close("y", y_m, y_r, "megablox")
    close("dx", dx_m, dx_r, "megablox")
    for name in _moe.PARAMS:
        close(f"d{name}", dp_m[name], dp_r[name], "megablox", 1.0 if name == "router" else 0.0)


def test_bfloat16_flows_and_stays_near_float32():
    """Under BFLOAT16 with tp inside the experts, y and every gradient are bf16 and y is the
    float32 layer's within a few bf16 roundings (2⁻⁶ of its scale, as the capacity path's)."""
    mesh = shardops.make_mesh({"data": 2, "model": 2})
    x, params, _, _ = inputs(1, 4, 8, 16, 16, 8, 2)
    x = jnp.asarray(x, jnp.bfloat16)
    params = {n: jnp.asarray(v, jnp.bfloat16) for n, v in params.items()}
    layer = functools.partial(_moe.expert_parallel_moe, mesh=mesh, k=2, capacity_factor=None,
                              expert_axis=None, model_axis="model")  # fmt: skip
    bf16 = functools.partial(layer, precision=shardops.BFLOAT16)
    y, _ = jax.jit(bf16)(x, params)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(bf16(x, p)[0])))(params)
    y32, _ = jax.jit(layer)(x.astype(jnp.float32), jax.tree.map(lambda v: v.astype(jnp.float32), params))  # fmt: skip
    assert y.dtype == jnp.bfloat16
    assert {g.dtype for g in grads.values()} == {jnp.dtype(jnp.bfloat16)}
    scale = float(jnp.max(jnp.abs(y32)))
    assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - y32))) <= 2.0**-6 * scale


def test_collectives_per_pass():
    """data = 4 × model = 2, no expert split, 2 groups of S = 8 per device, D = F = 16, E = 8,
    k = 2. Forward: no AllToAll; the one AllReduce of y[G, S, D] over model after the combine,
    the global statistics (2E + 1 floats) over data (the drops are zeros: nothing reduced).
    Backward: dx and the combine weights' gradient [G, S, k] over model; the router's and,
    every expert on every device, the experts' gradients [E, D, F/2] (three) over data."""
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    x, params, ct, _ = inputs(0, 8, 8, 16, 16, 8, 2)
    specs = _moe.moe_specs(expert_axis=None, model_axis="model")
    args = (jax.device_put(x, jax.NamedSharding(mesh, specs.x)),
            shardops.shard_params(params, mesh, specs.params),
            jax.device_put(ct, jax.NamedSharding(mesh, specs.y)))  # fmt: skip
    options = (("k", 2), ("capacity_factor", None), ("expert_axis", None), ("model_axis", "model"))
    run = functools.partial(sharded_loss_and_grads, module=_moe, mesh=mesh, options=options)
    got = shardops.inspect.ledger(mesh, run, *args).by_pass()
    ar, data, model = "all-reduce", ("data",), ("model",)
    y = 2 * 8 * 16 * 4  # y[G, S, D] float32 (and dx)
    assert got["forward"] == {(ar, model): y, (ar, data): (2 * 8 + 1) * 4}
    weights = 2 * 8 * 2 * 4  # [G, S, k]
    router, experts = 16 * 8 * 4, 3 * 8 * 16 * 8 * 4
    assert got["backward"] == {(ar, model): y + weights, (ar, data): router + experts}


# --- refused ------------------------------------------------------------------------------------


def test_an_expert_split_is_refused_with_the_fix():
    """Dropless with the experts split over an axis of 4 would need a ragged AllToAll: the
    layer (whose expert_axis defaults to 'data') and the kernel refuse it."""
    mesh = shardops.make_mesh({"data": 4})
    params = _moe.init_moe(jax.random.key(0), 16, 32, 8)
    x = jnp.ones((4, 8, 16))
    fix = "pass expert_axis=None"
    with refused(ValueError, argument="expert_axis='data'", got="has size 4",
                 expected="capacity_factor=None (dropless) needs the experts unsplit",
                 fix=fix):  # fmt: skip
        _moe.expert_parallel_moe(x, params, mesh=mesh, k=2, capacity_factor=None)
    specs = _moe.moe_specs()
    kernel = functools.partial(_moe.moe_kernel, k=2, capacity_factor=None, expert_axis="data",
                               batch_axes=("data",))  # fmt: skip
    stats = _moe.MoeStats(P("data"), P("data"), P("data"), P("data"))
    run = jax.shard_map(kernel, mesh=mesh, in_specs=(specs.x, specs.params),
                        out_specs=(specs.y, stats))  # fmt: skip
    with refused(ValueError, argument="expert_axis='data'", got="has size 4",
                 expected="needs the experts unsplit", fix="or a capacity_factor"):  # fmt: skip
        run(jax.device_put(x, jax.NamedSharding(mesh, specs.x)),
            shardops.shard_params(params, mesh, specs.params))  # fmt: skip


def test_bad_grouped_matmuls_are_refused_with_the_fix():
    mesh = shardops.make_mesh({"data": 2, "model": 2})
    params = _moe.init_moe(jax.random.key(0), 16, 32, 8)
    x = jnp.ones((2, 8, 16))
    with refused(ValueError, argument="grouped_matmul='gmm'", got="'gmm'",
                 expected="('ragged_dot', 'megablox')", fix="pass 'ragged_dot'"):  # fmt: skip
        _moe.moe(x, params, k=2, capacity_factor=None, grouped_matmul="gmm")
    with refused(ValueError, argument="grouped_matmul='megablox'", got="mesh axes ['data', "
                 "'model']", expected="outside shard_map only",
                 fix="pass grouped_matmul='ragged_dot'"):  # fmt: skip
        _moe.expert_parallel_moe(x, params, mesh=mesh, k=2, capacity_factor=None,
                                 expert_axis=None, model_axis="model", grouped_matmul="megablox")  # fmt: skip


# --- mutants ------------------------------------------------------------------------------------

MUTANTS = {
    # the boundary between experts 0 and 1 one row late: expert 1's first choice by expert 0
    "group_sizes_off_by_one": (
        "    group_sizes = jnp.bincount(expert, length=e).astype(jnp.int32)  # [E]: tokens per expert",
        "    group_sizes = jnp.bincount(expert, length=e).astype(jnp.int32).at[0].add(1).at[1].add(-1)",
    ),
    # the experts' outputs combined in sorted (expert) order, not the tokens'
    "unsort_omitted": (
        "    ye = ys[unsort].reshape(g, s, k, d)  # ye[G, S, k, D]: choice j of token s back in place",
        "    ye = ys.reshape(g, s, k, d)",
    ),
    # the top-k probabilities used as they are: the k weights of a token do not sum to 1
    "weights_not_renormalised": (
        "    weights = top_p / jnp.sum(top_p, axis=-1, keepdims=True)  # [G, S, k], renormalised over k",
        "    weights = top_p  # [G, S, k]",
    ),
}
MUTANT_CASE = {"mesh_name": "data2_model2_no_expert_axis", "capacity_factor": None, "e": 4}


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(name):
    line, replacement = MUTANTS[name]
    module = moe_mutant(name, line, replacement)
    with pytest.raises(AssertionError):
        check_moe(module=module, **MUTANT_CASE)


def test_unmutated_copy_passes():
    line = MUTANTS["unsort_omitted"][0]
    check_moe(module=moe_mutant("unmutated", line, line), **MUTANT_CASE)
