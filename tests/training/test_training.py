"""The training loop's machinery: whole-set metrics as the examples print them
(``dataset_metrics``: chunks padded to split evenly, summed from each strategy's own ``evaluate``)
equal the unsharded model on the full set; and what only changes the schedule or the memory,
which no value can show: the train step donates its state and nothing else donates, at most
``limit`` steps are in flight, and the next batch is placed before the current one is used."""

import jax
import numpy as np
import optax
import pytest
from _data_checks import check_staged, check_steps_in_flight
from _model_checks import check_donation, mesh_for

import shardops_models as models
from shardops_models.training import loop

SIZES = (48, 64, 24, 10)


@pytest.mark.parametrize(
    ("strategy", "mesh_shape"),
    [("ref", None), ("dp", {"data": 8}), ("tp", {"model": 8}), ("2d", {"data": 4, "model": 2}),
     ("fsdp", {"data": 8}), ("fsdp_tp", {"data": 2, "model": 4})],
    ids=str,
)  # fmt: skip
def test_dataset_metrics_equal_the_unsharded_model_on_the_whole_set(strategy, mesh_shape):
    rng = np.random.default_rng(3)
    n = 101  # prime: the last chunk is padded on every mesh
    images = rng.random((n, SIZES[0]), dtype=np.float32)
    labels = np.eye(SIZES[-1], dtype=np.float32)[rng.integers(0, SIZES[-1], n)]
    params = models.init_mlp(jax.random.key(2), SIZES, scale=0.1)
    setup = models.build(strategy, mesh_for(mesh_shape), optimizer=optax.sgd(1.0), sizes=SIZES)
    loss, accuracy = loop.dataset_metrics(
        setup, setup.shard(params).params, images, labels, chunk=40
    )
    ref_loss = float(models.loss(params, images, labels))
    ref_correct = int(np.sum(np.argmax(models.mlp_forward(params, images), -1) == labels.argmax(1)))
    assert 0 < ref_correct < n
    assert accuracy == ref_correct / n
    assert abs(loss - ref_loss) <= 1e-6, (loss, ref_loss)


def test_dataset_metrics_refuse_unpaired_arrays():
    setup = models.build("ref", optimizer=optax.sgd(1.0), sizes=SIZES)
    with pytest.raises(ValueError, match="10 images but 9 labels"):
        loop.dataset_metrics(setup, None, np.zeros((10, 48)), np.zeros((9, 10)))


def test_the_train_step_donates_its_state_and_nothing_else_donates():
    check_donation()


def test_steps_in_flight_are_bounded_and_awaited_oldest_first():
    check_steps_in_flight()


def test_staged_places_the_next_batch_before_yielding_the_current():
    check_staged()
