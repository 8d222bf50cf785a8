"""FSDP's dense layer that moves its activations instead of gathering its weight.

Under FSDP a dense weight is split over ``data`` (N devices) along one of its dims and the batch
is split over ``data`` too. The default computes ``x · w`` by gathering ``w``; when the batch's
activations are smaller than the weight (wide layers, small batches) it is cheaper to leave
``w`` where it is and move ``x`` and ``y`` (scaling-book notation, ``w[K, F]`` as the layer sees
it, i.e. after any ``model`` split):

- ``w`` split along K (``w[K_data, F]``): AllToAll ``x[B_data, K] → x[B, K_data]`` (compute
  dtype), ``y[B, F]{U_data}`` = local matmul, ReduceScatter ``y{U_data} → y[B_data, F]``
  (float32, before the bias and the one cast). Backward: AllGather of ``dy`` (float32),
  ``dw[K_data, F] = x[B, K_data]ᵀ · dy[B, F]`` is already this device's shard (no reduction),
  and AllToAll of ``dx`` back.
- ``w`` split along F (``w[K, F_data]``): AllGather ``x[B_data, K] → x[B, K]``, ``y[B, F_data]``
  local, AllToAll ``y[B, F_data] → y[B_data, F]`` (float32); backward: AllToAll of ``dy``,
  ReduceScatter of ``dx`` (float32), ``dw`` local.

Which layers take this route is the strategy's choice (``shardops_models.strategies.fsdp``:
``moves_activations``, a rule in bytes).
"""

from __future__ import annotations

import jax

from shardops._axes import DATA_AXIS
from shardops.comm._collectives import all_reduce, all_to_all, reduce_scatter
from shardops.comm._mappings import REPLICATED_INPUT, copy_to_region, gather_to_region
from shardops.comm._reasons import Reason, because

# Why each collective of dense_moving_activations runs (``shardops.comm.because``; explain reads them).
_WHY = "FSDP moves this layer's activations instead of gathering its weight (they are smaller)"
_EXCHANGE = Reason("moving_exchange", forward={
    "all_to_all": f"{_WHY}: activations are exchanged over {{axis}} between the batch layout "
                  f"and a layout split along features",
}, backward={
    "all_to_all": "it is the transpose of the forward all_to_all: the gradient returns to the "
                  "other layout",
})  # fmt: skip
_PARTIAL_ROWS = Reason("moving_partial_rows", forward={
    "psum_scatter": f"{_WHY}: each device multiplied the whole batch by its block of the "
                    f"contraction, so the output's partial sums are reduced and each device "
                    f"keeps its rows",
}, backward={
    "all_gather": "it is the transpose of the forward psum_scatter: each device needs dy for "
                  "the whole batch",
})  # fmt: skip
_WHOLE_BATCH = Reason("moving_whole_batch", forward={
    "all_gather": f"{_WHY}: each device needs the whole batch's input for its block of output "
                  f"features",
}, backward={
    "psum_scatter": "it is the transpose of the input's all_gather: the dx partial sums are "
                    "reduced and split back over {axis} along the batch",
})  # fmt: skip
_ROW_SUMS = Reason("moving_row_partial_sums", forward={
    "psum": "the layer's contraction is also split over {axis} (tensor parallelism): its "
            "partial sums are reduced",
})  # fmt: skip
_REPLICA_WEIGHT = Reason("moving_replica_weight", backward={
    "psum": "the weight block is replicated over {axis} while the batch splits over it (HSDP): "
            "each replica's dw is summed",
})  # fmt: skip


def dense_moving_activations(
    x,
    w,
    b,
    *,
    split_dim: int,
    role: str,
    precision,
    data_axes=(DATA_AXIS,),
    model_axis=None,
    replicated_over=(),
):
    """``x[B_data, ..., K] · w + b → y[B_data, ..., F]`` with ``w`` left split over ``data``.

    Per device, inside ``jax.shard_map`` (``check_vma=True``). ``w``: the local block
    ``w[K_data, F']`` (``split_dim=0``) or ``w[K', F_data]`` (``split_dim=1``), where ``'``
    marks a ``model`` split under tp or sp (``role`` column: F/p; row: K/p, and ``x`` is then the
    column layer's ``x[..., K/p]``). ``b``: the bias as the layer sees it (already gathered
    over ``data``), added once after every reduction. ``data_axes``: the fsdp axes (``data``
    above); ``model_axis``: the tp axis, or None; ``replicated_over``: HSDP's replica axes, over
    which ``dw`` is AllReduced in float32.

    Communication: see the module docstring (``data``); with ``model_axis``, a column layer's
    ``dx`` is AllReduced over it in the backward pass and a row layer's ``y{U_model}`` in the
    forward.
    """
    with jax.named_scope("shardops.dense_moving_activations"):  # named in explain and profiles
        return _dense_moving_activations(x, w, b, split_dim=split_dim, role=role, precision=precision,
                                         data=tuple(data_axes), model=model_axis,
                                         replicas=tuple(replicated_over))  # fmt: skip


def _dense_moving_activations(x, w, b, *, split_dim: int, role: str, precision, data, model,
                              replicas):  # fmt: skip
    accum = precision.accum_dtype
    column, row = model is not None and role == "column", model is not None and role == "row"
    last = x.ndim - 1
    if replicas:  # w[..] replicated over the replicas: dw AllReduced over them in accum
        with because(_REPLICA_WEIGHT, replicas):
            w = copy_to_region(w, replicas, accum)
    if split_dim == 0:
        # x[B_data, ..., K] → x[B, ..., K_data]: one block of K to each device, in compute dtype.
        x = all_to_all(x, data, split_axis=last, concat_axis=0, reason=_EXCHANGE)
        if column:  # replicated over model: dx[B, ..., K_data]{U_model} AllReduced in accum
            with because(REPLICATED_INPUT, model):
                x = copy_to_region(x, model, accum)
        y = precision.matmul(x, w)  # y[B, ..., F']{U_data} in accum
        y = reduce_scatter(y, data, scatter_dimension=0, reason=_PARTIAL_ROWS)  # y[B_data, .., F']
        if row:  # the row layer's own reduction
            y = all_reduce(y, model, reason=_ROW_SUMS)  # y[B_data, ..., D]
    else:
        # x[B_data, ..., K'] → x[B, ..., K']; backward: ReduceScatter of dx in accum.
        with because(_WHOLE_BATCH, data):
            x = gather_to_region(x, data, 0, accum)  # x[B, ..., K'] in accum
        if column:
            with because(REPLICATED_INPUT, model):
                x = copy_to_region(x, model, accum)
        y = precision.matmul(x, w)  # y[B, ..., F_data]{U_model if row} in accum
        if row:
            y = all_reduce(y, model, reason=_ROW_SUMS)  # y[B, ..., F_data]
        # y[B, ..., F_data] → y[B_data, ..., F'] in accum
        y = all_to_all(y, data, split_axis=0, concat_axis=last, reason=_EXCHANGE)
    return precision.finish(y, b)
