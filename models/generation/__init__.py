"""Generating text from shardops' models: KV-cache decoding under tensor and expert
parallelism.

decoder = generation.Decoder(model, mesh, batch=8, max_len=256)
tokens = decoder.generate(decoder.place(params), prompt, steps=64, temperature=0.8,
                          key=jax.random.key(0))
logits, cache = decoder.logits(params, decoder.init_cache(), prompt, 0)  # teacher-forced
"""

from shardops_models.generation.decoding import Decoder, KVCache, decoding_strategy

__all__ = ["Decoder", "KVCache", "decoding_strategy"]
