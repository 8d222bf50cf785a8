"""KV-cache decoding (``shardops_models.generation.Decoder``) against transformers' float64
forward of the same checkpoint (``_hf_checks``): the cached logits of a prefill and 32 one-token
steps equal a full recompute within the float32 bound, under tp (1×8) and 2d (2×4, 4×2: KV
heads replicated and split); greedy tokens equal the unsharded model's wherever the top-2
margin exceeds that bound; sampling draws the same tokens on every mesh for one key, from
softmax(logits / T); the compiled program's collectives are the documented ones."""

import collections
import dataclasses

import jax
import numpy as np
import pytest
import torch
from _gpt_checks import MESHES
from _hf_checks import check_close, checkpoint, hf_logits, tokens
from _model_checks import mesh_for

import shardops_models as models
from shardops.inspect import collectives
from shardops.layers import kv_cache_heads
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


def teacher_forced(decoder, params, ids, steps: int = STEPS):
    """The logits of a prefill of PROMPT tokens, then ``steps`` one-token steps fed the true
    next token: ``[B, PROMPT + steps, V]``."""
    cache = decoder.init_cache()
    logits, cache = decoder.logits(params, cache, ids[:, :PROMPT], 0)  # the prefill
    out = [np.asarray(logits)]
    for t in range(PROMPT, PROMPT + steps):
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


def check_gpt(mesh_name, decoder_type=Decoder, steps: int = STEPS):
    """The GPT decodes too (its learned positions read at the cache's positions): a prefill
    and 32 steps within 4 times the float32 error of the GPT's own plain-jnp reference against
    the float64 forward, plus 4 ulps of the largest logit."""
    shape = {"data": 1, "model": 1} if mesh_name == "1x1" else MESHES[mesh_name]
    decoder = decoder_type(GPT, mesh_for(shape), batch=BATCH, max_len=MAX_LEN)
    full = GPT.init(jax.random.key(3))
    params = decoder.place(full)
    ids, _ = tokens(GPT.vocab_size, seed=6, seq=PROMPT + steps)
    got = teacher_forced(decoder, params, ids, steps)
    exact = _gpt_float64(full, ids)
    own = np.abs(np.asarray(GPT.reference_logits(full, ids)) - exact).max()
    bound = 4 * own + 4 * np.finfo(np.float32).eps * np.abs(exact).max()
    assert np.abs(got - exact).max() <= bound, (np.abs(got - exact).max(), bound)
    # The first greedy token is the argmax of the prompt's last logits, where the margin is clear.
    greedy = np.asarray(decoder.generate(params, ids[:, :PROMPT], 4))
    assert greedy.shape == (BATCH, 4)
    last = exact[:, PROMPT - 1]
    top2 = np.sort(last, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * bound
    assert clear.sum() >= BATCH - 1, top2
    np.testing.assert_array_equal(greedy[clear, 0], last.argmax(-1)[clear])


@pytest.mark.parametrize("heads, kv, p, n", [
    (8, 2, 8, 1), (8, 2, 4, 1), (8, 2, 2, 1), (8, 4, 2, 2), (8, 8, 4, 2), (8, 1, 4, 1),
    (6, 2, 3, 2),  # device 1 holds query heads 2, 3: KV heads 0 and 1
    (12, 6, 4, 2),  # device 1 holds query heads 3, 4, 5: KV heads 1 and 2
])  # fmt: skip
def test_kv_cache_heads_are_the_ones_a_device_reads(heads, kv, p, n):
    """The KV heads a device caches: KV/p where p divides KV, else the most any device's query
    heads read (worked out by hand for each row)."""
    assert kv_cache_heads(heads, kv, p) == n
