"""Deep Kernel Shaping, the baseline TAT builds on (TAT paper section 3 and Appendix B.1).

The maximal slope function mu_f^1(C'(1)) = M_{f, r_1}(1) with r_1(x) = C'(1) x is a polynomial in
C'(1) with non-negative coefficients, increasing on [1, inf), so the per-layer slope that makes
mu_f^1 = zeta is found by a bracketing root finder. The local conditions are then
Q(1) = 1, Q'(1) = 1 (or the optional per-layer target ``local_q_slope``, dks's
``local_q_slope_target``), C(0) = 0 and C'(1) = that slope (Table 1, DKS column).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import SigpropError
from ..maps.activations import Activation
from ..maps.transform import TransformSolution, solve_transform
from ..network.program import NetworkProgram
from .roots import newton_bracketed


def max_slope(program: NetworkProgram, local_slope: float) -> float:
    """mu_f^1: the maximal C'_g(1) over subnetworks g when every layer has C'(1) = local_slope."""
    return program.max_slope(local_slope)


def local_slope_target(program: NetworkProgram, zeta: float) -> float:
    if not zeta > 1.0:
        raise SigpropError(
            "invalid_target",
            f"zeta = {zeta} must be greater than 1",
            "zeta is the maximal C'_f(1); DKS uses a modest value above 1 such as 1.5",
        )
    at_hi = max_slope(program, 2.0)
    if not at_hi > 1.0 + 1e-9:  # sums of squared weights round to 1 +- 1 ulp
        raise SigpropError(
            "unreachable_target",
            "the network has no nonlinear layer that reaches the output, so C'_f(1) = 1 for any zeta",
            "add activation nodes to the graph",
        )
    hi = 2.0
    for _ in range(64):  # mu_f^1 grows at least linearly in the local slope, so 2^64 brackets any zeta
        if at_hi >= zeta:
            break
        hi *= 2.0
        at_hi = max_slope(program, hi)
    else:
        raise SigpropError(
            "unreachable_target",
            f"no per-layer slope reaches a maximal C'_f(1) of {zeta}",
            "use a smaller zeta, or check that the graph's nonlinear layers reach the output",
        )
    # mu_f^1(1) = 1 < zeta, except where products raise it: a mul has C'(1) = C_u'(1) + C_v'(1), 2 for
    # two factors of slope 1, so a linear activation already gives 2 per gated block on a path
    at_lo = max_slope(program, 1.0) if program.has_products else 1.0
    if at_lo >= zeta:
        raise SigpropError(
            "unreachable_target",
            f"zeta = {zeta} is below this network's C'_f(1) with a linear activation, {at_lo:.6g}: each mul "
            "node adds its factors' slopes (C'(1) = C_u'(1) + C_v'(1), 2 for a gate times a linear stream)",
            f"ask for zeta above {at_lo:.6g} (about 15 % above leaves the activation room to reach it); "
            "norms and shortcuts lower the floor only to 2, the gated block's own",
        )
    # from zeta^(1/depth), exact for a chain, Newton needs a few passes
    start = min(zeta ** (1.0 / max(program.depth, 1)), hi)

    def residual(x: float) -> tuple[float, float]:
        value, slope = program.max_slope_and_derivative(x)
        return value - zeta, slope

    return newton_bracketed(residual, 1.0, hi, start, f_lo=at_lo - zeta)


@dataclass(frozen=True)
class DKSSolution:
    local_c_slope_1: float
    transform: TransformSolution


def check_local_q_slope(value: float) -> float:
    """The per-layer Q'(1) target (dks's ``local_q_slope_target``): Q'(1) = E[phi_hat phi_hat' z] (equation 16,
    first line) is positive for any non-constant phi_hat with Q(1) = 1 near the identity, so it must be > 0."""
    if not value > 0.0:
        raise SigpropError(
            "invalid_target",
            f"local_q_slope = {value} must be positive",
            "local_q_slope is the per-layer Q'(1); 1 (the default) keeps q fixed, the DKS paper's "
            "ablations use values near 1",
        )
    return float(value)


def solve_dks(program: NetworkProgram, act: Activation, zeta: float, q_slope_1: float = 1.0) -> DKSSolution:
    """alpha, beta, gamma, delta with maximal C'_g(1) = zeta, C(0) = 0, Q(1) = 1 and Q'(1) = q_slope_1 (default 1)."""
    slope = local_slope_target(program, zeta)
    try:
        return DKSSolution(slope, solve_transform(act, c_slope_1=slope, q_slope_1=q_slope_1, c_0=0.0))
    except SigpropError as err:
        for smaller in (1.0 + (zeta - 1.0) / 2, 1.0 + (zeta - 1.0) / 10):
            try:
                solve_transform(
                    act,
                    c_slope_1=local_slope_target(program, smaller),
                    q_slope_1=q_slope_1,
                    c_0=0.0,
                    num_tries=6,
                    eval_budget=400,
                )
            except SigpropError:
                continue
            err.hint = f"zeta = {smaller:.10g} is reachable for '{act.name}' on this graph; ask for at most that"
            break
        raise


def max_slope_and_curvature(program: NetworkProgram, local_slope, local_curv) -> np.ndarray:
    """(max_g C'_g(1), max_g C''_g(1)) over subnetworks g (``NetworkProgram.max_slope_and_curvature``)."""
    return program.max_slope_and_curvature(local_slope, local_curv)
