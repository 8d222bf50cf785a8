"""fsdp_tp: weights split on both mesh axes, the scaling book's 2D weight sharding.

Megatron TP over ``model`` (as ``tp``) and FSDP over ``data`` (as ``fsdp``): a column weight is
stored as ``w[D_data, F_model]``, a row weight as ``w[F_model, D_data]`` (or, when D does not
divide, split further along F: ``w[F_(model,data), D]``). Each layer AllGathers its weights over
``data`` just in time (ReduceScatter of the gradients in the backward), then runs the TP kernel
on the batch shard ``x[B_data, D]``.
"""

from models._layout import data_axis_budget, merge, model_axis_budget, tp_plan, tp_specs, with_fsdp
from models._mlp import mlp_apply
from models.fsdp import gathered
from models.tp import TP_LAYERS
from shardops import DATA_AXIS, FLOAT32, MODEL_AXIS

NAME = "fsdp_tp"
AXES = (DATA_AXIS, MODEL_AXIS)
BATCH_AXES = (DATA_AXIS,)


def param_specs(sizes, mesh):
    return with_fsdp(tp_specs(sizes), sizes, mesh)


def forward(params, x, specs, *, remat=False, precision=FLOAT32):
    plan = tp_plan(len(params))
    # AllGather over data just in time, then the TP kernel of the layer over model.
    layer_fns = [gathered(TP_LAYERS[k], s, remat=remat) for k, s in zip(plan, specs, strict=True)]
    return mlp_apply(layer_fns, params, x, precision)  # (B/N, C)


def collective_budget(sizes, batch, mesh, *, remat=False, precision=FLOAT32):
    local_batch = batch // mesh.shape[DATA_AXIS]
    return merge(
        model_axis_budget(sizes, local_batch, mesh),
        data_axis_budget(
            param_specs(sizes, mesh),
            sizes,
            mesh,
            remat=remat,
            param_bytes=precision.param_dtype.itemsize,
        ),
    )
