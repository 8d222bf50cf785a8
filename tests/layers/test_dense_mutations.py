"""Mutation check: known kernel bugs, injected into a copy of shardops/layers/_dense_kernels.py, are caught.

Each mutant replaces one exact line of the real source (the test fails if that line is gone, so
mutants cannot silently drift from the code), is loaded as a module, and is swapped in under the
layers. The suite's own check (``check_dense``: forward and gradients against float64) must then
fail. A suite that stays green under these mutants proves nothing.
"""

import inspect
import types

import jax
import pytest
from _dense_checks import check_dense, check_dtype_flow

import shardops
from shardops import _precision
from shardops.layers import _dense as _layers
from shardops.layers import _dense_kernels as _kernels

SOURCE = inspect.getsource(_kernels)
PRECISION_SOURCE = inspect.getsource(_precision)
F32, BF16, MIXED = shardops.FLOAT32, shardops.BFLOAT16, shardops.MIXED_BFLOAT16

# Used by the "gradient scaled by the axis size" mutant: identity forward, cotangent × p.
GRAD_TIMES = """
import jax

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
        "y = reduce_from_region(y_partial, axis_name)  # y[B, D]",
        "y = reduce_from_region(reduce_from_region(y_partial, axis_name), axis_name)  # y[B, D]",
        "",
        ("row", {}, F32),
    ),
    # psum forgotten: partial sums leave the layer (check_vma flags the out_specs at trace).
    "missing_psum": (
        "y = reduce_from_region(y_partial, axis_name)  # y[B, D]",
        "y = y_partial  # y[B, D]",
        "",
        ("row", {}, F32),
    ),
    # The bias added to every partial sum, so the psum counts it p times.
    "bias_before_reduction": (
        "y_partial = precision.matmul(x, w)  # y[B, D]{U_model}",
        "y_partial = precision.matmul(x, w) + (0 if b is None else b)  # y[B, D]{U_model}",
        "",
        ("row", {}, F32),
    ),
    # dw scaled by p, as when an extra psum double-counts autodiff's gradient reduction.
    "gradient_scaled_by_axis_size": (
        "y_partial = precision.matmul(x, w)  # y[B, D]{U_model}",
        "y_partial = precision.matmul(x, _grad_times(w, p))  # y[B, D]{U_model}",
        GRAD_TIMES,
        ("row", {}, F32),
    ),
    # Precision: the row partial sums rounded to bf16 before the psum (the tight bf16 bound and
    # the dtype flow both see it).
    "bf16_partial_sum_before_psum": (
        "y_partial = precision.matmul(x, w)  # y[B, D]{U_model}",
        "y_partial = precision.matmul(x, w).astype(precision.compute_dtype)  # y[B, D]{U_model}",
        "",
        ("row", {}, BF16),
    ),
    # Megatron's "f" applied to the bf16 activation: autodiff all-reduces dx in bf16.
    "dx_all_reduced_in_bf16": (
        "x = copy_to_region(x, axis_name, accum)  # x[..., D] in accum",
        "x = lax.pcast(x, axis_name, to='varying')  # x[B, D]",
        "",
        ("column", {}, BF16),
    ),
    # The sequence-parallel gather's transpose (a reduce-scatter of dx) in bf16.
    "dx_reduce_scattered_in_bf16": (
        "x = gather_to_region(x, axis_name, gather_dimension, accum)  # x[..., D] in accum",
        "x = lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True)  # x[..., D]",
        "",
        ("column", {"gather_input": True}, BF16),
    ),
    # Uneven widths: the mask of padded columns removed. Padded weights are zero, so outputs stay
    # right; the garbage in the padded input columns (row) or cotangent columns (column) then
    # reaches the padded weights' gradient, which must be exactly zero.
    "row_padding_not_masked": (
        "        x = x * _valid_columns(axis_name, f_local, in_features, x.dtype)  # padding → 0",
        "        x = x  # padding → 0",
        "",
        ("row", {}, F32, {"d_in": 250}),
    ),
    "column_padding_not_masked": (
        "        y_block = y_block * _valid_columns(axis_name, f_local, out_features, y_block.dtype)",
        "        y_block = y_block",
        "",
        ("column", {}, F32, {"d_out": 62}),
    ),
}

# Mutants of shardops/_precision.py: Precision's matmul (and its full-precision flag) are
# swapped for the mutant module's, so every layer computes with them.
PRECISION_MUTANTS = {
    # A float32 matmul at default precision: TF32 on GPU; numerically invisible on CPU.
    "f32_matmul_at_default_precision": (
        "            return lax.Precision.HIGHEST",
        "            return lax.Precision.DEFAULT",
        ("row", {}, F32),
    ),
    # The weight left in float32 under the mixed policy.
    "weight_left_in_f32_under_mixed": (
        "        b.astype(compute),\n",
        "        b,\n",
        ("column", {}, MIXED),
    ),
    # The backward product dx rounded to bf16 before the all-reduce (plain autodiff's rounding):
    # the reduction itself still runs in f32, so only the tight bound sees it.
    "dx_partials_rounded_to_bf16": (
        "    dx = _dot(g, w_c, ((g.ndim - 1,), (1,)), compute, accum, precision)  # dx[..., K] in accum",
        "    dx = _dot(g, w_c, ((g.ndim - 1,), (1,)), compute, accum, precision).astype(compute)",
        ("column", {}, BF16),
    ),
}


def load_kernels(old: str, new: str, extra: str) -> types.ModuleType:
    assert SOURCE.count(old) == 1, (
        f"mutated line not found exactly once in _dense_kernels.py: {old!r}"
    )
    module = types.ModuleType("shardops._kernels_mutant")
    exec(
        compile(
            SOURCE.replace(old, new) + extra,
            "<mutant of shardops/layers/_dense_kernels.py>",
            "exec",
        ),
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


def suite_check(layer, options, precision=F32, dims=None):
    dims = {"d_in": 256, "d_out": 64, **(dims or {})}
    for mesh_shape in [(4,), (2, 4)]:
        check_dense(layer, mesh_shape, options, precision, batch=16, **dims)
    check_dtype_flow(layer, (2, 4), options, precision)


@pytest.fixture
def swap_precision(monkeypatch):
    def swap(old: str, new: str):
        assert PRECISION_SOURCE.count(old) == 1, f"not found once in _precision.py: {old!r}"
        module = types.ModuleType("shardops._precision_mutant")
        source = PRECISION_SOURCE.replace(old, new)
        exec(compile(source, "<mutant of shardops/_precision.py>", "exec"), module.__dict__)
        for name in ("matmul", "matmul_precision"):
            monkeypatch.setattr(_precision.Precision, name, module.Precision.__dict__[name])
        jax.clear_caches()

    yield swap
    jax.clear_caches()


@pytest.mark.parametrize("name", PRECISION_MUTANTS)
def test_unmutated_precision_copy_passes(swap_precision, name):
    old, _, (layer, options, precision) = PRECISION_MUTANTS[name]
    swap_precision(old, old)
    suite_check(layer, options, precision)


@pytest.mark.parametrize("name", PRECISION_MUTANTS)
def test_precision_mutant_is_caught(swap_precision, name):
    old, new, (layer, options, precision) = PRECISION_MUTANTS[name]
    swap_precision(old, new)
    with pytest.raises(AssertionError):
        suite_check(layer, options, precision)


# The sequence-parallel gather made invariant. check_vma keeps the numbers right (dx is then
# all-reduced in full and sliced), so only the communication budget can see it: the backward
# reduce-scatter of dx[B, D] becomes an all-reduce, twice the bytes.
INVARIANT_GATHER = (
    "x = gather_to_region(x, axis_name, gather_dimension, accum)  # x[..., D] in accum",
    "x = lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True, to='invarying').astype(accum)",
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
    old, _, extra, (layer, options, precision, *dims) = MUTANTS[name]
    swap_kernels(load_kernels(old, old, extra))
    suite_check(layer, options, precision, *dims)


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(swap_kernels, name):
    old, new, extra, (layer, options, precision, *dims) = MUTANTS[name]
    swap_kernels(load_kernels(old, new, extra))
    with pytest.raises((AssertionError, ValueError)) as caught:
        suite_check(layer, options, precision, *dims)
    if isinstance(caught.value, ValueError):  # only check_vma's trace-time verdict counts
        assert "out_specs" in str(caught.value) or "vma" in str(caught.value), caught.value
