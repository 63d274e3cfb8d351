"""One preparation per request: admitted against the limits, parsed, built and keyed once.

``POST /v1/solve``, its solver processes, ``sigprop solve`` and ``sigprop.solve`` all turn a body
into an ``engine.solve.Prepared`` here, against one ``engine.limits.Limits`` their caller built
from its settings (the engine reads none). Admission comes before any work that grows with the
request (``admit``): the JSON alone says a template's exact size (from its parameters, computed
once and handed on to the expansion) or a node-by-node graph's node count, cost (nodes plus edges)
and widest sum or concat, so an oversized request is refused (413 ``graph_too_large``) before
it is validated or built. What admission cannot know before the build (a hand-written graph's
depth, a graph's node count after its structure is read) is checked on the built graph.

A ``Prepared`` pickles compactly (``engine.solve``): the service prepares a request once, in its
own process or, for a large body, in a solver process, and the solver process that solves it
receives that prepared form rather than the body to parse again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import ValidationError

from .engine.limits import MAX_TOKEN_KERNEL, Limits, token_work
from .engine.solve import Prepared, prepare
from .engine.templates.builder import TemplateSize
from .engine.templates.expand import TEMPLATES
from .engine.templates.transformer import transformer_param
from .errors import SigpropError
from .requests import SOLVE_HINT, load_json, parse_solve_request
from .schemas.graph import Template
from .schemas.ops import ATTENTION, OP_TABLE

# ops that take any number of inputs (their row's arity has no upper bound): what max_fan_in limits
_UNBOUNDED_FAN_IN = frozenset(op for op, row in OP_TABLE.items() if row.arity[1] is None)

# About the nanoseconds of one core a node or an edge of a graph costs to solve (MLP and ladder
# graphs, 10-17 us each: ``bench/cost_bench.py``): what converts a token-kernel price into nodes + edges.
NS_PER_COST = 10_000

COST_HINT = (
    "split the network or use a smaller template depth, or raise SIGPROP_MAX_SOLVE_COST "
    "(nodes + edges) on your own deployment"
)


@dataclass(frozen=True)
class Admitted:
    """A request body's JSON that passed admission, and what admission learned of its size."""

    data: object  # the parsed JSON (``parse_solve_request`` says what is wrong with a non-request)
    cost: int | None  # nodes + edges, when the JSON says it before the build
    template: TemplateSize | None  # a template's size from its parameters (None: not a valid template)


def graph_cost(graph) -> tuple[int, int] | None:
    """(nodes, edges) of a request's graph, before it is expanded or built: ``graph`` is the raw
    JSON value or a parsed ``Template``. None when the shape is not a graph (validation says why)."""
    if isinstance(graph, dict) and "template" in graph:
        try:
            graph = Template.model_validate(graph)
        except ValidationError:
            return None
    if isinstance(graph, Template):
        size = template_size(graph)
        return None if size is None else (size.nodes, size.edges)
    nodes = graph.get("nodes") if isinstance(graph, dict) else getattr(graph, "nodes", None)
    if not isinstance(nodes, list):
        return None
    edges = 0
    for nd in nodes:
        ins = nd.get("inputs") if isinstance(nd, dict) else getattr(nd, "inputs", None)
        edges += len(ins) if isinstance(ins, list) else 0
    return len(nodes), edges


def template_size(t: Template) -> TemplateSize | None:
    spec = TEMPLATES.get(t.template)
    return spec.size(t) if spec is not None else None


def check_cost(graph, budget: int) -> None:
    """Refuse (413 ``graph_too_large``, the hint naming SIGPROP_MAX_SOLVE_COST) a graph whose nodes
    plus edges exceed ``budget``."""
    cost = graph_cost(graph)
    if cost is not None:
        _check_cost(cost, budget, _what(graph))


def _what(graph) -> str:
    if isinstance(graph, Template):
        return f"template '{graph.template}' expands to"
    if isinstance(graph, dict) and "template" in graph:
        return f"template '{graph.get('template')}' expands to"
    return "the graph has"


def _check_cost(cost: tuple[int, int], budget: int | None, what: str) -> None:
    nodes, edges = cost
    if budget is not None and nodes + edges > budget:
        raise SigpropError(
            "graph_too_large",
            f"{what} {nodes} nodes and {edges} edges, a cost of {nodes + edges}: more than this "
            f"service's budget of {budget} per solve",
            COST_HINT,
        )


def check_template(
    t: Template, limits: Limits, shaping: str | None = None, schedule: str | None = None
) -> TemplateSize | None:
    """A template's size from its parameters, refused (413) over any limit; None when its
    parameters are invalid (the expansion says why). ``shaping``, ``schedule``: the request's
    attention shaping and schedule (their price)."""
    size = template_size(t)
    if size is None:
        return None
    what = f"template '{t.template}' expands to"
    if size.nodes > limits.max_nodes:
        raise too_large(size.nodes, limits.max_nodes, what)
    if limits.max_depth is not None and size.depth > limits.max_depth:
        raise too_deep(size.depth, limits.max_depth, what)
    if limits.max_fan_in is not None and size.fan_in > limits.max_fan_in:
        raise fan_in_error(f"a concat of template '{t.template}'", size.fan_in, limits.max_fan_in)
    _check_cost((size.nodes, size.edges), limits.max_cost, what)
    if t.template == "transformer":  # its tokens and token-kernel price, before it is built
        _check_tokens(transformer_param(t, "seq_len"), t.depth or 0, size.nodes - t.depth, limits, shaping, schedule)
    return size


def admit(data, limits: Limits) -> Admitted:
    """``data`` (a parsed JSON body) checked against ``limits`` before it is validated or built."""
    raw = data.get("graph") if isinstance(data, dict) else None
    if isinstance(raw, dict) and "template" in raw:
        try:
            template = Template.model_validate(raw)
        except ValidationError:
            return Admitted(data, None, None)  # validation says why
        size = check_template(template, limits, _shaping(data), _schedule(data))
        return Admitted(data, None if size is None else size.nodes + size.edges, size)
    nodes = raw.get("nodes") if isinstance(raw, dict) else None
    if not isinstance(nodes, list):
        return Admitted(data, None, None)
    if len(nodes) > limits.max_nodes:
        raise too_large(len(nodes), limits.max_nodes)
    cost = graph_cost(raw)
    _check_cost(cost, limits.max_cost, "the graph has")
    if limits.max_fan_in is not None:
        for nd in nodes:
            ins = nd.get("inputs") if isinstance(nd, dict) else None
            op = nd.get("op") if isinstance(nd, dict) else None
            unbounded = isinstance(op, str) and op in _UNBOUNDED_FAN_IN
            if unbounded and isinstance(ins, list) and len(ins) > limits.max_fan_in:
                raise fan_in_error(f"{op} node '{nd.get('id')}'", len(ins), limits.max_fan_in)
    return Admitted(data, cost[0] + cost[1], None)


def prepare_admitted(admitted: Admitted, limits: Limits) -> Prepared:
    """The admitted request validated, built and keyed; refused (413) when the built graph says
    what its JSON could not (its node count, its depth)."""
    request = parse_solve_request(admitted.data)
    prep = prepare(request, limits, admitted.template)
    if prep.graph.n > limits.max_nodes:
        raise too_large(prep.graph.n, limits.max_nodes)
    if limits.max_depth is not None:
        depth = prep.graph.depth()
        if depth > limits.max_depth:
            raise too_deep(depth, limits.max_depth)
    check_tokens(prep.graph, limits, _shaping(admitted.data), _schedule(admitted.data))
    return prep


def check_tokens(graph, limits: Limits, shaping: str | None = None, schedule: str | None = None) -> None:
    """Refuse (413) a sequence graph whose tokens or token-kernel propagation exceed the limits."""
    tokens = _tokens(graph)
    if tokens:
        attention = sum(1 for nd in graph.nodes if nd.kind == ATTENTION)
        _check_tokens(tokens, attention, graph.n - attention, limits, shaping, schedule)


def _tokens(graph) -> int:
    return max((nd.shape[0] for nd in graph.nodes if nd.attrs.get("sequence")), default=0)


def _shaping(data) -> str | None:
    """The attention shaping a request body names (None: none, or not a request)."""
    return _attention_field(data, "shaping")


def _schedule(data) -> str | None:
    """The attention schedule a request body names (None: the shaping's default, or not a request)."""
    return _attention_field(data, "schedule")


def _attention_field(data, name: str) -> str | None:
    attention = data.get("attention") if isinstance(data, dict) else None
    value = attention.get(name) if isinstance(attention, dict) else None
    return value if isinstance(value, str) else None


def solve_price(graph, shaping: str | None = None, schedule: str | None = None) -> int:
    """What a built graph's solve costs, in the unit of ``max_cost`` (nodes plus edges, about
    ``NS_PER_COST`` ns each): its nodes plus edges, plus a sequence graph's token-kernel propagation
    (``token_work``, in ns) converted. What chooses a cold solve's lane: a transformer of few nodes
    and a long token kernel is large, whatever its family (issue 35)."""
    price = graph.n + sum(len(nd.inputs) for nd in graph.nodes)
    tokens = _tokens(graph)
    if tokens:
        attention = sum(1 for nd in graph.nodes if nd.kind == ATTENTION)
        price += token_work(tokens, attention, graph.n - attention, shaping, schedule) // NS_PER_COST
    return price


def _check_tokens(
    tokens: int, attention: int, others: int, limits: Limits, shaping: str | None = None, schedule: str | None = None
) -> None:
    if limits.max_seq_len is not None and tokens > limits.max_seq_len:
        raise SigpropError(
            "graph_too_large",
            f"the graph's sequences have {tokens} tokens, more than this service's limit of {limits.max_seq_len}",
            "use a shorter seq_len (the answer's attention generators hold for any length)",
        )
    work = token_work(tokens, attention, others, shaping, schedule)
    if limits.max_token_work is not None and work > limits.max_token_work:
        raise SigpropError(
            "graph_too_large",
            f"the token-kernel propagation of {attention} attention nodes over {min(tokens, MAX_TOKEN_KERNEL)} "
            f"tokens costs {work:.3g}, more than this service's budget of {limits.max_token_work:.3g}",
            "use fewer blocks or a shorter seq_len",
        )


def prepare_data(data, limits: Limits) -> Prepared:
    """A parsed JSON request, admitted and prepared (``sigprop solve``, ``sigprop.solve``)."""
    return prepare_admitted(admit(data, limits), limits)


def prepare_payload(payload: bytes | Admitted, limits: Limits) -> tuple[Prepared, str]:
    """A body (or an admitted one) prepared, with the request text stored beside its answer
    (compact JSON): what a solver process runs for a request too heavy for the API's process."""
    admitted = payload if isinstance(payload, Admitted) else admit(load_json(payload, SOLVE_HINT), limits)
    return prepare_admitted(admitted, limits), json.dumps(admitted.data, separators=(",", ":"))


def too_large(n: int, limit: int, what: str = "the graph has") -> SigpropError:
    return SigpropError(
        "graph_too_large",
        f"{what} {n} nodes, more than this service's limit of {limit}",
        "split the network, use a smaller template depth, or raise SIGPROP_MAX_NODES on your own deployment",
    )


def too_deep(depth: int, limit: int, what: str = "the graph has") -> SigpropError:
    return SigpropError(
        "graph_too_large",
        f"{what} {depth} nonlinear layers on its longest path, more than this service's limit of {limit}",
        "use a smaller depth, or raise SIGPROP_MAX_DEPTH on your own deployment",
    )


def fan_in_error(what: str, n: int, limit: int) -> SigpropError:
    return SigpropError(
        "graph_too_large",
        f"{what} has {n} inputs, more than this service's limit of {limit}",
        "join the inputs in a tree of smaller sums or concats, or raise SIGPROP_MAX_FAN_IN on your own deployment",
    )
