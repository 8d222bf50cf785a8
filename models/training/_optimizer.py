"""The seed's optimizer: SGD with a per-epoch staircase decay of the learning rate."""

from __future__ import annotations

import optax

INIT_LR = 1.0


DECAY_RATE = 0.95


DECAY_STEPS = 5


def seed_schedule(
    steps_per_epoch: int, *, init_lr=INIT_LR, decay_rate=DECAY_RATE, decay_steps=DECAY_STEPS
) -> optax.Schedule:
    """The seed's ``lr = init_lr · decay_rate^(epoch / decay_steps)``, constant within an epoch.

    As an optax staircase decay: one transition per epoch, each by ``decay_rate^(1/decay_steps)``.
    """
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be ≥ 1; got {steps_per_epoch}")
    return optax.exponential_decay(
        init_lr,
        transition_steps=steps_per_epoch,
        decay_rate=decay_rate ** (1 / decay_steps),
        staircase=True,
    )


def seed_sgd(steps_per_epoch: int, **schedule_kwargs) -> optax.GradientTransformation:
    """The seed's optimizer: plain SGD with ``seed_schedule``."""
    return optax.sgd(seed_schedule(steps_per_epoch, **schedule_kwargs))
