"""What an answer predicts at every node of a graph, and the report ``diagnose`` gives in both adapters.

``diagnose`` (``sigprop.client.torch.diagnose``, ``sigprop.client.jax.diagnose``) feeds a network
two inputs at a known cosine ``input_c`` and compares, node by node, the empirical

* q: the mean squared activation (per example, per location for feature maps), and
* c: the cosine similarity of the two inputs' features (per location for feature maps),

with what the answer predicts at every node (``sigprop.client.prediction.predict``: the answer's
layers and C maps composed along the graph, one handler per kind of the op table; tat and dks at
q = 1, eoc and sparse_eoc at q*). At the output the composition equals ``c_map.global`` at
``input_c`` up to the interpolation between samples (``Diagnosis.c_global`` holds the answer's own
value). Average and max pooling are the identity on the maps only when the pooled locations see
the same input: nodes after a pool are marked unless the inputs were built with identical
locations. The predictions are for the pair's measured cosine (``Diagnosis.pair_c``; a one-channel
pair flips a whole number of locations).

Every row states the noise of its measurement, the standard deviation expected over networks at
the graph's widths and initializations (:func:`stated_noise`: finite-width theory,
``sigprop.client.finite_width`` and ``sigprop.client.sampling_noise``), and a row off by more than
``FLAG_SIGMAS`` of it is flagged; :func:`judge` names the first such nodes with their likely
cause, and the printed diagnosis ends with one verdict line (:meth:`Diagnosis.verdict`). This
module is framework-free; the adapters only measure.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..schemas.ops import ACT, AFFINE, OP_TABLE, SOURCE, SUM
from ..schemas.solve import Solution
from .finite_width import propagate
from .prediction import Prediction, check_solution, interpolate, predict
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

# the rows shown (the op table's ``shown``): flatten, dropout and identity nodes would repeat their input's row
SHOWN_OPS = tuple(op for op, row in OP_TABLE.items() if row.shown)


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
    frontier = [nd["id"] for nd in graph["nodes"] if _row(nd).kind == SOURCE]
    while frontier:
        nexts = [r for i in frontier for r in readers.get(i, [])]
        if not nexts or any(_row(r).shown for r in nexts):  # a node that changes something reads it first
            return False
        if all(_row(r).to_features for r in nexts):
            return True
        frontier = [r["id"] for r in nexts if not _row(r).to_features]
    return False


def _row(nd: dict):
    return OP_TABLE[nd["op"]]


# stated noises of the last few (graph, answer, inputs, activation): diagnosing several networks of one
# answer on one input (seeds, as the docs advise) states the same noise for each, and computing it was
# three quarters of a ResNet-18's diagnose (1.8 of 2.5 s)
_NOISE_CACHE: OrderedDict[str, dict] = OrderedDict()
_NOISE_CACHE_SIZE = 8
_NOISE_LOCK = threading.Lock()
_PHI_PROBE = np.linspace(-3.0, 3.0, 13)


def _noise_key(graph: dict, sol: Solution, x1, x2, phi) -> str:
    """What the stated noise depends on, hashed; ``phi`` by its values on a probe grid."""
    h = hashlib.sha256()
    h.update(json.dumps(graph, sort_keys=True, default=str).encode())
    h.update(sol.model_dump_json().encode())
    for x in (x1, x2):
        a = np.ascontiguousarray(x, dtype=np.float64)
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    fns = sorted(phi.items()) if isinstance(phi, dict) else [("", phi)]
    for name, fn in fns:
        h.update(name.encode())
        h.update(b"identity" if fn is None else np.asarray(fn(_PHI_PROBE), dtype=np.float64).tobytes())
    return h.hexdigest()


def stated_noise(graph: dict, sol: Solution, x1, x2, phi) -> dict[str, tuple[float | None, float | None]]:
    """Graph id -> (sd of q, sd of c) expected of one applied network's measurement on the pairs
    ``(x1, x2)`` (numpy, channels first: ``[B, F]`` or ``[B, C, *spatial]``), from finite-width
    theory at the graph's widths and the answer's initializations (``sigprop.client.finite_width``;
    what the measurement averages: ``sigprop.client.sampling_noise``). ``phi``: the answer's
    transformed activation as a numpy function (or graph id -> one). 0 at the input (exact); None
    where it is not known (after a global pool of locations that differ). The last few are kept:
    the same graph, answer, inputs and activation give them again without the propagation."""
    if not hasattr(sol, "model_dump_json"):  # a duck-typed answer (tests): no stable key, no cache
        return _stated_noise(graph, sol, x1, x2, phi)
    key = _noise_key(graph, sol, x1, x2, phi)
    with _NOISE_LOCK:  # diagnose may run on several threads of one process
        kept = _NOISE_CACHE.get(key)
        if kept is not None:
            _NOISE_CACHE.move_to_end(key)
            return dict(kept)
    out = _stated_noise(graph, sol, x1, x2, phi)
    with _NOISE_LOCK:
        _NOISE_CACHE[key] = dict(out)
        while len(_NOISE_CACHE) > _NOISE_CACHE_SIZE:
            _NOISE_CACHE.popitem(last=False)
    return out


def _stated_noise(graph: dict, sol: Solution, x1, x2, phi) -> dict[str, tuple[float | None, float | None]]:
    features = _flattens_first(graph)
    few = not features and np.ndim(x1) > 2 and np.shape(x1)[1] <= 4  # few channels: cosines far from 0
    rep = pair_representatives(x1, x2, features=features, examples=32 if few else 16)

    def reduce(kernel, dk, shape, cov_q):
        return pair_noise(kernel, dk, shape, cov_q, rep)

    out = {}
    for gid, (sd_q, sd_c) in propagate(graph, sol, rep.kernel, rep.shape, phi, reduce).items():
        out[gid] = (None if math.isnan(sd_q) else sd_q, None if math.isnan(sd_c) else sd_c)
    for nd in graph["nodes"]:
        if _row(nd).kind == SOURCE:
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
    kind = OP_TABLE[row.op].kind if row.op in OP_TABLE else None
    if kind == ACT:
        return (
            "its input matches the prediction and its output does not: the activation there is not the answer's "
            "transformed activation (swap it in: apply() does, or use transformed_activation in the model's code)"
        )
    if kind == AFFINE:
        return (
            "its input matches the prediction and its output does not: the layer does not have the answer's "
            "initialization (apply the answer to this model, and do not re-initialize it afterwards)"
        )
    if kind == SUM:
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
