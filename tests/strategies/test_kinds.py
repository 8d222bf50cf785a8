"""A kind of parallelism defined in this file, touching no library file, trains like the
unsharded reference: the core (``build``, the step, the layer context) asks the strategy's kinds
(``models.strategies.kind``) instead of branching on flags.

``Replicas`` is data parallelism written as a plug-in: the batch split over its axes, the
parameters replicated over them, their gradients summed; plus a rule of its own (a minimum of
rows per device), which ``build``'s batch check must ask it."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _gpt_checks import BATCH, GPT, check_lm_trajectory, gpt_batches, mesh_for
from _messages import refused

import shardops
import shardops_models as models
from shardops_models.strategies.kind import Kind

AR = "all-reduce"


@dataclasses.dataclass(frozen=True)
class Replicas(Kind):
    """Copies of the model over ``axes``, each on its own rows (a toy: dp, written here)."""

    min_rows: int = 1

    name: ClassVar[str] = "replicas"
    doc: ClassVar[str] = "the batch split; parameters replicated; gradients summed (a toy kind)"
    splits_batch: ClassVar[bool] = True
    sums_gradients: ClassVar[bool] = True

    def check_batch(self, strategy, mesh, x) -> None:
        rows = x.shape[0] // math.prod(mesh.shape[a] for a in strategy.batch_axes)
        if rows < self.min_rows:
            raise ValueError(
                f"x: {rows} row(s) per device, and the replicas kind needs at least "
                f"{self.min_rows}; use a batch of at least {self.min_rows * x.shape[0] // rows}"
            )


TOY_2D = models.Strategy("replicas_tp", tp="model", extra=(Replicas("data"),))
TOY_HSDP = models.Strategy("toy_hsdp_tp", fsdp="data", tp="model", extra=(Replicas("replica"),))


@pytest.mark.parametrize(("strategy", "mesh"), [(TOY_2D, "4x2"), (TOY_HSDP, "2x2x2")],
                         ids=["replicas×tp", "fsdp×replicas×tp"])  # fmt: skip
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_kind_of_your_own_trains_like_the_reference(strategy, mesh, opt):
    """5 steps of the GPT: losses, gradients (SGD) and parameters equal the unsharded model's;
    with fsdp beside it, the toy's axis is where a split parameter's shard is replicated."""
    check_lm_trajectory(GPT, strategy, mesh, opt)


def test_it_runs_the_program_of_the_built_in_dp():
    """The toy is dp by another name: the same collectives and, step for step, the same bits
    as the built-in ``2d`` on the same mesh (the core treats both kinds alike)."""
    mesh = mesh_for({"data": 4, "model": 2})
    ids, labels = (a[0] for a in gpt_batches())
    results = []
    for strategy in (TOY_2D, "2d"):
        setup = models.build(strategy, mesh, model=GPT, optimizer=optax.adam(1e-2))
        state = setup.shard(GPT.init(jax.random.key(0)))
        for _ in range(2):
            state, loss = setup.train_step(state, *setup.place_batch(ids, labels))
            float(loss)  # one step in flight
        budget = setup.budget(BATCH).totals()
        results.append((setup.gather(state.params), budget))
    (toy, toy_budget), (dp, dp_budget) = results
    assert toy_budget == dp_budget
    assert (AR, ("data",)) in toy_budget
    for a, b in zip(jax.tree.leaves(toy), jax.tree.leaves(dp), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_strategy_asks_its_kinds():
    """Its row in the table, the rules, and where its axes go: the batch's split after the
    built-in kinds', the gradient sums, the loss sum."""
    assert TOY_HSDP.rules == {"fsdp": ("data",), "replicas": ("replica",), "tp": ("model",)}
    assert TOY_HSDP.batch_axes == ("data", "replica")
    assert TOY_HSDP.gradient_axes == ("data", "replica")
    assert TOY_HSDP.reduce_axes == ("data", "replica")
    assert TOY_HSDP.axes == ("data", "replica", "model")
    assert "  replicas replica" in TOY_HSDP.table()
    assert "(a toy kind)" in TOY_HSDP.table()
    # the columns widen for the longest kind's name (docs/adding-a-kind.md shows this table)
    assert "\n  tp       model            each layer's weights split" in TOY_2D.table()
    assert TOY_HSDP.logical_rules == {"vocab": "model", "mlp": "model", "heads": "model",
                                      "kv_heads": "model"}  # fmt: skip


def test_the_kinds_batch_check_is_asked():
    strategy = models.Strategy("picky", tp="model", extra=(Replicas("data", min_rows=8),))
    setup = models.build(strategy, mesh_for({"data": 4, "model": 2}), model=GPT,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    ids, labels = (a[0] for a in gpt_batches())  # 16 rows: 4 a device
    with refused(ValueError, argument="x", got="4 row(s) per device", expected="at least 8",
                 fix="a batch of at least 32"):  # fmt: skip
        setup.place_batch(ids, labels)


def test_a_kind_on_an_axis_another_kind_uses_is_refused():
    with refused(ValueError, argument="mesh axis 'data'", got="both dp and replicas",
                 expected="each axis carries one kind", fix="an axis of its own"):  # fmt: skip
        models.Strategy("clash", dp="data", extra=(Replicas("data"),))


def test_extra_takes_kinds():
    with refused(TypeError, argument="extra", got="'data'", expected="Kind instances",
                 fix="MyKind('data')"):  # fmt: skip
        models.Strategy("wrong", extra=("data",))


def test_a_kind_that_does_not_sum_its_gradients_is_caught():
    """The mutant kind: the batch split, ``sums_gradients`` dropped. Autodiff still sums the
    gradients over its axis (``check_vma`` enters a replicated parameter varying by itself,
    where it meets the batch), so the values stay right; but not as ``ctx.unit`` sums them for
    the built-in dp and the toy (once per parameter, in float32, ``copy_to_region`` in
    ``accum_dtype``): under BFLOAT16 the step's AllReduces over ``data`` move other bytes
    (34,052 B against dp's 27,908 B for this GPT)."""

    class Unsummed(Replicas):
        sums_gradients: ClassVar[bool] = False

    mesh = mesh_for({"data": 4, "model": 2})
    unsummed = models.Strategy("unsummed", tp="model", extra=(Unsummed("data"),))
    gradients = {}
    for strategy in (TOY_2D, "2d", unsummed):
        setup = models.build(strategy, mesh, model=GPT, optimizer=optax.sgd(0.1),
                             precision=shardops.BFLOAT16)  # fmt: skip
        gradients[setup.strategy.name] = setup.budget(BATCH).totals()[(AR, ("data",))]
    assert gradients["replicas_tp"] == gradients["2d"]
    assert gradients["unsummed"] != gradients["2d"], gradients


class Experts(Kind):
    """A toy kind that only names a logical dim: ``experts`` over its axis."""

    name: ClassVar[str] = "experts"
    doc: ClassVar[str] = "a toy: the experts dim split (rules only)"

    def logical_rules(self) -> dict[str, str]:
        return {"experts": self.axes[0]}


class ExpertModel:
    """The least a model needs for ``build`` to lay it out: one leaf of a user's expert role."""

    name = "experts"

    def init(self, key, dtype=jnp.float32):
        return {"w": jnp.zeros((4, 16, 32), dtype)}  # w[E, D, F]

    def plan(self):
        from shardops_models.strategies.plan import Role

        return {"w": Role("expert_column", {"w": ("experts", "embed", "mlp")})}

    def apply(self, ctx, params, x):
        raise NotImplementedError  # never traced: the test reads the layout only

    loss_sum = check_batch = apply


def test_a_kinds_logical_rules_reach_the_layout():
    """A role of the user's (``experts``, ``embed``, ``mlp``) with a kind that maps ``experts``
    to ``data``: ``build`` lays dim 0 over data (and, under tp, dim 2 over model), from the
    strategy's one rules table; without that row the experts stay whole."""
    from jax.sharding import PartitionSpec as P

    strategy = models.Strategy("moe_tp", tp="model", extra=(Experts("data"),))
    assert strategy.logical_rules["experts"] == "data"
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    setup = models.build(strategy, mesh, model=ExpertModel(), optimizer=optax.sgd(0.1))
    assert setup.param_specs == {"w": P("data", None, "model")}
    alone = models.Strategy("moe", dp="replica", extra=(Experts("data"),))  # no tp: the same rule
    mesh3 = jax.sharding.AbstractMesh((2, 2), ("replica", "data"))
    setup = models.build(alone, mesh3, model=ExpertModel(), optimizer=optax.sgd(0.1))
    assert setup.param_specs == {"w": P("data", None, None)}
    # without the row, experts (one of the library's logical names) stay whole
    setup = models.build("tp", mesh, model=ExpertModel(), optimizer=optax.sgd(0.1))
    assert setup.param_specs == {"w": P(None, None, "model")}


def test_kinds_the_core_cannot_honour_are_refused():
    """Two kinds of one name, a built-in kind through ``extra``, an extra kind splitting the
    sequence: each refused before anything runs."""
    from shardops_models.strategies.data import DataKind

    class Sequence(Replicas):
        name: ClassVar[str] = "seq"
        splits_sequence: ClassVar[bool] = True

    with refused(ValueError, argument="Strategy 'twice'", got="two kinds named ['replicas']",
                 expected="a name of its own", fix="another name"):  # fmt: skip
        models.Strategy("twice", extra=(Replicas("a"), Replicas("b")))
    with refused(TypeError, argument="Strategy 'builtin'", got="DataKind is a built-in kind",
                 expected="the field dp=", fix="instead of extra"):  # fmt: skip
        models.Strategy("builtin", extra=(DataKind("data"),))
    with refused(ValueError, argument="kind 'seq'", got="splits the sequence",
                 expected="only for the built-in kinds", fix="use those fields"):  # fmt: skip
        models.Strategy("seq", extra=(Sequence("context"),))


def test_a_layer_of_your_own_finds_its_kinds_axis():
    """``ctx.axis_name`` answers a kind's own name (its axis), and the batch axes include the
    kinds that split the batch; a name the strategy lacks is refused, naming its kinds."""
    from shardops_models.strategies.parallel import Parallel

    ctx = Parallel(TOY_HSDP)
    assert ctx.axis_name("replicas") == "replica"
    assert ctx.axis_name("fsdp") == "data"
    assert ctx.axis_name("data") == ("data", "replica")
    with refused(ValueError, argument="kind", got="'expert'",
                 expected="['fsdp', 'replicas', 'tp']", fix="Name one of them"):  # fmt: skip
        ctx.axis_name("expert")
