"""What the adapters of foreign modules (``FlaxModel``, ``EquinoxModel``) share: the task's loss,
metrics and batches (``task="lm"``: next-token over ``ids[B, S]``; ``"classify"``: integer
classes of ``x[B, ...]``), the heads and padding checks of a tp layout, and a path into a
parameter dict."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax import lax

from shardops import MODEL_AXIS, entry_axes
from shardops_models.networks._lm import LanguageModel

TASKS = ("lm", "classify")


def check_unpadded(p: dict, where: str, owner: str) -> None:
    """Refuse a layer's parameter the strategy stores padded (a dim the tp axis does not
    divide): the module's own code between its layers would see the padding (a head cut in
    two, a zero column read as a feature). ``owner``: the adapter, for the message."""
    for key, param in p.items():
        if param.logical is None:
            continue
        entries = [*param.spec, *[None] * (param.value.ndim - len(param.spec))]
        stored = tuple(n * math.prod(lax.axis_size(a) for a in entry_axes(e))
                       for n, e in zip(param.value.shape, entries, strict=True))  # fmt: skip
        if stored != tuple(param.logical):
            raise ValueError(
                f"{owner}: {where}.{key} of shape {tuple(param.logical)} is split over the tp "
                f"axis {MODEL_AXIS!r}, which does not divide it (stored padded to {stored}): the "
                f"module's own code would see the padding. Use sizes the axis divides, or a "
                f"mesh whose {MODEL_AXIS!r} axis divides them"
            )


def at_dict(tree, path):
    """The subtree of the nested dict ``tree`` at ``path`` (a sequence of keys)."""
    for key in path:
        tree = tree[key]
    return tree


class Refusing:
    """A plain object in the place of a module's layer (or sub-module) during a forward: the
    attributes it holds (``OWN``) read as usual; any other attribute the module's own code
    reads is refused by ``REFUSAL`` (formatted with ``where`` and the attribute's ``name``),
    which says why and what to call instead."""

    OWN: tuple[str, ...] = ()
    REFUSAL = "{where}.{name}"

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("where", *self.OWN):
            raise AttributeError(name)
        raise AttributeError(self.REFUSAL.format(where=self.where, name=name))


class ForeignModel(LanguageModel):
    """The task's loss, metrics and batches, and the heads check, of an adapter with fields
    ``task``, ``name``, ``num_heads``, ``num_kv_heads``, ``context`` and ``example_shape``."""

    def check_heads(self, ctx) -> None:
        """Under tp, the declared heads divide over the tp axis (each device's projections
        then hold whole heads: the module's own attention reads them as heads)."""
        if ctx.axis_name(MODEL_AXIS) is None or self.num_heads is None:
            return
        p = ctx.axis_size(MODEL_AXIS)
        for name, count in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads)):
            if count is not None and count % p:
                raise ValueError(
                    f"{type(self).__name__} {self.name!r}: {name}={count} is not divisible by "
                    f"the tp axis {MODEL_AXIS!r} (size {p}): a device would hold part of a "
                    f"head. Use a mesh whose {MODEL_AXIS!r} axis divides it"
                )

    def loss_sum(self, ctx, params, logits, labels):
        if self.task == "lm":
            return super().loss_sum(ctx, params, logits, labels)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
        return jnp.sum(losses)

    def metrics(self, ctx, params, logits, labels):
        if self.task == "lm":
            return super().metrics(ctx, params, logits, labels)
        hits = jnp.argmax(logits, -1) == labels
        return (self.loss_sum(ctx, params, logits, labels), jnp.sum(hits, dtype=jnp.int32),
                jnp.asarray(labels.size, jnp.int32))  # fmt: skip

    def abstract_batch(self, batch: int, seq: int | None):
        """Abstract ``(x, y)`` of one batch: ``ids, labels[batch, seq]``, or ``x[batch,
        *example_shape]`` and ``y[batch]`` integer classes."""
        if self.task == "lm":
            s = seq if seq is not None else self.context
            ids = jax.ShapeDtypeStruct((batch, s), jnp.int32)
            return ids, ids
        if self.example_shape is None:
            raise ValueError(f"{type(self).__name__} {self.name!r}: give example_shape (one "
                             f"example's shape, e.g. (784,)) to trace a batch of it")  # fmt: skip
        return (jax.ShapeDtypeStruct((batch, *self.example_shape), jnp.float32),
                jax.ShapeDtypeStruct((batch,), jnp.int32))  # fmt: skip

    def check_batch(self, x, y=None) -> None:
        if self.task == "lm":
            return super().check_batch(x, y)
        if y is not None and (tuple(y.shape) != x.shape[:1] or
                              not jnp.issubdtype(y.dtype, jnp.integer)):  # fmt: skip
            raise ValueError(f"labels must be integer classes of shape ({x.shape[0]},); got "
                             f"{y.dtype}{tuple(y.shape)}")  # fmt: skip
        return None
