"""The decoder's layer context (``models/generation/_cached_context.py``): the decoder runs the
model's own ``apply`` (a spy on it counts the traces), and a forward that does not attend once a
layer, or asks for positions of its own, is refused by name before a wrong cache could come
out. That the decoding checks catch mutants of the models' forward is
``test_decoding_mutations.py``'s ``MODEL`` (the GPT's positions and first norm, the Llama's
MLP residual and final norm)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _messages import refused
from _model_checks import mesh_for
from jax.sharding import PartitionSpec as P

import shardops_models as models
from shardops_models.generation import Decoder
from shardops_models.generation._cached_context import CachedParallel
from shardops_models.strategies.parallel import strategy_named, wrap
from shardops_models.strategies.plan import leaf_roles

ONE_DEVICE = {"data": 1, "model": 1}
GPT = models.Gpt(vocab_size=32, d_model=16, num_heads=2, num_layers=2, context=8)
LLAMA = models.Llama(vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                     context=8)  # fmt: skip


def _decoding(model):
    """``(decoder, placed params, ids[2, 4])`` of ``model`` on one device."""
    decoder = Decoder(model, mesh_for(ONE_DEVICE), batch=2, max_len=8)
    ids = np.arange(8, dtype=np.int32).reshape(2, 4) % model.vocab_size
    return decoder, decoder.place(model.init(jax.random.key(0))), ids


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_the_decoder_runs_the_models_own_apply(model, monkeypatch):
    """Each program the decoder traces (a ``logits`` call, ``generate``'s prefill and step)
    calls ``type(model).apply`` with a ``CachedParallel``: there is no second forward."""
    seen = []
    apply = type(model).apply

    def spy(self, ctx, params, ids, **kwargs):
        seen.append((type(ctx), ids.shape))
        return apply(self, ctx, params, ids, **kwargs)

    decoder, params, ids = _decoding(model)  # build may trace apply with a probe of its own
    monkeypatch.setattr(type(model), "apply", spy)
    logits, cache = decoder.logits(params, decoder.init_cache(), ids, 0)
    assert logits.shape == (2, 4, model.vocab_size) and cache.length == 4
    decoder.generate(params, ids, 3)
    assert seen == [(CachedParallel, (2, 4)), (CachedParallel, (2, 4)), (CachedParallel, (2, 1))]


def _block_attending(times: int):
    """A ``_block`` for the model whose attention runs ``times`` times (0: none) on the
    block's input, each added to the residual stream."""

    def patched(self, ctx, *args):
        def run(p, x):
            h = x
            for _ in range(times):
                h = h + ctx.attention(p["attn"], x, num_heads=self.num_heads,
                                      num_kv_heads=getattr(self, "num_kv_heads", None),
                                      rope_theta=getattr(self, "rope_theta", None))  # fmt: skip
            return h

        return run

    return patched


@pytest.mark.parametrize("times, error", [
    (0, dict(argument="CachedParallel.written", got="called ctx.attention 0 times",
             expected="the cache holds 2 layers, one call each",
             fix="every layer attends once")),
    (2, dict(argument="CachedParallel.attention", got="call 3 of this forward",
             expected="the cache holds 2 layers, one call each",
             fix="Make one context per forward")),
])  # fmt: skip
def test_an_unrolled_forward_that_does_not_attend_once_a_layer_is_refused(times, error,
                                                                           monkeypatch):  # fmt: skip
    """The GPT's blocks (one ``ctx.unit`` each): a block that attends twice would read and
    write the next layer's cache; one that never attends would leave its layer unwritten."""
    monkeypatch.setattr(models.Gpt, "_block", _block_attending(times))
    decoder, params, ids = _decoding(GPT)
    with refused(ValueError, **error):
        decoder.logits(params, decoder.init_cache(), ids, 0)


def test_a_stacked_layer_that_attends_twice_is_refused(monkeypatch):
    """The Llama's blocks (``ctx.scan``): each layer of the loop reads and writes one slice."""
    monkeypatch.setattr(models.Llama, "_block", _block_attending(2))
    decoder, params, ids = _decoding(LLAMA)
    with refused(ValueError, argument="CachedParallel.scan", got="called ctx.attention 2 times",
                 expected="one slice a layer", fix="every layer attends once"):  # fmt: skip
        decoder.logits(params, decoder.init_cache(), ids, 0)


def _context(layers: int):
    """A context over an empty cache of ``layers`` layers ``[L, b=2, n=1, S_max=8, hd=8]``."""
    cache = (jnp.zeros((layers, 2, 1, 8, 8)),) * 2
    return CachedParallel(strategy_named("2d"), cache=cache, start=0)


def test_stacked_layers_beyond_the_cache_are_refused():
    """The Llama's 2 stacked layers against a cache of 1: refused before the loop runs."""
    abstract = jax.eval_shape(LLAMA.init, jax.random.key(0))
    roles = leaf_roles(LLAMA.plan(), jax.tree.map(lambda a: tuple(a.shape), abstract))
    tree = wrap(abstract, roles, jax.tree.map(lambda _: P(), roles))
    with refused(ValueError, argument="CachedParallel.scan", got="2 stacked layers",
                 expected="the cache holds 1 layers", fix="Decoder.init_cache"):  # fmt: skip
        _context(1).scan(lambda p, x: x, tree["blocks"], jnp.zeros((2, 4, 16)))


@pytest.mark.parametrize("option, got", [
    ({"positions": jnp.zeros((2, 4), jnp.int32)}, "positions=given"),
    ({"segment_ids": jnp.zeros((2, 4), jnp.int32)}, "segment_ids=given"),
    ({"causal": False}, "causal=False"),
])  # fmt: skip
def test_positions_of_the_models_own_and_bidirectional_attention_are_refused(option, got):
    """The cache's positions are ``start …``, one causal sequence a row: packed documents
    (``segment_ids``), positions of the model's own, or attention to later tokens would be
    computed against a cache that cannot hold them."""
    with refused(ValueError, argument="CachedParallel.attention", got=got,
                 expected="one causal sequence a row", fix="Decode one document a row"):  # fmt: skip
        _context(1).attention({}, jnp.zeros((2, 4, 16)), num_heads=2, **option)


def test_a_cache_that_is_not_a_pair_is_refused():
    with refused(TypeError, argument="CachedParallel: cache", got="got NoneType",
                 expected="the pair (k, v)", fix="Pass cache=(k, v)"):  # fmt: skip
        CachedParallel(strategy_named("2d"))
