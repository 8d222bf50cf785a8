"""Tiny transformers Llama checkpoints built in the test session (random weights, nothing
downloaded), and transformers' own PyTorch forward of them, in float32 and float64.

The weights are drawn N(0, 0.1) (norms 1 + N(0, 0.2)), not transformers' 0.02 and ones: the
logits then spread over several units, attention is far from uniform, and a norm read from the
wrong tensor changes them."""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import shardops_models as models

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


def check_close(got: np.ndarray, path: str, ids: np.ndarray, what: str, *,
                forward=None) -> float:  # fmt: skip
    """``got`` (float32 logits of shardops) is as close to transformers' float64 forward as
    transformers' own float32 forward is (× 2, plus 4 float32 ulps of the largest logit: the
    two float32 programs round in different orders). Returns the ratio to that bound.
    ``forward(path, ids, dtype)``: transformers' logits (default ``hf_logits``, the Llama's)."""
    forward = forward or hf_logits
    exact = forward(path, ids, torch.float64)
    own = np.abs(forward(path, ids) - exact).max()
    bound = 2 * own + 4 * np.finfo(np.float32).eps * np.abs(exact).max()
    err = np.abs(got.astype(np.float64) - exact).max()
    assert got.shape == exact.shape, f"{what}: logits {got.shape}, transformers' {exact.shape}"
    assert err <= bound, f"{what}: |shardops − transformers(float64)| = {err:.3g} > {bound:.3g}"
    return err / bound


# The checks below take the module they check (``shardops_models.interop.hf_llama`` or a
# mutant of it, tests/interop/test_hf_llama_mutations.py); any failure is an AssertionError.


def refused(call, exc: type[Exception], pattern: str) -> None:
    """``pytest.raises(exc, match=pattern)`` around ``call()``, a failure of any kind (nothing
    raised, another exception, another message) an ``AssertionError``."""
    try:
        with pytest.raises(exc, match=pattern):
            call()
    except pytest.fail.Exception as e:
        raise AssertionError(str(e)) from None
    except AssertionError:
        raise
    except Exception as e:
        raise AssertionError(f"{type(e).__name__} instead of {exc.__name__}: {e}") from e


# A config.json that sets every field llama_from_config reads, each to a value other than
# transformers' default, so that a field left out shows the default taken in its place.
FULL_CONFIG = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 88,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    "tie_word_embeddings": True,
    "max_position_embeddings": 64,
}


def llama_of_transformers(config: dict) -> dict:
    """The ``models.Llama`` fields of the ``LlamaConfig`` transformers builds from ``config``
    (its own defaults for the fields left out)."""
    c = LlamaConfig.from_dict(config)
    return dict(vocab_size=c.vocab_size, d_model=c.hidden_size, d_ff=c.intermediate_size,
                num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                num_kv_heads=c.num_key_value_heads, rope_theta=c.rope_parameters["rope_theta"],
                norm_eps=c.rms_norm_eps, tie_embeddings=c.tie_word_embeddings,
                context=c.max_position_embeddings)  # fmt: skip


def check_defaults(module) -> None:
    """Each field of ``FULL_CONFIG`` left out (RoPE's θ from both places at once), and all of
    them: ``llama_from_config`` gives the model of transformers' ``LlamaConfig``."""
    drops = [[k] for k in FULL_CONFIG if k not in ("model_type", "rope_theta", "rope_parameters")]
    drops += [["rope_theta", "rope_parameters"], [k for k in FULL_CONFIG if k != "model_type"]]
    for drop in drops:
        config = {k: v for k, v in FULL_CONFIG.items() if k not in drop}
        got = module.llama_from_config(config)
        want = llama_of_transformers(config)
        wrong = {k: (getattr(got, k), v) for k, v in want.items() if getattr(got, k) != v}
        assert not wrong, f"without {drop}: (shardops, transformers) {wrong}"


def check_activation_aliases(module) -> None:
    """``hidden_act`` is accepted exactly when transformers' ``ACT2FN[hidden_act]`` computes
    SiLU (a name transformers does not know, a capitalised one, is refused too)."""
    from transformers.activations import ACT2CLS, ACT2FN

    x = torch.linspace(-6, 6, 101)
    silu = {k for k in ACT2CLS if torch.allclose(ACT2FN[k](x), torch.nn.functional.silu(x))}
    assert "silu" in silu, silu
    for name in [*ACT2CLS, "SiLU", "swiglu"]:
        config = {**FULL_CONFIG, "hidden_act": name}
        if name in silu:
            try:
                module.llama_from_config(config)
            except module.UnsupportedConfig as e:
                raise AssertionError(f"hidden_act={name!r} (SiLU in transformers): {e}") from e
        else:
            refused(lambda c=config: module.llama_from_config(c), module.UnsupportedConfig,
                    rf"hidden_act={name!r} is not supported.*SwiGLU")  # fmt: skip


def hub_split(plan: list[tuple[str, int]], max_shard_bytes: int) -> dict[str, str]:
    """Tensor name → file as huggingface_hub splits tensors of these sizes (what transformers'
    ``save_pretrained(max_shard_size=)`` calls), for ``plan``'s ``(name, bytes)``."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(
        dict(plan), get_storage_size=lambda n: n, max_shard_size=max_shard_bytes,
        filename_pattern="model{suffix}.safetensors")  # fmt: skip
    return split.tensor_to_filename


def check_shard_split(module) -> None:
    """``save_hf_llama``'s files for tensors at and around the boundary (the open file filled
    to exactly ``max_shard_bytes``, one byte over; a tensor of exactly ``max_shard_bytes``, one
    byte larger, amid others) are huggingface_hub's."""
    m = 100
    plans = [
        [2, m - 2], [2, m - 1], [m], [m + 1], [3, m, 1], [3, m + 1, 1], [50, 50, 50],
        [50, 51, 49, 1], [1, m + 1, m, 99, 1], [m + 1, m + 1], [40, 60, 0, 1],
    ]  # fmt: skip
    for sizes in plans:
        plan = [(f"t{i}", n) for i, n in enumerate(sizes)]
        got, want = module._files(plan, m), hub_split(plan, m)
        assert got == want, f"sizes {sizes}, max_shard_bytes {m}: {got} != huggingface_hub's {want}"


def _copy(name: str, to: Path, **config) -> Path:
    """A copy of checkpoint ``name`` at ``to``, its config.json fields replaced by ``config``."""
    shutil.copytree(checkpoint(name), to)
    fields = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**fields, **config}))
    return to


def _ref(module, path):
    """``module.HfLlama(path)`` and a ``ref`` setup of its model."""
    ckpt = module.HfLlama(path)
    return ckpt, models.build("ref", model=ckpt.model(), optimizer=optax.sgd(0.1))


def _tied_in_transformers(path) -> bool:
    """Whether transformers' ``from_pretrained`` ties the head of ``path`` to its embedding."""
    hf = LlamaForCausalLM.from_pretrained(path)
    return hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def check_untied_head(module, tmp: Path) -> None:
    """A config.json that ties over files holding an lm_head.weight unlike the embedding (gqa's
    config edited): loaded untied with a warning, as transformers loads it, with its logits."""
    path = _copy("gqa", tmp / "tied-config", tie_word_embeddings=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt, setup = _ref(module, path)
    params = ckpt.load(setup, optimizer_state=False)
    ids, _ = tokens(setup.model.vocab_size)
    logits = np.asarray(setup.logits(params, setup.place_batch(ids)))
    check_close(logits, str(path), ids, "a tied config over a distinct lm_head.weight")
    assert not _tied_in_transformers(path)
    assert ckpt.tie_embeddings is False and setup.model.tie_embeddings is False
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any(re.search(r"tie_word_embeddings=true, but the files hold an lm_head.weight that "
                         r"differs .*loaded untied.*set tie_word_embeddings to false", m)
               for m in said), f"no warning of the untied head: {said}"  # fmt: skip


def check_lm_head_alone(module, tmp: Path) -> None:
    """A tied checkpoint whose files hold the embedding as lm_head.weight alone (mqa_tied's
    renamed): transformers ties to the tensor that is there, and so does the load (its
    logits)."""
    path = _copy("mqa_tied", tmp / "head-alone")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert _tied_in_transformers(path)
    ckpt, setup = _ref(module, path)
    assert ckpt.tie_embeddings
    try:
        params = ckpt.load(setup, optimizer_state=False)
    except ValueError as e:
        raise AssertionError(f"the embedding not read from lm_head.weight: {e}") from e
    assert ckpt.elements_read == _elements(setup.model)
    ids, _ = tokens(setup.model.vocab_size)
    logits = np.asarray(setup.logits(params, setup.place_batch(ids)))
    check_close(logits, str(path), ids, "a tied head's lm_head.weight alone")


def _elements(model) -> int:
    return sum(a.size for a in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))


def check_unplaced_tensors(module, tmp: Path) -> None:
    """Every tensor of the files that the mapping does not place is refused by name; what is
    placed without being read (RoPE's frequencies, a tied head's lm_head.weight equal to the
    embedding, which transformers ties too) is accepted."""
    path = _copy("mqa_tied", tmp / "extra")
    file = path / "model.safetensors"
    tensors = load_file(file)
    d = tensors["model.norm.weight"].shape[0]
    accepted = {"model.rotary_emb.inv_freq": np.ones(4, np.float32),
                "lm_head.weight": tensors["model.embed_tokens.weight"]}  # fmt: skip
    save_file({**tensors, **accepted}, file, metadata={"format": "pt"})
    ckpt, setup = _ref(module, path)
    assert ckpt.tie_embeddings and _tied_in_transformers(path)
    ckpt.load(setup, optimizer_state=False)
    assert ckpt.elements_read == _elements(setup.model)  # the tied lm_head.weight is not read
    unplaced = {
        "model.layers.0.self_attn.q_proj.bias": np.zeros(d, np.float32),  # a bias
        "lm_head.bias": np.zeros(101, np.float32),
        "model.layers.2.mlp.up_proj.weight": tensors["model.layers.1.mlp.up_proj.weight"],
        "model.embed_positions.weight": np.zeros((64, d), np.float32),  # another architecture's
    }
    for name, value in unplaced.items():
        save_file({**tensors, **accepted, name: value}, file, metadata={"format": "pt"})
        ckpt, setup = _ref(module, path)
        refused(lambda c=ckpt, s=setup: c.load(s), ValueError,
                rf"{re.escape(str(path))}: the files do not hold the tensors HfLlama reads: "
                rf"not understood \[{re.escape(repr(name))}\] \(no parameter")  # fmt: skip


def check_elements_read(module) -> None:
    """``elements_read`` is the latest load's: the checkpoint's size after each of two loads."""
    ckpt, setup = _ref(module, checkpoint("gqa"))
    assert ckpt.elements_read == 0
    for _ in range(2):
        ckpt.load(setup, optimizer_state=False)
        assert ckpt.elements_read == _elements(setup.model), ckpt.elements_read


def check_json_errors(module, tmp: Path) -> None:
    """A config.json or index that is not a JSON object, an index without its weight map or
    naming a file that is not there: an error naming the file, what it holds and the fix."""
    fix = "fix the file or re-save the checkpoint"
    for text, got in (("{", r"is not valid JSON \(Expecting property name enclosed in double "
                             r"quotes, line 1 column 2\)"),
                      ("[1, 2]", "holds a JSON list")):  # fmt: skip
        path = _copy("mqa_tied", tmp / f"config{len(text)}")
        (path / "config.json").write_text(text)
        pattern = rf"{re.escape(str(path / 'config.json'))} {got}: expected .*object.*; {fix}"
        refused(lambda p=path: module.HfLlama(p), ValueError, pattern)
        refused(lambda p=path: module.llama_from_config(p), ValueError, pattern)
    index = "model.safetensors.index.json"
    path = _copy("gqa", tmp / "index")
    weight_map = json.loads((path / index).read_text())["weight_map"]
    (path / index).write_text('{"weight_map": {')
    refused(lambda: module.HfLlama(path), ValueError,
            rf"{re.escape(str(path / index))} is not valid JSON .*; {fix}")  # fmt: skip
    (path / index).write_text('{"metadata": {}}')
    refused(lambda: module.HfLlama(path), ValueError,
            rf"{re.escape(str(path / index))} has no weight_map: expected .*weight_map.*, got "
            r"weight_map=None; re-save the checkpoint")  # fmt: skip
    (path / index).write_text(json.dumps({"weight_map": weight_map}))
    module.HfLlama(path)
    gone = sorted(set(weight_map.values()))[-1]
    (path / gone).unlink()
    refused(lambda: module.HfLlama(path), FileNotFoundError,
            rf"names files that are not in {re.escape(str(path))}: \['{gone}'\]; copy them")  # fmt: skip


def check_save_errors(module, tmp: Path) -> None:
    """``save_hf_llama`` refuses a dtype transformers cannot load, a path that is a file and a
    shard size that is not a positive int, before writing anything."""
    ckpt, setup = _ref(module, checkpoint("gqa"))
    params = ckpt.load(setup, optimizer_state=False)
    allowed = re.escape("('float32', 'bfloat16', 'float16', 'float64')")
    for dtype in ("float8", "int8", np.int32):
        got = repr(np.dtype(dtype).name) if dtype != "float8" else "'float8'"
        refused(lambda d=dtype: module.save_hf_llama(tmp / "out", setup, params, dtype=d),
                ValueError, rf"save_hf_llama: dtype must be one of {allowed} \(the float dtypes "
                rf"transformers loads\); got {got}: pass dtype='bfloat16' or another of them")  # fmt: skip
    for size in (0, -1, True, 1.5):
        refused(lambda s=size: module.save_hf_llama(tmp / "out", setup, params,
                                                    max_shard_bytes=s), ValueError,
                rf"save_hf_llama: max_shard_bytes must be a positive int of bytes or None \(one "
                rf"file\); got {size!r}: pass")  # fmt: skip
    (tmp / "a-file").write_text("")
    refused(lambda: module.save_hf_llama(tmp / "a-file", setup, params), ValueError,
            rf"save_hf_llama: directory={re.escape(repr(str(tmp / 'a-file')))} is a file; "
            r"expected a folder \(created if missing\): pass another path or remove the file")  # fmt: skip
    assert not (tmp / "out").exists()


def check_sharded_save(module, tmp: Path) -> None:
    """Saved with ``max_shard_bytes`` at the largest tensor's size and one byte under it: the
    files are huggingface_hub's split of the tensors in the order they are written, each
    tensor in one file (the index lists each once, in the file that holds it), each file within
    ``max_shard_bytes`` unless it holds one tensor, and the tensors are the params."""
    ckpt, setup = _ref(module, checkpoint("gqa"))
    params = ckpt.load(setup, optimizer_state=False)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    plan = module._plan(setup, leaves, np.dtype(np.float32))
    largest = max(n for _, n in plan)
    for m in (largest, np.int64(largest - 1)):  # a numpy int too (a size computed with numpy)
        out = tmp / f"sharded-{m}"
        files = module.save_hf_llama(out, setup, params, max_shard_bytes=m)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == hub_split(plan, m), m
        assert index["metadata"]["total_size"] == sum(n for _, n in plan)
        assert files == [*sorted({*index["weight_map"].values()}), "model.safetensors.index.json"]
        seen = []
        for file in files[:-1]:
            held = load_file(out / file)
            seen += held
            assert all(index["weight_map"][name] == file for name in held), file
            assert len(held) == 1 or sum(a.nbytes for a in held.values()) <= m, (file, m)
        assert sorted(seen) == sorted(name for name, _ in plan)
    hf = LlamaForCausalLM.from_pretrained(out)
    want = np.asarray(params["blocks"]["mlp"]["down"]["w"][1]).T
    np.testing.assert_array_equal(hf.model.layers[1].mlp.down_proj.weight.detach().numpy(), want)


def check_circular_load(module, tmp: Path) -> None:
    """8 layers in 2 stages × 4 virtual stages (``2d+circular4``): stored row r holds layer
    ``stage_order(8, 2, 4)[r]``, [0, 2, 4, 6, 1, 3, 5, 7][r], a permutation that is not its own
    inverse (2 × 2's [0, 2, 1, 3] is: a loader reading row r from layer order⁻¹[r] loads the
    same params there). The load, gathered, is the ``ref`` setup's load of the same files (the
    model's order) bit for bit, and ``shard`` of that stores the load's arrays; the logits are
    transformers'; saved back (in the model's order), transformers' logits are shardops'."""
    from _model_checks import mesh_for

    from shardops.pipeline import stage_order

    path = tmp / "deep"
    fields = {**CONFIGS["gqa"][0], "num_hidden_layers": 8}
    perturb(LlamaForCausalLM(LlamaConfig(**fields)), seed=4).save_pretrained(path)
    ckpt, ref = _ref(module, path)
    setup = models.build("2d+circular4", mesh_for({"pipe": 2, "data": 2, "model": 2}),
                         model=ckpt.model(), optimizer=optax.sgd(0.1), microbatches=2)  # fmt: skip
    order = stage_order(8, 2, 4)
    assert set(setup.padding.order.values()) == {order}, setup.padding.order
    assert [order[r] for r in order] != list(range(8)), f"{order} is its own inverse"
    want = jax.device_get(ckpt.load(ref, optimizer_state=False))  # the model's order
    params = ckpt.load(setup, optimizer_state=False)
    placed = setup.shard(want).params
    gathered = setup.gather(params)
    for (key, leaf), got, stored, own in zip(jax.tree_util.tree_leaves_with_path(want),
                                             jax.tree.leaves(gathered), jax.tree.leaves(placed),
                                             jax.tree.leaves(params), strict=True):  # fmt: skip
        where = jax.tree_util.keystr(key)
        np.testing.assert_array_equal(got, leaf, err_msg=f"{where}: gathered load")
        np.testing.assert_array_equal(np.asarray(stored), np.asarray(own),
                                      err_msg=f"{where}: shard of the model's order")  # fmt: skip
    ids, _ = tokens(setup.model.vocab_size)
    logits = np.asarray(setup.logits(params, setup.place_batch(ids)))
    check_close(logits, str(path), ids, "2d+circular4 load")
    module.save_hf_llama(tmp / "saved", setup, params)
    check_close(logits, str(tmp / "saved"), ids, "2d+circular4 saved")


def check_generate_stops_at_eos_after_a_save(hf_class, path: str, loader, save, tmp_path,
                                             **hf_options) -> None:  # fmt: skip
    """A transformers checkpoint (``hf_class`` at ``path``) given special tokens its greedy
    ``generate`` meets (two eos ids, each the token some row generates at a different step; a
    bos and a pad id), loaded by shardops (``loader``, e.g. ``HfLlama``) into the reference
    setup and saved back (``save``): transformers' ``generate`` on the saved folder, reading
    only its files, stops every row at its eos where the original does (the same tokens,
    pad after the eos, the same length), and both files hold the ids as transformers writes
    them (config.json and generation_config.json). ``hf_options``: ``from_pretrained``'s."""
    from transformers import GenerationConfig

    prompt = torch.as_tensor(np.random.default_rng(5).integers(0, 60, (4, 6)))
    model = hf_class.from_pretrained(path, **hf_options).eval()

    def greedy(m, steps=12):
        with torch.no_grad():
            return m.generate(prompt, attention_mask=torch.ones(prompt.shape), do_sample=False,
                              max_new_tokens=steps).numpy()[:, prompt.shape[1] :]  # fmt: skip

    model.generation_config.eos_token_id = None  # the continuation the eos ids are taken from
    free = greedy(model)
    eos = [int(free[0, 3]), int(free[1, 7])]
    eos[1] = eos[1] if eos[1] != eos[0] else int(free[1, 8])
    pad = next(t for t in range(2, 60) if t not in free)  # a pad no row generates
    model.config.update({"bos_token_id": 1, "eos_token_id": eos, "pad_token_id": pad})
    model.generation_config = GenerationConfig.from_model_config(model.config)
    source = tmp_path / "with-special-tokens"
    model.save_pretrained(source)
    want = greedy(hf_class.from_pretrained(source, **hf_options).eval())
    stopped = [(row == pad).any() for row in want]
    assert stopped[0] and stopped[1], f"the eos ids {eos} stop no row: {want}"
    ckpt = loader(source)
    assert ckpt.model().special_tokens == models.SpecialTokens(bos=1, eos=tuple(eos), pad=pad)
    setup = models.build("ref", None, model=ckpt.model(), optimizer=optax.sgd(0.1))
    out = tmp_path / "saved-by-shardops"
    save(out, setup, ckpt.load(setup, optimizer_state=False))
    got = greedy(hf_class.from_pretrained(out, **hf_options).eval())
    np.testing.assert_array_equal(got, want, err_msg="generate on the saved checkpoint")
    config = json.loads((out / "config.json").read_text())
    theirs = json.loads((source / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == theirs[key], (key, config[key], theirs[key])
    ours, original = (GenerationConfig.from_pretrained(d).to_diff_dict() for d in (out, source))
    for diff in (ours, original):
        diff.pop("transformers_version", None)
    assert ours == original, (ours, original)
