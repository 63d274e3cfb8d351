"""The torch adapter on sequence models (issue 28): ShapedAttention, extraction of GPT-style blocks
and nn.MultiheadAttention, apply installing the answer's attention matrices, and the output token
kernel measured against the answer's ``token_kernel.output``."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

import sigprop  # noqa: E402
from sigprop.client.torch import apply, diagnose, graph_from_module  # noqa: E402
from sigprop.client.torch.attention import ShapedAttention  # noqa: E402
from sigprop.client.torch.sequence_diagnose import diagnose_tokens, orthonormal_tokens  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402
from sigprop.schemas.attention_init import expand_attention  # noqa: E402


class GPTBlock(nn.Module):
    """A nanoGPT-style block without shortcuts: separate or fused q/k/v, sdpa, optional pre-LN."""

    def __init__(self, d: int, heads: int, fused: bool = False, norms: bool = False):
        super().__init__()
        self.heads, self.fused, self.norms = heads, fused, norms
        if fused:
            self.qkv = nn.Linear(d, 3 * d)
        else:
            self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj, self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        if norms:
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        B, T, C = x.size()
        h = self.ln1(x) if self.norms else x
        if self.fused:
            q, k, v = self.qkv(h).split(C, dim=2)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        h = self.ln2(x) if self.norms else x
        return self.fc2(F.relu(self.fc1(h)))


class GPT(nn.Module):
    def __init__(self, d=16, heads=2, depth=2, **kw):
        super().__init__()
        self.blocks = nn.Sequential(*[GPTBlock(d, heads, **kw) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(x)


class MHA(nn.Module):
    def __init__(self, d=16, heads=2, t=8, causal=True):
        super().__init__()
        self.att, self.fc = nn.MultiheadAttention(d, heads, batch_first=True), nn.Linear(d, d)
        self.register_buffer("mask", torch.triu(torch.full((t, t), -math.inf), 1) if causal else None)

    def forward(self, x):
        return self.fc(torch.relu(self.att(x, x, x, attn_mask=self.mask, need_weights=False)[0]))


class TemplateBlock(nn.Module):
    """Block i of the `transformer` template, its modules at the template's node ids."""

    def __init__(self, width: int, heads: int, seq_len: int):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.attn = ShapedAttention(heads, seq_len, causal=True)
        self.proj = nn.Linear(width, width)
        self.fc1, self.act, self.fc2 = nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)

    def forward(self, h):
        a = self.proj(self.attn(self.q(h), self.k(h), self.v(h)))
        return self.fc2(self.act(self.fc1(a)))


class TemplateNet(nn.Module):
    def __init__(self, depth: int, width: int, heads: int, seq_len: int):
        super().__init__()
        self.depth = depth
        for i in range(depth):
            self.add_module(f"b{i}", TemplateBlock(width, heads, seq_len))

    def forward(self, x):
        for i in range(self.depth):
            x = getattr(self, f"b{i}")(x)
        return x


def _heads(x, h):
    b, t, d = x.shape
    return x.view(b, t, h, d // h).transpose(1, 2)


# -- ShapedAttention ------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_shaped_attention_by_default_is_scaled_dot_product_attention(causal):
    torch.manual_seed(0)
    m = ShapedAttention(4, 16, causal)
    q, k, v = (torch.randn(3, 12, 32) for _ in range(3))
    want = F.scaled_dot_product_attention(_heads(q, 4), _heads(k, 4), _heads(v, 4), is_causal=causal)
    assert torch.allclose(m(q, k, v), want.transpose(1, 2).reshape(3, 12, 32), atol=1e-6)


def _measured_matrix(m: ShapedAttention, q, k, t: int) -> torch.Tensor:
    """A of one head measured by feeding one-hot value tokens (d_head >= T)."""
    width = q.shape[-1]
    v = torch.zeros(1, t, width)
    v[0, torch.arange(t), torch.arange(t)] = 1.0  # head 0's first T features
    with torch.no_grad():
        return m(q, k, v)[0, :, :t]


GENERATORS = {
    "e-spa": {"form": "cholesky_ratio", "target": {"family": "exponential", "gamma": 0.2},
              "source": {"family": "exponential", "gamma": 0.5}},
    "u-spa": {"form": "cholesky_ratio", "target": {"family": "uniform", "rho": 0.6}, "source": {"family": "identity"}},
    "value-skipinit": {"form": "value_skipinit", "alpha": 1.0, "beta": 0.0},
    "shaped": {"form": "shaped", "temperature": 1.0},
}  # fmt: skip


@pytest.mark.parametrize("name", list(GENERATORS))
def test_shaped_attention_installs_the_answer_matrix(name):
    t = 8
    init = expand_attention(GENERATORS[name], t, True)
    m = ShapedAttention(2, t, True, d_model=32).load_init(init)
    k = torch.randn(1, t, 32)
    got = _measured_matrix(m, torch.zeros(1, t, 32), k, t)
    assert torch.allclose(got.double(), torch.as_tensor(init.matrix()), atol=1e-6)
    assert m.alpha.requires_grad == m.beta.requires_grad == (name == "value-skipinit")


# -- extraction -----------------------------------------------------------------------------------


def _ops(graph):
    return [(nd["id"], nd["op"], nd.get("inputs", [])) for nd in graph["nodes"]]


@pytest.mark.parametrize("fused", [False, True])
def test_a_gpt_block_stack_is_read_as_a_sequence_graph(fused):
    graph = graph_from_module(GPT(depth=2, fused=fused), torch.randn(2, 8, 16))
    nodes = graph["nodes"]
    assert nodes[0] == {"id": "x", "op": "input", "shape": [8, 16], "sequence": True}
    q = "qkv.q" if fused else "q"
    for i, prev in ((0, "x"), (1, "blocks.0.fc2")):
        p = f"blocks.{i}."
        qkv = [p + (f"qkv.{r}" if fused else r) for r in "qkv"]
        by_id = {nd["id"]: nd for nd in nodes}
        for gid in qkv:
            assert by_id[gid] == {"id": gid, "op": "dense", "inputs": [prev], "units": 16, "bias": True}
        att = f"blocks.{i}"
        assert by_id[att] == {"id": att, "op": "attention", "inputs": qkv, "heads": 2, "causal": True}
        assert by_id[p + "proj"]["inputs"] == [att]
    assert [nd["op"] for nd in nodes].count("attention") == 2 and q in nodes[1]["id"]
    assert [nd["op"] for nd in nodes[-4:]] == ["dense", "activation", "dense", "output"]


def test_layer_norms_and_multihead_attention_are_read():
    g = graph_from_module(GPT(depth=1, norms=True), torch.randn(2, 8, 16))
    assert _ops(g)[1] == ("blocks.0.ln1", "layer_norm", ["x"])
    assert ("blocks.0.ln2", "layer_norm", ["blocks.0.proj"]) in _ops(g)
    g = graph_from_module(MHA(), torch.randn(2, 8, 16))
    assert _ops(g) == [
        ("x", "input", []),
        ("att.q", "dense", ["x"]),
        ("att.k", "dense", ["x"]),
        ("att.v", "dense", ["x"]),
        ("att", "attention", ["att.q", "att.k", "att.v"]),
        ("att.out_proj", "dense", ["att"]),
        ("relu", "activation", ["att.out_proj"]),
        ("fc", "dense", ["relu"]),
        ("output", "output", ["fc"]),
    ]
    assert g["nodes"][4]["causal"] is True
    assert graph_from_module(MHA(causal=False), torch.randn(2, 8, 16))["nodes"][4]["causal"] is False
    blocked = MHA(causal=False)
    blocked.mask = torch.ones(8, 8, dtype=torch.bool).triu(1)  # nn.MultiheadAttention: True = may not attend
    assert graph_from_module(blocked, torch.randn(2, 8, 16))["nodes"][4]["causal"] is True
    blocked.mask = ~blocked.mask  # that is sdpa's convention: not the causal mask here
    with pytest.raises(SigpropError, match="not the causal mask"):
        graph_from_module(blocked, torch.randn(2, 8, 16))


def test_the_template_model_has_the_template_ids():
    g = graph_from_module(TemplateNet(2, 16, 2, 8), torch.randn(2, 8, 16))
    ids = [nd["id"] for nd in g["nodes"]]
    block = ["q", "k", "v", "attn", "proj", "fc1", "act", "fc2"]
    assert ids == ["x", *[f"b{i}.{n}" for i in range(2) for n in block], "output"]


class _Cross(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.pre = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return F.scaled_dot_product_attention(
            _heads(self.q(x), 2), _heads(self.k(self.pre(x)), 2), _heads(self.v(x), 2)
        ).transpose(1, 2).flatten(2)  # fmt: skip


class _Raw(nn.Module):  # attention on the input itself: q, k, v are no dense layers
    def forward(self, x):
        return F.scaled_dot_product_attention(_heads(x, 2), _heads(x, 2), _heads(x, 2)).transpose(1, 2).flatten(2)


class _Shared(nn.Module):  # one Linear output as query, key and value
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 16)

    def forward(self, x):
        h = _heads(self.qkv(x), 2)
        return F.scaled_dot_product_attention(h, h, h).transpose(1, 2).flatten(2)


class _Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.head = nn.Linear(16, 16), nn.Linear(128, 4)

    def forward(self, x):
        return self.head(self.up(x).flatten(1))


@pytest.mark.parametrize(
    "model, says",
    [
        (_Cross(), "cross-attention"),
        (_Raw(), "not by an nn.Linear"),
        (_Shared(), "are the same Linear output"),
        (_Flat(), "a flatten in a sequence model"),
        (nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), "TransformerEncoderLayer: attention"),
    ],
)
@pytest.mark.parametrize("allow", [False, True])
def test_what_a_sequence_graph_cannot_hold_is_refused_by_name(model, says, allow):
    with pytest.raises(SigpropError) as info:
        graph_from_module(model, torch.randn(2, 8, 16), allow_unsupported=allow)
    assert info.value.code == "unsupported_op" and says in info.value.message, info.value.message


# -- apply ----------------------------------------------------------------------------------------


def _solve(graph, shaping="e-spa", eta=0.3, **extra):
    return sigprop.solve(graph, "tat", "leaky_relu", {"eta": eta}, attention={"shaping": shaping, **extra})


def _captured(model, path):
    """(q, k) a ShapedAttention at ``path`` receives when ``model`` runs on orthonormal tokens."""
    seen = {}
    mod = model.get_submodule(path)
    hook = mod.register_forward_hook(lambda m, args, out: seen.update(q=args[0], k=args[1]))
    with torch.no_grad():
        model(orthonormal_tokens(1, 8, 16))
    hook.remove()
    return mod, seen["q"], seen["k"]


_MODELS = {"gpt": lambda: GPT(), "gpt-fused": lambda: GPT(fused=True), "mha": lambda: MHA(),
           "template": lambda: TemplateNet(2, 16, 2, 8)}  # fmt: skip


@pytest.mark.parametrize("name, shaping", [*((n, "e-spa") for n in _MODELS), ("gpt-fused", "u-spa"), ("mha", "u-spa")])
def test_apply_installs_the_answer_attention_matrices(name, shaping):
    make = _MODELS[name]
    model = make()
    x = torch.randn(2, 8, 16)
    graph = graph_from_module(model, x)
    sol = _solve(graph, shaping)
    rep = apply(model, sol, graph=graph, example_input=x, seed=0)
    assert rep.complete and not rep.missing_layers, rep.summary()
    paths = rep.model.sigprop_sequence["attention"]
    generators = {e.node: e.generator for e in sol.attention.layers}
    assert set(paths) == set(generators) and len(paths) >= 1
    for gid, path in paths.items():
        mod, q, k = _captured(rep.model, path)
        assert torch.count_nonzero(q) == 0  # zero query weights and biases: logits = bias alone
        want = expand_attention(generators[gid], 8, True).matrix()
        assert torch.allclose(_measured_matrix(mod, q, k, 8).double(), torch.as_tensor(want), atol=1e-5)


@pytest.mark.parametrize("shaping", ["value-skipinit", "shaped"])
def test_value_skipinit_and_shaped_attention_are_the_identity_at_init(shaping):
    model = GPT(depth=1)
    x = torch.randn(2, 8, 16)
    graph = graph_from_module(model, x)
    sol = _solve(graph, shaping)
    rep = apply(model, sol, graph=graph, example_input=x, seed=0)
    mod, q, k = _captured(rep.model, rep.model.sigprop_sequence["attention"]["blocks.0"])
    assert mod.alpha.requires_grad == mod.beta.requires_grad == (shaping == "value-skipinit")
    assert bool(mod.shaped) == (shaping == "shaped") and mod.d_model == 16
    exact = torch.count_nonzero(q) == 0  # the answer zeroes the queries (shaped: at infinite width only)
    got = _measured_matrix(mod, q, k, 8)
    assert torch.allclose(got, torch.eye(8), atol=1e-6 if exact else 0.1), got


def test_apply_resets_layer_norms_and_refuses_in_place():
    model = GPT(depth=1, norms=True)
    with torch.no_grad():
        model.blocks[0].ln1.weight.fill_(3.0)
    x = torch.randn(2, 8, 16)
    graph = graph_from_module(model, x)
    sol = _solve(graph)
    rep = apply(model, sol, graph=graph, example_input=x, seed=0)
    assert torch.all(rep.model.get_submodule("blocks.0.ln1").weight == 1.0)
    assert float(model.blocks[0].ln1.weight.detach()[0]) == 3.0  # the model itself is untouched
    with pytest.raises(ValueError, match="not available for sequence models"):
        apply(model, sol, graph=graph, example_input=x, inplace=True)


# -- the output token kernel ------------------------------------------------------------------------


def _token_kernel_check(depth, seq_len, width, heads, shaping, networks=8, eta=0.5):
    sol = sigprop.solve(
        {"template": "transformer", "depth": depth, "seq_len": seq_len, "width": width, "heads": heads},
        "tat",
        "leaky_relu",
        {"eta": eta},
        attention={"shaping": shaping},
    )
    model = TemplateNet(depth, width, heads, seq_len)
    x = torch.randn(2, seq_len, width)
    nets = [apply(model, sol, example_input=x, seed=s).model for s in range(networks)]
    return diagnose_tokens(nets, sol, batch=1)


@pytest.mark.parametrize("shaping", ["e-spa", pytest.param("u-spa", marks=pytest.mark.slow)])
def test_a_small_transformer_output_token_kernel_matches_the_answer(shaping):
    torch.manual_seed(0)
    diag = _token_kernel_check(2, 8, 128, 2, shaping, eta=0.3)
    assert diag.noise_source == "networks" and diag.ok, str(diag)
    assert np.all(np.abs(diag.error) <= 3 * diag.noise + 0.02), str(diag)


@pytest.mark.slow
@pytest.mark.parametrize("shaping", ["e-spa", "u-spa"])
def test_the_transformer_template_output_token_kernel_matches_the_answer(shaping):
    """Issue 28's done-when: T = 64, 12 blocks, causal, no shortcuts, no norms, width 512, tat
    leaky_relu, 8 networks: every output token-kernel entry within 3 standard errors + 0.02."""
    torch.manual_seed(0)
    diag = _token_kernel_check(12, 64, 512, 8, shaping, eta=0.8)
    print(f"{shaping}: max |error| {diag.max_error:.4g}, max error / SE {diag.max_sigmas:.3g}")
    assert np.all(np.abs(diag.error) <= 3 * diag.noise + 0.02), str(diag)


def test_diagnose_of_one_applied_sequence_model_states_its_noise():
    model = TemplateNet(2, 64, 2, 8)
    x = torch.randn(2, 8, 64)
    sol = _solve(graph_from_module(model, x))
    net = apply(model, sol, example_input=x, seed=0).model
    diag = diagnose(net, sol, x)
    assert diag.noise_source == "stated" and diag.predicted.shape == (8, 8)
    rows = {n.id: n for n in diag.nodes}
    assert rows["b0.q"].op == "query" and rows["b0.q"].q_measured == 0.0
    assert abs(rows["b0.attn"].q_measured - 1.0) < 1e-4  # orthogonal k/v of orthonormal tokens, E-SPA rows
    assert "output token kernel" in str(diag)
    with pytest.raises(ValueError, match="needs the model apply"):
        diagnose(model, sol, x)  # not applied: no answer matrices to diagnose


def test_the_gpt_shaping_example_runs(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "gpt_shaping.py"
    spec = importlib.util.spec_from_file_location("gpt_shaping", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(depth=2, seq_len=8, width=32, heads=2, eta=0.3)
    out = capsys.readouterr().out
    assert "ShapedAttention(heads=2, causal=True), cholesky_ratio" in out and "output token kernel" in out
    assert "0 of 64 entries off" in out, out
