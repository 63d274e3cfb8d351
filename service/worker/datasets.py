"""Datasets a validation trains on (contract section 4): numpy only, nothing downloaded at run time.

``load_dataset(name, seed, input_shape=None)`` returns a :class:`Dataset`:

``digits``
    scikit-learn's bundled 8x8 handwritten digits (1797 examples, 64 features, 10 classes; no
    download), split 75/25 with ``seed`` and standardized per feature with the training split's
    mean and standard deviation (constant pixels become 0). Its input shape is ``[64]``;
    ``reshape_to([1, 8, 8])`` (or ``input_shape=[1, 8, 8]``) gives images for a convolutional graph.
``synthetic``
    teacher-student classification: Gaussian inputs of ``input_shape`` (default ``[64]``) labelled
    with the argmax of a random two-layer tanh teacher network over 10 classes; 4096 training and
    1024 test examples, all drawn from ``seed``.
``<path>.npz``
    a file on the worker with arrays ``x_train``, ``y_train``, ``x_test``, ``y_test`` (labels are
    integers 0 .. n_classes - 1). Loaded without pickles; used as stored (no standardization).

Every problem with a dataset is a ``SigpropError("invalid_request")`` whose message says what is
wrong and whose hint says what to do.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..errors import SigpropError

__all__ = ["Dataset", "load_dataset", "DATASET_NAMES", "SYNTHETIC_TRAIN", "SYNTHETIC_TEST", "SYNTHETIC_CLASSES"]

DATASET_NAMES = ("digits", "synthetic")
SYNTHETIC_TRAIN = 4096
SYNTHETIC_TEST = 1024
SYNTHETIC_CLASSES = 10
_SYNTHETIC_HIDDEN = 256
_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
_NPZ_HINT = (
    "an .npz dataset holds four arrays: x_train [N, ...features], y_train [N] integer labels, "
    "x_test [M, ...features] (same feature shape), y_test [M]; write it with "
    "numpy.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)"
)


def _bad(message: str, hint: str = "") -> SigpropError:
    return SigpropError("invalid_request", message, hint)


@dataclass(frozen=True)
class Dataset:
    """Training and test arrays: inputs float32 ``[N, *input_shape]``, labels int64 ``[N]``."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    n_classes: int
    input_shape: tuple[int, ...]

    def reshape_to(self, shape: Sequence[int]) -> Dataset:
        """The same examples with each input reshaped to ``shape`` (e.g. ``[64]`` -> ``[1, 8, 8]``)."""
        shape = tuple(int(s) for s in shape)
        if shape == self.input_shape:
            return self
        if not shape or any(s < 1 for s in shape) or math.prod(shape) != math.prod(self.input_shape):
            raise _bad(
                f"dataset '{self.name}' has inputs of shape {list(self.input_shape)} "
                f"({math.prod(self.input_shape)} values) that cannot be reshaped to the graph's input "
                f"shape {list(shape)} ({math.prod(shape) if shape else 0} values)",
                f"give the graph's input node a shape with {math.prod(self.input_shape)} values, "
                f"e.g. {list(self.input_shape)}" + (" or [1, 8, 8]" if self.name == "digits" else ""),
            )
        return replace(
            self,
            x_train=self.x_train.reshape((-1,) + shape),
            x_test=self.x_test.reshape((-1,) + shape),
            input_shape=shape,
        )

    def describe(self) -> dict:
        """JSON-ready facts about the dataset, for validation results."""
        return {
            "name": self.name,
            "n_train": int(len(self.y_train)),
            "n_test": int(len(self.y_test)),
            "n_classes": int(self.n_classes),
            "input_shape": list(self.input_shape),
        }


def load_dataset(name: str, seed: int, input_shape: Sequence[int] | None = None) -> Dataset:
    """The dataset ``name`` ('digits', 'synthetic' or an ``.npz`` path), split/drawn with ``seed``.

    With ``input_shape`` (the graph's input shape) the inputs are reshaped to it (digits, npz) or
    drawn with it (synthetic); a size that does not fit is an ``invalid_request``.
    """
    if not isinstance(name, str) or not name:
        raise _bad("the dataset name is empty", "use 'digits', 'synthetic' or the path of an .npz file on the worker")
    seed = int(seed)
    if name == "digits":
        ds = _digits(seed)
    elif name == "synthetic":
        ds = _synthetic(seed, tuple(input_shape) if input_shape is not None else (64,))
    elif name.lower().endswith(".npz"):
        ds = _npz(name)
    else:
        raise _bad(
            f"unknown dataset {name!r}",
            "use 'digits' (scikit-learn's bundled digits), 'synthetic' (teacher-student) or the path "
            "of an .npz file on the worker",
        )
    return ds.reshape_to(input_shape) if input_shape is not None else ds


def _split(n: int, seed: int, test_fraction: float = 0.25) -> tuple[np.ndarray, np.ndarray]:
    perm = np.random.default_rng(seed).permutation(n)
    n_test = int(round(n * test_fraction))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def _digits(seed: int) -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # pragma: no cover - the worker extra installs scikit-learn
        raise _bad(
            "the 'digits' dataset needs scikit-learn, which is not installed on the worker",
            "install the worker extra (pip install 'sigprop[worker]') or use 'synthetic' or an .npz file",
        ) from None
    data = load_digits()
    x = np.asarray(data.data, dtype=np.float64)
    y = np.asarray(data.target, dtype=np.int64)
    train, test = _split(len(y), seed)
    mean = x[train].mean(axis=0)
    std = x[train].std(axis=0)
    std[std == 0] = 1.0  # constant pixels (always 0 in the corners) become 0
    xs = ((x - mean) / std).astype(np.float32)
    return Dataset("digits", xs[train], y[train], xs[test], y[test], 10, (64,))


def _synthetic(seed: int, shape: tuple[int, ...]) -> Dataset:
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 1 for s in shape):
        raise _bad(f"synthetic inputs need a positive shape, got {list(shape)}", "give the graph's input node a shape")
    d = math.prod(shape)
    if d > 1_000_000:
        raise _bad(
            f"synthetic inputs of shape {list(shape)} have {d} values", "use an input shape with at most 1e6 values"
        )
    rng = np.random.default_rng(seed)
    # teacher: logits = W2 tanh(W1 x / sqrt(d)) with unit-variance Gaussian weights
    w1 = rng.standard_normal((d, _SYNTHETIC_HIDDEN)) / math.sqrt(d)
    w2 = rng.standard_normal((_SYNTHETIC_HIDDEN, SYNTHETIC_CLASSES)) / math.sqrt(_SYNTHETIC_HIDDEN)
    b1 = 0.5 * rng.standard_normal(_SYNTHETIC_HIDDEN)
    n = SYNTHETIC_TRAIN + SYNTHETIC_TEST
    x = rng.standard_normal((n, d))
    logits = np.tanh(x @ w1 + b1) @ w2
    # centre the logits so every class is used (a random teacher can favour a few classes)
    logits -= logits.mean(axis=0, keepdims=True)
    y = np.argmax(logits, axis=1).astype(np.int64)
    x = x.astype(np.float32).reshape((n,) + shape)
    return Dataset(
        "synthetic",
        x[:SYNTHETIC_TRAIN],
        y[:SYNTHETIC_TRAIN],
        x[SYNTHETIC_TRAIN:],
        y[SYNTHETIC_TRAIN:],
        SYNTHETIC_CLASSES,
        shape,
    )


def _labels(name: str, y: np.ndarray, path: str) -> np.ndarray:
    if y.ndim != 1:
        raise _bad(f"{name} in {path} has shape {list(y.shape)}, not [N]", _NPZ_HINT)
    if y.size and not np.issubdtype(y.dtype, np.integer):
        if not np.issubdtype(y.dtype, np.floating) or not np.all(np.isfinite(y)) or np.any(y != np.round(y)):
            raise _bad(f"{name} in {path} holds non-integer labels (dtype {y.dtype})", _NPZ_HINT)
    y = y.astype(np.int64)
    if y.size and y.min() < 0:
        raise _bad(f"{name} in {path} holds negative labels (min {int(y.min())})", "labels are 0 .. n_classes - 1")
    return y


def _npz(path: str) -> Dataset:
    if not os.path.isfile(path):
        raise _bad(
            f"dataset file {path!r} does not exist on the worker",
            "give the path of an .npz file the worker can read, or use 'digits' or 'synthetic'",
        )
    try:
        with np.load(path, allow_pickle=False) as f:
            keys = set(f.files)
            missing = [k for k in _NPZ_KEYS if k not in keys]
            if missing:
                raise _bad(f"dataset file {path!r} lacks array(s) {', '.join(missing)}", _NPZ_HINT)
            arrays = {k: np.asarray(f[k]) for k in _NPZ_KEYS}
    except SigpropError:
        raise
    except Exception as exc:  # noqa: BLE001 - not a zip, a pickled object array, a truncated file, ...
        raise _bad(
            f"dataset file {path!r} is not a readable .npz file ({type(exc).__name__}: {exc})", _NPZ_HINT
        ) from None
    x_tr, x_te = arrays["x_train"], arrays["x_test"]
    for key, x in (("x_train", x_tr), ("x_test", x_te)):
        if x.ndim < 2:
            raise _bad(f"{key} in {path} has shape {list(x.shape)}: it needs a batch axis and features", _NPZ_HINT)
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_):
            raise _bad(f"{key} in {path} has dtype {x.dtype}, not numbers", _NPZ_HINT)
    y_tr = _labels("y_train", arrays["y_train"], path)
    y_te = _labels("y_test", arrays["y_test"], path)
    if len(x_tr) != len(y_tr):
        raise _bad(f"x_train in {path} has {len(x_tr)} examples but y_train has {len(y_tr)} labels", _NPZ_HINT)
    if len(x_te) != len(y_te):
        raise _bad(f"x_test in {path} has {len(x_te)} examples but y_test has {len(y_te)} labels", _NPZ_HINT)
    if len(y_tr) == 0 or len(y_te) == 0:
        raise _bad(f"dataset file {path!r} has an empty {'training' if len(y_tr) == 0 else 'test'} split", _NPZ_HINT)
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise _bad(
            f"x_train in {path} has examples of shape {list(x_tr.shape[1:])} but x_test {list(x_te.shape[1:])}",
            "training and test inputs need the same shape",
        )
    x_tr = x_tr.astype(np.float32)
    x_te = x_te.astype(np.float32)
    if not (np.all(np.isfinite(x_tr)) and np.all(np.isfinite(x_te))):
        raise _bad(f"dataset file {path!r} holds NaN or infinite inputs", "clean the data before validating")
    n_classes = int(max(y_tr.max(), y_te.max())) + 1
    if n_classes < 2:
        raise _bad(f"dataset file {path!r} has a single class", "a classification dataset needs at least two classes")
    return Dataset(os.path.basename(path), x_tr, y_tr, x_te, y_te, n_classes, tuple(int(s) for s in x_tr.shape[1:]))
