"""Graph extraction: a Keras 3 ``Sequential`` or Functional model to a ``sigprop.graph/v1`` graph.

The walk reads the model's own graph of operation calls (``model._nodes_by_depth``, the order in
which Keras runs a Functional model), so residual adds written as ``x + y`` on symbolic tensors and
scalings written as ``0.8 * x`` are seen, not only layers. Each value is a graph node times a
scalar factor: ``Rescaling`` and multiplications or divisions by a constant change the factor,
and a sum takes its inputs' factors as its weights (``Add()([Rescaling(0.8)(x), Rescaling(0.6)(h)])``
is the sum with weights ``[0.8, 0.6]``; ``(x + h) / sqrt(2)`` the equal one). Every layer the graph
cannot express is refused by its name and type: nothing is passed through.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import keras

from ...schemas.activations import ACTIVATION_NAMES
from ...schemas.errors import SigpropError
from ...schemas.graph import Graph
from ...schemas.shapes import infer_shapes
from ..adapters import Unsupported as _Unsupported
from ..adapters import check_assumptions, clean_id, finish_graph
from ..scaled_sums import ScaledSums
from .attention import ATTENTION_HINT, ATTENTION_LAYERS, ATTENTION_WHY
from .layers import WeightedSum, activation_of

__all__ = ["graph_from_keras", "extract", "Entry", "Extraction"]

L = keras.layers
_DROPOUTS = (L.Dropout, L.SpatialDropout1D, L.SpatialDropout2D)
_POOLS = {L.MaxPooling1D: "max_pool", L.MaxPooling2D: "max_pool", L.AveragePooling1D: "avg_pool"}
_POOLS[L.AveragePooling2D] = "avg_pool"
_NORMS = tuple(
    getattr(L, n) for n in ("BatchNormalization", "LayerNormalization", "GroupNormalization", "UnitNormalization")
)
_RMS_NORM = getattr(L, "RMSNormalization", None)  # Keras 3.9+: x / sqrt(mean(x^2) + eps) * scale
_SEQUENCE = tuple(
    getattr(L, n)
    for n in ("MultiHeadAttention", "Attention", "Embedding", "LSTM", "GRU", "SimpleRNN", "RNN", "Bidirectional")
    if hasattr(L, n)
)
_UNSUPPORTED_HINT = (
    "the graph covers Dense and Conv layers, catalogue activations, Add (optionally scaled), Concatenate, "
    "pooling, Flatten, Dropout and Identity: replace or remove the layer, or write the graph by hand"
)
_NORM_HINT = (
    "TAT and DKS networks are normalization-free: remove it (the answer's initialization and transformed "
    "activations do its job)"
)


class Unsupported(_Unsupported):
    default_hint = _UNSUPPORTED_HINT


def _unknown_activation(exc: ValueError) -> Unsupported:
    """An activation function outside the catalogue, named with the catalogue's list."""
    return Unsupported(
        f"{exc}; supported: {', '.join(ACTIVATION_NAMES)}",
        "use one of those (by name, e.g. activation='swish', or sigprop.client.keras.TransformedActivation(name)), "
        "or write the graph by hand",
    )


@dataclass
class Entry:
    """One graph node: the Keras call it comes from and what apply and diagnose need of it."""

    gid: str
    op: str  # contract op
    layer: object  # the Keras layer or operation (None for the output node)
    kind: str  # "input", "layer", "fused" (a Dense/Conv's own activation), "sum", "output"
    tensor: int | None = None  # id() of the Keras tensor holding the node's value (None: fused)
    fn: str | None = None  # activation: the model's own function
    fn_params: dict = field(default_factory=dict)
    plain: bool = False  # sum: the model adds without weights (apply makes it the normalized sum)
    scale: float = 1.0  # the node's value is ``scale`` times the tensor's (a scaled sum no op reads scaled)


@dataclass
class Extraction:
    model: object  # the Functional graph walked (a Sequential's inner Functional)
    graph: dict
    entries: dict  # graph id -> Entry
    order: list  # ("node", Keras node) in the order they run, and ("bind", dst, src) tensor aliases
    warnings: list[str]


@dataclass
class _Val:
    gid: str
    factor: float = 1.0
    via: int | None = None  # id() of the Keras tensor carrying the scaled value


def _contract_shape(shape, what: str) -> list[int]:
    """Keras's channels-last ``(None, ...)`` shape as the contract's: [F], [C, L, 1] or [C, H, W]."""
    dims = list(shape[1:])
    if any(d is None for d in dims):
        raise SigpropError(
            "invalid_graph",
            f"{what} has an unknown dimension in its shape {tuple(shape)}",
            "give the model a fixed input shape, e.g. keras.Input((32, 32, 3))",
        )
    dims = [int(d) for d in dims]
    if len(dims) == 1:
        return dims
    if len(dims) == 2:
        return [dims[1], dims[0], 1]
    if len(dims) == 3:
        return [dims[2], dims[0], dims[1]]
    raise SigpropError(
        "invalid_graph",
        f"{what} has shape {tuple(shape)}",
        "the graph takes [batch, features], [batch, length, channels] or [batch, height, width, channels] values",
    )


def _functional(model):
    if isinstance(model, keras.Sequential):
        fn = getattr(model, "_functional", None)
        if fn is None:
            raise SigpropError(
                "invalid_graph",
                f"the Sequential model '{model.name}' is not built, so its input shape is unknown",
                "start it with keras.Input(shape) or call model.build((None, ...)) first",
            )
        return fn
    if isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth"):
        return model
    if isinstance(model, keras.Model):
        raise SigpropError(
            "unsupported_op",
            f"'{model.name}' is a subclassed keras.Model ({type(model).__name__}), whose call() Keras cannot list",
            "graph_from_keras reads Sequential and Functional models: build the network with keras.Input and "
            "layer calls, or write the graph by hand",
        )
    raise TypeError(f"expected a keras.Model (Sequential or Functional), got {type(model).__name__}")


def _pair(v, one_d: bool) -> list[int]:
    v = [int(x) for x in (v if isinstance(v, (tuple, list)) else [v])]
    return [v[0], 1] if one_d else (v * 2 if len(v) == 1 else v[:2])


def _conv_attrs(layer) -> dict:
    one_d = isinstance(layer, L.Conv1D)
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        raise Unsupported("a channels_first convolution", "use data_format='channels_last' (Keras's default)")
    if int(getattr(layer, "groups", 1)) != 1:
        raise Unsupported(f"a grouped convolution (groups={layer.groups})", "the analysis covers groups=1 only")
    if any(int(d) != 1 for d in _pair(layer.dilation_rate, one_d)):
        raise Unsupported(f"a dilated convolution (dilation_rate={layer.dilation_rate})", "use dilation_rate=1")
    if layer.padding not in ("same", "valid"):
        raise Unsupported(f"a convolution with padding='{layer.padding}'", "use padding 'same' or 'valid'")
    return {
        "channels": int(layer.filters),
        "kernel": _pair(layer.kernel_size, one_d),
        "stride": _pair(layer.strides, one_d),
        "padding": layer.padding,
        "bias": bool(layer.use_bias),
    }


def _pool_attrs(layer, in_shape, out_shape) -> dict:
    one_d = isinstance(layer, (L.MaxPooling1D, L.AveragePooling1D))
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        raise Unsupported("channels_first pooling", "use data_format='channels_last' (Keras's default)")
    k = _pair(layer.pool_size, one_d)
    s = _pair(layer.strides if layer.strides is not None else layer.pool_size, one_d)
    spatial_in, spatial_out = list(in_shape[1:-1]), list(out_shape[1:-1])
    valid = [(n - kk) // ss + 1 for n, kk, ss in zip(spatial_in, k, s, strict=False)]
    if layer.padding != "valid" and valid != spatial_out:
        raise Unsupported(
            f"pooling with padding='{layer.padding}' that pads {spatial_in} -> {spatial_out}",
            "use padding='valid', or a pool size and stride that divide the map",
        )
    return {"kernel": k, "stride": s}


def _activation(layer) -> tuple[str, dict] | None:
    """(catalogue name, params) computed by an activation layer, None for the identity."""
    if isinstance(layer, L.ReLU):
        if layer.max_value is not None or float(layer.threshold) != 0.0:
            raise Unsupported(f"ReLU with max_value={layer.max_value}, threshold={layer.threshold}", "use a plain ReLU")
        slope = float(layer.negative_slope)
        return ("leaky_relu", {"negative_slope": slope}) if slope else ("relu", {})
    if isinstance(layer, L.LeakyReLU):
        return "leaky_relu", {"negative_slope": float(layer.negative_slope)}
    if isinstance(layer, L.ELU):
        return "elu", {"alpha": float(layer.alpha)}
    try:
        return activation_of(layer.activation)
    except ValueError as exc:
        raise _unknown_activation(exc) from None


def _scalar(value) -> float | None:
    """A Python or 0-d numeric constant as a float, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) == () and not isinstance(value, keras.KerasTensor):
        return float(value)
    return None


def _describe(op) -> str:
    return f"{type(op).__name__} '{op.name}'"


class _Walker:
    def __init__(self, fn_model):
        self.fm = fn_model
        self.vals: dict[int, _Val] = {}  # id(Keras tensor) -> value
        self.nodes: list[dict] = []
        self.entries: dict[str, Entry] = {}
        self.used: set[str] = set()
        self.calls: dict[int, int] = {}
        self.sums = ScaledSums()
        self.notes: list[str] = []
        self.order: list = []  # ("node", Keras node) to run, or ("bind", tensor id, tensor id) to alias
        self.prefix = ""  # "<model>/" inside a nested model

    def new_id(self, raw: str) -> str:
        base = clean_id(raw)
        gid, k = base, 1
        while gid in self.used:
            gid, k = f"{base}:{k}", k + 1
        self.used.add(gid)
        return gid

    def read(self, v: _Val, reader: str) -> str:
        """The graph id an op other than a sum reads; a sum's output scale comes from such reads."""
        if self.sums.is_sum(v.gid):
            self.sums.read(v.gid, v.factor, reader, v.via)
            return v.gid
        if v.factor == 1.0:
            return v.gid
        if self.entries[v.gid].op == "input":
            self.notes.append(
                f"the input '{v.gid}' is scaled by {v.factor:g} before {reader}: the kernel analysis assumes the "
                "network input has q = 1 per example after it; scale your data accordingly"
            )
            return v.gid
        raise SigpropError(
            "unsupported_op",
            f"{reader} reads '{v.gid}' multiplied by {v.factor:g}, a scaling the graph cannot express",
            "the graph scales only the inputs and the output of a sum (its weights): remove the scaling, or move it "
            "into an Add",
        )

    def emit(self, gid: str, op: str, inputs: list[str], entry: Entry, **attrs) -> dict:
        wire = {"id": gid, "op": op}
        if op != "input":
            wire["inputs"] = inputs
        wire.update(attrs)
        self.nodes.append(wire)
        self.entries[gid] = entry
        return wire

    def walk(self, fm) -> None:
        """Visit the calls of Functional graph ``fm`` in Keras's running order (a nested model's inline)."""
        for depth in sorted(fm._nodes_by_depth, reverse=True):
            for node in fm._nodes_by_depth[depth]:
                if fm is not self.fm and node.is_input:
                    continue  # a nested model's input is bound to the outer value (see nested)
                if not isinstance(node.operation, keras.Model):
                    self.order.append(("node", node))
                self.visit(node)

    def nested(self, node, op, name: str) -> None:
        """A Sequential or Functional model called as a layer: its calls inline, ids ``<name>/<layer>``."""
        inner = _functional(op)
        if len(inner.inputs) != 1 or len(inner.outputs) != 1 or len(node.input_tensors) != 1:
            raise Unsupported("a nested model with several inputs or outputs", "give the inner model one of each")
        self.vals[id(inner.inputs[0])] = self.ins(node)[0]
        self.order.append(("bind", id(inner.inputs[0]), id(node.input_tensors[0])))
        saved, self.prefix = self.prefix, f"{self.prefix}{name}/"
        try:
            self.walk(inner)
        finally:
            self.prefix = saved
        self.vals[id(node.outputs[0])] = self.vals[id(inner.outputs[0])]
        self.order.append(("bind", id(node.outputs[0]), id(inner.outputs[0])))

    def run(self) -> dict:
        self.walk(self.fm)
        outs = self.fm.outputs
        if len(outs) != 1:
            raise SigpropError(
                "unsupported_op",
                f"the model has {len(outs)} outputs",
                "the graph has exactly one output: merge heads with a Concatenate or Add",
            )
        if len(self.fm.inputs) != 1:
            raise SigpropError("unsupported_op", f"the model has {len(self.fm.inputs)} inputs", "give it one input")
        v = self.vals[id(outs[0])]
        gid = self.new_id("output")
        src = self.read(v, "the output")
        self.emit(gid, "output", [src], Entry(gid, "output", None, "output", tensor=id(outs[0])))
        self.sums.finalize()
        for sid, info in self.sums.sums.items():
            e = self.entries[sid]
            e.plain, e.scale = info.plain and not isinstance(e.layer, WeightedSum), info.scale
            if info.tensor is not None:
                e.tensor, e.scale = info.tensor, 1.0
        return {"schema": "sigprop.graph/v1", "nodes": self.nodes}

    def visit(self, node) -> None:
        op = node.operation
        if node.is_input or isinstance(op, L.InputLayer):
            t = node.outputs[0]
            gid = self.new_id(op.name)
            shape = _contract_shape(t.shape, f"input '{op.name}'")
            self.emit(gid, "input", [], Entry(gid, "input", op, "input", tensor=id(t)), shape=shape)
            self.vals[id(t)] = _Val(gid)
            return
        k = self.calls.get(id(op), 0)
        self.calls[id(op)] = k + 1
        name = self.prefix + (op.name if k == 0 else f"{op.name}:{k}")
        try:
            self.classify(node, op, name)
        except Unsupported as exc:
            raise SigpropError("unsupported_op", f"{_describe(op)} is not supported: {exc.why}", exc.hint) from None

    def ins(self, node) -> list[_Val]:
        return [self.vals[id(t)] for t in node.input_tensors]

    def one_to_one(self, node, op, name, kind_op: str, **attrs) -> str:
        (v,) = self.ins(node) or [None]
        if v is None:
            raise Unsupported("it has no input from the network")
        gid = self.new_id(name)
        src = self.read(v, _describe(op))
        t = node.outputs[0]
        self.emit(gid, kind_op, [src], Entry(gid, kind_op, op, "layer", tensor=id(t)), **attrs)
        self.vals[id(t)] = _Val(gid)
        return gid

    def classify(self, node, op, name) -> None:
        if len(node.outputs) != 1:
            raise Unsupported(f"it returns {len(node.outputs)} tensors")
        t_out = node.outputs[0]
        in_shapes = [tuple(t.shape) for t in node.input_tensors]
        if isinstance(op, keras.Model):
            self.nested(node, op, name)
            return
        if type(op) is L.Dense:
            if len(in_shapes[0]) != 2:
                raise Unsupported(
                    f"Dense applied to a tensor of shape {in_shapes[0]} (per position of a sequence or map); sequence "
                    "models are not supported yet",
                    "the graph's dense layers take [batch, features]: Flatten or GlobalAveragePooling first",
                )
            self.weighted(node, op, name, "dense", {"units": int(op.units), "bias": bool(op.use_bias)})
            return
        if type(op) in (L.Conv1D, L.Conv2D):
            self.weighted(node, op, name, "conv", _conv_attrs(op))
            return
        if isinstance(op, (L.Activation, L.ReLU, L.LeakyReLU, L.ELU)):
            act = _activation(op)
            if act is None:
                self.vals[id(t_out)] = self.ins(node)[0]  # Activation('linear'): the value itself
                return
            gid = self.one_to_one(node, op, name, "activation")
            self.entries[gid].fn, self.entries[gid].fn_params = act
            return
        if isinstance(op, WeightedSum) or type(op) is L.Add or _is_op(op, "Add"):
            self.add(node, op, name)
            return
        if type(op) is L.Multiply or (_is_op(op, "Multiply") and _tensors(node) == 2):
            self.product(node, op, name)
            return
        if _RMS_NORM is not None and type(op) is _RMS_NORM:
            if len(in_shapes[0]) != 2 or op.axis not in (-1, 1, [-1], [1]):
                raise Unsupported(f"RMSNormalization over axis {op.axis} of {in_shapes[0]}", "normalize axis -1")
            self.one_to_one(node, op, name, "rms_norm")  # apply sets its scale to 1
            return
        if type(op) is L.Rescaling or _is_op(op, "Multiply", "TrueDivide", "Divide"):
            self.scale(node, op)
            return
        if type(op) is L.Concatenate:
            if int(op.axis) not in (-1, len(in_shapes[0]) - 1):
                raise Unsupported(f"concatenation along axis {op.axis}", "concatenate channels (axis=-1)")
            vs = self.ins(node)
            gid = self.new_id(name)
            srcs = [self.read(v, _describe(op)) for v in vs]
            self.emit(gid, "concat", srcs, Entry(gid, "concat", op, "layer", tensor=id(t_out)))
            self.vals[id(t_out)] = _Val(gid)
            return
        if type(op) in _POOLS:
            self.one_to_one(node, op, name, _POOLS[type(op)], **_pool_attrs(op, in_shapes[0], tuple(t_out.shape)))
            return
        if type(op) in (L.GlobalAveragePooling1D, L.GlobalAveragePooling2D):
            if op.keepdims or getattr(op, "data_format", "channels_last") != "channels_last":
                raise Unsupported("global pooling with keepdims=True or channels_first", "use the defaults")
            self.one_to_one(node, op, name, "global_avg_pool")
            return
        if type(op) in (L.Flatten, L.Reshape):
            in_s, out_s = in_shapes[0], tuple(t_out.shape)
            if len(out_s) != 2 or out_s[1] != math.prod(in_s[1:]):
                raise Unsupported(
                    f"a reshape from {in_s} to {out_s}", "only flattening to [batch, features] is covered"
                )
            if len(in_s) == 2:
                self.vals[id(t_out)] = self.ins(node)[0]
                return
            self.one_to_one(node, op, name, "flatten")
            return
        if isinstance(op, _DROPOUTS):
            self.one_to_one(node, op, name, "dropout", rate=float(op.rate))
            return
        if type(op) is L.Identity:
            self.one_to_one(node, op, name, "identity")
            return
        if _NORMS and isinstance(op, _NORMS):
            raise Unsupported("a normalization layer, which the Q/C map analysis does not model", _NORM_HINT)
        if type(op).__name__ in ATTENTION_LAYERS:
            raise Unsupported(ATTENTION_WHY, ATTENTION_HINT)
        if _SEQUENCE and isinstance(op, _SEQUENCE):
            raise Unsupported(
                "attention, embeddings and recurrent layers are not supported yet",
                "sigprop covers feed-forward and convolutional networks",
            )
        raise Unsupported("it is not an op of the sigprop graph")

    def weighted(self, node, op, name: str, kind: str, attrs: dict) -> None:
        try:
            act = activation_of(op.activation)
        except ValueError as exc:
            raise _unknown_activation(exc) from None
        (v,) = self.ins(node)
        gid = self.new_id(name)
        src = self.read(v, _describe(op))
        t = node.outputs[0]
        self.emit(gid, kind, [src], Entry(gid, kind, op, "layer", tensor=None if act else id(t)), **attrs)
        if act is None:
            self.vals[id(t)] = _Val(gid)
            return
        aid = self.new_id(f"{name}/activation")
        self.emit(aid, "activation", [gid], Entry(aid, "activation", op, "fused", id(t), act[0], act[1]))
        self.vals[id(t)] = _Val(aid)

    def add(self, node, op, name: str) -> None:
        args = node.arguments.args
        flat = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
        if any(not isinstance(a, keras.KerasTensor) for a in flat) or len(flat) < 2:
            raise Unsupported(
                "an add of a tensor and a constant (a bias shift)", "only sums of network tensors map to a 'sum' node"
            )
        shapes = {tuple(a.shape) for a in flat}
        if len(shapes) != 1:
            raise Unsupported(f"an add that broadcasts shapes {sorted(shapes)}", "sum tensors of one shape")
        vs = [self.vals[id(a)] for a in flat]
        if isinstance(op, WeightedSum):
            coef = op._weights_for(len(vs))
            vs = [_Val(v.gid, v.factor * c, v.via) for v, c in zip(vs, coef, strict=True)]
        gid = self.new_id(name)
        t = node.outputs[0]
        wire = self.emit(gid, "sum", [v.gid for v in vs], Entry(gid, "sum", op, "sum", tensor=id(t)))
        self.sums.add(wire, [v.gid for v in vs], [v.factor for v in vs])  # weights: ScaledSums.finalize
        self.vals[id(t)] = _Val(gid)

    def product(self, node, op, name: str) -> None:
        """``Multiply()([u, v])`` or ``u * v`` of two network tensors of one shape: a ``mul`` node."""
        flat = _flat_args(node)
        if len(flat) != 2 or any(not isinstance(a, keras.KerasTensor) for a in flat):
            raise Unsupported("a product of other than two network tensors", "mul multiplies two tensors (u * v)")
        if tuple(flat[0].shape) != tuple(flat[1].shape):
            raise Unsupported(f"a product that broadcasts {tuple(flat[0].shape)} and {tuple(flat[1].shape)}")
        srcs = [self.read(self.vals[id(a)], _describe(op)) for a in flat]
        gid, t = self.new_id(name), node.outputs[0]
        self.emit(gid, "mul", srcs, Entry(gid, "mul", op, "layer", tensor=id(t)))
        self.vals[id(t)] = _Val(gid)

    def scale(self, node, op) -> None:
        t = node.outputs[0]
        if type(op) is L.Rescaling:
            s, off = _scalar(op.scale), _scalar(op.offset)
            if s is None or off != 0.0:
                raise Unsupported(
                    f"Rescaling with scale={op.scale}, offset={op.offset}", "use a scalar scale and offset 0"
                )
            (v,) = self.ins(node)
            self.vals[id(t)] = _Val(v.gid, v.factor * s, id(t))
            return
        a, b = node.arguments.args[:2]
        tensor_a = isinstance(a, keras.KerasTensor)
        tensor_b = isinstance(b, keras.KerasTensor)
        const = _scalar(b if tensor_a else a)
        if tensor_a == tensor_b or const is None:
            raise Unsupported(
                "a product or quotient of two network tensors, or by a non-scalar constant",
                "the graph scales values only by scalar constants, and only into or out of a sum",
            )
        v = self.vals[id(a if tensor_a else b)]
        if type(op).__name__ == "Multiply":
            f = const
        elif tensor_a:
            f = 1.0 / const
        else:
            raise Unsupported("a constant divided by a network tensor")
        self.vals[id(t)] = _Val(v.gid, v.factor * f, id(t))


def _flat_args(node) -> list:
    args = node.arguments.args
    return list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)


def _tensors(node) -> int:
    """How many of a call's arguments are Keras tensors."""
    return sum(isinstance(a, keras.KerasTensor) for a in _flat_args(node))


def _is_op(op, *names: str) -> bool:
    """Whether ``op`` is one of keras.ops' symbolic operations (``x + y`` on KerasTensors)."""
    cls = type(op)
    return cls.__name__ in names and cls.__module__.startswith("keras.src.ops")


def _check(graph: dict, walker: _Walker) -> None:
    """The contract's graph rules, and every node's shape against the one Keras computed."""
    try:
        shapes = infer_shapes(Graph.model_validate(graph))
    except SigpropError as exc:
        raise SigpropError(
            exc.code, f"the graph extracted from the Keras model is not valid: {exc.message}", exc.hint
        ) from None
    tensors = {}
    for kind, *rest in walker.order:
        if kind == "node":
            for t in rest[0].outputs:
                tensors[id(t)] = t
    for gid, e in walker.entries.items():
        t = tensors.get(e.tensor) if e.tensor is not None else None
        if t is None or e.op in ("output", "input"):
            continue
        want = tuple(_contract_shape(t.shape, gid))
        if want != tuple(shapes[gid]):
            raise SigpropError(
                "unsupported_op",
                f"node '{gid}' has shape {list(want)} in the model but {list(shapes[gid])} in the graph",
                "a layer's attributes (padding, pooling) map onto the graph differently than Keras computes them",
            )


def extract(model) -> Extraction:
    """The model's graph and what apply and diagnose need (see :class:`Extraction`)."""
    fm = _functional(model)
    walker = _Walker(fm)
    graph = walker.run()
    _check(graph, walker)
    return Extraction(fm, graph, walker.entries, walker.order, walker.notes)


def graph_from_keras(model, *, keep_fn: bool = False, assumptions: str = "strict") -> dict:
    """The ``sigprop.graph/v1`` graph of a Keras 3 ``Sequential`` or Functional model (a JSON-ready dict).

    Node ids are the layer names (``name:k`` for the k-th call of a shared layer); the activation of a
    ``Dense``/``Conv`` layer built with ``activation=...`` is its own node ``<layer>/activation``. Maps
    ``Dense`` (on ``[batch, features]``) to ``dense``; ``Conv2D`` and ``Conv1D`` (channels last, a 1-d
    map as ``[channels, length, 1]``) to ``conv``; ``Activation``, ``ReLU``, ``LeakyReLU``, ``ELU`` and
    fused activations of the catalogue to ``activation``; ``Add`` and ``x + y`` to ``sum`` (weights
    ``1/sqrt(n)``, which ``apply`` makes the add compute, or the scalings the model applies to its
    inputs and output: ``Rescaling``, ``c * x``, ``x / c``); ``Concatenate`` (channels) to
    ``concat``; ``MaxPooling``/``AveragePooling`` 1D/2D to ``max_pool``/``avg_pool``;
    ``GlobalAveragePooling`` 1D/2D to ``global_avg_pool``; ``Flatten`` (and ``Reshape`` to
    ``[batch, features]``) to ``flatten``; ``Dropout`` and ``SpatialDropout`` to ``dropout``;
    ``Identity`` to ``identity``.

    A Sequential or Functional model called as a layer is read inline (ids ``<model>/<layer>``).
    Any other layer (normalization, attention, embeddings, recurrent layers, a custom layer) raises
    ``SigpropError("unsupported_op")`` naming it; nothing is passed through.
    ``keep_fn`` and ``assumptions`` are those of ``sigprop.client.torch.graph_from_module``: activation
    nodes carry the model's ``fn`` only with ``keep_fn=True``, and the graph is checked against the
    kernel theory's structure rules (``"warn"`` warns instead of raising).
    """
    check_assumptions(assumptions)
    ext = extract(model)
    for note in ext.warnings:
        warnings.warn(note, stacklevel=2)
    graph = ext.graph
    if keep_fn:
        for nd in graph["nodes"]:
            if nd["op"] == "activation":
                nd["fn"] = ext.entries[nd["id"]].fn
    fns = (e.fn for e in ext.entries.values() if e.op == "activation")
    finish_graph(graph, fns, keep_fn=keep_fn, assumptions=assumptions)
    return graph
