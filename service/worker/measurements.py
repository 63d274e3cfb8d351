"""What a validation measures on a network: empirical C values at initialization, activation
sparsity and dead units, per-layer gradient norms, test accuracy and loss.

Each function takes the model and the node id -> module path map of the graph it was built from
(``sigprop.worker.models``), so every number is reported by graph node id.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from ..client.torch import NormalizedSum, TransformedActivation
from ..schemas.activations import CATALOGUE
from ..schemas.solve import Solution
from .models import RELU_FAMILY

__all__ = [
    "C_PAIRS",
    "CValues",
    "ActivationStats",
    "predicted_c0",
    "c_values",
    "activation_stats",
    "grad_norms",
    "evaluate",
]

C_PAIRS = 16  # orthogonal input pairs for the empirical C values


@dataclass
class CValues:
    """Empirical C values at initialization for orthogonal input pairs (c0 = 0), by layer and where
    the answer's global C map applies, next to its prediction."""

    orthogonal: str  # "per_location" or "whole_input": over what the two inputs of a pair are orthogonal
    q: float  # the inputs' mean squared value
    layers: dict[str, float]  # weighted layer id -> mean cosine of its outputs
    logits: float  # at the network output
    output: float  # where the global C map applies (see output_site)
    output_site: str
    predicted_output: float | None

    def to_json(self) -> dict:
        res = {
            "input_c": 0.0,
            "pairs": C_PAIRS,
            "orthogonal": self.orthogonal,
            "q": self.q,
            "layers": self.layers,
            "logits": self.logits,
            "output": self.output,
            "output_site": self.output_site,
            "predicted_output": self.predicted_output,
        }
        if self.predicted_output is not None:
            res["deviation"] = self.output - self.predicted_output
        return res


@dataclass
class ActivationStats:
    """Exact zeros in the activation outputs and dead units (ReLU family) on one batch."""

    zero_fraction: float | None
    zero_per_layer: dict[str, float]
    dead_fraction: float | None  # None when no activation is of the ReLU family
    dead_per_layer: dict[str, float]


def predicted_c0(sol: Solution | None) -> float | None:
    if sol is None:
        return None
    if sol.network_c_f_0 is not None:
        return float(sol.network_c_f_0)
    if sol.c_map is not None and sol.c_map.c:
        return float(np.interp(0.0, sol.c_map.c, sol.c_map.global_))
    return None


PER_LOCATION_MIN_CHANNELS = 8


def _orthogonal_pairs(
    n_pairs: int, input_shape: tuple[int, ...], q: float, gen: torch.Generator
) -> tuple[torch.Tensor, str]:
    """[2 n_pairs, *input_shape] float64 inputs with mean squared value ``q``; the two inputs of a
    pair are orthogonal at every location (over the channel axis) when there are at least
    ``PER_LOCATION_MIN_CHANNELS`` channels, else over all their values (an image with 1 or 3
    channels cannot be orthogonal per location; random patches then have cosine 0 on average)."""
    channels = input_shape[0]
    locations = math.prod(input_shape[1:]) if len(input_shape) > 1 else 1
    per_location = locations == 1 or channels >= PER_LOCATION_MIN_CHANNELS
    if not per_location:
        channels, locations = channels * locations, 1
    a = torch.randn(n_pairs, channels, locations, generator=gen, dtype=torch.float64)
    b = torch.randn(n_pairs, channels, locations, generator=gen, dtype=torch.float64)
    a = a / a.norm(dim=1, keepdim=True)
    b = b - (a * b).sum(1, keepdim=True) * a
    b = b / b.norm(dim=1, keepdim=True)
    x = torch.stack([a, b], 1).reshape(2 * n_pairs, channels, locations) * math.sqrt(channels * q)
    mode = "per_location" if per_location and locations > 1 else "whole_input"
    return x.reshape((2 * n_pairs,) + tuple(input_shape)), mode


def _pair_cosine(y: torch.Tensor) -> float:
    """Mean cosine between the two examples of each pair, per location for feature maps."""
    y = y.reshape(y.shape[0] // 2, 2, y.shape[1], -1)
    return float(F.cosine_similarity(y[:, 0], y[:, 1], dim=1).mean())


class _LeafTracer(torch.fx.Tracer):
    """Keeps sigprop's activation and sum modules whole (as the client's tracer does)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, (TransformedActivation, NormalizedSum)) or super().is_leaf_module(m, qualname)


class _Capture(torch.fx.Interpreter):
    """Runs a GraphModule and keeps the value entering ``site`` (an fx node)."""

    def __init__(self, gm: torch.fx.GraphModule, site: torch.fx.Node | None):
        super().__init__(gm)
        self.site = site
        self.captured: torch.Tensor | None = None

    def run_node(self, n):
        if n is self.site:
            self.captured = self.env[n.args[0]]
        return super().run_node(n)


def c_values(
    model: nn.Module,
    paths: dict[str, str],
    weighted: list[str],
    input_shape,
    q: float,
    predicted: float | None,
    device: torch.device,
    seed: int,
) -> CValues:
    """Empirical C values for orthogonal input pairs (c0 = 0) with mean squared value q (TAT paper
    Appendix E.1), at every weighted layer's output (per location for feature maps) and where the
    answer's global C map applies: the input of the last global average pooling (the Q/C map
    analysis treats pooling as the identity on per-location correlations; the pooled vector also
    mixes locations), else the network output."""
    net = copy.deepcopy(model).to(device=device, dtype=torch.float64).eval()
    gm = net if isinstance(net, torch.fx.GraphModule) else torch.fx.GraphModule(net, _LeafTracer().trace(net))
    pools = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "mean"]
    site = pools[-1] if pools else None
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for nid in weighted:
        hooks.append(
            gm.get_submodule(paths[nid]).register_forward_hook(
                lambda _m, _i, out, nid=nid: seen.__setitem__(nid, out.detach())
            )
        )
    gen = torch.Generator().manual_seed(10_000 + seed)
    x, mode = _orthogonal_pairs(C_PAIRS, tuple(input_shape), q, gen)
    runner = _Capture(gm, site)
    try:
        with torch.no_grad():
            out = runner.run(x.to(device))
    finally:
        for h in hooks:
            h.remove()
    layers = {nid: _pair_cosine(seen[nid]) for nid in weighted if nid in seen}
    logits = _pair_cosine(out)
    emp = _pair_cosine(runner.captured) if runner.captured is not None else logits
    return CValues(
        mode, q, layers, logits, emp, "global_avg_pool input" if site is not None else "network output", predicted
    )


def _active(module: nn.Module, z: torch.Tensor) -> torch.Tensor | None:
    """Where a ReLU-family activation is on its active (non-flat) side, or None for other activations."""
    if isinstance(module, (nn.ReLU, nn.LeakyReLU)):
        return z > 0
    if isinstance(module, TransformedActivation) and module.name in RELU_FAMILY:
        u = z * module.input_scale + module.input_shift
        tau = module.params.get("tau", 0.0)  # relu and leaky_relu: active above 0
        return u.abs() > tau if CATALOGUE[module.name].two_sided else u > tau
    return None


def activation_stats(
    model: nn.Module, paths: dict[str, str], activations: list[str], x: torch.Tensor
) -> ActivationStats:
    """Fraction of exact zeros in the activation outputs, and dead units (ReLU family: never on the
    active side for any example of the batch, at any location), overall and per layer."""
    zeros = total = dead = units = 0
    per_layer: dict[str, float] = {}
    zero_layer: dict[str, float] = {}
    hooks = []

    def hook(nid, module, inputs, out):
        nonlocal zeros, total, dead, units
        z = int((out == 0).sum())
        zeros += z
        total += out.numel()
        zero_layer[nid] = z / out.numel()
        act = _active(module, inputs[0])
        if act is not None:
            alive = act.transpose(0, 1).reshape(act.shape[1], -1).any(dim=1)
            d = int((~alive).sum())
            dead += d
            units += alive.numel()
            per_layer[nid] = d / alive.numel()

    for nid in activations:
        mod = model.get_submodule(paths[nid])
        hooks.append(mod.register_forward_hook(lambda m, i, o, nid=nid: hook(nid, m, i, o)))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return ActivationStats(zeros / total if total else None, zero_layer, dead / units if units else None, per_layer)


def grad_norms(model: nn.Module, paths: dict[str, str], weighted: list[str]) -> dict[str, float]:
    out = {}
    for nid in weighted:
        g = model.get_submodule(paths[nid]).weight.grad
        out[nid] = float(torch.linalg.vector_norm(g)) if g is not None else None
    return out


def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float, device: torch.device, chunk: int = 1024
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) in eval mode."""
    was = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    try:
        with torch.no_grad():
            for i in range(0, len(y), chunk):
                xb = x[i : i + chunk].to(device, non_blocking=True) * scale
                yb = y[i : i + chunk].to(device, non_blocking=True)
                out = model(xb)
                loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
                correct += int((out.argmax(1) == yb).sum())
    finally:
        model.train(was)
    return correct / len(y), loss_sum / len(y)
