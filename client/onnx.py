"""ONNX import: a ``sigprop.graph/v1`` graph from an ONNX model (``torch.onnx.export``, ``tf2onnx``,
``onnx.helper``), and which initializers hold each layer's weights.

    from sigprop.client.onnx import graph_from_onnx

    graph, params = graph_from_onnx("model.onnx")
    # params: {"layer1/conv1": {"weight": "layer1.conv1.weight", "bias": None}, ...}

Only the ``onnx`` package is needed (no runtime): the model's own shape inference gives every
tensor's shape, which is checked against the graph's shape rules node by node. What maps to what:

* ``Gemm`` (``alpha = beta = 1``, weight an initializer) and ``MatMul`` by an initializer followed
  by ``Add`` of an initializer (its bias) -> ``dense``; ``Conv`` (groups 1, no dilation; a 1-d
  convolution on ``[channels, length, 1]``) -> ``conv``;
* ``Relu``, ``LeakyRelu``, ``Tanh``, ``Sigmoid``, ``Softplus``, ``Softsign``, ``Elu``, ``Selu``,
  ``Gelu``, ``Erf``, ``Atan``, ``Asinh``, ``x * Sigmoid(x)`` (swish) and ``x * (1 + Erf(x / sqrt(2)))
  * 0.5`` (GELU as exporters write it before opset 20) -> ``activation``;
* ``Mul`` of two network tensors of one shape -> ``mul``; ``RMSNormalization`` of ``[B, F]`` -> ``rms_norm``;
* ``Add`` and ``Sum`` of network tensors -> ``sum``; ``Mul``/``Div`` by a scalar constant is a
  factor on a sum's input or output (``(x + h) / sqrt(2)``, ``0.8 x + 0.6 h``): the sum's weights.
  An unscaled add gets the equal weights ``1/sqrt(n)``, as ``graph_from_module`` gives it;
* ``Concat`` (axis 1) -> ``concat``; ``MaxPool``/``AveragePool`` -> ``max_pool``/``avg_pool``;
  ``GlobalAveragePool`` and ``ReduceMean`` over the spatial axes -> ``global_avg_pool``;
  ``Flatten`` and ``Reshape`` to ``[batch, features]`` -> ``flatten``; ``Dropout`` -> ``dropout``;
  ``Identity`` -> ``identity``;
* a ``[batch, tokens, features]`` input (and no convolution or pooling) makes a sequence model:
  ``MatMul``/``Gemm`` per token -> ``dense``, ``LayerNormalization`` (``RMSNormalization``) over the
  features -> ``layer_norm`` (``rms_norm``; ``params`` names its scale and bias), and self-attention,
  the MatMul/Softmax pattern or the opset-23 ``Attention`` op, -> ``attention`` on dense q, k, v
  (``onnx_attention``; a fused qkv layer is three dense nodes ``<id>.q/.k/.v``).

Nodes computed from constants and shapes only (``Shape``, ``Gather``, ``Constant``, ...) are not on
the data path and are skipped. Any other op on the data path raises ``SigpropError("unsupported_op")``
naming its op type and node name. Node ids are the torch module paths where the export keeps them
(``torch.onnx.export``'s default exporter, in each node's metadata): a leaf module's ops are named
after its path (``0``, ``blocks.0.f.1``), a function called in ``forward`` after its node
(``add``), as ``graph_from_module`` names them; otherwise the ONNX node names (leading ``/``
dropped), ``:k`` appended to repeats.
"""

from __future__ import annotations

try:
    import onnx
    from onnx import numpy_helper, shape_inference
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "sigprop.client.onnx needs the onnx package, which is not installed: pip install 'sigprop[onnx]'"
    ) from _exc

import math
from dataclasses import dataclass

import numpy as np

from ..schemas.activations import SELU_ALPHA, SELU_LAMBDA
from ..schemas.errors import SigpropError
from .adapters import Unsupported, check_assumptions, clean_id, finish_graph
from .onnx_attention import ATTENTION_HINT, AttentionSite, emit_attention, find_sites
from .onnx_io import check, contract_shape, dims_of, load, torch_id
from .scaled_sums import ScaledSums

__all__ = ["graph_from_onnx"]

_HINT = (
    "the graph covers Gemm/MatMul+Add, Conv, catalogue activations, Add/Sum/Mul-by-constant, Concat, pooling, "
    "Flatten/Reshape, Dropout and Identity: export the model without the op, or write the graph by hand"
)
_NORM_HINT = (
    "TAT and DKS networks are normalization-free: remove it before exporting (the answer's initialization and "
    "transformed activations do its job)"
)
_ACTIVATIONS = {
    "Relu": "relu",
    "LeakyRelu": "leaky_relu",
    "Tanh": "tanh",
    "Sigmoid": "sigmoid",
    "Softplus": "softplus",
    "Softsign": "softsign",
    "Elu": "elu",
    "Selu": "selu",
    "Gelu": "gelu",
    "Erf": "erf",
    "Atan": "atan",
    "Asinh": "asinh",
}
_NORMS = {"BatchNormalization", "LayerNormalization", "GroupNormalization", "InstanceNormalization", "LRN"}
_SELU = (SELU_ALPHA, SELU_LAMBDA)  # ONNX's default alpha and gamma are the catalogue's selu
_SPATIAL = {"Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "ConvTranspose"}


class _Unsupported(Unsupported):
    default_hint = _HINT


@dataclass
class _Val:
    gid: str
    factor: float = 1.0


def _attrs(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _decode(v):
    return v.decode() if isinstance(v, bytes) else v


class _Importer:
    def __init__(self, model):
        self.model = model
        g = model.graph
        self.consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        self.init_names = set(self.consts)
        self.shapes = {}  # tensor name -> dims
        for vi in list(g.value_info) + list(g.input) + list(g.output):
            dims = dims_of(vi)
            if dims is not None:
                self.shapes[vi.name] = dims
        for node in g.node:  # Constant nodes' values up front: a pattern may read one that comes later
            if node.op_type == "Constant" and "value" in _attrs(node):
                self.consts[node.output[0]] = numpy_helper.to_array(_attrs(node)["value"])
        self.consumers: dict[str, list] = {}
        for node in g.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.vals: dict[str, _Val] = {}  # tensor name -> value on the data path
        self.nodes: list[dict] = []
        self.entries: dict[str, dict] = {}  # gid -> {"op", "plain", "weights"}
        self.params: dict[str, dict] = {}
        self.fan_in: dict[str, int] = {}  # dense/conv id -> input features its weight takes
        self.used: set[str] = set()
        self.sums = ScaledSums()
        self.skip: set[int] = set()  # ids of nodes already folded into another (a MatMul's bias Add)
        self.sequence = False  # a [B, T, D] input read per token, with attention (onnx_attention.py)
        self.region: dict[int, AttentionSite] = {}  # id() of an ONNX node -> the attention site it is part of
        self.cuts: dict[str, list] = {}  # a fused qkv output tensor -> [(lo, hi, role)]
        self.part_gid: dict[tuple, str] = {}  # (tensor, lo, hi) -> dense gid
        self.dense_base: dict[str, str] = {}  # dense gid -> the id of its whole layer

    def new_id(self, raw: str) -> str:
        base = clean_id(raw.lstrip("/"))
        gid, k = base, 1
        while gid in self.used:
            gid, k = f"{base}:{k}", k + 1
        self.used.add(gid)
        return gid

    def const(self, name: str):
        return self.consts.get(name)

    def read(self, v: _Val, reader: str) -> str:
        """The graph id an op other than a sum reads; a sum's output scale comes from such reads."""
        if self.sums.is_sum(v.gid):
            self.sums.read(v.gid, v.factor, reader)
        elif v.factor != 1.0:
            raise SigpropError(
                "unsupported_op",
                f"{reader} reads '{v.gid}' multiplied by {v.factor:g}, a scaling the graph cannot express",
                "the graph scales only the inputs and the output of a sum (its weights): remove the scaling",
            )
        return v.gid

    def emit(self, gid: str, op: str, inputs: list[str], **attrs) -> dict:
        wire = {"id": gid, "op": op}
        if op != "input":
            wire["inputs"] = inputs
        wire.update(attrs)
        self.nodes.append(wire)
        self.entries[gid] = {"op": op, "node": wire}
        return wire

    def run(self) -> dict:
        g = self.model.graph
        data_inputs = [i for i in g.input if i.name not in self.init_names]
        if len(data_inputs) != 1:
            raise SigpropError(
                "unsupported_op",
                f"the ONNX graph has {len(data_inputs)} inputs ({', '.join(i.name for i in data_inputs)})",
                "the sigprop graph has one input: export the model with one input tensor",
            )
        x = data_inputs[0]
        gid, dims = self.new_id(x.name), self.shapes.get(x.name) or []
        self.sequence = len(dims) == 3 and not any(n.op_type in _SPATIAL for n in g.node)
        if self.sequence:  # [batch, tokens, features]
            contract_shape(dims, f"the input '{x.name}'")
            self.emit(gid, "input", [], shape=[int(dims[1]), int(dims[2])], sequence=True)
            self.find_sites(x.name, dims)
        else:
            self.emit(gid, "input", [], shape=contract_shape(dims, f"the input '{x.name}'"))
        self.vals[x.name] = _Val(gid)
        for k, node in enumerate(g.node):
            if id(node) in self.skip:
                continue
            if node.op_type in ("Shape", "Size"):  # a tensor's shape is not on the data path
                continue
            if id(node) in self.region:
                if self.region[id(node)].anchor == k:
                    self.attention(self.region[id(node)])
                continue
            data = [n for n in node.input if n in self.vals]
            if not data:  # computed from constants and shapes only: off the data path
                continue
            raw = node.name or (node.output[0] if node.output else f"{node.op_type}_{k}")
            name = torch_id(node) or raw
            try:
                self.visit(node, name, data)
            except _Unsupported as exc:
                where = f"'{raw}' ({node.op_type}" + (f", '{name}' in the torch model)" if name != raw else ")")
                raise SigpropError(
                    "unsupported_op", f"ONNX node {where} is not supported: {exc.why}", exc.hint
                ) from None
        if len(g.output) != 1 or g.output[0].name not in self.vals:
            raise SigpropError(
                "unsupported_op",
                f"the ONNX graph has {len(g.output)} outputs",
                "the sigprop graph has exactly one output computed from the input",
            )
        src = self.read(self.vals[g.output[0].name], "the output")
        self.emit(self.new_id("output"), "output", [src])
        self.sums.finalize()
        return {"schema": "sigprop.graph/v1", "nodes": self.nodes}

    # ------------------------------------------------------------------ sequence models

    def find_sites(self, name: str, dims: list) -> None:
        find_sites(self, name, dims)

    def attention(self, site: AttentionSite) -> None:
        emit_attention(self, site, _Val)

    def dense(self, node, name: str, src: str, out: str, weight: str, bias, units: int, fan_in: int) -> None:
        """A dense node for ``out`` (several, one per block, for a fused qkv layer cut for attention)."""
        cuts = sorted(self.cuts.get(out, []))
        if not cuts or [c[:2] for c in cuts] == [(0, units)]:
            gid = self.new_id(name)
            self.emit(gid, "dense", [src], units=units, bias=bias is not None)
            self.params[gid] = {"weight": weight, "bias": bias}
            self.fan_in[gid] = fan_in
            self.vals[out] = _Val(gid)
            return
        base = clean_id(name.lstrip("/"))
        for lo, hi, role in cuts:
            gid = self.new_id(f"{base}.{role}")
            self.emit(gid, "dense", [src], units=hi - lo, bias=bias is not None)
            self.params[gid] = {"weight": weight, "bias": bias, "columns": [lo, hi]}
            self.fan_in[gid] = fan_in
            self.part_gid[(out, lo, hi)] = gid
            self.dense_base[gid] = base

    def sequence_op(self, node, name: str, t: str, a: dict) -> bool:
        """The ops a sequence model adds or refuses; True if handled."""
        rank = len(self.shapes.get(node.input[0]) or [])
        last = int(a.get("axis", -1)) % max(rank, 1) == rank - 1
        if t in ("LayerNormalization", "RMSNormalization") and rank == 3 and last:
            gid = self.one(node, name, "layer_norm" if t == "LayerNormalization" else "rms_norm")
            self.params[gid] = {"scale": node.input[1], "bias": node.input[2] if len(node.input) > 2 else None}
            return True
        if t in ("Concat", "Flatten", "Reshape", "ReduceMean", "Softmax", "Attention", "Transpose", "Split"):
            raise _Unsupported(
                f"a {t} in a sequence model outside an attention pattern (sequence ops act per token or mix "
                "tokens by attention)",
                ATTENTION_HINT,
            )
        return False

    # ------------------------------------------------------------------ one node

    def one(self, node, name: str, op: str, **attrs) -> str:
        v = self.vals[node.input[0]]
        gid = self.new_id(name)
        self.emit(gid, op, [self.read(v, f"'{gid}'")], **attrs)
        self.vals[node.output[0]] = _Val(gid)
        return gid

    def visit(self, node, name: str, data: list[str]) -> None:
        t, a = node.op_type, _attrs(node)
        if self.sequence and self.sequence_op(node, name, t, a):
            return None
        if t == "Gemm":
            return self.gemm(node, name, a)
        if t == "MatMul":
            return self.matmul(node, name)
        if t == "Conv":
            return self.conv(node, name, a)
        if t in _ACTIVATIONS:
            return self.activation(node, name, t, a)
        if t in ("Add", "Sum"):
            return self.add(node, name)
        if t in ("Mul", "Div"):
            end = self.erf_gelu(node)
            if end is not None:  # x * 0.5 * (1 + erf(x / sqrt(2))), as exporters write GELU before opset 20
                gid = self.one(node, name, "activation")
                self.entries[gid]["fn"] = "gelu"
                self.vals[end] = self.vals.pop(node.output[0])
                return None
            return self.scale(node, name, t)
        if t == "Concat":
            rank = len(self.shapes.get(node.output[0]) or [0, 0])
            if int(a.get("axis", 1)) % max(rank, 1) != 1:
                raise _Unsupported(f"concatenation along axis {a.get('axis')}", "concatenate channels (axis 1)")
            gid = self.new_id(name)
            self.emit(gid, "concat", [self.read(self.vals[i], f"'{gid}'") for i in node.input])
            self.vals[node.output[0]] = _Val(gid)
            return None
        if t in ("MaxPool", "AveragePool"):
            return self.pool(node, name, t, a)
        if t == "GlobalAveragePool":
            self.one(node, name, "global_avg_pool")
            return None
        if t == "ReduceMean":
            return self.reduce_mean(node, name, a)
        if t in ("Flatten", "Reshape"):
            return self.flatten(node, name, t, a)
        if t == "Dropout":
            ratio = float(a.get("ratio", 0.5))
            if len(node.input) > 1 and node.input[1]:
                r = self.const(node.input[1])
                ratio = float(r) if r is not None else ratio
            self.one(node, name, "dropout", rate=ratio)
            return None
        if t == "Identity":
            self.one(node, name, "identity")
            return None
        rank = len(self.shapes.get(node.input[0]) or [])
        if t == "RMSNormalization" and rank == 2 and int(a.get("axis", -1)) in (-1, 1):  # opset 23, [B, F]
            if not np.all(self.weight(node.input[1], "scale") == 1.0):
                raise _Unsupported("RMSNormalization with a scale other than 1", "export it with scale 1")
            self.one(node, name, "rms_norm")
            return None
        if t in _NORMS | {"RMSNormalization"}:
            raise _Unsupported("a normalization layer, which the Q/C map analysis does not model", _NORM_HINT)
        if t in ("Attention", "MultiHeadAttention", "LSTM", "GRU", "RNN", "Gather"):
            raise _Unsupported("attention, embeddings and recurrent ops are not supported yet")
        raise _Unsupported("it is not an op of the sigprop graph")

    def weight(self, name: str, what: str) -> np.ndarray:
        w = self.const(name)
        if w is None:
            raise _Unsupported(f"its {what} '{name}' is computed, not an initializer", "export with constant weights")
        return w

    def dense_input(self, node, reader: str) -> str:
        dims = self.shapes.get(node.input[0])
        if dims is not None and len(dims) != (3 if self.sequence else 2):
            raise _Unsupported(
                f"a matrix product on a tensor of shape {dims}",
                "the graph's dense layers take [batch, features] (flatten first), or act per token of a "
                "[batch, tokens, features] sequence model's input",
            )
        return self.read(self.vals[node.input[0]], reader)

    def gemm(self, node, name: str, a: dict) -> None:
        if float(a.get("alpha", 1.0)) != 1.0 or float(a.get("beta", 1.0)) != 1.0 or int(a.get("transA", 0)):
            raise _Unsupported("Gemm with alpha, beta or transA", "export a plain linear layer")
        w = self.weight(node.input[1], "weight")
        units = int(w.shape[0] if int(a.get("transB", 0)) else w.shape[1])
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        if bias is not None:
            self.weight(bias, "bias")
        src = self.dense_input(node, f"'{name}'")
        fan_in = int(w.shape[1] if int(a.get("transB", 0)) else w.shape[0])
        self.dense(node, name, src, node.output[0], node.input[1], bias, units, fan_in)

    def matmul(self, node, name: str) -> None:
        if node.input[0] not in self.vals or node.input[1] in self.vals:
            raise _Unsupported("a product of two network tensors, or of a constant by the data", "use x @ W")
        w = self.weight(node.input[1], "weight")
        if w.ndim != 2:
            raise _Unsupported(f"MatMul by a weight of shape {list(w.shape)}", "a dense layer's weight is 2-d")
        out, bias = node.output[0], None
        users = self.consumers.get(out, [])
        if len(users) == 1 and users[0].op_type == "Add":
            other = [i for i in users[0].input if i != out]
            b = self.const(other[0]) if len(other) == 1 else None
            if b is not None and b.shape in ((w.shape[1],), (1, w.shape[1])):
                bias = other[0]
                self.skip.add(id(users[0]))
                out = users[0].output[0]
        src = self.dense_input(node, f"'{name}'")
        self.dense(node, name, src, out, node.input[1], bias, int(w.shape[1]), int(w.shape[0]))

    def conv(self, node, name: str, a: dict) -> None:
        w = self.weight(node.input[1], "weight")
        one_d = w.ndim == 3
        if w.ndim not in (3, 4):
            raise _Unsupported(f"a {w.ndim - 2}-d convolution", "the graph has 1-d and 2-d convolutions")
        if int(a.get("group", 1)) != 1:
            raise _Unsupported(f"a grouped convolution (group={a['group']})", "the analysis covers group=1 only")
        if any(int(d) != 1 for d in a.get("dilations", [1])):
            raise _Unsupported(f"a dilated convolution (dilations={a['dilations']})", "use dilation 1")
        kernel = [int(k) for k in w.shape[2:]]
        strides = [int(s) for s in a.get("strides", [1] * len(kernel))]
        auto = _decode(a.get("auto_pad", "NOTSET"))
        pads = [int(p) for p in a.get("pads", [0] * 2 * len(kernel))]
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            padding = "same"
        elif auto == "VALID" or not any(pads):
            padding = "valid"
        elif pads[: len(kernel)] != pads[len(kernel) :]:
            raise _Unsupported(f"asymmetric convolution padding {pads}", "pad every side alike")
        elif all(k % 2 == 1 for k in kernel) and pads[: len(kernel)] == [(k - 1) // 2 for k in kernel]:
            padding = "same"  # the same output size as the contract's 'same' for odd kernels, any stride
        elif not one_d and len(set(pads)) == 1:
            padding = pads[0]
        else:
            raise _Unsupported(f"convolution padding {pads} with kernel {kernel}", "use 'same' or one integer padding")
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        gid = self.new_id(name)
        self.emit(
            gid,
            "conv",
            [self.read(self.vals[node.input[0]], f"'{gid}'")],
            channels=int(w.shape[0]),
            kernel=kernel + [1] if one_d else kernel,
            stride=strides + [1] if one_d else strides,
            padding=padding,
            bias=bias is not None,
        )
        self.params[gid] = {"weight": node.input[1], "bias": bias}
        self.fan_in[gid] = int(w.shape[1])
        self.vals[node.output[0]] = _Val(gid)

    def activation(self, node, name: str, t: str, a: dict) -> None:
        fn = _ACTIVATIONS[t]
        if t == "Sigmoid":  # x * Sigmoid(x) is swish: the Mul is the activation
            users = self.consumers.get(node.output[0], [])
            if len(users) == 1 and users[0].op_type == "Mul" and set(users[0].input) == {node.input[0], node.output[0]}:
                self.skip.add(id(users[0]))
                gid = self.one(node, name, "activation")
                self.entries[gid]["fn"] = "swish"
                self.vals[users[0].output[0]] = self.vals.pop(node.output[0])
                return
        if t == "Gelu" and _decode(a.get("approximate", "none")) == "tanh":
            fn = "gelu_tanh"
        if t == "Selu" and (
            abs(float(a.get("alpha", _SELU[0])) - _SELU[0]) > 1e-6
            or abs(float(a.get("gamma", _SELU[1])) - _SELU[1]) > 1e-6
        ):
            raise _Unsupported("Selu with non-default alpha or gamma", "use the standard SELU")
        gid = self.one(node, name, "activation")
        self.entries[gid]["fn"] = fn

    def add(self, node, name: str) -> None:
        ins = [i for i in node.input if i]
        if any(i not in self.vals for i in ins):
            raise _Unsupported(
                "an add of a constant to the data (a bias shift)", "only sums of network tensors map to a 'sum' node"
            )
        dims = {tuple(self.shapes[i]) for i in ins if i in self.shapes}
        if len(dims) > 1:
            raise _Unsupported(f"an add that broadcasts shapes {sorted(dims)}", "sum tensors of one shape")
        vs = [self.vals[i] for i in ins]
        gid = self.new_id(name)
        wire = self.emit(gid, "sum", [v.gid for v in vs])  # weights: ScaledSums.finalize
        self.sums.add(wire, [v.gid for v in vs], [v.factor for v in vs])
        self.vals[node.output[0]] = _Val(gid)

    def _only_user(self, tensor: str, op_type: str):
        users = self.consumers.get(tensor, [])
        return users[0] if len(users) == 1 and users[0].op_type == op_type else None

    def _scalar_const(self, node, data: str) -> float | None:
        other = [i for i in node.input if i != data]
        c = self.const(other[0]) if len(other) == 1 else None
        return float(c.reshape(())) if c is not None and c.size == 1 else None

    def erf_gelu(self, node) -> str | None:
        """The output of an exact GELU written out from this ``x / sqrt(2)``, marking its nodes done; else None."""
        x = node.input[0]
        c = self._scalar_const(node, x)
        if c is None or x not in self.vals or abs((c if node.op_type == "Div" else 1.0 / c) - math.sqrt(2)) > 1e-5:
            return None
        erf = self._only_user(node.output[0], "Erf")
        add = erf and self._only_user(erf.output[0], "Add")
        if not add or abs((self._scalar_const(add, erf.output[0]) or 0.0) - 1.0) > 1e-6:
            return None
        mul = self._only_user(add.output[0], "Mul")
        if not mul or set(mul.input) != {x, add.output[0]}:
            return None
        half = self._only_user(mul.output[0], "Mul")
        if not half or abs((self._scalar_const(half, mul.output[0]) or 0.0) - 0.5) > 1e-6:
            return None
        self.skip.update(id(n) for n in (erf, add, mul, half))
        return half.output[0]

    def scale(self, node, name: str, t: str) -> None:
        a, b = node.input[0], node.input[1]
        if t == "Mul" and a in self.vals and b in self.vals:  # a gated MLP's gate: two tensors of one shape
            if a == b or self.shapes.get(a) != self.shapes.get(b):  # x * x: factors sharing every atom
                raise _Unsupported(f"a Mul of two network tensors that are one tensor or broadcast ({a}, {b})")
            gid = self.new_id(name)
            self.emit(gid, "mul", [self.read(self.vals[a], f"'{gid}'"), self.read(self.vals[b], f"'{gid}'")])
            self.vals[node.output[0]] = _Val(gid)
            return
        if (a in self.vals) == (b in self.vals):
            raise _Unsupported(f"a {t} of two network tensors", "the graph multiplies values by constants only")
        const = self.const(b if a in self.vals else a)
        if const is None or const.size != 1:
            raise _Unsupported(f"a {t} by a non-scalar or computed value", "scale by a scalar constant only")
        c = float(const.reshape(()))
        if t == "Div" and a not in self.vals:
            raise _Unsupported("a constant divided by the data")
        v = self.vals[a if a in self.vals else b]
        self.vals[node.output[0]] = _Val(v.gid, v.factor * (1.0 / c if t == "Div" else c))

    def pool(self, node, name: str, t: str, a: dict) -> None:
        kernel = [int(k) for k in a["kernel_shape"]]
        one_d = len(kernel) == 1
        strides = [int(s) for s in a.get("strides", [1] * len(kernel))]
        pads = [int(p) for p in a.get("pads", [0] * 2 * len(kernel))]
        if int(a.get("ceil_mode", 0)) or any(int(d) != 1 for d in a.get("dilations", [1])):
            raise _Unsupported("pooling with ceil_mode or dilation", "use ceil_mode=False and dilation 1")
        if _decode(a.get("auto_pad", "NOTSET")) not in ("NOTSET", "VALID") or len(set(pads)) > 1 or (one_d and pads[0]):
            raise _Unsupported(f"pooling padding {pads}", "pad every side alike with one integer (2-d pooling)")
        attrs = {"kernel": kernel + [1] if one_d else kernel, "stride": strides + [1] if one_d else strides}
        if pads and pads[0]:
            attrs["padding"] = pads[0]
        self.one(node, name, "max_pool" if t == "MaxPool" else "avg_pool", **attrs)

    def reduce_mean(self, node, name: str, a: dict) -> None:
        axes = a.get("axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            axes = self.const(node.input[1])
        dims = self.shapes.get(node.input[0]) or []
        rank = len(dims)
        got = sorted(int(x) % rank for x in (axes if axes is not None else [])) if rank else []
        if rank not in (3, 4) or got != list(range(2, rank)):
            raise _Unsupported(f"a mean over axes {got} of a rank-{rank} tensor", "only global average pooling")
        self.one(node, name, "global_avg_pool")

    def flatten(self, node, name: str, t: str, a: dict) -> None:
        dims_in, dims_out = self.shapes.get(node.input[0]), self.shapes.get(node.output[0])
        if dims_in is None or dims_out is None:
            raise _Unsupported("a reshape whose shapes the ONNX shape inference does not know", "export fixed shapes")
        if dims_in[1:] == dims_out[1:]:
            self.vals[node.output[0]] = self.vals[node.input[0]]
            return
        rest = dims_in[1:]
        if len(dims_out) != 2 or not all(isinstance(d, int) for d in rest) or dims_out[1] != math.prod(rest):
            raise _Unsupported(f"a reshape from {dims_in} to {dims_out}", "only flattening to [batch, features]")
        if len(rest) == 1:
            self.vals[node.output[0]] = self.vals[node.input[0]]
            return
        self.one(node, name, "flatten")


def graph_from_onnx(model_or_path, *, keep_fn: bool = False, assumptions: str = "strict") -> tuple[dict, dict]:
    """``(graph, params)``: the ``sigprop.graph/v1`` graph of an ONNX model and, for every dense and conv
    node, the names of its initializers ``{"weight": name, "bias": name or None}``.

    ``model_or_path``: an ``onnx.ModelProto``, its serialized bytes, or a file path. The input needs a
    fixed shape (the batch dimension may be symbolic). ``keep_fn`` and ``assumptions`` are those of
    ``sigprop.client.torch.graph_from_module``; the graph of a ``torch.onnx.export`` of a model equals
    ``graph_from_module``'s (the same request key; with the default exporter, the same ids for module
    calls), save for dropout, which an export in eval mode leaves out. See the module docstring for the
    ops covered; anything else raises ``SigpropError("unsupported_op")`` naming the op type and the node.
    """
    check_assumptions(assumptions)
    model = load(model_or_path)
    try:
        model = shape_inference.infer_shapes(model)
    except Exception as exc:  # noqa: BLE001 - onnx raises several types for a model it cannot infer
        raise SigpropError(
            "invalid_graph", f"ONNX shape inference failed: {exc}", "check the model with onnx.checker"
        ) from exc
    imp = _Importer(model)
    graph = imp.run()
    for nd in graph["nodes"]:
        if nd["op"] == "activation" and keep_fn:
            nd["fn"] = imp.entries[nd["id"]]["fn"]
    check(graph, imp)
    fns = (e["fn"] for e in imp.entries.values() if e["op"] == "activation")
    finish_graph(graph, fns, keep_fn=keep_fn, assumptions=assumptions)
    return graph, imp.params
