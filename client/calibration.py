"""Measured where the theory is silent: ``apply(..., example_input=x)`` calibrates the ops whose
effect on q an answer cannot predict, in both adapters.

The Q/C maps of an answer (TAT paper, arXiv:2203.08120, section 2.3) hold for activations that
read Gaussian inputs. Some ops break that with no map to say by how much: max pooling (the maximum
of 9 Gaussians has a mean square near 2.5 and a positive mean), the activations that read a
max-pooled map (their input is not Gaussian), average pooling of locations that differ (it
averages correlations the per-location maps do not track), ops an adapter treats as the
identity, and whatever the answer itself names as outside its predictions. :func:`measured_nodes`
is the one place that decides which nodes these are.

For each such node the adapter runs the example batch, measures the mean square of the node's
input(s) and output, and multiplies the node's output by ``factor = sqrt(q_target / q_out)``.
``q_target`` is the q the answer predicts at the node (tat and dks: its maps composed along the
graph, as ``diagnose`` composes them; 1 for every node of a TAT leaky_relu answer), or, where the
answer predicts none, what its maps give from the measured inputs (the input's q for pooling and
identity-like ops, ``Q(1)`` for an activation, ``sum w_i^2 q_i`` for a sum, 1 after a norm,
``q_u q_v`` for a product). The factor goes into
weights, so the network computes it with no extra op:

* ``reads``: the dense/conv layers that read the node (through identity, flatten, dropout) get
  their kernels multiplied: a linear layer's kernel scale is a scale of its input, bias untouched;
* ``feeds``: otherwise, for a positively homogeneous node (pooling), the one dense/conv layer whose
  output reaches only this node gets kernel and bias multiplied (pooling of ``a y`` is ``a`` times
  the pooling of ``y`` for ``a > 0``);
* ``multiplier``: otherwise the torch adapter inserts ``output * factor`` after the node; the JAX
  adapter cannot rewrite the model's code and reports the node as not calibrated (``none``).

Nodes are calibrated in topological waves (a node is measured only after every calibrated node
above it has been corrected): one forward pass of the example batch per wave, at most one per
calibrated node, so the cost is bounded by the graph before any work starts. The factors hold for
inputs like the batch: they are measured, not predicted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..schemas.graph import Graph
from ..schemas.kernels import concat_coefficients, sum_coefficients
from ..schemas.ops import (
    ACT,
    AFFINE,
    CONCAT,
    EXACT,
    NORM,
    OP_TABLE,
    PASS,
    PRODUCT,
    SOURCE,
    SUM,
    canonical_attrs,
    row_at,
)
from ..schemas.shapes import infer_shapes
from ..schemas.solve import Solution

__all__ = ["Calibration", "Placement", "measured_nodes", "answer_uncovered", "placement", "calibrate"]

# The op table's rows say what each op is to calibration (``sigprop.schemas.ops``):
# layers (kind affine) are where factors go, not what is measured, and neither are the input and output;
# a factor passes unchanged through the ops that change nothing (kind pass, not shown: identity,
# flatten, dropout) and through a homogeneous op (f(a y) = a f(y) for a > 0: those and the pools).
_LAYERS = frozenset(op for op, row in OP_TABLE.items() if row.kind == AFFINE)
_PASS = frozenset(op for op, row in OP_TABLE.items() if row.kind == PASS and not row.shown)
_HOMOGENEOUS = frozenset(op for op, row in OP_TABLE.items() if row.homogeneous)
_NEVER = _LAYERS | {op for op, row in OP_TABLE.items() if row.kind == SOURCE or row.sink}
_POOLING = {"max": "max pooling", "mean": "average pooling"}  # a row's ``pool``, for the reason given


@dataclass(frozen=True)
class Placement:
    """Where node ``node``'s factor goes: ``where`` is reads | feeds | multiplier; ``layers`` graph ids."""

    node: str
    where: str
    layers: tuple[str, ...] = ()


@dataclass
class Calibration:
    """One calibrated node: what was measured on the example batch and where the factor went."""

    id: str
    op: str
    why: str
    q_in: float  # mean square of its (first) input on the example batch
    q_out: float  # mean square of its output, before the correction
    q_target: float  # the answer's q at the node (else its maps applied to the measured inputs)
    factor: float  # multiplier now on the node's output: sqrt(q_target / q_out)
    where: str  # reads | feeds | multiplier | none (not applied)
    layers: list[str] = field(default_factory=list)  # graph ids of the rescaled layers

    @property
    def effect(self) -> float:
        """The op's measured effect on q: ``q_out / q_in`` (1 for an op the theory would predict)."""
        return self.q_out / self.q_in if self.q_in > 0 else math.nan

    def describe(self) -> str:
        placed = {
            "reads": f"kernel of {', '.join(self.layers)} (the layer(s) reading it)",
            "feeds": f"kernel and bias of {', '.join(self.layers)} (the layer feeding it)",
            "multiplier": "a multiplier inserted after it",
            "none": "NOT APPLIED (no layer to rescale: scale its output by hand)",
        }[self.where]
        return (
            f"{self.id} ({self.why}): q {self.q_in:.4g} -> {self.q_out:.4g} on the example batch "
            f"(x{self.effect:.4g}); factor {self.factor:.6g} on its output, in the {placed}"
        )


def answer_uncovered(sol: Solution) -> list[str]:
    """Node ids the answer names as outside its predictions: the activations whose input is not
    Gaussian (``assumptions.violations``, under ``"assumptions": "warn"``). A list of nodes whose
    effect the answer measures rather than predicts belongs here too, when the answer carries one."""
    return list(sol.assumptions.violations) if sol.assumptions is not None else []


def _pooled(wire, in_shape) -> str:
    """Why a pool is measured (its row's coverage: ``calibrated`` over more than one location; a pair
    of features, ``max_pool_pairs``, is exact), else ""."""
    row = row_at(wire.op, [tuple(in_shape)])
    if not row.pool or row.coverage(canonical_attrs(wire, len(wire.inputs)), tuple(in_shape)).verdict == EXACT:
        return ""
    return ("global " if row.to_features else "") + _POOLING.get(row.pool, f"{row.pool} pooling")


def measured_nodes(graph: Mapping, uncovered: Iterable[str] = ()) -> dict[str, str]:
    """Graph id -> why, for every node whose effect on q is measured rather than predicted.

    Max pooling and average pooling over more than one location (global pooling of a map larger
    than 1 x 1); every id in ``uncovered`` (the answer's list, :func:`answer_uncovered`, and the
    ops an adapter treated as the identity); and every activation whose input carries one of those
    nodes' outputs with no dense/conv in between (a max-pooled map is not Gaussian: its mean is
    positive, so the activation's Q map does not apply). Never dense/conv, input or output nodes."""
    named = set(uncovered)
    wire = Graph.model_validate(dict(graph))
    shapes = infer_shapes(wire)
    out: dict[str, str] = {}
    origin: dict[str, str] = {}  # value -> the measured node it carries, with no layer in between
    for nd, wnd in zip(graph["nodes"], wire.nodes, strict=True):
        op, nid, row = nd["op"], nd["id"], OP_TABLE[nd["op"]]
        if op in _NEVER:
            continue
        carried = next((origin[i] for i in nd.get("inputs", []) if i in origin), None)
        # pooling first: the answer names a pool over several locations among its violations too
        # (its locations are not known to be identical), and the op's own reason says more
        pooled = _pooled(wnd, shapes.get(nd["inputs"][0], [1])) if row.pool else ""
        if pooled:
            out[nid] = pooled
        elif nid in named:
            out[nid] = f"{op} outside the answer's predictions"
        elif row.kind == ACT and carried is not None:
            out[nid] = f"activation of a non-Gaussian input (from '{carried}')"
        if row.kind != ACT and carried is not None:
            origin[nid] = carried
        elif row.kind != ACT and row.pool != "mean" and nid in out:
            origin[nid] = nid  # averages of Gaussian maps stay Gaussian; the others do not
    return out


def _consumers(graph: Mapping) -> dict[str, list[Mapping]]:
    users: dict[str, list[Mapping]] = {nd["id"]: [] for nd in graph["nodes"]}
    for nd in graph["nodes"]:
        for i in nd.get("inputs", []):
            users[i].append(nd)
    return users


def placement(graph: Mapping, nid: str) -> Placement:
    """Where node ``nid``'s factor can go without a new op (module docstring), else ``multiplier``."""
    users, by_id = _consumers(graph), {nd["id"]: nd for nd in graph["nodes"]}
    readers: list[str] = []
    stack, ok = [nid], True
    while stack and ok:
        for u in users[stack.pop()]:
            if u["op"] in _LAYERS:
                readers.append(u["id"])
            elif u["op"] in _PASS:
                stack.append(u["id"])
            else:
                ok = False
    if ok and readers:
        return Placement(nid, "reads", tuple(readers))
    cur = by_id[nid]
    while cur["op"] in _HOMOGENEOUS:
        src = by_id[cur["inputs"][0]]
        if len(users[src["id"]]) != 1:
            break
        if src["op"] in _LAYERS:
            return Placement(nid, "feeds", (src["id"],))
        cur = src
    return Placement(nid, "multiplier")


def _answer_q(graph: Mapping, sol: Solution, unmodelled: Iterable[str]) -> dict[str, float]:
    """The q the answer predicts at each node for inputs at q = 1 (tat, dks, eoc and sparse_eoc
    answers: the maps composed along the graph, ``sigprop.client.prediction.predict``); {} for other
    methods."""
    from .prediction import PREDICTED_METHODS, predict  # late: only answers with maps need it

    if sol.method not in PREDICTED_METHODS or sol.c_map is None:
        return {}
    preds = predict(dict(graph), sol, 0.5, same_locations=True, unmodelled=unmodelled)
    return {nid: p.q for nid, p in preds.items() if p.q is not None}


def _target(nd: Mapping, q_ins: list[float], sol: Solution, widths: list[int]) -> float:
    """The q the answer's maps give at ``nd`` from its measured input q's (where the answer
    predicts no q at ``nd`` itself)."""
    from .prediction import activation_q

    kind = OP_TABLE[nd["op"]].kind
    if kind == ACT:
        q_out = activation_q(sol, nd.get("fn"))[1]
        return q_out if q_out is not None else 1.0
    if kind == SUM:
        weights = nd.get("weights") or [len(q_ins) ** -0.5] * len(q_ins)
        return sum(f * q for f, q in zip(sum_coefficients(weights), q_ins, strict=True))
    if kind == CONCAT:
        return sum(f * q for f, q in zip(concat_coefficients(widths), q_ins, strict=True))
    if kind == NORM:  # each example (token) divided by its root mean square: q = 1
        return 1.0
    if kind == PRODUCT:  # independent factors: q = q_u q_v
        return q_ins[0] * q_ins[1]
    return q_ins[0]


def _waves(graph: Mapping, nodes: list[str]) -> list[list[str]]:
    """``nodes`` grouped so that no node shares a wave with a calibrated node above it."""
    inputs = {nd["id"]: nd.get("inputs", []) for nd in graph["nodes"]}
    chosen, level = set(nodes), {}
    for nd in graph["nodes"]:  # listed after the nodes they read
        above = max((level.get(i, 0) for i in inputs[nd["id"]]), default=0)
        level[nd["id"]] = above + (1 if nd["id"] in chosen else 0)
    waves: dict[int, list[str]] = {}
    for n in nodes:
        waves.setdefault(level[n], []).append(n)
    return [waves[k] for k in sorted(waves)]


def calibrate(
    graph: Mapping,
    sol: Solution,
    nodes: Mapping[str, str],
    measure: Callable[[list[str]], dict[str, tuple[float, list[float]]]],
    rescale: Callable[[Placement, float], bool],
    unmodelled: Iterable[str] = (),
) -> tuple[list[Calibration], list[str]]:
    """Calibrate ``nodes`` (id -> why, from :func:`measured_nodes`); returns (calibrations, warnings).

    ``measure(ids)`` runs the example batch through the model as it now is and returns, per id,
    (q of the output, [q of each input in the graph's order]); ``rescale(placement, factor)``
    puts the factor into the model and says whether it could. One ``measure`` per wave.
    ``unmodelled``: ids of ops the adapter treated as the identity (no prediction past them)."""
    by_id = {nd["id"]: nd for nd in graph["nodes"]}
    shapes = infer_shapes(Graph.model_validate(dict(graph)))
    predicted = _answer_q(graph, sol, unmodelled)
    done: list[Calibration] = []
    warnings: list[str] = []
    for wave in _waves(graph, [n for n in nodes if n in shapes]):
        measured = measure(wave)
        for nid in wave:
            nd = by_id[nid]
            q_out, q_ins = measured[nid]
            widths = [shapes[i][0] for i in nd.get("inputs", [])]
            target = predicted.get(nid) or _target(nd, q_ins, sol, widths)
            if not (q_out > 0 and target > 0 and math.isfinite(q_out)):
                warnings.append(f"'{nid}' ({nodes[nid]}): q {q_out:.4g} on the example batch; not calibrated")
                continue
            factor = math.sqrt(target / q_out)
            place = placement(graph, nid)
            applied = rescale(place, factor)
            where = place.where if applied else "none"
            cal = Calibration(nid, nd["op"], nodes[nid], q_ins[0], q_out, target, factor, where, list(place.layers))
            if not applied:
                warnings.append(f"not calibrated: {cal.describe()}")
            done.append(cal)
    return done, warnings
