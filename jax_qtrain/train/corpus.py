"""The training corpus: the Python standard library's own source files, as bytes.

Nothing is downloaded. The files are every `*.py` under `sysconfig.get_paths()["stdlib"]`
except `site-packages/` (third-party code differs from machine to machine). The split is fixed
and deterministic:

  - the file list is sorted by relative POSIX path;
  - a file is a **validation** file when the first 8 bytes of SHA-256(relative path), read as a
    big-endian integer, are ≡ 0..VALIDATION_PERCENT-1 (mod 100); every other file is training.
    A file's split depends on its own path only, so adding or removing files never moves others;
  - each split is its files' bytes concatenated in sorted order, each file followed by one
    DOCUMENT_SEPARATOR byte (0, which Python source never contains).

Tokens are bytes (vocabulary 256). A split is cut into fixed-size, non-overlapping windows of
`seq_len + 1` bytes (inputs and next-byte targets). Training batch `step` is
`batch_size` windows drawn with replacement by `numpy.random.default_rng([seed, step])`, so any
step's batch can be recomputed from the step number alone (what makes resuming exact).
Validation uses `num_windows` windows spread evenly over the validation split, always the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from pathlib import Path

import numpy as np

VALIDATION_PERCENT = 5
DOCUMENT_SEPARATOR = 0
VOCAB_SIZE = 256


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation_file(relative_path: str) -> bool:
    """The fixed split rule: SHA-256 of the relative POSIX path, mod 100, below 5."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < VALIDATION_PERCENT


def stdlib_source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the corpus files under `root`, sorted."""
    paths = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if "site-packages" in relative.parts or "__pycache__" in relative.parts:
            continue
        if path.is_file():
            paths.append(relative.as_posix())
    return sorted(paths)


@dataclasses.dataclass(frozen=True)
class CorpusSplit:
    """One split: its files and the concatenated bytes."""

    files: tuple[str, ...]
    data: np.ndarray  # uint8

    def num_windows(self, seq_len: int) -> int:
        return len(self.data) // (seq_len + 1)

    def window(self, index: int, seq_len: int) -> np.ndarray:
        start = index * (seq_len + 1)
        return self.data[start : start + seq_len + 1]


@dataclasses.dataclass(frozen=True)
class Corpus:
    root: str
    train: CorpusSplit
    validation: CorpusSplit

    def fingerprint(self) -> dict:
        """What identifies this corpus: a resumed run must see the same one."""
        listing = hashlib.sha256()
        for split in (self.train, self.validation):
            for name in split.files:
                listing.update(name.encode("utf-8") + b"\n")
            listing.update(hashlib.sha256(split.data.tobytes()).digest())
        return {
            "root": self.root,
            "train_files": len(self.train.files),
            "train_bytes": len(self.train.data),
            "validation_files": len(self.validation.files),
            "validation_bytes": len(self.validation.data),
            "sha256": listing.hexdigest(),
        }

    def train_batch(self, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
        """(batch_size, seq_len + 1) uint8 windows for training step `step` (0-based)."""
        rng = np.random.default_rng([seed, step])
        indices = rng.integers(0, self.train.num_windows(seq_len), size=batch_size)
        return np.stack([self.train.window(int(i), seq_len) for i in indices])

    def validation_windows(self, num_windows: int, seq_len: int) -> np.ndarray:
        """(num_windows, seq_len + 1) uint8: windows spread evenly over the validation split."""
        available = self.validation.num_windows(seq_len)
        if available < num_windows:
            raise ValueError(
                f"the validation split has {available} windows of {seq_len + 1} bytes; "
                f"{num_windows} were asked for"
            )
        indices = np.linspace(0, available - 1, num_windows).round().astype(np.int64)
        return np.stack([self.validation.window(int(i), seq_len) for i in indices])


def _concatenate(root: Path, files: list[str]) -> np.ndarray:
    separator = bytes([DOCUMENT_SEPARATOR])
    return np.frombuffer(
        b"".join((root / name).read_bytes() + separator for name in files), np.uint8
    )


def load_corpus(root: Path | None = None) -> Corpus:
    """The standard library corpus (or the same rules applied to any directory of `.py` files)."""
    root = stdlib_root() if root is None else Path(root)
    files = stdlib_source_files(root)
    if not files:
        raise FileNotFoundError(f"no .py files under {root}: nothing to train on")
    validation = [name for name in files if is_validation_file(name)]
    train = [name for name in files if not is_validation_file(name)]
    if not validation or not train:
        raise ValueError(f"{root} has too few .py files for a train/validation split")
    return Corpus(
        root=str(root),
        train=CorpusSplit(tuple(train), _concatenate(root, train)),
        validation=CorpusSplit(tuple(validation), _concatenate(root, validation)),
    )
