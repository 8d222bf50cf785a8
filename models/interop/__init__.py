"""Checkpoints of other libraries in and out of shardops' models.

ckpt = interop.HfLlama("path/to/llama")        # a transformers Llama: config + safetensors
setup = models.build("tp", mesh, model=ckpt.model(), optimizer=optax.adamw(1e-4))
state = ckpt.load(setup)                        # each process reads only its slices
interop.save_hf_llama("out/", setup, state)    # LlamaForCausalLM.from_pretrained("out/")

interop.HfMixtral / interop.save_hf_mixtral: the same for Mixtral (models.Llama with experts).
"""

from shardops_models.interop.hf_llama import (
    NAMES,
    HfLlama,
    UnsupportedConfig,
    generation_config,
    hf_config,
    llama_from_config,
    save_hf_llama,
)
from shardops_models.interop.hf_mixtral import HfMixtral, mixtral_from_config, save_hf_mixtral

__all__ = ["NAMES", "HfLlama", "HfMixtral", "UnsupportedConfig", "generation_config", "hf_config",
           "llama_from_config", "mixtral_from_config", "save_hf_llama", "save_hf_mixtral"]  # fmt: skip
