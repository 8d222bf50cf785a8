"""Flax's multi-dimensional dense layers (``nnx.LinearGeneral``, ``nnx.Einsum``) as ``ctx.dense``.

Both contract the trailing dims of ``x`` with the leading dims of a kernel ``k[*in, *out]``
(``LinearGeneral(in_features, out_features, axis=-1 or trailing axes)``; an ``Einsum`` whose
equation says the same, e.g. ``"BTD,DNH->BTNH"``): flattened, that is ``ctx.dense`` of
``x[..., prod(in)]`` and ``w[prod(in), prod(out)]``, reshaped back. The tensor-parallel split
lies on the first ``out`` dim (column-parallel: an attention's query heads) or the first ``in``
dim (row-parallel: its output projection over the heads), so that each device's block of the
flattened weight is contiguous: ``k[D, H_model, h]`` is ``w[D, (H·h)_model]``. Any other layout
of the split, contraction or batch dims is refused, naming the layer.
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import PartitionSpec as P

from shardops import MODEL_AXIS
from shardops_models.strategies.plan import COLUMN, REPLICATED, ROW, Role


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A multi-dimensional dense layer as ``x[..., *in] · k[*in, *out] → y[..., *out]``."""

    n_in: int
    """How many trailing dims of ``x`` (leading dims of the kernel) it contracts."""
    where: str

    def role(self, names, bias_rank: int | None) -> Role:
        """The layer's plan role from its kernel's tensor-parallel split (``names``: per dim,
        whether its logical name maps to the tp axis): ``column`` on the first out dim,
        ``row`` on the first in dim, else ``replicated``."""
        split = [d for d, s in enumerate(names) if s]
        if not split:
            return REPLICATED
        if split == [self.n_in]:
            name, dims = COLUMN.name, ["embed"] * self.n_in + ["mlp"] + [None] * (
                len(names) - self.n_in - 1)  # fmt: skip
            bias = ("mlp", *[None] * (len(names) - self.n_in - 1))
        elif split == [0]:
            name, dims = ROW.name, ["mlp"] + [None] * (self.n_in - 1) + ["embed"] * (
                len(names) - self.n_in)  # fmt: skip
            bias = ("embed",) * (len(names) - self.n_in)
        else:
            raise ValueError(
                f"{self.where}.kernel: the dims mapped to {MODEL_AXIS!r} are {split} of a kernel "
                f"[*in ({self.n_in} dims), *out]; shardops splits the first out dim (dim "
                f"{self.n_in}: column-parallel) or the first in dim (dim 0: row-parallel), one "
                f"of them"
            )
        leaves = {"kernel": tuple(dims)}
        if bias_rank is not None:
            leaves["bias"] = tuple(bias)
        return Role(name, leaves)

    def run(self, ctx, p: dict, x, whole_sequence: bool = False):
        """``y[..., *out]`` of ``x[..., *in]`` by ``ctx.dense`` on the flattened kernel (``p``:
        the layer's ``Param``s, ready: inside ``ctx.unit``; ``whole_sequence`` as
        ``ctx.dense``'s)."""
        kernel = ctx.array(p["kernel"])  # k[*in, *out]: this device's block, whole over data
        d_in, d_out = kernel.shape[: self.n_in], kernel.shape[self.n_in :]
        if tuple(x.shape[x.ndim - self.n_in :]) != tuple(d_in):
            raise ValueError(f"{self.where}: x{tuple(x.shape)} does not end in the kernel's "
                             f"contracted dims {tuple(d_in)}")  # fmt: skip
        role, axis = p["kernel"].role, ctx.axis_name(MODEL_AXIS)
        spec = {COLUMN: P(None, axis), ROW: P(axis, None)}.get(role, P())
        flat = {"w": p["kernel"].replace(value=kernel.reshape(math.prod(d_in), math.prod(d_out)),
                                         spec=spec, pending=None, logical=None)}  # fmt: skip
        if "bias" in p:
            bias = ctx.array(p["bias"])
            flat["b"] = p["bias"].replace(value=bias.reshape(-1), pending=None, logical=None,
                                          spec=P(axis) if role == COLUMN else P())  # fmt: skip
        y = ctx.dense(flat, x.reshape(*x.shape[: x.ndim - self.n_in], math.prod(d_in)),
                      whole_sequence=whole_sequence)  # fmt: skip
        return y.reshape(*y.shape[:-1], *d_out)  # y[..., *out]


def linear_general(layer, where: str) -> Geometry:
    """The geometry of an ``nnx.LinearGeneral``: its ``axis`` the trailing dims, no batch axes."""
    n_in = len(layer.in_features)
    axes = tuple(layer.axis) if isinstance(layer.axis, tuple | list) else (layer.axis,)
    if layer.batch_axis or tuple(a if a < 0 else None for a in axes) != tuple(range(-n_in, 0)):
        raise ValueError(
            f"{where}: nnx.LinearGeneral(axis={layer.axis!r}, batch_axis="
            f"{dict(layer.batch_axis)!r}); shardops runs one that contracts the trailing dims "
            f"of x (axis=-1, or (-2, -1) for two) with no batch axes"
        )
    return Geometry(n_in, where)


def einsum(layer, where: str) -> Geometry:
    """The geometry of an ``nnx.Einsum`` whose equation is a dense layer's:
    ``"[batch][in],[in][out]->[batch][out]"`` (``...`` allowed for the batch)."""
    equation = layer.einsum_str.replace(" ", "")
    try:
        operands, out = equation.split("->")
        x, k = operands.split(",")
    except ValueError:
        x = k = out = ""
    kernel_letters = k
    contracted = [c for c in kernel_letters if c in x]
    n_in = len(contracted)
    features = kernel_letters[n_in:]
    batch = x[: len(x) - n_in]
    if (n_in == 0 or kernel_letters[:n_in] != x[len(x) - n_in :] or set(features) & set(x)
            or out != batch + features):  # fmt: skip
        raise ValueError(
            f"{where}: nnx.Einsum({layer.einsum_str!r}) is not a dense layer's contraction; "
            f"shardops runs an Einsum of the form 'BTD,DNH->BTNH': the kernel's leading dims "
            f"the input's trailing ones, its other dims the output's last, in order"
        )
    return Geometry(n_in, where)
