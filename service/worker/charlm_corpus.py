"""The text of the character-level language-modelling validation (``"task": "charlm"``): Python's own
standard-library sources, so nothing is downloaded and every worker with the same Python has the
same corpus.

The corpus is a fixed list of long-lived top-level modules (:data:`CORPUS_FILES`, in this order)
read as bytes from ``sysconfig.get_paths()["stdlib"]``; the vocabulary is the 256 byte values. Each
file is split by position: its first 90% goes to the training text and its last 10% to the
validation text (a contiguous tail, so no validation window overlaps a training window), and the
files are joined with a newline. A file missing from an installation (a trimmed distribution) is
skipped and named in :meth:`Corpus.describe`, with the SHA-256 digest of what was read, so two
results are comparable exactly when their digests agree.

Confinement: the request never names a file. Every path is the stdlib folder joined with a name
from the fixed list, resolved (links followed) and read only when it is a regular file that stays
inside the resolved stdlib folder; the corpus is bounded by :data:`MAX_CORPUS_BYTES`.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import SigpropError

__all__ = ["CORPUS_NAME", "CORPUS_FILES", "VOCAB_SIZE", "Corpus", "load_corpus", "stdlib_dir"]

CORPUS_NAME = "stdlib"
VOCAB_SIZE = 256  # byte values
VALIDATION_FRACTION = 0.1
MAX_CORPUS_BYTES = 2_000_000
# Top-level modules present as single files in CPython 3.10 to 3.14 (pathlib and zipfile became
# packages in 3.12/3.13 and are left out); about 1.7 MB together on CPython 3.11.
CORPUS_FILES = (
    "argparse.py",
    "ast.py",
    "calendar.py",
    "configparser.py",
    "contextlib.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "locale.py",
    "optparse.py",
    "os.py",
    "pickle.py",
    "platform.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "textwrap.py",
    "threading.py",
    "traceback.py",
    "typing.py",
)


def stdlib_dir() -> Path:
    """The resolved standard-library folder of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


@dataclass(frozen=True)
class Corpus:
    """Training and validation byte streams (uint8 arrays) and where they came from."""

    train: np.ndarray
    validation: np.ndarray
    files: tuple[str, ...]  # the files read, in order
    missing: tuple[str, ...]  # files of CORPUS_FILES this installation lacks
    digest: str  # SHA-256 over the files' names and bytes, in order

    def describe(self) -> dict:
        """JSON-ready facts about the corpus, for validation results."""
        return {
            "name": CORPUS_NAME,
            "source": "Python standard-library sources (sysconfig stdlib folder)",
            "python": sys.version.split()[0],
            "files": list(self.files),
            "missing": list(self.missing),
            "digest": self.digest,
            "vocabulary": "bytes",
            "vocab_size": VOCAB_SIZE,
            "n_train": int(self.train.size),
            "n_validation": int(self.validation.size),
            "validation_fraction": VALIDATION_FRACTION,
        }


def _confined(root: Path, name: str) -> Path | None:
    """``root / name`` when it is a regular file inside ``root`` (links followed), else None."""
    path = (root / name).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return None
    return path


def read_corpus_files(root: Path, names: tuple[str, ...] = CORPUS_FILES) -> tuple[list[tuple[str, bytes]], list[str]]:
    """(name, bytes) of each listed file found inside ``root``, and the names not found there;
    raises ``SigpropError`` when the files together exceed :data:`MAX_CORPUS_BYTES`."""
    found, missing, total = [], [], 0
    root = root.resolve()
    for name in names:
        path = _confined(root, name)
        if path is None:
            missing.append(name)
            continue
        data = path.read_bytes()
        total += len(data)
        if total > MAX_CORPUS_BYTES:
            raise SigpropError(
                "dataset_too_large",
                f"dataset: the stdlib corpus passes {MAX_CORPUS_BYTES} bytes at {name!r}",
                "this Python's standard library is unusually large; report it",
            )
        found.append((name, data))
    return found, missing


def split_corpus(files: list[tuple[str, bytes]]) -> tuple[np.ndarray, np.ndarray, str]:
    """(train bytes, validation bytes, digest): each file's first 90% to training, its last 10% to
    validation, files joined with a newline (module docstring)."""
    digest = hashlib.sha256()
    train_parts, val_parts = [], []
    for name, data in files:
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        cut = int(round(len(data) * (1.0 - VALIDATION_FRACTION)))
        train_parts += [data[:cut], b"\n"]
        val_parts += [data[cut:], b"\n"]
    train = np.frombuffer(b"".join(train_parts), dtype=np.uint8).copy()
    validation = np.frombuffer(b"".join(val_parts), dtype=np.uint8).copy()
    return train, validation, digest.hexdigest()


@lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    """The corpus of the running Python (cached: it is read once per process)."""
    files, missing = read_corpus_files(stdlib_dir())
    if not files:
        raise SigpropError(
            "invalid_request",
            "dataset: this worker's Python has none of the standard-library files the 'stdlib' corpus reads",
            "run the worker with a full CPython installation (its standard-library .py sources)",
        )
    train, validation, digest = split_corpus(files)
    return Corpus(train, validation, tuple(n for n, _ in files), tuple(missing), digest)
