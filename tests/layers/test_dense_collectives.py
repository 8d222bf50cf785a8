"""The compiled HLO of each kernel option holds exactly the intended collectives.

Budgets are bytes per (kind, mesh axes), read from the compiled program with
``shardops.inspect.collectives``; XLA may combine ops into tuples, so op counts are not compared.
Shapes below are per device: on a (data=2, model=4) mesh with the batch split over ``data``,
x[B, D] has local rows Bl = B/2, and p = 4.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dense_checks import sharded_forward_and_grads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops

F32 = 4
B, D_IN, D_OUT = 16, 32, 64
DATA, MODEL = 2, 4
BL = B // DATA  # local batch rows


def budget(collectives):
    """{(kind, axes): bytes}, leaving out single-device groups (0 bytes)."""
    out = collections.Counter()
    for c in collectives:
        assert c.axes is not None, f"collective over groups that match no mesh axes: {c}"
        if c.bytes:
            out[(c.kind, c.axes)] += c.bytes
    return dict(out)


def compiled_budget(layer, options, *, mesh_axes=(DATA, MODEL), wrt_x=True):
    mesh = shardops.make_mesh({shardops.DATA_AXIS: mesh_axes[0], shardops.MODEL_AXIS: mesh_axes[1]})
    opts = dict(options, batch_axis=shardops.DATA_AXIS)
    specs = (
        shardops.column_parallel_dense_specs
        if layer == "column"
        else shardops.row_parallel_dense_specs
    )(**opts)
    rng = np.random.default_rng(0)
    args = [
        rng.standard_normal(s).astype(np.float32)
        for s in ((B, D_IN), (D_IN, D_OUT), (D_OUT,), (B, D_OUT))
    ]
    args = [
        jax.device_put(a, NamedSharding(mesh, s))
        for a, s in zip(args, (specs.x, specs.w, specs.b, specs.y), strict=True)
    ]
    if wrt_x:
        fn = sharded_forward_and_grads
        kwargs = dict(
            layer=layer, mesh=mesh, options=tuple(sorted(opts.items())), precision=shardops.FLOAT32
        )
        return budget(shardops.inspect.collectives(mesh, fn, *args, **kwargs))

    layer_fn = getattr(shardops, f"{layer}_parallel_dense")

    def params_only(x, w, b, ct):  # x is data: no gradient
        def loss(w, b):
            y = layer_fn(x, w, b, mesh=mesh, **opts)
            return jnp.sum(y * ct), y

        # (grads, y): the scalar loss itself is not returned, so its reduction is not counted.
        return jax.grad(loss, argnums=(0, 1), has_aux=True)(w, b)

    return budget(shardops.inspect.collectives(mesh, params_only, *args))


# Weights and biases are replicated over `data`, so their gradients are all-reduced over it:
# column: dw[D_IN, D_OUT/p] and db[D_OUT/p]; row: dw[D_IN/p, D_OUT] and db[D_OUT] (or
# db[D_OUT/p] when the output is split over features).
COLUMN_DATA_GRADS = (D_IN * D_OUT // MODEL + D_OUT // MODEL) * F32
ROW_DATA_GRADS = (D_IN // MODEL * D_OUT + D_OUT) * F32
ROW_DATA_GRADS_B_SHARDED = (D_IN // MODEL * D_OUT + D_OUT // MODEL) * F32
AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"
M, Dt = ("model",), ("data",)

CASES = {
    # Replicated x: no forward communication; backward AllReduce of dx[Bl, D_IN] over model.
    "column": (
        "column",
        {},
        {(AR, M): BL * D_IN * F32, (AR, Dt): COLUMN_DATA_GRADS},
    ),
    # Gathered output: forward AllGather of y[Bl, D_OUT]; its backward is a local slice.
    "column_gather_output": (
        "column",
        {"gather_output": True},
        {(AG, M): BL * D_OUT * F32, (AR, M): BL * D_IN * F32, (AR, Dt): COLUMN_DATA_GRADS},
    ),
    # Sequence-parallel input: forward AllGather x[Bl/p, D_IN] → x[Bl, D_IN]; backward
    # ReduceScatter of dx (full size Bl·D_IN).
    "column_gather_input": (
        "column",
        {"gather_input": True},
        {(AG, M): BL * D_IN * F32, (RS, M): BL * D_IN * F32, (AR, Dt): COLUMN_DATA_GRADS},
    ),
    # psum: exactly one AllReduce over model, of y[Bl, D_OUT], forward; none backward.
    "row_psum": (
        "row",
        {},
        {(AR, M): BL * D_OUT * F32, (AR, Dt): ROW_DATA_GRADS},
    ),
    # Sequence-parallel output: forward ReduceScatter of y; backward AllGather of dy, plus the
    # AllReduce over model of the replicated bias' gradient db[D_OUT].
    "row_scatter_batch": (
        "row",
        {"reduce": "psum_scatter", "scatter_dimension": 0},
        {
            (RS, M): BL * D_OUT * F32,
            (AG, M): BL * D_OUT * F32,
            (AR, M): D_OUT * F32,
            (AR, Dt): ROW_DATA_GRADS,
        },
    ),
    # Feature-split output: the bias is split too, so its gradient needs no model reduction.
    "row_scatter_features": (
        "row",
        {"reduce": "psum_scatter", "scatter_dimension": 1},
        {(RS, M): BL * D_OUT * F32, (AG, M): BL * D_OUT * F32, (AR, Dt): ROW_DATA_GRADS_B_SHARDED},
    ),
    # Replicated x sliced locally: backward AllReduce of the zero-padded dx[Bl, D_IN] (2× the
    # bytes an AllGather of the dx blocks would move).
    "row_sliced_input": (
        "row",
        {"input_is_parallel": False},
        {(AR, M): BL * D_OUT * F32 + BL * D_IN * F32, (AR, Dt): ROW_DATA_GRADS},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_collectives(case):
    layer, options, expected = CASES[case]
    assert compiled_budget(layer, options) == expected


def test_column_input_without_gradient_has_no_backward_all_reduce():
    # Only the data-parallel gradient reduction of w and b remains.
    assert compiled_budget("column", {}, wrt_x=False) == {(AR, Dt): COLUMN_DATA_GRADS}


def test_row_psum_is_one_all_reduce_on_a_model_only_mesh():
    assert compiled_budget("row", {}, mesh_axes=(1, 8)) == {(AR, M): B * D_OUT * F32}


def _stacked(mesh, x, p1, p2):
    h = jax.nn.relu(shardops.column_parallel_dense(x, **p1, mesh=mesh, batch_axis="data"))
    return shardops.row_parallel_dense(h, **p2, mesh=mesh, batch_axis="data")


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_stacked_layers_compose_in_user_jit_without_resharding(axis_types):
    """column → relu → row in the user's own jit: only the kernels' collectives, no resharding."""
    mesh = shardops.make_mesh({"data": DATA, "model": MODEL}, axis_types=axis_types)
    hidden = 128
    col = shardops.column_parallel_dense_specs(batch_axis="data")
    row = shardops.row_parallel_dense_specs(batch_axis="data")
    p1 = shardops.shard_params(
        shardops.init_dense(jax.random.key(1), D_IN, hidden), mesh, col.params
    )
    p2 = shardops.shard_params(
        shardops.init_dense(jax.random.key(2), hidden, D_OUT), mesh, row.params
    )
    x = jax.device_put(jnp.ones((B, D_IN)), NamedSharding(mesh, col.x))

    forward = jax.jit(lambda x, p1, p2: _stacked(mesh, x, p1, p2))
    assert budget(shardops.inspect.collectives(mesh, forward, x, p1, p2)) == {
        (AR, M): BL * D_OUT * F32
    }
    assert forward(x, p1, p2).sharding.spec == P("data", None)

    def loss(p1, p2):
        return jnp.mean(_stacked(mesh, x, p1, p2) ** 2)

    train = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    grads_bytes = D_IN * hidden // MODEL + hidden // MODEL + hidden // MODEL * D_OUT + D_OUT
    # One forward model all-reduce; none backward (x needs no gradient); the parameter
    # gradients are reduced over data. The scalar loss mean over data is a 4-byte all-reduce.
    got = budget(shardops.inspect.collectives(mesh, train, p1, p2))
    assert got == {(AR, M): BL * D_OUT * F32, (AR, Dt): grads_bytes * F32 + F32}


def test_compiled_hlo_names_the_layers():
    mesh = shardops.make_mesh({"data": DATA, "model": MODEL})
    p1 = shardops.init_dense(jax.random.key(1), D_IN, 64)
    p2 = shardops.init_dense(jax.random.key(2), 64, D_OUT)
    x = jnp.ones((B, D_IN))

    def loss(x, p1, p2):
        return jnp.sum(_stacked(mesh, x, p1, p2))

    cs = shardops.inspect.collectives(mesh, jax.value_and_grad(loss), x, p1, p2)
    model_ops = [c.op_name for c in cs if c.axes == ("model",)]
    assert any("shardops.row_parallel_dense" in n for n in model_ops), model_ops
    assert any("shardops.column_parallel_dense" in n for n in model_ops), model_ops
