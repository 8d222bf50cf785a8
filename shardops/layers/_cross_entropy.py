"""Vocab-parallel softmax cross-entropy and argmax (Megatron's ``vocab_parallel_cross_entropy``).

The logits ``logits[B, S, V_model]`` stay split over mesh axis ``model`` along the vocabulary:
no device ever holds a whole row. Three reductions over ``model`` of ``[B, S]``-sized values
replace the gather of ``[B, S, V]``:

    m = pmax(max_j logits_j)                  (stop_gradient: the loss does not depend on it)
    Z = psum(Σ_j exp(logits_j − m))
    t = psum(logits_label − m, on the one device that owns the label)
    loss = log Z − t

and the gradient ``softmax − onehot`` is computed locally from them (no backward communication).
Everything runs in ``accum_dtype`` (float32) whatever the compute dtype of the logits. With a
padded vocabulary (``vocab_size`` < the stored V, see ``shardops.padded_size``) the padded
columns are −∞: they add nothing to Z, never win the max or the argmax, and get zero gradient.

A kernel given logits that are *replicated* over ``model`` refuses to run: each device would
count the whole vocabulary and the loss would be off by log(p) (Megatron-LM issue 7452).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardops._axes import MODEL_AXIS
from shardops._mesh import axis_size, check_divisible, spec_entry, varying_axes
from shardops._precision import FLOAT32, Precision
from shardops.comm._collectives import all_max, all_min, all_reduce
from shardops.comm._reasons import Reason
from shardops.layers._common import (
    bound_axis_size,
    check_axes,
    check_precision,
    check_replicated_over,
    run_layer,
    scoped,
)
from shardops.layers._embedding import _check_in_range, _check_vocab_size
from shardops.layers._params import padded_size

# Why the kernels' collectives run (``shardops.comm.because``; ``explain`` reads them).
_LOSS = Reason("vocabulary_loss", forward={
    "*": "the vocabulary is split over {axis}: the row max and the sums of exp and of the "
         "target logit are combined across devices, so the logits are never gathered",
})  # fmt: skip
_ARGMAX = Reason("vocabulary_argmax", forward={
    "pmax": "the vocabulary is split over {axis}: the row maxima are combined across devices, "
            "so the logits are never gathered",
    "pmin": "the vocabulary is split over {axis}: the first index holding the row max wins "
            "across devices, so the logits are never gathered",
})  # fmt: skip


class CrossEntropySpecs(NamedTuple):
    """PartitionSpecs of the ``logits``, the integer ``labels`` and the per-example ``loss``
    (also the layout of ``vocab_parallel_argmax``'s result)."""

    logits: P
    labels: P
    loss: P


def vocab_parallel_cross_entropy_specs(
    *, ndim: int = 3, axis_name: str = MODEL_AXIS, batch_axis: str | None = None
) -> CrossEntropySpecs:
    """Layout of ``vocab_parallel_cross_entropy``: ``logits[B_batch, S, V_model]``, ``labels[B_batch, S]``.

    ``ndim`` is the rank of the logits (``logits[B, S, V]``: 3; at least 2).
    """
    _check_ndim(ndim)
    lead = [spec_entry(batch_axis)] + [None] * (ndim - 2)
    return CrossEntropySpecs(logits=P(*lead, axis_name), labels=P(*lead), loss=P(*lead))


@scoped("vocab_parallel_cross_entropy")
def vocab_parallel_cross_entropy_kernel(
    logits,
    labels,
    *,
    vocab_size: int | None = None,
    axis_name: str = MODEL_AXIS,
    precision: Precision = FLOAT32,
):
    """Softmax cross-entropy on local blocks: ``logits[B, S, V_model]``, ``labels[B, S]`` → ``loss[B, S]``.

    Arguments (local blocks, ``p`` = size of ``axis_name``):
        logits: ``logits[..., V/p]``, columns ``i·V/p … (i+1)·V/p − 1`` on device ``i``; they
            must vary over ``axis_name`` (replicated logits are an error, not a loss off by
            log p).
        labels: integer ``labels[...]`` (the logits' leading shape), replicated over
            ``axis_name``, in ``[0, vocab_size)``.
        vocab_size: the logical vocabulary when the stored ``p·V/p`` columns are padded; the
            padded columns are masked (−∞). Default: all columns.

    Returns:
        ``loss[...] = logsumexp(logits) − logits[label]`` in float32 (``accum_dtype``),
        replicated over ``axis_name``. Its gradient is ``softmax − onehot(label)``, cast once to
        the logits' dtype; zero on padded columns.

    Communication over ``axis_name`` (three ``[...]``-sized float32 values, no ``[..., V]``):
        forward: AllReduce(max) of the local maxima; AllReduce(sum) of the local Σ exp(l − m);
        AllReduce(sum) of the target logit, nonzero only on the device owning the label.
        backward: none (the max is under ``stop_gradient``; the transpose of each psum only
        marks its cotangent varying).
        Under ``jit`` labels cannot be checked: one outside ``[0, vocab_size)`` contributes no
        target logit (its loss is ``log Σ exp(l − m)``).
    """
    op = "vocab_parallel_cross_entropy_kernel"
    v_local, vocab_size = _check_local(op, logits, labels, vocab_size, axis_name)  # V/p, V
    logits = logits.astype(precision.accum_dtype)  # [..., V/p] in accum
    start = lax.axis_index(axis_name) * v_local  # first vocabulary id of this block
    real = start + jnp.arange(v_local) < vocab_size  # [V/p]: not padding
    logits = jnp.where(real, logits, -jnp.inf)  # [..., V/p], padding −∞
    local_max = jnp.max(logits, axis=-1)  # [...]
    global_max = all_max(lax.stop_gradient(local_max), axis_name, reason=_LOSS)  # [...]
    shifted = logits - global_max[..., None]  # [..., V/p], ≤ 0
    sum_exp = all_reduce(jnp.sum(jnp.exp(shifted), axis=-1), axis_name, reason=_LOSS)  # [...]
    local_label = labels - start  # [...]
    owns = (local_label >= 0) & (local_label < v_local) & (labels < vocab_size)  # [...]
    index = jnp.where(owns, local_label, 0)[..., None]  # [..., 1] in [0, V/p)
    picked = jnp.take_along_axis(shifted, index, axis=-1)[..., 0]  # [...] shifted target logit
    target = all_reduce(jnp.where(owns, picked, 0.0), axis_name, reason=_LOSS)  # [...]
    return jnp.log(sum_exp) - target  # loss[...] in accum


@scoped("vocab_parallel_argmax")
def vocab_parallel_argmax_kernel(
    logits, *, vocab_size: int | None = None, axis_name: str = MODEL_AXIS
):
    """Argmax over a split vocabulary on local blocks: ``logits[B, S, V_model] → index[B, S]``.

    The first index holding the maximum, as ``jnp.argmax`` of the gathered logits would give,
    padded columns excluded. Returns int32 ``index[...]`` replicated over ``axis_name``.

    Communication over ``axis_name``: forward AllReduce(max) of the local maxima (float32),
    AllReduce(min) of the candidate indices (int32); not differentiable (no backward).
    """
    op = "vocab_parallel_argmax_kernel"
    v_local, vocab_size = _check_local(op, logits, None, vocab_size, axis_name)  # V/p, V
    p = lax.axis_size(axis_name)  # devices on axis_name
    logits = logits.astype(jnp.float32)  # [..., V/p], exact for every float dtype we accept
    start = lax.axis_index(axis_name) * v_local  # first vocabulary id of this block
    real = start + jnp.arange(v_local) < vocab_size  # [V/p]: not padding
    logits = jnp.where(real, logits, -jnp.inf)  # [..., V/p], padding never wins
    local_max = jnp.max(logits, axis=-1)  # [...]
    global_max = all_max(local_max, axis_name, reason=_ARGMAX)  # [...]
    local_index = (jnp.argmax(logits, axis=-1) + start).astype(jnp.int32)  # [...]
    candidate = jnp.where(local_max == global_max, local_index, p * v_local)  # [...]
    # index[...]: the first device holding the max wins
    return all_min(candidate, axis_name, reason=_ARGMAX)


def vocab_parallel_cross_entropy(
    logits,
    labels,
    *,
    mesh: Mesh,
    vocab_size: int | None = None,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
    precision: Precision = FLOAT32,
):
    """Vocab-parallel softmax cross-entropy on global arrays: ``logits[B, S, V_model]``, ``labels[B, S] → loss[B, S]``.

    Arguments:
        logits: ``logits[..., V]`` (rank ≥ 2) in ``precision.compute_dtype``, split over
            ``axis_name`` along V (e.g. a ``column_parallel_dense`` output) and over
            ``batch_axis`` (if given) along dim 0. V must divide by the axis size: pad it to
            ``padded_size(vocab_size, p)`` and pass ``vocab_size``.
        labels: integer ``labels[...]`` of shape ``logits.shape[:-1]``; concrete labels are
            checked to lie in ``[0, vocab_size)``.
        vocab_size: the logical vocabulary (≤ V); columns from ``vocab_size`` on are padding
            and are excluded from the loss and its gradient. Default: V.

    Returns:
        The per-example ``loss[...]`` in float32, laid out as
        ``vocab_parallel_cross_entropy_specs(...).loss``; take its mean yourself.

    Communication: see ``vocab_parallel_cross_entropy_kernel``: three float32 AllReduces of
    ``[...]`` over ``axis_name`` forward, none backward; the logits are never gathered.
    """
    op = "vocab_parallel_cross_entropy"
    specs, vocab_size = _check_layer_args(op, logits, vocab_size, mesh, axis_name, batch_axis)
    check_precision(op, precision)
    precision.check_activation("logits", logits.dtype)
    if not hasattr(labels, "shape") or not hasattr(labels, "dtype"):
        raise TypeError(f"{op}: labels must be an integer array; got {type(labels).__name__}")
    _check_labels(op, labels, logits.shape)
    _check_in_range(op, "labels", labels, vocab_size, "a label outside adds no target logit")
    kernel = functools.partial(
        vocab_parallel_cross_entropy_kernel,
        vocab_size=vocab_size,
        axis_name=axis_name,
        precision=precision,
    )
    args = {"logits": logits, "labels": labels}
    in_specs = {"logits": specs.logits, "labels": specs.labels}
    return run_layer(op, kernel, mesh, args, in_specs, specs.loss)


def vocab_parallel_argmax(
    logits,
    *,
    mesh: Mesh,
    vocab_size: int | None = None,
    axis_name: str = MODEL_AXIS,
    batch_axis: str | None = None,
):
    """Argmax of ``logits[B, S, V_model]`` over the split vocabulary, without gathering: ``→ index[B, S]``.

    Arguments as ``vocab_parallel_cross_entropy`` (any floating dtype). Returns int32
    ``index[...]`` laid out as ``vocab_parallel_cross_entropy_specs(...).loss``: the first
    index of the maximum among the ``vocab_size`` real columns. Accuracy is
    ``mean(index == labels)``.

    Communication: see ``vocab_parallel_argmax_kernel``: an AllReduce(max) (float32) and an
    AllReduce(min) (int32) of ``[...]`` over ``axis_name``.
    """
    op = "vocab_parallel_argmax"
    specs, vocab_size = _check_layer_args(op, logits, vocab_size, mesh, axis_name, batch_axis)
    kernel = functools.partial(
        vocab_parallel_argmax_kernel, vocab_size=vocab_size, axis_name=axis_name
    )
    return run_layer(op, kernel, mesh, {"logits": logits}, {"logits": specs.logits}, specs.loss)


# --- checks -----------------------------------------------------------------------------------


def _check_ndim(ndim) -> None:
    if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 2:
        raise ValueError(
            f"logits must have rank ≥ 2 (logits[B, V] or logits[B, S, ..., V]); got rank "
            f"{ndim!r}. A single example is logits[None]."
        )


def _check_local(op: str, logits, labels, vocab_size, axis_name: str) -> tuple[int, int]:
    """Kernel-side checks; returns ``(V/p, vocab_size)``."""
    p = bound_axis_size(axis_name, op)
    _check_floating(op, logits)
    if logits.ndim < 1:
        raise ValueError(f"{op}: logits must have a vocabulary dim (logits[..., V/p])")
    if axis_name not in varying_axes(logits):
        raise ValueError(
            f"{op}: logits must be split over mesh axis {axis_name!r} along the vocabulary, "
            f"but they are the same on every device of that axis: each device would count the "
            f"whole vocabulary and the loss would be off by log({p}). Give shard_map an in_spec "
            f"that splits their last dim over {axis_name!r} (P(..., {axis_name!r})), or use the "
            f"layer {op.removesuffix('_kernel')} on global arrays; keep check_vma=True."
        )
    if labels is not None:
        check_replicated_over(labels, axis_name, "labels", op)
        _check_labels(op, labels, logits.shape, scope="local ")
    v_local = logits.shape[-1]
    return v_local, _check_vocab_size(op, vocab_size, v_local * p, "the logits' vocabulary")


def _check_labels(op: str, labels, logits_shape, *, scope: str = "") -> None:
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"{op}: labels must be integer class ids; got dtype {np.dtype(labels.dtype).name}. "
            f"Pass ids, not one-hot rows (labels = onehot.argmax(-1)), cast with "
            f"labels.astype(jnp.int32)."
        )
    if tuple(labels.shape) != tuple(logits_shape[:-1]):
        raise ValueError(
            f"{op}: {scope}labels must have the logits' leading shape {tuple(logits_shape[:-1])} "
            f"({scope}logits{tuple(logits_shape)} minus the vocabulary dim); got "
            f"{tuple(labels.shape)}. No broadcasting is done."
        )


def _check_layer_args(op, logits, vocab_size, mesh, axis_name, batch_axis):
    check_axes(mesh, axis_name, batch_axis)
    if not hasattr(logits, "shape") or not hasattr(logits, "dtype"):
        raise TypeError(f"{op}: logits must be an array; got {type(logits).__name__}")
    _check_ndim(len(logits.shape))
    _check_floating(op, logits)
    v, dim, p = logits.shape[-1], len(logits.shape) - 1, axis_size(mesh, axis_name)
    if v % p:
        raise ValueError(
            f"{op}: logits dim {dim} (vocabulary) = {v} is not divisible by mesh axis "
            f"{axis_name!r} (size {p}); pad the vocabulary to {padded_size(v, p)} "
            f"(shardops.padded_size({v}, {p}); e.g. an output layer whose weight is padded with "
            f"zero columns) and pass vocab_size={v}."
        )
    vocab_size = _check_vocab_size(op, vocab_size, v, f"logits dim {dim} (vocabulary)")
    check_divisible(
        argument="logits",
        dim=0,
        dim_name="batch",
        size=logits.shape[0],
        mesh=mesh,
        axes=(batch_axis,),
    )
    specs = vocab_parallel_cross_entropy_specs(
        ndim=len(logits.shape), axis_name=axis_name, batch_axis=batch_axis
    )
    return specs, vocab_size


def _check_floating(op: str, logits) -> None:
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"{op}: logits must be floating; got dtype {np.dtype(logits.dtype).name}")
