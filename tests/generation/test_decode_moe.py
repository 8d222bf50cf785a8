"""KV-cache decoding of a Llama with a mixture of experts (Mixtral-style), routed without drops
(``CachedParallel.moe``): greedy tokens of a prefill and every step are the argmax of the full
forward of the same model with a dropless ``Experts`` (``capacity_factor=None``), on one
device, under tp (1×8), 2d (2×4), and with the experts split over an ``expert`` axis (2d+ep,
tp+ep, and ep with no tensor parallelism: the decoder's default on such a mesh); the model
trains at a capacity factor that drops choices of the prompt, and that forward's first token
differs, so a decoder that kept the training capacity in its prefill fails (its mutant is
caught); under 2d the experts cost no collective over the batch; under ep each forward's slots
go to their experts' devices by AllToAll (bytes traced), and a kernel that sends them to the
next device's experts is caught; a second ``generate`` runs its program without tracing
again; a scanned layer that does not return ``(x, out)`` is refused by name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _messages import refused
from _model_checks import mesh_for
from _moe_checks import moe_mutant
from _mutants import mutant
from test_cached_context import _block_attending

import shardops
import shardops_models as models
from shardops.inspect import collectives
from shardops_models.generation import Decoder, _cached_context, decoding

E, K = 4, 2
# capacity_factor 0.5: C = ceil(0.5 · 12 · 2 / 4) = 3 slots per expert for a prompt's 24
# choices; the training forward drops about half of them. Weights N(0, 0.3²): routing and
# logits far from ties (the margins below).
MODEL = models.Llama(vocab_size=64, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2,
                     d_ff=32, context=32, init_scale=0.3,
                     experts=models.Experts(num_experts=E, k=K, capacity_factor=0.5))  # fmt: skip
DROPLESS = dataclasses.replace(MODEL, experts=dataclasses.replace(MODEL.experts,
                                                                  capacity_factor=None))  # fmt: skip
PROMPT, STEPS, BATCH = 12, 6, 4
MESHES = {
    "1x1": {"data": 1, "model": 1},  # the unsharded decoding
    "1x8": {"data": 1, "model": 8},  # tp: each expert's hidden units over 8, F = 32 → 4 each
    "2x4": {"data": 2, "model": 4},  # 2d
    "d2e2m2": {"data": 2, "expert": 2, "model": 2},  # 2d+ep: the experts split over expert
    "e4m2": {"expert": 4, "model": 2},  # tp+ep
    "e4m1": {"expert": 4, "model": 1},  # ep (no tensor parallelism)
}


def _prompt():
    return np.random.default_rng(1).integers(0, MODEL.vocab_size, (BATCH, PROMPT), np.int32)


def _clear_argmax(logits, what: str) -> np.ndarray:
    """The argmax of float32 ``logits[B, T, V]``, each with a top-2 margin far beyond the two
    float32 programs' rounding (64 ulps of the largest logit), so that the comparison is
    exact: a failure here is a seed to change, not a decoder bug."""
    top2 = np.sort(logits, axis=-1)[..., -2:]
    margin = (top2[..., 1] - top2[..., 0]).min()
    bound = 64 * np.finfo(np.float32).eps * np.abs(logits).max()
    assert margin > bound, f"{what}: a top-2 margin of {margin:.3g} ≤ {bound:.3g}"
    return logits.argmax(-1)


def check_greedy(mesh_name: str = "1x1", decoder_type=Decoder) -> None:
    """Greedy ``generate`` from a prompt the training forward drops choices of: each token is
    the argmax of the dropless forward of the prompt and the tokens before it."""
    params, prompt = MODEL.init(jax.random.key(0)), _prompt()
    dropped = np.asarray(MODEL.expert_stats(params, prompt)["dropped"])  # [L, E]
    assert dropped.max() > 0.25, f"the training capacity drops too little: {dropped}"
    decoder = decoder_type(MODEL, mesh_for(MESHES[mesh_name]), batch=BATCH,
                           max_len=PROMPT + STEPS)  # fmt: skip
    got = np.asarray(decoder.generate(decoder.place(params), prompt, STEPS))  # [B, steps]
    fed = np.concatenate([prompt, got[:, :-1]], axis=1)  # each token's inputs
    full = np.asarray(DROPLESS.reference_logits(params, fed))[:, PROMPT - 1 :]  # [B, steps, V]
    want = _clear_argmax(full, "the dropless forward")
    # The training capacity's forward of the prompt picks another first token in some row:
    # a prefill that dropped would be seen.
    trained = np.asarray(MODEL.reference_logits(params, prompt))[:, -1]  # [B, V]
    assert (trained.argmax(-1) != want[:, 0]).any(), "the drops change no first token"
    np.testing.assert_array_equal(got, want, err_msg=f"greedy tokens on {mesh_name}")


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_greedy_tokens_are_the_dropless_forwards_argmax_at_every_step(mesh_name):
    check_greedy(mesh_name)


TRAINING_CAPACITY = (  # the mutant: the decoder routes at the model's training capacity
    "        return super().moe(p, x, k=k, capacity_factor=experts / k if split else None,",
    "        return super().moe(p, x, k=k, capacity_factor=capacity_factor,",
)


@pytest.mark.parametrize("mutated", [False, True], ids=["copy", "training_capacity"])
def test_a_decoder_that_keeps_the_training_capacity_is_caught(monkeypatch, mutated):
    """The mutant (its prefill drops the prompt's overflowing choices) fails ``check_greedy``;
    its unmutated copy passes."""
    line, new = TRAINING_CAPACITY
    module = mutant(_cached_context, "training_capacity", line, new if mutated else line)
    monkeypatch.setattr(decoding, "CachedParallel", module.CachedParallel)
    decoder_type = type("Decoder_training_capacity", (decoding.Decoder,), {})
    try:
        if mutated:
            with pytest.raises(AssertionError, match="greedy tokens"):
                check_greedy("1x1", decoder_type)
        else:
            check_greedy("1x1", decoder_type)
    finally:
        jax.clear_caches()


def test_the_experts_cost_no_collective_over_data():
    """On 2×4 the program's collectives are over model alone (the attention's, the experts'
    combine, the embedding's and the argmax's), traced (``budget``) and compiled: every
    expert is on every row shard (no AllToAll over data), and the routing statistics, which
    the decoder discards, are not AllReduced over the batch."""
    decoder = Decoder(MODEL, mesh_for(MESHES["2x4"]), batch=BATCH, max_len=PROMPT + STEPS)
    traced = {axes for _, axes in decoder.budget(PROMPT, 2).totals(requested=True)}
    assert traced == {("model",)}, traced
    compiled = {c.axes for c in collectives(decoder.mesh, decoder.generate_program(2),
                                            *_abstract(decoder))}  # fmt: skip
    assert compiled == {("model",)}, compiled


def test_under_ep_each_token_goes_to_its_experts_device_by_all_to_all():
    """On data 2 × expert 2 × model 2 (``2d+ep``) the experts stay split over ``expert``
    (``E/2`` a device) and every forward, the prefill and each one-token step, sends its
    rows' slots ``[E, b·s, D]`` to the experts' devices and back: 2 AllToAlls a layer over
    ``expert``, ``L · 2 · E · b · (S_p + steps − 1) · D · 4`` bytes in all (float32, ``b = B/4``
    rows a device, ``s`` = the tokens of the forward), and nothing over ``data``."""
    decoder = Decoder(MODEL, mesh_for(MESHES["d2e2m2"]), batch=BATCH, max_len=PROMPT + STEPS)
    assert decoder.setup.strategy.name == "2d+ep"
    assert decoder.param_specs["blocks"]["moe"]["gate"][1] == "expert"
    rows, d = BATCH // 4, MODEL.d_model
    for steps in (1, 3):
        totals = decoder.budget(PROMPT, steps).totals(requested=True)
        assert set(totals) == {("all-reduce", ("model",)), ("all-to-all", ("expert",))}, totals
        want = MODEL.num_layers * 2 * E * rows * (PROMPT + steps - 1) * d * 4
        assert totals[("all-to-all", ("expert",))] == want, (steps, totals)


WRONG_DEVICE = (  # the mutant: each row's slots go to the next device's experts
    "        xe = all_to_all(xe, expert_axis, split_axis=0, concat_axis=1, reason=_DISPATCH)",
    "        xe = all_to_all(jnp.roll(xe, xe.shape[0] // lax.axis_size(expert_axis), axis=0),"
    " expert_axis, split_axis=0, concat_axis=1, reason=_DISPATCH)",
)


@pytest.mark.parametrize("mutated", [False, True], ids=["copy", "wrong_device"])
def test_decoding_that_sends_tokens_to_the_wrong_devices_experts_is_caught(monkeypatch, mutated):
    """The mutant kernel sends each row's slots to the experts of the next device on
    ``expert`` (the same shapes, finite tokens): ``check_greedy`` under ep fails; its
    unmutated copy passes."""
    line, new = WRONG_DEVICE
    module = moe_mutant("wrong_device", line, new if mutated else line)
    monkeypatch.setattr(shardops.layers, "moe_kernel", module.moe_kernel)
    try:
        if mutated:
            with pytest.raises(AssertionError, match="greedy tokens"):
                check_greedy("e4m1")
        else:
            check_greedy("e4m1")
    finally:
        jax.clear_caches()


def _abstract(decoder):
    """Abstract placed ``(params, prompt, key)`` of ``decoder.generate_program``."""
    sharding = jax.sharding.NamedSharding
    params = jax.tree.map(
        lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                             sharding=sharding(decoder.mesh, spec)),
        decoder.setup.padding.abstract(jnp.float32), decoder.param_specs)  # fmt: skip
    prompt = jax.ShapeDtypeStruct((BATCH, PROMPT), jnp.int32,
                                  sharding=sharding(decoder.mesh, decoder.batch_spec))  # fmt: skip
    return params, prompt, jax.random.key(0)


def test_a_second_generate_runs_the_program_without_tracing_again(monkeypatch):
    """``generate`` keeps its program per (steps, temperature): the same request again traces
    the model's forward no more (it would compile again: the example times that second call);
    another length traces a program of its own."""
    traced = []
    apply = models.Llama.apply

    def spy(self, ctx, params, ids, **kwargs):
        traced.append(ids.shape)
        return apply(self, ctx, params, ids, **kwargs)

    decoder = Decoder(MODEL, mesh_for(MESHES["1x1"]), batch=BATCH, max_len=PROMPT + STEPS)
    params = decoder.place(MODEL.init(jax.random.key(0)))
    monkeypatch.setattr(models.Llama, "apply", spy)
    first = np.asarray(decoder.generate(params, _prompt(), STEPS))
    assert traced == [(BATCH, PROMPT), (BATCH, 1)]  # the prefill and the step
    np.testing.assert_array_equal(decoder.generate(params, _prompt(), STEPS), first)
    assert len(traced) == 2
    decoder.generate(params, _prompt(), STEPS - 1)
    assert len(traced) == 4


def test_a_scanned_layer_without_its_outputs_is_refused(monkeypatch):
    """The Llama with experts scans its blocks with ``outputs=True``: a block that returns
    the residual stream alone (it attends once, as the cache needs) is refused by name."""
    monkeypatch.setattr(models.Llama, "_block", _block_attending(1))
    decoder = Decoder(MODEL, mesh_for(MESHES["1x1"]), batch=BATCH, max_len=PROMPT)
    params = decoder.place(MODEL.init(jax.random.key(0)))
    with refused(ValueError, argument="CachedParallel.scan(outputs=True)", got="got float32[4,12,32]",
                 expected="must return (x, out)", fix="Return the pair"):  # fmt: skip
        decoder.logits(params, decoder.init_cache(), _prompt(), 0)


@pytest.mark.parametrize(("strategy", "why"), [
    ("fsdp_tp", "its fsdp does not decode"),
    ("dp_sp", "sp splits the sequence"),
    ("dp+ep", "it has no tp axis"),
])  # fmt: skip
def test_a_strategy_that_is_not_a_decoding_layout_is_refused(strategy, why):
    with refused(ValueError, argument=f"strategy {strategy!r}", got=why,
                 expected="'tp', '2d', 'tp+ep' or '2d+ep'", fix="decoder.place"):  # fmt: skip
        Decoder(MODEL, mesh_for(MESHES["d2e2m2"]), batch=BATCH, max_len=PROMPT,
                strategy=strategy)  # fmt: skip


def test_a_batch_the_picked_ep_layout_cannot_split_names_the_choice_and_the_way_back():
    """On a mesh with an ``expert`` axis the decoder picks ``2d+ep`` (rows over data × expert):
    a batch of 2 over 4 row shards is refused, saying why that layout was picked and how to
    decode with every expert on each device instead."""
    with refused(ValueError, argument="batch size 2", got="4 devices of mesh axes ('data', "
                 "'expert')", expected="picked strategy '2d+ep'", fix="Pass strategy='2d'"):  # fmt: skip
        Decoder(MODEL, mesh_for(MESHES["d2e2m2"]), batch=2, max_len=PROMPT)
    decoder = Decoder(MODEL, mesh_for(MESHES["d2e2m2"]), batch=2, max_len=PROMPT, strategy="2d")
    assert decoder.setup.strategy.name == "2d"


def test_sampled_tokens_under_ep_are_the_unsharded_decoders():
    """The Gumbel draw's row index under ep (rows over data × expert, data-major) is the
    global row: sampling at temperature 1 with one key draws the tokens of one device."""
    params, prompt = MODEL.init(jax.random.key(0)), _prompt()
    key, drawn = jax.random.key(7), {}
    for name in ("1x1", "d2e2m2", "e4m1"):
        decoder = Decoder(MODEL, mesh_for(MESHES[name]), batch=BATCH, max_len=PROMPT + STEPS)
        drawn[name] = np.asarray(decoder.generate(decoder.place(params), prompt, STEPS,
                                                  temperature=1.0, key=key))  # fmt: skip
    np.testing.assert_array_equal(drawn["d2e2m2"], drawn["1x1"])
    np.testing.assert_array_equal(drawn["e4m1"], drawn["1x1"])
    assert len(np.unique(drawn["1x1"])) > STEPS, "the draw is nearly constant"
