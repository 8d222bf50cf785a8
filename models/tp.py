"""tp: Megatron tensor parallelism over ``model``; the batch is replicated.

Layers alternate column-parallel ``w[D, F_model]`` and row-parallel ``w[F_model, D]``, so each
column→ReLU→row pair needs one AllReduce forward (the row layer's psum) and, when its input
needs a gradient, one backward (the column layer's dx). An odd last layer is replicated
(``models._layout.tp_plan``).
"""

import shardops
from models._layout import COLUMN, DENSE, ROW, model_axis_budget, tp_plan, tp_specs
from models._mlp import dense_layer, mlp_apply
from shardops import FLOAT32, MODEL_AXIS

NAME = "tp"
AXES = (MODEL_AXIS,)
BATCH_AXES: tuple[str, ...] = ()

TP_LAYERS = {
    # x[b, D] replicated → h[b, F/p]; backward AllReduce of dx over model.
    COLUMN: lambda layer, x, precision: shardops.column_parallel_dense_kernel(
        x, **layer, precision=precision
    ),
    # h[b, F/p] → y[b, D]{U_model} → psum over model → y[b, D] replicated.
    ROW: lambda layer, x, precision: shardops.row_parallel_dense_kernel(
        x, **layer, precision=precision
    ),
    # the unpaired last layer: replicated, no communication.
    DENSE: dense_layer,
}


def param_specs(sizes, mesh):
    return tp_specs(sizes)


def forward(params, x, specs, *, remat=False, precision=FLOAT32):
    layer_fns = [TP_LAYERS[kind] for kind in tp_plan(len(params))]
    return mlp_apply(layer_fns, params, x, precision)  # (B, C), replicated over model


def collective_budget(sizes, batch, mesh, *, remat=False, precision=FLOAT32):
    # Model axis only: row outputs forward, column dx backward (not the first layer's).
    return model_axis_budget(sizes, batch, mesh)
