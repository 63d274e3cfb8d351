"""Which datasets a validation may use, checked before anything is allocated: by the API when a
validation is submitted (a 4xx answer) and again by the worker before it trains.

* ``digits`` and ``synthetic`` are built in; ``synthetic`` draws inputs of the graph's input shape,
  so that shape is bounded (``SIGPROP_MAX_INPUT_VALUES`` values per example).
* ``<name>.npz`` is a file inside ``SIGPROP_DATASETS_DIR``, named relative to it. Unset, .npz
  datasets are off. Absolute names, ``..`` and anything that resolves outside the folder (a
  symlink included) are refused with one message that says nothing about what lies outside. The
  file is at most ``SIGPROP_MAX_DATASET_BYTES`` on disk, and so are its four arrays together as
  their headers declare them (read from the archive without loading any array), so a compressed
  archive cannot unpack into more; their feature shape is bounded like ``synthetic``'s.

Errors never name arrays other than the four required ones.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from ..errors import SigpropError
from ..schemas.graph import Graph
from ..schemas.ops import OP_TABLE, SOURCE, kind_of
from ..schemas.shapes import infer_shapes
from ..schemas.validation import CHARLM_DATASET
from .datasets import SYNTHETIC_CLASSES

BUILTIN = ("digits", "synthetic")
# What each built-in dataset feeds (datasets.py): (input shape, or None for "the graph's own", classes).
# digits: scikit-learn's 8x8 images as 64 features, reshaped to any input shape of 64 values.
BUILTIN_FACTS: dict[str, tuple[tuple[int, ...] | None, int]] = {
    "digits": ((64,), 10),
    "synthetic": (None, SYNTHETIC_CLASSES),
}
SYNTHETIC_DEFAULT_SHAPE = (64,)
NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
_NPZ_HINT = (
    "an .npz dataset holds the arrays x_train [N, ...features], y_train [N], x_test [M, ...features] and "
    "y_test [M], written with numpy.savez"
)


def _bad(message: str, hint: str) -> SigpropError:
    return SigpropError("invalid_request", f"dataset: {message}", hint)


def _too_large(message: str, hint: str) -> SigpropError:
    return SigpropError("dataset_too_large", f"dataset: {message}", hint)


def _is_sink(op: object) -> bool:
    row = OP_TABLE.get(op) if isinstance(op, str) else None
    return row is not None and row.sink


def graph_input_shape(graph: dict) -> tuple[int, ...] | None:
    """The shape of the first ``input`` node of a wire graph (what the trainer feeds), or None."""
    for node in graph.get("nodes") or ():
        if isinstance(node, dict) and kind_of(node.get("op")) == SOURCE and node.get("shape") is not None:
            return tuple(int(s) for s in node["shape"])
    return None


@dataclass(frozen=True)
class DatasetPolicy:
    """The datasets folder and the bounds (see the module docstring)."""

    root: Path | None
    max_bytes: int
    max_input_values: int

    @classmethod
    def from_settings(cls, settings) -> DatasetPolicy:
        return cls(settings.datasets_dir, settings.max_dataset_bytes, settings.max_input_values)

    def check(self, name: str, input_shape: Sequence[int] | None) -> str:
        """Refuse (``SigpropError``) a dataset this server must not load; return the name to load:
        the built-in name, or the .npz file's resolved path inside the datasets folder."""
        if name in ("digits", CHARLM_DATASET):  # built in; 'stdlib' reads a fixed list (charlm_corpus)
            return name
        if name == "synthetic":
            self.check_features(tuple(input_shape) if input_shape else SYNTHETIC_DEFAULT_SHAPE, "synthetic inputs")
            return name
        if not name.lower().endswith(".npz"):
            raise _bad(
                f"{name!r} is not a dataset",
                "use 'digits', 'synthetic', 'stdlib' (text, for task 'charlm'), or the name of an .npz file in the "
                "server's datasets folder (SIGPROP_DATASETS_DIR), relative to it",
            )
        path = self.resolve(name)
        self.check_npz(path, name)
        return str(path)

    def check_fit(self, name: str, graph: dict) -> None:
        """Refuse (422 ``invalid_request``) a dataset the graph cannot train on: inputs of another
        size than the graph's input, or another number of classes than its output's units. Checked
        at submission, so a mismatch is answered at once instead of failing on the worker later."""
        if name == CHARLM_DATASET:  # text for a transformer: charlm_plan checks the graph
            return
        if name in BUILTIN_FACTS:
            features, classes = BUILTIN_FACTS[name]
        else:
            try:
                features, classes = _npz_facts(self.resolve(name))
            except SigpropError:
                raise
            except Exception:  # noqa: BLE001 - unreadable labels: the worker's loader says why
                return
        if features is not None:
            _check_input(name, features, graph_input_shape(graph))
        _check_classes(name, classes, graph_output_shape(graph))

    def check_features(self, shape: tuple[int, ...], what: str) -> None:
        values = math.prod(shape) if shape else 0
        if values > self.max_input_values:
            raise _too_large(
                f"{what} of shape {list(shape)} have {values} values per example, over this server's "
                f"bound of {self.max_input_values}",
                "use a smaller input shape, or raise SIGPROP_MAX_INPUT_VALUES on your own deployment",
            )

    def resolve(self, name: str) -> Path:
        """The file ``name`` names inside the datasets folder (refused when it leads anywhere else)."""
        if self.root is None:
            raise _bad(
                ".npz datasets are off on this server: SIGPROP_DATASETS_DIR is not set",
                "use 'digits' or 'synthetic', or ask the operator to set SIGPROP_DATASETS_DIR to a folder of "
                ".npz files that the API and the workers share",
            )
        outside = _bad(
            f"{name!r} is not a file name inside the datasets folder",
            "name the .npz file relative to SIGPROP_DATASETS_DIR, e.g. 'mnist.npz' or 'sub/mnist.npz'; "
            "absolute paths, '..' and links leading out of the folder are refused",
        )
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts or "\\" in name:
            raise outside
        root = Path(self.root).resolve()
        path = (root / pure).resolve()  # follows every symlink, existing or not
        if not path.is_relative_to(root) or path == root:
            raise outside
        if not path.is_file():
            raise _bad(
                f"there is no file {name!r} in the datasets folder",
                "list the files the operator put in SIGPROP_DATASETS_DIR, or use 'digits' or 'synthetic'",
            )
        return path

    def check_npz(self, path: Path, name: str) -> None:
        """The file's size, and its arrays' shapes and sizes read from their headers (no array is loaded)."""
        size = path.stat().st_size
        if size > self.max_bytes:
            raise _too_large(
                f"{name!r} has {size} bytes, over this server's bound of {self.max_bytes}",
                "use a smaller file, or raise SIGPROP_MAX_DATASET_BYTES on your own deployment",
            )
        try:
            headers = _npz_headers(path)
        except SigpropError:
            raise
        except Exception as exc:  # noqa: BLE001 - not a zip, truncated, a bad header, ...
            raise _bad(f"{name!r} is not a readable .npz file ({type(exc).__name__})", _NPZ_HINT) from None
        missing = [k for k in NPZ_ARRAYS if k not in headers]
        if missing:
            raise _bad(f"{name!r} lacks the array(s) {', '.join(missing)}", _NPZ_HINT)
        total = 0
        for key in NPZ_ARRAYS:
            shape, dtype, stored = headers[key]
            if dtype.hasobject:
                raise _bad(f"{name!r} holds Python objects in {key}, which are never loaded", _NPZ_HINT)
            total += max(stored, math.prod(shape) * dtype.itemsize)
            if key.startswith("x") and len(shape) >= 2:
                self.check_features(tuple(shape[1:]), f"the inputs in {name!r}")
        if total > self.max_bytes:
            raise _too_large(
                f"the arrays of {name!r} take {total} bytes unpacked, over this server's bound of {self.max_bytes}",
                "use a smaller dataset, or raise SIGPROP_MAX_DATASET_BYTES on your own deployment",
            )


def graph_output_shape(graph: dict) -> tuple[int, ...] | None:
    """The shape of a wire graph's ``output`` node, by the contract's shape rules (None when the
    graph does not infer: the solve that produced it already said why)."""
    try:
        shapes = infer_shapes(Graph.model_validate(graph))
    except (SigpropError, ValueError):
        return None
    out = next((n.get("id") for n in graph.get("nodes") or () if isinstance(n, dict) and _is_sink(n.get("op"))), None)
    return tuple(shapes[out]) if out in shapes else None


def _fit_hint(name: str, features: tuple[int, ...]) -> str:
    values = math.prod(features)
    images = " or [1, 8, 8] (cnn, resnet, densenet)" if name == "digits" else ""
    return (
        f'give the graph\'s input {values} values: for a template set "input_shape": {list(features)}{images}; '
        "or pick a dataset that fits the network ('synthetic' fits any input shape)"
    )


def _check_input(name: str, features: tuple[int, ...], graph_shape: tuple[int, ...] | None) -> None:
    if graph_shape is None or math.prod(graph_shape) == math.prod(features):
        return
    raise _bad(
        f"{name!r} has inputs of {math.prod(features)} values per example (shape {list(features)}) but the "
        f"graph's input has shape {list(graph_shape)} ({math.prod(graph_shape)} values)",
        _fit_hint(name, features),
    )


def _check_classes(name: str, classes: int, out_shape: tuple[int, ...] | None) -> None:
    if out_shape is None or tuple(out_shape) == (classes,):
        return
    raise _bad(
        f"{name!r} has {classes} classes but the graph's output has shape {list(out_shape)}",
        f'end the graph with a dense layer of {classes} units: for a template set "classes": {classes}',
    )


def _npz_facts(path: Path) -> tuple[tuple[int, ...], int]:
    """(feature shape, classes) of an .npz the policy already admitted (sizes bounded): the labels
    are read, without pickles, to count the classes as the trainer will (largest label + 1)."""
    features = _npz_headers(path)["x_train"][0][1:]
    with np.load(path, allow_pickle=False) as f:
        top = max((int(np.max(f[k])) for k in ("y_train", "y_test") if f[k].size), default=0)
    return tuple(features), top + 1


def _npz_headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype, int]]:
    """{array name: (shape, dtype, unpacked member size)} of the four required arrays, from the
    .npy headers inside the archive."""
    out = {}
    with zipfile.ZipFile(path) as zf:
        members = {info.filename: info for info in zf.infolist()}
        for key in NPZ_ARRAYS:
            info = members.get(f"{key}.npy")
            if info is None:
                continue
            with zf.open(info) as fh:
                version = np.lib.format.read_magic(fh)
                if version == (1, 0):
                    shape, _fortran, dtype = np.lib.format.read_array_header_1_0(fh)
                else:
                    shape, _fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            out[key] = (tuple(int(s) for s in shape), dtype, int(info.file_size))
    return out
