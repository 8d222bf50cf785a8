"""The model contract (``models.Model``), auxiliary losses and microbatches.

- ``build`` names every member a model lacks; ``apply`` must return ``(logits, aux)``;
- an auxiliary loss enters the objective × its weight, averaged over the devices that hold
  different tokens: the loss and gradients of every strategy equal a plain-JAX reference of
  ``mean CE + w · mean(x²)`` over the global batch (off by a mesh-axis size if the average
  is wrong, by the weight if it is dropped);
- ``microbatches=k`` gives the gradient of one pass over the batch (sum, not mean, of the
  parts' gradients) and trains the same trajectory.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cover import cover
from _messages import refused

import shardops
import shardops_models as models

V, D, F, B, S = 32, 16, 32, 16, 8
WEIGHT = 0.5


class AuxLM:
    """ids → table[V, D] → x + down(gelu(up(x))) → head → logits; aux = mean(x²) of its tokens."""

    name, sequence, vocab_size = "aux lm", True, V
    aux_weights: ClassVar = {"activation_l2": WEIGHT}

    def init(self, key, dtype=None):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        return {
            "embed": {"table": 0.5 * jax.random.normal(k1, (V, D))},
            "up": shardops.init_dense(k2, D, F),
            "down": shardops.init_dense(k3, F, D),
            "head": {"w": 0.2 * jax.random.normal(k4, (D, V))},
        }

    def plan(self):
        return {"embed": models.VOCAB, "up": models.COLUMN, "down": models.ROW,
                "head": models.COLUMN}  # fmt: skip

    def apply(self, ctx, params, ids):
        def mlp(p, x):
            return x + ctx.dense(p["down"], jax.nn.gelu(ctx.dense(p["up"], x)))

        x = ctx.unit(ctx.embed, params["embed"], ids)  # x[b, S, D] (sp, cp: S split)
        x = ctx.unit(mlp, {"up": params["up"], "down": params["down"]}, x)
        aux = {"activation_l2": jnp.mean(jnp.square(x.astype(jnp.float32)))}
        return ctx.unit(ctx.dense, params["head"], x), aux

    def loss_sum(self, ctx, params, logits, labels):
        return ctx.cross_entropy(logits, labels, split=ctx.is_split(params["head"])).sum()

    def check_batch(self, ids, labels=None):
        pass


def reference(params, ids, labels, weight=WEIGHT):
    """``mean CE + weight · mean(x²)`` over the global batch, in plain JAX (float32)."""
    x = params["embed"]["table"][ids]
    up, down = params["up"], params["down"]
    x = x + jax.nn.gelu(x @ up["w"] + up["b"]) @ down["w"] + down["b"]
    logits = x @ params["head"]["w"]
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1).mean()
    return ce + weight * jnp.mean(jnp.square(x))


def batch(seed=0):
    tokens = np.random.default_rng(seed).integers(0, V, (B, S + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


MESHES = {"dp": {"data": 8}, "fsdp_sp": {"data": 2, "model": 4}, "2d+ring": None,
          "zero1_tp": {"data": 4, "model": 2}}  # fmt: skip
MESHES["2d+ring"] = {"data": 2, "context": 2, "model": 2}


@pytest.mark.parametrize(
    "strategy, microbatches", cover(list(MESHES), [1, 2], full=True), ids=str
)  # fmt: skip
def test_aux_loss_and_microbatches_match_the_reference(strategy, microbatches):
    setup = models.build(strategy, shardops.make_mesh(MESHES[strategy]), model=AuxLM(),
                         optimizer=optax.sgd(0.1), microbatches=microbatches)  # fmt: skip
    params = AuxLM().init(jax.random.key(0))
    ids, labels = batch()
    loss, grads = setup.loss_and_grads(setup.shard(params).params, *setup.place_batch(ids, labels))
    want, want_grads = jax.value_and_grad(reference)(params, ids, labels)
    np.testing.assert_allclose(float(loss), float(want), rtol=2e-6)
    got = setup.gather(grads)
    for path, g in jax.tree_util.tree_leaves_with_path(want_grads):
        np.testing.assert_allclose(
            np.asarray(_at(got, path)), np.asarray(g), rtol=2e-5, atol=2e-6,
            err_msg=f"{strategy} microbatches={microbatches} grads{jax.tree_util.keystr(path)}",
        )  # fmt: skip


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_the_aux_weight_counts():
    """The reference without the aux loss differs by more than the tolerance (so the test above
    sees a dropped or doubled weight), and a weight from build overrides the model's."""
    params = AuxLM().init(jax.random.key(0))
    ids, labels = batch()
    assert (
        abs(float(reference(params, ids, labels)) - float(reference(params, ids, labels, 0.0)))
        > 1e-2
    )
    setup = models.build("ref", model=AuxLM(), optimizer=optax.sgd(0.1),
                         aux_weights={"activation_l2": 2.0})  # fmt: skip
    loss, _ = setup.loss_and_grads(setup.shard(params).params, *setup.place_batch(ids, labels))
    np.testing.assert_allclose(float(loss), float(reference(params, ids, labels, 2.0)), rtol=2e-6)


def test_microbatches_train_the_same_trajectory():
    """Three Adam steps under zero1_tp (its ReduceScatter update) with 2 microbatches and with
    none: the same parameters to float32 rounding."""
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    ends = []
    for k in (1, 2):
        setup = models.build("zero1_tp", mesh, model=AuxLM(), optimizer=optax.adam(1e-2),
                             microbatches=k)  # fmt: skip
        state = setup.init(jax.random.key(0))
        for seed in range(3):
            state, _ = setup.train_step(state, *setup.place_batch(*batch(seed)))
            jax.block_until_ready(state)
        ends.append(setup.gather(state.params))
    for a, b in zip(jax.tree.leaves(ends[0]), jax.tree.leaves(ends[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


class Bare:
    def init(self, key, dtype=None):
        return {}


def test_build_names_each_member_a_model_lacks():
    with refused(TypeError, argument="model Bare", got="lacks name, plan, apply, loss_sum, "
                 "check_batch", expected="a model needs name, init", fix="models.Model"):  # fmt: skip
        models.build("ref", model=Bare(), optimizer=optax.sgd(0.1))


class BareLogits(AuxLM):
    def apply(self, ctx, params, ids):
        return super().apply(ctx, params, ids)[0]


class Metered(AuxLM):
    def metrics(self, ctx, params, logits, labels):
        n = labels.size
        return self.loss_sum(ctx, params, logits, labels), jnp.int32(0), jnp.int32(n)


class Unweighted(AuxLM):
    aux_weights: ClassVar = {}


def test_apply_must_return_logits_and_aux():
    setup = models.build("ref", model=BareLogits(), optimizer=optax.sgd(0.1))
    state = setup.init(jax.random.key(0))
    with refused(TypeError, argument="BareLogits.apply", got="an array of shape (16, 8, 32)", expected="(logits, aux)",
                 fix="Return `logits, {}`"):  # fmt: skip
        setup.train_step(state, *setup.place_batch(*batch()))


def test_an_aux_loss_needs_a_weight():
    setup = models.build("ref", model=Unweighted(), optimizer=optax.sgd(0.1))
    state = setup.init(jax.random.key(0))
    with refused(ValueError, argument="auxiliary loss 'activation_l2'", got="has no weight",
                 expected="weights given", fix="aux_weights={'activation_l2': w}"):  # fmt: skip
        setup.train_step(state, *setup.place_batch(*batch()))


def test_an_aux_weight_that_names_no_aux_loss_is_refused():
    """A misspelt weight would leave its loss unweighted (refused above) or, beside the right
    one, train as if it were not given: every weight must name a loss ``apply`` returns."""
    setup = models.build("ref", model=AuxLM(), optimizer=optax.sgd(0.1),
                         aux_weights={"activation_l1": 2.0})  # fmt: skip
    state = setup.init(jax.random.key(0))
    with refused(ValueError, argument="aux_weights ['activation_l1']", got="name no auxiliary "
                 "loss AuxLM.apply returns", expected="(it returns: 'activation_l2')",
                 fix="correct the names in models.build(aux_weights=...)"):  # fmt: skip
        setup.train_step(state, *setup.place_batch(*batch()))
    moe = models.Llama(vocab_size=V, d_model=D, num_layers=1, num_heads=2, num_kv_heads=1,
                       d_ff=F, context=S, experts=models.Experts(num_experts=4, k=2))  # fmt: skip
    for model, weights, returned in (
        (moe, {"load_balence": 100.0}, "'load_balance', 'z_loss'"),
        (dataclasses.replace(moe, experts=None), {"load_balance": 1.0}, "none"),
    ):
        setup = models.build("ref", model=model, optimizer=optax.sgd(0.1), aux_weights=weights)
        with pytest.raises(ValueError, match=re.escape(f"(it returns: {returned})")):
            setup.logits(setup.init(jax.random.key(0)).params, batch()[0])


def test_microbatches_must_split_the_batch():
    with refused(ValueError, argument="microbatches", got="0", expected="positive int",
                 fix="1 for none"):  # fmt: skip
        models.build("ref", model=AuxLM(), optimizer=optax.sgd(0.1), microbatches=0)
    setup = models.build("dp", shardops.make_mesh({"data": 8}), model=Metered(),
                         optimizer=optax.sgd(0.1), microbatches=2)  # fmt: skip
    assert setup.batch_multiple == 8  # an evaluation batch's; a training batch's × 2
    ids, labels = batch()
    placed = setup.place_batch(ids[:8], labels[:8])
    setup.evaluate(setup.init(jax.random.key(0)).params, *placed)  # not split: no refusal
    with refused(ValueError, argument="each device's batch of 1 rows", got="microbatches=2",
                 expected="multiple of 16", fix="another microbatches"):  # fmt: skip
        setup.train_step(setup.init(jax.random.key(0)), *placed)


class Misweighted(AuxLM):
    aux_weights: ClassVar = {"activation_l2": "big"}


def test_aux_weights_are_real_numbers():
    with refused(TypeError, argument="Misweighted.aux_weights", got="'big'",
                 expected="a real number", fix="{'load_balance': 0.01}"):  # fmt: skip
        models.build("ref", model=Misweighted(), optimizer=optax.sgd(0.1))
    with refused(TypeError, argument="aux_weights", got="True", expected="a real number",
                 fix="{'load_balance': 0.01}"):  # fmt: skip
        models.build("ref", model=AuxLM(), optimizer=optax.sgd(0.1),
                     aux_weights={"activation_l2": True})  # fmt: skip
    setup = models.build("ref", model=AuxLM(), optimizer=optax.sgd(0.1),
                         aux_weights={"activation_l2": np.float32(0.25)})  # fmt: skip
    assert setup.aux_weights == {"activation_l2": 0.25}
