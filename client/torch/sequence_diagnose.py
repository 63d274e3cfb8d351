"""Diagnosis of an applied sequence model: its output token kernel, measured against the answer's.

The answer's ``token_kernel.output`` is the exact infinite-width propagation of the token kernel
of orthonormal input tokens (q = 1 per token) through the network (attention matrices, the MLPs'
C maps, sums, layer norms; "Deep Transformers without Shortcuts", He, Martens et al.,
arXiv:2302.10322, section 3). :func:`diagnose_tokens` feeds such tokens to one or several applied
networks (``apply`` with different seeds) and compares ``K_ij = y_i . y_j / width`` of the output
tokens entry by entry:

- with several networks, the noise of each entry is the standard error of the mean over them,
  measured (the honest figure: a finite-width network's kernel deviates from the limit by its
  own weights' draw, which more inputs do not average away), and an entry is flagged beyond
  Student's t quantile at the 3-sigma level for that many networks (4.53 for 8) plus 0.02;
- with one network, the noise is stated, not measured: ``sqrt((K_ii K_jj + K_ij^2) * layers /
  (4 width))``, a Gaussian estimate's spread per layer accumulated over the dense layers on the
  longest path (finite-width deviations grow like depth / width: Hanin and Nica, "Products of Many
  Large Random Matrices and Gradients in Deep Neural Networks", arXiv:1812.05994), the factor 1/4
  calibrated on orthogonally initialized TAT networks (48 networks of width 128 with 8 dense layers
  per path: per-network std of an output token's q 0.15, the formula's 0.18). A rough figure:
  measure several networks for a sharp check. Flagged beyond 3 noise + 0.02.

Each node's q (mean square over tokens and features) is measured too and set beside the answer's
scalar program, where attention and layer norm pass q through (q = q* = 1 for TAT and DKS; 0 for
the zero-initialized queries, op ``query``): a
guide, as the token kernel's diagonal drifts from it by the E-SPA rescaling (the output's
predicted diagonal shows by how much).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..solution import as_solution
from .sequence_apply import answer_part

__all__ = ["TokenKernelDiagnosis", "diagnose_tokens", "orthonormal_tokens", "flag_sigmas", "FLAG_SIGMAS"]

FLAG_SIGMAS = 3.0
SLACK = 0.02  # absolute tolerance added to the flag threshold: float32 rounding and a few networks' SE
# Student's t quantiles at the normal's 3-sigma level (two-sided 0.27 %) for 1..30 degrees of
# freedom (scipy.stats.t.ppf(norm.cdf(3), dof)): with n networks the standard error is itself
# estimated from n draws, so an entry is flagged at the same false-alarm rate as 3 sigma
_T_AT_3_SIGMA = (
    235.801, 19.207, 9.219, 6.62, 5.507, 4.904, 4.53, 4.277, 4.094, 3.957, 3.85, 3.764, 3.694, 3.636, 3.586,
    3.544, 3.507, 3.475, 3.447, 3.422, 3.4, 3.38, 3.361, 3.345, 3.33, 3.316, 3.303, 3.291, 3.28, 3.27,
)  # fmt: skip


def flag_sigmas(networks: int, measured_noise: bool) -> float:
    """How many noise units an entry may be off: 3 for a stated noise, Student's t at the same
    false-alarm rate for a standard error measured over ``networks`` networks."""
    if not measured_noise:
        return FLAG_SIGMAS
    dof = networks - 1
    return _T_AT_3_SIGMA[dof - 1] if dof <= len(_T_AT_3_SIGMA) else FLAG_SIGMAS


def orthonormal_tokens(batch: int, seq_len: int, width: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """``batch`` sets of ``seq_len`` orthogonal tokens of mean square 1 (``x_i . x_j = width *
    delta_ij``): the answer's input kernel ``I`` at q = 1. Needs ``seq_len <= width``."""
    if seq_len > width:
        raise ValueError(f"{seq_len} orthogonal tokens need a width of at least {seq_len}, got {width}")
    gen = torch.Generator().manual_seed(int(seed))
    z = torch.randn(batch, width, seq_len, generator=gen, dtype=torch.float64)
    q, _ = torch.linalg.qr(z)  # (batch, width, seq_len), orthonormal columns
    return (q.transpose(1, 2) * math.sqrt(width)).to(dtype)


@dataclass
class NodeQ:
    id: str
    op: str
    q_predicted: float | None
    q_measured: float


@dataclass
class TokenKernelDiagnosis:
    """The output token kernel, measured against the answer's ``token_kernel.output``."""

    method: str
    activation: str
    shaping: str | None
    networks: int
    predicted: np.ndarray  # (T, T)
    measured: np.ndarray  # (T, T): mean over the networks
    noise: np.ndarray  # (T, T): standard error (several networks) or stated noise (one)
    noise_source: str  # "networks" or "stated"
    nodes: list[NodeQ] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def error(self) -> np.ndarray:
        return self.measured - self.predicted

    @property
    def max_error(self) -> float:
        return float(np.abs(self.error).max())

    @property
    def max_sigmas(self) -> float:
        """The largest |error| / noise over the entries."""
        return float((np.abs(self.error) / np.maximum(self.noise, 1e-12)).max())

    @property
    def threshold(self) -> float:
        """Noise units an entry may be off (:func:`flag_sigmas`)."""
        return flag_sigmas(self.networks, self.noise_source == "networks")

    @property
    def flagged(self) -> np.ndarray:
        """Entries off by more than ``threshold`` times their noise plus SLACK."""
        return np.abs(self.error) > self.threshold * self.noise + SLACK

    @property
    def ok(self) -> bool:
        return not self.warnings and not self.flagged.any()

    def table(self) -> str:
        t = self.predicted.shape[0]
        lines = [
            f"sigprop diagnose ({self.method}, {self.activation}, attention {self.shaping}): output token kernel "
            f"of {t} orthonormal tokens (q = 1), {self.networks} network(s), noise {self.noise_source}",
            f"max |measured - predicted| = {self.max_error:.4g}; max error / noise = {self.max_sigmas:.3g}; "
            f"{int(self.flagged.sum())} of {t * t} entries off by more than {self.threshold:.3g} noise + {SLACK:g}",
            f"diagonal predicted {np.diag(self.predicted).min():.4f}..{np.diag(self.predicted).max():.4f}, measured "
            f"{np.diag(self.measured).min():.4f}..{np.diag(self.measured).max():.4f}; K[T-1, 0] predicted "
            f"{self.predicted[-1, 0]:.4f}, measured {self.measured[-1, 0]:.4f}",
        ]
        if self.nodes:
            width = max(len(n.id) for n in self.nodes)
            lines.append(f"{'node':<{width}}  {'op':<11} {'q pred':>8} {'q meas':>8}")
            for n in self.nodes:
                pred = f"{n.q_predicted:8.4f}" if n.q_predicted is not None else "       -"
                lines.append(f"{n.id:<{width}}  {n.op:<11} {pred} {n.q_measured:8.4f}")
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)

    __str__ = table


def _probes(model: nn.Module) -> dict[str, tuple[str, str]]:
    """Graph id -> (module path, op) of the nodes ``apply`` left a module for."""
    info = getattr(model, "sigprop_sequence", None) or {}
    return dict(info.get("probes", {}))


def _measure(model: nn.Module, x: torch.Tensor, probes: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """The output on ``x`` (eval mode, no gradients) and each probed node's q."""
    q: dict[str, float] = {}
    hooks = []
    modules = dict(model.named_modules())
    for gid, (path, _) in probes.items():
        m = modules.get(path)
        if m is None:
            continue

        def hook(_m, _inp, out, gid=gid):
            out = out[0] if isinstance(out, tuple) else out
            q[gid] = float(out.detach().double().pow(2).mean())

        hooks.append(m.register_forward_hook(hook))
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            y = model(x)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return y, q


def _dense_layers(graph: dict) -> tuple[int, int]:
    """(dense layers on the longest path, the narrowest width) of a sequence graph."""
    depth: dict[str, int] = {}
    width = []
    for nd in graph.get("nodes", []):
        ins = nd.get("inputs", [])
        d = max((depth.get(i, 0) for i in ins), default=0)
        if nd["op"] == "dense":
            d += 1
            width.append(int(nd["units"]))
        depth[nd["id"]] = d
    return max(depth.values(), default=0), min(width, default=1)


def diagnose_tokens(models, solution, *, batch: int = 4, seed: int = 0) -> TokenKernelDiagnosis:
    """The output token kernel of one applied sequence model (``apply(...).model``) or a list of
    them (the same network applied with different seeds), against the answer's
    ``token_kernel.output`` (module docstring). ``batch`` sets of orthonormal tokens are fed to
    each network; ``str()`` is a summary and a per-node q table."""
    models = list(models) if isinstance(models, (list, tuple)) else [models]
    sol = as_solution(solution)
    kernel = answer_part(solution, "token_kernel") or {}
    if kernel.get("output") is None:
        raise ValueError(
            "the answer has no token_kernel.output (not a sequence answer, or T above the answer's max_token_kernel): "
            "nothing to compare the output token kernel with"
        )
    predicted = np.asarray(kernel["output"], dtype=np.float64)
    t = predicted.shape[0]
    info = getattr(models[0], "sigprop_sequence", None) or {}
    graph = info.get("graph", {})
    width_in = next((nd["shape"][-1] for nd in graph.get("nodes", []) if nd.get("op") == "input"), None)
    if width_in is None:
        raise ValueError("diagnose_tokens needs models returned by apply() for a sequence answer")
    x = orthonormal_tokens(batch, t, int(width_in), seed=seed)
    per_net, qs = [], []
    for model in models:
        y, q = _measure(model, x, _probes(model))
        y = y.detach().double()
        per_net.append(torch.einsum("bid,bjd->ij", y, y).numpy() / (y.shape[0] * y.shape[-1]))
        qs.append(q)
    stack = np.stack(per_net)
    measured = stack.mean(axis=0)
    if len(models) >= 2:
        noise, source = stack.std(axis=0, ddof=1) / math.sqrt(len(models)), "networks"
    else:
        layers, narrow = _dense_layers(graph)
        d = np.diag(predicted)
        noise = np.sqrt((np.outer(d, d) + predicted**2) * max(layers, 1) / (4 * narrow))
        source = "stated"
    q_star = sol.q_star if sol.q_star is not None else 1.0
    probes = _probes(models[0])
    nodes = [
        NodeQ(gid, op, 0.0 if op == "query" else q_star, float(np.mean([q[gid] for q in qs if gid in q])))
        for gid, (_, op) in probes.items()
        if any(gid in q for q in qs)
    ]
    diag = TokenKernelDiagnosis(
        sol.method,
        sol.activation,
        (answer_part(solution, "attention") or {}).get("shaping"),
        len(models),
        predicted,
        measured,
        noise,
        source,
        nodes,
    )
    _judge(diag)
    return diag


def _judge(diag: TokenKernelDiagnosis) -> None:
    """Warnings naming what is off, and its likely cause."""
    off = np.argwhere(diag.flagged)
    if not len(off):
        return
    i, j = (int(v) for v in off[np.argmax(np.abs(diag.error)[diag.flagged])])
    err = diag.error[i, j]
    cause = (
        "the output's q is off too: an initialization not applied (a Linear the answer does not list, a LayerNorm "
        "or activation left as it was) or an input not at q = 1"
        if np.diag(diag.flagged).any()
        else "the correlations are off with q right: the attention matrices (bias, queries not zero) or the "
        "activation's transformation"
    )
    diag.warnings.append(
        f"{len(off)} output token-kernel entries off their prediction; the worst K[{i}, {j}] by {err:+.4g} "
        f"({abs(err) / max(diag.noise[i, j], 1e-12):.1f} noise): {cause}"
    )
