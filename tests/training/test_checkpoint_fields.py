"""A checkpoint saved before a model's config gained a field (the GPT's ``stacked``) still
identifies the model where the field is at its default, and not where it is not. (The Llama's
``experts``, an ``Experts`` or None, is not a plain value: no config records it, and the
experts' parameters tell the models apart.)"""

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
