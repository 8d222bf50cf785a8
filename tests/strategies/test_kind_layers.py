"""A kind of parallelism defined in this file runs layers: its ``dense`` hook is the kernel of the
plan roles it splits, and no library file changes. ``Columns`` is Megatron's MLP split written as
a plug-in: a rules row (``mlp`` → its axis) lays the column and row layers out, and its
``dense`` runs shardops' column- and row-parallel kernels on them. Beside dp it trains the MLP
like the unsharded reference, and runs the built-in ``2d`` program bit for bit; a mutant that
leaves the row layers to the local kernel is caught."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import numpy as np
import optax
import pytest
from _model_checks import batches, check_trajectory, mesh_for

import shardops
import shardops_models as models
from shardops_models.strategies.kind import Kind
from shardops_models.strategies.plan import COLUMN, ROW

SIZES, BATCH = (24, 32, 16, 8), 32  # column, row, replicated
MESH = {"data": 4, "model": 2}


@dataclasses.dataclass(frozen=True)
class Columns(Kind):
    """The MLP's hidden units split over one axis: column layers ``w[D, F_axis]``, row layers
    ``w[F_axis, D]`` whose partial sums are AllReduced (a toy: tp for dense layers only)."""

    name: ClassVar[str] = "columns"
    doc: ClassVar[str] = "hidden units split: column and row layers (a toy kind)"
    row_kernel: ClassVar[bool] = True

    @property
    def axis(self) -> str:
        return self.axes[0]

    def logical_rules(self) -> dict[str, str]:
        return {"mlp": self.axis}

    def dense(self, ctx, p, x):
        w, b = ctx._arrays(p, "w", "dense"), ctx._optional(p, "b")
        if p["w"].role == COLUMN:  # y[b, F_axis]: no communication
            return shardops.layers.column_parallel_dense_kernel(
                x, w, b, axis_name=self.axis, precision=ctx.precision
            )
        if p["w"].role == ROW and self.row_kernel:  # y{U_axis} → y: AllReduce
            return shardops.layers.row_parallel_dense_kernel(
                x, w, b, axis_name=self.axis, precision=ctx.precision
            )
        return None

    def splits_output(self, p) -> bool:
        return p["w"].role == COLUMN


TOY = models.Strategy("dp_columns", dp="data", extra=(Columns("model"),))


def test_its_layout_is_its_rules_row():
    """``mlp`` → model: the column layer's w and b, the row layer's w split; the rest whole."""
    setup = models.build(TOY, mesh_for(MESH), optimizer=optax.sgd(0.1), sizes=SIZES)
    split = [{k: "model" in jax.tree.leaves(tuple(s)) for k, s in layer.items()}
             for layer in setup.param_specs]  # fmt: skip
    assert split == [{"w": True, "b": True}, {"w": True, "b": False}, {"w": False, "b": False}]
    assert setup.param_specs[0]["w"] == jax.sharding.PartitionSpec(None, "model")


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_kind_that_runs_layers_trains_like_the_reference(opt):
    """5 steps: losses, gradients (SGD) and parameters equal the unsharded MLP's."""
    check_trajectory(TOY, MESH, opt, sizes=SIZES, batch=BATCH)


def test_it_runs_the_program_of_the_built_in_2d():
    """The same kernels as tp's on the same layout: the same collectives and the same bits."""
    xs, ys = batches(SIZES, BATCH)
    results = []
    for strategy in (TOY, "2d"):
        setup = models.build(strategy, mesh_for(MESH), optimizer=optax.adam(1e-2), sizes=SIZES)
        state = setup.init(jax.random.key(0))
        for x, y in zip(xs[:2], ys[:2], strict=True):
            state, loss = setup.train_step(state, *setup.place_batch(x, y))
            float(loss)  # one step in flight
        results.append((setup.gather(state.params), setup.budget(BATCH).totals()))
    (toy, toy_budget), (tp, tp_budget) = results
    assert toy_budget == tp_budget
    assert ("all-reduce", ("model",)) in toy_budget
    for a, b in zip(jax.tree.leaves(toy), jax.tree.leaves(tp), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_kind_that_leaves_its_row_layers_to_the_local_kernel_is_caught():
    """The mutant: the row layer's split weight multiplied locally, its partial sums never
    reduced. shard_map's check of the step's outputs refuses a loss varying over the axis."""

    class NoRows(Columns):
        row_kernel: ClassVar[bool] = False

    mutant = models.Strategy("dp_columns", dp="data", extra=(NoRows("model"),))
    with pytest.raises(ValueError, match="out_specs"):
        check_trajectory(mutant, MESH, "sgd", sizes=SIZES, batch=BATCH)
