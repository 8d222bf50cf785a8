"""The dense layers' ``collective_matmul`` option ("ring", "bidirectional") equals the builtin
collectives (``None``): forward ``y`` and the gradients ``dx``, ``dw``, ``db``, on every mesh,
with and without a batch axis, rank 2 and 3, ring dim 0 and 1, with and without bias; under the
bfloat16 policies with the same dtypes and values; compiled to N − 1 collective-permutes per
direction moving the builtin's ring bytes (bf16 forward, f32 backward); mutants are caught.

Values are small integers in float32, so every sum is exact in any order and the comparison is
bit for bit. The bf16 checks use integers up to 16 (exact in bf16) whose products and partial
sums exceed 256, the largest range where bf16 holds every integer: accumulated in float32 they
are exact in any order, so ring and builtin agree bit for bit after the one final rounding,
while any partial sum rounded to bf16 on the way (the precision mutants) shows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mutants import mutant
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops.comm import _collective_matmul
from shardops.layers import _collective_dense
from shardops.layers import _dense_kernels as _kernels

COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
RINGS = ("ring", "bidirectional")
F32, BF16, MIXED = shardops.FLOAT32, shardops.BFLOAT16, shardops.MIXED_BFLOAT16
# (mesh, axis_name, batch_axis): the ring runs over axis_name.
MESHES = [({"x": 2}, "x", None), ({"x": 4}, "x", None), ({"x": 8}, "x", None)] + [
    (mesh, "model", batch)
    for mesh in ({"data": 2, "model": 4}, {"data": 4, "model": 2})
    for batch in ("data", None)
]
# (layer, options, x's global shape): the ring dim's local size gives even blocks on every mesh.
LAYERS = [
    ("column", {"gather_input": True, "gather_dimension": 0}, (16, 4)),
    ("column", {"gather_input": True, "gather_dimension": 0}, (16, 2, 4)),
    ("column", {"gather_input": True, "gather_dimension": 1}, (4, 16, 4)),
    ("row", {"reduce": "psum", "scatter_dimension": 0}, (16, 8)),
    ("row", {"reduce": "psum", "scatter_dimension": 0}, (16, 2, 8)),
    ("row", {"reduce": "psum", "scatter_dimension": 1}, (4, 16, 8)),
    ("row", {"reduce": "psum_scatter", "scatter_dimension": 0}, (16, 8)),
    ("row", {"reduce": "psum_scatter", "scatter_dimension": 0}, (16, 2, 8)),
    ("row", {"reduce": "psum_scatter", "scatter_dimension": 1}, (4, 16, 8)),
]
OUT = {"column": 8, "row": 4}  # the global output features (column: split over the axis)


def layer_fn(layer):
    return getattr(shardops, f"{layer}_parallel_dense")


def values_and_grads(layer, mesh, options, precision, bias, collective_matmul):
    """``(x, w, b, c) → (y, dx, dw[, db])`` of ``sum(y · c)`` through the layer."""
    fn = layer_fn(layer)

    def run(x, w, b, c):
        def loss(x, w, b):
            y = fn(x, w, b, mesh=mesh, precision=precision, collective_matmul=collective_matmul,
                   **options)  # fmt: skip
            return jnp.sum(y.astype(jnp.float32) * c), y

        argnums = (0, 1, 2) if bias else (0, 1)
        (_, y), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(x, w, b)
        return (y, *grads)

    return run


def compare_program(layer, mesh, options, precision, bias):
    """One compiled program: the layer's values and gradients for every ``COLLECTIVE_MATMULS``."""
    runs = [
        values_and_grads(layer, mesh, options, precision, bias, cm)
        for cm in shardops.layers.COLLECTIVE_MATMULS
    ]
    return jax.jit(lambda *a: [r(*a) for r in runs], compiler_options=COMPILER_OPTIONS)


@functools.cache
def cached_program(layer, mesh_key, options_key, bias):
    return compare_program(layer, shardops.make_mesh(dict(mesh_key)), dict(options_key), F32, bias)


def arguments(x_shape, f, precision, seed, high):
    """Integer-valued ``x[.., D]``, ``w[D, F]``, ``b[F]`` and the cotangent ``c`` of ``y``."""
    rng = np.random.default_rng(seed)
    d = x_shape[-1]

    def ints(shape, dtype):
        return jnp.asarray(rng.integers(-high, high + 1, shape), dtype)

    x = ints(x_shape, precision.compute_dtype)
    w = ints((d, f), precision.param_dtype)
    b = ints((f,), precision.param_dtype)
    c = ints((*x_shape[:-1], f), precision.compute_dtype).astype(jnp.float32)
    return x, w, b, c


def assert_rings_equal_builtin(outputs, where):
    builtin, *rings = outputs
    names = ("y", "dx", "dw", "db")
    for cm, ring in zip(RINGS, rings, strict=True):
        for name, got, want in zip(names, ring, builtin, strict=False):
            assert got.dtype == want.dtype, f"{where}, {cm}: {name} {got.dtype} != {want.dtype}"
            np.testing.assert_array_equal(
                np.asarray(got, np.float32), np.asarray(want, np.float32),
                err_msg=f"{where}, collective_matmul={cm!r}: {name}",
            )  # fmt: skip


@settings(max_examples=max(settings.default.max_examples, 1))
@given(
    mesh=st.sampled_from(MESHES),
    layer=st.sampled_from(LAYERS),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_collective_matmul_equals_builtin(mesh, layer, bias, seed):
    """Ring and bidirectional ring equal the builtin collectives bit for bit (integer values)."""
    (mesh_shape, axis_name, batch_axis), (kind, options, x_shape) = mesh, layer
    options = dict(options, axis_name=axis_name, batch_axis=batch_axis)
    program = cached_program(kind, tuple(mesh_shape.items()), tuple(options.items()), bias)
    x, w, b, c = arguments(x_shape, OUT[kind], F32, seed, 3)
    outputs = program(x, w, b if bias else None, c)
    where = f"{kind} {options} on {mesh_shape}, x{x_shape}, bias={bias}"
    expected = np.asarray(x) @ np.asarray(w) + (np.asarray(b) if bias else 0)
    np.testing.assert_array_equal(outputs[0][0], expected, err_msg=f"{where}: builtin y")
    assert_rings_equal_builtin(outputs, where)


# Replicated row inputs and padded widths: the mask and slice happen before the ring.
EDGE_CASES = {
    "row_replicated_x_psum": ("row", {"input_is_parallel": False}, (16, 8), 8, None),
    "row_replicated_x_scatter_seq": (
        "row",
        {"input_is_parallel": False, "reduce": "psum_scatter", "scatter_dimension": 1},
        (2, 8, 8),
        8,
        None,
    ),
    "row_padded_in_features": ("row", {"in_features": 6}, (16, 8), 8, None),
    "row_replicated_logical_x": (
        "row",
        {"input_is_parallel": False, "in_features": 6},
        (16, 6),
        8,
        None,
    ),
    "column_padded_out_features": (
        "column",
        {"gather_input": True, "gather_dimension": 1, "out_features": 6, "gather_output": True},
        (2, 8, 4),
        4,
        8,
    ),
    "column_without_gather_input": ("column", {"batch_axis": "data"}, (8, 4), 4, 8),
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_collective_matmul_edge_cases_equal_builtin(name):
    layer, options, x_shape, d_in, f_out = EDGE_CASES[name]
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    rng = np.random.default_rng(0)
    f_out = f_out or 4
    x = jnp.asarray(rng.integers(-3, 4, x_shape), jnp.float32)
    w = rng.integers(-3, 4, (d_in, f_out)).astype(np.float32)
    if "in_features" in options:
        w[options["in_features"] :] = 0  # padded rows of w are zero (shardops.pad_params)
    if "out_features" in options:
        w[:, options["out_features"] :] = 0
    b = jnp.asarray(rng.integers(-3, 4, (f_out,)), jnp.float32)
    y_shape = jax.eval_shape(
        lambda x, w, b: layer_fn(layer)(x, w, b, mesh=mesh, **options), x, w, b
    ).shape
    c = jnp.asarray(rng.integers(-3, 4, y_shape), jnp.float32)
    outputs = compare_program(layer, mesh, options, F32, True)(x, jnp.asarray(w), b, c)
    assert_rings_equal_builtin(outputs, name)


# --- bfloat16: the ring keeps the policy's dtypes and its float32 sums

BF16_LAYERS = {
    "column_seq_gather": LAYERS[2],
    "row_psum": LAYERS[3],
    "row_seq_scatter": LAYERS[8],
}
# x[.., 32] and, for the column layer, F = 32: every per-device contraction (y's over F/p in the
# row layer, dx's over F/p in the column layer) has 8 terms, so partial sums pass 256.
BF16_WIDTH = 32


def bf16_program(name, precision):
    kind, options, _ = BF16_LAYERS[name]
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    return compare_program(kind, mesh, dict(options, batch_axis="data"), precision, True)


cached_bf16_program = functools.cache(bf16_program)


def bf16_arguments(name, precision, values):
    """``values(shape, dtype)`` for ``x[.., 32]``, ``w``, ``b`` and the cotangent ``c``."""
    kind, _, x_shape = BF16_LAYERS[name]
    x_shape, f = (*x_shape[:-1], BF16_WIDTH), BF16_WIDTH if kind == "column" else OUT[kind]
    return (
        values(x_shape, precision.compute_dtype),
        values((BF16_WIDTH, f), precision.param_dtype),
        values((f,), precision.param_dtype),
        values((*x_shape[:-1], f), precision.compute_dtype).astype(jnp.float32),
    )


def integers(seed, high=16):
    """Integers in [-16, 16], exact in bfloat16."""
    rng = np.random.default_rng(seed)
    return lambda shape, dtype: jnp.asarray(rng.integers(-high, high + 1, shape), dtype)


def check_bf16(precisions=(BF16, MIXED), names=tuple(BF16_LAYERS), program=bf16_program):
    """Ring and builtin agree in dtype and bit for bit (mutants: fresh programs)."""
    for precision in precisions:
        for name in names:
            outputs = program(name, precision)(*bf16_arguments(name, precision, integers(0)))
            want = (precision.compute_dtype, precision.compute_dtype, precision.param_dtype,
                    precision.param_dtype)  # fmt: skip
            assert tuple(v.dtype for v in outputs[0]) == want, (name, precision.name)
            assert_rings_equal_builtin(outputs, f"{precision.name} {name}")


def test_bf16_ring_keeps_dtypes_and_values():
    check_bf16(program=cached_bf16_program)


def reorder_bounds(x, w, b, c):
    """Per output ``(y, dx, dw, db)``: how far two float32 sums of the same terms in different
    orders may drift apart, ``n · eps_f32 · Σ|terms|`` (n = the longest contraction)."""
    x, w, b, c = (np.asarray(a, np.float64) for a in (x, w, b, c))
    xf, cf = x.reshape(-1, x.shape[-1]), c.reshape(-1, c.shape[-1])
    n = max(x.shape[-1], c.shape[-1], xf.shape[0])
    scale = n * np.finfo(np.float32).eps
    terms = (np.abs(x) @ np.abs(w) + np.abs(b), np.abs(c) @ np.abs(w).T,
             np.abs(xf).T @ np.abs(cf), np.abs(cf).sum(0))  # fmt: skip
    return [scale * t for t in terms]


@pytest.mark.parametrize("precision", [BF16, MIXED], ids=lambda p: p.name)
def test_bf16_random_normals_agree_to_one_rounding(precision):
    """Random normals: ring and builtin add the same float32 partial products in different
    orders (the ring adds block j's partial sums starting at device j + 1, the builtin in its
    own order; a block product may use another GEMM blocking than the full one). The float32
    results then differ by at most ``reorder_bounds``, and after the one rounding to bfloat16
    by at most that plus one bfloat16 ulp. Measured on x[4, 64, 256] (3 seeds, 2 meshes): 1–8
    elements in 10⁵ differ, by one ulp, or two where y + b cancels (the float32 drift is then
    large next to the small result's ulp). A partial sum rounded to bfloat16 (2⁻⁹ relative)
    would exceed the float32 term by far."""
    rng = np.random.default_rng(1)

    def normals(shape, dtype):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    for name in BF16_LAYERS:
        args = bf16_arguments(name, precision, normals)
        builtin, *rings = cached_bf16_program(name, precision)(*args)
        for ring in rings:
            for got, want, drift in zip(ring, builtin, reorder_bounds(*args), strict=False):
                assert got.dtype == want.dtype
                got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
                larger = np.maximum(np.abs(got), np.abs(want)).astype(jnp.bfloat16)
                ulp = np.spacing(larger).astype(np.float32)
                assert np.all(np.abs(got - want) <= ulp + drift), (precision.name, name)


# --- compiled HLO: permutes, their count and bytes

N_MODEL = 4


HLO_LAYERS = {
    "column_seq_gather": ("column", {"gather_input": True, "gather_dimension": 1}),
    "row_psum": ("row", {"reduce": "psum", "scatter_dimension": 1}),
    "row_seq_scatter": ("row", {"reduce": "psum_scatter", "scatter_dimension": 1}),
}


@functools.cache
def compiled_collectives(name, precision, collective_matmul, grad=False, requested=False):
    """The layer's collectives over ``model`` in its compiled forward (or value-and-gradients);
    ``requested``: as the program asked for them (XLA:CPU runs bf16 collectives in f32)."""
    layer, options = HLO_LAYERS[name]
    mesh = shardops.make_mesh({"data": 2, "model": N_MODEL})
    options = dict(options, batch_axis="data", collective_matmul=collective_matmul)
    specs_fn = (
        shardops.column_parallel_dense_specs
        if layer == "column"
        else shardops.row_parallel_dense_specs
    )
    specs = specs_fn(**{k: v for k, v in options.items() if k != "collective_matmul"}, ndim=3)
    d, f = (32, 16) if layer == "column" else (16, 32)
    shapes = {"x": (4, 16, d), "w": (d, f), "b": (f,)}
    dtypes = {"x": precision.compute_dtype, "w": precision.param_dtype, "b": precision.param_dtype}
    args = [
        jax.device_put(jnp.zeros(shapes[k], dtypes[k]), NamedSharding(mesh, getattr(specs, k)))
        for k in ("x", "w", "b")
    ]
    fn = functools.partial(layer_fn(layer), mesh=mesh, precision=precision, **options)
    if grad:
        layer_call = fn

        def fn(x, w, b):  # value and gradients: the forward ring stays in the program
            loss = lambda x, w, b: jnp.sum(layer_call(x, w, b).astype(jnp.float32))  # noqa: E731
            return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, b)

    ledger = shardops.inspect.ledger(mesh, jax.jit(fn), *args)
    if requested:  # the lowered module holds the shard_map's collectives only
        return [c for c in ledger.requested if c.bytes and c.axes == ("model",)]
    # The layer's own collectives over model (not the loss's sum of the sharded y).
    return [
        c
        for c in ledger.collectives
        if c.bytes and c.axes == ("model",) and f"shardops.{layer}_parallel_dense" in c.op_name
    ]


def ring_bytes(collectives):
    return sum(shardops.inspect.ring_bytes(c.kind, c.bytes, c.group_size) for c in collectives)


@pytest.mark.parametrize("collective_matmul", RINGS)
@pytest.mark.parametrize("name", sorted(HLO_LAYERS))
def test_forward_compiles_to_permutes_of_the_builtin_ring_bytes(name, collective_matmul):
    """N − 1 collective-permutes per direction over ``model`` (row psum: plus the builtin
    AllGather), sending per device what the builtin collective sends on a ring."""
    builtin = compiled_collectives(name, F32, None)
    ring = compiled_collectives(name, F32, collective_matmul)
    permutes = [c for c in ring if c.kind == "collective-permute"]
    directions = 2 if collective_matmul == "bidirectional" else 1
    assert len(permutes) == (N_MODEL - 1) * directions, ring
    others = [c.kind for c in ring if c.kind != "collective-permute"]
    assert others == (["all-gather"] if name == "row_psum" else []), ring
    assert "collective-permute" not in {c.kind for c in builtin}, builtin
    assert ring_bytes(ring) == ring_bytes(builtin) > 0, (ring, builtin)


@pytest.mark.parametrize("collective_matmul", RINGS)
def test_bf16_column_ring_moves_bf16_forward_and_f32_backward(collective_matmul):
    """x's blocks travel in bfloat16 (half the bytes of float32); dx's partial sums in float32:
    the bytes of the builtin AllGather (bf16) and ReduceScatter (f32) they replace. Read from
    the lowered program: XLA:CPU then runs bf16 collectives, builtin or permute, in f32."""
    builtin = compiled_collectives("column_seq_gather", BF16, None, grad=True, requested=True)
    ring = compiled_collectives("column_seq_gather", BF16, collective_matmul, True, True)
    directions = 2 if collective_matmul == "bidirectional" else 1
    by_dtype = {}
    for c in ring:
        assert c.kind == "collective-permute", ring
        by_dtype.setdefault(c.dtypes, []).append(c)
    assert sorted(by_dtype) == [("bf16",), ("f32",)], ring
    assert len(by_dtype[("bf16",)]) == len(by_dtype[("f32",)]) == (N_MODEL - 1) * directions
    bf16_bytes, f32_bytes = ring_bytes(by_dtype[("bf16",)]), ring_bytes(by_dtype[("f32",)])
    assert 2 * bf16_bytes == f32_bytes
    gather = [c for c in builtin if c.kind == "all-gather"]
    scatter = [c for c in builtin if c.kind == "reduce-scatter"]
    assert [c.dtypes for c in gather] == [("bf16",)] and [c.dtypes for c in scatter] == [("f32",)]
    assert (bf16_bytes, f32_bytes) == (ring_bytes(gather), ring_bytes(scatter))


# --- errors


def test_bad_collective_matmul_options_are_clear_errors():
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    x, w = jnp.zeros((8, 12, 8)), jnp.zeros((8, 8))
    allowed = r"collective_matmul must be one of \(None, 'ring', 'bidirectional'\); got 'rings'"
    for layer in ("column", "row"):
        with pytest.raises(ValueError, match=allowed):
            layer_fn(layer)(x, w, mesh=mesh, collective_matmul="rings")
    with pytest.raises(ValueError, match=allowed):
        jax.shard_map(
            functools.partial(shardops.layers.row_parallel_dense_kernel, collective_matmul="rings"),
            mesh=mesh, in_specs=(P(None, None, "model"), P("model")), out_specs=P(),
        )(x, w)  # fmt: skip
    # Row psum: the ring still splits y along scatter_dimension, which must divide.
    with pytest.raises(
        ValueError,
        match=r"x dim 1 \(sequence\) = 6 is not divisible by mesh axis 'model' \(size 4\)"
        r".*collective_matmul='ring' reduce-scatters y along scatter_dimension=1",
    ):
        shardops.row_parallel_dense(jnp.zeros((8, 6, 8)), w, mesh=mesh,
                                    scatter_dimension=1, collective_matmul="ring")  # fmt: skip
    # Bidirectional: half of each block each way, so the block must be even.
    with pytest.raises(ValueError, match=r"x dim 1 \(gather_dimension=1\) = 12 over mesh axis "
                       r"'model' \(size 4\) gives blocks of 3 rows \(odd\)"):  # fmt: skip
        shardops.column_parallel_dense(x, w, mesh=mesh, gather_input=True, gather_dimension=1,
                                       collective_matmul="bidirectional")  # fmt: skip
    with pytest.raises(ValueError, match=r"x dim 0 \(scatter_dimension=0\) = 24 over mesh axis "
                       r"'data' \(size 2\) × 'model' \(size 4\) gives blocks of 3 rows"):  # fmt: skip
        shardops.row_parallel_dense(jnp.zeros((24, 8)), w, mesh=mesh, batch_axis="data",
                                    collective_matmul="bidirectional")  # fmt: skip
    # Row psum_scatter over the features: not a ring the layer can run.
    with pytest.raises(
        ValueError, match=r"scatter_dimension=-1 is the feature dim of y\(8, 12, 8\)"
    ):
        shardops.row_parallel_dense(x, w, mesh=mesh, reduce="psum_scatter", scatter_dimension=-1,
                                    collective_matmul="ring")  # fmt: skip


def test_kernel_errors_name_the_dim_the_axis_and_the_fix():
    mesh = shardops.make_mesh({"model": 4})

    def row(x, w, **options):
        kernel = functools.partial(shardops.layers.row_parallel_dense_kernel, **options)
        return jax.shard_map(kernel, mesh=mesh, in_specs=(P(None, "model"), P("model")),
                             out_specs=P())(x, w)  # fmt: skip

    w = jnp.zeros((8, 8))
    with pytest.raises(ValueError, match=r"output dim 0 = 6 is not divisible by mesh axis "
                       r"'model' \(size 4\), so the ring of collective_matmul='ring'"):  # fmt: skip
        row(jnp.zeros((6, 8)), w, collective_matmul="ring")
    with pytest.raises(ValueError, match=r"the block along scatter_dimension=0 has 1 rows \(odd\)"):
        row(jnp.zeros((4, 8)), w, collective_matmul="bidirectional")
    with pytest.raises(ValueError, match="is the feature dim of y"):
        row(jnp.zeros((4, 8)), w, reduce="psum", scatter_dimension=1, collective_matmul="ring")


# --- mutants, each caught by one of the checks above


def check_f32(layers=(LAYERS[0], LAYERS[5], LAYERS[8])):
    """Fixed f32 cases (fresh programs): every ring layer equals the builtin bit for bit."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    for kind, options, x_shape in layers:
        options = dict(options, batch_axis="data")
        x, w, b, c = arguments(x_shape, OUT[kind], F32, 0, 3)
        outputs = compare_program(kind, mesh, options, F32, True)(x, w, b, c)
        assert_rings_equal_builtin(outputs, f"{kind} {options}")


GATHER_STEP = (
    "            nxt = lax.ppermute(block, axis_name, ring_pairs(n, +1)) if s < n - 1 else None\n"
)
ACC = "            acc = acc + product(i - (s + 1) * shift, lo, size)\n"
PASS = "            acc = lax.ppermute(acc, axis_name, ring_pairs(n, shift))\n"
DX_PRODUCT = "        return ring.dot(g_rows, w_c, ((g_rows.ndim - 1,), (1,)))\n"
COLUMN_DW = "    dw = ring.dot(x_c, g, (lead, lead))  # dw[D, F] in accum: one product, all of S\n"
ROW_DW = (
    "    dw = ring.dot(x_c, g_full, (lead, lead))  # dw[F/N, D] in accum: one product, all of S\n"
)


def rounded_blocks(x, g):
    """``dw`` as the sum of N per-block products, each rounded to the compute dtype."""
    return (
        f"    n = lax.axis_size(ring.axis_name)\n"
        f"    blocks = zip(*(jax.numpy.split(a, n, ring.dim) for a in ({x}, {g})), strict=True)\n"
        f"    dw = sum(ring.dot(a, b, (lead, lead)).astype(ring.compute) for a, b in blocks)\n"
        f"    dw = dw.astype(ring.accum)\n"
    )


COLUMN, ROW_PSUM, ROW_SCATTER = [LAYERS[0]], [LAYERS[5]], [LAYERS[8]]
# name: (module, line, replacement, check)
MUTANTS = {
    # The dense ring's blocks sent the wrong way round: each product written at the wrong rows.
    "gather_shift_reversed": (
        _collective_matmul,
        GATHER_STEP,
        GATHER_STEP.replace("ring_pairs(n, +1)", "ring_pairs(n, -1)"),
        functools.partial(check_f32, COLUMN),
    ),
    # The reduce-scatter ring's partial sums sent the wrong way: sums of the wrong blocks.
    "scatter_shift_reversed": (
        _collective_matmul,
        PASS,
        PASS.replace("ring_pairs(n, shift)", "ring_pairs(n, -shift)"),
        functools.partial(check_f32, ROW_PSUM),
    ),
    # A block accumulated twice on its way round the ring.
    "block_accumulated_twice": (
        _collective_matmul,
        ACC,
        ACC.replace("acc + product", "acc + 2 * product"),
        functools.partial(check_f32, ROW_SCATTER),
    ),
    # The backward ring of the column layer carries and sums dx in bf16 (autodiff's transpose).
    "dx_ring_summed_in_compute_dtype": (
        _collective_dense,
        DX_PRODUCT,
        DX_PRODUCT.replace("(1,)))", "(1,))).astype(ring.compute)"),
        functools.partial(check_bf16, (BF16,), ("column_seq_gather",)),
    ),
    # dw as a sum of N bf16-rounded per-block pieces (autodiff of the loop), column and row.
    "column_dw_from_rounded_blocks": (
        _collective_dense,
        COLUMN_DW,
        rounded_blocks("x_c", "g"),
        functools.partial(check_bf16, (BF16,), ("column_seq_gather",)),
    ),
    "row_dw_from_rounded_blocks": (
        _collective_dense,
        ROW_DW,
        rounded_blocks("x_c", "g_full"),
        functools.partial(check_bf16, (MIXED,), ("row_seq_scatter",)),
    ),
}


@pytest.fixture
def swap(monkeypatch):
    """Load a mutant and put it under the kernels."""

    def load(module, name, line, replacement):
        loaded = mutant(module, name, line, replacement)
        if module is _collective_matmul:
            monkeypatch.setattr(_collective_dense, "_collective_matmul", loaded)
        else:
            monkeypatch.setattr(_kernels, "_collective_dense", loaded)
        jax.clear_caches()

    yield load
    jax.clear_caches()


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_collective_dense_mutant_is_caught(swap, name):
    module, line, replacement, check = MUTANTS[name]
    swap(module, name, line, line)  # the unmutated copy passes
    check()
    swap(module, name, line, replacement)
    with pytest.raises(AssertionError):
        check()


def test_row_psum_ring_backward_has_no_collective_over_the_axis():
    """As for psum, dy is replicated: the backward pass of the row ring sends nothing over
    ``model`` (``dense_all_reduce``'s custom VJP, not a gather of the already-full dy)."""
    fwd = compiled_collectives("row_psum", F32, "ring")
    both = compiled_collectives("row_psum", F32, "ring", grad=True)
    assert sorted(c.kind for c in both) == sorted(c.kind for c in fwd)


def test_kernel_under_a_users_shard_map_with_a_replicated_data_axis():
    """dp × tp with w replicated over ``data``: ``dw`` is all-reduced over ``data`` (the
    custom VJP's ``_reduce_to``), like the builtin path."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.integers(-3, 4, (4, 16, 8)), jnp.float32)
    w = jnp.asarray(rng.integers(-3, 4, (8, 8)), jnp.float32)

    def grads(cm):
        def body(x, w):
            y = shardops.layers.column_parallel_dense_kernel(
                x, w, gather_input=True, gather_dimension=1, collective_matmul=cm
            )
            return lax.psum(jnp.sum(y * y), ("data", "model"))

        f = jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"), P(None, "model")),
                          out_specs=P())  # fmt: skip
        return jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)

    for cm in RINGS:
        for got, want in zip(grads(cm), grads(None), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=cm)
