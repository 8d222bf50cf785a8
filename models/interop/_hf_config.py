"""transformers' Llama config in and out of ``models.Llama`` (``hf_llama``'s docstring:
**Config**, **Special tokens**): ``llama_from_config`` reads ``config.json`` into the model,
refusing by name what it cannot compute; ``hf_config`` and ``generation_config`` write the
model's back; ``_read_json`` reads any of the folder's JSON files, naming a broken one.
"""

from __future__ import annotations

import json
import os

import numpy as np

from shardops_models.networks.llama import Llama, SpecialTokens

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"

# What transformers' ``LlamaConfig()`` gives a field that config.json leaves out (the tests read
# them from transformers). ``num_key_value_heads`` and ``head_dim`` follow the heads.
DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
# The special token ids of ``LlamaConfig()`` and ``MixtralConfig()`` where config.json leaves
# a field out (one it sets to null stays None, as transformers reads it): ``Llama.special_tokens``.
TOKEN_DEFAULTS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
# ``hidden_act`` names whose transformers function (``ACT2FN``) is SiLU, what the MLP computes.
SILU = ("silu", "swish")

# Config fields the model cannot honour, with the value it computes: (field, test of a value).
_UNSUPPORTED = (
    ("rope_scaling", lambda v: v is None, "RoPE scaling (Llama 3.1's, YaRN …) is not implemented"),
    ("attention_bias", lambda v: not v, "models.Llama has no attention biases"),
    ("mlp_bias", lambda v: not v, "models.Llama has no MLP biases"),
    ("hidden_act", lambda v: v in SILU, f"models.Llama's gated MLP is SwiGLU: {SILU}"),
    ("attention_dropout", lambda v: not v, "models.Llama trains without dropout"),
)


class UnsupportedConfig(ValueError):
    """A transformers config field whose value ``models.Llama`` cannot compute."""


def llama_from_config(config: dict | str | os.PathLike, **overrides) -> Llama:
    """The ``models.Llama`` of a transformers Llama config (a dict, ``config.json`` or its
    folder); ``overrides`` replace fields (``context=``, ``bos_id=``). Unsupported fields are
    an ``UnsupportedConfig`` naming the field (``hf_llama``'s module docstring)."""
    config = _config_dict(config)
    if config.get("model_type") != "llama":
        other = " (a Mixtral: interop.HfMixtral)" if config.get("model_type") == "mixtral" else ""
        raise UnsupportedConfig(
            f"config model_type={config.get('model_type')!r}: only 'llama' (LlamaForCausalLM) "
            f"checkpoints load into models.Llama by HfLlama{other}"
        )
    return Llama(**{**_llama_fields(config, DEFAULTS), **overrides})


def _config_dict(config: dict | str | os.PathLike) -> dict:
    """A transformers config: the dict itself, or read from ``config.json`` or its folder."""
    if isinstance(config, dict):
        return config
    path = os.fspath(config)
    return _read_json(os.path.join(path, CONFIG) if os.path.isdir(path) else path)


def _llama_fields(config: dict, defaults: dict) -> dict:
    """The ``models.Llama`` fields of a Llama-family config (Llama's, Mixtral's), a field it
    leaves out taking ``defaults``'; unsupported fields refused by name (``_UNSUPPORTED``)."""
    for field, supported, why in _UNSUPPORTED:
        if field in config and not supported(config[field]):
            raise UnsupportedConfig(f"config {field}={config[field]!r} is not supported: {why}")
    rope = config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))  # "type": older configs
    if rope_type != "default":
        raise UnsupportedConfig(
            f"config rope_parameters.rope_type={rope_type!r} is not supported: only 'default' "
            f"RoPE (no scaling) is implemented"
        )
    tokens = SpecialTokens(*(config.get(key, default) for key, default in TOKEN_DEFAULTS.items()))
    config = {**defaults, **{k: v for k, v in config.items() if v is not None}}
    heads, width = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != width:
        raise UnsupportedConfig(
            f"config head_dim={head_dim} is not supported: models.Llama's head_dim is "
            f"hidden_size / num_attention_heads = {width} / {heads}"
        )
    fields = {
        "vocab_size": config["vocab_size"],
        "d_model": width,
        "d_ff": config["intermediate_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": config.get("num_key_value_heads") or heads,
        "rope_theta": float(rope.get("rope_theta", config["rope_theta"])),
        "norm_eps": float(config["rms_norm_eps"]),
        "tie_embeddings": bool(config["tie_word_embeddings"]),
        "context": config["max_position_embeddings"],
        "special_tokens": tokens,
    }
    return fields


def hf_config(model: Llama, dtype="float32") -> dict:
    """The transformers ``config.json`` of ``model`` (``LlamaForCausalLM``)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.d_ff,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.context,
        "rms_norm_eps": model.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "rope_theta": model.rope_theta,  # transformers < 5 reads it here
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": model.tie_embeddings,
        "dtype": str(np.dtype(dtype)),
        "torch_dtype": str(np.dtype(dtype)),
        **token_ids(model),
    }


def token_ids(model: Llama) -> dict:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` of ``model``'s
    ``special_tokens`` (as its checkpoint's config.json gave them); a model without them
    writes its packing id ``bos_id`` as ``bos_token_id`` and None for the others."""
    tokens = model.special_tokens or SpecialTokens(bos=model.bos_id)
    eos = list(tokens.eos) if isinstance(tokens.eos, tuple) else tokens.eos
    return {"bos_token_id": tokens.bos, "eos_token_id": eos, "pad_token_id": tokens.pad}


def generation_config(model: Llama) -> dict:
    """The ``generation_config.json`` transformers' ``save_pretrained`` writes for a model
    without a generation config of its own (``GenerationConfig.from_model_config``): the
    token ids ``token_ids`` gives, those that are set, which ``generate`` stops (eos) and
    pads at, and the three defaults transformers 5 writes beside them; not its
    ``transformers_version`` (transformers is not a dependency; it reads the file without).
    The test compares transformers' reading of both files, field by field."""
    return {"_from_model_config": True,
            **{k: v for k, v in token_ids(model).items() if v is not None},
            "output_attentions": False, "output_hidden_states": False, "use_cache": True}  # fmt: skip


def _read_json(path: str) -> dict:
    """The JSON object in ``path`` (``config.json``, the index), or an error naming the file."""
    with open(path) as f:
        text = f.read()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e.msg}, line {e.lineno} column {e.colno}): expected "
            f"the JSON object save_pretrained writes; fix the file or re-save the checkpoint"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}: expected an object "
                         f"({{\"field\": value, …}}); fix the file or re-save the checkpoint")  # fmt: skip
    return value
