"""Deep Kernel Shaping, the baseline TAT builds on (TAT paper section 3 and Appendix B.1).

The maximal slope function mu_f^1(C'(1)) = M_{f, r_1}(1) with r_1(x) = C'(1) x is a polynomial in
C'(1) with non-negative coefficients, increasing on [1, inf), so the per-layer slope that makes
mu_f^1 = zeta is found by a bracketing root finder. The local conditions are then
Q(1) = 1, Q'(1) = 1, C(0) = 0 and C'(1) = that slope (Table 1, DKS column).
"""

from __future__ import annotations

from dataclasses import dataclass

import scipy.optimize as sp_opt

from ..errors import SigpropError
from .activations import Activation
from .subnetworks import SubnetworkProgram
from .transform import TransformSolution, solve_transform


def max_slope(program: SubnetworkProgram, local_slope: float) -> float:
    """mu_f^1: the maximal C'_g(1) over subnetworks g when every layer has C'(1) = local_slope."""
    return float(program.maximize(1.0, lambda y, _slot: local_slope * y))


def local_slope_target(program: SubnetworkProgram, zeta: float) -> float:
    if not zeta > 1.0:
        raise SigpropError("invalid_target", f"zeta = {zeta} must be greater than 1",
                           "zeta is the maximal C'_f(1); DKS uses a modest value above 1 such as 1.5")
    if not max_slope(program, 2.0) > 1.0 + 1e-9:  # sums of squared weights round to 1 +- 1 ulp
        raise SigpropError("unreachable_target", "the network has no nonlinear layer that reaches the output, so "
                           "C'_f(1) = 1 for any zeta", "add activation nodes to the graph")
    hi = 2.0
    for _ in range(64):  # mu_f^1 grows at least linearly in the local slope, so 2^64 brackets any zeta
        if max_slope(program, hi) >= zeta:
            break
        hi *= 2.0
    else:
        raise SigpropError("unreachable_target", f"no per-layer slope reaches a maximal C'_f(1) of {zeta}",
                           "use a smaller zeta, or check that the graph's nonlinear layers reach the output")
    return float(sp_opt.brentq(lambda x: max_slope(program, x) - zeta, 1.0, hi, xtol=1e-15, rtol=1e-15, maxiter=200))


@dataclass(frozen=True)
class DKSSolution:
    local_c_slope_1: float
    transform: TransformSolution


def solve_dks(program: SubnetworkProgram, act: Activation, zeta: float) -> DKSSolution:
    """alpha, beta, gamma, delta with maximal C'_g(1) = zeta, C(0) = 0 and Q(1) = Q'(1) = 1."""
    slope = local_slope_target(program, zeta)
    try:
        return DKSSolution(slope, solve_transform(act, c_slope_1=slope, q_slope_1=1.0, c_0=0.0))
    except SigpropError as err:
        for smaller in (1.0 + (zeta - 1.0) / 2, 1.0 + (zeta - 1.0) / 10):
            try:
                solve_transform(act, c_slope_1=local_slope_target(program, smaller), q_slope_1=1.0, c_0=0.0,
                                num_tries=6, eval_budget=400)
            except SigpropError:
                continue
            err.hint = f"zeta = {smaller:.6g} is reachable for '{act.name}' on this graph; ask for at most that"
            break
        raise
