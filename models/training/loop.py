"""Loop helpers for the examples: bounded steps in flight, staged batches, whole-set metrics.

Whole-set metrics come from the strategy's own ``Setup.evaluate`` (sums over a padded chunk,
reduced over the mesh), so what the examples print is what the sharded model computes.

The hang trap: with 8 simulated devices on few cores, dispatching many steps that contain
collectives without waiting can deadlock XLA:CPU's collectives. ``StepsInFlight`` waits for the
oldest step once more than ``limit`` are queued, so every training loop stays bounded.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import jax
import numpy as np

from shardops_models.data.mnist import epoch_order
from shardops_models.training._train import gather_tree

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


def epoch_batches(
    images, labels, batch_size: int, *, seed: int, epoch: int, rows: slice | None = None,
    start: int = 0,
) -> Iterator:  # fmt: skip
    """Host batches of one epoch in the seeded order (the same for every strategy); the last
    partial batch is dropped, as every batch must split evenly over the mesh.

    ``rows``: only these rows of each global batch are read (``Setup.process_rows``: a
    process of a multi-process run reads its own part). ``start``: the first batch to yield
    (resuming mid-epoch from a checkpoint).
    """
    order = epoch_order(len(images), seed, epoch)
    rows = slice(0, batch_size) if rows is None else rows
    for first in range(start * batch_size, len(order) - batch_size + 1, batch_size):
        idx = order[first : first + batch_size][rows]
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


def _chunks(setup, n: int, chunk: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(global chunk size, real examples, this process's indices)`` of whole-set chunks:
    chunks padded to split evenly over the mesh, each process reading only its rows. Padding
    rows have index -1."""
    multiple = setup.batch_multiple
    chunk = max(multiple, chunk - chunk % multiple)
    for start in range(0, n, chunk):
        real = min(chunk, n - start)
        size = real + (-real) % multiple
        rows = setup.process_rows(size)
        idx = np.arange(start + rows.start, start + rows.stop)
        yield size, real, np.where(idx < start + real, idx, -1)


def _take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[idx]`` with zero rows where ``idx`` is -1 (padding)."""
    out = a[np.maximum(idx, 0)]
    out[idx < 0] = 0
    return out


def dataset_logits(setup, params, images: np.ndarray, chunk: int = 2000) -> np.ndarray:
    """Logits ``[N, C]`` of a whole set on the host (every process gets all of them), in
    chunks padded to split evenly; each process reads only its rows of each chunk."""
    inflight, out = StepsInFlight(), []
    for size, real, idx in _chunks(setup, len(images), chunk):
        logits = setup.logits(params, setup.place_local_batch(_take(images, idx), batch=size))
        inflight.add(logits)
        out.append((logits, real))
    inflight.drain()
    return np.concatenate([gather_tree(logits)[:n] for logits, n in out])


def dataset_metrics(
    setup, params, images: np.ndarray, labels: np.ndarray, chunk: int = 2000
) -> tuple[float, float]:
    """The seed's loss and the accuracy of a whole set, from ``setup.evaluate`` on chunks.

    Every example counts exactly once: the last chunk is padded to split evenly over the mesh
    with rows whose label is all zeros, which ``evaluate`` leaves out. The per-chunk sums are
    added on the host (loss in float64, counts as integers). In a multi-process run each
    process reads only its rows of each chunk and every process gets the global figures.
    """
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    inflight, sums = StepsInFlight(), []
    for size, _, idx in _chunks(setup, len(images), chunk):
        placed = setup.place_local_batch(_take(images, idx), _take(labels, idx), batch=size)
        metrics = setup.evaluate(params, *placed)
        inflight.add(metrics)
        sums.append(metrics)
    inflight.drain()
    sums = gather_tree(sums)  # replicated scalars: every process holds them
    loss_sum = sum(float(m.loss_sum) for m in sums)
    correct = sum(int(m.correct) for m in sums)
    count = sum(int(m.count) for m in sums)
    if count != len(images):
        raise AssertionError(f"evaluated {count} examples of {len(images)}")  # internal invariant
    return loss_sum / count, correct / count
