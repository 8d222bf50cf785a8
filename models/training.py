"""Loop helpers for the examples: bounded steps in flight, staged batches, whole-set metrics.

The hang trap: with 8 simulated devices on few cores, dispatching many steps that contain
collectives without waiting can deadlock XLA:CPU's collectives. ``StepsInFlight`` waits for the
oldest step once more than ``limit`` are queued, so every training loop stays bounded.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import jax
import numpy as np

from models.data import epoch_order

MAX_STEPS_IN_FLIGHT = 2


class StepsInFlight:
    """Keep at most ``limit`` dispatched steps un-synchronised."""

    def __init__(self, limit: int = MAX_STEPS_IN_FLIGHT):
        self.limit = limit
        self._queue: collections.deque = collections.deque()

    def add(self, result) -> None:
        self._queue.append(result)
        while len(self._queue) > self.limit:
            jax.block_until_ready(self._queue.popleft())

    def drain(self) -> None:
        while self._queue:
            jax.block_until_ready(self._queue.popleft())


def epoch_batches(images, labels, batch_size: int, *, seed: int, epoch: int) -> Iterator:
    """Host batches of one epoch in the seeded order (the same for every strategy); the last
    partial batch is dropped, as every batch must split evenly over the mesh."""
    order = epoch_order(len(images), seed, epoch)
    for start in range(0, len(order) - batch_size + 1, batch_size):
        idx = order[start : start + batch_size]
        yield images[idx], labels[idx]


def staged(place, batches: Iterator) -> Iterator:
    """Yield ``place(*batch)`` for each host batch, the next one's transfer started ahead.

    ``place`` is e.g. ``setup.place_batch``; a function placing one host batch for two setups
    stages both (the reference comparison of the examples) without a host round trip.
    """
    batches = iter(batches)
    nxt = next(batches, None)
    ahead = None if nxt is None else place(*nxt)
    while ahead is not None:
        current = ahead
        nxt = next(batches, None)
        ahead = None if nxt is None else place(*nxt)  # async device_put
        yield current


def dataset_logits(setup, params, images: np.ndarray, chunk: int = 2000) -> np.ndarray:
    """Logits ``[N, C]`` of a whole set on the host, in chunks padded to split evenly."""
    multiple = setup.batch_multiple
    chunk = max(multiple, chunk - chunk % multiple)
    inflight, out = StepsInFlight(), []
    for start in range(0, len(images), chunk):
        x = images[start : start + chunk]
        pad = (-len(x)) % multiple
        if pad:
            x = np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])
        logits = setup.logits(params, setup.place_batch(x))
        inflight.add(logits)
        out.append((logits, len(x) - pad))
    inflight.drain()
    return np.concatenate([np.asarray(logits)[:n] for logits, n in out])


def seed_metrics(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """The seed's loss ``-mean(one_hot · log_softmax)`` and accuracy, in float64 on the host."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    loss = -np.mean(labels * log_probs)
    accuracy = np.mean(np.argmax(logits, -1) == np.argmax(labels, -1))
    return float(loss), float(accuracy)
