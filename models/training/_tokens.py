"""What ``build`` learns of a model by tracing it abstractly: its parameter shapes, the activation
names its layers make (for remat), the vocabularies its token ids and labels index (so that a
token out of range is refused by name), and an abstract batch of it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardops_models.networks import contract
from shardops_models.networks._lm import LanguageModel, check_token_range
from shardops_models.strategies.parallel import (
    Parallel,
    strategy_named,
    wrap,
)
from shardops_models.strategies.plan import leaf_roles
from shardops_models.strategies.remat import names_made


def _concrete_tokens(a) -> bool:
    """Whether ``a`` is an integer array whose values can be read here (not a tracer)."""
    return (isinstance(a, np.ndarray | jax.Array) and not isinstance(a, jax.core.Tracer)
            and jnp.issubdtype(a.dtype, jnp.integer))  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class _VocabularyProbe(Parallel):
    """The unsharded layer context, noting the vocabulary of each batch array (``x``, ``y``)
    that reaches ``ctx.embed`` (as the ids) or ``ctx.cross_entropy`` (as the labels) unchanged."""

    inputs: dict = dataclasses.field(default_factory=dict)  # "x", "y" → the traced array
    seen: dict = dataclasses.field(default_factory=dict)  # "x", "y" → [(size, where from)]

    def _note(self, array, size: int, source: str, grow: str) -> None:
        for name, a in self.inputs.items():
            if array is a:
                self.seen.setdefault(name, []).append((int(size), source, grow))

    def embed(self, p, ids):
        table = self._arrays(p, "table", "embed")  # table[V, D], whole (unsharded)
        path = f"params{getattr(p['table'], 'path', '')}"
        self._note(ids, table.shape[0], f"the rows of {path}, the table ctx.embed reads",
                   f"{path} of {{n}} rows")  # fmt: skip
        return super().embed(p, ids)

    def cross_entropy(self, logits, labels, *, split: bool, vocab_size: int | None = None):
        source = (f"the vocab_size={vocab_size} the model passes to ctx.cross_entropy" if vocab_size
                  else "the logits' columns that ctx.cross_entropy reads")  # fmt: skip
        self._note(labels, vocab_size or logits.shape[-1], source, "logits of {n} columns")
        return super().cross_entropy(logits, labels, split=split, vocab_size=vocab_size)


def _vocabularies(model, plan, precision, x, y) -> dict[str, tuple[int, str, str]]:
    """Per batch array (``"x"``, ``"y"``): the vocabulary its values must lie in, as
    ``(size, where it comes from, how to grow it)``; arrays it is not known for are absent.

    A model that declares ``vocab_size`` gets it for both. Else the model's unsharded forward
    and loss are traced abstractly (no compilation) with a context that notes the arrays that
    reach ``ctx.embed`` or ``ctx.cross_entropy`` unchanged. ``models.Gpt`` and ``models.Llama``
    check their own batches (``LanguageModel.check_batch``): nothing more here.
    """
    if isinstance(model, LanguageModel):
        return {}
    declared = contract.declared(model).vocab_size
    if isinstance(declared, int | np.integer) and not isinstance(declared, bool):
        known = (int(declared), f"{type(model).__name__}.vocab_size", "vocab_size={n}")
        return {"x": known, "y": known}
    probe = _VocabularyProbe(strategy_named("ref"), precision)
    roles = leaf_roles(plan, _shapes(model))
    params = jax.eval_shape(functools.partial(model.init, dtype=precision.param_dtype),
                            jax.random.key(0))  # fmt: skip

    def run(params, x, y):
        probe.inputs.update(x=x) if y is None else probe.inputs.update(x=x, y=y)
        tree = wrap(params, roles, jax.tree.map(lambda _: P(), roles))
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(precision.compute_dtype)  # as the step casts it
        logits, _ = model.apply(probe, tree, x)
        return logits if y is None else model.loss_sum(probe, tree, logits, y)

    abstract = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, y)]
    try:
        jax.eval_shape(run, params, *abstract)
    except Exception:  # the train step's own trace reports the model's errors
        return {}
    return {name: min(seen) for name, seen in probe.seen.items()}  # the smallest, if several


def _names_made(model, plan, precision) -> set[str]:
    """The activation names (``checkpoint_name``) the model's unsharded forward makes, read
    from its trace (abstract: nothing is compiled); a remat policy may save these."""
    roles = leaf_roles(plan, _shapes(model))
    params = jax.eval_shape(functools.partial(model.init, dtype=precision.param_dtype),
                            jax.random.key(0))  # fmt: skip
    ctx = Parallel(strategy_named("ref"), precision)
    x, _ = model_batch(model, 1, None)

    def run(params, x):
        tree = wrap(params, roles, jax.tree.map(lambda _: P(), roles))
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(precision.compute_dtype)  # as the step casts it
        return model.apply(ctx, tree, x)

    return names_made(jax.make_jaxpr(run)(params, x))


def _check_tokens(vocabularies: dict, **arrays) -> None:
    """Each concrete integer array of ``arrays`` inside its vocabulary (``_vocabularies``)."""
    for name, a in arrays.items():
        if name in vocabularies and _concrete_tokens(a):
            size, source, grow = vocabularies[name]
            check_token_range(size, vocabulary=source, grow=grow, **{name: a})


def _shapes(model):
    """The parameter tree's global shapes (tuples), from ``model.init`` traced abstractly."""
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    return jax.tree.map(lambda a: tuple(a.shape), abstract)


def model_batch(model, batch: int, seq: int | None):
    """Abstract ``(x, y)`` of one batch: the MLP's ``x[b, D], y[b, C]``; a sequence model's
    ``ids[b, S], labels[b, S]`` (S: ``seq`` or the model's context); a model's own
    ``abstract_batch(batch, seq)`` where it has one."""
    if callable(getattr(model, "abstract_batch", None)):
        return model.abstract_batch(batch, seq)
    if contract.declared(model).sequence:
        s = model.context if seq is None else seq
        ids = jax.ShapeDtypeStruct((batch, s), jnp.int32)
        return ids, ids
    sizes = model.sizes
    return (jax.ShapeDtypeStruct((batch, sizes[0]), jnp.float32),
            jax.ShapeDtypeStruct((batch, sizes[-1]), jnp.float32))  # fmt: skip
