"""Moments of a pair of correlated Gaussians, in closed form: the orthant probability and the
product of two ramps, vectorized over arrays of (h, k, rho); and a token kernel's correlations.

The token-kernel maps of piecewise-linear and exponential-linear activations (``token_activation``,
``token_exponential``) reduce every expectation to these.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtr, owens_t

__all__ = ["orthant", "ramp_pair", "normal_pdf", "token_correlations"]

_SQRT_2PI = math.sqrt(2.0 * math.pi)


def token_correlations(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sqrt(K_ii K_jj), c_ij clipped to [-1, 1]; 0 where a token is 0)."""
    roots = np.sqrt(np.diag(k))
    norm = np.outer(roots, roots)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(norm > 0.0, k / np.where(norm > 0.0, norm, 1.0), 0.0)
    np.fill_diagonal(c, np.where(roots > 0.0, 1.0, 0.0))  # exactly (K_ii / (sqrt K_ii)^2 can round below 1)
    return norm, np.clip(c, -1.0, 1.0)


def orthant(h: np.ndarray, k: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """P(X > h, Y > k) for standard normals of correlation rho in (-1, 1): Phi_2(-h, -k; rho) by
    Owen's T function (Owen 1956, "Tables for computing bivariate normal probabilities", eq. 2.1):
    Phi_2(a, b; rho) = (Phi(a) + Phi(b)) / 2 - T(a, (b - rho a) / (a s)) - T(b, (a - rho b) / (b s))
    - beta, s = sqrt(1 - rho^2), beta = 1/2 where a b < 0 or a b = 0 > a + b, else 0."""
    a, b = -h, -k
    s = np.sqrt(1.0 - rho * rho)

    def slope(x, y):  # (y - rho x) / (x s), +-inf where x = 0 (T's limit is then right)
        num = y - rho * x
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(x != 0.0, num / np.where(x != 0.0, x * s, 1.0), np.copysign(np.inf, num))

    both_zero = (a == 0.0) & (b == 0.0)
    out = 0.5 * (ndtr(a) + ndtr(b)) - owens_t(a, slope(a, b)) - owens_t(b, slope(b, a))
    out -= np.where((a * b < 0.0) | ((a * b == 0.0) & (a + b < 0.0)), 0.5, 0.0)
    # a = b = 0: Sheppard's 1/4 + arcsin(rho) / (2 pi) (both slopes above are then undefined)
    return np.where(both_zero, 0.25 + np.arcsin(rho) / (2.0 * math.pi), out)


def normal_pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / _SQRT_2PI


def ramp_pair(h: np.ndarray, k: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """E[(X - h)_+ (Y - k)_+] for standard normals of correlation rho: E[(X - h)(Y - k); A] over
    A = {X > h, Y > k} from the truncated moments of Rosenbaum ("Moments of a truncated bivariate
    normal distribution", 1961): with s = sqrt(1 - rho^2), P = P(A),
    E[X; A] = phi(h) Q((k - rho h) / s) + rho phi(k) Q((h - rho k) / s) (and Y's by symmetry),
    E[XY; A] = rho P + rho h phi(h) Q((k - rho h) / s) + rho k phi(k) Q((h - rho k) / s)
               + s phi(h) phi((k - rho h) / s), Q = 1 - Phi.
    rho = +-1 (equal or opposite tokens) by the one-dimensional limits."""
    rho = np.clip(rho, -1.0, 1.0)
    # the general formula loses about 1e-16 (1 - |rho|)^(-3/4) to cancellation (1e-11 at 1 - |rho| =
    # 1e-12); within _EDGE of +-1 the first order in rho about the limit is closer by far:
    # dF/drho = P(X > h, Y > k) (Price's theorem), the rest O((1 - |rho|)^(3/2))
    inner = np.abs(rho) < 1.0 - _EDGE
    r = np.where(inner, rho, 0.0)
    s = np.sqrt(1.0 - r * r)
    qh = ndtr(-(k - r * h) / s)  # Q((k - rho h) / s)
    qk = ndtr(-(h - r * k) / s)
    ph, pk = normal_pdf(h), normal_pdf(k)
    p = orthant(h, k, r)
    ex = ph * qh + r * pk * qk
    ey = pk * qk + r * ph * qh
    exy = r * p + r * h * ph * qh + r * k * pk * qk + s * ph * normal_pdf((k - r * h) / s)
    general = exy - k * ex - h * ey + h * k * p
    # rho = 1: E[(X - h)(X - k); X > m], m = max(h, k); rho = -1: E[(X - h)(-X - k); h < X < -k]
    m = np.maximum(h, k)
    same = (m * normal_pdf(m) + ndtr(-m)) - (h + k) * normal_pdf(m) + h * k * ndtr(-m)
    lo, hi = h, np.maximum(-k, h)
    second = (ndtr(hi) - hi * normal_pdf(hi)) - (ndtr(lo) - lo * normal_pdf(lo))  # E[X^2; lo < X < hi]
    first = normal_pdf(lo) - normal_pdf(hi)
    opposite = -second + (h - k) * first + h * k * (ndtr(hi) - ndtr(lo))
    same = same - (1.0 - rho) * ndtr(-m)
    opposite = opposite + (1.0 + rho) * np.maximum(ndtr(-k) - ndtr(h), 0.0)
    return np.where(inner, general, np.where(rho > 0.0, same, opposite))


_EDGE = 1e-11
