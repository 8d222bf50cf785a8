"""Writing a setup's parameters as a transformers checkpoint folder (``hf_llama``'s docstring):
``save_hf_llama``, and ``_save_hf``, the writer it shares with ``save_hf_mixtral``: the
parameters gathered one at a time, cut into transformers' tensors, split into files as
``save_pretrained`` splits them (``_files``), each file written as soon as it is complete.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import ml_dtypes  # noqa: F401  (numpy knows "bfloat16": the files' dtype may be bfloat16)
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from shardops_models.interop._hf_config import (
    CONFIG,
    GENERATION_CONFIG,
    generation_config,
    hf_config,
)
from shardops_models.interop._hf_reader import INDEX, NAMES, SINGLE, _expand, _placeholders
from shardops_models.networks.llama import Llama
from shardops_models.training import _layer_order
from shardops_models.training._setup import Setup
from shardops_models.training._state import TrainState

# The files' dtypes ``save_hf_llama`` writes: the float dtypes transformers loads and runs.
SAVE_DTYPES = ("float32", "bfloat16", "float16", "float64")


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
    directory = _save_directory(directory, max_shard_bytes, caller)
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
    _write_tensors(directory, setup, leaves, names, files, out_dtype, main)
    written = sorted(set(files.values()))
    if main and written != [SINGLE]:
        _write_index(directory, plan, files, out_dtype)
        written.append(INDEX)
    if jax.process_count() > 1:  # the others return once the files are written
        multihost_utils.sync_global_devices(f"{caller} {directory}")
    return written if main else []


def _save_directory(directory, max_shard_bytes, caller: str) -> str:
    """The folder ``_save_hf`` writes into, as an absolute path, once it (a folder or nothing
    yet) and ``max_shard_bytes`` (a positive int or None) are checked."""
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{caller}: directory={directory!r} is a file; expected a folder "
                         f"(created if missing): pass another path or remove the file")  # fmt: skip
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(
            max_shard_bytes, int | np.integer) or max_shard_bytes < 1):  # fmt: skip
        raise ValueError(f"{caller}: max_shard_bytes must be a positive int of bytes or "
                         f"None (one file); got {max_shard_bytes!r}: pass a size in bytes such "
                         f"as 5 * 10**9 (save_pretrained's '5GB'), or None")  # fmt: skip
    return directory


def _write_tensors(directory: str, setup: Setup, leaves, names: dict, files: dict[str, str],
                   dtype: np.dtype, main: bool) -> None:  # fmt: skip
    """Each of ``leaves`` gathered (every process calls it), then, in process 0 (``main``),
    cut into its tensors (``names``, layer by layer, then expert by expert) in ``dtype``;
    each file of ``files`` (tensor name → file) written as soon as its tensors are in."""
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
        whole = whole.astype(dtype)
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


def _write_index(directory: str, plan: list[tuple[str, int]], files: dict[str, str],
                 dtype: np.dtype) -> None:  # fmt: skip
    """``model.safetensors.index.json`` of a checkpoint in several files, as
    ``save_pretrained`` writes it: the total size and parameter count of ``plan``, and
    ``files`` (tensor name → file) as its ``weight_map``."""
    total = sum(b for _, b in plan)
    metadata = {"total_parameters": total // dtype.itemsize, "total_size": total}
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": metadata, "weight_map": files}, f, indent=2, sort_keys=True)


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
