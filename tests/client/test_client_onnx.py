"""``sigprop.client.onnx.graph_from_onnx`` on models exported by ``torch.onnx.export`` and built with
``onnx.helper``: the exported graph has the same request key as ``graph_from_module`` on the torch
model, the params map names the initializers, and anything outside the graph is refused by op type
and node name."""

from __future__ import annotations

import io
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from torch import nn  # noqa: E402

from sigprop.client.onnx import graph_from_onnx  # noqa: E402
from sigprop.client.torch import graph_from_module  # noqa: E402
from sigprop.engine.solve import prepare  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402
from sigprop.schemas.solve import SolveRequest  # noqa: E402


class PreActBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.a1, self.c1 = nn.ReLU(), nn.Conv2d(c, c, 3, padding=1)
        self.a2, self.c2 = nn.ReLU(), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.c2(self.a2(self.c1(self.a1(x))))


class PreActResNet(nn.Module):
    def __init__(self, c: int = 16, blocks: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.blocks = nn.Sequential(*[PreActBlock(2 * c) for _ in range(blocks)])
        self.act, self.pool, self.fc = nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Linear(2 * c, 10)

    def forward(self, x):
        h = self.blocks(self.down(torch.relu(self.stem(x))))
        return self.fc(torch.flatten(self.pool(self.act(h)), 1))


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 10, bias=False)
    )


def _key(graph: dict) -> str:
    req = SolveRequest(graph=graph, method="tat", activation="leaky_relu", targets={"eta": 0.3})
    return prepare(req).key


def _export(model: nn.Module, x, *, dynamo: bool = False) -> bytes:
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        if dynamo:
            return torch.onnx.export(model, (x,), dynamo=True, verbose=False).model_proto.SerializeToString()
        buf = io.BytesIO()
        torch.onnx.export(model, (x,), buf, dynamo=False)
        return buf.getvalue()


@pytest.mark.parametrize("build, shape", [(mlp, (2, 1, 8, 8)), (PreActResNet, (2, 3, 8, 8))])
def test_torch_export_has_the_request_key_of_graph_from_module(build, shape, tmp_path):
    torch.manual_seed(0)
    model, x = build(), torch.randn(*shape)
    data = _export(model, x)
    path = tmp_path / "model.onnx"
    path.write_bytes(data)
    graph, params = graph_from_onnx(path)
    assert _key(graph) == _key(graph_from_module(model, x))
    assert graph_from_onnx(data)[0] == graph == graph_from_onnx(onnx.load(path))[0]  # bytes, path, ModelProto
    # each layer's initializers hold its module's parameters (a bias-free Linear is exported as a MatMul
    # by a transposed copy of its weight, under a name of the exporter's)
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    ops = {nd["id"]: nd["op"] for nd in graph["nodes"]}
    assert len(params) == len(layers) and all(ops[gid] in ("dense", "conv") for gid in params)
    for (gid, p), m in zip(params.items(), layers, strict=True):
        w, want = inits[p["weight"]], m.weight.detach().numpy()
        assert np.array_equal(w, want) or np.array_equal(w.T, want), gid
        assert (p["bias"] is None) == (m.bias is None)
        if p["bias"] is not None:
            assert np.array_equal(inits[p["bias"]], m.bias.detach().numpy())


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x):
        return x + self.f(x)


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.blocks = nn.Linear(4, 8), nn.Sequential(_Block(), _Block())
        self.act, self.mid, self.head = nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.act(self.mid(self.act(self.blocks(self.stem(x))))))  # self.act called twice


@pytest.mark.parametrize(
    "build", [lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2, bias=False)), _Nested]
)
def test_dynamo_export_ids_are_the_module_paths_graph_from_module_gives(build):
    """The default exporter names nodes node_linear_1; its metadata keeps the module path, which the ids
    are (``0``, ``blocks.0.f.1``, ``act:1`` for a second call), as are the params' keys; function
    calls keep their node's name (``add``). The input is the ONNX input's name."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model, x = build().eval(), torch.randn(2, 4)
    graph, params = graph_from_onnx(_export(model, x, dynamo=True))
    ids = [nd["id"] for nd in graph["nodes"]]
    want = [nd["id"] for nd in graph_from_module(model, x)["nodes"]]
    assert ids[1:] == want[1:] and len(set(ids)) == len(ids), (ids, want)
    layers = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert list(params) == layers
    if build is _Nested:
        assert {"blocks.0.f.1", "blocks.1.f.0", "add", "add_1", "act", "act:1"} <= set(ids)


@pytest.mark.slow
@pytest.mark.parametrize("build, shape", [(mlp, (2, 1, 8, 8)), (PreActResNet, (2, 3, 8, 8))])
def test_dynamo_export_has_the_same_request_key(build, shape):
    """torch 2.13's default exporter (torch.export + onnxscript): ReduceMean and Reshape where the
    TorchScript exporter writes GlobalAveragePool and Flatten; about 5 s per model."""
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model, x = build(), torch.randn(*shape)
    graph, params = graph_from_onnx(_export(model, x, dynamo=True))
    assert _key(graph) == _key(graph_from_module(model, x))
    assert len(params) == sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in model.modules())


@pytest.mark.parametrize("opset", [17, 20])
def test_gelu_written_out_before_opset_20_is_the_gelu_activation(opset):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    x = torch.randn(2, 8)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), buf, dynamo=False, opset_version=opset)
    graph, _ = graph_from_onnx(buf.getvalue(), keep_fn=True)
    assert [nd.get("fn") for nd in graph["nodes"] if nd["op"] == "activation"] == ["gelu", "gelu"]
    assert _key(graph) == _key(graph_from_module(model, x, keep_fn=True))


def _init(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def _model(nodes, inits, in_shape, out_shape, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def test_helper_built_cnn_covers_every_listed_op():
    rng = np.random.default_rng(0)
    s = 1 / math.sqrt(2)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("LeakyRelu", ["c1"], ["a1"], name="lrelu", alpha=0.1),
        helper.make_node("Conv", ["a1", "w2"], ["c2"], name="conv2", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c1", "c2"], ["s_raw"], name="res"),
        helper.make_node("Div", ["s_raw", "sqrt2"], ["s"], name="res_scale"),  # (c1 + c2) / sqrt(2)
        helper.make_node("Mul", ["s", "w08"], ["s08"], name="m08"),
        helper.make_node("Sigmoid", ["s"], ["sig"], name="swish_sig"),
        helper.make_node("Mul", ["s", "sig"], ["sw"], name="swish"),
        helper.make_node("Conv", ["sw", "w3"], ["c3"], name="conv3", kernel_shape=[1, 1]),
        helper.make_node("Mul", ["c3", "w06"], ["c306"], name="m06"),
        helper.make_node("Sum", ["s08", "c306"], ["s2"], name="res2"),  # 0.8 s + 0.6 c3
        helper.make_node("Identity", ["s2"], ["s2i"], name="ident"),
        helper.make_node("Concat", ["s2i", "c3"], ["cat"], name="cat", axis=1),
        helper.make_node("Elu", ["cat"], ["e"], name="elu"),
        helper.make_node("MaxPool", ["e"], ["mp"], name="mpool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("AveragePool", ["mp"], ["ap"], name="apool", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["ap"], ["gap"], name="gap"),
        helper.make_node("Reshape", ["gap", "shape"], ["flat"], name="flat"),
        helper.make_node("Dropout", ["flat", "ratio"], ["dr"], name="drop"),
        helper.make_node("MatMul", ["dr", "wd"], ["mm"], name="fc"),
        helper.make_node("Add", ["mm", "bd"], ["fcb"], name="fc_bias"),
        helper.make_node("Tanh", ["fcb"], ["t"], name="tanh"),
        helper.make_node("Gemm", ["t", "wg", "bg"], ["y"], name="head", transB=1),
    ]
    inits = [
        _init("w1", rng.standard_normal((8, 3, 3, 3))),
        _init("b1", np.zeros(8)),
        _init("w2", rng.standard_normal((8, 8, 3, 3))),
        _init("w3", rng.standard_normal((8, 8, 1, 1))),
        _init("sqrt2", math.sqrt(2)),
        _init("w08", 0.8),
        _init("w06", [0.6]),
        numpy_helper.from_array(np.array([0, -1], dtype=np.int64), "shape"),
        _init("ratio", 0.25),
        _init("wd", rng.standard_normal((16, 12))),
        _init("bd", np.zeros(12)),
        _init("wg", rng.standard_normal((5, 12))),
        _init("bg", np.zeros(5)),
    ]
    graph, params = graph_from_onnx(_model(nodes, inits, [4, 3, 8, 8], [4, 5]), keep_fn=True)
    nodes_by_id = {nd["id"]: nd for nd in graph["nodes"]}
    assert nodes_by_id["x"]["shape"] == [3, 8, 8]
    assert nodes_by_id["conv1"] == {
        "id": "conv1", "op": "conv", "inputs": ["x"], "channels": 8, "kernel": [3, 3], "stride": [1, 1],
        "padding": "same", "bias": True,
    }  # fmt: skip
    assert nodes_by_id["conv2"]["bias"] is False and nodes_by_id["conv3"]["padding"] == "valid"
    assert nodes_by_id["lrelu"]["fn"] == "leaky_relu" and nodes_by_id["elu"]["fn"] == "elu"
    assert nodes_by_id["swish_sig"]["fn"] == "swish" and nodes_by_id["swish_sig"]["inputs"] == ["res"]
    assert nodes_by_id["res"]["weights"] == pytest.approx([s, s])  # the Div folded into the sum
    assert nodes_by_id["res2"]["inputs"] == ["res", "conv3"]
    assert nodes_by_id["res2"]["weights"] == pytest.approx([0.8, 0.6])
    assert nodes_by_id["ident"]["op"] == "identity" and nodes_by_id["cat"]["inputs"] == ["ident", "conv3"]
    assert nodes_by_id["mpool"]["kernel"] == [2, 2] and nodes_by_id["apool"]["padding"] == 1
    assert [nodes_by_id[k]["op"] for k in ("gap", "flat", "drop")] == ["global_avg_pool", "flatten", "dropout"]
    assert nodes_by_id["drop"]["rate"] == pytest.approx(0.25)
    assert nodes_by_id["fc"] == {"id": "fc", "op": "dense", "inputs": ["drop"], "units": 12, "bias": True}
    assert "fc_bias" not in nodes_by_id and nodes_by_id["tanh"]["inputs"] == ["fc"]
    assert nodes_by_id["head"]["units"] == 5
    assert params == {
        "conv1": {"weight": "w1", "bias": "b1"},
        "conv2": {"weight": "w2", "bias": None},
        "conv3": {"weight": "w3", "bias": None},
        "fc": {"weight": "wd", "bias": "bd"},
        "head": {"weight": "wg", "bias": "bg"},
    }
    assert _key(graph)  # a valid request


@pytest.mark.parametrize(
    "op_type, attrs, fn",
    [
        ("Relu", {}, "relu"),
        ("LeakyRelu", {"alpha": 0.2}, "leaky_relu"),
        ("Tanh", {}, "tanh"),
        ("Sigmoid", {}, "sigmoid"),
        ("Softplus", {}, "softplus"),
        ("Softsign", {}, "softsign"),
        ("Elu", {}, "elu"),
        ("Selu", {}, "selu"),
        ("Gelu", {}, "gelu"),
        ("Gelu", {"approximate": "tanh"}, "gelu_tanh"),
        ("Erf", {}, "erf"),
        ("Atan", {}, "atan"),
        ("Asinh", {}, "asinh"),
    ],
)
def test_every_catalogue_activation_op_and_the_flatten_op(op_type, attrs, fn):
    """Conv -> activation -> Flatten -> Gemm for each activation op the importer maps (the catalogue
    names it gives are the engine's), with an ONNX Flatten (not a Reshape) before the dense layer."""
    from sigprop.schemas.activations import CATALOGUE

    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node(op_type, ["c"], ["a"], name="act", **attrs),
        helper.make_node("Flatten", ["a"], ["f"], name="flat", axis=1),
        helper.make_node("Gemm", ["f", "wg"], ["y"], name="head", transB=1),
    ]
    inits = [_init("w", np.ones((4, 3, 3, 3))), _init("wg", np.ones((5, 64)))]
    graph, params = graph_from_onnx(_model(nodes, inits, [2, 3, 4, 4], [2, 5], opset=20), keep_fn=True)
    assert [(nd["id"], nd["op"]) for nd in graph["nodes"]] == [
        ("x", "input"), ("conv", "conv"), ("act", "activation"), ("flat", "flatten"), ("head", "dense"),
        ("output", "output"),
    ]  # fmt: skip
    assert graph["nodes"][2]["fn"] == fn and fn in CATALOGUE
    assert params == {"conv": {"weight": "w", "bias": None}, "head": {"weight": "wg", "bias": None}}
    assert _key(graph)


def _mlp_with(node, extra_inits=()) -> onnx.ModelProto:
    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], name="fc1", transB=1), node]
    out = node.output[0]
    nodes.append(helper.make_node("Gemm", [out, "w2"], ["y"], name="fc2", transB=1))
    inits = [_init("w", np.ones((6, 4))), _init("w2", np.ones((3, 6))), *extra_inits]
    return _model(nodes, inits, [2, 4], [2, 3])


@pytest.mark.parametrize(
    "node, inits, match",
    [
        (helper.make_node("Softmax", ["h"], ["o"], name="probs"), (), r"ONNX node 'probs' \(Softmax\) is not supp"),
        (
            helper.make_node("BatchNormalization", ["h", "g", "b", "m", "v"], ["o"], name="bn1"),
            [_init(n, np.ones(6)) for n in "gbmv"],
            r"ONNX node 'bn1' \(BatchNormalization\) is not supported: a normalization",
        ),
        (helper.make_node("Add", ["h", "c"], ["o"], name="shift"), [_init("c", np.ones(6))], r"'shift' \(Add\).*const"),
        (helper.make_node("Mul", ["h", "h"], ["o"], name="sq"), (), r"'sq' \(Mul\).*two network tensors"),
        (helper.make_node("Mul", ["h", "c"], ["o"], name="half"), [_init("c", 0.5)], r"'fc2' reads 'fc1' multiplied"),
    ],
)
def test_other_ops_are_refused_by_op_type_and_node_name(node, inits, match):
    with pytest.raises(SigpropError, match=match) as err:
        graph_from_onnx(_mlp_with(node, inits))
    assert err.value.code == "unsupported_op" and err.value.hint


def test_unnormalized_sum_weights_and_bad_inputs_are_refused():
    nodes = [
        helper.make_node("Gemm", ["x", "w"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["a"], name="act"),
        helper.make_node("Gemm", ["a", "w1"], ["h2"], name="fc2", transB=1),
        helper.make_node("Add", ["h", "h2"], ["y"], name="res"),
        # 0.8 and 0.8 on the branches: sum of squares 1.28
    ]
    model = _model(nodes, [_init("w", np.ones((4, 4))), _init("w1", np.ones((4, 4)))], [2, 4], [2, 4])
    graph, _ = graph_from_onnx(model)
    assert {nd["id"]: nd for nd in graph["nodes"]}["res"]["weights"] == pytest.approx([2**-0.5] * 2)
    scaled = [
        helper.make_node("Mul", ["h", "k"], ["hk"], name="m1"),
        helper.make_node("Mul", ["h2", "k"], ["h2k"], name="m2"),
        helper.make_node("Add", ["hk", "h2k"], ["y"], name="res"),
    ]
    inits = [_init("w", np.ones((4, 4))), _init("w1", np.ones((4, 4))), _init("k", 0.8)]
    with pytest.raises(SigpropError, match=r"not valid: sum node 'res' weights have sum of squares 1.28"):
        graph_from_onnx(_model(nodes[:3] + scaled, inits, [2, 4], [2, 4]))
    with pytest.raises(SigpropError, match="fixed input shape"):
        graph_from_onnx(_model([helper.make_node("Relu", ["x"], ["y"])], [], [2, 4, 3, 3, 3], [2, 4, 3, 3, 3]))
    with pytest.raises(TypeError):
        graph_from_onnx(42)


def test_a_sum_only_sums_read_takes_its_normalization_from_the_scaling():
    """0.8 * (a + b) / sqrt(2) + 0.6 * h: the inner sum is (a + b) / sqrt(2), the outer weights [0.8, 0.6]."""
    nodes = [
        helper.make_node("Gemm", ["x", "w"], ["a"], name="fa", transB=1),
        helper.make_node("Relu", ["a"], ["ra"], name="act"),
        helper.make_node("Gemm", ["ra", "w"], ["b"], name="fb", transB=1),
        helper.make_node("Add", ["a", "b"], ["s"], name="inner"),
        helper.make_node("Mul", ["s", "k"], ["sk"], name="scale"),  # k = 0.8 / sqrt(2)
        helper.make_node("Relu", ["b"], ["rb"], name="act2"),
        helper.make_node("Gemm", ["rb", "w"], ["h"], name="fh", transB=1),
        helper.make_node("Mul", ["h", "k6"], ["h6"], name="scale6"),
        helper.make_node("Add", ["sk", "h6"], ["y"], name="outer"),
    ]
    inits = [_init("w", np.ones((4, 4))), _init("k", 0.8 / math.sqrt(2)), _init("k6", 0.6)]
    graph, _ = graph_from_onnx(_model(nodes, inits, [2, 4], [2, 4]), assumptions="warn")
    weights = {nd["id"]: nd["weights"] for nd in graph["nodes"] if nd["op"] == "sum"}
    assert weights["inner"] == pytest.approx([2**-0.5] * 2) and weights["outer"] == pytest.approx([0.8, 0.6])


def test_import_without_onnx_says_how_to_install():
    code = (
        "import sys; sys.modules['onnx'] = None\n"
        "try:\n    import sigprop.client.onnx\nexcept ImportError as e:\n    print('IMPORT-ERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "IMPORT-ERROR" in out.stdout and "pip install 'sigprop[onnx]'" in out.stdout, out.stdout + out.stderr
