"""Hypothesis: every strategy trains a random model under a random valid plan like the reference.

Each example draws

- a model built from shardops layers: a GPT (1–2 blocks) or an MLP (1–3 layers), with widths
  that need not divide by any mesh axis;
- a strategy (every one but ``ref``, the oracle; sequence parallelism for the GPT only) and a
  mesh it runs on: every 2-axis mesh of 8 devices (1×8, 2×4, 4×2, 8×1), smaller ones (2×2,
  1×2, 2×1, 1×4, 4×1) and, for a strategy on one axis, the 1-axis meshes of 1, 2, 4, 8;
- a plan valid on that mesh, layer by layer: a role that splits a layer over ``model`` only
  where its dimension divides by the axis, else ``replicated``. FSDP leaves replicated over
  ``data`` the leaves no dimension of which divides. Each role is written once per layer, once
  per leaf, or once for a whole subtree whose layers share it (a plan is a pytree prefix);
- SGD (sometimes Adam), remat under FSDP, the params' seed, a batch and a sequence length.

Against the ``ref`` strategy, from the same params on the same batches, it checks the first
batch's gradients (``setup.loss_and_grads``, gathered with ``setup.gather``) and the losses and
final params of 3 steps of ``setup.step``. Both run in one jitted program per setup (the steps
in a ``lax.scan``): an example compiles the strategy's program and the reference's, and those
two compile at once on the two cores.

    HYPOTHESIS_PROFILE=quick python -m pytest tests/strategies/test_strategy_properties.py -q
"""

import collections
import functools
import re
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import optax
import pytest
from _model_checks import TOL, optimizer
from hypothesis import event, example, given, note, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models
from shardops_models import COLUMN, HEAD, REPLICATED, ROW, VOCAB
from shardops_models.strategies.plan import is_shape

STEPS = 3
SEQUENCE_PARALLEL = ("sp", "dp_sp", "fsdp_sp")
SEQUENCE_PARALLEL = (*SEQUENCE_PARALLEL, "hsdp_sp")
STRATEGIES = sorted(set(models.STRATEGIES) - {"ref"})
TWO_AXIS_STRATEGIES = [
    n for n in STRATEGIES if shardops.REPLICA_AXIS not in models.STRATEGIES[n].axes
]
STRATEGY_DRAWS_2D = [
    s for s in TWO_AXIS_STRATEGIES for _ in range(1 if s in SEQUENCE_PARALLEL else 2)
]
TWO_AXIS = [(1, 8), (2, 4), (4, 2), (8, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 1)]
# Tiny models: an example's time is the time it takes to compile two programs.
MAX_WIDTH, MAX_SEQUENCE, MAX_VOCAB, MAX_BATCH, MAX_CLASSES = 32, 16, 40, 16, 16
MIN_D_MODEL = 4  # a layer norm over 1 or 2 features is ±1 or bias: chaotic near var ≈ eps
# As in test_models_properties. A GPT at GPT-2's 0.02 has near-uniform attention, and the
# gradients of its queries (~1e-6) are too small to show a bug; at 0.1 every leaf's gradient
# is ≳ 100 × TOL.
INIT_SCALE = 0.1
# The MLP trains at the seed's LR 1.0 (``optimizer("sgd")``). A GPT's steps amplify float32
# rounding more (its layer norms divide by the activations' spread): at LR 1.0 a strategy's
# final params differ from the reference's by up to 0.6 TOL in 3 steps (120 draws), at 0.1 by
# ≤ 0.12 TOL, while every parameter still moves ≫ TOL.
GPT_SGD_LR = 0.1
# Adam steps by m/(√v + ε): where a gradient entry is ~0 it multiplies the entry's rounding by
# up to 1/ε. A GPT has thousands of entries, some within 1e-8 of 0, so at the usual ε = 1e-8
# rounding noise of 1e-10 moves params by ~1e-5 (TOL) in 3 steps; ε = 1e-6 (RoBERTa's) keeps
# that below 1e-7 and is still ≪ the gradients (≳ 1e-5), so Adam stays Adam.
GPT_ADAM_EPS = 1e-6
U = 2.0**-24  # float32 unit roundoff
# The XLA:CPU backend's LLVM optimisations are half of an example's time (two programs, run
# once on tiny arrays). They change nothing a strategy decides: its HLO, collectives included.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


# --- draws


@functools.cache
def param_shapes(net):
    """The params' shapes (``jax.ShapeDtypeStruct`` leaves), from ``net.init`` traced once."""
    return jax.eval_shape(net.init, jax.random.key(0))


def size(draw, low: int, high: int, multiple: int) -> int:
    """A size in [low, high]: 2 times out of 3 a multiple of ``multiple`` (so that a role which
    splits it over ``model`` fits), else any size (uneven ones included)."""
    multiples = range(-(-low // multiple) * multiple, high + 1, multiple)
    if multiples and draw(st.sampled_from([True, True, False])):
        return draw(st.sampled_from(multiples))
    return draw(st.integers(low, high))


def role(draw, splitting_role: str, size: int, model: int) -> str:
    """If ``size`` divides by the model axis, ``splitting_role`` 3 times out of 4, else
    replicated; replicated if it does not divide."""
    if size % model:
        return REPLICATED
    return draw(st.sampled_from([splitting_role] * 3 + [REPLICATED]))


def spell(draw, plan, shapes):
    """The same plan written another way: a layer's role as one role per leaf, or a subtree
    whose leaves share one role as that role once."""
    if isinstance(plan, str):
        if isinstance(shapes, dict) and draw(st.booleans()):
            return dict.fromkeys(shapes, plan)
        return plan
    roles = set(jax.tree.leaves(plan))
    if len(roles) == 1 and draw(st.integers(0, 3)) == 0:
        return roles.pop()
    if isinstance(plan, dict):
        return {key: spell(draw, plan[key], shapes[key]) for key in plan}
    return [spell(draw, p, s) for p, s in zip(plan, shapes, strict=True)]


def gpt_config(draw, sequence_parallel: bool, model: int, data: int):
    """A GPT, a plan valid on a model axis of ``model`` devices, and ``(batch, sequence)``."""
    # Under sp attention must be head-parallel (whole heads per device) and the sequence must
    # split. The head must be column-parallel too: a replicated head under sp fails (its logits
    # cover the device's S/p positions, its labels all S: a shape error inside the loss), so
    # the vocabulary divides there.
    sp = sequence_parallel
    heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if h % model == 0] if sp
                                 else [1, 2, 3, 4, 8]))  # fmt: skip
    d_ff = size(draw, 1, MAX_WIDTH, model)
    vocab = (model * draw(st.integers(-(-2 // model), MAX_VOCAB // model)) if sp
             else size(draw, 2, MAX_VOCAB, model))  # fmt: skip
    seq = (model * draw(st.integers(1, MAX_SEQUENCE // model)) if sp
           else draw(st.integers(1, MAX_SEQUENCE)))  # fmt: skip
    gpt = models.Gpt(
        vocab_size=vocab,
        d_model=heads * draw(st.integers(-(-MIN_D_MODEL // heads), MAX_WIDTH // heads)),
        num_heads=heads,
        num_layers=draw(st.integers(1, 2)),
        context=draw(st.integers(seq, MAX_SEQUENCE)),
        d_ff=d_ff,
    )

    def block():
        mlp = role(draw, COLUMN, d_ff, model)
        return {
            "ln1": REPLICATED,
            "attn": HEAD if sp else role(draw, HEAD, heads, model),
            "ln2": REPLICATED,
            "up": mlp,
            "down": ROW if mlp == COLUMN else REPLICATED,  # a column layer feeds a row layer
        }

    plan = {
        "embed": role(draw, VOCAB, vocab, model),
        "pos": role(draw, VOCAB, gpt.context, model),  # a table too: split by position
        "blocks": [block() for _ in range(gpt.num_layers)],
        "ln_f": REPLICATED,
        "head": COLUMN if sp else role(draw, COLUMN, vocab, model),
    }
    return gpt, plan, (data * draw(st.integers(1, MAX_BATCH // data)), seq)


def mlp_config(draw, model: int, data: int):
    """An MLP, a plan valid on a model axis of ``model`` devices, and ``(batch,)``."""
    depth = draw(st.integers(1, 3))
    hidden = [size(draw, 1, MAX_WIDTH, model) for _ in range(depth - 1)]
    sizes = (draw(st.integers(1, MAX_WIDTH)), *hidden, draw(st.integers(2, MAX_CLASSES)))
    plan = []
    while len(plan) < depth:  # Megatron pairs where the hidden width divides, else replicated
        layer = len(plan)
        if layer + 1 < depth and role(draw, COLUMN, sizes[layer + 1], model) == COLUMN:
            plan += [COLUMN, ROW]
        else:
            plan.append(REPLICATED)
    return models.Mlp(sizes), plan, (data * draw(st.integers(1, MAX_BATCH // data)),)


THREE_AXIS = [(2, 2, 2), (2, 4, 1), (1, 2, 4), (2, 1, 4), (4, 2, 1), (2, 2, 1), (1, 1, 8)]
AXIS_NAMES = (shardops.REPLICA_AXIS, shardops.DATA_AXIS, shardops.MODEL_AXIS)


@st.composite
def layouts(draw, mesh: dict, sequence: bool):
    """A layout of the mesh's axes drawn kind by kind: each axis carries dp, fsdp, zero1, tp
    or nothing (at most one tp; zero1 alone among the batch kinds), sp where tp is."""
    kinds = {}
    for axis in mesh:
        kinds[axis] = draw(st.sampled_from(["dp", "fsdp", "zero1", "tp", None]))
    tp = [a for a, k in kinds.items() if k == "tp"]
    zero1 = [a for a, k in kinds.items() if k == "zero1"]
    if zero1:  # zero1 composes with tp only
        kinds = {a: ("zero1" if k in ("dp", "fsdp") else k) for a, k in kinds.items()}
    rules = {k: tuple(a for a, kk in kinds.items() if kk == k) for k in ("dp", "fsdp", "zero1")}
    tp_axis = tp[0] if tp else None
    if len(tp) > 1:  # one tp axis: the others replicate
        rules["dp"] = rules["dp"] if zero1 else rules["dp"] + tuple(tp[1:])
    sp = bool(tp_axis) and sequence and draw(st.booleans())
    return models.Strategy("drawn", **rules, tp=tp_axis, sp=sp)


@st.composite
def configurations(draw):
    # A GPT compiles 4× slower than an MLP: the sequence-parallel strategies (GPT only) are
    # drawn half as often as the others, and the others draw the MLP 2 times out of 3. One
    # draw in three is a 3-axis mesh (replica × data × model) with a preset for it or a
    # layout drawn axis by axis.
    if draw(st.integers(0, 2)) == 0:
        mesh = dict(zip(AXIS_NAMES, draw(st.sampled_from(THREE_AXIS)), strict=True))
        kind = draw(st.sampled_from(["mlp", "mlp", "gpt"]))
        presets = [n for n in STRATEGIES if kind == "gpt" or n not in SEQUENCE_PARALLEL]
        if draw(st.booleans()):
            strategy = draw(layouts(mesh, kind == "gpt"))
        else:
            strategy = models.STRATEGIES[draw(st.sampled_from(presets))]
    else:
        name = draw(st.sampled_from(STRATEGY_DRAWS_2D))
        kind = "gpt" if name in SEQUENCE_PARALLEL else draw(st.sampled_from(["mlp", "mlp", "gpt"]))
        strategy = models.STRATEGIES[name]
        meshes = [{"data": d, "model": m} for d, m in TWO_AXIS]
        if len(strategy.axes) == 1:
            meshes += [{strategy.axes[0]: n} for n in (1, 2, 4, 8)]
        mesh = draw(st.sampled_from(meshes))
    model = mesh.get(strategy.tp, 1) if strategy.tp else 1  # off the tp axis roles are moot
    data = int(np.prod([mesh.get(a, 1) for a in strategy.batch_axes]))
    if kind == "gpt":
        net, plan, shape = gpt_config(draw, strategy.sp, model, data)
    else:
        net, plan, shape = mlp_config(draw, model, data)
    plan = spell(draw, plan, param_shapes(net))
    opt = draw(st.sampled_from(["sgd", "sgd", "adam"]))
    remat = bool(strategy.fsdp) and draw(st.sampled_from([False, False, False, True]))
    return strategy, mesh, net, plan, shape, opt, remat


# --- the check


def init(net, seed: int):
    """Params shaped like ``net.init``'s, every leaf drawn: normal × the init scale, norm
    scales around 1. Biases and norms are not 0 or 1, so a layer that mishandles one (adds a
    bias on every device, say) shows in the first loss. Drawn by numpy: ``net.init`` run
    eagerly compiles each of its random ops (half an example's time)."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        x = rng.normal(0.0, INIT_SCALE, shape.shape).astype(np.float32)
        return x + 1 if jax.tree_util.keystr(path).endswith("['scale']") else x

    return jax.tree_util.tree_map_with_path(leaf, param_shapes(net))


def batches(net, shape, seed: int):
    """``STEPS`` global batches: token ids and next tokens ``[STEPS, B, S]`` for the GPT;
    inputs in [0, 1) ``[STEPS, B, D]`` and one-hot labels ``[STEPS, B, C]`` for the MLP."""
    rng = np.random.default_rng(seed)
    if isinstance(net, models.Gpt):
        ids = rng.integers(0, net.vocab_size, (2, STEPS, *shape), dtype=np.int32)
        return ids[0], ids[1]
    xs = rng.random((STEPS, *shape, net.sizes[0]), dtype=np.float32)
    ys = np.eye(net.sizes[-1], dtype=np.float32)[rng.integers(0, net.sizes[-1], (STEPS, *shape))]
    return xs, ys


def optimizer_for(net, opt: str) -> optax.GradientTransformation:
    """The MLP's are the suite's (``_model_checks.optimizer``); the GPT's, see GPT_SGD_LR and
    GPT_ADAM_EPS."""
    if not isinstance(net, models.Gpt):
        return optimizer(opt)
    return optax.sgd(GPT_SGD_LR) if opt == "sgd" else optax.adam(1e-3, eps=GPT_ADAM_EPS)


_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
PROGRAMS_KEPT = 16  # hypothesis revisits recent configurations; compiled programs hold memory


def program(strategy, mesh_shape, net, plan, opt: str, remat: bool):
    """The setup and one jitted program of it: the first batch's gradients
    (``setup.loss_and_grads``), then ``STEPS`` steps of ``setup.step`` scanned. Built once per
    configuration: hypothesis revisits a configuration with new seeds, and the examples of one
    model (and batch shape) share the reference's."""
    key = (strategy, str(mesh_shape), net, str(plan), opt, remat)
    if key not in _PROGRAMS:
        mesh = None if mesh_shape is None else shardops.make_mesh(mesh_shape)
        setup = models.build(strategy, mesh, optimizer=optimizer_for(net, opt), model=net,
                             plan=plan, remat=remat)  # fmt: skip

        def run(state, xs, ys):
            grads = None
            if not remat:  # remat's jit carries compiler options, so it cannot be nested
                _, grads = setup.loss_and_grads(state.params, xs[0], ys[0])
            state, losses = jax.lax.scan(lambda s, batch: setup.step(s, *batch), state, (xs, ys))
            return grads, state.params, losses

        _PROGRAMS[key] = setup, jax.jit(run, compiler_options=COMPILER_OPTIONS)
        while len(_PROGRAMS) > PROGRAMS_KEPT:
            _PROGRAMS.popitem(last=False)
    _PROGRAMS.move_to_end(key)
    return _PROGRAMS[key]


def trajectory(setup, run, params, xs, ys):
    """``(first gradients, final params, losses)`` of a ``program``, on the host."""
    state = setup.shard(params)
    if setup.mesh is not None:
        layout = NamedSharding(setup.mesh, P(None, *setup.batch_spec))  # [STEPS, B_data, ...]
        xs, ys = jax.device_put(xs, layout), jax.device_put(ys, layout)
    grads, final, losses = run(state, xs, ys)
    if grads is None:
        _, grads = setup.loss_and_grads(state.params, *setup.place_batch(xs[0], ys[0]))
    return setup.gather(grads), setup.gather(final), np.asarray(losses, np.float64)


def worst(a, b, *, skip=()) -> tuple[float, str]:
    """``(max |a − b|, the leaf)`` over two trees laid out alike, but the leaves in ``skip``."""
    out = (0.0, "")
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b),
                            strict=True):  # fmt: skip
        name = jax.tree_util.keystr(path)
        if not name.endswith(skip):
            err = float(np.max(np.abs(np.asarray(x, np.float64) - y), initial=0.0))
            out = max(out, (err, name))
    return out


def floor_example(name: str):
    """A fixed example of preset ``name`` on the 2×4 mesh (2×2×2 with a replica axis): a GPT
    with the default plan under sequence parallelism (Adam), else an MLP with a column→row pair
    (SGD). Hypothesis draws cluster, so these make sure each preset runs in every profile."""
    strategy = models.STRATEGIES[name]
    mesh = ({"replica": 2, "data": 2, "model": 2} if shardops.REPLICA_AXIS in strategy.axes
            else {"data": 2, "model": 4})  # fmt: skip
    if name in SEQUENCE_PARALLEL:
        gpt = models.Gpt(vocab_size=12, d_model=8, num_heads=4, num_layers=1, context=8, d_ff=12)
        return strategy, mesh, gpt, gpt.plan(), (4, 8), "adam", False
    return strategy, mesh, models.Mlp((6, 8, 5)), [COLUMN, ROW], (8,), "sgd", False


# Layouts no preset has, on 2×2×2: the kinds on other axes than their usual names.
DRAWN_FLOOR = [
    (models.Strategy("drawn", dp="model", fsdp="replica", tp="data"), models.Mlp((6, 8, 5)),
     [COLUMN, ROW], (8,), "adam"),
    (models.Strategy("drawn", zero1=("model", "replica"), tp="data"), models.Mlp((6, 8, 5)),
     [COLUMN, ROW], (8,), "adam"),
]  # fmt: skip


def floor_examples(test):
    for strategy in STRATEGIES:
        test = example(config=floor_example(strategy), seed=0)(test)
    mesh = {"replica": 2, "data": 2, "model": 2}
    for strategy, net, plan, shape, opt in DRAWN_FLOOR:
        test = example(config=(strategy, mesh, net, plan, shape, opt, False), seed=1)(test)
    return test


# A quarter of the profile's examples: 10 drawn in CI, 50 under SHARDOPS_FULL=1 (each draws a
# new model and compiles it twice), and one fixed example per strategy (CI time).
@settings(max_examples=max(settings.default.max_examples // 4, 1))
@given(config=configurations(), seed=st.integers(0, 2**16))
@floor_examples
def test_any_strategy_and_plan_trains_like_the_reference(config, seed):
    strategy, mesh_shape, net, plan, shape, opt, remat = config
    event(f"strategy {strategy.name}")
    event(f"mesh axes {len(mesh_shape)}")
    event(f"model {'gpt' if isinstance(net, models.Gpt) else 'mlp'}")
    event(f"optimizer {opt}")
    note(f"{strategy.table()}\non {mesh_shape}: {net.name}, batch {shape}, {opt}, remat={remat}")
    note(f"plan {plan}")

    params, (xs, ys) = init(net, seed), batches(net, shape, seed)
    with ThreadPoolExecutor(1) as pool:  # the reference compiles while the strategy does
        reference = pool.submit(
            lambda: trajectory(*program("ref", None, net, None, opt, False), params, xs, ys)
        )
        grads, final, losses = trajectory(
            *program(strategy, mesh_shape, net, plan, opt, remat), params, xs, ys
        )
        ref_grads, ref_final, ref_losses = reference.result()

    tol = TOL[opt]
    # The loss is a float32 mean of n terms ≥ 0 (the positions of a GPT batch, the batch ×
    # classes of the MLP's): summed in another order (per device, then psum) it moves by up
    # to (n − 1)·u·loss each side, the bound of any summation order. A GPT's loss (≈ ln V)
    # over 16 × 16 positions needs it; TOL's 1e-6 covers the terms' own differences.
    n = ys[0].size
    loss_tol = tol["loss"] + 2 * (n - 1) * U * ref_losses
    assert np.all(np.abs(losses - ref_losses) <= loss_tol), (
        f"losses {losses} ≠ reference {ref_losses} (tolerance {loss_tol})"
    )
    err, where = worst(grads, ref_grads)
    assert err <= tol["grads"], f"first gradient {where}: max |sharded − ref| = {err:.2e}"
    err, where = worst(final, ref_final)
    assert err <= tol["params"], f"final params {where}: max |sharded − ref| = {err:.2e}"


# --- plans that cannot run: errors before anything is traced


GPT = models.Gpt(vocab_size=12, d_model=8, num_heads=4, num_layers=2, context=8, d_ff=30)
MLP = models.Mlp((8, 30, 10))


def gpt_plan(embed=VOCAB, head=COLUMN, up=COLUMN, down=ROW, blocks=None):
    """``GPT``'s plan with these roles (``blocks``: instead, the whole list of blocks)."""
    block = {"ln1": REPLICATED, "attn": HEAD, "ln2": REPLICATED, "up": up, "down": down}
    return {"embed": embed, "pos": REPLICATED, "ln_f": REPLICATED, "head": head,
            "blocks": [dict(block) for _ in range(GPT.num_layers)] if blocks is None
            else blocks}  # fmt: skip


def build_tp(net, plan, model: int):
    return models.build("tp", shardops.make_mesh({"model": model}), optimizer=optax.sgd(0.1),
                        model=net, plan=plan)  # fmt: skip


@pytest.mark.parametrize(
    ("net", "plan", "model", "leaf", "dim"),
    [
        (GPT, gpt_plan(), 4, "['blocks'][0]['down']['w']", 0),  # d_ff 30 on 4: row
        (GPT, gpt_plan(), 4, "['blocks'][0]['up']['b']", 0),  # and column
        (GPT, gpt_plan(blocks=REPLICATED, head=REPLICATED), 8, "['embed']['table']", 0),  # 12 on 8
        (GPT, gpt_plan(blocks=REPLICATED, embed=REPLICATED), 8, "['head']['w']", 1),
        (MLP, [COLUMN, ROW], 4, "[0]['b']", 0),
    ],
    ids=["gpt-row", "gpt-column", "gpt-vocab", "gpt-head", "mlp-column"],
)  # fmt: skip
def test_a_role_that_splits_an_uneven_dim_pads_it_and_equals_the_reference(net, plan, model,
                                                                            leaf, dim):  # fmt: skip
    """Every role over a dim the model axis does not divide: the leaf is stored padded to a
    multiple of the axis, and the loss and gradients (in the model's own shapes) equal the
    unsharded model's."""
    setup = build_tp(net, plan, model)
    stored = dict(jax.tree_util.tree_leaves_with_path(setup.padding.stored, is_leaf=is_shape))
    logical = dict(jax.tree_util.tree_leaves_with_path(setup.padding.logical, is_leaf=is_shape))
    key = next(k for k in stored if jax.tree_util.keystr(k) == leaf)
    assert logical[key][dim] % model and stored[key][dim] == shardops.padded_size(
        logical[key][dim], model
    )
    ref = models.build("ref", optimizer=optax.sgd(0.1), model=net, plan=plan)
    params = net.init(jax.random.key(0))
    if isinstance(net, models.Mlp):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((8, 8)).astype(np.float32)
        y = np.eye(10, dtype=np.float32)[rng.integers(0, 10, 8)]
    else:
        tokens = np.random.default_rng(0).integers(0, 12, (4, 9)).astype(np.int32)
        x, y = tokens[:, :-1], tokens[:, 1:]
    state = setup.shard(params)
    loss, grads = setup.loss_and_grads(state.params, *setup.place_batch(x, y))
    want_loss, want_grads = ref.loss_and_grads(params, x, y)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-6)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(setup.gather(grads)),
                                 jax.tree.leaves(want_grads), strict=True):  # fmt: skip
        np.testing.assert_allclose(got, want, atol=2e-7, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    ("net", "plan", "message"),
    [
        (MLP, [COLUMN, ROW, REPLICATED], r"plan \(the top level\): 3 role\(s\) for 2 parameter subtrees"),
        (MLP, [REPLICATED], r"plan \(the top level\): 1 role\(s\) for 2"),
        (GPT, {k: v for k, v in gpt_plan().items() if k != "head"},
         r"plan \(the top level\): no role for \['head'\]; the parameters there have keys"),
        (GPT, gpt_plan(blocks=gpt_plan()["blocks"][:1]), r"plan\['blocks'\]: 1 role\(s\) for 2"),
        (GPT, gpt_plan(up={"w": COLUMN}), r"plan\['blocks'\]\[0\]\['up'\]: no role for \['b'\]"),
        (GPT, gpt_plan(up={"w": COLUMN, "b": COLUMN, "bias": COLUMN}),
         r"plan\['blocks'\]\[0\]\['up'\]: roles for \['bias'\], which the parameters do not have"),
        (GPT, gpt_plan(up=[COLUMN]), r"plan\['blocks'\]\[0\]\['up'\]: a list where the parameters have dict"),
    ],
    ids=["mlp-long", "mlp-short", "gpt-no-head", "gpt-one-block", "gpt-leaf-missing",
         "gpt-leaf-extra", "gpt-list-for-dict"],
)  # fmt: skip
def test_a_plan_that_is_not_a_prefix_of_the_params_is_refused(net, plan, message):
    """The error names the first place the plan does not fit, and what it lacks or adds."""
    with pytest.raises(ValueError, match=message):
        build_tp(net, plan, 2)


def test_an_unknown_role_names_its_place_in_the_plan():
    with pytest.raises(ValueError, match=re.escape("plan['blocks'][0]['up']['b']: unknown role "
                                                   "'colum'; choose one of")):  # fmt: skip
        build_tp(GPT, gpt_plan(up="colum"), 2)


def test_stacked_inside_stacked_is_refused():
    from shardops_models.strategies.plan import leaf_roles

    shapes = {"w": (2, 3, 4, 4), "b": (2, 3, 4)}
    with pytest.raises(ValueError, match=r"stacked\(...\) inside stacked\(...\) is not supported"):
        leaf_roles(models.stacked(models.stacked({"w": COLUMN, "b": COLUMN})), shapes)
    roles = leaf_roles(models.stacked({"w": COLUMN, "b": COLUMN}), shapes)
    assert roles == {"w": "column", "b": "column"} and roles["w"].layer == "column"
