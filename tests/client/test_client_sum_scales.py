"""The adapters apply the answer's ``sum_scales`` (a sum an atom reaches through several paths):
PyTorch's ``apply`` rewrites the add with the rescaled weights, and the rewritten network has q = 1
at that sum where the graph's weights give 2; JAX exposes the weights through ``sum_weights``."""

from __future__ import annotations

import math
from functools import partial

import pytest

from ..solving import solve_graph

_solve = partial(solve_graph, activation="softplus", targets={"tau": 0.5})


def test_torch_apply_rescales_a_sum_of_a_stream_and_its_dropout_copy():
    torch = pytest.importorskip("torch")
    from torch import nn

    from sigprop.client.torch import apply, graph_from_module

    class Copy(nn.Module):
        def __init__(self, width=256):
            super().__init__()
            self.stem, self.lin, self.drop = nn.Linear(64, width), nn.Linear(width, width), nn.Dropout(0.1)
            self.act1, self.act2, self.head = nn.Softplus(), nn.Softplus(), nn.Linear(width, 10)

        def forward(self, x):
            z = self.lin(self.act1(self.stem(x)))
            return self.head(self.act2(z + self.drop(z)))

    torch.manual_seed(0)
    model = Copy().eval()
    x = torch.randn(64, 64)
    graph = graph_from_module(model, x)
    sol = _solve(graph)
    (sid,) = [nd["id"] for nd in graph["nodes"] if nd["op"] == "sum"]
    assert sol.sum_scales == {sid: pytest.approx(1 / math.sqrt(2))}
    report = apply(model, sol, graph=graph, seed=1)
    (change,) = report.sums
    assert change.source == "graph x sum_scales" and change.weights == pytest.approx([0.5, 0.5])
    solved = report.model.eval()
    seen = {}
    add = next(m for m in solved.modules() if type(m).__name__ == "NormalizedSum")

    def record(_module, _inputs, out):
        seen["q"] = float(out.pow(2).mean())  # returns None: the output stays as it is

    add.register_forward_hook(record)
    with torch.no_grad():
        solved(x)
    assert seen["q"] == pytest.approx(1.0, abs=0.15)  # 2 with the graph's weights


def test_jax_sum_weights_multiply_the_graph_weights_by_the_scales():
    pytest.importorskip("jax")
    from sigprop.client.jax import sum_weights

    graph = {
        "schema": "sigprop.graph/v1",
        "nodes": [
            {"id": "x", "op": "input", "shape": [8]},
            {"id": "z0", "op": "dense", "inputs": ["x"], "units": 8},
            {"id": "a", "op": "activation", "inputs": ["z0"]},
            {"id": "z", "op": "dense", "inputs": ["a"], "units": 8},
            {"id": "c", "op": "identity", "inputs": ["z"]},
            {"id": "s", "op": "sum", "inputs": ["z", "c"], "weights": [0.6, 0.8]},
            {"id": "b", "op": "activation", "inputs": ["s"]},
            {"id": "head", "op": "dense", "inputs": ["b"], "units": 2},
            {"id": "out", "op": "output", "inputs": ["head"]},
        ],
    }
    sol = _solve(graph)
    assert sum_weights(sol, graph) == {"s": pytest.approx([0.6 / 1.4, 0.8 / 1.4])}


def test_validation_worker_applies_sum_scales_under_module_paths():
    """The worker builds the graph's network, extracts it and applies the answer by module path:
    the answer's ``sum_scales`` travel with the translated ids."""
    torch = pytest.importorskip("torch")
    from sigprop.engine.graph.build import build_graph
    from sigprop.schemas.graph import Graph
    from sigprop.worker.models import build_solved

    graph = {
        "schema": "sigprop.graph/v1",
        "nodes": [
            {"id": "x", "op": "input", "shape": [16]},
            {"id": "z", "op": "dense", "inputs": ["x"], "units": 32},
            {"id": "c", "op": "identity", "inputs": ["z"]},
            {"id": "s", "op": "sum", "inputs": ["z", "c"]},
            {"id": "a", "op": "activation", "inputs": ["s"]},
            {"id": "head", "op": "dense", "inputs": ["a"], "units": 10},
            {"id": "out", "op": "output", "inputs": ["head"]},
        ],
    }
    sol = _solve(graph)
    assert sol.sum_scales == {"s": pytest.approx(1 / math.sqrt(2))}
    net = build_graph(Graph.model_validate(graph), default_activation="softplus")
    built = build_solved(net, sol, 10, torch.randn(4, 16), seed=0)
    (change,) = built.report.sums
    assert change.source == "graph x sum_scales" and change.weights == pytest.approx([0.5, 0.5])
