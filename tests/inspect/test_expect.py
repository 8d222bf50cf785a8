"""``shardops.testing.expect_collectives``: per-pass byte budgets worked out by hand, the diff it
prints when they differ, the pass of each compiled collective, and mutants of that
classification that the checks catch.

Bytes are V (``shardops.inspect.ledger``): the tensor one group of devices reduces or assembles. Every
expected number below is derived in the comment above it, never read from the ledger.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _mutants import mutant, training
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models
from shardops.inspect import _hlo, _passes
from shardops.testing import expect_collectives

AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"
DATA, MODEL = ("data",), ("model",)

# --- The column + row tensor-parallel MLP on data=4 × model=2: x[16, 8] split over data (4 rows
# each), w1[8, 32] and b1[32] split over model (16 columns each), w2[32, 8] split over model
# along its rows, b2[8] replicated.
# Forward: the row layer's psum over model of y[4, 8] f32 = 128 bytes (the column layer needs no
# forward collective).
TP_FORWARD = {(AR, MODEL): 128}
# value_and_grad of sum(y²): forward also sums the loss over data, one f32 = 4 bytes (XLA
# inserts it outside the shard_map). Backward: every parameter is replicated over data and
# meets a data-split batch, so its gradient is summed over data: w1 block [8, 16] 512 + b1
# [16] 64 + w2 block [16, 8] 512 + b2 [8] 32 = 1,120. x is not differentiated: no dx psum.
TP_GRAD_FORWARD = {(AR, MODEL): 128, (AR, DATA): 4}
TP_GRAD_BACKWARD = {(AR, DATA): 1_120}

# --- The MLP 32-64-10 under fsdp (gather_weights), batch 16. Leaves: w1[32, 64] 8,192, b1[64]
# 256, w2[64, 10] 2,560, b2[10] 40 bytes. Forward: w1, b1, w2 gathered over data (8,192 + 256
# + 2,560 = 11,008) and the loss summed over data (4). Backward: the same 11,008 reduce-
# scattered; b2[10] does not divide by 4 or 8, stays replicated, and its gradient is
# all-reduced (40).
FSDP_FORWARD = {(AG, DATA): 11_008, (AR, DATA): 4}
FSDP_BACKWARD = {(RS, DATA): 11_008, (AR, DATA): 40}
# The global-norm clip below: one psum over data of the split leaves' squared norm, one f32.
CLIP_OPTIMIZER = {(AR, DATA): 4}
# remat re-gathers w2 (2,560) in the backward; layer 0's input is the data, so w1 is not needed.
REMAT_BACKWARD = {(AG, DATA): 2_560, (RS, DATA): 11_008, (AR, DATA): 40}

# --- A hand-written ZeRO-style step on data=4 × model=2 (model holds replicas): w[16, 8]
# split over data. Forward: all_gather of w (16·8·4 = 512) and the loss psum (4); backward:
# psum_scatter of dw (V = 512); optimizer: the psum of the squared gradient norm (4).
HAND_FORWARD = {(AG, DATA): 512, (AR, DATA): 4}
HAND_BACKWARD = {(RS, DATA): 512}
HAND_OPTIMIZER = {(AR, DATA): 4}


def clip_by_global_norm_over_data(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` for gradients split over data inside ``shard_map``: the
    squares of the split leaves are summed over data (optax's own would clip each device by
    the norm of its shard)."""

    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None):
        leaves = jax.tree.leaves(updates)
        split = [g for g in leaves if "data" in jax.typeof(g).manual_axis_type.varying]
        whole = [g for g in leaves if "data" not in jax.typeof(g).manual_axis_type.varying]
        squares = lax.psum(sum(jnp.sum(g * g) for g in split), "data")  # AllReduce of f32[]
        norm = jnp.sqrt(squares + sum(jnp.sum(g * g) for g in whole))
        scale = jnp.minimum(1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * scale, updates), state

    return optax.GradientTransformation(init, update)


@pytest.fixture(scope="module")
def mesh():
    return shardops.make_mesh({"data": 4, "model": 2})


@pytest.fixture(scope="module")
def tp(mesh):
    """``(mlp, params, x)``: the column + row MLP on global arrays placed on ``mesh``."""

    def place(shape, spec):
        return jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))

    params = {
        "w1": place((8, 32), P(None, "model")), "b1": place((32,), P("model")),
        "w2": place((32, 8), P("model", None)), "b2": place((8,), P()),
    }  # fmt: skip
    x = place((16, 8), P("data"))

    def mlp(params, x):
        h = shardops.column_parallel_dense(x, params["w1"], params["b1"], mesh=mesh,
                                           batch_axis="data")  # fmt: skip
        return shardops.row_parallel_dense(jax.nn.relu(h), params["w2"], params["b2"],
                                           mesh=mesh, batch_axis="data")  # fmt: skip

    return mlp, params, x


@pytest.fixture(scope="module")
def tp_grad(tp):
    """The ledger of ``value_and_grad`` of the MLP's ``sum(y²)``, compiled once."""
    mlp, params, x = tp

    def loss(params, x):
        return jnp.sum(mlp(params, x) ** 2)

    return expect_collectives(jax.value_and_grad(loss), params, x)  # nothing checked yet


def fsdp_step(mesh_shape, optimizer, **kwargs):
    mesh = shardops.make_mesh(mesh_shape)
    setup = models.build("fsdp", mesh, optimizer=optimizer, sizes=(32, 64, 10),
                         fsdp_dense="gather_weights", **kwargs)  # fmt: skip
    x = np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(16, 32)
    y = np.eye(10, dtype=np.float32)[np.arange(16) % 10]
    return setup.train_step, setup.init(jax.random.key(0)), *setup.place_batch(x, y)


CLIPPED_SGD = optax.chain(clip_by_global_norm_over_data(1.0), optax.sgd(0.1))


@pytest.fixture(scope="module")
def fsdp_clip():
    """The ledger of an fsdp train step on data=8 whose optimizer clips by the global norm."""
    return expect_collectives(*fsdp_step({"data": 8}, CLIPPED_SGD))  # nothing checked yet


# --- Budgets that hold.


def test_tp_layer_forward(tp):
    mlp, params, x = tp
    led = expect_collectives(mlp, params, x, forward=TP_FORWARD, backward={}, optimizer={})
    assert isinstance(led, shardops.inspect.Ledger)
    assert led.totals(pass_="forward") == TP_FORWARD and led.totals() == TP_FORWARD


def test_tp_value_and_grad_separates_forward_and_backward(tp_grad):
    led = expect_collectives(
        tp_grad, forward=TP_GRAD_FORWARD, backward=TP_GRAD_BACKWARD, optimizer={}
    )
    assert led.totals() == {(AR, MODEL): 128, (AR, DATA): 1_124}  # both passes, summed
    # XLA combined the loss sum (forward) and the gradients (backward) into one tuple.
    (combined,) = [c for c in led.collectives if c.axes == DATA]
    assert sorted(combined.passes) == ["backward"] * 4 + ["forward"]
    assert combined.pass_ == "mixed" and sum(combined.element_bytes) == combined.bytes == 1_124
    assert "forward+backward" in str(led)


def test_fsdp_train_step_gathers_forward_scatters_backward_clips_in_the_optimizer(fsdp_clip):
    led = expect_collectives(
        fsdp_clip, forward=FSDP_FORWARD, backward=FSDP_BACKWARD, optimizer=CLIP_OPTIMIZER
    )
    by_pass = led.by_pass()
    assert by_pass == {"forward": FSDP_FORWARD, "backward": FSDP_BACKWARD,
                       "optimizer": CLIP_OPTIMIZER}  # fmt: skip
    # The optimizer's psum went into one tuple with b2's gradient and the loss: split by element.
    (combined,) = [c for c in led.collectives if c.kind == AR]
    assert sorted(zip(combined.passes, combined.element_bytes, strict=True)) == [
        ("backward", 40), ("forward", 4), ("optimizer", 4)
    ]  # fmt: skip
    assert "optimizer" in str(led)


def test_fsdp_remat_regathers_in_the_backward():
    led = expect_collectives(
        *fsdp_step({"data": 4}, optax.sgd(0.1), remat=True),
        forward=FSDP_FORWARD, backward=REMAT_BACKWARD, optimizer={},
    )  # fmt: skip
    assert led.mesh.shape == {"data": 4}  # inferred from the arguments' shardings


def test_hand_written_step_with_an_optimizer_scope(mesh):
    def step(w_block, x_block):  # w[16_data, 8], x[16_data, 16]
        def local_loss(w_block):
            w = lax.all_gather(w_block, "data", tiled=True)  # w[16, 8]
            return jnp.sum((x_block @ w) ** 2) / 16  # this device's share of the mean

        loss, dw_block = jax.value_and_grad(local_loss)(w_block)  # dw: ReduceScatter
        loss = lax.psum(loss, "data")
        with jax.named_scope(shardops.inspect.OPTIMIZER_SCOPE):
            norm = jnp.sqrt(lax.psum(jnp.sum(dw_block * dw_block), "data"))
            return w_block - 0.1 * dw_block * jnp.minimum(1.0, 1.0 / norm), loss

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data")),
                               out_specs=(P("data"), P())))  # fmt: skip
    w = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))
    x = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P("data")))
    expect_collectives(fn, w, x, forward=HAND_FORWARD, backward=HAND_BACKWARD,
                       optimizer=HAND_OPTIMIZER)  # fmt: skip
    with pytest.raises(
        AssertionError, match=r"optimizer .*all-reduce +data +- +4 +\+4 +unexpected"
    ):
        expect_collectives(fn, w, x, optimizer={})


def test_none_leaves_a_pass_unchecked(tp_grad):
    expect_collectives(tp_grad, forward=TP_GRAD_FORWARD)  # backward's 1,120 bytes unchecked
    expect_collectives(tp_grad)  # nothing checked: always passes
    with pytest.raises(AssertionError, match=r"not checked: forward \(132 bytes\)"):
        expect_collectives(tp_grad, backward={})


# --- Failures and their diff.


def test_wrong_bytes_show_the_diff(tp_grad):
    with pytest.raises(AssertionError) as info:
        expect_collectives(tp_grad, forward=TP_GRAD_FORWARD, backward={(AR, DATA): 1_000})
    text = str(info.value)
    row = next(line for line in text.splitlines() if "differs" in line)
    assert row.split()[:7] == ["backward", AR, "data", "1,000", "1,120", "+120", "differs"]
    # the layers and shapes behind the compiled bytes: each layer's weight and bias gradients
    assert "column_parallel_dense: f32[1,16], f32[8,16]" in row
    assert "row_parallel_dense: f32[1,8], f32[16,8]" in row
    assert "1 of 3 rows" in text and "passes checked: forward, backward" in text
    assert "  backward={('all-reduce', ('data',)): 1_120}," in text  # to paste


def test_a_reshard_nobody_asked_for_is_unexpected(tp):
    mlp, params, x = tp
    # The output is asked for replicated, but the layer leaves it split over data: XLA gathers
    # y[16, 8] over data (512 bytes) after the shard_map.
    replicated = NamedSharding(x.sharding.mesh, P())
    fn = jax.jit(mlp, out_shardings=replicated)
    with pytest.raises(AssertionError) as info:
        expect_collectives(fn, params, x, forward=TP_FORWARD)
    lines = str(info.value).splitlines()
    (row,) = [line for line in lines if "unexpected" in line]
    assert row.split()[:7] == ["forward", AG, "data", "-", "512", "+512", "unexpected"]
    assert "f32[16,8]" in row
    (row,) = [line for line in lines if line.split()[:3] == ["forward", AR, "model"]]
    assert row.split() == ["forward", AR, "model", "128", "128", "0", "ok",
                           "row_parallel_dense:", "f32[4,8]"]  # fmt: skip


def test_a_missing_collective(tp):
    mlp, params, x = tp
    # A column layer with gather_input would all-gather x over model; this one does not.
    with pytest.raises(AssertionError) as info:
        expect_collectives(mlp, params, x, forward={**TP_FORWARD, (AG, MODEL): 256})
    (row,) = [line for line in str(info.value).splitlines() if "missing" in line]
    assert row.split() == ["forward", AG, "model", "256", "0", "-256", "missing", "-"]


def test_bytes_declared_in_the_wrong_pass_fail(tp_grad, fsdp_clip):
    with pytest.raises(AssertionError, match=r"backward +all-reduce +data +- +1,120 +\+1,120 +unexpected"):  # fmt: skip
        expect_collectives(tp_grad, forward={**TP_GRAD_FORWARD, (AR, DATA): 1_124}, backward={})
    # fsdp's gathers declared in the backward, its reduce-scatters in the forward.
    with pytest.raises(AssertionError) as info:
        expect_collectives(fsdp_clip, forward={(RS, DATA): 11_008, (AR, DATA): 4},
                           backward={(AG, DATA): 11_008, (AR, DATA): 40})  # fmt: skip
    statuses = [[*line.split()[:2], line.split()[6]] for line in str(info.value).splitlines()
                if line.split()[:1] in (["forward"], ["backward"])]  # fmt: skip
    assert ["forward", AG, "unexpected"] in statuses and ["forward", RS, "missing"] in statuses
    assert ["backward", RS, "unexpected"] in statuses and ["backward", AG, "missing"] in statuses


def test_the_optimizer_pass_is_separate(fsdp_clip):
    # The optimizer's 4 bytes counted with the forward's loss sum: wrong.
    with pytest.raises(AssertionError, match=r"forward +all-reduce +data +8 +4 +-4 +differs"):
        expect_collectives(fsdp_clip, forward={(AG, DATA): 11_008, (AR, DATA): 8},
                           backward=FSDP_BACKWARD, optimizer={})  # fmt: skip
    with pytest.raises(AssertionError, match=r"optimizer +all-reduce +data +- +4 +\+4 +unexpected +optimizer: f32\[\]"):  # fmt: skip
        expect_collectives(fsdp_clip, optimizer={})


def test_the_models_optimizer_runs_under_the_optimizer_scope():
    step, state, x, y = fsdp_step({"data": 2}, optax.adam(1e-3))
    text = step.lower(state, x, y).as_text(debug_info=True)
    # adam's arithmetic and apply_updates carry the scope (locations are relative names)
    assert f'loc("{shardops.inspect.OPTIMIZER_SCOPE}/sqrt"' in text
    assert f'loc("{shardops.inspect.OPTIMIZER_SCOPE}/add"' in text
    expect_collectives(step, state, x, y, optimizer={})  # adam moves nothing: the state is split


# --- The pass of each element of a combined collective, on hand-written HLO.


def combined_line(op_name, shapes="f32[], f32[8,8]{1,0}, f32[4]{0}"):
    return (
        f"%ar = ({shapes}) all-reduce(%a, %b, %c), channel_id=1, "
        "replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%add, "
        f'metadata={{op_name="{op_name}"}}'
    )


def test_a_combined_name_is_split_element_by_element(mesh):
    name = (
        "jit(step)/shard_map/(psum:transpose(jvp(shardops.row_parallel_dense))/psum:optimizer/psum)"
    )
    (c,) = shardops.inspect.hlo_collectives(combined_line(name), mesh)
    assert c.op_names == (
        "jit(step)/shard_map/psum",
        "jit(step)/shard_map/transpose(jvp(shardops.row_parallel_dense))/psum",
        "jit(step)/shard_map/optimizer/psum",
    )
    assert c.passes == ("forward", "backward", "optimizer") and c.pass_ == "mixed"
    assert c.element_bytes == (4, 256, 16) and c.bytes == 276
    led = shardops.inspect.Ledger(mesh, (c,), ())
    assert led.by_pass() == {"forward": {(AR, DATA): 4}, "backward": {(AR, DATA): 256},
                             "optimizer": {(AR, DATA): 16}}  # fmt: skip
    expect_collectives(led, forward={(AR, DATA): 4}, backward={(AR, DATA): 256},
                       optimizer={(AR, DATA): 16})  # fmt: skip


def test_a_combined_name_that_cannot_be_split_is_mixed(mesh):
    # Two names for three elements: the bytes cannot be assigned to passes.
    name = "jit(step)/shard_map/(psum:transpose(jvp())/psum)"
    (c,) = shardops.inspect.hlo_collectives(combined_line(name), mesh)
    assert c.passes == ("mixed",) * 3
    led = shardops.inspect.Ledger(mesh, (c,), ())
    assert led.by_pass()["mixed"] == {(AR, DATA): 276}
    with pytest.raises(AssertionError, match=r"mixed +all-reduce +data +- +276 +\+276 +mixed"):
        expect_collectives(led, forward={}, backward={})
    # Names that agree on the pass still give it.
    (c,) = shardops.inspect.hlo_collectives(
        combined_line("jit(f)/(transpose(jvp(a))/psum:transpose(jvp(b))/psum)"), mesh
    )
    assert c.passes == ("backward",) * 3


@pytest.mark.parametrize(
    ("op_name", "pass_", "scopes"),
    [
        ("jit(f)/shard_map/jvp(shardops.row_parallel_dense)/psum_invariant", "forward",
         ("shardops.row_parallel_dense",)),
        ("jit(f)/shard_map/transpose(jvp(shardops.row_parallel_dense))/psum", "backward",
         ("shardops.row_parallel_dense",)),
        ("jit(f)/shard_map/transpose(jvp(shardops.row_parallel_dense))/because.row_bias[model]/psum",
         "backward", ("shardops.row_parallel_dense",)),  # a reason is not a layer
        ("jit(run)/shard_map/transpose(jvp(jvp()))/checkpoint/rematted_computation/all_gather",
         "backward", ()),
        ("jit(run)/shard_map/optimizer/psum_invariant", "optimizer", ("optimizer",)),
        ("jit(step)/jit(optimizer)/psum", "optimizer", ("optimizer",)),
        ("jit(f)/transpose_block/psum", "forward", ("transpose_block",)),  # a scope, not autodiff
        ("jit(f)/optimizers/psum", "forward", ("optimizers",)),
        ("", "forward", ()),  # no metadata: a reshard XLA inserted
    ],
)  # fmt: skip
def test_pass_of_an_op_name(op_name, pass_, scopes):
    assert shardops.inspect.pass_of(op_name) == pass_
    assert _passes.scopes_of(op_name) == scopes


# --- Bad input.


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"forward": {("allreduce", MODEL): 128}}, ValueError,
         r"forward\[\('allreduce', \('model',\)\)\]: kind must be one of \('all-reduce'"),
        ({"backward": {(AR, "model"): 128}}, TypeError,
         r"backward\[.*axes must be a tuple of mesh axis names; got the string 'model'. Write \('model',\)"),
        ({"forward": {(AR, ("tensor",)): 128}}, ValueError,
         r"axes \('tensor',\) name 'tensor', not an axis of the mesh \{'data': 4, 'model': 2\}"),
        ({"forward": {(AR, ("model", "data")): 128}}, ValueError,
         r"must be distinct and in mesh order, as the ledger keys them; write \('data', 'model'\)"),
        ({"forward": {(AR, ()): 128}}, TypeError, r"axes must be a non-empty tuple"),
        ({"optimizer": {(AR, MODEL): -1}}, ValueError,
         r"optimizer\[.*bytes must be an int ≥ 0 \(V, the full tensor's bytes\); got -1"),
        ({"forward": {(AR, MODEL): 128.0}}, TypeError, r"got 128.0 \(float\)"),
        ({"forward": {(AR, MODEL): True}}, TypeError, r"got True \(bool\)"),
        ({"forward": {AR: 128}}, TypeError, r"a key must be a \(kind, axes\) pair"),
        ({"forward": [((AR, MODEL), 128)]}, TypeError,
         r"forward must be a dict \{\(kind, axes\): bytes\} \(or None .*got list"),
        ({"mesh": {"data": 4}}, TypeError, r"mesh must be a jax.sharding.Mesh; got dict"),
    ],
)  # fmt: skip
def test_bad_expectations(tp, kwargs, error, match):
    mlp, params, x = tp
    with pytest.raises(error, match=match):
        expect_collectives(mlp, params, x, **kwargs)


def test_no_mesh_to_infer(tp, mesh):
    mlp, params, _ = tp
    x = np.ones((16, 8), np.float32)  # not placed; params are: their mesh is used
    expect_collectives(mlp, params, x, forward=TP_FORWARD)
    unplaced = jax.tree.map(np.asarray, params)
    with pytest.raises(ValueError, match=r"no argument is placed with a NamedSharding.*pass mesh="):
        expect_collectives(mlp, unplaced, x, forward=TP_FORWARD)
    expect_collectives(mlp, unplaced, x, forward=TP_FORWARD, mesh=mesh)
    other = jax.device_put(x, NamedSharding(shardops.make_mesh({"data": 8}), P("data")))
    with pytest.raises(ValueError, match=r"live on 2 different meshes .*pass mesh="):
        expect_collectives(mlp, params, other)


def test_a_ledger_takes_no_arguments(tp_grad, mesh):
    with pytest.raises(TypeError, match="fn is a Ledger .*pass no arguments and no mesh"):
        expect_collectives(tp_grad, mesh=mesh)


def test_totals_of_a_pass(tp_grad):
    with pytest.raises(ValueError, match=r"pass_ must be one of \('forward', 'backward', 'optimizer'\)"):  # fmt: skip
        tp_grad.totals(pass_="bwd")
    with pytest.raises(ValueError, match="requested .* carry no op_name"):
        tp_grad.totals(pass_="forward", requested=True)
    assert tp_grad.totals(pass_="optimizer") == {}


# --- Mutants: plausible bugs in the classification, each caught by the checks above. The
# ledgers compute passes when asked, so a swapped-in ``passes_of`` takes effect on them.

PASS_MUTANTS = {
    # forward and backward swapped
    "backward_is_forward": ("    if _BACKWARD.search(op_name):",
                            "    if not _BACKWARD.search(op_name):"),
    # the optimizer scope ignored: its collectives counted as forward
    "no_optimizer_pass": ("    if _OPTIMIZER.search(op_name):", "    if False:"),
    # XLA's combined names not split: the whole tuple gets one (mixed) pass
    "combined_not_split": ("    if len(names) == n:\n        return tuple(pass_of(name)",
                           "    if False:\n        return tuple(pass_of(name)"),
}  # fmt: skip


def check_all(tp_grad, fsdp_clip):
    expect_collectives(tp_grad, forward=TP_GRAD_FORWARD, backward=TP_GRAD_BACKWARD, optimizer={})
    expect_collectives(fsdp_clip, forward=FSDP_FORWARD, backward=FSDP_BACKWARD,
                       optimizer=CLIP_OPTIMIZER)  # fmt: skip


def test_unmutated_copy_passes(monkeypatch, tp_grad, fsdp_clip):
    line = PASS_MUTANTS["backward_is_forward"][0]
    monkeypatch.setattr(_hlo, "passes_of", mutant(_passes, "same", line, line).passes_of)
    check_all(tp_grad, fsdp_clip)


@pytest.mark.parametrize("name", PASS_MUTANTS)
def test_pass_mutant_is_caught(monkeypatch, tp_grad, fsdp_clip, name):
    line, replacement = PASS_MUTANTS[name]
    monkeypatch.setattr(_hlo, "passes_of", mutant(_passes, name, line, replacement).passes_of)
    with pytest.raises(AssertionError, match="moves other bytes than expected"):
        check_all(tp_grad, fsdp_clip)


def test_a_step_without_the_optimizer_scope_is_caught(monkeypatch):
    """The models' step without ``named_scope(OPTIMIZER_SCOPE)``: the clip's psum moves to the
    forward, and the fsdp budget fails."""
    line = "        with jax.named_scope(shardops.inspect.OPTIMIZER_SCOPE):"
    monkeypatch.setattr(models, "build", training("no_scope", line, "        if True:").build)
    with pytest.raises(AssertionError, match=r"forward +all-reduce +data +4 +8 +\+4 +differs"):
        expect_collectives(*fsdp_step({"data": 8}, CLIPPED_SGD), forward=FSDP_FORWARD,
                           backward=FSDP_BACKWARD, optimizer=CLIP_OPTIMIZER)  # fmt: skip
