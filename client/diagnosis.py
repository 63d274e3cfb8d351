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
marked unless the inputs were built with identical locations. The predictions are for the pair's
measured cosine (``Diagnosis.pair_c``; a one-channel pair flips a whole number of locations).

Every row states the noise of its measurement, the standard deviation expected over networks at
the graph's widths and initializations (:func:`stated_noise`: finite-width theory,
``sigprop.client.finite_width`` and ``sigprop.client.sampling_noise``), and a row off by more than
``FLAG_SIGMAS`` of it is flagged; :func:`judge` names the first such nodes with their likely
cause, and the printed diagnosis ends with one verdict line (:meth:`Diagnosis.verdict`). This
module is framework-free; the adapters only measure.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..schemas.graph import OPS, Graph
from ..schemas.kernels import atom_coefficients, concat_coefficients, sum_coefficients
from ..schemas.shapes import infer_shapes
from ..schemas.solve import Solution
from ..schemas.structure import wire_structure
from .finite_width import propagate
from .sampling_noise import pair_noise, pair_representatives

__all__ = [
    "LayerDiagnosis",
    "Diagnosis",
    "Prediction",
    "predict",
    "check_solution",
    "interpolate",
    "pair_c",
    "note_calibrations",
    "stated_noise",
    "judge",
    "Off",
    "FLAG_SIGMAS",
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
class Off:
    """A node found wrong: its id and op, how many standard deviations of its stated noise it is
    off (None: found wrong otherwise, e.g. its function compared directly) and the likely cause."""

    id: str
    op: str
    sigmas: float | None
    cause: str


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
    q_noise: float | None = None  # the standard deviation expected of q_empirical at this width (0: exact)
    c_noise: float | None = None  # likewise of c_empirical
    flagged: bool = False  # off the prediction by more than FLAG_SIGMAS times its noise

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
    warnings: list[str] = field(default_factory=list)  # measured values off their prediction, and why
    off: list[Off] = field(default_factory=list)  # the nodes found wrong, first ones first, with the likely cause
    pair_c: float | None = None  # the input pair's measured cosine (the predictions are for it)

    @property
    def ok(self) -> bool:
        """True when every node with a prediction is within FLAG_SIGMAS times its stated noise and
        nothing else was found wrong (``warnings`` is empty)."""
        return not self.warnings and not any(r.flagged for r in self.layers)

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
            note = f"OFF ({_sigmas(r):.0f} sigma) {r.note}" if r.flagged else r.note
            lines.append(
                f"{r.id:<{width}}  {r.op:<15} {num(r.q_predicted)} {num(r.q_empirical)} "
                f"{num(r.c_predicted)} {num(r.c_empirical)}  {note}".rstrip()
            )
        if self.c_global is not None:
            lines.append(f"answer's global C map at c = {self._c_text()}: {self.c_global:.4f}")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"WARNING: {w}" for w in self.warnings]
        lines.append(self.verdict())
        return "\n".join(lines)

    __str__ = table

    def _c_text(self) -> str:
        c = self.pair_c
        return f"{self.input_c:g}" if c is None or abs(c - self.input_c) < 5e-5 else f"{c:.4f}"

    def verdict(self) -> str:
        """One line: PASS (the largest deviation, in units of its stated noise), or FAIL with the
        nodes found off and the likely cause of each (``judge``), and what else was found wrong."""
        checked = [(_sigmas(r), r.id) for r in self.layers if not r.note and r.q_noise is not None]
        if self.ok:
            z, where = max(checked, default=(0.0, ""))
            at = f" (largest {z:.1f} sigma, at '{where}')" if where else ""
            return f"verdict: PASS: every node within {FLAG_SIGMAS:g} sigma of its prediction{at}"
        named = [f"'{o.id}' ({o.op}{f', {o.sigmas:.0f} sigma off' if o.sigmas else ''}): {o.cause}" for o in self.off]
        flagged = sum(r.flagged for r in self.layers)
        if flagged > len([o for o in self.off if o.sigmas]):
            named.append(f"{flagged} node(s) off in all, the first ones named")
        rest = [w for w in self.warnings if not any(w.startswith(f"node '{o.id}'") for o in self.off)]
        rest = [w for w in rest if "node(s) in all are off" not in w]
        return "verdict: FAIL: " + "; ".join(named + rest)


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
        # sums an atom reaches through several paths mix over atoms, not inputs (schemas.atoms)
        self.shared = _shared_sums(graph) if sol.sum_scales else {}
        self.comps: dict[str, list[Prediction]] = {}  # node id -> its prediction per pair component

    def node(self, nd: dict, ins: list[Prediction], k: int = 0) -> Prediction:
        """Node ``nd``'s prediction from its inputs' (component ``k`` of a one-channel pair)."""
        op, nid = nd["op"], nd["id"]
        if nid in self.unmodelled:
            return Prediction(None, None, "op outside the graph (treated as the identity)")
        if op in ("dense", "conv"):
            return self.affine(nid, ins[0])
        if op == "activation":
            return self.activation(ins[0])
        if op == "sum" and nid in self.shared:
            mix = self.shared[nid]
            return _mix(list(zip(atom_coefficients(mix.values()), [self.component(a, k) for a in mix], strict=True)))
        if op == "sum":
            weights = nd.get("weights") or [1.0 / math.sqrt(len(ins))] * len(ins)
            return _mix(list(zip(sum_coefficients(weights), ins, strict=True)))
        if op == "concat":
            widths = concat_coefficients(self.shapes[i][0] for i in nd["inputs"])
            return _mix(list(zip(widths, ins, strict=True)))
        return ins[0]

    def component(self, nid: str, k: int) -> Prediction:
        comp = self.comps[nid]
        return comp[k] if len(comp) > 1 else comp[0]

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
        nid, op = nd["id"], nd["op"]
        if op == "input":
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
        if op in _POOLS and not same_locations and not pred.note:
            note = "after pooling: exact only for locations that see the same input"
            pred = Prediction(pred.q, pred.c, note)
            comps[nid] = [Prediction(p.q, p.c, note) for p in comps[nid]]
        out[nid] = pred
    return out


def _spatial(walker: _Predictor, nd: dict, ins: list[Prediction], per_location: bool, k: int = 0) -> Prediction:
    if per_location and nd["op"] == "conv":
        layer = walker.layers.get(nd["id"])
        if layer is not None and layer.distribution != "orthogonal_delta":
            return Prediction(None, None, "a one-channel input read by a conv that mixes locations: not predicted")
    return walker.node(nd, ins, k)


def _mean_c(parts: list[tuple[float, float]], preds: list[Prediction]) -> Prediction:
    """The mean over locations of a one-channel pair's components (q is the same in each)."""
    if any(p.q is None or p.c is None for p in preds):
        return Prediction(None, None, next((p.note for p in preds if p.note), ""))
    return Prediction(preds[0].q, sum(w * p.c for (w, _), p in zip(parts, preds, strict=True)), preds[0].note)


def pair_c(c: float) -> float:
    """``input_c`` checked: a cosine strictly inside (-1, 1)."""
    if not (-1.0 < float(c) < 1.0):
        raise ValueError(f"input_c must be in (-1, 1), got {c!r}")
    return float(c)


# -- how far a measurement may be from its prediction -----------------------------------------

# A node is flagged when it is off its prediction by more than this many standard deviations of its
# stated noise (stated_noise: finite-width theory, within 1.5x of the spread measured over networks).
FLAG_SIGMAS = 5.0
# ... plus this much in c: the predictions interpolate the answer's C maps linearly between its
# samples, which is off by up to h^2 / 8 C'' per activation (h = 1/16 on the default 33 samples)
C_SLACK = 2e-3
# ... and this share of q: a layer whose noise is 0 (an orthogonal matrix that keeps every norm) must
# match to the rounding of a float32 forward pass, not exactly
Q_SLACK = 1e-3


def _flattens_first(graph: dict) -> bool:
    """The input is flattened before any layer reads it (the pairs measured are the flattened examples)."""
    readers: dict[str, list[dict]] = {}
    for nd in graph["nodes"]:
        for i in nd.get("inputs", []):
            readers.setdefault(i, []).append(nd)
    frontier = [nd["id"] for nd in graph["nodes"] if nd["op"] == "input"]
    while frontier:
        nexts = [r for i in frontier for r in readers.get(i, [])]
        if not nexts or any(r["op"] not in ("flatten", "identity", "dropout") for r in nexts):
            return False
        if all(r["op"] == "flatten" for r in nexts):
            return True
        frontier = [r["id"] for r in nexts if r["op"] != "flatten"]
    return False


def stated_noise(graph: dict, sol: Solution, x1, x2, phi) -> dict[str, tuple[float | None, float | None]]:
    """Graph id -> (sd of q, sd of c) expected of one applied network's measurement on the pairs
    ``(x1, x2)`` (numpy, channels first: ``[B, F]`` or ``[B, C, *spatial]``), from finite-width
    theory at the graph's widths and the answer's initializations (``sigprop.client.finite_width``;
    what the measurement averages: ``sigprop.client.sampling_noise``). ``phi``: the answer's
    transformed activation as a numpy function (or graph id -> one). 0 at the input (exact); None
    where it is not known (after a global pool of locations that differ)."""
    features = _flattens_first(graph)
    few = not features and np.ndim(x1) > 2 and np.shape(x1)[1] <= 4  # few channels: cosines far from 0
    rep = pair_representatives(x1, x2, features=features, examples=32 if few else 16)

    def reduce(kernel, dk, shape, cov_q):
        return pair_noise(kernel, dk, shape, cov_q, rep)

    out = {}
    for gid, (sd_q, sd_c) in propagate(graph, sol, rep.kernel, rep.shape, phi, reduce).items():
        out[gid] = (None if math.isnan(sd_q) else sd_q, None if math.isnan(sd_c) else sd_c)
    for nd in graph["nodes"]:
        if nd["op"] == "input":
            out[nd["id"]] = (0.0, 0.0)
    return out


def _sigmas(row: LayerDiagnosis) -> float:
    """How far off ``row`` is in units of its stated noise plus the slack (Q_SLACK of q, C_SLACK)
    spread over FLAG_SIGMAS: flagged above FLAG_SIGMAS. A row whose noise is None states none."""
    zs = [0.0]
    if row.q_error is not None and row.q_noise is not None:
        zs.append(abs(row.q_error) / (row.q_noise + Q_SLACK * abs(row.q_predicted) / FLAG_SIGMAS + 1e-300))
    if row.c_error is not None and row.c_noise is not None:
        zs.append(abs(row.c_error) / (row.c_noise + C_SLACK / FLAG_SIGMAS))
    return max(zs)


def with_noise(row: LayerDiagnosis, noise: tuple[float | None, float | None]) -> LayerDiagnosis:
    """``row`` with its stated noise, flagged when it is off by more than FLAG_SIGMAS of it (never a
    row whose note says its prediction is not exact there: after pooling, after an op outside the
    graph)."""
    out = replace(row, q_noise=noise[0], c_noise=noise[1])  # 0: exact there (an isometry), None: not known
    return replace(out, flagged=not out.note and _sigmas(out) > FLAG_SIGMAS)


def _cause(row: LayerDiagnosis, suspect: str) -> str:
    """What most likely makes ``row`` (the first node off, whose inputs are on) wrong."""
    if suspect:
        return suspect
    if row.op == "activation":
        return (
            "its input matches the prediction and its output does not: the activation there is not the answer's "
            "transformed activation (swap it in: apply() does, or use transformed_activation in the model's code)"
        )
    if row.op in ("dense", "conv"):
        return (
            "its input matches the prediction and its output does not: the layer does not have the answer's "
            "initialization (apply the answer to this model, and do not re-initialize it afterwards)"
        )
    if row.op == "sum":
        return "its inputs match the prediction and it does not: the add is not the answer's normalized sum"
    return "its input matches the prediction and it does not: an op the graph does not see acts here"


def judge(diag: Diagnosis, graph: dict, *, suspects: dict[str, str] | None = None, outside: dict | None = None):
    """Add ``diag.warnings``: the first node(s) off their prediction by more than their noise, with
    the likely cause (``suspects``: graph id -> what the adapter knows is wrong there, e.g. an
    activation module that is not the transformed one), and every op outside the graph
    (``outside``: graph id -> what it is), a normalization layer named with the fix."""
    suspects, outside = suspects or {}, outside or {}
    rows = {r.id: r for r in diag.layers}
    inputs = {nd["id"]: nd.get("inputs", []) for nd in graph["nodes"]}
    off = {r.id for r in diag.layers if r.flagged}

    def upstream_off(gid: str, seen: set) -> bool:
        for i in inputs.get(gid, []):
            if i in seen:
                continue
            seen.add(i)
            if i in off or (i not in rows and upstream_off(i, seen)):
                return True
        return False

    first = [r for r in diag.layers if r.flagged and not upstream_off(r.id, set())]
    for r in first[:3]:
        what = f"q {r.q_empirical:.4f} against {r.q_predicted:.4f}" if r.q_predicted is not None else ""
        if r.c_predicted is not None:
            what += f"{', ' if what else ''}c {r.c_empirical:.4f} against {r.c_predicted:.4f}"
        cause = _cause(r, suspects.get(r.id, ""))
        diag.off.append(Off(r.id, r.op, _sigmas(r), cause))
        diag.warnings.append(
            f"node '{r.id}' ({r.op}) measures {what}, {_sigmas(r):.0f} times the noise expected at this width "
            f"(q +- {r.q_noise or 0:.3g}, c +- {r.c_noise or 0:.3g}): {cause}"
        )
    if len(off) > len(first[:3]):
        diag.warnings.append(f"{len(off)} node(s) in all are off their prediction; the ones named above come first")
    for gid, what in outside.items():
        text = f"'{gid}' ({what}) is outside the graph and was run as it is: nodes after it have no prediction"
        if "norm" in what.lower():
            text += (
                "; a normalization layer left in: TAT and DKS networks are normalization-free, remove it "
                "(torch: normalization_free(model, preactivation=True) for a torchvision-style ResNet, "
                "normalization_free(model) otherwise) and solve and apply again"
            )
        diag.warnings.append(text)


def note_calibrations(diag: Diagnosis, calibrations) -> None:
    """Mark the rows of the ops ``apply`` measured on its example batch and rescaled
    (``sigprop.client.calibration.Calibration``), and list each one under the table."""
    by_id = {c.id: c for c in calibrations}

    def note(r: LayerDiagnosis) -> str:
        c = by_id[r.id]
        return "; ".join(filter(None, [r.note, f"calibrated: measured q x{c.effect:.4g}, factor {c.factor:.4g}"]))

    diag.layers = [replace(r, note=note(r)) if r.id in by_id else r for r in diag.layers]
    diag.notes.extend(f"calibrated by apply: {c.describe()}" for c in calibrations)
