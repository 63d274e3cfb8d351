"""What ``diagnose`` averages over, and the noise of those averages (framework-free, numpy).

``diagnose`` measures q as the mean of y^2 over 2N inputs (N pairs: examples x the locations of a
feature map, the two inputs of each pair) and n features, and c as the mean over the N pairs of
the cosine of each pair's features (``sigprop.client.torch.diagnose._q_and_c``,
``sigprop.client.pairs.q_and_c``); the sequence check measures K_ij, the mean over B sets of
y_i . y_j / n of the output tokens (``sigprop.client.token_diagnosis.token_kernel_of``). Their
variance over networks is the mean covariance of the fluctuations of the averaged terms over
all ordered pairs of them:

    Var(q) = (1 / (2N)^2) sum_(a, c) Cov(dq_a, dq_c),   Var(c) = (1 / N^2) sum_(P, P') Cov(dc_P, dc_P'),

with dc_P = dK_ab / q - c (dK_aa + dK_bb) / 2 q linearized for P = (a, b) at q_a = q_b = q (where it cancels, as for
a pair of opposite inputs through a leaky ReLU, c moves at second order, by c d^2 / 2 in the
relative difference d of the halves' q: its spread, and its bias where it leads, are added).
The same input and the
two halves of a pair give the "self" terms, which fall as 1 / N; every other pair of inputs gives
a cross term that does not fall at all (the inputs share the weights). ``sigprop.client.
finite_width`` gives these covariances on a few representatives (a grid of examples x locations,
both halves of each pair), drawn here from the pairs measured; the self terms are their means,
and the cross terms are fitted on the representatives' cosines (q: cos, cos^2, cos^3; c: the
first- and second-order terms of the Mehler expansion in the two pairs' cross block) and read at
the whole measurement's means of those (:class:`Moments`, from C x C sums of the inputs), so
that their near-cancellation over thousands of inputs is not replaced by a few dozen sampled
cosines. The q of one input compounds multiplicatively over layers (Hanin and Nica, "Products of
Many Large Random Matrices and Gradients in Deep Neural Networks", arXiv:1812.05994), so the
standard deviation stated is q sqrt(exp(v) - 1) for the linear-order relative variance v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Representatives", "Moments", "pair_representatives", "token_representatives", "pair_noise", "token_noise"]


@dataclass(frozen=True)
class Representatives:
    """The inputs the noise is propagated on and how the measurement averages over them.

    ``kernel``: their exact Gram matrix (x_a . x_b / features). Layout ``"pairs"``: inputs indexed
    ``(example, location, half)`` on a grid ``shape = (k_e, k_l, 2)`` standing for ``examples`` x
    ``locations`` measured pairs; ``"tokens"``: ``shape = (sets, T)`` standing for ``examples`` sets.
    ``moments``: the population's means of what the sampled cross covariances are regressed on
    (:class:`Moments`); ``features``: the same for the examples flattened (what the layers after a
    flatten or global pool see)."""

    kernel: np.ndarray
    layout: str
    shape: tuple[int, ...]
    examples: int
    locations: int
    moments: Moments | None = None
    features: Representatives | None = None


def _grid(total: int, k: int, rng) -> np.ndarray:
    return np.arange(total) if total <= k else np.sort(rng.choice(total, k, replace=False))


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-300)


@dataclass(frozen=True)
class Moments:
    """Population means of the features the sampled cross covariances are fitted on: for q, over
    ordered pairs of inputs that are neither the same input nor one pair's halves, (cos, cos^2,
    cos^3); for c, over ordered pairs of distinct pairs P, P' with cross block B (the cosines of P's
    halves with P''s), (mean B, mean B^2, (B_11 B_22 + B_12 B_21) / 2, (mean B)^2): the first- and
    second-order terms of the Mehler expansion of a covariance in the cross block."""

    q: tuple[float, ...]
    c: tuple[float, ...]


def _cubic(x: np.ndarray, limit: int) -> float:
    """sum over ordered pairs of distinct rows of (x_a . x_c)^3: from the Gram matrix for up to
    ``limit`` rows, as ||sum_a x_a^(x)3||^2 for up to 40 columns, else from ``limit`` sampled rows
    (the population's q cross terms can cancel to 1 / N of a self term: a sampled cubic moment would
    not resolve that, an exact one does, e.g. for one input channel, where cos^3 = cos)."""
    n, d = x.shape
    if n > limit and d <= 40:
        t = np.einsum("ai,aj,ak->ijk", x, x, x)
        return float(np.sum(t * t)) - n
    sub = x if n <= limit else x[np.random.default_rng(0).choice(n, limit, replace=False)]
    g = sub @ sub.T
    return (float(np.sum(g**3)) - len(sub)) * (n / len(sub)) ** 2


def _moments(a: np.ndarray, b: np.ndarray, cubic_limit: int = 4096) -> Moments:
    """:class:`Moments` of the pairs ``(a[i], b[i])`` ([N, C] each) from C x C sums (no N^2 table)."""
    u, v = _unit(a), _unit(b)
    n = len(u)
    both = np.concatenate([u, v])
    pc = np.sum(u * v, axis=1)  # each pair's own cosine
    gram = both.T @ both
    q1 = float(np.sum(both.sum(0) ** 2)) - 2 * n - 2 * float(pc.sum())
    q2 = float(np.sum(gram * gram)) - 2 * n - 2 * float(np.sum(pc * pc))
    q3 = _cubic(both, cubic_limit) - 2 * float(np.sum(pc**3))
    count = max(4 * n * n - 4 * n, 1)
    s_p = u + v
    t_sum = u.T @ v  # sum over pairs of u v^T
    sums = s_p.T @ s_p
    c1 = (float(np.sum(s_p.sum(0) ** 2)) - float(np.sum(s_p * s_p))) / 4
    c2 = (float(np.sum(gram * gram)) - float(np.sum(2 + 2 * pc * pc))) / 4
    c3 = (float(np.sum(t_sum * t_sum)) + float(np.sum(t_sum * t_sum.T)) - float(np.sum(1 + pc * pc))) / 2
    c4 = (float(np.sum(sums * sums)) - float(np.sum(np.sum(s_p * s_p, axis=1) ** 2))) / 16
    pairs = max(n * n - n, 1)
    return Moments((q1 / count, q2 / count, q3 / count), (c1 / pairs, c2 / pairs, c3 / pairs, c4 / pairs))


def pair_representatives(x1, x2, *, features: bool, examples: int = 16, locations: int = 4) -> Representatives:
    """A grid of at most ``examples`` x ``locations`` of the measured pairs ``(x1, x2)`` (numpy,
    channels first: ``[B, F]`` or ``[B, C, *spatial]``), with the population's cosine moments.
    ``features``: the graph flattens (or globally pools) its input before any layer, so the pairs
    are the flattened examples."""
    a, b = np.asarray(x1, np.float64), np.asarray(x2, np.float64)
    if a.ndim > 2 and features:
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    flat = (a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1))
    if a.ndim == 2:
        a, b = a[:, :, None], b[:, :, None]
    a, b = a.reshape(a.shape[0], a.shape[1], -1), b.reshape(b.shape[0], b.shape[1], -1)
    n_b, n_c, n_l = a.shape
    rng = np.random.default_rng(0)
    k_l = min(n_l, locations)
    ex, loc = _grid(n_b, max(1, examples // k_l) if n_l > 1 else examples, rng), _grid(n_l, k_l, rng)
    v = np.stack([a[ex][:, :, loc], b[ex][:, :, loc]], axis=-1)  # (k_e, C, k_l, 2)
    v = np.moveaxis(v, 1, -1).reshape(-1, n_c)  # (k_e * k_l * 2, C)
    per_location = (np.moveaxis(a, 1, -1).reshape(-1, n_c), np.moveaxis(b, 1, -1).reshape(-1, n_c))
    feats = None
    if n_l > 1:  # what a flatten after the maps sees: the examples' flattened cosines
        fv = np.stack([flat[0][ex], flat[1][ex]], axis=1).reshape(-1, flat[0].shape[1])
        fk = fv @ fv.T / fv.shape[1]
        feats = Representatives(fk, "pairs", (len(ex), 1, 2), n_b, 1, _moments(*flat))
    return Representatives(v @ v.T / n_c, "pairs", (len(ex), len(loc), 2), n_b, n_l, _moments(*per_location), feats)


def token_representatives(x, limit: int = 64) -> Representatives:
    """As many whole sets of the ``[B, T, D]`` tokens fed to a sequence model as fit in ``limit``
    representatives (at least one): all B sets, the exact population, when they fit."""
    x = np.asarray(x, np.float64)
    sets = x[: max(1, min(x.shape[0], limit // x.shape[1]))]
    v = sets.reshape(-1, x.shape[-1])
    return Representatives(v @ v.T / x.shape[-1], "tokens", sets.shape[:2], x.shape[0], 1)


_GROUPS = 8  # the probes split to estimate the Monte-Carlo error of a fitted cross term


def _fit(cov: np.ndarray, mask: np.ndarray, features: list[np.ndarray], means) -> float:
    """The mean covariance over the population's cross pairs: the sampled cross pairs' covariances
    fitted on (1, *features) of their inputs and read at the population's means of the features
    (the regression estimator). A plain mean of the sample would carry the sample's own cosines:
    with many inputs the population's cross terms nearly cancel (phi's odd Hermite part gives terms
    odd in the cosines), and a few dozen sampled pairs do not."""
    y = cov[mask]
    if y.size == 0:
        return 0.0
    x = np.stack([np.ones_like(y)] + [f[mask] for f in features], axis=1)
    beta = np.linalg.lstsq(x, y, rcond=1e-10)[0]
    return float(beta @ np.array([1.0, *means]))


def _cross_term(values: np.ndarray, mask: np.ndarray, features: list[np.ndarray], means) -> float:
    """:func:`_fit` of the probes' covariances, shrunk where the probes do not resolve it: with
    thousands of inputs the population's cross term can be smaller than the probes' Monte-Carlo
    error, whose size the spread of the fit over groups of probes gives; the factor
    max(0, 1 - (2 se / fit)^2) keeps a term measured to better than two standard errors and drops
    one that is not (its sign is then unknown, and the self terms carry the variance)."""
    r = values.shape[0]
    fit = _fit(values.T @ values / r, mask, features, means)
    parts = [_fit(g.T @ g / len(g), mask, features, means) for g in np.array_split(values, _GROUPS)]
    se2 = float(np.var(parts, ddof=1)) / _GROUPS
    return fit * max(0.0, 1.0 - 4.0 * se2 / max(fit * fit, 1e-300))


def _jackknife(values: np.ndarray, k_e: int, features: list[np.ndarray], means) -> float:
    """The jackknife standard error of the fitted cross term over the sampled examples (the pairs
    of one example left out at a time)."""
    if k_e < 3:
        return 0.0
    example = np.repeat(np.arange(k_e), values.shape[1] // k_e)
    cov = values.T @ values / values.shape[0]
    fits = []
    for e in range(k_e):
        keep = example != e
        mask = ~np.eye(int(keep.sum()), dtype=bool)
        fits.append(_fit(cov[np.ix_(keep, keep)], mask, [f[np.ix_(keep, keep)] for f in features], means))
    return math.sqrt((k_e - 1) / k_e * float(np.sum((np.array(fits) - np.mean(fits)) ** 2)))


def pair_noise(kernel: np.ndarray, dk: np.ndarray, shape, cov_q, rep: Representatives) -> tuple[float, float]:
    """(sd of q, sd of c) of one node's measurement over all the measured pairs (module docstring):
    ``kernel`` the node's representatives' kernel, ``dk`` [probes, 3m / 2] realizations of the
    fluctuations of their q (m) and of each pair's own entry (m / 2), ``shape`` their layout,
    ``cov_q`` the exact covariance of their q fluctuations (None: from the probes). NaN where the
    fluctuations are not known (after a global pool of sampled locations)."""
    if not np.all(np.isfinite(dk)):
        return math.nan, math.nan
    base = rep.features if shape[1] == 1 and rep.features is not None else rep
    k_e, k_l, _ = shape
    m = k_e * k_l * 2
    big_m, big_n = 2 * base.examples * base.locations, base.examples * base.locations
    roots = np.sqrt(np.maximum(np.diag(base.kernel), 1e-300))
    rho = base.kernel / np.outer(roots, roots)
    a, b = np.arange(0, m, 2), np.arange(1, m, 2)
    dd, own = dk[:, :m], dk[:, m:]
    r = dk.shape[0]
    pair = np.arange(m) // 2
    cross, q_features = pair[:, None] != pair[None, :], [rho, rho**2, rho**3]
    if cov_q is None:
        cov_q = dd.T @ dd / r
        q_cross = _cross_term(dd, cross, q_features, base.moments.q)
    else:  # exact: the fit has no Monte-Carlo error to shrink
        q_cross = _fit(cov_q, cross, q_features, base.moments.q)
    total_q = big_m * (np.mean(np.diag(cov_q)) + np.mean(cov_q[a, b])) + (big_m * big_m - 2 * big_m) * q_cross
    q = float(np.mean(np.diag(kernel)))
    var_q = abs(total_q) / (big_m * big_m) / (q * q)  # abs: as var_c below
    qa, qb = np.diag(kernel)[a], np.diag(kernel)[b]
    root = np.sqrt(np.maximum(qa * qb, 1e-300))
    c = kernel[a, b] / root
    dc = own / root - 0.5 * c * (dd[:, a] / qa + dd[:, b] / qb)  # d(K_ab / sqrt(K_aa K_bb)), linearized
    b11, b12, b21, b22 = (rho[np.ix_(i, j)] for i in (a, b) for j in (a, b))
    mean_b = (b11 + b12 + b21 + b22) / 4
    features = [mean_b, (b11**2 + b12**2 + b21**2 + b22**2) / 4, (b11 * b22 + b12 * b21) / 2, mean_b**2]
    c_cross = _cross_term(dc, ~np.eye(len(a), dtype=bool), features, base.moments.c)
    var_c = (big_n * np.mean(dc * dc) + (big_n * big_n - big_n) * c_cross) / (big_n * big_n)
    # The cross term is read off a few dozen sampled pairs, and which pairs were drawn can decide it
    # (few input channels: their cosines spread far from 0, and the covariances with them). Its
    # jackknife error over the sampled examples is what the sample cannot tell: the variance stated
    # is at least that (and a negative total, impossible, is read as that much)
    jack = _jackknife(dc, k_e, features, base.moments.c) * (big_n * big_n - big_n) / (big_n * big_n)
    var_c = max(var_c, jack)
    # second order: c / sqrt((1 + dq_a / q_a)(1 + dq_b / q_b)) moves by c d^2 / 2 in d = (dq_a / q_a -
    # dq_b / q_b) / 2, which leads where the first order cancels: a pair at cosine -1 through a leaky
    # ReLU, whose q residuals are opposite. With d Gaussian (covariances D from the exact q ones) the
    # term spreads by Cov(c d_P^2, c d_P'^2) / 4 = c_P c_P' D_PP'^2 / 2 and shifts c by c s^2 / 2
    # (s^2 = D_PP). Elsewhere it is an O(1/n) correction to the first order, which the theory does
    # not carry (nor the network's own second-order response): each pair's share counts by the weight
    # w it has against the first order, 1 where that cancels, ~0 where it does not
    u = cov_q / np.outer(np.diag(kernel), np.diag(kernel))
    dmat = (u[np.ix_(a, a)] - u[np.ix_(a, b)] - u[np.ix_(b, a)] + u[np.ix_(b, b)]) / 4
    s2 = np.diag(dmat)
    own2 = c * c * s2 * s2 / 2
    w = own2 / np.maximum(own2 + np.mean(dc * dc, axis=0), 1e-300)
    lead = c * np.sqrt(w)
    second = np.outer(lead, lead) * dmat**2 / 2
    off = second[~np.eye(len(a), dtype=bool)]
    spread2 = big_n * float(np.mean(np.diag(second))) + (big_n * big_n - big_n) * float(np.mean(off) if off.size else 0)
    bias = float(np.mean(w * c * s2 / 2))
    sd_c = math.sqrt(max(var_c, 0.0) + spread2 / (big_n * big_n) + bias**2)  # the rms deviation from the prediction
    return q * math.sqrt(math.expm1(max(var_q, 0.0))), sd_c


def token_noise(kernel: np.ndarray, dk: np.ndarray, shape, sets: int) -> np.ndarray:
    """Per entry of the T x T kernel averaged over ``sets`` sets: its standard deviation (the
    diagonal, a q, compounds multiplicatively as in Hanin and Nica)."""
    s, t = shape
    blocks = [dk[:, i * t : (i + 1) * t, i * t : (i + 1) * t] for i in range(s)]
    v_self = np.mean([np.mean(x * x, axis=0) for x in blocks], axis=0)
    pairs = [np.mean(blocks[i] * blocks[j], axis=0) for i in range(s) for j in range(s) if i != j]
    v_cross = np.mean(pairs, axis=0) if pairs else np.zeros((t, t))
    var = np.maximum((v_self + (sets - 1) * v_cross) / sets, 0.0)
    k = np.mean([kernel[i * t : (i + 1) * t, i * t : (i + 1) * t] for i in range(s)], axis=0)
    sd = np.sqrt(var)
    d = np.diag(k)
    rel = np.diag(var) / np.maximum(d * d, 1e-300)
    np.fill_diagonal(sd, d * np.sqrt(np.expm1(rel)))
    return sd
