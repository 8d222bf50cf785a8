"""Mutants of KV-cache decoding, each caught by a check of tests/generation/test_decoding.py
(its unmutated copy passing the same check): positions restarting at 0 in each step, the cache
written one position late, the causal mask read from the last query's position, the cache's
blocked read told one key fewer than written or counting one block fewer (a one-token prompt,
a length one past a block's end), its clamped last block given the positions past it or
folded in twice (``check_one_token_prompt``, ``check_block_edges``: blocks of 4), and, in the
models' own ``apply`` (which the decoder runs: it has no forward of its own), the GPT's
learned positions read from 0 in each step, its first layer norm skipped, the Llama's MLP
residual dropped and its final norm skipped (teacher-forced logits against a float64 forward);
each data shard given rows 0 … b−1's noise, each model shard the first vocabulary block's
(the same draw on every mesh); the logits multiplied by the temperature (the draws'
distribution); the same key at every step, the temperature not applied (several sampled steps
against the documented key schedule); a start past the cache's length not refused (rewinding
checked against a float64 forward); an empty or 1-D prompt, or params that are not the
decoding layout's (generate's check, setup.logits', a TrainState's), let through to a raw
error."""

import functools

import jax
import pytest
from _mutants import mutant, training
from test_decoding import (
    check_block_edges,
    check_cache_positions,
    check_gpt,
    check_key_schedule,
    check_misuse,
    check_one_token_prompt,
    check_same_draws,
    check_sampling_distribution,
    check_teacher_forced,
)

from shardops.layers import _cached_attention, _flash
from shardops_models.generation import _cached_context, decoding
from shardops_models.networks import gpt, llama

ATTENTION = {  # mutant → (line of shardops/layers/_cached_attention.py, its replacement)
    "positions_restart": (
        "    positions = start + jnp.arange(seq, dtype=jnp.int32)  # [s]: the tokens' global positions",
        "    positions = jnp.arange(seq, dtype=jnp.int32)",
    ),
    "cache_written_late": ("    at = (0, 0, start, 0)", "    at = (0, 0, start + 1, 0)"),
    # Every query of a prefill masked as the last one: the prompt sees its future. The blocked
    # path (the default) and the einsum reference (``EINSUM``: its decoder asks for it).
    "mask_of_the_last_query": (
        "        o = _flash.cache_attention(q, keys, values, q_positions=positions, length=start + seq,",
        "        o = _flash.cache_attention(q, keys, values, q_positions=positions[-1:].repeat(seq), "
        "length=start + seq,",
    ),
    "einsum_mask_of_the_last_query": (
        "        visible = _masks.visible(positions, key_positions, None, None, True)  # [1, 1, s, S_max]",
        "        visible = _masks.visible(positions[-1:].repeat(seq), key_positions, None, None, True)",
    ),
    # The blocked read told the cache holds one key fewer than written: the last key is lost
    # where it is its block's first (a one-token prompt; a length of 4k + 1 in blocks of 4).
    "cache_length_one_short": (
        "        o = _flash.cache_attention(q, keys, values, q_positions=positions, length=start + seq,",
        "        o = _flash.cache_attention(q, keys, values, q_positions=positions, "
        "length=start + seq - 1,",
    ),
}
# The blocked read of the cache itself (``_flash.cache_attention``), at its blocks' edges: the
# decoding tests' other checks read one block (BLOCK_K = 512, clipped to max_len), where each
# of these changes nothing; ``check_one_token_prompt`` and ``check_block_edges`` read blocks
# of 4.
FLASH = {  # mutant → (line of shardops/layers/_flash.py, its replacement)
    "block_count_one_short": (  # ⌈(length − 1) / block⌉ blocks: a block's first key skipped
        "    carry = lax.fori_loop(0, (length + block - 1) // block, body, carry)",
        "    carry = lax.fori_loop(0, (length + block - 2) // block, body, carry)",
    ),
    "clamped_block_positions_unclamped": (  # the clamped block's keys given the positions past it
        "        first = jnp.minimum(i * block, size - block)  # the block's first key (clamped at the end)",
        "        first = i * block",
    ),
    "clamped_block_folded_twice": (  # the clamped block's overlap with the previous one counted again
        "        real = key_positions >= i * block  # a clamped block's keys already folded in: masked",
        "        real = key_positions >= first",
    ),
}
# The model's own forward: a decoder with a second forward of its own would not see these.
MODEL = {  # mutant → (module of models/networks, its line, the replacement)
    "gpt_positions_restart": (
        gpt,
        "            positions = jnp.broadcast_to(start + jnp.arange(ids.shape[1]), ids.shape)  # [b, S]",
        "            positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)",
    ),
    "gpt_first_norm_skipped": (
        gpt,
        '            h = ctx.layer_norm(p["ln1"], x)',
        "            h = x",
    ),
    "llama_mlp_residual_dropped": (
        llama,
        '            return x + ctx.gated_mlp(p["mlp"], h)  # x[b, S, D] (sp: x[b, S_model, D])',
        '            return ctx.gated_mlp(p["mlp"], h)',
    ),
    "llama_final_norm_skipped": (
        llama,
        '            x = ctx.rms_norm(p["norm"], x, eps=self.norm_eps)',
        "            pass",
    ),
}
FORWARD = ("apply", "_embed", "_block", "_head")  # the methods of a model's forward
DECODING = {  # mutant → (line of models/generation/decoding.py, its replacement)
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
    "key_reused_every_step": (
        "                token = self._local_next(logits[:, -1], jax.random.fold_in(key, t), temperature)",
        "                token = self._local_next(logits[:, -1], jax.random.fold_in(key, 0), temperature)",
    ),
    "temperature_not_applied": (
        "            logits = logits / temperature + noise",
        "            logits = logits + noise",
    ),
    "start_past_next_not_refused": ("        if start > cache.length:", "        if False:"),
    "empty_prompt_not_refused": ("        if ids.shape[1] == 0:", "        if False:"),
    "one_d_prompt_not_refused": (
        "        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):",
        "        if not jnp.issubdtype(ids.dtype, jnp.integer):",
    ),
    "generate_params_unchecked": (
        '        self.setup.padding.check_stored(params, "Decoder.generate", "decoder.place(params)")',
        "        pass",
    ),
}
TRAIN = {  # mutant → (line of a models/training module, its replacement): the decoder's setup
    "setup_logits_params_unchecked": (
        '    logits = _params_checked(logits, padding, "setup.logits")',
        "    logits = logits",
    ),
    "train_state_not_recognised": (
        "        if isinstance(params, TrainState):",
        "        if False:",
    ),
}
CHECKS = {  # mutant → the check that catches it (a mutant not listed: the draws on 1x1 and 1x8)
    **dict.fromkeys(ATTENTION, lambda d: check_teacher_forced("gqa", "2x4", d, steps=8)),
    "cache_length_one_short": check_one_token_prompt,
    **dict.fromkeys(FLASH, check_block_edges),
    "gpt_positions_restart": lambda d: check_gpt("2x4", d, steps=8),
    "gpt_first_norm_skipped": lambda d: check_gpt("1x1", d, steps=8),
    **dict.fromkeys(
        ["llama_mlp_residual_dropped", "llama_final_norm_skipped"],
        lambda d: check_teacher_forced("gqa", "2x4", d, steps=8),
    ),
    "logits_times_temperature": lambda d: check_sampling_distribution(0.5, d),
    "noise_of_the_first_rows": lambda d: check_same_draws(d, meshes=("1x1", "2x4")),  # data = 2
    # One device compiles fastest; the schedule keyed by global rows and token ids is the same
    # on every mesh (the draws' test).
    "key_reused_every_step": lambda d: check_key_schedule(d, "1x1"),
    "temperature_not_applied": lambda d: check_key_schedule(d, "1x1"),
    "start_past_next_not_refused": lambda d: check_cache_positions(d, "1x1"),
    **dict.fromkeys(
        [
            "empty_prompt_not_refused",
            "one_d_prompt_not_refused",
            "generate_params_unchecked",
            *TRAIN,
        ],
        check_misuse,
    ),
}


def _check(name, decoder_type):
    default = lambda d: check_same_draws(d, meshes=("1x1", "1x8"))  # model = 8  # noqa: E731
    CHECKS.get(name, default)(decoder_type)


@pytest.fixture
def decoder_type(monkeypatch):
    """``make(name, mutated)``: a Decoder class running the mutant (or its unmutated copy)."""

    def make(name, mutated: bool):
        if name in ATTENTION:
            line, new = ATTENTION[name]
            module = mutant(_cached_attention, name, line, new if mutated else line)
            monkeypatch.setattr(_cached_context, "cached_attention_kernel",
                                module.cached_attention_kernel)  # fmt: skip
            if name.startswith("einsum_"):
                return functools.partial(decoding.Decoder, attention="einsum")
            return decoding.Decoder
        if name in FLASH:  # the cached attention reading the cache through the mutated module
            line, new = FLASH[name]
            module = mutant(_flash, name, line, new if mutated else line)
            monkeypatch.setattr(_cached_attention, "_flash", module)
            return decoding.Decoder
        if name in MODEL:  # the model's class running the mutated module's forward
            network, line, new = MODEL[name]
            module = mutant(network, name, line, new if mutated else line)
            real = network.Gpt if network is gpt else network.Llama
            for method in FORWARD:
                monkeypatch.setattr(real, method, getattr(module, real.__name__).__dict__[method])
            # A class of its own, so that the decoders built with this forward are not shared.
            return type(f"Decoder_{name}", (decoding.Decoder,), {})
        if name in TRAIN:
            line, new = TRAIN[name]
            module = training(name, line, new if mutated else line)
            monkeypatch.setattr(decoding, "build", module.build)
            # A class of its own, so that the decoders built with this setup are not shared.
            return type(f"Decoder_{name}", (decoding.Decoder,), {})
        line, new = DECODING[name]
        return mutant(decoding, name, line, new if mutated else line).Decoder

    yield make
    jax.clear_caches()


@pytest.mark.parametrize("name", ["positions_restart", "cache_length_one_short",
                                  "block_count_one_short",
                                  "gpt_positions_restart", "llama_final_norm_skipped",
                                  "key_reused_every_step", "start_past_next_not_refused",
                                  "train_state_not_recognised"])  # fmt: skip
def test_unmutated_copy_passes(decoder_type, name):
    """A copy of each module (attention, its blocked read of the cache, the GPT, the Llama,
    decoding, training) passes the checks its mutants fail (one check a module where the
    others' copies would compile again for nothing)."""
    _check(name, decoder_type(name, mutated=False))


@pytest.mark.parametrize("name", [*ATTENTION, *FLASH, *MODEL, *DECODING, *TRAIN])
def test_mutant_is_caught(decoder_type, name):
    mutated = decoder_type(name, mutated=True)  # outside raises: a line not found is no catch
    with pytest.raises(AssertionError):
        _check(name, mutated)
