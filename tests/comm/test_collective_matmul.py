"""Collective matmul (``shardops.comm.all_gather_matmul``, ``matmul_reduce_scatter``) equals the
unfused builtins and the unsharded product, forward and gradients (x and w), on every mesh
axis, uni- and bidirectional; it compiles to collective-permutes only, one way round the ring or
(bidirectional) half each way; mutants are caught.

Values are small integers in float32, so every sum is exact in any order and the comparison
is bit for bit.
"""

import functools

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
from shardops.comm import _collective_matmul

KINDS = ("all_gather_matmul", "matmul_reduce_scatter")
MESHES = [{"x": 1}, {"x": 2}, {"x": 4}, {"x": 8}, {"data": 2, "model": 4},
          {"data": 4, "model": 2}, {"data": 8, "model": 1}]  # fmt: skip
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def spec(rank: int, dim: int, axis_name: str) -> P:
    return P(*[axis_name if d == dim else None for d in range(rank)])


def run(module, mesh_shape, axis_name, kind, dim, bidirectional, lead, k, f, seed):
    """Ring and unfused ``(y, dx, dw)`` as global arrays, and the unsharded ``x @ w``.

    ``lead``: the leading dims of the *global* ``x`` (the one at ``dim`` divisible by N);
    ``k``, ``f``: contraction and output features per device.
    """
    mesh = shardops.make_mesh(mesh_shape)
    n = mesh.shape[axis_name]
    rng = np.random.default_rng(seed)
    rank = len(lead) + 1
    if kind == "all_gather_matmul":  # x split along dim, w[K, F] split along F
        x = rng.integers(-3, 4, (*lead, k)).astype(np.float32)
        w = rng.integers(-3, 4, (k, n * f)).astype(np.float32)
        x_spec, w_spec, y_spec = spec(rank, dim, axis_name), P(None, axis_name), spec(rank, rank - 1, axis_name)  # fmt: skip

        def ring(a, b):
            return module.all_gather_matmul(a, b, axis_name, axis=dim, bidirectional=bidirectional)

        def unfused(a, b):
            return lax.all_gather(a, axis_name, axis=dim, tiled=True) @ b
    else:  # x split along K, w[K, F] split along K; y scattered along dim
        x = rng.integers(-3, 4, (*lead, n * k)).astype(np.float32)
        w = rng.integers(-3, 4, (n * k, f)).astype(np.float32)
        x_spec, w_spec, y_spec = spec(rank, rank - 1, axis_name), P(axis_name, None), spec(rank, dim, axis_name)  # fmt: skip

        def ring(a, b):
            return module.matmul_reduce_scatter(a, b, axis_name, scatter_dimension=dim,
                                                bidirectional=bidirectional)  # fmt: skip

        def unfused(a, b):
            return lax.psum_scatter(a @ b, axis_name, scatter_dimension=dim, tiled=True)

    expected = x @ w  # the unsharded product, global
    c = rng.integers(-3, 4, expected.shape).astype(np.float32)  # the cotangent

    def per_device(a, b, c):
        out = []
        for op in (ring, unfused):
            y = op(a, b)
            gx, gw = jax.grad(lambda a, b, op=op: jnp.sum(op(a, b) * c), argnums=(0, 1))(a, b)
            out += [y, gx, gw]
        return tuple(out)

    f_jit = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(x_spec, w_spec, y_spec),
                      out_specs=(y_spec, x_spec, w_spec) * 2),
        compiler_options=COMPILER_OPTIONS,
    )  # fmt: skip
    return [np.asarray(v) for v in f_jit(x, w, c)], expected


@st.composite
def cases(draw):
    mesh_shape = draw(st.sampled_from(MESHES))
    axis_name = draw(st.sampled_from(sorted(mesh_shape)))
    n = mesh_shape[axis_name]
    kind = draw(st.sampled_from(KINDS))
    bidirectional = draw(st.booleans())
    rank = draw(st.integers(2, 3))
    dim = draw(st.integers(0, rank - 2))
    lead = [draw(st.integers(1, 3)) for _ in range(rank - 1)]
    block = draw(st.integers(1, 3)) * (2 if bidirectional else 1)
    lead[dim] = n * block
    return (mesh_shape, axis_name, kind, dim, bidirectional, tuple(lead),
            draw(st.integers(1, 4)), draw(st.integers(1, 4)))  # fmt: skip


@settings(max_examples=max(settings.default.max_examples, 1))
@given(case=cases(), seed=st.integers(0, 2**16))
def test_collective_matmul_equals_unfused_and_unsharded(case, seed):
    (ring_y, ring_gx, ring_gw, y, gx, gw), expected = run(_collective_matmul, *case, seed)
    where = f"{case[2]} over {case[1]!r} of {case[0]}, dim {case[3]}, bidirectional={case[4]}"
    np.testing.assert_array_equal(y, expected, err_msg=f"{where}: unfused vs unsharded")
    np.testing.assert_array_equal(ring_y, expected, err_msg=f"{where}: forward")
    np.testing.assert_array_equal(ring_gx, gx, err_msg=f"{where}: dx")
    np.testing.assert_array_equal(ring_gw, gw, err_msg=f"{where}: dw")


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_collective_matmul_compiles_to_permutes_of_the_ring_bytes(kind, bidirectional):
    """Forward: only collective-permutes over ``model``, N − 1 steps (per direction), moving
    (N − 1)/N of the gathered ``x`` (all-gather) or of the full ``y`` (reduce-scatter)."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    n = 4
    if kind == "all_gather_matmul":
        x, w = jnp.zeros((n * 8, 16)), jnp.zeros((16, n * 4))

        def fn(a, b):
            return shardops.comm.all_gather_matmul(a, b, "model", bidirectional=bidirectional)

        specs, out, v = (P("model"), P(None, "model")), P(None, "model"), n * 8 * 16 * 4
    else:
        x, w = jnp.zeros((n * 8, n * 4)), jnp.zeros((n * 4, 16))

        def fn(a, b):
            return shardops.comm.matmul_reduce_scatter(a, b, "model", bidirectional=bidirectional)

        specs, out, v = (P(None, "model"), P("model")), P("model"), n * 8 * 16 * 4
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out))
    ledger = shardops.inspect.ledger(mesh, f, x, w)
    shifts = permute_shifts(f.lower(x, w).compile().as_text(), mesh, "model")
    check_ring_directions(shifts, bidirectional, kind)
    permutes = [c for c in ledger.collectives if c.bytes]
    assert {c.kind for c in permutes} == {"collective-permute"}, permutes
    assert len(permutes) == (n - 1) * (2 if bidirectional else 1)
    assert ledger.totals() == {("collective-permute", ("model",)): (n - 1) / n * v}


def test_bad_arguments_are_clear_errors():
    mesh = shardops.make_mesh({"model": 4})

    def call(fn, *local_shapes):
        args = [jnp.zeros((4 * shape[0], *shape[1:])) for shape in local_shapes]
        return jax.shard_map(fn, mesh=mesh, in_specs=P("model"), out_specs=P("model"))(*args)

    with pytest.raises(ValueError, match=r"x dim 0 = 6 is not divisible by mesh axis 'model'"):
        call(lambda a, b: shardops.comm.matmul_reduce_scatter(a, b, "model"), (6, 3), (3, 2))
    with pytest.raises(ValueError, match="the block has 3 rows there; use an even block"):
        call(lambda a, b: shardops.comm.all_gather_matmul(a, b, "model", bidirectional=True),
             (3, 2), (2, 2))  # fmt: skip
    with pytest.raises(ValueError, match="axis=1 must name a leading dim of x"):
        call(lambda a, b: shardops.comm.all_gather_matmul(a, b, "model", axis=1), (4, 2), (2, 2))


def check_fixed(module, directions=(False,)) -> None:
    """Forward equals the unsharded product and gradients the unfused ones, fixed cases."""
    for kind in KINDS:
        for bidirectional in directions:
            case = ({"data": 2, "model": 4}, "model", kind, 0, bidirectional, (8, 3), 2, 3)
            (ring_y, ring_gx, ring_gw, _, gx, gw), expected = run(module, *case, seed=0)
            assert np.array_equal(ring_y, expected), case
            assert np.array_equal(ring_gx, gx) and np.array_equal(ring_gw, gw), case


def check_directions(module, directions=(False, True)) -> None:
    """Compiled, both kernels step i → i + 1 only, or (bidirectional) as often i → i − 1."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    x, w = jnp.zeros((4 * 8, 16)), jnp.zeros((16, 16))
    # all_gather_matmul's product is whole on every device but varies over model in type (it
    # comes out of ppermutes), so it leaves stacked, P("model"): only the permutes are read.
    for kind, specs, out in (("all_gather_matmul", (P("model"), P()), P("model")),
                             ("matmul_reduce_scatter", (P(None, "model"), P("model")), P("model"))):  # fmt: skip
        for bidirectional in directions:
            fn = functools.partial(getattr(module, kind), axis_name="model",
                                   bidirectional=bidirectional)  # fmt: skip
            f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out))
            shifts = permute_shifts(f.lower(x, w).compile().as_text(), mesh, "model")
            check_ring_directions(shifts, bidirectional, f"{kind}, bidirectional={bidirectional}")


def check_dtypes(module) -> None:
    """In bfloat16 both kernels return what the unfused builtins return: dtype and values."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    x = jnp.asarray(np.arange(16 * 8).reshape(16, 8) % 5, jnp.bfloat16)
    w = jnp.asarray(np.arange(8 * 8).reshape(8, 8) % 3, jnp.bfloat16)
    cases = [
        (module.all_gather_matmul, (P("model"), P(None, "model")), P(None, "model"),
         lambda a, b: lax.all_gather(a, "model", tiled=True) @ b),
        (module.matmul_reduce_scatter, (P(None, "model"), P("model")), P("model"),
         lambda a, b: lax.psum_scatter(a @ b, "model", tiled=True)),
    ]  # fmt: skip
    for fused, in_specs, out_spec, unfused in cases:
        for bidirectional in (False, True):
            got, want = (
                jax.shard_map(op, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(x, w)
                for op in (
                    functools.partial(fused, axis_name="model", bidirectional=bidirectional),
                    unfused,
                )
            )
            assert got.dtype == want.dtype == jnp.bfloat16, (fused.__name__, got.dtype)
            assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_collective_matmul_keeps_the_dtype():
    check_dtypes(_collective_matmul)


# --- mutants, each caught by one of the checks above


def check_bidirectional(module) -> None:
    """``check_directions`` of the bidirectional rings only (the one-way ones share no line
    with the mutants below)."""
    check_directions(module, (True,))


PLACE = "            start = ((i - s) % n) * m\n"
# The second halves of a bidirectional all-gather: sent i → i − 1, so written from device i + s.
LEFT = (
    "        nxt_l = lax.ppermute(left, axis_name, ring_pairs(n, -1)) if s < n - 1 else None\n"
    "        out = put(out, fn(right), ((i - s) % n) * m)\n"
    "        out = put(out, fn(left), ((i + s) % n) * m + h)\n"
)
LEFT_SCATTER = "    return jnp.concatenate([ring(0, h, +1), ring(h, h, -1)], axis=dim)\n"
ACC = "            acc = acc + product(i - (s + 1) * shift, lo, size)\n"
PRODUCT = "        return rows @ w\n"
MUTANTS = {
    # The ring's shift read backwards: each block's product written at the wrong rows.
    "gather_shift_reversed": (PLACE, PLACE.replace("(i - s)", "(i + s)"), check_fixed),
    # A block accumulated twice on its way round the ring.
    "block_accumulated_twice": (
        ACC,
        ACC.replace("acc + product", "acc + 2 * product"),
        check_fixed,
    ),
    # bidirectional=True sends both halves the same way (and places them to match): the same
    # values and bytes as the two-way ring, all of it over one direction of each link.
    "bidirectional_gather_one_way": (
        LEFT,
        LEFT.replace("ring_pairs(n, -1)", "ring_pairs(n, +1)").replace(
            "(i + s) % n", "(i - s) % n"
        ),
        check_bidirectional,
    ),
    "bidirectional_scatter_one_way": (
        LEFT_SCATTER,
        LEFT_SCATTER.replace("ring(h, h, -1)", "ring(h, h, +1)"),
        check_bidirectional,
    ),
    # Products accumulated in float32 whatever the input: a bf16 layer returns float32.
    "products_in_float32": (
        PRODUCT,
        PRODUCT.replace("rows @ w", "jnp.matmul(rows, w, preferred_element_type=jnp.float32)"),
        check_dtypes,
    ),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_collective_matmul_mutant_is_caught(name):
    line, replacement, check = MUTANTS[name]
    check(_collective_matmul)  # the real module passes
    bad = mutant(_collective_matmul, name, line, replacement)  # (the schedule-only mutants
    with pytest.raises(AssertionError):  # keep the values: test_ring shows it for its own)
        check(bad)
