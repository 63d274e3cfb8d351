"""``rms_norm`` and ``mul`` in the ONNX reader (issue 34): ``Mul`` of two network tensors of one shape
is a ``mul`` node (by a scalar constant it stays a scale), ``RMSNormalization`` (opset 23) over the
features of ``[B, F]`` with scale 1 an ``rms_norm`` node; with another scale it is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from sigprop.client.onnx import graph_from_onnx  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402


def _gated(scale: float = 1.0, halve: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = {n: rng.standard_normal((16, 16)) / 4 for n in ("w1", "wg", "wu", "wd")}
    inits |= {"scale": np.full(16, scale), "half": np.array(0.5)}
    nodes = [
        helper.make_node("Gemm", ["x", "w1"], ["h1"], name="dense1"),
        helper.make_node("RMSNormalization", ["h1", "scale"], ["n"], name="norm", axis=-1),
        helper.make_node("Gemm", ["n", "wg"], ["g"], name="gate"),
        helper.make_node("Tanh", ["g"], ["ga"], name="act"),
        helper.make_node("Gemm", ["n", "wu"], ["u"], name="up"),
        helper.make_node("Mul", ["ga", "u"], ["m"], name="gated"),
        helper.make_node("Gemm", ["m", "wd"], ["y0" if halve else "y"], name="down"),
    ]
    if halve:  # a tensor times a constant: a scale, not a product
        nodes.append(helper.make_node("Mul", ["y0", "half"], ["y"], name="scaled"))
    graph = helper.make_graph(
        nodes,
        "gated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_a_gated_onnx_graph_reads_rms_norm_and_mul():
    graph, _ = graph_from_onnx(_gated())
    ops = {nd["id"]: (nd["op"], nd.get("inputs", [])) for nd in graph["nodes"]}
    assert ops["norm"] == ("rms_norm", ["dense1"])
    assert ops["gated"] == ("mul", ["act", "up"])
    with pytest.raises(SigpropError, match="multiplied by 0.5, a scaling"):  # Mul by a constant: a scale, as before
        graph_from_onnx(_gated(halve=True))


def test_an_rms_normalization_with_a_trained_scale_is_refused():
    with pytest.raises(SigpropError, match="RMSNormalization with a scale other than 1"):
        graph_from_onnx(_gated(scale=2.0))
