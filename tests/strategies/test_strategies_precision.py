"""The precision policy through the strategies: the train step's dtype flow under every policy,
the bytes each collective is asked to move (the MLP, and the GPT under every strategy), and
5-step trajectories under the bf16 policies."""

import jax
import numpy as np
import optax
import pytest
from _model_checks import (
    BF16_BUDGET_MESHES,
    batches,
    check_bf16_budget,
    check_dtype_flow,
    check_trajectory,
    mesh_for,
)

import shardops
import shardops_models as models
from shardops.testing import dtype_flow

POLICIES = [shardops.FLOAT32, shardops.MIXED_BFLOAT16, shardops.BFLOAT16]
SIZES = (48, 64, 24, 10)
CASES = [
    ("ref", None, False),
    ("dp", {"data": 8}, False),
    ("tp", {"model": 8}, False),
    ("2d", {"data": 4, "model": 2}, False),
    ("2d", {"data": 2, "model": 4}, False),
    ("fsdp", {"data": 8}, False),
    ("fsdp", {"data": 4}, True),
    ("fsdp_tp", {"data": 4, "model": 2}, False),
    ("fsdp_tp", {"data": 2, "model": 4}, True),
]
COLLECTIVE_SUMS = {"psum", "psum_invariant", "psum2", "reduce_scatter", "psum_scatter"}


def _id(case):
    strategy, mesh, remat = case
    return f"{strategy}-{'x'.join(map(str, mesh.values())) if mesh else 'none'}" + (
        "-remat" if remat else ""
    )


def placed_step_args(setup, batch=32):
    state = setup.init(jax.random.key(0))
    xs, ys = batches(setup.sizes, batch)
    return state, *setup.place_batch(xs[0], ys[0])


@pytest.mark.parametrize("precision", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_train_step_follows_the_dtype_flow_of_its_policy(case, precision):
    """Every matmul (forward and backward) in compute dtype into float32, float32 matmuls at
    full precision, and every reduction, autodiff's gradient reductions over data and model
    included, in float32."""
    strategy, mesh_shape, remat = case
    setup, args = check_dtype_flow(strategy, mesh_shape, precision, sizes=SIZES, remat=remat)
    flow = dtype_flow(setup.step, *args)
    # 3 layers: 3 forward matmuls, 3 dx and 3 dw (the custom VJP forms the first layer's dx
    # too; XLA drops it as dead code). remat's recomputation is added when the step compiles.
    assert sum(name == "dot_general" for name, *_ in flow) == 9
    collective_sums = [name for name, *_ in flow if name in COLLECTIVE_SUMS]
    assert bool(collective_sums) == (strategy != "ref"), collective_sums
    state = args[0]
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {precision.param_dtype}


@pytest.mark.parametrize("precision", POLICIES[1:], ids=lambda p: p.name)
@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "ref"], ids=_id)
def test_collectives_ask_for_the_budgeted_bytes(case, precision):
    """What the program asks for (the lowered module, before XLA:CPU promotes a bf16 all-reduce
    to f32) equals the budget: reductions in float32, FSDP gathers in the param dtype."""
    strategy, mesh_shape, remat = case
    mesh = mesh_for(mesh_shape)
    setup = models.build(strategy, mesh, optimizer=optax.sgd(1.0), sizes=models.SEED_SIZES,
                         remat=remat, precision=precision)  # fmt: skip
    ledger = shardops.inspect.ledger(mesh, setup.train_step, *placed_step_args(setup, 64))
    budget = setup.collective_budget(64)
    assert ledger.totals(requested=True) == budget
    moved = ledger.totals()
    if precision == shardops.BFLOAT16 and ("all-gather", ("data",)) in budget:
        # XLA:CPU hoists the convert to f32 above the all-gather of bf16 params (2× the bytes);
        # the ledger reports it as promoted, and everything else moves as asked.
        # Activation gathers (models/strategies/fsdp.py) are float32 already: only bf16 doubles.
        key = ("all-gather", ("data",))
        bf16 = sum(c.bytes for c in ledger.requested
                   if c.kind == "all-gather" and c.shapes[0][0] == "bf16")  # fmt: skip
        assert bf16 and moved.pop(key) == budget.pop(key) + bf16
        assert "all-gather" in ledger.promoted()
    if ("all-to-all", ("data",)) in budget:
        # A layer that moves activations (models/strategies/fsdp.py) sends its bf16 input by
        # AllToAll as asked; XLA:CPU runs the bf16 all-to-all in f32 (2× the bytes).
        key = ("all-to-all", ("data",))
        assert moved.pop(key) == 2 * budget.pop(key)
        assert "all-to-all" in ledger.promoted()
    assert moved == budget


@pytest.mark.parametrize("precision", POLICIES[1:], ids=lambda p: p.name)
@pytest.mark.parametrize("strategy", sorted(BF16_BUDGET_MESHES))
def test_every_strategy_asks_the_gpt_for_its_bf16_budget(strategy, precision):
    """Every strategy, the sequence-parallel ones included, on the GPT (embedding, attention,
    norms, MLP, head): the requested bytes per kind and axis equal the budget."""
    check_bf16_budget(strategy, precision)


def test_bf16_params_halve_the_fsdp_gather_and_keep_f32_reductions():
    """Literal bytes: fsdp on data=8 under BFLOAT16 gathers w1, b1, w2 in bf16 (2 bytes each) and
    reduce-scatters their f32 gradients (4 bytes); b2[10] and the loss are all-reduced in f32."""
    mesh = mesh_for({"data": 8})
    setup = models.build("fsdp", mesh, optimizer=optax.sgd(1.0), precision=shardops.BFLOAT16,
                         fsdp_dense="gather_weights")  # fmt: skip
    ledger = shardops.inspect.ledger(mesh, setup.train_step, *placed_step_args(setup, 64))
    split = 784 * 512 + 512 + 512 * 10
    assert ledger.totals(requested=True) == {
        ("all-gather", ("data",)): split * 2,
        ("reduce-scatter", ("data",)): split * 4,
        ("all-reduce", ("data",)): (10 + 1) * 4,
    }


@pytest.mark.parametrize("precision", POLICIES[1:], ids=lambda p: p.name)
@pytest.mark.parametrize(
    ("strategy", "mesh_shape"),
    [("dp", {"data": 8}), ("tp", {"model": 8}), ("2d", {"data": 4, "model": 2}),
     ("fsdp", {"data": 8}), ("fsdp_tp", {"data": 2, "model": 4})],
    ids=str,
)  # fmt: skip
def test_five_steps_equal_the_reference_under_bf16_policies(strategy, mesh_shape, precision):
    check_trajectory(strategy, mesh_shape, "sgd", sizes=SIZES, batch=32, precision=precision)


def test_params_in_another_dtype_than_the_policy_are_an_error():
    setup = models.build("dp", mesh_for({"data": 8}), optimizer=optax.sgd(1.0),
                         precision=shardops.BFLOAT16)  # fmt: skip
    f32 = models.init_mlp(jax.random.key(0))
    with pytest.raises(TypeError, match=r"params\[0\]\['b'\] has dtype float32 but precision "
                       r"policy BFLOAT16 stores parameters in bfloat16"):  # fmt: skip
        setup.shard(f32)
    with pytest.raises(TypeError, match="precision must be a shardops.Precision"):
        models.build("dp", mesh_for({"data": 8}), optimizer=optax.sgd(1.0), precision="bf16")
    np.testing.assert_array_equal(
        np.asarray(setup.gather(setup.init(jax.random.key(0)).params)[0]["w"], np.float32),
        np.asarray(f32[0]["w"].astype(np.dtype("bfloat16")), np.float32),
    )
