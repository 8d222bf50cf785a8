"""A circular pipeline's params are stored with the stacked layers' rows permuted, in the model's
shapes (``models/training/_layer_order.py``): given raw to a setup of another order they are
refused at every entry (the steps, ``logits``, ``evaluate``, ``shard``, ``gather``, checkpoint and
Hugging Face saves), and so are the model's-order params given to a circular setup; converted
through ``gather`` and ``shard`` they give the circular setup's logits."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from _messages import refused
from _model_checks import mesh_for

import shardops_models as models
from shardops_models.generation import Decoder
from shardops_models.interop import save_hf_llama
from shardops_models.training.checkpoint import Checkpoints

LLAMA = models.Llama(vocab_size=64, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2,
                     d_ff=32, context=16)  # fmt: skip
IDS = np.arange(4 * 16).reshape(4, 16) % 64


@pytest.fixture(scope="module")
def trained():
    """``(circular, ref, 1f1b, state)``: one step of ``ref+circular`` on pipe = 2 (V = 2)."""
    mesh = mesh_for({"pipe": 2})
    build = dict(model=LLAMA, optimizer=optax.sgd(0.5), microbatches=2)
    circular = models.build("ref+circular", mesh, **build)
    state = circular.init(jax.random.key(0))
    state, _ = circular.train_step(state, *circular.place_batch(IDS, IDS))
    ref = models.build("ref", model=LLAMA, optimizer=optax.sgd(0.5))
    one_f_one_b = models.build("ref+1f1b", mesh, **build)
    return circular, ref, one_f_one_b, state


def test_the_stored_order_is_a_permutation(trained):
    """The premise: the stacked rows really are permuted (else nothing here could fail)."""
    circular, *_ = trained
    assert circular.layer_order is not None
    (path, rows), *_ = circular.layer_order
    assert sorted(rows) == list(range(LLAMA.num_layers)) and list(rows) != sorted(rows), path


@pytest.mark.parametrize("entry", ["logits", "evaluate", "loss_and_grads", "train_step"])
def test_circular_params_given_to_another_setup_are_refused(trained, entry):
    _, ref, one_f_one_b, state = trained
    for other in (ref, one_f_one_b):
        arg = state if entry == "train_step" else state.params
        batch = other.place_batch(IDS) if entry == "logits" else other.place_batch(IDS, IDS)
        with refused(ValueError, argument=f"setup.{entry}:", got="a circular pipeline's stored "
                     "order", expected="this setup stores them in the model's layer order",
                     fix="gather(state).params, then setup.shard(params)"):  # fmt: skip
            getattr(other, entry)(arg, *batch)


def test_the_model_order_given_to_a_circular_setup_is_refused(trained):
    circular, ref, _, _ = trained
    params = ref.init(jax.random.key(0)).params
    with refused(ValueError, argument="setup.logits: params", got="in the model's layer order",
                 expected="this setup stores them in a circular pipeline's stored order",
                 fix="then setup.shard(params)"):  # fmt: skip
        circular.logits(params, circular.place_batch(IDS))


def test_host_params_given_to_a_circular_setup_are_refused(trained, tmp_path):
    """Host arrays carry no order; in a circular setup's steps or saves they are most likely
    ``gather``'s copies, in the model's order: refused, naming ``shard``."""
    circular, _, _, state = trained
    gathered = circular.gather(state)
    with refused(ValueError, argument="setup.logits: params", got="is a host array",
                 expected="this setup stores it in a circular pipeline's stored order",
                 fix="place them with setup.shard(params)"):  # fmt: skip
        circular.logits(gathered.params, circular.place_batch(IDS))
    with pytest.raises(ValueError, match=r"setup.train_step: state: \.params\['blocks'\].* host"):
        circular.train_step(gathered, *circular.place_batch(IDS, IDS))
    with Checkpoints(tmp_path / "ckpt") as ckpt, pytest.raises(ValueError, match="host array"):
        ckpt.save(1, circular, gathered)
    np.testing.assert_allclose(  # through shard: the circular setup's own logits
        np.asarray(circular.logits(circular.shard(gathered.params).params,
                                   circular.place_batch(IDS))),
        np.asarray(circular.logits(state.params, circular.place_batch(IDS))), rtol=1e-6)  # fmt: skip


def test_shard_gather_and_saves_refuse_another_order(trained, tmp_path):
    circular, ref, _, state = trained
    with pytest.raises(ValueError, match=r"setup.shard: params.*circular pipeline's stored"):
        circular.shard(state.params)
    with pytest.raises(ValueError, match=r"setup.gather: tree.*Gather it with the setup it"):
        ref.gather(state)
    with Checkpoints(tmp_path / "ckpt") as ckpt, pytest.raises(
            ValueError, match=r"Checkpoints.save: state.*Save it with the setup it came from"):  # fmt: skip
        ckpt.save(1, ref, state)
    with pytest.raises(ValueError, match=r"save_hf_llama: params.*Save them with the setup"):
        save_hf_llama(tmp_path / "hf", ref, state)
    decoder = Decoder(LLAMA, mesh_for({"data": 1, "model": 2}), batch=1, max_len=8)
    with pytest.raises(ValueError, match=r"Decoder.generate: params.*decoder.place\(setup_it"):
        decoder.generate(state.params, np.zeros((1, 2), np.int32), steps=1)


def test_params_converted_through_the_model_order_give_the_circular_logits(trained, tmp_path):
    """``gather`` then ``shard`` (and a checkpoint's restore) give the circular setup's logits;
    the raw stored rows, run in the model's order (the refusal bypassed), would not."""
    circular, ref, one_f_one_b, state = trained
    want = np.asarray(circular.logits(state.params, circular.place_batch(IDS)))
    params = circular.gather(state).params
    for other in (ref, one_f_one_b):
        got = other.logits(other.shard(params).params, other.place_batch(IDS))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with Checkpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, circular, state)
        restored, _ = ckpt.restore(ref)
    np.testing.assert_allclose(np.asarray(ref.logits(restored.params, IDS)), want, rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    raw = jax.tree.map(np.asarray, state.params)  # host copies: no mark, the refusal bypassed
    permuted = np.asarray(ref.logits(ref.shard(raw).params, IDS))
    assert np.max(np.abs(permuted - want)) > 1e-3, "the stored rows run in the model's order"
