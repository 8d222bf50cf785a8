"""Layouts over named mesh axes (``models.strategies.layout``): HSDP, HSDP × TP and ZeRO-1 move
the bytes worked out by hand and hold the bytes they should per device (measured), their
mutants are caught, bad layouts and mesh specs are one-line errors, and the nine presets keep
their axes."""

import math
import sys

import jax
import numpy as np
import optax
import pytest
from _model_checks import batches, check_trajectory, mesh_for
from _mutants import mutant

import shardops
import shardops_models as models
from shardops_models.strategies import layout as layout_module
from shardops_models.strategies import zero1 as zero1_module
from shardops_models.training import _train
from shardops_models.training.meshes import mesh_for as run_mesh

AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"
SIZES = (16, 32, 8)  # w1[16, 32], b1[32], w2[32, 8], b2[8]: every dim divides by 4 and 8
PARAM_BYTES = (16 * 32 + 32 + 32 * 8 + 8) * 4  # 3,232
BATCH = 16
HSDP_MESH = {"replica": 2, "data": 4}


def build(strategy, shape, sizes=SIZES, **options):
    return models.build(strategy, mesh_for(shape), optimizer=optax.adam(1e-2), sizes=sizes,
                        **options)  # fmt: skip


def compiled(setup, batch=BATCH):
    state = setup.init(jax.random.key(0))
    xb, yb = setup.place_batch(*(a[0] for a in batches(setup.sizes, batch)))
    return shardops.inspect.ledger(setup.mesh, setup.train_step, state, xb, yb).by_pass()


# --- the bytes, worked out by hand


def hsdp_table():
    """hsdp on replica=2 × data=4, weights gathered (not moved): every leaf splits over data
    (4 divides each), so the forward gathers all 3,232 bytes over data and AllReduces the loss
    (one f32) over replica × data; the backward ReduceScatters the 3,232 bytes of gradient over
    data, then AllReduces each device's quarter, 808 bytes, over replica."""
    return {
        "forward": {(AG, ("data",)): PARAM_BYTES, (AR, ("replica", "data")): 4},
        "backward": {(RS, ("data",)): PARAM_BYTES, (AR, ("replica",)): PARAM_BYTES // 4},
        "optimizer": {},
    }


def zero1_table():
    """zero1 on data=8: the forward AllReduces the loss; nothing in the backward (each device
    keeps its partial gradients); the optimizer ReduceScatters the 3,232 bytes of gradient over
    data, updates its eighth, and AllGathers the 3,232 bytes of parameters back."""
    return {
        "forward": {(AR, ("data",)): 4},
        "backward": {},
        "optimizer": {(RS, ("data",)): PARAM_BYTES, (AG, ("data",)): PARAM_BYTES},
    }


def hsdp_tp_table():
    """hsdp_tp on replica=2 × data=2 × model=2: w1 column-parallel (w1[16, 32_model], b1[32_model]),
    w2 row-parallel (w2[32_model, 8], b2 replicated over model). Each device's model shard is
    2048/2 + 128/2 + 1024/2 = 1,600 bytes, plus b2's 32: 1,632 split over data, gathered in the
    forward and reduce-scattered in the backward, its halves (816) AllReduced over replica. The
    row layer AllReduces y[4, 8] (its 4 rows: 128 bytes) over model in the forward; x, the
    model's input, needs no gradient."""
    return {
        "forward": {(AG, ("data",)): 1632, (AR, ("model",)): 4 * 8 * 4,
                    (AR, ("replica", "data")): 4},
        "backward": {(RS, ("data",)): 1632, (AR, ("replica",)): 1632 // 2},
        "optimizer": {},
    }  # fmt: skip


CASES = {
    "hsdp": (HSDP_MESH, hsdp_table),
    "zero1": ({"data": 8}, zero1_table),
    "hsdp_tp": ({"replica": 2, "data": 2, "model": 2}, hsdp_tp_table),
}


@pytest.mark.parametrize("strategy", CASES)
def test_the_compiled_step_moves_the_bytes_worked_out_by_hand(strategy):
    shape, table = CASES[strategy]
    setup = build(strategy, shape, fsdp_dense="gather_weights")
    assert compiled(setup) == table()
    assert setup.budget(BATCH).by_pass() == table()


# --- what each device holds, measured on the placed arrays


def per_device_bytes(tree) -> int:
    """The bytes device 0 holds of ``tree``'s arrays."""
    device = jax.devices()[0]
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
               if s.device == device)  # fmt: skip


def test_zero1_holds_an_eighth_of_dps_optimizer_state_and_all_of_its_parameters():
    dp, zero1 = build("dp", {"data": 8}), build("zero1", {"data": 8})
    dp_state, zero1_state = dp.init(jax.random.key(0)), zero1.init(jax.random.key(0))
    adam = 2 * PARAM_BYTES  # mu and nu: param-shaped
    assert per_device_bytes(dp_state.opt_state) == adam + 4  # + the step count (int32)
    assert per_device_bytes(zero1_state.opt_state) == adam // 8 + 4
    assert per_device_bytes(zero1_state.params) == per_device_bytes(dp_state.params) == PARAM_BYTES


def test_hsdp_splits_parameters_over_data_only():
    hsdp, fsdp = build("hsdp", HSDP_MESH), build("fsdp", {"data": 8})
    assert per_device_bytes(hsdp.init(jax.random.key(0)).params) == PARAM_BYTES // 4
    assert per_device_bytes(fsdp.init(jax.random.key(0)).params) == PARAM_BYTES // 8


# --- mutants


MUTANTS = {
    # HSDP's gradient AllReduced over data (the whole tensor) and then sliced, instead of
    # ReduceScattered: the numbers stay right, the bytes do not.
    "gradient_all_reduced_over_data": (
        shardops.comm._mappings,
        "    mine = lax.psum_scatter(flat, axis_name, scatter_dimension=0)  # [Σ|x_i|]: this device's\n",
        "    mine = lax.psum(flat, axis_name)[lax.axis_index(axis_name)]\n",
        "hsdp",
    ),
    # The replica axis's reduction dropped: each replica group trains on its own half batch.
    "replica_reduction_dropped": (
        shardops.comm._mappings,
        "        mine = lax.psum(mine, replicated_over)\n",
        "        mine = mine\n",
        "hsdp",
    ),
    # HSDP's parameters split over replica too: FSDP over both axes (the numbers are right,
    # the layout and the bytes are FSDP's).
    "parameters_sharded_over_replica": (
        layout_module,
        '        Strategy("hsdp", dp=REPLICA_AXIS, fsdp=DATA_AXIS),\n',
        '        Strategy("hsdp", fsdp=(REPLICA_AXIS, DATA_AXIS)),\n',
        "hsdp",
    ),
    # ZeRO-1 updating from each device's unreduced gradients.
    "zero1_unreduced_gradients": (
        zero1_module,
        "            return comm.reduce_scatter(g, axes, scatter_dimension=d, reason=UPDATE)\n",
        "            return lax.dynamic_slice_in_dim(g, lax.axis_index(axes) * (g.shape[d] // n), g.shape[d] // n, d)\n",
        "zero1",
    ),
}


def check_layout(strategy: str) -> None:
    """The hand-worked bytes and 5 Adam steps against the unsharded MLP."""
    shape, table = CASES[strategy]
    setup = build(strategy, shape, fsdp_dense="gather_weights")
    assert compiled(setup) == table()
    check_trajectory(strategy, shape, "adam", sizes=SIZES, batch=BATCH)


def swap(monkeypatch, name: str, replace: bool) -> None:
    module, line, new, _ = MUTANTS[name]
    bad = mutant(module, name, line, new if replace else line)
    if module is layout_module:
        for target in (sys.modules["shardops_models.strategies.parallel"], _train, models):
            monkeypatch.setattr(target, "STRATEGIES", bad.STRATEGIES, raising=False)
        monkeypatch.setattr(layout_module, "STRATEGIES", bad.STRATEGIES)
    elif module is zero1_module:
        monkeypatch.setattr(zero1_module.Zero1, "update", bad.Zero1.update)
    else:
        for name_ in ("gather_to_region", "gather_many_to_region"):
            monkeypatch.setattr(shardops.comm, name_, getattr(bad, name_))
    jax.clear_caches()


@pytest.mark.parametrize("name", MUTANTS)
def test_unmutated_copy_passes(monkeypatch, name):
    swap(monkeypatch, name, replace=False)
    check_layout(MUTANTS[name][3])


@pytest.mark.parametrize("name", MUTANTS)
def test_layout_mutant_is_caught(monkeypatch, name):
    swap(monkeypatch, name, replace=True)
    with pytest.raises((AssertionError, ValueError)) as caught:
        check_layout(MUTANTS[name][3])
    if isinstance(caught.value, ValueError):  # only check_vma's type verdict counts
        assert "same type" in str(caught.value) or "vma" in str(caught.value), caught.value


# --- layouts and mesh specs that cannot work: one line each


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dp="data", fsdp="data"), "mesh axis 'data' carries both dp and fsdp"),
        (dict(sp=True), "sp splits activations over the tp axis; name it"),
        (dict(zero1="data", fsdp="replica"), "zero1 keeps parameters replicated"),
        (dict(tp=("model", "data")), "tp takes one mesh axis name"),
        (dict(dp=3), "dp takes a mesh axis name or a tuple of them"),
    ],
)
def test_a_layout_that_cannot_work_is_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        models.Strategy("bad", **kwargs)


def test_the_nine_presets_keep_their_axes_and_the_new_ones_add_replica():
    rules = {name: s.rules for name, s in models.STRATEGIES.items()}
    assert rules == {
        "ref": {}, "dp": {"dp": ("data",)}, "fsdp": {"fsdp": ("data",)}, "tp": {"tp": ("model",)},
        "sp": {"sp": ("model",)}, "2d": {"dp": ("data",), "tp": ("model",)},
        "fsdp_tp": {"fsdp": ("data",), "tp": ("model",)},
        "dp_sp": {"dp": ("data",), "sp": ("model",)}, "fsdp_sp": {"fsdp": ("data",), "sp": ("model",)},
        "hsdp": {"dp": ("replica",), "fsdp": ("data",)},
        "hsdp_tp": {"dp": ("replica",), "fsdp": ("data",), "tp": ("model",)},
        "hsdp_sp": {"dp": ("replica",), "fsdp": ("data",), "sp": ("model",)},
        "zero1": {"zero1": ("data",)}, "zero1_tp": {"zero1": ("data",), "tp": ("model",)},
    }  # fmt: skip
    assert models.STRATEGIES["hsdp_tp"].batch_axes == ("replica", "data")
    table = models.STRATEGIES["hsdp_tp"].table().splitlines()
    assert table[0] == "hsdp_tp:" and [row.split()[:2] for row in table[1:]] == [
        ["dp", "replica"], ["fsdp", "data"], ["tp", "model"]]  # fmt: skip


def test_a_layout_of_your_own_builds_on_any_axis_names():
    mine = models.Strategy("mine", dp="pod", fsdp="host", tp="chip")
    mesh = shardops.make_mesh({"pod": 2, "host": 2, "chip": 2})
    setup = models.build(mine, mesh, optimizer=optax.sgd(0.1), sizes=SIZES,
                         fsdp_dense="gather_weights")  # fmt: skip
    assert setup.batch_spec == jax.sharding.PartitionSpec(("pod", "host"))
    budget = setup.budget(BATCH).totals()
    # the fsdp rule splits every leaf over host (2 divides each): gathered and reduce-scattered
    # over host, each shard AllReduced over pod, the row layer's AllReduce over chip, the loss
    # over pod × host; nothing else
    assert set(budget) == {(AG, ("host",)), (RS, ("host",)), (AR, ("pod",)), (AR, ("chip",)),
                           (AR, ("pod", "host"))}  # fmt: skip


GPT = models.Gpt(vocab_size=16, d_model=16, num_heads=4, num_layers=1, context=8, d_ff=32)


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        (models.Strategy("mine", dp="pod", fsdp="host", tp="chip"), {"pod": 2, "host": 2, "chip": 2}),
        # the axis named "model" carries the batch, "data" the tensor parallelism
        (models.Strategy("swapped", dp="model", tp="data"), {"data": 2, "model": 4}),
    ],
    ids=["own-names", "swapped-names"],
)  # fmt: skip
def test_a_gpt_on_axes_of_its_own_names_equals_the_reference(layout, shape):
    """Every kernel of the GPT (the vocab-parallel loss and arg-max included) on the layout's
    own axes: the loss, every gradient and the metrics equal the unsharded model's."""
    setup = models.build(layout, shardops.make_mesh(shape), model=GPT, optimizer=optax.sgd(0.1))
    ref = models.build("ref", model=GPT, optimizer=optax.sgd(0.1))
    params = GPT.init(jax.random.key(1))
    ids = (
        np.random.default_rng(0).integers(0, GPT.vocab_size, (8, GPT.context + 1)).astype(np.int32)
    )
    x, y = ids[:, :-1], ids[:, 1:]
    loss, grads = setup.loss_and_grads(setup.shard(params).params, *setup.place_batch(x, y))
    ref_loss, ref_grads = ref.loss_and_grads(ref.shard(params).params, *ref.place_batch(x, y))
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-6)
    for a, b in zip(jax.tree.leaves(setup.gather(grads)), jax.tree.leaves(ref.gather(ref_grads)),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    got = setup.evaluate(setup.shard(params).params, *setup.place_batch(x, y))
    want = ref.evaluate(ref.shard(params).params, *ref.place_batch(x, y))
    assert int(got.correct) == int(want.correct) and int(got.count) == int(want.count) == x.size
    np.testing.assert_allclose(got.loss_sum, want.loss_sum, rtol=2e-6)


@pytest.mark.parametrize(
    ("strategy", "spec", "message"),
    [
        (
            "hsdp_tp",
            "4x2",
            r"strategy 'hsdp_tp' needs mesh axes \('replica', 'data', 'model'\) "
            r"\(missing \('replica',\)\); e.g. replica=N,data=N,model=N",
        ),
        ("2d", "2x2x2", "more than two axes need their names"),
        ("2d", "data=4,model=0", "expected NAME=SIZE"),
        ("2d", "data=4,model=4", "needs 16 devices; this process has 8"),
    ],
)
def test_a_mesh_spec_that_does_not_fit_is_one_line(strategy, spec, message):
    with pytest.raises(ValueError, match=message) as caught:
        run_mesh(strategy, spec)
    assert "\n" not in str(caught.value)


def test_mesh_specs_parse_and_format_back():
    assert shardops.parse_mesh("4x2") == {"data": 4, "model": 2}
    for spec in ("4x2", "1x8", "replica=2,data=2,model=2", "model=2,data=4", "Pod=2,chip=4"):
        assert shardops.format_mesh(shardops.parse_mesh(spec)) == spec  # the order kept too
    assert shardops.parse_mesh("replica=2,data=2,model=2") == {"replica": 2, "data": 2, "model": 2}
    assert run_mesh("ref", "4x2") is None
    assert dict(run_mesh("hsdp_tp", "replica=2,data=2,model=2").shape) == {
        "replica": 2, "data": 2, "model": 2}  # fmt: skip
    assert math.prod(run_mesh("dp", "data=8").shape.values()) == 8
    np.testing.assert_array_equal(np.ravel(run_mesh("2d", "4x2").devices), jax.devices()[:8])
