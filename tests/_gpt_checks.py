"""Shared checks of the GPT (``models.Gpt``) under every strategy: 5 steps equal an independent
reference, and the compiled collectives equal the budget traced from the step.

The reference is ``jax.value_and_grad(model.reference_loss)``: the GPT in plain ``jax.numpy``
(no shardops layer, no ``models.strategies.parallel``) with the same optax optimizer, so a bug in the
strategy mechanism, the layers or the step cannot hide in both.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from _lm_budgets import EXPECTED, check_hand_budget
from _model_checks import MIN_MOVE, STEPS, max_diff, mesh_for

import shardops
import shardops_models as models
from shardops_models import PAD_LABEL

# A GPT every mesh of 8 divides: 8 heads of 4, vocabulary 64, MLP 64, S = 16 (sp splits it).
GPT = models.Gpt(vocab_size=64, d_model=32, num_heads=8, num_layers=1, context=16, d_ff=64)
BATCH, SEQ = 16, 16
# f32: sharding reorders sums (and the softmax's max/Σexp over vocabulary shards). The loss
# (≈ 4.2) is held to 1e-6 of itself, 8 float32 ulps: observed up to 2.4e-6 (5 ulps) under the
# default run's compiler (tests/_cover.py), 2e-6 under XLA's defaults.
TOL = {
    "sgd": {"loss": 4e-6, "grads": 1e-6, "params": 5e-6},
    "adam": {"loss": 4e-6, "grads": 1e-6, "params": 1e-5},
}
GPT_ERRORS: dict[tuple, dict] = {}  # (strategy, mesh, optimizer) → worst errors, for the report

MESHES = {
    "2x2x2": {"replica": 2, "data": 2, "model": 2},
    "2x4x1": {"replica": 2, "data": 4, "model": 1},
    "1x2x4": {"replica": 1, "data": 2, "model": 4},
    "1x8": {"data": 1, "model": 8},
    "2x4": {"data": 2, "model": 4},
    "4x2": {"data": 4, "model": 2},
    "8x1": {"data": 8, "model": 1},
    "data8": {"data": 8},
    "model8": {"model": 8},
}
# Meshes with a context axis (tests/strategies/test_context_parallel.py), kept apart so that
# the strategies without one are not also run on them as replicas.
CP_MESHES = {
    "context8": {"context": 8},
    "2x4c": {"data": 2, "context": 4},
    "2x2x2c": {"data": 2, "context": 2, "model": 2},
    "c2x4": {"context": 2, "model": 4},
    "c4x2": {"context": 4, "model": 2},
    "r2d2c2": {"replica": 2, "data": 2, "context": 2},
    "r2d1c2m2": {"replica": 2, "data": 1, "context": 2, "model": 2},
}

# Meshes with an expert axis (tests/networks/test_moe_llama.py).
EP_MESHES = {
    "d2e2m2": {"data": 2, "expert": 2, "model": 2},
    "d2e4": {"data": 2, "expert": 4},
    "e4m2": {"data": 4, "model": 2},
    "r2d2e2": {"replica": 2, "data": 2, "expert": 2},
    "e2c2m2": {"expert": 2, "context": 2, "model": 2},
}

# Meshes with a pipe axis (tests/strategies/test_pipeline.py).
PP_MESHES = {
    "pipe2": {"pipe": 2},
    "pipe4": {"pipe": 4},
    "pipe8": {"pipe": 8},
    "p2d4": {"pipe": 2, "data": 4},
    "p2d2m2": {"pipe": 2, "data": 2, "model": 2},
    "p2r2d2": {"pipe": 2, "replica": 2, "data": 2},
    "p2c2m2": {"pipe": 2, "context": 2, "model": 2},
    "p2c2": {"pipe": 2, "context": 2},  # Ulysses: the Llama's 2 KV heads over context 2
    "p4m2": {"pipe": 4, "model": 2},
    "p2d2m2e": {"pipe": 2, "data": 1, "expert": 2, "model": 2},
}


def cases():
    """Every strategy on every mesh of 8 that has its axes (1-axis meshes included)."""
    out = []
    for name in sorted(models.STRATEGIES):
        if name == "ref":
            continue
        axes = set(models.STRATEGIES[name].axes)
        out += [(name, mesh) for mesh, shape in MESHES.items() if axes <= set(shape)]
    return out


OPTIMIZERS = ("sgd", "adam")


def optimizer(name: str, clip: float | None = None, *, sharded: bool = True, sgd_lr: float = 4.0):
    """SGD (at ``sgd_lr``) or Adam, after global-norm clipping at ``clip``
    (``shardops.clip_by_global_norm`` for the strategies, optax's own for the reference:
    ``sharded=False``)."""
    # Adam divides by |g| + eps: with the default eps = 1e-8, an entry whose gradient is tiny
    # (~1e-9, e.g. a rarely used position's) turns its float32 rounding noise into a step of
    # ~lr · noise / eps, up to 2e-5 after 5 steps. eps = 1e-6 bounds that amplification; the
    # leaves' real gradients (≥ 1e-5) still take full Adam steps.
    opt = optax.sgd(sgd_lr) if name == "sgd" else optax.adam(1e-3, eps=1e-6)
    if clip is None:
        return opt
    clipping = shardops.clip_by_global_norm if sharded else optax.clip_by_global_norm
    return optax.chain(clipping(clip), opt)


def lm_batches(model, seed: int = 0, batch: int = BATCH, seq: int = SEQ):
    """``ids[STEPS, B, S]`` and next-token ``labels`` (int32) from one random token stream."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.vocab_size, (STEPS, batch, seq + 1))
    bos = getattr(model, "bos_id", None)
    if bos is not None:  # packed documents: a new one begins at ~1 token in 5
        tokens = np.where(rng.random(tokens.shape) < 0.2, bos, tokens)
    return tokens[..., :-1].astype(np.int32), tokens[..., 1:].astype(np.int32)


def gpt_batches(seed: int = 0):
    return lm_batches(GPT, seed)


def reference_trajectory(model, params, ids, labels, opt, context_shards: int = 1):
    loss = model.reference_loss
    if context_shards != 1:  # the experts' capacity groups as cp over that many devices
        loss = functools.partial(loss, context_shards=context_shards)
    value_and_grad = jax.jit(jax.value_and_grad(loss))
    opt_state = opt.init(params)
    losses, grads, norms = [], [], []
    for x, y in zip(ids, labels, strict=True):
        loss, g = value_and_grad(params, x, y)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
        grads.append(jax.device_get(g))
        norms.append(float(optax.tree.norm(g)))
    return np.array(losses), grads, jax.device_get(params), norms


@functools.cache
def _reference(model, opt_name: str, clip: float | None = None, sgd_lr: float = 4.0,
               batch: int = BATCH, context_shards: int = 1):  # fmt: skip
    """The initial params, the batches and the reference trajectory of ``model`` under
    ``opt_name``, computed once per session: every strategy, mesh and mutant shares it."""
    params = model.init(jax.random.key(0))
    ids, labels = lm_batches(model, batch=batch)
    labels[:, 0, -3:] = PAD_LABEL  # a short document's end: no loss, no gradient, every layout
    opt = optimizer(opt_name, clip, sharded=False, sgd_lr=sgd_lr)
    trajectory = reference_trajectory(model, params, ids, labels, opt, context_shards)
    return params, ids, labels, trajectory


def check_gpt_trajectory(strategy, mesh_name, opt_name, **options) -> dict:
    """``check_lm_trajectory`` of the GPT."""
    return check_lm_trajectory(GPT, strategy, mesh_name, opt_name, **options)


def check_lm_trajectory(model, strategy, mesh_name, opt_name, *, build=models.build, plan=None,
                        remat=False, budget=False, clip=None, sgd_lr=4.0, tol=None,
                        attention="auto", microbatches=1, batch=BATCH,
                        context_shards=1, raw_grads=False) -> dict:  # fmt: skip
    """Assert 5 steps' losses, gradients and params of ``model`` equal its plain reference;
    with ``budget``, also that the compiled train step's collectives equal
    ``collective_budget``; with ``clip``, the gradients are clipped to that global norm (and
    the reference's norm must exceed it, so the clipping is exercised); ``microbatches``: the
    build's (each device's batch of ``batch`` split so); ``context_shards``: the reference's
    (``Llama.reference_loss``: a mixture of experts' capacity groups under cp over that many
    devices); ``raw_grads``: with SGD, also each step's unclipped gradients from
    ``setup.loss_and_grads`` (a second program to compile)."""
    tol = tol or TOL[opt_name]
    params, ids, labels, (ref_losses, ref_grads, ref_params, norms) = _reference(
        model, opt_name, clip, sgd_lr, batch, context_shards
    )
    if clip is not None:
        assert min(norms) > 1.5 * clip, f"clip={clip} never binds: gradient norms {norms}"
    mesh = mesh_for({**MESHES, **CP_MESHES, **EP_MESHES, **PP_MESHES}.get(mesh_name))  # None: ref
    options = {} if attention == "auto" else {"attention": attention}  # a build of your own
    if microbatches != 1:
        options["microbatches"] = microbatches
    setup = build(strategy, mesh, optimizer=optimizer(opt_name, clip, sgd_lr=sgd_lr),
                  model=model, plan=plan, remat=remat, **options)  # fmt: skip
    state = setup.shard(params)
    # One compiled step serves the budget check and the 5 steps. Gradients are checked on the
    # SGD runs only (Adam's check is its losses and parameters).
    step = setup.train_step.lower(state, *setup.place_batch(ids[0], labels[0])).compile()
    if budget:
        check_budget(setup, step, ids.shape[1:], (model.name, strategy, mesh_name, opt_name, clip,
                                                  remat))  # fmt: skip
    # With SGD each step's gradient as the step applies it (clipped) is read back from the step
    # itself, (p_t − p_t+1) / lr, against the reference's clipped alike: no second program to
    # compile (a separate loss_and_grads program was a third of a case's time). Its rounding,
    # ulp(p) / lr ≤ 2.4e-7 at |p| ≤ 1 and lr = 0.5, stays under the tolerance. A clipping that
    # binds hides a gradient scaled as a whole (a reduction summed twice): the unclipped GPT
    # runs see one; ``raw_grads`` also holds ``setup.loss_and_grads``'s to the reference's.
    sgd = opt_name == "sgd"
    losses, grads, raw = [], [], []
    before = setup.gather(state.params) if sgd else None
    for x, y in zip(ids, labels, strict=True):
        xb, yb = setup.place_batch(x, y)
        if raw_grads and sgd:
            raw.append(setup.gather(setup.loss_and_grads(state.params, xb, yb)[1]))
        state, loss = step(state, xb, yb)
        losses.append(float(loss))  # a host sync every step: at most one step in flight
        if sgd:  # Adam's parameters are gathered once, at the end
            after = setup.gather(state.params)
            grads.append(
                jax.tree.map(lambda p, q: (np.asarray(p, np.float64) - q) / sgd_lr, before, after)
            )
            before = after
    final = before if sgd else setup.gather(state.params)
    applied = [_clipped(g, norm, clip) for g, norm in zip(ref_grads, norms, strict=True)]
    pairs = [*zip(grads, applied, strict=False), *zip(raw, ref_grads, strict=False)]
    errors = {
        "loss": float(np.max(np.abs(np.array(losses) - ref_losses))),
        "grads": max((max_diff(g, r) for g, r in pairs), default=0.0),
        "params": max_diff(final, ref_params),
    }
    where = (f"{model.name} {strategy} on {mesh_name} with {opt_name}" + (" (remat)" if remat
             else "") + (f" clip {clip}" if clip else ""))  # fmt: skip
    for k, err in errors.items():
        assert err <= tol[k], f"{where}: max |{k} − reference| = {err:.3e} > {tol[k]:.0e}"
    for (path, start), end in zip(jax.tree_util.tree_leaves_with_path(params),
                                  jax.tree.leaves(ref_params), strict=True):  # fmt: skip
        moved = float(np.max(np.abs(np.asarray(end) - np.asarray(start))))
        assert moved >= MIN_MOVE * tol["params"], (
            f"{jax.tree_util.keystr(path)} moved only {moved:.2e} in {STEPS} steps: the check "
            f"could not see a zeroed or doubled gradient"
        )
    key = (f"{model.name.split()[0]} {strategy}" + ("+remat" if remat else ""), mesh_name,
           opt_name)  # fmt: skip
    old = GPT_ERRORS.get(key, {})
    GPT_ERRORS[key] = {k: max(v, old.get(k, 0.0)) for k, v in errors.items()}
    return errors


def _clipped(grads, norm: float, clip: float | None):
    """``grads`` as optax's ``clip_by_global_norm(clip)`` passes them on, given their norm."""
    if clip is None or norm < clip:
        return grads
    return jax.tree.map(lambda g: np.float64(g) * (clip / norm), grads)


def check_budget(setup, compiled, batch_shape, case=None) -> None:
    """The compiled train step moves exactly the bytes of the budget traced from it per
    (kind, axes); where ``case`` has a hand-written budget (``_lm_budgets.EXPECTED``), the
    traced step and the compiled one also equal it (the traced budget alone cannot see a
    change to the step: it is read from that step)."""
    totals: dict = {}
    for c in shardops.inspect.collectives(setup.mesh, compiled):
        if c.bytes:
            totals[(c.kind, c.axes)] = totals.get((c.kind, c.axes), 0) + c.bytes
    expected = setup.collective_budget(*batch_shape)
    assert totals == expected, (
        f"GPT {setup.strategy.name} on {dict(setup.mesh.shape)}: compiled collectives {totals} "
        f"!= the traced budget {expected}"
    )
    if case in EXPECTED:
        check_hand_budget(case, setup, compiled, batch_shape)
