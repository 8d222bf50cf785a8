"""Mutation check for the literal layout and cost tests: bugs injected into copies of
models/strategies/fsdp.py (the FSDP rule) and shardops/inspect/_ledger.py (the ring formulas) are caught by the
checks test_layouts.py and test_ledger.py run (``_layout_checks``); bugs in the search's cost
counts (models/search/_program_cost.py, models/search/_search.py, models/search/_hardware.py) by the checks
test_search.py runs (``_search_checks``).

Each mutant replaces one exact line of the real source (asserted to occur exactly once, so a
mutant cannot drift from the code). The mutated functions are swapped in wherever a module of
``models`` or ``shardops`` holds them (the strategies import ``with_fsdp``, ``tp_specs`` … by
name; the ledger and ``Setup.cost_model`` both call ``ring_bytes``). The first mutant moves the
same bytes and computes the same numbers in another layout: the comparison of the ledger with
the strategies' own budget, which the suite used to make, passes under it; the literal layout
table does not.
"""

import inspect
import sys
import types

import jax
import pytest
from _layout_checks import (
    BUDGETS,
    LAYOUTS,
    SEED,
    SHARD_INDICES,
    budget_run,
    build_setup,
    check_adam_layout,
    check_layout,
    check_ledger_budget,
    check_model_budget,
    check_ring_formulas,
    check_shard_indices,
    ledger_of_step,
)
from _search_checks import (
    check_flop_rates,
    check_loop_flops,
    check_peak_keeps_outputs_and_arguments,
)

import shardops_models.search
from shardops.inspect import _ledger
from shardops_models.search import _hardware, _program_cost
from shardops_models.strategies import fsdp as _fsdp_rule
from shardops_models.strategies import zero1 as _zero1

FREE_FIRST = "    for d in free + split:\n"
LARGEST_FREE = "                  key=lambda d: -shape[d])  # fmt: skip\n"
DATA_MINOR = "            entries[d] = spec_entry(*entry_axes(entries[d]), *axes)\n"

# name → (old line, new line, a layout case and a shard-index case that must catch it)
LAYOUT_MUTANTS = {
    # FSDP prefers a model-split dimension: fsdp_tp's column w1 becomes w[D, F_(model,data)]
    # (and 2×4's row w2 w[F_(model,data), D]): same bytes, same numbers, another layout.
    "fsdp_prefers_model_split_dim": (
        FREE_FIRST,
        "    for d in split + free:\n",
        ("fsdp_tp", "4x2", SEED),
        ("fsdp_tp", "4x2", SEED, 0, "w"),
    ),
    # FSDP splits the smallest free dimension: fsdp's w1[784, 512] becomes w[D, F_data].
    "fsdp_smallest_free_dim": (
        LARGEST_FREE,
        LARGEST_FREE.replace("-shape[d]", "shape[d]"),
        ("fsdp", "data8", SEED),
        ("fsdp", "data8", SEED, 0, "w"),
    ),
    # data as the major axis on a model-split dimension: b1[512_(data,model)], whose AllGather
    # over data no longer rebuilds a model shard.
    "fsdp_data_major_on_model_split_dim": (
        DATA_MINOR,
        DATA_MINOR.replace("*entry_axes(entries[d]), *axes", "*axes, *entry_axes(entries[d])"),
        ("fsdp_tp", "4x2", SEED),
        ("fsdp_tp", "4x2", SEED, 0, "b"),
    ),
}

ALL_REDUCE = "        return 2 * nbytes * (n - 1) / n\n"
OTHERS = "    return nbytes * (n - 1) / n\n"

# name → (old line, new line, a budget case that must catch it)
RING_MUTANTS = {
    "all_reduce_without_factor_2": (ALL_REDUCE, "        return nbytes * (n - 1) / n\n", ("dp", "data8", False)),
    # AllGather, ReduceScatter and AllToAll charged V instead of V·(N−1)/N.
    "gather_scatter_all_to_all_send_V": (OTHERS, "    return float(nbytes)\n", ("fsdp", "data8", False)),
}  # fmt: skip


def load_mutant(module: types.ModuleType, old: str, new: str, monkeypatch) -> types.ModuleType:
    source = inspect.getsource(module)
    assert source.count(old) == 1, (
        f"mutated line not found exactly once in {module.__name__}: {old!r}"
    )
    mutant = types.ModuleType(f"{module.__name__}_mutant")
    monkeypatch.setitem(sys.modules, mutant.__name__, mutant)  # dataclasses look their module up
    code = compile(source.replace(old, new), f"<mutant of {module.__name__}>", "exec")
    exec(code, mutant.__dict__)
    return mutant


def swap(monkeypatch, module, mutant, names=None) -> None:
    """Every function of ``module`` (or those in ``names``), wherever a module of ``models`` or
    ``shardops`` holds it by name, becomes the mutant's."""
    names = names or [
        n for n, f in vars(module).items()
        if inspect.isfunction(f) and f.__module__ == module.__name__
    ]  # fmt: skip
    for name in names:
        original = getattr(module, name)
        for held_by in list(sys.modules.values()):
            if (
                isinstance(held_by, types.ModuleType)
                and held_by.__name__.split(".")[0] in ("shardops_models", "shardops")
                and not held_by.__name__.endswith("_mutant")
                and getattr(held_by, name, None) is original
            ):
                monkeypatch.setattr(held_by, name, getattr(mutant, name))
    jax.clear_caches()  # drop programs traced with the real functions


@pytest.fixture
def clear():
    yield
    jax.clear_caches()


def self_referential_budget_check(led, setup) -> None:
    """The comparison the suite used to make: the ledger against the strategy's own budget and
    ``cost_model``, both derived from the same specs and the same ``ring_bytes``."""
    assert led.totals() == setup.collective_budget(256)
    model = setup.cost_model(256)
    assert led.ring_bytes().keys() == model.keys()
    for axes, sent in led.ring_bytes().items():
        assert sent == pytest.approx(model[axes], rel=1e-12)


FSDP_LAYOUTS = [case for case in LAYOUTS if case[0] in ("fsdp", "fsdp_tp")]
FSDP_INDICES = [case for case in SHARD_INDICES if case[0] in ("fsdp", "fsdp_tp")]


def held_by_the_strategies(name: str) -> set[str]:
    """The modules the strategies' kinds take ``name`` from: fsdp's layout, zero1's optimizer
    layout (``models.strategies.fsdp``, ``zero1``)."""
    return {getattr(module, name).__module__ for module in (_fsdp_rule, _zero1)}


def test_unmutated_copies_pass(monkeypatch, clear):
    """The harness itself causes no failure: the copies without a mutation pass every check."""
    runs = {case: budget_run(*case) for case in BUDGETS}  # compiled with the real code
    swap(monkeypatch, _fsdp_rule, load_mutant(_fsdp_rule, FREE_FIRST, FREE_FIRST, monkeypatch))
    swap(monkeypatch, _ledger, load_mutant(_ledger, OTHERS, OTHERS, monkeypatch), ["ring_bytes"])
    assert held_by_the_strategies("with_fsdp") == {"shardops_models.strategies.fsdp_mutant"}
    for case in FSDP_LAYOUTS:
        check_layout(*case)
    for case in FSDP_INDICES:
        check_shard_indices(*case)
    check_adam_layout()
    check_ring_formulas()
    for case, (setup, led) in runs.items():
        check_ledger_budget(case, led)
        check_model_budget(case, setup)
    # A program compiled with the copied layout functions moves the same bytes.
    setup = build_setup("fsdp_tp", "4x2", SEED)
    check_ledger_budget(("fsdp_tp", "4x2", False), ledger_of_step(setup))


@pytest.mark.parametrize("name", LAYOUT_MUTANTS)
def test_layout_mutant_is_caught(monkeypatch, clear, name):
    old, new, layout_case, index_case = LAYOUT_MUTANTS[name]
    swap(monkeypatch, _fsdp_rule, load_mutant(_fsdp_rule, old, new, monkeypatch))
    with pytest.raises(AssertionError):
        check_layout(*layout_case)
    with pytest.raises(AssertionError):
        check_shard_indices(*index_case)


def test_same_bytes_other_layout_passes_the_budget_but_not_the_layout_table(monkeypatch, clear):
    """The hole was real: a layout bug that moves the same bytes passes every budget check
    (with every weight gathered; the per-layer route choice would change the bytes too)."""
    old, new, layout_case, _ = LAYOUT_MUTANTS["fsdp_prefers_model_split_dim"]
    swap(monkeypatch, _fsdp_rule, load_mutant(_fsdp_rule, old, new, monkeypatch))
    case = ("fsdp_tp", "4x2", False, "gather_weights")
    # built and compiled anew, not budget_run's
    setup = build_setup("fsdp_tp", "4x2", SEED, fsdp_dense="gather_weights")
    led = ledger_of_step(setup)
    self_referential_budget_check(led, setup)  # the old test: passes
    check_ledger_budget(case, led)  # even the literal bytes: same bytes
    check_model_budget(case, setup)
    with pytest.raises(AssertionError, match="stored as|param_specs"):
        check_layout(*layout_case)  # only the layout table sees it


@pytest.mark.parametrize("name", RING_MUTANTS)
def test_ring_mutant_is_caught(monkeypatch, name):
    old, new, case = RING_MUTANTS[name]
    setup, led = budget_run(*case)  # compiled with the real code, before the swap
    check_ledger_budget(case, led)
    swap(monkeypatch, _ledger, load_mutant(_ledger, old, new, monkeypatch), ["ring_bytes"])
    with pytest.raises(AssertionError):
        check_ring_formulas()
    with pytest.raises(AssertionError, match="ledger: .*ring bytes"):
        check_ledger_budget(case, led)  # Ledger.ring_bytes() → the mutant
    with pytest.raises(AssertionError, match="cost_model: .*ring bytes"):
        check_model_budget(
            case, setup
        )  # Setup.cost_model → shardops.inspect.ring_bytes → the mutant


# --- the search's cost counts: mutants of models/search/_program_cost.py, models/search/_search.py and
# models/search/_hardware.py, each caught by a check that tests/search/test_search.py runs (_search_checks).

REPEAT = '                repeat = times * int(eqn.params.get("length", 1))\n'
FREED = "            if b is not None and last_use.get(b, -1) <= i and b not in outputs and b not in kept:\n"
RATE = "    compute = (cost.flops / hw.flops_for(_dtype_name(precision.compute_dtype))\n"
FLOPS_FOR = '        return self.flops.get(dtype_name, self.flops.get("float32", min(self.flops.values())))\n'

# name → (module, old line, new line, the check that must catch it)
COST_MUTANTS = {
    # A loop body counted once, as XLA's cost_analysis counts a rolled loop.
    "loop_body_counted_once": (_program_cost, REPEAT, "                repeat = times\n", "loops"),
    # A nested loop forgets the trips of the loop around it.
    "nested_loop_forgets_the_outer_trips": (
        _program_cost, REPEAT, '                repeat = int(eqn.params.get("length", 1))\n',
        "loops",
    ),
    # Outputs freed after their last use inside the program, as if nobody read them after.
    "outputs_freed_early": (_program_cost, FREED, FREED.replace(" and b not in outputs", ""),
                            "peak"),
    # The caller's arguments freed after their last use, as if every argument were donated.
    "held_arguments_freed_early": (_program_cost, FREED, FREED.replace(" and b not in kept", ""),
                                   "peak"),
    # Donation never reaches a shard_map body: its blocks of the donated state stay live.
    "donation_stops_at_shard_map": (_program_cost, "                yield sub, inner\n",
                                    "                yield sub, [True] * len(sub.invars)\n",
                                    "peak"),
    # A donated argument the program reads again after the shard_map freed inside it.
    "donated_but_read_again_freed": (
        _program_cost, "            isinstance(v, Literal) or outer.get(v, True) or last_use[v] > i\n",
        "            isinstance(v, Literal) or outer.get(v, True)\n", "peak",
    ),
    # The matmul rate of the param dtype (float32 under the mixed policy), not the compute dtype.
    "flop_rate_of_the_param_dtype": (
        shardops_models.search._search, RATE, RATE.replace("precision.compute_dtype", "precision.param_dtype"),
        "rates",
    ),
    # Every dtype timed at the float32 rate.
    "flop_rate_always_float32": (
        _hardware, FLOPS_FOR, '        return self.flops.get("float32", min(self.flops.values()))\n',
        "rates",
    ),
}  # fmt: skip


def cost_check(check: str, module) -> None:
    if check == "loops":
        check_loop_flops(module.program_cost)
    elif check == "peak":
        check_peak_keeps_outputs_and_arguments(module.program_cost)
    elif (
        module is shardops_models.search._search
        or module.__name__ == "shardops_models.search._search_mutant"
    ):
        check_flop_rates(predict=module.predict)
    else:
        check_flop_rates(hardware_cls=module.Hardware)


def load_cost_mutant(monkeypatch, module, old, new):
    mutant = load_mutant(module, old, new, monkeypatch)
    if module is _hardware:  # plan.predict takes the mutant's Hardware only through its own check
        swap(monkeypatch, _hardware, mutant, ["hardware_named"])
    return mutant


@pytest.mark.parametrize("name", COST_MUTANTS)
def test_unmutated_cost_copy_passes(monkeypatch, clear, name):
    module, old, _, check = COST_MUTANTS[name]
    cost_check(check, load_cost_mutant(monkeypatch, module, old, old))


@pytest.mark.parametrize("name", COST_MUTANTS)
def test_cost_mutant_is_caught(monkeypatch, clear, name):
    module, old, new, check = COST_MUTANTS[name]
    bad = load_cost_mutant(monkeypatch, module, old, new)  # outside raises: a missing line fails
    with pytest.raises(AssertionError):
        cost_check(check, bad)
