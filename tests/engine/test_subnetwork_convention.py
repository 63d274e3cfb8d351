"""Which subnetworks the maxima range over, by brute force over every candidate region.

TAT Appendix B defines M_{f,r} as a maximum over subnetworks, footnote 4: "a connected subset of the
layers in f that constitute a neural network with a singular input and output layer". sigprop reads
this as single-entry single-exit regions (s, t): every path from the inputs to t passes through s, and
every node of the region other than t feeds only the region (the convention of the B.5 example and
of dks, whose hand-written subnet_max_func skips, for example, a DenseNet's partial blocks). Read
literally, any region with one entry s and one exit t counts, even if its inner nodes also feed
layers outside it; in a DenseNet that takes in partial chains of dense layers whose outputs also go to
later concatenations, and the maxima are larger. This test computes both readings by brute force on
small graphs, checks that the engine's dominator-tree compilation equals the first, and shows the gap.
"""

from __future__ import annotations

import pytest

from sigprop.engine.graph.build import build_graph
from sigprop.engine.methods.tat import curvature_multiplier
from sigprop.engine.network.program import compile_program
from sigprop.engine.templates.expand import expand_template
from sigprop.schemas import Template
from sigprop.schemas.ops import ACT, CONCAT, SOURCE, SUM

ROOT = -1


def _candidates(graph):
    """Every (s, region, t) with s dominating t (s = ROOT: the inputs) and the region the nodes on
    paths from s to t, with a flag saying whether the region is single-exit."""
    nodes = graph.nodes
    consumers = graph.consumers()
    ancestors = []  # ancestors[v]: v and everything that feeds it
    for nd in nodes:
        acc = {nd.index}
        for i in nd.inputs:
            acc |= ancestors[i]
        ancestors.append(acc)
    for t in range(graph.n):
        if nodes[t].kind == SOURCE:
            continue
        for s in [ROOT] + sorted(ancestors[t] - {t}):
            if s == ROOT:
                region = set(ancestors[t])
            else:
                region = {v for v in ancestors[t] if s in ancestors[v] and v != s}
                # s dominates t: no node of the region reads from outside the region except s,
                # and no input node lies inside it
                if any(nodes[v].kind == SOURCE for v in region) or any(
                    i != s and i not in region for v in region for i in nodes[v].inputs
                ):
                    continue
            single_exit = all(set(consumers[v]) <= region for v in region if v != t)
            yield s, region, t, single_exit


def _u(graph, s, region, t, x, r):
    """U_{g,r}(x) of the region by the B.4 recipe."""
    nodes = graph.nodes
    vals = {s: x}
    for v in sorted(region):
        nd = nodes[v]
        if nd.kind == SOURCE:
            vals[v] = x
        elif nd.kind == ACT:
            vals[v] = r(vals[nd.inputs[0]])
        elif nd.kind == SUM:
            vals[v] = sum(w * w * vals[i] for w, i in zip(nd.attrs["weights"], nd.inputs, strict=False))
        elif nd.kind == CONCAT:
            widths = [nodes[i].width for i in nd.inputs]
            vals[v] = sum(wd * vals[i] for wd, i in zip(widths, nd.inputs, strict=False)) / sum(widths)
        else:
            vals[v] = vals[nd.inputs[0]]
    return vals[t]


def _kappa_by_reading(template: dict) -> tuple[float, float]:
    """(maximal C''_g(1) / C''(1) over single-entry single-exit regions, over any single-entry region)."""
    graph = build_graph(expand_template(Template(**template)), default_activation="softplus")
    sese = literal = 0.0
    for s, region, t, single_exit in _candidates(graph):
        k = _u(graph, s, region, t, 0.0, lambda y: 1.0 + y)  # B.4's second recipe
        literal = max(literal, k)
        if single_exit:
            sese = max(sese, k)
    return sese, literal


@pytest.mark.parametrize(
    "template",
    [
        {"template": "densenet", "depth": 10, "growth_rate": 4, "input_shape": [3, 8, 8]},
        {"template": "densenet", "depth": 16, "growth_rate": 4, "input_shape": [3, 8, 8]},
        {"template": "densenet", "depth": 22, "growth_rate": 4, "input_shape": [3, 8, 8]},
    ],
)
def test_densenet_maxima_under_both_readings(template):
    sese, literal = _kappa_by_reading(template)
    graph = build_graph(expand_template(Template(**template)), default_activation="softplus")
    engine = curvature_multiplier(compile_program(graph))
    assert engine == pytest.approx(sese, rel=1e-12)  # the engine implements the single-entry single-exit reading
    assert literal > sese * 1.01  # the literal reading counts partial dense blocks too
    print(f"{template}: single-entry single-exit {sese:.4f}, literal {literal:.4f} (+{literal / sese - 1:.1%})")


@pytest.mark.parametrize(
    "template",
    [
        {"template": "mlp", "depth": 6, "width": 4},
        {"template": "resnet", "depth": 18, "shortcut_weight": 0.6, "input_shape": [3, 16, 16]},
        {"template": "cnn", "depth": 5, "width": 4, "input_shape": [3, 8, 8]},
    ],
)
def test_readings_agree_where_every_region_is_single_exit(template):
    sese, literal = _kappa_by_reading(template)
    graph = build_graph(expand_template(Template(**template)), default_activation="softplus")
    assert curvature_multiplier(compile_program(graph)) == pytest.approx(sese, rel=1e-12)
    assert literal == pytest.approx(sese, rel=1e-12)


def test_the_answer_names_the_convention():
    from sigprop.engine.solve import solve
    from sigprop.requests import parse_solve_request

    ans = solve(
        parse_solve_request(
            {
                "graph": {"template": "mlp", "depth": 4, "width": 8},
                "method": "tat",
                "activation": "softplus",
                "targets": {"tau": 0.3},
            }
        )
    )
    assert ans.subnetworks == "single-entry single-exit"
