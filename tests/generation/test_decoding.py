"""KV-cache decoding (``shardops_models.generation.Decoder``) against transformers' float64
forward of the same checkpoint (``_hf_checks``): the cached logits of a prefill and 32 one-token
steps equal a full recompute within the float32 bound, under tp (1×8) and 2d (2×4, 4×2: KV
heads replicated and split), and so do they at the edges of the cache's key blocks (read in
blocks of 4: a one-token prompt, prompts of block − 1, block and block + 1 tokens, a clamped
last block); greedy tokens equal the unsharded model's wherever the top-2
margin exceeds that bound; sampling draws the same tokens on every mesh for one key, from
softmax(logits / T), and each step's token is the one the documented key schedule and noise
give on the float64 forward; ``Decoder.logits`` refuses a start past the cache's length and
rewinds below it; a context axis replicates the decoding; misuse is a shardops error; the
compiled program's collectives are the documented ones."""

import collections
import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _gpt_checks import CP_MESHES, MESHES
from _hf_checks import check_close, checkpoint, hf_logits, tokens
from _model_checks import mesh_for
from jax.sharding import PartitionSpec as P

import shardops_models as models
from shardops.inspect import collectives
from shardops.layers import _attention_core, kv_cache_heads
from shardops_models.generation import Decoder
from shardops_models.interop import HfLlama

PROMPT, STEPS, BATCH = 8, 32, 8
MAX_LEN = PROMPT + STEPS


def _decoder(name, mesh_name, batch=BATCH):
    ckpt = HfLlama(checkpoint(name))
    decoder = Decoder(ckpt.model(), mesh_for(MESHES[mesh_name]), batch=batch, max_len=MAX_LEN)
    return decoder, ckpt.load(decoder.setup, optimizer_state=False)


@pytest.mark.parametrize("name, mesh_name, heads", [
    ("gqa", "1x8", "2 KV heads replicated on 8 (one cached per device)"),
    ("gqa", "2x4", "2 KV heads replicated on 4, batch split over data"),
    ("gqa", "4x2", "2 KV heads split over 2"),
    ("mqa_tied", "2x4", "1 KV head, tied head"),
])  # fmt: skip
def test_cached_logits_of_every_step_equal_a_full_recompute(name, mesh_name, heads):
    check_teacher_forced(name, mesh_name)


def teacher_forced(decoder, params, ids, steps: int = STEPS, prompt: int = PROMPT):
    """The logits of a prefill of ``prompt`` tokens, then ``steps`` one-token steps fed the
    true next token: ``[B, prompt + steps, V]``."""
    cache = decoder.init_cache()
    logits, cache = decoder.logits(params, cache, ids[:, :prompt], 0)  # the prefill
    out = [np.asarray(logits)]
    for t in range(prompt, prompt + steps):
        logits, cache = decoder.logits(params, cache, ids[:, t : t + 1], t)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


def check_teacher_forced(name, mesh_name, decoder_type=Decoder, steps: int = STEPS):
    ckpt = HfLlama(checkpoint(name))
    decoder = decoder_type(ckpt.model(), mesh_for(MESHES[mesh_name]), batch=BATCH,
                           max_len=MAX_LEN)  # fmt: skip
    params = ckpt.load(decoder.setup, optimizer_state=False)
    ids, _ = tokens(decoder.model.vocab_size, seed=2, seq=PROMPT + steps)
    check_close(teacher_forced(decoder, params, ids, steps), checkpoint(name), ids,
                f"{name} {mesh_name}")  # fmt: skip


@pytest.mark.parametrize("mesh_name", ["1x8", "2x4"])
def test_greedy_tokens_equal_the_unsharded_model_where_the_margin_is_clear(mesh_name):
    decoder, params = _decoder("gqa", mesh_name)
    prompt, _ = tokens(97, seed=3, seq=PROMPT)
    got = np.asarray(decoder.generate(params, prompt, STEPS))
    assert got.shape == (BATCH, STEPS)
    text = np.concatenate([prompt, got], axis=1)
    path = checkpoint("gqa")
    exact = hf_logits(path, text[:, :-1], torch.float64)[:, PROMPT - 1 :]  # [B, STEPS, V]
    bound = 2 * np.abs(hf_logits(path, text[:, :-1])[:, PROMPT - 1 :] - exact).max() + 4 * (
        np.finfo(np.float32).eps * np.abs(exact).max())  # fmt: skip
    top2 = np.sort(exact, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * bound  # a float32 error cannot swap them
    assert clear.mean() > 0.95, f"only {clear.mean():.0%} of steps have a clear top-2 margin"
    np.testing.assert_array_equal(got[clear], exact.argmax(-1)[clear])


def test_sampling_draws_the_same_tokens_on_every_mesh():
    check_same_draws()


def check_same_draws(decoder_type=Decoder, meshes=("1x1", "1x8", "2x4")):
    """One key, Gumbel noise keyed by global row and token id: a mesh that gave each data
    shard the noise of rows 0 … b−1, or each model shard the first vocabulary block's, draws
    other tokens."""
    prompt, _ = tokens(97, seed=4, seq=PROMPT)
    draws = {}
    for mesh_name in meshes:
        shape = {"data": 1, "model": 1} if mesh_name == "1x1" else MESHES[mesh_name]
        ckpt = HfLlama(checkpoint("gqa"))
        decoder = decoder_type(ckpt.model(), mesh_for(shape), batch=BATCH, max_len=MAX_LEN)
        params = ckpt.load(decoder.setup, optimizer_state=False)
        draws[mesh_name] = np.asarray(decoder.generate(params, prompt, 8, temperature=0.8,
                                                       key=jax.random.key(7)))  # fmt: skip
    for mesh_name in meshes[1:]:
        np.testing.assert_array_equal(draws[mesh_name], draws[meshes[0]], err_msg=mesh_name)
    greedy = np.asarray(decoder.generate(params, prompt, 8))
    assert (draws[meshes[-1]] != greedy).any()  # sampling, not the argmax


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_follows_softmax_of_logits_over_temperature(temperature):
    check_sampling_distribution(temperature)


def check_sampling_distribution(temperature, decoder_type=Decoder):
    """512 rows of one prompt, one token each: the mean log-probability of the draws under
    softmax(logits / T) (transformers' float64 logits) is its expectation −H within 5 standard
    errors; drawing at 1/T would miss by 28 (T = 0.5) and 20 (T = 2) standard errors, at
    T = 1 by 17 and 8 (computed from the same logits)."""
    rows = 512
    ckpt = HfLlama(checkpoint("gqa"))
    decoder = decoder_type(ckpt.model(), mesh_for(MESHES["2x4"]), batch=rows, max_len=MAX_LEN)
    params = ckpt.load(decoder.setup, optimizer_state=False)
    prompt = np.repeat(tokens(97, seed=5, seq=PROMPT)[0][:1], rows, axis=0)
    drawn = np.asarray(decoder.generate(params, prompt, 1, temperature=temperature,
                                        key=jax.random.key(11)))[:, 0]  # fmt: skip
    z = hf_logits(checkpoint("gqa"), prompt[:1], torch.float64)[0, -1] / temperature
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    p = np.exp(logp)
    mean, sd = (p * logp).sum(), np.sqrt((p * logp**2).sum() - (p * logp).sum() ** 2)
    assert abs(logp[drawn].mean() - mean) < 5 * sd / np.sqrt(rows), (logp[drawn].mean(), mean)
    assert len(set(drawn.tolist())) > 5  # not one token for every row


@pytest.mark.parametrize("mesh_name", ["2x4", "4x2"])
def test_the_compiled_program_runs_the_documented_collectives(mesh_name):
    """Over model, per token fed (the prompt's S_p at once, then one per step): the
    embedding's AllReduce of x[b, s, D] and two per layer (attention, MLP), float32; per token
    drawn, the argmax's AllReduce(max) and AllReduce(min) of [b]. Nothing over data."""
    decoder, params = _decoder("gqa", mesh_name)
    m, steps = decoder.model, 5
    b = BATCH // MESHES[mesh_name]["data"]
    prompt = jax.device_put(tokens(97, seq=PROMPT)[0],
                            jax.sharding.NamedSharding(decoder.mesh, decoder.batch_spec))  # fmt: skip
    program = decoder.generate_program(steps)
    listed = collectives(decoder.mesh, program, params, prompt, jax.random.key(0))
    found = collections.Counter((c.kind, c.axes, c.dtypes, c.bytes) for c in listed)
    per_layer = 2 * m.num_layers + 1
    want = collections.Counter({
        ("all-reduce", ("model",), ("f32",), b * PROMPT * m.d_model * 4): per_layer,
        ("all-reduce", ("model",), ("f32",), b * 1 * m.d_model * 4): per_layer * (steps - 1),
        ("all-reduce", ("model",), ("f32",), b * 4): steps,  # pmax of the local maxima
        ("all-reduce", ("model",), ("s32",), b * 4): steps,  # pmin of the candidate indices
    })  # fmt: skip
    assert found == want
    # The decoder's budget, traced without compiling, is the compiled program's.
    totals = collections.Counter()
    for (kind, axes, _, size), n in found.items():
        totals[(kind, axes)] += size * n
    assert decoder.budget(PROMPT, steps).totals() == dict(totals)


def test_bad_decoding_requests_are_clear_errors():
    decoder, params = _decoder("gqa", "2x4")
    prompt, _ = tokens(97, seq=PROMPT)
    assert np.asarray(decoder.generate(params, prompt, MAX_LEN - PROMPT)).shape == (8, STEPS)
    with pytest.raises(ValueError, match="do not fit the cache of max_len=40"):
        decoder.generate(params, prompt, MAX_LEN - PROMPT + 1)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        decoder.generate(params, prompt, 0)
    with pytest.raises(ValueError, match="do not fit the cache"):
        decoder.logits(params, decoder.init_cache(), prompt[:, :1], MAX_LEN)
    with pytest.raises(ValueError, match="packs documents"):
        Decoder(dataclasses.replace(decoder.model, bos_id=1), decoder.mesh, batch=8, max_len=8)
    with pytest.raises(ValueError, match="built for batch=8"):
        decoder.generate(params, prompt[:4], 4)
    with pytest.raises(ValueError, match="needs key="):
        decoder.generate(params, prompt, 4, temperature=1.0)
    with pytest.raises(ValueError, match="temperature must be"):
        decoder.generate(params, prompt, 4, temperature=-1.0)
    with pytest.raises(ValueError, match="outside"):
        decoder.generate(params, prompt + 200, 4)
    with pytest.raises(ValueError, match="max_len=65 must be in"):
        Decoder(decoder.model, decoder.mesh, batch=8, max_len=65)
    with pytest.raises(ValueError, match="batch size 7"):
        Decoder(decoder.model, decoder.mesh, batch=7, max_len=8)


# The GPT: learned positions, layer norms, biases, 4 heads (split on model = 4), an odd
# vocabulary (66, padded to 68 on 4), d_ff 72 (padded to 76), weights × 0.1.
GPT = models.Gpt(vocab_size=66, d_model=32, num_heads=4, num_layers=2, d_ff=72, context=MAX_LEN,
                 init_scale=0.1)  # fmt: skip


def _gpt_float64(params, ids):
    """The GPT in float64 numpy, written from its definition (models/networks/gpt.py's
    docstring): logits[B, S, V]."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    b, s = ids.shape
    heads, hd = GPT.num_heads, GPT.d_model // GPT.num_heads

    def norm(x, q):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * q["scale"] + q[
            "bias"
        ]

    def split(t):
        return t.reshape(b, s, heads, hd).transpose(0, 2, 1, 3)

    x = p["embed"]["table"][ids] + p["pos"]["table"][:s]
    for blk in p["blocks"]:
        a, h = blk["attn"], norm(x, blk["ln1"])
        q, k = split(h @ a["wq"] + a["bq"]), split(h @ a["wk"] + a.get("bk", 0))
        v = split(h @ a["wv"] + a["bv"])
        scores = np.where(np.tril(np.ones((s, s), bool)), q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd),
                          -np.inf)  # fmt: skip
        w = np.exp(scores - scores.max(-1, keepdims=True))
        o = (w / w.sum(-1, keepdims=True)) @ v
        x = x + o.transpose(0, 2, 1, 3).reshape(b, s, -1) @ a["wo"] + a["bo"]
        u = norm(x, blk["ln2"]) @ blk["up"]["w"] + blk["up"]["b"]
        gelu = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
        x = x + gelu @ blk["down"]["w"] + blk["down"]["b"]
    return norm(x, p["ln_f"]) @ p["head"]["w"]


@pytest.mark.parametrize("mesh_name", ["1x1", "2x4"])
def test_gpt_cached_logits_equal_a_float64_recompute(mesh_name):
    check_gpt(mesh_name)


@functools.cache
def _gpt_decoder(mesh_name, decoder_type=Decoder):
    """``(decoder, full params, placed params)`` of the GPT on ``mesh_name``, built once per
    mesh and decoder class (its programs compile once for the tests that share it)."""
    shape = {"data": 1, "model": 1} if mesh_name == "1x1" else {**MESHES, **CP_MESHES}[mesh_name]
    decoder = decoder_type(GPT, mesh_for(shape), batch=BATCH, max_len=MAX_LEN)
    full = GPT.init(jax.random.key(3))
    return decoder, full, decoder.place(full)


def _gpt_bound(full, ids, exact):
    """What a float32 GPT may differ from the float64 forward ``exact`` of ``ids``: 4 times
    the GPT's own plain-jnp reference's error, plus 4 ulps of the largest logit."""
    own = np.abs(np.asarray(GPT.reference_logits(full, ids)) - exact).max()
    return 4 * own + 4 * np.finfo(np.float32).eps * np.abs(exact).max()


def check_gpt(mesh_name, decoder_type=Decoder, steps: int = STEPS):
    """The GPT decodes too (its learned positions read at the cache's positions): a prefill
    and 32 steps within 4 times the float32 error of the GPT's own plain-jnp reference against
    the float64 forward, plus 4 ulps of the largest logit."""
    decoder, full, params = _gpt_decoder(mesh_name, decoder_type)
    ids, _ = tokens(GPT.vocab_size, seed=6, seq=PROMPT + steps)
    got = teacher_forced(decoder, params, ids, steps)
    exact = _gpt_float64(full, ids)
    bound = _gpt_bound(full, ids, exact)
    assert np.abs(got - exact).max() <= bound, (np.abs(got - exact).max(), bound)
    # The first greedy token is the argmax of the prompt's last logits, where the margin is clear.
    greedy = np.asarray(decoder.generate(params, ids[:, :PROMPT], 4))
    assert greedy.shape == (BATCH, 4)
    last = exact[:, PROMPT - 1]
    top2 = np.sort(last, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * bound
    assert clear.sum() >= BATCH - 1, top2
    np.testing.assert_array_equal(greedy[clear, 0], last.argmax(-1)[clear])


# --- The edges of the cache's blocked read (``_flash.cache_attention``). The tests above read
# one block (BLOCK_K = 512 keys, clipped to max_len) and prompts of several tokens, where a
# block count one short, or a clamped last block read wrong, changes nothing. Here the blocks
# are of 4 keys: a one-token prompt reads a cache of one key, and a short decoding crosses
# several blocks' ends, the last block clamped where max_len is not a multiple of 4.
EDGE_BLOCK = 4


@contextlib.contextmanager
def key_blocks(block: int):
    """Decoders traced inside read their cache in blocks of ``block`` keys: the cached
    attention reads ``shardops.layers._attention_core.BLOCK_K`` when it is traced, and a
    decoder's programs keep the size they were traced with (build and run the decoder inside)."""
    before = _attention_core.BLOCK_K
    _attention_core.BLOCK_K = block
    try:
        yield
    finally:
        _attention_core.BLOCK_K = before


def test_a_one_token_prompt_decodes_across_key_blocks():
    check_one_token_prompt()


def check_one_token_prompt(decoder_type=Decoder, mesh_name="1x8"):
    """A prefill of one token (the cache's length 1: one key in the first block), then 11
    steps to max_len 12, a multiple of the block of 4: steps write each block's first position
    (4 and 8: lengths 5 and 9) and fill the last block to its end. The gqa Llama (rotary
    positions from 0; tp on 1×8, its 2 KV heads replicated) against transformers' float64
    forward, within ``check_close``'s bound."""
    max_len = 3 * EDGE_BLOCK
    ckpt = HfLlama(checkpoint("gqa"))
    ids, _ = tokens(ckpt.model().vocab_size, seed=8, seq=max_len)
    with key_blocks(EDGE_BLOCK):
        decoder = decoder_type(ckpt.model(), mesh_for(MESHES[mesh_name]), batch=BATCH,
                               max_len=max_len)  # fmt: skip
        params = ckpt.load(decoder.setup, optimizer_state=False)
        got = teacher_forced(decoder, params, ids, steps=max_len - 1, prompt=1)
    check_close(got, checkpoint("gqa"), ids, f"gqa {mesh_name}: a one-token prompt, blocks of 4")


def test_prompts_and_steps_at_a_key_blocks_end_decode():
    check_block_edges()


def check_block_edges(decoder_type=Decoder, mesh_name="2x4"):
    """Prompts of block − 1, block and block + 1 tokens (3, 4, 5), each followed by steps to
    the end of a cache of max_len 10, not a multiple of the block of 4: a prefill ending on
    either side of a block's end, a step writing position 4 (the second block's first), and
    steps at 8 and 9 reading the last block clamped to the cache's end (keys 6 … 9, of which 6
    and 7 already folded in). The GPT (learned positions read from ``start``; 2d on 2×4, its 4
    heads split) against its float64 forward, within ``check_gpt``'s bound."""
    max_len = 2 * EDGE_BLOCK + 2
    full = GPT.init(jax.random.key(3))
    ids, _ = tokens(GPT.vocab_size, seed=9, seq=max_len)
    exact = _gpt_float64(full, ids)  # [B, 10, V]
    bound = _gpt_bound(full, ids, exact)
    with key_blocks(EDGE_BLOCK):
        decoder = decoder_type(GPT, mesh_for(MESHES[mesh_name]), batch=BATCH, max_len=max_len)
        params = decoder.place(full)
        for prompt in (EDGE_BLOCK - 1, EDGE_BLOCK, EDGE_BLOCK + 1):
            got = teacher_forced(decoder, params, ids, steps=max_len - prompt, prompt=prompt)
            err = np.abs(got - exact).max(axis=(0, 2))  # [10]: the worst error at each position
            assert err.max() <= bound, (f"prompt {prompt}", err, bound)


def documented_draws(logits, key, temperature):
    """What the module docstring says ``generate(temperature=T, key=key)`` draws from
    ``logits[B, steps, V]`` (the logits each token is drawn from), written from the docs alone:
    step ``t``'s key is ``fold_in(key, t)``; entry ``(r, v)`` of its Gumbel noise ``g`` is
    ``gumbel(fold_in(fold_in(step_key, r), v))`` for the global row ``r`` and token id ``v``;
    the token is ``argmax(logits / T + g)``. Returns the tokens ``[B, steps]``, the gap between
    the two largest of ``logits / T + g`` and the largest ``|g|``."""
    b, steps, vocab = logits.shape

    def entry(t, r, v):
        step_key = jax.random.fold_in(key, t)
        return jax.random.gumbel(jax.random.fold_in(jax.random.fold_in(step_key, r), v), (),
                                 jnp.float32)  # fmt: skip

    per_token = jax.vmap(entry, (None, None, 0))
    per_row = jax.vmap(per_token, (None, 0, None))
    g = jax.vmap(per_row, (0, None, None))(jnp.arange(steps), jnp.arange(b), jnp.arange(vocab))
    g = np.asarray(g, np.float64).transpose(1, 0, 2)  # g[B, steps, V]
    z = logits / temperature + g
    top2 = np.sort(z, axis=-1)[..., -2:]
    return z.argmax(-1), top2[..., 1] - top2[..., 0], np.abs(g).max()


KEY_SCHEDULE_MESH = "2x2x2c"  # data 2 (global rows), model 2 (token ids), and a context axis


def test_sampled_tokens_follow_the_documented_key_schedule():
    check_key_schedule()


def check_key_schedule(decoder_type=Decoder, mesh_name=KEY_SCHEDULE_MESH, steps: int = 4,
                       temperature: float = 0.5):  # fmt: skip
    """4 sampled steps of 8 rows equal the draws recomputed from the documented schedule on
    the GPT's float64 forward of the tokens drawn, wherever the gap between the two largest
    perturbed logits exceeds twice what float32 may move them (nearly all). A key reused at
    every step, or the logits not divided by T (their spread is 0.57 per row), draws other
    tokens; so does a mesh that keyed the noise by local rows or token ids."""
    decoder, full, params = _gpt_decoder(mesh_name, decoder_type)
    prompt, _ = tokens(GPT.vocab_size, seed=7, seq=PROMPT)
    key = jax.random.key(5)
    got = np.asarray(decoder.generate(params, prompt, steps, temperature=temperature, key=key))
    text = np.concatenate([prompt, got], axis=1)
    exact = _gpt_float64(full, text[:, :-1])  # [B, S_p + steps − 1, V]
    want, gap, noise = documented_draws(exact[:, PROMPT - 1 :], key, temperature)
    eps = np.finfo(np.float32).eps
    clear = gap > 2 * (_gpt_bound(full, text[:, :-1], exact) / temperature + 4 * eps * noise)
    assert clear.mean() > 0.9, f"only {clear.mean():.0%} of the draws have a clear margin"
    np.testing.assert_array_equal(got[clear], want[clear])


def test_a_context_axis_replicates_the_decoding():
    """A mesh with axes besides data and model (here context) is accepted: the decoding is
    laid out on data and model alone, so the devices along context hold the same rows, cache
    and tokens (computed again, no faster); ``check_key_schedule`` shows the tokens right."""
    decoder, _, params = _gpt_decoder(KEY_SCHEDULE_MESH)
    assert decoder.cache_spec == P(None, "data", "model", None, None)
    assert decoder.batch_spec == P("data")
    prompt, _ = tokens(GPT.vocab_size, seed=7, seq=PROMPT)
    got = decoder.generate(params, prompt, 4, temperature=0.5, key=jax.random.key(5))
    mesh = decoder.mesh
    coords = {d: dict(zip(mesh.axis_names, np.argwhere(mesh.devices == d)[0], strict=True))
              for d in mesh.devices.flat}  # fmt: skip
    held = collections.defaultdict(list)  # rows → (context index, the tokens) of each device
    for shard in got.addressable_shards:
        rows = shard.index[0].indices(BATCH)[:2]
        assert rows == (coords[shard.device]["data"] * 4, coords[shard.device]["data"] * 4 + 4)
        held[rows].append((coords[shard.device]["context"], np.asarray(shard.data)))
    assert len(held) == 2
    for rows, copies in held.items():
        assert {c for c, _ in copies} == {0, 1}, rows
        for _, data in copies:
            np.testing.assert_array_equal(data, copies[0][1])


@contextlib.contextmanager
def refused(kind, pattern):
    """``pytest.raises(kind, match=pattern)`` whose every other outcome (no error, a raw one,
    another message) is an AssertionError, so that the mutation tests see a mutant that lets
    a raw error through as caught."""
    try:
        yield
    except kind as e:
        assert re.search(pattern, str(e)), f"{pattern!r} does not match: {e}"
    except Exception as e:
        raise AssertionError(f"wanted {kind.__name__} matching {pattern!r}; got "
                             f"{type(e).__name__}: {e}") from e  # fmt: skip
    else:
        raise AssertionError(f"wanted {kind.__name__} matching {pattern!r}; nothing raised")


def test_logits_refuses_a_start_past_the_cache_and_rewinds_below_it():
    check_cache_positions()


def check_cache_positions(decoder_type=Decoder, mesh_name="2x4"):
    """A prefill of 8 leaves a cache of length 8; ``start`` 9 or 13 is refused (it would read
    never-written slots). Rewinding to 4 with another token, then stepping to 5, gives the
    float64 logits of that other sequence: the stale slots 4 … 7 are overwritten or masked."""
    decoder, full, params = _gpt_decoder(mesh_name, decoder_type)
    ids, _ = tokens(GPT.vocab_size, seed=6, seq=PROMPT)
    cache = decoder.init_cache()
    assert cache.length == 0
    _, cache = decoder.logits(params, cache, ids, 0)
    assert cache.length == PROMPT
    for start, unwritten in ((PROMPT + 1, "position 8 was"), (PROMPT + 5, "positions 8 … 12 were")):
        pattern = (rf"Decoder.logits: start={start} is past the cache's next position {PROMPT} "
                   rf"\(cache.length\): {unwritten} never written.* Feed the tokens of those "
                   rf"positions first, or pass start={PROMPT} \(or less, to rewind\)")  # fmt: skip
        with refused(ValueError, pattern):
            decoder.logits(params, cache, ids[:, :1], start)
    other = (ids[:, 4:5] + 1) % GPT.vocab_size  # another token at position 4
    text = np.concatenate([ids[:, :4], other, ids[:, 5:6]], axis=1)
    at4, cache = decoder.logits(params, cache, other, 4)
    at5, cache = decoder.logits(params, cache, ids[:, 5:6], 5)
    assert cache.length == 6
    exact = _gpt_float64(full, text)
    got = np.concatenate([np.asarray(at4), np.asarray(at5)], axis=1)
    bound = _gpt_bound(full, text, exact)
    assert np.abs(got - exact[:, 4:]).max() <= bound, (np.abs(got - exact[:, 4:]).max(), bound)


def test_misuse_is_a_shardops_error():
    check_misuse()


def check_misuse(decoder_type=Decoder):
    """An empty or 1-D prompt, a TrainState, the model's unplaced params and another model's
    (another depth, another width) given to ``generate``, ``logits`` and the decoder's
    ``setup.logits``: each a ValueError or TypeError naming the argument, what was expected,
    what came and the fix, raised before anything is traced."""
    decoder, full, params = _gpt_decoder("2x4", decoder_type)
    prompt, _ = tokens(GPT.vocab_size, seed=6, seq=PROMPT)
    with refused(ValueError, r"prompt has no tokens: prompt\(8, 0\); give each row at least "
                             r"one \(.* a BOS id\)"):  # fmt: skip
        decoder.generate(params, prompt[:, :0], 4)
    with refused(ValueError, r"ids has no tokens: ids\(8, 0\)"):
        decoder.logits(params, decoder.init_cache(), prompt[:, :0], 0)
    with refused(ValueError, r"prompt must be integer tokens \[batch, tokens\]; got int32\(8,\)"
                             r"\. One sequence is one row: prompt\[None\] for a decoder of "
                             r"batch=1, or np\.repeat\(prompt\[None\], 8, axis=0\)"):  # fmt: skip
        decoder.generate(params, prompt[0], 4)
    with refused(TypeError, r"cache must be the KVCache of decoder.init_cache\(\) .*got tuple"):
        decoder.logits(params, (decoder.init_cache().k, decoder.init_cache().v), prompt, 0)
    with refused(ValueError, r"Decoder\.logits: start=-1 is negative: it is the position of "
                             r"ids\[:, 0\], 0 for a prefill or cache\.length to continue"):  # fmt: skip
        decoder.logits(params, decoder.init_cache(), prompt, -1)
    old = decoder.init_cache()
    _, cache = decoder.logits(params, old, prompt, 0)  # donates old: its arrays are gone
    with refused(ValueError, r"Decoder\.logits: cache\.k has been deleted or donated to an "
                             r"earlier call\. logits donates the cache it is given: pass the "
                             r"cache the latest call returned .* KVCache\(jnp\.copy\(cache\.k\)"):  # fmt: skip
        decoder.logits(params, old, prompt, 0)
    decoder.logits(params, cache, prompt, 0)  # the cache returned rewinds
    state = decoder.setup.shard(full)
    deeper = dataclasses.replace(GPT, num_layers=3).init(jax.random.key(0))
    wider = dataclasses.replace(GPT, d_model=48).init(jax.random.key(0))
    calls = {
        "Decoder.generate": (lambda p: decoder.generate(p, prompt, 4), r"decoder\.place"),
        "Decoder.logits": (lambda p: decoder.logits(p, decoder.init_cache(), prompt, 0),
                           r"decoder\.place"),
        "setup.logits": (lambda p: decoder.setup.logits(p, decoder.setup.place_batch(prompt)),
                         r"setup\.shard"),
    }  # fmt: skip
    for what, (call, place) in calls.items():
        with refused(TypeError, rf"{what}: params is a TrainState \(params and optimizer "
                                rf"state\); pass state\.params"):  # fmt: skip
            call(state)
        with refused(ValueError, rf"{what}: params\['embed'\]\['table'\] has shape \(66, 32\), "
                                 rf"the model's own; this layout stores it padded to \(68, 32\)\. "
                                 rf"Lay the params out with {place}"):  # fmt: skip
            call(full)
        with refused(ValueError, rf"{what}: params are not this model's tree: missing \[\], "
                                 rf"unknown \[\"\['blocks'\]\[2\].* \(15 in all\)\. Pass the "
                                 rf"params of the model this was built for, laid out by {place}"):  # fmt: skip
            call(deeper)
        with refused(ValueError, rf"{what}: params\['blocks'\]\[0\]\['attn'\]\['bo'\] has "
                                 rf"shape \(48,\); this model's is \(32,\) \(stored as "
                                 rf"\(32,\)\): params of another model\? Pass the params of the "
                                 rf"model this was built for, laid out by {place}"):  # fmt: skip
            call(wider)


@pytest.mark.parametrize("heads, kv, p, n", [
    (8, 2, 8, 1), (8, 2, 4, 1), (8, 2, 2, 1), (8, 4, 2, 2), (8, 8, 4, 2), (8, 1, 4, 1),
    (6, 2, 3, 2),  # device 1 holds query heads 2, 3: KV heads 0 and 1
    (12, 6, 4, 2),  # device 1 holds query heads 3, 4, 5: KV heads 1 and 2
])  # fmt: skip
def test_kv_cache_heads_are_the_ones_a_device_reads(heads, kv, p, n):
    """The KV heads a device caches: KV/p where p divides KV, else the most any device's query
    heads read (worked out by hand for each row)."""
    assert kv_cache_heads(heads, kv, p) == n
