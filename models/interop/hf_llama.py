"""Hugging Face Llama checkpoints in and out of ``models.Llama``, under any strategy and mesh.

    ckpt = interop.HfLlama("path/to/llama")             # config.json + *.safetensors
    setup = models.build("fsdp_tp", mesh, model=ckpt.model(), optimizer=optax.adamw(3e-4))
    state = ckpt.load(setup)                             # each process reads only its slices
    ...
    interop.save_hf_llama("out/", setup, state)         # transformers' from_pretrained loads it

(A Mixtral, ``models.Llama`` with experts: ``hf_mixtral``, which reads and writes through this
module's reader and writer with a names table of its own.) This module holds this docstring
and the public names; the code is in three files, one concept each: ``_hf_config``
(config.json and generation_config.json in and out of ``models.Llama``), ``_hf_reader`` (the
names table, ``HfLlama`` and its block reader) and ``_hf_writer`` (``save_hf_llama``, the
split into files).

A checkpoint is the folder ``save_pretrained`` writes: ``config.json`` and either
``model.safetensors`` or the sharded ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``. Reading uses ``safetensors.safe_open(...).get_slice``: each
device's block is read straight from the file (``jax.make_array_from_callback``), so a process
reads only what its devices hold, never a whole tensor it does not need (``elements_read``
counts what the latest ``load`` read), and never the other processes' blocks. A file that is
not valid JSON, an index without its ``weight_map`` or naming a file that is not there, is
refused naming the file.

**Names and layouts** (transformers stores a linear layer's weight ``[out, in]``; shardops
stores ``w[in, out]``, and the blocks stacked ``[L, …]``):

=================================  ==========================================  ===============
shardops parameter                 transformers tensor                         layout
=================================  ==========================================  ===============
``embed.table[V, D]``              ``model.embed_tokens.weight[V, D]``          as is
``blocks.attn_norm.scale[L, D]``   ``model.layers.{l}.input_layernorm.weight``  stacked
``blocks.attn.wq[L, D, H·hd]``     ``model.layers.{l}.self_attn.q_proj.weight``  stacked, ᵀ
``blocks.attn.wk[L, D, KV·hd]``    ``model.layers.{l}.self_attn.k_proj.weight``  stacked, ᵀ
``blocks.attn.wv[L, D, KV·hd]``    ``model.layers.{l}.self_attn.v_proj.weight``  stacked, ᵀ
``blocks.attn.wo[L, H·hd, D]``     ``model.layers.{l}.self_attn.o_proj.weight``  stacked, ᵀ
``blocks.mlp_norm.scale[L, D]``    ``model.layers.{l}.post_attention_layernorm.weight``  stacked
``blocks.mlp.gate.w[L, D, F]``     ``model.layers.{l}.mlp.gate_proj.weight``     stacked, ᵀ
``blocks.mlp.up.w[L, D, F]``       ``model.layers.{l}.mlp.up_proj.weight``       stacked, ᵀ
``blocks.mlp.down.w[L, F, D]``     ``model.layers.{l}.mlp.down_proj.weight``     stacked, ᵀ
``norm.scale[D]``                  ``model.norm.weight[D]``                     as is
``head.w[D, V]``                   ``lm_head.weight[V, D]`` (absent when tied)  ᵀ
=================================  ==========================================  ===============

No permutation of ``q_proj``/``k_proj``: transformers' Llama rotates halves (``rotate_half``),
as shardops' attention does (``shardops.layers``' attention docstring). A padded dim (a
vocabulary the tp axis does not divide) is read from the file's logical size and zero-filled
beyond it. Every tensor of the files has its place in the table, or the load is refused
naming it (a bias, a layer past ``num_hidden_layers``, another architecture's tensor); the
exceptions are RoPE's ``inv_freq``, which older transformers saved and the model (like
transformers) recomputes from the config, and a tied head's ``lm_head.weight``.

**Tied heads**, as transformers' ``from_pretrained`` decides them: a config with
``tie_word_embeddings: true`` whose files hold no ``lm_head.weight`` ties the head to the
embedding; one whose files hold ``lm_head.weight`` and no embedding ties them too, the
embedding read from ``lm_head.weight`` (transformers ties to the tensor that is there); one
whose files hold both, equal, ties them too (``lm_head.weight`` is not read); one
whose ``lm_head.weight`` differs loads **untied**, the head read from
``lm_head.weight``, with a ``UserWarning`` that says so (transformers warns and unties; the
fix is ``tie_word_embeddings: false`` in config.json). ``HfLlama(...).tie_embeddings`` holds
the decision; deciding it reads both tensors whole, in blocks of rows, in every process
(when the ``HfLlama`` is made; not counted in ``elements_read``).

**Config.** ``llama_from_config`` maps ``vocab_size``, ``hidden_size``,
``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``rms_norm_eps``, ``rope_parameters.rope_theta`` (or the older
top-level ``rope_theta``), ``tie_word_embeddings`` and ``max_position_embeddings`` (the
context). A field config.json leaves out takes transformers'
``LlamaConfig()`` default (``DEFAULTS``: vocabulary 32000, width 4096, ``d_ff`` 11008, 32
layers of 32 heads, ``rms_norm_eps`` 1e-6, θ 10000, context 2048, untied;
``num_key_value_heads``: the heads). What the model cannot compute, or would train
differently, is refused with the field named: another
``model_type``, ``rope_scaling`` or a ``rope_type`` other than ``"default"``, ``head_dim`` ≠
``hidden_size / num_attention_heads``, ``attention_bias`` or ``mlp_bias``, a ``hidden_act``
whose transformers function is not SiLU (``SILU``: ``silu`` and ``swish``; transformers' names
are case-sensitive), a non-zero ``attention_dropout``. The
tensors' shapes must be the ones the config gives (a config that disagrees with its files is
refused before anything is read). ``pretraining_tp`` only changes how
transformers slices its matmuls (the same function) and is accepted.

**Special tokens.** ``bos_token_id``, ``eos_token_id`` (an id or a list) and ``pad_token_id``
are read into ``Llama.special_tokens`` (``LlamaConfig()``'s 1, 2 and None for a field
config.json leaves out; a null stays None), which the forward never reads (``Llama.bos_id``,
the packing id, stays None) and ``load`` takes from the setup's model. Saving writes them back
to config.json and writes ``generation_config.json`` as transformers' ``save_pretrained``
does for a model without a generation config of its own (``generation_config``), so
transformers' ``generate`` on the saved folder stops at the same eos ids as on the original
(tested). A model without ``special_tokens`` writes its ``bos_id`` as ``bos_token_id``, and
no eos: ``generate`` then runs to ``max_new_tokens``. Sampling settings of the original's own
generation_config.json (temperature, top_p) are not carried.
"""

from __future__ import annotations

from shardops_models.interop._hf_config import (  # noqa: F401  (module.DEFAULTS & co.)
    CONFIG,
    DEFAULTS,
    GENERATION_CONFIG,
    SILU,
    TOKEN_DEFAULTS,
    UnsupportedConfig,
    generation_config,
    hf_config,
    llama_from_config,
    token_ids,
)
from shardops_models.interop._hf_reader import (  # noqa: F401  (module.NAMES & co.)
    DERIVED,
    EMBED,
    HEAD,
    INDEX,
    NAMES,
    PLACEHOLDERS,
    SINGLE,
    HfLlama,
)
from shardops_models.interop._hf_writer import (  # noqa: F401  (_files, _plan: the tests' checks)
    SAVE_DTYPES,
    _files,
    _plan,
    save_hf_llama,
)

# The API: the classes and functions (the constants above stay importable from here too).
__all__ = [
    "HfLlama",
    "UnsupportedConfig",
    "generation_config",
    "hf_config",
    "llama_from_config",
    "save_hf_llama",
    "token_ids",
]
