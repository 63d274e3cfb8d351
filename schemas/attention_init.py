"""The attention matrix at initialization, expanded from the compact generator an answer carries.

An answer shapes each ``attention`` node with a generator (contract, ``attention.layers``), small
enough to send for any sequence length; the engine (to predict token kernels) and every adapter
(to install the bias matrices) expand it here, so both read one definition.

At initialization the logits ``Q K^T`` vanish (zero query weights for E-SPA, U-SPA and
Value-SkipInit; the width-dependent temperature of shaped attention at infinite width), so the
attention matrix is fixed:

    A = identity * I + diag(scale) softmax(bias) - centre * softmax(mask),

``bias`` an additive logit bias (``-inf`` where a token may not attend), ``mask`` the bias of plain
(causal or full) attention. Its forms, from "Deep Transformers without Shortcuts: Modifying
Self-attention for Faithful Signal Propagation" (He, Martens et al., arXiv:2302.10322), section 3,
and "The Shaped Transformer" (Noci et al., arXiv:2306.17759):

- ``cholesky_ratio`` (E-SPA, U-SPA): A = L_t L_s^{-1} with L_t, L_s the Cholesky factors of a target
  and a source kernel matrix, so that A Sigma_s A^T = Sigma_t. A is lower triangular with
  non-negative entries for the paper's kernel families when the target is at least as correlated as
  the source (its Theorem 1); written as A = D P with D = diag(row sums) (the location-dependent
  rescaling) and P = softmax(log P) row-stochastic, so bias = log P. With ``source_floor`` f > 0
  (E-SPA's joint schedule, issue 37) the source the attention reads is f 1 1^T + (1 - f) Sigma_s, the
  floor every pair of tokens has after MLP blocks whose C(0) > 0; each row i of L_t L_s^{-1} (row sum
  d_i) is divided by sqrt(f d_i^2 + 1 - f), so that every token keeps q = 1: the output is
  (f d d^T + (1 - f) Sigma_t) with unit diagonal, non-negative as the paper's ratio is.
- ``value_skipinit``: A = alpha I + beta softmax(mask) (alpha, beta trainable; 1 and 0 at init).
- ``shaped``: A = I + softmax(logits / temperature) - softmax(mask): the identity at init.

Kernel families of a ``cholesky_ratio`` (tokens indexed from 0):

- ``identity``: I, orthonormal tokens (the paper's input, gamma_0 = infinity);
- ``exponential`` with ``gamma``: Sigma_ij = exp(-gamma |i - j|) (E-SPA);
- ``uniform`` with ``rho``: Sigma = (1 - rho) I + rho 1 1^T (U-SPA).
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass

import numpy as np

__all__ = [
    "AttentionInit",
    "expand_attention",
    "kernel_matrix",
    "kernel_factor",
    "exponential_cholesky",
    "cholesky_ratio",
    "one_blas_thread",
]

FORMS = ("cholesky_ratio", "value_skipinit", "shaped")
FAMILIES = ("identity", "exponential", "uniform")


@dataclass(frozen=True)
class AttentionInit:
    """One attention node's matrix at initialization, in the form an adapter installs."""

    identity: float  # weight of I (Value-SkipInit's alpha; 1 for shaped attention)
    scale: np.ndarray  # (T,): the location-dependent rescaling D of the softmax term
    bias: np.ndarray  # (T, T): additive logit bias, -inf where a token may not attend
    centre: float  # weight of the subtracted softmax(mask) (1 for shaped attention)
    causal: bool
    temperature: float = 1.0  # shaped attention's tau_0; 1 elsewhere

    def softmax(self) -> np.ndarray:
        """softmax(bias), row by row: the softmax term at zero logits."""
        return _row_softmax(self.bias)

    def matrix(self) -> np.ndarray:
        """A at initialization (zero logits)."""
        t = self.bias.shape[0]
        a = self.scale[:, None] * self.softmax()
        if self.identity:
            a = a + self.identity * np.eye(t)
        if self.centre:
            a = a - self.centre * _row_softmax(mask_bias(t, self.causal))
        return a


def mask_bias(seq_len: int, causal: bool) -> np.ndarray:
    """The logit bias of plain attention: 0 where a token may attend, -inf elsewhere."""
    bias = np.zeros((seq_len, seq_len))
    if causal:
        bias[np.triu_indices(seq_len, 1)] = -np.inf
    return bias


def _row_softmax(bias: np.ndarray) -> np.ndarray:
    top = bias.max(axis=1, keepdims=True)
    e = np.exp(bias - top)
    return e / e.sum(axis=1, keepdims=True)


def kernel_matrix(family: dict, seq_len: int) -> np.ndarray:
    """The T x T kernel matrix of a family (module docstring)."""
    kind = family.get("family")
    t = np.arange(seq_len)
    if kind == "identity":
        return np.eye(seq_len)
    if kind == "exponential":
        return np.exp(-_gamma(family) * np.abs(t[:, None] - t[None, :]))
    if kind == "uniform":
        rho = _rho(family)
        return (1.0 - rho) * np.eye(seq_len) + rho
    raise ValueError(f"unknown kernel family {kind!r}; expected one of {', '.join(FAMILIES)}")


def exponential_cholesky(gamma: float, seq_len: int) -> np.ndarray:
    """The Cholesky factor of exp(-gamma |i - j|) in closed form: with rho = exp(-gamma) and
    s = sqrt(1 - rho^2), L_i0 = rho^i and L_ij = s rho^(i - j) for 1 <= j <= i (the stationary
    AR(1) process x_i = rho x_(i-1) + s z_i)."""
    rho = math.exp(-gamma)
    s = math.sqrt(-math.expm1(-2.0 * gamma))
    t = np.arange(seq_len)
    lag = t[:, None] - t[None, :]
    factor = np.where(lag >= 0, s * rho ** np.maximum(lag, 0), 0.0)
    factor[:, 0] = rho**t
    return factor


def kernel_factor(family: dict, seq_len: int) -> np.ndarray:
    """The lower Cholesky factor of ``kernel_matrix(family)`` (closed form where there is one)."""
    kind = family.get("family")
    if kind == "identity":
        return np.eye(seq_len)
    if kind == "exponential":
        return exponential_cholesky(_gamma(family), seq_len)
    return np.linalg.cholesky(kernel_matrix(family, seq_len))


def cholesky_ratio(target: dict, source: dict, seq_len: int) -> np.ndarray:
    """A = L_target L_source^{-1}: the lower-triangular matrix with A Sigma_s A^T = Sigma_t."""
    lt = kernel_factor(target, seq_len)
    kind = source.get("family")
    if kind == "identity":
        return lt
    if kind == "exponential":
        # L_s^{-1} is bidiagonal (AR(1) whitening): column j of A is
        # L_t[:, j] Linv[j, j] + L_t[:, j + 1] Linv[j + 1, j]
        gamma = _gamma(source)
        rho = math.exp(-gamma)
        s = math.sqrt(-math.expm1(-2.0 * gamma))
        diag = np.full(seq_len, 1.0 / s)
        diag[0] = 1.0
        a = lt * diag[None, :]
        a[:, :-1] -= lt[:, 1:] * (rho / s)
        return a
    ls = kernel_factor(source, seq_len)
    return np.linalg.solve(ls.T, lt.T).T


def expand_attention(generator: dict, seq_len: int, causal: bool) -> AttentionInit:
    """The attention node's matrix at initialization from its answer's generator."""
    form = generator.get("form")
    plain = mask_bias(seq_len, causal)
    ones = np.ones(seq_len)
    if form == "value_skipinit":
        return AttentionInit(
            float(generator.get("alpha", 1.0)), float(generator.get("beta", 0.0)) * ones, plain, 0.0, causal
        )
    if form == "shaped":
        return AttentionInit(1.0, ones, plain, 1.0, causal, float(generator.get("temperature", 1.0)))
    if form != "cholesky_ratio":
        raise ValueError(f"unknown attention generator form {form!r}; expected one of {', '.join(FORMS)}")
    with one_blas_thread():  # U-SPA's Cholesky factors and solve: T^3 each
        a = cholesky_ratio(generator["target"], generator["source"], seq_len)
    a[np.triu_indices(seq_len, 1)] = 0.0  # exact zeros above the diagonal (rounding of the solve)
    low = a.min()
    if low < -1e-10 * max(1.0, abs(a).max()):
        raise ValueError(
            f"the generator's attention matrix has a negative entry ({low:.3g}): a softmax cannot "
            "produce it (the target kernel must be at least as correlated as the source)"
        )
    a = np.maximum(a, 0.0)
    floor = _source_floor(generator)
    if floor:
        a = a / floor_row_scale(a.sum(axis=1), floor)[:, None]
    scale = a.sum(axis=1)
    with np.errstate(divide="ignore"):
        bias = np.log(a / scale[:, None])
    return AttentionInit(0.0, scale, bias, 0.0, causal)


_controller = None
_controller_lock = threading.Lock()


def one_blas_thread():
    """A context in which BLAS/LAPACK run on one thread (threadpoolctl; a no-op without it). Every
    engine path runs BLAS this way: its matrices are at most 256 x 256, where threads gain little,
    and the service runs several solver processes on few cores, where BLAS threads mostly wait for
    each other: six concurrent U-SPA solves took 20-21.5 s each with OpenBLAS's default threads and
    10.3-11 s with one (issue 35). The controller (which libraries are loaded) is read once, so
    entering costs microseconds, not the 0.2 ms of ``threadpool_limits``."""
    global _controller
    if _controller is None:
        with _controller_lock:
            if _controller is None:
                try:
                    from threadpoolctl import ThreadpoolController
                except ImportError:  # pragma: no cover - a dependency, but the engine works without it
                    return contextlib.nullcontext()
                _controller = ThreadpoolController()
    return _controller.limit(limits=1, user_api="blas")


def floor_row_scale(row_sums: np.ndarray, floor: float) -> np.ndarray:
    """sqrt(f d_i^2 + 1 - f): row i of a ratio A with row sums d maps the floored source f 1 1^T +
    (1 - f) Sigma_s (unit diagonal, A Sigma_s A^T unit diagonal) to f d_i^2 + (1 - f) on the diagonal;
    dividing the row by this keeps every token at q = 1."""
    return np.sqrt(floor * row_sums * row_sums + (1.0 - floor))


def _source_floor(generator: dict) -> float:
    floor = float(generator.get("source_floor", 0.0))
    if not 0.0 <= floor < 1.0:
        raise ValueError(f"a cholesky_ratio's source_floor must lie in [0, 1), got {generator.get('source_floor')!r}")
    return floor


def _gamma(family: dict) -> float:
    gamma = float(family.get("gamma", math.nan))
    if not gamma > 0.0:
        raise ValueError(f"an exponential kernel needs gamma > 0, got {family.get('gamma')!r}")
    return gamma


def _rho(family: dict) -> float:
    rho = float(family.get("rho", math.nan))
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"a uniform kernel needs 0 <= rho < 1, got {family.get('rho')!r}")
    return rho
