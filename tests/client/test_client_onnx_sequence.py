"""``graph_from_onnx`` on exported GPT-2-shaped sequence models (issue 36): pre-LN blocks with
attention written with plain ops (``softmax(q k^T * scale + causal mask) @ v``) or with
``F.scaled_dot_product_attention``, exported by the dynamo exporter (opset 20: MatMul/Softmax, opset
23: the ``Attention`` op) and by the TorchScript exporter. The graph equals ``graph_from_module``'s on
the sdpa twin of the model (same module names and weights), the engine solves it, and what the
pattern cannot map is refused by name."""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from torch import nn  # noqa: E402

import sigprop  # noqa: E402
from sigprop.client.onnx import graph_from_onnx  # noqa: E402
from sigprop.client.torch import graph_from_module  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402

D, H, T = 32, 4, 8


class Block(nn.Module):
    """GPT-2's block: x + proj(attn(ln1 x)), then x + out(gelu(fc(ln2 x)))."""

    def __init__(self, fused: bool, sdpa: bool, bias: str | None = None):
        super().__init__()
        self.fused, self.sdpa, self.bias = fused, sdpa, bias
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        if fused:
            self.qkv = nn.Linear(D, 3 * D)
        else:
            self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.proj, self.fc, self.act, self.out = (
            nn.Linear(D, D),
            nn.Linear(D, 4 * D),
            nn.GELU("tanh"),
            nn.Linear(4 * D, D),
        )

    def forward(self, x):
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).split(c, dim=-1) if self.fused else (self.q(h), self.k(h), self.v(h))
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // H))
            if self.bias == "alibi":  # a relative-position term: not a mask
                pos = torch.arange(t, dtype=torch.float32)
                a = a - 0.5 * (pos[:, None] - pos[None, :]).abs()
            if self.bias != "full":
                a = a.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
            if self.bias == "scale":
                a = a * 2.0
            y = a.softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, fused=False, sdpa=False, bias=None, n=2):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(fused, sdpa, bias) for _ in range(n)])
        self.ln_f = nn.LayerNorm(D)

    def forward(self, x):
        return self.ln_f(self.blocks(x))


def _export(model, x, exporter: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            buf = io.BytesIO()
            torch.onnx.export(model, (x,), buf, dynamo=False)
            return onnx.load_from_string(buf.getvalue())
        opset = 23 if exporter == "dynamo23" else 20
        return torch.onnx.export(model, (x,), dynamo=True, verbose=False, opset_version=opset).model_proto


def _twins(fused: bool):
    torch.manual_seed(0)
    plain = GPT(fused=fused).eval()
    sdpa = GPT(fused=fused, sdpa=True).eval()
    sdpa.load_state_dict(plain.state_dict())
    return plain, sdpa, torch.randn(2, T, D)


def _shape(graph):
    """Op counts and wiring, without the ids (the TorchScript exporter names nodes its own way)."""
    index = {nd["id"]: k for k, nd in enumerate(graph["nodes"])}
    return [
        (nd["op"], [index[i] for i in nd.get("inputs", [])], {k: v for k, v in nd.items() if k not in ("id", "inputs")})
        for nd in graph["nodes"]
    ]


@pytest.mark.parametrize("fused", [False, True], ids=["qkv", "fused"])
@pytest.mark.parametrize("sdpa", [False, True], ids=["matmul-softmax", "sdpa"])
@pytest.mark.parametrize("exporter", ["dynamo", "dynamo23", "torchscript"])
def test_exported_gpt_matches_graph_from_module(fused, sdpa, exporter):
    plain, twin, x = _twins(fused)
    model = twin if sdpa else plain
    graph, params = graph_from_onnx(_export(model, x, exporter), keep_fn=True)
    want = graph_from_module(twin, x, keep_fn=True)
    if exporter == "torchscript":
        assert _shape(graph) == _shape(want)
    else:
        assert graph == want  # ids too: the dynamo exporter keeps the module paths
    ops = [nd["op"] for nd in graph["nodes"]]
    assert ops.count("attention") == 2 and ops.count("layer_norm") == 5 and ops.count("dense") == 12
    att = [nd for nd in graph["nodes"] if nd["op"] == "attention"]
    assert all(nd["heads"] == H and nd["causal"] for nd in att)
    if exporter != "torchscript":
        assert att[0]["id"] == "blocks.0" and att[0]["inputs"][0] == ("blocks.0.qkv.q" if fused else "blocks.0.q")
    if fused:  # each part names the fused layer's weight and its block of output features
        parts = [params[g] for g in att[0]["inputs"]]
        assert [p["columns"] for p in parts] == [[0, D], [D, 2 * D], [2 * D, 3 * D]]
        assert len({p["weight"] for p in parts}) == 1
    sol = sigprop.solve(graph, "tat", "gelu_tanh", {"tau": 0.3}, attention={"shaping": "e-spa"})
    assert sol.token_kernel is not None and len(sol.token_kernel.output) == T


@pytest.mark.parametrize(
    "bias, match",
    [
        ("alibi", r"'.*Softmax.*' \(Softmax\): an additive bias on the attention logits that is not a mask"),
        ("scale", r"a softmax scale of 0.707107, not 1/sqrt\(d_head\) = 0.353553"),
    ],
)
def test_unmappable_attention_is_refused_by_name(bias, match):
    torch.manual_seed(0)
    model = GPT(bias=bias, n=1).eval()
    with pytest.raises(SigpropError, match=match) as err:
        graph_from_onnx(_export(model, torch.randn(2, T, D), "torchscript"))
    assert err.value.code == "unsupported_op" and err.value.hint


def test_full_attention_is_read_as_not_causal():
    torch.manual_seed(0)
    model = GPT(bias="full", n=1).eval()
    graph, _ = graph_from_onnx(_export(model, torch.randn(2, T, D), "dynamo"))
    (att,) = [nd for nd in graph["nodes"] if nd["op"] == "attention"]
    assert att["causal"] is False and att["heads"] == H


def _attention_op_model(**attrs) -> onnx.ModelProto:
    """x -> q, k, v = x @ Wq, x @ Wk, x @ Wv -> Attention (3-d, q_num_heads) -> @ Wo."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), n) for n in ("wq", "wk", "wv", "wo")
    ]
    nodes = [helper.make_node("MatMul", ["x", f"w{r}"], [r], name=r) for r in "qkv"]
    nodes.append(
        helper.make_node("Attention", ["q", "k", "v"], ["a"], name="att", q_num_heads=H, kv_num_heads=H, **attrs)
    )
    nodes.append(helper.make_node("MatMul", ["a", "wo"], ["y"], name="o"))
    g = helper.make_graph(
        nodes,
        "m",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", T, D])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", T, D])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])


def test_the_opset_attention_op_on_3d_inputs():
    graph, params = graph_from_onnx(_attention_op_model(is_causal=1))
    assert [(nd["id"], nd["op"]) for nd in graph["nodes"]] == [
        ("x", "input"), ("q", "dense"), ("k", "dense"), ("v", "dense"), ("att", "attention"), ("o", "dense"),
        ("output", "output"),
    ]  # fmt: skip
    assert graph["nodes"][4]["heads"] == H and graph["nodes"][4]["causal"] is True
    assert params["q"] == {"weight": "wq", "bias": None}
    with pytest.raises(SigpropError, match=r"'att' \(Attention\): a softcap"):
        graph_from_onnx(_attention_op_model(softcap=30.0))
    with pytest.raises(SigpropError, match=r"'att' \(Attention\): a custom softmax scale"):
        graph_from_onnx(_attention_op_model(scale=1.0))
