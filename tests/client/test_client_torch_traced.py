"""One trace per session: ``graph_from_module`` keeps its ``torch.fx`` trace in the graph it returns,
``apply`` reuses it and keeps the rewritten model's for ``diagnose`` (``sigprop.client.torch.traced``).
The answers are the engine's, in-process; the models are small (a few ms per trace)."""

from __future__ import annotations

import copy
import json
import pickle
from functools import partial

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from sigprop.client.torch import apply, diagnose, extraction, graph_from_module  # noqa: E402
from sigprop.client.torch.traced import TracedGraph  # noqa: E402

from ..solving import solve_graph  # noqa: E402


class Block(nn.Module):
    """Functional ops on purpose: an ``F.relu`` and a ``+`` that apply rewrites out of place."""

    def __init__(self, w: int):
        super().__init__()
        self.a, self.b = nn.Linear(w, w), nn.Linear(w, w)

    def forward(self, x):
        return x + self.b(F.relu(self.a(x)))


def _model(w: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, w), Block(w), Block(w), nn.ReLU(), nn.Linear(w, 4))


@pytest.fixture
def traces(monkeypatch):
    """Counts the torch.fx traces (every extraction goes through ``extraction._trace``)."""
    count = [0]
    real = extraction._trace

    def counting(model):
        count[0] += 1
        return real(model)

    monkeypatch.setattr(extraction, "_trace", counting)
    return count


_solve = partial(solve_graph, eta=0.3)


def test_a_session_traces_the_model_once_and_answers_as_a_fresh_trace_does(traces):
    model, x = _model(), torch.randn(64, 16)
    graph = graph_from_module(model, x)
    assert isinstance(graph, TracedGraph) and traces[0] == 1
    sol = _solve(graph)
    report = apply(model, sol, graph=graph, example_input=x, seed=0)
    diag = diagnose(report.model, sol, x, input_c=0.5)
    assert traces[0] == 1, "apply and diagnose traced the model again"

    # the same session from a plain dict: apply and diagnose trace again, with the same result
    fresh = apply(model, sol, graph=dict(graph), example_input=x, seed=0)
    assert traces[0] == 2
    assert fresh.summary().replace(" ", "") == report.summary().replace(" ", "")
    own, new = report.model.state_dict(), fresh.model.state_dict()
    assert own.keys() == new.keys() and all(torch.equal(own[k], new[k]) for k in own)
    y = torch.randn(8, 16)
    assert torch.equal(report.model(y), fresh.model(y))

    plain = diagnose(copy.deepcopy(fresh.model), sol, x, input_c=0.5)  # a model apply did not return
    assert traces[0] == 3
    rows = [(r.op, r.q_predicted, r.q_empirical, r.c_predicted, r.c_empirical) for r in diag.layers]
    assert rows == [(r.op, r.q_predicted, r.q_empirical, r.c_predicted, r.c_empirical) for r in plain.layers]
    # the kept trace names every row with the solved graph's id; a new trace of the rewritten
    # model names the rewritten functional ops after their new modules
    assert [r.id for r in diag.layers] == [nd["id"] for nd in graph["nodes"]]
    assert "sigprop_act_relu" in {r.id for r in plain.layers}


def test_a_model_changed_since_the_trace_or_another_input_shape_is_traced_again(traces):
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    cnn.append(nn.AdaptiveAvgPool2d(1)).append(nn.Flatten()).append(nn.Linear(8, 4))
    graph = graph_from_module(cnn, torch.randn(2, 3, 8, 8))
    apply(cnn, _solve(graph), graph=graph, example_input=torch.randn(2, 3, 12, 12))  # other shapes: a new trace
    assert traces[0] == 2

    model, x = _model(), torch.randn(8, 16)
    graph = graph_from_module(model, x)
    sol = _solve(graph)
    model[3] = nn.Tanh()  # a module swapped after the trace
    report = apply(model, sol, graph=graph, example_input=x)
    assert traces[0] == 4
    assert any("Tanh" in c.was for c in report.activations)
    apply(_model(), sol, graph=graph, example_input=x)  # the graph of another model (same architecture)
    assert traces[0] == 5
    net = report.model
    net.add_submodule("extra", nn.Identity())  # the applied model changed: diagnose traces it
    diagnose(net, sol, x)
    assert traces[0] == 6


def test_inplace_keeps_the_models_own_trace_for_diagnose(traces):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(64, 16)
    graph = graph_from_module(model, x)
    sol = _solve(graph)
    assert apply(model, sol, graph=graph, example_input=x, seed=0, inplace=True).model is model
    diag = diagnose(model, sol, x)
    assert traces[0] == 1 and diag.ok, str(diag)


def test_the_traced_graph_is_a_plain_graph_on_the_wire():
    model, x = _model(), torch.randn(4, 16)
    graph = graph_from_module(model, x)
    assert json.loads(json.dumps(graph)) == graph
    for c in (copy.copy(graph), copy.deepcopy(graph), pickle.loads(pickle.dumps(graph))):
        assert type(c) is dict and c == graph


def test_diagnose_reads_a_calibrated_node_where_the_network_reads_it():
    """A calibration multiplier apply inserted after a max pool (no layer can take its factor):
    with apply's trace the pool's row is what the next layer reads (brought to q = 1) and the rows
    after it keep their predictions; a new trace of the rewritten model sees the multiplier as an op
    outside the graph, which leaves every later row unpredicted."""
    from .test_client_calibration import PooledShortcut, _tat

    torch.manual_seed(0)
    model, x = PooledShortcut(), torch.randn(32, 32, 8, 8)
    graph = graph_from_module(model, x[:2])
    sol = _tat(graph, 0.2)
    report = apply(model, sol, graph=graph, example_input=x, seed=0)
    assert next(c for c in report.calibrations if c.id == "pool").where == "multiplier"
    rows = {r.id: r for r in diagnose(report.model, sol, x[:16], input_c=0.5).layers}
    assert rows["pool"].q_empirical == pytest.approx(1.0, abs=0.1)
    assert rows["fc"].q_predicted is not None
    fresh = diagnose(copy.deepcopy(report.model), sol, x[:16], input_c=0.5)
    assert {r.id: r for r in fresh.layers}["fc"].q_predicted is None
    assert any("'mul'" in w and "outside the graph" in w for w in fresh.warnings)
