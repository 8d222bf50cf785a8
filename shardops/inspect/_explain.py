"""``explain``: which collective runs where, and why, in plain words, read from the ledger."""

from __future__ import annotations

import re

from jax.sharding import Mesh

from shardops.comm._reasons import reason_for
from shardops.inspect._hlo import Collective
from shardops.inspect._ledger import ledger
from shardops.inspect._passes import pass_of

JAX_NAMES = {
    "all-reduce": "psum",
    "all-gather": "all_gather",
    "reduce-scatter": "psum_scatter",
    "collective-permute": "ppermute",
    "all-to-all": "all_to_all",
}


def explain(mesh: Mesh, fn, /, *args, traced: bool = False, **kwargs) -> list[str]:
    """One sentence per collective of the compiled ``fn(*args)``: layer, collective, mesh axis,
    tensor, bytes, and the reason. Layers are named by their ``named_scope("shardops.<layer>")``;
    the reason is the sentence the kernel wrote next to the collective (``shardops.comm.because``,
    read back from the program's op names, for whatever the mesh axes are called); a collective
    no kernel explains (autodiff's reduction of a replicated value's gradient, a loss's sum) is
    explained by its kind and pass. With
    ``traced=True`` it reads the traced program instead (``shardops.inspect.traced_collectives``:
    the budget's own source; nothing compiles, ``mesh`` may be an ``AbstractMesh``), one
    sentence per collective the program asks for, before XLA combines any. E.g.

        row_parallel_dense: psum over 'model' of f32[64,10] (2.5 KiB), because the contraction
        dim is split over 'model' (each device holds partial sums y{U_model})
    """
    if traced:
        from shardops.inspect._traced import traced_collectives

        found = traced_collectives(mesh, fn, *args, **kwargs)
    else:
        found = ledger(mesh, fn, *args, **kwargs).collectives
    return [sentence(c) for c in found if c.bytes]


_PASS_WORDS = {"optimizer": "optimizer", "mixed": "forward and backward passes"}


def sentence(c: Collective) -> str:
    layers = sorted(set(re.findall(r"shardops\.(\w+)", c.op_name)))
    where = ", ".join(layers) if layers else _PASS_WORDS.get(c.pass_, f"{c.pass_} pass")
    axes = " × ".join(repr(a) for a in c.axes)
    if len(c.shapes) > 2:
        what = f"{len(c.shapes)} tensors"
    else:
        what = ", ".join(f"{d}[{','.join(map(str, s))}]" for d, s in c.shapes)
    name = JAX_NAMES[c.kind]
    if c.kind == "all-reduce":  # HLO names the kind, the scope names max/min reductions
        name = next((n for n in ("pmax", "pmin") if n in c.op_name.split("/")[-1]), name)
    return f"{where}: {name} over {axes} of {what} ({_size(c.bytes)}), because {_reason(c, name)}"


def _reason(c: Collective, name: str) -> str:
    """Each element's reason, in order, once each: the sentence of the ``because`` scope it ran
    in (``shardops.comm.Reason``, written in the kernel), else what autodiff or a program does
    with a collective of its kind, shape and pass."""
    axis = " × ".join(repr(a) for a in c.axes)
    found: list[str] = []
    for op_name, (_, shape) in zip(c.op_names, c.shapes, strict=True):
        backward = pass_of(op_name) == "backward"
        text = reason_for(op_name, name, backward, c.axes) if c.axes else None
        if text is None:
            text = _unscoped_reason(c.kind, len(shape), backward, axis)
        if text not in found:
            found.append(text)
    return "; and ".join(found)


def _unscoped_reason(kind: str, rank: int, backward: bool, axis: str) -> str:
    if kind == "all-reduce" and rank == 0:
        return f"each device computed a partial sum from its shard along {axis} (a loss, a metric, a dot product): the partial sums are added"
    if kind == "all-reduce" and backward:
        return f"parameters replicated over {axis} meet activations split over {axis} (a batch or sequence shard): their gradients are summed (autodiff inserts this reduction)"
    return f"the program moves data between devices along {axis}"


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
