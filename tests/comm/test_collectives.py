"""The named collectives (``shardops.comm.all_reduce`` …) are ``lax``'s own calls: the same
jaxpr, the same values and gradients bit for bit, equal to a numpy reference, on one axis and on
a tuple of axes, with pytrees; ``explain`` gives each the sentence of its ``reason``.

Values are small integers in float32, so every sum is exact in any order and a block put on the
wrong device cannot hide in a tolerance.
"""

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
from shardops import comm

REASON = comm.Reason("test_collectives", forward={"*": "the test asks over {axis}"},
                     backward={"*": "the test's backward over {axis}"})  # fmt: skip

# (mesh, the axes the collective runs over)
AXES = [({"x": 8}, "x"), ({"data": 2, "model": 4}, "model"),
        ({"data": 2, "model": 4}, ("data", "model")), ({"data": 4, "model": 2}, "data")]  # fmt: skip
BLOCK = (16, 3)  # this device's x: divisible by every axis size along dim 0


def _size(mesh, axes) -> int:
    return int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))


def _blocks(x, n):
    return np.split(x, n, axis=0)  # each device's x, in the axes' linear order


def reference(kind, x, n, shift=1):
    """The global result (device blocks stacked along dim 0) of ``kind`` in numpy."""
    xs = _blocks(x, n)
    if kind == "all_reduce":
        return np.tile(sum(xs), (n, 1))
    if kind == "all_max":
        return np.tile(np.max(xs, axis=0), (n, 1))
    if kind == "all_min":
        return np.tile(np.min(xs, axis=0), (n, 1))
    if kind == "all_gather":
        return np.tile(x, (n, 1))
    if kind == "reduce_scatter":
        return sum(xs)  # device j holds rows j of the sum: stacked, the whole sum
    if kind == "all_to_all":  # split dim 0 in n, block j to device j, joined along dim 1
        return np.concatenate(
            [np.concatenate([np.split(xi, n, axis=0)[j] for xi in xs], axis=1) for j in range(n)]
        )
    assert kind == "ring_pass"
    return np.concatenate([xs[(j - shift) % n] for j in range(n)])


def pair(kind, axes, shift=1):
    """``(named, raw)`` per-device functions of one kind."""
    if kind == "all_reduce":
        return (lambda a: comm.all_reduce(a, axes, reason=REASON), lambda a: lax.psum(a, axes))
    if kind == "all_max":
        return (lambda a: comm.all_max(a, axes, reason=REASON), lambda a: lax.pmax(a, axes))
    if kind == "all_min":
        return (lambda a: comm.all_min(a, axes, reason=REASON), lambda a: lax.pmin(a, axes))
    if kind == "all_gather":
        return (
            lambda a: comm.all_gather(a, axes, reason=REASON),
            lambda a: lax.all_gather(a, axes, axis=0, tiled=True),
        )
    if kind == "reduce_scatter":
        return (
            lambda a: comm.reduce_scatter(a, axes, reason=REASON),
            lambda a: lax.psum_scatter(a, axes, scatter_dimension=0, tiled=True),
        )
    if kind == "all_to_all":
        return (
            lambda a: comm.all_to_all(a, axes, split_axis=0, concat_axis=1, reason=REASON),
            lambda a: lax.all_to_all(a, axes, 0, 1, tiled=True),
        )
    assert kind == "ring_pass"

    def raw(a):
        n = _size_inside(axes)
        return lax.ppermute(a, axes, [(i, (i + shift) % n) for i in range(n)])

    return (lambda a: comm.ring_pass(a, axes, shift=shift, reason=REASON), raw)


def _size_inside(axes) -> int:
    return int(np.prod([lax.axis_size(a) for a in ((axes,) if isinstance(axes, str) else axes)]))


KINDS = ("all_reduce", "all_max", "all_min", "all_gather", "reduce_scatter", "all_to_all",
         "ring_pass")  # fmt: skip


def sharded(mesh, axes, body):
    def per_device(a):  # one name for both, so their jaxprs print alike
        return body(a)

    spec = P(axes)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("mesh_shape", "axes"), AXES)
def test_a_named_collective_is_the_lax_call(kind, mesh_shape, axes):
    mesh = shardops.make_mesh(mesh_shape)
    n = _size(mesh, axes)
    rng = np.random.default_rng(0)
    x = rng.integers(-4, 5, (n * BLOCK[0], BLOCK[1])).astype(np.float32)
    named, raw = pair(kind, axes, shift=3 if kind == "ring_pass" else 1)
    f, g = sharded(mesh, axes, named), sharded(mesh, axes, raw)
    # the same program: the jaxprs print the same (the reason lives in the name stack only)
    assert str(jax.make_jaxpr(f)(x)) == str(jax.make_jaxpr(g)(x))
    y = np.asarray(f(x))
    np.testing.assert_array_equal(y, np.asarray(g(x)))
    np.testing.assert_array_equal(y, reference(kind, x, n, shift=3))
    if kind in ("all_max", "all_min"):
        return  # JAX differentiates neither (callers put them under stop_gradient)
    # JAX's own autodiff: the gradients agree bit for bit
    w = rng.integers(-3, 4, y.shape).astype(np.float32)
    grads = [jax.grad(lambda a, h=h: (h(a) * w).sum())(x) for h in (f, g)]
    np.testing.assert_array_equal(*grads)


def test_pytrees_are_taken_as_lax_takes_them():
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    tree = {"a": np.arange(8 * 4, dtype=np.float32).reshape(8, 4), "b": (np.ones((8, 2)),)}

    def body(t):
        return (
            comm.all_reduce(t, "model", reason=REASON),
            comm.all_gather(t, "model", reason=REASON),
            comm.ring_pass(t, "model", reason=REASON),
        )

    s, gathered, passed = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=P("model"), out_specs=P("model")))(tree)  # fmt: skip
    np.testing.assert_array_equal(s["a"], reference("all_reduce", tree["a"], 4))
    np.testing.assert_array_equal(s["b"][0], 4 * np.ones((8, 2)))
    np.testing.assert_array_equal(gathered["a"], reference("all_gather", tree["a"], 4))
    np.testing.assert_array_equal(passed["a"], reference("ring_pass", tree["a"], 4))


def test_the_reason_is_required_and_must_be_a_reason():
    with pytest.raises(TypeError, match="reason"):
        comm.all_reduce(np.ones(2), "x")  # no reason= at all
    mesh = shardops.make_mesh({"x": 8})
    f = jax.shard_map(lambda a: comm.all_reduce(a, "x", reason="because"), mesh=mesh,
                      in_specs=P("x"), out_specs=P())  # fmt: skip
    with pytest.raises(TypeError, match="must be a shardops.comm.Reason"):
        f(np.ones(8, np.float32))


@pytest.mark.parametrize("traced", [True, False])
def test_explain_gives_each_collective_its_reason(traced):
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    kinds = {"all_reduce": "psum", "all_max": "pmax", "all_min": "pmin",
             "all_gather": "all_gather", "reduce_scatter": "psum_scatter",
             "all_to_all": "all_to_all", "ring_pass": "ppermute"}  # fmt: skip

    def body(a):
        outs = []
        for i, kind in enumerate(kinds):  # different values, so XLA merges none
            named, _ = pair(kind, "model")
            outs.append(named(a + i))
        return outs

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("model"), out_specs=P("model"))
    lines = shardops.inspect.explain(mesh, fn, np.ones((32, 3), np.float32), traced=traced)
    for name in kinds.values():
        assert any(
            f"{name} over 'model'" in line and "because the test asks over 'model'" in line
            for line in lines
        ), (name, lines)
