"""Per-layer q and c of an applied torch model, measured against what the answer predicts.

:func:`diagnose` takes the extraction ``apply`` kept of the model it returned (``traced``), or
traces the model (``torch.fx``); it runs it once on a pair of inputs at a known cosine, records
every graph node's output, and compares with
:func:`sigprop.client.diagnosis.predict` (the answer's maps composed along the graph).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.fx
from torch import nn

from ...schemas.ops import ACT, OP_TABLE, SOURCE
from ..diagnosis import (
    SHOWN_OPS,
    Diagnosis,
    LayerDiagnosis,
    Off,
    interpolate,
    judge,
    note_calibrations,
    pair_c,
    predict,
    stated_noise,
    with_noise,
)
from ..pairs import PAIR_SEED_OFFSET
from ..solution import as_solution
from .extraction import extract
from .modules import TransformedActivation
from .sequence import SequenceExtraction
from .traced import recall

__all__ = ["diagnose", "input_pair"]

# The partner's draw is offset from the caller's seed: apply(seed=0) draws its orthogonal matrices
# from a generator seeded 0, and a partner drawn from the same stream would be correlated with
# the first layer's weights (its rows would span the same directions), which biases every figure.
_PAIR_SEED_OFFSET = PAIR_SEED_OFFSET  # the same stream as the channels-last adapters (client.pairs)


def input_pair(example_input: torch.Tensor, input_c: float, *, same_locations: bool = False, seed: int = 0):
    """Two batches ``(x1, x2)`` with q = 1 and cosine ``input_c`` per example (dense inputs) or per
    location (feature maps: the channel vectors at each location), for any input shape.

    ``x1`` is ``example_input`` with each example's (location's) vector rescaled to mean square 1,
    the q the TAT and DKS analyses assume. ``x2`` is its correlated copy: ``input_c * x1 +
    sqrt(1 - input_c^2) * z``, with ``z`` a seeded Gaussian draw made orthogonal to ``x1`` and of the
    same norm. A single channel (MNIST's ``[N, 1, 28, 28]``, a ``[N, 1, L]`` signal) has no second
    direction at a location to be orthogonal in, so there ``x1`` is +-1 at every location (q = 1 in
    every patch a layer reads) and ``x2`` is ``x1`` with the signs of a seeded fraction
    ``(1 - input_c) / 2`` of each example's locations flipped: q = 1, and the cosine per example (and
    its mean over locations) is ``input_c`` to within 1 / locations. ``same_locations=True`` first
    replaces each example by its spatial mean at every location (and ``z`` likewise), so pooling is
    the identity on the maps and the answer's predictions hold after it too (two or more channels)."""
    input_c = pair_c(input_c)
    x = example_input.detach().to(torch.float64 if example_input.dtype == torch.float64 else torch.float32)
    spatial = tuple(range(2, x.dim()))
    gen = torch.Generator().manual_seed(_PAIR_SEED_OFFSET + int(seed))
    if x.dim() > 2 and x.shape[1] == 1:
        if same_locations:
            raise ValueError(
                "same_locations=True needs two or more input channels: one channel, the same at every "
                "location, gives two inputs whose cosine is +-1"
            )
        return _spin_pair(x, input_c, gen)
    z = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)  # drawn on the CPU: same on any device
    if same_locations and spatial:
        x = x.mean(dim=spatial, keepdim=True).expand_as(x).contiguous()
        z = z.mean(dim=spatial, keepdim=True).expand_as(z).contiguous()
    n = x.shape[1]
    x1 = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30) * math.sqrt(n)
    z = z - (z * x1).sum(1, keepdim=True) / n * x1
    z = z / z.norm(dim=1, keepdim=True).clamp_min(1e-30) * math.sqrt(n)
    return x1, input_c * x1 + math.sqrt(1.0 - input_c * input_c) * z


def _spin_pair(x: torch.Tensor, input_c: float, gen: torch.Generator):
    """The pair of a one-channel input: signs of ``x``, and the same with a seeded share flipped."""
    x1 = torch.where(x >= 0, 1.0, -1.0).to(x.dtype)
    flat = x1.reshape(x1.shape[0], -1)
    m = flat.shape[1]
    flips = round((1.0 - input_c) / 2.0 * m)
    order = torch.rand(flat.shape, generator=gen).argsort(dim=1)[:, :flips].to(x.device)
    sign = torch.ones_like(flat).scatter_(1, order, -1.0)
    return x1, (flat * sign).reshape(x1.shape)


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


def _measure(model: nn.Module, ext, x1: torch.Tensor, x2: torch.Tensor) -> tuple[dict, dict]:
    """Graph id -> (q, c) measured on the pair, and graph id -> the node's output."""
    value_of = {}  # graph id -> fx node whose output is that node's value
    for node, e in ext.entries.items():
        value_of[e.gid] = e.inputs[0] if OP_TABLE[e.op].sink else node
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()  # dropout off: the maps treat it as the identity
        rec = _Recorder(ext.gm, set(value_of.values()))
        with torch.no_grad():
            rec.run(torch.cat([x1, x2]))
    finally:
        for m, mode in modes.items():
            m.training = mode
    values = {gid: rec.values[node] for gid, node in value_of.items()}
    return {gid: _q_and_c(v, x1.shape[0]) for gid, v in values.items()}, values


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
    Diagnosis`: ``str()`` is a table ending with a verdict line, ``.layers`` the rows
    (``LayerDiagnosis``), ``.as_dicts()`` the same as dicts. Empirical values are one finite-width
    network's: each row states the standard deviation expected of it over networks (finite-width
    theory, below); average several seeds for a tighter check. The predictions are for the pair's
    measured cosine (``.pair_c``: ``input_c`` to rounding). Nodes after
    pooling are marked unless ``same_locations=True``; the ops ``apply`` calibrated on its example
    batch are marked with the effect it measured and its factor. tat, dks, eoc and sparse_eoc
    answers (ValueError otherwise: a geometric answer states no C map). The model's parameters and
    modes are left as they were.

    Every row states the noise expected of its measurement at the network's widths and the
    answer's initializations (``q_noise``, ``c_noise``: :func:`~sigprop.client.diagnosis.stated_noise`,
    finite-width theory; 0 where the layer is an isometry); a row off by more than ``FLAG_SIGMAS``
    of it is ``flagged``, and ``.warnings`` (printed under the table) names the first such node with
    its likely cause: the activation not swapped in, the layer not initialized by the answer, an
    op outside the graph, a BatchNorm left in. ``.ok`` is False then, and so is the verdict line.

    A sequence model ``apply`` rewrote is diagnosed by its output token kernel instead
    (:func:`~sigprop.client.torch.sequence_diagnose.diagnose_tokens`: ``example_input`` and
    ``input_c`` are not used; pass several applied networks to ``diagnose_tokens`` for measured
    standard errors).
    """
    if getattr(model, "sigprop_sequence", None) is not None:  # apply's rewrite of a sequence model
        from .sequence_diagnose import diagnose_tokens

        return diagnose_tokens(model, solution, seed=seed)
    sol = as_solution(solution)
    x1, x2 = input_pair(example_input, input_c, same_locations=same_locations, seed=seed)
    kept = recall(model, x1)  # what apply kept of the model it returned, with the solved graph's ids
    ext = (
        kept.bind(model) if kept is not None else extract(model, x1, allow_unsupported=True, keep_fn=False, warn=False)
    )
    if isinstance(ext, SequenceExtraction):
        raise ValueError(
            "diagnose of a sequence model needs the model apply() returned (report.model): its attention "
            "modules carry the answer's matrices; apply the answer first"
        )
    unmodelled = {e.gid for e in ext.entries.values() if e.unsupported}
    one_channel = x1.dim() > 2 and x1.shape[1] == 1
    measured, values = _measure(model, ext, x1, x2)
    # the prediction is for the pair measured: its cosine is input_c only to rounding (and to within
    # 1 / locations for a one-channel pair, which flips a whole number of locations)
    actual_c = next(measured[nd["id"]][1] for nd in ext.graph["nodes"] if OP_TABLE[nd["op"]].kind == SOURCE)
    predicted = predict(
        ext.graph, sol, actual_c, same_locations=same_locations, unmodelled=unmodelled, one_channel=one_channel
    )
    ops = {nd["id"]: nd["op"] for nd in ext.graph["nodes"]}
    noise = stated_noise(ext.graph, sol, x1.double().cpu().numpy(), x2.double().cpu().numpy(), _phi(sol, ext))
    rows = [
        with_noise(LayerDiagnosis(gid, ops[gid], p.q, measured[gid][0], p.c, measured[gid][1], p.note), noise[gid])
        for gid, p in predicted.items()
        if ops[gid] in SHOWN_OPS
    ]
    c_global = None
    if sol.c_map is not None:
        c_global = interpolate(actual_c, sol.c_map.c, sol.c_map.global_)
    diag = Diagnosis(
        sol.method,
        sol.activation,
        input_c,
        1.0,
        "location" if x1.dim() > 2 else "example",
        int(x1.shape[0]),
        rows,
        c_global,
        pair_c=actual_c,
    )
    note_calibrations(diag, getattr(model, "sigprop_calibrations", ()))  # what apply measured
    outside = {e.gid: f"{e.desc}: {e.unsupported}" for e in ext.entries.values() if e.unsupported}
    wrong = _wrong_activations(ext, sol, values)
    judge(diag, ext.graph, suspects=wrong, outside=outside)
    named = " ".join(diag.warnings)
    for gid, why in list(wrong.items())[:3]:
        if f"node '{gid}'" not in named:  # off by less than its noise, but certainly not the answer's function
            diag.warnings.append(f"node '{gid}' (activation): {why}")
            diag.off.append(Off(gid, "activation", None, why))
    return diag


def _phi(sol, ext):
    """The answer's transformed activation as a numpy function (graph id -> one per activation node
    when the answer has several functions), for the stated noise; None where it cannot be built."""

    def numpy_fn(solution, defaults=None):
        try:
            act = TransformedActivation.from_solution(solution, defaults=defaults).double()
        except (KeyError, ValueError, TypeError):
            return None
        return lambda z: act(torch.from_numpy(np.asarray(z, np.float64))).numpy()

    if not (sol.activations and len(sol.activations) > 1):
        return numpy_fn(sol)
    fns = {}
    for e in ext.entries.values():
        if OP_TABLE[e.op].kind == ACT:
            node = next((nd for nd in ext.graph["nodes"] if nd["id"] == e.gid), {})
            fns[e.gid] = numpy_fn(sol.for_function(node.get("fn") or sol.activation), e.fn_params)
    return fns


def _wrong_activations(ext, sol, values: dict) -> dict[str, str]:
    """Activation nodes whose outputs on the diagnosed inputs are not the answer's transformed
    activation of their inputs (a ReLU module left in place, an ``F.relu`` call): exact, whatever
    the width, as the function is compared and not its statistics. Answers with several functions
    are not checked (which node has which is the model's)."""
    if sol.activations and len(sol.activations) > 1:
        return {}
    inputs = {nd["id"]: nd.get("inputs", []) for nd in ext.graph["nodes"]}
    out = {}
    for e in ext.entries.values():
        if OP_TABLE[e.op].kind != ACT or isinstance(e.module, TransformedActivation) or not inputs.get(e.gid):
            continue
        x, y = values[inputs[e.gid][0]].double(), values[e.gid].double()
        try:
            want = TransformedActivation.from_solution(sol, defaults=e.fn_params).double()(x)
        except (KeyError, ValueError, TypeError):
            continue
        gap = float((y - want).abs().max()) if y.shape == want.shape else math.inf
        if gap > 1e-3 * (1.0 + float(want.abs().max())):
            out[e.gid] = (
                f"it runs {e.desc}, not the answer's transformed activation (their outputs differ by up to "
                f"{gap:.3g} on the diagnosed inputs): swap it in (apply() does; by hand, "
                "sigprop.client.torch.TransformedActivation)"
            )
    return out
