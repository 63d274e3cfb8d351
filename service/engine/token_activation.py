"""An elementwise activation on a whole token kernel: K'_ij = E[phi(u) phi(v)] with (u, v) ~ N(0,
[[K_ii, K_ij], [K_ij, K_jj]]), exactly, for diagonals that differ from token to token.

"Deep Transformers without Shortcuts" (He, Martens et al., arXiv:2302.10322) section 2 propagates
the kernel matrix of a sequence through an MLP block by this dual kernel. Its diagonals are not all
equal once E-SPA's location-dependent rescaling D and the C maps' f(c) >= c have acted, so the
scalar C map of "Rapid training of deep neural networks without skip connections or
normalization layers using Deep Kernel Shaping" / TAT (q = 1 for every input) is not enough.
Three exact routes, by what phi is:

- positively homogeneous phi (relu, leaky_relu, TAT's sqrt(2 / (1 + a^2)) phi_a, any transformation
  without shifts): phi(x) = r x for x > 0 and l x for x < 0, so E[phi(u) phi(v)] =
  sqrt(K_ii K_jj) (r^2 + l^2) / 2 * C(c) with C the closed form of TAT's equation 9 (the arc-cosine
  kernel), k = (r - l)^2 / (pi (r^2 + l^2)) and c = K_ij / sqrt(K_ii K_jj) (``qc_maps.rectifier_c_map``);
- otherwise the Mehler (Hermite) series with a coefficient vector per token: with a_k(q) =
  E[phi(sqrt(q) z) h_k(z)], h_k = He_k / sqrt(k!), E[phi(u) phi(v)] = sum_k a_k(K_ii) a_k(K_jj) c^k
  (the series ``qc_maps.HermiteCMap`` sums at q = 1; its coefficients come from the same code).
  Its truncation after K terms errs by at most |c|^K sqrt(R_i R_j), R_i = E[phi^2] - sum_k a_k^2;
- the pairs where that bound exceeds the tolerance (|c| near 1 for a phi with a kink, where the
  series converges slowly) are integrated directly: E over u of phi(u) E[phi(v) | u], the inner
  expectation in closed form for a piecewise-linear phi (E[(m + s Z - x)_+] = d Phi(d / s) +
  s phi(d / s), d = m - x) and by a composite Gauss-Legendre rule split at phi's kinks otherwise,
  the outer one by ``quadrature.gaussian_rule`` split at the kinks of both factors.

The diagonal is E[phi(sqrt(K_ii) z)^2] from the one-dimensional rule.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtr

from .activations import Activation
from .qc_maps import _hermite_coefficients, rectifier_c_map
from .quadrature import SERIES_RULE, TAIL, _legendre, gaussian_rule

__all__ = ["activation_token_kernel", "activation_token_mean", "homogeneous_slopes", "TOLERANCE"]

# a pair's series is summed directly when its truncation bound is below this, relative to
# sqrt(E[phi(u)^2] E[phi(v)^2]); others are integrated
TOLERANCE = 1e-12
SERIES_TERMS = 96
# the inner rule of a pair integrated directly: each piece between phi's kinks in equal panels
INNER_PANELS = 20
INNER_NODES = 12
_SQRT_2PI = math.sqrt(2.0 * math.pi)


def _square(k) -> np.ndarray:
    k = np.asarray(k, dtype=np.float64)
    if k.ndim != 2 or k.shape[0] != k.shape[1]:
        raise ValueError(f"a token kernel is a square T x T matrix, got shape {k.shape}")
    if not np.all(np.isfinite(k)) or np.any(np.diag(k) < 0.0):
        raise ValueError("a token kernel needs finite entries and a non-negative diagonal")
    return k


def homogeneous_slopes(act: Activation) -> tuple[float, float] | None:
    """(r, l) with phi(x) = r x for x > 0 and l x for x < 0 when phi is positively homogeneous
    (phi(t x) = t phi(x), t >= 0: then phi is fixed by phi(1) and phi(-1)); None otherwise."""
    if not act.positively_homogeneous:
        return None
    ends = np.asarray(act.fn(np.array([1.0, -1.0])), dtype=float)
    return float(ends[0]), float(-ends[1])


def activation_token_kernel(k, act: Activation, *, tolerance: float = TOLERANCE) -> np.ndarray:
    """K'_ij = E[phi(u) phi(v)], (u, v) ~ N(0, [[K_ii, K_ij], [K_ij, K_jj]]) (module docstring);
    ``act`` the transformed activation (``token_kernels.answer_activation``). Add a dense layer's
    bias variance to K before, as the layer does."""
    k = _square(k)
    slopes = homogeneous_slopes(act)
    if slopes is not None:
        return _homogeneous_kernel(k, *slopes)
    return _series_kernel(k, act, tolerance)


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


def _correlations(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sqrt(K_ii K_jj), c_ij clipped to [-1, 1]; 0 where a token is 0)."""
    roots = np.sqrt(np.diag(k))
    norm = np.outer(roots, roots)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(norm > 0.0, k / np.where(norm > 0.0, norm, 1.0), 0.0)
    return norm, np.clip(c, -1.0, 1.0)


def _homogeneous_kernel(k: np.ndarray, right: float, left: float) -> np.ndarray:
    """sqrt(K_ii K_jj) (r^2 + l^2) / 2 * C(c_ij), C TAT's equation 9 with k = (r - l)^2 / (pi (r^2 + l^2))."""
    total = right * right + left * left
    if total == 0.0:
        return np.zeros_like(k)
    norm, c = _correlations(k)
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


def _series_kernel(k: np.ndarray, act: Activation, tolerance: float) -> np.ndarray:
    t = k.shape[0]
    roots = np.sqrt(np.diag(k))
    unique, inverse = np.unique(roots, return_inverse=True)
    series = [_token_series(act, r) for r in unique.tolist()]
    coef = np.array([s[0] for s in series])[inverse]  # (T, K)
    second = np.array([s[1] for s in series])[inverse]
    rest = np.maximum(second - np.einsum("ik,ik->i", coef, coef), 0.0)
    _, c = _correlations(k)
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
    for i, j in zip(*np.nonzero(np.triu(slow, 1)), strict=True):
        out[i, j] = out[j, i] = pair_expectation(act, float(roots[i]), float(roots[j]), float(c[i, j]))
    np.fill_diagonal(out, second)
    return out


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
