"""The stacked GPT (``models.Gpt(stacked=True)``: blocks ``[L, …]`` run by one ``ctx.scan``) is
the unrolled GPT on the same weights: ``init`` draws the same numbers, stacked; the logits are
equal under ``ref`` and a sharded strategy; it trains like its plain reference under a covering
design of strategies (dp, tp, fsdp_sp with remat) and under pipeline parallelism (1F1B alone,
GPipe composed with 2d), which refuses the unrolled GPT; a KV-cache decoder greedily emits the
unrolled one's tokens; the divergence locator names the stacked layer a bug is in."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _gpt_checks import PP_MESHES, check_lm_trajectory, lm_batches
from _messages import refused
from _model_checks import mesh_for

import shardops
import shardops_models as models
from shardops_models.generation import Decoder
from shardops_models.networks.gpt import stack_blocks, unstack_blocks

# 4 blocks: whole layers on 2 and on 4 stages. Every mesh of 8 divides its 8 heads, vocabulary
# and MLP (as tests/_gpt_checks.py's GPT). Weights × 0.1 and clipped SGD at 0.5, as
# tests/strategies/test_pipeline.py's Llama: every leaf moves ≥ 100× the tolerance in 5 steps
# (at 0.02 and clip 0.25 the second norm's bias moves 5e-5), and the clipping's global norm,
# summed over shards and stages, is exercised (the gradient norms stay ≥ 1.4 > 1.5 · 0.25).
GPT_STACKED = models.Gpt(vocab_size=64, d_model=32, num_heads=8, num_layers=4, context=16,
                         d_ff=64, init_scale=0.1, stacked=True)  # fmt: skip
GPT_UNROLLED = dataclasses.replace(GPT_STACKED, stacked=False)
CLIP, SGD_LR = 0.25, 0.5


def test_init_draws_the_unrolled_numbers_stacked():
    """Each block's leaves are the unrolled block's, in order (not reversed, not one block's
    key for all); the rest of the tree is the same; ``unstack_blocks`` inverts the stacking."""
    key = jax.random.key(7)
    flat, stacked = GPT_UNROLLED.init(key), GPT_STACKED.init(key)
    assert jax.tree.map(np.shape, stacked["blocks"]["up"]) == {"w": (4, 32, 64), "b": (4, 64)}
    same = jax.tree.map(np.array_equal, {**flat, "blocks": stack_blocks(flat["blocks"])}, stacked)
    assert all(jax.tree.leaves(same)), same
    again = jax.tree.map(np.array_equal, unstack_blocks(stacked["blocks"]), flat["blocks"])
    assert all(jax.tree.leaves(again))
    blocks = stacked["blocks"]["attn"]["wq"]
    assert not np.array_equal(blocks[0], blocks[1])  # the blocks differ: order is observable
    assert GPT_STACKED.name.endswith(" stacked") and "stacked" not in GPT_UNROLLED.name


@pytest.mark.parametrize(("strategy", "mesh"), [("ref", None), ("2d", {"data": 2, "model": 4})])
def test_logits_equal_the_unrolled_gpt_on_the_same_weights(strategy, mesh):
    """One function of the same weights: the stacked GPT's scan and the unrolled GPT's blocks
    (and both plain references) give the same logits, within float32 rounding of a reordered
    sum (the scan's compiled block may fuse otherwise than the unrolled ones)."""
    params = GPT_UNROLLED.init(jax.random.key(1))
    stacked = {**params, "blocks": stack_blocks(params["blocks"])}
    ids = lm_batches(GPT_STACKED, seed=1)[0][0]  # ids[B, S]
    want = np.asarray(GPT_UNROLLED.reference_logits(params, ids))  # [B, S, V]
    np.testing.assert_allclose(GPT_STACKED.reference_logits(stacked, ids), want, atol=1e-6)
    got = {}
    for model, p in ((GPT_UNROLLED, params), (GPT_STACKED, stacked)):
        setup = models.build(strategy, mesh and shardops.make_mesh(mesh), model=model,
                             optimizer=optax.sgd(0.1))  # fmt: skip
        got[model.stacked] = np.asarray(setup.logits(setup.shard(p).params, setup.place_batch(ids)))
    np.testing.assert_allclose(got[True], want, atol=2e-6)
    np.testing.assert_allclose(got[True], got[False], atol=2e-6)


# A covering design: each strategy once, each optimizer and mesh shape, remat on one.
@pytest.mark.parametrize(("strategy", "mesh", "opt", "remat"), [
    ("dp", "8x1", "sgd", False),
    ("tp", "1x8", "adam", False),
    ("fsdp_sp", "4x2", "sgd", True),
])  # fmt: skip
def test_trains_like_the_reference(strategy, mesh, opt, remat):
    """5 steps equal the plain reference; the compiled collectives equal the traced budget
    (a scan's per-layer gathers and reductions counted once a layer)."""
    check_lm_trajectory(GPT_STACKED, strategy, mesh, opt, remat=remat, clip=CLIP, sgd_lr=SGD_LR,
                        budget=True)  # fmt: skip


@pytest.mark.parametrize(("strategy", "mesh", "m", "opt"), [
    ("ref+1f1b", "pipe2", 2, "sgd"),
    ("2d+gpipe", "p2d2m2", 2, "adam"),
    ("ref+circular", "pipe2", 2, "sgd"),
])  # fmt: skip
def test_pipelines_like_the_reference(strategy, mesh, m, opt):
    """Pipeline parallelism cuts the stacked blocks into contiguous stages (2 blocks a stage;
    circular: 2 chunks of one block a stage, stored in ``stage_order``): 5 steps equal the
    reference; the embedding, positions and head, replicated over the stages, train too
    (every leaf must move)."""
    check_lm_trajectory(GPT_STACKED, models.strategy_named(strategy), mesh, opt, microbatches=m,
                        clip=CLIP, sgd_lr=SGD_LR, budget=opt == "sgd")  # fmt: skip


def test_the_unrolled_gpt_is_refused_by_pipeline_parallelism():
    with refused(ValueError, argument="strategy 'ref+1f1b'", got="the model's plan stacks none",
                 expected="pipelines the stacked layers over 'pipe'", fix="use the strategy "
                 "without pp"):  # fmt: skip
        models.build(models.strategy_named("ref+1f1b"), mesh_for(PP_MESHES["pipe2"]),
                     model=GPT_UNROLLED, optimizer=optax.sgd(0.1), microbatches=2)  # fmt: skip


def test_stacked_must_be_a_bool():
    with refused(TypeError, argument="Gpt: stacked", got="got 'yes'", expected="must be a bool",
                 fix="False: a list, unrolled"):  # fmt: skip
        models.Gpt(stacked="yes")


def test_greedy_decoding_equals_the_unrolled_gpt():
    """The decoder runs the stacked blocks through ``CachedParallel.scan`` (the cache carried
    through the loop, layer ``l`` reading and writing ``k, v[l]``): a prefill's logits equal
    the unrolled GPT's, and 12 greedy tokens are the same (weights × 0.1: clear margins)."""
    model = dataclasses.replace(GPT_STACKED, context=24)
    unrolled = dataclasses.replace(model, stacked=False)
    params = unrolled.init(jax.random.key(3))
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    prompt = lm_batches(model, seed=4, batch=8, seq=8)[0][0]  # prompt[8, 8]
    tokens, logits = {}, {}
    for m, p in ((unrolled, params), (model, {**params, "blocks": stack_blocks(params["blocks"])})):
        decoder = Decoder(m, mesh, batch=8, max_len=24)
        placed = decoder.place(p)
        logits[m.stacked] = np.asarray(decoder.logits(placed, decoder.init_cache(), prompt, 0)[0])
        tokens[m.stacked] = np.asarray(decoder.generate(placed, prompt, 12))
    np.testing.assert_allclose(logits[True], logits[False], atol=2e-6)
    np.testing.assert_array_equal(tokens[True], tokens[False])
    assert len(np.unique(tokens[True])) > 8  # not one token repeated: the steps are exercised


def test_the_locator_names_the_stacked_layer_a_bug_is_in(monkeypatch):
    """``models.locate`` taps each stacked layer under its own path (``['blocks'][i]…``): a
    wrong head split in block 1's attention is the first and only layer beyond its bound
    (beside the stacked attention weights' gradients, which hold block 1's). Two blocks: the
    tapped forward unrolls the scan."""
    model = dataclasses.replace(GPT_STACKED, num_layers=2)
    real, calls = shardops.layers.head_parallel_attention_kernel, [0]

    def kernel(x, params, **kwargs):  # block 1's wk with this device's two halves swapped
        i, calls[0] = calls[0], calls[0] + 1
        if i % model.num_layers == 1:
            wk = params["wk"]  # wk[D, (H·hd)_model]
            half = wk.shape[1] // 2
            params = {**params, "wk": jnp.concatenate([wk[:, half:], wk[:, :half]], axis=1)}
        return real(x, params, **kwargs)

    monkeypatch.setattr(shardops.layers, "head_parallel_attention_kernel", kernel)
    setup = models.build("fsdp_tp", shardops.make_mesh({"data": 4, "model": 2}),
                         model=model, optimizer=optax.sgd(0.1))  # fmt: skip
    params = model.init(jax.random.key(0))
    ids, labels = (a[0, :8] for a in lm_batches(model, seed=5))
    report = models.locate(setup, setup.shard(params).params, ids, labels,
                           reference_params=params, end_to_end=False)  # fmt: skip
    assert report.first == "['blocks'][1]['attn']", str(report)
    layers = {r.layer for r in report.rows if r.beyond and r.what != "param"}
    assert layers == {"['blocks'][1]['attn']"}, str(report)
    # A stacked leaf's gradient is one row [L, …]: attention's, holding block 1's, differ.
    grads = {r.layer for r in report.rows if r.beyond and r.what == "param"}
    assert grads and all(g.startswith("['blocks']['attn']") for g in grads), str(report)
    tapped = {r.layer for r in report.rows if r.what == "output"}
    assert len(tapped) == 2 + 2 * 5 + 2, sorted(tapped)  # embed, pos; 5 a block; ln_f, head
