"""Mutants of the reasons ``explain`` reads (``shardops/comm/_reasons.py``) and of the sentences
it writes (``shardops/inspect/_explain.py``): each is caught by a test of ``test_views.py`` run
against the mutant."""

import pytest
import test_views
from _mutants import mutant

import shardops
from shardops.comm import _reasons
from shardops.inspect import _explain

MUTANTS = {
    # A scope explains collectives over any axes: autodiff's data-parallel reduction traced
    # inside the ring's scope takes the ring's sentence.
    "any_axes": (
        '        if reason is None or set(scope_axes.split(",")) != set(axes):\n',
        "        if reason is None:\n",
        (
            "test_explain_each_kernel_option",
            "row",
            {"reduce": "psum_scatter", "collective_matmul": "ring"},
            ["ppermute over 'model'"],
        ),
    ),
    # Reasons bound to the default axis name: nothing is explained on axes of other names.
    "model_only": (
        '        if reason is None or set(scope_axes.split(",")) != set(axes):\n',
        '        if reason is None or set(scope_axes.split(",")) != set(axes) or "model" not in axes:\n',
        ("test_explain_says_the_same_on_axes_of_any_names", False),
    ),
    # The outermost scope wins.
    "outermost": (
        "    for name, scope_axes in reversed(_SCOPE.findall(op_name)):\n",
        "    for name, scope_axes in _SCOPE.findall(op_name):\n",
        ("test_a_reason_of_your_own",),
    ),
    # Remat's re-gather explained as a first gather.
    "no_remat": (
        '                text += " (again in the backward pass: remat recomputes the forward)"\n',
        "                pass\n",
        ("test_remat_regathers_are_said_to_be_recomputed",),
    ),
    # The backward explained by the forward's sentences.
    "forward_for_both": (
        "        side = self.backward if backward else self.forward\n",
        "        side = self.forward\n",
        (
            "test_explain_each_kernel_option",
            "row",
            {"reduce": "psum_scatter"},
            ["psum_scatter over 'model'", "reduced and scattered", "each device needs all of dy"],
        ),
    ),
}


def run(monkeypatch, name, replacement):
    line, new, (test, *args) = MUTANTS[name]
    bad = mutant(_reasons, name, line, new if replacement else line)
    bad._REGISTRY = _reasons._REGISTRY  # the kernels' reasons, read by the mutant
    monkeypatch.setattr(shardops.inspect._explain, "reason_for", bad.reason_for)
    monkeypatch.setattr(_reasons.Reason, "sentence", bad.Reason.sentence)
    fn = getattr(test_views, test)
    if test == "test_explain_each_kernel_option":
        fn(*args, traced=True)
    else:
        fn(*args)


@pytest.mark.parametrize("name", MUTANTS)
def test_unmutated_copy_passes(monkeypatch, name):
    run(monkeypatch, name, replacement=False)


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(monkeypatch, name):
    with pytest.raises(AssertionError):
        run(monkeypatch, name, replacement=True)


# Mutants of the sentence itself: each caught by the exact sizes and reasons of
# test_views.test_explain_says_each_size_and_each_reason_exactly.
SENTENCE_MUTANTS = {
    # kilo- and mega- as powers of ten: 3072 B said as 3.1 KiB
    "decimal_units": (
        '    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):\n',
        '    for unit, scale in (("MiB", 10**6), ("KiB", 10**3)):\n',
    ),
    # the wrong unit's name
    "unit_named_kb": (
        '    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):\n',
        '    for unit, scale in (("MiB", 2**20), ("kB", 2**10)):\n',
    ),
    # the decimal dropped: 1.1 KiB said as 1 KiB
    "no_decimal": (
        '            return f"{nbytes / scale:.1f} {unit}"\n',
        '            return f"{nbytes / scale:.0f} {unit}"\n',
    ),
    # a reason said once per tuple element
    "reason_repeated": (
        "        if text not in found:\n",
        "        if True:\n",
    ),
    # only the first element's reason said
    "reason_dropped": (
        '    return "; and ".join(found)\n',
        "    return found[0]\n",
    ),
}


def run_sentence(monkeypatch, name, replacement):
    line, new = SENTENCE_MUTANTS[name]
    bad = mutant(_explain, name, line, new if replacement else line)
    monkeypatch.setattr(_explain, "sentence", bad.sentence)
    test_views.test_explain_says_each_size_and_each_reason_exactly()


@pytest.mark.parametrize("name", SENTENCE_MUTANTS)
def test_unmutated_sentence_copy_passes(monkeypatch, name):
    run_sentence(monkeypatch, name, replacement=False)


@pytest.mark.parametrize("name", SENTENCE_MUTANTS)
def test_sentence_mutant_is_caught(monkeypatch, name):
    with pytest.raises(AssertionError):
        run_sentence(monkeypatch, name, replacement=True)
