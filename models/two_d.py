"""2d: data × model on one mesh (the seed's 4×2). ``x[B_data, D]``, Megatron TP over ``model``.

Parameters are split over ``model`` as in ``tp`` and replicated over ``data``. Per step: the
``tp`` collectives over ``model`` on the local batch B/N, plus the ``dp`` AllReduce over ``data``
of every gradient shard and of the loss.
"""

import jax

from models import tp
from models._layout import data_axis_budget, gather_over_data, merge, model_axis_budget, tp_specs
from shardops import DATA_AXIS, FLOAT32, MODEL_AXIS

NAME = "2d"
AXES = (DATA_AXIS, MODEL_AXIS)
BATCH_AXES = (DATA_AXIS,)


def param_specs(sizes, mesh):
    return tp_specs(sizes)  # replicated over data


def forward(params, x, specs, *, remat=False, precision=FLOAT32):
    # Replicated over data: pcast to varying, whose transpose AllReduces the grads over data.
    params = jax.tree.map(lambda p, s: gather_over_data(p, s, precision.accum_dtype), params, specs)
    return tp.forward(params, x, specs, precision=precision)  # (B/N, C)


def collective_budget(sizes, batch, mesh, *, remat=False, precision=FLOAT32):
    local_batch = batch // mesh.shape[DATA_AXIS]
    return merge(
        model_axis_budget(sizes, local_batch, mesh),
        data_axis_budget(param_specs(sizes, mesh), sizes, mesh),
    )
