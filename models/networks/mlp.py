"""The MLP as a model of the strategy mechanism: the seed's 784-512-10 (any depth and widths).

    x[B, D] → unit 0: dense → ReLU → unit 1: dense → … → logits[B, C]

Each layer is one unit (``ctx.unit``: one FSDP unit, one remat unit). The default plan is
Megatron's pairs, column, row, column, row, …, an odd last layer replicated (``tp_plan``).
Labels are one-hot ``y[B, C]``; the loss is the seed's ``-mean(one_hot · log_softmax)`` over
batch *and* classes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from shardops_models.networks._mlp import SEED_SIZES, check_sizes, cross_entropy_sum, init_mlp
from shardops_models.strategies.plan import COLUMN, REPLICATED, ROW


def tp_plan(n_layers: int) -> list[str]:
    """Megatron pairs: column, row, column, row, …; an odd last layer stays replicated.

    A column→activation→row pair needs one AllReduce forward. The unpaired last layer (the
    classifier of an odd-depth MLP) is small, so every ``model`` device computes it in full
    rather than paying a collective for it; a depth-1 MLP therefore has no tensor parallelism.
    """
    plan = [COLUMN, ROW] * (n_layers // 2)
    return [*plan, REPLICATED] if n_layers % 2 else plan


@dataclasses.dataclass(frozen=True)
class Mlp:
    """An MLP with layer widths ``sizes`` (input first, classes last)."""

    sizes: tuple[int, ...] = SEED_SIZES
    sequence = False  # no sequence dim: sequence parallelism does not apply

    def __post_init__(self):
        object.__setattr__(self, "sizes", check_sizes(self.sizes))

    @property
    def name(self) -> str:
        return "mlp " + "-".join(map(str, self.sizes))

    def init(self, key, dtype=None):
        """``[{"w": w[m, n], "b": b[n]}, ...]``: the seed's init (``init_mlp``)."""
        return init_mlp(key, self.sizes, dtype=dtype)

    def plan(self) -> list[str]:
        return tp_plan(len(self.sizes) - 1)

    def apply(self, ctx, params, x):
        """Logits ``[b, C]`` of the local batch ``x[b, D]`` (in compute dtype), and no
        auxiliary loss (``models.Model``)."""
        for i, layer in enumerate(params):
            x = ctx.unit(ctx.dense, layer, x)  # (b, width)
            if i < len(params) - 1:
                x = jax.nn.relu(x)
        return x, {}  # logits[b, C]

    def loss_sum(self, ctx, params, logits, y):
        """``-Σ one_hot · log_softmax`` over the local rows and classes (float32)."""
        return cross_entropy_sum(logits, y)

    def metrics(self, ctx, params, logits, y):
        """Local ``(loss_sum, correct, count)``; all-zero label rows are padding."""
        labelled = jnp.sum(y, -1) > 0  # (b,)
        loss_sum = cross_entropy_sum(logits, y) / y.shape[-1]  # padding rows add 0
        hits = (jnp.argmax(logits, -1) == jnp.argmax(y, -1)) & labelled  # (b,)
        return loss_sum, jnp.sum(hits, dtype=jnp.int32), jnp.sum(labelled, dtype=jnp.int32)

    def check_batch(self, x, y=None) -> None:
        """A global batch ``x[B, sizes[0]]`` and one-hot ``y[B, sizes[-1]]``."""
        if x.ndim != 2 or x.shape[1] != self.sizes[0]:
            raise ValueError(f"x must have shape (batch, {self.sizes[0]}); got {tuple(x.shape)}")
        if y is not None and tuple(y.shape) != (x.shape[0], self.sizes[-1]):
            raise ValueError(
                f"labels must be one-hot of shape ({x.shape[0]}, {self.sizes[-1]}); got "
                f"{tuple(y.shape)}"
            )
