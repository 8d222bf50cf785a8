"""ref: the unsharded step, for comparison. One device, no mesh, no collectives."""

from models._mlp import mlp_forward
from shardops import FLOAT32

NAME = "ref"
AXES: tuple[str, ...] = ()
BATCH_AXES: tuple[str, ...] = ()


def param_specs(sizes, mesh):
    return None


def forward(params, x, specs, *, remat=False, precision=FLOAT32):
    return mlp_forward(params, x, precision)  # (B, C)


def collective_budget(sizes, batch, mesh, *, remat=False, precision=FLOAT32):
    return {}
