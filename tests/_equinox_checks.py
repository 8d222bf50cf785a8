"""Equinox modules as their authors write them (an MLP here; examples/equinox_gpt.py's GPT),
Equinox's own unsharded run of each, and the check that ``EquinoxModel`` trains them alike
(tests/interop/test_equinox.py)."""

import functools
import pathlib
import sys

import _foreign_checks
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _gpt_checks import TOL, optimizer

from shardops_models.interop.equinox import EquinoxModel

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
import equinox_gpt

STEPS, BATCH, SEQ, SGD_LR, MIN_MOVE = 5, 16, 16, 0.5, 100
CONFIG = equinox_gpt.Config()
VOCAB, HEADS, ROLES = CONFIG.vocab_size, CONFIG.num_heads, equinox_gpt.ROLES
# The loss bound: Equinox and shardops sum in other orders (float32), as for Flax's modules.
TOL = {opt: {**bounds, "loss": 8e-6} for opt, bounds in TOL.items()}


class Mlp(eqx.Module):
    """LayerNorm, then Linear → ReLU → Linear, on one example ``x[24]``."""

    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(24, eps=1e-3)
        self.up = eqx.nn.Linear(24, 64, key=k1)
        self.down = eqx.nn.Linear(64, 8, key=k2)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(self.norm(x))))


MLP_ROLES = {"up": "column", "down": "row"}


class MapMlp(Mlp):
    """The MLP calling its layers outside the loss's vmap too: in ``lax.map`` over two views of
    the example, and on a constant."""

    def __call__(self, x):
        h = jax.lax.map(lambda t: jax.nn.relu(self.up(self.norm(t))), jnp.stack([x, 0.5 * x]))
        return self.down(h.sum(0) - jax.nn.relu(self.up(jnp.zeros(24))))


def Gpt(key):
    return equinox_gpt.Gpt(CONFIG, key)


MAKE = {"mlp": Mlp, "mlp-map": MapMlp, "gpt": Gpt}


def equinox_model(name: str, module=None) -> EquinoxModel:
    cls = EquinoxModel if module is None else module.EquinoxModel
    if name.startswith("mlp"):
        return cls(MAKE[name], roles=MLP_ROLES, task="classify", name="equinox mlp",
                   example_shape=(24,))  # fmt: skip
    return cls(Gpt, roles=ROLES, name="equinox gpt", num_heads=HEADS)


def batches(name: str):
    rng = np.random.default_rng(1)
    if name.startswith("mlp"):
        xs = rng.normal(size=(STEPS, BATCH, 24)).astype(np.float32)
        return xs, rng.integers(0, 8, (STEPS, BATCH)).astype(np.int32)
    tokens = rng.integers(0, VOCAB, (STEPS, BATCH, SEQ + 1)).astype(np.int32)
    return tokens[..., :-1], tokens[..., 1:]


def _params_of(module) -> dict:
    """``EquinoxModel.init``'s dict of a module's parameters."""
    params = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        eqx.filter(module, eqx.is_inexact_array)
    )[0]:
        keys = [getattr(k, "name", getattr(k, "idx", None)) for k in path]
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = leaf
    return params


@functools.cache
def equinox_trajectory(name: str, opt_name: str):
    """Losses, each step's gradients and the final parameters of the module trained by
    Equinox alone, unsharded (``eqx.filter_jit``, optax)."""
    module = MAKE[name](jax.random.key(0))
    opt = optimizer(opt_name, sharded=False, sgd_lr=SGD_LR)
    state = opt.init(eqx.filter(module, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(module, state, x, y):
        def loss(module):
            logits = jax.vmap(module)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = eqx.filter_value_and_grad(loss)(module)
        updates, state = opt.update(grads, state, eqx.filter(module, eqx.is_inexact_array))
        return eqx.apply_updates(module, updates), state, value, grads

    losses, grads = [], []
    for x, y in zip(*batches(name), strict=True):
        module, state, loss, g = step(module, state, x, y)
        losses.append(float(loss))
        grads.append(_params_of(g))
    return np.array(losses), grads, _params_of(module)


STRATEGIES = {"ref": None, "dp": {"data": 8}, "fsdp": {"data": 8}, "zero1": {"data": 8},
              "tp": {"data": 1, "model": 2}, "2d": {"data": 4, "model": 2},
              "fsdp_tp": {"data": 4, "model": 2},
              "hsdp_tp": {"replica": 2, "data": 2, "model": 2}}  # fmt: skip


def check_trains_like_equinox(model, name: str, strategy: str, opt_name: str, budget=False):
    """``model`` under ``strategy`` trains like Equinox trains the module ``name``."""
    mesh = STRATEGIES[strategy]
    trained = _foreign_checks.train(model, mesh, opt_name, batches(name), SGD_LR, budget,
                                    strategy=strategy)  # fmt: skip
    _foreign_checks.check_trains_like(model, trained, equinox_trajectory(name, opt_name),
                                      TOL[opt_name], MIN_MOVE,
                                      _foreign_checks.report_key(f"eqx {name}", strategy, mesh,
                                                                 opt_name))  # fmt: skip
