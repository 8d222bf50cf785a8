"""Mutation check for the strategies: bugs injected into a copy of models/_train.py are caught
by the same trajectory check the suite runs (against an independent reference)."""

import inspect
import sys
import types

import jax
import pytest
from _model_checks import check_trajectory

from models import _train

SOURCE = inspect.getsource(_train)
GRADS = "        loss, grads = jax.value_and_grad(self.local_loss)(params, x, y)\n"
LOCAL_LOSS = (
    "        return cross_entropy_sum(logits, y) / (self._global_batch(x.shape[0]) * y.shape[-1])\n"
)

MUTANTS = {
    "zeroed_layer_gradient": (
        GRADS,
        GRADS + "        grads[0] = jax.tree.map(jnp.zeros_like, grads[0])\n",
    ),
    "doubled_layer_gradient": (
        GRADS,
        GRADS + "        grads[-1] = jax.tree.map(lambda g: 2 * g, grads[-1])\n",
    ),
    # The gradient trap: autodiff already reduced the gradients over data.
    "extra_psum_over_data": (GRADS, GRADS + "        grads = lax.psum(grads, 'data')\n"),
    "loss_averaged_locally": (
        LOCAL_LOSS,
        LOCAL_LOSS.replace("self._global_batch(x.shape[0])", "x.shape[0]"),
    ),
}
CASES = [
    ("dp", {"data": 4}),
    ("2d", {"data": 2, "model": 4}),
    ("fsdp", {"data": 4}),
    ("fsdp_tp", {"data": 4, "model": 2}),
]
SIZES = (48, 64, 24, 10)


def mutant_build(old: str, new: str):
    assert SOURCE.count(old) == 1, f"mutated line not found exactly once in _train.py: {old!r}"
    module = types.ModuleType("models._train_mutant")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(SOURCE.replace(old, new), "<mutant of models/_train.py>", "exec"), module.__dict__)
    return module.build


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_unmutated_copy_passes(case):
    build = mutant_build(GRADS, GRADS)
    check_trajectory(*case, "sgd", sizes=SIZES, batch=32, build=build)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(name, case):
    build = mutant_build(*MUTANTS[name])
    with pytest.raises(AssertionError):
        check_trajectory(*case, "sgd", sizes=SIZES, batch=32, build=build)
    jax.clear_caches()
