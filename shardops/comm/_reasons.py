"""Why a collective runs, written where it runs.

A kernel says why it communicates next to the call that does it::

    PARTIAL_SUMS = Reason("row_partial_sums", forward={
        "psum": "the contraction dim is split over {axis} (each device holds partial sums y{U})",
    })

    with because(PARTIAL_SUMS, axis_name):
        y = reduce_from_region(y_partial, axis_name)

``because`` is a ``jax.named_scope`` (``because.row_partial_sums[model]``): it costs nothing, it
travels with every op traced inside it into the jaxpr's name stack and the compiled HLO's
``op_name``, through autodiff's transpose, ``custom_vjp`` rules and remat. ``shardops.inspect.
explain`` reads it back from the traced or the compiled program, so a kernel's communication is
said once, in the kernel, and a user's own layer is explained by the same two lines.

A ``Reason`` holds one sentence per collective and pass, keyed by JAX's names (``psum``, ``pmax``,
``pmin``, ``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``), or one sentence for
any collective of that pass (``"*"``). ``{axis}`` in a sentence stands for the mesh axes the
collective runs over (``'model'``, ``'replica' × 'data'``). The scope applies only to
collectives over exactly the axes it names: autodiff's own reductions traced inside it (a
weight replicated over ``data`` used with a batch split over ``data``) keep their own reasons.
The innermost matching scope wins, except that a ``fallback`` reason (a generic one, said by a
mapping that cannot know its caller, such as the gradient reduction inside
``shardops.precision.matmul``) yields to any other scope that explains the collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import jax

KINDS = ("psum", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all", "ppermute")
"""The collectives a ``Reason`` can name (JAX's names), and ``"*"``: any of them."""

SCOPE = "because"
_SCOPE = re.compile(rf"{SCOPE}\.(\w+)\[([\w,]*)\]")

_REGISTRY: dict = {}
REASONS = MappingProxyType(_REGISTRY)
"""Every ``Reason`` made so far, by name (read by ``shardops.inspect.explain``)."""


@dataclasses.dataclass(frozen=True)
class Reason:
    """One reason to communicate: a sentence per JAX collective (or ``"*"``) and pass.

    Making one registers it under ``name`` (a Python identifier, unique: a second ``Reason``
    of the same name must say the same). A backward collective with no backward sentence whose
    kind has a forward one is remat's recomputation of the forward, and is explained as such.
    ``fallback=True``: a generic reason, used only where no other scope over the same axes
    explains the collective (the kernel around it knows better).
    """

    name: str
    forward: Mapping[str, str] = dataclasses.field(default_factory=dict)
    backward: Mapping[str, str] = dataclasses.field(default_factory=dict)
    fallback: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"Reason name must be a Python identifier; got {self.name!r}")
        for side in ("forward", "backward"):
            sentences = dict(getattr(self, side))
            unknown = sorted(set(sentences) - {*KINDS, "*"})
            if unknown:
                raise ValueError(
                    f"Reason {self.name!r}: {side} names {unknown}, which are not collectives; "
                    f"expected some of {(*KINDS, '*')}"
                )
            object.__setattr__(self, side, MappingProxyType(sentences))
        if not (self.forward or self.backward):
            raise ValueError(f"Reason {self.name!r} has no sentence: give forward= or backward=")
        known = _REGISTRY.setdefault(self.name, self)
        if known is not self and known != self:
            raise ValueError(
                f"Reason {self.name!r} is already registered with other sentences "
                f"({dict(known.forward)}, {dict(known.backward)}): choose another name"
            )

    def __eq__(self, other):
        return isinstance(other, Reason) and (self.name, dict(self.forward),
                                              dict(self.backward), self.fallback) == (
            other.name, dict(other.forward), dict(other.backward), other.fallback)  # fmt: skip

    def __hash__(self):
        return hash(self.name)

    def sentence(self, kind: str, backward: bool, axes: str) -> str | None:
        """The sentence for JAX collective ``kind`` in the backward (or forward) pass over
        ``axes`` (already written, e.g. ``'model'``), or None if this reason has none."""
        side = self.backward if backward else self.forward
        text = side.get(kind, side.get("*"))
        if text is None and backward:
            text = self.forward.get(kind, self.forward.get("*"))
            if text is not None:
                text += " (again in the backward pass: remat recomputes the forward)"
        return None if text is None else text.replace("{axis}", axes)


def because(reason: Reason, axis_name: str | Sequence[str]):
    """``with because(reason, axis_name):`` the collectives over ``axis_name`` traced inside
    are explained by ``reason`` (a ``jax.named_scope``; see the module docstring)."""
    if not isinstance(reason, Reason):
        raise TypeError(f"because: reason must be a shardops.comm.Reason; got {reason!r}")
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ValueError(
            f"because({reason.name!r}, ...): axis_name must be a mesh axis name or a tuple of "
            f"them; got {axis_name!r}"
        )
    if not all(a.isidentifier() for a in axes):
        # a name the op-name syntax cannot carry ('data-par', 'tensor.model'): the kernel runs
        # as ever, and explain gives the collective its generic reason
        return contextlib.nullcontext()
    return jax.named_scope(f"{SCOPE}.{reason.name}[{','.join(axes)}]")


def reason_for(op_name: str, kind: str, backward: bool, axes: Sequence[str]) -> str | None:
    """The sentence of the innermost ``because`` scope in ``op_name`` that names exactly
    ``axes`` and has a sentence for ``kind`` in that pass (a ``fallback`` reason only where no
    other has one); None if there is none."""
    written = " × ".join(repr(a) for a in axes)
    fallback = None
    for name, scope_axes in reversed(_SCOPE.findall(op_name)):
        reason = _REGISTRY.get(name)
        if reason is None or set(scope_axes.split(",")) != set(axes):
            continue
        text = reason.sentence(kind, backward, written)
        if text is not None and not reason.fallback:
            return text
        fallback = fallback or text
    return fallback
