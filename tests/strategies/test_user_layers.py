"""A layer of the user's own inside ``models.build``: a hand-written gated MLP with its own
``psum``, with a bias sliced by ``axis_index``, and with its hidden units gathered
(``ctx.gather``). Nobody wrote cost code for them, and the budget
(read from the traced step) equals the compiled step per kind, axes and pass, equals the bytes
worked out by hand, and the training equals the unsharded model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _messages import refused
from _mutants import mutant

import shardops
import shardops_models as models
from shardops_models.strategies import _axes, parallel

V, D, F, S = 16, 8, 16, 4  # vocabulary, width, gated width, sequence
BATCH = 8


class GatedLM:
    """ids[B, S] → table[V, D] → x + down(silu(x·gate) · (x·up) + bias) → head → logits[B, S, V].

    The gated MLP is written by hand: ``gate``, ``up`` are column-parallel blocks
    ``w[D, F_model]``, ``down`` a row-parallel block ``w[F_model, D]`` whose partial sums the
    layer reduces itself (``ctx.psum``). Variant ``"axis_index"``: a bias ``b[F]`` stays
    replicated and each device adds its block of ``F / ctx.axis_size()``, cut at
    ``ctx.axis_index() · F/p``. Variant ``"gather"``: ``down`` is replicated and the layer
    gathers ``h[b, S, F_model]`` (``ctx.gather``) before it."""

    name, sequence, context = "gated lm", True, S

    def __init__(self, variant: str = "psum"):
        self.variant = variant
        self.sliced_bias = variant == "axis_index"

    def init(self, key, dtype=None):
        ks = jax.random.split(key, 6)
        dtype = dtype or jnp.float32

        def normal(k, shape):
            return (0.3 * jax.random.normal(k, shape)).astype(dtype)

        params = {
            "embed": {"table": normal(ks[0], (V, D))},
            "mlp": {"gate": normal(ks[1], (D, F)), "up": normal(ks[2], (D, F)),
                    "down": normal(ks[3], (F, D))},
            "head": {"w": normal(ks[4], (D, V))},
        }  # fmt: skip
        if self.sliced_bias:
            params["mlp"]["bias"] = normal(ks[5], (F,))
        return params

    def plan(self):
        down = models.REPLICATED if self.variant == "gather" else models.ROW
        mlp = {"gate": models.COLUMN, "up": models.COLUMN, "down": down}
        if self.sliced_bias:
            mlp["bias"] = models.REPLICATED
        return {"embed": models.REPLICATED, "mlp": mlp, "head": models.REPLICATED}

    def apply(self, ctx, params, ids):
        def gated_mlp(p, x):  # x[b, S, D], replicated over model
            gate, up, down = (ctx.array(p[k]) for k in ("gate", "up", "down"))
            h = jax.nn.silu(x @ gate) * (x @ up)  # h[b, S, F_model]
            if self.sliced_bias:
                bias = ctx.array(p["bias"])  # b[F], whole on every device
                f_local = bias.shape[0] // ctx.axis_size()  # F/p
                h = h + jax.lax.dynamic_slice_in_dim(bias, ctx.axis_index() * f_local, f_local)
            if self.variant == "gather":
                return x + ctx.gather(h) @ down  # h[b, S, F] · down[F, D], replicated
            return x + ctx.psum(h @ down)  # y{U_model} → y[b, S, D]

        x = ctx.unit(ctx.embed, params["embed"], ids)  # x[b, S, D]
        x = ctx.unit(gated_mlp, params["mlp"], x)
        return ctx.unit(ctx.dense, params["head"], x), {}  # logits[b, S, V]

    def loss_sum(self, ctx, params, logits, labels):
        return ctx.cross_entropy(logits, labels, split=False).sum()

    def check_batch(self, ids, labels=None):
        pass


def reference_loss(model, params, ids, labels):
    x = params["embed"]["table"][ids]
    p = params["mlp"]
    h = jax.nn.silu(x @ p["gate"]) * (x @ p["up"])
    if model.sliced_bias:
        h = h + p["bias"]
    x = x + h @ p["down"]
    logits = x @ params["head"]["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum() / labels.size


def batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, (BATCH, S + 1)).astype(np.int32)
    return ids[:, :-1], ids[:, 1:]


CASES = [("2d", {"data": 4, "model": 2}), ("tp", {"model": 8}), ("fsdp_tp", {"data": 2, "model": 4}),
         ("dp", {"data": 8})]  # fmt: skip


VARIANTS = ["psum", "axis_index", "gather"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("strategy", "shape"), CASES, ids=[c[0] for c in CASES])
def test_the_budget_of_a_hand_written_layer_is_its_compiled_step(strategy, shape, variant):
    model = GatedLM(variant)
    mesh = shardops.make_mesh(shape)
    setup = models.build(strategy, mesh, model=model, optimizer=optax.sgd(0.5))
    ids, labels = batch()
    state = setup.shard(model.init(jax.random.key(0)))
    compiled = shardops.inspect.ledger(
        mesh, setup.train_step, state, *setup.place_batch(ids, labels)
    )
    budget = setup.budget(BATCH, S)
    assert budget.by_pass() == compiled.by_pass()
    assert budget.totals() == compiled.totals()
    check_one_step(setup, model)


def check_one_step(setup, model):
    """One SGD step of ``setup`` equals the unsharded model's: the loss and every parameter
    (each of which moves)."""
    ids, labels = batch()
    params = model.init(jax.random.key(0))
    state = setup.shard(params)
    xb, yb = setup.place_batch(ids, labels)
    loss, grads = jax.value_and_grad(reference_loss, argnums=1)(model, params, ids, labels)
    new_state, got = setup.train_step(state, xb, yb)
    np.testing.assert_allclose(got, loss, rtol=2e-6)
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    got_params = setup.gather(new_state.params)
    for (path, want), have, before in zip(
        jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(got_params),
        jax.tree.leaves(params), strict=True,
    ):  # fmt: skip
        name = jax.tree_util.keystr(path)
        assert np.abs(np.asarray(want) - np.asarray(before)).max() > 1e-3, f"{name} did not move"
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-5, atol=1e-6,
                                   err_msg=name)  # fmt: skip


def test_the_budget_of_the_hand_written_layer_has_the_bytes_worked_out_by_hand():
    """2d on data=4 × model=2: each device holds b = 2 rows of S = 4 tokens, x[2, 4, 8] f32 =
    256 bytes; gate, up hold w[8, 8] (256 bytes) and down w[8, 8]; the bias b[16] is 64 bytes.

    model: the layer's own psum of y{U_model} (forward, 256); in the backward the two column
    matmuls' dx{U_model} (x meets varying weights twice: 2 × 256), and with the sliced bias
    its gradient, whole on every device but nonzero only in each device's block (64).
    data: dp all-reduces every gradient once: table 512, gate + up + down 3 × 256, head 512
    (bias 64), and the forward loss, 4 bytes."""
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    for variant, bias in (("psum", 0), ("axis_index", 64)):
        setup = models.build("2d", mesh, model=GatedLM(variant), optimizer=optax.sgd(0.5))
        assert setup.budget(BATCH, S).by_pass() == {
            "forward": {("all-reduce", ("model",)): 256, ("all-reduce", ("data",)): 4},
            "backward": {
                ("all-reduce", ("model",)): 2 * 256 + bias,
                ("all-reduce", ("data",)): 512 + 3 * 256 + 512 + bias,
            },
            "optimizer": {},
        }


# --- mutants of the ctx pieces a layer of one's own uses (models/strategies/_axes.py)

CTX_MUTANTS = {
    # every device told it is alone on the model axis: its bias block is the whole bias
    "axis_size_one": (
        "axis_size",
        "        return lax.axis_size(axis) if axis else 1\n",
        "        return 1\n",
        "axis_index",
    ),
    # every device takes the first block of the bias
    "axis_index_zero": (
        "axis_index",
        "        return lax.axis_index(axis) if axis else jnp.int32(0)\n",
        "        return jnp.int32(0)\n",
        "axis_index",
    ),
    # the hidden units gathered along the sequence instead of the features, then reshaped to
    # the right shape: h[b, S·p, F/p] read as h[b, S, F], a transposed layout
    "gather_along_the_sequence": (
        "gather",
        "            y = shardops.comm.gather_from_region(y_block, mesh_axis, axis)\n",
        "            y = shardops.comm.gather_from_region(y_block, mesh_axis, 1).reshape("
        "*y_block.shape[:-1], -1)\n",
        "gather",
    ),
    # the partial sums left unreduced
    "psum_dropped": (
        "psum",
        "            return shardops.comm.reduce_from_region(y_partial, axis)\n",
        "            return y_partial\n",
        "psum",
    ),
}


def check_mutant(monkeypatch, name: str, replace: bool) -> None:
    method, line, new, variant = CTX_MUTANTS[name]
    bad = mutant(_axes, name, line, new if replace else line)
    monkeypatch.setattr(parallel.Parallel, method, getattr(bad.Axes, method))
    model = GatedLM(variant)
    setup = models.build("2d", shardops.make_mesh({"data": 4, "model": 2}), model=model,
                         optimizer=optax.sgd(0.5))  # fmt: skip
    check_one_step(setup, model)


@pytest.mark.parametrize("name", CTX_MUTANTS)
def test_unmutated_ctx_copy_passes(monkeypatch, name):
    check_mutant(monkeypatch, name, replace=False)


@pytest.mark.parametrize("name", CTX_MUTANTS)
def test_ctx_mutant_is_caught(monkeypatch, name):
    with pytest.raises((AssertionError, ValueError, TypeError)) as caught:
        check_mutant(monkeypatch, name, replace=True)
    if not isinstance(caught.value, AssertionError):  # a shape or type verdict must name it
        assert (
            "shape" in str(caught.value)
            or "vma" in str(caught.value)
            or "out_specs" in str(caught.value)
        ), caught.value


class KeyedLM:
    """ids → table → rms_norm(norm) → dense(head): the parameter dicts are the test's to name."""

    name, sequence, context = "keyed lm", True, S

    def __init__(self, norm: dict, head: dict):
        self.norm, self.head = norm, head

    def init(self, key, dtype=None):
        k1, k2 = jax.random.split(key)
        return {"embed": {"table": jax.random.normal(k1, (V, D))}, "norm": dict(self.norm),
                "head": {k: jax.random.normal(k2, s) for k, s in self.head.items()}}  # fmt: skip

    def plan(self):
        return {"embed": models.REPLICATED, "norm": models.REPLICATED, "head": models.COLUMN}

    def apply(self, ctx, params, ids):
        x = ctx.unit(ctx.embed, params["embed"], ids)
        x = ctx.unit(ctx.rms_norm, params["norm"], x)
        return ctx.unit(ctx.dense, params["head"], x), {}

    def loss_sum(self, ctx, params, logits, labels):
        return ctx.cross_entropy(logits, labels, split=ctx.is_split(params["head"])).sum()

    def check_batch(self, ids, labels=None):
        pass


@pytest.mark.parametrize(
    ("norm", "head", "message"),
    [
        ({"weight": jnp.full(D, 2.0)}, {"w": (D, V)},
         r"ctx.rms_norm at \['norm'\]: expects parameter keys \[\], optionally \['scale'\]; got "
         r"\['weight'\] \(unknown \['weight'\]\). Hugging Face's norm 'weight' is 'scale' here"),
        ({}, {"kernel": (D, V)},
         r"ctx.dense at \['head'\]: expects parameter keys \['w'\], optionally \['b'\]; got "
         r"\['kernel'\] \(missing \['w'\], unknown \['kernel'\]\). Flax's 'kernel' is 'w' here"),
        ({}, {"w": (D, V), "b": (V,), "gain": (V,)}, r"ctx.dense at \['head'\].*unknown \['gain'\]"),
    ],
    ids=["hf-norm-weight", "flax-kernel", "extra-key"],
)  # fmt: skip
@pytest.mark.parametrize("strategy", ["ref", "2d"])
def test_a_layer_refuses_parameter_keys_it_does_not_use(norm, head, message, strategy):
    mesh = None if strategy == "ref" else shardops.make_mesh({"data": 4, "model": 2})
    setup = models.build(strategy, mesh, model=KeyedLM(norm, head), optimizer=optax.sgd(0.1))
    params = setup.shard(KeyedLM(norm, head).init(jax.random.key(0))).params
    with pytest.raises(ValueError, match=message):
        setup.loss_and_grads(params, *setup.place_batch(*batch()))


def test_the_norm_scale_is_used_and_trained():
    """The documented key: the scale multiplies the output and gets its gradient."""
    model = KeyedLM({"scale": jnp.full(D, 2.0)}, {"w": (D, V)})
    setup = models.build("2d", shardops.make_mesh({"data": 4, "model": 2}), model=model,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    params = model.init(jax.random.key(0))
    _, grads = setup.loss_and_grads(setup.shard(params).params, *setup.place_batch(*batch()))

    def reference(params, ids, labels):
        x = params["embed"]["table"][ids]
        x = (
            x
            * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
            * params["norm"]["scale"]
        )
        logits = x @ params["head"]["w"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum() / labels.size

    expected = jax.grad(reference)(params, *batch())
    got = setup.gather(grads)
    assert float(jnp.abs(expected["norm"]["scale"]).max()) > 1e-3
    np.testing.assert_allclose(
        got["norm"]["scale"], expected["norm"]["scale"], rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(got["head"]["w"], expected["head"]["w"], rtol=1e-5, atol=1e-7)


class HeadedLM(KeyedLM):
    def output_layer(self, params):
        return params["head"]


def test_setup_logits_needs_to_know_the_output_layer_of_split_logits():
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    ids, _ = batch()
    args = ({"scale": jnp.ones(D)}, {"w": (D, V)})
    params = KeyedLM(*args).init(jax.random.key(0))
    plain = models.build("2d", mesh, model=KeyedLM(*args), optimizer=optax.sgd(0.1))
    with refused(ValueError, argument="setup.logits: KeyedLM's logits",
                 got="(2, 4, 8) (per device) vary over the tp axis 'model'",
                 expected="the model has no output_layer(params) saying which layer makes them",
                 fix="define it (return the head's parameter dict, as models.Gpt does)"):  # fmt: skip
        plain.logits(plain.shard(params).params, plain.place_batch(ids))
    headed = models.build("2d", mesh, model=HeadedLM(*args), optimizer=optax.sgd(0.1))
    ref = models.build("ref", model=HeadedLM(*args), optimizer=optax.sgd(0.1))
    got = headed.logits(headed.shard(params).params, headed.place_batch(ids))
    expected = ref.logits(ref.shard(params).params, ref.place_batch(ids))
    assert got.shape == (BATCH, S, V)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# --- token ids and labels outside the vocabulary, refused when a batch is placed


class PaddedHeadLM(KeyedLM):
    """Its own padding: a head of ``V + 4`` columns, the loss told the vocabulary is ``V``."""

    def __init__(self):
        super().__init__({}, {"w": (D, V + 4)})

    def loss_sum(self, ctx, params, logits, labels):
        split = ctx.is_split(params["head"])
        return ctx.cross_entropy(logits, labels, split=split, vocab_size=V).sum()


class DeclaredLM(KeyedLM):
    """Looks its ids up by hand (``jnp.take``, no ``ctx.embed``): the library cannot see the
    vocabulary, so the model declares it (``vocab_size``)."""

    vocab_size = V

    def __init__(self):
        super().__init__({}, {"w": (D, V)})

    def apply(self, ctx, params, ids):
        x = ctx.unit(lambda p, i: jnp.take(ctx.array(p["table"]), i, axis=0), params["embed"], ids)
        return ctx.unit(ctx.dense, params["head"], x), {}


EMBED = "the rows of params\\['embed'\\]\\['table'\\], the table ctx.embed reads"
TOKEN_CASES = [  # (model, array, bad value, the vocabulary's source, its size, how to grow it)
    (GatedLM, "x", V, EMBED, V, r"params\['embed'\]\['table'\] of 17 rows"),
    (GatedLM, "y", V, "the logits' columns that ctx.cross_entropy reads", V, "logits of 17 columns"),
    (GatedLM, "x", -1, EMBED, V, None),
    (PaddedHeadLM, "y", V, f"the vocab_size={V} the model passes to ctx.cross_entropy", V,
     "logits of 17 columns"),
    (DeclaredLM, "x", V, "DeclaredLM.vocab_size", V, "vocab_size=17"),
    (DeclaredLM, "y", -1, "DeclaredLM.vocab_size", V, None),
]  # fmt: skip


def check_tokens_refused(model_cls, array, value, source, size, grow) -> None:
    """``place_batch`` refuses the batch with ``value`` at ``array[1, 2]``, naming the array,
    the value, where it is, the vocabulary, its source and the fix; the last id is accepted."""
    setup = models.build("2d", shardops.make_mesh({"data": 4, "model": 2}), model=model_cls(),
                         optimizer=optax.sgd(0.1))  # fmt: skip
    arrays = dict(zip(("x", "y"), batch(), strict=True))
    arrays[array] = arrays[array].copy()
    arrays[array][1, 2] = value
    fix = rf"map every token into \[0, {size}\)" + (
        rf", or give the model a vocabulary of at least {value + 1} tokens \({grow}\)$"
        if grow else "$")  # fmt: skip
    with pytest.raises(ValueError, match=rf"^{array} hold 1 token\(s\) outside \[0, {size}\) "
                       rf"\({source}\), e\.g\. {value} at {array}\[1, 2\]; min -?\d+, max \d+\. "
                       rf"Fix the data: {fix}"):  # fmt: skip
        setup.place_batch(arrays["x"], arrays["y"])
    arrays[array][1, 2] = size - 1  # the last token of the vocabulary is one
    setup.place_batch(arrays["x"], arrays["y"])


@pytest.mark.parametrize("case", TOKEN_CASES, ids=lambda c: f"{c[0].__name__}-{c[1]}{c[2]}")
def test_tokens_outside_the_vocabulary_of_a_model_of_ones_own_are_refused(case):
    check_tokens_refused(*case)


def test_the_vocabulary_is_found_once_per_setup_and_only_for_concrete_tokens():
    """A float batch (the MLP's) and a traced one are not read; the model's forward is traced
    for its vocabulary once per batch shape, by the first concrete integer batch of it."""
    model = GatedLM()
    setup = models.build("2d", shardops.make_mesh({"data": 4, "model": 2}), model=model,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    ids, labels = batch()
    setup.budget(BATCH, S)  # abstract arrays: nothing to read
    assert not [k for k in setup._traces if k[0] == "vocabularies"]
    setup.place_batch(ids, labels)
    setup.place_batch(ids, labels)
    found = [k for k in setup._traces if k[0] == "vocabularies"]
    assert found == [("vocabularies", (ids.shape, ids.dtype), (labels.shape, labels.dtype))]
    setup.place_batch(ids[:, : S // 2], labels[:, : S // 2])  # another shape: traced again
    assert len([k for k in setup._traces if k[0] == "vocabularies"]) == 2


# Each mutant lets a batch outside the vocabulary through (or refuses the last id).
VOCAB_MUTANTS = {
    # off by one: the id equal to the vocabulary size passes
    "vocabulary_off_by_one": (
        "lm",
        "        bad = ((a < 0) | (a >= vocab_size)) & ~np.isin(a, allowed)\n",
        "        bad = ((a < 0) | (a > vocab_size)) & ~np.isin(a, allowed)\n",
    ),
    # the check skipped when a batch is placed
    "vocabulary_check_skipped": (
        "train",
        "            _check_tokens(self._traces[key], x=x, y=y)\n",
        "            pass\n",
    ),
    # the model's own vocab_size given to the loss ignored: the padded head's width instead
    "loss_vocab_size_ignored": (
        "train",
        '        self._note(labels, vocab_size or logits.shape[-1], source, "logits of {n} columns")\n',
        '        self._note(labels, logits.shape[-1], source, "logits of {n} columns")\n',
    ),
}


def check_vocab_mutant(monkeypatch, name: str, replace: bool) -> None:
    from _mutants import training

    from shardops_models.networks import _lm
    from shardops_models.training import _setup, _tokens

    where, line, new = VOCAB_MUTANTS[name]
    if where == "lm":
        bad = mutant(_lm, name, line, new if replace else line)
        monkeypatch.setattr(_tokens, "check_token_range", bad.check_token_range)
    else:  # the Setup's checks from copies of models/training's modules, one line replaced
        bad = training(name, line, new if replace else line)
        monkeypatch.setattr(_setup.Setup, "check_batch", bad.Setup.check_batch)
        monkeypatch.setattr(_setup.Setup, "_check_token_range", bad.Setup._check_token_range)
    for case in TOKEN_CASES:
        check_tokens_refused(*case)


@pytest.mark.parametrize("name", VOCAB_MUTANTS)
def test_unmutated_vocabulary_check_copy_passes(monkeypatch, name):
    check_vocab_mutant(monkeypatch, name, replace=False)


@pytest.mark.parametrize("name", VOCAB_MUTANTS)
def test_vocabulary_check_mutant_is_caught(monkeypatch, name):
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check_vocab_mutant(monkeypatch, name, replace=True)


# --- ctx.stage, renamed ctx.unit ("stage" names a pipeline stage)


def test_ctx_stage_is_refused_with_its_new_name():
    """A forward written against the old ``ctx.stage`` fails at once, naming ``ctx.unit``,
    rather than running (an alias would leave two words for one meaning)."""
    ctx = models.Parallel(models.STRATEGIES["ref"])
    x = jnp.zeros((2, D))
    with refused(AttributeError, argument="ctx.stage", got="stage names a pipeline stage",
                 expected="ctx.unit: an FSDP and remat unit", fix="rename the call"):  # fmt: skip
        ctx.stage(ctx.dense, {}, x)
