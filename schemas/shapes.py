"""The contract's shape rules for ``sigprop.graph/v1`` (contract section 1) applied to a graph: how
many inputs each op takes and what shape each node has, given its inputs' shapes, as the op table
(``schemas.ops``) defines them.

They live on the shared floor so that the client can check a graph it extracted from a model
(``sigprop.client.torch.graph_from_module``) by the rules the service applies, without importing
the service. The engine's ``build_graph`` applies the same rules while it canonicalizes a graph.
"""

from __future__ import annotations

from .errors import SigpropError
from .graph import Graph
from .ops import OP_TABLE, row_at
from .shape_rules import SUM_WEIGHT_TOLERANCE, Shape

__all__ = ["ARITY", "SUM_WEIGHT_TOLERANCE", "check_arity", "node_shape", "infer_shapes"]

# (fewest, most) inputs of the ops that do not take exactly one; None: no upper bound
ARITY = {row.op: row.arity for row in OP_TABLE.values() if row.arity != (1, 1)}


def _invalid(message: str, hint: str) -> SigpropError:
    return SigpropError("invalid_graph", message, hint)


def node_shape(nd, in_shapes: list[Shape]) -> Shape:
    """The shape of wire node ``nd`` given its inputs' shapes, in its ``inputs`` order.

    Raises ``SigpropError("invalid_graph")`` saying what is wrong when the rules reject it.
    """
    return row_at(nd.op, in_shapes).shape(nd, in_shapes)


def check_arity(nd) -> None:
    """Raise ``invalid_graph`` unless the node has as many inputs as its op takes (``ARITY``)."""
    lo, hi = OP_TABLE[nd.op].arity
    k = len(nd.inputs)
    if k < lo or (hi is not None and k > hi):
        want = f"{lo}" if lo == hi else f"at least {lo}"
        raise _invalid(f"node '{nd.id}' ({nd.op}) has {k} inputs", f"op '{nd.op}' takes {want} input(s)")


def _check_wiring(graph: Graph) -> str:
    """Ids, arity and edges of every node (dead ones too); returns the output node's id."""
    outputs = [nd.id for nd in graph.nodes if OP_TABLE[nd.op].sink]
    if len(outputs) != 1:
        listed = f" ({', '.join(outputs[:5])})" if outputs else ""
        raise _invalid(
            f"the graph has {len(outputs)} output nodes{listed}",
            "exactly one node must have op 'output'; merge several heads with a concat or sum first",
        )
    earlier: dict[str, str] = {}  # id -> op of the nodes listed so far
    for nd in graph.nodes:
        if nd.id in earlier:
            raise _invalid(f"node id '{nd.id}' is used twice", "give every node a unique id")
        check_arity(nd)
        for src in nd.inputs:
            if src not in earlier:
                raise _invalid(
                    f"node '{nd.id}' reads from '{src}', which is not listed before it",
                    "list every node after the nodes it reads from",
                )
            if OP_TABLE[earlier[src]].sink:
                raise _invalid(f"node '{nd.id}' reads from the output node '{src}'", "the output node must be last")
        earlier[nd.id] = nd.op
    return outputs[0]


def infer_shapes(graph: Graph) -> dict[str, Shape]:
    """The shape of every node that reaches the output, by id.

    For a graph whose nodes are listed after the nodes they read from, as ``graph_from_module``
    writes them (the engine's ``build_graph`` takes any order). Nodes that do not reach the output
    are checked for their wiring only, as the engine ignores them. Raises
    ``SigpropError("invalid_graph")`` with the engine's messages.
    """
    by_id = {nd.id: nd for nd in graph.nodes}
    live, stack = set(), [_check_wiring(graph)]
    while stack:
        nid = stack.pop()
        if nid not in live:
            live.add(nid)
            stack.extend(by_id[nid].inputs)
    shapes: dict[str, Shape] = {}
    for nd in graph.nodes:
        if nd.id in live:
            shapes[nd.id] = node_shape(nd, [shapes[i] for i in nd.inputs])
    return shapes
