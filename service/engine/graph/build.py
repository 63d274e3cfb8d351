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
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ...errors import SigpropError
from ...schemas.activations import ACTIVATION_NAMES
from ...schemas.graph import Graph
from ...schemas.ops import ACT, AFFINE, OP_TABLE, PASS, SOURCE, SUM, row_at
from ...schemas.shapes import ARITY, check_arity, node_shape


@dataclass(slots=True)
class Node:
    """One node in canonical numbering; ``inputs`` are canonical indices of earlier nodes.

    Slotted, and not frozen: a frozen dataclass sets each field through ``object.__setattr__``,
    which made creating nodes (one per node of a request, again for its anonymized copy) a good
    part of a cold request's graph work. Nothing mutates or hashes nodes (``attrs``, a dict, made
    a frozen node unhashable anyway).
    """

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

    def canonical_json(self) -> str:
        """``json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))``, the text the cache
        key hashes, written row by row (see ``_row_json``): the generic encoder took about as long
        as building the whole graph."""
        return "[" + ",".join([_row_json(nd) for nd in self.nodes]) + "]"

    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

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
            ins = nd.inputs
            # most nodes have one input: no generator for them (this runs on every cold request)
            base = d[ins[0]] if len(ins) == 1 else max((d[i] for i in ins), default=0)
            d[nd.index] = base + (nd.kind == ACT)
        return d[self.output]

    def count(self, kind: str) -> int:
        return sum(1 for nd in self.nodes if nd.kind == kind)


def _row_json(nd: Node) -> str:
    """One node of ``canonical_json``: ``json.dumps({"op": nd.op, "inputs": list(nd.inputs), **nd.attrs},
    sort_keys=True, separators=(",", ":"))``, directly for the attributes most nodes have (checked
    to be of the types written the same way: names JSON needs no escapes for, ints, bools) and
    through ``json.dumps`` for the rest. ``inputs`` are canonical indices, ints by construction."""
    op, attrs = nd.op, nd.attrs
    if op in _NAMES:
        ins = nd.inputs
        ins = str(ins[0]) if len(ins) == 1 else ",".join(map(str, ins))
        if not attrs:
            return f'{{"inputs":[{ins}],"op":"{op}"}}'
        if len(attrs) == 1:
            fn = attrs.get("fn")
            if type(fn) is str and fn in _NAMES:  # an activation
                return f'{{"fn":"{fn}","inputs":[{ins}],"op":"{op}"}}'
            weights = attrs.get("weights")
            if type(weights) is list and _finite_floats(weights):  # a sum
                return f'{{"inputs":[{ins}],"op":"{op}","weights":[{",".join(map(float.__repr__, weights))}]}}'
        elif len(attrs) == 2:
            units, bias = attrs.get("units"), attrs.get("bias")
            if type(units) is int and type(bias) is bool:  # a dense layer
                return f'{{"bias":{"true" if bias else "false"},"inputs":[{ins}],"op":"{op}","units":{units}}}'
    return json.dumps({"op": op, "inputs": list(nd.inputs), **attrs}, sort_keys=True, separators=(",", ":"))


# Ops and activation names: strings JSON writes as they are between quotes.
_NAMES = frozenset(OP_TABLE) | frozenset(ACTIVATION_NAMES)
assert all(name.isascii() and name.isidentifier() for name in _NAMES)


def _invalid(message: str, hint: str) -> SigpropError:
    return SigpropError("invalid_graph", message, hint)


class _SumView(NamedTuple):
    """A sum node with its weights in its canonical input order: what the shape rules and the op table's ``attrs``
    read of it (a pydantic ``model_copy`` per sum cost more than all the rest of its work)."""

    id: str
    op: str
    weights: list[float]


def build_graph(graph: Graph, default_activation: str | None = None) -> NetworkGraph:
    """Validate a wire graph and return its canonical form (see module docstring).

    ``graph`` is a ``Graph`` or anything with its validated ``nodes``. Errors come in a fixed
    order, whatever the work skipped on the way: duplicate ids, the output count, each node's
    arity and inputs (in listing order), cycles, then each live node's shape and activation
    function in canonical order.
    """
    if getattr(graph, "sequential", False):  # a template's sequence: valid and in canonical order as made
        nodes = _template_sequential_nodes(graph.ids, graph.models, default_activation)
        return NetworkGraph(nodes=nodes, output=len(nodes) - 1, warnings=[])
    wire = graph.nodes
    by_id = {nd.id: nd for nd in wire}
    if len(by_id) != len(wire):
        _raise_duplicate(wire)
    outputs = [nd.id for nd in wire if OP_TABLE[nd.op].sink]
    if len(outputs) != 1:
        raise _invalid(
            f"the graph has {len(outputs)} output nodes" + (f" ({', '.join(outputs[:5])})" if outputs else ""),
            "exactly one node must have op 'output'; merge several heads with a concat or sum first",
        )
    out_id = outputs[0]
    in_order, joins = _check_edges(wire, by_id, out_id)
    # A graph listed after its inputs (templates, torch exports, most written by hand) has no
    # cycle, and its listing is a topological order: Kahn's algorithm is for the others.
    topo = wire if in_order else _topological_order(wire, by_id)
    if joins:
        sums = _canonical_sum_order(topo, default_activation)
        order = _post_order(by_id, out_id, sums)
    else:  # no sum or concat: the live nodes are the chain that ends in the output
        sums = {}
        order = _chain(by_id, out_id)
    nodes = _canonical_nodes(order, sums, default_activation)
    warnings = []
    if len(order) != len(wire):
        live = {nd.id for nd in order}
        dropped = [nd.id for nd in wire if nd.id not in live]
        warnings.append(f"{len(dropped)} node(s) do not reach the output and were ignored: {', '.join(dropped[:10])}")
    # identities an adapter put in place of ops it could not express (allow_unsupported): their
    # notes are not in the key, so like the line above this is the request's, in every answer
    warnings += [
        f"node '{nd.id}' is an identity in place of an op the graph could not express ({note}): "
        "the answer is solved as if it were not there; replace it or check its effect (diagnose)"
        for nd in order
        if (note := getattr(nd, "unsupported", None))
    ]
    if not any(nd.kind == SOURCE for nd in nodes):
        raise _invalid("no input node reaches the output", "add an 'input' node feeding the network")
    return NetworkGraph(nodes=nodes, output=len(nodes) - 1, warnings=warnings)


def _raise_duplicate(wire_nodes) -> None:
    """Raise for the first node whose id an earlier node has."""
    earlier: set[str] = set()
    for nd in wire_nodes:
        if nd.id in earlier:
            raise _invalid(f"node id '{nd.id}' is used twice", "give every node a unique id")
        earlier.add(nd.id)


def _check_edges(wire_nodes, by_id, out_id: str) -> tuple[bool, bool]:
    """Check every node's arity and inputs (dead nodes too), in listing order. Return whether each
    node is listed after its inputs, and whether any node has several inputs."""
    in_order, joins = True, False
    earlier: set[str] = set()
    for nd in wire_nodes:
        srcs = nd.inputs
        if len(srcs) != 1 or nd.op in ARITY:  # every other op takes exactly one input
            check_arity(nd)
            joins = joins or len(srcs) > 1
        for src in srcs:
            if src not in earlier:
                if src not in by_id:
                    raise _invalid(
                        f"node '{nd.id}' reads from '{src}', which is not in the graph",
                        "every id in 'inputs' must be the id of a node in 'nodes'",
                    )
                in_order = False
            if src == out_id:  # the one node with op 'output'
                raise _invalid(f"node '{nd.id}' reads from the output node '{src}'", "the output node must be last")
        earlier.add(nd.id)
    return in_order, joins


def _chain(by_id, out_id: str) -> list:
    """The live nodes of an acyclic graph whose nodes have one input at most, in canonical order:
    the nodes the output reads through, from the input on (what ``_post_order`` finds, directly)."""
    order = [by_id[out_id]]
    while srcs := order[-1].inputs:
        order.append(by_id[srcs[0]])
    order.reverse()
    return order


def _post_order(by_id, out_id: str, sums) -> list:
    """Iterative post-order DFS from the output, following inputs in canonical order (sum inputs
    sorted by the structure of what feeds them, so listing a sum's branches in another order is
    the same graph): the live nodes in canonical order.

    The stack is three lists (node, its inputs, the next one to follow): an object per entry would
    keep a deep network's whole depth of them alive, for the garbage collector to scan."""
    order = []
    seen = {out_id}
    out = by_id[out_id]
    stack, inputs, positions = [out], [out.inputs], [0]
    while stack:
        srcs, pos = inputs[-1], positions[-1]
        n = len(srcs)
        while pos < n and srcs[pos] in seen:
            pos += 1
        if pos == n:
            inputs.pop()
            positions.pop()
            order.append(stack.pop())
        else:
            src = srcs[pos]
            positions[-1] = pos + 1
            seen.add(src)
            child = by_id[src]
            stack.append(child)
            inputs.append(sums[src][0] if src in sums else child.inputs)
            positions.append(0)
    return order


def _canonical_nodes(order: list, sums, default_activation) -> list[Node]:
    """The canonical nodes of wire nodes in canonical order: indices, shapes (the contract's rules,
    ``schemas.shapes``) and canonical attributes."""
    nodes: list[Node] = []
    index: dict[str, int] = {}
    for i, nd in enumerate(order):
        nid, op = nd.id, nd.op
        index[nid] = i
        if nid in sums:
            srcs, weights = sums[nid]
            nd = _SumView(nid, op, weights)
        else:
            srcs = nd.inputs
        row = OP_TABLE[op]
        if len(srcs) == 1:
            j = index[srcs[0]]
            ins: tuple[int, ...] = (j,)
            if row.kind == ACT:  # its input's shape, and the request's function by default
                fn = nd.fn or default_activation
                if fn is None:
                    raise _no_function(nid)
                nodes.append(Node(i, nid, op, ACT, ins, {"fn": fn}, nodes[j].shape))
                continue
            in_shapes = [nodes[j].shape]
        elif len(srcs) == 2:  # most sums
            j, k = index[srcs[0]], index[srcs[1]]
            ins = (j, k)
            in_shapes = [nodes[j].shape, nodes[k].shape]
        else:
            ins = tuple([index[x] for x in srcs])
            in_shapes = [nodes[j].shape for j in ins]
        row = row_at(op, in_shapes)  # the row standing for the op on what it reads (max_pool on features)
        nodes.append(Node(i, nid, row.op, row.kind, ins, row.attrs(nd, len(ins)), row.shape(nd, in_shapes)))
    return nodes


def _no_function(nid: str) -> SigpropError:
    return _invalid(f"activation node '{nid}' names no function", "set 'fn' on the node or 'activation' on the request")


def _template_sequential_nodes(ids: list[str], models: list, default_activation) -> list[Node]:
    """``_canonical_nodes`` of a sequential template (``TemplateNodes.sequential``: node i reads node i - 1,
    all valid), from each node's id and the validated node its fields come from. Nodes made from
    one model share its kind and attributes (nothing mutates them), and its shape for an equal
    input shape: a few hundred nanoseconds a node, not a wire node and a canonical node."""
    nodes: list[Node] = []
    made: dict[int, tuple[str, str, dict]] = {}  # id(model) -> (op, kind, attrs)
    shapes: dict[tuple, tuple[int, ...]] = {}  # (id(model), input shape) -> shape
    shape: tuple[int, ...] = ()
    for i, (nid, model) in enumerate(zip(ids, models, strict=True)):
        found = made.get(id(model))
        if found is None:
            op = model.op
            row = OP_TABLE[op]
            if row.kind == ACT:
                fn = model.fn or default_activation
                if fn is None:
                    raise _no_function(nid)
                found = (op, ACT, {"fn": fn})
            else:
                found = (op, row.kind, row.attrs(model, 1 if i else 0))
            made[id(model)] = found
        op, kind, attrs = found
        if kind != ACT:  # an activation keeps its input's shape
            key = (id(model), shape)
            out = shapes.get(key)
            if out is None:
                out = shapes[key] = node_shape(model, [shape] if i else [])
            shape = out
        nodes.append(Node(i, nid, op, kind, (i - 1,) if i else (), attrs, shape))
    return nodes


def _topological_order(wire_nodes, by_id) -> list:
    """Kahn's algorithm over every node (dead branches too): a cycle anywhere is an invalid graph.
    Returns the nodes, each after its inputs."""
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
    return [by_id[nid] for nid in order]


def _canonical_sum_order(topo, default_activation) -> dict[str, tuple[list[str], list[float]]]:
    """Each sum's inputs in canonical order, with its weights permuted alongside, by sum id.

    A structural hash of every node (its op, attributes and its inputs' hashes) orders a sum's
    (input, weight) pairs; concat keeps its order, which fixes the channel layout. A graph without
    sums has nothing to order, and skips the hashing (most of a chain's graph-building time).
    ``topo`` is every node, each after its inputs.

    The hash is sha256 of ``json.dumps([attrs, input_hashes, weights], sort_keys=True, default=str)``
    with ``attrs`` the node's ``model_dump()`` without id, inputs and weights (an activation's
    ``fn`` defaulted), as it was first defined: it fixes canonical graphs, hence cache keys. The
    text is written out directly (``_attrs_text``, ``_json``), without the dump and the generic
    encoder, which took most of a large residual graph's build time.
    """
    sums: dict[str, tuple[list[str], list[float]]] = {}
    if not any(OP_TABLE[nd.op].kind == SUM for nd in topo):
        return sums
    digest: dict[str, str] = {}
    texts: dict = {}
    sha256 = hashlib.sha256
    for nd in topo:
        ins = nd.inputs
        attrs = _attrs_text(nd, default_activation, texts)
        if OP_TABLE[nd.op].kind == SUM:
            n, given = len(ins), nd.weights
            w = list(given) if given is not None and len(given) == n else [1.0 / math.sqrt(n)] * n
            if n == 2:  # what the stable sort below does with two
                (a, b), (wa, wb) = ins, w
                da, db = digest[a], digest[b]
                if (db, wb) < (da, wa):
                    a, b, da, db, wa, wb = b, a, db, da, wb, wa
                ins, weights, digests = [a, b], [wa, wb], f'["{da}", "{db}"]'
            else:
                pairs = sorted(zip(ins, w, strict=False), key=lambda p: (digest[p[0]], p[1]))
                ins, weights = [p[0] for p in pairs], [p[1] for p in pairs]
                digests = _strings([digest[i] for i in ins])
            if given is not None and len(given) != n:
                weights = list(given)  # wrong length: the shape rules report it
            sums[nd.id] = (ins, weights)
            text = f"[{attrs}, {digests}, {_floats(weights)}]"
        elif len(ins) == 1:
            text = f'[{attrs}, ["{digest[ins[0]]}"], null]'
        else:
            text = f"[{attrs}, {_strings([digest[i] for i in ins])}, null]"
        digest[nd.id] = sha256(text.encode()).hexdigest()
    return sums


# Per wire node class (a node model, or the template builder's stand-in for one): the names of its
# ``model_dump()`` without id, inputs and weights, sorted, a getter of their values as a tuple,
# and where "fn" is among them (or -1).
_LAYOUTS: dict[type, tuple[tuple[str, ...], Callable, int]] = {}


def _attrs_text(nd, default_activation, texts: dict) -> str:
    """``json.dumps(attrs, sort_keys=True, default=str)`` for a node's structural hash (see
    ``_canonical_sum_order``). ``texts`` remembers it by the node's class and values, when these
    are strings, ints, bools or None (equal values of these exact types are written alike; floats
    are not: 0.0 == -0.0), so each of the many nodes alike in a graph costs a lookup."""
    layout = _LAYOUTS.get(type(nd))
    if layout is None:
        # the keys of model_dump(): a node model has neither computed nor excluded fields
        # an input's "sequence" (token streams, added later) is left out, and written only when true
        # (below), so the hashes, hence canonical graphs and cache keys, of other graphs stay as they were
        # an identity's "unsupported" note is no structure: left out, so it changes no hash
        skip = ("id", "inputs", "weights", "sequence", "unsupported")
        names = tuple(sorted(name for name in type(nd).model_fields if name not in skip))
        getter = operator.attrgetter(*names)
        layout = _LAYOUTS[type(nd)] = (
            names,
            getter if len(names) > 1 else lambda node: (getter(node),),
            names.index("fn") if "fn" in names else -1,
        )
    names, values_of, fn = layout
    if getattr(nd, "sequence", False):  # a token stream's input
        return json.dumps({**dict(zip(names, values_of(nd), strict=True)), "sequence": True}, sort_keys=True)
    values = values_of(nd)
    types = tuple(map(type, values))
    key = (type(nd), values, types) if _SCALARS.issuperset(types) else None
    text = texts.get(key)
    if text is None:
        if fn >= 0 and OP_TABLE[nd.op].kind == ACT:
            values = values[:fn] + (values[fn] or default_activation,) + values[fn + 1 :]
        text = "{" + ", ".join([f'"{name}": {_json(v)}' for name, v in zip(names, values, strict=True)]) + "}"
        if key is not None:
            texts[key] = text
    return text


_SCALARS = frozenset((str, int, bool, type(None)))


def _strings(hexdigests: list[str]) -> str:
    """``json.dumps`` of a list of hex digests."""
    return '["' + '", "'.join(hexdigests) + '"]' if hexdigests else "[]"


def _floats(values: list) -> str:
    """``json.dumps`` of a sum's weights (``_json``, directly for finite floats)."""
    if _finite_floats(values):
        return "[" + ", ".join(map(float.__repr__, values)) + "]"
    return _json(values)


def _finite_floats(values: list) -> bool:
    """Whether all values are finite floats, which JSON writes as ``float.__repr__`` does."""
    for v in values:
        if type(v) is not float or not math.isfinite(v):
            return False
    return True


def _json(value) -> str:
    """``json.dumps(value, sort_keys=True, default=str)``, directly for the types wire nodes hold."""
    kind = type(value)
    if kind is str:
        # json.dumps escapes quotes, backslashes and all but printable ASCII
        if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
            return f'"{value}"'
    elif kind is int:
        return int.__repr__(value)
    elif kind is bool:
        return "true" if value else "false"
    elif kind is float:
        if math.isfinite(value):
            return float.__repr__(value)
    elif kind is list or kind is tuple:
        return "[" + ", ".join([_json(v) for v in value]) + "]"
    elif value is None:
        return "null"
    return json.dumps(value, sort_keys=True, default=str)


def pass_sources(nodes: list[Node]) -> list[int]:
    """For each node (in topological order), the node its value comes from through pass-through
    ops (first inputs followed while the op is one; the node itself when it is not): one pass,
    where a walk per query is quadratic on a long chain of them read by thousands of nodes."""
    source = list(range(len(nodes)))
    for nd in nodes:
        if nd.kind == PASS and nd.inputs:
            source[nd.index] = source[nd.inputs[0]]
    return source


def correlated_sum_warnings(nodes: list[Node]) -> list[str]:
    """The normalized-sum rule q = sum w_i^2 q_i (TAT section 2.3) holds when the summed branches
    are uncorrelated, which a weighted layer with fresh zero-mean weights on all but one branch
    guarantees. Say so where a sum adds two branches that no such layer separates."""
    out = []
    source = pass_sources(nodes)
    for nd in nodes:
        if nd.kind != SUM:
            continue
        plain = [i for i in nd.inputs if nodes[source[i]].kind != AFFINE]
        if len(set(nd.inputs)) < len(nd.inputs) or len(plain) > 1:
            out.append(
                f"sum node '{nd.user_id}' adds branches not separated by a weighted layer (or the same input "
                "twice): they are correlated, so the normalized-sum rule and the solved maps are approximate there"
            )
    return out
