"""The Llama (``models.Llama``: RoPE, grouped-query attention, SwiGLU, RMSNorm, stacked blocks
under ``lax.scan``, optionally tied embeddings and packed documents) under every strategy: 5
steps of SGD and of Adam with global-norm clipping on equal the plain-jnp reference, the
compiled collectives equal the budget traced from the step, and a vocabulary of 97 and a d_ff
of 172 train padded on model = 2, 4 and 8."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from _cover import FULL
from _gpt_checks import (
    BATCH,
    MESHES,
    OPTIMIZERS,
    SEQ,
    check_lm_trajectory,
    lm_batches,
)
from _lm_budgets import EXPECTED
from _messages import refused
from test_gpt import TRAJECTORIES as GPT_TRAJECTORIES
from test_gpt import degenerate, next_mesh

import shardops
import shardops_models as models
from shardops_models.networks._lm import PAD_LABEL

# 8 query heads share 2 KV heads (replicated over model = 4 and 8, split over 2), vocabulary 97
# and d_ff 172 (padded on every model axis > 1), 2 stacked layers.
# Weights drawn × 0.1 (not Llama's 0.02), so that attention is not uniform and every leaf,
# wq and wk included, moves enough in 5 steps for the check to see a wrong gradient.
GQA = models.Llama(vocab_size=97, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2,
                   d_ff=172, context=SEQ, init_scale=0.1)  # fmt: skip
# Multi-query attention, the output head tied to the embedding, packed documents (token 1
# begins one).
TIED_MQA = models.Llama(vocab_size=97, d_model=32, num_layers=2, num_heads=8, num_kv_heads=1,
                        d_ff=172, context=SEQ, tie_embeddings=True, bos_id=1,
                        init_scale=0.1)  # fmt: skip
MODELS = {"gqa": GQA, "tied_mqa": TIED_MQA}
CLIP = 0.25  # below every reference gradient norm (≥ 0.95): the clipping binds at every step
# Each clipped SGD step moves the parameters by SGD_LR · CLIP in norm: 0.125, a tenth of
# their norm, so 5 steps stay in the smooth region where float32 differences do not grow.
SGD_LR = 0.5


def _cases():
    """By default Adam for every strategy the GPT trains with SGD alone
    (tests/networks/test_gpt.py: between the two every strategy trains an LM with each
    optimizer), the models in turn; the hand-written budget's case (the GQA under tp on
    model = 8: vocabulary 97 padded to 104) and the tied MQA under fsdp with SGD, so that each
    model trains with each optimizer; meshes on which each of the strategy's axes has more than
    one device, in turn. Every strategy × mesh with its axes × optimizer × model under
    SHARDOPS_FULL=1."""
    names = sorted(s for s in models.STRATEGIES if s != "ref")
    if FULL:
        out = []
        for name in names:
            axes = set(models.STRATEGIES[name].axes)
            meshes = [m for m, shape in MESHES.items() if axes <= set(shape)]
            out += [(m, name, mesh, o) for mesh in meshes for o in OPTIMIZERS for m in MODELS]
        return out
    hand = [(k, s, m, o) for k, lm in MODELS.items() for name, s, m, o, *_ in EXPECTED
            if name == lm.name]  # fmt: skip
    gpt_adam = {s for s, _, o in GPT_TRAJECTORIES if o == "adam"}
    used = [m for _, m, _ in GPT_TRAJECTORIES] + [m for _, _, m, _ in hand]
    out = list(hand)
    for i, name in enumerate(n for n in names if n not in gpt_adam):
        out.append((("gqa", "tied_mqa")[i % 2], name, next_mesh(name, used), "adam"))
        used.append(out[-1][2])
    out.append(("tied_mqa", "fsdp", next_mesh("fsdp", used), "sgd"))
    return out


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_trajectory_and_budget(case):
    model, strategy, mesh, opt = case
    check_lm_trajectory(MODELS[model], strategy, mesh, opt, clip=CLIP, sgd_lr=SGD_LR, budget=True)


def test_the_cases_cover_every_strategy_model_and_optimizer():
    """With the GPT's, every strategy trains an LM with each optimizer and every mesh appears;
    each model trains with each optimizer; the hand budget's case, a 3-axis mesh and
    vocabulary 97 on model = 8 appear; no axis of a strategy has a single device."""
    strategies = set(models.STRATEGIES) - {"ref"}
    pairs = {(s, o) for _, s, _, o in CASES} | {(s, o) for s, _, o in GPT_TRAJECTORIES}
    assert pairs == {(s, o) for s in strategies for o in OPTIMIZERS}
    assert {(m, o) for m, _, _, o in CASES} == {(m, o) for m in MODELS for o in OPTIMIZERS}
    assert {m for *_, m, _ in CASES} | {m for _, m, _ in GPT_TRAJECTORIES} == set(MESHES)
    three_axes = {mesh for *_, mesh, _ in CASES if len(MESHES[mesh]) == 3}
    assert three_axes, "a 3-axis layout"
    assert any(mesh == "model8" for _, _, mesh, _ in CASES)  # vocabulary 97 on model = 8
    if not FULL:
        assert not any(degenerate(s, m) for _, s, m, _ in CASES)


@pytest.mark.parametrize(("model", "strategy", "mesh"),
                         [("gqa", "fsdp_tp", "4x2"), *[("tied_mqa", "dp", "data8")] * FULL])  # fmt: skip
def test_trajectory_with_the_einsum_reference_attention(model, strategy, mesh):
    """Every other trajectory runs the default attention (the blocked online softmax off TPU);
    the S×S einsum trains the same, packed documents and shared KV heads included."""
    check_lm_trajectory(MODELS[model], strategy, mesh, "sgd", clip=CLIP, sgd_lr=SGD_LR,
                        attention="einsum")  # fmt: skip


def test_build_refuses_an_unknown_attention():
    with refused(
        ValueError,
        argument="attention",
        got="'flash'",
        expected="'auto', 'einsum', 'blocked', 'splash'",
        fix="'auto' picks",
    ):
        models.build("ref", model=GQA, optimizer=optax.sgd(0.1), attention="flash")


@pytest.mark.parametrize("strategy", ["fsdp_tp", "hsdp_sp"])
def test_remat_trajectory_and_budget(strategy):
    """Remat inside the scan: each layer's weights gathered again in the backward pass."""
    check_lm_trajectory(GQA, strategy, "2x2x2" if strategy.startswith("hsdp") else "4x2", "sgd",
                        clip=CLIP, sgd_lr=SGD_LR, remat=True, budget=True)  # fmt: skip


@pytest.mark.parametrize("model", sorted(MODELS))
def test_ref_strategy_equals_the_plain_reference(model):
    llama = MODELS[model]
    setup = models.build("ref", optimizer=optax.sgd(0.1), model=llama)
    params = llama.init(jax.random.key(1))
    ids, labels = (a[0] for a in lm_batches(llama, 1))
    np.testing.assert_allclose(np.asarray(setup.logits(params, ids)),
                               llama.reference_logits(params, ids), atol=2e-6)  # fmt: skip
    loss, _ = setup.loss_and_grads(params, ids, labels)
    np.testing.assert_allclose(float(loss), float(llama.reference_loss(params, ids, labels)),
                               rtol=1e-6)  # fmt: skip


@pytest.mark.parametrize(("model", "strategy", "mesh"), [("gqa", "fsdp_sp", {"data": 2, "model": 4}),
                         ("tied_mqa", "tp", {"model": 8}), ("tied_mqa", "2d", {"data": 4, "model": 2})],
                         ids=str)  # fmt: skip
def test_evaluate_and_logits_never_see_the_padding(model, strategy, mesh):
    """Vocabulary 97 stored as 100 or 104: ``logits`` returns 97 columns equal to the
    reference, ``evaluate``'s loss and arg-max never pick a padded column, and ``PAD_LABEL``
    positions count nowhere."""
    llama = MODELS[model]
    setup = models.build(strategy, shardops.make_mesh(mesh), optimizer=optax.sgd(0.1),
                         model=llama)  # fmt: skip
    params = llama.init(jax.random.key(2))
    ids, labels = (np.array(a[0]) for a in lm_batches(llama, 2))
    labels[-4:, 5:] = PAD_LABEL
    real = labels != PAD_LABEL
    logits = np.asarray(llama.reference_logits(params, ids))  # [B, S, 97]
    picked = np.take_along_axis(jax.nn.log_softmax(logits), np.where(real, labels, 0)[..., None],
                                -1)[..., 0]  # fmt: skip
    state = setup.shard(params)
    metrics = setup.evaluate(state.params, *setup.place_batch(ids, labels))
    assert int(metrics.count) == real.sum()
    assert int(metrics.correct) == ((logits.argmax(-1) == labels) & real).sum()
    np.testing.assert_allclose(float(metrics.loss_sum), -picked[real].sum(), rtol=1e-5)
    got = np.asarray(setup.logits(state.params, setup.place_batch(ids)))
    assert got.shape == (BATCH, SEQ, 97)
    np.testing.assert_allclose(got, logits, atol=2e-6)
    # The stored table holds the padding (zero rows); gather gives the model's own shapes.
    stored = state.params["embed"]["table"]
    assert stored.shape[0] == shardops.padded_size(97, mesh["model"]) > 97
    assert not np.asarray(stored)[97:].any()
    back = setup.gather(state)
    assert back.params["embed"]["table"].shape == (97, 32)
    np.testing.assert_array_equal(back.params["embed"]["table"], params["embed"]["table"])


def test_the_stacked_layers_compile_one_block():
    """The blocks run under one lax.scan: the train step's jaxpr holds one scan of length L
    (and its transpose), not L copies of the block."""
    llama = models.Llama(vocab_size=64, d_model=32, num_layers=6, num_heads=4, num_kv_heads=2,
                         context=SEQ)  # fmt: skip
    setup = models.build("fsdp_tp", shardops.make_mesh({"data": 2, "model": 4}),
                         optimizer=optax.sgd(0.1), model=llama)  # fmt: skip
    text = str(setup.step_jaxpr(BATCH, SEQ))
    assert text.count("length=6") >= 2  # forward and backward scans
    assert text.count("dot_general") < 6 * 7  # the 7 block matmuls appear in the loop bodies


def test_config_and_build_errors():
    with pytest.raises(ValueError, match=r"num_kv_heads=3 must divide num_heads=8"):
        models.Llama(d_model=32, num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"head_dim = 3 must be even"):
        models.Llama(d_model=24, num_heads=8, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"bos_id=99 is not a token of the vocabulary"):
        models.Llama(vocab_size=97, bos_id=99)
    odd = models.Llama(vocab_size=97, d_model=48, num_heads=6, num_kv_heads=2, context=SEQ)
    with pytest.raises(ValueError, match=r"build: num_heads=6 is not divisible by mesh axis "
                                         r"'model' \(size 4\); each device must hold whole query "
                                         r"heads \(num_kv_heads=2\)"):  # fmt: skip
        models.build("tp", shardops.make_mesh({"data": 2, "model": 4}), model=odd,
                     optimizer=optax.sgd(0.1))  # fmt: skip
    setup = models.build("tp", shardops.make_mesh({"model": 2}), model=GQA,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    with pytest.raises(ValueError, match=r"ids hold 1 token\(s\) outside \[0, 97\)"):
        bad = np.zeros((4, 8), np.int32)
        bad[0, 0] = 97
        setup.place_batch(bad, np.zeros((4, 8), np.int32))
    with pytest.raises(ValueError, match=r"params\['embed'\]\['table'\] has shape \(100, 32\); "
                                         r"the model's is \(97, 32\)"):  # fmt: skip
        setup.shard(dict(GQA.init(jax.random.key(0)), embed={"table": np.zeros((100, 32),
                                                                                np.float32)}))  # fmt: skip


def test_the_locator_taps_each_stacked_layer_and_the_padded_head():
    """Under ``compare`` the scan is unrolled, so each layer is a row of its own
    (``['blocks'][1]['mlp']``); the padded vocabulary is cut off the head's tap; the tied
    head is a row apart from the embedding."""
    setup = models.build("fsdp_sp", shardops.make_mesh({"data": 2, "model": 4}),
                         optimizer=optax.sgd(0.1), model=TIED_MQA)  # fmt: skip
    state = setup.init(jax.random.key(0))
    ids, labels = (a[0] for a in lm_batches(TIED_MQA))
    report = models.locate(setup, state.params, ids, labels)
    assert report.within_bound, report.verdict()
    assert {"['blocks'][0]['attn']", "['blocks'][1]['mlp']", "['embed'] (tied head)",
            "['embed']"} <= set(report.layers)  # fmt: skip


def _table_gathers(setup, state, ids, labels) -> list[str]:
    """The passes of the compiled train step's AllGathers over data that assemble this model
    device's block of the tied table: [98 / 2, 32] f32 on model = 2."""
    compiled = setup.train_step.lower(state, *setup.place_batch(ids, labels)).compile()
    block = 98 // 2 * 32 * 4
    return [c.pass_ for c in shardops.inspect.collectives(setup.mesh, compiled)
            if c.kind == "all-gather" and c.axes == ("data",) and c.bytes == block]  # fmt: skip


def test_fsdp_gathers_a_tied_table_once_per_use(monkeypatch):
    """Under fsdp_sp on 4×2 the tied table is gathered for the embedding and again for the head
    (and for neither's backward without remat). The two gathers are alike, and XLA's CSE
    merges them (keeping the whole table alive in between) in the mutant without the
    use-numbered barrier."""
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    setup = models.build("fsdp_sp", mesh, optimizer=optax.sgd(0.1), model=TIED_MQA)
    state = setup.init(jax.random.key(0))
    ids, labels = (a[0] for a in lm_batches(TIED_MQA))
    assert _table_gathers(setup, state, ids, labels) == ["forward", "forward"]

    from _mutants import mutant

    from shardops_models.strategies import fsdp

    line = "                values, _ = lax.optimization_barrier((values, jnp.int32(uses)))"
    merged = mutant(fsdp, "no_barrier", line, "                pass")
    monkeypatch.setattr(fsdp.FsdpKind, "materialise", merged.FsdpKind.materialise)
    jax.clear_caches()
    setup = models.build("fsdp_sp", mesh, optimizer=optax.sgd(0.1), model=TIED_MQA)
    assert _table_gathers(setup, setup.init(jax.random.key(0)), ids, labels) == ["forward"]
    jax.clear_caches()


def test_misuse_of_padded_parameters_and_stacked_layers_is_a_clear_error():
    """ctx.array of a padded parameter, a stacked plan inside a stacked plan, a scanned layer
    that changes its input's shape, and params that are not the model's tree."""
    tiny = models.Llama(vocab_size=97, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                        d_ff=24, context=8)  # fmt: skip

    class Peeks(models.Llama):
        def _head(self, ctx):
            def head(p, x):
                ctx.array(p["out"]["w"])  # w[D, 97] stored as [D, 100] on model = 4
                return ctx.dense(p["out"], x)

            return head

    peek = Peeks(**{f: getattr(tiny, f) for f in ("vocab_size", "d_model", "num_layers",
                                                  "num_heads", "num_kv_heads", "d_ff", "context")})  # fmt: skip
    mesh = shardops.make_mesh({"model": 4})
    setup = models.build("tp", mesh, optimizer=optax.sgd(0.1), model=peek)
    ids = np.zeros((4, 8), np.int32)
    with pytest.raises(ValueError, match=r"ctx.array: \['head'\]\['w'\] is stored padded, "
                                         r"\(16, 100\) for the model's \(16, 97\)"):  # fmt: skip
        setup.loss_and_grads(setup.init(jax.random.key(0)).params, *setup.place_batch(ids, ids))

    class Grows(models.Llama):
        def _block(self, ctx, segment_ids):
            return lambda p, x: x[..., :8]  # not a residual stream

    grows = Grows(**{f: getattr(tiny, f) for f in ("vocab_size", "d_model", "num_layers",
                                                   "num_heads", "num_kv_heads", "d_ff", "context")})  # fmt: skip
    setup = models.build("ref", optimizer=optax.sgd(0.1), model=grows)
    with pytest.raises(ValueError, match=r"ctx.scan: each layer must return what it takes .* "
                                         r"the layer of \['blocks'\] returned"):  # fmt: skip
        setup.loss_and_grads(grows.init(jax.random.key(0)), ids, ids)

    nested = {**tiny.plan(), "blocks": models.stacked(models.stacked(REPLICATED_BLOCK))}
    # (here the inner layers' leaves differ in their next dim; where they did not, leaf_roles
    # refuses stacked(...) inside stacked(...) by name)
    with pytest.raises(ValueError, match=r"plan\['blocks'\]: stacked\(...\) leaves hold "
                                         r"different numbers of layers"):  # fmt: skip
        models.build("tp", mesh, optimizer=optax.sgd(0.1), model=tiny, plan=nested)

    setup = models.build("tp", mesh, optimizer=optax.sgd(0.1), model=tiny)
    params = tiny.init(jax.random.key(0))
    del params["head"]
    with pytest.raises(ValueError, match=r"params are not the model's tree: missing "
                                         r"\[\"\['head'\]\['w'\]\"\], unknown \[\]"):  # fmt: skip
        setup.shard(params)


REPLICATED_BLOCK = {"attn_norm": models.REPLICATED, "attn": models.REPLICATED,
                    "mlp_norm": models.REPLICATED, "mlp": models.REPLICATED}  # fmt: skip


def test_special_tokens_are_carried_not_compared_and_numpy_ids_are_ints():
    """``special_tokens`` is metadata for transformers' tools: a model with them equals and
    hashes as the one without (the same programs), a checkpoint does not record them, and
    numpy ids become Python ints (config.json is written from them)."""
    from shardops_models.training import _checkpoint_record

    tokens = models.SpecialTokens(bos=np.int64(1), eos=[np.int32(2), 3], pad=None)
    assert tokens == models.SpecialTokens(bos=1, eos=(2, 3))
    assert all(type(i) is int for i in (tokens.bos, *tokens.eos))
    with_tokens = dataclasses.replace(GQA, special_tokens=tokens)
    assert with_tokens == GQA and hash(with_tokens) == hash(GQA)
    assert "special_tokens" not in _checkpoint_record._config(with_tokens)
    with pytest.raises(ValueError, match="eos must be a token id"):
        models.SpecialTokens(eos=["2"])
