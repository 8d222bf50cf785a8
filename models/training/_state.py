"""The values a step carries and returns: ``TrainState`` (params, optimizer state) and ``Metrics``
(evaluation sums).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class TrainState(NamedTuple):
    params: Any
    opt_state: Any


class Metrics(NamedTuple):
    """Evaluation sums over the labelled targets of a global batch (rows of the MLP, positions
    of the GPT). A padding target (an all-zero one-hot row; a ``PAD_LABEL`` token) counts
    nowhere. Sums, not means, so that chunks of a set add up exactly."""

    loss_sum: jax.Array
    """Σ over labelled targets of the model's loss (float32): the mean loss × count."""
    correct: jax.Array
    """Labelled targets whose arg-max logit is the label (int32)."""
    count: jax.Array
    """Labelled targets (int32)."""

    @property
    def loss(self):
        """The mean loss over the labelled targets (the seed's loss for the MLP)."""
        return self.loss_sum / self.count

    @property
    def accuracy(self):
        return self.correct / self.count
