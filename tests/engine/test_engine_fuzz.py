"""Random and mutated requests through the validator and the engine: a Solution or a clean
SigpropError, never another exception (that would be a 500 behind the HTTP service)."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sigprop.engine.solve import solve
from sigprop.errors import SigpropError
from sigprop.requests import parse_solve_request
from sigprop.schemas.graph import OPS as GRAPH_OPS

# every op of the graph contract between the input and the output, and one it does not have
OPS = [op for op in GRAPH_OPS if op not in ("input", "output")] + ["lstm"]
METHODS = [
    ("tat", "leaky_relu", {"eta": 0.5}),
    ("tat", "softplus", {"tau": 0.3}),
    ("dks", "tanh", {"zeta": 1.5}),
    ("eoc", "gelu", {}),
    ("sparse_eoc", "crelu", {"sparsity": 0.8, "v_slope": 0.7}),
    ("geometric", "relu", {}),
    ("tat", "relu", {"eta": 0.5}),
    ("dks", "nope", {"zeta": 1.5}),
    ("tat", "swish", {"tau": float("nan")}),
]


@st.composite
def graphs(draw):
    image = draw(st.booleans())
    nodes = [{"id": "x", "op": "input", "shape": [3, 8, 8] if image else [16]}]
    for i in range(draw(st.integers(1, 12))):
        op = draw(st.sampled_from(OPS))
        prev = [n["id"] for n in nodes]
        k = draw(st.integers(2, 3)) if op in ("sum", "concat") else 1
        node = {"id": f"n{i}", "op": op, "inputs": [draw(st.sampled_from(prev)) for _ in range(k)]}
        if op == "dense":
            node["units"] = draw(st.integers(1, 32))
        if op == "conv":
            node["channels"] = draw(st.integers(1, 16))
            node["kernel"] = draw(st.sampled_from([1, 2, 3, 5]))
        if op == "sum" and draw(st.booleans()):
            node["weights"] = draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=k, max_size=k))
        nodes.append(node)
    nodes.append({"id": "out", "op": "output", "inputs": [nodes[-1]["id"]]})
    if draw(st.booleans()):  # mutate: drop, duplicate or rewire a node
        victim = draw(st.integers(0, len(nodes) - 1))
        action = draw(st.sampled_from(["drop", "dup", "loop"]))
        if action == "drop":
            nodes.pop(victim)
        elif action == "dup":
            nodes.append(dict(nodes[victim]))
        elif nodes[victim].get("inputs"):
            nodes[victim]["inputs"] = ["out"]
    return {"schema": "sigprop.graph/v1", "nodes": nodes}


@settings(max_examples=150, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(graph=graphs(), method=st.sampled_from(METHODS))
def test_random_graphs_get_an_answer_or_a_clean_error(graph, method):
    name, act, targets = method
    try:
        ans = solve(parse_solve_request({"graph": graph, "method": name, "activation": act, "targets": targets}))
    except SigpropError as err:
        assert err.code and err.message and err.hint and 400 <= err.status < 600
        return
    assert ans.key and all(math.isfinite(v) for v in ans.c_map.global_) if ans.c_map else ans.key


def residual_chain(blocks: int, width: int = 16) -> dict:
    """A graph of ``blocks`` residual blocks x -> 0.8 x + 0.6 dense(act(x)), written node by node."""
    nodes = [{"id": "x", "op": "input", "shape": [width]}, {"id": "d", "op": "dense", "inputs": ["x"], "units": width}]
    prev = "d"
    for b in range(blocks):
        nodes += [
            {"id": f"a{b}", "op": "activation", "inputs": [prev]},
            {"id": f"l{b}", "op": "dense", "inputs": [f"a{b}"], "units": width},
            {"id": f"s{b}", "op": "sum", "inputs": [prev, f"l{b}"], "weights": [0.8, 0.6]},
        ]
        prev = f"s{b}"
    nodes.append({"id": "out", "op": "output", "inputs": [prev]})
    return {"nodes": nodes}


def test_very_deep_residual_network_solves_without_overflow():
    """1,000 residual blocks: the finite-width Jacobian moments overflow a float; the answer
    must still come back (without them), not crash."""
    ans = solve(
        parse_solve_request(
            {"graph": residual_chain(1000), "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.9}}
        )
    )
    assert abs(ans.c_f_0 - 0.9) < 1e-12


def test_dks_on_a_graph_whose_only_activation_is_dead_fails_cleanly():
    """Found by the fuzz test: three equal sum weights square to 1 + 1 ulp, which made the slope
    bracket look nonlinear and double forever."""
    graph = {
        "nodes": [
            {"id": "x", "op": "input", "shape": [3, 8, 8]},
            {"id": "n0", "op": "sum", "inputs": ["x", "x", "x"]},
            {"id": "n3", "op": "activation", "inputs": ["x"]},  # does not reach the output
            {"id": "n9", "op": "dropout", "inputs": ["n0"]},
            {"id": "out", "op": "output", "inputs": ["n9"]},
        ]
    }
    for method, targets in (("dks", {"zeta": 1.5}), ("tat", {"tau": 0.3})):
        try:
            solve(parse_solve_request({"graph": graph, "method": method, "activation": "tanh", "targets": targets}))
        except SigpropError as err:
            assert err.code == "unreachable_target" and "nonlinear" in err.message
        else:
            raise AssertionError("a graph without a live nonlinear layer cannot reach zeta or tau")
