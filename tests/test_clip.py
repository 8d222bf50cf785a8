"""Global-norm clipping under any sharding (``shardops.clip_by_global_norm``): the norm of the
global gradients, one AllReduce per distinct set of axes, equal to optax's unsharded; and the
mutant that computes each device's norm of its shards is caught."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _mutants import mutant
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops import _clip

# A tree whose leaves are split over data, over model, over both, and replicated.
SPECS = {"fsdp": P("data", None), "tp": P(None, "model"), "both": P("data", "model"),
         "replicated": P(None, None), "bias": P("model")}  # fmt: skip
SHAPES = {"fsdp": (8, 6), "tp": (6, 8), "both": (4, 8), "replicated": (3, 5), "bias": (8,)}


def tree(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def sharded(fn):
    """``fn`` applied inside a shard_map over data=2 × model=4 to the tree laid out by SPECS;
    the result laid out the same (a tree) or replicated (a scalar)."""
    mesh = shardops.make_mesh({"data": 2, "model": 4})

    def run(t, out_specs):
        placed = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in t.items()}
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(SPECS,), out_specs=out_specs))(placed)

    return mesh, run


def test_global_norm_is_the_norm_of_the_global_arrays():
    t = tree()
    want = np.sqrt(sum(np.sum(np.square(v.astype(np.float64))) for v in t.values()))
    _, run = sharded(shardops.global_norm)
    np.testing.assert_allclose(float(run(t, P())), want, rtol=1e-6)
    np.testing.assert_allclose(float(shardops.global_norm(t)), want, rtol=1e-6)  # unsharded


def test_one_all_reduce_per_set_of_axes():
    """4 distinct sets of axes ((data,), (model,), (data, model), none): 3 scalar AllReduces."""
    mesh, _ = sharded(shardops.global_norm)
    placed = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, SPECS[k]))
              for k, s in SHAPES.items()}  # fmt: skip
    fn = jax.shard_map(shardops.global_norm, mesh=mesh, in_specs=(SPECS,), out_specs=P())
    found = shardops.inspect.traced_collectives(mesh, fn, placed)
    assert sorted((c.kind, c.axes, c.bytes) for c in found) == sorted(
        [("all-reduce", ("data",), 4), ("all-reduce", ("model",), 4),
         ("all-reduce", ("data", "model"), 4)])  # fmt: skip


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["binds", "does_not_bind"])
def test_clip_equals_optax_unsharded(max_norm):
    t = tree(1)
    want, _ = optax.clip_by_global_norm(max_norm).update(t, optax.EmptyState())
    transform = shardops.clip_by_global_norm(max_norm)
    _, run = sharded(lambda g: transform.update(g, transform.init(g))[0])
    got = run(t, SPECS)
    for k in t:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, err_msg=k)
    if max_norm > 1e3:
        for k in t:
            np.testing.assert_array_equal(np.asarray(got[k]), t[k])


def test_the_norm_of_each_devices_shards_is_caught():
    """The mutant skips the AllReduce: each device clips by the norm of its own shards. A
    replicated output then varies over the mesh (check_vma refuses it), and the norm of a
    shard is not the norm: caught either way."""
    bad = mutant(_clip, "per_shard", "            squares = all_reduce(squares, axes, "
                 "reason=_SQUARES)  # the whole arrays' Σ g²", "            pass")  # fmt: skip
    t = tree()
    want = np.sqrt(sum(np.sum(np.square(v.astype(np.float64))) for v in t.values()))
    _, run = sharded(bad.global_norm)
    with pytest.raises((AssertionError, ValueError)) as caught:
        np.testing.assert_allclose(float(run(t, P())), want, rtol=1e-6)
    if isinstance(caught.value, ValueError):
        assert "vma" in str(caught.value) or "out_specs" in str(caught.value), caught.value


def test_bad_max_norm():
    for bad in (0, -1.0, "1", True):
        with pytest.raises(ValueError, match="max_norm must be a positive number"):
            shardops.clip_by_global_norm(bad)
