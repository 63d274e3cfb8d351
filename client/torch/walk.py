"""The walk that turns a traced, shape-propagated ``torch.fx`` GraphModule into graph nodes, one
per data node, and the helpers both the plain (``extraction``) and the sequence (``sequence``)
extraction use.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.fx
from torch.fx.passes.shape_prop import TensorMetadata

from ...schemas.errors import SigpropError
from ...schemas.graph import unsupported_note
from ..adapters import clean_id
from .ops import NotYet, Unsupported, classify, describe
from .traced import Entry

__all__ = ["Walker", "clean_id", "tensor_shape"]


def tensor_shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    if isinstance(meta, TensorMetadata):
        return tuple(int(d) for d in meta.shape)
    return None


def _contract_shape(shape: tuple[int, ...]) -> list[int] | None:
    """[B, F] -> [F]; [B, C, L] -> [C, L, 1] (1-d feature maps); [B, C, H, W] -> [C, H, W]."""
    if len(shape) == 2:
        return [shape[1]]
    if len(shape) == 3:
        return [shape[1], shape[2], 1]
    if len(shape) == 4:
        return list(shape[1:])
    return None


class Walker:
    """Walks a traced, shape-propagated GraphModule once, writing a graph node per data node."""

    def __init__(self, gm: torch.fx.GraphModule, allow_unsupported: bool, keep_fn: bool, warn: bool):
        self.gm, self.allow_unsupported, self.keep_fn, self.warn = gm, allow_unsupported, keep_fn, warn
        self.shapes: dict = {}  # data nodes (tensor values computed from the input) -> torch shape
        self.entries: dict = {}
        self.value: dict = {}
        self.nodes_out: list[dict] = []
        self.used_ids: set[str] = set()
        self.module_calls: dict[str, int] = {}
        self.notes: list[str] = []
        self.traced_modules: set[str] = set()
        self.tuple_src: dict = {}  # multi-output (tuple) nodes -> their data inputs

    def new_id(self, raw: str) -> str:
        base = clean_id(raw)
        gid, k = base, 1
        while gid in self.used_ids:
            gid = f"{base}:{k}"
            k += 1
        self.used_ids.add(gid)
        return gid

    def data_args(self, node) -> list:
        out: list = []

        def visit(a):  # map_arg walks args and kwargs, nested lists, tuples and dicts included
            if a in self.shapes:
                out.append(a)
            elif a in self.tuple_src:
                out.extend(x for x in self.tuple_src[a] if x not in out)
            return a

        torch.fx.node.map_arg((node.args, node.kwargs), visit)
        return out

    def depends_on_data(self, node) -> bool:
        found = []

        def visit(a):
            if a in self.shapes or a.meta.get("_sigprop_data"):
                found.append(a)
            return a

        torch.fx.node.map_arg((node.args, node.kwargs), visit)
        return bool(found)

    def run(self, data_input: torch.fx.Node) -> dict:
        """The graph, as a JSON-ready dict."""
        out_node = None
        for node in self.gm.graph.nodes:
            if node.op == "call_module":
                self.traced_modules.add(node.target)
            if node.op == "placeholder" and node is not data_input:
                continue  # an optional argument left at its default: not on the data path
            if node.op == "placeholder":
                self.add_input(node)
            elif node.op == "output":
                out_node = node
            elif node.op != "get_attr" and self.depends_on_data(node):  # else a constant, off the data path
                self.add_node(node)
        self.add_output(out_node)
        return {"schema": "sigprop.graph/v1", "nodes": self.nodes_out}

    def add_input(self, node: torch.fx.Node) -> None:
        shape = tensor_shape(node)
        gid = self.new_id(node.name)
        self.shapes[node] = shape
        self.value[node] = gid
        cshape = _contract_shape(shape)
        self.nodes_out.append({"id": gid, "op": "input", "shape": cshape})
        self.entries[node] = Entry(node, gid, "input", [], {"shape": cshape}, f"input '{node.name}'")

    def add_node(self, node: torch.fx.Node) -> None:
        shape = tensor_shape(node)
        if shape is None:
            # sizes, shapes, tuples: not a tensor on the data path (a tuple result is flagged where used)
            node.meta["_sigprop_data"] = True
            if isinstance(node.meta.get("tensor_meta"), (tuple, list)):
                self.tuple_src[node] = self.data_args(node)
            return
        ins = self.data_args(node)
        self.shapes[node] = shape
        desc = describe(node, self.gm)
        classified = self.classify(node, ins, shape, desc)
        if classified is None:  # a tensor made from nothing on the data path: leave it out
            del self.shapes[node]
            return
        op, attrs, extra, ins = classified
        if node.op == "call_module":
            k = self.module_calls.get(node.target, 0)
            self.module_calls[node.target] = k + 1
            raw = node.target if k == 0 else f"{node.target}:{k}"
        else:
            raw = node.name
        gid = self.new_id(raw)
        self.value[node] = gid
        self.entries[node] = Entry(
            node,
            gid,
            op,
            ins,
            attrs,
            desc,
            module=extra.get("module"),
            fn=extra.get("fn"),
            fn_params=extra.get("fn_params", {}),
            unsupported=extra.get("unsupported"),
        )
        wire = {"id": gid, "op": op, "inputs": [self.value[a] for a in ins]}
        if op == "activation":
            if self.keep_fn:
                wire["fn"] = attrs["fn"]
        else:
            wire.update(attrs)
        if extra.get("unsupported"):
            # on the graph itself, so that every answer for it warns, whoever sends it
            wire["unsupported"] = unsupported_note(f"{desc}: {extra['unsupported']}")
        if op == "sum" and "weights" not in attrs:
            wire["weights"] = [1.0 / math.sqrt(len(ins))] * len(ins)
        self.nodes_out.append(wire)

    def classify(self, node: torch.fx.Node, ins: list, shape, desc: str) -> tuple[str, dict, dict, list] | None:
        """(op, attrs, extra, inputs) of a data node; under ``allow_unsupported`` an op the graph
        cannot express becomes the identity of its first input (None when it has no input)."""
        tuple_args = [a for a in node.all_input_nodes if a in self.tuple_src]
        try:
            if tuple_args:
                raise Unsupported(
                    f"it takes part of the multi-output result of '{tuple_args[0].name}' "
                    f"({describe(tuple_args[0], self.gm)})"
                )
            if not ins:
                raise Unsupported("it has no input from the network")
            return (*classify(node, self.gm, ins, self.shapes), ins)
        except Unsupported as exc:
            name = clean_id(node.target if node.op == "call_module" else node.name)
            if not self.allow_unsupported or isinstance(exc, NotYet):
                raise SigpropError(
                    "unsupported_op", f"node '{name}' ({desc}) is not supported: {exc.why}", exc.hint
                ) from None
            msg = f"node '{name}' ({desc}) is not supported ({exc.why}); treated as the identity"
            if len(ins) > 1:
                msg += f" of its first input (dropped inputs: {', '.join(a.name for a in ins[1:])})"
            if ins and self.shapes[ins[0]] != shape:
                msg += (
                    f"; it changes the shape {list(self.shapes[ins[0]])} -> {list(shape)}, which the graph does not see"
                )
            self.notes.append(msg)
            if self.warn:
                warnings.warn(msg, stacklevel=6)  # the caller of graph_from_module
            return ("identity", {}, {"unsupported": exc.why}, ins[:1]) if ins else None

    def add_output(self, out_node: torch.fx.Node | None) -> None:
        result = out_node.args[0] if out_node is not None and out_node.args else None
        if not isinstance(result, torch.fx.Node) or result not in self.shapes:
            got = "several values" if isinstance(result, (tuple, list, dict)) else "no tensor computed from the input"
            raise SigpropError(
                "unsupported_op",
                f"forward returns {got}",
                "the graph has exactly one output: return one tensor (merge heads with a concat or sum)",
            )
        gid = self.new_id(out_node.name)
        self.nodes_out.append({"id": gid, "op": "output", "inputs": [self.value[result]]})
        self.entries[out_node] = Entry(out_node, gid, "output", [result], {}, "output")
        self.value[out_node] = gid
