"""The output token kernel of sequence models against the answer's, framework-free (numpy only).

A sequence model's answer predicts ``token_kernel.output``: the exact infinite-width propagation
of the token kernel of orthonormal input tokens (q = 1 per token) through the network (attention
matrices, the MLPs' C maps, sums, layer norms; "Deep Transformers without Shortcuts: Modifying
Self-attention for Faithful Signal Propagation", He, Martens et al., arXiv:2302.10322, section 3).
An adapter feeds such tokens to one or several applied networks and measures
``K_ij = y_i . y_j / width`` of the output tokens; this module compares, entry by entry, as
``sigprop.client.torch.sequence_diagnose`` and ``sigprop.client.jax.token_diagnose`` do with it
(same fields, same noise, same judgement):

- with several networks, the noise of each entry is the standard error of the mean over them,
  measured (a finite-width network's kernel deviates from the limit by its own weights' draw,
  which more inputs do not average away), and an entry is flagged beyond Student's t quantile at
  the 3-sigma level for that many networks (4.53 for 8) plus 0.02;
- with one network, the noise is stated, not measured: the standard deviation of each entry over
  networks from finite-width theory (:func:`stated_token_noise`: the fluctuations of the B sets'
  token kernels propagated through the graph at its widths and initializations, attention mixing
  them as A dK A^T; ``sigprop.client.finite_width``, after Hanin and Nica, "Products of Many Large
  Random Matrices and Gradients in Deep Neural Networks", arXiv:1812.05994). Flagged beyond 3
  noise + 0.02.

Each node's q is measured too and set beside the answer's scalar program, where attention and
layer norm pass q through (q = q* = 1 for TAT and DKS; 0 for the zero-initialized queries, op
``query``): a guide, as the token kernel's diagonal drifts from it by the E-SPA rescaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..schemas.ops import OP_TABLE
from .finite_width import propagate
from .sampling_noise import token_noise, token_representatives

__all__ = [
    "FLAG_SIGMAS",
    "SLACK",
    "flag_sigmas",
    "NodeQ",
    "TokenKernelDiagnosis",
    "orthonormal_tokens",
    "token_kernel_of",
    "answer_token_kernel",
    "judge_tokens",
    "stated_token_noise",
]

FLAG_SIGMAS = 3.0
FLOAT32_RESOLUTION = 1e-6  # float32's relative rounding (2^-23 = 1.2e-7) with headroom for a few products
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


def orthonormal_tokens(batch: int, seq_len: int, width: int, *, seed: int = 0) -> np.ndarray:
    """``[batch, seq_len, width]`` float64: ``batch`` sets of ``seq_len`` orthogonal tokens of mean
    square 1 (``x_i . x_j = width * delta_ij``, the answer's input kernel ``I`` at q = 1), a fresh
    uniformly random frame per set. Needs ``seq_len <= width``."""
    if seq_len > width:
        raise ValueError(f"{seq_len} orthogonal tokens need a width of at least {seq_len}, got {width}")
    rng = np.random.default_rng(int(seed))
    q, r = np.linalg.qr(rng.standard_normal((batch, width, seq_len)))
    q = q * np.sign(np.diagonal(r, axis1=1, axis2=2))[:, None, :]  # Haar: signs fixed by diag(R)
    return np.swapaxes(q, 1, 2) * math.sqrt(width)


def token_kernel_of(y) -> np.ndarray:
    """``K_ij = y_i . y_j / width`` of outputs ``[B, T, width]``, averaged over the B sets: ``[T, T]``."""
    y = np.asarray(y, np.float64)
    return np.einsum("bid,bjd->ij", y, y) / (y.shape[0] * y.shape[-1])


def answer_token_kernel(sol) -> np.ndarray:
    """The answer's ``token_kernel.output`` (ValueError, saying why, when it has none)."""
    kernel = getattr(sol, "token_kernel", None)
    output = None if kernel is None else getattr(kernel, "output", None)
    if output is None:
        raise ValueError(
            "the answer has no token_kernel.output (not a sequence answer, or T above the answer's "
            "max_token_kernel): nothing to compare the output token kernel with"
        )
    return np.asarray(output, dtype=np.float64)


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
        """The largest |error| / noise over the entries. Noise is floored at float32's resolution: an
        entry a norm fixes (the diagonal after a final layer or RMS norm) has no noise over networks,
        and its float32 rounding is no error in noise units."""
        return float((np.abs(self.error) / np.maximum(self.noise, FLOAT32_RESOLUTION)).max())

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
        lines.append(self.verdict())
        return "\n".join(lines)

    __str__ = table

    def verdict(self) -> str:
        """One line: PASS, or FAIL with the worst entry and the likely cause (``judge_tokens``)."""
        if self.ok:
            return (
                f"verdict: PASS: every output token-kernel entry within {self.threshold:.3g} noise + {SLACK:g} of the "
                f"answer's (largest {self.max_sigmas:.2g} noise)"
            )
        return "verdict: FAIL: " + "; ".join(self.warnings or ["output token-kernel entries off their prediction"])


def stated_token_noise(sol, graph: dict, tokens, phi) -> np.ndarray:
    """One network's stated noise per entry of the output token kernel measured on ``tokens``
    ([B, T, D], the sets fed; their mean kernel is measured): the standard deviation over networks
    from finite-width theory at the graph's widths and the answer's initializations (module
    docstring). ``phi``: the answer's transformed activation as a numpy function."""
    rep = token_representatives(tokens)
    out = propagate(
        graph, sol, rep.kernel, rep.shape, phi, lambda k, dk, shape, _: token_noise(k, dk, shape, rep.examples)
    )
    return next(out[nd["id"]] for nd in graph["nodes"] if OP_TABLE[nd["op"]].sink)


def judge_tokens(diag: TokenKernelDiagnosis, *, layer: str = "a Dense layer") -> None:
    """Warnings naming what is off, and its likely cause (``layer``: what the framework calls a
    dense layer, for the message). The output's q is off when a diagonal entry is flagged."""
    off = np.argwhere(diag.flagged)
    if not len(off):
        return
    i, j = (int(v) for v in off[np.argmax(np.abs(diag.error)[diag.flagged])])
    err = diag.error[i, j]
    cause = (
        f"the output's q is off too: an initialization not applied ({layer} the answer does not list, a "
        "LayerNorm or activation left as it was) or an input not at q = 1"
        if np.diag(diag.flagged).any()
        else "the correlations are off with q right: the attention matrices (bias, queries not zero) or the "
        "activation's transformation"
    )
    diag.warnings.append(
        f"{len(off)} output token-kernel entries off their prediction; the worst K[{i}, {j}] by {err:+.4g} "
        f"({abs(err) / max(diag.noise[i, j], 1e-12):.1f} noise): {cause}"
    )
