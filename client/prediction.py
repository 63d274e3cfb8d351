"""What an answer predicts at every node of a graph: its maps composed along the graph (the walk
``diagnose`` compares with; the report is ``sigprop.client.diagnosis``).

The answer carries every layer's initialization (``layers``), the activation's local C map
sampled on [-1, 1] and the q it maps to; :func:`predict` composes them node by node, one handler
per kind of the op table (``sigprop.schemas.ops``: a row's ``kind``, never its op's name):

* ``affine`` (dense/conv): q -> s q + b and c -> (s q c + b) / (s q + b), with s =
  ``weight_variance * fan_in`` (sigma_w^2) and b = ``bias_variance`` of the answer's layer;
* ``act``: c -> the activation's own C map at c (linear interpolation between the answer's
  samples), q -> its output q; both hold only for inputs at the q the answer solved at
  (:func:`activation_q`): q = 1 with ``c_map.local`` and Q(1) = ``q_1`` for tat and dks; q = q* with
  ``c_map.activation`` (E[phi(u) phi(v)] / E[phi(u)^2] at q*) and E[phi(sqrt(q*) z)^2] =
  (q* - sigma_b^2) / sigma_w^2 (from V(q*) = q*) for eoc and sparse_eoc, whose layers put every
  activation's input at q*;
* ``sum`` with weights w: q -> sum w_i^2 q_i, c -> sum w_i^2 q_i c_i / q (the branches' cross terms
  vanish: each branch ends in an independent zero-mean weight matrix); over atoms where an atom
  reaches the sum through several paths (the answer's ``sum_scales``);
* ``concat``: the same with the widths as weights;
* ``norm`` (``rms_norm``; a row that ``centres`` too, ``layer_norm``, the same for the centred
  features, which at infinite width are the features: every unit has mean 0 after a zero-mean
  layer): q -> 1, c unchanged (each example divided by its own root mean square);
* ``product`` (``mul``, a gated MLP's gate): q = q_u q_v, c = c_u c_v (E[u v u' v'] = E[u u'] E[v v']
  for factors whose atoms are independent, which the engine's atom pass requires);
* ``max_pair`` (max_pool of adjacent feature pairs): q through, c -> c/2 + (sqrt(1 - c^2) + c arcsin c)/pi;
* every other kind (pooling, flatten, dropout, identity, output): unchanged.

This is exactly what the engine computes for the global C map (TAT paper, section 2.3), so at the
output the composition equals ``c_map.global`` at ``input_c`` up to the interpolation between
samples. Average and max pooling (rows with a ``pool``) are the identity on the maps only when the
pooled locations see the same input: nodes after a pool are marked unless the inputs were built
with identical locations.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ..schemas.activations import canonical_name
from ..schemas.graph import Graph
from ..schemas.kernels import atom_coefficients, concat_coefficients, sum_coefficients
from ..schemas.ops import (
    ACT,
    AFFINE,
    ATTENTION,
    CONCAT,
    MAX_PAIR,
    NORM,
    OP_TABLE,
    PASS,
    PRODUCT,
    SOURCE,
    SUM,
    pair_max_c,
    row_at,
)
from ..schemas.shapes import infer_shapes
from ..schemas.solve import Solution
from ..schemas.structure import wire_structure

__all__ = ["Prediction", "predict", "check_solution", "interpolate", "activation_q", "PREDICTED_METHODS"]

# the methods whose answers predict q and c at every node: tat and dks at q = 1, eoc and sparse_eoc
# at q* (each layer's variances from what it reads, issue 34)
PREDICTED_METHODS = ("tat", "dks", "eoc", "sparse_eoc")
_AT_Q_STAR = ("eoc", "sparse_eoc")


@dataclass(frozen=True)
class Prediction:
    """The answer's q and c at one node (None where the answer predicts nothing there)."""

    q: float | None
    c: float | None
    note: str = ""


def check_solution(sol: Solution) -> None:
    """ValueError unless the answer carries the maps ``diagnose`` compares with."""
    if sol.method not in PREDICTED_METHODS:
        raise ValueError(
            f"diagnose compares with the predictions of tat, dks, eoc and sparse_eoc answers, not {sol.method!r} "
            "(a geometric answer states no C map)"
        )
    if sol.c_map is None:
        raise ValueError("the answer carries no c_map to compare with")


def interpolate(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear interpolation of the samples (xs increasing), clamped to their range."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    k = bisect.bisect_right(xs, x)
    t = (x - xs[k - 1]) / (xs[k] - xs[k - 1])
    return ys[k - 1] + t * (ys[k] - ys[k - 1])


def activation_q(sol: Solution, fn: str | None = None) -> tuple[float, float | None]:
    """(q of an activation's input, q of its output) that the answer's maps hold at, for an
    activation node computing ``fn`` (None: the answer's function): tat and dks (1, Q(1)); eoc and
    sparse_eoc (q*, (q* - sigma_b^2) / sigma_w^2), with the function's own pair where the answer
    lists several (``activations``). The output q is None where the answer does not give it."""
    if sol.method not in _AT_Q_STAR:
        return 1.0, (sol.q_1 if sol.q_1 is not None else 1.0)
    q_star = sol.q_star if sol.q_star is not None else 1.0
    per = (sol.activations or {}).get(canonical_name(fn) or fn or "") if fn else None
    sw2, sb2 = (per.sigma_w2, per.sigma_b2) if per is not None else (sol.sigma_w2, sol.sigma_b2)
    if not sw2 or sb2 is None:
        return q_star, None
    return q_star, (q_star - sb2) / sw2


def _activation_c_map(sol: Solution) -> list[float] | None:
    """The samples of the activation's own C map at the q it is solved at (module docstring)."""
    cm = sol.c_map
    if cm is None:
        return None
    return cm.activation if sol.method in _AT_Q_STAR else cm.local


def _mix(parts: list[tuple[float, Prediction]]) -> Prediction:
    """A sum or concatenation: weights^2 (or widths) times q, c weighted by q."""
    if any(p.q is None or p.c is None for _, p in parts):
        return Prediction(None, None, next((p.note for _, p in parts if p.note), ""))
    q = sum(w * p.q for w, p in parts)
    c = sum(w * p.q * p.c for w, p in parts) / q if q > 0 else None
    return Prediction(q, c, next((p.note for _, p in parts if p.note), ""))


class _Predictor:
    """Walks the graph once, in the order its nodes are listed (inputs before the nodes reading them)."""

    # the method that predicts each kind of node from its inputs' predictions; every other kind of the
    # table passes its input's prediction on (PASSED), and a kind in neither is an error, not a guess
    RULES = {
        AFFINE: "affine",
        ACT: "activation",
        SUM: "sum",
        CONCAT: "concat",
        NORM: "norm",
        PRODUCT: "product",
        MAX_PAIR: "max_pair",
    }
    PASSED = frozenset({SOURCE, PASS, ATTENTION})

    def __init__(self, graph: dict, sol: Solution, unmodelled: set[str]):
        self.sol, self.unmodelled = sol, unmodelled
        self.layers = {layer.id: layer for layer in sol.layers}
        self.shapes = infer_shapes(Graph.model_validate(graph))
        self.mixed = bool(sol.activations) and len(sol.activations) > 1
        self.local = _activation_c_map(sol)
        # sums an atom reaches through several paths mix over atoms, not inputs (schemas.atoms)
        self.shared = _shared_sums(graph) if sol.sum_scales else {}
        self.comps: dict[str, list[Prediction]] = {}  # node id -> its prediction per pair component
        self.handlers = {kind: getattr(self, name) for kind, name in self.RULES.items()}

    def row(self, nd: dict):
        """The node's row: a wire op with a ``features`` row resolves by its input's shape (``ops.row_at``)."""
        ins = nd.get("inputs") or []
        return row_at(nd["op"], [self.shapes[ins[0]]] if ins and ins[0] in self.shapes else [])

    def node(self, nd: dict, ins: list[Prediction], k: int = 0) -> Prediction:
        """Node ``nd``'s prediction from its inputs' (component ``k`` of a one-channel pair)."""
        if nd["id"] in self.unmodelled:
            return Prediction(None, None, "op outside the graph (treated as the identity)")
        kind = self.row(nd).kind
        if kind in self.PASSED:
            return ins[0]
        return self.handlers[kind](nd, ins, k)

    def component(self, nid: str, k: int) -> Prediction:
        comp = self.comps[nid]
        return comp[k] if len(comp) > 1 else comp[0]

    def affine(self, nd: dict, ins: list[Prediction], k: int) -> Prediction:
        layer, p = self.layers.get(nd["id"]), ins[0]
        if layer is None or p.q is None:
            return Prediction(None, None, p.note or "a layer the answer does not list")
        s, b = layer.weight_variance * layer.fan_in, layer.bias_variance
        q = s * p.q + b
        c = (s * p.q * p.c + b) / q if p.c is not None and q > 0 else None
        return Prediction(q, c, p.note)

    def activation(self, nd: dict, ins: list[Prediction], k: int) -> Prediction:
        p = ins[0]
        q_in, q_out = activation_q(self.sol, nd.get("fn") if self.mixed else None)
        if p.q is None or abs(p.q - q_in) > 1e-6 * max(1.0, q_in):
            # the local maps are the answer's at q_in; elsewhere it predicts nothing
            return Prediction(None, None, p.note or f"input q is not {q_in:.6g}")
        if self.mixed:
            return Prediction(q_out, None, "several functions: per-node C maps not in the answer")
        if self.local is None:
            return Prediction(q_out, None, p.note or "the answer carries no C map of the activation")
        c = interpolate(p.c, self.sol.c_map.c, self.local) if p.c is not None else None
        return Prediction(q_out, c, p.note)

    def max_pair(self, nd: dict, ins: list[Prediction], k: int) -> Prediction:
        """max_pool of adjacent feature pairs: q through, c by the closed form (``ops.pair_max_c``)."""
        p = ins[0]
        return Prediction(p.q, pair_max_c(p.c) if p.c is not None else None, p.note)

    def sum(self, nd: dict, ins: list[Prediction], k: int) -> Prediction:
        mix = self.shared.get(nd["id"])
        if mix is not None:
            return _mix(list(zip(atom_coefficients(mix.values()), [self.component(a, k) for a in mix], strict=True)))
        weights = nd.get("weights") or [1.0 / math.sqrt(len(ins))] * len(ins)
        return _mix(list(zip(sum_coefficients(weights), ins, strict=True)))

    def norm(self, nd: dict, ins: list[Prediction], k: int) -> Prediction:
        p = ins[0]
        if p.q is None:
            return Prediction(None, None, p.note)
        return Prediction(1.0, p.c, p.note)

    def product(self, nd: dict, ins: list[Prediction], k: int) -> Prediction:
        u, v = ins
        note = u.note or v.note
        if u.q is None or v.q is None:
            return Prediction(None, None, note)
        c = u.c * v.c if u.c is not None and v.c is not None else None
        return Prediction(u.q * v.q, c, note)

    def concat(self, nd: dict, ins: list[Prediction], k: int) -> Prediction:
        widths = concat_coefficients(self.shapes[i][0] for i in nd["inputs"])
        return _mix(list(zip(widths, ins, strict=True)))


def _shared_sums(graph: dict) -> dict[str, dict[str, float]]:
    """Sum id -> {atom id: coefficient, with the answer's sum scales} for the sums of shared atoms."""
    ids, report = wire_structure(Graph.model_validate(graph))
    return {ids[v]: {ids[a]: c for a, c in report.atoms.mixes[v].items()} for v in report.shared_sums}


def predict(
    graph: dict, sol: Solution, input_c: float, *, same_locations: bool, unmodelled=(), one_channel: bool = False
) -> dict:
    """Graph id -> :class:`Prediction` of every node, for inputs at q = 1 and cosine ``input_c``.

    ``unmodelled``: ids of nodes that stand for ops the graph cannot express (an adapter treated
    them as the identity): they and what follows them get no prediction.

    ``one_channel``: the input is a one-channel map built as the adapters' ``input_pair`` builds
    it (+-1 at every location, a share ``(1 - input_c) / 2`` of the locations flipped). An
    Orthogonal Delta conv reads one location, so up to the first flatten or global pool every
    location carries a pair at cosine +1 or -1, not ``input_c``: each node's c is the mixture
    ``(1 + input_c) / 2 * c(+1) + (1 - input_c) / 2 * c(-1)`` of the two compositions, the mean
    over locations that ``diagnose`` measures; where the map turns into features (flatten, global
    pool) the mixture becomes one pair again, exactly as the flattened vectors' cosine is the mean of
    the locations' (all at q = 1). Other conv kernels mix locations: no prediction after them."""
    check_solution(sol)
    walker = _Predictor(graph, sol, set(unmodelled))
    parts = [(1.0, float(input_c))]
    if one_channel:
        parts = [((1.0 + input_c) / 2.0, 1.0), ((1.0 - input_c) / 2.0, -1.0)]
    comps = walker.comps
    out: dict[str, Prediction] = {}
    for nd in graph["nodes"]:
        nid, row = nd["id"], walker.row(nd)
        if row.kind == SOURCE:
            comps[nid] = [Prediction(1.0, c) for _, c in parts]
        else:
            ins = [comps[i] for i in nd.get("inputs", [])]
            width = max(len(c) for c in ins)
            if width > 1 and len(walker.shapes[nid]) == 1:  # a map turns into features: one pair again
                merged = _mix([(w, p) for w, p in zip([w for w, _ in parts], ins[0], strict=True)])
                comps[nid] = [merged]
            else:
                comps[nid] = [
                    _spatial(walker, nd, [c[k] if len(c) > 1 else c[0] for c in ins], width > 1, k)
                    for k in range(width)
                ]
        pred = comps[nid][0] if len(comps[nid]) == 1 else _mean_c(parts, comps[nid])
        if row.pool and not same_locations and not pred.note:
            note = "after pooling: exact only for locations that see the same input"
            pred = Prediction(pred.q, pred.c, note)
            comps[nid] = [Prediction(p.q, p.c, note) for p in comps[nid]]
        out[nid] = pred
    return out


def _spatial(walker: _Predictor, nd: dict, ins: list[Prediction], per_location: bool, k: int = 0) -> Prediction:
    row = OP_TABLE[nd["op"]]
    if per_location and row.kind == AFFINE and row.spatial:
        layer = walker.layers.get(nd["id"])
        if layer is not None and layer.distribution != "orthogonal_delta":
            return Prediction(None, None, "a one-channel input read by a conv that mixes locations: not predicted")
    return walker.node(nd, ins, k)


def _mean_c(parts: list[tuple[float, float]], preds: list[Prediction]) -> Prediction:
    """The mean over locations of a one-channel pair's components (q is the same in each)."""
    if any(p.q is None or p.c is None for p in preds):
        return Prediction(None, None, next((p.note for p in preds if p.note), ""))
    return Prediction(preds[0].q, sum(w * p.c for (w, _), p in zip(parts, preds, strict=True)), preds[0].note)
