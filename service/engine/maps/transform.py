"""Solve the activation transformation phi_hat(x) = gamma (phi(alpha x + beta) + delta) for local targets.

Shared by TAT for smooth activations (TAT paper Algorithm 2, the system of equation 16:
Q'(1) = 1, C'(1) = 1, C''(1) = the local curvature target, with gamma from Q(1) = 1, equation 15)
and by DKS (Q'(1) = 1, C'(1) = the local slope target, C(0) = 0, which fixes delta = -E[phi(alpha z
+ beta)], and Q(1) = 1 for gamma).

Like the reference dks package, the nonlinear system is handed to MINPACK's hybrid Powell method
from a fixed, deterministic sequence of starting points (the same ones, in the same order, so the
same root is chosen), and roots with input_scale * output_scale >= 2 are rejected: the reference
observed those to have unstable Q maps and larger kernel approximation errors. The product is
signed, as in dks: a root with a negative input scale passes whatever its magnitude (dks accepts
such roots, e.g. softsign under DKS at zeta 1.5 on a 3-layer MLP, and sigprop gives the same
answer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import scipy.optimize as sp_opt

from ...errors import SigpropError
from .. import budget
from .activations import Activation
from .qc_maps import raw_mean, shaped_stats

# dks's search order: its "always try" values, then seeded uniform draws (dks/base/activation_transform.py).
_ALWAYS_TRY = {
    "input_scale": (1.0, 0.1),
    "input_shift": (0.0, 1.0, -1.0),
    "output_shift": (0.0, 1.0, -1.0),
    "negative_slope": (0.0, 0.5),
}
_LOW = {"input_scale": 0.0, "input_shift": -3.0, "output_shift": -3.0, "negative_slope": 0.0}
_HIGH = {"input_scale": 2.0, "input_shift": 3.0, "output_shift": 3.0, "negative_slope": 1.0}
_SEED = 123
NUM_TRIES = 50
RESIDUAL_TOL = 1e-9
# double precision resolves an O(1) Gaussian expectation such as C'(1) to a few 1e-16
ABSOLUTE_FLOOR = 4e-15
# below this per-layer target the near-linear search goes first (see ``_NearLinear``)
NEAR_LINEAR_BELOW = 1e-4
NEAR_LINEAR_SCALES = (1.0, 3.0, 0.3)
NEAR_LINEAR_SHIFTS = (0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0)
POLISH_EVALS = 40
# a root whose conditions already hold this closely needs no polishing (hybr's quadratic
# convergence usually ends there): the polish would cost up to POLISH_EVALS more evaluations
POLISHED_BELOW = 1e-14
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


@lru_cache(maxsize=8)
def starting_points(names: tuple[str, ...], num_tries: int = NUM_TRIES) -> tuple[tuple[float, ...], ...]:
    """dks's starting points, in its order (fixed by the seed: computed once per process)."""
    points = list(itertools.product(*(_ALWAYS_TRY[p] for p in names)))
    rng = np.random.RandomState(_SEED)
    while len(points) < num_tries:
        points.append(tuple(rng.uniform(low=_LOW[p], high=_HIGH[p]) for p in names))
    return tuple(points)


def complete_params(act: Activation, names: tuple[str, ...], p, c_0_target: float | None) -> dict[str, float]:
    """Fill in output_shift (from C(0), when targeted) and output_scale (from Q(1) = 1)."""
    params = {name: float(v) for name, v in zip(names, p, strict=False)}
    shift = None if c_0_target is not None else params["output_shift"]
    shift, scale, _ = shaped_stats(act, params["input_scale"], params["input_shift"], shift, c_0_target or 0.0)
    params["output_shift"], params["output_scale"] = shift, scale
    return params


def _conditions(act: Activation, c_0: float | None, targets, p) -> np.ndarray | None:
    """The residuals of the conditions at reference coordinates p = (alpha, beta[, delta]); None
    outside the search's bounds. Every step of both searches runs this, so p goes straight to
    ``shaped_stats`` (no parameter dict)."""
    v = p.tolist()
    if not (abs(v[0]) <= MAX_INPUT_SCALE and all(abs(x) <= 1e3 for x in v[1:])):
        return None
    st = shaped_stats(act, v[0], v[1], None if c_0 is not None else v[2], c_0 or 0.0)[2]
    q_slope_1, c_slope_1, c_curv_1 = targets
    if c_curv_1 is None:
        return np.array([st.q_slope_1 - q_slope_1, st.c_slope_1 - c_slope_1])
    return np.array([st.q_slope_1 - q_slope_1, st.c_slope_1 - c_slope_1, st.c_curv_1 - c_curv_1])


class LastPoint:
    """``_conditions`` at fixed targets, remembering the last point: scipy's root evaluates its
    start three times (a shape check, then hybrd's own start), and a polished root is evaluated
    again in the other coordinates, where it maps back to the same point. A cold DKS solve is
    mostly these evaluations, and a sixth of them were repeats."""

    def __init__(self, act: Activation, c_0: float | None, targets):
        self.act, self.c_0, self.targets = act, c_0, targets
        self.key: bytes | None = None
        self.value: np.ndarray | None = None

    def __call__(self, p: np.ndarray) -> np.ndarray | None:
        key = p.tobytes()
        if key != self.key:
            budget.check()  # between evaluations: a solve with a budget stops here (engine.budget)
            self.key, self.value = key, _conditions(self.act, self.c_0, self.targets, p)
        return None if self.value is None else self.value.copy()


def _reference_residuals(conditions: LastPoint, n: int):
    """The conditions in the reference's own coordinates (alpha, beta[, delta]), as dks solves them."""

    def residuals(p):
        r = conditions(np.asarray(p, dtype=float))
        return np.full(n, _PENALTY) if r is None else r

    return residuals


class _NearLinear:
    """Coordinates in which a nearly linear transformation is well conditioned.

    A per-layer target t = C''(1) (TAT) or |C'(1) - 1| (DKS) of a very deep network is tiny (2e-7 for
    tau = 1e-3 at depth 5000), and its root has alpha = O(sqrt t) while delta must cancel
    E[phi(alpha z + beta)] to within O(t): in (alpha, beta, delta) the system is ill conditioned and
    hybr stalls far from the root. In u = (alpha / sqrt t, beta, (E[phi(alpha z + beta)] + delta) / t),
    with the residuals divided by t, every unknown and every residual is O(1) at the root.
    """

    def __init__(self, conditions: LastPoint, names: tuple[str, ...], scale: float):
        self.conditions, self.names, self.t = conditions, names, scale
        self.act, self.c_0 = conditions.act, conditions.c_0
        self.root_t = float(np.sqrt(scale))

    def to_reference(self, u) -> np.ndarray:
        alpha, beta = u[0] * self.root_t, u[1]
        if self.c_0 is not None:
            return np.array([alpha, beta])
        return np.array([alpha, beta, self.t * u[2] - raw_mean(self.act, alpha, beta)])

    def from_reference(self, p) -> np.ndarray:
        u = [p[0] / self.root_t, p[1]]
        if self.c_0 is None:
            u.append((raw_mean(self.act, p[0], p[1]) + p[2]) / self.t)
        return np.asarray(u)

    def residuals(self, u) -> np.ndarray:
        r = self.conditions(self.to_reference(u))
        return np.full(len(self.names), _PENALTY) if r is None else r / self.t

    def starting_points(self) -> list[tuple[float, ...]]:
        """Positive input scales first, then their mirror images (-alpha, -beta): for a phi whose
        positive-scale near-linear roots are all unstable (sigmoid: |alpha gamma| >= 4), the mirrored
        root is the one the signed stability rule accepts, and the search reaches it every time."""
        tail = () if self.c_0 is not None else (0.0,)
        points = [(a, b) + tail for b in NEAR_LINEAR_SHIFTS for a in NEAR_LINEAR_SCALES]
        return points + [(-p[0], -p[1]) + p[2:] for p in points]


def solve_transform(
    act: Activation,
    *,
    c_slope_1: float,
    q_slope_1: float = 1.0,
    c_curv_1: float | None = None,
    c_0: float | None = None,
    num_tries: int = NUM_TRIES,
    eval_budget: int = EVAL_BUDGET,
) -> TransformSolution:
    """Find alpha, beta, delta, gamma meeting the local targets; raise if no stable root exists.

    Two searches share one evaluation budget: the reference's (dks's starting points, in its
    coordinates, so the same root is chosen) and one in near-linear coordinates (``_NearLinear``)
    whose starting points scale with the target. Deep networks need per-layer targets of 1e-7 and
    less, where only the second converges; it goes first below ``NEAR_LINEAR_BELOW``. A root whose
    conditions do not already hold to ``POLISHED_BELOW`` is polished in near-linear coordinates;
    a root is accepted only when each condition holds to ``RESIDUAL_TOL`` relative to the target's
    distance from the identity map (see ``_accept``).
    """
    names: tuple[str, ...] = (
        ("input_scale", "input_shift") if c_0 is not None else ("input_scale", "input_shift", "output_shift")
    )
    targets = (q_slope_1, c_slope_1, c_curv_1)
    deviation = c_curv_1 if c_curv_1 is not None else abs(c_slope_1 - 1.0)
    conditions = LastPoint(act, c_0, targets)  # both searches' steps, and the last point they asked
    near = _NearLinear(conditions, names, min(max(deviation, 1e-300), 1.0))
    reference = _reference_residuals(conditions, len(names))
    evals = [0]

    def counted(fn):
        def wrapped(x):
            evals[0] += 1
            if evals[0] > eval_budget:
                raise _OutOfBudget
            return fn(x)

        return wrapped

    searches = [
        (counted(reference), starting_points(names, num_tries), lambda x: x),
        (counted(near.residuals), near.starting_points(), near.to_reference),
    ]
    if deviation < NEAR_LINEAR_BELOW:
        searches.reverse()
    rejected = attempt = 0
    try:
        for fn, starts, to_reference in searches:
            for start in starts:
                attempt += 1
                found = _root(fn, start, MAX_EVALS_PER_START)
                if found is None:
                    continue
                params, res = _polish(near, counted(near.residuals), to_reference(found), c_0)
                if params is None or not _accept(res, near.t, c_curv_1):
                    continue
                if params["input_scale"] * params["output_scale"] >= UNSTABLE_PRODUCT:
                    rejected += 1
                    continue
                return TransformSolution(
                    params, tuple(float(x) for x in start), attempt - 1, rejected, float(np.max(np.abs(res)))
                )
    except _OutOfBudget:
        pass
    target = f"C''(1) = {c_curv_1:.6g}" if c_curv_1 is not None else f"C'(1) = {c_slope_1:.6g}"
    raise SigpropError(
        "unreachable_target",
        f"no stable transformation of '{act.name}' reaches the per-layer target {target} "
        f"(searched {attempt} starting points with input_scale up to {MAX_INPUT_SCALE:g}, "
        f"{rejected} unstable roots rejected)",
        "ask for less curvature (smaller tau or zeta), use a deeper network so each layer needs less, "
        "or try another activation function",
    )


def _root(fn, start, maxfev: int, xtol: float = 1.49012e-08, require_success: bool = True):
    with np.errstate(all="ignore"):
        sol = sp_opt.root(fn, np.asarray(start, dtype=float), method="hybr", options={"maxfev": maxfev, "xtol": xtol})
    if (require_success and not sol.success) or not np.all(np.isfinite(sol.x)):
        return None
    return sol.x


def _polish(near: _NearLinear, fn, p, c_0):
    """Refine a root in near-linear coordinates (xtol near machine precision); absolute residuals back."""
    with np.errstate(all="ignore"):
        u = near.from_reference(p)
        if not np.all(np.isfinite(u)):
            return None, None
        if np.max(np.abs(fn(u))) * near.t > POLISHED_BELOW:
            # hybr reports "no further improvement" once xtol is below what the residuals resolve:
            # its last iterate is still the best one, so success is not required here
            better = _root(fn, u, POLISH_EVALS, xtol=1e-14, require_success=False)
            if better is not None and np.max(np.abs(fn(better))) <= np.max(np.abs(fn(u))):
                u = better
        ref = near.to_reference(u)
        params = complete_params(near.act, near.names, ref, c_0)
        res = fn(u) * near.t
    if not np.all(np.isfinite(res)) or not all(np.isfinite(v) for v in params.values()):
        return None, None
    return params, res


def _accept(res: np.ndarray, t: float, c_curv_1: float | None) -> bool:
    """Q'(1) and C'(1) to RESIDUAL_TOL times the target's distance t from the identity map (never
    below what double precision resolves in an O(1) expectation), and C''(1) to RESIDUAL_TOL relative."""
    tol = max(RESIDUAL_TOL * t, ABSOLUTE_FLOOR)
    if np.max(np.abs(res[:2])) > tol:
        return False
    return c_curv_1 is None or abs(res[2]) <= RESIDUAL_TOL * min(c_curv_1, 1.0) + ABSOLUTE_FLOOR * 1e-3
