"""The divergence locator (``shardops.inspect.compare``, ``shardops.inspect.tap``, ``shardops_models.training.locate``).

Clean models are within the bound of float reordering on every mesh factorisation and under
both precision policies; a bug injected in one layer (an extra psum, a missing psum, a bias
added before the reduction, a wrong head split) is named, and it is the only layer beyond its
bound. Mutants of the locator (no teacher forcing, the input-rounding term of the bound
dropped, the sequence and feature dims of a tap swapped) are caught.
"""

import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _mutants import mutant
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models
from shardops.inspect import _locate as _compare
from shardops_models.strategies import _layers, parallel

F32, MIXED = shardops.FLOAT32, shardops.MIXED_BFLOAT16  # and BFLOAT16 once
ROOT = pathlib.Path(__file__).resolve().parents[2]
MLP = models.Mlp((48, 64, 96, 32, 10))


def gpt():
    return models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=2, context=16, d_ff=64)


def example():
    spec = importlib.util.spec_from_file_location("locate_divergence",
                                                  ROOT / "examples" / "locate_divergence.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batch_for(model, rng):
    if isinstance(model, models.Gpt):
        ids = rng.integers(0, model.vocab_size, (8, model.context)).astype(np.int32)
        return ids, np.roll(ids, -1, axis=1)
    x = rng.normal(size=(32, model.sizes[0])).astype(np.float32)
    return x, np.eye(model.sizes[-1], dtype=np.float32)[rng.integers(0, model.sizes[-1], 32)]


def locate(model, strategy, mesh, precision, *, locate=models.locate, remat=False):
    setup = models.build(strategy, shardops.make_mesh(mesh), model=model,
                         optimizer=optax.sgd(0.1), precision=precision, remat=remat)  # fmt: skip
    params = model.init(jax.random.key(0))
    noise = jax.random.key(1)  # non-zero biases and norms: a zero bias hides a bias bug
    params = jax.tree.map(
        lambda a: (a + 0.05 * jax.random.normal(noise, a.shape)).astype(precision.param_dtype),
        params,
    )
    state = setup.shard(params)
    return locate(setup, state.params, *batch_for(model, np.random.default_rng(0)),
                  reference_params=params, end_to_end=False)  # fmt: skip


def beyond(report) -> set[str]:
    return {r.layer for r in report.rows if r.beyond}


# Every 8-device factorisation of both axes, every strategy, both policies.
CLEAN = [
    (MLP, "dp", {"data": 8}, F32),
    (MLP, "fsdp", {"data": 8}, MIXED),
    (MLP, "tp", {"model": 8}, MIXED),
    (MLP, "2d", {"data": 4, "model": 2}, shardops.BFLOAT16),
    (MLP, "fsdp_tp", {"data": 2, "model": 4}, MIXED),
    (gpt(), "sp", {"data": 2, "model": 4}, MIXED),
    (gpt(), "fsdp_tp", {"data": 4, "model": 2}, F32),
]


@pytest.mark.parametrize(("model", "strategy", "mesh", "precision"), CLEAN,
                         ids=[f"{m.name}-{s}-{'x'.join(map(str, g.values()))}-{p.name}"
                              for m, s, g, p in CLEAN])  # fmt: skip
def test_clean_models_are_within_bound(model, strategy, mesh, precision):
    report = locate(model, strategy, mesh, precision)
    assert report.within_bound, str(report)
    assert "within bound" in report.verdict()
    tapped = {r.layer for r in report.rows if r.what == "output"}
    expected = 4 if isinstance(model, models.Mlp) else 2 + 2 * 5 + 2  # embeds, blocks, ln_f, head
    assert len(tapped) == expected, sorted(tapped)
    # every parameter's gradient is compared and owned by its layer
    params = jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0)))
    owned = [r for r in report.rows if r.what == "param" and r.layer in tapped]
    assert len(owned) == len(params)


@pytest.mark.parametrize(("bug", "layer", "precision"), [
    ("bias-before-reduction", 3, F32),
    ("bias-before-reduction", 3, MIXED),
    ("extra-psum", 5, F32),
    ("missing-psum", 3, MIXED),
])  # fmt: skip
def test_the_injected_layer_and_only_it_is_named(bug, layer, precision):
    """The example's model of six shardops layers, a hand-written bug in one row layer. (A
    missing psum under check_vma=False leaves the devices disagreeing on the layer's output:
    the tap shows one device's, the next layer reads each device's own, so the next layer may
    look guilty too; the first named is still the right one.)"""
    report = example().run(bug, layer, precision)
    assert report.first == f"layer{layer}", str(report)
    if bug != "missing-psum":
        assert beyond(report) == {f"layer{layer}"}, str(report)
    assert f"bug: layer layer{layer}" in report.verdict()


def test_the_example_is_within_bound_without_a_bug():
    assert example().run(precision=MIXED).within_bound


def test_the_example_runs_from_the_command_line(capsys):
    demo = example()
    assert demo.main(["--bug", "bias-before-reduction", "--layer", "3"]) == 0
    out = capsys.readouterr().out
    assert "← first beyond bound" in out and "bug: layer layer3" in out
    with pytest.raises(SystemExit):
        demo.main(["--bug", "extra-psum", "--layer", "2"])  # a column layer: refused
    assert "the bugs are in row layers" in capsys.readouterr().err


def _bug_on_call(monkeypatch, name: str, call: int, every: int, broken):
    """``shardops.layers.<name>`` broken on its ``call``-th use of each ``every`` (the GPT's blocks
    share shapes: the block is told apart by the order of the calls as the forward traces)."""
    real, calls = getattr(shardops.layers, name), [0]

    def kernel(*args, **kwargs):
        i, calls[0] = calls[0], calls[0] + 1
        return broken(real, *args, **kwargs) if i % every == call else real(*args, **kwargs)

    monkeypatch.setattr(shardops.layers, name, kernel)


def test_a_wrong_head_split_in_block_1_is_named(monkeypatch):
    def swapped_heads(real, x, params, **kwargs):  # this device's two heads of wk swapped
        wk = params["wk"]  # wk[D, H_model · hd]
        half = wk.shape[1] // 2
        params = {**params, "wk": jnp.concatenate([wk[:, half:], wk[:, :half]], axis=1)}
        return real(x, params, **kwargs)

    _bug_on_call(monkeypatch, "head_parallel_attention_kernel", 1, 2, swapped_heads)
    report = locate(gpt(), "fsdp_tp", {"data": 4, "model": 2}, F32)
    assert report.first == "['blocks'][1]['attn']", str(report)
    assert beyond(report) == {"['blocks'][1]['attn']"}, str(report)


def test_an_extra_psum_in_block_0_is_named(monkeypatch):
    def psum_twice(real, *args, **kwargs):
        return lax.psum(real(*args, **kwargs), shardops.MODEL_AXIS)

    _bug_on_call(monkeypatch, "row_parallel_dense_kernel", 0, 2, psum_twice)
    report = locate(gpt(), "tp", {"data": 2, "model": 4}, MIXED)
    assert report.first == "['blocks'][0]['down']", str(report)
    assert beyond(report) == {"['blocks'][0]['down']"}, str(report)


@pytest.mark.parametrize("remat", [True, "matmuls", ("attention_output",), "offload"],
                         ids=str)  # fmt: skip
def test_under_every_remat_policy_the_locator_runs_and_names_the_bug(monkeypatch, remat):
    """A setup built with remat compiles its programs with XLA options that a nested jit may
    not carry (the locator's): ``locate`` runs under every policy and names the extra psum."""

    def psum_twice(real, *args, **kwargs):
        return lax.psum(real(*args, **kwargs), shardops.MODEL_AXIS)

    _bug_on_call(monkeypatch, "row_parallel_dense_kernel", 0, 2, psum_twice)
    report = locate(gpt(), "fsdp_tp", {"data": 2, "model": 4}, F32, remat=remat)
    assert report.first == "['blocks'][0]['down']", str(report)


def test_blocks_that_should_be_replicas_must_agree():
    """Inside shard_map a tap's blocks are put together by its spec; devices that the spec
    makes replicas but that hold different values (a missing psum) are a bug even when the
    block the caller keeps happens to be right."""
    mesh = shardops.make_mesh({"data": 4, "model": 2})

    def fn(w, x, *, reduce):
        def body(w, x):  # x[B/4, D/2] · w[D/2, F] → y[B/4, F]{U_model}
            y = x @ w
            y = lax.psum(y, "model") if reduce else y
            return jnp.sum(shardops.inspect.tap(y, "y", spec=P("data"), k=x.shape[-1]) ** 2)[None]

        parts = jax.shard_map(body, mesh=mesh, in_specs=(P("model"), P("data", "model")),
                              out_specs=P(("data", "model")))(w, x)  # fmt: skip
        return jnp.sum(parts) / 2

    def reference(w, x):
        return jnp.sum(shardops.inspect.tap(x @ w, "y", k=x.shape[-1]) ** 2)

    w, x = np.ones((8, 4), np.float32), np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    good = shardops.inspect.compare(lambda w, x: fn(w, x, reduce=True), reference, w, x)
    assert good.within_bound, str(good)
    bad = shardops.inspect.compare(lambda w, x: fn(w, x, reduce=False), reference, w, x)
    rows = [r for r in bad.rows if r.what == "output"]
    assert rows[0].replicas > 0 and bad.first == "y", str(bad)
    assert "replicas differ" in bad.verdict()


def check_two_axis_entry(module, mesh_shape: dict, entry: tuple[str, str]) -> None:
    """A clean program whose taps split one dim over two mesh axes in one spec entry (``entry``
    major, as in ``P(("data", "model"))``), rows or columns, is within bound: the locator puts
    every block where the spec says and no block is taken for another's replica."""
    mesh = shardops.make_mesh(mesh_shape)
    d, f = 16, 12

    def layers(w, x, tap, rows, cols):  # x[B, D] · w[D, F]; the taps' specs are rows, cols
        h = tap(jnp.tanh(x @ w), "rows", spec=rows, k=d)  # h[B, F]
        g = tap(jnp.sin(h).T * 2.0, "cols", spec=cols, k=1)  # g[F, B]
        return jnp.sum(g**2)

    def sharded(w, x):
        def body(w, x):  # x[B/n, D]: its rows split over both axes, ``entry[0]`` major
            part = layers(w, x, module.tap, P(entry), P(None, entry))
            return lax.psum(part, tuple(mesh_shape))  # Σ over both axes: the loss, replicated

        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(entry)), out_specs=P())(w, x)

    def reference(w, x):
        return layers(w, x, module.tap, None, None)

    rng = np.random.default_rng(0)
    w = rng.normal(size=(d, f)).astype(np.float32)
    x = rng.normal(size=(2 * math.prod(mesh_shape.values()), d)).astype(np.float32)  # [B, D]
    report = module.compare(sharded, reference, w, x)
    where = f"P({entry}) on {mesh_shape}"
    assert report.within_bound, f"{where}:\n{report}"
    assert {r.layer for r in report.rows if r.what == "output"} == {"rows", "cols"}, where


@pytest.mark.parametrize(("mesh_shape", "entry"), [
    ({"data": 2, "model": 4}, ("data", "model")),
    ({"data": 4, "model": 2}, ("model", "data")),
], ids=["2x4-data-model", "4x2-model-data"])  # fmt: skip
def test_a_spec_entry_over_two_mesh_axes_is_within_bound(mesh_shape, entry):
    check_two_axis_entry(_compare, mesh_shape, entry)


def test_tap_is_the_identity_outside_compare_and_no_tapped_program_outlives_it():
    def f(x):
        return jnp.sum(shardops.inspect.tap(x * 2, "double", k=1))

    assert "callback" not in str(jax.make_jaxpr(f)(jnp.ones(3)))
    jitted = jax.jit(f)
    report = shardops.inspect.compare(lambda p, x: jitted(p * x), lambda p, x: f(p * x), jnp.ones(3),
                              jnp.ones(3))  # fmt: skip
    assert report.within_bound and report.layers[0] == "double"
    # the tapped trace is gone: the same jitted function has no callback now
    assert "callback" not in jitted.lower(jnp.ones(3)).as_text()
    assert "callback" not in str(jax.make_jaxpr(f)(jnp.ones(3)))


def test_taps_on_one_side_only_cannot_be_compared():
    def sharded(p, x):
        return jnp.sum(shardops.inspect.tap(p * x, "a") ** 2)

    def reference(p, x):
        return jnp.sum(shardops.inspect.tap(p * x, "b") ** 2)

    report = shardops.inspect.compare(sharded, reference, jnp.ones(4), jnp.ones(4))
    assert not report.within_bound and report.missing == ("a", "b")
    assert report.verdict().startswith("cannot compare")


def test_bad_input_is_refused():
    def f(x):
        return jnp.sum(x)

    with pytest.raises(ValueError, match="pass the batch"):
        shardops.inspect.compare(f, f, jnp.ones(3))
    with pytest.raises(ValueError, match="scalar loss or"):
        shardops.inspect.compare(lambda p, x: p * x, lambda p, x: p * x, jnp.ones(3), jnp.ones(3))
    with pytest.raises(TypeError, match="precision"):
        shardops.inspect.compare(f, f, jnp.ones(3), jnp.ones(3), precision="bf16")
    mesh = shardops.make_mesh({"data": 8})
    inside = jax.shard_map(lambda x: shardops.inspect.tap(x, "x", spec=P("data")), mesh=mesh,
                           in_specs=P("data"), out_specs=P("data"))  # fmt: skip
    with pytest.raises(ValueError, match="unsharded reference_fn"):
        shardops.inspect.compare(lambda p, x: jnp.sum(inside(p * x)), lambda p, x: jnp.sum(inside(p * x)),
                         jnp.ones(8), jnp.ones(8))  # fmt: skip
    with pytest.raises(ValueError, match="manual over"):
        shardops.inspect.compare(lambda p, x: jnp.sum(shardops.inspect.tap(p, "p", spec=P("data"))), f,
                         jnp.ones(3), jnp.ones(3))  # fmt: skip


# --- mutants of the locator


def test_without_teacher_forcing_later_layers_look_guilty_too(monkeypatch):
    bad = mutant(_compare, "unforced",
                 "        return x if forced_value is None else _opaque(forced_value, x.dtype)\n",
                 "        return x\n")  # fmt: skip
    monkeypatch.setattr(shardops.inspect, "tap", bad.tap)
    demo = example()
    monkeypatch.setattr(demo.shardops.inspect, "compare", bad.compare)
    report = demo.run("bias-before-reduction", 3)
    assert report.first == "layer3"  # the first is still right ...
    assert beyond(report) != {"layer3"}  # ... but the test above would fail: layers 4-6 too


def test_a_bound_without_input_rounding_fails_a_clean_bf16_model(monkeypatch):
    bad = mutant(_compare, "no_input_rounding",
                 "    inputs = float(jnp.finfo(precision.compute_dtype).eps) * scale"
                 "  # operands rounded, or not\n",
                 "    inputs = float(jnp.finfo(precision.accum_dtype).eps) * scale\n")  # fmt: skip
    monkeypatch.setattr(shardops.inspect, "tap", bad.tap)
    report = locate(
        gpt(),
        "sp",
        {"data": 2, "model": 4},
        MIXED,
        locate=lambda *args, **kwargs: _locate_with(bad, *args, **kwargs),
    )
    assert not report.within_bound


def test_a_tap_with_the_sequence_and_feature_dims_swapped_fails_a_clean_model(monkeypatch):
    bad = mutant(_layers, "tap_dims_swapped",
                 "                entries[-1 if features_split else SEQUENCE_DIM] = model\n",
                 "                entries[SEQUENCE_DIM if features_split else -1] = model\n")  # fmt: skip
    monkeypatch.setattr(parallel.Parallel, "_tap", bad.Layers._tap)
    with pytest.raises(ValueError, match="global shape"):  # x[B, S/p, D] put together as
        locate(gpt(), "sp", {"data": 2, "model": 4}, F32)  # x[B, S/p, D·p]


def _locate_with(module, setup, params, x, y, reference_params, end_to_end):
    ref = models.build("ref", model=setup.model, optimizer=setup.optimizer,
                       precision=setup.precision)  # fmt: skip
    return module.compare(setup.loss_and_grads, ref.loss_and_grads, params,
                          *setup.place_batch(x, y), reference_params=reference_params,
                          reference_batch=(x, y), precision=setup.precision,
                          end_to_end=end_to_end)  # fmt: skip


ENTRY_ORDER = "            for a in e:  # the first axis of an entry is the major one\n"
TWO_AXIS_MUTANTS = {
    # An entry over two axes read minor-major: P(("data", "model"))'s blocks in the wrong order.
    "entry_axes_reversed": (ENTRY_ORDER, ENTRY_ORDER.replace("in e:", "in reversed(e):")),
    # Only the first axis of an entry places a block: the blocks of the second overwrite
    # each other as replicas.
    "entry_first_axis_only": (ENTRY_ORDER, ENTRY_ORDER.replace("in e:", "in e[:1]:")),
}


@pytest.mark.parametrize("name", TWO_AXIS_MUTANTS)
def test_a_two_axis_entry_mutant_is_caught(name):
    old, new = TWO_AXIS_MUTANTS[name]
    bad = mutant(_compare, name, old, new)
    with pytest.raises(AssertionError, match=r"P\(\(.* on "):
        check_two_axis_entry(bad, {"data": 2, "model": 4}, ("data", "model"))
