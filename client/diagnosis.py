"""What an answer predicts at every node of a graph, and the report ``diagnose`` gives in both adapters.

``diagnose`` (``sigprop.client.torch.diagnose``, ``sigprop.client.jax.diagnose``) feeds a network
two inputs at a known cosine ``input_c`` and compares, node by node, the empirical

* q: the mean squared activation (per example, per location for feature maps), and
* c: the cosine similarity of the two inputs' features (per location for feature maps),

with what the answer predicts. The answer carries the transformed activation's local C map sampled
on [-1, 1] (``c_map.local``), its Q(1) (``q_1``), every layer's initialization (``layers``) and the
network's global C map (``c_map.global``); :func:`predict` composes them along the graph:

* dense/conv: q -> s q + b and c -> (s q c + b) / (s q + b), with s = ``weight_variance * fan_in``
  (sigma_w^2) and b = ``bias_variance`` of the answer's layer;
* activation: c -> the local C map at c (linear interpolation between the answer's samples), q ->
  Q(1) = ``q_1``; both hold only for inputs at q = 1, the point TAT and DKS solve at;
* sum with weights w: q -> sum w_i^2 q_i, c -> sum w_i^2 q_i c_i / q (the branches' cross terms
  vanish: each branch ends in an independent zero-mean weight matrix);
* concat: the same with the widths as weights; pooling, flatten, dropout, identity: unchanged.

This is exactly what the engine computes for the global C map (TAT paper, section 2.3), so at the
output the composition equals ``c_map.global`` at ``input_c`` up to the interpolation between
samples (``Diagnosis.c_global`` holds the answer's own value). Average and max pooling are the
identity on the maps only when the pooled locations see the same input: nodes after a pool are
marked unless the inputs were built with identical locations. This module is framework-free; the
adapters only measure.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field, replace

from ..schemas.graph import OPS, Graph
from ..schemas.shapes import infer_shapes
from ..schemas.solve import Solution

__all__ = [
    "LayerDiagnosis",
    "Diagnosis",
    "Prediction",
    "predict",
    "check_solution",
    "interpolate",
    "pair_c",
    "note_calibrations",
    "SHOWN_OPS",
]

# the rows shown: flatten, dropout and identity nodes would repeat their input's row
SHOWN_OPS = tuple(op for op in OPS if op not in ("flatten", "dropout", "identity"))
_POOLS = ("avg_pool", "global_avg_pool", "max_pool")


@dataclass(frozen=True)
class Prediction:
    """The answer's q and c at one node (None where the answer predicts nothing there)."""

    q: float | None
    c: float | None
    note: str = ""


@dataclass(frozen=True)
class LayerDiagnosis:
    """One node: predicted and empirical q and c (``None`` where the answer predicts nothing)."""

    id: str
    op: str
    q_predicted: float | None
    q_empirical: float
    c_predicted: float | None
    c_empirical: float
    note: str = ""

    @property
    def q_error(self) -> float | None:
        return None if self.q_predicted is None else self.q_empirical - self.q_predicted

    @property
    def c_error(self) -> float | None:
        return None if self.c_predicted is None else self.c_empirical - self.c_predicted


@dataclass
class Diagnosis:
    """Per-node q and c, predicted against measured; ``str()`` is the table."""

    method: str
    activation: str
    input_c: float
    input_q: float
    scope: str  # "example" (dense graphs) or "location" (feature maps: q and c per location)
    examples: int  # input pairs measured
    layers: list[LayerDiagnosis] = field(default_factory=list)
    c_global: float | None = None  # the answer's global C map at input_c (the output's prediction)
    notes: list[str] = field(default_factory=list)

    def as_dicts(self) -> list[dict]:
        return [asdict(row) for row in self.layers]

    def max_q_error(self, ops: tuple[str, ...] = SHOWN_OPS) -> float:
        errs = [abs(r.q_error) for r in self.layers if r.op in ops and r.q_error is not None]
        return max(errs, default=0.0)

    def max_c_error(self, ops: tuple[str, ...] = SHOWN_OPS) -> float:
        errs = [abs(r.c_error) for r in self.layers if r.op in ops and r.c_error is not None]
        return max(errs, default=0.0)

    def table(self) -> str:
        width = max([len(r.id) for r in self.layers] + [4])

        def num(v: float | None) -> str:
            return f"{v:8.4f}" if v is not None else "       -"

        lines = [
            f"sigprop diagnose ({self.method}, {self.activation}): {self.examples} input pair(s) at c = "
            f"{self.input_c:g}, q = {self.input_q:g} per {'location' if self.scope == 'location' else 'example'}",
            f"{'node':<{width}}  {'op':<15} {'q pred':>8} {'q emp':>8} {'c pred':>8} {'c emp':>8}  note",
        ]
        for r in self.layers:
            lines.append(
                f"{r.id:<{width}}  {r.op:<15} {num(r.q_predicted)} {num(r.q_empirical)} "
                f"{num(r.c_predicted)} {num(r.c_empirical)}  {r.note}".rstrip()
            )
        if self.c_global is not None:
            lines.append(f"answer's global C map at c = {self.input_c:g}: {self.c_global:.4f}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = table


def check_solution(sol: Solution) -> None:
    """ValueError unless the answer carries the maps ``diagnose`` compares with."""
    if sol.method not in ("tat", "dks"):
        raise ValueError(
            f"diagnose compares with the q = 1 predictions of tat and dks answers, not {sol.method!r} "
            "(eoc, sparse_eoc and geometric answers sit at other q values, which the answer does not sample)"
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


def _mix(parts: list[tuple[float, Prediction]]) -> Prediction:
    """A sum or concatenation: weights^2 (or widths) times q, c weighted by q."""
    if any(p.q is None or p.c is None for _, p in parts):
        return Prediction(None, None, next((p.note for _, p in parts if p.note), ""))
    q = sum(w * p.q for w, p in parts)
    c = sum(w * p.q * p.c for w, p in parts) / q if q > 0 else None
    return Prediction(q, c, next((p.note for _, p in parts if p.note), ""))


class _Predictor:
    """Walks the graph once, in the order its nodes are listed (inputs before the nodes reading them)."""

    def __init__(self, graph: dict, sol: Solution, unmodelled: set[str]):
        self.sol, self.unmodelled = sol, unmodelled
        self.layers = {layer.id: layer for layer in sol.layers}
        self.shapes = infer_shapes(Graph.model_validate(graph))
        self.mixed = bool(sol.activations) and len(sol.activations) > 1
        self.q_act = sol.q_1 if sol.q_1 is not None else 1.0

    def node(self, nd: dict, ins: list[Prediction]) -> Prediction:
        op, nid = nd["op"], nd["id"]
        if nid in self.unmodelled:
            return Prediction(None, None, "op outside the graph (treated as the identity)")
        if op in ("dense", "conv"):
            return self.affine(nid, ins[0])
        if op == "activation":
            return self.activation(ins[0])
        if op == "sum":
            weights = nd.get("weights") or [1.0 / math.sqrt(len(ins))] * len(ins)
            return _mix([(w * w, p) for w, p in zip(weights, ins, strict=True)])
        if op == "concat":
            widths = [self.shapes[i][0] for i in nd["inputs"]]
            total = sum(widths)
            return _mix([(w / total, p) for w, p in zip(widths, ins, strict=True)])
        return ins[0]

    def affine(self, nid: str, p: Prediction) -> Prediction:
        layer = self.layers.get(nid)
        if layer is None or p.q is None:
            return Prediction(None, None, p.note or "a layer the answer does not list")
        s, b = layer.weight_variance * layer.fan_in, layer.bias_variance
        q = s * p.q + b
        c = (s * p.q * p.c + b) / q if p.c is not None and q > 0 else None
        return Prediction(q, c, p.note)

    def activation(self, p: Prediction) -> Prediction:
        if p.q is None or abs(p.q - 1.0) > 1e-6:
            # the local maps are the answer's at q = 1; elsewhere it predicts nothing
            return Prediction(None, None, p.note or "input q is not 1")
        if self.mixed:
            return Prediction(self.q_act, None, "several functions: per-node C maps not in the answer")
        cm = self.sol.c_map
        return Prediction(self.q_act, interpolate(p.c, cm.c, cm.local) if p.c is not None else None, p.note)


def predict(graph: dict, sol: Solution, input_c: float, *, same_locations: bool, unmodelled=()) -> dict:
    """Graph id -> :class:`Prediction` of every node, for inputs at q = 1 and cosine ``input_c``.

    ``unmodelled``: ids of nodes that stand for ops the graph cannot express (an adapter treated
    them as the identity): they and what follows them get no prediction."""
    check_solution(sol)
    walker = _Predictor(graph, sol, set(unmodelled))
    out: dict[str, Prediction] = {}
    for nd in graph["nodes"]:
        ins = [out[i] for i in nd.get("inputs", [])]
        if nd["op"] == "input":
            out[nd["id"]] = Prediction(1.0, float(input_c))
            continue
        pred = walker.node(nd, ins)
        if nd["op"] in _POOLS and not same_locations and not pred.note:
            pred = Prediction(pred.q, pred.c, "after pooling: exact only for locations that see the same input")
        out[nd["id"]] = pred
    return out


def pair_c(c: float) -> float:
    """``input_c`` checked: a cosine strictly inside (-1, 1)."""
    if not (-1.0 < float(c) < 1.0):
        raise ValueError(f"input_c must be in (-1, 1), got {c!r}")
    return float(c)


def note_calibrations(diag: Diagnosis, calibrations) -> None:
    """Mark the rows of the ops ``apply`` measured on its example batch and rescaled
    (``sigprop.client.calibration.Calibration``), and list each one under the table."""
    by_id = {c.id: c for c in calibrations}

    def note(r: LayerDiagnosis) -> str:
        c = by_id[r.id]
        return "; ".join(filter(None, [r.note, f"calibrated: measured q x{c.effect:.4g}, factor {c.factor:.4g}"]))

    diag.layers = [replace(r, note=note(r)) if r.id in by_id else r for r in diag.layers]
    diag.notes.extend(f"calibrated by apply: {c.describe()}" for c in calibrations)
