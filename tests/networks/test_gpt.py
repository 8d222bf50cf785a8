"""The GPT (``models.Gpt``) under every strategy on every mesh: 5 steps of SGD and of Adam equal
the plain-jnp reference, and the compiled collectives equal the budget traced from the step exactly."""

import jax
import numpy as np
import optax
import pytest
from _cover import FULL
from _gpt_checks import (
    BATCH,
    GPT,
    MESHES,
    OPTIMIZERS,
    SEQ,
    cases,
    check_gpt_trajectory,
    gpt_batches,
)
from _lm_budgets import EXPECTED

import shardops
import shardops_models as models

CASES = cases()


def case_id(case):
    return "-".join(case)


def test_every_strategy_has_a_case_on_every_mesh_with_its_axes():
    names = {s for s, _ in CASES}
    assert names == set(models.STRATEGIES) - {"ref"}
    assert ("2d", "4x2") in CASES and ("sp", "model8") in CASES and ("fsdp", "data8") in CASES


# By default every strategy trains with SGD, unclipped: its gradients, read back from each step,
# are held to the reference's, so a gradient scaled as a whole (a reduction summed twice) shows;
# a clipped or Adam run cannot see one. The cases are those of the hand-written budgets
# (tests/_lm_budgets.py), whose mesh and optimizer they take, and SGD on a mesh on which each
# of the strategy's axes has more than one device for the four whose budget is under Adam.
# Adam trains every strategy on the GPT or on the Llama (tests/networks/test_llama.py); the
# meshes are taken in turn, so that with the Llama's every mesh appears. Under SHARDOPS_FULL=1
# every strategy × mesh × optimizer.
def degenerate(strategy: str, mesh: str) -> bool:
    """Whether one of ``strategy``'s axes has a single device on ``mesh``."""
    return any(MESHES[mesh][axis] == 1 for axis in models.STRATEGIES[strategy].axes)


def next_mesh(strategy: str, used: list) -> str:
    """A mesh with ``strategy``'s axes, none of one device, the one least often in ``used``."""
    meshes = [m for t, m in CASES if t == strategy and not degenerate(t, m)]
    return min(meshes, key=lambda m: (used.count(m), m))


def _trajectories():
    if FULL:
        return [(s, m, o) for s, m in CASES for o in OPTIMIZERS]
    hand = sorted((s, m, o) for name, s, m, o, *_ in EXPECTED if name == GPT.name and "+" not in s)
    out, used = list(hand), [m for _, m, _ in hand]
    for s, _, o in hand:
        if o != "sgd":
            out.append((s, next_mesh(s, used), "sgd"))
            used.append(out[-1][1])
    return out


TRAJECTORIES = _trajectories()


@pytest.mark.parametrize("case", TRAJECTORIES, ids=case_id)
def test_trajectory_and_budget(case):
    check_gpt_trajectory(*case, budget=True)


def test_every_strategy_trains_with_sgd_and_every_hand_budget_is_a_case():
    strategies = {s for s, _ in CASES}
    assert {s for s, _, o in TRAJECTORIES if o == "sgd"} == strategies
    hand = {(s, m, o) for name, s, m, o, *_ in EXPECTED if name == GPT.name and "+" not in s}
    assert hand <= set(TRAJECTORIES)
    if FULL:
        assert {(s, o) for s, _, o in TRAJECTORIES} == {
            (s, o) for s in strategies for o in OPTIMIZERS
        }


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_tp", "fsdp_sp"])
def test_remat_trajectory_and_budget(strategy):
    """Remat re-gathers each unit's parameters (and reruns its forward collectives) in the
    backward pass: same numbers, and exactly the bytes the recorder predicts."""
    check_gpt_trajectory(strategy, "4x2", "sgd", remat=True, budget=True)


def test_ref_strategy_equals_the_plain_reference():
    """The ``ref`` strategy runs the model code through ``models.strategies.parallel`` with no mesh: its
    logits and loss equal the independent plain-jnp GPT."""
    setup = models.build("ref", optimizer=optax.sgd(0.1), model=GPT)
    params = GPT.init(jax.random.key(1))
    ids, labels = (a[0] for a in gpt_batches(1))
    np.testing.assert_allclose(
        np.asarray(setup.logits(params, ids)), GPT.reference_logits(params, ids), atol=2e-6
    )
    loss, _ = setup.loss_and_grads(params, ids, labels)
    np.testing.assert_allclose(
        float(loss), float(GPT.reference_loss(params, ids, labels)), rtol=1e-6
    )


@pytest.mark.parametrize("strategy", ["fsdp_tp", "fsdp_sp", "dp"])
def test_evaluate_and_logits_equal_the_reference_with_padding(strategy):
    """``evaluate`` sums loss and hits over labelled positions only (``PAD_LABEL`` counts
    nowhere), reduced over the mesh; ``logits`` returns the whole vocabulary."""
    setup = models.build(strategy, shardops.make_mesh({"data": 4, "model": 2}),
                         optimizer=optax.sgd(0.1), model=GPT)  # fmt: skip
    params = GPT.init(jax.random.key(2))
    ids, labels = (np.array(a[0]) for a in gpt_batches(2))
    labels[-4:, 5:] = models.networks.gpt.PAD_LABEL  # some padded positions
    real = labels != models.networks.gpt.PAD_LABEL
    logits = np.asarray(GPT.reference_logits(params, ids))  # [B, S, V]
    log_probs = jax.nn.log_softmax(logits)
    picked = np.take_along_axis(log_probs, np.where(real, labels, 0)[..., None], -1)[..., 0]
    state = setup.shard(params)
    metrics = setup.evaluate(state.params, *setup.place_batch(ids, labels))
    assert int(metrics.count) == real.sum()
    assert int(metrics.correct) == ((logits.argmax(-1) == labels) & real).sum()
    np.testing.assert_allclose(float(metrics.loss_sum), -picked[real].sum(), rtol=1e-5)
    got = np.asarray(setup.logits(state.params, setup.place_batch(ids)))
    assert got.shape == (BATCH, SEQ, GPT.vocab_size)
    np.testing.assert_allclose(got, logits, atol=2e-6)


def test_build_errors_name_the_leaf_the_axis_and_both_sizes():
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    odd = models.Gpt(vocab_size=66, d_model=32, num_heads=4, num_layers=1, context=16)
    padded = models.build("tp", mesh, optimizer=optax.sgd(0.1), model=odd)  # 66 stored as 68
    assert padded.padding.stored["embed"]["table"] == (68, 32)
    with pytest.raises(ValueError, match=r"build: num_heads=6 is not divisible by mesh axis "
                                         r"'model' \(size 4\)"):  # fmt: skip
        models.build("tp", mesh, optimizer=optax.sgd(0.1),
                     model=models.Gpt(d_model=48, num_heads=6, num_layers=1, context=16))  # fmt: skip
    with pytest.raises(ValueError, match="no sequence dimension"):
        models.build("sp", mesh, optimizer=optax.sgd(0.1))  # the MLP
    setup = models.build("sp", mesh, optimizer=optax.sgd(0.1), model=GPT)
    ids = np.zeros((4, 6), np.int32)  # S = 6 does not split over model = 4
    with pytest.raises(ValueError, match="sequence"):
        setup.place_batch(ids, ids)
    with pytest.raises(ValueError, match="labels must be integer tokens"):
        setup.place_batch(np.zeros((4, 8), np.int32), np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match="unknown role"):
        models.build("tp", mesh, optimizer=optax.sgd(0.1), model=GPT,
                     plan={**GPT.plan(), "head": "colum"})  # fmt: skip


def test_a_replicated_head_under_sequence_parallelism_is_a_clear_error():
    plan = {**GPT.plan(), "head": models.REPLICATED}
    setup = models.build("sp", shardops.make_mesh({"model": 8}), optimizer=optax.sgd(0.1),
                         model=GPT, plan=plan)  # fmt: skip
    ids, labels = (a[0] for a in gpt_batches())
    state = setup.init(jax.random.key(0))
    with pytest.raises(ValueError, match="give it the plan's role 'column'"):
        setup.train_step(state, *setup.place_batch(ids, labels))
    with pytest.raises(ValueError, match="give it the plan's role 'column'"):
        setup.collective_budget(BATCH, SEQ)


@pytest.mark.parametrize(
    ("field", "value", "where"), [("ids", 16, "[1, 2]"), ("ids", -1, "[1, 2]"), ("labels", 99, "[1, 2]"),
     ("labels", -2, "[1, 2]")]
)  # fmt: skip
def test_tokens_outside_the_vocabulary_are_refused_when_a_batch_is_placed(field, value, where):
    tiny = models.Gpt(vocab_size=16, d_model=16, num_heads=2, num_layers=1, context=8)
    setup = models.build(
        "tp", shardops.make_mesh({"model": 2}), model=tiny, optimizer=optax.sgd(0.1)
    )
    batch = {"ids": np.zeros((4, 8), np.int32), "labels": np.ones((4, 8), np.int32)}
    batch[field][1, 2] = value
    with pytest.raises(ValueError, match=rf"{field} hold 1 token\(s\) outside \[0, 16\) \(the "
                       rf"model's vocabulary\), e.g. {value} at {field}\{where[:-1]}\]"):  # fmt: skip
        setup.place_batch(batch["ids"], batch["labels"])
    batch[field][1, 2] = 15  # the last id is in range
    setup.place_batch(batch["ids"], batch["labels"])
