"""A layer of the user's own inside ``models.build``: a hand-written gated MLP with its own
``psum``, and a bias sliced by ``axis_index``. Nobody wrote cost code for them, and the budget
(read from the traced step) equals the compiled step per kind, axes and pass, equals the bytes
worked out by hand, and the training equals the unsharded model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardops
import shardops_models as models

V, D, F, S = 16, 8, 16, 4  # vocabulary, width, gated width, sequence
BATCH = 8


class GatedLM:
    """ids[B, S] → table[V, D] → x + down(silu(x·gate) · (x·up) + bias) → head → logits[B, S, V].

    The gated MLP is written by hand: ``gate``, ``up`` are column-parallel blocks
    ``w[D, F_model]``, ``down`` a row-parallel block ``w[F_model, D]`` whose partial sums the
    layer reduces itself (``ctx.psum``); with ``sliced_bias`` a bias ``b[F]`` stays replicated
    and each device adds its block, cut at ``ctx.axis_index() · F/p``."""

    name, sequence, context = "gated lm", True, S

    def __init__(self, sliced_bias: bool = False):
        self.sliced_bias = sliced_bias

    def init(self, key, dtype=None):
        ks = jax.random.split(key, 6)
        dtype = dtype or jnp.float32

        def normal(k, shape):
            return (0.3 * jax.random.normal(k, shape)).astype(dtype)

        params = {
            "embed": {"table": normal(ks[0], (V, D))},
            "mlp": {"gate": normal(ks[1], (D, F)), "up": normal(ks[2], (D, F)),
                    "down": normal(ks[3], (F, D))},
            "head": {"w": normal(ks[4], (D, V))},
        }  # fmt: skip
        if self.sliced_bias:
            params["mlp"]["bias"] = normal(ks[5], (F,))
        return params

    def plan(self):
        mlp = {"gate": models.COLUMN, "up": models.COLUMN, "down": models.ROW}
        if self.sliced_bias:
            mlp["bias"] = models.REPLICATED
        return {"embed": models.REPLICATED, "mlp": mlp, "head": models.REPLICATED}

    def apply(self, ctx, params, ids):
        def gated_mlp(p, x):  # x[b, S, D], replicated over model
            gate, up, down = (ctx.array(p[k]) for k in ("gate", "up", "down"))
            h = jax.nn.silu(x @ gate) * (x @ up)  # h[b, S, F_model]
            if self.sliced_bias:
                bias = ctx.array(p["bias"])  # b[F], whole on every device
                f_local = h.shape[-1]
                h = h + jax.lax.dynamic_slice_in_dim(bias, ctx.axis_index() * f_local, f_local)
            return x + ctx.psum(h @ down)  # y{U_model} → y[b, S, D]

        x = ctx.stage(ctx.embed, params["embed"], ids)  # x[b, S, D]
        x = ctx.stage(gated_mlp, params["mlp"], x)
        return ctx.stage(ctx.dense, params["head"], x)  # logits[b, S, V]

    def loss_sum(self, ctx, params, logits, labels):
        return ctx.cross_entropy(logits, labels, split=False).sum()

    def check_batch(self, ids, labels=None):
        pass


def reference_loss(model, params, ids, labels):
    x = params["embed"]["table"][ids]
    p = params["mlp"]
    h = jax.nn.silu(x @ p["gate"]) * (x @ p["up"])
    if model.sliced_bias:
        h = h + p["bias"]
    x = x + h @ p["down"]
    logits = x @ params["head"]["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum() / labels.size


def batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, (BATCH, S + 1)).astype(np.int32)
    return ids[:, :-1], ids[:, 1:]


CASES = [("2d", {"data": 4, "model": 2}), ("tp", {"model": 8}), ("fsdp_tp", {"data": 2, "model": 4}),
         ("dp", {"data": 8})]  # fmt: skip


@pytest.mark.parametrize("sliced_bias", [False, True], ids=["psum", "axis_index"])
@pytest.mark.parametrize(("strategy", "shape"), CASES, ids=[c[0] for c in CASES])
def test_the_budget_of_a_hand_written_layer_is_its_compiled_step(strategy, shape, sliced_bias):
    model = GatedLM(sliced_bias)
    mesh = shardops.make_mesh(shape)
    setup = models.build(strategy, mesh, model=model, optimizer=optax.sgd(0.5))
    ids, labels = batch()
    params = model.init(jax.random.key(0))
    state = setup.shard(params)
    xb, yb = setup.place_batch(ids, labels)
    compiled = shardops.inspect.ledger(mesh, setup.train_step, state, xb, yb)
    budget = setup.budget(BATCH, S)
    assert budget.by_pass() == compiled.by_pass()
    assert budget.totals() == compiled.totals()
    # and the layer trains like the unsharded model: one SGD step's loss and parameters
    loss, grads = jax.value_and_grad(reference_loss, argnums=1)(model, params, ids, labels)
    new_state, got = setup.train_step(state, xb, yb)
    np.testing.assert_allclose(got, loss, rtol=2e-6)
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    got_params = setup.gather(new_state.params)
    for (path, want), have, before in zip(
        jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(got_params),
        jax.tree.leaves(params), strict=True,
    ):  # fmt: skip
        name = jax.tree_util.keystr(path)
        assert np.abs(np.asarray(want) - np.asarray(before)).max() > 1e-3, f"{name} did not move"
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-5, atol=1e-6,
                                   err_msg=name)  # fmt: skip


def test_the_budget_of_the_hand_written_layer_has_the_bytes_worked_out_by_hand():
    """2d on data=4 × model=2: each device holds b = 2 rows of S = 4 tokens, x[2, 4, 8] f32 =
    256 bytes; gate, up hold w[8, 8] (256 bytes) and down w[8, 8]; the bias b[16] is 64 bytes.

    model: the layer's own psum of y{U_model} (forward, 256); in the backward the two column
    matmuls' dx{U_model} (x meets varying weights twice: 2 × 256), and with the sliced bias
    its gradient, whole on every device but nonzero only in each device's block (64).
    data: dp all-reduces every gradient once: table 512, gate + up + down 3 × 256, head 512
    (bias 64), and the forward loss, 4 bytes."""
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    for sliced_bias, bias in ((False, 0), (True, 64)):
        setup = models.build("2d", mesh, model=GatedLM(sliced_bias), optimizer=optax.sgd(0.5))
        assert setup.budget(BATCH, S).by_pass() == {
            "forward": {("all-reduce", ("model",)): 256, ("all-reduce", ("data",)): 4},
            "backward": {
                ("all-reduce", ("model",)): 2 * 256 + bias,
                ("all-reduce", ("data",)): 512 + 3 * 256 + 512 + bias,
            },
            "optimizer": {},
        }
