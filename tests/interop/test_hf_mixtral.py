"""Hugging Face Mixtral checkpoints (``shardops_models.interop.HfMixtral``) against transformers'
own ``MixtralForCausalLM``: a tiny checkpoint it writes from a config (random weights, nothing
downloaded) loads under expert × tensor parallelism, tensor parallelism alone and the
reference with transformers' logits (dropless: ``capacity_factor=None``, and ``E / k`` under
expert parallelism, which cannot split dropless experts); what shardops
saves after training loads in transformers with shardops' logits, and the same files come out
of an expert-parallel layout and a layout without one, bit for bit; greedy KV-cache decoding
generates transformers' ``generate`` tokens; mutants of the names
table and of the capacity default are caught; what the model cannot compute is refused by
name."""

import dataclasses
import functools
import json
import re
import shutil

import jax
import numpy as np
import optax
import pytest
import torch
from _cover import cover
from _gpt_checks import EP_MESHES, MESHES
from _hf_checks import check_close, check_generate_stops_at_eos_after_a_save, tokens
from _messages import refused
from _model_checks import mesh_for
from _mutants import mutant
from test_decoding import teacher_forced
from transformers import MixtralConfig, MixtralForCausalLM

import shardops_models as models
from shardops_models.generation import Decoder
from shardops_models.interop import (
    HfLlama,
    HfMixtral,
    UnsupportedConfig,
    hf_mixtral,
    save_hf_llama,
    save_hf_mixtral,
)

torch.set_num_threads(1)  # the suite's workers share 2 cores

# 2 layers of 4 heads on 2 KV heads, E = 4 experts of F = 30, each token to k = 2 of them; a
# vocabulary of 61. On model = 4 (tp on 2×4, 2d on 2×4) both are padded (F to 32, V to 64); on
# model = 2 (2d+ep) the vocabulary alone (to 62): the experts' blocks are read zero-filled.
FIELDS = dict(vocab_size=61, hidden_size=32, intermediate_size=30, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
              num_experts_per_tok=2, max_position_embeddings=64, rope_theta=500.0,
              router_aux_loss_coef=0.02)  # fmt: skip
LAYOUTS = [("2d+ep", "d2e2m2"), ("tp", "2x4"), ("ref", None)]


@functools.cache
def _checkpoint(root: str, layers: int = 2, k: int = 2, kv_heads: int = 2) -> str:
    """A ``MixtralForCausalLM`` of ``FIELDS`` (``layers`` layers, each token to ``k`` experts,
    ``kv_heads`` KV heads), its weights N(0, 0.1) and its norms 1 + N(0, 0.2)
    (``_hf_checks``' draw: logits that spread, routing far from uniform), saved in
    ``root``."""
    fields = {**FIELDS, "num_hidden_layers": layers, "num_experts_per_tok": k,
              "num_key_value_heads": kv_heads}  # fmt: skip
    model = MixtralForCausalLM(MixtralConfig(**fields))
    gen = torch.Generator().manual_seed(layers if (k, kv_heads) == (2, 2) else 10 * k + kv_heads)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.1 * noise)
    path = f"{root}/mixtral{layers}-k{k}-kv{kv_heads}"
    model.eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(str(tmp_path_factory.mktemp("hf-mixtral")))


def _hf(path: str, dtype=torch.float32) -> MixtralForCausalLM:
    # The eager experts: transformers' grouped matmul has no float64.
    return MixtralForCausalLM.from_pretrained(path, dtype=dtype,
                                              experts_implementation="eager").eval()  # fmt: skip


def _hf_logits(path: str, ids: np.ndarray, dtype=torch.float32) -> np.ndarray:
    with torch.no_grad():
        return _hf(path, dtype)(torch.as_tensor(ids)).logits.numpy()


def _check_close(got: np.ndarray, path: str, ids: np.ndarray, what: str) -> None:
    """``_hf_checks.check_close`` with transformers' Mixtral forward."""
    check_close(got, path, ids, what, forward=_hf_logits)


def _build(model, strategy, mesh_name, optimizer=None):
    mesh = mesh_for({**MESHES, **EP_MESHES}[mesh_name]) if mesh_name else None
    return models.build(strategy, mesh, model=model, optimizer=optimizer or optax.sgd(0.1))


def _logits(module, path, strategy="2d+ep", mesh_name="d2e2m2", **overrides):
    ckpt = module.HfMixtral(path)
    setup = _build(ckpt.model(strategy=strategy, **overrides), strategy, mesh_name)
    params = ckpt.load(setup, optimizer_state=False, experts="setup" if overrides else "checkpoint")
    ids, _ = tokens(FIELDS["vocab_size"])
    return ckpt, np.asarray(setup.logits(params, setup.place_batch(ids))), ids


@pytest.mark.parametrize(("strategy", "mesh_name"), LAYOUTS, ids=lambda c: str(c))
def test_a_checkpoint_loads_with_transformers_logits(checkpoint, strategy, mesh_name):
    """Every element of the files read once, whatever the layout (replicas share a read); the
    model dropless, or at ``E / k`` (``C = S``, nothing dropped) under expert parallelism."""
    ckpt, logits, ids = _logits(hf_mixtral, checkpoint, strategy, mesh_name)
    model = ckpt.model(strategy=strategy)
    expert_parallel = strategy is not None and models.strategy_named(strategy).ep is not None
    assert model.experts.capacity_factor == (4 / 2 if expert_parallel else None)
    total = sum(a.size for a in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0))))
    assert ckpt.elements_read == total
    _check_close(logits, checkpoint, ids, f"{strategy} {mesh_name}")


def test_a_smaller_capacity_drops_choices_and_departs_from_transformers(checkpoint):
    """capacity_factor=1 (C = ceil(S · k / E) = 8 of 16 slots): the tokens routed here overflow
    an expert, so the dropless default is what makes the logits transformers'."""
    ckpt, logits, ids = _logits(hf_mixtral, checkpoint, capacity_factor=1.0)
    assert ckpt.model(capacity_factor=1.0).experts.capacity_factor == 1.0
    with pytest.raises(AssertionError, match="shardops − transformers"):
        _check_close(logits, checkpoint, ids, "capacity 1")


def test_trained_checkpoint_saved_by_shardops_loads_in_transformers_bit_for_bit(checkpoint,
                                                                                tmp_path):  # fmt: skip
    """3 Adam steps under 2d+ep, saved: transformers' logits are shardops'; the checkpoint
    loaded into 2d (no expert axis, another padding) and saved again gives the same files byte
    for byte, and loads back into 2d+ep with the trained parameters bit for bit."""
    ckpt = HfMixtral(checkpoint)
    setup = _build(ckpt.model(strategy="2d+ep"), "2d+ep", "d2e2m2", optax.adam(3e-2))
    state = ckpt.load(setup)
    ids, labels = tokens(FIELDS["vocab_size"], seed=1)
    before = setup.gather(state.params)
    for _ in range(3):
        state, _ = setup.train_step(state, *setup.place_batch(ids, labels))
    trained = setup.gather(state.params)
    moe = zip(jax.tree.leaves(trained["blocks"]["moe"]), jax.tree.leaves(before["blocks"]["moe"]),
              strict=True)  # fmt: skip
    assert all(np.abs(a - b).max() > 1e-3 for a, b in moe), "the experts did not train"
    out = tmp_path / "ep"
    assert save_hf_mixtral(out, setup, state) == ["model.safetensors"]
    _check_close(np.asarray(setup.logits(state.params, setup.place_batch(ids))), str(out), ids,
                 "saved after training")  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["router_aux_loss_coef"] == FIELDS["router_aux_loss_coef"]
    again = HfMixtral(out)
    assert again.model(strategy="2d+ep") == setup.model
    dense = _build(again.model(), "2d", "2x4")  # dropless
    save_hf_mixtral(tmp_path / "2d", dense, again.load(dense, optimizer_state=False))
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "2d" / name).read_bytes() == (out / name).read_bytes(), name
    reloaded = setup.gather(HfMixtral(tmp_path / "2d").load(setup, optimizer_state=False))
    for a, b in zip(jax.tree.leaves(reloaded), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(a, b)


# The decoding layouts: a mesh and the strategy ``Decoder`` picks on it by default; and the
# checkpoints they decode: top-1 and top-2 routing, GQA (2 KV heads) and MQA (1).
DECODE_MESHES = {
    "tp": ({"model": 4}, "tp"),  # every expert on every device, its hidden units split
    "2d": ({"data": 2, "model": 4}, "2d"),
    "ep": ({"expert": 4, "model": 1}, "tp+ep"),  # one expert a device, no tensor parallelism
    "tp+ep": ({"expert": 2, "model": 4}, "tp+ep"),
    "2d+ep": ({"data": 2, "expert": 2, "model": 2}, "2d+ep"),
}
ROUTINGS = {"top2-gqa": (2, 2), "top2-mqa": (2, 1), "top1-gqa": (1, 2), "top1-mqa": (1, 1)}
DECODE_CASES = cover(list(DECODE_MESHES), list(ROUTINGS))


def test_the_decoding_cases_cover_every_layout_and_checkpoint():
    assert {m for m, _ in DECODE_CASES} == set(DECODE_MESHES)
    assert {r for _, r in DECODE_CASES} == set(ROUTINGS)


@pytest.mark.parametrize(("layout", "routing"), DECODE_CASES, ids=lambda c: str(c))
def test_decoding_is_transformers_generate_under_every_layout(tmp_path_factory, layout, routing):
    """The KV-cache decoder of a transformers-written Mixtral (default strategy on each mesh:
    tp, 2d, and with the experts split over ``expert``, ep, tp+ep and 2d+ep) generates, greedy,
    the tokens of transformers' ``generate(do_sample=False)`` (float64, its own KV cache),
    every one of 8 rows × 12 steps (each step's top-2 margin in transformers' float64 forward
    exceeds twice the float32 bound of ``check_close``); teacher-forced, a prefill and one-token
    steps give transformers' full forward's logits at every position."""
    prompt_len, steps = 8, 12
    k, kv_heads = ROUTINGS[routing]
    path = _checkpoint(str(tmp_path_factory.mktemp("hf-mixtral")), 2, k, kv_heads)
    ckpt = HfMixtral(path)
    shape, strategy = DECODE_MESHES[layout]
    decoder = Decoder(ckpt.model(), mesh_for(shape), batch=8, max_len=prompt_len + steps)
    assert decoder.setup.strategy == models.strategy_named(strategy)
    split = decoder.param_specs["blocks"]["moe"]["gate"][1]
    assert split == ("expert" if "ep" in layout else None), split
    params = ckpt.load(decoder.setup, optimizer_state=False)
    prompt, _ = tokens(FIELDS["vocab_size"], seed=4, seq=prompt_len)
    got = np.asarray(decoder.generate(params, prompt, steps))
    hf = _hf(path, torch.float64)
    hf.generation_config.eos_token_id = None  # a random model's eos ends nothing
    with torch.no_grad():
        out = hf.generate(torch.as_tensor(prompt), attention_mask=torch.ones(prompt.shape),
                          max_new_tokens=steps, do_sample=False, pad_token_id=0).numpy()  # fmt: skip
    want = out[:, prompt_len:]
    fed = out[:, :-1]  # each generated token's inputs
    exact = _hf_logits(path, fed, torch.float64)[:, prompt_len - 1 :]
    bound = 2 * np.abs(_hf_logits(path, fed)[:, prompt_len - 1 :] - exact).max()
    bound += 4 * np.finfo(np.float32).eps * np.abs(exact).max()
    top2 = np.sort(exact, axis=-1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 2 * bound, "a near tie: change the seed"
    np.testing.assert_array_equal(got, want, err_msg=f"greedy tokens, {layout} {routing}")
    _check_close(teacher_forced(decoder, params, fed, fed.shape[1] - prompt_len, prompt_len), path, fed,
                 f"teacher-forced {layout} {routing}")  # fmt: skip


def test_the_load_balance_weight_gives_transformers_aux_loss(tmp_path):
    """One layer (where the layers cannot route apart): the load-balancing loss times its
    weight (router_aux_loss_coef · k / L) is transformers' aux_loss times the coefficient."""
    path = _checkpoint(str(tmp_path), layers=1)
    ckpt = HfMixtral(path)
    model = ckpt.model()
    params = ckpt.load(_build(model, "ref", None), optimizer_state=False)
    ids, labels = tokens(FIELDS["vocab_size"])
    no_aux = dataclasses.replace(model, experts=dataclasses.replace(
        model.experts, load_balance_weight=0.0))  # fmt: skip
    ours = float(model.reference_loss(params, ids, labels) - no_aux.reference_loss(params, ids,
                                                                                    labels))  # fmt: skip
    with torch.no_grad():
        out = _hf(path, torch.float64)(torch.as_tensor(ids), output_router_logits=True)
    theirs = FIELDS["router_aux_loss_coef"] * float(out.aux_loss)
    assert abs(ours - theirs) <= 1e-5 * theirs, (ours, theirs)


def test_a_field_config_json_leaves_out_takes_transformers_default():
    """Each Mixtral field left out: the model of transformers' own MixtralConfig."""
    c = MixtralConfig()
    want = dict(vocab_size=c.vocab_size, d_model=c.hidden_size, d_ff=c.intermediate_size,
                num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                num_kv_heads=c.num_key_value_heads, rope_theta=c.rope_parameters["rope_theta"],
                norm_eps=c.rms_norm_eps, tie_embeddings=c.tie_word_embeddings,
                context=c.max_position_embeddings)  # fmt: skip
    got = hf_mixtral.mixtral_from_config({"model_type": "mixtral"})
    assert {k: getattr(got, k) for k in want} == want
    e = c.num_local_experts
    assert got.experts == models.Experts(
        num_experts=e, k=c.num_experts_per_tok, capacity_factor=None,
        load_balance_weight=c.router_aux_loss_coef * c.num_experts_per_tok / c.num_hidden_layers,
        z_loss_weight=0.0)  # fmt: skip


def _edited(checkpoint, tmp_path, **changes):
    path = tmp_path / "edited"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.mark.parametrize(("field", "value"), [
    ("router_jitter_noise", 0.01), ("sliding_window", 32), ("attention_dropout", 0.1),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), ("head_dim", 16),
])  # fmt: skip
def test_an_unsupported_config_field_is_refused_by_name(checkpoint, tmp_path, field, value):
    with pytest.raises(UnsupportedConfig, match=re.escape(f"{field}={value!r}")):
        HfMixtral(_edited(checkpoint, tmp_path, **{field: value})).model()


def test_a_sliding_window_at_least_the_context_is_accepted(checkpoint, tmp_path):
    path = _edited(checkpoint, tmp_path, sliding_window=64)
    assert HfMixtral(path).model().context == 64
    with pytest.raises(UnsupportedConfig, match="pass context=32"):
        HfMixtral(_edited(checkpoint, tmp_path / "b", sliding_window=32)).model()
    assert HfMixtral(_edited(checkpoint, tmp_path / "c", sliding_window=32)).model(
        context=32).context == 32  # fmt: skip


def test_each_loader_and_saver_refuses_the_other_architecture(checkpoint, tmp_path):
    with pytest.raises(UnsupportedConfig, match=r"model_type='mixtral'.*interop\.HfMixtral"):
        HfLlama(checkpoint).model()
    setup = _build(HfMixtral(checkpoint).model(), "ref", None)
    params = HfMixtral(checkpoint).load(setup, optimizer_state=False)
    with pytest.raises(ValueError, match="save_hf_llama: the setup's model has experts.*"
                       "save_hf_mixtral"):  # fmt: skip
        save_hf_llama(tmp_path, setup, params)
    dense = _build(dataclasses.replace(setup.model, experts=None), "ref", None)
    with pytest.raises(TypeError, match="with experts.*interop.save_hf_llama"):
        save_hf_mixtral(tmp_path, dense, params)
    with pytest.raises(UnsupportedConfig, match="model_type='llama'.*interop.HfLlama"):
        hf_mixtral.mixtral_from_config({"model_type": "llama"})


def test_a_setup_of_other_experts_is_refused(checkpoint):
    """A capacity that drops choices, or other loss weights, only with ``experts="setup"``
    (each field named otherwise); a capacity that drops nothing (``E / k``) is the
    checkpoint's; the experts' number is the checkpoint's whatever ``experts``."""
    ckpt = HfMixtral(checkpoint)
    trained = _build(ckpt.model(capacity_factor=1.25, z_loss_weight=1e-3), "ref", None)
    with refused(ValueError, argument="HfMixtral.load: the setup's experts",
                 got="capacity_factor=1.25 (below E / k = 2: the choices", expected="z_loss_weight=0.001 (the "
                 "checkpoint's: 0.0)", fix="ckpt.model(strategy=...), or pass load(setup, "
                 "experts='setup')"):  # fmt: skip
        ckpt.load(trained)
    ckpt.load(trained, experts="setup")
    ckpt.load(_build(ckpt.model(capacity_factor=2.0), "ref", None))  # E / k: nothing dropped
    with pytest.raises(ValueError, match="load_balance='group' .the checkpoint's: 'global'"):
        ckpt.load(_build(ckpt.model(load_balance="group"), "ref", None))
    with pytest.raises(ValueError, match=r"experts must be one of \('checkpoint', 'setup'\)"):
        ckpt.load(trained, experts="mine")
    other = dataclasses.replace(ckpt.model(), experts=models.Experts(num_experts=4, k=1))
    with pytest.raises(ValueError, match="experts: Experts.*k=2.*in the checkpoint"):
        ckpt.load(_build(other, "ref", None))


# name → (exact line of hf_mixtral.py, replacement); each changes the logits on 2d+ep, but
# the dropless default's (read on tp: MUTANT_LAYOUTS).
_CAPACITY = '    experts = Experts(num_experts=e, k=k, capacity_factor=None, score="softmax",'
_SPLIT = "    experts = dataclasses.replace(experts.splittable() if ep else experts, **training)"
MUTANTS = {
    "router_not_transposed": (
        '    ("blocks", "moe", "router"): (_MOE + "gate.weight", True),',
        '    ("blocks", "moe", "router"): (_MOE + "gate.weight", False),'),
    "w1_w3_swapped": (  # up read from w1, then gate (its place in the table kept) from w3
        '    ("blocks", "moe", "up"): (_MOE + "experts.{e}.w3.weight", True),',
        '    ("blocks", "moe", "up"): (_MOE + "experts.{e}.w1.weight", True),\n'
        '    ("blocks", "moe", "gate"): (_MOE + "experts.{e}.w3.weight", True),'),
    "capacity_of_training": (_SPLIT, _SPLIT.replace("experts.splittable()",
                                                    "dataclasses.replace(experts, capacity_factor=1.25)")),
    "capacity_of_training_without_ep": (_CAPACITY, _CAPACITY.replace("=None", "=1.25")),
}  # fmt: skip
MUTANT_LAYOUTS = {"capacity_of_training_without_ep": ("tp", "2x4")}


@pytest.mark.parametrize("name", [None, *MUTANTS])
def test_mutant_is_caught(checkpoint, name):
    """The unmutated copy (``None``) passes; each mutant fails the logits check, or (the router
    read ``[E, D]`` into ``[D, E]``) the check of the files' shapes."""
    line, new = MUTANTS[name or "router_not_transposed"]
    module = mutant(hf_mixtral, name or "unmutated", line, new if name else line)
    if name is None:
        _, logits, ids = _logits(module, checkpoint)
        _check_close(logits, checkpoint, ids, "unmutated")
        return
    layout = MUTANT_LAYOUTS.get(name, ())
    with pytest.raises((AssertionError, ValueError), match="shardops − transformers|the config "
                       "gives"):  # fmt: skip
        _, logits, ids = _logits(module, checkpoint, *layout)
        _check_close(logits, checkpoint, ids, name)


def test_a_dropless_model_under_expert_parallelism_is_refused(checkpoint):
    """The default model (dropless) built under ep: refused when the setup builds, naming
    the fix (``ckpt.model(strategy=...)`` gives ``E / k`` there)."""
    with refused(ValueError, argument="strategy '2d+ep'", got="is dropless",
                 expected="splits experts over 'expert'",
                 fix="interop.HfMixtral(path).model(strategy='2d+ep')"):  # fmt: skip
        _build(HfMixtral(checkpoint).model(), "2d+ep", "d2e2m2")


def test_a_missing_expert_tensor_is_refused_by_name_and_nothing_else(checkpoint, tmp_path):
    """One expert's ``w2`` of one layer left out of the files: the message names it, says why
    it matters and how to fix it, and says nothing of tensors not understood (there are
    none)."""
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "missing"
    shutil.copytree(checkpoint, path)
    tensors = load_file(path / "model.safetensors")
    gone = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    del tensors[gone]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    ckpt = HfMixtral(path)
    setup = _build(ckpt.model(), "2d", "2x4")
    with refused(ValueError, argument=f"{path}: the files", got=f"missing [{gone!r}]",
                 expected="the tensors HfMixtral reads", fix="the config's architecture, whole"
                 ) as info:  # fmt: skip
        ckpt.load(setup)
    assert "not understood" not in str(info.value) and "bias" not in str(info.value)


def test_a_saved_checkpoint_stops_generate_at_eos_where_the_original_does(checkpoint, tmp_path):
    check_generate_stops_at_eos_after_a_save(MixtralForCausalLM, checkpoint, HfMixtral,
                                             save_hf_mixtral, tmp_path,
                                             experts_implementation="eager")  # fmt: skip


def test_help_of_the_mixtral_reader_names_its_strategy_argument():
    """``HfMixtral.model`` and ``.load`` are Mixtral's own in ``help()``: ``strategy=`` and
    ``experts=`` with what they do, not the Llama reader's text."""
    import inspect

    assert "strategy" in inspect.signature(HfMixtral.model).parameters
    assert "E / k" in HfMixtral.model.__doc__ and "strategy" in HfMixtral.model.__doc__
    assert HfMixtral.model.__doc__ != HfLlama.model.__doc__
    assert "experts" in inspect.signature(HfMixtral.load).parameters
    assert 'experts="setup"' in HfMixtral.load.__doc__
