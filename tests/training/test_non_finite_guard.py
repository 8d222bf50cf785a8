"""Stopping a run at the first non-finite step (``loop.NonFiniteGuard``) and naming the layer
(``shardops_models.locate_non_finite``), on sharded strategies of a 4×2 mesh.

A NaN put into one weight before step ``N`` stops the run at step ``N`` (learnt ``limit`` steps
later, never more) with that layer named; a NaN in the batch names the first layer; a gradient
that is NaN under a finite loss is caught at its step through the parameters it spoils; a NaN
loss whose update the optimizer skips is caught through the loss; a finite run is never
stopped. Each ``check_*`` takes the ``loop`` module under test, so that
``test_non_finite_mutations.py`` runs it against mutants of ``models/training/loop.py``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardops
import shardops_models as models
from shardops_models.training import loop

MESH = {"data": 4, "model": 2}
N = 3  # the step that goes non-finite
STEPS = 8
BATCH = 8
MLP = models.Mlp((8, 16, 16, 16, 4))  # layers [0] … [3]


@dataclasses.dataclass(frozen=True)
class AbsMlp(models.Mlp):
    """The MLP with ``|h| = √(h²)`` for its activation: finite everywhere, but its gradient at
    ``h = 0`` is ``0 · ∞ = NaN``, so a unit whose weights are all zero has a finite forward, a
    finite loss and a NaN gradient."""

    def apply(self, ctx, params, x):
        for i, layer in enumerate(params):
            x = ctx.unit(ctx.dense, layer, x)  # (b, width)
            if i < len(params) - 1:
                x = jnp.sqrt(x * x)  # |x|; d/dx at 0: (0.5 / √0) · 2x = ∞ · 0
        return x, {}  # logits[b, C], no auxiliary loss


_SETUPS: dict = {}


def setup_for(model, strategy="2d", optimizer="sgd"):
    """One ``Setup`` per case for the whole module (its train step compiles once)."""
    key = (model, strategy, optimizer)
    if key not in _SETUPS:
        opt = {"sgd": optax.sgd(0.1),
               "skip": optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=STEPS)}[optimizer]  # fmt: skip
        _SETUPS[key] = models.build(strategy, shardops.make_mesh(MESH), model=model, optimizer=opt)
    return _SETUPS[key]


def batches(model, seed=0):
    rng = np.random.default_rng(seed)
    if isinstance(model, models.Gpt):
        ids = rng.integers(0, model.vocab_size, (STEPS, BATCH, model.context)).astype(np.int32)
        return [(i, np.roll(i, -1, axis=1)) for i in ids]
    xs = rng.random((STEPS, BATCH, model.sizes[0]), dtype=np.float32)
    ys = np.eye(model.sizes[-1], dtype=np.float32)[rng.integers(0, model.sizes[-1], (STEPS, BATCH))]
    return list(zip(xs, ys, strict=True))


def with_params(state, path: str, change):
    """``state`` with leaf ``path`` of its params replaced by ``change(host copy)``, laid out
    as it was."""

    def put(p, leaf):
        if jax.tree_util.keystr(p) != path:
            return leaf
        host = np.array(leaf)
        change(host)
        return jax.device_put(host, leaf.sharding)

    return state._replace(params=jax.tree_util.tree_map_with_path(put, state.params))


def train(module, setup, *, inject=None, batch=None, locate=True, limit=2):
    """Train ``STEPS`` steps under a guard; before step ``N``, ``inject`` changes the state
    (``with_params``) or ``batch`` replaces the batch. Returns ``(error or None, steps
    dispatched)``."""
    state = setup.init(jax.random.key(0))
    guard = module.NonFiniteGuard(setup, limit=limit, locate=locate)
    dispatched = []
    try:
        for step, (x, y) in enumerate(batches(setup.model)):
            if step == N and inject is not None:
                state = inject(state)
            if step == N and batch is not None:
                x, y = batch(x, y)
            dispatched.append(step)
            state, _ = guard.train_step(step, state, *setup.place_batch(x, y))
        guard.drain()
    except module.NonFiniteError as e:
        fresh = setup.init(jax.random.key(1))
        try:  # no step runs past it
            guard.train_step(STEPS, fresh, *setup.place_batch(x, y))
        except module.NonFiniteError as again:
            assert again is e
        else:
            raise AssertionError(f"the guard ran step {STEPS} after raising at {e.step}") from e
        assert not jax.tree.leaves(fresh.params)[0].is_deleted(), "the step ran (and donated)"
        return e, dispatched
    return None, dispatched


def check_stopped_at_n(error, dispatched, limit=2):
    assert error is not None, f"the run was not stopped ({dispatched})"
    assert error.step == N, f"stopped at step {error.step}, expected {N}:\n{error}"
    assert dispatched[-1] <= N + limit, f"steps {dispatched} ran past {N} + limit {limit}"
    assert str(error).startswith(f"step {N}: ")


def check_nan_weight(module=loop, model=MLP, strategy="2d", path="[1]['w']", layer="[1]"):
    """A NaN in one element of a middle layer's weight before step N."""

    def nan_at(w):
        w[(0,) * w.ndim] = np.nan

    error, dispatched = train(module, setup_for(model, strategy), inject=lambda s: with_params(s, path, nan_at))  # fmt: skip
    check_stopped_at_n(error, dispatched)
    assert np.isnan(error.loss) and f"step {N}: the loss is nan" in str(error)
    assert path in error.params, error.params
    assert error.report is not None, str(error)
    assert (error.report.what, error.report.layer) == ("output", layer), str(error)
    assert f"the first non-finite value is the output of layer {layer} (" in str(error)


def check_nan_batch(module=loop):
    """A NaN in one row of the batch of step N: the first layer, that row (16 units) only."""

    def nan_batch(x, y):
        x = x.copy()
        x[1, 2] = np.nan
        return x, y

    error, dispatched = train(module, setup_for(MLP), batch=nan_batch)
    check_stopped_at_n(error, dispatched)
    assert (error.report.what, error.report.layer, error.report.nan) == ("output", "[0]", 16), str(error)  # fmt: skip


def check_nan_gradient(module=loop):
    """Unit 5 of layer [1] all zeros before step N: the forward and the loss stay finite, the
    gradient at that unit is NaN, and layer [1] and the one before it are spoilt by it."""

    def dead_unit(a):
        a[..., 5] = 0.0

    def inject(state):
        return with_params(with_params(state, "[1]['w']", dead_unit), "[1]['b']", dead_unit)

    error, dispatched = train(module, setup_for(AbsMlp(MLP.sizes)), inject=inject)
    check_stopped_at_n(error, dispatched)
    assert np.isfinite(error.loss) and "is finite but the gradient is not" in str(error)
    assert set(error.params) == {"[0]['b']", "[0]['w']", "[1]['b']", "[1]['w']"}, error.params
    assert (error.report.what, error.report.layer) == ("gradient", "[1]"), str(error)


def check_skipped_update(module=loop):
    """A NaN batch at step N under an optimizer that skips non-finite updates: the parameters
    stay finite and only the loss tells."""

    def nan_batch(x, y):
        return np.full_like(x, np.nan), y

    setup = setup_for(MLP, "dp", optimizer="skip")  # (tp and fsdp refuse apply_if_finite)
    error, dispatched = train(module, setup, batch=nan_batch, locate=False)
    check_stopped_at_n(error, dispatched)
    assert np.isnan(error.loss) and error.params == () and error.report is None
    assert "every parameter is finite" in str(error) and "locate=True" in str(error)


def check_finite_run(module=loop):
    error, dispatched = train(module, setup_for(MLP), limit=1)
    assert error is None, str(error)
    assert dispatched == list(range(STEPS))


def test_a_nan_weight_in_an_mlp_stops_the_run_at_its_step_and_names_the_layer():
    check_nan_weight()


def test_a_nan_weight_in_a_gpt_block_names_its_attention():
    gpt = models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=2, context=16, d_ff=64)
    check_nan_weight(model=gpt, strategy="fsdp_tp", path="['blocks'][1]['attn']['wv']",
                     layer="['blocks'][1]['attn']")  # fmt: skip


def test_a_nan_in_the_batch_names_the_first_layer():
    check_nan_batch()


def test_a_nan_gradient_under_a_finite_loss_is_caught_at_its_step():
    check_nan_gradient()


def test_a_nan_loss_whose_update_is_skipped_is_caught_by_the_loss():
    check_skipped_update()


def test_a_finite_run_is_never_stopped():
    check_finite_run()


def test_locate_non_finite_of_a_finite_step_names_nothing():
    setup = setup_for(MLP)
    report = models.locate_non_finite(setup, setup.init(jax.random.key(0)).params, *batches(MLP)[0])
    assert report.finite and report.layers == ("[0]", "[1]", "[2]", "[3]"), str(report)


def test_bad_arguments_are_refused():
    setup = setup_for(MLP)
    with pytest.raises(TypeError, match="NonFiniteGuard: setup must come from shardops_models.build; got str"):  # fmt: skip
        loop.NonFiniteGuard("2d")
    with pytest.raises(ValueError, match=r"limit \(steps in flight\) must be an int ≥ 1; got 0"):
        loop.NonFiniteGuard(setup, limit=0)
    with pytest.raises(TypeError, match="locate_non_finite: setup must come from"):
        models.locate_non_finite(None, None, None, None)
    state = setup.init(jax.random.key(0))
    loss = jnp.float32(1.0)
    guard = loop.NonFiniteGuard(setup)
    with pytest.raises(TypeError, match="step must be an int; got 1.0"):
        guard.add(1.0, loss, state)
    guard.add(4, loss, state)
    with pytest.raises(ValueError, match="steps must increase; got step 4 after step 4"):
        guard.add(4, loss, state)
    guard.drain()
    with pytest.raises(ValueError, match=r"locate=True needs guard.before\(7, state, x, y\)"):
        loop.NonFiniteGuard(setup, locate=True).add(7, loss, state)
