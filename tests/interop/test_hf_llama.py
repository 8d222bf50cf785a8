"""Hugging Face Llama checkpoints (``shardops_models.interop``) against an implementation
nobody here wrote: tiny checkpoints written by transformers from a config (``_hf_checks``)
load into every strategy and mesh of ``models.Llama`` with transformers' own logits and loss;
a checkpoint shardops saves after training loads in transformers with shardops' logits; each
block is read once, from its slice; what the model cannot compute is refused by name."""

import json
import os
import re
import shutil

import _hf_checks
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from _cover import FULL
from _gpt_checks import MESHES
from _hf_checks import (
    CONFIGS,
    check_circular_load,
    check_close,
    check_generate_stops_at_eos_after_a_save,
    checkpoint,
    hf_logits,
    tokens,
)
from _model_checks import mesh_for
from _processes import launcher, run
from transformers import LlamaForCausalLM

import shardops_models as models
from shardops_models.generation import Decoder
from shardops_models.interop import HfLlama, UnsupportedConfig, hf_llama, save_hf_llama


def _cases():
    """Every strategy (ref included) once by default, the two checkpoints and the meshes taken
    in turn, model = 8 and model = 4 first (2 KV heads replicated, vocabularies 97 and 101
    padded); every strategy × mesh × checkpoint under SHARDOPS_FULL=1."""
    out = []
    for i, name in enumerate(sorted(models.STRATEGIES)):
        axes = set(models.STRATEGIES[name].axes)
        meshes = [m for m, shape in MESHES.items() if axes <= set(shape)] or [None]
        if FULL:
            out += [(c, name, m) for c in CONFIGS for m in meshes]
            continue
        preferred = [m for m in ("1x8", "2x4", "1x2x4", "model8") if m in meshes]
        out.append((sorted(CONFIGS)[i % 2], name, (preferred or meshes)[i // 2 % len(
            preferred or meshes)]))  # fmt: skip
    return out


CASES = _cases()


def _load(name, strategy, mesh_name, optimizer=None):
    ckpt = HfLlama(checkpoint(name))
    mesh = mesh_for(MESHES[mesh_name]) if mesh_name else None
    setup = models.build(strategy, mesh, model=ckpt.model(), optimizer=optimizer or optax.sgd(0.1))
    return ckpt, setup, ckpt.load(setup)


def _loss(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean next-token cross-entropy of float64 logits."""
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, labels[..., None].astype(np.int64), -1).mean())


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_a_checkpoint_loads_into_every_strategy_with_transformers_logits_and_loss(case):
    name, strategy, mesh_name = case
    ckpt, setup, state = _load(name, strategy, mesh_name)
    model = setup.model
    # Each element of the files read exactly once, whatever the layout (replicas share a read).
    total = sum(a.size for a in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))
    assert ckpt.elements_read == total
    ids, labels = tokens(model.vocab_size)
    logits = np.asarray(setup.logits(state.params, setup.place_batch(ids)))
    check_close(logits, checkpoint(name), ids, f"{name} {strategy} {mesh_name}")
    metrics = setup.evaluate(state.params, *setup.place_batch(ids, labels))
    exact = _loss(hf_logits(checkpoint(name), ids, torch.float64), labels)
    assert abs(float(metrics.loss) - exact) <= 1e-5 * exact, (float(metrics.loss), exact)


def test_a_checkpoint_loads_into_circular_stages_and_saves_back(tmp_path):
    """8 layers in 2 stages × 4 virtual stages (``2d+circular4``), stored in ``stage_order``,
    a permutation that is not its own inverse: the loader reads each stored row's own layer
    (gathered: the model's order; the logits transformers'), and saved back in the model's
    order, transformers' logits are shardops' (``_hf_checks.check_circular_load``)."""
    check_circular_load(hf_llama, tmp_path)


def test_the_cases_cover_every_strategy_both_checkpoints_and_model_4_and_8():
    assert {s for _, s, _ in CASES} == set(models.STRATEGIES)
    assert {c for c, *_ in CASES} == set(CONFIGS)
    assert {MESHES[m].get("model") for *_, m in CASES if m} >= {4, 8}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_trained_checkpoint_saved_by_shardops_loads_in_transformers(name, tmp_path):
    """3 Adam steps under fsdp_tp on 2×4 (vocabulary padded to 100 or 104), saved (the GQA one
    index-sharded into files of ≤ 20 kB), loaded by transformers: its logits are shardops'
    within the float32 bound, and the checkpoint loads back into tp on 1×8 bit for bit."""
    _, setup, state = _load(name, "fsdp_tp", "2x4", optax.adam(3e-2))
    ids, labels = tokens(setup.model.vocab_size, seed=1)
    before = setup.gather(state.params)
    for _ in range(3):
        state, _ = setup.train_step(state, *setup.place_batch(ids, labels))
    trained = setup.gather(state.params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(trained), jax.tree.leaves(before),
                            strict=True):  # fmt: skip
        assert np.abs(a - b).max() > 1e-3, f"params{jax.tree_util.keystr(path)} did not train"
    out = tmp_path / "saved"
    sharded = 20_000 if name == "gqa" else None
    files = save_hf_llama(out, setup, state, max_shard_bytes=sharded)
    assert (len(files) > 2) == (sharded is not None), files
    if sharded:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == set(files[:-1])
    logits = np.asarray(setup.logits(state.params, setup.place_batch(ids)))
    check_close(logits, str(out), ids, f"{name} saved after training")
    hf = LlamaForCausalLM.from_pretrained(out)
    assert hf.config.tie_word_embeddings == setup.model.tie_embeddings
    assert hf.config.num_key_value_heads == setup.model.num_kv_heads
    again = HfLlama(out)
    assert again.model() == setup.model
    tp = models.build("tp", mesh_for(MESHES["1x8"]), model=again.model(), optimizer=optax.sgd(0.1))
    reloaded = tp.gather(again.load(tp, optimizer_state=False))
    for a, b in zip(jax.tree.leaves(reloaded), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_bfloat16_checkpoint_loads_into_float32_params_exactly(tmp_path):
    """transformers' usual dtype: BF16 tensors, widened exactly to the params' float32."""
    path = tmp_path / "bf16"
    LlamaForCausalLM.from_pretrained(checkpoint("mqa_tied"), dtype=torch.bfloat16).save_pretrained(
        path
    )
    ckpt = HfLlama(path)
    setup = models.build(
        "tp", mesh_for(MESHES["1x8"]), model=ckpt.model(), optimizer=optax.sgd(0.1)
    )
    params = setup.gather(ckpt.load(setup, optimizer_state=False))
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    want = hf.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
    np.testing.assert_array_equal(params["blocks"]["attn"]["wq"][1], want)
    assert params["embed"]["table"].dtype == np.float32


def _edited_config(tmp_path, **changes):
    path = tmp_path / "edited"
    shutil.copytree(checkpoint("gqa"), path)
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            config[outer] = {**config[outer], inner: value}
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("field, value, named", [
    ("model_type", "mistral", "model_type"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling"),
    ("rope_parameters.rope_type", "yarn", "rope_parameters.rope_type"),
    ("rope_parameters", {"type": "linear", "factor": 4.0, "rope_theta": 500.0},
     "rope_parameters.rope_type='linear'"),  # older configs name it "type"
    ("head_dim", 16, "head_dim"),
    ("attention_bias", True, "attention_bias"),
    ("mlp_bias", True, "mlp_bias"),
    ("hidden_act", "gelu", "hidden_act"),
    ("attention_dropout", 0.1, "attention_dropout"),
])  # fmt: skip
def test_an_unsupported_config_field_is_refused_by_name(tmp_path, field, value, named):
    path = _edited_config(tmp_path, **{field: value})
    with pytest.raises(UnsupportedConfig, match=re.escape(named)):
        HfLlama(path).model()


def test_tensors_whose_shapes_disagree_with_the_config_are_refused(tmp_path):
    """intermediate_size 88 in the files, 80 in the config: refused before anything is read
    (a clamped slice would silently drop 8 hidden units)."""
    path = _edited_config(tmp_path, intermediate_size=80)
    ckpt = HfLlama(path)
    setup = models.build("ref", model=ckpt.model(), optimizer=optax.sgd(0.1))
    with pytest.raises(
        ValueError, match=r"gate_proj.weight is \[88, 64\], the config gives \[80, 64\]"
    ):
        ckpt.load(setup)
    assert ckpt.elements_read == 0


def test_saving_over_a_checkpoint_of_the_other_form_replaces_its_weights(tmp_path):
    """A sharded save over a single-file one (and back): neither transformers (which reads
    model.safetensors first) nor HfLlama (the index first) can read the stale weights."""
    _, setup, state = _load("gqa", "tp", "1x8")
    out = tmp_path / "out"
    save_hf_llama(out, setup, state)  # one file
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    files = save_hf_llama(out, setup, zeros, max_shard_bytes=20_000)  # sharded, all zeros
    assert sorted(os.listdir(out)) == sorted(["config.json", "generation_config.json", *files])
    hf = LlamaForCausalLM.from_pretrained(out)
    assert float(hf.model.embed_tokens.weight.detach().abs().max()) == 0.0
    save_hf_llama(out, setup, state)  # one file again
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    (out / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="holds both model.safetensors and"):
        HfLlama(out)


def test_saved_in_bfloat16_transformers_reads_the_rounded_weights(tmp_path):
    _, setup, state = _load("mqa_tied", "2d", "2x4")
    save_hf_llama(tmp_path, setup, state, dtype=jnp.bfloat16)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert hf.config.dtype == torch.bfloat16 or str(hf.config.dtype).endswith("bfloat16")
    want = setup.gather(state.params)["blocks"]["mlp"]["down"]["w"][0].T.astype(jnp.bfloat16)
    got = hf.model.layers[0].mlp.down_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(got, np.asarray(want, np.float32))


def test_a_missing_or_unexpected_tensor_is_refused_by_name(tmp_path):
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "one"
    LlamaForCausalLM.from_pretrained(checkpoint("mqa_tied")).save_pretrained(path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    setup = models.build("ref", model=HfLlama(path).model(), optimizer=optax.sgd(0.1))
    bias = "model.layers.0.self_attn.q_proj.bias"
    save_file({**tensors, bias: np.zeros(64, np.float32)}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"not understood.*{bias}"):
        HfLlama(path).load(setup)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        HfLlama(path).load(setup)


def test_a_setup_of_another_model_is_refused(tmp_path):
    ckpt = HfLlama(checkpoint("gqa"))
    other = models.build("ref", model=ckpt.model(num_kv_heads=4), optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match="num_kv_heads: 2 in the checkpoint, 4 in the setup"):
        ckpt.load(other)
    with pytest.raises(FileNotFoundError, match="config.json"):
        HfLlama(tmp_path)
    os.makedirs(tmp_path / "c")
    (tmp_path / "c" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        HfLlama(tmp_path / "c")


def test_each_process_of_a_two_process_run_reads_only_its_slices(tmp_path):
    """tp on 1×8 over 2 processes of 4 devices: each process reads half of every split matrix
    (its 4 devices' heads, d_ff columns and vocabulary rows: 52 of the 104 padded rows for
    process 0, the last 45 real ones for process 1) and all of the replicated K/V weights
    (2 KV heads on 8 devices) and norms; the logits equal transformers', the checkpoint the
    two processes save loads in transformers with them, and they decode the tokens one process
    decodes."""
    ids, _ = tokens(97)
    np.save(tmp_path / "ids.npy", ids)
    out, saved = tmp_path / "out", tmp_path / "saved"
    run(launcher(2, "tests/_hf_worker.py", checkpoint("gqa"), str(tmp_path / "ids.npy"), str(out),
                 str(saved), "tp:1x8"), tmp_path, "hf", timeout=240)  # fmt: skip
    fields = CONFIGS["gqa"][0]
    layers, d, f = fields["num_hidden_layers"], fields["hidden_size"], fields["intermediate_size"]
    kv = fields["num_key_value_heads"] * d // fields["num_attention_heads"]
    halves = layers * (2 * d * d + 3 * d * f) // 2  # wq, wo, gate, up, down: split over model
    replicated = layers * (2 * d * kv + 2 * d) + d  # wk, wv, the two norms a layer, the last norm
    rows = (52, 45)  # vocabulary rows of table[V, D] and head columns w[D, V] per process
    for process in (0, 1):
        read = json.loads((tmp_path / f"out.{process}.json").read_text())["elements_read"]
        assert read == halves + replicated + 2 * rows[process] * d, (process, read)
    logits = np.load(f"{out}.npz")["logits"]
    check_close(logits, checkpoint("gqa"), ids, "2 processes")
    # KV-cache decoding across the 2 processes: the tokens one process decodes on 1×8.
    decoder = Decoder(HfLlama(checkpoint("gqa")).model(), mesh_for(MESHES["1x8"]), batch=len(ids),
                      max_len=16)  # fmt: skip
    params = HfLlama(checkpoint("gqa")).load(decoder.setup, optimizer_state=False)
    alone = np.asarray(decoder.generate(params, ids[:, :8], 6))
    np.testing.assert_array_equal(np.load(f"{out}.npz")["decoded"], alone)
    check_close(logits, str(saved), ids, "saved by 2 processes")


def test_a_field_config_json_leaves_out_takes_transformers_default():
    """Each field left out, and all of them: the model of transformers' own LlamaConfig."""
    _hf_checks.check_defaults(hf_llama)


def test_hidden_act_is_accepted_exactly_where_transformers_computes_silu():
    _hf_checks.check_activation_aliases(hf_llama)


def test_shards_split_at_max_shard_bytes_as_huggingface_hub_splits():
    """Tensor sizes around the boundary, against huggingface_hub's own split (pure Python)."""
    _hf_checks.check_shard_split(hf_llama)


def test_a_sharded_save_at_the_boundary_lists_each_tensor_once(tmp_path):
    _hf_checks.check_sharded_save(hf_llama, tmp_path)


def test_a_tied_config_over_a_distinct_lm_head_loads_untied_as_transformers_does(tmp_path):
    _hf_checks.check_untied_head(hf_llama, tmp_path)


def test_a_tied_checkpoint_holding_lm_head_alone_reads_the_embedding_from_it(tmp_path):
    _hf_checks.check_lm_head_alone(hf_llama, tmp_path)


def test_every_tensor_the_mapping_does_not_place_is_refused_by_name(tmp_path):
    _hf_checks.check_unplaced_tensors(hf_llama, tmp_path)


def test_elements_read_is_the_latest_loads():
    _hf_checks.check_elements_read(hf_llama)


def test_config_or_index_that_is_not_json_is_refused_naming_the_file(tmp_path):
    _hf_checks.check_json_errors(hf_llama, tmp_path)


def test_save_refuses_a_dtype_a_file_path_and_a_shard_size_by_name(tmp_path):
    _hf_checks.check_save_errors(hf_llama, tmp_path)


def test_a_saved_checkpoint_stops_generate_at_eos_where_the_original_does(tmp_path):
    check_generate_stops_at_eos_after_a_save(LlamaForCausalLM, checkpoint("gqa"), HfLlama,
                                             save_hf_llama, tmp_path)  # fmt: skip
