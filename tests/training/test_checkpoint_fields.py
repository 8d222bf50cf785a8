"""A checkpoint saved before a model's config gained a field (the GPT's ``stacked``) still
identifies the model where the field is at its default, and not where it is not. A nested
config (the Llama's ``experts``) is recorded field by field: another router is another model."""

from __future__ import annotations

import optax
import pytest

import shardops_models as models
from shardops_models.training.checkpoint import describe, differences


@pytest.mark.parametrize(("model", "field", "other"), [
    (models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=2, context=16, d_ff=64),
     "stacked", {"stacked": True}),
], ids=["gpt"])  # fmt: skip
def test_a_field_added_since_the_save_at_its_default_is_the_same_model(model, field, other):
    import dataclasses

    setup = models.build("ref", model=model, optimizer=optax.sgd(0.1))
    saved = describe(setup)
    del saved["config"][field], saved["defaults"]  # as a record written before the field
    assert differences(saved, describe(setup)) == []
    changed = models.build("ref", model=dataclasses.replace(model, **other),
                           optimizer=optax.sgd(0.1))  # fmt: skip
    assert differences(saved, describe(changed)), "a field off its default is another model"
    assert any(field in d for d in differences(saved, describe(changed)))


def test_the_experts_configuration_is_recorded_field_by_field():
    """k, the score, the capacity, the load-balance form and the loss weights: each named as
    ``experts.<field>``, though the parameters' shapes are the same; no experts at all is the
    whole ``Experts`` named."""
    import dataclasses

    moe = models.Llama(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                       d_ff=32, context=16, experts=models.Experts(num_experts=4, k=2))  # fmt: skip
    saved = describe(models.build("ref", model=moe, optimizer=optax.sgd(0.1)))
    assert differences(saved, saved) == []
    for field, value, shown in (("k", 1, "2 in the checkpoint, 1 here"),
                                ("score", "sigmoid", "'softmax' in the checkpoint, 'sigmoid'"),
                                ("capacity_factor", 2.0, "1.25 in the checkpoint, 2.0 here"),
                                ("load_balance", "group", "'global' in the checkpoint, 'group'"),
                                ("load_balance_weight", 0.1, "0.01 in the checkpoint, 0.1 here"),
                                ("z_loss_weight", 0.0, "0.001 in the checkpoint, 0.0 here")):  # fmt: skip
        other = dataclasses.replace(moe, experts=dataclasses.replace(moe.experts, **{field: value}))
        found = differences(saved, describe(models.build("ref", model=other,
                                                         optimizer=optax.sgd(0.1))))  # fmt: skip
        assert len(found) == 1 and found[0].startswith(f"model config experts.{field}: {shown}"), (
            found
        )
    dense = dataclasses.replace(moe, experts=None)
    found = differences(saved, describe(models.build("ref", model=dense, optimizer=optax.sgd(0.1))))
    assert found[0] == (
        "model config experts: Experts(num_experts=4, k=2, capacity_factor=1.25, "
        "score='softmax', load_balance='global', load_balance_weight=0.01, "
        "z_loss_weight=0.001) in the checkpoint, None here"
    ), found
    old = {**saved, "config": {k: v for k, v in saved["config"].items() if k != "experts"}}
    with pytest.warns(UserWarning, match=r"does not record the model's experts .*save it again"):
        assert differences(old, saved) == []  # a checkpoint saved before: its params compare
