"""fsdp (ZeRO-3): parameters, gradients and optimizer state split over ``data``.

Each weight is AllGathered over ``data`` just before its layer runs; autodiff transposes that
AllGather into the ReduceScatter of its gradient, so each device only ever keeps its shard (no
extra ``psum_scatter``: that would double-count). Leaves no dimension lets us split stay
replicated and their gradients are AllReduced (``models._layout.with_fsdp``). With ``remat``,
each layer's gather is recomputed in the backward pass instead of keeping the full weight.
"""

import jax

from models._layout import data_axis_budget, gather_over_data, replicated_specs, with_fsdp
from models._mlp import dense_layer, mlp_apply
from shardops import DATA_AXIS, FLOAT32

NAME = "fsdp"
AXES = (DATA_AXIS,)
BATCH_AXES = (DATA_AXIS,)


def param_specs(sizes, mesh):
    return with_fsdp(replicated_specs(sizes), sizes, mesh)


def gathered(fn, spec, *, remat):
    """``fn(layer, x)`` on the layer's params AllGathered over data just in time.

    With ``remat`` the gather is not saved for the backward pass: ``jax.checkpoint`` reruns it.
    """

    def apply(layer, x, precision):
        accum = precision.accum_dtype
        return fn(
            jax.tree.map(lambda p, s: gather_over_data(p, s, accum), layer, spec), x, precision
        )

    return jax.checkpoint(apply, static_argnums=(2,)) if remat else apply


def forward(params, x, specs, *, remat=False, precision=FLOAT32):
    layer_fns = [gathered(dense_layer, spec, remat=remat) for spec in specs]
    return mlp_apply(layer_fns, params, x, precision)  # (B/N, C)


def collective_budget(sizes, batch, mesh, *, remat=False, precision=FLOAT32):
    # AllGather(data) of each split leaf (twice with remat) and ReduceScatter of its gradient;
    # AllReduce(data) of the replicated leaves' gradients and of the loss.
    param_bytes = precision.param_dtype.itemsize  # the gather moves params in their own dtype
    return data_axis_budget(
        param_specs(sizes, mesh), sizes, mesh, remat=remat, param_bytes=param_bytes
    )
