"""``explain``: which collective runs where, and why, in plain words, read from the ledger."""

from __future__ import annotations

import re

from jax.sharding import Mesh

from shardops._axes import DATA_AXIS, MODEL_AXIS
from shardops.inspect._hlo import Collective
from shardops.inspect._ledger import ledger

JAX_NAMES = {
    "all-reduce": "psum",
    "all-gather": "all_gather",
    "reduce-scatter": "psum_scatter",
    "collective-permute": "ppermute",
    "all-to-all": "all_to_all",
}


def explain(mesh: Mesh, fn, /, *args, traced: bool = False, **kwargs) -> list[str]:
    """One sentence per collective of the compiled ``fn(*args)``: layer, collective, mesh axis,
    tensor, bytes, and the reason. Layers are recognised by their ``named_scope`` and their
    collectives over ``MODEL_AXIS``; everything else is explained by kind and pass. With
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


def sentence(c: Collective) -> str:
    layers = sorted(set(re.findall(r"shardops\.(\w+)", c.op_name)))
    backward = "transpose" in c.op_name
    where = ", ".join(layers) if layers else ("backward pass" if backward else "forward pass")
    axes = " × ".join(repr(a) for a in c.axes)
    if len(c.shapes) > 2:
        what = f"{len(c.shapes)} tensors"
    else:
        what = ", ".join(f"{d}[{','.join(map(str, s))}]" for d, s in c.shapes)
    name = JAX_NAMES[c.kind]
    if c.kind == "all-reduce":  # HLO names the kind, the scope names max/min reductions
        name = next((n for n in ("pmax", "pmin") if n in c.op_name.split("/")[-1]), name)
    return (
        f"{where}: {name} over {axes} of {what} ({_size(c.bytes)}), because "
        f"{_reason(c, layers, backward)}"
    )


def _reason(c: Collective, layers: list[str], backward: bool) -> str:
    axis = " × ".join(repr(a) for a in c.axes)
    rank = max(len(s) for _, s in c.shapes) if c.shapes else 0
    kind = c.kind
    if "dense_moving_activations" in layers:
        return _moving_activations_reason(kind, axis, backward, DATA_AXIS in c.axes)
    if MODEL_AXIS not in c.axes:
        layers = []  # the layers' own collectives run over their weight axis (the default name)
    if layers == ["row_parallel_dense"]:
        if not backward and kind == "all-reduce":
            return (
                f"the contraction dim is split over {axis} (each device holds partial sums y{{U}})"
            )
        if not backward and kind == "reduce-scatter":
            return f"the contraction dim is split over {axis} and the output is kept split: partial sums are reduced and scattered"
        if backward and kind == "all-gather":
            return "it is the transpose of the forward psum_scatter: each device needs all of dy"
        if backward and kind == "all-reduce" and rank == 1:
            return f"the bias is replicated but the output is split over {axis}: its gradient is summed"
        if backward and kind == "all-reduce":
            return f"the replicated input was sliced over {axis}: each device's zero-padded dx is summed"
    if layers == ["column_parallel_dense"]:
        if backward and kind == "all-reduce":
            return f"x is replicated over {axis} but each device multiplies it by its own columns of w: the partial dx are summed (Megatron's f)"
        if backward and kind == "reduce-scatter":
            return f"it is the transpose of the sequence-parallel gather: dx partial sums are reduced and split back over {axis}"
        if kind == "all-gather" and "invariant" in c.op_name:
            return f"gather_output asks for the full y, whose columns are split over {axis}"
        if kind == "all-gather":
            return f"the input is split over {axis} along its batch or sequence dim (sequence parallelism) and the layer needs all of it"
    if layers == ["vocab_parallel_embedding"]:
        if not backward and kind in ("all-reduce", "reduce-scatter"):
            kept = (
                "" if kind == "all-reduce" else ", and the result is kept split along the sequence"
            )
            return f"the table's rows are split over {axis}: each device looks up only the ids in its rows (zeros elsewhere), and the partial embeddings are summed{kept}"
        if backward and kind == "all-gather":
            return "it is the transpose of the forward psum_scatter: each device needs all of dx"
    if layers == ["vocab_parallel_cross_entropy"] or layers == ["vocab_parallel_argmax"]:
        return f"the vocabulary is split over {axis}: the row max and the sums of exp and of the target logit are combined across devices, so the logits are never gathered"
    if layers == ["head_parallel_attention"]:
        if not backward and kind == "all-reduce":
            return f"the heads are split over {axis}: the output projection's partial sums y{{U}} are reduced"
        if not backward and kind == "reduce-scatter":
            return f"the heads are split over {axis}: the output projection's partial sums are reduced and scattered along the sequence"
        if not backward and kind == "all-gather":
            return f"the input is split along the sequence over {axis} (sequence parallelism) and every head needs all of it"
        if backward and kind == "all-reduce" and rank == 1:
            return f"the output bias is replicated but the output is split over {axis}: its gradient is summed"
        if backward and kind == "all-reduce":
            return f"x is replicated over {axis} but each device projects it with its own heads: the partial dx are summed"
        if backward and kind == "reduce-scatter":
            return f"it is the transpose of the sequence-parallel gather: dx partial sums are reduced and split back over {axis}"
        if backward and kind == "all-gather":
            return "it is the transpose of the forward psum_scatter: each device needs all of dy"
    if kind == "all-reduce" and rank == 0 and len(c.shapes) == 1:
        return f"each device computed a partial sum from its shard along {axis} (a loss, a metric, a dot product): the partial sums are added"
    if backward and kind == "all-reduce":
        return f"parameters replicated over {axis} meet activations split over {axis} (a batch or sequence shard): their gradients are summed"
    if kind == "all-gather" and not backward:
        return f"weights stored split over {axis} (FSDP) are gathered just before use"
    if kind == "all-gather":
        return f"weights stored split over {axis} are gathered again for the backward pass (remat)"
    if kind == "reduce-scatter" and backward:
        return f"it is the transpose of the weights' all_gather: gradients are summed and each device keeps its shard over {axis}"
    return f"the program moves data between devices along {axis}"


def _moving_activations_reason(kind: str, axis: str, backward: bool, data: bool) -> str:
    """A dense layer under FSDP that moves its activations instead of gathering its weight
    (``models/strategies/fsdp.py``)."""
    why = "FSDP moves this layer's activations instead of gathering its weight (they are smaller)"
    if not data:  # the layer's own tensor-parallel reduction, over model
        if backward:
            return f"x is replicated over {axis} but each device multiplies it by its own columns of w: the partial dx are summed (Megatron's f)"
        return f"the layer's contraction is also split over {axis} (tensor parallelism): its partial sums are reduced"
    reasons = {
        ("all-to-all", False): f"{why}: activations are exchanged over {axis} between the batch layout and a layout split along features",
        ("reduce-scatter", False): f"{why}: each device multiplied the whole batch by its block of the contraction, so the output's partial sums are reduced and each device keeps its rows",
        ("all-gather", False): f"{why}: each device needs the whole batch's input for its block of output features",
        ("all-gather", True): "it is the transpose of the forward psum_scatter: each device needs dy for the whole batch",
        ("all-to-all", True): "it is the transpose of the forward all_to_all: the gradient returns to the other layout",
        ("reduce-scatter", True): f"it is the transpose of the input's all_gather: the dx partial sums are reduced and split back over {axis} along the batch",
    }  # fmt: skip
    return reasons.get((kind, backward), f"{why}; the program moves data along {axis}")


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
