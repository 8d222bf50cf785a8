"""The divergence locator for a strategy: ``shardops.inspect.compare`` of a ``Setup`` and its
``ref``, and ``shardops.inspect.first_non_finite`` of a ``Setup``.

    report = shardops_models.locate(setup, state.params, x, y)
    print(report)        # every layer's output and gradient against the bound; the first bug

    report = shardops_models.locate_non_finite(setup, state.params, x, y)
    print(report)        # the first layer whose output (or arriving gradient) is NaN or inf

Every layer a model runs through its context (``ctx.dense``, ``ctx.attention``, ``ctx.embed``,
``ctx.layer_norm``, ``ctx.rms_norm``) is tapped under its parameters' path (e.g.
``['blocks'][1]['attn']``), so a model written once for every strategy is located without a
line of its own.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

import shardops
from shardops_models.training._setup import Setup
from shardops_models.training._train import build


def locate(
    setup: Setup, params, x, y, *, reference_params=None, end_to_end: bool = True
) -> shardops.inspect.Report:
    """Compare one gradient step of ``setup`` (any strategy) with the same model, plan and
    precision unsharded, on the global batch ``x``, ``y``, layer by layer.

    Arguments:
        setup: from ``shardops_models.build``.
        params: the setup's parameters (``state.params``, laid out by the strategy).
        x, y: a global batch (host arrays, or placed by ``setup.place_batch``).
        reference_params: the same parameters for the reference (default: ``params``
            gathered to host).
        end_to_end: also run the reference unforced (``shardops.inspect.compare``).

    Returns:
        ``shardops.inspect.Report``: ``report.first`` is the first layer beyond its bound, or None.
    """
    _check_setup("locate", setup)
    ref = build("ref", model=setup.model, optimizer=setup.optimizer, plan=setup.plan,
                precision=setup.precision)  # fmt: skip
    if reference_params is None:
        reference_params = setup.gather(params) if setup.mesh is not None else params
    placed = setup.place_batch(x, y)
    host = jax.device_get((x, y))
    return shardops.inspect.compare(
        _model_loss_and_grads(setup), lambda p, x, y: ref.loss_and_grads(p, x, y), params, *placed,
        reference_params=reference_params, precision=setup.precision,
        reference_batch=host, end_to_end=end_to_end,
    )  # fmt: skip


def locate_non_finite(setup: Setup, params, x, y) -> shardops.inspect.NonFiniteReport:
    """Run one gradient computation of ``setup`` (any strategy) on the global batch ``x``,
    ``y`` and name the first layer whose output, or the gradient arriving at it, holds a NaN
    or an inf (``shardops.inspect.first_non_finite``; padding cut off).

    Under pipeline parallelism the layers run inside the pipeline's stages, where the
    locator cannot tap them: the step is replayed on the same model, plan, precision, remat
    and microbatches under the strategy without pp (``"2d+1f1b"`` → ``"2d"``), on the
    devices at index 0 of the pipe axis (the mesh's other axes as they are), from ``params``
    gathered (``setup.gather``, in the model's layer order) and placed there. It computes
    what the pipeline computes (the same microbatches, summed in the same order), so a
    non-finite value arises in the same layer. The replay holds every layer on those devices
    (1/P of the mesh) and a host copy of the params: memory the pipeline was spreading, which
    a model that fits only pipelined does not have. One process only: a multi-process run is
    refused (the replay's devices are some processes' alone).

    Arguments:
        setup: from ``shardops_models.build``.
        params: the setup's parameters (``state.params``, laid out by the strategy), e.g. the
            ones before the step whose loss went NaN.
        x, y: a global batch (host arrays, or placed by ``setup.place_batch``).

    Returns:
        ``shardops.inspect.NonFiniteReport``: ``report.layer`` and ``report.what``
        (``"output"``, ``"loss"``, ``"gradient"``, ``"param"``; None: every value finite).
    """
    _check_setup("locate_non_finite", setup)
    if setup.strategy.pp is not None:
        setup, params = _without_pipeline(setup, params)
    return shardops.inspect.first_non_finite(
        _model_loss_and_grads(setup), params, *setup.place_batch(x, y)
    )


def _without_pipeline(setup: Setup, params) -> tuple[Setup, object]:
    """``setup``'s model under its strategy without pp, on the devices at pipe index 0, and
    ``params`` placed there (``locate_non_finite``)."""
    strategy, axis = setup.strategy, setup.strategy.pp
    if jax.process_count() > 1:
        raise ValueError(
            f"locate_non_finite: strategy {strategy.name!r} pipelines the layers over {axis!r} "
            f"(pp), whose stages the locator cannot tap, and the replay without pp runs on one "
            f"process's devices; this run has {jax.process_count()} processes. Save the "
            f"state (Checkpoints) and call locate_non_finite in one process on a setup "
            f"without pp"
        )
    flat = dataclasses.replace(
        strategy, name=f"{strategy.name} without pp", pp=None, pp_schedule="1f1b", pp_virtual=None
    )  # the defaults
    pipe = setup.mesh.axis_names.index(axis)
    names = tuple(a for a in setup.mesh.axis_names if a != axis)
    types = tuple(t for i, t in enumerate(setup.mesh.axis_types) if i != pipe)
    devices = np.take(setup.mesh.devices, 0, axis=pipe)
    mesh = jax.sharding.Mesh(devices, names, axis_types=types) if names else None
    replay = build(flat if names else "ref", mesh, model=setup.model, optimizer=setup.optimizer,
                   plan=setup.plan, remat=setup.remat, precision=setup.precision,
                   fsdp_dense=setup.fsdp_dense, collective_matmul=setup.collective_matmul,
                   attention=setup.attention, aux_weights=setup.aux_weights,
                   microbatches=setup.microbatches)  # fmt: skip
    return replay, replay.shard(setup.gather(params)).params


def _model_loss_and_grads(setup: Setup):
    """``setup.loss_and_grads`` with the gradients in the model's own shapes (padding cut off)."""

    def loss_and_grads(params, x, y):
        loss, grads = setup.loss_and_grads(params, x, y)
        return loss, setup.padding.unpad(grads)

    return loss_and_grads


def _check_setup(caller: str, setup) -> None:
    if not isinstance(setup, Setup):
        raise TypeError(
            f"{caller}: setup must come from shardops_models.build; got {type(setup).__name__}"
        )
