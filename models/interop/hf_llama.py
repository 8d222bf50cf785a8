"""Hugging Face Llama checkpoints in and out of ``models.Llama``, under any strategy and mesh.

    ckpt = interop.HfLlama("path/to/llama")             # config.json + *.safetensors
    setup = models.build("fsdp_tp", mesh, model=ckpt.model(), optimizer=optax.adamw(3e-4))
    state = ckpt.load(setup)                             # each process reads only its slices
    ...
    interop.save_hf_llama("out/", setup, state)         # transformers' from_pretrained loads it

(A Mixtral, ``models.Llama`` with experts: ``hf_mixtral``, which reads and writes through this
module's reader and writer with a names table of its own.)

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

import json
import math
import os
import re
import warnings
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (numpy knows "bfloat16": safetensors reads BF16 tensors)
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, SingleDeviceSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from shardops_models.networks.llama import Llama, SpecialTokens
from shardops_models.strategies.plan import is_shape
from shardops_models.training import _layer_order
from shardops_models.training._setup import Setup
from shardops_models.training._state import TrainState

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# shardops path → (transformers name, with {l} for the layer; transposed: stored [out, in]).
NAMES: dict[tuple[str, ...], tuple[str, bool]] = {
    ("embed", "table"): ("model.embed_tokens.weight", False),
    ("blocks", "attn_norm", "scale"): ("model.layers.{l}.input_layernorm.weight", False),
    ("blocks", "attn", "wq"): ("model.layers.{l}.self_attn.q_proj.weight", True),
    ("blocks", "attn", "wk"): ("model.layers.{l}.self_attn.k_proj.weight", True),
    ("blocks", "attn", "wv"): ("model.layers.{l}.self_attn.v_proj.weight", True),
    ("blocks", "attn", "wo"): ("model.layers.{l}.self_attn.o_proj.weight", True),
    ("blocks", "mlp_norm", "scale"): ("model.layers.{l}.post_attention_layernorm.weight", False),
    ("blocks", "mlp", "gate", "w"): ("model.layers.{l}.mlp.gate_proj.weight", True),
    ("blocks", "mlp", "up", "w"): ("model.layers.{l}.mlp.up_proj.weight", True),
    ("blocks", "mlp", "down", "w"): ("model.layers.{l}.mlp.down_proj.weight", True),
    ("norm", "scale"): ("model.norm.weight", False),
    ("head", "w"): ("lm_head.weight", True),
}
EMBED, HEAD = NAMES["embed", "table"][0], NAMES["head", "w"][0]
# Tensors a file may hold that the model derives (older transformers saved RoPE's frequencies;
# transformers recomputes them from the config too).
DERIVED = ("rotary_emb.inv_freq",)

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
GENERATION_CONFIG = "generation_config.json"
# ``hidden_act`` names whose transformers function (``ACT2FN``) is SiLU, what the MLP computes.
SILU = ("silu", "swish")
# The files' dtypes ``save_hf_llama`` writes: the float dtypes transformers loads and runs.
SAVE_DTYPES = ("float32", "bfloat16", "float16", "float64")

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
    an ``UnsupportedConfig`` naming the field (module docstring)."""
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


class HfLlama:
    """A transformers Llama checkpoint folder, read lazily (module docstring).

    ``model()`` is its ``models.Llama``; ``load(setup)`` reads its parameters into ``setup``'s
    layout; ``elements_read`` is the number of elements the latest ``load`` read from the files
    in this process (0 before the first): the checkpoint's size in a run of one process.
    ``tie_embeddings`` is whether the head is the embedding: the config's
    ``tie_word_embeddings``, unless the files also hold an ``lm_head.weight`` that differs from
    the embedding (then ``False``, with a warning, as transformers does).
    """

    TABLE = NAMES  # shardops path → (transformers name, transposed)

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.path.abspath(os.fspath(directory))
        config = os.path.join(self.directory, CONFIG)
        if not os.path.exists(config):
            raise FileNotFoundError(f"{self.directory} has no {CONFIG}: not a transformers "
                                    f"checkpoint folder (save_pretrained writes one)")  # fmt: skip
        self.config = _read_json(config)
        self.files = self._weight_map()  # tensor name → file name
        self.elements_read = 0
        self.tie_embeddings = self._tie_embeddings()
        # Where each parameter is read: NAMES, but a tied head whose files hold lm_head.weight
        # alone reads the embedding from it (transformers ties to the tensor that is there).
        self.names = dict(self.TABLE)
        if self.tie_embeddings and EMBED not in self.files and HEAD in self.files:
            self.names["embed", "table"] = (HEAD, False)

    def model(self, **overrides) -> Llama:
        """``llama_from_config(self.config, **overrides)``, tied as ``tie_embeddings`` says."""
        return self._from_config({**self.config, "tie_word_embeddings": self.tie_embeddings},
                                 **overrides)  # fmt: skip

    @staticmethod
    def _from_config(config: dict, **overrides) -> Llama:
        return llama_from_config(config, **overrides)

    def _training_fields(self, model: Llama) -> dict:
        """The fields of the setup's ``model`` that do not change the checkpoint's function
        (how it trains, how long its batches are): taken from the setup when comparing."""
        return dict(context=model.context, bos_id=model.bos_id, init_scale=model.init_scale,
                    special_tokens=model.special_tokens)  # fmt: skip

    def _tie_embeddings(self) -> bool:
        """transformers' rule (``PreTrainedModel.tie_weights``): a config that ties, over files
        holding both the embedding and an ``lm_head.weight``, ties them only if they are equal;
        otherwise each is read from its own tensor."""
        tied = bool(self.config.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"]))
        if not tied or HEAD not in self.files or EMBED not in self.files:
            return tied
        if self._equal(EMBED, HEAD):
            return True
        warnings.warn(
            f"{self.directory}: {CONFIG} says tie_word_embeddings=true, but the files hold an "
            f"{HEAD} that differs from {EMBED}: loaded untied (the head read from {HEAD}), as "
            f"transformers does; set tie_word_embeddings to false in {CONFIG} to silence this",
            UserWarning,
            stacklevel=3,
        )
        return False

    def _equal(self, a: str, b: str, rows: int = 4096) -> bool:
        """Whether tensors ``a`` and ``b`` hold the same values (read ``rows`` rows at a time)."""
        handles: dict[str, Any] = {}
        try:
            va, vb = (self._open(handles, name).get_slice(name) for name in (a, b))
            if va.get_shape() != vb.get_shape():
                return False
            size = va.get_shape()[0]
            return all(np.array_equal(va[i : min(i + rows, size)], vb[i : min(i + rows, size)])
                       for i in range(0, size, rows))  # fmt: skip
        finally:
            for handle in handles.values():
                handle.__exit__(None, None, None)

    def _weight_map(self) -> dict[str, str]:
        index = os.path.join(self.directory, INDEX)
        if os.path.exists(index) and os.path.exists(os.path.join(self.directory, SINGLE)):
            raise ValueError(
                f"{self.directory} holds both {SINGLE} and {INDEX}: two checkpoints in one "
                f"folder (transformers would read {SINGLE}); remove the stale one"
            )
        if os.path.exists(index):
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(
                    f'{index} has no weight_map: expected {{"weight_map": {{tensor name: '
                    f"file}}}}, got weight_map={weight_map!r}; re-save the checkpoint "
                    f"(save_pretrained writes it)"
                )
            absent = sorted({f for f in weight_map.values()
                             if not os.path.isfile(os.path.join(self.directory, f))})  # fmt: skip
            if absent:
                raise FileNotFoundError(f"{index} names files that are not in "
                                        f"{self.directory}: {absent}; copy them there")  # fmt: skip
            return dict(weight_map)
        single = os.path.join(self.directory, SINGLE)
        if not os.path.exists(single):
            raise FileNotFoundError(f"{self.directory} has neither {SINGLE} nor {INDEX}")
        with safe_open(single, "numpy") as f:
            return dict.fromkeys(f.keys(), SINGLE)

    def load(self, setup: Setup, *, optimizer_state: bool = True):
        """The checkpoint's parameters laid out for ``setup`` (any strategy and mesh of the same
        ``models.Llama``), in its param dtype: a ``TrainState`` with a fresh optimizer state,
        or the params alone with ``optimizer_state=False``. Every process of a multi-process
        run calls it and reads only the blocks its devices hold."""
        model = setup.model
        if not isinstance(model, Llama):
            raise TypeError(f"HfLlama.load needs a setup of models.Llama; got {type(model)}")
        expected = self.model(**self._training_fields(model))
        if expected != model:
            diff = [f"{f}: {getattr(expected, f)!r} in the checkpoint, {getattr(model, f)!r} "
                    f"in the setup" for f in expected.__dataclass_fields__
                    if getattr(expected, f) != getattr(model, f)]  # fmt: skip
            raise ValueError(f"the setup's model is not the checkpoint's ({self.directory}): "
                             + "; ".join(diff) + " (build the setup with model=ckpt.model())")  # fmt: skip
        logical, stored = setup.padding.logical, setup.padding.stored
        self._check_tensors(model, logical)
        self.elements_read = 0  # this load's
        dtype = np.dtype(setup.precision.param_dtype)
        shardings = _shardings(setup)
        handles: dict[str, Any] = {}
        try:

            def leaf(path, shape, stored_shape, sharding):
                key = tuple(k.key for k in path)
                name, transposed = self.names[key]
                read = _BlockReader(self, handles, name, transposed, tuple(shape),
                                    tuple(stored_shape), dtype,
                                    setup.padding.order.get(jax.tree_util.keystr(path)))  # fmt: skip
                return jax.make_array_from_callback(tuple(stored_shape), sharding, read)

            params = jax.tree_util.tree_map_with_path(leaf, logical, stored, shardings,
                                                      is_leaf=is_shape)  # fmt: skip
        finally:
            for handle in handles.values():
                handle.__exit__(None, None, None)
        _layer_order.mark(params, setup.layer_order)
        if not optimizer_state:
            return params
        opt_shardings = (None if setup.mesh is None else
                         jax.tree.map(lambda s: NamedSharding(setup.mesh, s), setup.opt_specs,
                                      is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)))  # fmt: skip
        opt_state = jax.jit(setup.optimizer.init, out_shardings=opt_shardings)(params)
        return _layer_order.mark(TrainState(params, opt_state), setup.layer_order)

    def _check_tensors(self, model: Llama, logical) -> None:
        """Every tensor the model needs is in the files with the shape the config gives, and
        every tensor of the files has its place (``NAMES``), but a ``DERIVED`` one and a tied
        head's ``lm_head.weight`` equal to the embedding (``tie_embeddings``)."""
        want = set()
        for key, (name, _) in self.names.items():
            if key[0] == "head" and model.tie_embeddings:
                continue
            want |= set(_expand(name, _stack_sizes(model, name)))
        have = set(self.files)
        missing = sorted(want - have)
        # A tied head's lm_head.weight is the embedding (read as it, or equal to it).
        placed = want | ({HEAD} if self.tie_embeddings else set())
        extra = sorted(n for n in have - placed if not n.endswith(DERIVED))
        if missing or extra:
            what = type(self).__name__
            problems = ([f"missing {missing[:6]}{' …' if len(missing) > 6 else ''} (the config "
                         f"needs them: a file of the checkpoint not there, or another "
                         f"architecture than the config's)"] if missing else [])  # fmt: skip
            problems += ([f"not understood {extra[:6]}{' …' if len(extra) > 6 else ''} (no "
                          f"parameter of models.Llama holds them: a bias or another "
                          f"architecture's tensor, which loading would silently drop)"]
                         if extra else [])  # fmt: skip
            raise ValueError(
                f"{self.directory}: the files do not hold the tensors {what} reads: "
                f"{'; '.join(problems)}. Load a checkpoint of the config's architecture, "
                f"whole"
            )
        handles: dict[str, Any] = {}
        wrong = []
        try:
            for path, shape in jax.tree_util.tree_leaves_with_path(logical, is_leaf=is_shape):
                key = tuple(k.key for k in path)
                name, transposed = self.names[key]
                stacked = len(_placeholders(name))
                shape = tuple(shape[stacked:])
                want = shape[::-1] if transposed else shape
                for n in _expand(name, _stack_sizes(model, name)):
                    got = tuple(self._open(handles, n).get_slice(n).get_shape())
                    if got != want:
                        wrong.append(f"{n} is {list(got)}, the config gives {list(want)}")
        finally:
            for handle in handles.values():
                handle.__exit__(None, None, None)
        if wrong:
            raise ValueError(
                f"{self.directory}: tensors whose shapes disagree with config.json (vocab_size, "
                f"hidden_size, intermediate_size, heads): "
                + "; ".join(wrong[:4])
                + (f"; … and {len(wrong) - 4} more" if len(wrong) > 4 else "")
            )

    def _open(self, handles: dict, name: str):
        file = self.files[name]
        if file not in handles:
            handle = safe_open(os.path.join(self.directory, file), "numpy")
            handles[file] = handle.__enter__()
        return handles[file]


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


class _BlockReader:
    """``make_array_from_callback``'s callback for one parameter: the block at a device's
    index, read from the file's tensor(s) (one per layer, and per expert, when stacked:
    ``PLACEHOLDERS``), transposed to
    shardops' ``[in, out]``, zero-filled beyond the logical shape (padding). Each distinct
    block is read once (replicas ask for it again)."""

    def __init__(self, ckpt: HfLlama, handles, name, transposed, shape, stored_shape, dtype,
                 order=None):  # fmt: skip
        self.ckpt, self.handles, self.name = ckpt, handles, name
        self.transposed, self.dtype = transposed, dtype
        self.shape, self.stored_shape = shape, stored_shape
        self.order = order  # stored row r holds layer order[r] (pp's circular chunks)
        self.blocks: dict[tuple, np.ndarray] = {}

    def __call__(self, index):
        key = tuple((s.start, s.stop) for s in index)
        if key not in self.blocks:
            self.blocks[key] = self._read(index)
        return self.blocks[key]

    def _read(self, index):
        stored = [s.stop - s.start for s in _bounded(index, self.stored_shape)]
        block = np.zeros(stored, self.dtype)
        # The part of the block inside the logical shape; the rest is padding (zeros).
        inside = [slice(s.start, min(s.stop, n))
                  for s, n in zip(_bounded(index, self.stored_shape), self.shape, strict=True)]  # fmt: skip
        if any(s.start >= s.stop for s in inside):
            return block
        rows = (None if self.order is None
                else [self.order[r] for r in range(inside[0].start, inside[0].stop)])  # fmt: skip
        part = self._stacked(_placeholders(self.name), inside, {}, rows)
        block[tuple(slice(0, n) for n in part.shape)] = part
        return block

    def _stacked(self, fields: tuple[str, ...], inside: list[slice], at: dict,
                 rows=None) -> np.ndarray:  # fmt: skip
        """The block ``inside`` of the stack over ``fields`` (the leading dims: layers, then
        experts), each of its tensors read at ``at`` and the rest of ``inside``; the first
        dim's ``rows`` where given (the stored order's)."""
        if not fields:
            return self._tensor(self.name.format(**at), inside)
        rows = range(inside[0].start, inside[0].stop) if rows is None else rows
        return np.stack([self._stacked(fields[1:], inside[1:], {**at, fields[0]: i})
                         for i in rows])  # fmt: skip

    def _tensor(self, name: str, inside: list[slice]) -> np.ndarray:
        """``name``'s slice ``inside`` in shardops' layout (the file's slice, transposed)."""
        view = self.ckpt._open(self.handles, name).get_slice(name)
        part = view[tuple(reversed(inside)) if self.transposed else tuple(inside)]
        self.ckpt.elements_read += part.size
        return (part.T if self.transposed else part).astype(self.dtype)


def _bounded(index, shape) -> list[slice]:
    """A device's index (slices that may be open, ``slice(None)``) as bounded slices."""
    return [slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def _shardings(setup: Setup):
    if setup.mesh is None:
        device = SingleDeviceSharding(jax.local_devices()[0])
        return jax.tree.map(lambda _: device, setup.padding.stored, is_leaf=is_shape)
    return jax.tree.map(lambda s: NamedSharding(setup.mesh, s), setup.param_specs,
                        is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))  # fmt: skip


def save_hf_llama(directory: str | os.PathLike, setup: Setup, state, *,
                  max_shard_bytes: int | None = None, dtype=None) -> list[str]:  # fmt: skip
    """Write ``state`` (a ``TrainState`` or the params, laid out by ``setup``) as a transformers
    Llama checkpoint in ``directory`` (a folder, created if missing): ``config.json`` and
    ``model.safetensors``, or, when the tensors exceed ``max_shard_bytes`` (a positive int of
    bytes; ``None``, the default: one file), ``model-0000i-of-0000n.safetensors`` files with
    ``model.safetensors.index.json``, split as transformers' ``save_pretrained(...,
    max_shard_size=max_shard_bytes)`` splits (huggingface_hub's rule): tensors in order, a file
    closed when the next tensor would take it past ``max_shard_bytes``; a tensor never split,
    one larger than ``max_shard_bytes`` alone in a file of its own. ``dtype`` (default the
    params') is the files' dtype, one of ``SAVE_DTYPES``: float32, bfloat16, float16, float64.

    Every process calls it; the parameters are gathered one at a time, and each file is
    written (by process 0) as soon as its tensors are in, so the host holds one parameter and
    one file's tensors at a time, not the model. Process 0 writes into a folder every process
    can read (a shared file system across hosts), replacing the weight files of a checkpoint
    saved there before; all return once the files are written. Returns the files written
    (process 0; ``[]`` elsewhere).
    A model trained on packed documents (``bos_id``) is saved as it is: transformers attends
    across documents. A model with experts is a Mixtral: ``save_hf_mixtral``.
    """
    model = setup.model
    if not isinstance(model, Llama):
        raise TypeError(f"save_hf_llama needs a setup of models.Llama; got {type(model)}")
    if model.experts is not None:
        raise ValueError(f"save_hf_llama: the setup's model has experts ({model.experts}), "
                         f"which LlamaForCausalLM cannot hold; save it with "
                         f"interop.save_hf_mixtral (a MixtralForCausalLM)")  # fmt: skip
    return _save_hf(directory, setup, state, NAMES, hf_config, "save_hf_llama",
                   max_shard_bytes=max_shard_bytes, dtype=dtype)  # fmt: skip


def _save_hf(directory, setup: Setup, state, names: dict, config_of, caller: str, *,
            max_shard_bytes: int | None, dtype) -> list[str]:  # fmt: skip
    """``save_hf_llama``'s and ``save_hf_mixtral``'s writer: the parameters named by ``names``
    (``NAMES``' form), ``config_of(model, dtype)`` as ``config.json``, errors naming
    ``caller``."""
    model = setup.model
    params = state.params if isinstance(state, TrainState) else state
    _layer_order.check(params, setup.layer_order, f"{caller}: params",
                       "Save them with the setup they came from")  # fmt: skip
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{caller}: directory={directory!r} is a file; expected a folder "
                         f"(created if missing): pass another path or remove the file")  # fmt: skip
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(
            max_shard_bytes, int | np.integer) or max_shard_bytes < 1):  # fmt: skip
        raise ValueError(f"{caller}: max_shard_bytes must be a positive int of bytes or "
                         f"None (one file); got {max_shard_bytes!r}: pass a size in bytes such "
                         f"as 5 * 10**9 (save_pretrained's '5GB'), or None")  # fmt: skip
    leaves = jax.tree_util.tree_leaves_with_path(params)
    out_dtype = _save_dtype(dtype if dtype is not None else leaves[0][1].dtype, dtype is None,
                            caller)  # fmt: skip
    plan = _plan(setup, leaves, out_dtype, names)  # (tensor name, bytes) in the order they are made
    files = _files(plan, None if max_shard_bytes is None else int(max_shard_bytes))  # name → file
    main = jax.process_index() == 0
    # The JSON files' text first: nothing is removed from the folder if one cannot be written.
    configs = {CONFIG: json.dumps(config_of(model, out_dtype), indent=2),
               GENERATION_CONFIG: json.dumps(generation_config(model), indent=2)}  # fmt: skip
    if main:
        os.makedirs(directory, exist_ok=True)
        _remove_weights(directory)  # a checkpoint saved here before, in either form
        for name, text in configs.items():
            with open(os.path.join(directory, name), "w") as f:
                f.write(text)
    waiting = {
        file: sum(f == file for f in files.values()) for file in dict.fromkeys(files.values())
    }
    pending: dict[str, dict[str, np.ndarray]] = {file: {} for file in waiting}
    for path, leaf in leaves:
        key = tuple(k.key for k in path)
        name, transposed = names[key]
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)  # every process calls it
        if not main:
            continue
        whole = setup.padding.unpad_leaf(path, np.asarray(jax.device_get(leaf)))
        whole = whole.astype(out_dtype)
        fields = _placeholders(name)
        layers = [(name.format(**dict(zip(fields, i, strict=True))), whole[i])
                  for i in np.ndindex(whole.shape[: len(fields)])]  # fmt: skip
        for n, a in layers:
            file = files[n]
            pending[file][n] = np.ascontiguousarray(a.T if transposed else a)
            if len(pending[file]) == waiting[file]:  # the file is complete: write it
                save_file(
                    pending.pop(file), os.path.join(directory, file), metadata={"format": "pt"}
                )  # transformers reads only known formats
    written = sorted(waiting)
    if main and written != [SINGLE]:
        total = sum(b for _, b in plan)
        metadata = {"total_parameters": total // out_dtype.itemsize, "total_size": total}
        with open(os.path.join(directory, INDEX), "w") as f:  # as save_pretrained writes it
            json.dump({"metadata": metadata, "weight_map": files}, f, indent=2, sort_keys=True)
        written.append(INDEX)
    if jax.process_count() > 1:  # the others return once the files are written
        multihost_utils.sync_global_devices(f"{caller} {directory}")
    return written if main else []


def _plan(setup: Setup, leaves, dtype, names: dict = NAMES) -> list[tuple[str, int]]:
    """``(transformers name, bytes)`` of every tensor ``names`` gives, in the order ``_save_hf``
    makes them (the leaves', each stacked leaf layer by layer, then expert by expert)."""
    out = []
    for path, _ in leaves:
        name, _ = names[tuple(k.key for k in path)]
        shape = setup.padding.logical_shape(path)
        stacked = len(_placeholders(name))
        out += [(n, math.prod(shape[stacked:]) * dtype.itemsize)
                for n in _expand(name, shape[:stacked])]  # fmt: skip
    return out


# The stacked dims of a tensor name, in the order the parameter stacks them: ``{l}`` the layer
# (``[L, …]``), ``{e}`` the expert (``[L, E, …]``).
PLACEHOLDERS = ("l", "e")


def _placeholders(name: str) -> tuple[str, ...]:
    """The stacked dims ``name`` has (``PLACEHOLDERS`` it holds), in order."""
    return tuple(f for f in PLACEHOLDERS if "{" + f + "}" in name)


def _stack_sizes(model: Llama, name: str) -> tuple[int, ...]:
    """The sizes of ``name``'s stacked dims in ``model``: ``L``, then ``E``."""
    sizes = {"l": model.num_layers, "e": model.experts.num_experts if model.experts else 0}
    return tuple(sizes[f] for f in _placeholders(name))


def _expand(name: str, sizes: tuple[int, ...]) -> list[str]:
    """Every tensor name of a stack of ``sizes`` (layer-major), ``[name]`` when unstacked."""
    fields = _placeholders(name)
    return [name.format(**dict(zip(fields, i, strict=True))) for i in np.ndindex(*sizes)]


def _save_dtype(dtype, from_params: bool, caller: str = "save_hf_llama") -> np.dtype:
    """``save_hf_llama``'s ``dtype``, one of ``SAVE_DTYPES``, or an error listing them."""
    try:
        out = np.dtype(dtype)
    except TypeError:
        out = None
    if out is None or out.name not in SAVE_DTYPES:
        got = repr(dtype) if out is None else repr(out.name)
        got = f"the params' {got}" if from_params else got
        raise ValueError(f"{caller}: dtype must be one of {SAVE_DTYPES} (the float dtypes "
                         f"transformers loads); got {got}: pass dtype='bfloat16' or another of "
                         f"them")  # fmt: skip
    return out


def _files(plan: list[tuple[str, int]], max_shard_bytes: int | None) -> dict[str, str]:
    """Tensor name → file, as huggingface_hub's ``split_state_dict_into_shards_factory`` (what
    ``save_pretrained`` calls) splits ``plan``: tensors in order into the open file until the
    next would take it past ``max_shard_bytes``; one larger than that in a file of its own,
    added at once; ``model.safetensors`` if that makes one file, else
    ``model-0000i-of-0000n.safetensors``."""
    if max_shard_bytes is None:
        return {name: SINGLE for name, _ in plan}
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name, nbytes in plan:
        if nbytes > max_shard_bytes:
            shards.append([name])
            continue
        if size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    n = len(shards)
    if n == 1:
        return dict.fromkeys(shards[0], SINGLE)
    return {name: f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            for i, names in enumerate(shards) for name in names}  # fmt: skip


def _remove_weights(directory: str) -> None:
    """The weight files of a checkpoint already in ``directory`` (single or index-sharded):
    left beside a new one, transformers or ``HfLlama`` could read the stale weights."""
    for name in os.listdir(directory):
        if name in (SINGLE, INDEX) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name):
            os.remove(os.path.join(directory, name))
