"""``diagnose`` of Edge-of-Chaos answers (issue 34): eoc and sparse_eoc put every activation's input
at q* (each layer's variances from what it reads), and the answer carries what the prediction
needs at every node: the layers' variances, ``sigma_w2``/``sigma_b2``/``q_star`` (an activation's
output q is (q* - sigma_b2) / sigma_w2) and ``c_map.activation``, the activation's own C map at q*.

Real PyTorch networks at width 256 (an MLP with a factorised pair of layers, dense -> dense, and a
pre-activation residual net, ``h + dense(act(h))``), solved in-process, applied and diagnosed:
every node within ``FLAG_SIGMAS`` of its stated noise (PASS). The same networks with the answer's
activation swapped for a plain ReLU after ``apply`` are flagged (FAIL)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from sigprop.client.diagnosis import SHOWN_OPS  # noqa: E402
from sigprop.client.torch import TransformedActivation, apply, diagnose, graph_from_module  # noqa: E402

from ..solving import solve_graph  # noqa: E402

WIDTH, D_IN = 256, 64
CASES = [
    ("eoc", "tanh", {}, torch.tanh),
    ("eoc", "erf", {}, torch.erf),
    ("sparse_eoc", "relu_tau", {"sparsity": 0.7}, torch.relu),
]


class Fn(nn.Module):
    """An activation written as a function call (traced as one; apply swaps in the answer's)."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


def _mlp(f) -> nn.Module:
    w = WIDTH
    return nn.Sequential(
        nn.Linear(D_IN, w), Fn(f), nn.Linear(w, w), nn.Linear(w, w), Fn(f), nn.Linear(w, w), Fn(f), nn.Linear(w, w)
    )


class Residual(nn.Module):
    """Pre-activation residual blocks h + dense(act(h)) (the adds become normalized sums)."""

    def __init__(self, f, blocks: int = 3):
        super().__init__()
        self.f = f
        self.inp = nn.Linear(D_IN, WIDTH)
        self.branches = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.inp(x)
        for lin in self.branches:
            h = h + lin(self.f(h))
        return self.head(self.f(h))


MODELS = {"mlp": _mlp, "residual": Residual}


def _applied(model_name: str, method: str, act: str, targets: dict, f):
    torch.manual_seed(12345)  # not apply's seed: inputs drawn from its stream would align with its matrices
    model = MODELS[model_name](f)
    x = torch.randn(32, D_IN)
    graph = graph_from_module(model, x)
    sol = solve_graph(graph, method, act, targets)
    assert sol.assumptions is None or sol.assumptions.holds, sol.warnings
    return apply(model, sol, graph=graph, example_input=x, seed=0).model, sol, x


def _worst(diag) -> tuple[float, float]:
    """max |q error| / q noise and max |c error| / c noise over the rows with a prediction."""
    rows = [r for r in diag.layers if r.op in SHOWN_OPS and r.q_predicted is not None and r.q_noise]
    zq = max((abs(r.q_error) / r.q_noise for r in rows), default=0.0)
    zc = max((abs(r.c_error) / r.c_noise for r in rows if r.c_noise and r.c_error is not None), default=0.0)
    return zq, zc


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize(("method", "act", "targets", "f"), CASES, ids=[c[1] for c in CASES])
def test_an_applied_eoc_network_passes_at_every_node(model_name, method, act, targets, f):
    net, sol, x = _applied(model_name, method, act, targets, f)
    diag = diagnose(net, sol, x)
    predicted = [r for r in diag.layers if r.q_predicted is not None and r.c_predicted is not None]
    assert len(predicted) == len(diag.layers), str(diag)  # every node predicted, q and c
    q_star = sol.q_star
    for r in diag.layers:
        if r.op == "dense":
            assert abs(r.q_predicted - q_star) < 1e-9, r  # q = q* after every weighted layer
    assert diag.ok, str(diag)
    assert str(diag).splitlines()[-1].startswith("verdict: PASS"), str(diag)
    zq, zc = _worst(diag)
    print(f"{model_name} {method} {act}: max |q error| / noise {zq:.2f}, max |c error| / noise {zc:.2f}")


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize(("method", "act", "targets", "f"), CASES, ids=[c[1] for c in CASES])
def test_the_same_network_with_a_plain_relu_is_flagged(model_name, method, act, targets, f):
    net, sol, x = _applied(model_name, method, act, targets, f)
    swapped = [name for name, m in net.named_modules() if isinstance(m, TransformedActivation)]
    assert swapped
    for name in swapped:
        parent, _, leaf = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, leaf, Fn(torch.relu))
    diag = diagnose(net, sol, x)
    assert not diag.ok, str(diag)
    verdict = str(diag).splitlines()[-1]
    assert verdict.startswith("verdict: FAIL") and "activation" in verdict, verdict
    assert any(r.flagged for r in diag.layers), str(diag)  # its statistics, not only the function compared


def test_a_geometric_answer_is_refused():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    sol = solve_graph(graph_from_module(model, x), "geometric", "relu", {})
    with pytest.raises(ValueError, match="tat, dks, eoc and sparse_eoc"):
        diagnose(model, sol, x)
