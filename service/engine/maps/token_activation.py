"""An elementwise activation on a whole token kernel: K'_ij = E[phi(u) phi(v)] with (u, v) ~ N(0,
[[K_ii, K_ij], [K_ij, K_jj]]), exactly, for diagonals that differ from token to token.

"Deep Transformers without Shortcuts" (He, Martens et al., arXiv:2302.10322) section 2 propagates
the kernel matrix of a sequence through an MLP block by this dual kernel. Its diagonals are not all
equal once E-SPA's location-dependent rescaling D and the C maps' f(c) >= c have acted, so the
scalar C map of "Rapid training of deep neural networks without skip connections or
normalization layers using Deep Kernel Shaping" / TAT (q = 1 for every input) is not enough.
Four exact routes, by what phi is:

- positively homogeneous phi (relu, leaky_relu, TAT's sqrt(2 / (1 + a^2)) phi_a, any transformation
  without shifts): phi(x) = r x for x > 0 and l x for x < 0, so E[phi(u) phi(v)] =
  sqrt(K_ii K_jj) (r^2 + l^2) / 2 * C(c) with C the closed form of TAT's equation 9 (the arc-cosine
  kernel), k = (r - l)^2 / (pi (r^2 + l^2)) and c = K_ij / sqrt(K_ii K_jj) (``qc_maps.rectifier_c_map``);
- other continuous piecewise-linear phi (DKS's shifted ReLU, relu_tau, soft_threshold, crelu, cst):
  phi(x) = b + s_0 x + sum_k J_k (x - x_k)_+, and E[(u - x)_+ (v - y)_+] is a closed form in the
  bivariate normal orthant probability (``bivariate_normal``: Owen's T function);
- otherwise the Mehler (Hermite) series with a coefficient vector per token: with a_k(q) =
  E[phi(sqrt(q) z) h_k(z)], h_k = He_k / sqrt(k!), E[phi(u) phi(v)] = sum_k a_k(K_ii) a_k(K_jj) c^k
  (the series ``qc_maps.HermiteCMap`` sums at q = 1; its coefficients come from the same code).
  Its truncation after K terms errs by at most |c|^K sqrt(R_i R_j), R_i = E[phi^2] - sum_k a_k^2;
- the pairs where that bound exceeds the tolerance (|c| near 1 for elu, selu or softsign, whose
  kinks make the series converge slowly) are integrated directly: E over u of phi(u) E[phi(v) | u],
  the inner expectation by a composite Gauss-Legendre rule split at phi's kinks (in closed form,
  E[(m + s Z - x)_+] = d Phi(d / s) + s phi(d / s) with d = m - x, for a piecewise-linear phi:
  ``pair_expectation`` serves as an independent check of the closed forms), the outer one by
  ``quadrature.gaussian_rule`` split at the kinks and bends of both factors.

The series' diagonal is E[phi(sqrt(K_ii) z)^2] from the one-dimensional rule. Accuracy (tests,
against nested ``scipy.integrate.quad``): 1e-10 or better at q in [0.2, 5], |c| up to 0.99999.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtr

from ...errors import SigpropError
from .activations import Activation
from .bivariate_normal import normal_pdf, ramp_pair, token_correlations
from .qc_maps import _hermite_coefficients, rectifier_c_map
from .quadrature import SERIES_RULE, TAIL, _legendre, gaussian_rule
from .token_exponential import elu_family, elu_family_kernel

__all__ = [
    "activation_token_kernel",
    "activation_token_mean",
    "homogeneous_slopes",
    "TOLERANCE",
    "MAX_INTEGRATED_PAIRS",
]

# a pair's series is summed directly when its truncation bound is below this, relative to
# sqrt(E[phi(u)^2] E[phi(v)^2]); others are integrated
TOLERANCE = 1e-12
# the ELU family's closed form up to this standard deviation of its exponent (``activation_token_kernel``)
TILT_LIMIT = 25.0
# at most this many pairs integrated directly in one call (about 2 ms each; ``activation_token_kernel``)
MAX_INTEGRATED_PAIRS = 4096
SERIES_TERMS = 96
# the inner rule of a pair integrated directly: each piece between phi's kinks in equal panels
INNER_PANELS = 10
INNER_NODES = 10
_SQRT_2PI = math.sqrt(2.0 * math.pi)


def _square(k) -> np.ndarray:
    k = np.asarray(k, dtype=np.float64)
    if k.ndim != 2 or k.shape[0] != k.shape[1]:
        raise ValueError(f"a token kernel is a square T x T matrix, got shape {k.shape}")
    if not np.all(np.isfinite(k)) or np.any(np.diag(k) < 0.0):
        raise ValueError("a token kernel needs finite entries and a non-negative diagonal")
    return 0.5 * (k + k.T)  # the maps below are entrywise: an exactly symmetric input keeps them so


def homogeneous_slopes(act: Activation) -> tuple[float, float] | None:
    """(r, l) with phi(x) = r x for x > 0 and l x for x < 0 when phi is positively homogeneous
    (phi(t x) = t phi(x), t >= 0: then phi is fixed by phi(1) and phi(-1)); None otherwise."""
    if not act.positively_homogeneous:
        return None
    ends = np.asarray(act.fn(np.array([1.0, -1.0])), dtype=float)
    return float(ends[0]), float(-ends[1])


def activation_token_kernel(
    k, act: Activation, *, tolerance: float = TOLERANCE, max_integrated_pairs: int | None = MAX_INTEGRATED_PAIRS
) -> np.ndarray:
    """K'_ij = E[phi(u) phi(v)], (u, v) ~ N(0, [[K_ii, K_ij], [K_ij, K_jj]]) (module docstring);
    ``act`` the transformed activation (``token_kernels.answer_activation``). Add a dense layer's
    bias variance to K before, as the layer does.

    Raises ``SigpropError("graph_too_large")`` when more than ``max_integrated_pairs`` token pairs
    (None: no limit) would need the direct integration, about 2 ms each: a phi with a kink that is
    neither piecewise linear nor positively homogeneous (elu, selu, softsign) on strongly
    correlated tokens (E-SPA's |c| near 1), where the Hermite series converges slowly."""
    k = _square(k)
    slopes = homogeneous_slopes(act)
    if slopes is not None:
        return _homogeneous_kernel(k, *slopes)
    pl = _piecewise_linear(act)
    if pl is not None:
        return _piecewise_linear_kernel(k, pl)
    fam = elu_family(act)
    # the tilts e^{m + s^2 / 2} times probabilities of order e^{-s^2 / 2}: both representable while
    # the exponent's standard deviation s = |a| sqrt(K_ii) stays below TILT_LIMIT
    if fam is not None and abs(fam.slope) * math.sqrt(float(np.max(np.diag(k)))) <= TILT_LIMIT:
        return elu_family_kernel(k, fam)
    return _series_kernel(k, act, tolerance, max_integrated_pairs)


def activation_token_mean(q, act: Activation) -> np.ndarray:
    """Per token E[phi(sqrt(q_i) z)], z ~ N(0, 1): the feature mean after the activation at
    infinite width (what layer normalization subtracts)."""
    q = np.asarray(q, dtype=np.float64)
    if q.ndim != 1 or np.any(q < 0.0) or not np.all(np.isfinite(q)):
        raise ValueError("activation_token_mean takes the non-negative diagonal of a token kernel")
    roots = np.sqrt(q)
    slopes = homogeneous_slopes(act)
    if slopes is not None:
        return roots * (slopes[0] - slopes[1]) / _SQRT_2PI
    unique, inverse = np.unique(roots, return_inverse=True)
    means = np.empty(len(unique))
    for n, root in enumerate(unique.tolist()):
        if root == 0.0:
            means[n] = float(act.fn(np.zeros(1))[0])
            continue
        z, w = gaussian_rule(_z_kinks(act, root), scale=root)
        means[n] = float(w @ act.fn(root * z))
    return means[inverse]


def _homogeneous_kernel(k: np.ndarray, right: float, left: float) -> np.ndarray:
    """sqrt(K_ii K_jj) (r^2 + l^2) / 2 * C(c_ij), C TAT's equation 9 with k = (r - l)^2 / (pi (r^2 + l^2))."""
    total = right * right + left * left
    if total == 0.0:
        return np.zeros_like(k)
    norm, c = token_correlations(k)
    out = (0.5 * total) * norm * rectifier_c_map(c, (right - left) ** 2 / (math.pi * total))
    np.fill_diagonal(out, 0.5 * total * np.diag(k))  # C(1) = 1: exact
    return out


def _z_kinks(act: Activation, root: float) -> list[float]:
    """phi(root z)'s kinks in z."""
    return [x / root for x in act.kinks]


def _token_series(act: Activation, root: float) -> tuple[np.ndarray, float]:
    """(a_0 .. a_(K-1), E[phi^2]) of phi(root z), from ``qc_maps``' Hermite coefficients."""
    if root == 0.0:
        coef = np.zeros(SERIES_TERMS)
        coef[0] = float(act.fn(np.zeros(1))[0])
        return coef, coef[0] ** 2
    widest, tail = SERIES_RULE
    rule = gaussian_rule(_z_kinks(act, root), scale=root, widest=widest, tail=tail)
    return _hermite_coefficients(act, rule, root, 0.0, 1.0, 0.0, SERIES_TERMS)


def _hermite_rows(z: np.ndarray, terms: int) -> np.ndarray:
    """h_0(z) .. h_(terms-1)(z), h_k = He_k / sqrt(k!), by the three-term recurrence."""
    h = np.empty((terms, len(z)))
    h[0] = 1.0
    if terms > 1:
        h[1] = z
    for k in range(2, terms):
        h[k] = (z * h[k - 1] - math.sqrt(k - 1) * h[k - 2]) / math.sqrt(k)
    return h


def _shared_series(act: Activation, roots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``_token_series`` for many tokens on one rule: valid when phi's kinks are all at 0 (or it
    has none), so that phi(root z) kinks at the same z for every root; the rule's panels are as
    fine as the largest root needs."""
    widest, tail = SERIES_RULE
    z, w = gaussian_rule([0.0] if act.kinks else [], scale=float(roots.max()), widest=widest, tail=tail)
    f = np.asarray(act.fn(roots[:, None] * z[None, :]), dtype=float)  # (tokens, nodes)
    wf = f * w[None, :]
    return wf @ _hermite_rows(z, SERIES_TERMS).T, np.einsum("tn,tn->t", wf, f)


def _series(act: Activation, roots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token the Hermite coefficients (T, K) and E[phi^2] (T,), each distinct root once."""
    unique, inverse = np.unique(roots, return_inverse=True)
    if all(x == 0.0 for x in act.kinks) and unique[0] > 0.0:
        coef, second = _shared_series(act, unique)
    else:
        series = [_token_series(act, r) for r in unique.tolist()]
        coef, second = np.array([s[0] for s in series]), np.array([s[1] for s in series])
    # the terms after the last that matters for any token (a smooth phi's a_k^2 fall geometrically)
    big = np.nonzero(np.any(coef * coef > _NEGLIGIBLE * second[:, None], axis=0))[0]
    coef = coef[:, : (big[-1] + 1 if len(big) else 1)]
    return coef[inverse], second[inverse]


# a Hermite coefficient with a_k^2 below this fraction of E[phi^2] for every token is left out
# (its mass stays in the truncation bound)
_NEGLIGIBLE = 1e-24


def _series_kernel(k: np.ndarray, act: Activation, tolerance: float, max_pairs: int | None) -> np.ndarray:
    t = k.shape[0]
    roots = np.sqrt(np.diag(k))
    coef, second = _series(act, roots)
    rest = np.maximum(second - np.einsum("ik,ik->i", coef, coef), 0.0)
    _, c = token_correlations(k)
    out = np.zeros((t, t))
    power = np.ones((t, t))
    for n in range(coef.shape[1]):
        column = coef[:, n]
        if np.any(column):
            out += np.outer(column, column) * power
        power *= c
    # the truncated tail: |sum_(n >= K) a_n(i) a_n(j) c^n| <= |c|^K sqrt(R_i R_j) (Cauchy-Schwarz)
    bound = np.abs(power) * np.sqrt(np.outer(rest, rest))
    slow = bound > tolerance * np.sqrt(np.outer(second, second))
    rows, cols = np.nonzero(np.triu(slow, 1))
    if max_pairs is not None and len(rows) > max_pairs:
        raise SigpropError(
            "graph_too_large",
            f"the token kernel after activation '{act.name}' needs {len(rows)} token pairs integrated one by one "
            f"(its Hermite series converges slowly on strongly correlated tokens), more than the limit of {max_pairs}",
            "use a shorter sequence (T tokens make T (T - 1) / 2 pairs), or an activation whose token kernel has a "
            "closed form (relu, leaky_relu, the piecewise-linear ones) or an analytic one (tanh, gelu, swish, ...)",
        )
    for i, j in zip(rows, cols, strict=True):
        out[i, j] = out[j, i] = pair_expectation(act, float(roots[i]), float(roots[j]), float(c[i, j]))
    np.fill_diagonal(out, second)
    return out


# --------------------------------------------------------------------------- piecewise linear


def _piecewise_linear_kernel(k: np.ndarray, pl) -> np.ndarray:
    """E[phi(u) phi(v)] in closed form for phi(x) = b + s_0 x + g(x), g = sum_k J_k (x - x_k)_+:
    b^2 + b (E g(u) + E g(v)) + s_0^2 K_ij + s_0 K_ij (E g'(u) + E g'(v)) + E[g(u) g(v)] (Stein's
    lemma for E[u g(v)] = K_ij E[g'(v)]), E[g(u) g(v)] = sum_kl J_k J_l sigma_i sigma_j
    E[(X - h_ki)_+ (Y - h_lj)_+] with h_ki = x_k / sigma_i (``bivariate_normal.ramp_pair``)."""
    b, s0, xs, jumps = pl
    sigma = np.sqrt(np.diag(k))
    norm, rho = token_correlations(k)
    live = sigma > 0.0
    # h = x_k / sigma_i; a placeholder 0 for a constant token (sigma = 0), whose terms are taken apart
    h = np.where(live[None, :], xs[:, None] / np.where(live, sigma, 1.0)[None, :], 0.0)
    # per token: E g(u) = sum_k J_k sigma (phi(h) - h Q(h)), E g'(u) = sum_k J_k Q(h) (sigma = 0: g(0), g'(0))
    ramp_mean = np.where(live[None, :], sigma[None, :] * (normal_pdf(h) - h * ndtr(-h)), np.maximum(-xs, 0.0)[:, None])
    g_mean = jumps @ ramp_mean
    g_slope = jumps @ np.where(live[None, :], ndtr(-h), (xs < 0.0)[:, None].astype(float))
    out = b * b + b * (g_mean[:, None] + g_mean[None, :]) + s0 * s0 * k + s0 * k * (g_slope[:, None] + g_slope[None, :])
    # E[g(u) g(v)] on the upper triangle only (the kernel is symmetric), then mirrored
    rows, cols = np.triu_indices(len(sigma))
    both = live[rows] & live[cols]
    pairs = np.zeros(len(rows))
    for n, jn in enumerate(jumps.tolist()):
        for m, jm in enumerate(jumps.tolist()):
            term = norm[rows, cols] * ramp_pair(h[n][rows], h[m][cols], rho[rows, cols])
            # a constant token (sigma = 0) is g(0) times the other token's E g: independent factors
            pairs += jn * jm * np.where(both, term, ramp_mean[n][rows] * ramp_mean[m][cols])
    upper = np.zeros_like(out)
    upper[rows, cols] = pairs
    out += upper + np.triu(upper, 1).T
    return 0.5 * (out + out.T)


# --------------------------------------------------------------------------- one pair, directly


def _piecewise_linear(act: Activation) -> tuple[float, float, np.ndarray, np.ndarray] | None:
    """phi(x) = b + s_0 x + sum_k jump_k (x - x_k)_+ as (b, s_0, x_k, jump_k) for a continuous
    piecewise-linear phi (checked at test points); None for any other phi."""
    if act.smooth:
        return None
    xs = np.array(sorted(act.kinks), dtype=float)
    if len(xs) == 0:
        probe = np.array([-1.0, 1.0])
        ends = act.fn(probe)
        s0 = float(ends[1] - ends[0]) / 2.0
        return float(ends[1]) - s0, s0, xs, np.zeros(0)
    inner = (xs[:-1] + xs[1:]) / 2.0
    mids = np.concatenate([[xs[0] - 1.0], inner, [xs[-1] + 1.0]])
    slopes = np.asarray(act.d1(mids), dtype=float)
    s0 = float(slopes[0])
    b = float(act.fn(np.array([mids[0]]))[0]) - s0 * mids[0]
    jumps = np.diff(slopes)
    probe = np.concatenate([mids, xs, xs[-1:] + 3.0, xs[:1] - 3.0])
    fitted = b + s0 * probe + np.maximum(probe[:, None] - xs[None, :], 0.0) @ jumps
    scale = 1.0 + np.max(np.abs(fitted))
    if np.max(np.abs(fitted - act.fn(probe))) > 1e-12 * scale:
        return None  # a jump in phi itself (none in the catalogue): the generic rule takes it
    return b, s0, xs, jumps


def _inner_piecewise_linear(pl, m: np.ndarray, sigma: float) -> np.ndarray:
    """E[phi(m + sigma Z)], Z ~ N(0, 1), for the piecewise-linear phi ``pl``: each ramp
    (x - x_k)_+ gives d Phi(d / sigma) + sigma phi(d / sigma), d = m - x_k."""
    b, s0, xs, jumps = pl
    out = b + s0 * m
    if len(xs) == 0:
        return out
    d = m[:, None] - xs[None, :]
    if sigma == 0.0:
        return out + np.maximum(d, 0.0) @ jumps
    r = d / sigma
    ramp = d * ndtr(r) + sigma * np.exp(-0.5 * r * r) / _SQRT_2PI
    return out + ramp @ jumps


def _inner_quadrature(act: Activation, m: np.ndarray, sigma: float) -> np.ndarray:
    """E[phi(m + sigma Z)] for each m: Z on [-TAIL, TAIL] in pieces split at phi's kinks
    (x_k - m) / sigma, each in INNER_PANELS equal panels of an INNER_NODES-point Legendre rule."""
    if sigma == 0.0:
        return np.asarray(act.fn(m), dtype=float)
    cuts = np.sort(np.clip((np.array(act.kinks)[None, :] - m[:, None]) / sigma, -TAIL, TAIL), axis=1)
    edges = np.concatenate([np.full((len(m), 1), -TAIL), cuts, np.full((len(m), 1), TAIL)], axis=1)
    lo, width = edges[:, :-1], np.diff(edges, axis=1)  # (N, pieces)
    x0, w0 = _legendre(INNER_NODES)
    frac = ((np.arange(INNER_PANELS)[:, None] + 0.5 * (x0[None, :] + 1.0)) / INNER_PANELS).ravel()
    wts = np.tile(w0, INNER_PANELS) / (2.0 * INNER_PANELS)
    z = lo[:, :, None] + width[:, :, None] * frac[None, None, :]  # (N, pieces, nodes)
    w = width[:, :, None] * wts[None, None, :] * np.exp(-0.5 * z * z) / _SQRT_2PI
    return np.einsum("npk,npk->n", w, act.fn(m[:, None, None] + sigma * z))


def pair_expectation(act: Activation, root_u: float, root_v: float, c: float) -> float:
    """E[phi(u) phi(v)] for u = root_u z1, v = root_v (c z1 + s z2), s = sqrt(1 - c^2), by
    integrating over z1 the product phi(u) E[phi(v) | z1] (module docstring)."""
    if root_u == 0.0 or root_v == 0.0:
        f0 = float(act.fn(np.zeros(1))[0])
        other = root_v if root_u == 0.0 else root_u
        if other == 0.0:
            return f0 * f0
        z, w = gaussian_rule(_z_kinks(act, other), scale=other)
        return f0 * float(w @ act.fn(other * z))
    s = math.sqrt(max(0.0, 1.0 - c * c))
    sigma = root_v * s
    # E[phi(v) | z1] bends where its mean root_v c z1 crosses a kink, over a width s / |c| in z1
    kinks = _z_kinks(act, root_u)
    scale = root_u
    if c != 0.0:
        kinks += [x / (root_v * c) for x in act.kinks]
        scale = max(scale, min(abs(c) / s, 1e6) if s > 0.0 and act.kinks else root_v * abs(c))
    z, w = gaussian_rule(kinks, scale=scale)
    m = root_v * c * z
    pl = _piecewise_linear(act)
    inner = _inner_piecewise_linear(pl, m, sigma) if pl is not None else _inner_quadrature(act, m, sigma)
    return float(w @ (act.fn(root_u * z) * inner))
