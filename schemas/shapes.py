"""The contract's shape rules for ``sigprop.graph/v1`` (contract section 1): how many inputs each op
takes and what shape each node has, given its inputs' shapes.

They live on the shared floor so that the client can check a graph it extracted from a model
(``sigprop.client.torch.graph_from_module``) by the rules the service applies, without importing
the service. The engine's ``build_graph`` applies the same rules while it canonicalizes a graph.
"""

from __future__ import annotations

import math

from .errors import SigpropError
from .graph import Graph
from .kernels import sum_coefficients

__all__ = ["ARITY", "SUM_WEIGHT_TOLERANCE", "check_arity", "node_shape", "infer_shapes"]

# (fewest, most) inputs; None: no upper bound. Every op not listed takes exactly one.
ARITY = {"input": (0, 0), "sum": (2, None), "concat": (2, None), "attention": (3, 3)}
SUM_WEIGHT_TOLERANCE = 1e-6

Shape = tuple[int, ...]


def _invalid(message: str, hint: str) -> SigpropError:
    return SigpropError("invalid_graph", message, hint)


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _conv_out(size: int, kernel: int, stride: int, padding) -> int:
    if padding == "same":
        return math.ceil(size / stride)
    pad = 0 if padding == "valid" else int(padding)
    return (size + 2 * pad - kernel) // stride + 1


def _sequence_refusal(nd, what: str) -> SigpropError:
    return SigpropError(
        "unsupported_structure",
        f"{nd.op} node '{nd.id}' {what} a token stream: sequence graphs take dense, activation, attention, "
        "layer_norm, sum, dropout and identity nodes",
        "token streams have shape [tokens, features]; mixing tokens other than by an 'attention' node "
        "(convolution, pooling, flattening, concatenation) is not covered",
    )


def _dense(nd, s: Shape) -> Shape:
    if len(s) == 2:  # a token stream [tokens, features]: the layer acts per token
        return (s[0], nd.units)
    if len(s) != 1:
        raise _invalid(
            f"dense node '{nd.id}' gets a feature map of shape {list(s)}",
            "insert a 'flatten' or 'global_avg_pool' node before a dense layer",
        )
    return (nd.units,)


def _conv(nd, s: Shape) -> Shape:
    if len(s) == 2:
        raise _sequence_refusal(nd, "reads")
    if len(s) != 3:
        raise _invalid(
            f"conv node '{nd.id}' gets a vector of shape {list(s)}",
            "conv layers take [channels, height, width] inputs; give the input node a 3-element shape",
        )
    (kh, kw), (sh, sw) = _pair(nd.kernel), _pair(nd.stride)
    h, w = _conv_out(s[1], kh, sh, nd.padding), _conv_out(s[2], kw, sw, nd.padding)
    if h < 1 or w < 1:
        raise _invalid(
            f"conv node '{nd.id}' shrinks a {s[1]}x{s[2]} map to nothing",
            "use padding 'same', a smaller kernel or stride, or a larger input",
        )
    return (nd.channels, h, w)


def _pool(nd, s: Shape) -> Shape:
    if len(s) == 2:
        raise _sequence_refusal(nd, "reads")
    if len(s) != 3:
        raise _invalid(
            f"{nd.op} node '{nd.id}' gets a vector of shape {list(s)}",
            "pooling needs a [channels, height, width] input",
        )
    kh, kw = _pair(nd.kernel)
    sh, sw = _pair(nd.stride if nd.stride is not None else nd.kernel)
    pad = getattr(nd, "padding", 0)
    if 2 * pad > min(kh, kw):
        raise _invalid(
            f"{nd.op} node '{nd.id}' pads {pad} with a {kh}x{kw} kernel",
            "padding may be at most half the kernel size (as in PyTorch)",
        )
    h, w = (s[1] + 2 * pad - kh) // sh + 1, (s[2] + 2 * pad - kw) // sw + 1
    if h < 1 or w < 1:
        raise _invalid(f"{nd.op} node '{nd.id}' shrinks a {s[1]}x{s[2]} map to nothing", "use a smaller pooling kernel")
    return (s[0], h, w)


def _global_pool(nd, s: Shape) -> Shape:
    if len(s) == 2:
        raise _sequence_refusal(nd, "reads")
    if len(s) != 3:
        raise _invalid(
            f"global_avg_pool node '{nd.id}' gets a vector of shape {list(s)}",
            "it needs a [channels, height, width] input",
        )
    return (s[0],)


def _sum(nd, in_shapes: list[Shape]) -> Shape:
    s = in_shapes[0]
    if in_shapes.count(s) != len(in_shapes):
        raise _invalid(
            f"sum node '{nd.id}' adds shapes {[list(x) for x in in_shapes]}",
            "all inputs of a sum must have the same shape",
        )
    n = len(in_shapes)
    weights = nd.weights if nd.weights is not None else [1.0 / math.sqrt(n)] * n
    if len(weights) != n:
        raise _invalid(f"sum node '{nd.id}' has {n} inputs but {len(weights)} weights", "give one weight per input")
    sq = sum(sum_coefficients(weights))  # the sum's q for inputs at q = 1
    if abs(sq - 1.0) > SUM_WEIGHT_TOLERANCE:
        norm = math.sqrt(sq) if sq > 0 else 1.0
        raise _invalid(
            f"sum node '{nd.id}' weights have sum of squares {sq:.6g}, not 1",
            f"normalize them, e.g. {[round(w / norm, 6) for w in weights]}, or omit them for equal weights",
        )
    return s


def _concat(nd, in_shapes: list[Shape]) -> Shape:
    s = in_shapes[0]
    if any(len(x) == 2 for x in in_shapes):
        raise _sequence_refusal(nd, "joins")
    if len({len(x) for x in in_shapes}) != 1 or (len(s) == 3 and len({x[1:] for x in in_shapes}) != 1):
        raise _invalid(
            f"concat node '{nd.id}' joins shapes {[list(x) for x in in_shapes]}",
            "concatenation is along channels: inputs need equal rank and equal height and width",
        )
    return (sum(x[0] for x in in_shapes),) + tuple(s[1:])


def _flatten(nd, s: Shape) -> Shape:
    if len(s) == 2:
        raise _sequence_refusal(nd, "reads")
    return (math.prod(s),)


def _layer_norm(nd, s: Shape) -> Shape:
    if len(s) != 2:
        raise _invalid(
            f"layer_norm node '{nd.id}' gets shape {list(s)}, not a token stream",
            'layer_norm normalizes each token of a sequence: give the input node "sequence": true and shape '
            "[tokens, features]",
        )
    return s


def _attention(nd, in_shapes: list[Shape]) -> Shape:
    """Query, key and value: token streams of one shape whose features the heads divide."""
    if any(len(x) != 2 for x in in_shapes):
        raise _invalid(
            f"attention node '{nd.id}' reads shapes {[list(x) for x in in_shapes]}, not token streams",
            'attention mixes tokens: give the input node "sequence": true and shape [tokens, features]',
        )
    s = in_shapes[0]
    if in_shapes.count(s) != 3:
        raise _invalid(
            f"attention node '{nd.id}' reads query, key and value of shapes {[list(x) for x in in_shapes]}",
            "query, key and value must be dense nodes with equal units reading the same node",
        )
    if s[1] % nd.heads:
        raise _invalid(
            f"attention node '{nd.id}' has {nd.heads} heads for {s[1]} features",
            "the query/key/value units must be a multiple of heads",
        )
    return s


_ONE_INPUT = {
    "dense": _dense,
    "conv": _conv,
    "avg_pool": _pool,
    "max_pool": _pool,
    "global_avg_pool": _global_pool,
    "flatten": _flatten,
    "layer_norm": _layer_norm,
}
_MANY_INPUTS = {"sum": _sum, "concat": _concat, "attention": _attention}


def node_shape(nd, in_shapes: list[Shape]) -> Shape:
    """The shape of wire node ``nd`` given its inputs' shapes, in its ``inputs`` order.

    Raises ``SigpropError("invalid_graph")`` saying what is wrong when the rules reject it.
    """
    op = nd.op
    if (rule := _ONE_INPUT.get(op)) is not None:
        return rule(nd, in_shapes[0])
    if (rule := _MANY_INPUTS.get(op)) is not None:
        return rule(nd, in_shapes)
    if op == "input":
        return tuple(nd.shape)
    return in_shapes[0]  # activation, dropout, identity, output


def check_arity(nd) -> None:
    """Raise ``invalid_graph`` unless the node has as many inputs as its op takes (``ARITY``)."""
    lo, hi = ARITY.get(nd.op, (1, 1))
    k = len(nd.inputs)
    if k < lo or (hi is not None and k > hi):
        want = f"{lo}" if lo == hi else f"at least {lo}"
        raise _invalid(f"node '{nd.id}' ({nd.op}) has {k} inputs", f"op '{nd.op}' takes {want} input(s)")


def _check_wiring(graph: Graph) -> str:
    """Ids, arity and edges of every node (dead ones too); returns the output node's id."""
    outputs = [nd.id for nd in graph.nodes if nd.op == "output"]
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
            if earlier[src] == "output":
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
