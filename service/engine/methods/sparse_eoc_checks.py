"""Argument checks of the sparse Edge of Chaos functions (``engine.methods.sparse_eoc``): every value a
request can carry is checked here and rejected with a contract error saying what is accepted."""

from __future__ import annotations

import math

import numpy as np

from ...errors import SigpropError
from ...schemas.activations import CATALOGUE, CLIPPED_SPARSE_ACTIVATIONS, UNCLIPPED_SPARSE_ACTIVATIONS

# one- or two-sided thresholding, per kind
SPARSE_KINDS = UNCLIPPED_SPARSE_ACTIVATIONS + CLIPPED_SPARSE_ACTIVATIONS
CLIPPED_KINDS = CLIPPED_SPARSE_ACTIVATIONS
_SIDES = {k: 2 if CATALOGUE[k].two_sided else 1 for k in SPARSE_KINDS}


def _kind(kind) -> str:
    if not isinstance(kind, str) or kind not in _SIDES:
        raise SigpropError(
            "unsupported_activation",
            f"sparse EOC is defined for {', '.join(SPARSE_KINDS)}; got {kind!r}",
            "use relu_tau or soft_threshold (Price et al. eqs. 7, 8) or their clipped variants "
            "crelu and cst (eqs. 9, 10)",
        )
    return kind


def _number(name: str, value, *, code: str = "invalid_request") -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise SigpropError(code, f"{name} must be a number, got {value!r}", f"give {name} as a finite number") from None
    if not math.isfinite(v):
        raise SigpropError(code, f"{name} must be finite, got {value!r}", f"give {name} as a finite number")
    return v


def _q_star(q_star) -> float:
    q = _number("q_star", q_star, code="invalid_target")
    if q <= 0:
        raise SigpropError(
            "invalid_target",
            f"q_star = {q_star!r} is not a positive number",
            "q_star is the fixed point of the variance map; the default is 1",
        )
    return q


def _params(kind: str, tau, m) -> tuple[float, float | None]:
    t = _number("tau", tau)
    if t < 0:
        raise SigpropError(
            "invalid_request",
            f"threshold tau of {kind!r} must be >= 0, got {tau!r}",
            "tau is the sparsifying threshold; tau = 0 gives no sparsification",
        )
    if kind in CLIPPED_KINDS:
        if m is None:
            raise SigpropError(
                "invalid_request",
                f"{kind!r} needs a clip level m",
                "m is the magnitude at which the activation is clipped (eqs. 9, 10)",
            )
        mm = _number("m", m)
        if mm <= 0:
            raise SigpropError(
                "invalid_request",
                f"clip level m of {kind!r} must be > 0, got {m!r}",
                "m is the magnitude at which the activation is clipped",
            )
        return t, mm
    if m is not None:
        raise SigpropError(
            "invalid_request",
            f"{kind!r} is not clipped and takes no m (got {m!r})",
            "pass m=None, or use the clipped variant " + ("crelu" if kind == "relu_tau" else "cst"),
        )
    return t, None


def _sigmas(sigma_w2, sigma_b2=0.0) -> tuple[float, float]:
    w = _number("sigma_w2", sigma_w2)
    b = _number("sigma_b2", sigma_b2)
    if w <= 0:
        raise SigpropError(
            "invalid_request",
            f"sigma_w2 must be > 0, got {sigma_w2!r}",
            "sigma_w^2 is the weight variance times fan_in",
        )
    if b < 0:
        raise SigpropError(
            "invalid_request", f"sigma_b2 must be >= 0, got {sigma_b2!r}", "sigma_b^2 is the bias variance"
        )
    return w, b


def _q_array(q) -> np.ndarray:
    try:
        qa = np.asarray(q, dtype=np.float64)
    except (TypeError, ValueError):
        raise SigpropError(
            "invalid_request",
            f"q must be a number or an array of numbers, got {q!r}",
            "q is the pre-activation variance, q > 0",
        ) from None
    if not (np.all(np.isfinite(qa)) and np.all(qa > 0)):
        raise SigpropError(
            "invalid_request", "every q must be finite and > 0", "q is the pre-activation variance, q > 0"
        )
    return qa


def _out(x: np.ndarray, like: np.ndarray):
    return float(x) if like.ndim == 0 else x


def _sparsity(kind: str, s) -> float:
    v = _number("sparsity", s, code="invalid_target")
    if not 0.0 < v < 1.0:
        raise SigpropError(
            "invalid_target",
            f"sparsity must lie in (0, 1), got {s!r}",
            "sparsity is the expected fraction of exact zeros, e.g. 0.8",
        )
    if _SIDES[kind] == 1 and v < 0.5:
        raise SigpropError(
            "invalid_target",
            f"{kind!r} cannot reach sparsity {v:g} < 0.5: it would need tau = sqrt(q*) Phi^-1({v:g}) < 0",
            "ReLU-type activations zero out at least half of N(0, q*) with tau >= 0 (eq. 57); "
            "use sparsity >= 0.5, or soft_threshold / cst, which reach any sparsity in (0, 1) (eq. 58)",
        )
    return v
