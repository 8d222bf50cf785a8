"""MNIST-style image data for the examples and tests: tfds, local IDX files, or the shipped sample.

``load(dataset, data_dir)`` picks, in order:

1. ``data_dir``: the four standard IDX files in that folder (``train-images-idx3-ubyte``,
   ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each
   optionally ``.gz``): MNIST, Fashion-MNIST, or Debian's ``dataset-fashion-mnist`` in
   /usr/share/datasets/fashion-mnist.
2. ``dataset="sample"``: the Fashion-MNIST sample shipped in ``models/data/sample_data`` (6,000
   train and 1,000 test images; provenance and MIT license beside it).
3. tensorflow-datasets (``mnist``, ``fashion_mnist``) through its data-source API (array_record,
   no TensorFlow needed): already prepared data is used as is; otherwise it is downloaded if
   tfds' download host answers within ``offline_timeout`` seconds. If not (an offline machine:
   tfds itself would retry for minutes), ``load`` says so in one line and uses the sample.

Nothing is read from system folders unless ``data_dir`` names one. Images become float32
``[N, 784]`` in [0, 1], labels one-hot float32 ``[N, 10]``.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import pathlib

import numpy as np

from shardops_models.data._net import host_reachable

SAMPLE_DIR = pathlib.Path(__file__).parent / "sample_data" / "fashion-mnist-sample"
IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
TFDS_DATASETS = ("mnist", "fashion_mnist")
DATASETS = (*TFDS_DATASETS, "sample")
# tfds downloads MNIST and Fashion-MNIST from Google Cloud Storage.
TFDS_DOWNLOAD_HOST = ("storage.googleapis.com", 443)
NUM_CLASSES = 10
_IDX_DTYPES = {0x08: np.uint8}


class DataError(ValueError):
    """A data file is missing, corrupt or inconsistent; the message names the file."""


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    source: str
    """Where the data came from, in words (printed by the examples)."""
    train_images: np.ndarray  # (N, 784) float32 in [0, 1]
    train_labels: np.ndarray  # (N, 10) float32 one-hot
    test_images: np.ndarray
    test_labels: np.ndarray

    def take_train(self, n: int) -> Dataset:
        """The first ``n`` training examples (for quick runs)."""
        return dataclasses.replace(
            self, train_images=self.train_images[:n], train_labels=self.train_labels[:n]
        )


def read_idx(path: str | os.PathLike, *, ndim: int) -> np.ndarray:
    """Read one IDX file (optionally gzipped), checking its magic number, rank and length."""
    path = pathlib.Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: not a valid gzip file ({e})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        magic = raw[:4].hex() or "empty"
        raise DataError(
            f"{path}: bad magic number 0x{magic}; an IDX file of unsigned bytes starts with "
            f"0x000008{ndim:02x}. Is this an MNIST-format file?"
        )
    if raw[3] != ndim:
        raise DataError(f"{path}: holds a {raw[3]}-d array, expected {ndim}-d")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated inside its header ({len(raw)} bytes)")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(dims))
    body = len(raw) - header
    if body != expected:
        what = "truncated" if body < expected else "longer than its header says"
        raise DataError(
            f"{path}: {what}: header says {' × '.join(map(str, dims))} = {expected} bytes of "
            f"data, but {body} follow"
        )
    return np.frombuffer(raw, dtype=_IDX_DTYPES[raw[2]], offset=header).reshape(dims)


def _find(data_dir: pathlib.Path, stem: str) -> pathlib.Path:
    for name in (stem, stem + ".gz"):
        if (data_dir / name).exists():
            return data_dir / name
    raise DataError(
        f"{data_dir}: missing {stem}(.gz); an IDX data folder holds "
        f"{', '.join(IDX_FILES.values())} (each optionally .gz)"
    )


def load_idx_dir(data_dir: str | os.PathLike, *, name: str | None = None) -> Dataset:
    """The four standard IDX files of ``data_dir`` as a ``Dataset``."""
    data_dir = pathlib.Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: not a folder (--data-dir wants the folder of IDX files)")
    paths = {key: _find(data_dir, stem) for key, stem in IDX_FILES.items()}
    arrays = {}
    for split in ("train", "test"):
        images = read_idx(paths[f"{split}_images"], ndim=3)
        labels = read_idx(paths[f"{split}_labels"], ndim=1)
        if images.shape[1:] != (28, 28):
            raise DataError(
                f"{paths[f'{split}_images']}: images are {images.shape[1]}×{images.shape[2]}, "
                f"expected 28×28"
            )
        if len(images) != len(labels):
            raise DataError(
                f"{paths[f'{split}_images']} holds {len(images)} images but "
                f"{paths[f'{split}_labels']} holds {len(labels)} labels"
            )
        if labels.size and labels.max() >= NUM_CLASSES:
            raise DataError(f"{paths[f'{split}_labels']}: label {labels.max()} is out of range 0–9")
        arrays[split] = (_images(images), _one_hot(labels))
    return Dataset(
        name=name or data_dir.name,
        source=f"IDX files in {data_dir}",
        train_images=arrays["train"][0],
        train_labels=arrays["train"][1],
        test_images=arrays["test"][0],
        test_labels=arrays["test"][1],
    )


def load_sample() -> Dataset:
    """The shipped Fashion-MNIST sample (see ``models/data/sample_data/README.md``)."""
    data = load_idx_dir(SAMPLE_DIR, name="fashion_mnist_sample")
    return dataclasses.replace(
        data,
        source=(
            f"the shipped Fashion-MNIST sample ({len(data.train_images):,} train / "
            f"{len(data.test_images):,} test images, MIT license, models/data/sample_data)"
        ),
    )


def load_tfds(name: str, *, data_dir=None, download: bool = True) -> Dataset:
    """``name`` through tfds' data-source API (array_record; TensorFlow is not needed)."""
    import tensorflow_datasets as tfds

    splits = tfds.data_source(name, split=["train", "test"], data_dir=data_dir, download=download)
    arrays = []
    for source in splits:
        examples = [source[i] for i in range(len(source))]
        images = np.stack([np.asarray(e["image"]).reshape(28, 28) for e in examples])
        labels = np.array([int(e["label"]) for e in examples])
        arrays.append((_images(images), _one_hot(labels)))
    return Dataset(
        name=name,
        source=f"tensorflow-datasets '{name}'",
        train_images=arrays[0][0],
        train_labels=arrays[0][1],
        test_images=arrays[1][0],
        test_labels=arrays[1][1],
    )


def tfds_prepared(name: str, data_dir=None) -> bool:
    """Whether tfds already has ``name`` prepared locally (no network needed)."""
    import tensorflow_datasets as tfds
    from absl import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # tfds warns about every folder it looks into
    try:
        return tfds.builder(name, data_dir=data_dir).is_prepared()
    except Exception:  # an unreadable or partial prepared folder counts as not prepared
        return False
    finally:
        logging.set_verbosity(verbosity)


def load(
    dataset: str = "mnist",
    data_dir=None,
    *,
    tfds_data_dir=None,
    offline_timeout: float = 5.0,
    log=print,
) -> Dataset:
    """Load ``dataset``; see the module docstring for the order and the offline fallback."""
    if data_dir is not None:
        return load_idx_dir(data_dir)
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {DATASETS}")
    if dataset == "sample":
        return load_sample()
    if tfds_prepared(dataset, tfds_data_dir):
        return load_tfds(dataset, data_dir=tfds_data_dir, download=False)
    if host_reachable(TFDS_DOWNLOAD_HOST, timeout=offline_timeout):
        return load_tfds(dataset, data_dir=tfds_data_dir, download=True)
    sample = load_sample()
    log(
        f"Data: tfds cannot download {dataset!r} here (no answer from its download host within "
        f"{offline_timeout:g} s), so this run uses {sample.source}. For the full data, run once "
        f"online, or pass --data-dir DIR with the four IDX files."
    )
    return sample


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled example order of one epoch: seeded, the same for every strategy."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def _images(images: np.ndarray) -> np.ndarray:
    return images.reshape(len(images), -1).astype(np.float32) / 255.0  # (N, 784) in [0, 1]


def _one_hot(labels: np.ndarray) -> np.ndarray:
    return np.eye(NUM_CLASSES, dtype=np.float32)[labels]  # (N, 10)
