"""ref: the unsharded step, for comparison. One device, no mesh, no collectives."""

from models._mlp import mlp_forward

NAME = "ref"
AXES: tuple[str, ...] = ()
BATCH_AXES: tuple[str, ...] = ()


def param_specs(sizes, mesh):
    return None


def forward(params, x, specs, *, remat=False):
    return mlp_forward(params, x)  # (B, C)


def collective_budget(sizes, batch, mesh, *, remat=False):
    return {}
