"""The model contract: what ``models.build`` needs of a model, declared once and checked at build.

A model is any object with these members (``Model``, a ``typing.Protocol``)::

    name: str                                   # for messages
    init(key, dtype=None) -> params             # the parameter tree (global shapes)
    plan() -> roles                             # each parameter's role (models.strategies.plan)
    apply(ctx, params, x) -> (logits, aux)      # the forward, once for every strategy
    loss_sum(ctx, params, logits, y) -> scalar  # Σ of the loss over this device's targets
    check_batch(x, y=None) -> None              # a global batch's shapes, else a clear error
    metrics(ctx, params, logits, y) -> (loss_sum, correct, count)   # for setup.evaluate only

``apply`` returns the logits and a dict of auxiliary losses (``{}`` for most models; a mixture of
experts returns its load-balancing loss): each a float scalar, this device's value for its share
of the tokens. The step adds each, times its weight (``build(aux_weights=...)`` or the model's
``aux_weights``), averaged over the devices that hold different tokens, to the mean loss.

A model may also declare (``declared`` reads them, once, with their defaults):

- ``sequence: bool`` (False): the batch is ``ids[B, S]``: sequence and context parallelism apply;
  ``context``, the sequence length of an abstract batch;
- ``vocab_size: int`` (None): token ids lie in ``[0, vocab_size)``;
- ``num_heads``, ``num_kv_heads`` (None): the attention's head counts, checked against the mesh;
- ``output_layer(params)`` (None): the layer that makes the logits, so that logits split over
  the vocabulary are gathered by ``setup.logits``;
- ``bos_id`` (None): the token that begins a packed document;
- ``aux_weights: Mapping[str, float]`` ({}): the weight of each auxiliary loss ``apply`` returns;
- ``abstract_batch(batch, seq) -> (x, y)`` (None): the abstract batch the budget and the cost
  model trace (``ShapeDtypeStruct``s), where it is neither the MLP's ``x[B, sizes[0]]`` nor a
  sequence model's ``ids[B, S]`` (``FlaxModel(task="classify")``).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

REQUIRED = ("name", "init", "plan", "apply", "loss_sum", "check_batch")
"""The members every model has (``Model``); ``metrics`` is needed by ``setup.evaluate`` only."""


@runtime_checkable
class Model(Protocol):
    """The members ``models.build`` calls (the module docstring says what each returns)."""

    name: str

    def init(self, key, dtype=None) -> Any: ...

    def plan(self) -> Any: ...

    def apply(self, ctx, params, x) -> tuple[Any, Mapping[str, Any]]: ...

    def loss_sum(self, ctx, params, logits, y) -> Any: ...

    def check_batch(self, x, y=None) -> None: ...


@dataclasses.dataclass(frozen=True)
class Declared:
    """What a model declares beyond ``Model`` (the module docstring), with the defaults."""

    sequence: bool = False
    vocab_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    output_layer: Callable | None = None
    bos_id: int | None = None
    aux_weights: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def kv_heads(self) -> int | None:
        """The number of K/V heads (``num_heads`` where the model declares no other)."""
        return self.num_kv_heads or self.num_heads


def check_model(model, where: str = "models.build") -> Declared:
    """``model``'s declarations, after checking it has every member of ``Model``.

    Raises ``TypeError`` naming each member the model lacks (or has, but not callable)."""
    missing = [m for m in REQUIRED if not hasattr(model, m)]
    not_callable = [
        m for m in REQUIRED[1:] if hasattr(model, m) and not callable(getattr(model, m))
    ]
    if missing or not_callable:
        problems = [f"lacks {', '.join(missing)}"] if missing else []
        problems += [f"has {', '.join(not_callable)} but not as methods"] if not_callable else []
        raise TypeError(
            f"{where}: model {type(model).__name__} {' and '.join(problems)}; a model needs "
            f"{', '.join(REQUIRED)} (models.Model: see models/networks/contract.py, or "
            f"models.Gpt for a whole one)"
        )
    found = declared(model)
    if not _weights(found.aux_weights):
        raise TypeError(
            f"{where}: {type(model).__name__}.aux_weights must map each auxiliary loss's name to "
            f"its weight, a real number (e.g. {{'load_balance': 0.01}}); got {found.aux_weights!r}"
        )
    return found


def declared(model) -> Declared:
    """What ``model`` declares (``Declared``): each member it has, else the default."""
    found = {f.name: getattr(model, f.name) for f in dataclasses.fields(Declared)
             if getattr(model, f.name, None) is not None}  # fmt: skip
    return Declared(**found)


def aux_weights(declared: Declared, given: Mapping[str, float] | None, where: str = "models.build"):
    """The weight of each auxiliary loss: the model's ``aux_weights`` updated by ``given``."""
    for source, weights in (("the model's aux_weights", declared.aux_weights),
                            ("aux_weights", given)):  # fmt: skip
        if weights is not None and not _weights(weights):
            raise TypeError(
                f"{where}: {source} must map each auxiliary loss's name to a real number, e.g. "
                f"{{'load_balance': 0.01}}; got {weights!r}"
            )
    return {k: float(v) for k, v in {**declared.aux_weights, **(given or {})}.items()}


def check_aux_names(weights: Mapping[str, float], aux: Mapping[str, Any], model,
                    where: str) -> None:  # fmt: skip
    """A ``ValueError`` for each weight that names no auxiliary loss ``model.apply`` returned
    (``aux``): a misspelt key would otherwise leave its loss at no weight, or train without it."""
    unknown = sorted(set(weights) - set(aux))
    if unknown:
        returned = ", ".join(repr(n) for n in sorted(aux)) or "none"
        raise ValueError(
            f"{where}: aux_weights {unknown} name no auxiliary loss {type(model).__name__}.apply "
            f"returns (it returns: {returned}); correct the names in models.build(aux_weights=...)"
            f" or the model's aux_weights, or drop them"
        )


def _weights(weights) -> bool:
    return isinstance(weights, Mapping) and all(
        isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
        for k, v in weights.items()
    )


def check_metrics(model, where: str = "setup.evaluate") -> None:
    """A ``TypeError`` unless ``model`` has ``metrics`` (which ``setup.evaluate`` calls)."""
    if not callable(getattr(model, "metrics", None)):
        raise TypeError(
            f"{where}: model {type(model).__name__} has no metrics(ctx, params, logits, y) "
            f"returning (loss_sum, correct, count) over this device's targets; define it to "
            f"evaluate (models.Gpt.metrics is one)"
        )


def split_output(out, model, where: str):
    """``(logits, aux)`` of what ``model.apply`` returned, checked."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
        if isinstance(out, tuple):
            got = f"a tuple of {len(out)}"
        else:
            got = f"an array of shape {tuple(out.shape)}" if hasattr(out, "shape") else repr(out)
        raise TypeError(
            f"{where}: {type(model).__name__}.apply must return (logits, aux), aux a dict of "
            f"auxiliary losses ({{}} for none); got {got}. Return `logits, {{}}`"
        )
    return out
