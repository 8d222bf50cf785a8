"""The collectives read from a traced program (``shardops.inspect.traced_ledger``): literal bytes
worked out by hand for every kind, passes, remat, scans, conds and nested jits, the same on an
``AbstractMesh`` of 4,096 devices, and what XLA:CPU runs (``RUNS_AS``) against the compiled
program."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
from shardops.inspect import traced_ledger

AR, AG, RS, CP, A2A = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)
SHAPE = {"data": 4, "model": 2}


@pytest.fixture(scope="module")
def mesh():
    return shardops.make_mesh(SHAPE)


BATCH, BATCH_MODEL = P("data"), P("data", "model")


def sharded(mesh, body, in_specs=BATCH, out_specs=BATCH_MODEL, **jit):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs), **jit)


X = jnp.ones((16, 8))  # f32; each device's block under P("data") is x[4, 8]: 128 bytes


def everything(x):  # x[4, 8] f32, 128 bytes
    a = lax.psum(x, "data")  # AR over data: V = 128
    b = lax.all_gather(x, "model", tiled=True)  # AG over model: V = the result x[8, 8], 256
    c = lax.psum_scatter(x, "data", tiled=True)  # RS over data: V = the operand, 128
    d = lax.all_to_all(x, "model", 1, 1, tiled=True)  # A2A over model: V = 128
    e = lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])  # CP over data: 128
    f = lax.psum(lax.pcast(x, "model", to="varying"), ("data", "model"))  # AR over both: 128
    return a + b[:4] + jnp.tile(c, (4, 1)) + d + e + f


EVERYTHING = {
    (AR, ("data",)): 128,
    (AG, ("model",)): 256,
    (RS, ("data",)): 128,
    (A2A, ("model",)): 128,
    (CP, ("data",)): 128,
    (AR, ("data", "model")): 128,
}


def test_every_kind_has_the_bytes_worked_out_by_hand(mesh):
    fn = sharded(mesh, everything)
    led = traced_ledger(mesh, fn, X)
    assert led.totals(requested=True) == EVERYTHING
    assert led.totals() == EVERYTHING  # f32: XLA:CPU runs what is asked
    compiled = shardops.inspect.ledger(mesh, fn, X)
    assert compiled.totals(requested=True) == EVERYTHING
    assert compiled.totals() == EVERYTHING


def test_a_bf16_program_asks_for_bf16_and_xla_cpu_runs_it_in_f32(mesh):
    fn = sharded(mesh, everything)
    x = X.astype(jnp.bfloat16)
    led = traced_ledger(mesh, fn, x)
    half = {k: v // 2 for k, v in EVERYTHING.items()}
    assert led.totals(requested=True) == half
    assert led.totals() == EVERYTHING  # RUNS_AS["cpu"]: every bf16 collective in f32
    assert traced_ledger(mesh, fn, x, backend="gpu").totals() == half
    compiled = shardops.inspect.ledger(mesh, fn, x)
    assert compiled.totals(requested=True) == half
    assert compiled.totals() == led.totals()


def test_axes_of_size_one_move_nothing():
    mesh = shardops.make_mesh({"data": 8, "model": 1})
    fn = sharded(mesh, lambda x: lax.psum(lax.pcast(x, "model", to="varying"), ("data", "model")))
    x = jnp.ones((16, 8))  # x[2, 8]: 64 bytes
    assert traced_ledger(mesh, fn, x).totals(requested=True) == {(AR, ("data",)): 64}
    assert shardops.inspect.ledger(mesh, fn, x).totals() == {(AR, ("data",)): 64}


def loss(w, x):  # w[8, 4] replicated, x[4, 8] a batch block
    y = jnp.tanh(x @ lax.pcast(w, "data", to="varying"))  # backward: AR of dw[8, 4], 128 bytes
    return lax.psum(jnp.sum(y), "data")  # forward: AR of one f32, 4 bytes


def test_passes_are_read_from_the_name_stack(mesh):
    fn = sharded(mesh, jax.grad(loss), in_specs=(P(), P("data")), out_specs=P())
    w = jnp.ones((8, 4))
    led = traced_ledger(mesh, fn, w, X)
    assert led.by_pass() == {"forward": {}, "backward": {(AR, ("data",)): 128}, "optimizer": {}}
    # the forward's psum is dead in jax.grad's program (nothing reads the loss): left out
    with_loss = sharded(mesh, jax.value_and_grad(loss), in_specs=(P(), P("data")),
                        out_specs=(P(), P()))  # fmt: skip
    led = traced_ledger(mesh, with_loss, w, X)
    assert led.by_pass()["forward"] == {(AR, ("data",)): 4}
    assert led.by_pass()["backward"] == {(AR, ("data",)): 128}
    assert led.by_pass() == shardops.inspect.ledger(mesh, with_loss, w, X).by_pass()


def test_the_optimizer_scope_is_its_own_pass(mesh):
    def step(x):
        with jax.named_scope(shardops.inspect.OPTIMIZER_SCOPE):
            return lax.psum(x, "model")

    led = traced_ledger(mesh, sharded(mesh, step), X)
    assert led.by_pass()["optimizer"] == {(AR, ("model",)): 128}


def test_remat_recomputation_is_counted_in_the_backward(mesh):
    """A checkpointed gather runs twice: in the forward and again in the backward. XLA:CPU
    runs it twice only with its barriers kept (``RUNS_AS``); by default it merges the two."""

    def layer(w, x):  # w[2, 4] a block of w[8, 4] split over data; x[4, 8]
        full = lax.all_gather(w, "data", tiled=True)  # w[8, 4]: 128 bytes
        return lax.psum(jnp.sum(jnp.tanh(x @ full)), "data")  # the loss: AR of 4 bytes

    def grads(remat, **jit):
        f = jax.checkpoint(layer) if remat else layer
        return sharded(mesh, jax.value_and_grad(f), in_specs=(P("data"), P("data")),
                       out_specs=(P(), P("data")), **jit)  # fmt: skip

    w = jnp.ones((8, 4))
    plain = traced_ledger(mesh, grads(False), w, X).by_pass()
    again = traced_ledger(mesh, grads(True), w, X).by_pass()
    assert plain["forward"] == again["forward"] == {(AG, ("data",)): 128, (AR, ("data",)): 4}
    assert plain["backward"] == {(RS, ("data",)): 128}  # dw reduce-scattered back
    assert again["backward"] == {(RS, ("data",)): 128, (AG, ("data",)): 128}
    kept = grads(True, compiler_options=shardops.inspect.KEEP_REMAT)
    assert again == shardops.inspect.ledger(mesh, kept, w, X).by_pass()
    merged = shardops.inspect.ledger(mesh, grads(True), w, X).by_pass()
    assert merged["backward"] == plain["backward"]


def test_a_scan_counts_its_body_length_times_and_nested_jits_are_entered(mesh):
    """The trace counts what runs: the body 3 times, and so does the compiled reading (by
    the trip count XLA records on the while loop)."""

    @jax.jit
    def inner(x):
        return lax.psum(x, "model")

    def body(x):
        def step(carry, _):
            return inner(carry) * 0.5, None

        return lax.scan(step, x, None, length=3)[0]

    fn = sharded(mesh, body)
    assert traced_ledger(mesh, fn, X).totals(requested=True) == {(AR, ("model",)): 3 * 128}
    assert shardops.inspect.ledger(mesh, fn, X).totals() == {(AR, ("model",)): 3 * 128}


def test_a_cond_counts_once_and_differing_branches_are_refused(mesh):
    def same(x):
        return lax.cond(x[0, 0] > 0, lambda a: a + lax.psum(a, "data"),
                        lambda a: a - lax.psum(a, "data"), x)  # fmt: skip

    def different(x):
        return lax.cond(x[0, 0] > 0, lambda a: a + lax.psum(a, "data"), lambda a: 2 * a, x)

    fn = sharded(mesh, same)
    assert traced_ledger(mesh, fn, X).totals(requested=True) == {(AR, ("data",)): 128}
    assert shardops.inspect.ledger(mesh, fn, X).totals() == {(AR, ("data",)): 128}  # one branch
    with pytest.raises(ValueError, match="cond .* issues different collectives in its branches"):
        traced_ledger(mesh, sharded(mesh, different), X)


def test_a_while_loop_that_communicates_is_refused(mesh):
    def body(x):
        def step(c):
            return c[0] + lax.psum(c[0], "data"), c[1] + 1

        return lax.while_loop(lambda c: c[1] < 3, step, (x, 0))[0]

    with pytest.raises(ValueError, match="while loop issues all-reduce over .*lax.scan"):
        traced_ledger(mesh, sharded(mesh, body), X)


def test_an_abstract_mesh_of_4096_devices_traces_with_the_local_shapes_of_8():
    """64 × 64 devices with the per-device blocks of 4 × 2 (the global arrays scaled): every
    reduction has the block's bytes, and a gather's bytes grow with its group."""
    small = shardops.make_mesh(SHAPE)
    big = shardops.abstract_mesh({"data": 64, "model": 64})
    spec = P("data", "model")

    def body(x):  # x[4, 8] on every device of either mesh: 128 bytes
        return lax.psum(x, "data"), lax.all_gather(x, "model", axis=1, tiled=True)

    def traced(mesh):
        fn = sharded(mesh, body, in_specs=spec, out_specs=(P(None, "model"), spec))
        n, m = mesh.shape["data"], mesh.shape["model"]
        return traced_ledger(mesh, fn, jax.ShapeDtypeStruct((4 * n, 8 * m), jnp.float32))

    assert traced(small).totals(requested=True) == {(AR, ("data",)): 128, (AG, ("model",)): 256}
    assert traced(big).totals(requested=True) == {(AR, ("data",)): 128, (AG, ("model",)): 64 * 128}
    fn = sharded(small, body, in_specs=spec, out_specs=(P(None, "model"), spec))
    compiled = shardops.inspect.ledger(small, fn, jnp.ones((16, 16)))
    assert compiled.totals() == traced(small).totals()


def test_a_collective_over_an_axis_the_mesh_lacks_is_an_error(mesh):
    other = shardops.abstract_mesh({"replica": 2, "data": 4})
    fn = sharded(other, lambda x: lax.psum(x, "replica"), out_specs=P("data"))
    with pytest.raises(ValueError, match=r"psum\w* over \['replica'\].*the mesh has axes"):
        shardops.inspect.traced_collectives(mesh, fn, jax.ShapeDtypeStruct((16, 8), jnp.float32))


def test_an_unknown_backend_is_an_error(mesh):
    with pytest.raises(ValueError, match="backend must be one of"):
        traced_ledger(mesh, sharded(mesh, everything), X, backend="tpu-v9")


@pytest.mark.parametrize(
    ("dtype", "name", "nbytes"),
    [(jnp.float32, "f32", 4), (jnp.bfloat16, "bf16", 2), (jnp.float16, "f16", 2),
     (jnp.int32, "s32", 4), (jnp.uint8, "u8", 1), (jnp.bool_, "pred", 1),
     (jnp.float8_e4m3fn, "f8e4m3fn", 1), (jnp.float8_e5m2, "f8e5m2", 1)],
)  # fmt: skip
def test_dtypes_get_the_names_and_sizes_of_the_compiled_reading(dtype, name, nbytes):
    from shardops.inspect._hlo import _DTYPE_BYTES
    from shardops.inspect._traced import hlo_dtype

    assert hlo_dtype(dtype) == name and _DTYPE_BYTES[name] == nbytes == jnp.dtype(dtype).itemsize
