"""Mutation check: known bugs of the vocab-parallel embedding and cross-entropy, injected into a
copy of ``shardops/layers/_embedding.py`` or ``shardops/layers/_cross_entropy.py``, are caught.

Each mutant replaces one exact line of the real source (the test fails unless that line occurs
exactly once, so mutants cannot drift from the code), is loaded as a module, and its layers are
swapped in where the suite's checks look them up (at trace time). The suite's own checks
(``tests/_vocab_checks.py``) must then fail; the unmutated copy, loaded the same way, passes.
"""

import inspect
import types

import jax
import pytest
from _vocab_checks import (
    check_argmax_ties,
    check_cross_entropy,
    check_cross_entropy_dtype_flow,
    check_embedding,
    check_embedding_dtype_flow,
)

import shardops
from shardops.layers import _cross_entropy, _embedding

F32, BF16 = shardops.FLOAT32, shardops.BFLOAT16
PSUM = {"reduce": "psum"}
MODULES = {
    "embedding": (_embedding, ("vocab_parallel_embedding",)),
    "cross_entropy": (_cross_entropy, ("vocab_parallel_cross_entropy", "vocab_parallel_argmax")),
}


def embedding_suite(policy=F32):
    check_embedding((4,), PSUM, policy)  # vocab 50 padded to 52
    check_embedding((2, 4), PSUM, policy, out_of_range=True)  # jit: negative and padding ids
    check_embedding_dtype_flow((2, 4), PSUM, policy)


def cross_entropy_suite(policy=F32, *, scale=100.0):
    check_cross_entropy((4,), policy)  # vocab 50 padded to 52, |logits| ~ 1
    check_cross_entropy((2, 4), policy, scale=scale, seed=1)  # |logits| ~ 100
    check_argmax_ties()
    check_cross_entropy_dtype_flow((2, 4), policy)


MUTANTS = {
    # Out-of-range ids not masked: every device adds its clipped row for every id.
    "embedding_ids_not_masked": (
        "embedding",
        "    found = (local >= 0) & (local < v_local) & (ids < vocab_size)  # [B, S]: here, not padding",
        "    found = jnp.ones(ids.shape, bool)  # [B, S]",
        embedding_suite,
    ),
    # Padding ids (vocab_size ≤ id < padded size, only possible under jit) looked up: the
    # forward is still 0 (zero rows) but the padding rows get a gradient.
    "embedding_padding_rows_looked_up": (
        "embedding",
        "    found = (local >= 0) & (local < v_local) & (ids < vocab_size)  # [B, S]: here, not padding",
        "    found = (local >= 0) & (local < v_local)  # [B, S]",
        embedding_suite,
    ),
    # The rows reduced in bf16: numerically invisible (one nonzero term per element, exactly
    # representable), only the dtype flow sees the bf16 psum.
    "embedding_reduced_in_compute_dtype": (
        "embedding",
        "        x = reduce_from_region(x_partial, axis_name)  # x[B, S, D] in accum",
        "        x = reduce_from_region(x_partial.astype(precision.compute_dtype), axis_name)  # x[B, S, D]",
        lambda: embedding_suite(BF16),
    ),
    # The table's gradient accumulated in bf16 (what plain autodiff of a bf16 gather does).
    "embedding_table_gradient_accumulated_in_bf16": (
        "embedding",
        '    dtable = dtable.at[rows.reshape(-1)].add(g, mode="promise_in_bounds")  # scatter-add in accum',
        "    dtable = dtable.astype(table_kind.dtype).at[rows.reshape(-1)].add(g.astype(table_kind.dtype))",
        lambda: embedding_suite(BF16),
    ),
    # Each device shifts by its own max: the Σexp of different devices are on different scales.
    "cross_entropy_local_max": (
        "cross_entropy",
        "    global_max = all_max(lax.stop_gradient(local_max), axis_name, reason=_LOSS)  # [...]",
        "    global_max = lax.stop_gradient(local_max)  # [...]",
        cross_entropy_suite,
    ),
    # No max subtracted at all: exact algebra, but exp overflows float32 once logits pass ~88.
    "cross_entropy_no_max_subtracted": (
        "cross_entropy",
        "    global_max = all_max(lax.stop_gradient(local_max), axis_name, reason=_LOSS)  # [...]",
        "    global_max = jnp.zeros_like(local_max)  # [...]",
        cross_entropy_suite,
    ),
    # The target logit not masked to its owner: every device adds the column its clipped index
    # points at.
    "cross_entropy_target_not_masked": (
        "cross_entropy",
        "    target = all_reduce(jnp.where(owns, picked, 0.0), axis_name, reason=_LOSS)  # [...]",
        "    target = all_reduce(picked, axis_name, reason=_LOSS)  # [...]",
        cross_entropy_suite,
    ),
    # Padded vocabulary columns leak into the max, Σexp and the gradient.
    "cross_entropy_padding_leaks": (
        "cross_entropy",
        "    logits = jnp.where(real, logits, -jnp.inf)  # [..., V/p], padding −∞",
        "    logits = logits  # [..., V/p]",
        cross_entropy_suite,
    ),
    # The loss computed in the compute dtype (bf16 Σexp, bf16 psums).
    "cross_entropy_in_compute_dtype": (
        "cross_entropy",
        "    logits = logits.astype(precision.accum_dtype)  # [..., V/p] in accum",
        "    logits = logits  # [..., V/p]",
        lambda: cross_entropy_suite(BF16),
    ),
    # Padded columns can win the argmax.
    "argmax_padding_wins": (
        "cross_entropy",
        "    logits = jnp.where(real, logits, -jnp.inf)  # [..., V/p], padding never wins",
        "    logits = logits  # [..., V/p]",
        cross_entropy_suite,
    ),
    # Ties across devices resolved to the last index instead of the first.
    "argmax_last_maximum": (
        "cross_entropy",
        "    return all_min(candidate, axis_name, reason=_ARGMAX)",
        "    return all_max(jnp.where(candidate < p * v_local, candidate, -1), axis_name, reason=_ARGMAX)",
        cross_entropy_suite,
    ),
}


def load(kind: str, old: str, new: str) -> types.ModuleType:
    real, _ = MODULES[kind]
    source = inspect.getsource(real)
    assert source.count(old) == 1, (
        f"mutated line not found exactly once in {real.__name__}: {old!r}"
    )
    module = types.ModuleType(f"{real.__name__}_mutant")
    exec(compile(source.replace(old, new), f"<mutant of {real.__file__}>", "exec"), module.__dict__)
    return module


@pytest.fixture
def swap(monkeypatch):
    def swap_in(kind: str, module: types.ModuleType):
        real, names = MODULES[kind]
        for name in names:
            monkeypatch.setattr(real, name, getattr(module, name))
        jax.clear_caches()  # drop programs traced with the real layers

    yield swap_in
    jax.clear_caches()


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_unmutated_copy_passes(swap, kind):
    """The harness itself causes no failure: a copy loaded the same way passes every suite."""
    line = next(old for k, old, _, _ in MUTANTS.values() if k == kind)
    swap(kind, load(kind, line, line))
    if kind == "embedding":
        embedding_suite()
        embedding_suite(BF16)
    else:
        cross_entropy_suite()
        cross_entropy_suite(BF16)


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(swap, name):
    kind, old, new, suite = MUTANTS[name]
    swap(kind, load(kind, old, new))
    with pytest.raises(AssertionError):
        suite()


def test_only_large_logits_catch_the_missing_max(swap):
    """Without the max shift the loss is exact algebra: logits ~ 1 pass; ~ 100 overflow."""
    kind, old, new, _ = MUTANTS["cross_entropy_no_max_subtracted"]
    swap(kind, load(kind, old, new))
    check_cross_entropy((2, 4), F32, scale=1.0, seed=1)
    with pytest.raises(AssertionError):
        check_cross_entropy((2, 4), F32, scale=100.0, seed=1)
