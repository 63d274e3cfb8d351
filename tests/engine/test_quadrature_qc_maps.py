"""Gaussian quadrature, local Q/C map statistics and the EOC closed forms, checked against
independent computations: scipy.integrate.quad of the defining expectations (TAT paper
equations 4, 5, 15-19), the arc-cosine kernel closed form of ReLU networks, and finite
differences of the variance map.

Reference derivatives below are written out independently of ``sigprop.engine.maps.activations``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import integrate
from scipy.special import erf, expit, ndtr

from sigprop.engine.maps.activations import get_activation, transformed
from sigprop.engine.maps.qc_maps import c_map, leaky_relu_c_map, leaky_relu_c_map_scalar, local_stats
from sigprop.engine.maps.quadrature import expect, gaussian_rule
from sigprop.engine.methods import eoc

SQRT_2PI = math.sqrt(2.0 * math.pi)


def pdf(z):
    return np.exp(-0.5 * z * z) / SQRT_2PI


def quad_expect(f, breaks=()) -> float:
    """E[f(z)], z ~ N(0, 1), by adaptive quadrature split at ``breaks`` (pieces run to +-inf)."""
    pts = [-np.inf] + sorted(float(b) for b in breaks) + [np.inf]
    total = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", integrate.IntegrationWarning)  # "roundoff detected" at 1e-14 asks
        for a, b in zip(pts[:-1], pts[1:], strict=False):
            val, _ = integrate.quad(lambda z: f(z) * pdf(z), a, b, epsabs=1e-14, epsrel=1e-13, limit=400)
            total += val
    return total


def close(a, b, tol):
    return abs(a - b) <= tol * max(1.0, abs(b))


# ----------------------------------------------------------------- independent activations
# (fn, d1, d2, kinks) written from the textbook formulas


def _softplus(x):
    return np.logaddexp(0.0, x)


def _gelu_pdf(x):
    return np.exp(-0.5 * x * x) / SQRT_2PI


REF = {
    "tanh": (np.tanh, lambda x: 1.0 - np.tanh(x) ** 2, lambda x: -2.0 * np.tanh(x) * (1.0 - np.tanh(x) ** 2), ()),
    "softplus": (_softplus, expit, lambda x: expit(x) * (1.0 - expit(x)), ()),
    "gelu": (lambda x: x * ndtr(x), lambda x: ndtr(x) + x * _gelu_pdf(x), lambda x: (2.0 - x * x) * _gelu_pdf(x), ()),
    "swish": (
        lambda x: x * expit(x),
        lambda x: expit(x) * (1.0 + x * (1.0 - expit(x))),
        lambda x: expit(x) * (1.0 - expit(x)) * (2.0 + x * (1.0 - 2.0 * expit(x))),
        (),
    ),
    "erf": (
        erf,
        lambda x: 2.0 / math.sqrt(math.pi) * np.exp(-x * x),
        lambda x: -4.0 * x / math.sqrt(math.pi) * np.exp(-x * x),
        (),
    ),
    "elu": (
        lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0.0))),
        lambda x: np.where(x > 0, 1.0, np.exp(np.minimum(x, 0.0))),
        lambda x: np.where(x > 0, 0.0, np.exp(np.minimum(x, 0.0))),
        (0.0,),
    ),
    "leaky_relu": (
        lambda x: np.where(x > 0, x, 0.2 * x),
        lambda x: np.where(x > 0, 1.0, 0.2),
        lambda x: 0.0 * x,
        (0.0,),
    ),
}


def engine_activation(name):
    return get_activation("leaky_relu", negative_slope=0.2) if name == "leaky_relu" else get_activation(name)


# ----------------------------------------------------------------- quadrature


@pytest.mark.parametrize("a", [0.1, 0.3, 1.0, 2.0, 3.5, 5.0])
@pytest.mark.parametrize("b", [0.0, 0.7, -1.3])
def test_expect_tanh_squared_matches_quad(a, b):
    f = lambda z: np.tanh(a * z + b) ** 2  # noqa: E731
    assert close(expect(f, scale=a), quad_expect(f), 1e-10)


@pytest.mark.parametrize("name", ["softplus", "gelu", "swish", "erf"])
@pytest.mark.parametrize("a,b", [(1.0, 0.0), (0.4, 0.6), (2.5, -0.8)])
def test_expect_smooth_activations_match_quad(name, a, b):
    fn, d1, d2, _ = REF[name]
    for g in (
        lambda z: fn(a * z + b),
        lambda z: fn(a * z + b) ** 2,
        lambda z: d1(a * z + b) ** 2,
        lambda z: d2(a * z + b) ** 2,
        lambda z: fn(a * z + b) * d1(a * z + b) * z,
    ):
        assert close(expect(g, scale=a), quad_expect(g), 1e-10)


@pytest.mark.parametrize("a,b", [(1.0, 0.0), (0.5, 0.3), (2.0, -1.1), (4.0, 0.9), (-1.5, 0.4)])
def test_expect_kinked_integrands_with_breakpoints(a, b):
    """elu''(a z + b)^2 jumps where a z + b = 0; the rule must split exactly there."""
    _, d1, d2, _ = REF["elu"]
    kink = -b / a
    for g in (
        lambda z: d2(a * z + b) ** 2,
        lambda z: d1(a * z + b),
        lambda z: d2(a * z + b) * z * z,
        lambda z: np.maximum(a * z + b, 0.0) ** 2,
    ):
        got = expect(g, kinks=[kink], scale=abs(a))
        assert close(got, quad_expect(g, [kink]), 1e-10)


def test_expect_indicator_needs_the_kink():
    """With the breakpoint E[1{z > k}] is exact; without it the rule is visibly off."""
    k = 0.3137
    g = lambda z: (z > k).astype(float)  # noqa: E731
    exact = 1.0 - ndtr(k)
    assert abs(expect(g, kinks=[k]) - exact) < 1e-13
    assert abs(expect(g) - exact) > 1e-6


def test_gaussian_rule_moments():
    z, w = gaussian_rule()
    assert abs(w.sum() - 1.0) < 1e-13
    assert abs(w @ z) < 1e-14
    assert abs(w @ z**2 - 1.0) < 1e-13
    assert abs(w @ z**4 - 3.0) < 1e-12
    assert abs(w @ z**6 - 15.0) < 1e-11
    z2, w2 = gaussian_rule(kinks=[-0.5, 1.25, 40.0], scale=3.0)
    # nodes never straddle a breakpoint: the weight left of each kink is exactly Phi(kink)
    assert abs(w2[z2 < 1.25].sum() - ndtr(1.25)) < 1e-13
    assert abs(w2[z2 < -0.5].sum() - ndtr(-0.5)) < 1e-13


# ----------------------------------------------------------------- local statistics (eqs 15-19)

TRANSFORMS = [
    (1.0, 0.0, 1.0, 0.0),
    (0.35, 0.55, 4.6, -1.0),
    (1.7, -0.4, 0.8, 0.3),
    (0.13, 0.54, 10.1, -0.49),
    (50.0, 3.0, 0.1, 0.2),  # input scales up to 100 are searched by the transform solver
    (0.01, 0.2, 50.0, -0.19),
]


@pytest.mark.parametrize("name", sorted(REF))
@pytest.mark.parametrize("tr", TRANSFORMS)
def test_local_stats_match_defining_expectations(name, tr):
    alpha, beta, gamma, delta = tr
    fn, d1, d2, kinks = REF[name]
    zk = [(k - beta) / alpha for k in kinks] or [-beta / alpha]  # kinks, or where phi bends

    def phi(z):
        return gamma * (fn(alpha * z + beta) + delta)

    def dphi(z):
        return gamma * alpha * d1(alpha * z + beta)

    def ddphi(z):
        return gamma * alpha**2 * d2(alpha * z + beta)

    q1 = quad_expect(lambda z: phi(z) ** 2, zk)
    q_slope = quad_expect(lambda z: phi(z) * dphi(z) * z, zk)
    mean = quad_expect(phi, zk)
    c0 = mean**2 / q1
    c_slope_1 = quad_expect(lambda z: dphi(z) ** 2, zk) / q1
    c_slope_0 = quad_expect(dphi, zk) ** 2 / q1
    c_curv_1 = quad_expect(lambda z: ddphi(z) ** 2, zk) / q1

    st = local_stats(engine_activation(name), alpha, beta, gamma, delta)
    assert close(st.q_1, q1, 1e-10)
    assert close(st.q_slope_1, q_slope, 1e-10)
    assert close(st.mean, mean, 1e-10)
    assert close(st.c_0, c0, 1e-10)
    assert close(st.c_slope_1, c_slope_1, 1e-10)
    assert close(st.c_slope_0, c_slope_0, 1e-10)
    assert close(st.c_curv_1, c_curv_1, 1e-10)


@pytest.mark.parametrize("name", ["tanh", "softplus", "gelu"])
def test_q_slope_is_the_derivative_of_the_q_map(name):
    """Q'(1) = E[phi phi' z] (eq 16) is d/dq E[phi(sqrt(q) z)^2] at q = 1 (eq 4)."""
    fn = REF[name][0]
    alpha, beta, gamma, delta = 0.6, 0.3, 2.0, -0.4

    def Q(q):
        return quad_expect(lambda z: (gamma * (fn(alpha * math.sqrt(q) * z + beta) + delta)) ** 2)

    h = 1e-4
    fd = (Q(1 + h) - Q(1 - h)) / (2 * h)
    st = local_stats(get_activation(name), alpha, beta, gamma, delta)
    assert abs(st.q_slope_1 - fd) < 1e-7


def test_local_stats_relu_known_values():
    st = local_stats(get_activation("relu"), output_scale=math.sqrt(2.0))
    assert abs(st.q_1 - 1.0) < 1e-14
    assert abs(st.q_slope_1 - 1.0) < 1e-14
    assert abs(st.c_0 - 1.0 / math.pi) < 1e-14
    assert abs(st.c_slope_1 - 1.0) < 1e-14
    assert abs(st.c_slope_0 - 0.5) < 1e-14  # C'(0) = E[phi']^2 = (sqrt(2)/2)^2
    assert st.c_curv_1 == 0.0  # Dirac parts are not represented


# ----------------------------------------------------------------- C maps


def arccos_kernel_c_map(c, a):
    """Normalized Leaky ReLU C map from the arc-cosine kernel (Cho & Saul), independent of eq 9.

    phi_a = a x + (1 - a) relu(x); E[relu(u) relu(v)] = (sqrt(1-c^2) + (pi - arccos c) c) / (2 pi),
    E[u relu(v)] = c / 2, E[phi_a(u)^2] = (1 + a^2) / 2.
    """
    c = np.asarray(c, dtype=float)
    k = (np.sqrt(1.0 - c * c) + (np.pi - np.arccos(c)) * c) / (2.0 * np.pi)
    return (a * a * c + a * (1.0 - a) * c + (1.0 - a) ** 2 * k) / ((1.0 + a * a) / 2.0)


SLOPES = [0.0, 0.2, 0.5, 0.9, 1.0]
CS = np.array([-1.0, -0.9, -0.5, -0.1, 0.0, 0.3, 0.7, 0.95, 0.999, 1.0])


@pytest.mark.parametrize("a", SLOPES)
def test_leaky_relu_c_map_equals_arccos_kernel(a):
    assert np.max(np.abs(leaky_relu_c_map(CS, a) - arccos_kernel_c_map(CS, a))) < 1e-14
    for c in CS:
        assert abs(leaky_relu_c_map_scalar(float(c), a) - float(leaky_relu_c_map(c, a))) < 1e-15


def test_leaky_relu_c_map_known_values():
    for a in SLOPES:
        assert abs(float(leaky_relu_c_map(1.0, a)) - 1.0) < 1e-15
        assert abs(float(leaky_relu_c_map(0.0, a)) - (1 - a) ** 2 / (math.pi * (1 + a * a))) < 1e-15
        h = 1e-7  # C'(1) = 1
        assert abs((1.0 - float(leaky_relu_c_map(1.0 - h, a))) / h - 1.0) < 1e-3
    assert abs(float(leaky_relu_c_map(0.0, 0.0)) - 1.0 / math.pi) < 1e-15
    assert abs(float(leaky_relu_c_map(-1.0, 0.0))) < 1e-15  # relu(z) relu(-z) = 0
    assert np.array_equal(leaky_relu_c_map(CS, 1.0), CS)  # a = 1 is linear


def normalized_leaky_relu(a):
    return transformed(get_activation("leaky_relu", negative_slope=a), output_scale=math.sqrt(2.0 / (1 + a * a)))


@pytest.mark.parametrize("a", [0.5, 0.9])
def test_leaky_relu_c_map_matches_numerical_c_map(a):
    num = c_map(normalized_leaky_relu(a).fn, CS)
    assert np.max(np.abs(num - leaky_relu_c_map(CS, a))) < 2e-6


@pytest.mark.parametrize("a", [0.0, 0.2])
def test_numerical_c_map_of_relu_within_1e_4(a):
    """The documented accuracy of the 2-D reference rule for kinked activations (qc_maps.c_map)."""
    cs = np.linspace(-1, 1, 21)
    num = c_map(normalized_leaky_relu(a).fn, cs)
    assert np.max(np.abs(num - leaky_relu_c_map(cs, a))) < 1e-4


def test_c_map_known_values():
    relu = lambda x: np.maximum(x, 0.0)  # noqa: E731  (c_map normalizes by E[phi^2] itself)
    out = c_map(relu, [1.0, 0.0])
    assert abs(out[0] - 1.0) < 1e-12
    assert abs(out[1] - 1.0 / math.pi) < 1e-6
    # odd activation: C(-c) = -C(c), C(0) = 0
    t = c_map(np.tanh, [-0.6, 0.0, 0.6, 1.0])
    assert abs(t[0] + t[2]) < 1e-13 and abs(t[1]) < 1e-15 and abs(t[3] - 1.0) < 1e-12


def test_c_map_tanh_matches_2d_quadrature():
    """One point of eq 5 for tanh against scipy's adaptive 2-D rule."""
    c = 0.5
    s = math.sqrt(1 - c * c)
    f = lambda z2, z1: np.tanh(z1) * np.tanh(c * z1 + s * z2) * pdf(z1) * pdf(z2)  # noqa: E731
    num, _ = integrate.dblquad(f, -10, 10, -10, 10, epsabs=1e-12, epsrel=1e-12)
    den = quad_expect(lambda z: np.tanh(z) ** 2)
    assert abs(c_map(np.tanh, [c])[0] - num / den) < 1e-8


def test_c_map_derivatives_at_1_and_0_match_local_stats():
    """C(0), C'(0) (eq 19) and C'(1) (eq 18) of the 2-D map agree with the 1-D formulas."""
    act = transformed(get_activation("softplus"), 0.7, 0.2, 1.9, -0.5)
    st = local_stats(act)
    h = 1e-3
    v = c_map(act.fn, [0.0, -h, h, 1.0, 1.0 - h, 1.0 - 2 * h])
    assert abs(v[0] - st.c_0) < 1e-12
    assert abs((v[2] - v[1]) / (2 * h) - st.c_slope_0) < 1e-6
    assert abs((3 * v[3] - 4 * v[4] + v[5]) / (2 * h) - st.c_slope_1) < 1e-5


# ----------------------------------------------------------------- Edge of Chaos


@pytest.mark.parametrize("q_star", [1.0, 2.5, 0.3])
def test_eoc_relu_is_he_initialization(q_star):
    sol = eoc.solve_eoc(get_activation("relu"), q_star)
    assert abs(sol.sigma_w2 - 2.0) < 1e-12
    assert abs(sol.sigma_b2) < 1e-12
    assert abs(sol.chi_1 - 1.0) < 1e-12
    assert abs(sol.v_slope - 1.0) < 1e-12  # V(q) = q
    assert sol.v_curvature is None


def test_eoc_tanh_at_q_star_1_recomputed_with_quad():
    sol = eoc.solve_eoc(get_activation("tanh"), 1.0)
    d1_sq = quad_expect(lambda z: (1 - np.tanh(z) ** 2) ** 2)
    second = quad_expect(lambda z: np.tanh(z) ** 2)
    assert abs(sol.sigma_w2 - 1.0 / d1_sq) < 1e-10
    assert abs(sol.sigma_w2 * d1_sq - 1.0) < 1e-10  # chi_1 = 1
    assert abs(sol.sigma_w2 * second + sol.sigma_b2 - 1.0) < 1e-10  # V(q*) = q*
    assert abs(sol.chi_1 - 1.0) < 1e-12
    assert sol.sigma_b2 > 0.1  # tanh needs a bias at q* = 1
    v = eoc.variance_map(get_activation("tanh"), [1.0], sol.sigma_w2, sol.sigma_b2)
    assert abs(v[0] - 1.0) < 1e-12


@pytest.mark.parametrize("name,q_star", [("tanh", 1.0), ("tanh", 0.5), ("gelu", 1.5), ("erf", 2.0)])
def test_v_slope_and_curvature_match_finite_differences(name, q_star):
    act = get_activation(name)
    sol = eoc.solve_eoc(act, q_star)
    sw2, sb2 = sol.sigma_w2, sol.sigma_b2
    fn = REF[name][0]

    def V(q):
        return sw2 * quad_expect(lambda z: fn(math.sqrt(q) * z) ** 2) + sb2

    h = 1e-4
    slope_fd = (V(q_star + h) - V(q_star - h)) / (2 * h)
    assert abs(sol.v_slope - slope_fd) < 1e-7
    h2 = 1e-3
    curv_fd = (V(q_star + h2) - 2 * V(q_star) + V(q_star - h2)) / h2**2
    assert abs(sol.v_curvature - curv_fd) < 1e-5
    # the engine's own variance map agrees too
    ve = eoc.variance_map(act, [q_star - h, q_star + h], sw2, sb2)
    assert abs((ve[1] - ve[0]) / (2 * h) - sol.v_slope) < 1e-7


def test_eoc_softplus_q_star_1_is_unreachable_with_the_needed_bias():
    """softplus at q* = 1 would need sigma_b^2 = 1 - E[softplus^2] / E[sigmoid^2] < 0."""
    from sigprop.errors import SigpropError

    need = 1.0 - quad_expect(lambda z: _softplus(z) ** 2) / quad_expect(lambda z: expit(z) ** 2)
    assert need < -1.0
    with pytest.raises(SigpropError) as info:
        eoc.solve_eoc(get_activation("softplus"), 1.0)
    assert info.value.code == "unreachable_target"
    assert f"{need:.6g}" in info.value.message
    assert info.value.hint


# ----------------------------------------------------------------- Hermite-series C map (what answers sample)


@pytest.mark.parametrize("name", ["tanh", "softplus", "gelu", "swish", "erf"])
@pytest.mark.parametrize("tr", TRANSFORMS[:3])
def test_hermite_c_map_matches_c_map_and_local_stats(name, tr):
    from sigprop.engine.maps.qc_maps import HermiteCMap

    act = get_activation(name)
    h = HermiteCMap(act, *tr)
    phi = transformed(act, *tr)
    cs = np.array([-1.0, -0.77, -0.31, 0.0123, 0.42, 0.83, 0.97, 0.9991, 1.0])
    # documented bound: |error| <= tail = 2 R / Q(1), R the Hermite mass beyond the cut (slow for tanh(a z),
    # whose poles sit at distance pi / (2a): ~7e-8 at a = 1.7)
    assert h.tail < 1e-7
    assert np.max(np.abs(h(cs) - c_map(phi.fn, cs))) <= h.tail + 1e-13
    assert abs(float(h(1.0)) - 1.0) < 1e-15
    b = h.coefficients  # C(c) = sum_k b_k c^k with b_k >= 0 (positive definite, TAT A.4)
    k = np.arange(len(b))
    assert b.min() >= 0.0
    st = local_stats(phi)
    assert abs(b[0] - st.c_0) < 1e-12  # eq 19, i = 0
    assert abs(b[1] - st.c_slope_0) < 1e-12  # eq 19, i = 1
    assert abs((k * b).sum() - st.c_slope_1) < 1e-9 + len(b) * h.tail  # eq 18, i = 1
    assert abs((k * (k - 1) * b).sum() - st.c_curv_1) < (1e-7 + len(b) ** 2 * h.tail) * max(1.0, st.c_curv_1)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8])
def test_hermite_c_map_of_leaky_relu_within_its_tail_bound(a):
    from sigprop.engine.maps.qc_maps import HermiteCMap

    h = HermiteCMap(get_activation("leaky_relu", negative_slope=a), output_scale=math.sqrt(2 / (1 + a * a)))
    cs = np.linspace(-1, 1, 401)
    err = np.max(np.abs(h(cs) - leaky_relu_c_map(cs, a)))
    # for ReLU the bound 2 R / Q(1) is attained, at c = -1: the two sides differ there by the
    # rounding of evaluating both maps
    assert err <= h.tail + 4e-16
    assert float(h(1.0)) == pytest.approx(1.0, abs=1e-15)
    assert abs(h.coefficients[0] - (1 - a) ** 2 / (math.pi * (1 + a * a))) < 1e-12
    if a == 0.0:
        assert 1e-4 < h.tail < 1e-3  # the answer warns about it
