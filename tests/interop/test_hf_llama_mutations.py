"""Mutants of the Hugging Face loader and saver, each caught by the check that tests the code it
changes, its unmutated copy passing.

The logits check against transformers (tests/interop/test_hf_llama.py) catches the attention
norm read from post_attention_layernorm, o_proj read untransposed (square: the shapes still
fit), a transposed tensor's block read with the slices in shardops' order (a square one reads
the wrong block, another runs off the tensor). The checks of ``_hf_checks`` (each also a test of
test_hf_llama.py) catch: a wrong default for a field config.json leaves out (``rms_norm_eps``
from ``models.Llama``'s 1e-5, the context from Llama 2's 4096, the KV heads of MQA), the
``swish`` alias dropped, an off-by-one at the shard boundary (the open file, a tensor of
exactly ``max_shard_bytes``), a tied config over a distinct ``lm_head.weight`` loaded tied (the
issue's 3.46 off) or untied without a word, a tied head's ``lm_head.weight`` alone not read as
the embedding, an unplaced tensor let through, ``elements_read`` summed over loads, and each
raw error back (invalid JSON, an index without its weight map or naming a missing file, an
integer dtype, a path that is a file, a zero shard size), and a circular pipeline's stored rows
read from the inverse of their order (``check_circular_load``: 2 stages × 4 virtual stages,
whose order is not its own inverse)."""

import numpy as np
import optax
import pytest
from _gpt_checks import MESHES
from _hf_checks import (
    check_activation_aliases,
    check_circular_load,
    check_close,
    check_defaults,
    check_elements_read,
    check_json_errors,
    check_lm_head_alone,
    check_save_errors,
    check_shard_split,
    check_unplaced_tensors,
    check_untied_head,
    checkpoint,
    tokens,
)
from _model_checks import mesh_for
from _mutants import copies
from safetensors import SafetensorError

import shardops_models as models

# hf_llama's code, in import order: its config, reader and writer, and hf_llama, whose names the
# checks call (``module.HfLlama``, ``module.save_hf_llama``, ``module._files`` …).
MODULES = ("_hf_config", "_hf_reader", "_hf_writer", "hf_llama")


def mutant(name: str, line: str, replacement: str):
    """A copy of ``hf_llama`` whose names are those of copies of ``MODULES``, ``line`` replaced
    by ``replacement`` in the one of them that holds it."""
    return copies("shardops_models.interop", MODULES, name, line, replacement)["hf_llama"]


def _logits(module, tmp_path):
    ckpt = module.HfLlama(checkpoint("gqa"))
    setup = models.build("tp", mesh_for(MESHES["1x8"]), model=ckpt.model(),
                         optimizer=optax.sgd(0.1))  # fmt: skip
    params = ckpt.load(setup, optimizer_state=False)
    ids, _ = tokens(97)
    check_close(np.asarray(setup.logits(params, setup.place_batch(ids))), checkpoint("gqa"), ids,
                "mutant")  # fmt: skip


def _without_tmp(check):
    return lambda module, tmp_path: check(module)


CHECKS = {
    "logits": _logits,
    "defaults": _without_tmp(check_defaults),
    "aliases": _without_tmp(check_activation_aliases),
    "shard_split": _without_tmp(check_shard_split),
    "untied_head": check_untied_head,
    "lm_head_alone": check_lm_head_alone,
    "unplaced": check_unplaced_tensors,
    "elements_read": _without_tmp(check_elements_read),
    "json_errors": check_json_errors,
    "save_errors": check_save_errors,
    "circular_load": check_circular_load,
}

# name → (exact line, replacement, the check that catches it).
MUTANTS = {
    "attention_norm_of_the_mlp": (
        '    ("blocks", "attn_norm", "scale"): ("model.layers.{l}.input_layernorm.weight", False),',
        '    ("blocks", "attn_norm", "scale"): ("model.layers.{l}.post_attention_layernorm.weight", False),',
        "logits",
    ),
    "o_proj_not_transposed": (
        '    ("blocks", "attn", "wo"): ("model.layers.{l}.self_attn.o_proj.weight", True),',
        '    ("blocks", "attn", "wo"): ("model.layers.{l}.self_attn.o_proj.weight", False),',
        "logits",
    ),
    "slices_not_reversed": (
        "        part = view[tuple(reversed(inside)) if self.transposed else tuple(inside)]",
        "        part = view[tuple(inside)]",
        "logits",
    ),
    "default_norm_eps_of_models_llama": (
        '    "rms_norm_eps": 1e-6,', '    "rms_norm_eps": 1e-5,', "defaults"),
    "default_context_of_llama_2": (
        '    "max_position_embeddings": 2048,', '    "max_position_embeddings": 4096,', "defaults"),
    "default_kv_heads_one": (
        '        "num_kv_heads": config.get("num_key_value_heads") or heads,',
        '        "num_kv_heads": config.get("num_key_value_heads") or 1,',
        "defaults",
    ),
    "swish_alias_dropped": ('SILU = ("silu", "swish")', 'SILU = ("silu",)', "aliases"),
    "tensor_at_max_shard_bytes_alone": (
        "        if nbytes > max_shard_bytes:", "        if nbytes >= max_shard_bytes:",
        "shard_split"),
    "file_filled_to_max_shard_bytes_closed": (
        "        if size + nbytes > max_shard_bytes:", "        if size + nbytes >= max_shard_bytes:",
        "shard_split"),
    "untie_dropped": (
        "        if self._equal(EMBED, HEAD):", "        if True:", "untied_head"),
    "untied_without_a_warning": (
        "        warnings.warn(", "        (lambda *args, **kwargs: None)(", "untied_head"),
    "lm_head_alone_not_read_as_the_embedding": (
        '            self.names["embed", "table"] = (HEAD, False)', "            pass",
        "lm_head_alone"),
    "unplaced_tensor_let_through": (
        "        if missing or extra:", "        if missing:", "unplaced"),
    "elements_read_summed_over_loads": (
        "        self.elements_read = 0  # this load's", "        pass", "elements_read"),
    "invalid_json_raw": (
        "    except json.JSONDecodeError as e:", "    except KeyError as e:", "json_errors"),
    "index_without_weight_map_raw": (
        "            if not isinstance(weight_map, dict):", "            if False:", "json_errors"),
    "index_naming_a_missing_file_let_through": (
        "            if absent:", "            if False:", "json_errors"),
    "integer_dtype_saved": (
        "    if out is None or out.name not in SAVE_DTYPES:", "    if out is None:", "save_errors"),
    "saved_to_a_file_raw": (
        "    if os.path.exists(directory) and not os.path.isdir(directory):", "    if False:",
        "save_errors"),
    # a circular pipeline's stored row r read from layer order⁻¹[r], not order[r] (the same
    # rows where the order is its own inverse, as 2 stages × 2 virtual stages' is)
    "circular_rows_read_from_the_inverse_order": (
        "                else [self.order[r] for r in range(inside[0].start, inside[0].stop)])  # fmt: skip",
        "                else [int(np.argsort(self.order)[r]) for r in range(inside[0].start, inside[0].stop)])  # fmt: skip",
        "circular_load"),
    "zero_shard_size_accepted": (
        "            max_shard_bytes, int | np.integer) or max_shard_bytes < 1):  # fmt: skip",
        "            max_shard_bytes, int | np.integer) or max_shard_bytes < 0):  # fmt: skip",
        "save_errors"),
}  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_unmutated_copy_passes(check, tmp_path):
    line, _, _ = MUTANTS["o_proj_not_transposed"]
    CHECKS[check](mutant(f"unmutated_{check}", line, line), tmp_path)


def test_every_check_has_a_mutant():
    assert {check for *_, check in MUTANTS.values()} == set(CHECKS)


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(name, tmp_path):
    line, new, check = MUTANTS[name]
    # A wrong layout fails the logits check, or (a non-square tensor) the read of its slice;
    # every other check turns any failure into an AssertionError.
    caught = (AssertionError, ValueError, SafetensorError) if check == "logits" else AssertionError
    module = mutant(name, line, new)  # outside raises: a line not found is no catch
    with pytest.raises(caught):
        CHECKS[check](module, tmp_path)
