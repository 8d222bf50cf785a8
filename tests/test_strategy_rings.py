"""Strategies with ``collective_matmul`` ("ring", "bidirectional"): the tensor-parallel dense
layers run their collectives as rings of ppermute steps. Loss and every gradient equal the
unsharded reference, and the compiled step asks for exactly the budget (``Recorder``), in
which the rings are collective-permutes of V(p−1)/p bytes."""

import jax
import numpy as np
import optax
import pytest
import shardops_models as models
from test_dense_route import check_equal

import shardops
from shardops import BFLOAT16, FLOAT32

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
    led = shardops.ledger(mesh, setup.train_step, state, *setup.place_batch(x, y))
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
