"""The covering designs the default run uses (``tests/_cover.py``): every pair (or value) of the
factors appears, fewer cases than the product, and the full product under the switch."""

import itertools

import pytest
from _cover import cover, cover_meshes, covered
from hypothesis import given
from hypothesis import strategies as st

factor_sizes = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@given(factor_sizes)
def test_every_pair_of_values_appears(sizes):
    factors = [[f"{i}.{v}" for v in range(n)] for i, n in enumerate(sizes)]
    cases = cover(*factors, full=False)
    t = min(2, len(factors) - 1) or 1
    assert covered(cases, *factors, t=t)
    assert set(cases) <= set(itertools.product(*factors))
    assert len(set(cases)) == len(cases)


def test_fewer_cases_than_the_product():
    strategies = ["dp", "tp", "2d", "fsdp", "fsdp_tp", "sp", "dp_sp", "fsdp_sp"]
    meshes = ["1x8", "2x4", "4x2", "8x1"]
    policies = ["f32", "mixed", "bf16"]
    cases = cover(strategies, meshes, policies, full=False)
    assert covered(cases, strategies, meshes, policies, t=2)
    assert len(cases) <= 40 < 8 * 4 * 3
    two = cover(strategies, meshes, full=False)
    assert covered(two, strategies, meshes, t=1) and len(two) == 8


def test_a_constraint_keeps_only_valid_cases_and_covers_their_pairs():
    strategies, meshes, opts = ["dp", "tp", "2d"], ["data8", "model8", "4x2"], ["sgd", "adam"]
    axes = {"dp": {"data8", "4x2"}, "tp": {"model8", "4x2"}, "2d": {"4x2"}}

    def valid(s, m, o):
        return m in axes[s]

    cases = cover(strategies, meshes, opts, full=False, valid=valid)
    assert all(valid(*c) for c in cases)
    assert covered(cases, strategies, meshes, opts, t=2, valid=valid)
    assert not covered(cases[1:], strategies, meshes, opts, t=2, valid=valid)


def test_the_full_switch_is_the_product_in_order():
    assert cover([1, 2], "ab", [True, False], full=True) == list(
        itertools.product([1, 2], "ab", [True, False])
    )


def test_a_missing_pair_is_seen():
    assert not covered([(1, "a"), (2, "b")], [1, 2], "ab", t=2)


def test_an_empty_factor_is_an_error():
    with pytest.raises(ValueError, match="at least one value"):
        cover([1, 2], [])


def test_meshes_as_a_data_and_a_model_factor():
    meshes = [(1,), (2,), (4,), (8,), (1, 8), (2, 4), (4, 2), (8, 1)]
    options = ["a", "b", "c", "d", "e", "f"]
    cases = cover_meshes(meshes, options, full=False)
    assert {m for m, _ in cases} == set(meshes)
    model = {m: s[-1] for m in meshes for s in [m]}
    data = {m: (None if len(m) == 1 else m[0]) for m in meshes}
    assert {(model[m], o) for m, o in cases} == {(p, o) for p in (1, 2, 4, 8) for o in options}
    assert {(data[m], o) for m, o in cases} == {(d, o) for d in (None, 1, 2, 4, 8) for o in options}
    assert len(cases) < len(meshes) * len(options)
    assert cover_meshes(meshes, options, full=True) == [(m, o) for m in meshes for o in options]
