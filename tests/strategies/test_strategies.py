"""Every strategy on every mesh trains exactly like the unsharded MLP."""

import collections
import itertools
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from _cover import cover
from _messages import refused
from _model_checks import batches, check_evaluation, check_trajectory, mesh_for

import shardops
import shardops_models as models

# 1-axis meshes for the one-axis strategies, every 2-axis factorisation of 8 for all, and the
# layouts over replica × data × model on three 3-axis meshes.
TWO_AXIS = [{"data": d, "model": 8 // d} for d in (1, 2, 4, 8)]
THREE_AXIS = [dict(zip(("replica", "data", "model"), m, strict=True))
              for m in ((2, 2, 2), (2, 4, 1), (1, 2, 4))]  # fmt: skip
CASES = (
    [("ref", None)]
    + [(s, {"data": n}) for s in ("dp", "fsdp", "zero1") for n in (1, 2, 4, 8)]
    + [("tp", {"model": n}) for n in (1, 2, 4, 8)]
    + [(s, m) for s in ("dp", "tp", "2d", "fsdp", "fsdp_tp", "zero1_tp") for m in TWO_AXIS]
    + [(s, m) for s in ("hsdp", "hsdp_tp", "zero1_tp") for m in THREE_AXIS]
)
SIZES = (48, 64, 24, 10)  # 3 layers: a column/row pair and an odd, replicated last layer


def _id(case):
    strategy, mesh = case
    return f"{strategy}-{'x'.join(map(str, mesh.values())) if mesh else 'none'}"


# Each test runs every (strategy, mesh) pair, and pairs each strategy and each mesh with every
# value of its own option; the full product under SHARDOPS_FULL=1 (tests/_cover.py).
STRATEGY_NAMES = list(dict.fromkeys(s for s, _ in CASES))
MESH_KEYS = list(dict.fromkeys(None if m is None else tuple(m.items()) for _, m in CASES))
CASE_KEYS = {(s, None if m is None else tuple(m.items())) for s, m in CASES}


def _covered_cases(values):
    cases = cover(STRATEGY_NAMES, MESH_KEYS, values, valid=lambda s, m, v: (s, m) in CASE_KEYS)
    return [((s, None if m is None else dict(m)), v) for s, m, v in cases]


def _case_value_id(v):
    return _id(v) if isinstance(v, tuple) else str(v)


@pytest.mark.parametrize(("case", "opt_name"), _covered_cases(["sgd", "adam"]), ids=_case_value_id)
def test_five_steps_equal_the_reference(case, opt_name):
    strategy, mesh_shape = case
    check_trajectory(strategy, mesh_shape, opt_name, sizes=SIZES, batch=32)


@pytest.mark.parametrize(("case", "pad"), _covered_cases([0, 8]), ids=_case_value_id)
def test_evaluate_equals_the_unsharded_metrics(case, pad):
    """Loss and accuracy of every strategy on every mesh, against the plain unsharded model."""
    strategy, mesh_shape = case
    check_evaluation(strategy, mesh_shape, sizes=SIZES, batch=64, pad=pad)


def test_the_default_run_has_every_strategy_on_every_mesh():
    for values in (["sgd", "adam"], [0, 8]):
        cases = _covered_cases(values)
        assert {_id(c) for c, _ in cases} == {_id(c) for c in CASES}
        assert {(c[0], v) for c, v in cases} == {(s, v) for s, _ in CASES for v in values}


@pytest.mark.parametrize("strategy", ["2d", "fsdp_tp"])
def test_seed_mlp_on_the_seed_mesh(strategy):
    """The seed's 784-512-10 on 4×2, at the seed's LR 1.0."""
    check_trajectory(strategy, {"data": 4, "model": 2}, "sgd", sizes=models.SEED_SIZES, batch=64)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_tp"])
def test_remat_trains_the_same(strategy):
    check_trajectory(strategy, {"data": 2, "model": 4} if strategy == "fsdp_tp" else {"data": 4},
                     "sgd", sizes=SIZES, batch=32, remat=True)  # fmt: skip


def compiled_budget(setup, batch):
    state = setup.init(jax.random.key(0))
    xs, ys = batches(setup.sizes, batch)
    xb, yb = setup.place_batch(xs[0], ys[0])
    out = collections.Counter()
    for c in shardops.inspect.collectives(setup.mesh, setup.train_step, state, xb, yb):
        assert c.axes is not None, c
        if c.bytes:
            out[(c.kind, c.axes)] += c.bytes
    return dict(out)


BUDGET_CASES = (
    [
        ("dp", {"data": 8}, False),
        ("tp", {"model": 8}, False),
        ("fsdp", {"data": 8}, False),
        ("fsdp", {"data": 4}, True),
    ]
    + [(s, m, False) for s in ("2d", "fsdp_tp") for m in TWO_AXIS]
    + [("fsdp_tp", {"data": 2, "model": 4}, True)]
    + [
        ("hsdp", THREE_AXIS[1], False),
        ("hsdp", THREE_AXIS[0], True),
        ("hsdp_tp", THREE_AXIS[0], False),
        ("zero1", {"data": 8}, False),
        ("zero1_tp", THREE_AXIS[0], False),
    ]
)


@pytest.mark.parametrize("sizes", [models.SEED_SIZES, (64, 32, 32, 16)], ids=str)
@pytest.mark.parametrize(("strategy", "mesh_shape", "remat"), BUDGET_CASES, ids=str)
def test_compiled_collectives_match_the_budget(strategy, mesh_shape, remat, sizes):
    setup = models.build(
        strategy, mesh_for(mesh_shape), optimizer=optax.sgd(1.0), sizes=sizes, remat=remat
    )
    state = setup.init(jax.random.key(0))
    xb, yb = setup.place_batch(*(a[0] for a in batches(setup.sizes, 64)))
    compiled = shardops.inspect.ledger(setup.mesh, setup.train_step, state, xb, yb)
    assert compiled.totals() == setup.collective_budget(64)  # FLOAT32: XLA:CPU runs as asked
    assert compiled.by_pass() == setup.budget(64).by_pass()


def test_tp_seed_budget_has_no_backward_all_reduce():
    """784-512-10 under tp: one forward AllReduce of the logits [B, 10] and nothing else."""
    setup = models.build("tp", mesh_for({"model": 4}), optimizer=optax.sgd(1.0))
    assert compiled_budget(setup, 64) == {("all-reduce", ("model",)): 64 * 10 * 4}


@pytest.mark.parametrize("fsdp_dense", ["auto", "gather_weights"])
def test_fsdp_has_no_full_gradient_all_reduce(fsdp_dense):
    setup = models.build("fsdp", mesh_for({"data": 8}), optimizer=optax.sgd(1.0),
                         fsdp_dense=fsdp_dense)  # fmt: skip
    budget = compiled_budget(setup, 64)
    # Only b2[10] (not divisible by 8) and the loss are all-reduced: 10 + 1 floats.
    assert budget[("all-reduce", ("data",))] == (10 + 1) * 4
    # gather_weights: w1, b1 and w2 gathered and reduce-scattered. auto, at 8 rows a device:
    # both layers move activations instead (models/strategies/fsdp.py): y1[64, 512] and y2[64, 10]
    # reduce-scattered, dy gathered; x1[8, 784], x2[8, 512] and dx2 by AllToAll.
    if fsdp_dense == "gather_weights":
        gathered, all_to_all = 784 * 512 + 512 + 512 * 10, 0
    else:
        gathered, all_to_all = 64 * 512 + 512 + 64 * 10, 8 * 784 + 2 * 8 * 512
    assert (
        budget[("all-gather", ("data",))] == budget[("reduce-scatter", ("data",))] == gathered * 4
    )
    assert budget.get(("all-to-all", ("data",)), 0) == all_to_all * 4


def check_remat_regathers(build=models.build) -> None:
    """The compiled fsdp step with remat gathers the second layer's weight w[512, 10] again
    for dx; the first layer's is not needed (its input is the data), nor are the biases. (What
    the program asks for is the same with and without XLA's CSE merging the re-gather into the
    forward gather; only the compiled program shows it.)"""
    mesh = mesh_for({"data": 4})
    plain = compiled_budget(build("fsdp", mesh, optimizer=optax.sgd(1.0)), 64)
    remat = compiled_budget(build("fsdp", mesh, optimizer=optax.sgd(1.0), remat=True), 64)
    regathered = remat[("all-gather", ("data",))] - plain[("all-gather", ("data",))]
    assert regathered == 512 * 10 * 4, regathered


def test_remat_regathers_weights_in_the_backward_pass():
    check_remat_regathers()


@pytest.mark.parametrize(
    ("strategy", "mesh_shape"), [("fsdp", {"data": 8}), ("fsdp_tp", {"data": 4, "model": 2})]
)
def test_fsdp_devices_hold_a_shard_of_params_and_optimizer_state(strategy, mesh_shape):
    mesh = mesh_for(mesh_shape)
    setup = models.build(strategy, mesh, optimizer=optax.adam(1e-3))
    state = setup.init(jax.random.key(0))
    n = mesh.devices.size
    full = sum(4 * w * h + 4 * h for w, h in itertools.pairwise(models.SEED_SIZES))
    replicated = 4 * 10  # b2[10] divides over neither 8 devices nor data=4 (documented rule)
    for tree in (state.params, state.opt_state[0].mu, state.opt_state[0].nu):
        per_device = collections.Counter()
        for leaf in jax.tree.leaves(tree):
            for shard in leaf.addressable_shards:
                per_device[shard.device] += shard.data.size * 4
        assert len(per_device) == n
        assert set(per_device.values()) == {(full - replicated) // n + replicated}


@pytest.mark.parametrize("strategy", models.strategies_for(models.Mlp()))
def test_shard_then_gather_is_lossless(strategy):
    shape = (
        {"replica": 2, "data": 2, "model": 2}
        if "replica" in models.STRATEGIES[strategy].axes
        else {"data": 4, "model": 2}
    )
    mesh = None if strategy == "ref" else mesh_for(shape)
    setup = models.build(strategy, mesh, optimizer=optax.adam(1e-3))
    params = models.init_mlp(jax.random.key(3))
    state = setup.shard(params)
    back = setup.gather(state.params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    if mesh is not None:
        specs = jax.tree.leaves(
            setup.param_specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)
        )
        shardings = [leaf.sharding.spec for leaf in jax.tree.leaves(state.params)]
        assert specs == shardings


def test_the_seed_schedule_is_constant_within_an_epoch():
    schedule = models.seed_schedule(steps_per_epoch=10)
    got = [float(schedule(step)) for step in (0, 9, 10, 19, 50, 199)]
    want = [1.0 * 0.95 ** (epoch / 5) for epoch in (0, 0, 1, 1, 5, 19)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_bad_strategy_inputs():
    sgd = optax.sgd(1.0)
    with pytest.raises(ValueError, match=r"unknown strategy 'zero3'; choose one of \['2d', 'dp'"):
        models.build("zero3", mesh_for({"data": 8}), optimizer=sgd)
    with pytest.raises(ValueError) as unknown:
        models.strategy_named("zero3")
    for suffix in ("'+ep'", "'+ring'", "'+ulysses'", "'+gpipe'", "'+1f1b'", "'+circular<V>'"):
        assert suffix in str(unknown.value), (suffix, str(unknown.value))
    for part in ("ep", "ring", "allgather", "ulysses", "gpipe", "1f1b", "circular<V>"):
        assert part in models.strategy_named.__doc__, part
    with pytest.raises(
        ValueError,
        match=r"strategy '2d' needs mesh axes \('data', 'model'\), but the mesh has \('data',\) \(missing \('model',\)\)",
    ):
        models.build("2d", mesh_for({"data": 8}), optimizer=sgd)
    # A width the model axis does not divide is stored padded (30 → 32 on 4), not refused.
    padded = models.build("tp", mesh_for({"model": 4}), optimizer=sgd, sizes=(784, 30, 10))
    assert padded.padding.stored[0] == {"w": (784, 32), "b": (32,)}
    assert padded.padding.logical[0] == {"w": (784, 30), "b": (30,)}
    with refused(TypeError, argument="strategy 'dp'", got="got NoneType",
                 expected="a jax.sharding.Mesh with axes ('data',)", fix="see shardops.make_mesh"):  # fmt: skip
        models.build("dp", None, optimizer=sgd)
    setup = models.build("dp", mesh_for({"data": 8}), optimizer=sgd)
    xs, ys = batches(models.SEED_SIZES, 12)
    with pytest.raises(
        ValueError, match=r"x dim 0 \(batch\) = 12 is not divisible by mesh axis 'data' \(size 8\)"
    ):
        setup.place_batch(xs[0], ys[0])
    state = setup.init(jax.random.key(0))
    with refused(ValueError, argument="x dim 0 (batch)", got="= 12",
                 expected="mesh axis 'data' (size 8)", fix="choose a multiple of 8"):  # fmt: skip
        setup.train_step(state, xs[0], ys[0])


def test_wrong_params_or_state_to_the_steps_are_clear_errors():
    """A TrainState where params go, params where a TrainState goes, the model's own unpadded
    params and another model's: each step names itself, the leaf, both shapes and the fix,
    before shard_map compares them with its specs (it would print both pytrees whole)."""
    setup = models.build(
        "tp", mesh_for({"model": 4}), optimizer=optax.sgd(1.0), sizes=(784, 30, 10)
    )
    full = models.init_mlp(jax.random.key(0), (784, 30, 10))
    state = setup.shard(full)
    batch = setup.place_batch(*(a[0] for a in batches((784, 30, 10), 8)))
    for what, call in {
        "setup.evaluate": setup.evaluate,
        "setup.loss_and_grads": setup.loss_and_grads,
    }.items():
        with refused(TypeError, argument=f"{what}: params", got="is a TrainState",
                     expected="(params and optimizer state)", fix="pass state.params"):  # fmt: skip
            call(state, *batch)
        with refused(ValueError, argument=f"{what}: params[0]['b']", got="has shape (30,), the model's own",
                     expected="stores it padded to (32,)", fix="Lay the params out with setup.shard(params).params"):  # fmt: skip
            call(full, *batch)
        with refused(ValueError, argument=f"{what}: params[0]['b']", got="has shape (20,)",
                     expected="this model's is (30,) (stored as (32,))",
                     fix="Pass the params of the model this was built for"):  # fmt: skip
            call(models.init_mlp(jax.random.key(0), (784, 20, 10)), *batch)
    with refused(TypeError, argument="setup.train_step: state", got="got list",
                 expected="a TrainState (params, opt_state)", fix="Start from setup.init(key)"):  # fmt: skip
        setup.train_step(state.params, *batch)
    with refused(ValueError, argument="setup.train_step: params[0]['b']", got="(30,)",
                 expected="padded to (32,)", fix="Lay the params out with setup.shard(params)"):  # fmt: skip
        setup.train_step(models.TrainState(full, state.opt_state), *batch)


DONATED_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np, optax, shardops, shardops_models as models
from shardops_models.training import _setup
if sys.argv[1] == "unchecked":
    _setup.check_not_donated = lambda *args, **kwargs: None
setup = models.build("dp", shardops.make_mesh({"data": 8}), optimizer=optax.sgd(1.0),
                     sizes=(16, 32, 8))
state = setup.init(jax.random.key(0))
batch = setup.place_batch(np.ones((8, 16), np.float32), np.eye(8, dtype=np.float32))
new, loss = setup.train_step(state, *batch)
try:
    setup.train_step(state, *batch)  # the old, donated state
except ValueError as e:
    print(e)
"""


def donated_state_run(mode: str) -> subprocess.CompletedProcess:
    """The script above in a process of its own: without the check it is XLA's to answer."""
    return subprocess.run([sys.executable, "-c", DONATED_SCRIPT, mode], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip


def test_a_donated_state_or_params_is_a_clear_error_not_a_crash():
    """train_step donates its state: stepping the old one again handed XLA:CPU freed buffers
    (the process died of a segmentation fault). Every step, and evaluate and logits on the
    params of a donated state, name the array and the fix first."""
    setup = models.build("dp", mesh_for({"data": 8}), optimizer=optax.sgd(1.0), sizes=SIZES)
    state = setup.init(jax.random.key(0))
    xs, ys = batches(SIZES, 8)
    batch = setup.place_batch(xs[0], ys[0])
    new, _ = setup.train_step(state, *batch)
    fix = ("Pass the state (or state.params) the latest train_step returned",
           "jax.tree.map(jnp.copy, state)")  # fmt: skip
    with refused(ValueError, argument="train_step: state.params[0]['b']",
                 got="has been deleted or donated", expected="the state it is given", fix=fix):  # fmt: skip
        setup.train_step(state, *batch)
    with refused(ValueError, argument="evaluate: params[0]['b']",
                 got="has been deleted or donated", expected="the state it is given", fix=fix):  # fmt: skip
        setup.evaluate(state.params, *batch)
    setup.evaluate(new.params, *batch)  # the state returned is the live one


def test_a_donated_state_unchecked_is_caught():
    """The check gone (in a process of its own): the same call ends the process, or at best
    is XLA's error, where the test asks for the step's."""
    checked = donated_state_run("checked")
    assert checked.returncode == 0 and "train_step: state.params[0]['b'] has been deleted" in (
        checked.stdout
    ), checked.stdout + checked.stderr
    unchecked = donated_state_run("unchecked")
    assert unchecked.returncode != 0 or "has been deleted or donated to an earlier call" not in (
        unchecked.stdout
    ), unchecked.stdout


@pytest.mark.parametrize("strategy", ["2d", "fsdp_tp"])
def test_explicit_meshes_work_too(strategy):
    mesh = shardops.make_mesh({"data": 4, "model": 2}, axis_types="explicit")
    setup = models.build(strategy, mesh, optimizer=optax.sgd(1.0), sizes=SIZES)
    state = setup.init(jax.random.key(0))
    xs, ys = batches(SIZES, 32)
    state, loss = setup.train_step(state, *setup.place_batch(xs[0], ys[0]))
    auto = models.build(
        strategy, mesh_for({"data": 4, "model": 2}), optimizer=optax.sgd(1.0), sizes=SIZES
    )
    auto_state, auto_loss = auto.train_step(
        auto.init(jax.random.key(0)), *auto.place_batch(xs[0], ys[0])
    )
    assert float(loss) == float(auto_loss)
    np.testing.assert_array_equal(
        setup.gather(state.params)[0]["w"], auto.gather(auto_state.params)[0]["w"]
    )
