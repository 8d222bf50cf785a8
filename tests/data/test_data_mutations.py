"""Mutation check for the data pipeline: bugs injected into copies of models/data/mnist.py,
models/training/loop.py and models/data/text.py are caught by the suite's own checks (tests/_data_checks.py).

Each mutant replaces one exact line of the real source (the test fails if that line is gone, so
mutants cannot drift from the code), is loaded as a module, and its function is swapped in for
the real one. The check that tests/data/test_mnist.py (test_text.py) runs must then fail.
"""

import inspect
import sys
import types

import pytest
from _data_checks import (
    TEXT_WINDOW_BOUNDARIES,
    check_epochs,
    check_split_files,
    check_staged,
    check_steps_in_flight,
    check_text_windows,
)

from shardops_models.data import mnist, text
from shardops_models.training import loop

SOURCES = {m: inspect.getsource(m) for m in (mnist, loop, text)}
SWAPPED = {mnist: ("load_idx_dir",), loop: ("epoch_batches", "StepsInFlight", "staged"),
           text: ("window_count", "batches", "sample_batch")}  # fmt: skip
PATHS = "    paths = {key: _find(data_dir, stem) for key, stem in IDX_FILES.items()}\n"
ONE_HOT = "    return np.eye(NUM_CLASSES, dtype=np.float32)[labels]  # (N, 10)\n"
IMAGES = (
    "    return images.reshape(len(images), -1).astype(np.float32) / 255.0  # (N, 784) in [0, 1]\n"
)
ORDER = "    order = epoch_order(len(images), seed, epoch)\n"
RANGE = "    for first in range(start * batch_size, len(order) - batch_size + 1, batch_size):\n"
YIELD = "        yield images[idx], labels[idx]\n"
WINDOWS = "    return (len(tokens) - 1) // context\n"
BATCHES = "        for i in range(0, n - batch_size + 1, batch_size)\n"
STARTS = "    starts = rng.integers(0, len(tokens) - context, size=batch_size)  # (B,) last: len - S - 1\n"


def steps_in_flight(tmp_path):  # as test_steps_in_flight_are_bounded_and_awaited_oldest_first
    check_steps_in_flight()


def staged(tmp_path):  # as test_staged_places_the_next_batch_before_yielding_the_current
    check_staged()


def text_windows(tmp_path):  # as test_windows_at_the_boundaries
    for case in TEXT_WINDOW_BOUNDARIES:
        check_text_windows(*case)


def splits(tmp_path):  # as test_test_split_comes_from_the_t10k_files
    for n_train, n_test in [(20, 20), (50, 20)]:  # equal counts first: the content must differ
        (tmp_path / str(n_train)).mkdir()
        check_split_files(tmp_path / str(n_train), n_train, n_test, gz=True)


def pairing(tmp_path):  # as test_every_example_once_per_epoch_with_its_own_label
    check_epochs(tmp_path, 50, 16, epochs=3)


def partial_batch(tmp_path):  # as test_last_partial_batch_is_dropped_and_reshuffled
    check_epochs(tmp_path, 50, 35, epochs=6)


# name: (module, line, its replacement, the check that catches it)
MUTANTS = {
    # The test split read from the training files (same counts, so no DataError gives it away).
    "test_split_reads_train_files": (
        mnist,
        PATHS,
        PATHS.replace("_find(data_dir, stem)", '_find(data_dir, stem.replace("t10k", "train"))'),
        splits,
    ),
    "test_images_from_train_split": (
        mnist,
        '        test_images=arrays["test"][0],\n',
        '        test_images=arrays["train"][0],\n',
        splits,
    ),
    # The one-hot one class off: class c marks column c + 1 (class 9 marks nothing).
    "one_hot_off_by_one_class": (
        mnist,
        ONE_HOT,
        ONE_HOT.replace("dtype=", "k=1, dtype="),
        splits,
    ),
    "pixels_divided_by_256": (mnist, IMAGES, IMAGES.replace("255.0", "256.0"), splits),
    "labels_shuffled_apart_from_images": (
        loop,
        YIELD,
        YIELD.replace("labels[idx]", "labels[np.roll(idx, 1)]"),
        pairing,
    ),
    "epoch_drops_a_full_batch": (
        loop,
        RANGE,
        RANGE.replace("- batch_size + 1", "- 2 * batch_size + 1"),
        partial_batch,
    ),
    # Every epoch in epoch 0's order: the same examples are dropped every time.
    "same_order_every_epoch": (loop, ORDER, ORDER.replace("epoch)", "0)"), partial_batch),
    # One more step in flight than the limit: the bound that keeps XLA:CPU's collectives from
    # deadlocking is off by one.
    "one_step_too_many_in_flight": (
        loop,
        "        while len(self._queue) > self.limit:\n",
        "        while len(self._queue) > self.limit + 1:\n",
        steps_in_flight,
    ),
    # The newest step waited for instead of the oldest: an older, independent one (the
    # reference's) may still be running.
    "newest_step_waited_for": (
        loop,
        "        while len(self._queue) > self.limit:\n"
        "            self._wait(self._queue.popleft())\n",
        "        while len(self._queue) > self.limit:\n            self._wait(self._queue.pop())\n",
        steps_in_flight,
    ),
    # The next batch placed only after the current one was used: no transfer overlaps a step.
    "next_batch_placed_late": (
        loop,
        "        ahead = None if nxt is None else place(*nxt)  # async device_put\n"
        "        yield current\n",
        "        yield current\n        ahead = None if nxt is None else place(*nxt)\n",
        staged,
    ),
    # A window counted without its last target: at a length that is a multiple of the context
    # the last window reads one token past the end.
    "window_count_forgets_the_target": (text, WINDOWS, WINDOWS.replace(" - 1)", ")"), text_windows),
    # The windows counted one short: at a length of k·S + 1 the last window is never used.
    "window_count_one_short": (text, WINDOWS, WINDOWS.replace(" - 1)", " - 2)"), text_windows),
    # The last full batch dropped when the windows fill a whole number of batches.
    "epoch_drops_the_last_full_batch": (
        text,
        BATCHES,
        BATCHES.replace("- batch_size + 1", "- batch_size"),
        text_windows,
    ),
    # Windows one token apart too few: they overlap by one input.
    "windows_overlap": (
        text,
        "        windows_at(tokens, order[i : i + batch_size][rows] * context, context)\n",
        "        windows_at(tokens, order[i : i + batch_size][rows] * (context - 1), context)\n",
        text_windows,
    ),
    # A sampled window may start at N − S: its last target is past the end.
    "sample_past_the_end": (
        text,
        STARTS,
        STARTS.replace("len(tokens) - context,", "len(tokens) - context + 1,"),
        text_windows,
    ),
    # The last offset N − S − 1 is never sampled.
    "sample_never_the_last_offset": (
        text,
        STARTS,
        STARTS.replace("len(tokens) - context,", "len(tokens) - context - 1,"),
        text_windows,
    ),
}


def mutant_module(module, old: str, new: str) -> types.ModuleType:
    source = SOURCES[module]
    assert source.count(old) == 1, (
        f"mutated line not found exactly once in {module.__name__}: {old!r}"
    )
    mutant = types.ModuleType(f"{module.__name__}_mutant")
    mutant.__file__ = module.__file__  # mnist.py finds its sample folder from it
    sys.modules[mutant.__name__] = mutant  # dataclasses look their module up
    exec(
        compile(source.replace(old, new), f"<mutant of {module.__file__}>", "exec"), mutant.__dict__
    )
    return mutant


@pytest.fixture
def swap_in(monkeypatch):
    """Load a mutant of ``module`` and put its function in place of the real one."""

    def swap_in(module, old, new):
        mutant = mutant_module(module, old, new)
        for name in SWAPPED[module]:
            monkeypatch.setattr(module, name, getattr(mutant, name))

    return swap_in


@pytest.mark.parametrize("name", MUTANTS)
def test_unmutated_copy_passes(tmp_path, swap_in, name):
    """The harness itself does not cause failures: the same copy without the mutation passes."""
    module, old, _, check = MUTANTS[name]
    swap_in(module, old, old)
    check(tmp_path)


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(tmp_path, swap_in, name):
    module, old, new, check = MUTANTS[name]
    swap_in(module, old, new)
    with pytest.raises(AssertionError):
        check(tmp_path)
