"""Mutation check: known kernel bugs, injected into a copy of shardops/_kernels.py, are caught.

Each mutant replaces one exact line of the real source (the test fails if that line is gone, so
mutants cannot silently drift from the code), is loaded as a module, and is swapped in under the
layers. The suite's own check (``check_dense``: forward and gradients against float64) must then
fail. A suite that stays green under these mutants proves nothing.
"""

import inspect
import types

import jax
import pytest
from _dense_checks import check_dense

import shardops
from shardops import _kernels, _layers

SOURCE = inspect.getsource(_kernels)

# Used by the "gradient scaled by the axis size" mutant: identity forward, cotangent × p.
GRAD_TIMES = """
@jax.custom_vjp
def _grad_times(w, p):
    return w

def _grad_times_fwd(w, p):
    return w, p

def _grad_times_bwd(p, g):
    return g * p, None

_grad_times.defvjp(_grad_times_fwd, _grad_times_bwd)
"""

MUTANTS = {
    # psum applied twice: the second one sums an already-replicated value, ×p.
    "extra_psum": (
        "y = lax.psum(y_partial, axis_name)  # y[B, D]",
        "y = lax.psum(lax.psum(y_partial, axis_name), axis_name)  # y[B, D]",
        "",
        ("row", {}),
    ),
    # psum forgotten: partial sums leave the layer (check_vma flags the out_specs at trace).
    "missing_psum": (
        "y = lax.psum(y_partial, axis_name)  # y[B, D]",
        "y = y_partial  # y[B, D]",
        "",
        ("row", {}),
    ),
    # The bias added to every partial sum, so the psum counts it p times.
    "bias_before_reduction": (
        "y_partial = precision.matmul(x, w)  # y[B, D]{U_model}",
        "y_partial = precision.matmul(x, w) + (0 if b is None else b)  # y[B, D]{U_model}",
        "",
        ("row", {}),
    ),
    # dw scaled by p, as when an extra psum double-counts autodiff's gradient reduction.
    "gradient_scaled_by_axis_size": (
        "y_partial = precision.matmul(x, w)  # y[B, D]{U_model}",
        "y_partial = precision.matmul(x, _grad_times(w, p))  # y[B, D]{U_model}",
        GRAD_TIMES,
        ("row", {}),
    ),
}


def load_kernels(old: str, new: str, extra: str) -> types.ModuleType:
    assert SOURCE.count(old) == 1, f"mutated line not found exactly once in _kernels.py: {old!r}"
    module = types.ModuleType("shardops._kernels_mutant")
    exec(
        compile(SOURCE.replace(old, new) + extra, "<mutant of shardops/_kernels.py>", "exec"),
        module.__dict__,
    )
    return module


@pytest.fixture
def swap_kernels(monkeypatch):
    def swap(module):
        monkeypatch.setattr(_layers, "_kernels", module)
        jax.clear_caches()  # drop programs traced with the real kernels

    yield swap
    jax.clear_caches()


def suite_check(layer, options):
    for mesh_shape in [(4,), (2, 4)]:
        check_dense(layer, mesh_shape, options, shardops.FLOAT32, batch=16, d_in=256, d_out=64)


# The sequence-parallel gather made invariant. check_vma keeps the numbers right (dx is then
# all-reduced in full and sliced), so only the communication budget can see it: the backward
# reduce-scatter of dx[B, D] becomes an all-reduce, twice the bytes.
INVARIANT_GATHER = (
    "x = lax.all_gather(x, axis_name, axis=0, tiled=True)  # x[B, D]",
    "x = lax.all_gather(x, axis_name, axis=0, tiled=True, to='invarying')  # x[B, D]",
    "",
)


def test_costlier_backward_is_caught_by_the_collective_budget(swap_kernels):
    from test_dense_collectives import CASES, compiled_budget

    layer, options, expected = CASES["column_gather_input"]
    swap_kernels(load_kernels(*INVARIANT_GATHER))
    suite_check(layer, options)  # numerically still right...
    assert compiled_budget(layer, options) != expected  # ...but it moves more bytes


@pytest.mark.parametrize("name", MUTANTS)
def test_unmutated_copy_passes(swap_kernels, name):
    """The harness itself does not cause failures: the same copy without the mutation passes."""
    old, _, extra, (layer, options) = MUTANTS[name]
    swap_kernels(load_kernels(old, old, extra))
    suite_check(layer, options)


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(swap_kernels, name):
    old, new, extra, (layer, options) = MUTANTS[name]
    swap_kernels(load_kernels(old, new, extra))
    with pytest.raises((AssertionError, ValueError)) as caught:
        suite_check(layer, options)
    if isinstance(caught.value, ValueError):  # only check_vma's trace-time verdict counts
        assert "out_specs" in str(caught.value) or "vma" in str(caught.value), caught.value
