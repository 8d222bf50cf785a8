"""Context parallelism composed with every strategy: the GPT and the Llama (GQA; tied MQA with
packed documents) train 5 steps (one optimizer a strategy by default, both under
SHARDOPS_FULL=1) equal to their plain-jnp references, with the
sequence split over ``context`` and attention by all-gather, ring or Ulysses; the compiled
collectives equal the budget traced from the step, per pass; evaluation and logits equal the
reference; bad configurations are clear errors."""

import jax
import numpy as np
import optax
import pytest
from _cover import FULL
from _gpt_checks import BATCH, CP_MESHES, GPT, SEQ, check_lm_trajectory, gpt_batches
from _lm_budgets import EXPECTED
from _messages import refused
from test_llama import CLIP, MODELS, SGD_LR

import shardops
import shardops_models as models
from shardops.layers import CONTEXT_METHODS
from shardops_models.networks._lm import PAD_LABEL
from shardops_models.strategies.layout import strategy_named, with_context

LMS = {"gpt": GPT, **MODELS}
OPTIMIZERS = ("sgd", "adam")


def _meshes(strategy: str) -> list[str]:
    """The context meshes with the strategy's axes, those with the fewest other axes first."""
    axes = set(with_context(strategy, "ring").axes)
    fits = [m for m, shape in CP_MESHES.items() if axes <= set(shape)]
    return sorted(fits, key=lambda m: len(set(CP_MESHES[m]) - axes))


def _valid(model: str, method: str, mesh: str) -> bool:
    """Ulysses splits the heads over context: the KV heads each device sends must divide."""
    if method != "ulysses":
        return True
    shape = CP_MESHES[mesh]
    lm = LMS[model]
    kv = getattr(lm, "num_kv_heads", None) or lm.num_heads
    return kv % (shape.get("model", 1) * shape["context"]) == 0


# (model, method) pairs, each model with each method in turn (a Latin square's rows).
PAIRS = [(model, CONTEXT_METHODS[(i + k) % 3]) for k in range(3) for i, model in enumerate(LMS)]


def _cases():
    """Every strategy (``ref`` too: context parallelism alone) with one optimizer, the two in
    turn, the (model, method) pairs taken in turn on a mesh with the strategy's axes (the fewest
    others first, in turn); under SHARDOPS_FULL=1 every strategy × method × model × optimizer.
    (Every strategy trains with each optimizer without a context axis, in tests/networks.)"""
    out, turn = [], 0
    hand = {s.split("+")[0]: ("gpt", s, m, o) for lm, s, m, o, *_ in EXPECTED
            if lm == GPT.name and "+" in s}  # fmt: skip
    for i, name in enumerate(sorted(models.STRATEGIES)):
        meshes = _meshes(name)
        if name in hand and not FULL:  # a hand-written budget's case (tests/_lm_budgets.py)
            out.append(hand[name])
            continue
        for j, opt in enumerate(OPTIMIZERS):
            if not FULL and j != i % 2:  # CI time: one optimizer a strategy, in turn
                continue
            for pair in PAIRS if FULL else [None]:
                for _ in range(len(PAIRS)):  # the next pair some mesh of the strategy takes
                    model, method = pair or PAIRS[turn % len(PAIRS)]
                    order = meshes[j % len(meshes) :] + meshes[: j % len(meshes)]
                    mesh = next((m for m in order if _valid(model, method, m)), None)
                    turn += pair is None
                    if mesh is not None or pair is not None:
                        break
                if mesh is not None:
                    out.append((model, f"{name}+{method}", mesh, opt))
    # Context 8 alone (S = 16: chunks of one token): packed documents round the ring, and
    # Ulysses with one head per device.
    return [*out, ("tied_mqa", "ref+ring", "context8", "sgd"),
            ("gpt", "ref+ulysses", "context8", "adam")]  # fmt: skip


CASES = _cases()


def test_cases_cover_every_strategy_method_model_and_optimizer():
    strategies = {s.split("+")[0] for _, s, _, _ in CASES}
    assert strategies == set(models.STRATEGIES)
    methods = {(s.split("+")[1], o) for _, s, _, o in CASES}
    assert methods == {(m, o) for m in CONTEXT_METHODS for o in OPTIMIZERS}
    assert {m for m, _, _, _ in CASES} == set(LMS)
    assert {CP_MESHES[m]["context"] for _, _, m, _ in CASES} >= {2, 4, 8}
    assert any(len(CP_MESHES[m]) >= 3 for _, _, m, _ in CASES)


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_trajectory_and_budget(case):
    model, strategy, mesh, opt = case
    options = {} if model == "gpt" else {"clip": CLIP, "sgd_lr": SGD_LR}
    check_lm_trajectory(LMS[model], strategy, mesh, opt, budget=True, **options)


@pytest.mark.parametrize(
    ("model", "strategy", "mesh"),
    [("gqa", "2d+ring", "2x2x2c"),
     *[("tied_mqa", "ref+allgather", "2x4c"), ("gpt", "sp+ulysses", "c2x4")] * FULL],
)  # fmt: skip
def test_trajectory_with_the_einsum_reference_attention(model, strategy, mesh):
    """Every other trajectory runs the default attention (the blocked online softmax off TPU);
    the S×S einsum, each method's reference, trains the same."""
    options = {} if model == "gpt" else {"clip": CLIP, "sgd_lr": SGD_LR}
    check_lm_trajectory(LMS[model], strategy, mesh, "sgd", attention="einsum", **options)


@pytest.mark.parametrize(
    ("strategy", "mesh"),
    [("2d+ring", "2x2x2c"), ("fsdp_sp+allgather", "2x2x2c"), ("sp+ulysses", "c2x4")],
)
def test_budget_equals_the_compiled_step_per_pass(strategy, mesh):
    """The budget traced from the step, per (kind, axes, pass), equals the compiled step's."""
    setup = models.build(strategy, shardops.make_mesh(CP_MESHES[mesh]), model=GPT,
                         optimizer=optax.adam(1e-3))  # fmt: skip
    state = setup.init(jax.random.key(0))
    ids, labels = (a[0] for a in gpt_batches())
    compiled = shardops.inspect.ledger(setup.mesh, setup.train_step, state,
                                       *setup.place_batch(ids, labels))  # fmt: skip
    assert compiled.by_pass() == setup.budget(BATCH, SEQ).by_pass()
    context = {k: v for p in compiled.by_pass().values() for k, v in p.items()
               if "context" in k[1]}  # fmt: skip
    assert context, "no collective over the context axis"


@pytest.mark.parametrize("method", CONTEXT_METHODS)
def test_evaluate_and_logits_equal_the_reference_with_padding(method):
    """``evaluate`` sums loss and hits over every sequence shard, padding counting nowhere;
    ``logits`` come back whole and in the natural token order."""
    setup = models.build(f"fsdp_tp+{method}", shardops.make_mesh(CP_MESHES["2x2x2c"]),
                         optimizer=optax.sgd(0.1), model=GPT)  # fmt: skip
    params = GPT.init(jax.random.key(2))
    ids, labels = (np.array(a[0]) for a in gpt_batches(2))
    labels[-4:, 5:] = PAD_LABEL  # padded positions on every context shard
    real = labels != PAD_LABEL
    logits = np.asarray(GPT.reference_logits(params, ids))  # [B, S, V]
    log_probs = jax.nn.log_softmax(logits)
    picked = np.take_along_axis(log_probs, np.where(real, labels, 0)[..., None], -1)[..., 0]
    state = setup.shard(params)
    metrics = setup.evaluate(state.params, *setup.place_batch(ids, labels))
    assert int(metrics.count) == real.sum()
    assert int(metrics.correct) == ((logits.argmax(-1) == labels) & real).sum()
    np.testing.assert_allclose(float(metrics.loss_sum), -picked[real].sum(), rtol=1e-5)
    got = np.asarray(setup.logits(state.params, setup.place_batch(ids)))
    assert got.shape == (BATCH, SEQ, GPT.vocab_size)
    np.testing.assert_allclose(got, logits, atol=2e-6)


# --- the layout and its errors ------------------------------------------------------------------


def test_strategy_names_and_table():
    s = strategy_named("hsdp_sp+ulysses")
    assert (s.dp, s.fsdp, s.tp, s.sp, s.cp, s.cp_method) == (
        ("replica",), ("data",), "model", True, "context", "ulysses")  # fmt: skip
    assert s.axes == ("replica", "data", "context", "model")
    assert s.reduce_axes == ("replica", "data", "context")
    assert "cp     context" in s.table() and s.table().rstrip().endswith("sequence between layers")
    assert with_context("ref", "allgather").name == "ref+allgather"
    assert strategy_named(with_context("fsdp_tp", "ulysses").name) == with_context(
        "fsdp_tp", "ulysses"
    )
    with refused(ValueError, argument="unknown strategy", got="'2d+rings'",
                 expected="one of ('allgather', 'ring', 'ulysses')", fix="e.g. '2d+ring'"):  # fmt: skip
        strategy_named("2d+rings")
    with refused(ValueError, argument="Strategy 'x'", got="mesh axis 'model' carries both tp and cp",
                 expected="each axis carries one kind of parallelism",
                 fix="give cp an axis of its own"):  # fmt: skip
        models.Strategy("x", tp="model", cp="model")
    with refused(ValueError, argument="Strategy 'x': cp_method", got="got 'striped'",
                 expected="one of ('allgather', 'ring', 'ulysses')", fix="e.g. cp_method='ring'"):  # fmt: skip
        models.Strategy("x", cp="context", cp_method="striped")
    with refused(ValueError, argument="Strategy 'x': cp_method='ulysses'", got="without a cp axis",
                 expected="; name it", fix="e.g. cp='context'"):  # fmt: skip
        models.Strategy("x", tp="model", cp_method="ulysses")
    with refused(ValueError, argument="strategy '2d+ring'", got="already splits the sequence over "
                 "'context'", expected="the strategy without it", fix="with_context('2d', 'ring')"):  # fmt: skip
        with_context("2d+ring")
    mine = models.Strategy("mine", dp=("data",), cp="context")  # no preset names it
    with refused(ValueError, argument="strategy 'mine'", got="already splits the sequence",
                 expected="the strategy without it",
                 fix="with_context(dataclasses.replace(strategy, cp=None), 'ring')"):  # fmt: skip
        with_context(mine)


def test_errors_name_the_dim_the_axis_and_both_sizes():
    mesh = shardops.make_mesh(CP_MESHES["c4x2"])
    setup = models.build("sp+ring", mesh, model=GPT, optimizer=optax.sgd(0.1))
    state = setup.init(jax.random.key(0))
    ids = np.zeros((BATCH, 12), np.int32)  # 12 % (2 × 4) ≠ 0
    with pytest.raises(ValueError, match=r"x dim 1 \(sequence\) = 12 is not divisible by 2 × "
                       r"mesh axis 'context' \(size 4\) = 8: .* Use a sequence length that is a "
                       r"multiple of 8 \(e\.g\. 16\), or a smaller context axis\."):  # fmt: skip
        setup.train_step(state, ids, ids)
    mlp = "no sequence dimension"
    with pytest.raises(ValueError, match=mlp):
        models.build("dp+ring", shardops.make_mesh(CP_MESHES["2x4c"]), optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"key/value heads 2\), do not divide by 4"):
        models.build("fsdp+ulysses", shardops.make_mesh(CP_MESHES["2x4c"]), model=MODELS["gqa"],
                     optimizer=optax.sgd(0.1))  # fmt: skip
    with pytest.raises(ValueError, match=r"missing \('context',\)"):
        models.build("2d+ring", shardops.make_mesh({"data": 4, "model": 2}), model=GPT,
                     optimizer=optax.sgd(0.1))  # fmt: skip


def test_an_empty_or_short_sequence_is_refused_with_a_length_that_fits():
    """A batch of 0 tokens (it divides by anything) or fewer than 2 × context is refused by
    the strategy's batch check, before anything is traced, with a positive length that fits;
    ``ctx.local_tokens`` on a user's own tokens alike."""
    from jax.sharding import PartitionSpec as P

    mesh = shardops.make_mesh(CP_MESHES["c4x2"])
    setup = models.build("sp+ring", mesh, model=GPT, optimizer=optax.sgd(0.1))
    advice = (
        r"Use a sequence length that is a multiple of 8 \(e\.g\. 8\), or a smaller context axis\."
    )
    with pytest.raises(ValueError, match=r"the batch: x dim 1 \(sequence\) = 0 is empty; it needs "
                       r"a positive multiple of 2 × mesh axis 'context' \(size 4\) = 8: .* " + advice):  # fmt: skip
        setup.check_batch(np.zeros((BATCH, 0), np.int32))
    with pytest.raises(ValueError, match=r"x dim 1 \(sequence\) = 4 is not divisible by 2 × mesh "
                       r"axis 'context' \(size 4\) = 8: .* " + advice):  # fmt: skip
        setup.check_batch(np.zeros((BATCH, 4), np.int32))
    # sp splits each device's block over 'model' too: 12 tokens fill 2 × 2 chunks, not 8
    sp = models.build(
        "sp+ring", shardops.make_mesh(CP_MESHES["c2x4"]), model=GPT, optimizer=optax.sgd(0.1)
    )
    with pytest.raises(ValueError, match=r"the batch: x dim 1 \(sequence\) = 12 is not divisible "
                       r"by 2 × mesh axis 'context' \(size 2\) = 4 and, per device, by mesh axis "
                       r"'model' \(size 4\): a multiple of 8: .* Use a sequence length that is a "
                       r"multiple of 8 \(e\.g\. 16\), or a smaller context axis\."):  # fmt: skip
        sp.check_batch(np.zeros((BATCH, 12), np.int32))
    ctx = models.Parallel(with_context("ref", "ring"))
    with pytest.raises(ValueError, match=r"ctx.local_tokens: tokens dim 1 \(sequence\) = 0 is "
                       r"empty; .*'context' \(size 4\) = 8: .* " + advice):  # fmt: skip
        jax.shard_map(ctx.local_tokens, mesh=shardops.make_mesh({"context": 4}), in_specs=P(),
                      out_specs=P(None, "context"))(np.zeros((2, 0), np.int32))  # fmt: skip


@pytest.mark.parametrize("method", CONTEXT_METHODS)
def test_bf16_policies_flow_and_reduce_in_float32(method):
    """Under BFLOAT16 and MIXED_BFLOAT16 the step of ``fsdp_sp+<method>`` follows the policy
    (``dtype_flow_violations`` finds nothing) and asks for every reduction in float32."""
    from _model_checks import reductions_in_16_bits

    mesh = shardops.make_mesh(CP_MESHES["2x2x2c"])
    ids, labels = (a[0] for a in gpt_batches())
    for precision in (shardops.BFLOAT16, shardops.MIXED_BFLOAT16):
        setup = models.build(f"fsdp_sp+{method}", mesh, model=GPT, optimizer=optax.adam(1e-3),
                             precision=precision)  # fmt: skip
        state = setup.init(jax.random.key(0))
        args = (state, *setup.place_batch(ids, labels))
        problems = shardops.testing.dtype_flow_violations(setup.step, *args, policy=precision)
        assert not problems, "\n".join(problems)
        asked = shardops.inspect.lowered_collectives(setup.train_step.lower(*args).as_text(), mesh)
        assert not reductions_in_16_bits([c for c in asked if c.bytes])


def test_a_users_layer_reads_its_tokens_and_gathers_them_in_order():
    """``ctx.local_tokens`` gives this device's block of the layout; ``ctx.gather(...,
    kind="context")`` puts every token back in order (and its gradient goes to the block)."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    ctx = models.Parallel(with_context("ref", "ring"))
    mesh = shardops.make_mesh({"context": 4})
    tokens = jnp.arange(32, dtype=jnp.float32).reshape(2, 16)

    def body(tokens):
        local = ctx.local_tokens(tokens)  # [2, 4]: chunks i and 7 − i of 8
        return local, ctx.gather(local, axis=1, kind="context")

    local, whole = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P(None, "context"),
                                                                          P()))(tokens)  # fmt: skip
    order = shardops.layers.balanced_order(16, 4)
    np.testing.assert_array_equal(np.asarray(local), np.asarray(tokens)[:, order])
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(tokens))
    assert ctx.axis_name("context") == "context" and ctx.axis_name("data") is None


def test_ulysses_counts_the_heads_each_device_holds():
    """4 heads on context = 4 × model = 2: split by head over model, 2 per device do not divide
    by 4 (refused at build); with attention replicated over model (a plan's choice) all 4 do."""
    gpt4 = models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=1, context=16, d_ff=64)
    mesh = shardops.make_mesh(CP_MESHES["c4x2"])
    with pytest.raises(ValueError, match=r"query heads on each device.*\(query heads 2,"):
        models.build("tp+ulysses", mesh, model=gpt4, optimizer=optax.sgd(0.1))
    plan = gpt4.plan()
    for block in plan["blocks"]:
        block["attn"] = models.REPLICATED
    setup = models.build("tp+ulysses", mesh, model=gpt4, plan=plan, optimizer=optax.sgd(0.1))
    params = gpt4.init(jax.random.key(0))
    ids, labels = (a[0] for a in gpt_batches())
    loss, _ = setup.loss_and_grads(setup.shard(params).params, *setup.place_batch(ids, labels))
    assert float(loss) == pytest.approx(float(gpt4.reference_loss(params, ids, labels)), rel=1e-6)
