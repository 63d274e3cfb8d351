"""Valid graphs built to make a solver's work grow faster than its input (issue 26): the shapes
that were quadratic, or could be, for one method or another. Shared by tests/service/test_cost.py and
bench/cost_bench.py, which time every method on each."""

from __future__ import annotations

from .service.test_availability import ladder as input_ladder

__all__ = [
    "deep_chain",
    "fan_in",
    "input_ladder",
    "ladder",
    "late_sums",
    "mirrored_skips",
    "pool_chain",
    "request",
    "sums_after_identities",
]


def _graph(nodes: list[dict]) -> dict:
    return {"schema": "sigprop.graph/v1", "nodes": nodes}


def ladder(blocks: int, width: int = 8) -> dict:
    """The issue's ladder: h0 = dense(x), then ``blocks`` x [act -> dense -> sum(d_i, h0)]. Every
    block's sum takes h0, so h0 is the only dominator between the input and the last sum."""
    nodes = [
        {"id": "x", "op": "input", "shape": [width]},
        {"id": "h0", "op": "dense", "inputs": ["x"], "units": width},
    ]
    prev = "h0"
    for i in range(blocks):
        nodes += [
            {"id": f"a{i}", "op": "activation", "inputs": [prev]},
            {"id": f"d{i}", "op": "dense", "inputs": [f"a{i}"], "units": width},
            {"id": f"s{i}", "op": "sum", "inputs": [f"d{i}", "h0"]},
        ]
        prev = f"s{i}"
    nodes.append({"id": "out", "op": "output", "inputs": [prev]})
    return _graph(nodes)


def fan_in(branches: int, op: str = "sum", width: int = 8) -> dict:
    """One ``op`` (sum or concat) of ``branches`` branches act -> dense, all from one dense stem."""
    nodes = [
        {"id": "x", "op": "input", "shape": [width]},
        {"id": "h0", "op": "dense", "inputs": ["x"], "units": width},
    ]
    for i in range(branches):
        nodes += [
            {"id": f"a{i}", "op": "activation", "inputs": ["h0"]},
            {"id": f"d{i}", "op": "dense", "inputs": [f"a{i}"], "units": width},
        ]
    nodes.append({"id": "j", "op": op, "inputs": [f"d{i}" for i in range(branches)]})
    nodes.append({"id": "out", "op": "output", "inputs": ["j"]})
    return _graph(nodes)


def deep_chain(layers: int, width: int = 8) -> dict:
    """``layers`` x [dense -> act], node by node (the template ``mlp`` is the same, from 40 bytes)."""
    nodes = [{"id": "x", "op": "input", "shape": [width]}]
    prev = "x"
    for i in range(layers):
        nodes += [
            {"id": f"d{i}", "op": "dense", "inputs": [prev], "units": width},
            {"id": f"a{i}", "op": "activation", "inputs": [f"d{i}"]},
        ]
        prev = f"a{i}"
    nodes.append({"id": "out", "op": "output", "inputs": [prev]})
    return _graph(nodes)


def late_sums(chain: int, sums: int, width: int = 8) -> dict:
    """A chain of ``chain`` blocks dense -> act, then ``sums`` sums each of the chain's end and its
    first layer, joined by a binary tree of sums: every one of those sums meets a node thousands of
    dominator-tree levels above its other input (a walk one level at a time was quadratic)."""
    nodes = [
        {"id": "x", "op": "input", "shape": [width]},
        {"id": "c0", "op": "dense", "inputs": ["x"], "units": width},
    ]
    prev = "c0"
    for i in range(1, chain):
        nodes += [
            {"id": f"r{i}", "op": "activation", "inputs": [prev]},
            {"id": f"c{i}", "op": "dense", "inputs": [f"r{i}"], "units": width},
        ]
        prev = f"c{i}"
    level = []
    for k in range(sums):
        nodes.append({"id": f"s{k}", "op": "sum", "inputs": [prev, "c0"]})
        level.append(f"s{k}")
    nodes.append({"id": "out", "op": "output", "inputs": [_sum_tree(nodes, level)]})
    return _graph(nodes)


def _sum_tree(nodes: list[dict], level: list[str]) -> str:
    """Join ``level`` by a binary tree of sums appended to ``nodes``; the root's id."""
    t = 0
    while len(level) > 1:
        joined = []
        for j in range(0, len(level) - 1, 2):
            nodes.append({"id": f"t{t}", "op": "sum", "inputs": [level[j], level[j + 1]]})
            joined.append(f"t{t}")
            t += 1
        level = joined + level[len(level) - len(level) % 2 :]
    return level[0]


def sums_after_identities(chain: int, sums: int, width: int = 8) -> dict:
    """dense -> act, a chain of ``chain`` identity ops, then ``sums`` residual sums
    (chain end + dense(chain end)) joined by a tree of sums: every sum input reached the end of the
    identity chain by walking all of it (the correlated-sum check was quadratic)."""
    nodes = [
        {"id": "x", "op": "input", "shape": [width]},
        {"id": "h", "op": "dense", "inputs": ["x"], "units": width},
        {"id": "a", "op": "activation", "inputs": ["h"]},
    ]
    prev = "a"
    for i in range(chain):
        nodes.append({"id": f"i{i}", "op": "identity", "inputs": [prev]})
        prev = f"i{i}"
    level = []
    for k in range(sums):
        nodes.append({"id": f"d{k}", "op": "dense", "inputs": [prev], "units": width})
        nodes.append({"id": f"s{k}", "op": "sum", "inputs": [prev, f"d{k}"]})
        level.append(f"s{k}")
    nodes.append({"id": "out", "op": "output", "inputs": [_sum_tree(nodes, level)]})
    return _graph(nodes)


def pool_chain(pools: int, channels: int = 2, side: int = 2) -> dict:
    """conv -> act, then ``pools`` average pools of kernel 1 in a chain, flatten, dense: each pool
    looked back through all the pools before it (geometric's pooling warning was quadratic)."""
    nodes = [
        {"id": "x", "op": "input", "shape": [channels, side, side]},
        {"id": "h", "op": "conv", "inputs": ["x"], "channels": channels, "kernel": [1, 1]},
        {"id": "a", "op": "activation", "inputs": ["h"]},
    ]
    prev = "a"
    for i in range(pools):
        nodes.append({"id": f"p{i}", "op": "avg_pool", "inputs": [prev], "kernel": [1, 1]})
        prev = f"p{i}"
    nodes += [
        {"id": "f", "op": "flatten", "inputs": [prev]},
        {"id": "d", "op": "dense", "inputs": ["f"], "units": 2},
        {"id": "out", "op": "output", "inputs": ["d"]},
    ]
    return _graph(nodes)


def mirrored_skips(levels: int, width: int = 8) -> dict:
    """A chain of ``levels`` blocks act -> dense, then ``levels`` sums, the k-th joining the running
    value with the chain's layer ``levels - 1 - k``: nested skips, as in a U-Net of that many
    levels. Each sum ends a largest subnetwork nested in the next one's, so the subnetwork passes
    M_{f,r} needs total about 1.5 levels^2 steps: priced and refused past a budget."""
    nodes = [
        {"id": "x", "op": "input", "shape": [width]},
        {"id": "c0", "op": "dense", "inputs": ["x"], "units": width},
    ]
    prev, chain = "c0", ["c0"]
    for i in range(1, levels):
        nodes += [
            {"id": f"a{i}", "op": "activation", "inputs": [prev]},
            {"id": f"c{i}", "op": "dense", "inputs": [f"a{i}"], "units": width},
        ]
        prev = f"c{i}"
        chain.append(prev)
    for k in range(levels):
        nodes.append({"id": f"s{k}", "op": "sum", "inputs": [prev, chain[levels - 1 - k]]})
        prev = f"s{k}"
    nodes.append({"id": "out", "op": "output", "inputs": [prev]})
    return _graph(nodes)


# one request per method, with the activation and targets it takes (contract, section 2)
METHOD_REQUESTS = {
    "geometric": ("relu", {}),
    "tat": ("leaky_relu", {"eta": 0.3}),
    "dks": ("softplus", {"zeta": 1.5}),
    "eoc": ("tanh", {}),
    "sparse_eoc": ("relu_tau", {"sparsity": 0.5}),
}


def request(graph: dict, method: str) -> dict:
    """A solve request of ``graph`` by ``method``; ``assumptions: warn`` so that graphs outside the
    kernel theory (the input-summing ladder) are solved, not refused before any work."""
    activation, targets = METHOD_REQUESTS[method]
    return {"graph": graph, "method": method, "activation": activation, "targets": targets, "assumptions": "warn"}
