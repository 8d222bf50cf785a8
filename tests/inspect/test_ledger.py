"""The communication ledger: hand-built programs, dtype promotion, the ring formulas and every
strategy's bytes against literal numbers worked out by hand, and bad input."""

import jax
import jax.numpy as jnp
import pytest
from _layout_checks import (
    BUDGETS,
    budget_run,
    check_ledger_budget,
    check_model_budget,
    check_ring_formulas,
)
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops


@pytest.fixture(scope="module")
def mesh():
    return shardops.make_mesh({"data": 4, "model": 2})


def ledger_of(mesh, body, in_specs, out_specs, *args):
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return shardops.inspect.ledger(mesh, fn, *args)


X = jnp.ones((16, 8))  # f32: 512 bytes


@pytest.mark.parametrize(
    ("body", "in_spec", "out_spec", "kind", "axes", "nbytes", "ring"),
    [
        # psum over data of x[4, 8] (each device's block): V = 128, AllReduce sends 2V(N−1)/N.
        (
            lambda x: lax.psum(x, "data"),
            P("data"),
            P(),
            "all-reduce",
            ("data",),
            128,
            2 * 128 * 3 / 4,
        ),
        # all_gather over model of x[8, 8] → x[16, 8]: V = 512, sends V(N−1)/N.
        (
            lambda x: lax.all_gather(x, "model", tiled=True),
            P("model"),
            P("model"),
            "all-gather",
            ("model",),
            512,
            256,
        ),
        # psum_scatter over data of x[16, 4]: V is the full 256 bytes, not the shard.
        (
            lambda x: lax.psum_scatter(x, "data", tiled=True),
            P(None, "model"),
            P("data", "model"),
            "reduce-scatter",
            ("data",),
            256,
            192,
        ),
        # ppermute along data of x[4, 8]: each device sends its 128 bytes.
        (
            lambda x: lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)]),
            P("data"),
            P("data"),
            "collective-permute",
            ("data",),
            128,
            128,
        ),
        # all_to_all over data of x[4, 8]: 8 columns split into 4 chunks f32[4, 2], one to each
        # device, rows concatenated → x[16, 2]. V = 128 (the result, which the ledger reads as
        # XLA's 4 tuple operands f32[4, 2]); each device keeps 1/4 and sends 128·3/4 = 96.
        (
            lambda x: lax.all_to_all(x, "data", 1, 0, tiled=True),
            P("data"),
            P(None, "data"),
            "all-to-all",
            ("data",),
            128,
            96,
        ),
    ],
    ids=["psum", "all_gather", "psum_scatter", "ppermute", "all_to_all"],
)
def test_hand_built_programs(mesh, body, in_spec, out_spec, kind, axes, nbytes, ring):
    led = ledger_of(mesh, body, in_spec, out_spec, X)
    assert led.totals() == {(kind, axes): nbytes}
    assert led.totals(requested=True) == {(kind, axes): nbytes}
    assert led.ring_bytes() == {axes: pytest.approx(ring)}
    assert led.per_axis() == {axes: nbytes} and led.per_kind() == {kind: nbytes}


def test_bf16_promotion_is_reported(mesh):
    led = ledger_of(mesh, lambda x: lax.psum(x, "data"), P("data"), P(), X.astype(jnp.bfloat16))
    asked = led.totals(requested=True)[("all-reduce", ("data",))]
    moved = led.totals()[("all-reduce", ("data",))]
    assert asked == 64  # bf16[4, 8]
    assert moved in (64, 128)  # XLA:CPU runs bf16 all-reduces in f32
    assert led.requested[0].dtypes == ("bf16",)
    if moved == 128:
        assert led.promoted() == {"all-reduce": (64, 128)}
        assert "asked for 64" in str(led)


def test_table_and_data(mesh):
    led = ledger_of(mesh, lambda x: lax.psum(x, "data"), P("data"), P(), X)
    text = str(led)
    assert "all-reduce" in text and "total" in text and "data" in text
    data = led.as_dict()
    assert data["totals"] == {"all-reduce data": 128}
    assert data["collectives"][0]["shapes"] == [[4, 8]]


def test_ring_formulas_by_hand():
    check_ring_formulas()


@pytest.mark.parametrize(
    "case", list(BUDGETS), ids=lambda c: "-".join([c[0], c[1]] + ["remat"] * c[2] + list(c[3:]))
)
def test_each_strategy_moves_the_bytes_worked_out_by_hand(case):
    """The compiled step (the ledger) and the analytic model (``collective_budget``,
    ``cost_model``) each equal bytes worked out by hand (``_layout_checks.BUDGETS``), rather
    than each other: they share ``shardops.inspect.ring_bytes`` and the strategies' specs."""
    setup, led = budget_run(*case)
    check_ledger_budget(case, led)
    check_model_budget(case, setup)


def test_a_function_that_does_not_compile(mesh):
    def bad(x):
        return x @ jnp.ones((3, 3))  # (16, 8) @ (3, 3)

    with pytest.raises(ValueError, match=r"ledger: could not lower and compile 'bad'.*TypeError"):
        shardops.inspect.ledger(mesh, bad, X)


def test_a_mesh_that_does_not_match(mesh):
    fn = jax.jit(
        jax.shard_map(
            lambda x: lax.psum(x, "model"),
            mesh=mesh,
            in_specs=P("data", "model"),
            out_specs=P("data"),
        )
    )
    with pytest.raises(ValueError, match=r"runs on 8 devices but the mesh \{'data': 4\} has 4"):
        shardops.inspect.ledger(shardops.make_mesh({"data": 4}), fn, X)
    with pytest.raises(ValueError, match=r"match no set of the mesh's axes \('a', 'b'\)"):
        shardops.inspect.ledger(shardops.make_mesh({"a": 2, "b": 4}), fn, X)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        shardops.inspect.ledger({"data": 4}, fn, X)
