"""``sigprop.client.torch.diagnose``: per-layer q and c of an applied model against the answer's
prediction (answers from the engine in-process).

Tolerances: one network of width 512 and 64 input pairs; a cosine between two 512-dimensional
features fluctuates by about (1 - c^2) / sqrt(512) = 0.03 per pair, 0.004 over 64 pairs, and the
finite-width deviations compound over 20 layers, so c is checked to 0.06 and q (a mean of 512 x 64
squares per layer, compounding likewise) to 0.12 on the hidden layers. The last layer has 10 units:
its figures are shown but not checked."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from sigprop.client.diagnosis import Diagnosis, LayerDiagnosis  # noqa: E402
from sigprop.client.torch import apply, diagnose, graph_from_module, input_pair  # noqa: E402
from sigprop.engine.solve import solve  # noqa: E402
from sigprop.schemas.solve import SolveRequest  # noqa: E402

WIDTH = 512


def _mlp(depth: int = 20) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


class ConvNet(nn.Module):
    def __init__(self, c: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.body(x)), 1))


def _solve(graph: dict, method: str = "tat", activation: str = "leaky_relu", targets=None):
    return solve(
        SolveRequest(
            graph=graph, method=method, activation=activation, targets={"eta": 0.6} if targets is None else targets
        )
    )


@pytest.fixture(scope="module")
def mlp_case():
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(64, WIDTH)
    graph = graph_from_module(model, x)
    sol = _solve(graph)
    return model, x, graph, sol


def test_input_pair_has_q_one_and_the_cosine_asked_for():
    x = torch.randn(5, 3, 4, 4) * 7 + 1
    x1, x2 = input_pair(x, 0.3)
    for v in (x1, x2):
        assert torch.allclose((v * v).mean(dim=1), torch.ones(5, 4, 4), atol=1e-5)
    cos = torch.nn.functional.cosine_similarity(x1, x2, dim=1)
    assert torch.allclose(cos, torch.full_like(cos, 0.3), atol=1e-5)
    s1, _ = input_pair(x, 0.3, same_locations=True)
    assert torch.allclose(s1, s1[:, :, :1, :1].expand_as(s1))
    with pytest.raises(ValueError, match=r"\(-1, 1\)"):
        input_pair(x, 1.0)


def test_applied_mlp_follows_the_prediction_layer_by_layer(mlp_case):
    model, x, graph, sol = mlp_case
    net = apply(model, sol, graph=graph, example_input=x, seed=0).model
    diag = diagnose(net, sol, x, input_c=0.5)
    print("\n" + str(diag))
    assert isinstance(diag, Diagnosis) and all(isinstance(r, LayerDiagnosis) for r in diag.layers)
    rows = {r.id: r for r in diag.layers}
    assert [r.op for r in diag.layers].count("activation") == 20 and rows["output"].op == "output"
    hidden = [r for r in diag.layers if r.id not in ("40", "output")]
    assert max(abs(r.q_error) for r in hidden) < 0.12
    assert max(abs(r.c_error) for r in hidden) < 0.06
    assert all(r.q_predicted == pytest.approx(1.0) for r in diag.layers)
    # the per-layer composition ends where the answer's global C map says (interpolation: 1e-3)
    assert rows["output"].c_predicted == pytest.approx(diag.c_global, abs=1e-3)
    assert rows["1"].c_predicted > 0.5  # a TReLU layer raises c
    table = str(diag)
    assert table.splitlines()[1].split()[:6] == ["node", "op", "q", "pred", "q", "emp"]
    assert "answer's global C map at c = 0.5" in table
    assert set(diag.as_dicts()[0]) == {"id", "op", "q_predicted", "q_empirical", "c_predicted", "c_empirical", "note"}


def test_an_unapplied_model_is_caught(mlp_case):
    model, x, _, sol = mlp_case
    diag = diagnose(model, sol, x)  # PyTorch's default init and plain ReLUs: q collapses with depth
    assert diag.max_q_error(("activation",)) > 0.5, str(diag)
    for p in model.parameters():
        assert p.grad is None


def test_pooled_nodes_are_marked_unless_locations_are_alike():
    torch.manual_seed(1)
    model = ConvNet()
    x = torch.randn(16, 3, 8, 8)
    graph = graph_from_module(model, x)
    sol = _solve(graph, targets={"eta": 0.3})
    net = apply(model, sol, graph=graph, example_input=x, seed=0, calibrate=False).model  # the pool as solved
    diag = diagnose(net, sol, x, input_c=0.0)
    assert diag.scope == "location"
    rows = {r.id: r for r in diag.layers}
    assert rows["pool"].note.startswith("after pooling") and rows["fc"].note.startswith("after pooling")
    assert rows["body.1"].note == ""
    alike = diagnose(net, sol, x, input_c=0.0, same_locations=True)
    assert all(r.note == "" for r in alike.layers)
    assert abs({r.id: r for r in alike.layers}["pool"].c_error) < 0.1


def test_only_tat_and_dks_answers():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    sol = _solve(graph_from_module(model, x), method="eoc", activation="tanh", targets={})
    with pytest.raises(ValueError, match="tat and dks"):
        diagnose(model, sol, x)
