"""Edge of Chaos initialization, the classic baseline (TAT paper section 3, Table 1 EOC column;
sparsity paper section 2, equations 2-4).

For pre-activations h = W x + b with W_ij ~ N(0, sigma_w^2 / fan_in) and b_i ~ N(0, sigma_b^2),
the variance map is V(q) = sigma_w^2 E[phi(sqrt(q) z)^2] + sigma_b^2 and the correlation map's
slope at c = 1 is chi_1 = sigma_w^2 E[phi'(sqrt(q*) z)^2]. EOC picks the pair with chi_1 = 1 and
V(q*) = q*:

    sigma_w^2 = 1 / E[phi'(sqrt(q*) z)^2],    sigma_b^2 = q* - sigma_w^2 E[phi(sqrt(q*) z)^2].

ReLU gives (2, 0) for every q*. Derivatives of V use Gaussian integration by parts,
d/dq E[g(sqrt(q) z)] = E[g'(sqrt(q) z) z] / (2 sqrt(q)), so only phi' and phi'' are needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...errors import SigpropError
from ..maps.activations import Activation
from ..maps.quadrature import gaussian_rule


@dataclass(frozen=True)
class EOCSolution:
    q_star: float
    sigma_w2: float
    sigma_b2: float
    chi_1: float
    v_slope: float
    v_curvature: float | None  # None where phi'' has Dirac parts (piecewise-linear activations)


def _moments(act: Activation, q: float):
    s = math.sqrt(q)
    z, w = gaussian_rule([k / s for k in act.kinks], scale=s)
    u = s * z
    f, d1, d2 = act.fn(u), act.d1(u), act.d2(u)
    return z, w, f, d1, d2


def variance_map(act: Activation, q, sigma_w2: float, sigma_b2: float):
    """V(q) = sigma_w^2 E[phi(sqrt(q) z)^2] + sigma_b^2 (equation 2 of the sparsity paper)."""
    out = []
    for qi in np.atleast_1d(q):
        _, w, f, _, _ = _moments(act, float(qi))
        out.append(sigma_w2 * float(w @ (f * f)) + sigma_b2)
    return np.array(out)


def _bias_needed(act: Activation, q: float) -> float:
    _, w, f, d1, _ = _moments(act, q)
    return q - float(w @ (f * f)) / float(w @ (d1 * d1))


def _bias_hint(act: Activation, q_star: float) -> str:
    """Where sigma_b^2 >= 0 is found among a few other q*, or that none of them has it (softplus:
    E[phi^2] > q E[phi'^2] at every q, so its Edge of Chaos would need a negative bias variance)."""
    for q in (10.0 * q_star, 100.0 * q_star, 0.1 * q_star, 0.01 * q_star):
        if _bias_needed(act, q) >= 0.0:
            return f"choose another q_star: q_star = {q:g} has sigma_b^2 = {_bias_needed(act, q):.4g} >= 0"
    return (
        f"'{act.name}' needs sigma_b^2 < 0 at every q_star tried (0.01x to 100x): choose an activation "
        "with an Edge of Chaos (tanh, erf, elu, selu, gelu), or method 'tat' or 'dks'"
    )


def solve_eoc(act: Activation, q_star: float = 1.0) -> EOCSolution:
    if not (q_star > 0 and math.isfinite(q_star)):
        raise SigpropError(
            "invalid_target",
            f"q_star = {q_star} is not a positive number",
            "q_star is the fixed point of the variance map; the default is 1",
        )
    z, w, f, d1, d2 = _moments(act, q_star)
    d1_sq = float(w @ (d1 * d1))
    if d1_sq <= 0:
        raise SigpropError(
            "unreachable_target",
            f"'{act.name}' has zero derivative almost everywhere at q* = {q_star}",
            "choose another q_star or activation",
        )
    sigma_w2 = 1.0 / d1_sq
    sigma_b2 = q_star - sigma_w2 * float(w @ (f * f))
    if sigma_b2 < -1e-12 * max(1.0, q_star):
        raise SigpropError(
            "unreachable_target",
            f"no Edge of Chaos initialization of '{act.name}' has q* = {q_star}: "
            f"it would need sigma_b^2 = {sigma_b2:.6g} < 0",
            _bias_hint(act, q_star),
        )
    if sigma_b2 <= 1e-12 * max(1.0, q_star):
        # within rounding of 0 either way: a cancellation residue of q* - sigma_w^2 E[phi^2] (ReLU
        # at any q*), not a bias to initialize (and not one whose sign depends on the BLAS build)
        sigma_b2 = 0.0
    s = math.sqrt(q_star)
    fd1z = float(w @ (f * d1 * z))
    v_slope = sigma_w2 * fd1z / s
    v_curv = None
    if act.smooth:
        # V''(q) = sigma_w^2 / (2q) * (E[(phi'^2 + phi phi'')(u) z^2] - E[phi phi'(u) z] / sqrt(q))
        v_curv = sigma_w2 / (2 * q_star) * (float(w @ ((d1 * d1 + f * d2) * z * z)) - fd1z / s)
    return EOCSolution(q_star, sigma_w2, sigma_b2, sigma_w2 * d1_sq, v_slope, v_curv)
