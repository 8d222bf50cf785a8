"""Equinox modules as their authors write them (tests/_equinox_checks.py: an MLP, and a GPT in
the style of Equinox's BERT example, ``eqx.nn.MultiheadAttention`` included), trained by
``EquinoxModel`` under the dense strategies, each against the same module trained by Equinox
itself unsharded (``eqx.filter_jit``, optax): the losses at every step, SGD's gradients at every
step and the parameters after the last, as for Flax's modules (tests/_flax_checks.py)."""

import _foreign_checks
import jax
import optax
import pytest
from _cover import cover
from _equinox_checks import STRATEGIES, batches, check_trains_like_equinox, equinox_model
from _lm_budgets import by_dtype
from _model_checks import mesh_for

import shardops
import shardops_models as models

CASES = cover(["mlp", "gpt"], list(STRATEGIES), ["sgd", "adam"])


@pytest.mark.parametrize(("name", "strategy", "opt_name"), CASES, ids=["-".join(c) for c in CASES])
def test_an_equinox_module_trains_like_equinox_trains_it(name, strategy, opt_name):
    check_trains_like_equinox(equinox_model(name), name, strategy, opt_name,
                              budget=STRATEGIES[strategy] is not None and "model" in STRATEGIES[strategy])  # fmt: skip


@pytest.mark.parametrize("strategy", ["2d", "fsdp"])
def test_layers_called_in_lax_map_and_on_a_constant_train_like_equinox(strategy):
    """Outside the loss's vmap (inside ``lax.map``, on a constant) a layer runs its kernel on
    what it is given; inside it, once over the batch."""
    check_trains_like_equinox(equinox_model("mlp-map"), "mlp-map", strategy, "sgd")


HAND = {
    # Mlp (the Flax MLP's shapes, so the Flax MLP's count): over data the 6 leaves' gradients
    # (LayerNorm 2 × 24 × 4 = 192, up [64/2, 24] 3,072 + b [32] 128, down [8, 64/2] 1,024 + b
    # [8] 32: 4,448 bytes) and the loss; over model the row layer's y[4, 8] forward (128) and
    # the column layer's dx[4, 24] backward (384).
    "mlp": {("all-reduce", ("model",), "f32"): (2, 512),
            ("all-reduce", ("data",), "f32"): (7, 4448 + 4)},
    # Gpt: V = 80, D = 32, 4 heads, F = 64, 2 blocks, S = 16, b = 4 a device. Over model,
    # x[4, 16, 32] = 8,192 bytes: forward the vocab-parallel embedding's sum and per block the
    # two row layers' (output_proj, down), backward per block the four column layers' dx
    # (query, key, value, up) and the head's: 1 + 4 + 8 + 1 = 14 × 8,192; the vocab-parallel
    # loss's 3 values over [4, 16]: 3 × 256. Over data, the 35 leaves' gradients (local: embed
    # [40, 32] 5,120, pos [16, 32] 2,048; per block: 2 LayerNorm leaves 256, q w [16, 32] 2,048
    # + b 64, k w 2,048, v w 2,048 + b 64, output w [32, 16] 2,048 + b [32] 128, RMSNorm 256,
    # up w [32, 32] 4,096 + b 128, down w 4,096 + b 128: 17,408; final norm 256; head [40, 32]
    # 5,120: 47,360) and the loss.
    "gpt": {("all-reduce", ("model",), "f32"): (17, 14 * 8192 + 3 * 256),
            ("all-reduce", ("data",), "f32"): (36, 47360 + 4)},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HAND))
def test_the_ledger_under_2d_is_the_count_by_hand(name):
    """The traced step asks for ``HAND[name]``, and the compiled step moves those bytes (the
    collectives the layers run inside the module's vmaps are batched with them)."""
    setup = models.build("2d", mesh_for(STRATEGIES["2d"]), model=equinox_model(name),
                         optimizer=optax.sgd(0.5))  # fmt: skip
    xs, ys = batches(name)
    assert by_dtype(setup.budget(*xs.shape[1:]).requested) == HAND[name]
    state = setup.shard(setup.model.init(jax.random.key(0)))
    compiled = setup.train_step.lower(state, *setup.place_batch(xs[0], ys[0])).compile()
    moved = by_dtype(shardops.inspect.collectives(setup.mesh, compiled))
    assert {k: b for k, (_, b) in moved.items()} == {k: b for k, (_, b) in HAND[name].items()}


def test_the_plan_is_read_from_the_roles_by_path():
    plan = equinox_model("gpt").plan()
    attn = plan["blocks"][1]["attn"]
    assert attn["query_proj"]["weight"] == attn["value_proj"]["bias"] == "column"
    assert attn["output_proj"]["weight"] == plan["blocks"][0]["down"]["bias"] == "row"
    assert plan["embed"]["weight"] == "vocab" and plan["head"]["weight"] == "column"
    assert plan["pos"]["weight"] == plan["norm"]["bias"] == "replicated"
    # Column splits weight[out, in] along out: the layout reads the role's dims by key.
    setup = models.build("tp", mesh_for(STRATEGIES["tp"]), model=equinox_model("gpt"),
                         optimizer=optax.sgd(0.1))  # fmt: skip
    up = setup.param_specs["blocks"][0]["up"]
    assert (tuple(up["weight"]), tuple(up["bias"])) == (("model", None), ("model",))


def test_a_checkpoint_saved_under_2d_restores_under_fsdp_and_into_the_equinox_module(tmp_path):
    # Into Equinox: the module holding the restored parameters computes the sharded run's logits.
    _foreign_checks.check_checkpoint(equinox_model("gpt"), STRATEGIES, batches("gpt"),
                                     "equinox_gpt.Gpt", lambda module, ids: jax.vmap(module)(ids),
                                     tmp_path)  # fmt: skip


def test_explain_names_each_collective_and_the_locator_is_refused_by_name():
    """``explain`` reads the swapped layers' reasons from the step (the collectives batched by
    the module's vmaps); the locator, which compares layer outputs over the batch that the
    vmaps hide, is refused by name rather than compared wrongly."""
    from shardops_models.training.locate import locate

    xs, ys = batches("gpt")
    model = equinox_model("gpt")
    setup = models.build("2d", mesh_for(STRATEGIES["2d"]), model=model,
                         optimizer=optax.sgd(0.5))  # fmt: skip
    state = setup.shard(model.init(jax.random.key(0)))
    lines = shardops.inspect.explain(setup.mesh, setup.train_step, state,
                                     *setup.place_batch(xs[0], ys[0]), traced=True)  # fmt: skip
    assert any(line.startswith("row_parallel_dense: psum over 'model'") for line in lines), lines
    assert any(line.startswith("vocab_parallel_embedding") for line in lines), lines
    with pytest.raises(ValueError, match=r"the divergence locator compares each layer's output "
                                         r"over the batch, which the module's own vmaps hide"):  # fmt: skip
        locate(setup, state.params, xs[0], ys[0])
