"""``gather_many_to_region``: several parameters gathered in one collective. Values and
gradients equal the one-at-a-time ``gather_to_region`` bit for bit (integer-valued inputs, so
any summation order is exact), in the policy's dtypes, and the compiled program holds one
AllGather and one ReduceScatter in place of one per array."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models

MESHES = [{"data": 4}, {"data": 8}, {"data": 2, "model": 4}]
# (global shape, dim split over data)
LEAVES = [((8, 3), 0), ((3, 16), 1), ((8,), 0), ((2, 8, 5), 1)]


def specs(axis="data"):
    return tuple(
        P(*[axis if d == dim else None for d in range(len(shape))]) for shape, dim in LEAVES
    )


def leaves(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(-4, 5, shape).astype(dtype) for shape, _ in LEAVES)


def run(mesh_shape, dtype, many):
    """``(outputs, gradients)`` of the bundled or one-at-a-time gather, as global arrays."""
    mesh = shardops.make_mesh(mesh_shape)
    dims = [dim for _, dim in LEAVES]
    cotangents = tuple(np.random.default_rng(1).integers(-4, 5, s).astype(np.float32)
                       for s, _ in LEAVES)  # fmt: skip

    def gather(xs):
        if many:
            return shardops.comm.gather_many_to_region(xs, "data", dims, jnp.float32)
        return tuple(
            shardops.comm.gather_to_region(x, "data", d, jnp.float32)
            for x, d in zip(xs, dims, strict=True)
        )

    def per_device(xs, cts):
        out = tuple(o[None] for o in gather(xs))  # every device's gathered copy
        grads = jax.grad(
            lambda xs: sum(jnp.sum(o * c) for o, c in zip(gather(xs), cts, strict=True))
        )(xs)
        return out, grads

    replicated = tuple(P() for _ in LEAVES)
    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs(), replicated),
                               out_specs=(tuple(P("data") for _ in LEAVES), specs())))  # fmt: skip
    return fn, fn(leaves(dtype), cotangents), (leaves(dtype), cotangents), mesh


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_gather_many_equals_one_at_a_time(mesh_shape, dtype):
    fn, (out, grads), args, mesh = run(mesh_shape, dtype, many=True)
    _, (out1, grads1), _, _ = run(mesh_shape, dtype, many=False)
    for a, b, x in zip(out, out1, args[0], strict=True):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)
        n = mesh.shape["data"]
        # every device holds the whole array, in order
        np.testing.assert_array_equal(a, np.broadcast_to(x.astype(np.float32), (n, *x.shape)))
    for a, b, x in zip(grads, grads1, args[0], strict=True):
        assert a.dtype == b.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    led = shardops.inspect.ledger(mesh, fn, *args)
    kinds = [c.kind for c in led.requested if c.bytes]
    assert sorted(kinds) == ["all-gather", "reduce-scatter"]  # one each, for four arrays
    total = sum(int(np.prod(s)) for s, _ in LEAVES)
    itemsize = np.dtype(dtype).itemsize
    assert led.totals(requested=True) == {
        ("all-gather", ("data",)): total * itemsize,  # the blocks in their own dtype
        ("reduce-scatter", ("data",)): total * 4,  # the gradients in float32
    }


def test_mixed_dtypes_are_an_error():
    mesh = shardops.make_mesh({"data": 2})
    fn = jax.shard_map(
        lambda a, b: shardops.comm.gather_many_to_region((a, b), "data", (0, 0), jnp.float32),
        mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P()),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"one dtype; got \['bfloat16', 'float32'\]"):
        fn(jnp.zeros(4), jnp.zeros(4, jnp.bfloat16))


def test_a_gpt_fsdp_step_moves_each_unit_in_one_collective():
    """The GPT under fsdp: the parameters of a unit travel in one AllGather and one
    ReduceScatter per group (dtype and varying axes), not one per leaf; the bytes are the
    budget's."""
    gpt = models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=2, context=16)
    mesh = shardops.make_mesh({"data": 8})
    setup = models.build("fsdp", mesh, optimizer=optax.sgd(1.0), model=gpt,
                         fsdp_dense="gather_weights")  # fmt: skip
    state = setup.init(jax.random.key(0))
    ids = np.zeros((8, gpt.context), np.int32)
    led = shardops.inspect.ledger(mesh, setup.train_step, state, *setup.place_batch(ids, ids))
    assert led.totals(requested=True) == setup.collective_budget(8)
    leaves = len(jax.tree.leaves(state.params))  # 33 for this GPT
    units = gpt.num_layers + 2  # embedding, blocks, head
    for kind in ("all-gather", "reduce-scatter"):
        count = sum(1 for c in led.requested if c.kind == kind and c.bytes)
        # every unit's split leaves in one bundle; the dense weights (gathered when their
        # layer chooses to) one at a time: 2 per block (up, down) + the head
        assert count <= units + 2 * gpt.num_layers + 1 < leaves, (kind, count, leaves)


# Mutants of shardops/comm/_mappings.py, each caught by the comparison above.
MUTANTS = {
    # Every array's blocks joined along dim 0 whatever its split axis: a transposed layout
    # (caught by the arrays split along dim 1).
    "blocks_joined_on_dim_0": (
        "        block = jnp.moveaxis(block, 0, axis)  # [..., N, n_i, ...]\n",
        "        block = jnp.moveaxis(block, 0, 0)\n",
        np.float32,
    ),
    # The gradients reduce-scattered in the arrays' own dtype (bf16) instead of float32.
    "gradients_reduced_in_bf16": (
        "    flat = _blocks([g.astype(accum_dtype) for g in gs], axes, n)  # [N, Σ|x_i|] in accum\n",
        "    flat = _blocks([g.astype(kinds[0].dtype) for g in gs], axes, n)\n",
        jnp.bfloat16,
    ),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(monkeypatch, name):
    from _mutants import mutant

    from shardops.comm import _mappings

    old, new, dtype = MUTANTS[name]
    bad = mutant(_mappings, name, old, new)
    monkeypatch.setattr(shardops.comm, "gather_many_to_region", bad.gather_many_to_region)
    jax.clear_caches()
    with pytest.raises(AssertionError):
        test_gather_many_equals_one_at_a_time({"data": 4}, dtype)


def test_a_negative_dim_counts_from_the_end_and_a_bad_one_is_a_clear_error():
    """``reduce_scatter_from_region``, ``gather_from_region`` and ``gather_to_region`` take a
    negative dim as numpy does (it was an MLIR verifier error for the scatter); a dim out of
    range, or one the axis does not divide, names the helper, the argument, the shape and the fix."""
    from _messages import refused

    from shardops.comm import gather_from_region, gather_to_region, reduce_scatter_from_region

    mesh = shardops.make_mesh({"model": 4})
    y = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)

    def on_mesh(fn, out_specs):
        # check_vma off, in this test only: y enters replicated (P()) and goes straight into the
        # helpers, which here are tested for their dim handling (values exact: 4·y, 4 copies),
        # not their vma typing; the kernels' tests run them with check_vma on.
        return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=out_specs, check_vma=False)(y)

    for last in (2, -1):
        np.testing.assert_array_equal(
            on_mesh(lambda v, d=last: reduce_scatter_from_region(v, "model", d), P(None, None, "model")),
            4 * y,
        )  # fmt: skip
        gathered = on_mesh(lambda v, d=last: gather_from_region(v, "model", d), P())
        np.testing.assert_array_equal(gathered, np.concatenate([y] * 4, axis=2))
        gathered = on_mesh(lambda v, d=last: gather_to_region(v, "model", d, jnp.float32), P())
        np.testing.assert_array_equal(gathered, np.concatenate([y] * 4, axis=2))
    with refused(ValueError, argument="reduce_scatter_from_region: dim=3", got="y_partial of shape (2, 3, 8) (3 dims)",
                 expected="not a dim of", fix="pass an integer in [-3, 3)"):  # fmt: skip
        on_mesh(lambda v: reduce_scatter_from_region(v, "model", 3), P())
    with refused(ValueError, argument="gather_from_region: axis=-4", got="y_block of shape (2, 3, 8)",
                 expected="not a dim of", fix="pass an integer in [-3, 3)"):  # fmt: skip
        on_mesh(lambda v: gather_from_region(v, "model", -4), P())
    with refused(ValueError, argument="reduce_scatter_from_region: y_partial dim 1", got="= 3",
                 expected="mesh axis 'model' (size 4)", fix="pad that dim to a multiple of 4"):  # fmt: skip
        on_mesh(lambda v: reduce_scatter_from_region(v, "model", -2), P(None, "model"))


def test_a_negative_dim_passed_through_is_caught(monkeypatch):
    from _mutants import mutant

    from shardops.comm import _mappings

    bad = mutant(_mappings, "negative_dim", "    dim = int(dim) % ndim\n", "    dim = int(dim)\n")
    monkeypatch.setattr(shardops.comm, "reduce_scatter_from_region", bad.reduce_scatter_from_region)
    with pytest.raises(Exception, match="reduce_scatter"):  # the verifier's, not ours
        test_a_negative_dim_counts_from_the_end_and_a_bad_one_is_a_clear_error()
