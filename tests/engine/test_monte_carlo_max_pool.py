"""``max_pool`` of adjacent feature pairs (issue 34, proof by growth): exact against Monte Carlo.

For a, b jointly Gaussian of equal variance q, max(a, b) = (a + b)/2 + |a - b|/2 and the two halves
are independent, so E[max(a, b)^2] = q whatever their correlation; for independent entries (two units
of a dense layer: independent weights) and two inputs at correlation c the C map is
C(c) = c/2 + (sqrt(1 - c^2) + c arcsin c)/pi, the mean sqrt(q/pi) (``schemas.ops.pair_max_c``).

- a dense graph: blocks ``dense(2w) -> max_pool(2) -> dense(w) -> act``, Edge of Chaos (tanh) and TAT
  (leaky_relu, target eta): q, C(0), C(0.5) at the output and at a middle node (the graph cut there);
- a sequence graph, TAT (leaky_relu) with E-SPA attention: per token pairs after each attention's output
  projection: the token kernel at the output and at a middle node, for orthonormal tokens and tokens
  at cosine 0.5.

Networks are built from the answer's own ``layers`` by ``mc_networks``. Rule: within 3 standard errors
+ 0.01. The width-512 runs are ``slow``; the default ones take width 128 and a few networks.
"""

from __future__ import annotations

import math

import pytest
from scipy.integrate import dblquad
from scipy.special import ndtr

from sigprop.engine.network.subnetworks import max_pair_value
from sigprop.errors import SigpropError
from sigprop.schemas import Graph
from sigprop.schemas.ops import pair_max_c
from sigprop.schemas.shapes import infer_shapes
from sigprop.schemas.structure import wire_structure

from ..mc_networks import output_statistics, solve_request
from .test_monte_carlo_new_ops import check_dense, check_sequence

C0S = (0.0, 0.5)


def pairs_mlp(width=128, blocks=3, cut=None, fn=None):
    """``blocks`` x [dense(2 width) -> max_pool -> dense(width) -> act], then a dense; ``cut``: end at
    that block's activation (a middle node)."""
    nodes = [{"id": "x", "op": "input", "shape": [width]}]
    h = "x"
    for b in range(blocks):
        nodes += [
            {"id": f"d{b}", "op": "dense", "inputs": [h], "units": 2 * width},
            {"id": f"m{b}", "op": "max_pool", "inputs": [f"d{b}"]},
            {"id": f"e{b}", "op": "dense", "inputs": [f"m{b}"], "units": width},
            {"id": f"a{b}", "op": "activation", "inputs": [f"e{b}"], **({"fn": fn} if fn else {})},
        ]
        h = f"a{b}"
        if b == cut:
            break
    nodes += [{"id": "y", "op": "dense", "inputs": [h], "units": width}, {"id": "out", "op": "output", "inputs": ["y"]}]
    return {"schema": "sigprop.graph/v1", "nodes": nodes}


BODIES = {
    "eoc": lambda g: {"graph": g, "method": "eoc", "activation": "tanh", "targets": {}, "c_map_points": 5},
    "tat": lambda g: {"graph": g, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.65}},
}


def run_dense(method, width, nets, pairs=16):
    rows = []
    for cut in (1, None):
        graph, ans = solve_request(BODIES[method](pairs_mlp(width, cut=cut)))
        assert ans.assumptions.holds and not ans.warnings, ans.warnings
        stats = output_statistics(graph, ans, C0S, nets, pairs, seed=5 + (cut or 0))
        q = ans.output_q if method == "eoc" else 1.0
        rows += check_dense(ans, stats, q)
    return rows


@pytest.mark.parametrize("method", ["eoc", "tat"])
def test_dense_max_pool_pairs_quick(method):
    run_dense(method, 128, 6)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eoc", "tat"])
def test_dense_max_pool_pairs_width_512(method):
    for row in run_dense(method, 512, 16):
        print(method, row)


def transformer(width=128, tokens=4, blocks=2):
    """Attention blocks whose output projection is pooled in pairs: e -> q, k, v -> attention ->
    dense(2 width) -> max_pool -> dense(width) -> act -> dense(width) (the next block's e)."""
    nodes = [{"id": "x", "op": "input", "shape": [tokens, width], "sequence": True}]

    def add(nid, op, inputs, **attrs):
        nodes.append({"id": nid, "op": op, "inputs": inputs, **attrs})
        return nid

    h = add("e", "dense", ["x"], units=width)
    for b in range(blocks):
        q, k, v = (add(f"b{b}.{r}", "dense", [h], units=width) for r in "qkv")
        proj = add(f"b{b}.proj", "dense", [add(f"b{b}.attn", "attention", [q, k, v])], units=2 * width)
        m = add(f"b{b}.pool", "max_pool", [proj])
        a = add(f"b{b}.act", "activation", [add(f"b{b}.fc", "dense", [m], units=width)])
        h = add(f"b{b}.out", "dense", [a], units=width)
    add("out", "output", [h])
    return {"schema": "sigprop.graph/v1", "nodes": nodes}


def run_sequence(width, nets, tokens=4, at=("b0.pool", "out")):
    body = {
        "graph": transformer(width, tokens),
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.6},
        "attention": {"shaping": "e-spa"},
    }
    return check_sequence(*solve_request(body), width, nets, tokens, at, seed=13)


def test_sequence_max_pool_pairs_quick():
    run_sequence(128, 16)


@pytest.mark.slow
def test_sequence_max_pool_pairs_width_512():
    for row in run_sequence(512, 40):
        print(row)


def _clark_max_mean(m1, m2, theta):
    """E[max(X, Y)] for independent X ~ N(m1, s^2), Y ~ N(m2, s^2), theta = s sqrt(2) (Clark, 1961)."""
    if theta == 0.0:
        return max(m1, m2)
    d = (m1 - m2) / theta
    return m1 * ndtr(d) + m2 * ndtr(-d) + theta * math.exp(-0.5 * d * d) / math.sqrt(2 * math.pi)


def test_the_closed_form_against_quadrature():
    """E[max(a, b) max(a', b')] by two-dimensional quadrature: given a, b, the second input's entries
    a' = c a + s x, b' = c b + s y (x, y independent) have Clark's mean of a maximum."""
    pdf = lambda t: math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)  # noqa: E731
    for c in (-0.9, -0.3, 0.0, 0.5, 0.95):
        s = math.sqrt(1 - c * c)

        def f(b, a, c=c, s=s):
            return max(a, b) * _clark_max_mean(c * a, c * b, s * math.sqrt(2)) * pdf(a) * pdf(b)

        # the kink a = b splits the plane into two smooth halves
        lo = dblquad(f, -9, 9, lambda a: -9, lambda a: a, epsabs=1e-10)[0]
        hi = dblquad(f, -9, 9, lambda a: a, lambda a: 9, epsabs=1e-10)[0]
        assert abs(lo + hi - pair_max_c(c)) < 1e-7, (c, lo + hi, pair_max_c(c))
        assert abs(float(max_pair_value(c)) - pair_max_c(c)) < 1e-14
    assert pair_max_c(1.0) == pytest.approx(1.0) and pair_max_c(0.0) == pytest.approx(1 / math.pi)
    # complex step through the value rule: C'(c) = 1/2 + arcsin(c)/pi, so C'(1) = 1
    for c in (0.0, 0.5, 0.9):
        h = 1e-20
        assert max_pair_value(complex(c, h)).imag / h == pytest.approx(0.5 + math.asin(c) / math.pi, rel=1e-12)
    # E[max(a, b)^2] = q whatever a and b's correlation (rho), E[max(a, b)] = sqrt(q (1 - rho) / pi)
    for rho in (0.0, 0.6):
        r = math.sqrt(1 - rho * rho)
        sq = dblquad(lambda y, x: max(x, rho * x + r * y) ** 2 * pdf(x) * pdf(y), -9, 9, -9, 9, epsabs=1e-10)[0]
        assert abs(sq - 1.0) < 1e-6
    mean = dblquad(lambda y, x: max(x, y) * pdf(x) * pdf(y), -9, 9, -9, 9, epsabs=1e-10)[0]
    assert abs(mean - 1 / math.sqrt(math.pi)) < 1e-6


def _graph(nodes, shape=(16,)):
    return {"schema": "sigprop.graph/v1", "nodes": [{"id": "x", "op": "input", "shape": list(shape)}, *nodes]}


POOLED = [
    {"id": "d", "op": "dense", "inputs": ["x"], "units": 16},
    {"id": "m", "op": "max_pool", "inputs": ["d"]},
    {"id": "y", "op": "dense", "inputs": ["m"], "units": 16},
    {"id": "out", "op": "output", "inputs": ["y"]},
]


@pytest.mark.parametrize(
    "attrs,what",
    [({"kernel": 3}, "kernel 3"), ({"kernel": 2, "stride": 1}, "stride 1"), ({"kernel": 2, "padding": 1}, "padding 1")],
)
def test_windows_other_than_pairs_on_features_are_refused(attrs, what):
    nodes = [dict(nd) for nd in POOLED]
    nodes[1] = {**nodes[1], **attrs}
    with pytest.raises(SigpropError) as err:
        infer_shapes(Graph.model_validate(_graph(nodes)))
    assert err.value.code == "invalid_graph" and "max_pool node 'm'" in err.value.message and what in err.value.message
    assert "kernel 2" in err.value.hint


def test_odd_features_are_refused():
    nodes = [dict(nd) for nd in POOLED]
    nodes[0] = {**nodes[0], "units": 15}
    with pytest.raises(SigpropError) as err:
        solve_request({"graph": _graph(nodes), "method": "eoc", "activation": "tanh", "targets": {}})
    assert err.value.code == "invalid_graph" and "15 features" in err.value.message and err.value.hint


def test_shapes_of_pairs_per_example_and_per_token():
    shapes = infer_shapes(Graph.model_validate(_graph(POOLED)))
    assert list(shapes["m"]) == [8]
    seq = {"schema": "sigprop.graph/v1", "nodes": [{"id": "x", "op": "input", "shape": [4, 16], "sequence": True}]}
    seq["nodes"] += [dict(nd) for nd in POOLED]
    assert list(infer_shapes(Graph.model_validate(seq))["m"]) == [4, 8]


def test_a_max_pool_reading_a_feature_is_outside_the_theory():
    on_input = _graph([{"id": "m", "op": "max_pool", "inputs": ["x"]}, *POOLED[2:]])
    ids, report = wire_structure(Graph.model_validate(on_input))
    assert not report.holds and ids[report.violations[0].activation] == "m"
    with pytest.raises(SigpropError) as err:
        solve_request({"graph": on_input, "method": "eoc", "activation": "tanh", "targets": {}})
    assert err.value.code == "unsupported_structure" and "max_pool 'm'" in err.value.message and err.value.hint
    after_act = _graph(
        [POOLED[0], {"id": "a", "op": "activation", "inputs": ["d"]}, {**POOLED[1], "inputs": ["a"]}, *POOLED[2:]]
    )
    _, ans = solve_request(
        {"graph": after_act, "method": "eoc", "activation": "tanh", "targets": {}, "assumptions": "warn"}
    )
    assert not ans.assumptions.holds and "m" in ans.assumptions.violations


def test_curvature_methods_and_geometric_refuse_pairs():
    g = pairs_mlp(16, blocks=2)
    for method, fn, targets in (("dks", "softplus", {"zeta": 2.0}), ("tat", "softplus", {"tau": 0.5})):
        with pytest.raises(SigpropError) as err:
            solve_request({"graph": g, "method": method, "activation": fn, "targets": targets})
        assert err.value.code == "unsupported_structure" and "C''(1)" in err.value.message, method
        assert "leaky_relu" in err.value.hint
    with pytest.raises(SigpropError) as err:
        solve_request({"graph": g, "method": "geometric", "activation": "relu", "targets": {}})
    assert err.value.code == "unsupported_structure" and "max_pool" in err.value.message


def test_a_spatial_max_pool_keeps_its_row():
    conv = {
        "schema": "sigprop.graph/v1",
        "nodes": [
            {"id": "x", "op": "input", "shape": [3, 8, 8]},
            {"id": "c", "op": "conv", "inputs": ["x"], "channels": 8, "kernel": 3, "padding": "same"},
            {"id": "a", "op": "activation", "inputs": ["c"]},
            {"id": "m", "op": "max_pool", "inputs": ["a"]},
            {"id": "out", "op": "output", "inputs": ["m"]},
        ],
    }
    graph, ans = solve_request({"graph": conv, "method": "eoc", "activation": "tanh", "targets": {}})
    nd = next(nd for nd in graph.nodes if nd.user_id == "m")
    assert (nd.op, nd.kind, nd.shape) == ("max_pool", "pass", (8, 4, 4))
    assert not ans.assumptions.holds and any("max_pool" in w for w in ans.warnings)


def _flattened_pairs(spatial: int) -> dict:
    """conv -> flatten -> pairs of features: neighbouring entries are neighbouring locations of one
    channel when the map has several locations (correlated by the input), distinct channels when it
    has one."""
    nodes = [
        {"id": "c", "op": "conv", "inputs": ["x"], "channels": 8, "kernel": 1},
        {"id": "f", "op": "flatten", "inputs": ["c"]},
        {"id": "m", "op": "max_pool", "inputs": ["f"]},
        {"id": "y", "op": "dense", "inputs": ["m"], "units": 16},
        {"id": "out", "op": "output", "inputs": ["y"]},
    ]
    return _graph(nodes, shape=(3, spatial, spatial))


def test_pairs_of_a_flattened_map_hold_only_for_one_location():
    request = {"method": "eoc", "activation": "tanh", "targets": {}, "assumptions": "warn"}
    _, ans = solve_request({"graph": _flattened_pairs(4), **request})
    assert not ans.assumptions.holds and "m" in ans.assumptions.violations
    assert any("flattened map" in w and "'m'" in w for w in ans.warnings)
    assert any("flattened map" in w and "'m'" in w for w in ans.warnings)
    _, ans = solve_request({"graph": _flattened_pairs(1), **request})
    assert ans.assumptions.holds and not ans.assumptions.violations
