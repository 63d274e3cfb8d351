"""Local Q and C maps of one nonlinear layer, and their derivatives at q = 1 and c = 0, 1.

For the transformed activation phi_hat(x) = gamma * (phi(alpha * x + beta) + delta) (the dks
convention: gamma = output_scale, alpha = input_scale, beta = input_shift, delta = output_shift),
with z ~ N(0, 1) (TAT paper section 2.2 and Appendix A.3-A.4):

    Q(1)   = E[phi_hat(z)^2]                         (equation 4 at q = 1; 15)
    Q'(1)  = E[phi_hat(z) phi_hat'(z) z]             (16, first line)
    C(0)   = E[phi_hat(z)]^2 / Q(1)                  (19 with i = 0)
    C'(1)  = E[phi_hat'(z)^2] / Q(1)                 (18 with i = 1, c = 1)
    C'(0)  = E[phi_hat'(z)]^2 / Q(1)                 (19 with i = 1)
    C''(1) = E[phi_hat''(z)^2] / Q(1)                (18 with i = 2, c = 1)

All are one-dimensional expectations, taken with the exact derivatives of phi (no finite
differences) and the kink-aware rule of ``quadrature``. C(c) for c in (-1, 1) needs a
two-dimensional expectation (equation 5) except for the Leaky ReLU family, whose closed form is
equation 9.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .activations import Activation
from .quadrature import bivariate_rule, gaussian_rule


@dataclass(frozen=True)
class LocalStats:
    """Gaussian moments of a transformed activation at q = 1, and the map values they give."""

    mean: float  # E[phi_hat]
    second: float  # E[phi_hat^2] = Q(1)
    d1_mean: float  # E[phi_hat']
    d1_sq: float  # E[phi_hat'^2]
    d2_sq: float  # E[phi_hat''^2]
    q_slope_1: float  # Q'(1) = E[phi_hat phi_hat' z]

    @property
    def q_1(self) -> float:
        return self.second

    @property
    def c_0(self) -> float:
        return self.mean**2 / self.second

    @property
    def c_slope_0(self) -> float:
        return self.d1_mean**2 / self.second

    @property
    def c_slope_1(self) -> float:
        return self.d1_sq / self.second

    @property
    def c_curv_1(self) -> float:
        return self.d2_sq / self.second


def _z_kinks(act: Activation, input_scale: float, input_shift: float) -> list[float]:
    """Where phi(input_scale z + input_shift) kinks, or for a smooth phi, bends (at its input 0)."""
    if input_scale == 0:
        return []
    return [(k - input_shift) / input_scale for k in (act.kinks or (0.0,))]


@lru_cache(maxsize=16)
def _node_values(act: Activation, input_scale: float, input_shift: float) -> tuple[np.ndarray, ...]:
    """The rule (z, w) for phi(input_scale z + input_shift) and, on its nodes, phi, d/dz phi and
    d2/dz2 phi: the costly part of ``local_stats``. A root search asks for the same (alpha, beta)
    two or three times in one evaluation (the output shift from E[phi], the output scale from Q(1),
    then the conditions), so the recent ones are kept; read-only, as they are shared."""
    z, w = gaussian_rule(_z_kinks(act, input_scale, input_shift), scale=input_scale)
    u = input_scale * z + input_shift
    out = (z, w, act.fn(u), input_scale * act.d1(u), input_scale**2 * act.d2(u))
    for a in out[2:]:
        a.flags.writeable = False
    return out


def raw_mean(act: Activation, input_scale: float, input_shift: float) -> float:
    """E[phi(input_scale z + input_shift)]: what the output shift cancels."""
    _, w, f, _, _ = _node_values(act, float(input_scale), float(input_shift))
    return float(w @ f)


def shifted_second(act: Activation, input_scale: float, input_shift: float, output_shift: float) -> float:
    """E[(phi(input_scale z + input_shift) + output_shift)^2]: Q(1) before the output scale."""
    _, w, f, _, _ = _node_values(act, float(input_scale), float(input_shift))
    g = f + output_shift
    return float(w @ (g * g))


def local_stats(
    act: Activation,
    input_scale: float = 1.0,
    input_shift: float = 0.0,
    output_scale: float = 1.0,
    output_shift: float = 0.0,
) -> LocalStats:
    """All the q = 1 quantities of phi_hat from one pass of the quadrature rule."""
    z, w, f, d1, d2 = _node_values(act, float(input_scale), float(input_shift))
    f = output_scale * (f + output_shift)
    d1 = output_scale * d1
    d2 = output_scale * d2
    return LocalStats(
        mean=float(w @ f),
        second=float(w @ (f * f)),
        d1_mean=float(w @ d1),
        d1_sq=float(w @ (d1 * d1)),
        d2_sq=float(w @ (d2 * d2)),
        q_slope_1=float(w @ (f * d1 * z)),
    )


def leaky_relu_c_map(c, negative_slope):
    """Local C map of the normalized Leaky ReLU sqrt(2 / (1 + a^2)) * phi_a (TAT equation 9).

    C(c) = c + (1 - a)^2 / (pi (1 + a^2)) * (sqrt(1 - c^2) - c * arccos(c)); vectorized over c
    and the negative slope a.
    """
    c = np.clip(c, -1.0, 1.0)
    a = negative_slope
    k = (1.0 - a) ** 2 / (np.pi * (1.0 + a * a))
    return c + k * (np.sqrt(1.0 - c * c) - c * np.arccos(c))


def leaky_relu_c_map_scalar(c: float, negative_slope: float) -> float:
    """Scalar fast path of ``leaky_relu_c_map`` for the solver's inner loop."""
    c = min(1.0, max(-1.0, c))
    a = negative_slope
    return c + (1.0 - a) ** 2 / (math.pi * (1.0 + a * a)) * (math.sqrt(1.0 - c * c) - c * math.acos(c))


def c_map(phi, c, q: float = 1.0, second: float | None = None):
    """Local C map C(c, q, q) of an elementwise ``phi`` (TAT equation 5), vectorized over c.

    E[phi(u) phi(v)] / E[phi(u)^2] with (u, v) centred Gaussian of variance q and correlation c,
    by a fixed tensor rule: about 1e-12 for smooth phi, about 1e-4 for kinked ones (the kink line
    of phi(v) cuts across the panels). Answers use ``HermiteCMap``; this is the independent
    two-dimensional check the tests compare it with.
    """
    c = np.atleast_1d(np.asarray(c, dtype=float))
    z1, z2, w = bivariate_rule()
    sq = np.sqrt(q)
    f1 = phi(sq * z1)
    if second is None:
        zz, ww = gaussian_rule()
        second = float(ww @ phi(sq * zz) ** 2)
    out = np.empty_like(c)
    for i, ci in enumerate(np.clip(c, -1.0, 1.0)):
        v = sq * (ci * z1 + np.sqrt(max(0.0, 1.0 - ci * ci)) * z2)
        out[i] = (w @ (f1 * phi(v))) / second
    return out


class HermiteCMap:
    """The local C map of phi_hat as its Hermite (Mehler) series, from one 1-D quadrature pass.

    With a_k = E[phi_hat(z) h_k(z)] for the orthonormal Hermite polynomials h_k = He_k / sqrt(k!),
    E[phi_hat(u) phi_hat(v)] = sum_k a_k^2 c^k for unit-variance u, v with correlation c, and
    Q(1) = sum_k a_k^2 (this is why C is a positive definite function, TAT Appendix A.4). The
    series is cut at ``terms``; its tail R = Q(1) - sum a_k^2 >= 0 is put on c^terms so C(1) = 1
    exactly and |error| <= 2 R / Q(1) on [-1, 1]. ``tail`` reports that bound.
    """

    def __init__(
        self,
        act: Activation,
        input_scale: float = 1.0,
        input_shift: float = 0.0,
        output_scale: float = 1.0,
        output_shift: float = 0.0,
        terms: int = 96,
    ):
        z, w = gaussian_rule(_z_kinks(act, input_scale, input_shift), scale=input_scale)
        f = output_scale * (act.fn(input_scale * z + input_shift) + output_shift)
        second = float(w @ (f * f))
        coef = np.empty(terms)
        h_prev, h = np.zeros_like(z), np.ones_like(z)
        for k in range(terms):
            coef[k] = float(w @ (f * h))
            h_prev, h = h, (z * h - np.sqrt(k) * h_prev) / np.sqrt(k + 1)
        power = coef**2
        rest = max(0.0, second - float(power.sum()))
        self.tail = 2.0 * rest / second
        self.coefficients = _trimmed(np.append(power, rest) / second)

    def __call__(self, c):
        """C(c), elementwise for an array: every power of c from one cumulative product and one
        dot product (a global map calls this once per layer, so no Python loop over terms)."""
        coef = self.coefficients
        if np.ndim(c) != 1 or len(coef) == 1:
            return np.polynomial.polynomial.polyval(np.clip(c, -1.0, 1.0), coef)
        powers = np.repeat(np.minimum(np.maximum(c, -1.0), 1.0)[None], len(coef) - 1, axis=0)
        np.multiply.accumulate(powers, axis=0, out=powers)
        return coef[0] + coef[1:] @ powers


# Coefficients whose whole suffix sums to less than this are folded into one term: on [-1, 1] that
# moves C(c) by at most twice the folded mass, far below double precision's 1e-16 on C(c) ~ 1.
_FOLD_BELOW = 1e-18


def _trimmed(coefficients: np.ndarray) -> np.ndarray:
    """The series with its negligible tail folded into a single last term (C(1) = 1 still holds
    exactly): a smooth activation's a_k^2 decay geometrically, so about 15 of the 97 terms remain,
    and every evaluation of the map costs that much less."""
    suffix = np.cumsum(coefficients[::-1])[::-1]
    keep = int(np.count_nonzero(suffix >= _FOLD_BELOW))
    if keep >= len(coefficients) - 1:
        return coefficients
    return np.append(coefficients[:keep], suffix[keep])
