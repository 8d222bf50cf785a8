"""Mutants of KV-cache decoding, each caught by a check of tests/generation/test_decoding.py
(its unmutated copy passing the same check): positions restarting at 0 in each step, the cache
written one position late, the causal mask read from the last query's position, the GPT's
learned positions read from 0 in each step (teacher-forced logits against a float64 forward);
each data shard given rows 0 … b−1's noise, each model shard the first vocabulary block's
(the same draw on every mesh); the logits multiplied by the temperature (the draws'
distribution)."""

import jax
import pytest
from _mutants import mutant
from test_decoding import (
    check_gpt,
    check_same_draws,
    check_sampling_distribution,
    check_teacher_forced,
)

from shardops.layers import _attention
from shardops_models.generation import decoding

ATTENTION = {  # mutant → (line of shardops/layers/_attention.py, its replacement)
    "positions_restart": (
        "    positions = start + jnp.arange(seq, dtype=jnp.int32)  # [s]: the tokens' global positions",
        "    positions = jnp.arange(seq, dtype=jnp.int32)",
    ),
    "cache_written_late": ("    at = (0, 0, start, 0)", "    at = (0, 0, start + 1, 0)"),
    "mask_of_the_last_query": (
        "    visible = jnp.arange(size)[None, :] <= positions[:, None]  # [s, S_max]: key j ≤ query i",
        "    visible = jnp.arange(size)[None, :] <= positions[-1:, None]",
    ),
}
DECODING = {  # mutant → (line of models/generation/decoding.py, its replacement)
    "gpt_positions_restart": (
        "        positions = start + jnp.arange(ids.shape[1], dtype=jnp.int32)  # [s]",
        "        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)",
    ),
    "noise_of_the_first_rows": (
        "            first_row = lax.axis_index(self.data) * b if self.data else 0",
        "            first_row = 0",
    ),
    "noise_of_the_first_vocabulary_block": (
        "            cols = lax.axis_index(self.tp) * v_local + jnp.arange(v_local)  # [V_pad/p]: token ids",
        "            cols = jnp.arange(v_local)",
    ),
    "logits_times_temperature": (
        "            logits = logits / temperature + noise",
        "            logits = logits * temperature + noise",
    ),
}


def _check(name, decoder_type):
    if name in ATTENTION:
        check_teacher_forced("gqa", "2x4", decoder_type, steps=8)
    elif name == "gpt_positions_restart":
        check_gpt("2x4", decoder_type, steps=8)
    elif name == "logits_times_temperature":
        check_sampling_distribution(0.5, decoder_type)
    elif name == "noise_of_the_first_rows":
        check_same_draws(decoder_type, meshes=("1x1", "2x4"))  # data = 2
    else:
        check_same_draws(decoder_type, meshes=("1x1", "1x8"))  # model = 8


@pytest.fixture
def decoder_type(monkeypatch):
    """``make(name, mutated)``: a Decoder class running the mutant (or its unmutated copy)."""

    def make(name, mutated: bool):
        if name in ATTENTION:
            line, new = ATTENTION[name]
            module = mutant(_attention, name, line, new if mutated else line)
            monkeypatch.setattr(decoding, "cached_attention_kernel",
                                module.cached_attention_kernel)  # fmt: skip
            return decoding.Decoder
        line, new = DECODING[name]
        return mutant(decoding, name, line, new if mutated else line).Decoder

    yield make
    jax.clear_caches()


@pytest.mark.parametrize("name", ["positions_restart", "gpt_positions_restart"])
def test_unmutated_copy_passes(decoder_type, name):
    """A copy of each module (attention, decoding) passes the check its mutants fail."""
    _check(name, decoder_type(name, mutated=False))


@pytest.mark.parametrize("name", [*ATTENTION, *DECODING])
def test_mutant_is_caught(decoder_type, name):
    with pytest.raises(AssertionError):
        _check(name, decoder_type(name, mutated=True))
