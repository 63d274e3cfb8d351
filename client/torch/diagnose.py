"""Per-layer q and c of an applied torch model, measured against what the answer predicts.

:func:`diagnose` re-extracts the model (``torch.fx``), runs it once on a pair of inputs at a known
cosine, records every graph node's output, and compares with
:func:`sigprop.client.diagnosis.predict` (the answer's maps composed along the graph).
"""

from __future__ import annotations

import math

import torch
import torch.fx
from torch import nn

from ..diagnosis import SHOWN_OPS, Diagnosis, LayerDiagnosis, interpolate, note_calibrations, pair_c, predict
from ..solution import as_solution
from .extraction import extract

__all__ = ["diagnose", "input_pair"]

# The partner's draw is offset from the caller's seed: apply(seed=0) draws its orthogonal matrices
# from a generator seeded 0, and a partner drawn from the same stream would be correlated with
# the first layer's weights (its rows would span the same directions), which biases every figure.
_PAIR_SEED_OFFSET = 0x51D1A6


def input_pair(example_input: torch.Tensor, input_c: float, *, same_locations: bool = False, seed: int = 0):
    """Two batches ``(x1, x2)`` with q = 1 and cosine exactly ``input_c`` per example (dense inputs)
    or per location (feature maps: the channel vectors at each location).

    ``x1`` is ``example_input`` with each example's (location's) vector rescaled to mean square 1,
    the q the TAT and DKS analyses assume. ``x2`` is its correlated copy: ``input_c * x1 +
    sqrt(1 - input_c^2) * z``, with ``z`` a seeded Gaussian draw made orthogonal to ``x1`` and of the
    same norm. ``same_locations=True`` first replaces each example by its spatial mean at every
    location (and ``z`` likewise), so pooling is the identity on the maps and the answer's
    predictions hold after it too."""
    input_c = pair_c(input_c)
    x = example_input.detach().to(torch.float64 if example_input.dtype == torch.float64 else torch.float32)
    spatial = tuple(range(2, x.dim()))
    gen = torch.Generator().manual_seed(_PAIR_SEED_OFFSET + int(seed))
    z = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)  # drawn on the CPU: same on any device
    if same_locations and spatial:
        x = x.mean(dim=spatial, keepdim=True).expand_as(x).contiguous()
        z = z.mean(dim=spatial, keepdim=True).expand_as(z).contiguous()
    n = x.shape[1]
    x1 = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30) * math.sqrt(n)
    z = z - (z * x1).sum(1, keepdim=True) / n * x1
    z = z / z.norm(dim=1, keepdim=True).clamp_min(1e-30) * math.sqrt(n)
    return x1, input_c * x1 + math.sqrt(1.0 - input_c * input_c) * z


class _Recorder(torch.fx.Interpreter):
    """Runs the traced model and keeps the output of the nodes asked for."""

    def __init__(self, gm: torch.fx.GraphModule, keep: set):
        super().__init__(gm)
        self.keep, self.values = keep, {}

    def run_node(self, n: torch.fx.Node):
        out = super().run_node(n)
        if n in self.keep:
            self.values[n] = out.detach()
        return out


def _q_and_c(y: torch.Tensor, half: int) -> tuple[float, float]:
    """Mean square over both halves; mean cosine of the halves along dim 1 (per location)."""
    y = y.double()
    a, b = y[:half], y[half:]
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-30)
    return float((y * y).mean()), float(cos.mean())


def _measure(model: nn.Module, ext, x1: torch.Tensor, x2: torch.Tensor) -> dict:
    """Graph id -> (q, c) measured on the pair."""
    value_of = {}  # graph id -> fx node whose output is that node's value
    for node, e in ext.entries.items():
        value_of[e.gid] = e.inputs[0] if e.op == "output" else node
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()  # dropout off: the maps treat it as the identity
        rec = _Recorder(ext.gm, set(value_of.values()))
        with torch.no_grad():
            rec.run(torch.cat([x1, x2]))
    finally:
        for m, mode in modes.items():
            m.training = mode
    return {gid: _q_and_c(rec.values[node], x1.shape[0]) for gid, node in value_of.items()}


def diagnose(
    model: nn.Module,
    solution,
    example_input: torch.Tensor,
    *,
    input_c: float = 0.5,
    same_locations: bool = False,
    seed: int = 0,
) -> Diagnosis:
    """Per-node q and c of ``model`` (an applied model: ``apply(...).model``) against the answer.

    Runs ``model`` once on the pair :func:`input_pair` builds from ``example_input`` (q = 1 and
    cosine ``input_c`` per example, per location for feature maps; default 0.5, a point where the C
    map of a TAT or DKS answer is neither 0 nor 1) and returns a :class:`~sigprop.client.diagnosis.
    Diagnosis`: ``str()`` is a table, ``.layers`` the rows (``LayerDiagnosis``), ``.as_dicts()`` the
    same as dicts. Empirical values are one finite-width network's: expect deviations of a few
    ``1 / sqrt(width x pairs x locations)``; average several seeds for a tighter check. Nodes after
    pooling are marked unless ``same_locations=True``; the ops ``apply`` calibrated on its example
    batch are marked with the effect it measured and its factor. tat and dks answers only
    (ValueError otherwise). The model's parameters and modes are left as they were.
    """
    sol = as_solution(solution)
    x1, x2 = input_pair(example_input, input_c, same_locations=same_locations, seed=seed)
    ext = extract(model, x1, allow_unsupported=True, keep_fn=False, warn=False)
    unmodelled = {e.gid for e in ext.entries.values() if e.unsupported}
    predicted = predict(ext.graph, sol, input_c, same_locations=same_locations, unmodelled=unmodelled)
    measured = _measure(model, ext, x1, x2)
    ops = {nd["id"]: nd["op"] for nd in ext.graph["nodes"]}
    rows = [
        LayerDiagnosis(gid, ops[gid], p.q, measured[gid][0], p.c, measured[gid][1], p.note)
        for gid, p in predicted.items()
        if ops[gid] in SHOWN_OPS
    ]
    c_global = None
    if sol.c_map is not None:
        c_global = interpolate(input_c, sol.c_map.c, sol.c_map.global_)
    diag = Diagnosis(
        sol.method,
        sol.activation,
        input_c,
        1.0,
        "location" if x1.dim() > 2 else "example",
        int(x1.shape[0]),
        rows,
        c_global,
    )
    if unmodelled:
        diag.notes.append(f"ops outside the graph, treated as the identity: {', '.join(sorted(unmodelled)[:8])}")
    note_calibrations(diag, getattr(model, "sigprop_calibrations", ()))  # what apply measured
    return diag
