"""The node builder and parameter helpers the template expanders of :mod:`sigprop.engine.templates.expand` share.

:class:`_Builder` appends nodes in topological order, tracks each node's shape as the graph
engine infers it and validates the nodes (a :class:`~sigprop.schemas.Graph`, or
:class:`TemplateNodes` for the engine); :func:`_param` writes one documented template parameter;
:class:`TemplateSize` is a template's exact size from its parameters alone.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from pydantic import TypeAdapter, ValidationError

from sigprop.errors import SigpropError
from sigprop.schemas import GRAPH_SCHEMA, Graph, Template
from sigprop.schemas.graph import Node, NodeId

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
    lengths: list[int] | None = None,
) -> dict:
    p: dict[str, Any] = {"name": name, "type": type_, "required": required, "default": default}
    if allowed is not None:
        p["allowed"] = allowed
    if lengths is not None:  # the list lengths an array parameter may have (the OpenAPI schema states them)
        p["lengths"] = lengths
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


_NODE = TypeAdapter(Node)
_IDS = TypeAdapter(list[NodeId])


class _WireNode:
    """A validated wire node's fields as plain attributes: what the graph engine reads of a
    template's nodes (``_Builder.engine_nodes``), several times cheaper to make than the pydantic
    model. One subclass per node model, named after it and showing its ``model_fields``."""

    model_fields: dict = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


_WIRE_TYPES: dict[type, type] = {}


class TemplateNodes:
    """A template's nodes as the graph engine reads them (``build_graph`` takes it for a graph).

    ``ids`` and ``models`` give each node's id and the validated node its fields come from (one
    model per builder key, see ``_Builder.engine_nodes``); ``nodes`` are the wire nodes
    themselves, made on first use. ``sequential``: every node after the first reads the node listed
    before it and the last is the output, as the builder made them: unique ids, one output, all
    live, listed in canonical order, so ``build_graph`` makes the canonical nodes straight from
    ``ids`` and ``models`` without the checks and the walk that establish that for a user's graph.
    """

    __slots__ = ("ids", "models", "sequential", "_raw", "_nodes")

    def __init__(self, raw: list, ids: list[str], models: list, sequential: bool = False):
        self._raw, self.ids, self.models, self.sequential = raw, ids, models, sequential
        self._nodes: list | None = None

    @classmethod
    def of(cls, raw: list, nodes: list) -> TemplateNodes:
        """Validated wire nodes as they are, made from ``raw`` (the fallback that reports a schema error)."""
        made = cls(raw, [nd.id for nd in nodes], nodes)
        made._nodes = nodes
        return made

    def graph(self) -> Graph:
        """The nodes validated as one wire graph (raises pydantic's ``ValidationError``): what
        ``templates.expand_template`` returns, so the two expansions are one."""
        return Graph.model_validate({"schema": GRAPH_SCHEMA, "nodes": self._raw})

    @property
    def nodes(self) -> list:
        if self._nodes is None:
            new, nodes = object.__new__, []
            for raw, model in zip(self._raw, self.models, strict=True):
                if model.id == raw["id"]:  # validated from this node itself
                    nodes.append(model)
                    continue
                fields = model.__dict__.copy()
                fields["id"] = raw["id"]
                fields["inputs"] = raw["inputs"]
                wire = new(_wire_type(type(model)))
                wire.__dict__ = fields
                nodes.append(wire)
            self._nodes = nodes
        return self._nodes


def _wire_type(model: type) -> type:
    wire = _WIRE_TYPES.get(model)
    if wire is None:
        wire = _WIRE_TYPES[model] = type(model.__name__, (_WireNode,), {"model_fields": model.model_fields})
    return wire


class _Builder:
    """Appends nodes in topological order and tracks each node's shape (as the graph engine infers it).

    Each node is recorded with a key: what its fields other than id and inputs are made of (the
    builder call and its arguments, ints, bools and strings, with their types: equal keys, equal
    fields), or None for nodes checked one by one (the input node, sums and concats).
    ``engine_nodes`` validates one node per key.
    """

    def __init__(self, template: str):
        self.template = template
        self.nodes: list[dict] = []
        self.keys: list[tuple | None] = []
        self.shapes: dict[str, tuple[int, ...]] = {}

    def _add(self, node: dict, shape: tuple[int, ...], key: tuple | None = None) -> str:
        nid = node["id"]
        assert nid not in self.shapes, nid  # ids are generated; a clash is a bug here
        self.nodes.append(node)
        self.keys.append(key)
        self.shapes[nid] = shape
        return nid

    def graph(self) -> Graph:
        """The nodes as a validated graph (raises pydantic's ``ValidationError``)."""
        return TemplateNodes(self.nodes, [], []).graph()

    def engine_nodes(self) -> TemplateNodes | None:
        """``self.graph().nodes`` as the graph engine reads them, without validating every node: a
        request's template expansion is on the path of every cold solve, and validating each node
        cost more than building it. None when a node is invalid (``graph`` says which).

        The ids are validated all at once, and one node per key: the schema checks each field on
        its own, so a node that differs only in its (valid) id and inputs validates to the same
        fields. ``TemplateNodes.nodes`` are then ``_WireNode``s with these fields (or the
        validated models of the nodes without a key).
        """
        try:
            ids = [node["id"] for node in self.nodes]
            _IDS.validate_python(ids)
            models: list = []
            protos: dict[tuple, object] = {}
            # sequential: the input alone has no key (sums and concats have none), and every keyed
            # node (one input) reads the node before it
            sequential, last = True, None
            for node, key in zip(self.nodes, self.keys, strict=True):
                if key is None:
                    model = _NODE.validate_python(node)
                    sequential = sequential and last is None
                else:
                    model = protos.get(key)
                    if model is None:
                        model = protos[key] = _NODE.validate_python(node)
                    if node["inputs"][0] != last:
                        sequential = False
                last = node["id"]
                models.append(model)
        except ValidationError:
            return None
        return TemplateNodes(self.nodes, ids, models, sequential and self.nodes[-1]["op"] == "output")

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
        key = ("dense", units, type(units), bias, type(bias))
        return self._add({"id": nid, "op": "dense", "inputs": [src], "units": units, "bias": bias}, (units,), key)

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
            ("conv", channels, type(channels), kernel, type(kernel), stride, type(stride), bias, type(bias)),
        )

    def pool(self, nid: str, op: str, src: str, kernel: int, stride: int) -> str:
        c, h, w = self.shapes[src]
        h, w = (h - kernel) // stride + 1, (w - kernel) // stride + 1  # no padding
        if h < 1 or w < 1:
            raise self._too_small(nid)
        key = (op, kernel, type(kernel), stride, type(stride))
        return self._add({"id": nid, "op": op, "inputs": [src], "kernel": kernel, "stride": stride}, (c, h, w), key)

    def act(self, nid: str, src: str) -> str:
        return self._add({"id": nid, "op": "activation", "inputs": [src]}, self.shapes[src], ("activation",))

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
        return self._add({"id": nid, "op": op, "inputs": [src]}, shape, (op,))

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
