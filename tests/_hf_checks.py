"""Tiny transformers Llama checkpoints built in the test session (random weights, nothing
downloaded), and transformers' own PyTorch forward of them, in float32 and float64.

The weights are drawn N(0, 0.1) (norms 1 + N(0, 0.2)), not transformers' 0.02 and ones: the
logits then spread over several units, attention is far from uniform, and a norm read from the
wrong tensor changes them."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)  # the suite's workers share 2 cores

# name → (LlamaConfig fields, the largest safetensors file save_pretrained may write or None).
CONFIGS = {
    # Grouped-query attention: 8 query heads on 2 KV heads (replicated on model = 4 and 8),
    # an odd vocabulary (97: padded on every model axis > 1), the index-sharded form.
    "gqa": (dict(vocab_size=97, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, rope_theta=500.0,
                 rms_norm_eps=1e-5, max_position_embeddings=64), "40KB"),
    # Multi-query attention with the output head tied to the embedding, one file.
    "mqa_tied": (dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=True,
                      rms_norm_eps=1e-6, max_position_embeddings=64), None),
}  # fmt: skip
BATCH, SEQ = 8, 16

_ROOT = tempfile.mkdtemp(prefix="shardops-hf-")
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def perturb(model: LlamaForCausalLM, seed: int) -> LlamaForCausalLM:
    """Weights N(0, 0.1), norms 1 + N(0, 0.2) (module docstring), drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
    return model.eval()


@functools.cache
def checkpoint(name: str) -> str:
    """The folder of checkpoint ``name`` (``CONFIGS``), written once per session."""
    fields, shard = CONFIGS[name]
    model = perturb(LlamaForCausalLM(LlamaConfig(**fields)), seed=len(name))
    path = os.path.join(_ROOT, name)
    model.save_pretrained(path, **({} if shard is None else {"max_shard_size": shard}))
    return path


def hf_logits(path: str, ids: np.ndarray, dtype=torch.float32) -> np.ndarray:
    """transformers' forward of the checkpoint at ``path``: ``logits[B, S, V]`` as numpy."""
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def tokens(vocab: int, seed: int = 0, batch: int = BATCH, seq: int = SEQ):
    """``ids[B, S]`` and their next tokens ``labels[B, S]``, uniform over the vocabulary."""
    row = np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    return row[:, :-1], row[:, 1:]


def check_close(got: np.ndarray, path: str, ids: np.ndarray, what: str) -> float:
    """``got`` (float32 logits of shardops) is as close to transformers' float64 forward as
    transformers' own float32 forward is (× 2, plus 4 float32 ulps of the largest logit: the
    two float32 programs round in different orders). Returns the ratio to that bound."""
    exact = hf_logits(path, ids, torch.float64)
    own = np.abs(hf_logits(path, ids) - exact).max()
    bound = 2 * own + 4 * np.finfo(np.float32).eps * np.abs(exact).max()
    err = np.abs(got.astype(np.float64) - exact).max()
    assert got.shape == exact.shape, f"{what}: logits {got.shape}, transformers' {exact.shape}"
    assert err <= bound, f"{what}: |shardops − transformers(float64)| = {err:.3g} > {bound:.3g}"
    return err / bound
