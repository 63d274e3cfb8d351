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

from dataclasses import dataclass

import numpy as np

from ..errors import SigpropError
from .activations import get_activation
from .qc_maps import local_stats, raw_mean, shifted_second
from .transform import ABSOLUTE_FLOOR, NUM_TRIES, RESIDUAL_TOL, TransformSolution, _root, starting_points

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
        if not np.all(np.isfinite(p)) or np.any(np.abs(p) > 1e3):
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


def solve_rectifier(
    name: str, c_slope_1: float, q_slope_1: float = 1.0, num_tries: int = NUM_TRIES
) -> TransformSolution:
    """The first root from dks's starting points, polished; raise ``unreachable_target`` if none converges."""
    prob = problem(name, c_slope_1, q_slope_1)
    tol = max(RESIDUAL_TOL * abs(c_slope_1 - 1.0), ABSOLUTE_FLOOR)
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
    what = "C'(1)" if prob.q_slope_1 is None else f"C'(1) = {c_slope_1:.6g} with Q'(1)"
    raise SigpropError(
        "unreachable_target",
        f"no transformation of '{name}' reaches the per-layer target {what} = "
        f"{c_slope_1 if prob.q_slope_1 is None else q_slope_1:.6g} (searched {attempt} starting points)",
        "use a smaller zeta or a deeper network",
    )
