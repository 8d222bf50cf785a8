"""Reading a transformers checkpoint folder into any setup's layout (``hf_llama``'s docstring):
``NAMES``, where each parameter is in the files and how it is laid out there; ``HfLlama``,
the folder (its weight map, the tied-head decision, the checks before anything is read, the
load); ``_BlockReader``, one parameter's blocks read straight from the files, device by
device. ``hf_mixtral`` reads through the same class with a table of its own.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (numpy knows "bfloat16": safetensors reads BF16 tensors)
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from safetensors import safe_open

from shardops_models.interop._hf_config import CONFIG, DEFAULTS, _read_json, llama_from_config
from shardops_models.networks.llama import Llama
from shardops_models.strategies.plan import is_shape
from shardops_models.training import _layer_order
from shardops_models.training._setup import Setup
from shardops_models.training._state import TrainState

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


class HfLlama:
    """A transformers Llama checkpoint folder, read lazily (``hf_llama``'s module docstring).

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
