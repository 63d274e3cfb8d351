"""Answers are computed on the anonymized graph and relabelled per request, so a cached answer
can serve any request with the same key and still name that request's own nodes."""

from sigprop.answers import personalize
from sigprop.engine.solve import prepare, solve, solve_canonical
from sigprop.schemas import SolveRequest


def _request(prefix: str, dead: bool = False) -> SolveRequest:
    p = prefix
    nodes = [
        {"id": f"{p}x", "op": "input", "shape": [3, 8, 8]},
        {"id": f"{p}c1", "op": "conv", "inputs": [f"{p}x"], "channels": 8},
        {"id": f"{p}a1", "op": "activation", "inputs": [f"{p}c1"]},
        {"id": f"{p}mp", "op": "max_pool", "inputs": [f"{p}a1"], "kernel": 2},
        {"id": f"{p}c2", "op": "conv", "inputs": [f"{p}mp"], "channels": 8},
        {"id": f"{p}a2", "op": "activation", "inputs": [f"{p}c2"]},
        # neither branch ends in a weighted layer: two post-activation features, outside the kernel
        # theory (their means multiply), so the request solves under "warn" and the warning names the sum
        {"id": f"{p}s", "op": "sum", "inputs": [f"{p}mp", f"{p}a2"]},
        {"id": f"{p}g", "op": "global_avg_pool", "inputs": [f"{p}s"]},
        {"id": f"{p}out", "op": "output", "inputs": [f"{p}g"]},
    ]
    if dead:
        nodes.append({"id": f"{p}unused", "op": "dense", "inputs": [f"{p}g"], "units": 3})
    return SolveRequest.model_validate(
        {
            "graph": {"nodes": nodes},
            "method": "tat",
            "activation": "leaky_relu",
            "targets": {"eta": 0.3},
            "assumptions": "warn",
        }
    )


def test_same_key_same_canonical_answer_own_ids():
    a, b = prepare(_request("zqa_")), prepare(_request("zqb_", dead=True))
    assert a.key == b.key
    ca, cb = solve_canonical(a), solve_canonical(b)
    assert ca.to_json() == cb.to_json()
    assert "zqa_" not in ca.to_json() and "#" in " ".join(ca.warnings)

    for prep, p in ((a, "zqa_"), (b, "zqb_")):
        ans = personalize(ca, prep.ids, prep.graph.warnings)  # b is served a's cached answer
        assert [layer.id for layer in ans.layers] == [f"{p}c1", f"{p}c2"]
        text = " ".join(ans.warnings)
        assert f"{p}mp" in text and f"'{p}s'" in text and "#" not in text
        other = "zqb_" if p == "zqa_" else "zqa_"
        assert other not in ans.to_json()
        assert ans.to_json() == solve(_request(p, dead=(p == "zqb_"))).to_json()
    assert any("unused" in w for w in personalize(ca, b.ids, b.graph.warnings).warnings)
    assert not any("unused" in w for w in personalize(ca, a.ids, a.graph.warnings).warnings)
