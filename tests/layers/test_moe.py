"""The mixture of experts against an independent reference (``tests/_moe_checks.py``): the same
slots and drops, outputs, auxiliary losses and every gradient, on expert axes of 1, 2, 4 and 8
devices, with a model axis inside the experts, with drops and without; hypothesis over E, k,
capacity factors, group sizes and meshes; the load balance's two normalisations; the kernel in
a user's shard_map; the precision every product asks for, read from the traced program; and bad
input refused with the fix."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cover import FULL, cover
from _messages import refused
from _moe_checks import (
    MESHES,
    check_kernel_load_balance,
    check_moe,
    inputs,
    precision_violations,
    reference_routing,
    sharded_loss_and_grads,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardops
from shardops.layers import _moe

MESH_NAMES = list(MESHES)


@pytest.mark.parametrize(
    ("mesh_name", "drops"), cover(MESH_NAMES, [True, False]), ids=str
)  # fmt: skip
def test_matches_the_reference_on_every_mesh(mesh_name, drops):
    """cf = 1 with k = 2 drops tokens; cf = E / k gives every expert S slots: none dropped."""
    check_moe(mesh_name, capacity_factor=1.0 if drops else 4.0, expect_drops=drops)


@pytest.mark.parametrize(
    ("score", "load_balance", "k"),
    [("sigmoid", "group", 3), ("softmax", "group", 1), ("sigmoid", "global", 1)],
    ids=str,
)
def test_scores_load_balances_and_k(score, load_balance, k):
    check_moe("expert4_model2", score=score, load_balance=load_balance, k=k,
              capacity_factor=1.25, seq=12)  # fmt: skip


def test_a_single_group_of_tokens_and_no_mesh():
    """x[T, D] is one group; ``moe`` is the kernel without axes, equal to the layer."""
    x, params, _, logits = inputs(3, 1, 16, 16, 16, 8, 2)
    dispatch, *_ = reference_routing(logits, 2, 1.0)
    routing = _moe.route(x[0], params["router"], k=2, capacity_factor=1.0)
    assert np.array_equal(np.asarray(routing.dispatch), dispatch)
    y2, stats2 = _moe.moe(x[0], params, k=2, capacity_factor=1.0)
    y3, stats3 = _moe.moe(x, params, k=2, capacity_factor=1.0)
    assert y2.shape == x[0].shape
    np.testing.assert_array_equal(y2, y3[0])
    np.testing.assert_array_equal(stats2.dropped, stats3.dropped)


# --- hypothesis --------------------------------------------------------------------------------

MENU_E = [4, 8, 16]


@settings(max_examples=200 if FULL else 6)
@given(
    data=st.data(),
    mesh_name=st.sampled_from(MESH_NAMES),
    capacity_factor=st.sampled_from([0.5, 1.0, 1.25, 2.0]),
    seq=st.sampled_from([4, 8, 12]),
    groups_per_device=st.sampled_from([1, 2]),
    score=st.sampled_from(_moe.SCORES),
    load_balance=st.sampled_from(_moe.LOAD_BALANCE),
    seed=st.integers(0, 2**16),
)
def test_any_routing_equals_the_reference(
    data, mesh_name, capacity_factor, seq, groups_per_device, score, load_balance, seed
):
    sizes, expert_axis, _, _ = MESHES[mesh_name]
    n = sizes[expert_axis] if expert_axis else 1
    e = data.draw(st.sampled_from([v for v in MENU_E if v % n == 0]), label="E")
    k = data.draw(st.integers(1, min(3, e)), label="k")
    check_moe(mesh_name, e=e, k=k, capacity_factor=capacity_factor, seq=seq,
              groups_per_device=groups_per_device, score=score, load_balance=load_balance,
              seed=seed)  # fmt: skip


# --- the load balance's two normalisations -----------------------------------------------------


def test_global_and_per_group_load_balance_differ_and_each_matches_its_formula():
    """On 4 devices, the whole batch's fractions and the groups' average differ: each option
    is checked against its own formula, so the other formula fails it."""
    common = {"seq": 8, "e": 8, "k": 2, "capacity_factor": 1.0, "seed": 5}
    global_ = check_moe("expert4", load_balance="global", **common)["load_balance"]
    group = check_moe("expert4", load_balance="group", **common)["load_balance"]
    assert abs(global_ - group) > 100 * 2.0**-16 * max(global_, group), (global_, group)


def test_per_group_losses_are_averaged_over_every_batch_axis():
    """The tokens split over two batch axes (data = 2 × expert = 2, the experts over expert,
    their hidden units over model = 2): under ``"group"`` the layer's load balance and z-loss
    are the mean over all 4 devices' (each the mean of its own groups'), and so are their
    gradients, within ``TOLERANCE`` of the reference over all 8 groups. A mean over one batch
    axis's devices (the sum divided by 2) doubles both losses: off by the loss itself, 2¹⁶ times
    the bound (tests/layers/test_moe_mutations.py)."""
    sizes, _, _, batch_axes = MESHES["data2_expert2_model2"]
    assert len(batch_axes) == 2 and all(sizes[a] > 1 for a in batch_axes), batch_axes
    check_moe("data2_expert2_model2", load_balance="group")


@pytest.mark.parametrize("load_balance", _moe.LOAD_BALANCE)
def test_the_kernel_s_load_balance_on_each_device(load_balance):
    """Inside a user's shard_map: ``"global"`` gives every device the whole batch's value,
    ``"group"`` each device the mean of its own groups' (no communication)."""
    check_kernel_load_balance(load_balance)


# --- bad input --------------------------------------------------------------------------------


def _layer(mesh_sizes=None, **overrides):
    mesh = shardops.make_mesh(mesh_sizes or {"data": 4})
    params = _moe.init_moe(jax.random.key(0), 16, 32, 8)
    x = jnp.ones((4, 8, 16))
    options = {"k": 2, "capacity_factor": 1.0, **overrides}
    return lambda x=x, params=params: _moe.expert_parallel_moe(x, params, mesh=mesh, **options)


def test_bad_options_are_refused_with_the_fix():
    with refused(ValueError, argument="k=9", got="k=9", expected="[1, E = 8]",
                 fix="choose k between 1 and 8"):  # fmt: skip
        _layer(k=9)()
    with refused(ValueError, argument="k=0", got="k=0", expected="[1, E = 8]",
                 fix="choose k between 1 and 8"):  # fmt: skip
        _layer(k=0)()
    with refused(ValueError, argument="capacity_factor", got="capacity_factor=0.0",
                 expected="> 0", fix="use 1.0 to 2.0"):  # fmt: skip
        _layer(capacity_factor=0.0)()
    with refused(ValueError, argument="score", got="'relu'", expected="('softmax', 'sigmoid')",
                 fix="pass 'softmax'"):  # fmt: skip
        _layer(score="relu")()
    with refused(ValueError, argument="load_balance", got="'batch'",
                 expected="('global', 'group')", fix="pass 'global'"):  # fmt: skip
        _layer(load_balance="batch")()
    with refused(ValueError, argument="expert_axis='data'", got="batch_axes=()",
                 expected="one of batch_axes", fix="pass batch_axes=('data',)"):  # fmt: skip
        _layer(batch_axes=())()


def test_the_capacity_is_worked_out_by_hand_and_never_below_one_slot():
    """``C = min(S, ceil(cf · S · k / E))``, by hand; what the layer refuses (a factor ≤ 0,
    NaN or infinite, k outside [1, E], an empty group) is refused here too, never 0 or fewer
    slots."""
    assert _moe.moe_capacity(16, 2, 4, 1.25) == 10  # ceil(1.25 · 16 · 2 / 4) = ceil(10.0)
    assert _moe.moe_capacity(16, 2, 8, 1.0) == 4
    assert _moe.moe_capacity(10, 1, 8, 1.0) == 2  # ceil(1.25)
    assert _moe.moe_capacity(16, 2, 4, 4.0) == 16  # capped at S
    assert _moe.moe_capacity(16, 2, 4, None) == 16  # dropless
    assert _moe.moe_capacity(16, 1, 8, 1e-6) == 1
    for cf in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match=r"moe_capacity: capacity_factor=.* must be a finite"):
            _moe.moe_capacity(16, 2, 4, cf)
    with pytest.raises(ValueError, match=r"moe_capacity: k=5 .*\[1, E = 4\]"):
        _moe.moe_capacity(16, 5, 4, 1.0)
    with pytest.raises(ValueError, match=r"moe_capacity: group_size=0 must be a positive int"):
        _moe.moe_capacity(0, 2, 4, 1.0)
    with pytest.raises(ValueError, match=r"moe_capacity: num_experts=0 must be a positive int"):
        _moe.moe_capacity(16, 1, 0, 1.0)


@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["capacity", "dropless"])
def test_the_routing_hook_sees_the_choices_and_routes_by_what_it_returns(capacity_factor):
    """``moe_routing_hook``: the identity changes nothing; choices it replaces are routed with
    the probabilities at the returned experts, renormalised (dropless: against a sum over the
    chosen experts by hand); a hook that returns another type is refused; outside the
    ``with`` the layer is its own again."""
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    params = _moe.init_moe(jax.random.key(0), 16, 32, 8)
    run = functools.partial(_moe.moe, k=2, capacity_factor=capacity_factor)
    seen = []

    def identity(probs, top_i):
        seen.append((probs.shape, top_i.shape, top_i.dtype))
        return top_i

    want, stats = run(x, params)
    with shardops.layers.moe_routing_hook(identity):
        got, got_stats = run(x, params)
    assert seen == [((2, 8, 8), (2, 8, 2), jnp.int32)], seen
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_stats.load_balance, stats.load_balance)

    def second_and_third(probs, top_i):  # each token's 2nd and 3rd best experts
        return jax.lax.top_k(probs, 3)[1][..., 1:]

    with shardops.layers.moe_routing_hook(second_and_third):
        shifted, _ = run(x, params)
    assert np.max(np.abs(np.asarray(shifted) - np.asarray(want))) > 1e-3
    if capacity_factor is None:  # every choice computed: Σ_j w_j · expert_{i_j}(x), by hand
        hp = jax.lax.Precision.HIGHEST
        probs = jax.nn.softmax(jnp.einsum("gsd,de->gse", x, params["router"], precision=hp))
        chosen = jax.lax.top_k(probs, 3)[1][..., 1:]  # [G, S, 2]
        w = jnp.take_along_axis(probs, chosen, -1)
        w = w / jnp.sum(w, -1, keepdims=True)  # [G, S, 2]
        gate, up, down = (params[n][chosen] for n in ("gate", "up", "down"))  # [G, S, 2, …]
        h = jax.nn.silu(jnp.einsum("gsd,gskdf->gskf", x, gate, precision=hp)) * jnp.einsum(
            "gsd,gskdf->gskf", x, up, precision=hp)  # fmt: skip
        by_hand = jnp.einsum("gskf,gskfd,gsk->gsd", h, down, w, precision=hp)
        np.testing.assert_allclose(shifted, by_hand, rtol=1e-5, atol=1e-6)
    as_floats = shardops.layers.moe_routing_hook(lambda probs, top_i: top_i.astype(jnp.float32))
    with as_floats, pytest.raises(ValueError, match=r"routing_hook: the hook must return the "
                                  r"choices as it got them, int32\[2,8,2\]; got float32"):  # fmt: skip
        run(x, params)
    np.testing.assert_array_equal(run(x, params)[0], want)


def test_experts_that_do_not_divide_over_the_expert_axis_are_refused():
    params = _moe.init_moe(jax.random.key(0), 16, 32, 6)
    with refused(ValueError, argument="params['router'] dim 1 (experts)", got="= 6",
                 expected="mesh axis 'data' (size 4)", fix="choose a multiple of 4"):  # fmt: skip
        _layer()(params=params)


def test_axes_the_mesh_lacks_or_that_coincide_are_refused_by_name():
    """At the layer level: an expert or model axis the mesh lacks, the same axis for experts
    and hidden units (in ``expert_parallel_moe`` and in ``moe_specs``, before JAX's
    duplicate-spec error), each a message naming the argument and the fix."""
    params = _moe.init_moe(jax.random.key(0), 16, 32, 8)
    for name, axis in (("expert_axis", "expert"), ("model_axis", "tensor")):
        with refused(ValueError, argument=f"{name}={axis!r}", got="is not an axis of the mesh",
                     expected="the mesh has axes ('data',)", fix="Pass one of those names"):  # fmt: skip
            _layer(**{name: axis}, **({"batch_axes": ("data", axis)} if name == "expert_axis"
                                      else {}))(params=params)  # fmt: skip
    with refused(ValueError, argument="model_axis='data'", got="expert_axis='data'",
                 expected="must differ", fix="use another mesh axis"):  # fmt: skip
        _layer(model_axis="data")(params=params)
    with refused(ValueError, argument="moe_specs: model_axis='data'", got="expert_axis='data'",
                 expected="cannot also be", fix="Use another mesh axis for model_axis"):  # fmt: skip
        _moe.moe_specs(expert_axis="data", model_axis="data")


def test_inconsistent_params_are_refused():
    mesh = shardops.make_mesh({"data": 4})
    params = _moe.init_moe(jax.random.key(0), 16, 32, 8)
    specs = _moe.moe_specs()
    # the gate's experts not split: E/N = 8 per device × 4 devices = 32, but the router has 8
    wrong = {**specs.params, "gate": P(None, None, None), "up": P(None, None, None)}
    kernel = functools.partial(_moe.moe_kernel, k=2, capacity_factor=1.0, expert_axis="data",
                               batch_axes=("data",))  # fmt: skip
    run = jax.shard_map(kernel, mesh=mesh, in_specs=(specs.x, wrong),
                        out_specs=(specs.y, _moe.MoeStats(P("data"), P("data"), P("data"),
                                                          P("data"))))  # fmt: skip
    with pytest.raises(ValueError, match=r"params\['gate'\] must be the local shard of a weight "
                                         r"split over mesh axis 'data'"):  # fmt: skip
        run(jnp.ones((4, 8, 16)), params)
    with refused(ValueError, argument="params['down']", got="(8, 16, 32)",
                 expected="w[E, F, D] = (8, 32, 16)", fix="to match the gate"):  # fmt: skip
        _moe.moe(jnp.ones((8, 16)), {**params, "down": params["up"]}, k=2, capacity_factor=1.0)
    with refused(ValueError, argument="params['gate'] holds 8 experts", got="E = 6",
                 expected="= 8", fix="give every projection E/N experts per device"):  # fmt: skip
        _moe.moe(jnp.ones((8, 16)), {**params, "router": params["router"][:, :6]}, k=2,
                 capacity_factor=1.0)  # fmt: skip


def test_a_router_that_varies_over_the_model_axis_is_refused():
    """Each tp device routes the same tokens: a router that differs over ``model`` would
    send them to different experts. (Over the expert axis it may vary: a training step enters
    it varying over the batch axes, ``test_moe_llama.py``.)"""
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    params = _moe.init_moe(jax.random.key(0), 16, 32, 8)
    specs = _moe.moe_specs(model_axis="model")
    wrong = {**specs.params, "router": P("model", None)}  # each device a different block
    kernel = functools.partial(_moe.moe_kernel, k=2, capacity_factor=1.0, expert_axis="data",
                               model_axis="model", batch_axes=("data",))  # fmt: skip
    stats = _moe.MoeStats(P(), P(), P("data"), P("data"))
    params = {**params, "router": jnp.tile(params["router"], (2, 1))}
    with refused(ValueError, argument="params['router']", got="varies over it",
                 expected="replicated over mesh axis 'model'", fix="Reduce it first"):  # fmt: skip
        jax.shard_map(kernel, mesh=mesh, in_specs=(specs.x, wrong),
                      out_specs=(specs.y, stats))(jnp.ones((4, 8, 16)), params)  # fmt: skip


# --- communication and precision ---------------------------------------------------------------

AR, A2A = "all-reduce", "all-to-all"
DT, M = ("data",), ("model",)


def test_collectives_per_pass():
    """data = 4 (experts) × model = 2, 2 groups of S = 8 per device, D = F = 16, E = 8, k = 2,
    cf = 1: C = 2 slots, xe[E, G·C, D] = 8·4·16 floats. Forward: the two AllToAlls, the psum of
    y[G, S, D] over model after the combine, the global statistics over data; backward: the
    two AllToAlls, dx and the combine weights' gradient over model, the router's over data,
    and no reduction of the expert weights' gradients."""
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    x, params, ct, _ = inputs(0, 8, 8, 16, 16, 8, 2)
    specs = _moe.moe_specs(model_axis="model")
    args = (jax.device_put(x, jax.NamedSharding(mesh, specs.x)),
            shardops.shard_params(params, mesh, specs.params),
            jax.device_put(ct, jax.NamedSharding(mesh, specs.y)))  # fmt: skip
    options = (("k", 2), ("capacity_factor", 1.0), ("model_axis", "model"))
    run = functools.partial(sharded_loss_and_grads, module=_moe, mesh=mesh, options=options)
    got = shardops.inspect.ledger(mesh, run, *args).by_pass()
    xe = 8 * (2 * 2) * 16 * 4  # E·G·C·D float32: each AllToAll, each way
    y = 2 * 8 * 16 * 4  # y[G, S, D] (and dx)
    # counts, probability sums, z-loss sum (2E + 1) and the layer's drops (E; its counts are
    # the same sum as the loss's, which XLA computes once)
    stats = (2 * 8 + 1) * 4 + 8 * 4
    assert got["forward"] == {(A2A, DT): 2 * xe, (AR, M): y, (AR, DT): stats}
    weights = 2 * 8 * 8 * 4  # the combine weights' gradient [G, S, E]
    router = 16 * 8 * 4
    assert got["backward"] == {(A2A, DT): 2 * xe, (AR, M): y + weights, (AR, DT): router}


def test_bfloat16_flows_and_stays_near_float32():
    """Under BFLOAT16, y and every gradient are bf16, and y is the float32 layer's (on the same
    bf16 values; routing is float32 either way) within a few bf16 roundings (2⁻⁶ of its
    scale; a float32 value rounded to bf16 moves by ≤ 2⁻⁹ of itself)."""
    mesh = shardops.make_mesh({"data": 2, "model": 2})
    x, params, _, _ = inputs(1, 4, 8, 16, 16, 8, 2)
    x = jnp.asarray(x, jnp.bfloat16)
    params = {n: jnp.asarray(v, jnp.bfloat16) for n, v in params.items()}
    layer = functools.partial(_moe.expert_parallel_moe, mesh=mesh, k=2, capacity_factor=1.0,
                              model_axis="model")  # fmt: skip
    y, _ = jax.jit(functools.partial(layer, precision=shardops.BFLOAT16))(x, params)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer(x, p, precision=shardops.BFLOAT16)[0])))(
        params
    )
    y32, _ = jax.jit(layer)(
        x.astype(jnp.float32), {n: v.astype(jnp.float32) for n, v in params.items()}
    )
    assert y.dtype == jnp.bfloat16 and {g.dtype for g in grads.values()} == {
        jnp.dtype(jnp.bfloat16)
    }
    scale = float(jnp.max(jnp.abs(y32)))
    assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - y32))) <= 2.0**-6 * scale


@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["capacity", "dropless"])
@pytest.mark.parametrize("policy", ["FLOAT32", "MIXED_BFLOAT16", "BFLOAT16"])
def test_every_product_asks_for_the_policy_s_precision(policy, capacity_factor):
    """Forward and backward, traced: the experts' products at the policy's matmul precision,
    the router's, the slots' and the combine's at HIGHEST under every policy (a DEFAULT one is
    right on CPU and ~2⁻⁸ off on a TPU), every product accumulating in float32."""
    assert precision_violations(getattr(shardops, policy), capacity_factor) == []
