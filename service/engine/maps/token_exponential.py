"""The ELU family's token kernel in closed form: E[phi(u) phi(v)] for phi(x) = P + Q E(a (x - x0)),
E(y) = y_+ + alpha (e^y - 1) 1{y < 0} (ELU; SELU is its multiple), any transformation of it.

Its Hermite series converges slowly (phi'' jumps at the kink, or phi' for SELU), so on E-SPA's
strongly correlated tokens ``token_activation`` would integrate almost every pair directly. Instead,
with y = a (u - x0) Gaussian, E(y) = R + alpha X - alpha S over R = y_+, X = e^y 1{y < 0} and
S = 1{y < 0}, and every product's expectation is a bivariate normal moment:

- S S, R S and R R from the orthant probability and Rosenbaum's truncated moments
  (``token_activation._orthant``, ``_ramp_pair``, ``_ramp_step``);
- a factor e^{y_1} tilts the Gaussian (Cameron-Martin): E[e^{y_1} g(y_1, y_2)] = e^{m_1 + s_1^2 / 2}
  E[g(y_1', y_2')] with the means moved by the covariance column, m_1 + s_1^2 and m_2 + s_12, the
  covariance unchanged; so X S, X R and X X are S S, S R and S S of shifted means.

Every term is bounded (e^y < 1 where X is not 0), so nothing large cancels. Pairs with |c| within
1e-9 of 1 are extrapolated linearly in c (``_EDGE``), the diagonal E[phi^2] has its own closed form,
and a constant token (K_ii = 0) contributes phi(0) times the other token's mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr

from ...schemas.activations import SELU_ALPHA
from .activations import Activation
from .bivariate_normal import orthant, token_correlations
from .bivariate_normal import ramp_pair as standard_ramp_pair

__all__ = ["ExponentialLinear", "elu_family", "elu_family_kernel"]

_SQRT_2PI = math.sqrt(2.0 * math.pi)


@dataclass(frozen=True)
class ExponentialLinear:
    """phi(x) = offset + scale * E(slope * (x - kink)), E(y) = y_+ + alpha (e^y - 1) 1{y < 0}."""

    offset: float
    scale: float
    slope: float
    kink: float
    alpha: float

    def __call__(self, x):
        y = self.slope * (np.asarray(x, dtype=float) - self.kink)
        return self.offset + self.scale * np.where(y > 0.0, y, self.alpha * np.expm1(np.minimum(y, 0.0)))


def elu_family(act: Activation) -> ExponentialLinear | None:
    """phi's (P, Q, a, x0, alpha) for an ELU or SELU however transformed, read off phi's own values
    and derivatives (on the exponential side phi'' / phi' = a exactly) and checked at probe points;
    None for any other phi."""
    if act.name not in ("elu", "selu") or len(act.kinks) != 1:
        return None
    alpha = SELU_ALPHA if act.name == "selu" else float(dict(act.params).get("alpha", 1.0))
    if alpha == 0.0:
        return None  # ReLU itself: the piecewise-linear route's
    x0 = float(act.kinks[0])
    left, right = np.array([x0 - 1.0]), np.array([x0 + 1.0])
    exp_side, lin_side = (left, right) if act.d2(left)[0] != 0.0 else (right, left)
    d1 = float(act.d1(exp_side)[0])
    if d1 == 0.0:
        return None
    slope = float(act.d2(exp_side)[0]) / d1
    scale = float(act.d1(lin_side)[0]) / slope
    offset = float(act.fn(lin_side)[0]) - scale * slope * (float(lin_side[0]) - x0)
    fam = ExponentialLinear(offset, scale, slope, x0, alpha)
    probe = x0 + np.array([-3.0, -1.0, -0.3, 0.0, 0.4, 2.0]) / abs(slope)
    want = act.fn(probe)
    if not np.allclose(fam(probe), want, rtol=1e-12, atol=1e-12 * (1.0 + np.max(np.abs(want)))):
        return None
    return fam


def _step_pair(m1, m2, s1, s2, rho):
    """P(y1 < 0, y2 < 0)."""
    return orthant(m1 / s1, m2 / s2, rho)  # P(X1 > m1/s1, X2 > m2/s2) = P(y1 < 0, y2 < 0) by X -> -X


def _ramp_step(m1, m2, s1, s2, rho):
    """E[(y1)_+ 1{y2 < 0}] = E[(y1)_+] - E[(y1)_+ 1{y2 > 0}], the last s1 (E[X1 1_A] - h P(A)) over
    A = {X1 > h, X2 > k}, h = -m1/s1, k = -m2/s2, with Rosenbaum's E[X1 1_A] = phi(h) Q((k - rho h) / s)
    + rho phi(k) Q((h - rho k) / s), s = sqrt(1 - rho^2)."""
    h, k = -m1 / s1, -m2 / s2
    s = np.sqrt(1.0 - rho * rho)
    ph, pk = np.exp(-0.5 * h * h) / _SQRT_2PI, np.exp(-0.5 * k * k) / _SQRT_2PI
    ex = ph * ndtr(-(k - rho * h) / s) + rho * pk * ndtr(-(h - rho * k) / s)
    ramp = s1 * (ph - h * ndtr(-h))
    return ramp - s1 * (ex - h * orthant(h, k, rho))


def _ramp_pair(m1, m2, s1, s2, rho):
    return s1 * s2 * standard_ramp_pair(-m1 / s1, -m2 / s2, rho)


def _basis_products(m1, m2, s1, s2, rho, alpha):
    """E[E(y1) E(y2)] for y_i ~ N(m_i, s_i^2) of correlation rho (module docstring)."""
    s12 = rho * s1 * s2
    ss = _step_pair(m1, m2, s1, s2, rho)
    rs = _ramp_step(m1, m2, s1, s2, rho)
    sr = _ramp_step(m2, m1, s2, s1, rho)
    rr = _ramp_pair(m1, m2, s1, s2, rho)
    tilt1, tilt2 = np.exp(m1 + 0.5 * s1 * s1), np.exp(m2 + 0.5 * s2 * s2)
    # X1 g(y2): the means move to (m1 + s1^2, m2 + s12)
    xs = tilt1 * _step_pair(m1 + s1 * s1, m2 + s12, s1, s2, rho)
    xr = tilt1 * _ramp_step(m2 + s12, m1 + s1 * s1, s2, s1, rho)  # E'[1{y1 < 0} (y2)_+]
    sx = tilt2 * _step_pair(m1 + s12, m2 + s2 * s2, s1, s2, rho)
    rx = tilt2 * _ramp_step(m1 + s12, m2 + s2 * s2, s1, s2, rho)
    xx = np.exp(m1 + m2 + 0.5 * (s1 * s1 + 2.0 * s12 + s2 * s2)) * _step_pair(
        m1 + s1 * s1 + s12, m2 + s2 * s2 + s12, s1, s2, rho
    )
    a = alpha
    return rr + a * (rx - rs + xr - sr) + a * a * (xx - xs - sx + ss)


def _basis_mean(m, s, alpha):
    """E[E(y)], y ~ N(m, s^2): E[y_+] + alpha (E[e^y 1{y < 0}] - P(y < 0))."""
    r = m * ndtr(m / s) + s * np.exp(-0.5 * (m / s) ** 2) / _SQRT_2PI
    x = np.exp(m + 0.5 * s * s) * ndtr(-(m + s * s) / s)
    return r + alpha * (x - ndtr(-m / s))


def _basis_second(m, s, alpha):
    """E[E(y)^2]: R X = R S = 0, X S = X and S^2 = S leave E[y_+^2] + alpha^2 (E[X^2] - 2 E[X] + E[S]),
    E[y_+^2] = (m^2 + s^2) Phi(m / s) + m s phi(m / s), E[X^2] = e^{2 m + 2 s^2} Phi(-(m + 2 s^2) / s)."""
    r2 = (m * m + s * s) * ndtr(m / s) + m * s * np.exp(-0.5 * (m / s) ** 2) / _SQRT_2PI
    x = np.exp(m + 0.5 * s * s) * ndtr(-(m + s * s) / s)
    x2 = np.exp(2.0 * m + 2.0 * s * s) * ndtr(-(m + 2.0 * s * s) / s)
    return r2 + alpha * alpha * (x2 - 2.0 * x + ndtr(-m / s))


# Within _EDGE of |c| = 1 the closed forms lose digits to cancellation (about 1e-11 at 1 - |c| = 1e-11,
# 2e-12 at 1e-9): there the kernel is extrapolated linearly in c from c = +-(1 - _EDGE) and a point
# _STEP further in (the curvature of a kinked phi's kernel, O((1 - |c|)^(-1/2)), leaves about 1e-12).
_EDGE = 1e-9
_STEP = 1e-6


def elu_family_kernel(k: np.ndarray, fam: ExponentialLinear) -> np.ndarray:
    """E[phi(u) phi(v)] over the token kernel ``k`` (symmetric) in closed form (module docstring)."""
    sigma = np.sqrt(np.diag(k))
    _, rho = token_correlations(k)
    t = len(sigma)
    live = sigma > 0.0
    # y = a (u - x0): mean -a x0, standard deviation |a| sigma, the correlations of u
    m = -fam.slope * fam.kink
    s = abs(fam.slope) * np.where(live, sigma, 1.0)
    mean = _basis_mean(m, s, fam.alpha)
    rows, cols = np.triu_indices(t, 1)
    closed = live[rows] & live[cols]
    i, j, r = rows[closed], cols[closed], rho[rows[closed], cols[closed]]

    def value(c, a, b):
        pairs = _basis_products(m, m, s[a], s[b], c, fam.alpha)
        return fam.offset**2 + fam.offset * fam.scale * (mean[a] + mean[b]) + fam.scale**2 * pairs

    near = np.clip(r, -1.0 + _EDGE, 1.0 - _EDGE)
    values = value(near, i, j)
    edge = np.nonzero(near != r)[0]
    if len(edge):
        inward = near[edge] - np.sign(near[edge]) * _STEP
        slope = (values[edge] - value(inward, i[edge], j[edge])) / (near[edge] - inward)
        values[edge] += slope * (r[edge] - near[edge])
    # a constant token (K_ii = 0) is phi(0) times the other's mean, P + Q E[E(y)] (phi(0) for another)
    f0 = float(fam(0.0))
    token_mean = np.where(live, fam.offset + fam.scale * mean, f0)
    out = np.outer(f0 * np.ones(t), token_mean)
    out = np.where(live[:, None], out.T, out)
    upper = np.zeros((t, t))
    upper[i, j] = values
    out = np.where(np.outer(live, live), upper + upper.T, out)
    second = fam.offset**2 + 2.0 * fam.offset * fam.scale * mean + fam.scale**2 * _basis_second(m, s, fam.alpha)
    np.fill_diagonal(out, np.where(live, second, f0 * f0))
    return out
