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

import jax

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
    return shardops.inspect.first_non_finite(
        _model_loss_and_grads(setup), params, *setup.place_batch(x, y)
    )


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
