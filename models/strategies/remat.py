"""Activation checkpointing (remat): what each unit keeps for its backward pass.

A model runs its blocks through ``ctx.unit`` (or ``ctx.scan``, a unit per layer); the policy
``build(..., remat=...)`` wraps every unit of the train step in ``jax.checkpoint`` with a
policy, under every strategy:

    remat=            a unit's backward pass has                    recomputes
    "none", False     every residual its forward made (no remat)    nothing
    "full", True      the unit's inputs only                        the whole unit
    "matmuls"         the dense layers' outputs                     the rest: norms, activations,
                      (dots_with_no_batch_dims_saveable)            attention's score products
    ("attention_output", ...)  the activations of these names       the rest
    "offload"         as "matmuls", those outputs on the host       as "matmuls"
                      (offload_dot_with_no_batch_dims → "pinned_host")
    Remat("offload", names)    the named activations, on the host    the rest
    a jax.checkpoint policy    what it says is saveable               the rest

Under fsdp every policy but "none" gathers the unit's weights again in the backward pass: a
gather's output is no dot and no named activation, so no policy here saves it (the full
weights would stay alive from a unit's forward to its backward, undoing FSDP). ``"full"`` is
the ``remat=True`` of before: the re-gather, and the unit's forward recomputed. The unit's
forward collectives (tp's AllReduce, a context ring) run again where what they made is not
saved; ``Setup.budget`` reads them from the traced step.

Only the train step (and ``loss_and_grads``) checkpoints: ``evaluate`` and ``logits`` have no
backward pass. ``"matmuls"`` keeps the dots with no batch dimension, the projections ``x · w``
(shardops' dense matmul is a ``custom_vjp``; the policy sees the ``dot_general`` of its
forward), not attention's products, batched over heads (``checkpoint_dots`` would keep those).
On XLA:CPU ``"pinned_host"`` is the same memory as the device's: ``"offload"`` compiles, runs
and gives the same numbers there, and holds about what ``"matmuls"`` holds; not refused, so a
program meant for an accelerator runs and is tested on CPU.

The names (``NAMES``) are made by the layers with ``jax.ad_checkpoint.checkpoint_name``; tag
an activation of a layer of your own the same way to save it by its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr

ATTENTION_OUTPUT = "attention_output"
"""``ctx.attention``'s output ``y[b, S, D]`` (after the output projection)."""
MLP_INPUT = "mlp_input"
"""The MLP's input ``x[b, S, D]`` (``ctx.gated_mlp``'s; the GPT's normed input of ``up``)."""
MLP_HIDDEN = "mlp_hidden"
"""The MLP's hidden ``h[b, S, F]``: ``activation(gate) ⊙ up`` of a gated MLP
(``shardops.gated_mlp`` and its tensor-parallel kernel), the GPT's ``up`` output."""
MLP_OUTPUT = "mlp_output"
"""The MLP's output ``y[b, S, D]`` (``ctx.gated_mlp``'s; the GPT's ``down`` output)."""
NAMES = (ATTENTION_OUTPUT, MLP_INPUT, MLP_HIDDEN, MLP_OUTPUT)
"""The activations shardops' layers and models name."""

POLICIES = ("none", "full", "matmuls", "offload")
"""The policies a string names."""
KINDS = (*POLICIES, "save", "custom")

OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"


@dataclasses.dataclass(frozen=True)
class Remat:
    """An activation-checkpoint policy, applied to each unit (see the module docstring).

    ``build(remat=...)`` takes one of these or what ``Remat.of`` reads as one: ``"none"``
    (``False``), ``"full"`` (``True``), ``"matmuls"``, ``"offload"``, a tuple of names (save
    those), or a ``jax.checkpoint`` policy (a callable). ``Remat("offload", names)`` offloads
    the named activations to the host.

    Arguments:
        kind: ``"none"``, ``"full"``, ``"matmuls"``, ``"offload"``, ``"save"`` (``names``) or
            ``"custom"`` (``policy``).
        names: ``"save"``: the activations kept; ``"offload"``: the ones moved to the host
            (empty: the matmul outputs).
        policy: ``"custom"``: a ``jax.checkpoint_policies`` policy.
    """

    kind: str = "none"
    names: tuple[str, ...] = ()
    policy: Callable | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(
                f'remat: kind {self.kind!r} is not one of {KINDS}; use "none", "full", '
                f'"matmuls", "offload", a tuple of activation names (saved) or a '
                f"jax.checkpoint policy"
            )
        if isinstance(self.names, str) or not all(isinstance(n, str) for n in self.names):
            raise TypeError(f"remat: names must be a tuple of strings (e.g. {NAMES[:2]}); got "
                            f"{self.names!r}")  # fmt: skip
        object.__setattr__(self, "names", tuple(self.names))
        if self.kind == "save" and not self.names:
            raise ValueError(
                "remat: a policy that saves names needs at least one name; got none. Saving "
                'nothing is remat="full"'
            )
        if self.names and self.kind not in ("save", "offload"):
            raise ValueError(f"remat: kind {self.kind!r} takes no names; got {self.names}. Use "
                             f"kind \"save\" or \"offload\"")  # fmt: skip
        if (self.kind == "custom") != (self.policy is not None):
            raise ValueError('remat: a policy callable goes with kind "custom", and only there')

    @classmethod
    def of(cls, value) -> Remat:
        """The policy ``value`` names: a ``Remat``; ``False``/``None`` → ``"none"``, ``True``
        → ``"full"``; a string of ``POLICIES``; a tuple or list of names → save them; a
        ``jax.checkpoint`` policy (a callable) → ``"custom"``."""
        if isinstance(value, Remat):
            return value
        if value is None or value is False:
            return cls("none")
        if value is True:
            return cls("full")
        if isinstance(value, str):
            if value not in POLICIES:
                raise ValueError(
                    f"remat={value!r} is not a policy; expected one of {POLICIES}, a tuple of "
                    f"activation names (e.g. {NAMES[:2]}) or a jax.checkpoint policy. Pick one "
                    f"of {POLICIES}, or pass remat=({value!r},) to save an activation of that "
                    f"name"
                )
            return cls(value)
        if isinstance(value, tuple | list):
            return cls("save", tuple(value))
        if callable(value):
            return cls("custom", policy=value)
        raise TypeError(
            f"remat={value!r}: expected one of {POLICIES}, a bool, a tuple of activation names "
            f"or a jax.checkpoint policy; got {type(value).__name__}. Pass e.g. "
            f'remat="matmuls" or remat={NAMES[:1]}'
        )

    def __bool__(self) -> bool:
        """Whether a unit recomputes anything (every kind but ``"none"``)."""
        return self.kind != "none"

    def jax_policy(self) -> Callable | None:
        """The ``jax.checkpoint`` policy (None: nothing saveable, ``"full"``)."""
        policies = jax.checkpoint_policies
        if self.kind == "full":
            return None
        if self.kind == "matmuls":
            return policies.dots_with_no_batch_dims_saveable
        if self.kind == "save":
            return policies.save_only_these_names(*self.names)
        if self.kind == "offload" and not self.names:
            return policies.offload_dot_with_no_batch_dims(OFFLOAD_SRC, OFFLOAD_DST)
        if self.kind == "offload":
            return policies.save_and_offload_only_these_names(
                names_which_can_be_saved=(), names_which_can_be_offloaded=self.names,
                offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST,
            )  # fmt: skip
        if self.kind == "custom":
            return self.policy
        raise AssertionError(f"{self.kind!r} has no jax.checkpoint policy")

    def checkpoint(self, fn: Callable) -> Callable:
        """``fn`` under this policy: itself for ``"none"``, else ``jax.checkpoint(fn, policy)``."""
        if not self:
            return fn
        return jax.checkpoint(fn, policy=self.jax_policy())

    def __str__(self) -> str:
        if self.kind == "save":
            return repr(self.names)
        if self.kind == "offload" and self.names:
            return f"offload {self.names!r}"
        if self.kind == "custom":
            return getattr(self.policy, "__name__", "custom")
        return self.kind


def names_made(jaxpr) -> set[str]:
    """The names ``checkpoint_name`` gives activations anywhere in ``jaxpr`` (a ``Jaxpr`` or
    ``ClosedJaxpr``), its inner programs (jit, scan, checkpoint, custom rules) included."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    found: set[str] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            found.add(eqn.params["name"])
        for value in eqn.params.values():
            for inner in _jaxprs(value):
                found |= names_made(inner)
    return found


def _jaxprs(value) -> Iterable:
    if isinstance(value, ClosedJaxpr | Jaxpr):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _jaxprs(v)


def check_names(remat: Remat, made: set[str], model_name: str) -> None:
    """Refuse names of ``remat`` that no layer of the model makes (``made``)."""
    missing = [n for n in remat.names if n not in made]
    if missing:
        raise ValueError(
            f"remat names {missing}, but no layer of {model_name} makes an activation of "
            f"{'that name' if len(missing) == 1 else 'those names'}; it makes "
            f"{sorted(made) or 'none'}. Pick from those, or tag an activation of a layer of "
            f"your own with jax.ad_checkpoint.checkpoint_name(x, name)"
        )


__all__ = [
    "ATTENTION_OUTPUT",
    "MLP_HIDDEN",
    "MLP_INPUT",
    "MLP_OUTPUT",
    "NAMES",
    "POLICIES",
    "Remat",
    "check_names",
    "names_made",
]
