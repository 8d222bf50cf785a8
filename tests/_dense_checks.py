"""Shared checks: run a sharded dense layer and compare forward and gradients with float64.

Used by the parametrized tests, the hypothesis properties and the mutation tests, so that a
mutant is judged by exactly the checks the suite runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import shardops
from shardops.layers import _dense as _layers
from shardops.testing import dense_reference, dtype_flow, dtype_flow_violations, worst_ratio

# policy name → (max |err| / bound, max |err|, where)
WORST: dict[str, tuple[float, float, str]] = {}

# 1, 2, 4 and 8 devices on a model axis alone, and every 2-axis factorisation of 8 (data, model).
MESHES = [(1,), (2,), (4,), (8,), (1, 8), (2, 4), (4, 2), (8, 1)]
# Every factorisation of 1–8 devices, for the hypothesis properties.
ALL_MESHES = [
    (1,), (2,), (4,), (8,),
    (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2), (8, 1),
]  # fmt: skip
SPECS = {"column": shardops.column_parallel_dense_specs, "row": shardops.row_parallel_dense_specs}
POLICIES = {p.name: p for p in (shardops.FLOAT32, shardops.BFLOAT16, shardops.MIXED_BFLOAT16)}
COLUMN_OPTIONS = [
    {"gather_input": gi, "gather_output": go} for gi in (False, True) for go in (False, True)
]
ROW_OPTIONS = [
    {"input_is_parallel": par, "reduce": red, "scatter_dimension": dim}
    for par in (True, False)
    for red, dim in (("psum", 0), ("psum_scatter", 0), ("psum_scatter", 1))
]
# Sequence parallelism on x[B, S, ..., D]: gather and scatter along S (dim 1), or scatter the
# features (the last dim).
COLUMN_SEQ_OPTIONS = [
    {"gather_input": True, "gather_dimension": 1, "gather_output": go} for go in (False, True)
]
ROW_SEQ_OPTIONS = [
    {"input_is_parallel": par, "reduce": "psum_scatter", "scatter_dimension": dim}
    for par in (True, False)
    for dim in (1, -1)
]


def mesh_for(shape: tuple[int, ...]):
    """(model,) or (data, model) sizes → a mesh and the batch axis to use on it."""
    if len(shape) == 1:
        return shardops.make_mesh({shardops.MODEL_AXIS: shape[0]}), None
    data, model = shape
    mesh = shardops.make_mesh({shardops.DATA_AXIS: data, shardops.MODEL_AXIS: model})
    return mesh, shardops.DATA_AXIS


@functools.partial(jax.jit, static_argnames=("layer", "mesh", "options", "precision"))
def sharded_forward_and_grads(x, w, b, ct, *, layer, mesh, options, precision):
    """``y`` and ``d sum(ct·y) / d(x, w, b)`` through the sharded layer, in one program."""
    fn = getattr(_layers, f"{layer}_parallel_dense")  # looked up at trace time (mutation tests)

    def loss(x, w, b):
        y = fn(x, w, b, mesh=mesh, precision=precision, **dict(options))
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, b)
    return y, grads


def random_inputs(rng: np.random.Generator, batch, d_in: int, d_out: int, precision):
    lead = tuple(batch) if isinstance(batch, tuple) else (batch,)
    x = rng.standard_normal((*lead, d_in)).astype(precision.compute_dtype)
    w = rng.standard_normal((d_in, d_out)).astype(precision.param_dtype)
    b = rng.standard_normal((d_out,)).astype(precision.param_dtype)
    ct = rng.standard_normal((*lead, d_out)).astype(precision.compute_dtype)
    return x, w, b, ct


def check_dense(
    layer: str,
    mesh_shape: tuple[int, ...],
    options: dict,
    precision,
    *,
    batch: int,
    d_in: int,
    d_out: int,
    extra: tuple[int, ...] = (),
    seed: int = 0,
    use_bias: bool = True,
) -> float:
    """Assert forward and gradients of a sharded layer are within the bound; return the worst ratio.

    ``extra`` adds dims after the batch (``extra=(S,)``: ``x[B, S, D]``). A ``d_out`` (column) or ``d_in`` (row) that the
    model axis does not divide is padded (``shardops.pad_params``) and passed as the logical
    ``out_features`` / ``in_features``: the logical part must equal the reference, and every
    padded output, input gradient and parameter gradient must be exactly zero, with garbage in
    the padded columns of ``x`` and of the cotangent to prove the masking.
    """
    mesh, batch_axis = mesh_for(mesh_shape)
    p = mesh_shape[-1]
    lead = (batch, *extra)
    opts = dict(options, batch_axis=batch_axis)
    specs = SPECS[layer](**opts, ndim=len(lead) + 1)
    rng = np.random.default_rng(seed)
    x, w, b, ct = random_inputs(rng, lead, d_in, d_out, precision)
    ref = dense_reference(
        x.reshape(-1, d_in), w, b if use_bias else None, ct.reshape(-1, d_out), precision
    )
    # Padding: the stored (padded) widths, and garbage where only masking keeps it out.
    col, row = layer == "column", layer == "row"
    pad_out = shardops.padded_size(d_out, p) - d_out if col else 0
    pad_in = shardops.padded_size(d_in, p) - d_in if row else 0
    w_s = np.pad(w, ((0, pad_in), (0, pad_out)))
    b_s = np.pad(b, (0, pad_out))
    x_s, ct_s = x, ct
    if pad_out:
        opts["out_features"] = d_out
        if not opts.get("gather_output"):
            ct_s = np.concatenate([ct, random_inputs(rng, lead, 1, pad_out, precision)[3]], -1)
    if pad_in:
        opts["in_features"] = d_in
        if opts.get("input_is_parallel", True):
            x_s = np.concatenate([x, random_inputs(rng, lead, 1, pad_in, precision)[3]], -1)

    def place(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    y, (dx, dw, db) = sharded_forward_and_grads(
        place(x_s, specs.x),
        place(w_s, specs.w),
        place(b_s, specs.b) if use_bias else None,
        place(ct_s, specs.y),
        layer=layer,
        mesh=mesh,
        options=tuple(sorted(opts.items())),
        precision=precision,
    )
    assert y.dtype == precision.compute_dtype, (y.dtype, precision)
    assert dw.dtype == precision.param_dtype and dx.dtype == precision.compute_dtype
    y, dx, dw = (np.asarray(a, np.float64) for a in (y, dx, dw))
    db = None if db is None else np.asarray(db, np.float64)
    where = f"{layer} {mesh_shape} {options} lead={lead} in={d_in} out={d_out}"
    for name, padded in (("y", y[..., d_out:]), ("dx", dx[..., d_in:]), ("dw", dw[d_in:, d_out:]),
                         ("dw", dw[:, d_out:]), ("dw", dw[d_in:]),
                         ("db", None if db is None else db[d_out:])):  # fmt: skip
        if padded is not None and padded.size:
            assert not np.any(padded), f"padding leaked into {name} of {where}"
    results = [
        ("y", y[..., :d_out].reshape(-1, d_out), ref.y, ref.bound_y),
        ("dx", dx[..., :d_in].reshape(-1, d_in), ref.dx, ref.bound_dx),
        ("dw", dw[:d_in, :d_out], ref.dw, ref.bound_dw),
    ]
    if use_bias:
        results.append(("db", db[:d_out], ref.db, ref.bound_db))
    worst, worst_abs, worst_name = 0.0, 0.0, ""
    for name, got, want, bound in results:
        assert got.shape == want.shape, (name, got.shape, want.shape)
        ratio = worst_ratio(got, want, bound)
        abs_err = float(np.max(np.abs(got - want)))
        assert ratio <= 1.0, (
            f"{name} of {where} under {precision.name}: max |err| = {abs_err:.3e} exceeds the "
            f"bound by {ratio:.2f}×"
        )
        if ratio > worst:
            worst, worst_abs, worst_name = ratio, abs_err, name
    # Recorded only for passing checks, so mutation tests do not pollute the report.
    if worst > WORST.get(precision.name, (-1.0,))[0]:
        WORST[precision.name] = (worst, worst_abs, f"{worst_name}: {where}")
    return worst


def check_dtype_flow(layer: str, mesh_shape: tuple[int, ...], options: dict, precision) -> None:
    """Assert the jaxpr of the layer's forward and gradients follows ``precision``: one forward
    and two backward matmuls in compute dtype accumulating in accum dtype, every sum in accum."""
    mesh, batch_axis = mesh_for(mesh_shape)
    opts = dict(options, batch_axis=batch_axis)
    specs = SPECS[layer](**opts)
    x, w, b, ct = random_inputs(np.random.default_rng(0), 32, 64, 32, precision)
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in
            ((x, specs.x), (w, specs.w), (b, specs.b), (ct, specs.y))]  # fmt: skip
    kwargs = dict(layer=layer, mesh=mesh, options=tuple(sorted(opts.items())), precision=precision)
    problems = dtype_flow_violations(sharded_forward_and_grads, *args, policy=precision, **kwargs)
    assert not problems, "\n".join(problems)
    flow = dtype_flow(sharded_forward_and_grads, *args, **kwargs)
    assert sum(name == "dot_general" for name, *_ in flow) == 3, flow  # y, dx, dw
