"""Which pass a compiled collective belongs to (forward, backward, optimizer), read from the
``op_name`` metadata JAX writes into the HLO.

JAX 0.10 names every op by its path of jits, named scopes and transformations, e.g.

    jit(step)/shard_map/jvp(shardops.row_parallel_dense)/psum_invariant        forward
    jit(step)/shard_map/transpose(jvp(shardops.row_parallel_dense))/psum_…     backward
    jit(step)/shard_map/optimizer/psum                                           optimizer

- **backward**: the path holds ``transpose(…)``: autodiff's transpose of the forward (what
  ``jax.grad``/``jax.vjp`` run), including a ``custom_vjp``'s bwd rule and remat's re-computed
  forward (``transpose(jvp(…))/checkpoint/rematted_computation/…``).
- **optimizer**: the path holds a named scope (or function) called ``optimizer``
  (``OPTIMIZER_SCOPE``). This is a convention: ``shardops_models`` wraps its optimizer update in
  ``jax.named_scope("optimizer")``, and a step of your own does the same.
- **forward**: everything else, including a collective with no ``op_name`` and the loss's own
  reduction outside ``jax.grad`` (it computes the loss).

XLA combines small collectives of one kind and group into one tuple-shaped op and joins their
names as ``common/path/(name_1:name_2:…)``, one name per tuple element. ``op_names`` splits such
a name back into one full name per element, so a combined all-reduce carrying the loss (forward)
and the gradients (backward) is counted element by element. If the names cannot be matched to
the elements (a count that differs), every element gets the whole name's pass, or ``"mixed"``
when its parts disagree.
"""

from __future__ import annotations

import re

PASSES = ("forward", "backward", "optimizer")
"""The passes of a training step, in the order they run."""

MIXED = "mixed"
"""The pass of a combined collective whose parts disagree and cannot be told apart."""

OPTIMIZER_SCOPE = "optimizer"
"""Collectives under ``jax.named_scope(OPTIMIZER_SCOPE)`` count as the optimizer's."""

_BACKWARD = re.compile(r"(?:^|[/(])transpose\(")
_OPTIMIZER = re.compile(rf"(?:^|[/(]){OPTIMIZER_SCOPE}(?:[/)]|$)")
# Transformations JAX wraps a name in: jvp(layer), transpose(jvp(layer)), jit(f), …
_WRAPPER = re.compile(r"(?:jvp|transpose|vmap|jit|pjit|remat|checkpoint|custom_jvp_call|custom_vjp_call)\((.*)\)")  # fmt: skip
_PLUMBING = {"shard_map", "checkpoint", "rematted_computation", ""}
_REASON = "because."  # shardops.comm._reasons.SCOPE


def pass_of(op_name: str) -> str:
    """``"optimizer"``, ``"backward"`` or ``"forward"`` for one op's name (see the module
    docstring)."""
    if _OPTIMIZER.search(op_name):
        return "optimizer"
    if _BACKWARD.search(op_name):
        return "backward"
    return "forward"


def op_names(op_name: str, n: int) -> tuple[str, ...]:
    """One full name per element of an ``n``-element collective: a combined name
    ``common/(a:b:…)`` split into ``common/a``, ``common/b``, …, or ``op_name`` n times."""
    names = split_op_name(op_name)
    return tuple(names) if len(names) == n else (op_name,) * n


def passes_of(op_name: str, n: int) -> tuple[str, ...]:
    """The pass of each element of an ``n``-element collective named ``op_name``."""
    names = split_op_name(op_name)
    if len(names) == n:
        return tuple(pass_of(name) for name in names)
    found = {pass_of(name) for name in names}
    return ((found.pop() if len(found) == 1 else MIXED),) * n


def scopes_of(op_name: str) -> tuple[str, ...]:
    """The named scopes of one op's name, outermost first, without the program's own jit,
    autodiff's wrappers, ``shard_map``, the reasons' ``because.*`` scopes (``shardops.comm.
    because``: why, not where) and the primitive: ``jit(step)/shard_map/
    transpose(jvp(shardops.row_parallel_dense))/because.row_partial_sums[model]/psum`` →
    ``("shardops.row_parallel_dense",)``."""
    parts = _split_top(op_name, "/")[:-1]  # the last part is the primitive
    if parts and parts[0].startswith("jit("):
        parts = parts[1:]  # the compiled program itself
    found: list[str] = []
    for name in _unwrapped(parts):
        if name not in _PLUMBING and not name.startswith(_REASON) and name not in found:
            found.append(name)
    return tuple(found)


def _unwrapped(parts):
    for part in parts:
        if m := _WRAPPER.fullmatch(part):
            yield from _unwrapped(_split_top(m[1], "/"))
        else:
            yield part


def split_op_name(op_name: str) -> list[str]:
    """XLA's combined ``common/(a:b)`` → ``[common/a, common/b]``, recursively; any other name
    → ``[op_name]``."""
    if not op_name.endswith(")"):
        return [op_name]
    depth, start = 0, None
    for i in range(len(op_name) - 1, -1, -1):  # the "(" that matches the final ")"
        depth += {")": 1, "(": -1}.get(op_name[i], 0)
        if depth == 0:
            start = i
            break
    if start is None or (start > 0 and op_name[start - 1] != "/"):
        return [op_name]  # e.g. "jit(f)": a wrapper, not a combined name
    parts = _split_top(op_name[start + 1 : -1], ":")
    if len(parts) < 2:
        return [op_name]
    prefix = op_name[:start]
    return [name for part in parts for name in split_op_name(prefix + part)]


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside parentheses."""
    parts, depth, current = [], 0, []
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == sep and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts
