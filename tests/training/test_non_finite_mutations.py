"""Mutants of the non-finite stop: of ``models/training/loop.py`` (``NonFiniteGuard``), each
caught by a check of ``test_non_finite_guard.py``, and of ``shardops/inspect/_locate.py``
(``first_non_finite``), each caught by a check of ``test_first_non_finite.py``."""

import pytest
import test_first_non_finite as locating
import test_non_finite_guard as guarding
from _mutants import mutant

from shardops.inspect import _locate
from shardops_models.training import loop

REPORTED = "            result.step, float(jax.device_get(result.loss)),\n"
CHECKED = "        if loss_finite and params_finite.all():\n"
KEPT = "        super().add(_Step(int(step), loss, flags, self._before.pop(step, None)))\n"
LOOP_MUTANTS = {
    # The step named is the one being added when the bad one is found (n + limit).
    "step_when_found": (REPORTED, REPORTED.replace("result.step", "self._last"), "skipped_update"),
    # Off by one: the flags of the parameters after step n taken for step n + 1's.
    "step_after": (REPORTED, REPORTED.replace("result.step", "result.step + 1"), "skipped_update"),
    # The loss is not read: a NaN loss whose update the optimizer skips runs on.
    "loss_unchecked": (CHECKED, "        if params_finite.all():\n", "skipped_update"),
    # The parameters are not read: a NaN gradient under a finite loss is found a step late.
    "params_unchecked": (CHECKED, "        if loss_finite:\n", "nan_gradient"),
    # Nothing waited for until drain: the run trains on past the bad step.
    "unbounded": (
        "        super().__init__(limit)\n",
        "        super().__init__(limit + 100)\n",
        "skipped_update",
    ),
    # After raising, the next step runs.
    "continues": (
        "        if self.error is not None:  # no step runs past the first bad one\n",
        "        if False:\n",
        "skipped_update",
    ),
    # The replay starts from the parameters after the step, not before it: a NaN in one row
    # of the batch has spread to every row's output of the first layer.
    "replay_after": (
        KEPT,
        KEPT.replace(
            "self._before.pop(step, None)", "(_copy(state.params), *self._before.pop(step)[1:])"
        ),
        "nan_batch",
    ),
    # No copy kept: the train step donates the parameters the replay needs.
    "no_copy": (
        "            params = _copy(state.params)  # async, on their devices, laid out as they are\n",
        "            params = state.params\n",
        "nan_weight",
    ),
}
LOCATE_MUTANTS = {
    # Outputs read from the last layer: the layers a NaN spreads to are named, not its first.
    "outputs_last_first": (
        "    values = [(OUTPUT, n, session.value(n, OUTPUT)[0]) for n in layers]  # forward order\n",
        "    values = [(OUTPUT, n, session.value(n, OUTPUT)[0]) for n in reversed(layers)]\n",
        "forward_order",
    ),
    # Gradients read from the input: the far end of a backward NaN is named.
    "gradients_input_first": (
        "    values += [(GRADIENT, n, session.value(n, GRADIENT)[0]) for n in reversed(layers)]\n",
        "    values += [(GRADIENT, n, session.value(n, GRADIENT)[0]) for n in layers]\n",
        "backward_order",
    ),
    # The loss is not read: an inf loss from finite layers is blamed on a gradient.
    "loss_unchecked": ("    values.append((LOSS, LOSS, loss))\n", "    pass\n", "loss"),
    # The parameter gradients are not read.
    "params_unchecked": (
        "               for path, g in jax.tree_util.tree_leaves_with_path(grads)]  # fmt: skip\n",
        "               for path, g in []]\n",
        "param",
    ),
}


@pytest.mark.parametrize("check", sorted({c for *_, c in LOOP_MUTANTS.values()}))
def test_unmutated_loop_copy_passes(check):
    getattr(guarding, f"check_{check}")(mutant(loop, "copy", CHECKED, CHECKED))


@pytest.mark.parametrize("name", LOOP_MUTANTS)
def test_loop_mutant_is_caught(name):
    line, new, check = LOOP_MUTANTS[name]
    with pytest.raises(AssertionError):
        getattr(guarding, f"check_{check}")(mutant(loop, name, line, new))


@pytest.mark.parametrize("name", LOCATE_MUTANTS)
def test_locate_mutant_is_caught_and_its_unmutated_copy_passes(name):
    line, new, check = LOCATE_MUTANTS[name]
    getattr(locating, f"check_{check}")(mutant(_locate, f"{name}_copy", line, line))
    with pytest.raises(AssertionError):
        getattr(locating, f"check_{check}")(mutant(_locate, name, line, new))
