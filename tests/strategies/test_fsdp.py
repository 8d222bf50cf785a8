"""FSDP's per-layer choice (``models/strategies/fsdp.py``): gather the weight, or move the
activations. Both routes equal the unsharded reference (loss and every gradient) on every
fsdp strategy, K-split and F-split weights, rank-2 and rank-3 inputs, under all three
precision policies; the rule picks what its byte counts say; mutants are caught."""

import functools

import jax
import numpy as np
import optax
import pytest
from _model_checks import reductions_in_16_bits
from _mutants import mutant

import shardops
import shardops_models as models
from shardops import BFLOAT16, FLOAT32, MIXED_BFLOAT16
from shardops.layers import _fsdp_dense
from shardops_models.strategies import fsdp

ROUTES = ("gather_weights", "move_activations")
# (strategy, mesh, sizes, batch): w split over data along K (dim 0) everywhere but the last
# case, whose row layer's model shard w2[32/4, 24] is split along its 24 outputs (F).
MLP_CASES = [
    ("fsdp", {"data": 8}, (784, 64, 10), 64),
    ("fsdp", {"data": 4, "model": 2}, (48, 64, 24, 8), 32),
    ("fsdp_tp", {"data": 4, "model": 2}, (784, 64, 10), 64),
    ("fsdp_tp", {"data": 2, "model": 4}, (16, 32, 24, 8), 32),
]
TINY_GPT = models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=2, context=16)


def _case_id(case):
    strategy, mesh, sizes, _ = case
    return f"{strategy}-{'x'.join(map(str, mesh.values()))}-{'-'.join(map(str, sizes))}"


def mlp_batch(sizes, batch, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, sizes[0])).astype(np.float32)
    y = np.eye(sizes[-1], dtype=np.float32)[rng.integers(0, sizes[-1], batch)]
    return x, y


def loss_and_grads(strategy, mesh_shape, model, batch, precision, route, module=None):
    """``(loss, grads)`` of the sharded step (gathered) and of the reference, same params."""
    opt = optax.sgd(1.0)
    mesh = shardops.make_mesh(mesh_shape)
    setup = models.build(strategy, mesh, optimizer=opt, model=model, precision=precision,
                         fsdp_dense=route)  # fmt: skip
    ref = models.build("ref", optimizer=opt, model=model, precision=precision)
    params = ref.init(jax.random.key(1)).params
    x, y = batch
    expected = ref.loss_and_grads(params, x, y)
    got = setup.loss_and_grads(setup.shard(params).params, *setup.place_batch(x, y))
    return jax.tree.map(np.asarray, expected), jax.tree.map(np.asarray, models.gather_tree(got))


TOLERANCE = {FLOAT32: 1e-5, MIXED_BFLOAT16: 2e-2, BFLOAT16: 2e-2}


def check_equal(expected, got, precision):
    """Every leaf within ``TOLERANCE`` of its largest value (bf16: a few units in the last
    place, from float32 sums in another order rounded once to bf16)."""
    for path, e in jax.tree_util.tree_leaves_with_path(expected):
        g = _at(got, path)
        assert g.dtype == e.dtype, f"{jax.tree_util.keystr(path)}: dtype {g.dtype} ≠ {e.dtype}"
        e32, g32 = e.astype(np.float32), g.astype(np.float32)
        scale = max(float(np.max(np.abs(e32))), 1e-30)
        err = float(np.max(np.abs(e32 - g32))) / scale
        assert err <= TOLERANCE[precision], f"{jax.tree_util.keystr(path)}: {err:.2e}"


def _at(tree, path):
    for key in path:
        tree = tree[getattr(key, "key", getattr(key, "idx", None))]
    return tree


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", MLP_CASES, ids=_case_id)
def test_both_routes_equal_the_reference(case, route):
    strategy, mesh_shape, sizes, batch = case
    expected, got = loss_and_grads(strategy, mesh_shape, models.Mlp(sizes), mlp_batch(sizes, batch),
                                   FLOAT32, route)  # fmt: skip
    check_equal(expected, got, FLOAT32)


@pytest.mark.parametrize("precision", [MIXED_BFLOAT16, BFLOAT16], ids=lambda p: p.name)
@pytest.mark.parametrize("case", [MLP_CASES[0], MLP_CASES[3]], ids=_case_id)
def test_moving_activations_keeps_the_policy(case, precision):
    """Same dtypes as the reference for every gradient, values within bf16 reordering."""
    strategy, mesh_shape, sizes, batch = case
    expected, got = loss_and_grads(strategy, mesh_shape, models.Mlp(sizes),
                                   mlp_batch(sizes, batch), precision, "move_activations")  # fmt: skip
    check_equal(expected, got, precision)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_tp"])
def test_gpt_moving_activations_equals_the_reference(strategy):
    """Rank-3 inputs x[B, S, D]: the AllToAll splits D and joins B; attention and embedding
    parameters are still gathered."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY_GPT.vocab_size, (8, TINY_GPT.context)).astype(np.int32)
    mesh = {"data": 8} if strategy == "fsdp" else {"data": 2, "model": 4}
    expected, got = loss_and_grads(strategy, mesh, TINY_GPT, (ids, np.roll(ids, -1, 1)), FLOAT32,
                                   "move_activations")  # fmt: skip
    check_equal(expected, got, FLOAT32)


def test_the_rule_by_hand():
    """The benchmark's wide MLP (784-2048-2048-10, batch 1024 over 8): the 2048×2048 layer
    moves activations (2·128·2048·4 + 2·1024·2048·4 = 18,874,368 < 2048²·8 = 33,554,432); the
    first and last layers gather their weights. The GPT's layers (2048 tokens) gather."""
    rule = functools.partial(fsdp.moves_activations, "auto", n=8, precision=FLOAT32)
    assert rule(w_shape=(2048, 2048), split_dim=0, x_shape=(128, 2048))
    assert not rule(w_shape=(784, 2048), split_dim=0, x_shape=(128, 784))
    assert not rule(w_shape=(2048, 10), split_dim=0, x_shape=(128, 2048))
    assert not rule(w_shape=(128, 512), split_dim=0, x_shape=(2, 128, 128))
    cost = fsdp.route_bytes((2048, 2048), 0, (128, 2048), 8, FLOAT32)
    assert cost == {"gather_weights": 33_554_432 * 7 / 8, "move_activations": 18_874_368 * 7 / 8}
    # F split: w[K, F_data]: |x_full|·(c + 4) + 2·|y_block|·4, here 1024·256·8 + 2·128·512·4.
    cost = fsdp.route_bytes((256, 512), 1, (128, 256), 8, BFLOAT16)
    assert cost["move_activations"] == (1024 * 256 * 6 + 2 * 128 * 512 * 4) * 7 / 8
    assert cost["gather_weights"] == 256 * 512 * (2 + 4) * 7 / 8
    # forced routes and the cases without a choice
    assert fsdp.moves_activations("move_activations", (8, 8), 0, (1024, 8), 8, FLOAT32)
    assert not fsdp.moves_activations("gather_weights", (2048, 2048), 0, (1, 2048), 8,
                                              FLOAT32)  # fmt: skip
    assert not fsdp.moves_activations("auto", (2048, 2048), 0, (1, 2048), 1, FLOAT32)
    assert not fsdp.moves_activations("auto", (2048, 2048), None, (1, 2048), 8, FLOAT32)


def test_a_bad_route_is_an_error():
    with pytest.raises(ValueError, match=r"fsdp_dense must be one of .*'auto'.*got 'weights'"):
        models.build("fsdp", shardops.make_mesh({"data": 8}), optimizer=optax.sgd(1.0),
                     fsdp_dense="weights")  # fmt: skip


# --- mutants: each must fail the reference comparison or the dtype of its collectives


def check_collectives_follow_the_policy(strategy, mesh_shape, sizes, batch, precision):
    """What the step asks for (the lowered module) reduces in float32 and equals its budget."""
    mesh = shardops.make_mesh(mesh_shape)
    setup = models.build(strategy, mesh, optimizer=optax.sgd(1.0), sizes=sizes,
                         precision=precision, fsdp_dense="move_activations")  # fmt: skip
    state = setup.init(jax.random.key(0))
    led = shardops.inspect.ledger(
        mesh, setup.train_step, state, *setup.place_batch(*mlp_batch(sizes, batch))
    )
    low = reductions_in_16_bits(led.requested)
    assert not low, f"the program asks for reductions in 16 bits: {low}"
    assert led.totals(requested=True) == setup.collective_budget(batch)


@pytest.mark.parametrize("precision", [FLOAT32, BFLOAT16], ids=lambda p: p.name)
def test_collectives_follow_the_policy(precision):
    check_collectives_follow_the_policy(*MLP_CASES[0], precision)


MUTANTS = {
    # No reduction over data: each device keeps its own rows of its partial sums.
    "output_not_reduced": (
        "        y = reduce_scatter(y, data, scatter_dimension=0, reason=_PARTIAL_ROWS)  # y[B_data, .., F']\n",
        "        y = jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index(data) * (y.shape[0] // jax.lax.axis_size(data)), y.shape[0] // jax.lax.axis_size(data), 0)\n",
        MLP_CASES[0],
        FLOAT32,
    ),
    # The bias added to the partial sums, before the ReduceScatter: N + 1 times in all.
    "bias_before_reduction": (
        "        y = precision.matmul(x, w)  # y[B, ..., F']{U_data} in accum\n",
        "        y = precision.matmul(x, w) + b.astype(accum)\n",
        MLP_CASES[2],
        FLOAT32,
    ),
    # The row layer's model reduction forgotten on the F-split path: check_vma refuses the
    # program (the loss would vary over model), before anything runs.
    "row_not_reduced": (
        "            y = all_reduce(y, model, reason=_ROW_SUMS)  # y[B, ..., F_data]\n",
        "            y = y\n",
        MLP_CASES[3],
        FLOAT32,
    ),
    # The output cast to bf16 before the ReduceScatter: bf16 partial sums.
    "reduced_in_compute_dtype": (
        "        y = precision.matmul(x, w)  # y[B, ..., F']{U_data} in accum\n",
        "        y = precision.matmul(x, w).astype(precision.compute_dtype)\n",
        MLP_CASES[0],
        BFLOAT16,
    ),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(monkeypatch, name):
    old, new, case, precision = MUTANTS[name]
    bad = mutant(_fsdp_dense, name, old, new)
    monkeypatch.setattr(fsdp, "dense_moving_activations", bad.dense_moving_activations)
    strategy, mesh_shape, sizes, batch = case
    jax.clear_caches()
    with pytest.raises(ValueError if name == "row_not_reduced" else AssertionError):
        if precision == FLOAT32:
            expected, got = loss_and_grads(strategy, mesh_shape, models.Mlp(sizes),
                                           mlp_batch(sizes, batch), precision,
                                           "move_activations")  # fmt: skip
            check_equal(expected, got, precision)
        else:
            check_collectives_follow_the_policy(strategy, mesh_shape, sizes, batch, precision)
