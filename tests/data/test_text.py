"""models.data.text: byte tokens, the corpus sources and their fallback, and the batches.

No test touches the network: the tfds paths use an empty data_dir or a stand-in for tfds.
"""

import numpy as np
import pytest
import tensorflow_datasets as tfds
from _data_checks import TEXT_WINDOW_BOUNDARIES, check_text_windows
from hypothesis import given
from hypothesis import strategies as st

from shardops_models.data import text

SMALL = 200_000  # bytes of stdlib text for the quick corpus tests


@pytest.fixture(scope="module")
def stdlib_corpus():
    return text.load_corpus("stdlib")


@pytest.mark.parametrize("s", ["", "hello", "naïve café — 東京 🚀", "line\nbreak\ttab\x00"])
def test_encode_decode_round_trip(s):
    tokens = text.encode(s)
    assert tokens.dtype == np.int32
    assert tokens.shape == (len(s.encode("utf-8")),)
    assert tokens.min(initial=0) >= 0 and tokens.max(initial=0) < text.VOCAB_SIZE
    assert text.decode(tokens) == s


def test_decode_replaces_invalid_utf8():
    cut = text.encode("é")[:1]  # the first of its two bytes
    assert text.decode(cut) == "\ufffd"


def test_encode_decode_errors():
    with pytest.raises(TypeError, match="encode wants str or bytes, got int"):
        text.encode(3)
    with pytest.raises(ValueError, match=r"byte tokens in \[0, 256\), got values in \[0, 256\]"):
        text.decode([0, 256])
    with pytest.raises(TypeError, match="integer tokens, got dtype float64"):
        text.decode([1.0])


def test_stdlib_corpus_is_real_deterministic_and_split(stdlib_corpus):
    corpus = stdlib_corpus
    assert corpus.name == "python_stdlib"
    assert corpus.train.dtype == corpus.valid.dtype == np.int32
    assert len(corpus.train) + len(corpus.valid) == text.STDLIB_BYTES
    assert len(corpus.valid) == round(0.1 * text.STDLIB_BYTES)
    source = text.decode(corpus.train)
    for word in ("def ", "import ", "class ", "return "):
        assert source.count(word) > 100, word
    assert corpus.message.startswith("text: Python 3.")
    assert "standard library source, offline" in corpus.message
    assert f"{text.STDLIB_BYTES:,} bytes" in corpus.message
    assert "\n" not in corpus.message
    again = text.load_corpus("stdlib")
    np.testing.assert_array_equal(again.train, corpus.train)
    np.testing.assert_array_equal(again.valid, corpus.valid)
    assert again.message == corpus.message


@pytest.mark.parametrize("valid_fraction", [0.05, 0.1, 0.5])
def test_stdlib_split_respects_valid_fraction_and_max_bytes(valid_fraction, stdlib_corpus):
    corpus = text.load_corpus("stdlib", max_bytes=SMALL, valid_fraction=valid_fraction)
    assert len(corpus.valid) == round(SMALL * valid_fraction)
    assert len(corpus.train) == SMALL - len(corpus.valid)
    whole = np.concatenate([corpus.train, corpus.valid])
    np.testing.assert_array_equal(whole, stdlib_corpus.train[:SMALL])  # a prefix of the same text


def test_stdlib_selection_is_sorted_and_skips_tests_and_packages(monkeypatch, tmp_path):
    files = {
        "b.py": "b\n",
        "a/z.py": "az\n",
        "a/notes.txt": "not python\n",
        "a/test/test_z.py": "skip\n",
        "idlelib/idle_test/t.py": "skip\n",
        "site-packages/pkg/m.py": "skip\n",
        "encodings/cp1252.py": "skip\n",
        "c.py": "c\n",
    }
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    monkeypatch.setattr(text.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert text.load_stdlib_text() == (b"az\n\nb\n\nc\n", 3)
    assert text.load_stdlib_text(max_bytes=5) == (b"az\n\nb", 2)  # stops once the budget is met


def test_load_corpus_argument_errors():
    with pytest.raises(
        ValueError, match=r"source='web' is not one of \('auto', 'tfds', 'stdlib'\)"
    ):
        text.load_corpus("web")
    with pytest.raises(ValueError, match=r"valid_fraction must be in \(0, 1\), got 1.5"):
        text.load_corpus("stdlib", valid_fraction=1.5)
    with pytest.raises(ValueError, match="max_bytes must be at least 2"):
        text.load_corpus("stdlib", max_bytes=1)


def test_tfds_not_prepared_fails_fast_without_network(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiny_shakespeare is not prepared in"):
        text.load_tfds_text(tmp_path)
    with pytest.raises(text.TextUnavailableError, match="FileNotFoundError") as caught:
        text.load_corpus("tfds", data_dir=tmp_path)
    assert "TFDS_DATA_DIR" in str(caught.value) and "source='stdlib'" in str(caught.value)


def test_tfds_download_checks_the_host_first(monkeypatch, tmp_path):
    monkeypatch.setattr(text, "host_reachable", lambda *a, **k: False)

    def no_download(*args, **kwargs):
        raise AssertionError("tfds.data_source must not be called when the host is silent")

    monkeypatch.setattr(tfds, "data_source", no_download)
    with pytest.raises(ConnectionError, match="raw.githubusercontent.com:443 does not answer"):
        text.load_tfds_text(tmp_path, download=True)


def fail_tfds(*args, **kwargs):
    raise ConnectionError("Max retries exceeded\nsecond line")


def test_tfds_source_unavailable_raises_clear_error(monkeypatch):
    monkeypatch.setattr(text, "load_tfds_text", fail_tfds)
    with pytest.raises(text.TextUnavailableError) as caught:
        text.load_corpus("tfds")
    message = str(caught.value)
    assert "source='tfds'" in message and "(ConnectionError: Max retries exceeded)" in message
    assert "data_dir=DIR" in message and "TFDS_DATA_DIR" in message
    assert isinstance(caught.value.__cause__, ConnectionError)


def test_auto_falls_back_to_stdlib(monkeypatch):
    monkeypatch.setattr(text, "load_tfds_text", fail_tfds)
    corpus = text.load_corpus("auto", max_bytes=SMALL)
    assert corpus.name == "python_stdlib"
    assert "standard library source, offline" in corpus.message
    assert "tfds tiny_shakespeare unavailable (ConnectionError: Max retries exceeded)" in (
        corpus.message
    )
    assert "\n" not in corpus.message


class FakeBuilder:
    data_dir = "/fake/tiny_shakespeare/1.0.0"

    def is_prepared(self):
        return True


@pytest.mark.parametrize("source", ["auto", "tfds"])
def test_prepared_tfds_is_used(monkeypatch, source):
    """tfds' array_record source yields one example per split whose "text" is bytes."""
    splits = {"train": "To be, or not to be: that is the question.\n", "validation": "Ay me!\n"}
    monkeypatch.setattr(tfds, "builder", lambda *a, **k: FakeBuilder())
    monkeypatch.setattr(
        tfds, "data_source", lambda *a, split, **k: [[{"text": splits[s].encode()}] for s in split]
    )
    corpus = text.load_corpus(source)
    assert corpus.name == "tiny_shakespeare"
    assert text.decode(corpus.train) == splits["train"]
    assert text.decode(corpus.valid) == splits["validation"]
    assert corpus.message == "text: tiny_shakespeare (tfds, 43 train + 7 valid bytes)"
    short = text.load_corpus(source, max_bytes=25)
    assert (len(short.train), len(short.valid)) == (21, 3)  # both cut by 25/50


def test_batches_are_shifted_non_overlapping_windows():
    tokens = np.arange(1, 104, dtype=np.int32) % 251  # 103 tokens: (103 - 1) // 10 = 10 windows
    seen = []
    for inputs, targets in text.batches(tokens, 3, 10, seed=0, epoch=0):
        assert inputs.shape == targets.shape == (3, 10)
        assert inputs.dtype == targets.dtype == np.int32
        for x, y in zip(inputs, targets, strict=True):
            start = int(np.flatnonzero(tokens == x[0])[0])
            assert start % 10 == 0  # a window boundary
            np.testing.assert_array_equal(x, tokens[start : start + 10])
            np.testing.assert_array_equal(y, tokens[start + 1 : start + 11])  # shifted by one
            seen.append(start)
    assert len(seen) == 9  # 3 full batches; the 10th window is in the dropped partial batch
    assert len(set(seen)) == 9 and set(seen) <= set(range(0, 100, 10))


@st.composite
def token_counts(draw):
    """``(tokens, batch_size, context)``: lengths at k·S − 1, k·S, k·S + 1 or k·S + 2 (4 draws
    in 5), else anywhere in [k·S, (k + 1)·S); the window counts fall at and near multiples of
    the batch as k varies."""
    context = draw(st.integers(1, 24))
    batch_size = draw(st.integers(1, 6))
    k = draw(st.integers(1, 12))
    n = k * context + draw(st.sampled_from([-1, 0, 1, 2, draw(st.integers(0, context - 1))]))
    return max(n, context + 1), batch_size, context


@given(case=token_counts(), seed=st.integers(0, 2**16))
def test_every_window_of_an_epoch_is_in_bounds_and_counted(case, seed):
    check_text_windows(*case, seed=seed)


@pytest.mark.parametrize("case", TEXT_WINDOW_BOUNDARIES, ids=str)
def test_windows_at_the_boundaries(case):
    check_text_windows(*case)


def test_batches_are_seeded(stdlib_corpus):
    tokens = stdlib_corpus.valid

    def epoch(seed, epoch):
        return [x for x, _ in text.batches(tokens, 8, 64, seed=seed, epoch=epoch)]

    first = epoch(0, 0)
    assert len(first) == (len(tokens) - 1) // 64 // 8
    np.testing.assert_array_equal(np.stack(first), np.stack(epoch(0, 0)))
    assert not np.array_equal(first[0], epoch(1, 0)[0])
    assert not np.array_equal(first[0], epoch(0, 1)[0])
    assert text.decode(first[0][0])  # real text, decodable


def test_sample_batch(stdlib_corpus):
    tokens = stdlib_corpus.valid
    inputs, targets = text.sample_batch(tokens, 16, 32, np.random.default_rng([0, 5]))
    assert inputs.shape == targets.shape == (16, 32) and inputs.dtype == np.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    again, _ = text.sample_batch(tokens, 16, 32, np.random.default_rng([0, 5]))
    other, _ = text.sample_batch(tokens, 16, 32, np.random.default_rng([0, 6]))
    np.testing.assert_array_equal(inputs, again)
    assert not np.array_equal(inputs, other)
    tiny = np.arange(5, dtype=np.int32)  # exactly context + 1 tokens: one possible window
    x, y = text.sample_batch(tiny, 4, 4, np.random.default_rng(0))
    np.testing.assert_array_equal(x, np.tile(tiny[:4], (4, 1)))
    np.testing.assert_array_equal(y, np.tile(tiny[1:], (4, 1)))


def test_batch_argument_errors():
    tokens = np.zeros(100, np.int32)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        text.batches(tokens, 0, 8, seed=0, epoch=0)
    with pytest.raises(ValueError, match="context must be a positive int, got -1"):
        text.sample_batch(tokens, 2, -1, rng)
    with pytest.raises(
        ValueError, match=r"holds 100 tokens, but one window needs context \+ 1 = 101"
    ):
        text.batches(tokens, 1, 100, seed=0, epoch=0)
    with pytest.raises(ValueError, match="holds 9 windows of context=11, fewer than batch_size=10"):
        text.batches(tokens, 10, 11, seed=0, epoch=0)
    with pytest.raises(TypeError, match=r"1-D integer array .* got shape \(10, 10\)"):
        text.batches(tokens.reshape(10, 10), 1, 4, seed=0, epoch=0)
    with pytest.raises(TypeError, match="dtype float32"):
        text.sample_batch(tokens.astype(np.float32), 1, 4, rng)
    with pytest.raises(TypeError, match=r"rng must be a numpy Generator.*got int"):
        text.sample_batch(tokens, 1, 4, 0)
