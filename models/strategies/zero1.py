"""ZeRO-1: the optimizer state split over the data axes, the parameters and gradients whole.

Everything ZeRO-1 does, in one place (the step and ``build`` call it where the strategy has
zero1 axes):

- **Layout** (``Zero1Kind.optimizer_layout``): the optimizer state's parameter-shaped leaves are split over
  zero1's axes by the FSDP rule (``models.strategies.fsdp``); the parameters stay replicated.
- **Backward** (``Zero1.varying``): the parameters enter the loss as float32 values varying over
  the axes, so each device's gradients leave the backward as its float32 partial sums (as dp's
  ``copy_to_region`` gives them), unreduced.
- **Update** (``Zero1.update``): each partial gradient is ReduceScattered along the dim its
  optimizer state splits (AllReduced where none splits), this device's shard of the parameter
  and of the state is updated, and the parameter is AllGathered back.
- **Whole gradients** (``Zero1.whole``): for ``setup.loss_and_grads``, the partial sums
  AllReduced, laid out like the parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
from shardops_models.strategies.fsdp import with_fsdp
from shardops_models.strategies.kind import Kind, LayoutContext, split_dim

_Reason = shardops.comm.Reason
GRADIENTS = _Reason("zero1_gradients", forward={
    "psum": "ZeRO-1: each device's float32 partial gradients over {axis} are summed",
})  # fmt: skip
UPDATE = _Reason("zero1_update", forward={
    "psum_scatter": "ZeRO-1: each device updates only its shard over {axis} of the optimizer "
                    "state, so the partial gradients are reduced and scattered",
    "psum": "ZeRO-1: this gradient has no dim its shard could split over {axis}: its partial "
            "sums are reduced whole",
    "all_gather": "ZeRO-1: each device updated its shard over {axis} of the parameter: the "
                  "shards are gathered back",
})  # fmt: skip


class Zero1Kind(Kind):
    """ZeRO-1 over ``axes`` (``Strategy(zero1=...)``): the parameters' gradients are not summed
    by autodiff (they enter the loss varying already, ``Zero1.varying``) but by the update."""

    name: ClassVar[str] = "zero1"
    doc: ClassVar[str] = ("the batch split; parameters replicated, optimizer state split; "
                          "gradients ReduceScattered, parameters AllGathered after the update")  # fmt: skip
    splits_batch: ClassVar[bool] = True

    def optimizer_layout(self, specs, stored, context: LayoutContext):
        """The optimizer state's parameter-shaped leaves split over the axes by the FSDP rule
        (the parameters stay replicated)."""
        return with_fsdp(specs, stored, context.mesh, self.axes, context.roles)

    def update(self, opt_param_specs, precision) -> Zero1:
        """ZeRO-1's update, each parameter's optimizer state split along the dim of
        ``opt_param_specs`` (the optimizer layout's) over the axes."""
        dims = jax.tree.map(lambda spec: _or_minus_one(split_dim(spec, self.axes)),
                            opt_param_specs, is_leaf=lambda s: isinstance(s, P))  # fmt: skip
        return Zero1(self.axes, dims, precision.accum_dtype)


@dataclasses.dataclass(frozen=True)
class Zero1:
    """ZeRO-1 over mesh ``axes``; ``dims``: per parameter, the dim its optimizer state splits
    over them (−1: none; a leaf, where None would be an empty subtree)."""

    axes: tuple[str, ...]
    dims: Any
    accum_dtype: Any

    def varying(self, params):
        """The parameters as float32 values varying over the axes: each device's gradients
        then leave the backward as its float32 partial sums."""
        return jax.tree.map(lambda p: lax.pcast(p.astype(self.accum_dtype), self.axes,
                                                to="varying"), params)  # fmt: skip

    def whole(self, partial, params):
        """The partial sums (float32) → the gradients, laid out like ``params``."""
        return jax.tree.map(
            lambda g, p: shardops.comm.all_reduce(g, self.axes, reason=GRADIENTS).astype(p.dtype),
            partial, params,
        )  # fmt: skip

    def update(self, optimizer: optax.GradientTransformation, params, opt_state, partial):
        """ReduceScatter each gradient ``g{U_zero1}`` (float32) over the axes along the dim
        its optimizer state splits (an AllReduce where none splits), cast it to the
        parameter's dtype, update this device's shard of the parameter and of the state, and
        AllGather the parameter back: ``(params, opt_state)``."""
        axes, comm = self.axes, shardops.comm
        n = lax.axis_size(axes)

        def grad_shard(g, d):  # g[.., K, ..]{U_zero1} → g[.., K_zero1, ..]
            if d < 0:
                return comm.all_reduce(g, axes, reason=UPDATE)
            return comm.reduce_scatter(g, axes, scatter_dimension=d, reason=UPDATE)

        def param_shard(p, d):  # p[.., K, ..], replicated → this device's p[.., K_zero1, ..]
            if d < 0:
                return p
            size = p.shape[d] // n
            return lax.dynamic_slice_in_dim(p, lax.axis_index(axes) * size, size, d)

        def param_whole(p, d):  # the updated shards → p[.., K, ..], replicated
            if d < 0:
                return p
            return comm.all_gather(p, axes, axis=d, to="invarying", reason=UPDATE)

        grads = jax.tree.map(lambda g, d, p: grad_shard(g, d).astype(p.dtype), partial,
                             self.dims, params)  # fmt: skip
        shards = jax.tree.map(param_shard, params, self.dims)
        updates, opt_state = optimizer.update(grads, opt_state, shards)
        shards = optax.apply_updates(shards, updates)
        return jax.tree.map(param_whole, shards, self.dims), opt_state


def _or_minus_one(d: int | None) -> int:
    return -1 if d is None else d
