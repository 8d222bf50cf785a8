"""The data module: IDX reading and every bad-file case, tfds offline, the offline fallback, and
the pipeline from generated IDX files to epoch batches (images with their own labels)."""

import socket
import time

import numpy as np
import pytest
from _data_checks import check_epochs, check_split_files, write_idx

from shardops_models.data import mnist

# 50 train examples: batch sizes that divide 50 and ones that leave 1, 2 or 15 behind.
N_TRAIN = 50


def make_idx_dir(tmp_path, n_train=12, n_test=6, gz=True, **overrides):
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28)),
        "train_labels": rng.integers(0, 10, n_train),
        "test_images": rng.integers(0, 256, (n_test, 28, 28)),
        "test_labels": rng.integers(0, 10, n_test),
    }
    for key, stem in mnist.IDX_FILES.items():
        write_idx(
            tmp_path / (stem + (".gz" if gz else "")), arrays[key], gz=gz, **overrides.get(key, {})
        )
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_reads_generated_idx_files(tmp_path, gz):
    arrays = make_idx_dir(tmp_path, gz=gz)
    ds = mnist.load_idx_dir(tmp_path)
    assert ds.train_images.shape == (12, 784) and ds.train_images.dtype == np.float32
    np.testing.assert_allclose(ds.train_images[3], arrays["train_images"][3].reshape(-1) / 255.0)
    assert ds.test_labels.shape == (6, 10)
    np.testing.assert_array_equal(ds.test_labels.argmax(1), arrays["test_labels"])
    assert ds.train_images.min() >= 0.0 and ds.train_images.max() <= 1.0


@pytest.mark.parametrize(
    ("key", "override", "match"),
    [
        (
            "train_images",
            {"magic": b"\x08\x03\x00\x00"},
            r"train-images-idx3-ubyte.gz: bad magic number 0x08030000",
        ),
        (
            "test_labels",
            {"magic": bytes([0, 0, 0x0D, 1])},
            r"t10k-labels-idx1-ubyte.gz: bad magic number",
        ),
        (
            "train_labels",
            {"magic": bytes([0, 0, 8, 2])},
            r"train-labels-idx1-ubyte.gz: holds a 2-d array, expected 1-d",
        ),
        (
            "test_images",
            {"cut": 100},
            r"t10k-images-idx3-ubyte.gz: truncated: header says 6 × 28 × 28 = 4704 bytes of data, but 4604 follow",
        ),
        (
            "train_labels",
            {"extra": b"\x00\x01"},
            r"train-labels-idx1-ubyte.gz: longer than its header says",
        ),
    ],
)
def test_bad_files_name_the_file(tmp_path, key, override, match):
    make_idx_dir(tmp_path, **{key: override})
    with pytest.raises(mnist.DataError, match=match):
        mnist.load_idx_dir(tmp_path)


def test_corrupt_gzip(tmp_path):
    make_idx_dir(tmp_path)
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(mnist.DataError, match=r"train-labels-idx1-ubyte.gz: not a valid gzip file"):
        mnist.load_idx_dir(tmp_path)


def test_count_mismatch(tmp_path):
    make_idx_dir(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.zeros(5), gz=True)
    with pytest.raises(
        mnist.DataError,
        match=r"t10k-images-idx3-ubyte.gz holds 6 images but .*t10k-labels-idx1-ubyte.gz holds 5 labels",
    ):
        mnist.load_idx_dir(tmp_path)


def test_wrong_image_size_and_label_range(tmp_path):
    make_idx_dir(tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((12, 32, 32)), gz=True)
    with pytest.raises(mnist.DataError, match="images are 32×32, expected 28×28"):
        mnist.load_idx_dir(tmp_path)
    make_idx_dir(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.full(6, 12), gz=True)
    with pytest.raises(mnist.DataError, match="label 12 is out of range 0–9"):
        mnist.load_idx_dir(tmp_path)


def test_missing_file_and_folder(tmp_path):
    make_idx_dir(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(mnist.DataError, match=r"missing t10k-images-idx3-ubyte\(.gz\)"):
        mnist.load_idx_dir(tmp_path)
    with pytest.raises(mnist.DataError, match="not a folder"):
        mnist.load_idx_dir(tmp_path / "nope")


def test_shipped_sample_is_real_and_balanced():
    ds = mnist.load_sample()
    assert ds.train_images.shape == (6000, 784) and ds.test_images.shape == (1000, 784)
    counts = ds.train_labels.sum(0)
    assert counts.min() >= 500  # every class present
    assert 0.2 < ds.train_images.mean() < 0.4  # Fashion-MNIST's mean pixel is ~0.29


def test_tfds_data_source_offline_with_mock_data():
    import tensorflow_datasets as tfds  # installed by the [test] extra; never skipped

    with tfds.testing.mock_data(num_examples=24):
        ds = mnist.load_tfds("mnist")
    assert ds.train_images.shape == (24, 784) and ds.test_labels.shape == (24, 10)
    assert (
        ds.train_images.dtype == np.float32
        and 0.0 <= ds.train_images.min() <= ds.train_images.max() <= 1.0
    )
    np.testing.assert_array_equal(ds.train_labels.sum(1), 1.0)


def test_load_uses_prepared_tfds_data(monkeypatch):
    import tensorflow_datasets as tfds  # installed by the [test] extra; never skipped

    monkeypatch.setattr(mnist, "tfds_prepared", lambda name, data_dir=None: True)
    monkeypatch.setattr(
        mnist, "host_reachable", lambda *_, **__: pytest.fail("no network check needed")
    )
    with tfds.testing.mock_data(num_examples=16):
        ds = mnist.load("fashion_mnist")
    assert ds.name == "fashion_mnist" and len(ds.train_images) == 16


def test_offline_falls_back_to_the_sample_with_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(mnist, "host_reachable", lambda *_, **__: False)
    lines = []
    ds = mnist.load("mnist", tfds_data_dir=tmp_path, log=lines.append)
    assert ds.name == "fashion_mnist_sample"
    assert len(lines) == 1 and "cannot download 'mnist'" in lines[0] and "--data-dir" in lines[0]


def test_unreachable_host_is_detected_quickly():
    with socket.socket() as s:  # a loopback port that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    assert not mnist.host_reachable(("127.0.0.1", port), timeout=2.0)
    assert time.perf_counter() - start < 3.0


def test_epoch_order_is_seeded_and_a_permutation():
    a, b = mnist.epoch_order(100, 0, 3), mnist.epoch_order(100, 0, 3)
    np.testing.assert_array_equal(a, b)
    assert sorted(a) == list(range(100))
    assert not np.array_equal(a, mnist.epoch_order(100, 0, 4))


def test_unknown_dataset():
    with pytest.raises(ValueError, match="unknown dataset 'cifar'"):
        mnist.load("cifar")


@pytest.mark.parametrize(("n_train", "n_test"), [(N_TRAIN, 20), (20, 20)])
@pytest.mark.parametrize("gz", [True, False])
def test_test_split_comes_from_the_t10k_files(tmp_path, n_train, n_test, gz):
    check_split_files(tmp_path, n_train, n_test, gz=gz)


@pytest.mark.parametrize("batch_size", [1, 7, 10, 16, 25, N_TRAIN])
def test_every_example_once_per_epoch_with_its_own_label(tmp_path, batch_size):
    check_epochs(tmp_path, N_TRAIN, batch_size, epochs=3)


@pytest.mark.parametrize("batch_size", [7, 16, 35])
def test_last_partial_batch_is_dropped_and_reshuffled(tmp_path, batch_size):
    """floor(N/B) batches; the N mod B at the end of the order are dropped, and every example is
    seen within a few epochs (35 drops 15 of 50 per epoch)."""
    check_epochs(tmp_path, N_TRAIN, batch_size, epochs=6)
