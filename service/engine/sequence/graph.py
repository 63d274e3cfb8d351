"""Sequence graphs (token streams, ``attention``, ``layer_norm``): their coverage rules and the scalar
view the activation solvers read.

"Deep Transformers without Shortcuts: Modifying Self-attention for Faithful Signal Propagation"
(He, Martens et al., arXiv:2302.10322) combines TAT with its attention shaping by solving the MLP
blocks' activations as if attention passed its value input through: with zero query weights (E-SPA,
U-SPA, Value-SkipInit) or shaped attention at infinite width, attention at initialization is a
fixed token-mixing matrix A, and the activations are transformed for the network of MLP blocks
alone. ``scalar_view`` builds that network: each ``attention`` node becomes an ``identity`` reading
its value node (the query and key dense nodes, read by the attention alone, go), and each
``layer_norm`` or ``rms_norm`` an ``identity`` (per-token normalization changes neither q = 1 nor C at
q = 1, which is where the kernel methods hold every stream; rms_norm does not centre, so it is that
identity after an activation too). A ``mul`` stays: the view's passes carry its product rule. Node
shapes drop the token axis, so every existing pass (structure report, network program, methods)
reads the view as the vector network it is.
The token mixing itself is ``token_program``'s business: the exact T x T propagation.

Coverage (contract section 1): exact are dense, activation, attention whose query, key and value are
dense nodes of equal units reading the same node, layer_norm on a zero-mean stream, sums, dropout
and identity on token streams; refused are convolutions, pooling, flattening and concatenation of
token streams (``schemas.shapes``), cross-attention (query, key and value from different nodes) and
a layer_norm reading an activation's output (its per-token centring is not an identity there).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SigpropError
from ...schemas.ops import ACT, AFFINE, ATTENTION, NORM, OP_TABLE, PASS, SOURCE
from ...schemas.shapings import SHAPINGS
from ...schemas.solve import SEQUENCE_METHODS, SolveRequest
from ..graph.build import NetworkGraph, Node, pass_sources

__all__ = ["SequenceView", "is_sequence_graph", "scalar_view", "check_sequence_request", "SEQUENCE_METHODS"]


@dataclass(frozen=True)
class SequenceView:
    """A sequence graph's scalar view (module docstring) and where its nodes come from."""

    graph: NetworkGraph  # the view: attention and layer_norm as identities, no query/key nodes
    origin: tuple[int, ...]  # view index -> index in the full graph
    attention: tuple[int, ...]  # the full graph's attention nodes, in canonical (network) order
    queries: frozenset[int]  # the full graph's query dense nodes
    keys: frozenset[int]  # the full graph's key dense nodes
    tokens: int  # T


def is_sequence_graph(graph: NetworkGraph) -> bool:
    """Whether the graph carries token streams (a sequence input, attention, or a norm of a token
    stream: rms_norm also normalizes [features] per example in dense graphs)."""
    return any(
        nd.attrs.get("sequence") or nd.kind == ATTENTION or (nd.kind == NORM and len(nd.shape) == 2)
        for nd in graph.nodes
    )


def _unsupported(message: str, hint: str) -> SigpropError:
    return SigpropError("unsupported_structure", message, hint)


def check_sequence_request(graph: NetworkGraph, request: SolveRequest) -> None:
    """Refuse what the sequence solver does not cover, naming the construct (before any work)."""
    has_attention = any(nd.kind == ATTENTION for nd in graph.nodes)
    if has_attention and request.attention is None:
        first = next(nd.user_id for nd in graph.nodes if nd.kind == ATTENTION)
        raise SigpropError(
            "invalid_request",
            f"the graph has attention node '{first}' but the request has no 'attention' key",
            f'name how to shape attention, e.g. "attention": {{"shaping": "{SHAPINGS[0]}"}} (or '
            + ", ".join(f'"{name}"' for name in SHAPINGS[1:])
            + "): standard attention with random queries and keys is not a fixed matrix at initialization, "
            "so its signal propagation has no kernel description",
        )
    if request.method not in SEQUENCE_METHODS:
        raise SigpropError(
            "unsupported_method",
            f"method '{request.method}' does not solve sequence graphs (token streams, attention, layer_norm)",
            f"use method {' or '.join(repr(m) for m in SEQUENCE_METHODS)} with an 'attention' shaping",
        )


def _check_attention(graph: NetworkGraph, nd: Node, consumers: list[list[int]]) -> None:
    """``graph``: the graph with the request's own ids (errors name them)."""
    nodes = graph.nodes
    nd = nodes[nd.index]
    q, k, v = (nodes[i] for i in nd.inputs)
    if not all(x.kind == AFFINE and not OP_TABLE[x.op].spatial for x in (q, k, v)):
        raise _unsupported(
            f"attention node '{nd.user_id}' reads {', '.join(repr(x.user_id) for x in (q, k, v))}: query, key and "
            "value must be dense nodes",
            "write the query, key and value projections as dense nodes reading the attention's input",
        )
    if not (q.inputs == k.inputs == v.inputs):
        raise _unsupported(
            f"attention node '{nd.user_id}' is cross-attention: its query, key and value dense nodes read "
            f"different nodes ({', '.join(repr(nodes[x.inputs[0]].user_id) for x in (q, k, v))})",
            "only self-attention is covered: the query, key and value dense nodes must read the same node",
        )
    if len({q.index, k.index, v.index}) != 3:
        raise _unsupported(
            f"attention node '{nd.user_id}' reads one dense node twice",
            "give the query, key and value their own dense nodes",
        )
    for role, x in (("query", q), ("key", k)):
        if consumers[x.index] != [nd.index]:
            raise _unsupported(
                f"the {role} dense node '{x.user_id}' of attention '{nd.user_id}' is read by other nodes too",
                f"a {role} projection feeds its attention node only",
            )


def scalar_view(graph: NetworkGraph, named: NetworkGraph | None = None) -> SequenceView:
    """The scalar view of a sequence graph (module docstring), after the coverage checks; ``named``:
    the same graph with the ids its errors name (the request's own, where ``graph`` is anonymized)."""
    named = graph if named is None else named
    nodes = graph.nodes
    consumers = graph.consumers()
    source = pass_sources(nodes)
    attention, queries, keys = [], set(), set()
    for nd in nodes:
        if nd.kind == ATTENTION:
            _check_attention(named, nd, consumers)
            attention.append(nd.index)
            queries.add(nd.inputs[0])
            keys.add(nd.inputs[1])
        elif nd.kind == NORM and OP_TABLE[nd.op].centres and nodes[source[nd.inputs[0]]].kind == ACT:
            raise _unsupported(
                f"{nd.op} node '{named.nodes[nd.index].user_id}' reads the output of activation "
                f"'{named.nodes[source[nd.inputs[0]]].user_id}'",
                "a layer_norm centres each token, which the kernel maps of a post-activation stream do not "
                "describe: put a dense layer (or the residual sum of dense outputs) before it",
            )
    dropped = queries | keys
    index: dict[int, int] = {}
    view: list[Node] = []
    origin: list[int] = []
    tokens = 1
    for nd in nodes:
        if nd.index in dropped:
            continue
        shape = nd.shape
        if len(shape) == 2:
            tokens = shape[0]
            shape = shape[1:]
        i = len(view)
        index[nd.index] = i
        origin.append(nd.index)
        attrs, op, kind, ins = nd.attrs, nd.op, nd.kind, nd.inputs
        if kind == ATTENTION:
            op, kind, attrs, ins = "identity", PASS, {}, (nd.inputs[2],)
        elif kind == NORM:
            op, kind, attrs = "identity", PASS, {}
        elif kind == SOURCE and "sequence" in attrs:
            attrs = {"shape": list(shape)}
        view.append(Node(i, nd.user_id, op, kind, tuple(index[j] for j in ins), attrs, tuple(shape)))
    return SequenceView(
        NetworkGraph(view, len(view) - 1, list(graph.warnings)),
        tuple(origin),
        tuple(attention),
        frozenset(queries),
        frozenset(keys),
        tokens,
    )
