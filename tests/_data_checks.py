"""Checks of the data pipeline on generated IDX files and token streams, shared by
tests/data/test_mnist.py, tests/data/test_text.py and their mutation module (tests/data/test_data_mutations.py),
so that the mutants face the suite's own checks.

Every generated image encodes its split and index (pixel 0: index mod 256, pixel 1: index div
256, pixel 2: the split's tag, the rest a pattern of both), and its label is a function of the
same two, so each example found in a batch can be traced back to its row in the IDX files.
"""

import gzip

import numpy as np

from shardops_models.data import mnist, text
from shardops_models.training import loop

SPLIT_TAGS = {"train": 1, "test": 2}
SPLIT_STEMS = {"train": "train", "test": "t10k"}


def write_idx(path, array, *, magic=None, gz=False, cut=0, extra=b""):
    header = magic if magic is not None else bytes([0, 0, 8, array.ndim])
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes() + extra
    raw = raw[: len(raw) - cut] if cut else raw
    path.write_bytes(gzip.compress(raw) if gz else raw)


def example_pixels(split: str, index: np.ndarray) -> np.ndarray:
    """uint8 images ``[n, 28, 28]`` of the examples ``index`` of ``split``: unique per example."""
    index = np.asarray(index)
    tag = SPLIT_TAGS[split]
    k = np.arange(28 * 28)
    pixels = (index[:, None] * 31 + k * 7 + tag * 101) % 256  # (n, 784)
    pixels[:, 0], pixels[:, 1], pixels[:, 2] = index % 256, index // 256, tag
    return pixels.astype(np.uint8).reshape(-1, 28, 28)


def example_classes(split: str, index: np.ndarray) -> np.ndarray:
    """The class of each example ``index`` of ``split``: neighbours and splits differ."""
    return ((7 * np.asarray(index) + 3 * SPLIT_TAGS[split]) % mnist.NUM_CLASSES).astype(np.uint8)


def write_indexed_idx_dir(path, n_train: int, n_test: int, *, gz: bool = False) -> None:
    """The four IDX files of a data folder whose examples encode their split and index."""
    for split, n in (("train", n_train), ("test", n_test)):
        stem = SPLIT_STEMS[split]
        suffix = ".gz" if gz else ""
        write_idx(
            path / f"{stem}-images-idx3-ubyte{suffix}", example_pixels(split, np.arange(n)), gz=gz
        )
        write_idx(
            path / f"{stem}-labels-idx1-ubyte{suffix}", example_classes(split, np.arange(n)), gz=gz
        )


def index_of(images: np.ndarray) -> np.ndarray:
    """The example index encoded in each float image ``[n, 784]``."""
    pixels = np.rint(images[:, :2].astype(np.float64) * 255).astype(np.int64)  # (n, 2)
    return pixels[:, 0] + 256 * pixels[:, 1]


def check_examples(images, labels, split: str, index) -> None:
    """``images``/``labels`` are exactly the examples ``index`` of ``split``'s files: images
    float32 ``pixel / 255`` in [0, 1], labels float32 one-hot of the example's class."""
    index = np.asarray(index)
    assert images.dtype == np.float32 and labels.dtype == np.float32, (images.dtype, labels.dtype)
    assert images.shape == (len(index), 784), (images.shape, len(index))
    assert labels.shape == (len(index), mnist.NUM_CLASSES), (labels.shape, len(index))
    assert images.min(initial=0.0) >= 0.0 and images.max(initial=1.0) <= 1.0
    pixels = example_pixels(split, index).reshape(len(index), -1)
    # float64 then float32 rounds like the float32 division (double rounding is exact for /).
    expected = (pixels.astype(np.float64) / 255).astype(np.float32)
    np.testing.assert_array_equal(images, expected, err_msg=f"{split} images")
    one_hot = np.eye(mnist.NUM_CLASSES, dtype=np.float32)[example_classes(split, index)]
    np.testing.assert_array_equal(labels, one_hot, err_msg=f"{split} labels")


def check_split_files(tmp_path, n_train: int, n_test: int, *, gz: bool = False) -> None:
    """``load_idx_dir`` gives the train files' examples as train and the t10k files' as test."""
    write_indexed_idx_dir(tmp_path, n_train, n_test, gz=gz)
    ds = mnist.load_idx_dir(tmp_path)
    check_examples(ds.train_images, ds.train_labels, "train", np.arange(n_train))
    check_examples(ds.test_images, ds.test_labels, "test", np.arange(n_test))


def epoch_indices(ds, batch_size: int, *, seed: int, epoch: int) -> list[np.ndarray]:
    """The example indices of each batch of one epoch, each batch checked against the files."""
    batches = loop.epoch_batches(
        ds.train_images, ds.train_labels, batch_size, seed=seed, epoch=epoch
    )
    indices = []
    for images, labels in batches:
        index = index_of(images)
        check_examples(images, labels, "train", index)  # each image with its own label
        indices.append(index)
    return indices


def check_epochs(tmp_path, n: int, batch_size: int, *, epochs: int, seed: int = 0) -> None:
    """Each epoch holds ``n // batch_size`` full batches of distinct examples, paired with their
    labels, in ``epoch_order``; the ``n % batch_size`` left at the end of the order are dropped.
    The order is seeded, differs between consecutive epochs, and over ``epochs`` epochs every
    example is seen."""
    assert 0 < batch_size <= n, "the check needs at least one full batch"
    write_indexed_idx_dir(tmp_path, n, 5)
    ds = mnist.load_idx_dir(tmp_path)
    full = n // batch_size
    seen = set()
    orders = []
    for epoch in range(epochs):
        batches = epoch_indices(ds, batch_size, seed=seed, epoch=epoch)
        assert len(batches) == full, f"epoch {epoch}: {len(batches)} batches, expected {full}"
        order = np.concatenate(batches)
        assert len(set(order.tolist())) == len(order), f"epoch {epoch}: an example repeats"
        planned = mnist.epoch_order(n, seed, epoch)
        np.testing.assert_array_equal(order, planned[: full * batch_size], err_msg=f"epoch {epoch}")
        dropped = set(range(n)) - set(order.tolist())
        assert dropped == set(planned[full * batch_size :].tolist()), f"epoch {epoch}: {dropped}"
        again = epoch_indices(ds, batch_size, seed=seed, epoch=epoch)
        np.testing.assert_array_equal(np.concatenate(again), order, err_msg="same seed, new order")
        other_seed = epoch_indices(ds, batch_size, seed=seed + 1, epoch=epoch)
        assert not np.array_equal(order, np.concatenate(other_seed)), "the seed is ignored"
        seen |= set(order.tolist())
        orders.append(order)
    for epoch in range(1, epochs):
        assert not np.array_equal(orders[epoch - 1], orders[epoch]), f"epoch {epoch} repeats"
    assert seen == set(range(n)), f"never seen in {epochs} epochs: {set(range(n)) - seen}"


# --- text windows (shardops_models.data.text)

TEXT_WINDOW_BOUNDARIES = [
    # (tokens, batch_size, context): lengths at a multiple of the context, one more, one less;
    # window counts at a multiple of the batch, one more, one less; a single window.
    (100, 3, 10), (101, 3, 10), (99, 3, 10), (91, 3, 10), (121, 4, 10), (61, 1, 10),
    (5, 1, 4), (6, 2, 1), (17, 2, 8), (33, 4, 8), (32, 2, 8), (65, 8, 8), (65, 1, 64), (64, 1, 64),
]  # fmt: skip


def check_text_windows(n_tokens: int, batch_size: int, context: int, seed: int = 0) -> None:
    """One epoch of ``text.batches`` over ``n_tokens`` tokens (each token its own position, so a
    row names its window): ``(N − 1) // S`` windows, ``windows // B`` full batches of distinct
    windows at multiples of S, every input and target inside the tokens and the targets the
    inputs shifted by one; ``text.sample_batch`` draws windows at every offset in
    ``[0, N − S − 1]`` and at no other."""
    tokens = np.arange(n_tokens, dtype=np.int32)  # token i is position i
    windows = (n_tokens - 1) // context  # each window needs S inputs and one more target
    where = f"{n_tokens} tokens, batch {batch_size}, context {context}"
    if n_tokens < context + 1:  # not even one window
        try:
            text.window_count(tokens, batch_size, context)
        except ValueError:
            return
        raise AssertionError(f"{where}: no window fits, yet no error")
    assert text.window_count(tokens, batch_size, context) == windows, where
    if windows < batch_size:
        try:
            text.batches(tokens, batch_size, context, seed=seed, epoch=0)
        except ValueError:
            return
        raise AssertionError(f"{where}: {windows} windows make no full batch, yet no error")
    try:
        epoch = list(text.batches(tokens, batch_size, context, seed=seed, epoch=0))
    except IndexError as e:
        raise AssertionError(f"{where}: a window runs past the last token ({e})") from e
    assert len(epoch) == windows // batch_size, (where, len(epoch), windows // batch_size)
    starts = []
    for inputs, targets in epoch:
        assert inputs.shape == targets.shape == (batch_size, context), (where, inputs.shape)
        first = inputs[:, :1]  # (B, 1): each row's start
        np.testing.assert_array_equal(inputs, first + np.arange(context), err_msg=where)
        np.testing.assert_array_equal(targets, first + 1 + np.arange(context), err_msg=where)
        assert np.all(first % context == 0), (where, first.ravel())  # non-overlapping windows
        assert np.all(first + context < n_tokens), (where, first.ravel())  # the last target
        starts += first.ravel().tolist()
    assert len(set(starts)) == len(starts), f"{where}: a window twice in one epoch"
    assert set(starts) <= set(range(0, windows * context, context)), where
    rng = np.random.default_rng([seed, n_tokens])
    draws = max(64, 16 * (n_tokens - context))
    try:
        inputs, targets = text.sample_batch(tokens, draws, context, rng)
    except IndexError as e:
        raise AssertionError(f"{where}: sample_batch ran past the last token ({e})") from e
    first = inputs[:, :1]
    np.testing.assert_array_equal(inputs, first + np.arange(context), err_msg=where)
    np.testing.assert_array_equal(targets, first + 1 + np.arange(context), err_msg=where)
    offsets = set(first.ravel().tolist())
    assert offsets == set(range(n_tokens - context)), (where, sorted(offsets))


# --- the loop's schedule (shardops_models.training.loop): what no value shows


class _Pending:
    """A stand-in for a dispatched step's result: records when it is waited for."""

    def __init__(self, log: list, i: int):
        self.log, self.i = log, i

    def block_until_ready(self):
        self.log.append(self.i)
        return self


def check_steps_in_flight(module=loop) -> None:
    """``StepsInFlight(limit)``: after each ``add``, at most ``limit`` results are not waited
    for, the oldest waited for first, each once; ``drain`` waits for the rest, in order."""
    for limit in (1, 2, 3):
        waited: list = []
        inflight = module.StepsInFlight(limit)
        for i in range(10):
            inflight.add(_Pending(waited, i))
            assert waited == list(range(max(0, i + 1 - limit))), (limit, i, waited)
        inflight.drain()
        assert waited == list(range(10)), (limit, waited)


def check_staged(module=loop) -> None:
    """``staged(place, batches)``: each host batch placed once, in order, and the next one
    placed (its transfer started) before the current one is handed to the step."""
    placed: list = []

    def place(x, y):
        placed.append(x)
        return x, y

    got = []
    for x, _ in module.staged(place, iter([(i, -i) for i in range(5)])):
        assert placed == list(range(min(x + 2, 5))), (x, placed)  # x and, ahead, x + 1
        got.append(x)
    assert got == list(range(5)) and placed == list(range(5)), (got, placed)
    assert list(module.staged(place, iter([]))) == []
