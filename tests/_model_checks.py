"""Shared trajectory check: a strategy's 5-step training equals an independent reference.

The reference is plain ``jax.value_and_grad(models.loss)`` with the same optax optimizer; it
does not go through ``models.training._train``, so a bug there (or a mutant of it) cannot hide in both.
"""

from __future__ import annotations

import collections
import functools
import math

import jax
import numpy as np
import optax

import shardops
import shardops_models as models
from shardops import inspect as hlo
from shardops.testing import dtype_flow_violations

STEPS = 5
# f32 tolerances. Sharding only reorders sums: observed differences are ~2e-7 (see the note), and
# each leaf must move ≥ 100× the tolerance, so a zeroed or doubled gradient cannot hide.
TOL = {
    "sgd": {"loss": 1e-6, "grads": 1e-6, "params": 1e-6},
    "adam": {"loss": 1e-6, "grads": 1e-6, "params": 1e-5},
}
MIN_MOVE = 100
# (strategy, mesh, optimizer) → worst errors of a passing check, for the end-of-run report.
TRAJECTORY_ERRORS: dict[tuple, dict] = {}


def optimizer(name: str) -> optax.GradientTransformation:
    # The seed's SGD at LR 1.0 (its schedule is constant within the first epoch), or Adam 1e-3.
    return models.seed_sgd(steps_per_epoch=1000) if name == "sgd" else optax.adam(1e-3)


def mesh_for(shape: dict | None):
    return None if shape is None else shardops.make_mesh(shape)


def batches(sizes, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    xs = rng.random((STEPS, batch, sizes[0]), dtype=np.float32)  # pixel-like, in [0, 1)
    ys = np.eye(sizes[-1], dtype=np.float32)[rng.integers(0, sizes[-1], (STEPS, batch))]
    return xs, ys


def reference_trajectory(params, xs, ys, opt, precision=shardops.FLOAT32):
    """Losses, gradients and final params of the unsharded MLP, straight from ``models.loss``."""
    value_and_grad = jax.jit(
        jax.value_and_grad(functools.partial(models.loss, precision=precision))
    )
    opt_state = opt.init(params)
    losses, grads = [], []
    for x, y in zip(xs, ys, strict=True):
        loss, g = value_and_grad(params, x, y)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
        grads.append(jax.device_get(g))
    return np.array(losses), grads, jax.device_get(params)


@functools.cache
def _reference(sizes: tuple, batch: int, scale: float, opt_name: str, precision):
    """The initial params, the batches and the reference trajectory of one configuration,
    computed once per session: many strategies, meshes and mutants share it (read-only)."""
    params = models.init_mlp(jax.random.key(0), sizes, scale=scale, dtype=precision.param_dtype)
    xs, ys = batches(sizes, batch)
    return params, xs, ys, reference_trajectory(params, xs, ys, optimizer(opt_name), precision)


def sharded_trajectory(setup, params, xs, ys):
    state = setup.shard(params)
    losses, grads = [], []
    for x, y in zip(xs, ys, strict=True):
        xb, yb = setup.place_batch(x, y)
        _, g = setup.loss_and_grads(state.params, xb, yb)
        state, loss = setup.train_step(state, xb, yb)
        losses.append(float(loss))  # a host sync every step: at most one step in flight
        grads.append(setup.gather(g))
    return np.array(losses), grads, setup.gather(state.params)


def max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def check_trajectory(
    strategy,
    mesh_shape,
    opt_name,
    *,
    sizes,
    batch,
    scale=0.1,
    build=models.build,
    remat=False,
    precision=shardops.FLOAT32,
) -> dict:
    """Assert loss, gradients and params of 5 steps equal the reference; return the errors.

    Under the bf16 policies the reference is the unsharded model under the same policy: every
    product is exact and every sum is in float32 on both sides, so the only difference is still
    the float32 summation order, and each result is rounded once (so the same tolerances hold).
    """
    tol = TOL[opt_name]
    params, xs, ys, (ref_losses, ref_grads, ref_params) = _reference(
        tuple(sizes), batch, scale, opt_name, precision
    )
    setup = build(
        strategy,
        mesh_for(mesh_shape),
        optimizer=optimizer(opt_name),
        sizes=sizes,
        remat=remat,
        precision=precision,
    )
    losses, grads, final = sharded_trajectory(setup, params, xs, ys)
    errors = {
        "loss": float(np.max(np.abs(losses - ref_losses))),
        "grads": max(max_diff(g, r) for g, r in zip(grads, ref_grads, strict=True)),
        "params": max_diff(final, ref_params),
    }
    where = f"{strategy} on {mesh_shape} with {opt_name} under {precision.name}"
    for k, err in errors.items():
        assert err <= tol[k], f"{where}: max |{k} − reference| = {err:.3e} > {tol[k]:.0e}"
    for i, (start, end) in enumerate(zip(params, ref_params, strict=True)):
        for name in start:
            moved = float(np.max(np.abs(np.asarray(end[name]) - np.asarray(start[name]))))
            assert moved >= MIN_MOVE * tol["params"], (
                f"layer {i} {name} moved only {moved:.2e} in {STEPS} steps: a test that cannot "
                f"see a zeroed or doubled gradient; use larger inputs or init"
            )
    key = (
        getattr(strategy, "name", strategy),
        "x".join(map(str, mesh_shape.values())) if mesh_shape else "-",
        opt_name,
    )
    if precision != shardops.FLOAT32:
        key = (*key[:2], f"{opt_name}/{precision.name[:5].lower()}")
    old = TRAJECTORY_ERRORS.get(key, {})
    TRAJECTORY_ERRORS[key] = {k: max(v, old.get(k, 0.0)) for k, v in errors.items()}
    return errors


def check_evaluation(strategy, mesh_shape, *, sizes, batch, pad: int = 0, build=models.build):
    """``setup.evaluate`` on one batch equals the unsharded model's metrics on the same batch:
    the accuracy (as a count) exactly, the loss within 1e-6. With ``pad``, that many extra
    rows (random images, all-zero labels) are appended and must count nowhere."""
    params = models.init_mlp(jax.random.key(1), sizes, scale=0.1)
    xs, ys = batches(sizes, batch, seed=7)
    x, y = xs[0], ys[0]
    # The independent reference: the plain unsharded functions, on the unpadded batch.
    ref_loss = float(models.loss(params, x, y))
    ref_correct = int(np.sum(np.argmax(models.mlp_forward(params, x), -1) == np.argmax(y, -1)))
    assert 0 < ref_correct < batch, "a batch whose accuracy is 0 or 1 cannot show a bad count"
    if pad:
        rng = np.random.default_rng(8)
        x = np.concatenate([x, rng.random((pad, x.shape[1]), dtype=np.float32)])
        y = np.concatenate([y, np.zeros((pad, y.shape[1]), np.float32)])
    setup = build(strategy, mesh_for(mesh_shape), optimizer=optax.sgd(1.0), sizes=sizes)
    metrics = setup.evaluate(setup.shard(params).params, *setup.place_batch(x, y))
    where = f"{strategy} on {mesh_shape}, batch {batch} + {pad} padding rows"
    assert int(metrics.count) == batch, f"{where}: counted {int(metrics.count)} rows"
    assert int(metrics.correct) == ref_correct, (
        f"{where}: {int(metrics.correct)} correct, the unsharded model has {ref_correct}"
    )
    assert float(metrics.accuracy) == ref_correct / batch
    assert abs(float(metrics.loss) - ref_loss) <= 1e-6, (
        f"{where}: loss {float(metrics.loss)!r}, the unsharded model's {ref_loss!r}"
    )


def check_dtype_flow(strategy, mesh_shape, precision, *, sizes, remat=False, build=models.build):
    """The train step's jaxpr follows ``precision`` (``dtype_flow_violations`` finds nothing)."""
    setup = build(strategy, mesh_for(mesh_shape), optimizer=optax.adam(1e-3), sizes=sizes,
                  remat=remat, precision=precision)  # fmt: skip
    state = setup.init(jax.random.key(0))
    xs, ys = batches(sizes, 32)
    args = (state, *setup.place_batch(xs[0], ys[0]))
    problems = dtype_flow_violations(setup.step, *args, policy=precision)
    assert not problems, f"{strategy} on {mesh_shape}:\n" + "\n".join(problems)
    return setup, args


def check_donation(build=models.build) -> None:
    """The train step donates the state it is given (the compiled step aliases every byte of
    it to the new state, and the old state's buffers are gone after the call: one state in
    memory, not two); nothing else donates: the params given to ``loss_and_grads``,
    ``evaluate`` and ``logits`` stay valid. Values cannot show either: only memory does."""
    setup = build("fsdp_tp", mesh_for({"data": 4, "model": 2}), optimizer=optax.adam(1e-3),
                  sizes=(16, 32, 8))  # fmt: skip
    xs, ys = batches(setup.sizes, 32)
    x, y = setup.place_batch(xs[0], ys[0])
    state = setup.init(jax.random.key(0))
    per_device = sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(state)
    )
    analysis = setup.train_step.lower(state, x, y).compile().memory_analysis()
    assert analysis.alias_size_in_bytes == per_device, (
        f"the train step aliases {analysis.alias_size_in_bytes} of the state's {per_device} "
        f"bytes per device to its output"
    )
    new, loss = setup.train_step(state, x, y)
    jax.block_until_ready((new, loss))
    kept = [leaf for leaf in jax.tree.leaves(state) if not leaf.is_deleted()]
    assert not kept, f"{len(kept)} leaves of the donated state are still held after the step"
    for name in ("loss_and_grads", "evaluate", "logits"):
        params = jax.tree.map(lambda a: a.copy(), new.params)
        jax.block_until_ready(getattr(setup, name)(params, x, *((y,) if name != "logits" else ())))
        gone = [leaf for leaf in jax.tree.leaves(params) if leaf.is_deleted()]
        assert not gone, f"{name} deleted {len(gone)} of the params it must not donate"


# A GPT small enough to lower in a moment, split by every mesh below (4 heads, S = 16): its
# embedding, attention, norms, MLP and head cover every kernel the sequence strategies use.
BF16_GPT = models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=1, context=16, d_ff=64)
BF16_BUDGET_MESHES = {
    "dp": {"data": 4}, "fsdp": {"data": 4}, "tp": {"model": 4}, "sp": {"model": 4},
    "2d": {"data": 2, "model": 4}, "fsdp_tp": {"data": 2, "model": 4},
    "dp_sp": {"data": 2, "model": 4}, "fsdp_sp": {"data": 2, "model": 4},
    "hsdp_sp": {"replica": 2, "data": 2, "model": 2}, "zero1": {"data": 4},
    "zero1_tp": {"data": 2, "model": 4},
}  # fmt: skip


def reductions_in_16_bits(found) -> list[str]:
    """The all-reduces and reduce-scatters among ``found`` (``shardops.inspect.Collective``)
    that carry bf16 or f16: every policy reduces in float32."""
    return [
        f"{c.kind} over {c.axes} of {c.shapes}"
        for c in found
        if c.kind in (hlo.ALL_REDUCE, hlo.REDUCE_SCATTER) and set(c.dtypes) & {"bf16", "f16"}
    ]


def check_bf16_budget(strategy: str, precision, build=models.build) -> None:
    """The GPT's train step under a bf16 policy asks for every reduction in float32 (the
    lowered module: what the program requests, before XLA:CPU promotes bf16 collectives to
    f32), and its budget (read from the trace) is exactly what the lowered module asks for,
    bytes per kind and mesh axes. A reduction carried in bf16 shows here, where values barely
    move."""
    mesh = mesh_for(BF16_BUDGET_MESHES[strategy])
    setup = build(strategy, mesh, model=BF16_GPT, optimizer=optax.sgd(0.1), precision=precision)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, BF16_GPT.vocab_size, (8, BF16_GPT.context)).astype(np.int32)
    state = jax.eval_shape(setup.init, jax.random.key(0))  # shapes and shardings: nothing runs
    x, y = setup.place_batch(ids, np.roll(ids, -1, 1))
    lowered = setup.train_step.lower(state, x, y)  # lowered only: compiling adds nothing here
    asked = [c for c in hlo.lowered_collectives(lowered.as_text(), mesh) if c.bytes]
    low = reductions_in_16_bits(asked)
    assert not low, (
        f"{strategy} under {precision.name}: the program asks for reductions in 16 bits: {low}"
    )
    requested = collections.Counter()
    for c in asked:
        requested[(c.kind, c.axes)] += c.bytes
    requested, budget = dict(requested), setup.collective_budget(8)
    assert requested == budget, (
        f"{strategy} under {precision.name}: the program asks for {requested}, its budget is "
        f"{budget}"
    )
