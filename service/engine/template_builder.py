"""The node builder and parameter helpers the template expanders of :mod:`sigprop.engine.templates` share.

:class:`_Builder` appends nodes in topological order and tracks each node's shape as the graph
engine infers it; :func:`_param` writes one documented template parameter; :class:`TemplateSize`
is a template's exact size from its parameters alone.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from sigprop.errors import SigpropError
from sigprop.schemas import Template

_DEPTH_LIMIT = 100_000  # Template.depth's schema bound


def _param(
    name: str,
    type_: str,
    description: str,
    *,
    required: bool = False,
    default: Any = None,
    allowed: list | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
) -> dict:
    p: dict[str, Any] = {"name": name, "type": type_, "required": required, "default": default}
    if allowed is not None:
        p["allowed"] = allowed
    if minimum is not None:
        p["minimum"] = minimum
    if maximum is not None:
        p["maximum"] = maximum
    p["description"] = description
    return p


_BIAS = _param("bias", "boolean", "whether dense and conv layers have a bias", default=True)


class TemplateSize(NamedTuple):
    """Exact size of a template's graph, from its parameters alone."""

    nodes: int
    depth: int  # nonlinear layers on the longest path
    fan_in: int  # inputs of the widest sum or concat (1 when there is none)
    edges: int  # sum of the nodes' input counts


def _bad(message: str, hint: str) -> SigpropError:
    return SigpropError("invalid_request", message, hint)


class _Builder:
    """Appends nodes in topological order and tracks each node's shape (as the graph engine infers it)."""

    def __init__(self, template: str):
        self.template = template
        self.nodes: list[dict] = []
        self.shapes: dict[str, tuple[int, ...]] = {}

    def _add(self, node: dict, shape: tuple[int, ...]) -> str:
        nid = node["id"]
        assert nid not in self.shapes, nid  # ids are generated; a clash is a bug here
        self.nodes.append(node)
        self.shapes[nid] = shape
        return nid

    def _too_small(self, nid: str) -> SigpropError:
        first = self.nodes[0]["shape"]
        return _bad(
            f"input_shape {first} is too small for template '{self.template}': "
            f"node '{nid}' would shrink the feature map to nothing",
            "give a larger input height and width (or leave input_shape out for the default)",
        )

    def input(self, shape: list[int]) -> str:
        return self._add({"id": "input", "op": "input", "shape": list(shape)}, tuple(shape))

    def dense(self, nid: str, src: str, units: int, bias: bool) -> str:
        return self._add({"id": nid, "op": "dense", "inputs": [src], "units": units, "bias": bias}, (units,))

    def conv(self, nid: str, src: str, channels: int, kernel: int, stride: int, bias: bool) -> str:
        _, h, w = self.shapes[src]
        h, w = math.ceil(h / stride), math.ceil(w / stride)  # padding "same"
        return self._add(
            {
                "id": nid,
                "op": "conv",
                "inputs": [src],
                "channels": channels,
                "kernel": kernel,
                "stride": stride,
                "padding": "same",
                "bias": bias,
            },
            (channels, h, w),
        )

    def pool(self, nid: str, op: str, src: str, kernel: int, stride: int) -> str:
        c, h, w = self.shapes[src]
        h, w = (h - kernel) // stride + 1, (w - kernel) // stride + 1  # no padding
        if h < 1 or w < 1:
            raise self._too_small(nid)
        return self._add({"id": nid, "op": op, "inputs": [src], "kernel": kernel, "stride": stride}, (c, h, w))

    def act(self, nid: str, src: str) -> str:
        return self._add({"id": nid, "op": "activation", "inputs": [src]}, self.shapes[src])

    def sum(self, nid: str, srcs: list[str], weights: list[float]) -> str:
        return self._add({"id": nid, "op": "sum", "inputs": list(srcs), "weights": list(weights)}, self.shapes[srcs[0]])

    def concat(self, nid: str, srcs: list[str]) -> str:
        first = self.shapes[srcs[0]]
        channels = sum(self.shapes[s][0] for s in srcs)
        return self._add({"id": nid, "op": "concat", "inputs": list(srcs)}, (channels,) + first[1:])

    def simple(self, nid: str, op: str, src: str) -> str:
        shape = self.shapes[src]
        if op == "flatten":
            shape = (math.prod(shape),)
        elif op == "global_avg_pool":
            shape = (shape[0],)
        return self._add({"id": nid, "op": op, "inputs": [src]}, shape)

    def head(self, src: str, classes: int, bias: bool, pool: bool) -> None:
        if pool:
            src = self.simple("global_avg_pool", "global_avg_pool", src)
        src = self.dense("logits", src, classes, bias)
        self.simple("output", "output", src)


def _require_depth(t: Template, what: str, example: str) -> int:
    if t.depth is None:
        raise _bad(f"template '{t.template}' needs 'depth'", f"give 'depth', the number of {what}, e.g. {example}")
    return t.depth


def _image_shape(t: Template, default: list[int]) -> list[int]:
    shape = list(t.input_shape) if t.input_shape is not None else list(default)
    if len(shape) != 3:
        raise _bad(
            f"template '{t.template}' needs an image input, got input_shape {shape}",
            f"give input_shape as [channels, height, width], e.g. {default}, or leave it out",
        )
    return shape
