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

import cmath
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .activation_jets import ANALYTIC_STRIP
from .activations import Activation
from .quadrature import SERIES_RULE, bivariate_rule, gaussian_rule, unaligned_rule
from .quadrature import clear_cache as quadrature_rules_clear


@dataclass(slots=True)
class LocalStats:
    """Gaussian moments of a transformed activation at q = 1, and the map values they give.

    Slotted and not frozen: a root search makes one per evaluation, and a frozen dataclass sets
    each field through ``object.__setattr__``. Nothing mutates them."""

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


# A phi(alpha z + beta) analytic in a strip of half-width at least this around the real axis (in z)
# is integrated to rounding by the unaligned rule, whose panels are up to 2 wide (tanh with alpha =
# 0.75, strip 2.1: 2.3e-15 of each moment's scale; atan's strip of 1.33 at the same alpha: 1.8e-12).
# Then the rule need not follow the bend -beta / alpha as a root search moves it: each new aligned
# rule costs about 20 us, as much as evaluating phi, phi' and phi'' on it.
UNALIGNED_STRIP = 2.0


def _analytic_in_wide_strip(act: Activation, input_scale: float) -> bool:
    strip = ANALYTIC_STRIP.get(act.jet, 0.0) if act.jet is not None else 0.0
    return strip >= UNALIGNED_STRIP * abs(input_scale)


def moment_rule(act: Activation, input_scale: float, input_shift: float) -> tuple[np.ndarray, np.ndarray]:
    """The rule for the Gaussian moments of phi(input_scale z + input_shift) and its derivatives."""
    if _analytic_in_wide_strip(act, input_scale):
        return unaligned_rule(input_scale)
    return gaussian_rule(_z_kinks(act, input_scale, input_shift), scale=input_scale)


@lru_cache(maxsize=16)
def _node_values(act: Activation, input_scale: float, input_shift: float) -> tuple[np.ndarray, ...]:
    """The rule (z, w) for phi(input_scale z + input_shift) and, on its nodes, phi, d/dz phi and
    d2/dz2 phi: the costly part of ``local_stats``. A root search asks for the same (alpha, beta)
    two or three times in one evaluation (the output shift from E[phi], the output scale from Q(1),
    then the conditions), so the recent ones are kept; read-only, as they are shared.

    The output shift is added node by node where it is used: when it nearly cancels E[phi] (C(0) = 0
    with a near-linear phi) that keeps Q(1) as accurate as the nodes' values allow, which the
    depth-5000 targets need (their per-layer C''(1) of 2e-7 is met to 1e-9 relative)."""
    z, w = moment_rule(act, input_scale, input_shift)
    u = input_scale * z
    u += input_shift
    if act.jet is not None:
        f, d1, d2 = act.jet(u)
        d1 *= input_scale  # a jet's three arrays are new and its own (tests)
        d2 *= input_scale * input_scale
    else:
        f, d1, d2 = act.fn(u), input_scale * act.d1(u), input_scale * input_scale * act.d2(u)
    f.flags.writeable = d1.flags.writeable = d2.flags.writeable = False
    return z, w, f, d1, d2


def clear_caches() -> None:
    """Forget the per-(alpha, beta) node values and quadrature rules: a process that never saw a
    request has none of them, so ``bench/solve_bench.py`` clears them before each timed solve."""
    _node_values.cache_clear()
    quadrature_rules_clear()


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
    return _scaled(_expectations(z, w, f + output_shift, d1, d2), output_scale)


def _expectations(z, w, f, d1, d2) -> np.ndarray:
    """E[f], E[f^2], E[d1], E[d1^2], E[d2^2], E[f d1 z] as one matrix-vector product (a root
    search's evaluations are dominated by numpy's per-call cost on a few hundred nodes; np.array
    builds the matrix in half the time np.stack's argument checks take)."""
    return np.array([f, f * f, d1, d1 * d1, d2 * d2, f * d1 * z]) @ w


def _scaled(m: np.ndarray, scale: float) -> LocalStats:
    """The statistics of ``scale`` times the function whose expectations ``m`` are."""
    c2 = scale * scale
    mean, second, d1_mean, d1_sq, d2_sq, q_slope_1 = m.tolist()
    return LocalStats(scale * mean, c2 * second, scale * d1_mean, c2 * d1_sq, c2 * d2_sq, c2 * q_slope_1)


def shaped_stats(
    act: Activation, input_scale: float, input_shift: float, output_shift: float | None, c_0_target: float = 0.0
) -> tuple[float, float, LocalStats]:
    """(output_shift, output_scale, statistics) of the phi_hat a root-search step proposes.

    The output shift is ``output_shift``, or when that is None the one giving C(0) = ``c_0_target``
    (sqrt(c_0_target) - E[phi]); the output scale gives Q(1) = 1. What ``raw_mean``,
    ``shifted_second`` and ``local_stats`` compute one after the other, from one cache lookup and
    one matrix-vector product: a step's cost is numpy's per-call overhead on ~200 nodes."""
    z, w, f, d1, d2 = _node_values(act, float(input_scale), float(input_shift))
    if output_shift is None:
        output_shift = math.sqrt(c_0_target) - float(w @ f)
    m = _expectations(z, w, f + output_shift, d1, d2)
    # a step far into a saturated phi can make phi + delta vanish on every node: then the scale is
    # infinite and the statistics NaN, which the search rejects (as numpy's 1 / 0 did before)
    scale = 1.0 / math.sqrt(m[1]) if m[1] > 0.0 else math.inf
    return float(output_shift), scale, _scaled(m, scale)


def leaky_relu_c_map(c, negative_slope):
    """Local C map of the normalized Leaky ReLU sqrt(2 / (1 + a^2)) * phi_a (TAT equation 9).

    C(c) = c + (1 - a)^2 / (pi (1 + a^2)) * (sqrt(1 - c^2) - c * arccos(c)); vectorized over c
    and the negative slope a.
    """
    return rectifier_c_map(c, rectifier_k(negative_slope))


def rectifier_k(negative_slope):
    """k = (1 - a)^2 / (pi (1 + a^2)): equation 9's weight of the nonlinear part, C_a(0) itself;
    for a float, an array or (the complex step of ``roots``) a complex a."""
    a = negative_slope
    return (1.0 - a) ** 2 / (math.pi * (1.0 + a * a))


def rectifier_c_map(c, k):
    """c + k (sqrt(1 - c^2) - c arccos c): equation 9 with k = (1 - a)^2 / (pi (1 + a^2)) given.

    A global map applies this once per layer to the whole sample, so it is written with as few
    numpy calls as it takes (np.clip's dispatch alone costs more than the map on 100 points)."""
    c = np.minimum(np.maximum(c, -1.0), 1.0)
    if np.ndim(c) == 0:
        return c + k * (np.sqrt(1.0 - c * c) - c * np.arccos(c))
    return _rectifier_layer(c, k, np.empty_like(c), np.empty_like(c))


def rectifier_chain_map(c: np.ndarray, k, layers: int) -> np.ndarray:
    """``rectifier_c_map`` applied ``layers`` times (a chain's global C map, TAT equation 9 per
    layer), for k broadcast against c: on flat arrays, in two buffers that take turns (about 70
    values in an answer's sample, where a numpy call's overhead is most of its cost)."""
    shape = np.shape(c)
    k = np.broadcast_to(k, shape).ravel()
    c = np.minimum(np.maximum(c, -1.0), 1.0).ravel()
    out, t = np.empty_like(c), np.empty_like(c)
    for _ in range(layers):
        _rectifier_layer(c, k, out, t)
        np.minimum(out, 1.0, out=out)  # C(c) <= 1, C(c) >= C(-1) > -1: only rounding can leave [-1, 1]
        c, out = out, c
    return c.reshape(shape)


def _rectifier_layer(c: np.ndarray, k, out: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``out`` = c + k (sqrt(1 - c^2) - c arccos c) for c in [-1, 1], ``t`` scratch: eight numpy
    calls, no allocation, the outputs passed by position (a few percent of a layer each)."""
    mul, sub = np.multiply, np.subtract
    mul(c, c, out)
    sub(1.0, out, out)
    np.sqrt(out, out)
    np.arccos(c, t)
    mul(t, c, t)
    sub(out, t, out)
    mul(out, k, out)
    np.add(out, c, out)
    return out


def leaky_relu_stats(negative_slope: float, output_scale: float) -> LocalStats:
    """``local_stats`` of output_scale * phi_a, phi_a(x) = max(x, a x), in closed form: for
    z ~ N(0, 1), E[phi_a] = (1 - a) / sqrt(2 pi), E[phi_a^2] = E[phi_a'^2] = E[phi_a phi_a' z] =
    (1 + a^2) / 2, E[phi_a'] = (1 + a) / 2 and phi_a'' = 0 away from the kink (TAT equation 9's
    normalization sqrt(2 / (1 + a^2)) makes Q(1) = Q'(1) = C'(1) = 1)."""
    a, s2 = negative_slope, output_scale * output_scale
    half_norm = 0.5 * (1.0 + a * a)
    return LocalStats(
        mean=output_scale * (1.0 - a) / math.sqrt(2.0 * math.pi),
        second=s2 * half_norm,
        d1_mean=output_scale * 0.5 * (1.0 + a),
        d1_sq=s2 * half_norm,
        d2_sq=0.0,
        q_slope_1=s2 * half_norm,
    )


def leaky_relu_c_map_scalar(c: float, negative_slope: float) -> float:
    """Scalar fast path of ``leaky_relu_c_map`` for the solver's inner loop."""
    c = min(1.0, max(-1.0, c))
    a = negative_slope
    return c + rectifier_k(a) * (math.sqrt(1.0 - c * c) - c * math.acos(c))


def tailored_c_map_complex(c: complex, k: complex) -> complex:
    """Equation 9, C(c) = c + k (sqrt(1 - c^2) - c arccos c) with k = (1 - a)^2 / (pi (1 + a^2)),
    for complex arguments (the complex step of ``roots``); analytic for Re c in (-1, 1)."""
    if c.real >= 1.0:
        return complex(1.0)
    if c.real <= -1.0:
        return -1.0 + k * math.pi
    return c + k * (cmath.sqrt(1.0 - c * c) - c * cmath.acos(c))


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


_QUIET_BELOW = 1e-22
_QUIET_RUN = 4
_WIDE_RULE_TERMS = 24


_BLOCK = 8  # Hermite polynomials built between two checks for a quiet series


def _hermite_coefficients(act, rule, input_scale, input_shift, output_scale, output_shift, terms, trial=False):
    """(a_0 .. a_{terms-1}, Q(1)) of phi_hat on ``rule``; on a ``trial``, None unless the series
    goes quiet within ``terms`` (the caller then uses a finer rule).

    The orthonormal Hermite polynomials come from their three-term recurrence, h_{k+1} =
    (z h_k - sqrt(k) h_{k-1}) / sqrt(k + 1), written into the rows of one matrix a block at a
    time, and each block's coefficients from one matrix-vector product: four numpy calls a term,
    where a dot product and a slice test per term took ten."""
    z, w = rule
    f = output_scale * (act.fn(input_scale * z + input_shift) + output_shift)
    second = float(w @ (f * f))
    coef = np.zeros(terms)
    wf = w * f
    quiet = _QUIET_BELOW * second
    h = np.empty((terms, len(z)))
    rows = list(h)
    rows[0][:] = 1.0
    if terms > 1:
        rows[1][:] = z
    mul = np.multiply
    for start in range(0, terms, _BLOCK):
        stop = min(start + _BLOCK, terms)
        for k in range(max(start, 2), stop):  # rows 0 and 1 are set
            row = mul(z, rows[k - 1], rows[k])
            row -= _SQRT_F[k - 1] * rows[k - 2]
            row *= _INV_SQRT_F[k]
        coef[start:stop] = h[start:stop] @ wf
        # a smooth phi_hat's a_k^2 fall geometrically (every other one is 0 for an odd or even
        # phi_hat): once _QUIET_RUN of them in a row are below 1e-22 Q(1), the rest is far
        # below what _trimmed folds anyway, so the series stops there (after ~20 terms, not 96)
        for k in range(max(start, _QUIET_RUN), stop):
            if all(a * a < quiet for a in coef[k - _QUIET_RUN + 1 : k + 1].tolist()):
                coef[k + 1 :] = 0.0
                return coef, second
    return None if trial else (coef, second)


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
        found = None
        if _analytic_in_wide_strip(act, input_scale):
            # the moments' ~200-node rule resolves h_k up to about k = 24 (tests: within 2e-15 of
            # the series rule); a phi_hat whose series has gone quiet by then needs nothing finer
            found = _hermite_coefficients(
                act,
                moment_rule(act, input_scale, input_shift),
                input_scale,
                input_shift,
                output_scale,
                output_shift,
                min(terms, _WIDE_RULE_TERMS),
                trial=True,
            )
        if found is None:
            widest, tail = SERIES_RULE
            rule = gaussian_rule(_z_kinks(act, input_scale, input_shift), scale=input_scale, widest=widest, tail=tail)
            found = _hermite_coefficients(act, rule, input_scale, input_shift, output_scale, output_shift, terms)
        coef, second = found
        power = coef**2
        rest = max(0.0, second - float(power.sum()))
        self.tail = 2.0 * rest / second
        self.coefficients = _trimmed(power / second, rest / second)
        self._buffer: dict[int, np.ndarray] = {}  # the powers of c, per sample size (one thread per map)
        self._rising = np.ascontiguousarray(self.coefficients[1:])  # of c, c^2, ..

    def __call__(self, c):
        """C(c), elementwise for an array: the powers c, c^2, .. from one cumulative product down a
        buffer holding c in every row, then one matrix-vector product with the coefficients. A
        global map calls this once per layer on a ~35-point sample, where numpy's per-call cost is
        what counts: four calls, whatever the number of terms (Horner takes two a term, blocks of
        Paterson-Stockmeyer about 2 sqrt(terms)).

        An array is not clipped to [-1, 1]: the map is a polynomial, finite everywhere, with
        non-negative coefficients summing to 1, so it maps [-1, 1] into itself up to rounding."""
        coef = self.coefficients
        if np.ndim(c) != 1 or len(coef) == 1:
            return np.polynomial.polynomial.polyval(np.clip(c, -1.0, 1.0), coef)
        powers = self._buffer.get(len(c))
        if powers is None:
            powers = self._buffer[len(c)] = np.empty((len(coef) - 1, len(c)))
        return _apply_polynomial(coef, c, 1, powers, self._rising)

    def iterate(self, c: np.ndarray, layers: int) -> np.ndarray:
        """C applied ``layers`` times to a 1-D array (a chain's global C map).

        A deep chain with a short series runs through C∘C∘C∘C (``self_composed`` twice: about as
        many terms as C, its coefficients exact up to rounding) a quarter as many times: a layer of the
        sample costs four numpy calls whatever the number of terms, and the two compositions cost
        less than the three quarters of the layers they save. Within a few 1e-15 of the layer by
        layer map (the tests), as close to the exact composition of the coefficients as it."""
        coef = self.coefficients
        c = np.array(c, dtype=float)
        if len(coef) == 1 or c.ndim != 1:
            for _ in range(layers):
                c = self(c)
            return c
        if layers >= _COMPOSE_FROM and len(coef) <= _COMPOSE_TERMS:
            c = _apply_polynomial(self_composed(self_composed(coef)), c, layers // 4)
            layers %= 4
        return _apply_polynomial(coef, c, layers)


# A chain's global map runs through C^4 from this many layers, when C has at most this many terms:
# a near-linear phi_hat (DKS, TAT: C'(1) = zeta^(1/L) or 1), whose C^4 is about as short as C. A
# long series (a far from linear phi_hat) composes into a long one whose rounding the next layers
# amplify; it is run layer by layer.
_COMPOSE_FROM = 16
_COMPOSE_TERMS = 24


def self_composed(coef: np.ndarray) -> np.ndarray:
    """The coefficients of C∘C for C(c) = sum_k coef[k] c^k with non-negative coefficients summing
    to 1 (a ``HermiteCMap``'s): sum_k coef[k] C^k, the powers by convolution. Sums and products of
    non-negative numbers only, so each coefficient is exact to a few rounding errors; the tail is
    folded as ``_trimmed`` folds a series (C∘C(1) = 1 is kept)."""
    out = np.zeros((len(coef) - 1) ** 2 + 1)
    out[0] = coef[0]
    power = np.ones(1)
    for k in range(1, len(coef)):
        power = np.convolve(power, coef)
        out[: len(power)] += coef[k] * power
    return _trimmed(out, 0.0)


def _apply_polynomial(
    coef: np.ndarray, c: np.ndarray, times: int, powers: np.ndarray | None = None, rising: np.ndarray | None = None
) -> np.ndarray:
    """sum_k coef[k] c^k applied ``times`` times to a 1-D array: the powers from one cumulative
    product down a buffer (``powers``, len(coef) - 1 rows) holding c in every row, then one
    matrix-vector product with ``rising`` = coef[1:], contiguous."""
    if times == 0:
        return c
    if len(coef) == 1:
        return np.full_like(c, coef[0])
    if powers is None:
        powers = np.empty((len(coef) - 1, len(c)))
    if rising is None:
        rising = np.ascontiguousarray(coef[1:])
    accumulate, const = np.multiply.accumulate, coef[0]
    for _ in range(times):
        powers[:] = c
        accumulate(powers, 0, None, powers)
        c = rising @ powers
        c += const
    return c


# the Hermite recurrence's scalars sqrt(k) and 1 / sqrt(k), as Python floats
_SQRT_F = [math.sqrt(k) for k in range(200)]
_INV_SQRT_F = [1.0 / r if r > 0.0 else 1.0 for r in _SQRT_F]

# Coefficients whose whole suffix sums to less than this are folded into one term: on [-1, 1] that
# moves C(c) by at most twice the folded mass, far below double precision's 1e-16 on C(c) ~ 1.
_FOLD_BELOW = 1e-18


def _trimmed(series: np.ndarray, rest: float) -> np.ndarray:
    """The series' coefficients with its negligible tail folded into a single last term, which
    also carries the truncation remainder ``rest`` (so C(1) = 1 still holds exactly): a smooth
    activation's a_k^2 decay geometrically, so about 15 of the 97 terms remain, and every
    evaluation of the map costs that much less.

    The remainder is left out of the test for what is negligible: for a smooth phi_hat it is the
    rounding of Q(1) - sum a_k^2 (about 1e-16), which would otherwise keep every term. Moving it
    from c^terms to a lower power changes C(c) by at most 2 rest on [-1, 1], the accuracy ``tail``
    reports anyway."""
    suffix = np.cumsum(series[::-1])[::-1]
    keep = int(np.count_nonzero(suffix >= _FOLD_BELOW))
    if keep >= len(series):
        return np.append(series, rest)
    return np.append(series[:keep], suffix[keep] + rest)
