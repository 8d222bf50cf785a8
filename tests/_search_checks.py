"""Checks of the search's cost counts (``shardops_models.search._program_cost``, ``shardops_models.search.predict``),
shared by tests/search/test_search.py and its mutation module (tests/strategies/test_layout_cost_mutations.py), so
that the mutants face the suite's own checks.

XLA counts a rolled loop's body once (``cost_analysis`` of a ``scan`` of 5 matmuls is one
matmul's FLOPs); the same program written with ``unroll=True`` is counted in full. The search
counts from the jaxpr, so its count of the rolled program must equal XLA's count of the
unrolled one. The programs hold only matmuls, transcendentals (which XLA counts apart) and a
``fori_loop``'s index arithmetic (which XLA folds away once the loop is unrolled), so both
counts are exact.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models
import shardops_models.search
from shardops_models.search._program_cost import program_cost


def _scan(unroll):
    def f(x, ws):  # x[4, 8], ws[5, 8, 8]: 5 steps of x @ w, then tanh
        return lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws, unroll=unroll)[0]

    return f


def _nested_scan(unroll):
    def f(x, ws):  # ws[3, 5, 8, 8]: 3 outer steps of 5 inner matmuls
        def outer(c, block):
            return lax.scan(lambda c, w: (c @ w, None), c, block, unroll=unroll)[0], None

        return lax.scan(outer, x, ws, unroll=unroll)[0]

    return f


def _fori_loop(unroll):
    def f(x, w):  # 5 steps of x @ w (static bounds: a scan)
        return lax.fori_loop(0, 5, lambda i, c: jnp.tanh(c @ w), x, unroll=unroll)

    return f


def _scan_vjp(unroll):
    def f(x, ws):  # forward scan and its transpose (dx and dw per step): 3 matmuls a step
        y, back = jax.vjp(
            lambda x, ws: lax.scan(lambda c, w: (c @ w, c), x, ws, unroll=unroll)[0], x, ws
        )
        return back(y)

    return f


LOOP_PROGRAMS = {
    "scan": (_scan, ((4, 8), (5, 8, 8))),
    "nested scan": (_nested_scan, ((4, 8), (3, 5, 8, 8))),
    "fori_loop": (_fori_loop, ((4, 8), (8, 8))),
    "scan and its vjp": (_scan_vjp, ((4, 8), (5, 8, 8))),
}


def check_loop_flops(cost=program_cost) -> None:
    """The FLOPs counted inside ``scan`` and ``fori_loop`` bodies (nested, and transposed) equal
    XLA's ``cost_analysis`` of the same program unrolled."""
    for name, (program, shapes) in LOOP_PROGRAMS.items():
        args = [jnp.ones(s, jnp.float32) for s in shapes]
        counted = cost(jax.make_jaxpr(program(1))(*args).jaxpr, {}).flops
        unrolled = jax.jit(program(True)).lower(*args).compile().cost_analysis()["flops"]
        assert counted == unrolled, f"{name}: counted {counted} FLOPs, XLA unrolled {unrolled}"


def _argument_then_output(x):  # x[N] read first; the output [N] made from a scalar after it
    return jnp.full(x.shape, jnp.sum(x))  # no temporary: arguments + outputs is the whole peak


def _outputs_made_early(x):  # x[N]: three outputs made first, then scratch work
    a, b, c = x * 2.0, x * 3.0, x * 4.0  # [N] each, outputs
    t = jnp.outer(x[:256], x[:256])  # [256, 256]: 256 KiB of scratch, fused away by XLA
    return a, b, c, jnp.sum(t)


def _argument_read_first(x):  # x[N], held by the caller, read only by the first op
    total = jnp.sum(x)  # []
    return jnp.full(x.shape, total) * 2.0 + 1.0  # [N], two [N] temporaries fused by XLA


def _bytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def check_peak_keeps_outputs_and_arguments(cost=program_cost) -> None:
    """Outputs stay live to the end, and so do the arguments the caller holds (not donated):
    the predicted peak is at least the arguments and outputs together (for a program whose
    large outputs are made before its scratch work, and for ones that read their argument only
    at the start), and, where the jaxpr's temporaries leave room for XLA's own few bytes, at
    least what the compiled program holds (``memory_analysis``: arguments + outputs − aliased
    + temporaries). Donated, the argument is freed once read, at the top level and inside a
    ``shard_map`` body, unless the program reads it again after the ``shard_map``."""
    x = jnp.ones((1 << 16,), jnp.float32)  # 256 KiB
    for program in (_outputs_made_early, _argument_read_first, _argument_then_output):
        predicted = cost(jax.make_jaxpr(program)(x).jaxpr, {}).peak_bytes
        held = x.nbytes + _bytes(jax.eval_shape(program, x))
        assert predicted >= held, (
            f"{program.__name__}: predicted peak {predicted} < arguments + outputs {held} bytes"
        )
        if program is _argument_then_output:
            continue  # its peak is exactly arguments + outputs: XLA's tuple table exceeds it
        analysis = jax.jit(program).lower(x).compile().memory_analysis()
        compiled = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                    - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)  # fmt: skip
        assert predicted >= compiled, (
            f"{program.__name__}: predicted peak {predicted} < compiled {compiled} bytes"
        )
    # Donated, the argument is freed once read: the peak is one argument's bytes lower.
    jaxpr = jax.make_jaxpr(_argument_read_first)(x).jaxpr
    held, donated = cost(jaxpr, {}).peak_bytes, cost(jaxpr, {}, donated=[0]).peak_bytes
    assert donated == held - x.nbytes, (held, donated)
    # Inside shard_map: one device's block of x (x[N_data]) freed once read, when donated ...
    mesh = shardops.make_mesh({"data": 8})
    per_device = jax.shard_map(_argument_read_first, mesh=mesh, in_specs=P("data"),
                               out_specs=P("data"))  # fmt: skip
    jaxpr = jax.make_jaxpr(per_device)(x).jaxpr
    held, donated = (cost(jaxpr, dict(mesh.shape), donated=d).peak_bytes for d in ((), [0]))
    assert donated == held - x.nbytes // 8, ("shard_map", held, donated)
    # ... and held when the program reads x again after the shard_map.
    jaxpr = jax.make_jaxpr(lambda x: per_device(x) + x)(x).jaxpr
    held, donated = (cost(jaxpr, dict(mesh.shape), donated=d).peak_bytes for d in ((), [0]))
    assert donated == held, ("x read after the shard_map", held, donated)


# Distinct matmul rates per compute dtype: a rate read for the wrong dtype changes the time.
RATES = {"float32": 1e10, "bfloat16": 4e10}
MEMORY_BANDWIDTH = 1e11


def rated_hardware(hardware_cls=shardops_models.search.Hardware):
    return hardware_cls("rated", {"data": 1e11, "model": 1e11}, dict(RATES), MEMORY_BANDWIDTH,
                        0.0, 1e12)  # fmt: skip


POLICIES = (shardops.FLOAT32, shardops.MIXED_BFLOAT16, shardops.BFLOAT16)


def check_flop_rates(
    predict=shardops_models.search.predict,
    hardware_cls=shardops_models.search.Hardware,
) -> None:
    """Under each precision policy the compute time takes the matmul rate of its compute dtype:
    ``flops / rate[compute_dtype] + elementwise_bytes / memory_bandwidth``."""
    hw = rated_hardware(hardware_cls)
    model = models.Mlp((64, 128, 10))
    for precision in POLICIES:
        lay = predict(model, "2d", (4, 2), 32, precision=precision, hardware=hw)
        rate = RATES[np.dtype(precision.compute_dtype).name]
        want = lay.flops / rate + lay.elementwise_bytes / MEMORY_BANDWIDTH
        assert lay.flops > 0
        assert abs(lay.compute_time - want) <= 1e-9 * want, (
            f"{precision.name}: compute time {lay.compute_time} s, expected {want} s at "
            f"{rate:g} FLOP/s ({np.dtype(precision.compute_dtype).name})"
        )
