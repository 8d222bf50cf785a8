"""Pipeline parallelism (``pp``, ``models.strategies.pipe``) trains the Llama like its plain
reference: every schedule (circular with 2 and 4 virtual stages), stage count and microbatch
count, alone and composed with data, fsdp, HSDP, zero1, tensor, sequence and context
parallelism; budgets, checkpoints between pipeline layouts, and the refusals.

The model stacks 8 layers, so that 2, 4 and 8 stages each hold whole layers (4 on 2 stages of
one chunk: 2 layers a stage, at half the compile). Each case runs 5
steps of SGD (gradients checked every step) or Adam and checks the losses, the gradients and
the parameters (every leaf moving ≥ 100× the tolerance) against ``Llama.reference_loss``.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import optax
import pytest
from _gpt_checks import PP_MESHES, TOL, check_budget, check_lm_trajectory, lm_batches
from _messages import refused
from _model_checks import mesh_for
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models
from shardops_models.training.checkpoint import Checkpoints

# Weights × 0.1 and clipped SGD at 0.5, as tests/networks/test_llama.py: every leaf moves in 5
# steps and float32 differences stay near rounding.
LLAMA = models.Llama(vocab_size=97, d_model=32, num_layers=8, num_heads=8, num_kv_heads=2,
                     d_ff=64, context=16, bos_id=1, init_scale=0.1)  # fmt: skip
CLIP, SGD_LR = 0.25, 0.5
# 2 stages of 2 layers where the mesh has 2 stages of one chunk: a stage still runs several
# layers, and the unrolled step compiles in 1.8 s against 8 layers' 3.1 s (ref+1f1b on pipe2).
LLAMA4 = dataclasses.replace(LLAMA, num_layers=4)
FULL = os.environ.get("SHARDOPS_FULL") == "1"


def _pipe(base: str, schedule: str) -> str:
    return f"{base}+{schedule}"


# (strategy, mesh, microbatches, optimizer): every schedule on 2, 4 and 8 stages; M = 1, P and
# more than P (not a multiple of it: a batch of 18 for M = 3); the compositions with dp, fsdp,
# sp, zero1, tp and cp. CI time: hsdp+1f1b, tp+gpipe on 4 stages and circular on 4 stages
# (checked numerically in tests/pipeline/test_executor.py) run under SHARDOPS_FULL=1 (_full),
# with M = 2P + 1.
COVER = [
    ("ref+1f1b", "pipe2", 3, "sgd"),
    ("ref+gpipe", "pipe4", 4, "adam"),
    ("ref+1f1b", "pipe8", 1, "sgd"),
    ("ref+gpipe", "pipe2", 1, "sgd"),
    ("2d+1f1b", "p2d2m2", 2, "adam"),
    ("fsdp_sp+gpipe", "p2d2m2", 2, "sgd"),
    ("zero1+1f1b", "p2d4", 4, "adam"),
    ("tp+ring+1f1b", "p2c2m2", 2, "sgd"),
    ("2d+circular", "p2d2m2", 2, "adam"),
    # 2 stages × 4 virtual stages (CI time: one group of P; two groups, M = 4, under FULL and
    # in tests/pipeline/test_executor.py)
    ("fsdp+circular4", "p2d4", 2, "sgd"),
]


# The clipping binds at every step, so the gradients read back from a step cannot show one
# scaled as a whole (the microbatches' sum not divided by M): these cases also hold
# setup.loss_and_grads's unclipped gradients to the reference's, one for each schedule with
# M > 1 (every SGD case under SHARDOPS_FULL=1).
RAW_GRADS = {("ref+1f1b", 3), ("fsdp_sp+gpipe", 2), ("fsdp+circular4", 2)}


def _full():
    """Every schedule × P ∈ {2, 4, 8} × M ∈ {1, P, 2P + 1}, alone (circular: P ∈ {2, 4}, V = 2
    and 4 where P·V divides the 8 layers, M ∈ {P, 2P, 3P}); and every composition with every
    schedule."""
    out = []
    for mesh, p in (("pipe2", 2), ("pipe4", 4)):
        for v in (2, 4) if p == 2 else (2,):
            name = "circular" if v == 2 else f"circular{v}"
            out += [(f"ref+{name}", mesh, m, "sgd") for m in (p, 2 * p, 3 * p)]
    for base, mesh in (("2d", "p2d2m2"), ("fsdp_tp", "p2d2m2"), ("dp_sp", "p2d2m2"),
                       ("hsdp", "p2r2d2"), ("zero1", "p2d4"), ("fsdp", "p2d4"),
                       ("tp+ring", "p2c2m2"), ("ref+ulysses", "p2c2"), ("tp", "p4m2")):  # fmt: skip
        out += [(_pipe(base, "circular"), mesh, 4, opt) for opt in ("sgd", "adam")]
    for schedule in ("gpipe", "1f1b"):
        for mesh, p in (("pipe2", 2), ("pipe4", 4), ("pipe8", 8)):
            out += [(f"ref+{schedule}", mesh, m, "sgd") for m in (1, p, 2 * p + 1)]
        for base, mesh in (("2d", "p2d2m2"), ("fsdp_tp", "p2d2m2"), ("dp_sp", "p2d2m2"),
                           ("hsdp", "p2r2d2"), ("zero1", "p2d4"), ("fsdp", "p2d4"),
                           ("ref+ulysses", "p2c2"), ("tp", "p4m2")):  # fmt: skip
            out += [(_pipe(base, schedule), mesh, 2, opt) for opt in ("sgd", "adam")]
    return out


def _batch(mesh: str, m: int) -> int:
    """The smallest batch of ≥ 16 the mesh's batch axes and ``m`` microbatches divide."""
    shape = PP_MESHES[mesh]
    shards = shape.get("data", 1) * shape.get("replica", 1)
    unit = shards * m
    return unit * -(-16 // unit)


@pytest.mark.parametrize(("strategy", "mesh", "m", "opt"), _full() if FULL else COVER)
def test_pipeline_trains_like_the_reference(strategy, mesh, m, opt):
    """5 steps equal the reference; with SGD the compiled step's collectives equal the traced
    budget, but under cp, where XLA hoists the all-gather of the segment ids (the same in
    every layer) out of the stage's scan, which the traced budget counts per layer."""
    pp = models.strategy_named(strategy)
    chunks = PP_MESHES[mesh]["pipe"] * (pp.pp_virtual or 1)
    model = LLAMA4 if 2 * chunks <= LLAMA4.num_layers else LLAMA  # ≥ 2 layers a chunk
    check_lm_trajectory(model, pp, mesh, opt, microbatches=m,
                        batch=_batch(mesh, m), clip=CLIP, sgd_lr=SGD_LR,
                        budget=opt == "sgd" and pp.cp is None,
                        raw_grads=FULL or (strategy, m) in RAW_GRADS)  # fmt: skip


def _setup(strategy, mesh_name, m, model=LLAMA):
    return models.build(strategy, mesh_for(PP_MESHES[mesh_name]), optimizer=optax.sgd(0.1),
                        model=model, microbatches=m)  # fmt: skip


def test_stage_layers_are_contiguous():
    """Stage s holds layers s·L/P … (s+1)·L/P − 1: the blocks' dim 0 split over pipe."""
    setup = _setup("ref+1f1b", "pipe4", 4)
    state = setup.shard(LLAMA.init(jax.random.key(0)))
    wq = state.params["blocks"]["attn"]["wq"]
    assert wq.sharding.spec[0] == "pipe"
    for shard in wq.addressable_shards:
        stage = shard.index[0].start // 2  # 2 layers a stage
        assert shard.index[0] == slice(2 * stage, 2 * stage + 2)


def test_circular_stages_hold_their_chunks():
    """Under circular on 2 stages × 2 virtual stages (8 layers, chunks of 2) stage 0 holds
    layers 0, 1, 4, 5 and stage 1 layers 2, 3, 6, 7 (``stage_order``), and ``gather`` gives the
    model's order back."""
    setup = _setup("ref+circular", "pipe2", 2)
    params = LLAMA.init(jax.random.key(0))
    wq = params["blocks"]["attn"]["wq"]
    params["blocks"]["attn"]["wq"] = np.arange(8, dtype=np.float32).reshape(8, 1, 1) + 0 * wq
    state = setup.shard(params)
    stored = state.params["blocks"]["attn"]["wq"]
    for shard in stored.addressable_shards:
        stage = shard.index[0].start // 4
        want = [0, 1, 4, 5] if stage == 0 else [2, 3, 6, 7]
        assert list(np.asarray(shard.data)[:, 0, 0]) == want, stage
    np.testing.assert_array_equal(setup.gather(state.params)["blocks"]["attn"]["wq"],
                                  params["blocks"]["attn"]["wq"])  # fmt: skip


def test_checkpoints_move_between_pipeline_layouts_bit_for_bit(tmp_path):
    """A drawn Adam state saved under 1F1B on 2 stages × 2d restores under circular on 2 × 2
    virtual stages, GPipe on 4 stages, then 2d (no pipeline), circular on 2 × 4, 1F1B on 8
    stages, then ref: every leaf bit for bit, each saved by the setup before it (Megatron-LM
    1232's tp2pp2dp2 → tp2pp1dp4, here any P and V)."""
    chain = [("2d+1f1b", "p2d2m2"), ("2d+circular", "p2d2m2"), ("ref+gpipe", "pipe4"),
             ("2d", {"data": 4, "model": 2}), ("fsdp+circular4", "p2d4"), ("ref+1f1b", "pipe8"),
             ("ref", None)]  # fmt: skip
    rng, full, previous = np.random.default_rng(3), None, None
    for i, (strategy, mesh) in enumerate(chain):
        mesh = mesh_for(PP_MESHES.get(mesh, mesh) if isinstance(mesh, str) else mesh)
        setup = models.build(
            strategy,
            mesh,
            model=LLAMA,
            optimizer=optax.adam(1e-3),
            microbatches=2 if "circular" in strategy else 1,
        )  # groups of P
        if full is None:  # drawn once, every leaf (moments and counts too)
            state = jax.eval_shape(setup.init, jax.random.key(0))
            full = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(a.dtype)
                                if np.issubdtype(a.dtype, np.floating)
                                else rng.integers(1, 1000, a.shape).astype(a.dtype), state)  # fmt: skip
            previous = models.TrainState(models.shard_tree(full.params, setup.mesh, setup.param_specs),
                                         models.shard_tree(full.opt_state, setup.mesh,
                                                           setup.opt_specs))  # fmt: skip
            full = jax.device_get(setup.gather(previous))  # the model's shapes (unpadded)
        else:
            with Checkpoints(tmp_path / str(i - 1)) as ckpt:
                previous, _ = ckpt.restore(setup)
            gathered = setup.gather(previous)  # the model's shapes, every leaf
            for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(gathered),
                                         jax.tree.leaves(full), strict=True):  # fmt: skip
                np.testing.assert_array_equal(np.asarray(got), want,
                                              err_msg=f"{strategy}: {jax.tree_util.keystr(path)}")  # fmt: skip
        with Checkpoints(tmp_path / str(i)) as ckpt:
            ckpt.save(1, setup, previous)


@pytest.mark.parametrize("strategy", ["2d+1f1b", "2d+circular"])
def test_logits_and_evaluate_through_the_stages(strategy):
    """``setup.logits`` and ``setup.evaluate`` (one forward through the stages in turn; V laps
    under circular) equal the reference's."""
    params = LLAMA.init(jax.random.key(1))
    ids, labels = lm_batches(LLAMA)
    setup = _setup(strategy, "p2d2m2", 2)
    state = setup.shard(params)
    logits = setup.logits(state.params, setup.place_batch(ids[0]))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(LLAMA.reference_logits(params, ids[0])),
                               atol=2e-5)  # fmt: skip
    loss_sum, _, count = setup.evaluate(state.params, *setup.place_batch(ids[0], labels[0]))
    ref = LLAMA.reference_loss(params, ids[0], labels[0])
    assert int(count) == ids[0].size
    assert abs(float(loss_sum) / int(count) - float(ref)) < 1e-5


@pytest.mark.parametrize(("strategy", "v"), [("ref+1f1b", 1), ("ref+circular", 2)])
def test_budget_sends_each_microbatch_across_every_boundary(strategy, v):
    """The compiled step's collective-permutes over pipe move, per device, one microbatch's
    activation ``[b/M, S, D]`` per phase that sends: V·M + P − 2 forward phases and as many
    backward (each microbatch crosses P·V − 1 chunk boundaries each way, the phases
    overlapping)."""
    p, m, b, s, d = 2, 4, 16, 16, LLAMA4.d_model
    setup = _setup(strategy, "pipe2", m, model=LLAMA4)  # circular: 4 chunks of one layer
    state = setup.shard(LLAMA4.init(jax.random.key(0)))
    ids, labels = lm_batches(LLAMA4)
    compiled = setup.train_step.lower(state, *setup.place_batch(ids[0], labels[0])).compile()
    check_budget(setup, compiled, ids.shape[1:])
    permutes = [c for c in shardops.inspect.collectives(setup.mesh, compiled)
                if c.kind == "collective-permute" and c.bytes]  # fmt: skip
    activation = (b // m) * s * d * 4
    assert sum(c.bytes for c in permutes) == 2 * (v * m + p - 2) * activation
    assert all(c.axes == ("pipe",) for c in permutes)


def test_refusals():
    """Layers that do not split into the stages, a model without stacked layers, the
    divergence locator, an unknown schedule, a schedule without a pp axis."""
    odd = models.Llama(vocab_size=97, d_model=32, num_layers=6, num_heads=8, num_kv_heads=2,
                       d_ff=64, context=16)  # fmt: skip
    with refused(ValueError, argument="params['blocks']", got="6 layers", expected="4 pipeline stages",
                 fix="a number of layers 4 divides"):  # fmt: skip
        _setup("ref+1f1b", "pipe4", 4, model=odd)
    gpt = models.Gpt(vocab_size=64, d_model=32, num_heads=8, num_layers=2, context=16, d_ff=64)
    with refused(ValueError, argument="pipelines the stacked layers", got="stacks none",
                 expected="models.strategies.plan.stacked", fix="models.Gpt(stacked=True)"):  # fmt: skip
        _setup("ref+1f1b", "pipe2", 2, model=gpt)
    setup = _setup("ref+1f1b", "pipe2", 2)
    ids, labels = lm_batches(LLAMA)
    with refused(ValueError, argument="shardops.inspect.compare", got="pipelines the layers",
                 expected="inside one device's forward", fix="without pp"):  # fmt: skip
        models.locate(setup, setup.init(jax.random.key(0)).params, ids[0], labels[0])
    with refused(ValueError, argument="pp_schedule", got="'zb'", expected="'gpipe', '1f1b'",
                 fix="one of"):  # fmt: skip
        models.Strategy("x", pp="pipe", pp_schedule="zb")
    with refused(ValueError, argument="pp_schedule='gpipe'", got="without a pp axis",
                 expected="pp=", fix="name it"):  # fmt: skip
        models.Strategy("x", pp_schedule="gpipe")


def test_circular_refusals():
    """Layers the P·V chunks do not divide, microbatches not in groups of P, virtual stages
    on a contiguous schedule."""
    odd = dataclasses.replace(LLAMA, num_layers=6)
    with refused(ValueError, argument="params['blocks']", got="6 layers",
                 expected="4 chunks (2 stages × 2 virtual stages)",
                 fix="a number of layers 4 divides, or a smaller 'pipe' axis or fewer virtual "
                     "stages"):  # fmt: skip
        _setup("ref+circular", "pipe2", 2, model=odd)
    with refused(ValueError, argument="circular: 3 microbatches", got="3 microbatches",
                 expected="groups of 2 (one per stage)",
                 fix="a number of microbatches 2 divides (4, say), or the 1f1b schedule"):  # fmt: skip
        _setup("ref+circular", "pipe2", 3)  # when the setup builds
    with refused(ValueError, argument="pp_virtual=2", got="'1f1b' schedule",
                 expected="stages are contiguous", fix="pp_schedule='circular'"):  # fmt: skip
        models.Strategy("x", pp="pipe", pp_virtual=2)
    assert models.with_pipeline("2d", "circular", virtual=4).name == "2d+circular4"
    assert models.strategy_named("2d+circular4").kinds[0].virtual == 4
    assert models.strategy_named("2d+circular").kinds[0].virtual == 2
    assert models.strategy_named("2d+circular") == models.with_pipeline("2d", "circular", virtual=2)
    for bad in (0, "2", True):
        with refused(ValueError, argument="pp_virtual", got=f"got {bad!r}",
                     expected="a positive int", fix="Pass an int >= 1"):  # fmt: skip
            models.Strategy("x", pp="pipe", pp_schedule="circular", pp_virtual=bad)
    with refused(ValueError, argument="with_pipeline: virtual=3", got="'gpipe' schedule",
                 expected="stages are contiguous", fix="schedule='circular'"):  # fmt: skip
        models.with_pipeline("2d", "gpipe", virtual=3)


@dataclasses.dataclass(frozen=True)
class _SplitsLayers(models.strategies.kind.Kind):
    """A kind of one's own whose layout splits the stacked layers' dim 0 over its axis too."""

    name = "layers_too"

    def layout(self, specs, stored, context):
        def more(spec):
            if spec and "pipe" in shardops.entry_axes(spec[0]):
                return P(("pipe", *self.axes), *spec[1:])
            return spec

        return jax.tree.map(more, specs, is_leaf=lambda s: isinstance(s, P)), stored


def test_circular_refuses_the_layers_split_over_another_axis_too():
    """Circular's stored order gives each stage its chunks only where dim 0 is split over pipe
    alone; a kind that splits it further (a contiguous split of the stage's block) is refused
    when the setup builds (1F1B takes it: each stage still holds a contiguous block)."""
    for schedule in ("circular", "1f1b"):
        strategy = models.Strategy(f"x+{schedule}", pp="pipe", pp_schedule=schedule,
                                   extra=(_SplitsLayers("data"),))  # fmt: skip
        build = lambda: _setup(strategy, "p2d4", 2)  # noqa: B023, E731
        if schedule == "1f1b":
            assert build().param_specs["blocks"]["attn"]["wq"][0] == ("pipe", "data")
            continue
        with refused(ValueError, argument="params['blocks']", got="('pipe', 'data')",
                     expected="split over 'pipe' alone", fix="use the 1f1b schedule"):  # fmt: skip
            build()


def test_stored_order_converts_one_leaf_on_any_path():
    """``Padding.unpad_leaf`` (the HF saver's, one leaf at a time) un-permutes and slices the
    leaf at a path of dict keys or list indices alike."""
    from shardops_models.training._placement import Padding

    logical = {"blocks": [(4, 2), (3,)]}
    padding = Padding(logical, {"blocks": [(4, 3), (3,)]}, {"['blocks'][0]": (2, 0, 3, 1)})
    model = np.arange(8.0).reshape(4, 2)
    stored = padding.pad({"blocks": [model, np.zeros(3)]})["blocks"][0]
    assert stored.shape == (4, 3) and list(stored[:, 0]) == [4.0, 0.0, 6.0, 2.0]
    path = jax.tree_util.tree_flatten_with_path({"blocks": [0, 1]})[0][0][0]
    np.testing.assert_array_equal(padding.unpad_leaf(path, stored), model)


@pytest.mark.parametrize("strategy", ["fsdp+1f1b", "2d+gpipe"])
def test_weights_gathered_and_gradients_reduced_once_per_step(strategy):
    """fsdp's AllGather of the stage's weights and ReduceScatter of their gradients (and dp's
    AllReduce) run once per step, whatever M: the traced budget's bytes over the batch axes are
    the same for 2 and 8 microbatches, and the fsdp gather moves the stage's parameters once."""
    mesh = "p2d4" if strategy.startswith("fsdp") else "p2d2m2"
    budgets = [_setup(strategy, mesh, m).collective_budget(32, 16) for m in (2, 8)]
    data = [{k: v for k, v in b.items() if "data" in k[1] and "pipe" not in k[1]} for b in budgets]
    assert data[0] == data[1] and data[0], data
    if strategy.startswith("fsdp"):
        setup = _setup(strategy, mesh, 2)
        shapes = jax.eval_shape(setup.init, jax.random.key(0)).params
        specs = jax.tree.leaves(setup.param_specs, is_leaf=lambda s: isinstance(s, P))
        stage = sum(a.size * 4 // (2 if "pipe" in str(s) else 1)  # f32; this stage's layers
                    for a, s in zip(jax.tree.leaves(shapes), specs, strict=True)
                    if "data" in str(s))  # fmt: skip
        assert data[0][("all-gather", ("data",))] == stage


MOE = models.Llama(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=32,
                   context=16, experts=models.Experts(num_experts=4, k=2, capacity_factor=1.0))  # fmt: skip
# GShard's per-group load balance: the mean of each sequence's, so M microbatches' losses
# average to the batch's (Megatron's global form is refused under microbatches, pipelined or
# not: tests/networks/test_moe_llama.py).
MOE_GROUP = dataclasses.replace(MOE, experts=dataclasses.replace(MOE.experts, load_balance="group"))


@pytest.mark.parametrize(("model", "strategy", "mesh", "m", "opt"), [
    (MOE, "ref+1f1b", "pipe2", 1, "sgd"),
    (MOE_GROUP, "ref+gpipe", "pipe2", 4, "sgd"),
    (MOE_GROUP, models.with_pipeline(models.with_experts("2d"), "1f1b"), "p2d2m2e", 2, "adam"),
    (MOE, "dp+gpipe", "p2d4", 1, "adam"),
    # Adam: with SGD at 2 circular's summation order (not 1F1B's) takes the parameters to
    # 9.7e-6 of the reference's by the fifth step, over SGD's 5e-6 (its gradients within 1e-5)
    (dataclasses.replace(MOE_GROUP, num_layers=4), "ref+circular", "pipe2", 2, "adam"),
], ids=["global-1f1b", "group-gpipe-M4", "group-2d+ep+1f1b", "global-dp+gpipe",
        "group-circular"])  # fmt: skip
def test_experts_train_through_the_stages(model, strategy, mesh, m, opt):
    """A Mixtral-style Llama: each stage's layers' auxiliary losses (load balance, router
    z-loss) count in the objective on every stage (their gradients summed over the batch axes
    as the loss's), the experts split over an expert axis too; 5 steps like the reference (SGD
    at 2, gradients held to 1e-5, as tests/networks/test_moe_llama.py)."""
    tol = {**TOL[opt], "grads": 1e-5}
    check_lm_trajectory(model, models.strategy_named(strategy), mesh, opt, microbatches=m,
                        batch=_batch(mesh, m), tol=tol, sgd_lr=2.0, budget=opt == "sgd")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _TwoStacks(models.Llama):
    """The Llama's blocks run twice, by two ``ctx.scan`` calls: pp cuts at one."""

    def apply(self, ctx, params, ids):
        x = ctx.unit(self._embed(ctx), {"embed": params["embed"]}, ids)
        block = self._block(ctx, None)
        x = ctx.scan(block, params["blocks"], ctx.scan(block, params["blocks"], x))
        head = {"norm": params["norm"], "out": self.output_layer(params)}
        return ctx.unit(self._head(ctx), head, x), {}


def test_a_forward_with_two_stacks_is_refused():
    model = _TwoStacks(vocab_size=97, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2,
                       d_ff=64, context=16)  # fmt: skip
    setup = _setup("ref+1f1b", "pipe2", 2, model=model)
    ids, labels = lm_batches(model)
    with refused(ValueError, argument="calls ctx.scan twice", got="twice",
                 expected="its one stack of layers", fix="Stack every block in one ctx.scan"):  # fmt: skip
        setup.loss_and_grads(
            setup.init(jax.random.key(0)).params, *setup.place_batch(ids[0], labels[0])
        )


@pytest.mark.parametrize(
    ("strategy", "mesh_name"), [("2d+circular", "p2d2m2"), ("ref+1f1b", "pipe2")]
)
def test_locate_non_finite_replays_a_pipeline_without_it_and_names_the_layer(strategy, mesh_name):
    """A NaN in layer 5's MLP weights (of 8; in a circular pipeline's stored order another
    index): ``locate_non_finite`` replays the step without pp on the devices at pipe index 0
    (``"2d"`` on data 2 × model 2; ``"ref"`` where pipe is the only axis) from the params in
    the model's order, and names layer 5's MLP output first."""
    setup = _setup(strategy, mesh_name, 2)
    params = LLAMA.init(jax.random.key(0))
    down = np.array(params["blocks"]["mlp"]["down"]["w"])
    down[5, 0, 0] = np.nan
    params["blocks"]["mlp"]["down"]["w"] = down
    ids, labels = lm_batches(LLAMA)
    report = models.locate_non_finite(setup, setup.shard(params).params, ids[0], labels[0])
    assert (report.layer, report.what) == ("['blocks'][5]['mlp']", "output"), str(report)
