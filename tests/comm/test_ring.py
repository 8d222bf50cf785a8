"""Ring collectives from ``ppermute`` (``shardops.ring_*``) equal the ``lax`` builtins, forward
and gradient, on every mesh axis, uni- and bidirectional; their compiled collectives are
collective-permutes only, moving the ring model's bytes, one way round the ring or (bidirectional)
half each way; mutants are caught.

Values are small integers in float32, so every sum is exact in any order: ring and builtin
must agree bit for bit, and a block added twice or placed at the wrong device cannot hide in a
tolerance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mutants import mutant
from _permutes import check_ring_directions, permute_shifts
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
from shardops.comm import _ring

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MESHES = [{"x": 1}, {"x": 2}, {"x": 4}, {"x": 8}, {"data": 2, "model": 4},
          {"data": 4, "model": 2}, {"data": 8, "model": 1}]  # fmt: skip
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}  # tiny programs: compile time only


def ops(module, kind: str, axis_name: str, dim: int, bidirectional: bool):
    """``(ring, builtin)`` per-device functions of one kind."""
    if kind == "all_gather":
        return (
            lambda a: module.ring_all_gather(a, axis_name, axis=dim, bidirectional=bidirectional),
            lambda a: lax.all_gather(a, axis_name, axis=dim, tiled=True),
        )
    if kind == "reduce_scatter":
        return (
            lambda a: module.ring_reduce_scatter(
                a, axis_name, scatter_dimension=dim, bidirectional=bidirectional
            ),
            lambda a: lax.psum_scatter(a, axis_name, scatter_dimension=dim, tiled=True),
        )
    return (
        lambda a: module.ring_all_reduce(a, axis_name, bidirectional=bidirectional),
        lambda a: lax.pcast(lax.psum(a, axis_name), axis_name, to="varying"),
    )


def run(module, mesh_shape, axis_name, kind, dim, bidirectional, local_shape, seed):
    """Ring and builtin outputs and input gradients, stacked over the devices of the axis."""
    mesh = shardops.make_mesh(mesh_shape)
    n = mesh.shape[axis_name]
    rng = np.random.default_rng(seed)
    x = rng.integers(-4, 5, (n * local_shape[0], *local_shape[1:])).astype(np.float32)
    ring, builtin = ops(module, kind, axis_name, dim, bidirectional)
    out_local = jax.eval_shape(
        jax.shard_map(builtin, mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name)),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
    ).shape
    w = rng.integers(-4, 5, out_local).astype(np.float32)  # the cotangent, per device

    def per_device(a, w):
        outs = []
        for op in (ring, builtin):
            outs += [op(a), jax.grad(lambda a, op=op: jnp.sum(op(a) * w))(a)]
        return tuple(outs)

    f = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(axis_name), P(axis_name)),
                      out_specs=(P(axis_name),) * 4),
        compiler_options=COMPILER_OPTIONS,
    )  # fmt: skip
    return [np.asarray(v) for v in f(x, w)]


@st.composite
def cases(draw):
    mesh_shape = draw(st.sampled_from(MESHES))
    axis_name = draw(st.sampled_from(sorted(mesh_shape)))
    n = mesh_shape[axis_name]
    kind = draw(st.sampled_from(KINDS))
    rank = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 5)) for _ in range(rank)]
    dim = draw(st.integers(0, rank - 1))
    if kind == "reduce_scatter":
        shape[dim] = n * draw(st.integers(1, 3))
    return mesh_shape, axis_name, kind, dim, draw(st.booleans()), tuple(shape)


@settings(max_examples=max(settings.default.max_examples, 1))
@given(case=cases(), seed=st.integers(0, 2**16))
def test_ring_collectives_equal_the_builtins_forward_and_backward(case, seed):
    mesh_shape, axis_name, kind, dim, bidirectional, shape = case
    ring_y, ring_g, y, g = run(_ring, mesh_shape, axis_name, kind, dim, bidirectional, shape,
                               seed)  # fmt: skip
    where = f"{kind} over {axis_name!r} of {mesh_shape}, dim {dim}, bidirectional={bidirectional}"
    np.testing.assert_array_equal(ring_y, y, err_msg=f"{where}: forward")
    np.testing.assert_array_equal(ring_g, g, err_msg=f"{where}: gradient")


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mesh_shape", [{"data": 1, "model": 8}, {"data": 2, "model": 4}])
def test_ring_collectives_compile_to_permutes_moving_the_ring_bytes(mesh_shape, kind,
                                                                    bidirectional):  # fmt: skip
    """Only collective-permutes over ``model``, and per device the bytes of the ring model:
    (N − 1)/N · V for all-gather (V its result) and reduce-scatter (V its input), twice that
    for all-reduce. ``shardops.inspect.ring_bytes`` of the builtin gives the same figure."""
    mesh = shardops.make_mesh(mesh_shape)
    n = mesh.shape["model"]
    ring, _ = ops(_ring, kind, "model", 0, bidirectional)
    x = jnp.zeros((n * 8, 6), jnp.float32)  # local [8, 6]: every block splits evenly
    f = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=P("model"), out_specs=P("model")))
    ledger = shardops.inspect.ledger(mesh, f, x)
    shifts = permute_shifts(f.lower(x).compile().as_text(), mesh, "model")
    check_ring_directions(shifts, bidirectional, f"{kind} over model={n}")
    kinds = {c.kind for c in ledger.collectives if c.bytes}
    assert kinds == {"collective-permute"}, ledger.collectives
    local = 8 * 6 * 4
    v = {"all_gather": n * local, "reduce_scatter": local, "all_reduce": local}[kind]
    want = {"all_gather": (n - 1) / n * v, "reduce_scatter": (n - 1) / n * v,
            "all_reduce": 2 * (n - 1) / n * v}[kind]  # fmt: skip
    assert ledger.totals() == {("collective-permute", ("model",)): want}
    builtin_kind = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
                    "all_reduce": "all-reduce"}[kind]  # fmt: skip
    assert shardops.inspect.ring_bytes(builtin_kind, v, n) == want
    assert ledger.ring_bytes() == {("model",): want}
    steps = {"all_gather": n - 1, "reduce_scatter": n - 1, "all_reduce": 2 * (n - 1)}[kind]
    permutes = [c for c in ledger.collectives if c.kind == "collective-permute" and c.bytes]
    assert len(permutes) == steps * (2 if bidirectional else 1), permutes


def test_bad_arguments_are_clear_errors():
    mesh = shardops.make_mesh({"model": 4})

    def call(fn, local_shape):
        x = jnp.zeros((4 * local_shape[0], *local_shape[1:]))
        return jax.shard_map(fn, mesh=mesh, in_specs=P("model"), out_specs=P("model"))(x)

    with pytest.raises(ValueError, match=r"dim 1 = 6 is not divisible by mesh axis 'model' \(size 4\)"):  # fmt: skip
        call(lambda a: shardops.comm.ring_reduce_scatter(a, "model", scatter_dimension=1), (4, 6))
    with pytest.raises(ValueError, match="axis=2 is out of range for an array of rank 2"):
        call(lambda a: shardops.comm.ring_all_gather(a, "model", axis=2), (4, 6))


def check_fixed(module, directions=(False, True)) -> None:
    """Ring equals builtin, forward and gradient, on fixed float32 cases of every kind."""
    for kind in KINDS:
        for bidirectional in directions:
            case = ({"data": 2, "model": 4}, "model", kind, 0, bidirectional, (4, 3))
            ring_y, ring_g, y, g = run(module, *case, seed=0)
            assert np.array_equal(ring_y, y) and np.array_equal(ring_g, g), case


def check_dtypes(module) -> None:
    """In bfloat16 the rings return what the builtins return: the same dtype and values."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    x = jnp.asarray(np.arange(16 * 6).reshape(16, 6) % 7, jnp.bfloat16)
    for kind in KINDS:
        for bidirectional in (False, True):
            got, want = (
                jax.shard_map(op, mesh=mesh, in_specs=P("model"), out_specs=P("model"))(x)
                for op in ops(module, kind, "model", 0, bidirectional)
            )
            assert got.dtype == want.dtype == jnp.bfloat16, (kind, got.dtype)
            assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_ring_collectives_keep_the_dtype():
    check_dtypes(_ring)


def check_directions(module, directions=(False, True)) -> None:
    """Compiled, each ring steps i → i + 1 only, or (bidirectional) as often i → i − 1."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    x = jnp.zeros((4 * 8, 6), jnp.float32)
    for kind in KINDS:
        for bidirectional in directions:
            ring, _ = ops(module, kind, "model", 0, bidirectional)
            f = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=P("model"), out_specs=P("model")))
            shifts = permute_shifts(f.lower(x).compile().as_text(), mesh, "model")
            check_ring_directions(shifts, bidirectional, f"{kind}, bidirectional={bidirectional}")


# --- mutants, each caught by one of the checks above


def check_bidirectional(module) -> None:
    """``check_directions`` of the bidirectional rings only (the one-way ones share no line
    with the mutants below)."""
    check_directions(module, (True,))


SECOND_GATHER = "            [_gather_blocks(first[0], axis_name, +1), _gather_blocks(second[0], axis_name, -1)],\n"
SECOND_SCATTER = (
    "            [_reduce_blocks(first, axis_name, +1), _reduce_blocks(second, axis_name, -1)]\n"
)

PLACE = "        out = lax.dynamic_update_index_in_dim(out, block, (i - s * shift) % n, 0)\n"
START = "    acc = block(i - shift)\n"
MUTANTS = {
    # The ring's shift read backwards: each received block written at the wrong device's place.
    "gather_shift_reversed": (
        PLACE,
        PLACE.replace("(i - s * shift)", "(i + s * shift)"),
        check_fixed,
    ),
    # The partial sum seeded with this device's block twice.
    "block_accumulated_twice": (
        START,
        START.replace("block(i - shift)", "2 * block(i - shift)"),
        check_fixed,
    ),
    # One ring step fewer: the last block never arrives.
    "one_step_short": (
        "    for s in range(1, n):\n        acc = lax.ppermute",
        "    for s in range(1, n - 1):\n        acc = lax.ppermute",
        check_fixed,
    ),
    # bidirectional=True sends both halves the same way: same values, same bytes, one direction.
    "bidirectional_gather_one_way": (
        SECOND_GATHER,
        SECOND_GATHER.replace("second[0], axis_name, -1", "second[0], axis_name, +1"),
        check_bidirectional,
    ),
    "bidirectional_scatter_one_way": (
        SECOND_SCATTER,
        SECOND_SCATTER.replace("second, axis_name, -1", "second, axis_name, +1"),
        check_bidirectional,
    ),
    # The partial sums kept in float32 whatever the input: a bf16 reduction comes back float32.
    "reduce_in_float32": (
        START,
        START.replace("block(i - shift)", "block(i - shift).astype(jnp.float32)"),
        check_dtypes,
    ),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_ring_mutant_is_caught(name):
    line, replacement, check = MUTANTS[name]
    check(_ring)  # the real module passes
    bad = mutant(_ring, name, line, replacement)
    if check is check_bidirectional:
        check_fixed(bad, (True,))  # a schedule-only bug: the values are still right ...
    with pytest.raises(AssertionError):
        check(bad)  # ... but the compiled program shows it
