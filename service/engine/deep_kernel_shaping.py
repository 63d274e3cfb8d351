"""Deep Kernel Shaping, the baseline TAT builds on (TAT paper section 3 and Appendix B.1).

The maximal slope function mu_f^1(C'(1)) = M_{f, r_1}(1) with r_1(x) = C'(1) x is a polynomial in
C'(1) with non-negative coefficients, increasing on [1, inf), so the per-layer slope that makes
mu_f^1 = zeta is found by a bracketing root finder. The local conditions are then
Q(1) = 1, Q'(1) = 1 (or the optional per-layer target ``local_q_slope``, dks's
``local_q_slope_target``), C(0) = 0 and C'(1) = that slope (Table 1, DKS column).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import SigpropError
from .activations import Activation
from .roots import complex_step, newton_bracketed
from .subnetworks import SubnetworkProgram
from .transform import TransformSolution, solve_transform


def max_slope(program: SubnetworkProgram, local_slope: float) -> float:
    """mu_f^1: the maximal C'_g(1) over subnetworks g when every layer has C'(1) = local_slope."""
    if program.chain and local_slope >= 1.0:
        # a chain's subnetworks run from its input: their slopes are the powers s^l, l <= L
        return _power(local_slope, len(program.chain_slots))
    return float(program.maximize(1.0, lambda y, _slot: local_slope * y))


def _power(x: float, n: int) -> float:
    """x^n, or inf past the largest float (as the pass's products overflow)."""
    try:
        return float(x**n)
    except OverflowError:
        return math.inf


def local_slope_target(program: SubnetworkProgram, zeta: float) -> float:
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
    # mu_f^1(1) = 1 < zeta; from zeta^(1/depth), exact for a chain, Newton needs a few passes
    start = min(zeta ** (1.0 / max(program.depth, 1)), hi)
    if program.chain:  # mu_f^1(s) = s^L on [1, hi]: Newton on it in closed form
        layers = len(program.chain_slots)
        return newton_bracketed(
            lambda x: (_power(x, layers) - zeta, layers * _power(x, layers - 1)), 1.0, hi, start, f_lo=1.0 - zeta
        )
    return newton_bracketed(
        lambda x: complex_step(lambda z: program.maximize(1.0, lambda y, _slot: z * y) - zeta, x),
        1.0,
        hi,
        start,
        f_lo=1.0 - zeta,
    )


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


def solve_dks(program: SubnetworkProgram, act: Activation, zeta: float, q_slope_1: float = 1.0) -> DKSSolution:
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
            err.hint = f"zeta = {smaller:.6g} is reachable for '{act.name}' on this graph; ask for at most that"
            break
        raise


def max_slope_and_curvature(program: SubnetworkProgram, local_slope, local_curv) -> np.ndarray:
    """(max_g C'_g(1), max_g C''_g(1)) over subnetworks g, for any local C'(1) and C''(1).

    The pair (C'(1), C''(1)) of a composition follows the chain rule at the fixed point 1:
    (s y1, C''(1) y1^2 + s y2) for a layer after a subnetwork with (y1, y2); normalized sums and
    concatenations average both linearly. With C'(1) = 1 (TAT) the second component is the B.4
    recipe; DKS needs the general form because its layers have C'(1) = zeta^(1/L) != 1.
    ``local_slope`` and ``local_curv`` are numbers, or one per activation function slot.
    """
    slopes = [float(v) for v in np.atleast_1d(local_slope)]
    curvs = [float(v) for v in np.atleast_1d(local_curv)]
    one_slope, one_curv = len(slopes) == 1, len(curvs) == 1
    if program.chain and min(slopes) >= 1.0 and min(curvs) >= 0.0:
        # every layer then raises both components (y1 >= 1, y2 >= 0): the whole chain's pair is
        # the largest, from one pass in real arithmetic
        y1, y2 = 1.0, 0.0
        for slot in program.chain_slots:
            s, k = slopes[0 if one_slope else slot], curvs[0 if one_curv else slot]
            y1, y2 = s * y1, k * y1 * y1 + s * y2
        return np.array([y1, y2])

    # the pair (y1, y2) travels as the complex number y1 + i y2: sums and concatenations are real
    # linear maps, which act on both parts alike, and a layer is s y + i k y1^2 (no array per node)
    def layer(y, slot):
        s, k = slopes[0 if one_slope else slot], curvs[0 if one_curv else slot]
        return s * y + 1j * (k * y.real * y.real)

    found = [complex(v) for v in program.candidate_values(complex(1.0, 0.0), layer)]
    return np.array([max(v.real for v in found), max(v.imag for v in found)])
