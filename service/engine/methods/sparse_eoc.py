"""Edge of Chaos for the sparsifying activations ReLU_tau, ST_tau, CReLU_{tau,m} and CST_{tau,m}
(Price et al., "Deep neural network initialization with sparsity inducing activations").

Every quantity here is a closed form in the standard normal CDF ``Phi`` (``ndtr``, i.e. erf) and
density ``gamma``: no quadrature and no numerical differentiation (finite differences of the kinked
quadratures are off by up to 0.1 in V''). With ``a = tau / sqrt(q)`` and ``b = (tau + m) / sqrt(q)``,
the one-sided ("half") moments of CReLU_{tau,m}, ``F(q) = E[CReLU(sqrt(q) z)^2]`` (equations 44-46),
are

    F(q)   = (q + tau^2) (Phi(b) - Phi(a)) - sqrt(q) (tau gamma(a) + (m - tau) gamma(b))
             + m^2 (1 - Phi(b))                                                  (44)-(46)
    F'(q)  = Phi(b) - Phi(a) - (m / sqrt(q)) gamma(b)                            (50), (13)
    F''(q) = (a gamma(a) - b gamma(b)) / (2 q) - m gamma(b) (b^2 - 1) / (2 q^{3/2})
    E[CReLU'(sqrt(q) z)^2] = Phi(b) - Phi(a)                                     (51), (15)

and ReLU_tau is the limit m -> infinity (b -> infinity): F = (q + tau^2) Phi(-a) - sqrt(q) tau
gamma(a) (37), F' = Phi(-a) (38), F'' = a gamma(a) / (2 q) (40). The soft thresholds are odd, so
their moments are twice the one-sided ones (equations 41, 43, 53, 54):

    V(q)  = sigma_w^2 c F(q) + sigma_b^2,   V'(q) = sigma_w^2 c F'(q),   V''(q) = sigma_w^2 c F''(q),
    chi_1 = sigma_w^2 c E[CReLU'^2]          (c = 1 for relu_tau / crelu, 2 for soft_threshold / cst).

F'' is not written out in the paper for the clipped kinds; it follows from F' by the chain rule
(``da/dq = -a / (2q)``, ``db/dq = -b / (2q)``, ``gamma'(x) = -x gamma(x)``) and reduces to equation
(40) as m -> infinity. The tests check F against ``scipy.integrate.quad`` split at the kinks and F',
F'' against finite differences of the (smooth) closed-form V.

Two misprints of the paper, which do not matter at q* = 1 (all its tables): equations (13) and (17)
write ``m / (sqrt(2 pi) q)`` where the derivation (50), (52) gives ``m / sqrt(2 pi q)``; and (14)
reads ``V'_CST = 2 V'_CST`` for ``V'_CST = 2 V'_CReLU``. The code follows (50)-(55).

On the EOC (chi_1 = 1, so sigma_w^2 = 1 / (c (Phi(b) - Phi(a))), equations 59-62) the slope and
curvature at q* do not depend on c:

    V'(q*)  = 1 - (m / sqrt(q*)) gamma(b) / (Phi(b) - Phi(a))                   (17), (18)
    V''(q*) = F''(q*) / (Phi(b) - Phi(a)),

which is why CST at sparsity s has the same m, V' and V'' as CReLU at sparsity (1 + s) / 2
(Table 2: CST s = 0.6 and CReLU s = 0.8 share tau = 0.84). The unclipped kinds have V'(q*) = 1 and
V''(q*) > 0 for tau > 0: q* is stable only from the left (Section 2), the paper's first failure mode.
``q* V''(q*)``, ``m / sqrt(q*)`` and ``tau / sqrt(q*)`` are scale-free: all the tables are at q* = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import brentq
from scipy.special import ndtr, ndtri

from ...errors import SigpropError
from ...schemas.activations import CLIPPED_SPARSE_ACTIVATIONS, UNCLIPPED_SPARSE_ACTIVATIONS

# argument checks; _SIDES: one-sided (ReLU-like) kinds versus the odd (soft-threshold) ones,
# the c in V = sigma_w^2 c F + sigma_b^2
from .sparse_eoc_checks import _SIDES, _kind, _number, _out, _params, _q_array, _q_star, _sigmas, _sparsity

__all__ = [
    "SPARSE_KINDS",
    "CLIPPED_KINDS",
    "UNCLIPPED_KINDS",
    "CURVATURE_WARNING_THRESHOLD",
    "SparseEOCSolution",
    "threshold_for_sparsity",
    "expected_sparsity",
    "variance_map",
    "variance_slope",
    "variance_curvature",
    "chi_1",
    "sigma_w2_for_eoc",
    "sigma_b2_for_fixed_point",
    "eoc_v_slope",
    "v_slope_range",
    "clip_for_v_slope",
    "fixed_points",
    "jacobian_spectrum_variance",
    "solve_sparse_eoc",
]

UNCLIPPED_KINDS: tuple[str, ...] = UNCLIPPED_SPARSE_ACTIVATIONS
CLIPPED_KINDS: tuple[str, ...] = CLIPPED_SPARSE_ACTIVATIONS
SPARSE_KINDS: tuple[str, ...] = UNCLIPPED_KINDS + CLIPPED_KINDS


# Curvature at which a clipped EOC initialization is flagged as practically unstable, on the
# scale-free q* V''(q*) (= V''(q*) at the paper's q* = 1). In Table 2 (100-layer, width-300 DNNs on
# MNIST) every configuration with V''(q*) >= 0.41 failed to train in at least 4 of 5 runs from
# exploding gradients (CReLU s = 0.85, V' = 0.9, V'' = 0.41: accuracy 0.28 +- 0.37; CST s = 0.7,
# 0.8, 0.85 at V' = 0.9 with V'' = 0.41, 0.69, 0.89), while every configuration with V'' <= 0.39
# trained to full accuracy apart from the separate low-m "second failure mode" of Appendix G (CST
# s = 0.85, V' = 0.7, V'' = 0.39: 0.93 +- 0.01). The paper explains the failures by the variance map
# curving up after crossing the diagonal and following it over an extended interval, so that
# finite-width fluctuations of q^l drift to q > q* where the effective chi_1 > 1 (Section 3.1,
# Figure 4a). 0.4 separates the two groups. The CNN columns only lost accuracy from V'' >= 0.69
# (CST at s = 0.8 and 0.85), and the 30-layer DNNs of Table 5 tolerated up to 0.63 (CST s = 0.9,
# V' = 0.7): shallower networks accumulate fewer fluctuations, so 0.4 is the conservative,
# deep-network choice; pass a larger ``curvature_warning`` to solve_sparse_eoc for shallow ones.
CURVATURE_WARNING_THRESHOLD = 0.4

# Bracket of m / sqrt(q*) for clip_for_v_slope. V'(q*) increases monotonically in m from 0 (m -> 0)
# to 1 (m -> infinity) (Section 3.1, Figure 3); at m = 12 sqrt(q*) it is 1 to double precision.
_M_BRACKET = (1e-4, 12.0)

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_EXP_CUTOFF = 700.0

# fixed-point search (fixed_points)
_FP_GRID = 4001
_FP_MERGE_RTOL = 1e-7
_FP_TANGENT_TOL = 1e-10
_STABLE_MARGIN = 1e-9


# --------------------------------------------------------------------------- closed forms


def _gauss(x: np.ndarray) -> np.ndarray:
    """Standard normal density, exactly 0 where it would underflow."""
    h = 0.5 * x * x
    return np.where(h > _EXP_CUTOFF, 0.0, _INV_SQRT_2PI * np.exp(-np.minimum(h, _EXP_CUTOFF)))


def _half(q: np.ndarray, tau: float, m: float | None):
    """One-sided moments of CReLU_{tau,m} (ReLU_tau for m = None) at variance q.

    Returns (P, F, F', F''): P = E[phi'(sqrt(q) z)^2] = Phi(b) - Phi(a), F = E[phi(sqrt(q) z)^2]
    and its first two q-derivatives (module docstring; equations 37, 38, 40, 44-51).
    """
    sq = np.sqrt(q)
    a = tau / sq
    ga = _gauss(a)
    if m is None:
        p = ndtr(-a)
        f = (q + tau * tau) * p - sq * tau * ga
        f1 = p
        f2 = a * ga / (2.0 * q)
        return p, f, f1, f2
    b = (tau + m) / sq
    gb = _gauss(b)
    # Phi(b) - Phi(a) from the upper tails: no cancellation for a, b >= 0 far out
    p = ndtr(-a) - ndtr(-b)
    f = (q + tau * tau) * p - sq * (tau * ga + (m - tau) * gb) + m * m * ndtr(-b)
    f1 = p - (m / sq) * gb
    f2 = (a * ga - b * gb) / (2.0 * q) - m * gb * (b * b - 1.0) / (2.0 * q * sq)
    return p, f, f1, f2


def threshold_for_sparsity(kind: str, s: float, q_star: float = 1.0) -> float:
    """The smallest tau giving expected sparsity P(phi(Z) = 0) = s for Z ~ N(0, q*).

    ``relu_tau`` / ``crelu``: tau = sqrt(q*) Phi^-1(s) (equation 57), needs s >= 0.5 for tau >= 0;
    ``soft_threshold`` / ``cst``: tau = sqrt(q*) Phi^-1((1 + s) / 2) = sqrt(2 q*) erf^-1(s)
    (equation 58). Clipping does not change the zero set, so the clipped kinds share their
    parents' tau.
    """
    k = _kind(kind)
    v = _sparsity(k, s)
    q = _q_star(q_star)
    p = v if _SIDES[k] == 1 else 0.5 * (1.0 + v)
    return float(math.sqrt(q) * ndtri(p))


def expected_sparsity(kind: str, tau: float, q: float = 1.0) -> float:
    """P(phi(Z) = 0) for Z ~ N(0, q) (equations 12, 56): Phi(tau / sqrt q), or 2 Phi(tau / sqrt q) - 1."""
    k = _kind(kind)
    t = _number("tau", tau)
    if t < 0:
        raise SigpropError(
            "invalid_request", f"threshold tau must be >= 0, got {tau!r}", "tau is the sparsifying threshold"
        )
    qq = float(_q_array(q))
    a = t / math.sqrt(qq)
    return float(ndtr(a)) if _SIDES[k] == 1 else float(ndtr(a) - ndtr(-a))


def variance_map(kind: str, q, tau: float, m: float | None, sigma_w2: float, sigma_b2: float):
    """V(q) = sigma_w^2 E[phi(sqrt(q) z)^2] + sigma_b^2 in closed form (equations 3, 37, 41, 44, 53).

    ``q`` a number (answer a float) or an array (answer an array); ``m`` None for the unclipped kinds.
    """
    k = _kind(kind)
    t, mm = _params(k, tau, m)
    w, b = _sigmas(sigma_w2, sigma_b2)
    qa = _q_array(q)
    _, f, _, _ = _half(qa, t, mm)
    return _out(w * _SIDES[k] * f + b, qa)


def variance_slope(kind: str, q, tau: float, m: float | None, sigma_w2: float, sigma_b2: float = 0.0):
    """V'(q) in closed form: sigma_w^2 Phi(-tau / sqrt q) for ReLU_tau (38), twice that for ST_tau
    (43), sigma_w^2 (Phi(b) - Phi(a) - (m / sqrt q) gamma(b)) for CReLU (13, 50), twice that for CST
    (14, 53). ``sigma_b2`` does not enter; it is accepted for a uniform signature."""
    k = _kind(kind)
    t, mm = _params(k, tau, m)
    w, _ = _sigmas(sigma_w2, sigma_b2)
    qa = _q_array(q)
    _, _, f1, _ = _half(qa, t, mm)
    return _out(w * _SIDES[k] * f1, qa)


def variance_curvature(kind: str, q, tau: float, m: float | None, sigma_w2: float, sigma_b2: float = 0.0):
    """V''(q) in closed form: sigma_w^2 tau gamma(tau / sqrt q) / (2 q^{3/2}) for ReLU_tau (40),
    twice that for ST_tau (43); for CReLU the derivative of (50),
    sigma_w^2 [(a gamma(a) - b gamma(b)) / (2q) - m gamma(b) (b^2 - 1) / (2 q^{3/2})], twice that for
    CST. ``sigma_b2`` does not enter."""
    k = _kind(kind)
    t, mm = _params(k, tau, m)
    w, _ = _sigmas(sigma_w2, sigma_b2)
    qa = _q_array(q)
    _, _, _, f2 = _half(qa, t, mm)
    return _out(w * _SIDES[k] * f2, qa)


def chi_1(kind: str, q, tau: float, m: float | None, sigma_w2: float):
    """chi_1 = sigma_w^2 E[phi'(sqrt(q) z)^2] (equation 11) at variance q: sigma_w^2 Phi(-tau/sqrt q)
    for ReLU_tau (39), twice for ST_tau (42), sigma_w^2 (Phi(b) - Phi(a)) for CReLU (15, 51), twice
    for CST (16, 54)."""
    k = _kind(kind)
    t, mm = _params(k, tau, m)
    w, _ = _sigmas(sigma_w2)
    qa = _q_array(q)
    p, _, _, _ = _half(qa, t, mm)
    return _out(w * _SIDES[k] * p, qa)


def sigma_w2_for_eoc(kind: str, tau: float, m: float | None = None, q_star: float = 1.0) -> float:
    """sigma_w^2 with chi_1(q*) = 1: 1 / (c (Phi(b) - Phi(a))).

    Equals 1 / (1 - s) for the unclipped kinds at tau = tau_hat(s) (equations 59, 60) and
    2 / (erf((m + tau) / sqrt(2 q*)) - erf(tau / sqrt(2 q*))) for CReLU (61), without the 2 for CST
    (62).
    """
    k = _kind(kind)
    t, mm = _params(k, tau, m)
    q = _q_star(q_star)
    p, _, _, _ = _half(np.float64(q), t, mm)
    d = _SIDES[k] * float(p)
    if not d > 0.0:
        raise SigpropError(
            "unreachable_target",
            f"{k!r} with tau = {t:g} has zero derivative almost everywhere at q* = {q:g}",
            "lower tau (sparsity) or raise q_star / m",
        )
    return 1.0 / d


def sigma_b2_for_fixed_point(kind: str, tau: float, m: float | None, sigma_w2: float, q_star: float = 1.0) -> float:
    """sigma_b^2 = q* - sigma_w^2 E[phi(sqrt(q*) z)^2], i.e. V(q*) = q* (Appendix A, step iii).

    Zero is allowed; a negative value raises ``unreachable_target`` (no bias variance puts the fixed
    point at q*).
    """
    k = _kind(kind)
    t, mm = _params(k, tau, m)
    w, _ = _sigmas(sigma_w2)
    q = _q_star(q_star)
    _, f, _, _ = _half(np.float64(q), t, mm)
    sb = q - w * _SIDES[k] * float(f)
    if sb < -1e-12 * max(1.0, q):
        raise SigpropError(
            "unreachable_target",
            f"V(q*) = q* = {q:g} for {k!r} (tau = {t:g}, m = {mm}) with sigma_w^2 = {w:g} needs "
            f"sigma_b^2 = {sb:.6g} < 0",
            "sigma_w^2 E[phi^2] already exceeds q*: lower sigma_w^2, or raise m / lower tau",
        )
    return max(sb, 0.0)


def eoc_v_slope(kind: str, tau: float, m: float, q_star: float = 1.0) -> float:
    """V'(q*) on the EOC (chi_1 = 1) of a clipped kind: 1 - (m / sqrt q*) gamma(b) / (Phi(b) - Phi(a))
    (equations 17, 18 with chi_1 = 1); the same for crelu and cst."""
    k = _kind(kind)
    if k not in CLIPPED_KINDS:
        raise SigpropError(
            "invalid_target", f"{k!r} has V'(q*) = 1 on the EOC", "only crelu and cst have an adjustable V'(q*)"
        )
    t, mm = _params(k, tau, m)
    q = _q_star(q_star)
    p, _, f1, _ = _half(np.float64(q), t, mm)
    if not p > 0.0:
        raise SigpropError(
            "unreachable_target", f"{k!r} with tau = {t:g}, m = {mm:g} has no EOC at q* = {q:g}", "lower tau or raise m"
        )
    return float(f1 / p)


def _m_bracket(q: float) -> tuple[float, float]:
    sq = math.sqrt(q)
    return _M_BRACKET[0] * sq, _M_BRACKET[1] * sq


def v_slope_range(kind: str, s: float, q_star: float = 1.0) -> tuple[float, float]:
    """The V'(q*) that clip_for_v_slope reaches at sparsity s: its values at the ends of the m bracket
    [1e-4, 12] sqrt(q*) (V'(q*) increases with m from 0 to 1; Section 3.1, Figure 3)."""
    k = _kind(kind)
    tau = threshold_for_sparsity(k, s, q_star)
    lo, hi = _m_bracket(_q_star(q_star))
    return eoc_v_slope(k, tau, lo, q_star), eoc_v_slope(k, tau, hi, q_star)


def clip_for_v_slope(kind: str, s: float, v_slope: float, q_star: float = 1.0) -> float:
    """The clip level m with V'(q*) = v_slope on the EOC at sparsity s (Section 3.1, Table 2).

    Brent's method on m in [1e-4, 12] sqrt(q*), where V'(q*) rises monotonically from about
    5e-5 tau / sqrt(q*) (3e-9 at tau = 0) to 1. v_slope outside (0, 1), or an unclipped kind, is ``invalid_target``;
    inside (0, 1) but beyond the bracket's range, ``unreachable_target`` with the range in the hint.
    """
    k = _kind(kind)
    if k not in CLIPPED_KINDS:
        raise SigpropError(
            "invalid_target", f"{k!r} is not clipped: its V'(q*) is 1 on the EOC", "a V'(q*) target needs crelu or cst"
        )
    v = _number("v_slope", v_slope, code="invalid_target")
    if not 0.0 < v < 1.0:
        raise SigpropError(
            "invalid_target",
            f"v_slope = V'(q*) must lie in (0, 1), got {v_slope!r}",
            "the clipped kinds have 0 < V'(q*) < 1 on the EOC (eqs. 17, 18); the paper uses 0.5, 0.7 and 0.9",
        )
    tau = threshold_for_sparsity(k, s, q_star)
    q = _q_star(q_star)
    lo, hi = _m_bracket(q)
    v_lo, v_hi = eoc_v_slope(k, tau, lo, q), eoc_v_slope(k, tau, hi, q)
    if not v_lo <= v <= v_hi:
        raise SigpropError(
            "unreachable_target",
            f"V'(q*) = {v:g} is out of reach for {k!r} at sparsity {float(s):g}",
            f"at sparsity {float(s):g} the reachable V'(q*) is [{v_lo:.6g}, {v_hi:.17g}] (m in [{lo:.3g}, {hi:.3g}])",
        )
    if v == v_lo:
        return lo
    if v == v_hi:
        return hi
    return float(
        brentq(
            lambda mm: eoc_v_slope(k, tau, mm, q) - v,
            lo,
            hi,
            xtol=1e-14 * math.sqrt(q),
            rtol=4 * np.finfo(float).eps,
            maxiter=200,
        )
    )


# --------------------------------------------------------------------------- fixed points


def fixed_points(
    kind: str,
    tau: float,
    m: float | None,
    sigma_w2: float,
    sigma_b2: float,
    q_star: float = 1.0,
    q_max_factor: float = 50.0,
) -> list[tuple[float, bool]]:
    """All fixed points V(q) = q on (0, q_max_factor q*], ascending, each with its local stability
    |V'(q)| < 1 (strictly: |V'| >= 1 - 1e-9 counts as unstable, so tangent points are unstable).

    Crossings are the sign changes of V(q) - q on a 4001-point log grid (from sigma_b^2, below which
    V(q) >= sigma_b^2 > q, or from 1e-8 q* when sigma_b^2 = 0), refined by brentq. Tangencies, where
    V - q touches 0 without changing sign (the unclipped kinds on the EOC: V'(q*) = 1, V'' > 0), are
    the zeros of V'(q) - 1 with |V(q) - q| <= 1e-10 q, plus q* itself when it is such a point.
    Roots closer than 1e-7 relative are merged. When sigma_b^2 = 0, q = 0 is a fixed point too
    (excluded). An affine map with V(q) = q identically (ReLU_tau or ST_tau at tau = 0 on the EOC
    with sigma_b^2 = 0: every q is fixed, footnote 2) answers [(q_star, False)] (marginal, V' = 1).
    """
    k = _kind(kind)
    t, mm = _params(k, tau, m)
    w, b = _sigmas(sigma_w2, sigma_b2)
    qs = _q_star(q_star)
    qmf = _number("q_max_factor", q_max_factor)
    if qmf <= 0:
        raise SigpropError(
            "invalid_request",
            f"q_max_factor must be > 0, got {q_max_factor!r}",
            "the search covers (0, q_max_factor q*]; the default is 50",
        )
    c = _SIDES[k]
    q_hi = qmf * qs

    def f(q):
        return w * c * _half(np.asarray(q, dtype=np.float64), t, mm)[1] + b - q

    def slope(q):
        return w * c * _half(np.asarray(q, dtype=np.float64), t, mm)[2]

    if mm is None and t == 0.0:
        # V(q) = (sigma_w^2 c / 2) q + sigma_b^2 exactly
        a = 0.5 * w * c
        if abs(a - 1.0) <= 1e-12 and b == 0.0:
            return [(qs, False)]

    q_lo = b if b > 0.0 else 1e-8 * qs
    if q_lo >= q_hi:
        return []
    grid = np.unique(np.concatenate([np.geomspace(q_lo, q_hi, _FP_GRID), [qs] if q_lo < qs < q_hi else []]))
    fv = f(grid)
    roots: list[float] = [float(x) for x in grid[fv == 0.0]]
    sgn = np.sign(fv)
    for i in np.nonzero(sgn[:-1] * sgn[1:] < 0)[0]:
        roots.append(float(brentq(f, grid[i], grid[i + 1], xtol=1e-15 * grid[i], maxiter=200)))
    # tangencies
    dv = slope(grid) - 1.0
    cands = [qs] if q_lo <= qs <= q_hi else []
    ds = np.sign(dv)
    for i in np.nonzero(ds[:-1] * ds[1:] < 0)[0]:
        cands.append(
            float(brentq(lambda x: float(slope(x)) - 1.0, grid[i], grid[i + 1], xtol=1e-15 * grid[i], maxiter=200))
        )
    for qc in cands:
        if abs(float(f(qc))) <= _FP_TANGENT_TOL * max(qc, qs):
            roots.append(qc)
    roots.sort()
    merged: list[float] = []
    for r in roots:
        if merged and abs(r - merged[-1]) <= _FP_MERGE_RTOL * max(r, merged[-1]):
            # keep the better of the two
            if abs(float(f(r))) < abs(float(f(merged[-1]))):
                merged[-1] = r
            continue
        merged.append(r)
    return [(r, bool(abs(float(slope(r))) < 1.0 - _STABLE_MARGIN)) for r in merged]


# --------------------------------------------------------------------------- Jacobian spectrum


def jacobian_spectrum_variance(sigma_w2: float, depth: int, orthogonal: bool) -> float:
    """Variance of the spectrum of J J^T at chi_1 = 1, L (sigma_w^2 - 1 - s_1) (equation 30, Table 3).

    For the four sparsifying kinds phi' takes only the values 0 and 1, so mu_k = mu for all k and
    mu_1 / mu_2^2 = 1 / mu = sigma_w^2. s_1 (first moment of the S-transform of W W^T) is -1 for
    Gaussian and 0 for orthogonal weights: L sigma_w^2 and L (sigma_w^2 - 1), i.e. L / (1 - s) and
    L s / (1 - s) for the unclipped kinds (Appendix A).
    """
    w = _number("sigma_w2", sigma_w2)
    if w <= 0:
        raise SigpropError(
            "invalid_request",
            f"sigma_w2 must be > 0, got {sigma_w2!r}",
            "sigma_w^2 is the weight variance times fan_in",
        )
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 1:
        raise SigpropError(
            "invalid_request", f"depth must be a positive integer, got {depth!r}", "depth is the number of layers L"
        )
    s1 = 0.0 if orthogonal else -1.0
    return float(int(depth) * (w - 1.0 - s1))


# --------------------------------------------------------------------------- the solver


@dataclass(frozen=True)
class SparseEOCSolution:
    kind: str
    sparsity: float
    tau: float
    m: float | None  # None for the unclipped kinds
    sigma_w2: float
    sigma_b2: float
    q_star: float
    v_slope: float  # V'(q*), recomputed from the solved parameters
    v_curvature: float  # V''(q*)
    chi_1: float  # recomputed; 1 up to rounding
    fixed_points: list[tuple[float, bool]] = field(default_factory=list)
    only_stable: bool = False  # q* is the only stable fixed point on (0, 50 q*]
    warnings: list[str] = field(default_factory=list)


def solve_sparse_eoc(
    kind: str,
    sparsity: float,
    v_slope: float | None = None,
    q_star: float = 1.0,
    *,
    curvature_warning: float = CURVATURE_WARNING_THRESHOLD,
) -> SparseEOCSolution:
    """EOC initialization of a sparsifying activation at expected sparsity ``sparsity``.

    tau from equations 57 / 58; for crelu / cst, m from V'(q*) = v_slope (clip_for_v_slope);
    sigma_w^2 from chi_1 = 1 (59-62); sigma_b^2 from V(q*) = q* (Appendix A). ``v_slope`` is
    required for the clipped kinds (in (0, 1)) and forbidden for the unclipped ones, whose V'(q*)
    is 1 (``invalid_target`` otherwise).

    Warnings: the unclipped kinds always (q* is unstable from the right when tau > 0, V'' > 0:
    the first failure mode of Section 2; marginal at tau = 0); the clipped kinds when
    q* V''(q*) >= ``curvature_warning`` (see CURVATURE_WARNING_THRESHOLD) or when q* is not the only
    stable fixed point (Figure 4b).
    """
    k = _kind(kind)
    s = _sparsity(k, sparsity)
    q = _q_star(q_star)
    cw = _number("curvature_warning", curvature_warning)
    _check_v_slope(k, v_slope)

    tau = threshold_for_sparsity(k, s, q)
    m = clip_for_v_slope(k, s, v_slope, q) if k in CLIPPED_KINDS else None
    w = sigma_w2_for_eoc(k, tau, m, q)
    b = sigma_b2_for_fixed_point(k, tau, m, w, q)
    vs = variance_slope(k, q, tau, m, w, b)
    vc = variance_curvature(k, q, tau, m, w, b)
    c1 = chi_1(k, q, tau, m, w)
    fps = fixed_points(k, tau, m, w, b, q)
    stable = [r for r, st in fps if st]
    only = len(stable) == 1 and abs(stable[0] - q) <= 1e-6 * q

    warns = _warnings(k, q, tau, vc, cw, fps, only)

    return SparseEOCSolution(
        kind=k,
        sparsity=s,
        tau=tau,
        m=m,
        sigma_w2=w,
        sigma_b2=b,
        q_star=q,
        v_slope=float(vs),
        v_curvature=float(vc),
        chi_1=float(c1),
        fixed_points=fps,
        only_stable=only,
        warnings=warns,
    )


def _check_v_slope(k: str, v_slope: float | None) -> None:
    """A v_slope target is required for the clipped kinds and refused for the unclipped ones."""
    if k in CLIPPED_KINDS:
        if v_slope is None:
            raise SigpropError(
                "invalid_target",
                f"{k!r} needs a v_slope target V'(q*) in (0, 1)",
                "the clip level m is chosen from V'(q*); the paper uses 0.5, 0.7, 0.9",
            )
    elif v_slope is not None:
        raise SigpropError(
            "invalid_target",
            f"{k!r} takes no v_slope: its V'(q*) is 1 on the EOC (eqs. 39, 43)",
            f"drop v_slope, or use {'crelu' if k == 'relu_tau' else 'cst'} to choose V'(q*) < 1",
        )


def _warnings(k: str, q: float, tau: float, vc: float, cw: float, fps, only: bool) -> list[str]:
    """The failure modes the solution is exposed to (see :func:`solve_sparse_eoc`)."""
    warns: list[str] = []
    if k in UNCLIPPED_KINDS:
        if tau > 0.0:
            warns.append(
                f"unstable variance fixed point: on the EOC {k} has V'(q*) = chi_1 = 1 and "
                f"V''(q*) = {vc:.3g} > 0, so q* is stable only from the left; finite-width "
                "fluctuations push q^l above q*, from where it grows exponentially with depth "
                "(Price et al. section 2, the first failure mode). Use "
                f"{'crelu' if k == 'relu_tau' else 'cst'} with v_slope < 1."
            )
        else:
            warns.append(
                f"marginal variance map: at tau = 0 {k} on the EOC has V(q) = q for every q "
                "(V'(q*) = 1, V'' = 0), so nothing pulls q^l back to q* and finite-width "
                "fluctuations accumulate with depth (Price et al. footnote 2)."
            )
    else:
        if q * vc >= cw:
            warns.append(
                f"large variance-map curvature: q* V''(q*) = {q * vc:.3g} >= {cw:g}. V(q) follows "
                "the diagonal over an extended interval above q*, so finite-width fluctuations of "
                "q^l drift to q > q* where the effective chi_1 > 1 (exploding gradients; Price et al. "
                "section 3.1, Figure 4a, Table 2). Choose a smaller v_slope."
            )
        if not only:
            others = ", ".join(
                f"q = {r:.4g} ({'stable' if st else 'unstable'})" for r, st in fps if abs(r - q) > 1e-6 * q
            )
            warns.append(
                f"q* = {q:g} is not the only stable fixed point of V on (0, {50 * q:g}]: other "
                f"fixed points at {others}; q^l can be captured by a larger one, where chi_1 > 1 "
                "(Price et al. figure 4b). Choose a smaller v_slope."
            )
    return warns
