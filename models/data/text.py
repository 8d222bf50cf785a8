"""Byte-level text for the GPT example: tiny_shakespeare through tfds, or Python's own source.

    corpus = load_corpus()  # source="auto"
    print(corpus.message)   # text: Python 3.11 standard library source, offline (…)
    for inputs, targets in batches(corpus.train, 32, 256, seed=0, epoch=0):
        ...                 # (B, S) int32 each; targets[:, t] is the token after inputs[:, t]

Sources, chosen by ``source=``:

- ``"tfds"``: TensorFlow Datasets' ``tiny_shakespeare`` (its train and validation splits) through
  the data-source API (array_record; reading needs no TensorFlow). tfds' builder for it needs
  TensorFlow to *prepare* it, and offline tfds retries its download for about 3.5 minutes, so
  only an already prepared copy is used unless ``download=True`` (which first checks that the
  download host answers). Prepare it once on a machine with internet and TensorFlow, then pass
  its ``data_dir`` or set ``TFDS_DATA_DIR``.
- ``"stdlib"``: the ``.py`` files of the running Python's standard library, which every machine
  with Python has: sorted relative paths, tests, installed packages and generated tables
  skipped, the first ``STDLIB_BYTES`` bytes. The last ``valid_fraction`` is the validation text.
- ``"auto"`` (the default): tfds when it can be had without waiting on the network, else stdlib.

Tokens are the UTF-8 bytes of the text (vocabulary 256), held as int32.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
from collections.abc import Iterator

import numpy as np

from shardops_models.data._net import host_reachable

VOCAB_SIZE = 256  # one token per byte value
SOURCES = ("auto", "tfds", "stdlib")
TFDS_NAME = "tiny_shakespeare"
TFDS_DOWNLOAD_HOST = ("raw.githubusercontent.com", 443)  # where tfds fetches tiny_shakespeare
# About 3× tiny_shakespeare's training text (1,003,854 bytes); read in a fraction of a second.
STDLIB_BYTES = 3_000_000
# Tests, installed packages and generated files (codec tables, pydoc's topics dump) are not prose
# a model should learn from; skipping them also keeps the selection the same in every venv.
STDLIB_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    | {"encodings", "pydoc_data"}
)
TFDS_HOW_TO = (
    "to get it, run once on a machine with internet and TensorFlow (`pip install tensorflow "
    "tensorflow-datasets array_record`): `tfds.data_source('tiny_shakespeare', data_dir=DIR)`, "
    "then pass data_dir=DIR or set TFDS_DATA_DIR=DIR; or use source='stdlib'"
)


class TextUnavailableError(RuntimeError):
    """The requested corpus cannot be had here; the message says why and how to get it."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # (N_train,) int32 byte tokens in [0, 256)
    valid: np.ndarray  # (N_valid,) int32 byte tokens in [0, 256)
    name: str  # "tiny_shakespeare" or "python_stdlib"
    message: str  # one line naming the corpus used, for the caller to print


def encode(text: str | bytes) -> np.ndarray:
    """The UTF-8 bytes of ``text`` as int32 tokens, shape ``(len(text.encode()),)``."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    if not isinstance(text, bytes):
        raise TypeError(f"encode wants str or bytes, got {type(text).__name__}")
    return np.frombuffer(text, dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
    """Integer tokens in [0, 256), any shape, back to text; invalid UTF-8 becomes U+FFFD."""
    tokens = np.asarray(tokens)
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"decode wants integer tokens, got dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= VOCAB_SIZE):
        raise ValueError(
            f"decode wants byte tokens in [0, {VOCAB_SIZE}), got values in "
            f"[{tokens.min()}, {tokens.max()}]"
        )
    return tokens.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def load_tfds_text(data_dir=None, *, download: bool = False) -> tuple[bytes, bytes]:
    """tiny_shakespeare's train and validation text, through tfds' data-source API.

    Raises at once (``FileNotFoundError``) if it is not prepared and ``download`` is False, and
    (``ConnectionError``) if ``download`` is True but the download host does not answer.
    """
    import tensorflow_datasets as tfds
    from absl import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # tfds warns about each unprepared folder it looks into
    try:
        builder = tfds.builder(TFDS_NAME, data_dir=data_dir)
        prepared = builder.is_prepared()
    finally:
        logging.set_verbosity(verbosity)
    if not prepared and not download:
        raise FileNotFoundError(f"{TFDS_NAME} is not prepared in {builder.data_dir}")
    if not prepared and not host_reachable(TFDS_DOWNLOAD_HOST):
        host, port = TFDS_DOWNLOAD_HOST
        raise ConnectionError(f"{host}:{port} does not answer, so tfds cannot download {TFDS_NAME}")
    splits = tfds.data_source(
        TFDS_NAME, split=["train", "validation"], data_dir=data_dir, download=download
    )
    texts = [split[0]["text"] for split in splits]  # one example per split; bytes from array_record
    return tuple(t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in texts)


def load_stdlib_text(max_bytes: int = STDLIB_BYTES) -> tuple[bytes, int]:
    """The first ``max_bytes`` bytes of the standard library's ``.py`` files, and the file count.

    Files are concatenated (newline-separated) in sorted order of their paths, so the text is
    the same on every machine with the same Python version.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP_DIRS]  # prune before descending
        paths += [
            os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")
        ]
    chunks, total = [], 0
    for path in sorted(paths):
        if total >= max_bytes:
            break
        with open(os.path.join(root, path), "rb") as f:
            chunks.append(f.read())
        total += len(chunks[-1]) + 1
    if not chunks:
        raise TextUnavailableError(f"no .py files under {root} (is the standard library zipped?)")
    return b"\n".join(chunks)[:max_bytes], len(chunks)


def load_corpus(
    source: str = "auto",
    *,
    data_dir=None,
    valid_fraction: float = 0.1,
    max_bytes: int | None = None,
    download: bool = False,
) -> Corpus:
    """Load a byte-level corpus; see the module docstring for the sources and the fallback.

    Arguments:
        source: ``"auto"``, ``"tfds"`` or ``"stdlib"``.
        data_dir: tfds' data folder (default: ``TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
        valid_fraction: the share of the stdlib text held out (tfds has its own splits).
        max_bytes: at most this many bytes of train + valid text; default: all of
            tiny_shakespeare, or ``STDLIB_BYTES`` of the standard library.
        download: let tfds download tiny_shakespeare (needs internet and TensorFlow).
    """
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is not one of {SOURCES}")
    if not 0 < valid_fraction < 1:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    if max_bytes is not None and max_bytes < 2:
        raise ValueError(
            f"max_bytes must be at least 2 (one train, one valid byte), got {max_bytes}"
        )
    why_not_tfds = ""
    if source in ("auto", "tfds"):
        try:
            train, valid = load_tfds_text(data_dir, download=download)
        except Exception as e:
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if source == "tfds":
                raise TextUnavailableError(
                    f"source='tfds': tensorflow-datasets cannot provide {TFDS_NAME} here "
                    f"({reason}); {TFDS_HOW_TO}"
                ) from e
            why_not_tfds = f"; tfds {TFDS_NAME} unavailable ({reason})"
        else:
            if max_bytes is not None and len(train) + len(valid) > max_bytes:
                keep = max_bytes / (len(train) + len(valid))  # cut both splits alike
                train, valid = train[: int(len(train) * keep)], valid[: int(len(valid) * keep)]
            message = f"text: {TFDS_NAME} (tfds, {len(train):,} train + {len(valid):,} valid bytes)"
            return Corpus(encode(train), encode(valid), TFDS_NAME, message)
    text, n_files = load_stdlib_text(STDLIB_BYTES if max_bytes is None else max_bytes)
    n_valid = min(max(1, round(len(text) * valid_fraction)), len(text) - 1)  # both non-empty
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    message = (
        f"text: Python {version} standard library source, offline ({n_files} files, "
        f"{len(text):,} bytes){why_not_tfds}"
    )
    return Corpus(encode(text[:-n_valid]), encode(text[-n_valid:]), "python_stdlib", message)


def window_count(tokens, batch_size: int, context: int) -> int:
    """How many non-overlapping windows of ``context`` inputs ``tokens`` holds; checks arguments.

    Window ``i`` is ``tokens[i * context : (i + 1) * context + 1]``: its inputs and, shifted by
    one, their targets: consecutive windows share one token, and no token is a target twice.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(
            f"tokens must be a 1-D integer array (e.g. Corpus.train), got shape {tokens.shape} "
            f"dtype {tokens.dtype}"
        )
    for name, value in (("batch_size", batch_size), ("context", context)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if len(tokens) < context + 1:
        raise ValueError(
            f"tokens holds {len(tokens)} tokens, but one window needs context + 1 = {context + 1}; "
            f"use a shorter context or a longer corpus"
        )
    return (len(tokens) - 1) // context


def windows_at(tokens: np.ndarray, starts: np.ndarray, context: int):
    """``(inputs, targets)``, each ``(B, S)`` int32, for windows starting at ``starts`` ``(B,)``."""
    index = starts[:, None] + np.arange(context + 1)  # (B, S + 1)
    window = tokens[index].astype(np.int32)  # (B, S + 1)
    return window[:, :-1], window[:, 1:]  # (B, S) inputs, (B, S) next tokens


def batches(
    tokens, batch_size: int, context: int, *, seed: int, epoch: int, rows: slice | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One epoch of ``(inputs, targets)`` batches, each ``(B, S)`` int32, ``S = context``.

    The non-overlapping windows of ``window_count`` are visited in an order seeded by
    ``(seed, epoch)``; the last partial batch is dropped. Arguments are checked at the call.
    ``rows``: only these rows of each batch are read (``Setup.process_rows``: a process of a
    multi-process run reads its own part).
    """
    tokens = np.asarray(tokens)  # (N,)
    n = window_count(tokens, batch_size, context)
    if n < batch_size:
        raise ValueError(
            f"tokens holds {n} windows of context={context}, fewer than batch_size={batch_size}, "
            f"so an epoch has no full batch; lower batch_size or context"
        )
    order = np.random.default_rng([seed, epoch]).permutation(n)  # (n,) window indices
    rows = slice(0, batch_size) if rows is None else rows
    return (
        windows_at(tokens, order[i : i + batch_size][rows] * context, context)
        for i in range(0, n - batch_size + 1, batch_size)
    )


def sample_batch(tokens, batch_size: int, context: int, rng: np.random.Generator):
    """``(inputs, targets)``, each ``(B, S)`` int32, from windows at uniformly random offsets.

    For a step-indexed stream pass ``rng=np.random.default_rng([seed, step])``.
    """
    tokens = np.asarray(tokens)  # (N,)
    window_count(tokens, batch_size, context)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"rng must be a numpy Generator, e.g. np.random.default_rng([seed, step]); "
            f"got {type(rng).__name__}"
        )
    starts = rng.integers(0, len(tokens) - context, size=batch_size)  # (B,) last: len - S - 1
    return windows_at(tokens, starts, context)
