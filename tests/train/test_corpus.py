"""The corpus: the stdlib's sources, a fixed split by path hash, batches from (seed, step)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from jax_qtrain.train.corpus import (
    DOCUMENT_SEPARATOR,
    VALIDATION_PERCENT,
    is_validation_file,
    load_corpus,
    stdlib_root,
)


def _write_tree(root, count: int) -> dict[str, bytes]:
    files = {}
    for i in range(count):
        relative = f"pkg{i % 7}/module_{i}.py"
        content = f"# module {i}\nvalue = {i}\n".encode()
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(content)
        files[relative] = content
    (root / "site-packages" / "thirdparty").mkdir(parents=True)
    (root / "site-packages" / "thirdparty" / "x.py").write_text("excluded = True\n")
    (root / "notes.txt").write_text("not python\n")
    return files


def test_split_rule_is_the_documented_hash():
    for path in ("os.py", "asyncio/tasks.py", "json/__init__.py", "x/y/z.py"):
        digest = hashlib.sha256(path.encode()).digest()
        expected = int.from_bytes(digest[:8], "big") % 100 < VALIDATION_PERCENT
        assert is_validation_file(path) == expected


def test_corpus_from_a_directory_splits_concatenates_and_excludes(tmp_path):
    files = _write_tree(tmp_path, 200)
    corpus = load_corpus(tmp_path)
    assert sorted(corpus.train.files + corpus.validation.files) == sorted(files)
    assert not set(corpus.train.files) & set(corpus.validation.files)
    assert all(is_validation_file(f) for f in corpus.validation.files)
    assert list(corpus.train.files) == sorted(corpus.train.files)
    separator = bytes([DOCUMENT_SEPARATOR])
    expected = b"".join(files[f] + separator for f in corpus.train.files)
    assert corpus.train.data.tobytes() == expected
    # About 5% of the files are validation files.
    assert 2 <= len(corpus.validation.files) <= 20


def test_a_files_split_does_not_depend_on_the_other_files(tmp_path):
    _write_tree(tmp_path, 200)
    before = set(load_corpus(tmp_path).validation.files)
    for name in sorted(before)[:3]:
        (tmp_path / name).unlink()
    (tmp_path / "new_module.py").write_text("new = 1\n")
    after = set(load_corpus(tmp_path).validation.files)
    assert before - after == set(sorted(before)[:3])
    assert after - before <= {"new_module.py"}


def test_empty_directory_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \.py files"):
        load_corpus(tmp_path)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_stdlib_corpus_is_deterministic_and_substantial(corpus):
    assert corpus.root == str(stdlib_root())
    assert "os.py" in corpus.train.files + corpus.validation.files
    assert not any("site-packages" in f for f in corpus.train.files)
    assert len(corpus.train.data) > 5_000_000
    assert len(corpus.validation.data) > 100_000
    assert corpus.fingerprint() == load_corpus().fingerprint()


def test_batches_depend_on_seed_and_step_only(corpus):
    batch = corpus.train_batch(seed=0, step=7, batch_size=4, seq_len=32)
    assert batch.shape == (4, 33) and batch.dtype == np.uint8
    np.testing.assert_array_equal(batch, corpus.train_batch(0, 7, 4, 32))
    assert not np.array_equal(batch, corpus.train_batch(0, 8, 4, 32))
    assert not np.array_equal(batch, corpus.train_batch(1, 7, 4, 32))
    # The rows are the documented windows: indices from default_rng([seed, step]).
    indices = np.random.default_rng([0, 7]).integers(0, corpus.train.num_windows(32), size=4)
    for row, index in zip(batch, indices, strict=True):
        np.testing.assert_array_equal(row, corpus.train.data[index * 33 : index * 33 + 33])


def test_validation_windows_are_fixed_and_spread_over_the_split(corpus):
    windows = corpus.validation_windows(16, 64)
    assert windows.shape == (16, 65)
    np.testing.assert_array_equal(windows, corpus.validation_windows(16, 64))
    np.testing.assert_array_equal(windows[0], corpus.validation.data[:65])
    last = corpus.validation.num_windows(64) - 1
    np.testing.assert_array_equal(windows[-1], corpus.validation.window(last, 64))
    with pytest.raises(ValueError, match="validation split has"):
        corpus.validation_windows(10**9, 64)
