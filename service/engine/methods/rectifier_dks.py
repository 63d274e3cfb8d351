"""Deep Kernel Shaping for ReLU and Leaky ReLU: the special cases of dks's ``_solve_for_activation_params``.

DKS (Martens et al., "Rapid training of deep neural networks without skip connections or
normalization layers using Deep Kernel Shaping", arXiv:2110.01765) asks every nonlinear layer of
phi_hat(x) = gamma (phi(alpha x + beta) + delta) for Q(1) = 1, Q'(1) = the local Q-slope target
(1 by default), C(0) = 0 and C'(1) = the local slope that makes the maximal C'_f(1) equal zeta
(``deep_kernel_shaping.local_slope_target``). None of these needs C''(1), so kinked rectifiers
qualify; what differs is how many degrees of freedom they leave, because both are positively
homogeneous: phi(alpha x + beta) = alpha phi(x + beta / alpha) for alpha > 0.

- **ReLU.** alpha and gamma are interchangeable, so once delta is spent on C(0) = 0 (equation 19
  with i = 0) and gamma on Q(1) = 1 (equation 15), only the ratio beta / alpha is left: one unknown,
  so only C'(1) (equation 18, i = 1) can be imposed and the Q'(1) condition is dropped. dks fixes
  beta = +1 and solves for alpha. With beta > 0, C'(1) increases with alpha towards the centred
  ReLU's value 1 / (1 - 1/pi) = 1.4669422 as alpha -> inf; larger targets need beta = -1 (a
  ReLU acting on the tail of its input, whose C'(1) decreases from +inf towards the same limit).
  ``RELU_POSITIVE_SHIFT_MAX_SLOPE`` is dks's constant for that switch, taken verbatim.
- **Leaky ReLU.** alpha is again redundant with gamma, so dks fixes alpha = 1 and frees the negative
  slope instead: (negative_slope, beta) solve Q'(1) and C'(1) (equation 16, first two lines),
  delta gives C(0) = 0 and gamma gives Q(1) = 1.

As in dks, the unknowns are searched with MINPACK's hybrid Powell method from dks's starting points
in dks's order (its "always try" values, then seeded uniform draws), and the first converged root is
taken; dks applies no stability rejection under DKS, and neither does this module. Each root is
then polished (hybr with a step tolerance near machine precision) and accepted only when the
conditions hold to ``RESIDUAL_TOL`` of the target's distance from the identity map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import brentq
from scipy.special import ndtr

from ...errors import SigpropError
from ..maps.activations import get_activation
from ..maps.qc_maps import local_stats, raw_mean, shifted_second
from ..maps.transform import ABSOLUTE_FLOOR, NUM_TRIES, RESIDUAL_TOL, TransformSolution, _root, starting_points

# dks: "the maximum value of local_c_slope_1 that can be achieved in ReLUs given a positive input
# shift value", 1 / (1 - 1/pi) to the digits dks uses, so the same branch is taken at the boundary.
RELU_POSITIVE_SHIFT_MAX_SLOPE = 1.466942206924260361
RECTIFIERS = ("relu", "leaky_relu")
_PENALTY = 1e3


@dataclass(frozen=True)
class _Problem:
    """One rectifier's unknowns (dks's ``opt_params``), its fixed parameters and its conditions."""

    name: str
    names: tuple[str, ...]
    fixed: dict[str, float]
    q_slope_1: float | None
    c_slope_1: float
    # dks's box on the unknowns; ReLU's exact root (``relu_shift_ratio``) may lie far outside it
    bound: float = 1e3

    def activation(self, slope: float | None):
        return get_activation(self.name, negative_slope=slope) if slope is not None else get_activation(self.name)

    def params(self, p) -> dict[str, float] | None:
        """All parameters from the unknowns: delta from C(0) = 0, then gamma from Q(1) = 1 (dks's
        ``_compute_output_params``); None where phi_hat would be identically zero or undefined."""
        params = dict(self.fixed)
        params.update({k: float(v) for k, v in zip(self.names, p, strict=True)})
        slope = params.pop("negative_slope", None)
        act = self.activation(slope)
        a, b = params["input_scale"], params["input_shift"]
        delta = -raw_mean(act, a, b)
        second = shifted_second(act, a, b, delta)
        if not (np.isfinite(second) and second > 0.0):
            return None
        out = {
            "input_scale": a,
            "input_shift": b,
            "output_shift": float(delta),
            "output_scale": float(1.0 / np.sqrt(second)),
        }
        if slope is not None:
            out["negative_slope"] = slope
        return out

    def residuals(self, p) -> np.ndarray:
        """The conditions dks imposes, in its order: Q'(1) (unless dropped), then C'(1)."""
        if not np.all(np.isfinite(p)) or np.any(np.abs(p) > self.bound):
            return np.full(len(self.names), _PENALTY)
        params = self.params(p)
        if params is None:
            return np.full(len(self.names), _PENALTY)
        st = local_stats(
            self.activation(params.get("negative_slope")),
            params["input_scale"],
            params["input_shift"],
            params["output_scale"],
            params["output_shift"],
        )
        r = [] if self.q_slope_1 is None else [st.q_slope_1 - self.q_slope_1]
        return np.asarray(r + [st.c_slope_1 - self.c_slope_1])


def problem(name: str, c_slope_1: float, q_slope_1: float = 1.0) -> _Problem:
    """dks's special case for ``name``: ReLU solves alpha at a fixed shift and drops Q'(1); Leaky ReLU
    solves (negative_slope, beta) at alpha = 1."""
    if name == "relu":
        shift = 1.0 if c_slope_1 < RELU_POSITIVE_SHIFT_MAX_SLOPE else -1.0
        return _Problem(name, ("input_scale",), {"input_shift": shift}, None, c_slope_1)
    if name == "leaky_relu":
        return _Problem(name, ("negative_slope", "input_shift"), {"input_scale": 1.0}, q_slope_1, c_slope_1)
    raise SigpropError("unsupported_activation", f"'{name}' is not a rectifier", f"rectifiers: {', '.join(RECTIFIERS)}")


def relu_slope(s: float) -> float:
    """C'(1) of gamma (relu(z + s) + delta) with C(0) = 0 and Q(1) = 1 (equation 18 with i = 1):
    Phi(s) / Var relu(z + s), from E relu(z + s) = phi(s) + s Phi(s) and
    E relu(z + s)^2 = (1 + s^2) Phi(s) + s phi(s). Strictly decreasing in s, from +inf (s -> -inf)
    through 1 / (1 - 1/pi) (s = 0) to 1 (s -> +inf). phi(alpha z + beta) = alpha phi(z + beta / alpha)
    for alpha > 0, so s = beta / alpha is ReLU's one degree of freedom."""
    pdf, cdf = math.exp(-0.5 * s * s) / math.sqrt(2.0 * math.pi), float(ndtr(s))
    mean = pdf + s * cdf
    return cdf / ((1.0 + s * s) * cdf + s * pdf - mean * mean)


# |s| up to this: relu_slope(-32) = 517 per layer, beyond which Phi(s) underflows on the way
_RATIO_EDGE = 32.0
# below this |s| (input scale 1e12 with shift +-1) the centred ReLU (s = 0) is the root to rounding
_RATIO_ZERO = 1e-12


def relu_shift_ratio(c_slope_1: float) -> float | None:
    """The unique s = beta / alpha with ``relu_slope(s) = c_slope_1`` (Brent's method on the closed
    form), or None where it lies beyond |s| = _RATIO_EDGE (a C'(1) too close to 1 for the closed
    form's digits, or above relu_slope(-_RATIO_EDGE))."""
    f0 = RELU_POSITIVE_SHIFT_MAX_SLOPE - c_slope_1
    if f0 == 0.0:
        return 0.0
    step = 1.0 if f0 > 0.0 else -1.0  # a smaller target needs a larger s
    edge = step
    while (relu_slope(edge) - c_slope_1) * f0 > 0.0:
        edge *= 2.0
        if abs(edge) > _RATIO_EDGE:
            return None
    lo, hi = sorted((0.0, edge))
    return float(brentq(lambda s: relu_slope(s) - c_slope_1, lo, hi, xtol=1e-300, rtol=4 * np.finfo(float).eps))


def _relu_exact(prob: _Problem, ratio: float, tol: float) -> TransformSolution | None:
    """The ReLU root from ``relu_shift_ratio`` in dks's convention (input shift +-1, input scale
    1 / |s|; the centred ReLU for |s| below _RATIO_ZERO), polished on the quadrature's conditions."""
    if abs(ratio) < _RATIO_ZERO:
        prob = replace(prob, fixed={"input_shift": 0.0})
        found = np.array([1.0])
    else:
        prob = replace(prob, fixed={"input_shift": math.copysign(1.0, ratio)}, bound=math.inf)
        found = np.array([1.0 / abs(ratio)])
        if np.max(np.abs(prob.residuals(found))) > tol:
            better = _root(prob.residuals, found, 40, xtol=1e-15, require_success=False)
            if better is not None and np.max(np.abs(prob.residuals(better))) < np.max(np.abs(prob.residuals(found))):
                found = better
    res = prob.residuals(found)
    params = prob.params(found)
    if params is None or np.max(np.abs(res)) > tol:
        return None
    return TransformSolution(params, (float(found[0]),), 0, 0, float(np.max(np.abs(res))))


def solve_rectifier(
    name: str, c_slope_1: float, q_slope_1: float = 1.0, num_tries: int = NUM_TRIES
) -> TransformSolution:
    """The first root from dks's starting points, polished; raise ``unreachable_target`` if none converges.

    ReLU's root is unique (``relu_slope`` is monotone), so it is found first in closed form: where
    its input scale lies outside dks's box (|alpha| <= 1e3, targets within about 5e-4 of
    1 / (1 - 1/pi)), dks's search cannot converge and the closed-form root is taken (its
    ``starting_point`` is that root and ``attempt`` 0); elsewhere dks's search finds the same root."""
    prob = problem(name, c_slope_1, q_slope_1)
    tol = max(RESIDUAL_TOL * abs(c_slope_1 - 1.0), ABSOLUTE_FLOOR)
    ratio = relu_shift_ratio(c_slope_1) if name == "relu" else None
    if ratio is not None and abs(ratio) * prob.bound < 1.0:
        found = _relu_exact(prob, ratio, tol)
        if found is not None:
            return found
    attempt = 0
    for start in starting_points(prob.names, num_tries):
        attempt += 1
        found = _root(prob.residuals, start, 200 * (len(prob.names) + 1))  # dks: hybr with default options
        if found is None:
            continue
        better = _root(prob.residuals, found, 40, xtol=1e-14, require_success=False)
        if better is not None and np.max(np.abs(prob.residuals(better))) <= np.max(np.abs(prob.residuals(found))):
            found = better
        res = prob.residuals(found)
        params = prob.params(found)
        if params is None or np.max(np.abs(res)) > tol:
            continue
        return TransformSolution(params, tuple(float(x) for x in start), attempt - 1, 0, float(np.max(np.abs(res))))
    if ratio is not None:
        found = _relu_exact(prob, ratio, tol)
        if found is not None:
            return found
    what = "C'(1)" if prob.q_slope_1 is None else f"C'(1) = {c_slope_1:.6g} with Q'(1)"
    if name == "relu":
        top = relu_slope(-_RATIO_EDGE)
        raise SigpropError(
            "unreachable_target",
            f"no transformation of 'relu' reaches the per-layer target C'(1) = {c_slope_1:.6g}: "
            f"ReLU's C'(1) runs from 1 (exclusive) to {top:.6g} (input shift -1, input scale "
            f"{1 / _RATIO_EDGE:g}) in double precision",
            f"ask for a per-layer C'(1) below {top:.6g}: a smaller zeta, or a deeper network",
        )
    raise SigpropError(
        "unreachable_target",
        f"no transformation of '{name}' reaches the per-layer target {what} = "
        f"{c_slope_1 if prob.q_slope_1 is None else q_slope_1:.6g} (searched {attempt} starting points)",
        "use a smaller zeta or a deeper network",
    )
