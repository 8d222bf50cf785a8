"""What one device's program computes, counted from its jaxpr: matmul FLOPs, the bytes written
by the other array ops, the collectives it issues, and its peak of live bytes.

    cost = program_cost(jax.make_jaxpr(step)(*abstract_args).jaxpr, mesh_shape)
    cost.flops, cost.elementwise_bytes, cost.collectives, cost.peak_bytes

Inside ``jax.shard_map`` the jaxpr holds each device's *local* shapes, so every count is per
device. The counts are of the program as JAX traced it (value, gradient and optimizer update),
before XLA fuses, combines or schedules anything:

- ``flops``: ``2 · |out| · |contracted|`` per ``dot_general`` (a matmul of x[M, K] and
  w[K, N] is 2·M·K·N), times a scan's length.
- ``elementwise_bytes``: the bytes of every result of the other ops that compute (add, exp,
  reductions, the optimizer's updates…), leaving out ops that only relabel or move an array
  (reshape, broadcast, slice, convert, the varying-type casts). XLA fuses chains of them, so
  this overcounts memory traffic by a factor the calibration absorbs: ``shardops_models.search._search``'s
  ``calibrate`` measures seconds per byte *counted the same way* on a fused chain.
- ``collectives``: one per collective primitive whose mesh axes hold more than one device,
  keyed by those axes, as the program asks for them (XLA:CPU later combines independent
  all-reduces, e.g. dp's gradient all-reduces into one).
- ``peak_bytes``: the most bytes alive at once when the ops run in program order, each array
  freed after its last use, except the outputs (alive to the end, for the caller) and the
  arguments that are not donated (the caller holds them); a nested call adds its own peak above
  its inputs. It is the jaxpr's peak, before XLA fuses temporaries away. For the MLPs the tests
  compile it is at least what the compiled program holds (``memory_analysis``: arguments +
  outputs − aliased + temporaries); XLA may add buffers of its own (copies where a donation
  cannot alias, bf16 collectives run in f32 on CPU), and for the small test GPT, whose
  attention no longer keeps S×S arrays, XLA:CPU holds up to 23 % more than the jaxpr's peak.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from shardops.inspect import PRIMITIVE_KINDS

COLLECTIVE_PRIMITIVES = frozenset(PRIMITIVE_KINDS)
FREE_PRIMITIVES = frozenset({
    "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "pvary", "pcast", "pbroadcast",
    "convert_element_type", "slice", "dynamic_slice", "iota", "stop_gradient", "axis_index",
    "copy_p", "copy", "transpose", "concatenate", "dynamic_update_slice", "pad", "select_n",
})  # fmt: skip
"""Ops counted as moving or relabelling data rather than computing (XLA fuses most of them
into their consumer)."""


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """Per-device counts of one traced program (see the module docstring)."""

    flops: int
    elementwise_bytes: int
    collectives: dict[tuple[str, ...], int]
    """Mesh axes → number of collectives over them."""
    peak_bytes: int


def program_cost(
    jaxpr: Jaxpr | ClosedJaxpr, mesh_shape: dict[str, int], *, donated=()
) -> ProgramCost:
    """Count ``jaxpr``'s matmul FLOPs, elementwise bytes, collectives and peak live bytes.

    ``donated``: positions in ``jaxpr.invars`` of the arguments whose buffers the program may
    free (``jax.jit``'s ``donate_argnums``, flattened); the caller holds every other argument
    to the end. Inside ``jax.shard_map`` the peak is the body's, its blocks of the arguments
    held or donated as the arguments are (held when the program still reads them after the
    ``shard_map``). Other nested calls (a ``jit`` inside) hold their inputs."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    counts = _Counts(mesh_shape)
    counts.walk(jaxpr, 1)
    donated = set(donated)
    held = [i not in donated for i in range(len(jaxpr.invars))]
    return ProgramCost(
        flops=int(counts.flops),
        elementwise_bytes=int(counts.elementwise_bytes),
        collectives=dict(counts.collectives),
        peak_bytes=int(
            max(
                (peak_live_bytes(b, held=h) for b, h in _shard_map_bodies(jaxpr, held)),
                default=peak_live_bytes(jaxpr, held=held),
            )
        ),
    )


class _Counts:
    def __init__(self, mesh_shape):
        self.mesh_shape = mesh_shape
        self.flops = 0
        self.elementwise_bytes = 0
        self.collectives: Counter = Counter()

    def walk(self, jaxpr: Jaxpr, times: int) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            subs = list(_sub_jaxprs(eqn))
            if subs:
                repeat = times * int(eqn.params.get("length", 1))
                if name == "cond":  # one branch runs: count the dearest
                    self.walk(max(subs, key=lambda j: _flops_of(j, self.mesh_shape)), repeat)
                else:
                    for sub in subs:
                        self.walk(sub, repeat)
            elif name == "dot_general":
                self.flops += times * _dot_flops(eqn)
            elif name in COLLECTIVE_PRIMITIVES:
                axes = _axes_of(eqn)
                if math.prod(self.mesh_shape.get(a, 1) for a in axes) > 1:
                    self.collectives[axes] += times
            elif name not in FREE_PRIMITIVES:
                self.elementwise_bytes += times * sum(_nbytes(v) for v in eqn.outvars)


def _flops_of(jaxpr, mesh_shape) -> int:
    counts = _Counts(mesh_shape)
    counts.walk(jaxpr, 1)
    return counts.flops


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item


def _dot_flops(eqn) -> int:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    out = eqn.outvars[0].aval.shape
    return 2 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)


def _axes_of(eqn) -> tuple[str, ...]:
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    axes = axes if isinstance(axes, tuple | list) else (axes,)
    return tuple(a for a in axes if isinstance(a, str))


def _nbytes(var) -> int:
    aval = getattr(var, "aval", None)
    if aval is None or not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
        return 0
    try:
        return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
    except TypeError:  # key arrays and other extended dtypes
        return 0


ALIAS_PRIMITIVES = frozenset({
    "reshape", "squeeze", "expand_dims", "pvary", "pcast", "pbroadcast", "stop_gradient",
})  # fmt: skip
"""Ops whose result shares its operand's buffer (for ``peak_live_bytes``)."""


def _shard_map_bodies(jaxpr: Jaxpr, held):
    """``(body, held)`` of every ``shard_map`` in ``jaxpr``: a body's argument may be freed
    only when the value passed to it is a donated argument of ``jaxpr`` (``held[i]`` False for
    ``jaxpr.invars[i]``) that nothing reads after this call; any other value is held."""
    outer = {v: h for v, h in zip(jaxpr.invars, held, strict=True)}
    last_use: dict = {v: len(jaxpr.eqns) for v in jaxpr.outvars if not isinstance(v, Literal)}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[v] = max(last_use.get(v, i), i)
    for i, eqn in enumerate(jaxpr.eqns):
        passed = [
            isinstance(v, Literal) or outer.get(v, True) or last_use[v] > i
            or eqn.invars.count(v) > 1
            for v in eqn.invars
        ]  # fmt: skip
        for sub in _sub_jaxprs(eqn):
            if len(sub.invars) == len(passed):
                inner = passed
            elif len(sub.invars) == len(passed) - 1:  # cond: its first operand picks the branch
                inner = passed[1:]
            else:
                inner = [True] * len(sub.invars)
            if eqn.primitive.name == "shard_map":
                yield sub, inner
            else:
                yield from _shard_map_bodies(sub, inner)


def peak_live_bytes(jaxpr: Jaxpr, *, held=None) -> int:
    """The most bytes alive at once running ``jaxpr``'s ops in order (inputs included), each
    buffer freed after the last use of it or of a view of it (``ALIAS_PRIMITIVES``), except
    the outputs and the held inputs (``held[i]`` for ``jaxpr.invars[i]``; default: all held,
    as a caller holds the arguments it passes), which stay alive to the end."""
    held = [True] * len(jaxpr.invars) if held is None else list(held)
    root: dict = {}

    def buffer(v):
        return root.get(v, v)

    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ALIAS_PRIMITIVES and len(eqn.invars) == len(eqn.outvars):
            for a, b in zip(eqn.invars, eqn.outvars, strict=True):
                if not isinstance(a, Literal):
                    root[b] = buffer(a)
    last_use: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[buffer(v)] = i
    outputs = {buffer(v) for v in jaxpr.outvars if not isinstance(v, Literal)}
    kept = {buffer(v) for v, h in zip(jaxpr.invars, held, strict=True) if h}
    live = sum(_nbytes(v) for v in (*jaxpr.constvars, *jaxpr.invars))
    peak = live
    for i, eqn in enumerate(jaxpr.eqns):
        transient = max(
            (peak_live_bytes(sub) - sum(_nbytes(v) for v in (*sub.constvars, *sub.invars))
             for sub in _sub_jaxprs(eqn)),
            default=0,
        )  # fmt: skip
        live += sum(_nbytes(v) for v in eqn.outvars if v not in root)
        peak = max(peak, live + max(transient, 0))
        for v in (*eqn.invars, *eqn.outvars):
            b = None if isinstance(v, Literal) else buffer(v)
            if b is not None and last_use.get(b, -1) <= i and b not in outputs and b not in kept:
                live -= _nbytes(b)
                last_use[b] = len(jaxpr.eqns)  # freed once
    return peak
