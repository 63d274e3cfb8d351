"""One entry point: a validated ``SolveRequest`` in, a ``Solution`` (the contract's answer) out.

``prepare`` canonicalizes the request and computes its key without solving (the service looks the
key up in its cache first); ``solve_canonical`` solves it on the anonymized graph (node ids replaced
by ``#<canonical index>`` placeholders), which is what a cache stores; ``solve`` relabels that answer
with the request's own ids. The methods themselves are the ``engine.methods.registry`` registry. Serving
cached answer text to other requests (relabelling the text, the ``cached`` flag) is the service's
business: ``sigprop.answers``.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
from dataclasses import dataclass, fields

import numpy as np

from ..errors import SigpropError
from ..schemas.graph import Template
from ..schemas.ops import EXACT, MAX_PAIR, OP_TABLE, PASS, SUM
from ..schemas.solve import AssumptionReport, ResidualBeta, Solution, SolveRequest, TrainableAnswer
from ..schemas.structure import SUBNETWORK_CONVENTION, check_structure, structure_report
from ..version import ENGINE_VERSION
from .graph.build import NetworkGraph, Node, build_graph
from .limits import Limits
from .methods.registry import METHOD_TARGETS, METHODS, MethodInput, check_targets
from .network.program import compile_program
from .network.q_map import answer_q_slopes, unstable_q_warnings
from .sequence.graph import SequenceView, check_sequence_request, is_sequence_graph, scalar_view
from .sequence.solve import complete_sequence_answer
from .templates.builder import TemplateSize
from .templates.expand import expand_template_nodes

__all__ = ["METHOD_TARGETS", "Prepared", "prepare", "relabel_text", "request_key", "solve", "solve_canonical"]


@dataclass
class Prepared:
    request: SolveRequest
    graph: NetworkGraph
    key: str

    @property
    def ids(self) -> list[str]:
        """The request's node ids by canonical index."""
        return [nd.user_id for nd in self.graph.nodes]

    def __reduce__(self):
        # The service prepares a request once and hands this to a solver process (a pipe, so a
        # pickle): each node as a plain tuple pickles and loads in C, where a slotted dataclass
        # goes through its __getstate__ per node (an MLP-100's 203 nodes: 0.37 ms against 0.1 for the round trip).
        # A node-by-node request graph stays behind: its built form is ``graph``, and the key is
        # computed, so a solve reads nothing else of it (a template, a few bytes, goes along).
        graph, request = self.graph, self.request
        if not isinstance(request.graph, Template):
            request = request.model_copy(update={"graph": None})
        rest = {f.name: getattr(graph, f.name) for f in fields(graph) if f.name != "nodes"}
        rows = list(map(_NODE_ROW, graph.nodes))
        return _unpack, (request, rows, rest, self.key)


_NODE_ROW = operator.attrgetter(*(f.name for f in fields(Node)))  # a node's fields as a tuple, in C


def _unpack(request: SolveRequest, rows: list[tuple], rest: dict, key: str) -> Prepared:
    return Prepared(request, NetworkGraph([Node(*row) for row in rows], **rest), key)


# Stands for the graph in the key's payload until its text is put in place: json.dumps writes it
# as "\u0000graph", which nothing else in the payload can be (its strings are validated names).
_GRAPH_SLOT = "\x00graph"


def request_key(graph: NetworkGraph, request: SolveRequest) -> str:
    """Hex digest of the canonical request: equal for reordered or renamed graphs (contract 2).

    The payload is hashed as ``json.dumps(payload, sort_keys=True, separators=(",", ":"))`` with
    ``graph.canonical()`` under "graph"; that part's text comes from ``graph.canonical_json()``.
    """
    payload = {
        "engine": ENGINE_VERSION,
        "graph": _GRAPH_SLOT,
        "method": request.method,
        "activation": request.activation,
        "targets": {k: float(v) for k, v in request.targets.model_dump(exclude_none=True).items()},
        "init": request.init,
        "c_map_points": request.c_map_points,
    }
    if request.trainable is not None:
        payload["trainable"] = request.trainable.model_dump()
    if request.roots != "first":  # the default leaves the key as it was
        payload["roots"] = request.roots
    if request.assumptions != "strict":  # the default leaves the key as it was
        payload["assumptions"] = request.assumptions
    if request.attention is not None:  # absent: the key as it was
        payload["attention"] = {"shaping": request.attention.shaping, **request.attention.parameters()}
        if request.attention.schedule_name() is not None:  # the default written out gives the same key
            payload["attention"]["schedule"] = request.attention.schedule_name()
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    text = text.replace(json.dumps(_GRAPH_SLOT), graph.canonical_json(), 1)
    return hashlib.sha256(text.encode()).hexdigest()


def prepare(request: SolveRequest, limits: Limits | None = None, template_size: TemplateSize | None = None) -> Prepared:
    """The request's graph built and keyed, not solved. ``limits.max_nodes`` bounds a template's
    expansion (default ``Limits()``); ``template_size``: its size, when admission computed it
    (``sigprop.preparation``, which also applies the other limits)."""
    max_nodes = (limits or _NO_LIMITS).max_nodes
    # a template's nodes as the engine reads them: the same graph as expand_template's, built faster
    wire_graph = (
        expand_template_nodes(request.graph, max_nodes=max_nodes, size=template_size)
        if isinstance(request.graph, Template)
        else request.graph
    )
    graph = build_graph(wire_graph, default_activation=request.activation)
    return Prepared(request, graph, request_key(graph, request))


_NO_LIMITS = Limits()


def solve(request: SolveRequest, limits: Limits | None = None) -> Solution:
    """The answer for this request, with its own node ids and its graph's warnings."""
    prep = prepare(request, limits)
    answer = Solution.model_validate_json(relabel_text(solve_canonical(prep).to_json(), prep.ids))
    answer.warnings = list(prep.graph.warnings) + answer.warnings
    return answer


_PLACEHOLDER = re.compile(r"#(\d+)")


def relabel_text(canonical_json: str, ids) -> str:
    """A canonical answer's text with every ``#<index>`` placeholder replaced by ``ids[index]``.

    '#' cannot occur in ids or anywhere else in an answer, and equal keys mean equal canonical
    graphs, so the mapping is exact for any request with the same key. Ids are restricted to
    characters JSON never escapes, so substituting them into the text gives the same bytes as
    re-serializing.
    """
    return _PLACEHOLDER.sub(lambda m: ids[int(m.group(1))], canonical_json) if "#" in canonical_json else canonical_json


def solve_canonical(prep: Prepared) -> Solution:
    """The answer on the anonymized graph: what the cache stores under ``prep.key``."""
    request, method = prep.request, METHODS[prep.request.method]
    anonymous = Prepared(request, prep.graph.anonymized(), prep.key)
    full = graph = anonymous.graph
    # refused (strict, naming the request's own ids) before any solving: the check is one linear pass
    named = prep.graph if request.assumptions == "strict" else graph
    names = [nd.user_id for nd in named.nodes]
    view = _sequence_view(graph, prep.graph, request)
    if view is not None:  # the activations are solved on the scalar view (engine.sequence.graph)
        graph, names = view.graph, [names[i] for i in view.origin]
    report = structure_report(graph.nodes)
    notes = check_structure(names, report, request.assumptions) if method.kernel else []
    given = MethodInput(
        request, graph, prep.key, compile_program(graph, report), report, check_targets(request), names=names
    )
    answer = method.build(given)
    if method.kernel:
        # issue 34: the maps are per location; pooling several locations is the identity on them only
        # for inputs whose locations agree, which no graph says (a client's example_input calibration
        # measures these nodes): not a prediction, so holds is false, with pooling_warnings' words
        pooled = pooled_locations(graph)
        given.extra_violations.extend(v for v in pooled if v not in given.extra_violations)
        notes += [
            f"max_pool '{graph.nodes[v].user_id}' takes the maximum of neighbouring entries of a flattened map, "
            "which are neighbouring locations of one channel: correlated by the input, where the pair's map "
            "needs independent entries (pool before flattening, or pool a dense layer's units)"
            for v in pooled
            if OP_TABLE[graph.nodes[v].op].kind == MAX_PAIR
        ]
        answer.warnings = notes + answer.warnings + _degenerate(request, answer)
        answer.subnetworks = SUBNETWORK_CONVENTION
        answer.assumptions = AssumptionReport(
            mode=request.assumptions,
            holds=report.holds and not given.extra_violations,
            violations=[graph.nodes[v].user_id for v in report.flagged + given.extra_violations],
        )
        if report.sum_scales:
            answer.sum_scales = {graph.nodes[v].user_id: float(s) for v, s in sorted(report.sum_scales.items())}
        if answer.c_map is not None:
            answer.c_map.scope = "location" if report.convolutional else "example"
        local_q = answer_q_slopes(full, answer)
        if local_q is not None:  # on the full graph: the sequence view has its norms as identities
            answer.warnings += unstable_q_warnings(full, local_q)
    if view is not None:
        complete_sequence_answer(answer, full, view, request)
    if request.trainable is not None:
        answer.trainable, notes = _trainable(anonymous, answer)
        answer.warnings.extend(notes)
    return answer


def pooled_locations(graph: NetworkGraph) -> list[int]:
    """Pooling nodes that mix more than one location (their row's coverage is not exact: the window it
    reads is above one entry), e.g. avg_pool / max_pool with a window above 1 x 1, global_avg_pool of a map
    larger than 1 x 1; and pairs of features (``max_pool_pairs``) read from a flattened map of more
    than one location, whose neighbouring entries are neighbouring locations of one channel: correlated
    by the input, where the pair's closed form needs independent entries."""
    nodes = graph.nodes
    out = []
    for nd in nodes:
        row = OP_TABLE[nd.op]
        if row.pool and row.coverage(nd.attrs, nodes[nd.inputs[0]].shape).verdict != EXACT:
            out.append(nd.index)
        elif row.kind == MAX_PAIR and _reads_flattened_locations(nodes, nd.inputs[0]):
            out.append(nd.index)
    return out


def _reads_flattened_locations(nodes, i: int) -> bool:
    """Whether node ``i`` is, through pass-through ops, a map of more than one location flattened."""
    while OP_TABLE[nodes[i].op].kind == PASS and nodes[i].inputs:
        src = nodes[i].inputs[0]
        if OP_TABLE[nodes[i].op].to_features and math.prod(nodes[src].shape[1:]) > 1:
            return True
        i = src
    return False


def _sequence_view(graph: NetworkGraph, named: NetworkGraph, request: SolveRequest) -> SequenceView | None:
    """The scalar view of a sequence graph (refusing what it does not cover, naming ``named``'s ids),
    None for another graph; an ``attention`` key is refused on a graph without attention nodes."""
    if not is_sequence_graph(graph):
        if request.attention is not None:
            raise SigpropError(
                "invalid_request",
                "the request has an 'attention' shaping but the graph has no attention node",
                "leave 'attention' out, or solve a sequence graph (an 'attention' node, or the 'transformer' template)",
            )
        return None
    check_sequence_request(named, request)
    view = scalar_view(graph, named)
    if not view.attention and request.attention is not None:
        raise SigpropError(
            "invalid_request",
            "the request has an 'attention' shaping but the graph has no attention node",
            "leave 'attention' out for a sequence graph without attention",
        )
    return view


# how close to the identity a local C map may be before the answer says the network is linear
_LINEAR_C_MAP = 1e-4


def _degenerate(request: SolveRequest, answer: Solution) -> list[str]:
    """A warning when the targets make every transformed activation (nearly) linear: the C map is
    then the identity, and the network computes a linear map of its input (TAT paper, section 3:
    eta = 0 is Leaky ReLU with negative slope 1, the identity function)."""
    cm = answer.c_map
    if cm is None or not cm.local:
        return []
    gap = max(abs(y - c) for c, y in zip(cm.c, cm.local, strict=True))
    if gap > _LINEAR_C_MAP:
        return []
    targets = request.targets.model_dump(exclude_none=True)
    asked = ", ".join(f"{k} = {v:.10g}" for k, v in targets.items()) or "these targets"
    slope = f" (negative slope {answer.negative_slope:g})" if answer.negative_slope is not None else ""
    better = {"eta": "eta > 0 (the TAT paper uses 0.9)", "tau": "a larger tau", "zeta": "a larger zeta"}
    fix = next((better[k] for k in targets if k in better), "targets further from the identity")
    exact = gap == 0.0
    return [
        f"{asked} makes the transformed activation {'the identity' if exact else 'linear'}{slope}: the network "
        "becomes a linear network (a product of its weight matrices, no more expressive than one linear layer; "
        f"its C map is the identity{'' if exact else f' to within {gap:.1g}'}); ask for {fix}"
    ]


def _trainable(prep: Prepared, answer: Solution) -> tuple[TrainableAnswer, list[str]]:
    """Mark the TReLU slope and residual betas trainable (trainable-TAT paper, sections 2.1-2.2)."""
    opts, graph = prep.request.trainable, prep.graph
    notes = []
    slope = opts.negative_slope and answer.negative_slope is not None
    if opts.negative_slope and not slope:
        notes.append("trainable negative_slope applies to TAT with leaky_relu only; ignored")
    beta = None
    if opts.residual_beta != "none":
        sums = [nd.user_id for nd in graph.nodes if nd.kind == SUM and len(nd.inputs) == 2]
        if not sums:
            notes.append("trainable residual beta needs residual sums in the graph; there are none")
        else:
            scale = opts.beta / np.sqrt(len(sums))
            beta = ResidualBeta(
                mode=opts.residual_beta,
                init=opts.beta,
                blocks=len(sums),
                scale=float(scale),
                sums=sums,
                prune_fraction=opts.prune_fraction,
            )
            notes.append(
                "with residual beta the sums become x + beta / sqrt(L) F(x): un-normalized, so the "
                "solved kernel maps describe the network only up to that rescaling"
            )
    return TrainableAnswer(negative_slope=slope, residual_beta=beta), notes
