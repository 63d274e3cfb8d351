"""Solve the activation transformation phi_hat(x) = gamma (phi(alpha x + beta) + delta) for local targets.

Shared by TAT for smooth activations (TAT paper Algorithm 2, the system of equation 16:
Q'(1) = 1, C'(1) = 1, C''(1) = the local curvature target, with gamma from Q(1) = 1, equation 15)
and by DKS (Q'(1) = 1, C'(1) = the local slope target, C(0) = 0, which fixes delta = -E[phi(alpha z
+ beta)], and Q(1) = 1 for gamma).

Like the reference dks package, the nonlinear system is handed to MINPACK's hybrid Powell method
from a fixed, deterministic sequence of starting points (the same ones, in the same order, so the
same root is chosen), and roots with input_scale * output_scale >= 2 are rejected: the reference
observed those to have unstable Q maps and larger kernel approximation errors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import scipy.optimize as sp_opt

from ..errors import SigpropError
from .activations import Activation
from .qc_maps import local_stats

# dks's search order: its "always try" values, then seeded uniform draws (dks/base/activation_transform.py).
_ALWAYS_TRY = {"input_scale": (1.0, 0.1), "input_shift": (0.0, 1.0, -1.0), "output_shift": (0.0, 1.0, -1.0)}
_LOW = {"input_scale": 0.0, "input_shift": -3.0, "output_shift": -3.0}
_HIGH = {"input_scale": 2.0, "input_shift": 3.0, "output_shift": 3.0}
_SEED = 123
NUM_TRIES = 50
RESIDUAL_TOL = 1e-9
UNSTABLE_PRODUCT = 2.0
# Bounds that keep an unreachable target from turning into a long search: beyond this input
# scale the activation is a near-step function (no useful transformation), each root search gets
# a bounded number of evaluations, and the whole search a wall-clock budget.
MAX_INPUT_SCALE = 100.0
MAX_EVALS_PER_START = 150
# A budget in evaluations, not seconds, so the answer never depends on how busy the machine is;
# at ~0.2 ms an evaluation it bounds an unreachable target's search to about a second.
EVAL_BUDGET = 4000
_PENALTY = 1e3


class _OutOfBudget(Exception):
    pass


@dataclass(frozen=True)
class TransformSolution:
    params: dict[str, float]
    starting_point: tuple[float, ...]
    attempt: int
    rejected: int
    residual: float


def starting_points(names: tuple[str, ...], num_tries: int = NUM_TRIES) -> list[tuple[float, ...]]:
    points = list(itertools.product(*(_ALWAYS_TRY[p] for p in names)))
    rng = np.random.RandomState(_SEED)
    while len(points) < num_tries:
        points.append(tuple(rng.uniform(low=_LOW[p], high=_HIGH[p]) for p in names))
    return points


def complete_params(act: Activation, names: tuple[str, ...], p, c_0_target: float | None) -> dict[str, float]:
    """Fill in output_shift (from C(0), when targeted) and output_scale (from Q(1) = 1)."""
    params = {name: float(v) for name, v in zip(names, p)}
    a, b = params["input_scale"], params["input_shift"]
    if c_0_target is not None:
        raw = local_stats(act, a, b)
        params["output_shift"] = float(np.sqrt(c_0_target) - raw.mean)
    shifted = local_stats(act, a, b, 1.0, params["output_shift"])
    params["output_scale"] = float(1.0 / np.sqrt(shifted.second))
    return params


def solve_transform(act: Activation, *, c_slope_1: float, q_slope_1: float = 1.0,
                    c_curv_1: float | None = None, c_0: float | None = None,
                    num_tries: int = NUM_TRIES, eval_budget: int = EVAL_BUDGET) -> TransformSolution:
    """Find alpha, beta, delta, gamma meeting the local targets; raise if no stable root exists."""
    if c_0 is not None:
        names: tuple[str, ...] = ("input_scale", "input_shift")
    else:
        names = ("input_scale", "input_shift", "output_shift")

    evals = [0]

    def residuals(p):
        evals[0] += 1
        if evals[0] > eval_budget:
            raise _OutOfBudget
        if not (abs(p[0]) <= MAX_INPUT_SCALE and np.all(np.abs(p[1:]) <= 1e3)):
            return np.full(len(names), _PENALTY)
        params = complete_params(act, names, p, c_0)
        st = local_stats(act, **params)
        r = [st.q_slope_1 - q_slope_1, st.c_slope_1 - c_slope_1]
        if c_curv_1 is not None:
            r.append(st.c_curv_1 - c_curv_1)
        return np.asarray(r)

    rejected = 0
    for attempt, start in enumerate(starting_points(names, num_tries)):
        try:
            with np.errstate(all="ignore"):
                sol = sp_opt.root(residuals, np.asarray(start), method="hybr", options={"maxfev": MAX_EVALS_PER_START})
        except _OutOfBudget:
            break
        if not sol.success or not np.all(np.isfinite(sol.x)):
            continue
        with np.errstate(all="ignore"):
            params = complete_params(act, names, sol.x, c_0)
            res = float(np.max(np.abs(residuals(sol.x))))
        if not np.isfinite(res) or res > RESIDUAL_TOL or not all(np.isfinite(v) for v in params.values()):
            continue
        if params["input_scale"] * params["output_scale"] >= UNSTABLE_PRODUCT:
            rejected += 1
            continue
        return TransformSolution(params, tuple(float(x) for x in start), attempt, rejected, res)
    target = (f"C''(1) = {c_curv_1:.6g}" if c_curv_1 is not None else f"C'(1) = {c_slope_1:.6g}")
    raise SigpropError(
        "unreachable_target",
        f"no stable transformation of '{act.name}' reaches the per-layer target {target} "
        f"(searched {attempt + 1} starting points with input_scale up to {MAX_INPUT_SCALE:g}, "
        f"{rejected} unstable roots rejected)",
        "ask for less curvature (smaller tau or zeta), use a deeper network so each layer needs less, "
        "or try another activation function")
