"""Other roots of the activation-transformation system, by a bracket scan along the input shift.

TAT's system ("Deep Learning without Shortcuts: Shaping the Kernel with Tailored Rectifiers",
arXiv:2203.08120, Algorithm 2, equation 16: Q'(1) = 1, C'(1) = 1, C''(1) = t, gamma from Q(1) = 1,
equation 15) and DKS's (arXiv:2110.01765: Q'(1) = q, C'(1) = s, C(0) = 0) can have several roots: near the identity
(small t or s - 1) the conditions hold to leading order along a whole curve of input shifts beta,
and higher-order terms pick isolated roots on it. The root search (``transform.solve_transform``)
takes the first that converges from dks's starting points; this module looks for the others.

With m = E[phi], v = E[phi^2], A = E[phi'^2], B = E[phi''^2], P = E[phi phi' z], D = E[phi' z], all
at phi(alpha z + beta), and S = E[(phi + delta)^2] = 1 / gamma^2 (equations 15-18):

- C'(1) = alpha^2 A / S and C''(1) = alpha^4 B / S. For TAT, C'(1) = 1 makes S = alpha^2 A, so
  C''(1) = alpha^2 B / A = t fixes alpha for each beta, and delta = -m +- sqrt(alpha^2 A - v + m^2)
  (two branches). For DKS, delta = -m (C(0) = 0) and C'(1) = alpha^2 A / (v - m^2) = s fixes alpha.
- What is left is one scalar condition along beta: Q'(1) = alpha (P + delta D) / S.

So each branch is a function G(beta) = Q'(1) - target; its sign changes on a grid of shifts bracket
the other roots. Each bracket is then solved by hybr in the root search's near-linear coordinates
and polished and accepted by its rules (conditions to RESIDUAL_TOL, the stability rule), so a
listed root meets every condition as closely as the chosen one. (-alpha, beta, delta) is always a
root too, with the same Q and C maps (z and -z have one distribution): the scan keeps alpha > 0 and
lists no such mirror.
"""

from __future__ import annotations

import math

import numpy as np

from ...schemas.solve import OtherRoot
from .. import budget
from ..maps.activations import Activation
from ..maps.qc_maps import HermiteCMap, _node_values, local_stats
from ..maps.transform import (
    MAX_EVALS_PER_START,
    MAX_INPUT_SCALE,
    UNSTABLE_PRODUCT,
    LastPoint,
    TransformSolution,
    _accept,
    _NearLinear,
    _OutOfBudget,
    _polish,
    _root,
)
from .deep_kernel_shaping import local_slope_target
from .tat import curvature_multiplier

# the shifts scanned: where phi's shape changes for the catalogue's activations (bends near 0,
# saturation beyond +-3 for the sigmoid family)
SCAN_SHIFTS = np.linspace(-3.0, 3.0, 25)
ALPHA_ITERATIONS = 4
# two roots closer than this in (alpha, beta), relative, are one
SAME_ROOT = 1e-6
# condition evaluations the brackets' solves may spend together (the grid's own are
# len(SCAN_SHIFTS) * (ALPHA_ITERATIONS + 1)): about 0.2 s at worst, whatever the activation
SCAN_EVAL_BUDGET = 1500


def _moments(act: Activation, alpha: float, beta: float) -> tuple[float, ...]:
    budget.check()  # the scan's repeated step (engine.budget)
    z, w, f, d1, d2 = _node_values(act, alpha, beta)
    return tuple((np.array([f, f * f, d1 * d1, d2 * d2, f * d1 * z, d1 * z]) @ w).tolist())


def _branch_values(act: Activation, beta: float, c_slope_1: float, q_slope_1: float, c_curv_1) -> list[tuple]:
    """[(G, alpha, delta)] for each branch at shift beta; [] where the conditions other than
    Q'(1) have no solution there. Moments are of f(z) = phi(alpha z + beta) with z-derivatives,
    so A = E[f'^2] and B = E[f''^2] carry alpha^2 and alpha^4: C''(1) = B / A and, for DKS,
    C'(1) - 1 grow as alpha^2, which the fixed-point steps on alpha use."""
    excess = c_curv_1 if c_curv_1 is not None else c_slope_1 - 1.0
    if not excess > 0.0:
        return []
    alpha = math.sqrt(excess)
    for _ in range(ALPHA_ITERATIONS):
        m, v, a, b = _moments(act, alpha, beta)[:4]
        var = v - m * m
        if not (a > 0.0 and var > 0.0):
            return []
        got = b / a if c_curv_1 is not None else a / var - 1.0
        if not got > 0.0:
            return []
        alpha *= math.sqrt(excess / got)
        if not alpha <= MAX_INPUT_SCALE:
            return []
    m, v, a, b, p, d = _moments(act, alpha, beta)
    if c_curv_1 is None:
        deltas = [-m]
    else:
        disc = m * m - v + a  # S = E[(f + delta)^2] = A, for C'(1) = 1
        if disc < 0.0:
            return []
        deltas = [-m + math.sqrt(disc), -m - math.sqrt(disc)]
    out = []
    for delta in deltas:
        s = v + 2.0 * delta * m + delta * delta
        if s > 0.0:
            out.append(((p + delta * d) / s - q_slope_1, alpha, delta))
    return out


def scan_roots(
    act: Activation,
    *,
    c_slope_1: float,
    q_slope_1: float = 1.0,
    c_curv_1: float | None = None,
    c_0: float | None = None,
    known: tuple[dict, ...] = (),
) -> list[TransformSolution]:
    """The roots the scan brackets, other than those in ``known`` (parameter dicts), each polished
    and accepted by the root search's rules (conditions to RESIDUAL_TOL, stable), in order of beta."""
    names = ("input_scale", "input_shift") if c_0 is not None else ("input_scale", "input_shift", "output_shift")
    deviation = c_curv_1 if c_curv_1 is not None else abs(c_slope_1 - 1.0)
    conditions = LastPoint(act, c_0, (q_slope_1, c_slope_1, c_curv_1))
    near = _NearLinear(conditions, names, min(max(deviation, 1e-300), 1.0))
    values = [_branch_values(act, float(b), c_slope_1, q_slope_1, c_curv_1) for b in SCAN_SHIFTS]
    found = [dict(p) for p in known]
    out = []
    spent = [0]

    def residuals(u):
        spent[0] += 1
        if spent[0] > SCAN_EVAL_BUDGET:
            raise _OutOfBudget
        return near.residuals(u)

    try:
        _solve_brackets(values, near, residuals, c_0, c_curv_1, found, out)
    except _OutOfBudget:
        pass  # the roots found so far are listed
    return out


def _solve_brackets(values, near, residuals, c_0, c_curv_1, found: list, out: list) -> None:
    """Solve each sign change of a branch between neighbouring shifts; append new accepted roots."""
    for k in range(len(SCAN_SHIFTS) - 1):
        left, right = values[k], values[k + 1]
        for branch in range(min(len(left), len(right))):
            (g0, a0, d0), (g1, a1, d1) = left[branch], right[branch]
            if not (g0 * g1 <= 0.0 and g0 != g1):
                continue
            w = g0 / (g0 - g1)  # the secant's zero between the two shifts
            b0, b1 = SCAN_SHIFTS[k], SCAN_SHIFTS[k + 1]
            start = [a0 + w * (a1 - a0), b0 + w * (b1 - b0)] + ([] if c_0 is not None else [d0 + w * (d1 - d0)])
            solved = _root(residuals, near.from_reference(start), MAX_EVALS_PER_START)
            if solved is None:
                continue
            params, res = _polish(near, residuals, near.to_reference(solved), c_0)
            if params is None or not _accept(res, near.t, c_curv_1):
                continue
            if params["input_scale"] * params["output_scale"] >= UNSTABLE_PRODUCT:
                continue
            if any(_same(params, q) for q in found):
                continue
            found.append(params)
            out.append(TransformSolution(params, tuple(start), -1, 0, float(np.max(np.abs(res)))))


def _same(p: dict, q: dict) -> bool:
    return all(abs(p[k] - q[k]) <= SAME_ROOT * max(1.0, abs(q[k])) for k in ("input_scale", "input_shift"))


def other_roots(program, act: Activation, chosen: TransformSolution, method: str, targets: dict) -> list[OtherRoot]:
    """The answer's ``other_roots`` for one smooth function: the scan at the method's exact per-layer
    targets (TAT: C''(1) = tau / kappa; DKS: the slope from zeta), each root with its network's
    C_f(0) and C_f(0.5)."""
    if method == "tat":
        local = dict(c_slope_1=1.0, c_curv_1=targets["tau"] / curvature_multiplier(program))
    else:
        slope = local_slope_target(program, targets["zeta"])
        local = dict(c_slope_1=slope, q_slope_1=targets.get("local_q_slope", 1.0), c_0=0.0)
    out = []
    for root in scan_roots(act, **local, known=(chosen.params,)):
        table = HermiteCMap(act, **root.params)
        at = program.global_map(np.array([0.0, 0.5]), lambda c, _slot, t=table: t(c))
        out.append(
            OtherRoot(
                **root.params,
                local_c_0=local_stats(act, **root.params).c_0,
                network_c_f_0=float(at[0]),
                network_c_f_0_5=float(at[1]),
            )
        )
    return out
