"""Mutants of the traced reader (``shardops/inspect/_traced.py``): each is caught by a test of
``test_traced.py`` run against the mutant."""

import pytest
import test_traced
from _mutants import mutant

import shardops
from shardops.inspect import _traced

MUTANTS = {
    # The pass read from the equation's own name stack, not its enclosing programs': remat's
    # re-gather (inside the backward's remat) counted as forward.
    "pass_without_the_enclosing_stack": (
        "            here = _join(stack, str(eqn.source_info.name_stack))\n",
        "            here = str(eqn.source_info.name_stack)\n",
        "test_remat_recomputation_is_counted_in_the_backward",
    ),
    # Dead collectives kept: jax.grad's unused forward loss psum counted.
    "dead_code_kept": (
        "    if not jaxpr.eqns:\n        return jaxpr\n",
        "    return jaxpr\n",
        "test_passes_are_read_from_the_name_stack",
    ),
    # A scan's body counted once.
    "scan_counted_once": (
        '                repeat = times * int(eqn.params.get("length", 1)) if name == "scan" else times\n',
        "                repeat = times\n",
        "test_a_scan_counts_its_body_length_times_and_nested_jits_are_entered",
    ),
    # bf16 collectives assumed to run in bf16 on XLA:CPU.
    "bf16_as_asked_on_cpu": (
        "        shapes = tuple((table.get(d, d), s) for d, s in c.shapes)\n",
        "        shapes = c.shapes\n",
        "test_a_bf16_program_asks_for_bf16_and_xla_cpu_runs_it_in_f32",
    ),
    # A cond's branches all counted.
    "cond_branches_summed": (
        "        self.found.extend(seen[0])\n",
        "        self.found.extend(seen[0] + seen[1])\n",
        "test_a_cond_counts_once_and_differing_branches_are_refused",
    ),
    # Axes of size 1 kept in the key.
    "size_one_axes_kept": (
        "        axes = tuple(a for a in self.axis_names if a in named and self.sizes[a] > 1)\n",
        "        axes = tuple(a for a in self.axis_names if a in named)\n",
        "test_axes_of_size_one_move_nothing",
    ),
}


def run(monkeypatch, name, replacement):
    line, new, test = MUTANTS[name]
    bad = mutant(_traced, name, line, new if replacement else line)
    monkeypatch.setattr(test_traced, "traced_ledger", bad.traced_ledger)
    fn = getattr(test_traced, test)
    args = () if test == "test_axes_of_size_one_move_nothing" else (
        shardops.make_mesh(test_traced.SHAPE),)  # fmt: skip
    fn(*args)


@pytest.mark.parametrize("name", MUTANTS)
def test_unmutated_copy_passes(monkeypatch, name):
    run(monkeypatch, name, replacement=False)


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(monkeypatch, name):
    with pytest.raises(AssertionError):
        run(monkeypatch, name, replacement=True)
