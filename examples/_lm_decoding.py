"""The sample of examples/transformer_lm.py: the trained model's continuation of a prompt by
KV-cache decoding on the run's devices (``decode``), and the slow way ``--compare-decoding``
times it against, the whole prefix recomputed for every byte (``generate``), both dropless for a
model with experts."""

import dataclasses
import time

import jax
import numpy as np
import optax

import shardops
import shardops_models as models
from shardops_models.generation import Decoder


def decode(setup, params, prompt: np.ndarray, n_tokens: int, *, temperature: float, key):
    """The model's continuation of ``prompt`` by KV-cache decoding (``generation.Decoder``):
    on every device of the run, the model axis of the training mesh (1 without one) splitting
    the heads and the rest the batch, whose rows all start from ``prompt`` (row 0 is shown).
    Returns ``(tokens, seconds, compile_seconds, rows)``: the timed call is the second one."""
    mesh = setup.mesh
    tp = setup.strategy.tp if mesh is not None else None
    model_size = mesh.shape[tp] if tp else 1
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    decode_mesh = shardops.make_mesh({"data": len(devices) // model_size, "model": model_size},
                                     devices=devices)  # fmt: skip
    rows = len(devices) // model_size
    decoder = Decoder(setup.model, decode_mesh, batch=rows, max_len=len(prompt) + n_tokens,
                      precision=setup.precision, attention=setup.attention)  # fmt: skip
    params = decoder.place(setup.gather(params))  # any training layout → the decoding one
    prompts = np.repeat(np.asarray(prompt, np.int32)[None], rows, axis=0)
    options = {"temperature": temperature, "key": key}
    start = time.perf_counter()
    tokens = decoder.generate(params, prompts, n_tokens, **options)
    jax.block_until_ready(tokens)
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    tokens = models.gather_tree(decoder.generate(params, prompts, n_tokens, **options))
    return tokens[0], time.perf_counter() - start, compiled, rows


def generate(setup, params, prompt: np.ndarray, n_tokens: int, *, temperature: float, key):
    """``n_tokens`` bytes after ``prompt`` ``(P,)``, one ``setup.logits`` call per byte: the
    whole prefix recomputed for every byte (what ``--compare-decoding`` times against the KV
    cache of ``decode``). A model with experts is recomputed dropless
    (``recompute_setup``), as the decoder routes.

    Every call sees the same window ``ids[batch_multiple, context]`` (the last ``context``
    bytes, padded on the right; only row 0 is used), so the forward compiles once. Causal
    attention keeps the padding from reaching the logits read at the last real position.
    """
    setup = recompute_setup(setup)
    context = setup.model.context
    rows = setup.batch_multiple
    tokens = list(prompt)
    for i in range(n_tokens):
        window = tokens[-context:]
        ids = np.zeros((rows, context), np.int32)  # (R, S), right-padded
        ids[0, : len(window)] = window
        logits = setup.logits(params, setup.place_batch(ids))  # (R, S, V), full vocabulary
        last = models.gather_tree(logits)[0, len(window) - 1]  # (V,) the next byte's logits
        if temperature == 0:
            token = int(np.argmax(np.asarray(last)))
        else:
            token = int(jax.random.categorical(jax.random.fold_in(key, i), last / temperature))
        tokens.append(token)
    return np.asarray(tokens[len(prompt) :], np.int32)


def recompute_setup(setup):
    """``setup``, or for a model with experts the same strategy, mesh and policy building the
    model routed dropless (``capacity_factor = E / k``: every token to its k experts), the
    rule of the KV-cache decoder: the same parameters, the same layout, and the window's
    right padding, routed apart from the real bytes, cannot take their experts' slots."""
    experts = getattr(setup.model, "experts", None)
    if experts is None:
        return setup
    dropless = dataclasses.replace(setup.model, experts=dataclasses.replace(
        experts, capacity_factor=experts.num_experts / experts.k))  # fmt: skip
    return models.build(setup.strategy, setup.mesh, model=dropless, optimizer=optax.identity(),
                        precision=setup.precision, attention=setup.attention)  # fmt: skip
