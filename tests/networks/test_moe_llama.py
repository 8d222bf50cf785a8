"""The Mixtral-style Llama (``models.Llama(experts=Experts(...))``: a mixture of SwiGLU experts in
each block) trains like its plain-jnp reference under the strategies with and without expert
parallelism (ep composed with HSDP and ZeRO-1 too): 5 steps of SGD and Adam, losses (the
load-balancing and z losses included), gradients and parameters. The reference runs every expert on every token and keeps each token's
choices that fit its expert's capacity (``Llama._reference``), an implementation of the routing
rule independent of the kernel's dispatch. The dropless model (``capacity_factor=None``) trains
like its reference (every choice kept) under the strategies without expert parallelism, gives
the capacity path's logits at ``E / k``, and is refused by ep when it builds."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import optax
import pytest
from _cover import FULL, cover
from _gpt_checks import EP_MESHES, MESHES, TOL, check_lm_trajectory, lm_batches, mesh_for
from _messages import refused

import shardops_models as models
from shardops_models import Experts, Llama
from shardops_models.strategies.plan import stacked

MOE = Llama(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=32,
            context=16, experts=Experts(num_experts=4, k=2, capacity_factor=1.0))  # fmt: skip
EP = models.Strategy("ep_tp", ep="data", tp="model")  # GShard's: experts over the data axis
DROPLESS = dataclasses.replace(MOE, experts=dataclasses.replace(MOE.experts, capacity_factor=None))

CASES = [
    ("dp", "data8"),
    ("tp", "2x4"),
    ("fsdp_tp", "4x2"),
    (EP, "e4m2"),
    ("2d+ep", "d2e2m2"),
    ("fsdp+ep", "d2e4"),
    ("fsdp_tp+ep", "d2e2m2"),
]


# Every layout with one optimizer by default, the expert-parallel ones that keep the experts'
# optimizer state apart (fsdp+ep, fsdp_tp+ep) with Adam; both under SHARDOPS_FULL=1.
OPTIMIZED = [((s, m), ("adam" if i % 2 or s in ("fsdp+ep", "fsdp_tp+ep") else "sgd"))
             for i, (s, m) in enumerate(CASES)]  # fmt: skip
TRAJECTORIES = (
    [(s, m, o) for s, m in CASES for o in ("sgd", "adam")]
    if FULL
    else [(s, m, o) for (s, m), o in OPTIMIZED]
)


def test_every_layout_and_each_optimizer_train():
    assert {(s, m) for s, m, _ in TRAJECTORIES} == set(CASES)
    assert {o for *_, o in TRAJECTORIES} == {"sgd", "adam"}
    ep = {o for s, _, o in TRAJECTORIES if models.strategy_named(s).ep is not None}
    assert ep == {"sgd", "adam"}


@pytest.mark.parametrize(("strategy", "mesh", "opt"), TRAJECTORIES,
                         ids=lambda c: getattr(c, "name", c))  # fmt: skip
def test_the_mixture_of_experts_trains_like_the_reference(strategy, mesh, opt):
    """With expert parallelism, the compiled step's collectives (its two AllToAlls a layer,
    forward and backward) also equal the traced budget. SGD runs at a learning rate of 2 (the
    GPT's 4 grows the float32 differences of the dispatch and of the reference's every-expert
    sum to 2.8e-6 in the gradients and 1.5e-5 in the parameters by the fifth step, from 1e-8 at
    the first), and its gradients are held to 1e-5, where a wrong reduction is off by the
    gradient itself (≈ 1e-2)."""
    tol = {**TOL[opt], "grads": 1e-5}
    expert_parallel = models.strategy_named(strategy).ep is not None
    check_lm_trajectory(MOE, strategy, mesh, opt, tol=tol, budget=expert_parallel, sgd_lr=2.0)


# ep composed with the presets that keep the optimizer state or the parameters apart from the
# batch's other axes: HSDP (dp over replica, fsdp over data) and ZeRO-1 (the optimizer state
# split over data, the update's ReduceScatter and AllGather), the experts over expert. One
# optimizer each by default, both under SHARDOPS_FULL=1 (tests/_cover.py).
COMPOSED = cover([("hsdp+ep", "r2d2e2"), ("zero1+ep", "d2e4")], ["sgd", "adam"])


@pytest.mark.parametrize(("layout", "opt"), COMPOSED,
                         ids=lambda c: "-".join(c) if isinstance(c, tuple) else c)  # fmt: skip
def test_expert_parallelism_composed_with_hsdp_and_zero1_trains_like_the_reference(layout, opt):
    """As ``test_the_mixture_of_experts_trains_like_the_reference``, the compiled step's
    collectives equal to the traced budget."""
    strategy, mesh = layout
    check_lm_trajectory(MOE, strategy, mesh, opt, tol={**TOL[opt], "grads": 1e-5}, budget=True,
                        sgd_lr=2.0)  # fmt: skip


def test_the_composed_cases_cover_both_strategies_and_optimizers():
    assert {c[0][0] for c in COMPOSED} == {"hsdp+ep", "zero1+ep"}
    assert {c[1] for c in COMPOSED} == {"sgd", "adam"}
    assert ("zero1+ep", "adam") in {(c[0][0], c[1]) for c in COMPOSED}  # its state split


def test_capacity_drops_tokens_in_these_checks():
    """At the model's capacity the routing of inputs like the checks' drops choices (else a
    rule that fills slots in another order would pass unseen): the first layer's router on the
    embedded tokens of the first batch, row by row."""
    from shardops.layers import moe_route as route

    params = MOE.init(jax.random.key(0))
    h = params["embed"]["table"][lm_batches(MOE)[0][0]]  # [B, S, D]
    e = MOE.experts
    routing = route(h, params["blocks"]["moe"]["router"][0], k=e.k,
                    capacity_factor=e.capacity_factor)  # fmt: skip
    dropped = float(np.sum(routing.chosen) - np.sum(routing.dispatch))
    assert dropped > 0, "no choice dropped: the checks cannot see the capacity rule"


def test_expert_parallelism_without_experts_is_refused():
    with refused(ValueError, argument="strategy '2d+ep'", got="no parameter the role 'experts'",
                 expected="splits experts over 'expert'", fix="without ep"):  # fmt: skip
        models.build("2d+ep", mesh_for({"data": 2, "expert": 2, "model": 2}),
                     model=Llama(vocab_size=64, d_model=32, num_layers=1, num_heads=4,
                                 num_kv_heads=2, context=16), optimizer=optax.sgd(0.1))  # fmt: skip


def test_experts_the_axis_does_not_divide_are_refused():
    with refused(ValueError, argument="params['blocks']['moe']['down']", got="4 experts",
                 expected="do not split over mesh axis 'data' (size 8)",
                 fix="a number of experts 8 divides"):  # fmt: skip
        models.build(models.Strategy("ep", ep="data"), mesh_for({"data": 8}), model=MOE,
                     optimizer=optax.sgd(0.1))  # fmt: skip


# Mutants of the core's rule that an expert's gradient stays on its device: the expert weights
# (split over the ep axis, a gradient axis) entered varying over it all the same, by ctx.unit
# (2d+ep) and by fsdp's gather (fsdp+ep). check_vma refuses both when the step traces (a value
# varying over the axis cannot be made varying over it again), so the bug cannot pass silently;
# a sum that slips past check_vma is tests/layers/test_moe_mutations.py's (a custom VJP).
UNIT_LINE = "            axes = tuple(a for a in self.strategy.gradient_axes if a not in split)\n"
FSDP_LINE = "                     if a not in self.axes and a not in varying)  # fmt: skip\n"
GRADIENT_MUTANTS = {
    "unit_sums_expert_gradients": (UNIT_LINE, "            axes = self.strategy.gradient_axes\n",
                                   "2d+ep", "d2e2m2"),
    "fsdp_sums_expert_gradients": (FSDP_LINE, "                     if a not in self.axes)\n",
                                   "fsdp+ep", "d2e4"),
}  # fmt: skip


def _mutated_build(monkeypatch, name, mutated: bool):
    from _mutants import mutant, training

    from shardops_models.strategies import fsdp, layout, parallel

    line, replacement, *_ = GRADIENT_MUTANTS[name]
    new = replacement if mutated else line
    if name.startswith("fsdp"):
        monkeypatch.setattr(layout, "FsdpKind", mutant(fsdp, name, line, new).FsdpKind)
        return models.build
    copy = mutant(parallel, name, line, new)
    return training(name, Parallel=copy.Parallel, wrap=copy.wrap).build


@pytest.mark.parametrize("name", GRADIENT_MUTANTS)
def test_the_unmutated_copies_pass(monkeypatch, name):
    *_, strategy, mesh = GRADIENT_MUTANTS[name]
    build = _mutated_build(monkeypatch, name, mutated=False)
    check_lm_trajectory(MOE, strategy, mesh, "adam", build=build)


@pytest.mark.parametrize("name", GRADIENT_MUTANTS)
def test_expert_gradients_summed_over_the_expert_axis_are_refused(monkeypatch, name):
    *_, strategy, mesh = GRADIENT_MUTANTS[name]
    build = _mutated_build(monkeypatch, name, mutated=True)
    with pytest.raises(ValueError, match="pcast"):
        check_lm_trajectory(MOE, strategy, mesh, "adam", build=build)


def test_checkpoints_move_between_expert_parallel_and_other_layouts_bit_for_bit(tmp_path):
    """A drawn Adam state of the MoE Llama saved under 2d+ep (experts split over ``expert``)
    restores under 2d (every expert on every device), then ep_tp (experts over ``data``), then
    ref: every leaf bit for bit, laid out by the restoring setup's specs. The checkpoint
    records the experts' configuration: the same weights restored into another router (the
    dropless model, k = 1, a sigmoid score, the per-group load balance) are refused, naming
    the field."""
    from shardops_models.training.checkpoint import CheckpointMismatch, Checkpoints

    chain = [("2d+ep", "d2e2m2", MOE), ("2d", "4x2", MOE), (EP, "e4m2", MOE),
             ("ref", None, MOE)]  # fmt: skip
    rng = np.random.default_rng(3)
    full = None
    for i, (strategy, mesh, model) in enumerate(chain):
        mesh = None if mesh is None else mesh_for({**MESHES, **EP_MESHES}[mesh])
        setup = models.build(strategy, mesh, model=model, optimizer=optax.adam(1e-3))
        if full is None:  # drawn once, every leaf (moments and counts too)
            state = jax.eval_shape(setup.init, jax.random.key(0))
            full = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(a.dtype)
                                if np.issubdtype(a.dtype, np.floating)
                                else rng.integers(1, 1000, a.shape).astype(a.dtype), state)  # fmt: skip
            with Checkpoints(tmp_path / "0") as ckpt:
                ckpt.save(1, setup, models.TrainState(
                    models.shard_tree(full.params, setup.mesh, setup.param_specs),
                    models.shard_tree(full.opt_state, setup.mesh, setup.opt_specs)))  # fmt: skip
            continue
        with Checkpoints(tmp_path / str(i - 1)) as ckpt:
            restored, _ = ckpt.restore(setup)
        for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(restored),
                                     jax.tree.leaves(full), strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(setup.gather(got)), want,
                                          err_msg=f"{strategy}: {jax.tree_util.keystr(path)}")  # fmt: skip
        with Checkpoints(tmp_path / str(i)) as ckpt:
            ckpt.save(1, setup, restored)
    others = {"capacity_factor": (None, "1.0 in the checkpoint, None here"),
              "k": (1, "2 in the checkpoint, 1 here"),
              "score": ("sigmoid", "'softmax' in the checkpoint, 'sigmoid' here"),
              "load_balance": ("group", "'global' in the checkpoint, 'group' here")}  # fmt: skip
    with Checkpoints(tmp_path / "0") as ckpt:
        for field, (value, shown) in others.items():
            other = dataclasses.replace(MOE, experts=dataclasses.replace(MOE.experts,
                                                                         **{field: value}))  # fmt: skip
            with pytest.raises(CheckpointMismatch, match=re.escape(f"experts.{field}: {shown}")):
                ckpt.restore(models.build("ref", model=other, optimizer=optax.adam(1e-3)))


def test_the_global_load_balance_under_microbatches_is_refused():
    """Megatron's global load balance multiplies two whole-batch means: split into microbatches
    (accumulated, or pipelined) it would be no unsplit run's objective; the per-group form
    averages exactly and trains (tests/strategies/test_pipeline.py)."""
    group = dataclasses.replace(MOE, experts=dataclasses.replace(MOE.experts,
                                                                 load_balance="group"))  # fmt: skip
    ids = np.zeros((4, 16), np.int32)
    for strategy, mesh in (("ref", None), ("ref+1f1b", mesh_for({"pipe": 2}))):
        setup = models.build(strategy, mesh, model=MOE, optimizer=optax.sgd(0.1),
                             microbatches=2)  # fmt: skip
        state = setup.init(jax.random.key(0))
        with refused(ValueError, argument="load_balance='global' with microbatches=2",
                     got="match no unsplit run", expected="sees one part at a time",
                     fix="Experts(load_balance='group')"):  # fmt: skip
            setup.train_step(state, *setup.place_batch(ids, ids))
    setup = models.build("ref", model=MOE, optimizer=optax.sgd(0.1))  # one part: the batch's
    setup.train_step(setup.init(jax.random.key(0)), ids, ids)
    setup = models.build("ref", model=group, optimizer=optax.sgd(0.1), microbatches=2)
    setup.train_step(setup.init(jax.random.key(0)), ids, ids)


# Dropless: the strategies without an expert axis (each expert whole on every device, its
# hidden units split over model under tp), each optimizer once by default; every pair under
# SHARDOPS_FULL=1 (tests/_cover.py).
DROPLESS_CASES = cover([("dp", "data8"), ("tp", "2x4"), ("fsdp_tp", "4x2")], ["sgd", "adam"])


@pytest.mark.parametrize(("layout", "opt"), DROPLESS_CASES, ids=lambda c: "-".join(c) if
                         isinstance(c, tuple) else c)  # fmt: skip
def test_the_dropless_mixture_trains_like_the_reference(layout, opt):
    """Every choice computed by its expert (tokens sorted by expert, ``lax.ragged_dot``) equals
    the reference that keeps every choice, at the capacity model's tolerances; the compiled
    step's collectives equal the traced budget (no AllToAll). At the checks' inputs the capacity
    model drops choices (``test_capacity_drops_tokens_in_these_checks``), so a dropless layer
    that dropped as it does would be off by the dropped choices' outputs."""
    strategy, mesh = layout
    tol = {**TOL[opt], "grads": 1e-5}
    check_lm_trajectory(DROPLESS, strategy, mesh, opt, tol=tol, budget=True, sgd_lr=2.0)


def test_the_dropless_cases_cover_every_layout_and_optimizer():
    assert {c[0][0] for c in DROPLESS_CASES} == {"dp", "tp", "fsdp_tp"}
    assert {c[1] for c in DROPLESS_CASES} == {"sgd", "adam"}


def _logits(model, strategy, mesh_name, params, ids):
    setup = models.build(strategy, mesh_for(MESHES[mesh_name]), model=model,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    return np.asarray(setup.logits(setup.shard(params).params, setup.place_batch(ids)))


def test_dropless_gives_the_capacity_paths_logits_at_e_over_k():
    """At ``capacity_factor = E / k`` (``C = S``) the capacity path drops nothing: its logits
    under tp are the dropless layer's (float32 rounding of two summation orders), while at the
    model's capacity (1.0, which drops) they differ by far more."""
    e = MOE.experts
    params = MOE.init(jax.random.key(0))
    ids = lm_batches(MOE)[0][0]
    dropless = _logits(DROPLESS, "tp", "2x4", params, ids)
    at = {cf: _logits(dataclasses.replace(MOE, experts=dataclasses.replace(
        e, capacity_factor=cf)), "tp", "2x4", params, ids) for cf in (e.num_experts / e.k, 1.0)}  # fmt: skip
    np.testing.assert_allclose(dropless, at[e.num_experts / e.k], rtol=0, atol=2e-6)
    assert np.max(np.abs(dropless - at[1.0])) > 1e-3, "capacity 1.0 dropped nothing here"


def test_dropless_expert_stats_drop_nothing():
    """``expert_stats`` on sequences of one repeated token (every position the same ``h``, so
    each layer's k = 2 choices go to the same two experts, 16 tokens each): dropless drops
    nothing; the capacity model (C = 8) drops half of each chosen expert's tokens and none of
    an expert no token chose (not 1 − 0/0); the shares are the same (before dropping)."""
    params = MOE.init(jax.random.key(0))
    ids = np.full((2, MOE.context), 5, np.int32)
    dropless, capacity = DROPLESS.expert_stats(params, ids), MOE.expert_stats(params, ids)
    share = np.asarray(dropless["share"])  # [L, E]
    np.testing.assert_array_equal(np.sort(share, -1), [[0, 0, 0.5, 0.5]] * MOE.num_layers)
    np.testing.assert_array_equal(np.asarray(dropless["dropped"]), 0.0)
    np.testing.assert_array_equal(np.asarray(capacity["dropped"]), np.where(share > 0, 0.5, 0.0))
    np.testing.assert_array_equal(np.asarray(capacity["share"]), share)


@pytest.mark.parametrize(("strategy", "mesh"), [(EP, "e4m2"), ("2d+ep", "d2e2m2")],
                         ids=lambda c: getattr(c, "name", c))  # fmt: skip
def test_dropless_under_expert_parallelism_is_refused_when_it_builds(strategy, mesh):
    name = models.strategy_named(strategy).name
    axis = models.strategy_named(strategy).ep
    with refused(ValueError, argument=f"strategy {name!r}",
                 got=("is dropless", "names no 'experts' dim"),
                 expected=(f"splits experts over {axis!r}", "ragged AllToAll"),
                 fix=("Experts(capacity_factor=E / k) under ep", "the strategy without ep")):  # fmt: skip
        models.build(strategy, mesh_for(EP_MESHES[mesh]), model=DROPLESS, optimizer=optax.sgd(0.1))


def test_dropless_on_expert_parallel_experts_is_refused_when_it_traces():
    """A plan that splits the experts (``EXPERTS``) over ep around a dropless layer (a user's
    plan): ``ctx.moe`` refuses it when the step traces, naming the strategy, before the
    kernel's own check."""
    plan = {**DROPLESS.plan()}
    plan["blocks"] = stacked({**plan["blocks"].plan, "moe": models.EXPERTS})
    setup = models.build(EP, mesh_for(EP_MESHES["e4m2"]), model=DROPLESS, plan=plan,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    ids = lm_batches(MOE)[0][0]
    with refused(ValueError, argument="strategy 'ep_tp'", got="capacity_factor=None (dropless)",
                 expected="splits this layer's experts over 'data'",
                 fix="Experts(capacity_factor=E / k) under ep"):  # fmt: skip
        setup.logits(setup.shard(MOE.init(jax.random.key(0))).params, setup.place_batch(ids))


@pytest.mark.parametrize(("options", "argument", "got", "expected", "fix"), [
    ({"k": 5}, "k=5", "> num_experts=4", "picks k distinct experts", "use k ≤ num_experts"),
    ({"capacity_factor": 0.0}, "capacity_factor", "got 0.0", "a finite number > 0",
     "E / k drops nothing"),
    ({"capacity_factor": float("inf")}, "capacity_factor", "got inf", "a finite number > 0",
     "E / k drops nothing"),
    ({"capacity_factor": True}, "capacity_factor", "got True", "or None (dropless)",
     "and so does None"),
    ({"score": "relu"}, "score", "got 'relu'", "one of ('softmax', 'sigmoid')", "Pass one"),
    ({"load_balance": "local"}, "load_balance", "got 'local'", "one of ('global', 'group')",
     "Pass one"),
])  # fmt: skip
def test_experts_refuse_what_the_layer_cannot_run(options, argument, got, expected, fix):
    with refused(ValueError, argument=argument, got=got, expected=expected, fix=fix):
        Experts(num_experts=4, **options)


def test_ctx_array_of_an_expert_leaf_is_this_devices_experts():
    """``ctx.array`` on an expert leaf under 2d+ep, in a model whose other leaves are padded (so
    every leaf carries its logical shape): this device's experts, ``w[E/2, D, F/2]``, not
    mistaken for a padded leaf (the expert axis counts as a split, as the model axis does)."""
    from jax.sharding import PartitionSpec as P

    from shardops_models.strategies.parallel import Parallel, Param

    mesh = mesh_for(EP_MESHES["d2e2m2"])
    ctx = Parallel(models.strategy_named("2d+ep"))
    spec = P("expert", None, "model")

    def local(w):
        leaf = Param(w, models.EXPERTS, spec, "['moe']['gate']", ready=True, logical=(4, 8, 6))
        return ctx.array(leaf)

    w = np.arange(4 * 8 * 6, dtype=np.float32).reshape(4, 8, 6)
    out = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)(w)
    np.testing.assert_array_equal(np.asarray(out), w)
    padded = jax.shard_map(lambda w: ctx.array(Param(w, models.EXPERTS, spec, "['w']", ready=True,
                                                     logical=(4, 8, 5))),
                           mesh=mesh, in_specs=spec, out_specs=spec)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"is stored padded, \(4, 8, 6\) for the model's \(4, 8, 5\)"
    ):
        padded(w)


def test_experts_accept_none_as_dropless():
    assert Experts(num_experts=4, capacity_factor=None).capacity_factor is None
    assert DROPLESS.plan()["blocks"].plan["moe"] == models.EXPERTS  # one name: checkpoints move
