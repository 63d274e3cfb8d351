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

BUILTIN = ("digits", "synthetic")
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


def graph_input_shape(graph: dict) -> tuple[int, ...] | None:
    """The shape of the first ``input`` node of a wire graph (what the trainer feeds), or None."""
    for node in graph.get("nodes") or ():
        if isinstance(node, dict) and node.get("op") == "input" and node.get("shape") is not None:
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
        if name == "digits":
            return name
        if name == "synthetic":
            self.check_features(tuple(input_shape) if input_shape else SYNTHETIC_DEFAULT_SHAPE, "synthetic inputs")
            return name
        if not name.lower().endswith(".npz"):
            raise _bad(
                f"{name!r} is not a dataset",
                "use 'digits', 'synthetic', or the name of an .npz file in the "
                "server's datasets folder (SIGPROP_DATASETS_DIR), relative to it",
            )
        path = self.resolve(name)
        self.check_npz(path, name)
        return str(path)

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
