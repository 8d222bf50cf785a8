"""The collectives a program asks for, read from its traced jaxpr: no compilation, and no
devices (a ``jax.sharding.AbstractMesh`` traces as well as a ``Mesh``).

    led = shardops.inspect.traced_ledger(mesh, train_step, state, x, y)
    led.totals(requested=True)          # {(kind, axes): bytes}, as the program asks
    led.totals()                        # the same, as XLA:CPU runs it (see RUNS_AS)
    led.by_pass()                       # {pass: {(kind, axes): bytes}}

Inside ``jax.shard_map`` the jaxpr is each device's program: every ``psum``, ``pmax``,
``pmin``, ``all_gather``, ``psum_scatter``, ``all_to_all`` and ``ppermute`` with its local
shapes, dtype and mesh axes. Autodiff has already written the backward pass into it (a
``transpose(…)`` in the name stack, ``shardops.inspect._passes``), and remat's recomputation
too (the forward again, inside the backward's ``remat``), so a train step's trace holds
everything the step will run. The walk enters every nested program: ``jit``, ``shard_map``,
``custom_vjp`` / ``custom_jvp`` calls, ``remat`` and ``scan`` (its body × its length); a
``cond`` counts once when its branches issue the same collectives (else it is refused, like a
``while`` loop that issues any: their count is not known before the program runs).

Each collective is a ``shardops.inspect.Collective``, with the conventions of the compiled
reading (``shardops.inspect._hlo``): V is the full tensor reduced or assembled (the operand of
an all-reduce, reduce-scatter, all-to-all or permute; the result of an all-gather); mesh axes in
the mesh's order, axes of size 1 left out; a group of one device moves nothing (0 bytes); its
``op_name`` is the name stack (``jit(step)/shard_map/transpose(jvp(shardops.…))/psum``), so the
pass and the layer read the same way as the compiled program's.

What XLA does to the requested collectives before running them (``RUNS_AS``):

- **XLA:CPU runs every bfloat16 (and float16) collective in float32**: twice the bytes of
  what was asked for (measured for all five kinds: all-reduce, all-gather, reduce-scatter,
  all-to-all, collective-permute). ``RUNS_AS`` takes GPU and TPU to run them as asked; that
  is not measured here (no accelerator was lent to the machine that wrote this).
- **XLA combines** independent collectives of one kind and group into one tuple-shaped op
  (XLA:CPU: all-reduces). That changes the number of ops, not the bytes per kind, axes and pass
  (``Ledger.by_pass`` splits a combined tuple by its elements' names).
- **Remat**: XLA:CPU expands optimization barriers before a late CSE pass, which then merges
  remat's recomputed collectives into the forward's (the backward gathers nothing again, and
  the full weights stay alive). Compiled with ``compiler_options=KEEP_REMAT`` it runs what the
  trace counts; ``shardops_models`` compiles every remat step so.
- **Loops**: the trace counts a ``scan``'s body once per iteration; so does the compiled
  reading (``shardops.inspect.ledger``), by the trip count XLA records on the ``while`` loop.
- Dead collectives (a result nothing reads) are removed before lowering, here and by JAX alike
  (``jax.jit(..., keep_unused=True)`` keeps dead ones in the compiled program, not here).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from shardops.inspect._hlo import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVE_PERMUTE,
    REDUCE_SCATTER,
    Collective,
    _bytes,
)
from shardops.inspect._ledger import Ledger

PRIMITIVE_KINDS = {
    "psum": ALL_REDUCE,
    "psum_invariant": ALL_REDUCE,
    "pmax": ALL_REDUCE,
    "pmin": ALL_REDUCE,
    "all_gather": ALL_GATHER,
    "all_gather_invariant": ALL_GATHER,
    "reduce_scatter": REDUCE_SCATTER,  # lax.psum_scatter's primitive
    "all_to_all": ALL_TO_ALL,
    "ppermute": COLLECTIVE_PERMUTE,
}
"""The jaxpr primitives that communicate, and the HLO collective each one lowers to."""

UNCOUNTED = frozenset({
    "ragged_all_to_all", "psend", "precv", "all_gather_reduced", "unreduced_psum",
    "unreduced_reduce_scatter",
})  # fmt: skip
"""Collective primitives the walk does not count: a program that issues one is refused, never
given a budget that leaves it out."""

KEEP_REMAT = {"xla_disable_hlo_passes": "cse_barrier_expander"}
"""``jax.jit(..., compiler_options=KEEP_REMAT)``: XLA:CPU keeps remat's recomputed collectives
(see the module docstring)."""

RUNS_AS = {
    "cpu": {"bf16": "f32", "f16": "f32"},
    "gpu": {},
    "tpu": {},
}
"""Per backend, the dtype a collective of each dtype runs in, where it differs (see the module
docstring)."""


def hlo_dtype(dtype) -> str:
    """The HLO name of a dtype: ``float32`` → ``f32``, ``bfloat16`` → ``bf16``, ``bool`` →
    ``pred``, ``int32`` → ``s32``."""
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":
        return "bf16"
    if dt.name.startswith("float8_"):  # ml_dtypes' float8_e4m3fn → HLO's f8e4m3fn
        return "f8" + dt.name.removeprefix("float8_")
    if dt.kind == "b":
        return "pred"
    prefix = {"f": "f", "i": "s", "u": "u", "c": "c"}.get(dt.kind)
    if prefix is None:
        raise ValueError(f"no HLO name for dtype {dt.name!r}")
    return f"{prefix}{dt.itemsize * 8}"


def traced_collectives(mesh, fn, /, *args, **kwargs) -> list[Collective]:
    """The collectives ``fn(*args, **kwargs)`` asks for, from its jaxpr (``jax.make_jaxpr``, or
    ``fn.trace`` where ``fn`` is jitted, so a jit with its own ``compiler_options`` is traced as
    the top-level program it is; the arguments may be ``jax.ShapeDtypeStruct``). ``mesh`` is the
    ``Mesh`` or ``AbstractMesh`` its ``shard_map`` runs over."""
    import jax

    if callable(getattr(fn, "trace", None)):
        closed = fn.trace(*args, **kwargs).jaxpr
    else:
        closed = jax.make_jaxpr(fn)(*args, **kwargs)
    return jaxpr_collectives(closed.jaxpr, mesh)


def jaxpr_collectives(jaxpr, mesh) -> list[Collective]:
    """The collectives of a traced ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``) over ``mesh``."""
    from jax.extend.core import ClosedJaxpr

    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    sizes = dict(mesh.shape)
    walk = _Walk(tuple(mesh.axis_names), sizes)
    walk.jaxpr(_live(jaxpr), "", 1)
    return walk.found


def traced_ledger(mesh, fn, /, *args, backend: str = "cpu", **kwargs) -> Ledger:
    """The ``Ledger`` of ``fn(*args, **kwargs)`` from its trace, compiling nothing:
    ``requested`` is what the program asks for, ``collectives`` the same as ``backend`` runs
    it (``RUNS_AS``; uncombined). Its totals, passes and ring bytes read as a compiled ledger's."""
    asked = tuple(traced_collectives(mesh, fn, *args, **kwargs))
    return Ledger(mesh, runs_as(asked, backend), asked)


def runs_as(found, backend: str = "cpu") -> tuple[Collective, ...]:
    """``found`` as ``backend`` runs them: each element in the dtype ``RUNS_AS`` gives it."""
    if backend not in RUNS_AS:
        raise ValueError(f"backend must be one of {sorted(RUNS_AS)}; got {backend!r}")
    table = RUNS_AS[backend]
    out = []
    for c in found:
        shapes = tuple((table.get(d, d), s) for d, s in c.shapes)
        if shapes == c.shapes:
            out.append(c)
            continue
        out.append(
            dataclasses.replace(c, shapes=shapes, bytes=_bytes(c.kind, shapes, c.group_size))
        )
    return tuple(out)


class _Walk:
    def __init__(self, axis_names, sizes):
        self.axis_names, self.sizes = axis_names, sizes
        self.found: list[Collective] = []

    def jaxpr(self, jaxpr, stack: str, times: int) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            here = _join(stack, str(eqn.source_info.name_stack))
            if name in PRIMITIVE_KINDS:
                self.collective(eqn, here, times)
                continue
            if name in UNCOUNTED:
                raise ValueError(
                    f"{name} in {here!r}: the traced budget does not count this collective; "
                    f"read the compiled program instead (shardops.inspect.ledger)"
                )
            subs = list(_sub_jaxprs(eqn))
            if not subs:
                continue
            inner = _join(here, _WRAPPERS.get(name, "").format(eqn.params.get("name", "")))
            if name == "cond":
                self.cond(eqn, subs, inner, times)
            elif name == "while":
                self.refuse_loop(eqn, subs)
            else:
                repeat = times * int(eqn.params.get("length", 1)) if name == "scan" else times
                for sub in subs:
                    self.jaxpr(sub, inner, repeat)

    def collective(self, eqn, op_name: str, times: int) -> None:
        kind = PRIMITIVE_KINDS[eqn.primitive.name]
        if eqn.params.get("axis_index_groups") is not None:
            raise ValueError(
                f"{eqn.primitive.name} with axis_index_groups in {op_name!r}: the traced budget "
                f"counts collectives over whole mesh axes only"
            )
        named = _axes_of(eqn)
        unknown = [a for a in named if a not in self.sizes]
        if unknown:
            raise ValueError(
                f"{eqn.primitive.name} over {unknown} in {op_name!r}: the mesh has axes "
                f"{self.axis_names}; trace the program against the mesh its shard_map uses"
            )
        axes = tuple(a for a in self.axis_names if a in named and self.sizes[a] > 1)
        group = math.prod(self.sizes[a] for a in axes)
        # results, as the compiled reading has them (V is N × the result for reduce-scatter)
        shapes = tuple((hlo_dtype(v.aval.dtype), tuple(v.aval.shape)) for v in eqn.outvars)
        nbytes = _bytes(kind, shapes, group)
        if kind == COLLECTIVE_PERMUTE and not eqn.params.get("perm"):
            nbytes = 0
        c = Collective(kind=kind, shapes=shapes, axes=axes, group_size=group, bytes=nbytes,
                       op_name=_join(op_name, eqn.primitive.name))  # fmt: skip
        self.found.extend([c] * times)

    def cond(self, eqn, branches, stack: str, times: int) -> None:
        seen = []
        for branch in branches:
            walk = _Walk(self.axis_names, self.sizes)
            walk.jaxpr(branch, stack, times)
            seen.append(walk.found)
        signature = {tuple((c.kind, c.axes, c.bytes) for c in found) for found in seen}
        if len(signature) > 1:
            raise ValueError(
                f"a cond at {stack!r} issues different collectives in its branches; the "
                f"budget cannot know which runs. Issue them outside the cond"
            )
        self.found.extend(seen[0])

    def refuse_loop(self, eqn, bodies) -> None:
        for body in bodies:
            walk = _Walk(self.axis_names, self.sizes)
            walk.jaxpr(body, "", 1)
            if walk.found:
                raise ValueError(
                    f"a while loop issues {walk.found[0].kind} over {walk.found[0].axes}: its "
                    f"trip count is not known before the program runs. Use lax.scan or a "
                    f"fori_loop with static bounds"
                )


# How lowering names a nested program in op_name (the jit's own name; the rest are plumbing).
_WRAPPERS = {"pjit": "jit({})", "jit": "jit({})"}


def _join(stack: str, name: str) -> str:
    return f"{stack}/{name}" if stack and name else stack or name


def _sub_jaxprs(eqn):
    from jax.extend.core import ClosedJaxpr, Jaxpr

    for value in eqn.params.values():
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield _live(item.jaxpr)
            elif isinstance(item, Jaxpr):
                yield _live(item)


def _axes_of(eqn) -> tuple[str, ...]:
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    axes = axes if isinstance(axes, tuple | list) else (axes,)
    return tuple(a for a in axes if isinstance(a, str))


def _live(jaxpr):
    """``jaxpr`` without the equations no output depends on, as lowering drops them."""
    from jax._src.interpreters import partial_eval as pe  # dce_jaxpr has no public name

    if not jaxpr.eqns:
        return jaxpr
    live, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    return live
