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
                    num_tries: int = NUM_TRIES) -> TransformSolution:
    """Find alpha, beta, delta, gamma meeting the local targets; raise if no stable root exists."""
    if c_0 is not None:
        names: tuple[str, ...] = ("input_scale", "input_shift")
    else:
        names = ("input_scale", "input_shift", "output_shift")

    def residuals(p):
        params = complete_params(act, names, p, c_0)
        st = local_stats(act, **params)
        r = [st.q_slope_1 - q_slope_1, st.c_slope_1 - c_slope_1]
        if c_curv_1 is not None:
            r.append(st.c_curv_1 - c_curv_1)
        return np.asarray(r)

    rejected = 0
    for attempt, start in enumerate(starting_points(names, num_tries)):
        with np.errstate(all="ignore"):
            sol = sp_opt.root(residuals, np.asarray(start), method="hybr")
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
        f"({num_tries} starting points tried, {rejected} unstable roots rejected)",
        "ask for less curvature (smaller tau or zeta), use a deeper network so each layer needs less, "
        "or try another activation function")
