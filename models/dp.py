"""dp: data parallelism. ``x[B_data, D]``; parameters replicated; gradients AllReduced over data.

Per step (N = size of ``data``): forward none; backward one AllReduce over ``data`` of every
gradient (the transpose of ``pcast`` to varying), plus an AllReduce of the scalar loss.
"""

import jax

from models._layout import data_axis_budget, gather_over_data, replicated_specs
from models._mlp import mlp_forward
from shardops import DATA_AXIS, FLOAT32

NAME = "dp"
AXES = (DATA_AXIS,)
BATCH_AXES = (DATA_AXIS,)


def param_specs(sizes, mesh):
    return replicated_specs(sizes)  # w[D, F], b[F] on every device


def forward(params, x, specs, *, remat=False, precision=FLOAT32):
    # Replicated params meet a batch shard: pcast to varying; its transpose AllReduces the grads.
    params = jax.tree.map(lambda p, s: gather_over_data(p, s, precision.accum_dtype), params, specs)
    return mlp_forward(params, x, precision)  # (B/N, C)


def collective_budget(sizes, batch, mesh, *, remat=False, precision=FLOAT32):
    # AllReduce(data) of each full gradient w[m, n], b[n]; AllReduce(data) of the loss.
    return data_axis_budget(param_specs(sizes, mesh), sizes, mesh)
