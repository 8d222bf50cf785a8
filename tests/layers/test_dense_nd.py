"""N-D inputs, sequence parallelism along S, and uneven widths: every layer option on every
mesh equals the float64 reference, and padding is exactly zero wherever it could leak."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cover import cover_meshes
from _dense_checks import (
    COLUMN_OPTIONS,
    COLUMN_SEQ_OPTIONS,
    MESHES,
    POLICIES,
    ROW_OPTIONS,
    ROW_SEQ_OPTIONS,
    check_dense,
)
from jax.sharding import PartitionSpec as P

import shardops

LAYER_OPTIONS = (
    [("column", o) for o in COLUMN_OPTIONS + COLUMN_SEQ_OPTIONS]
    + [("row", o) for o in ROW_OPTIONS + ROW_SEQ_OPTIONS]
)  # fmt: skip


def _id(v):
    return v if isinstance(v, str) else ",".join(f"{k}={w}" for k, w in v.items())


def _case_id(v):
    return (
        str(v)
        if isinstance(v, tuple) and all(isinstance(d, int) for d in v)
        else (f"{v[0]}-{_id(v[1])}" if isinstance(v, tuple) else _id(v))
    )


# Every layer option on every model-axis size and every data-axis size (tests/_cover.py);
# every mesh × option under SHARDOPS_FULL=1.
@pytest.mark.parametrize(
    ("mesh_shape", "layer_options"), cover_meshes(MESHES, LAYER_OPTIONS), ids=_case_id
)
def test_rank_3_inputs_match_reference(mesh_shape, layer_options):
    """``x[B, S, D]``: batch over data, S gathered/scattered over model where asked."""
    layer, options = layer_options
    check_dense(layer, mesh_shape, options, shardops.FLOAT32, batch=8, extra=(16,), d_in=64,
                d_out=64)  # fmt: skip


@pytest.mark.parametrize("policy", ["BFLOAT16", "MIXED_BFLOAT16"])
@pytest.mark.parametrize(("layer", "options"), LAYER_OPTIONS, ids=_id)
def test_rank_3_under_bf16_policies(policy, layer, options):
    check_dense(layer, (2, 4), options, POLICIES[policy], batch=8, extra=(8,), d_in=256, d_out=64)


def test_rank_4_sequence_parallel():
    for layer, options in [("column", COLUMN_SEQ_OPTIONS[0]), ("row", ROW_SEQ_OPTIONS[0])]:
        check_dense(layer, (2, 4), options, shardops.FLOAT32, batch=2, extra=(8, 3), d_in=32,
                    d_out=32)  # fmt: skip


# hidden 100 on 8, 10 classes on 4, 50 on 2·4: padded, masked, and equal to the reference.
UNEVEN = [((8,), 100), ((1, 8), 100), ((2, 4), 10), ((4, 2), 50), ((4,), 10)]


@pytest.mark.parametrize(
    ("mesh_shape", "layer_options"),
    cover_meshes([m for m, _ in UNEVEN], LAYER_OPTIONS),
    ids=_case_id,
)
def test_uneven_widths_are_padded_and_masked(mesh_shape, layer_options):
    layer, options = layer_options
    width = dict(UNEVEN)[mesh_shape]
    sequence = options in COLUMN_SEQ_OPTIONS or options in ROW_SEQ_OPTIONS
    extra = (8,) if sequence else ()  # rank 3 for the sequence options, rank 2 otherwise
    # The uneven width is the split one: F of the column (its output), F of the row (its input).
    d_in, d_out = (32, width) if layer == "column" else (width, 32)
    check_dense(layer, mesh_shape, options, shardops.FLOAT32, batch=8, extra=extra, d_in=d_in,
                d_out=d_out)  # fmt: skip


def test_padded_mlp_trains_exactly_like_the_unpadded_one():
    """hidden 98 on model=4 (padded to 100): 5 Adam steps of a column → sigmoid → row pair
    (sigmoid(0) ≠ 0, so only masking keeps the padding out). The logical parameters follow the
    unsharded model, and the padding stays exactly zero (zero gradient, zero update)."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    col = shardops.column_parallel_dense_specs(batch_axis="data")
    row = shardops.row_parallel_dense_specs(batch_axis="data")
    k1, k2, kx = jax.random.split(jax.random.key(0), 3)
    full = {"col": shardops.init_dense(k1, 24, 98), "row": shardops.init_dense(k2, 98, 24)}
    full["col"]["b"] = jax.random.normal(k2, (98,)) * 0.1
    specs = {"col": col.params, "row": row.params}

    def sharded_loss(params, x):
        h = shardops.column_parallel_dense(x, **params["col"], mesh=mesh, batch_axis="data",
                                           out_features=98)  # fmt: skip
        y = shardops.row_parallel_dense(jax.nn.sigmoid(h), **params["row"], mesh=mesh,
                                        batch_axis="data", in_features=98)  # fmt: skip
        return jnp.mean((y - 1.0) ** 2)

    def reference_loss(params, x):
        h = shardops.dense(x, **params["col"])
        return jnp.mean((shardops.dense(jax.nn.sigmoid(h), **params["row"]) - 1.0) ** 2)

    opt = optax.adam(1e-2)
    params = shardops.shard_params(full, mesh, specs)  # zero-pads 98 → 100
    assert params["col"]["w"].shape == (24, 100) and params["row"]["w"].shape == (100, 24)
    ref = full
    state, ref_state = opt.init(params), opt.init(ref)
    step = jax.jit(jax.value_and_grad(sharded_loss))
    ref_step = jax.jit(jax.value_and_grad(reference_loss))
    x = jax.random.normal(kx, (16, 24))
    for _ in range(5):
        loss, grads = step(params, x)
        ref_loss, ref_grads = ref_step(ref, x)
        assert abs(float(loss) - float(ref_loss)) <= 1e-6
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = opt.update(ref_grads, ref_state, ref)
        ref = optax.apply_updates(ref, ref_updates)
    got = jax.device_get(params)
    for a, b in zip(jax.tree.leaves(shardops.unpad(got, ref)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert not np.any(got["col"]["w"][:, 98:]) and not np.any(got["col"]["b"][98:])
    assert not np.any(got["row"]["w"][98:])
    assert not any(np.any(np.asarray(m)[..., 98:]) for m in (state[0].mu["col"]["w"],))


def test_padding_refused_is_a_shardops_error():
    mesh = shardops.make_mesh({"model": 8})
    params = shardops.init_dense(jax.random.key(0), 16, 100)
    with pytest.raises(
        ValueError,
        match=r"params\['b'\] dim 0 \(split\) = 100 is not divisible by mesh axis 'model' "
        r"\(size 8\); .* or shard_params\(\.\.\., pad=True\)",
    ):
        shardops.shard_params(
            params, mesh, shardops.column_parallel_dense_specs().params, pad=False
        )
    padded = shardops.shard_params(params, mesh, shardops.column_parallel_dense_specs().params)
    assert padded["w"].shape == (16, 104) and shardops.padded_size(100, 8) == 104


def test_sequence_not_divisible_under_sequence_parallelism():
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    x, w = jnp.ones((2, 6, 16)), jnp.ones((16, 32))
    with pytest.raises(
        ValueError,
        match=r"x dim 1 \(sequence\) = 6 is not divisible by mesh axis 'model' \(size 4\)",
    ):
        shardops.column_parallel_dense(x, w, mesh=mesh, gather_input=True, gather_dimension=1)
    with pytest.raises(ValueError, match=r"x dim 1 \(sequence\) = 6 is not divisible"):
        shardops.row_parallel_dense(jnp.ones((2, 6, 32)), jnp.ones((32, 16)), mesh=mesh,
                                    reduce="psum_scatter", scatter_dimension=1)  # fmt: skip


def test_bad_logical_sizes():
    mesh = shardops.make_mesh({"model": 4})
    with pytest.raises(ValueError, match=r"out_features=120 must be an int in 1\.\.104"):
        shardops.column_parallel_dense(jnp.ones((4, 8)), jnp.ones((8, 104)), mesh=mesh,
                                       out_features=120)  # fmt: skip
    with pytest.raises(ValueError, match=r"gather_dimension must be one of the 1 dims"):
        shardops.column_parallel_dense(jnp.ones((4, 8)), jnp.ones((8, 8)), mesh=mesh,
                                       gather_input=True, gather_dimension=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"for a padded w pass in_features=100"):
        shardops.row_parallel_dense(jnp.ones((4, 100)), jnp.ones((104, 8)), mesh=mesh,
                                    input_is_parallel=False)  # fmt: skip


# Compiled collectives of the rank-3 options, padding and bf16 included, on data=2 × model=4:
# x[B=4, S=8, D=32] split over data → local rows BL = 2; per device V counts the full tensor.
BL, S, D_IN, D_OUT = 2, 8, 32, 64
AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"
M, DT = ("model",), ("data",)
COL_GRADS = D_IN * D_OUT // 4 + D_OUT // 4  # dw[D_IN, D_OUT/p] + db[D_OUT/p], all-reduced over data
ROW_GRADS = D_IN // 4 * D_OUT + D_OUT


def requested_bytes(layer, options, precision, d_out=D_OUT, out_features=None):
    """{(kind, axes): bytes} the program asks for (lowered module), forward and backward."""
    from _dense_checks import sharded_forward_and_grads
    from jax.sharding import NamedSharding

    mesh = shardops.make_mesh({"data": 2, "model": 4})
    opts = dict(options, batch_axis="data")
    specs = (
        shardops.column_parallel_dense_specs
        if layer == "column"
        else shardops.row_parallel_dense_specs
    )(**opts, ndim=3)
    if out_features is not None:
        opts["out_features"] = out_features
    rng = np.random.default_rng(0)
    d_in, d_o = (D_IN, d_out) if layer == "column" else (d_out, D_IN)  # row: F = d_out wide
    shapes = ((4, S, d_in), (d_in, d_o), (d_o,), (4, S, d_o))
    dtypes = (precision.compute_dtype, precision.param_dtype, precision.param_dtype,
              precision.compute_dtype)  # fmt: skip
    if opts.get("gather_output") and out_features is not None:
        shapes = (*shapes[:3], (4, S, out_features))
    args = [jax.device_put(rng.standard_normal(sh).astype(dt), NamedSharding(mesh, sp))
            for sh, dt, sp in zip(shapes, dtypes, (specs.x, specs.w, specs.b, specs.y), strict=True)]  # fmt: skip
    kwargs = dict(layer=layer, mesh=mesh, options=tuple(sorted(opts.items())), precision=precision)
    ledger = shardops.inspect.ledger(
        mesh, jax.jit(lambda *a: sharded_forward_and_grads(*a, **kwargs)), *args
    )
    return ledger.totals(requested=True)


F32, BF16 = shardops.FLOAT32, shardops.BFLOAT16
ND_BUDGETS = {
    # Sequence-parallel column: AllGather x[BL, S_model, D] forward (in the compute dtype),
    # ReduceScatter dx backward (always f32).
    "column_seq_f32": ("column", COLUMN_SEQ_OPTIONS[0], F32, None, {
        (AG, M): BL * S * D_IN * 4, (RS, M): BL * S * D_IN * 4, (AR, DT): COL_GRADS * 4}),
    "column_seq_bf16": ("column", COLUMN_SEQ_OPTIONS[0], BF16, None, {
        (AG, M): BL * S * D_IN * 2, (RS, M): BL * S * D_IN * 4, (AR, DT): COL_GRADS * 4}),
    # Sequence-parallel row: ReduceScatter y over S forward (f32), AllGather dy backward (f32:
    # the cotangent of the f32 reduction), AllReduce over model of the replicated db[D].
    "row_seq_f32": ("row", ROW_SEQ_OPTIONS[0], F32, None, {
        (RS, M): BL * S * D_IN * 4, (AG, M): BL * S * D_IN * 4, (AR, M): D_IN * 4,
        (AR, DT): (D_OUT // 4 * D_IN + D_IN) * 4}),
    "row_seq_bf16": ("row", ROW_SEQ_OPTIONS[0], BF16, None, {
        (RS, M): BL * S * D_IN * 4, (AG, M): BL * S * D_IN * 4, (AR, M): D_IN * 4,
        (AR, DT): (D_OUT // 4 * D_IN + D_IN) * 4}),
    # Padding shows: out_features=62 stored as 64; gather_output moves the 64 padded columns,
    # then slices to 62 locally. The dx all-reduce is unaffected.
    "column_padded_gather_output": ("column", {"gather_output": True}, F32, 62, {
        (AG, M): BL * S * D_OUT * 4, (AR, M): BL * S * D_IN * 4, (AR, DT): COL_GRADS * 4}),
}  # fmt: skip


@pytest.mark.parametrize("case", ND_BUDGETS)
def test_rank_3_collectives_ask_for_their_bytes(case):
    layer, options, precision, out_features, expected = ND_BUDGETS[case]
    assert requested_bytes(layer, options, precision, out_features=out_features) == expected


def _collective_counts(jaxpr) -> dict:
    counts: dict = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("all_gather", "reduce_scatter", "psum", "psum_scatter"):
            counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            for k, n in _collective_counts(sub).items():
                counts[k] = counts.get(k, 0) + n
    return counts


def test_one_gathered_input_feeds_two_column_layers_like_their_own_gathers():
    """``gathered_input``: q and k column layers reading one ``gather_to_region`` of x[B, S/p,
    D] (Megatron's "g" once a sublayer, ``ctx.gather_sequence``) compute the outputs and the
    gradients (dx: the gather's ReduceScatter of both layers' partial sums) of each layer
    gathering x itself, with one AllGather and one ReduceScatter instead of two each; and the
    two options together are refused."""
    mesh = shardops.make_mesh({"model": 4})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 8, 16)).astype(np.float32)  # x[B, S, D], split along S
    wq, wk = (rng.normal(size=(16, 12)).astype(np.float32) for _ in range(2))
    cq, ck = (rng.normal(size=(2, 8, 12)).astype(np.float32) for _ in range(2))
    kernel = shardops.layers.column_parallel_dense_kernel

    def loss(once, x, wq, wk, cq, ck):
        if once:
            whole = shardops.comm.gather_to_region(x, "model", 1, jnp.float32)
            q, k = (kernel(whole, w, gathered_input=True) for w in (wq, wk))
        else:
            q, k = (kernel(x, w, gather_input=True, gather_dimension=1) for w in (wq, wk))
        return jax.lax.psum(jnp.sum(q * cq) + jnp.sum(k * ck), "model")

    def grads(once):
        specs = (P(None, "model"), P(None, "model"), P(None, "model"), P(None, None, "model"),
                 P(None, None, "model"))  # fmt: skip
        fn = jax.shard_map(jax.value_and_grad(functools.partial(loss, once), argnums=(0, 1, 2)),
                           mesh=mesh, in_specs=(P(None, "model"), *specs[1:]),
                           out_specs=(P(), (P(None, "model"), *specs[1:3])))  # fmt: skip
        return jax.jit(fn), fn

    args = (x, wq, wk, cq, ck)
    (value, dx), (v1, d1) = ((r[0], r[1]) for r in (grads(True)[0](*args), grads(False)[0](*args)))
    np.testing.assert_allclose(value, v1, rtol=1e-6)
    for a, b in zip(dx, d1, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-6)
    once, twice = (_collective_counts(jax.make_jaxpr(grads(o)[1])(*args).jaxpr)
                   for o in (True, False))  # fmt: skip
    assert (once["all_gather"], twice["all_gather"]) == (1, 2), (once, twice)
    assert (once["reduce_scatter"], twice["reduce_scatter"]) == (1, 2), (once, twice)
    with pytest.raises(ValueError, match=r"gather_input and gathered_input both set"):
        jax.shard_map(lambda x, w: kernel(x, w, gather_input=True, gathered_input=True),
                      mesh=mesh, in_specs=(P(None, "model"), P(None, "model")),
                      out_specs=P(None, None, "model"))(x, wq)  # fmt: skip
