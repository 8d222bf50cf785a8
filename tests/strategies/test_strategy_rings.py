"""Strategies with ``collective_matmul`` ("ring", "bidirectional"): the tensor-parallel dense
layers run their collectives as rings of ppermute steps. Loss and every gradient equal the
unsharded reference, and the compiled step asks for exactly the budget (``Setup.budget``), in
which the rings are collective-permutes of V(p−1)/p bytes, going one way round the ``model``
ring or (``"bidirectional"``) as many steps each way."""

import jax
import numpy as np
import optax
import pytest
from _mutants import mutant
from _permutes import check_ring_directions, permute_shifts
from test_collective_matmul import LEFT_SCATTER
from test_fsdp import check_equal

import shardops
import shardops_models as models
from shardops import BFLOAT16, FLOAT32
from shardops import inspect as hlo
from shardops.comm import _collective_matmul
from shardops.layers import _collective_dense

TINY_GPT = models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=2, context=16)
MLP = models.Mlp((784, 64, 10))
CASES = [
    ("tp", {"model": 8}, MLP, "ring", FLOAT32, False),
    ("fsdp_tp", {"data": 4, "model": 2}, MLP, "bidirectional", FLOAT32, False),
    ("sp", {"model": 4}, TINY_GPT, "ring", FLOAT32, False),
    ("tp", {"model": 4}, TINY_GPT, "bidirectional", FLOAT32, False),
    ("fsdp_sp", {"data": 2, "model": 4}, TINY_GPT, "bidirectional", FLOAT32, True),
    ("dp_sp", {"data": 2, "model": 4}, TINY_GPT, "ring", BFLOAT16, False),
]


def batch_for(model, rows):
    rng = np.random.default_rng(0)
    if getattr(model, "sequence", False):
        ids = rng.integers(0, model.vocab_size, (rows, model.context)).astype(np.int32)
        return ids, np.roll(ids, -1, 1)
    x = rng.normal(size=(rows, model.sizes[0])).astype(np.float32)
    return x, np.eye(model.sizes[-1], dtype=np.float32)[rng.integers(0, model.sizes[-1], rows)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[3]}-{c[4].name}{'-remat' * c[5]}")
def test_rings_equal_the_reference_and_the_budget(case):
    strategy, mesh_shape, model, ring, precision, remat = case
    mesh = shardops.make_mesh(mesh_shape)
    opt = optax.sgd(1.0)
    setup = models.build(strategy, mesh, optimizer=opt, model=model, precision=precision,
                         remat=remat, collective_matmul=ring)  # fmt: skip
    ref = models.build("ref", optimizer=opt, model=model, precision=precision)
    params = ref.init(jax.random.key(1)).params
    rows = 64 if model is MLP else 8
    x, y = batch_for(model, rows)
    expected = jax.tree.map(np.asarray, ref.loss_and_grads(params, x, y))
    state = setup.shard(params)
    got = setup.loss_and_grads(state.params, *setup.place_batch(x, y))
    check_equal(expected, jax.tree.map(np.asarray, models.gather_tree(got)), precision)
    led = shardops.inspect.ledger(mesh, setup.train_step, state, *setup.place_batch(x, y))
    if mesh.shape["model"] > 2:  # on a ring of two, i → i + 1 and i → i − 1 are one step
        check_directions(setup, state, x, y, ring)
    budget = setup.collective_budget(rows)
    assert led.totals(requested=True) == budget
    assert budget[("collective-permute", ("model",))] > 0
    plain = models.build(strategy, mesh, optimizer=opt, model=model, precision=precision,
                         remat=remat)  # fmt: skip
    assert ("collective-permute", ("model",)) not in plain.collective_budget(rows)
    # A ring sends what the builtin it replaces sends, V(p−1)/p per gather or scatter (a row
    # psum: a ring reduce-scatter and a builtin gather, 2V(p−1)/p): per axis, the same bytes.
    ring_bytes, plain_bytes = setup.cost_model(rows), plain.cost_model(rows)
    assert ring_bytes.keys() == plain_bytes.keys()
    for axes, sent in plain_bytes.items():
        assert ring_bytes[axes] == pytest.approx(sent, rel=1e-12), axes


def check_directions(setup, state, x, y, ring) -> None:
    """The compiled train step's permutes over ``model`` go i → i + 1 only (``"ring"``: the
    custom VJPs' backward rings too), or as often each way (``"bidirectional"``)."""
    text = setup.train_step.lower(state, *setup.place_batch(x, y)).compile().as_text()
    shifts = permute_shifts(text, setup.mesh, "model")
    check_ring_directions(shifts, ring == "bidirectional", f"{setup.strategy.name} {ring}")


@pytest.fixture
def clear():
    """No trace made with a mutant outlives its test."""
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_a_one_way_bidirectional_ring_is_caught_in_the_train_step(monkeypatch, clear):
    """The strategies' ``collective_matmul="bidirectional"`` with the row layers' second halves
    sent the same way as the first (``test_collective_matmul``'s mutant, under the dense
    kernels), tp on model=8: the budget is unchanged, the compiled step's directions not."""
    mesh = shardops.make_mesh({"model": 8})
    bad = mutant(_collective_matmul, "one_way", LEFT_SCATTER,
                 LEFT_SCATTER.replace("ring(h, h, -1)", "ring(h, h, +1)"))  # fmt: skip
    monkeypatch.setattr(_collective_dense, "_collective_matmul", bad)
    setup = models.build("tp", mesh, optimizer=optax.sgd(1.0), model=MLP,
                         collective_matmul="bidirectional")  # fmt: skip
    x, y = batch_for(MLP, 64)
    state = jax.eval_shape(setup.init, jax.random.key(1))  # compiled, never run
    lowered = setup.train_step.lower(state, *setup.place_batch(x, y))
    requested = {}
    for c in hlo.lowered_collectives(lowered.as_text(), mesh):
        if c.bytes:
            requested[(c.kind, c.axes)] = requested.get((c.kind, c.axes), 0) + c.bytes
    assert requested == setup.collective_budget(64)  # the budget cannot tell
    with pytest.raises(AssertionError, match="as many blocks each way"):
        check_directions(setup, state, x, y, "bidirectional")
