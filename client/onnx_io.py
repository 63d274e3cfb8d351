"""Helpers of ``sigprop.client.onnx``: loading a model, tensor shapes, the torch ids the dynamo
exporter's metadata gives, and the final check of the graph read against the ONNX model's shapes."""

from __future__ import annotations

import ast
import math
import os

import onnx

from ..schemas.errors import SigpropError
from ..schemas.graph import Graph
from ..schemas.shapes import infer_shapes

__all__ = ["torch_id", "load", "contract_shape", "dims_of", "check"]

# torch classes whose calls torch.fx keeps as one call_module node (its default leaf modules, and
# sigprop's own): graph_from_module names their ops after the module path
_LEAF_PREFIXES = ("torch.nn.", "torch.ao.nn.", "sigprop.client.torch.")
_CONTAINERS = {"torch.nn.modules.container.Sequential"}


def torch_id(node) -> str | None:
    """The id ``graph_from_module`` gives the torch op behind ``node``, from the scopes the dynamo exporter
    writes in its metadata (``['', 'blocks', 'blocks.0', 'add']``, each with its class); None without them."""
    meta = {p.key: p.value for p in node.metadata_props}
    try:
        scopes = ast.literal_eval(meta["pkg.torch.onnx.name_scopes"])
        classes = ast.literal_eval(meta["pkg.torch.onnx.class_hierarchy"])
    except (KeyError, ValueError, SyntaxError):
        return None
    if not isinstance(scopes, list) or not isinstance(classes, list) or len(scopes) != len(classes) or not scopes:
        return None
    owner = str(classes[-2]) if len(classes) > 2 else ""  # the innermost submodule the op runs in
    if owner.startswith(_LEAF_PREFIXES) and owner not in _CONTAINERS:
        return str(scopes[-2]) or None  # a leaf module's own op: its path
    return str(scopes[-1]) or None  # an op written in forward: its node's name


def load(model_or_path):
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    if isinstance(model_or_path, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model_or_path))
    if isinstance(model_or_path, (str, os.PathLike)):
        return onnx.load(os.fspath(model_or_path))
    raise TypeError(f"expected an onnx.ModelProto, its bytes or a path, got {type(model_or_path).__name__}")


def contract_shape(dims: list, what: str) -> list[int]:
    """ONNX's channels-first ``[N, ...]`` shape as the contract's: [F], [C, L, 1] or [C, H, W]."""
    rest = dims[1:]
    if not rest or len(rest) > 3 or any(not isinstance(d, int) or d < 1 for d in rest):
        raise SigpropError(
            "invalid_graph",
            f"{what} has shape {dims}",
            "export with a fixed input shape [batch, features], [batch, channels, length] or "
            "[batch, channels, height, width]",
        )
    return list(rest) + ([1] if len(rest) == 2 else [])


def dims_of(vi) -> list | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


def check(graph: dict, imp) -> None:
    """The contract's rules, every layer's fan-in against its weight, every size against ONNX's."""
    try:
        shapes = infer_shapes(Graph.model_validate(graph))
    except SigpropError as exc:
        raise SigpropError(
            exc.code, f"the graph read from the ONNX model is not valid: {exc.message}", exc.hint
        ) from None
    inputs = {nd["id"]: nd.get("inputs", []) for nd in graph["nodes"]}
    sequence = any(nd.get("sequence") for nd in graph["nodes"] if nd["op"] == "input")
    for gid, want in imp.fan_in.items():
        got = shapes[inputs[gid][0]][-1 if sequence else 0]  # features: last of [T, D], first of [C, H, W]
        if want != got:
            raise SigpropError(
                "unsupported_op",
                f"node '{gid}' takes {want} input features but the graph gives it {got}",
                "an op before it changes shapes in a way the graph does not see",
            )
    for tensor, v in imp.vals.items():
        dims = imp.shapes.get(tensor)
        if v.factor != 1.0 or v.gid not in shapes or not dims or not all(isinstance(d, int) for d in dims[1:]):
            continue
        if math.prod(dims[1:]) != math.prod(shapes[v.gid]):  # sizes: ONNX keeps [C, 1, 1] after a global pool
            raise SigpropError(
                "unsupported_op",
                f"node '{v.gid}' has shape {list(shapes[v.gid])} in the graph but {dims[1:]} in the ONNX model",
                "an op's attributes map onto the graph differently than ONNX computes them",
            )
