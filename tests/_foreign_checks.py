"""The check a foreign module (Flax NNX, Equinox) passes under a strategy: trained by shardops,
it follows the same module trained by its own framework, unsharded (tests/_flax_checks.py,
tests/_equinox_checks.py give the modules, their batches and their framework's run)."""

import jax
import numpy as np
from _gpt_checks import check_budget, optimizer
from _model_checks import TRAJECTORY_ERRORS, mesh_for

import shardops_models as models


def train(model, mesh: dict | None, opt_name: str, batches, sgd_lr: float, budget: bool = False,
          strategy: str = "ref", **options):  # fmt: skip
    """Losses, SGD's gradients as each step applied them ((p_t − p_t+1) / lr; none for Adam)
    and the final parameters of ``model`` trained by shardops under ``strategy`` on ``mesh``
    over ``batches`` (``(xs, ys)``, a step each); ``budget``: the traced budget is held to
    the compiled step's collectives first."""
    setup = models.build(strategy, mesh_for(mesh), model=model,
                         optimizer=optimizer(opt_name, sgd_lr=sgd_lr), **options)  # fmt: skip
    state = setup.shard(model.init(jax.random.key(0)))
    xs, ys = batches
    step = setup.train_step.lower(state, *setup.place_batch(xs[0], ys[0])).compile()
    if budget:
        check_budget(setup, step, xs.shape[1:])
    losses, grads, before = [], [], setup.gather(state.params)
    for x, y in zip(xs, ys, strict=True):
        state, loss = step(state, *setup.place_batch(x, y))
        losses.append(float(loss))  # one step in flight
        if opt_name == "sgd":
            after = setup.gather(state.params)
            grads.append(jax.tree.map(lambda p, q: (np.float64(p) - q) / sgd_lr, before, after))
            before = after
    return np.array(losses), grads, setup.gather(state.params)


def check_trains_like(model, trained, reference, tol: dict, min_move: float, report_key) -> None:
    """``trained`` (``train``'s losses, SGD gradients and parameters) against ``reference``
    (the framework's own run: the same three): the losses, each step's SGD gradients (read back
    from the step: rounding ulp(p) / lr ≤ 2.4e-7 at |p| ≤ 1; Adam's are seen through its
    parameters) and the final parameters within ``tol``, every parameter moving ``min_move`` ×
    its bound (a zeroed or dropped gradient cannot hide under it); the worst errors go to the
    run's report under ``report_key``."""
    (losses, grads, params), (ref_losses, ref_grads, ref_params) = trained, reference
    where = f"{model.name}: {report_key}"
    grad_errors = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for g, r in zip(grads, ref_grads, strict=False)
                   for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r), strict=True)]  # fmt: skip
    errors = {"loss": float(np.max(np.abs(losses - ref_losses))),
              "grads": max(grad_errors, default=0.0), "params": 0.0}  # fmt: skip
    assert errors["grads"] <= tol["grads"], (where, errors)
    assert errors["loss"] <= tol["loss"], (where, losses, ref_losses)
    start = model.init(jax.random.key(0))
    for (path, p), q, p0 in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree.leaves(ref_params), jax.tree.leaves(start),
                                strict=True):  # fmt: skip
        err = float(np.max(np.abs(np.asarray(p) - np.asarray(q))))
        assert err <= tol["params"], f"{where}: {jax.tree_util.keystr(path)} off by {err:.2e}"
        moved = float(np.max(np.abs(np.asarray(q) - np.asarray(p0))))
        assert moved >= min_move * tol["params"], f"{jax.tree_util.keystr(path)} moved {moved}"
        errors["params"] = max(errors["params"], err)
    old = TRAJECTORY_ERRORS.get(report_key, {})  # the run's report: the worst errors seen
    TRAJECTORY_ERRORS[report_key] = {k: max(v, old.get(k, 0.0)) for k, v in errors.items()}


def report_key(label: str, strategy: str, mesh: dict | None, opt_name: str) -> tuple:
    return (f"{label} {strategy}", "x".join(map(str, mesh.values())) if mesh else "1", opt_name)


def check_checkpoint(model, strategies: dict, batches, module_type: str, run_module, tmp_path,
                     steps: int = 1):  # fmt: skip
    """A checkpoint of ``model`` trained ``steps`` steps under 2d restores under fsdp bit for bit
    (recording the module's class, ``module_type``), and into the framework's own module
    (``model.module``), whose logits, ``run_module(module, ids)``, are the sharded run's.
    ``strategies``: the meshes by strategy; ``batches``: ``(xs, ys)``."""
    from shardops_models.training.checkpoint import Checkpoints

    xs, ys = batches
    saved = models.build("2d", mesh_for(strategies["2d"]), model=model,
                         optimizer=optimizer("adam"))  # fmt: skip
    state = saved.shard(model.init(jax.random.key(0)))
    for x, y in zip(xs[:steps], ys[:steps], strict=True):
        state, loss = saved.train_step(state, *saved.place_batch(x, y))
        float(loss)  # one step in flight
    with Checkpoints(tmp_path) as ckpt:
        ckpt.save(steps, saved, state)
    fsdp = models.build("fsdp", mesh_for(strategies["fsdp"]), model=model,
                        optimizer=optimizer("adam"))  # fmt: skip
    with Checkpoints(tmp_path) as ckpt:
        restored, _ = ckpt.restore(fsdp)
        assert ckpt.record()["model"]["config"]["module_type"] == module_type
    params = fsdp.gather(restored.params)
    for a, b in zip(jax.tree.leaves(saved.gather(state.params)), jax.tree.leaves(params),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    module = model.module(params)
    sharded = saved.logits(state.params, saved.place_batch(xs[steps], ys[steps])[0])
    np.testing.assert_allclose(run_module(module, xs[steps]), sharded, atol=1e-5, rtol=0)
    return module, params
