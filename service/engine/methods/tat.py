"""Tailored Activation Transformation (TAT paper section 4, Appendix B.6).

``solve_tat_leaky_relu`` is Algorithm 1: the negative slope a of the Tailored Rectifier
sqrt(2 / (1 + a^2)) * phi_a with mu_f^0(a) = M_{f, C_a}(0) = eta, where C_a is the closed-form local
C map of equation 9. mu_f^0 is strictly decreasing in a (Appendix B.3), so a bracketed Newton
iteration on [0, 1] (``roots``, derivative by the complex step) is exact to machine precision, from a
start that a chain of the network's depth would need.

``solve_tat_smooth`` is Algorithm 2: the maximal curvature function mu_f^2(C''(1)) = M_{f, r_2}(0)
with r_2(x) = C''(1) + x is a non-negative multiple kappa * C''(1) (Appendix B.4, second recipe),
so the per-layer target is tau / kappa; then the system of equation 16 gives alpha, beta, delta and
equation 15 gives gamma.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...errors import SigpropError
from ..maps.activations import Activation
from ..maps.transform import TransformSolution, solve_transform
from ..network.program import NetworkProgram
from .roots import newton_bracketed


def max_c_value(program: NetworkProgram, negative_slope: float) -> float:
    """mu_f^0(a): the maximal C_g(0) over subnetworks g for Leaky ReLU slope a (Appendix B.1)."""
    return program.max_c0(negative_slope)


def solve_tat_leaky_relu(program: NetworkProgram, eta: float) -> float:
    """Negative slope a with mu_f^0(a) = eta (Algorithm 1)."""
    if not 0.0 <= eta < 1.0:
        raise SigpropError(
            "invalid_target",
            f"eta = {eta} is outside [0, 1)",
            "eta is a C map value at 0: use 0 <= eta < 1 (the paper uses 0.9 or 0.95)",
        )
    reachable = max_c_value(program, 0.0)  # a = 0 (ReLU) is the most nonlinear Leaky ReLU
    if eta > reachable:
        raise SigpropError(
            "unreachable_target",
            f"eta = {eta} is more than this network can reach: the largest maximal C_f(0) over its "
            f"subnetworks is {reachable:.6f}, at negative slope 0 (ReLU)",
            f"use eta <= {math.floor(reachable * 1e6) / 1e6:.6f}, or a deeper network",
        )
    if eta == reachable:
        return 0.0
    if eta == 0.0:
        return 1.0

    # mu_f^0 is decreasing in a: the root of eta - mu_f^0(a) on [0, 1], with f(0) < 0 known
    def residual(a: float) -> tuple[float, float]:
        value, slope = program.max_c0_and_derivative(a)
        return eta - value, -slope

    return newton_bracketed(
        residual,
        0.0,
        1.0,
        _slope_estimate(eta, program.depth),
        f_lo=eta - reachable,
    )


_GL_X, _GL_W = np.polynomial.legendre.leggauss(24)


def _slope_estimate(eta: float, depth: int) -> float:
    """A starting slope. A chain of ``depth`` layers with small k = (1 - a)^2 / (pi (1 + a^2))
    moves c by k g(c) per layer, g(c) = sqrt(1 - c^2) - c arccos c: the flow of dc/dt = k G(c)
    with G = g - k g g' / 2 + O(k^2) (the vector field whose time-1 map is the layer), so reaching
    eta from 0 takes depth = I / k + ln(g(eta) / g(0)) / 2 layers with I = int_0^eta dc / g(c).
    Within about 1e-4 of the root at depth 50 and 1e-7 at depth 1000 (eta = 0.9 to 0.95)."""
    c = 0.5 * eta * (_GL_X + 1.0)
    g = np.sqrt(1.0 - c * c) - c * np.arccos(c)
    g_eta = math.sqrt(1.0 - eta * eta) - eta * math.acos(eta)
    layers = max(depth, 1) - 0.5 * math.log(g_eta) if g_eta > 0.0 else max(depth, 1)
    k = min(float(0.5 * eta * (_GL_W @ (1.0 / g))) / layers, 1.0 / math.pi)
    m = 1.0 - math.pi * k  # (1 - a)^2 = pi k (1 + a^2), solved for a in [0, 1]
    return m / (1.0 + math.sqrt(max(0.0, 1.0 - m * m)))


@dataclass(frozen=True)
class SmoothTAT:
    kappa: float  # mu_f^2(C''(1)) / C''(1)
    local_c_curv_1: float  # per-layer C''(1) target
    transform: TransformSolution


def curvature_multiplier(program: NetworkProgram) -> float:
    """kappa with mu_f^2(C''(1)) = kappa * C''(1) (Appendix B.4 with C''(1) = 1)."""
    return program.curvature_multiplier()


def solve_tat_smooth(program: NetworkProgram, act: Activation, tau: float) -> SmoothTAT:
    """alpha, beta, gamma, delta with maximal C''_g(1) = tau and Q(1) = Q'(1) = C'(1) = 1 (Algorithm 2)."""
    if not tau > 0.0:
        raise SigpropError(
            "invalid_target",
            f"tau = {tau} is not positive",
            "tau is the maximal C''_f(1) over subnetworks: use a small positive value such as 0.3",
        )
    kappa = curvature_multiplier(program)
    if kappa <= 1e-12:
        raise SigpropError(
            "unreachable_target",
            "the network has no nonlinear layer, so C''_f(1) = 0 for any tau",
            "add activation nodes to the graph",
        )
    local = tau / kappa
    try:
        return SmoothTAT(kappa, local, solve_transform(act, c_slope_1=1.0, q_slope_1=1.0, c_curv_1=local))
    except SigpropError as err:
        # Say what is reachable: the largest of a few smaller targets that solves quickly.
        for factor in (0.5, 0.1, 0.01):
            try:
                solve_transform(
                    act, c_slope_1=1.0, q_slope_1=1.0, c_curv_1=local * factor, num_tries=6, eval_budget=400
                )
            except SigpropError:
                continue
            err.hint = (
                f"tau = {tau * factor:.6g} is reachable for '{act.name}' on this graph "
                f"(kappa = {kappa:.6g} curvature units per layer); ask for at most that, or use a deeper network"
            )
            break
        raise
