"""Mutants of the Hugging Face loader, each caught by the logits check against transformers
(tests/interop/test_hf_llama.py), its unmutated copy passing: the attention norm read from
post_attention_layernorm, o_proj read untransposed (square: the shapes still fit), a
transposed tensor's block read with the slices in shardops' order (a square one reads the
wrong block, another runs off the tensor)."""

import numpy as np
import optax
import pytest
from _gpt_checks import MESHES
from _hf_checks import check_close, checkpoint, tokens
from _model_checks import mesh_for
from _mutants import mutant
from safetensors import SafetensorError

import shardops_models as models
from shardops_models.interop import hf_llama

MUTANTS = {
    "attention_norm_of_the_mlp": (
        '    ("blocks", "attn_norm", "scale"): ("model.layers.{l}.input_layernorm.weight", False),',
        '    ("blocks", "attn_norm", "scale"): ("model.layers.{l}.post_attention_layernorm.weight", False),',
    ),
    "o_proj_not_transposed": (
        '    ("blocks", "attn", "wo"): ("model.layers.{l}.self_attn.o_proj.weight", True),',
        '    ("blocks", "attn", "wo"): ("model.layers.{l}.self_attn.o_proj.weight", False),',
    ),
    "slices_not_reversed": (
        "        part = view[tuple(reversed(inside)) if self.transposed else tuple(inside)]",
        "        part = view[tuple(inside)]",
    ),
}


def _check(module):
    ckpt = module.HfLlama(checkpoint("gqa"))
    setup = models.build("tp", mesh_for(MESHES["1x8"]), model=ckpt.model(),
                         optimizer=optax.sgd(0.1))  # fmt: skip
    params = ckpt.load(setup, optimizer_state=False)
    ids, _ = tokens(97)
    check_close(np.asarray(setup.logits(params, setup.place_batch(ids))), checkpoint("gqa"), ids,
                "mutant")  # fmt: skip


def test_unmutated_copy_passes():
    line, _ = MUTANTS["o_proj_not_transposed"]
    _check(mutant(hf_llama, "unmutated", line, line))


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(name):
    line, new = MUTANTS[name]
    # A wrong layout fails the logits check, or (a non-square tensor) the read of its slice.
    with pytest.raises((AssertionError, ValueError, SafetensorError)):
        _check(mutant(hf_llama, name, line, new))
