"""Validated, canonical form of an architecture graph, and its structure for kernel analysis.

``build_graph`` checks what pydantic cannot check node by node (duplicate ids, dangling inputs,
arity, exactly one output, cycles, shapes, normalized sum weights), infers every node's shape,
and renumbers the nodes canonically: a post-order walk from the output that follows each node's
``inputs`` order. Node order in the request and id names therefore change neither the answer nor
the cache key (contract section 2, ``key``).

Nodes that cannot reach the output are dropped with a warning: they do not affect the network.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

from ..errors import SigpropError
from ..schemas.graph import Graph
from ..schemas.shapes import check_arity, node_shape

# Kinds of node for the Q/C map analysis (TAT paper section 2.3, Appendix B.4).
SOURCE, PASS, AFFINE, ACT, SUM, CONCAT = "source", "pass", "affine", "act", "sum", "concat"

_KIND = {
    "input": SOURCE,
    "dense": AFFINE,
    "conv": AFFINE,
    "activation": ACT,
    "sum": SUM,
    "concat": CONCAT,
    "avg_pool": PASS,
    "max_pool": PASS,
    "global_avg_pool": PASS,
    "flatten": PASS,
    "dropout": PASS,
    "identity": PASS,
    "output": PASS,
}


@dataclass(frozen=True)
class Node:
    """One node in canonical numbering; ``inputs`` are canonical indices of earlier nodes."""

    index: int
    user_id: str
    op: str
    kind: str
    inputs: tuple[int, ...]
    attrs: dict
    shape: tuple[int, ...]

    @property
    def width(self) -> int:
        """Channels of a feature map, or features of a vector: the width a concat averages by."""
        return self.shape[0]


@dataclass
class NetworkGraph:
    nodes: list[Node]
    output: int
    warnings: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.nodes)

    def canonical(self) -> list[dict]:
        """The graph as plain data with canonical indices for ids: what the cache key hashes."""
        return [{"op": nd.op, "inputs": list(nd.inputs), **nd.attrs} for nd in self.nodes]

    def digest(self) -> str:
        payload = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()

    def anonymized(self) -> NetworkGraph:
        """The same graph with ids replaced by canonical placeholders ``#<index>`` ('#' is not
        allowed in ids) and no request-specific warnings: what answers are computed and cached
        on, so a cached answer can be relabelled for any request with the same key."""
        # Node(...) directly: dataclasses.replace costs several times more per node on large graphs
        return NetworkGraph(
            [Node(nd.index, f"#{nd.index}", nd.op, nd.kind, nd.inputs, nd.attrs, nd.shape) for nd in self.nodes],
            self.output,
            [],
        )

    def consumers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for nd in self.nodes:
            for i in nd.inputs:
                out[i].append(nd.index)
        return out

    def activation_fns(self) -> list[str]:
        """Distinct activation function names, in canonical order of first use."""
        seen: dict[str, None] = {}
        for nd in self.nodes:
            if nd.kind == ACT:
                seen.setdefault(nd.attrs["fn"], None)
        return list(seen)

    def depth(self) -> int:
        """Nonlinear layers on the longest path from an input to the output."""
        d = [0] * self.n
        for nd in self.nodes:
            base = max((d[i] for i in nd.inputs), default=0)
            d[nd.index] = base + (1 if nd.kind == ACT else 0)
        return d[self.output]

    def count(self, kind: str) -> int:
        return sum(1 for nd in self.nodes if nd.kind == kind)


def _invalid(message: str, hint: str) -> SigpropError:
    return SigpropError("invalid_graph", message, hint)


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _infer(nd, in_shapes: list[tuple[int, ...]]) -> tuple[tuple[int, ...], dict]:
    """Output shape (the contract's rules, ``schemas.shapes``) and canonical attributes of one node."""
    shape = node_shape(nd, in_shapes)
    op = nd.op
    if op == "input":
        return shape, {"shape": list(nd.shape)}
    if op == "dense":
        return shape, {"units": nd.units, "bias": nd.bias}
    if op == "conv":
        return shape, {
            "channels": nd.channels,
            "kernel": list(_pair(nd.kernel)),
            "stride": list(_pair(nd.stride)),
            "padding": nd.padding,
            "bias": nd.bias,
        }
    if op in ("avg_pool", "max_pool"):
        stride = nd.stride if nd.stride is not None else nd.kernel
        # padding only when given, so graphs without it keep their canonical form and cache keys
        return shape, {
            "kernel": list(_pair(nd.kernel)),
            "stride": list(_pair(stride)),
            **({"padding": nd.padding} if nd.padding else {}),
        }
    if op == "dropout":
        return shape, {"rate": nd.rate}
    if op == "sum":
        n = len(in_shapes)
        weights = nd.weights if nd.weights is not None else [1.0 / math.sqrt(n)] * n
        return shape, {"weights": [float(w) for w in weights]}
    return shape, {}  # global_avg_pool, flatten, concat, activation, identity, output


def build_graph(graph: Graph, default_activation: str | None = None) -> NetworkGraph:
    """Validate a wire graph and return its canonical form (see module docstring)."""
    by_id: dict[str, object] = {}
    for nd in graph.nodes:
        if nd.id in by_id:
            raise _invalid(f"node id '{nd.id}' is used twice", "give every node a unique id")
        by_id[nd.id] = nd

    outputs = [nd.id for nd in graph.nodes if nd.op == "output"]
    if len(outputs) != 1:
        raise _invalid(
            f"the graph has {len(outputs)} output nodes" + (f" ({', '.join(outputs[:5])})" if outputs else ""),
            "exactly one node must have op 'output'; merge several heads with a concat or sum first",
        )

    for nd in graph.nodes:
        check_arity(nd)
        for src in nd.inputs:
            if src not in by_id:
                raise _invalid(
                    f"node '{nd.id}' reads from '{src}', which is not in the graph",
                    "every id in 'inputs' must be the id of a node in 'nodes'",
                )
            if by_id[src].op == "output":
                raise _invalid(f"node '{nd.id}' reads from the output node '{src}'", "the output node must be last")

    topo = _topological_order(graph.nodes, by_id)
    ordered = _canonical_input_order(topo, by_id, default_activation)

    # Iterative post-order DFS from the output, following inputs in canonical order (sum inputs
    # sorted by the structure of what feeds them, so listing a sum's branches in another order
    # is the same graph).
    order: list[str] = []
    seen: set[str] = {outputs[0]}
    stack: list[tuple[str, int]] = [(outputs[0], 0)]
    while stack:
        nid, pos = stack[-1]
        ins = ordered[nid][0]
        if pos < len(ins):
            stack[-1] = (nid, pos + 1)
            nxt = ins[pos]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, 0))
        else:
            stack.pop()
            order.append(nid)
    warnings = []
    dropped = [nd.id for nd in graph.nodes if nd.id not in seen]
    if dropped:
        warnings.append(f"{len(dropped)} node(s) do not reach the output and were ignored: {', '.join(dropped[:10])}")

    index = {nid: i for i, nid in enumerate(order)}
    nodes: list[Node] = []
    for i, nid in enumerate(order):
        nd = by_id[nid]
        ins = tuple(index[x] for x in ordered[nid][0])
        if nd.op == "sum":
            nd = nd.model_copy(update={"weights": ordered[nid][1]})
        shape, attrs = _infer(nd, [nodes[j].shape for j in ins])
        if nd.op == "activation":
            fn = nd.fn or default_activation
            if fn is None:
                raise _invalid(
                    f"activation node '{nid}' names no function", "set 'fn' on the node or 'activation' on the request"
                )
            attrs = {"fn": fn}
        nodes.append(Node(i, nid, nd.op, _KIND[nd.op], ins, attrs, shape))
    if not any(nd.kind == SOURCE for nd in nodes):
        raise _invalid("no input node reaches the output", "add an 'input' node feeding the network")
    return NetworkGraph(nodes=nodes, output=len(nodes) - 1, warnings=warnings)


def _topological_order(wire_nodes, by_id) -> list[str]:
    """Kahn's algorithm over every node (dead branches too): a cycle anywhere is an invalid graph."""
    indegree = {nd.id: len(nd.inputs) for nd in wire_nodes}
    users: dict[str, list[str]] = {nd.id: [] for nd in wire_nodes}
    for nd in wire_nodes:
        for src in nd.inputs:
            users[src].append(nd.id)
    ready = [nd.id for nd in wire_nodes if indegree[nd.id] == 0]
    order = []
    while ready:
        nid = ready.pop()
        order.append(nid)
        for u in users[nid]:
            indegree[u] -= 1
            if indegree[u] == 0:
                ready.append(u)
    if len(order) != len(wire_nodes):
        stuck = sorted(nid for nid, d in indegree.items() if d > 0)
        raise _invalid(
            f"the graph has a cycle through '{stuck[0]}'"
            + (f" (nodes on or after it: {', '.join(stuck[:6])})" if len(stuck) > 1 else ""),
            "the graph must be acyclic: remove the edge that loops back",
        )
    return order


def _canonical_input_order(
    topo: list[str], by_id, default_activation
) -> dict[str, tuple[list[str], list[float] | None]]:
    """Each node's inputs in canonical order, with a sum's weights permuted alongside.

    A structural hash of every node (its op, attributes and its inputs' hashes) orders a sum's
    (input, weight) pairs; concat keeps its order, which fixes the channel layout. A graph without
    sums has nothing to order, and skips the hashing (most of a chain's graph-building time).
    """
    digest: dict[str, str] = {}
    ordered: dict[str, tuple[list[str], list[float] | None]] = {}
    if not any(by_id[nid].op == "sum" for nid in topo):
        return {nid: (list(by_id[nid].inputs), None) for nid in topo}
    for nid in topo:
        nd = by_id[nid]
        attrs = nd.model_dump(exclude={"id", "inputs", "weights"})
        if nd.op == "activation":
            attrs["fn"] = nd.fn or default_activation
        ins, weights = list(nd.inputs), None
        if nd.op == "sum":
            n = len(ins)
            w = list(nd.weights) if nd.weights is not None and len(nd.weights) == n else [1.0 / math.sqrt(n)] * n
            pairs = sorted(zip(ins, w, strict=False), key=lambda p: (digest[p[0]], p[1]))
            ins, weights = [p[0] for p in pairs], [p[1] for p in pairs]
            if nd.weights is not None and len(nd.weights) != n:
                weights = list(nd.weights)  # wrong length: _infer reports it
        ordered[nid] = (ins, weights)
        key = json.dumps([attrs, [digest[i] for i in ins], weights], sort_keys=True, default=str)
        digest[nid] = hashlib.sha256(key.encode()).hexdigest()
    return ordered


def correlated_sum_warnings(nodes: list[Node]) -> list[str]:
    """The normalized-sum rule q = sum w_i^2 q_i (TAT section 2.3) holds when the summed branches
    are uncorrelated, which a weighted layer with fresh zero-mean weights on all but one branch
    guarantees. Say so where a sum adds two branches that no such layer separates."""
    out = []
    for nd in nodes:
        if nd.kind != SUM:
            continue
        plain = []
        for i in nd.inputs:
            j = i
            while nodes[j].kind == PASS and nodes[j].inputs:
                j = nodes[j].inputs[0]
            if nodes[j].kind != AFFINE:
                plain.append(i)
        if len(set(nd.inputs)) < len(nd.inputs) or len(plain) > 1:
            out.append(
                f"sum node '{nd.user_id}' adds branches not separated by a weighted layer (or the same input "
                "twice): they are correlated, so the normalized-sum rule and the solved maps are approximate there"
            )
    return out
