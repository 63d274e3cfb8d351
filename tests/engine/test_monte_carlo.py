"""Monte Carlo check of the solved initializations in finite-width networks (TAT paper Appendix E.1).

Networks are built in numpy from the answer alone: the transformed activation's parameters and each
layer's ``fan_in``, ``fan_out``, ``distribution`` and ``gain``. Scale-corrected uniform orthogonal
(SUO, TAT Appendix D) weights are (X X^T)^{-1/2} X for an m x k Gaussian X (m <= k; transposed
construction when m > k) times max(sqrt(m / k), 1). The orthogonal factor (X X^T)^{-1/2} X is Haar
distributed, as is Q diag(sign(diag R)) from X^T = Q R, which is what ``suo`` computes: the same
distribution for a fraction of the cost of an eigendecomposition or SVD.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sigprop.engine.solve import solve
from sigprop.requests import parse_solve_request

WIDTH = 512


def suo(m: int, k: int, gain: float, rng: np.random.Generator) -> np.ndarray:
    """An m x k SUO matrix: orthonormal rows (m <= k) or columns (m > k), times ``gain``."""
    if m > k:
        return suo(k, m, 1.0, rng).T * gain
    q, r = np.linalg.qr(rng.standard_normal((k, m)))  # k x m, orthonormal columns
    q *= np.sign(np.diag(r))[None, :]
    return gain * q.T


def weights(layers, rng):
    out = []
    for layer in layers:
        assert layer.op == "dense" and layer.distribution == "scaled_uniform_orthogonal"
        assert layer.bias == "zeros"
        out.append(suo(layer.fan_out, layer.fan_in, layer.gain, rng))
    return out


def orthogonal_inputs(n, d, rng):
    """n rows with ||x||^2 = d and pairwise x_i . x_j = 0."""
    q, _ = np.linalg.qr(rng.standard_normal((d, n)))
    return q.T * math.sqrt(d)


def cosine(h):
    x1, x2 = h[0::2], h[1::2]
    return np.sum(x1 * x2, axis=1) / (np.linalg.norm(x1, axis=1) * np.linalg.norm(x2, axis=1))


def trelu_c(c, a):
    """Normalized Leaky ReLU C map via the arc-cosine kernel (independent of the engine)."""
    k = (math.sqrt(1 - c * c) + (math.pi - math.acos(c)) * c) / (2 * math.pi)
    return (a * a * c + a * (1 - a) * c + (1 - a) ** 2 * k) * 2 / (1 + a * a)


@pytest.mark.parametrize("m,k", [(3, 7), (7, 3), (5, 5)])
def test_suo_sampler(m, k):
    rng = np.random.default_rng(0)
    gain = max(math.sqrt(m / k), 1.0)
    w = suo(m, k, gain, rng)
    assert w.shape == (m, k)
    if m <= k:
        assert np.allclose(w @ w.T, gain**2 * np.eye(m), atol=1e-12)
    else:
        assert np.allclose(w.T @ w, gain**2 * np.eye(k), atol=1e-12)
    # same family as (X X^T)^{-1/2} X: both are orthonormal-row matrices; check that formula too
    x = rng.standard_normal((min(m, k), max(m, k)))
    lam, v = np.linalg.eigh(x @ x.T)
    polar = (v * lam**-0.5) @ v.T @ x
    assert np.allclose(polar @ polar.T, np.eye(min(m, k)), atol=1e-12)


def trelu_monte_carlo(nets: int, pairs: int, seed: int, depth: int = 50, eta: float = 0.9):
    """Empirical c (per layer, per pair) and q (per layer, per input) of the solved TReLU MLP."""
    ans = solve(
        parse_solve_request(
            {
                "graph": {"template": "mlp", "depth": depth, "width": WIDTH, "classes": WIDTH},
                "method": "tat",
                "activation": "leaky_relu",
                "targets": {"eta": eta},
            }
        )
    )
    a, gamma = ans.negative_slope, ans.output_scale
    assert len(ans.layers) == depth + 1
    assert all((x.fan_in, x.fan_out, x.gain) == (WIDTH, WIDTH, 1.0) for x in ans.layers)
    rng = np.random.default_rng(seed)
    cs = np.empty((nets, depth + 1, pairs))  # after each activation, then after the last dense layer
    qs = np.empty((nets, depth + 1, 2 * pairs))  # input, then after each activation
    for n in range(nets):
        h = orthogonal_inputs(2 * pairs, WIDTH, rng)
        qs[n, 0] = np.sum(h * h, axis=1) / WIDTH
        ws = weights(ans.layers, rng)
        for layer, w in enumerate(ws[:-1]):
            h = h @ w.T
            h = gamma * np.where(h > 0, h, a * h)
            cs[n, layer] = cosine(h)
            qs[n, layer + 1] = np.sum(h * h, axis=1) / WIDTH
        cs[n, depth] = cosine(h @ ws[-1].T)
    return ans, cs, qs


def check_trelu(ans, cs, qs, eta, tol):
    a, depth = ans.negative_slope, cs.shape[1] - 1
    pred = [0.0]
    for _ in range(depth):
        pred.append(trelu_c(pred[-1], a))
    assert abs(pred[-1] - eta) < 1e-12
    assert np.allclose(qs[:, 0], 1.0)

    mean_c = cs.mean(axis=(0, 2))
    assert abs(mean_c[-1] - eta) < tol  # the network output
    assert np.max(np.abs(mean_c[:-1] - np.array(pred[1:]))) < tol  # every layer l tracks C^l(0)

    # q: the local Q map is the identity (Q(q) = q); one layer multiplies q by 1 + O(d^-1/2) noise
    ratio = qs[:, 1:] / qs[:, :-1]
    assert abs(ratio.mean() - 1.0) < tol / 5
    assert abs(qs[:, 1].mean() - 1.0) < 0.05
    # the noise has the finite-width size (1 - a^2)/(1 + a^2) sqrt(3/d) (h uniform on a sphere): over 50
    # layers log q wanders by ~0.37 per network, which is why q itself is not within 5% of 1 at every layer
    expected_sd = (1 - a * a) / (1 + a * a) * math.sqrt(3 / WIDTH)
    assert abs(ratio.std() / expected_sd - 1.0) < 0.25


# -m slow: heavy Monte Carlo (40 s loaded); test_monte_carlo_structures checks the TReLU MLP at width 512
@pytest.mark.slow
def test_trelu_mlp_empirical_c_values_track_the_c_map():
    """Width 512, depth 50, eta = 0.9: empirical cosine similarities follow C^l(0), output ~ eta."""
    ans, cs, qs = trelu_monte_carlo(nets=3, pairs=16, seed=20240601)
    check_trelu(ans, cs, qs, 0.9, tol=0.05)


@pytest.mark.slow
def test_trelu_mlp_empirical_c_values_many_networks():
    ans, cs, qs = trelu_monte_carlo(nets=12, pairs=32, seed=99)
    check_trelu(ans, cs, qs, 0.9, tol=0.02)


def softplus_monte_carlo(nets: int, pairs: int, seed: int, depth: int = 20, tau: float = 0.3, c0s=(0.0, 0.5)):
    ans = solve(
        parse_solve_request(
            {
                "graph": {"template": "mlp", "depth": depth, "width": WIDTH, "classes": WIDTH},
                "method": "tat",
                "activation": "softplus",
                "targets": {"tau": tau},
            }
        )
    )
    alpha, beta, gamma, delta = ans.input_scale, ans.input_shift, ans.output_scale, ans.output_shift

    def phi(x):
        return gamma * (np.logaddexp(0.0, alpha * x + beta) + delta)

    rng = np.random.default_rng(seed)
    k = len(c0s)
    outs = {c0: [] for c0 in c0s}
    q_out = []
    for _ in range(nets):
        base = orthogonal_inputs(2 * k * pairs, WIDTH, rng)
        h = np.empty_like(base)
        for j, c0 in enumerate(c0s):  # rows 2 * pairs * j ... : pairs (x1, c0 x1 + sqrt(1 - c0^2) x2)
            x1, x2 = base[2 * pairs * j : 2 * pairs * (j + 1) : 2], base[2 * pairs * j + 1 : 2 * pairs * (j + 1) : 2]
            h[2 * pairs * j : 2 * pairs * (j + 1) : 2] = x1
            h[2 * pairs * j + 1 : 2 * pairs * (j + 1) : 2] = c0 * x1 + math.sqrt(1 - c0 * c0) * x2
        ws = weights(ans.layers, rng)
        for w in ws[:-1]:
            h = phi(h @ w.T)
        h = h @ ws[-1].T
        for j, c0 in enumerate(c0s):
            outs[c0].append(cosine(h[2 * pairs * j : 2 * pairs * (j + 1)]))
        q_out.append(np.sum(h * h, axis=1) / WIDTH)
    return ans, {c0: float(np.mean(v)) for c0, v in outs.items()}, float(np.mean(q_out))


def check_softplus(ans, outs, q_out, tol):
    grid, glob = np.array(ans.c_map.c), np.array(ans.c_map.global_)
    assert abs(float(np.interp(0.0, grid, glob)) - ans.network_c_f_0) < 1e-12
    for c0, got in outs.items():
        want = float(np.interp(c0, grid, glob))
        assert abs(got - want) < tol, (c0, got, want)
    assert abs(q_out - 1.0) < 2 * tol  # Q(1) = 1 and Q'(1) = 1: q stays near 1


def test_tat_softplus_mlp_output_c_matches_the_global_c_map():
    """Width 512, depth 20, tau = 0.3: output cosine similarity for c0 in {0, 0.5} vs the answer's C_f."""
    ans, outs, q_out = softplus_monte_carlo(nets=2, pairs=12, seed=7)
    check_softplus(ans, outs, q_out, tol=0.05)


@pytest.mark.slow
def test_tat_softplus_mlp_many_networks():
    ans, outs, q_out = softplus_monte_carlo(nets=12, pairs=32, seed=8, c0s=(0.0, 0.5, 0.8, -0.3))
    check_softplus(ans, outs, q_out, tol=0.02)
