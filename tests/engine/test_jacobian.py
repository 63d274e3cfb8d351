"""Per-layer Jacobian statistics (sigprop.engine.network.jacobian) against the per-layer-Jacobian paper:
Monte Carlo as in its Figure 2 (200 draws, width 40) for a ResNet with m = 2 and a DenseNet,
closed forms of Lemma 2 / Theorems 1-3, the residual branch scale, and structure detection."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sigprop.engine.graph.build import build_graph
from sigprop.engine.network.jacobian import (
    detect_structure,
    jacobian_stats,
    output_moments,
    residual_branch_scale,
    vanilla_jacobian_moments,
)
from sigprop.engine.templates.expand import expand_template
from sigprop.errors import SigpropError
from sigprop.schemas import Graph, Template

WIDTH, DRAWS = 40, 200  # Figure 2


def _matmul(a, b):
    return np.einsum("dij,djk->dik", a, b)


def _matvec(a, v):
    return np.einsum("dij,dj->di", a, v)


def resnet_jacobian_norms(depth, n, m, alpha, k, draws, rng):
    """||J^{k,1}||^2 (equation 1) of y^l = y^{l-1} + W^{lm} phi(... phi(W^{l1} y^{l-1})), per draw.

    ||J^{k1}||^2 = ||y^{k-1}||^2 ||d y^L / d h^{k1}||_F^2 with h^{k1} = W^{k1} y^{k-1}: the explicit
    product of the block Jacobians (I + W^m D ... D W^1) above block k, at width n."""
    eye = np.eye(n)
    y = np.ones((draws, n)) / math.sqrt(n)  # ||y^0||^2 = 1
    jac = a_norm = None
    for block in range(1, depth + 1):
        h, ws, masks = y, [], []
        for j in range(m):
            w = rng.standard_normal((draws, n, n)) * math.sqrt((2 * alpha if j < m - 1 else alpha) / n)
            pre = _matvec(w, h)
            mask = (pre > 0).astype(float) if j < m - 1 else None
            h = pre * mask if mask is not None else pre
            ws.append(w)
            masks.append(mask)
        if block == k:
            a_norm = np.sum(y**2, axis=1)
            jac = masks[0][:, :, None] * eye
            for j in range(1, m):
                jac = _matmul(ws[j], jac)
                if masks[j] is not None:
                    jac = masks[j][:, :, None] * jac
        elif block > k:
            branch = jac
            for j in range(m):
                branch = _matmul(ws[j], branch)
                if masks[j] is not None:
                    branch = masks[j][:, :, None] * branch
            jac = jac + branch
        y = y + h
    return a_norm * np.sum(jac**2, axis=(1, 2))


def densenet_jacobian_norms(depth, n, alpha, k, draws, rng):
    """||J^k||^2 of y^l = phi(W^l [y^0, ..., y^{l-1}]) (fan-in l n, c_2 = 2 alpha / (l n)), per draw:
    ||[y^0..y^{k-1}]||^2 ||d y^L / d h^k||_F^2, the Jacobians d y^L / d y^l summed over all paths."""
    ys, ws, masks = [np.ones((draws, n)) / math.sqrt(n)], {}, {}
    for l in range(1, depth + 1):
        x = np.concatenate(ys, axis=1)
        ws[l] = rng.standard_normal((draws, n, l * n)) * math.sqrt(2 * alpha / (l * n))
        pre = _matvec(ws[l], x)
        masks[l] = (pre > 0).astype(float)
        ys.append(pre * masks[l])
    grads = {depth: np.broadcast_to(np.eye(n), (draws, n, n))}
    for l in range(depth - 1, k - 1, -1):
        grads[l] = sum(
            _matmul(grads[q] * masks[q][:, None, :], ws[q][:, :, l * n : (l + 1) * n]) for q in range(l + 1, depth + 1)
        )
    dh = grads[k] * masks[k][:, None, :]
    return np.sum(np.concatenate(ys[:k], axis=1) ** 2, axis=1) * np.sum(dh**2, axis=(1, 2))


def check_against_theorem(norms_by_depth, kind, alpha, m=2, layer=1):
    """Theorem 1 per depth: mean exact (within Monte Carlo error), variance under the upper bound,
    and the growth of the variance in depth as the theorem's: var||J^k||^2 is pinned to
    var||y_(k)^L||^2 within the factor c_4 / c_2^2 = 3, so var(L) / var(L_0) must lie within a
    factor 3 of the predicted var_upper(L) / var_upper(L_0)."""
    depths = sorted(norms_by_depth)
    stats = {L: jacobian_stats(kind, L, WIDTH, m, alpha, layer) for L in depths}
    var = {L: float(np.var(norms_by_depth[L], ddof=1)) for L in depths}
    for L in depths:
        j = norms_by_depth[L]
        se = np.std(j) / math.sqrt(len(j))
        assert abs(j.mean() - stats[L].mean) < max(4 * se, 0.02 * stats[L].mean), (kind, alpha, L)
        assert var[L] <= stats[L].var_upper, (kind, alpha, L, var[L], stats[L].var_upper)
    base = depths[0]
    for L in depths[1:]:
        measured = var[L] / var[base]
        predicted = stats[L].var_upper / stats[base].var_upper
        assert predicted / 3 <= measured <= 3 * predicted, (kind, alpha, L, measured, predicted)
    return var, stats


def test_resnet_monte_carlo_figure_2():
    rng = np.random.default_rng(7)
    depths = (1, 2, 4, 8)
    for alpha in (1.0, 0.5):
        norms = {L: resnet_jacobian_norms(L, WIDTH, 2, alpha, 1, DRAWS, rng) for L in depths}
        var, stats = check_against_theorem(norms, "residual", alpha)
        if alpha == 1.0:
            # Theorem 2, equation 19: log var grows per block at a rate between rho_-^m / 2 and
            # 2 rho_+^(m/2) (rho_+- = alpha^2 (1 + 5/n) for Gaussian weights)
            rho = alpha**2 * (1 + 5 / WIDTH)
            rate = math.log(var[8] / var[2]) / 6
            assert 0.5 * rho**2 < rate < 2 * rho, rate
            assert var[8] / var[1] > 1e3  # unscaled branches explode
    # the recommended branch scale (L rho_+^(m/2) = 1) keeps the fluctuations bounded in depth:
    # the relative variance var / mean^2 of ||J||^2 stays put (the mean itself follows the branch
    # weights down, ~ alpha^(m-1), as the weights of a scaled branch matter less)
    rel_var, predicted = {}, {}
    for L in (4, 16):
        rec = residual_branch_scale(L, WIDTH, 2)
        assert L * rec["rho_plus"] == pytest.approx(1.0, rel=1e-12)
        j = resnet_jacobian_norms(L, WIDTH, 2, rec["alpha"], 1, DRAWS, rng)
        st = jacobian_stats("residual", L, WIDTH, 2, rec["alpha"], 1)
        var = np.var(j, ddof=1)
        assert abs(j.mean() / st.mean - 1) < 0.1 and var <= st.var_upper
        rel_var[L], predicted[L] = var / j.mean() ** 2, st.var_upper / st.mean**2
    assert predicted[16] / predicted[4] == pytest.approx(1.0, abs=0.15)
    assert 1 / 3 < rel_var[16] / rel_var[4] < 3, rel_var


# -m slow: heavy Monte Carlo (30 s loaded); the ResNet figure-2 test runs by default
@pytest.mark.slow
def test_densenet_monte_carlo_figure_2():
    rng = np.random.default_rng(11)
    depths = (2, 4, 8, 16)
    norms = {L: densenet_jacobian_norms(L, WIDTH, 1.0, 1, DRAWS, rng) for L in depths}
    var, stats = check_against_theorem(norms, "dense", 1.0)
    # Theorem 3 with alpha = 1 (He initialization): L^0, bounded in depth
    assert 0.5 < var[16] / var[2] < 2, var
    assert all(st.growth_exponents == (0.0, 0.0) for st in stats.values())
    # alpha != 1 grows polynomially, and the prediction follows it; a middle layer too
    norms = {L: densenet_jacobian_norms(L, WIDTH, 1.5, 1, DRAWS, rng) for L in (2, 8)}
    check_against_theorem(norms, "dense", 1.5)
    norms = {L: densenet_jacobian_norms(L, WIDTH, 1.0, 2, DRAWS, rng) for L in (2, 8)}
    check_against_theorem(norms, "dense", 1.0, layer=2)


def test_vanilla_exact_variance_and_theorem_1_lower_bound():
    # L = k = 1: ||J^1||^2 counts the active units, Binomial(n, 1/2): variance n / 4, below the
    # lower bound var||y^1||^2 / c_4 = 5 n / 12 that Theorem 1 states
    st = jacobian_stats("vanilla", 1, WIDTH)
    assert st.mean == pytest.approx(WIDTH / 2) and st.var_exact == pytest.approx(WIDTH / 4)
    assert st.var_lower == pytest.approx(5 * WIDTH / 12) and st.var_exact < st.var_lower
    rng = np.random.default_rng(3)
    for depth, k, alpha in ((4, 1, 1.0), (4, 3, 1.2)):
        draws = 3000
        eye = np.eye(WIDTH)
        y = np.ones((draws, WIDTH)) / math.sqrt(WIDTH)
        for l in range(1, depth + 1):
            w = rng.standard_normal((draws, WIDTH, WIDTH)) * math.sqrt(2 * alpha / WIDTH)
            pre = _matvec(w, y)
            mask = (pre > 0).astype(float)
            if l == k:
                a_norm, jac = np.sum(y**2, axis=1), mask[:, :, None] * eye
            elif l > k:
                jac = mask[:, :, None] * _matmul(w, jac)
            y = pre * mask
        j = a_norm * np.sum(jac**2, axis=(1, 2))
        mean, var = vanilla_jacobian_moments(depth, WIDTH, alpha, k)
        assert mean == pytest.approx(jacobian_stats("vanilla", depth, WIDTH, alpha=alpha, layer=k).mean)
        assert j.mean() == pytest.approx(mean, rel=0.03)
        assert np.var(j) == pytest.approx(var, rel=0.15)


# --------------------------------------------------------------------------- closed forms


def test_closed_forms():
    n = 40
    # Lemma 2 / equation 76 (alpha = 1): var||y^L||^2 = (n+5)/n prod (1 + 5/n) - 1 for n_l = n
    mu, fourth = output_moments("vanilla", 6, n)
    assert mu == 1.0 and fourth - 1 == pytest.approx((1 + 5 / n) ** 6 - 1)
    # Theorem 2: mu = alpha^m (1 + alpha^m)^(L-1); E||J||^2 = mu / c_2
    st = jacobian_stats("residual", 5, n, 3, 0.7, 2)
    assert st.output_mean == pytest.approx(0.7**3 * (1 + 0.7**3) ** 4)
    assert st.mean == pytest.approx(st.output_mean / (2 * 0.7 / n))
    assert st.var_upper == pytest.approx(3 * st.var_lower)
    # Theorem 3: alpha = 1 keeps E||y^L||^2 = 1 at every depth (layer L: nothing bypasses the last
    # layer, so its reduced network is the network)
    for L in (1, 2, 7, 50):
        assert output_moments("dense", L, n, layer=L)[0] == pytest.approx(1.0)
    # residual branch scale: L rho_+^(m/2) = kappa, shortcut / branch weights normalized
    rec = residual_branch_scale(100, 64, 3, kappa=0.5)
    assert 100 * rec["rho_plus"] ** 1.5 == pytest.approx(0.5)
    assert rec["shortcut_weight"] ** 2 + rec["branch_weight"] ** 2 == pytest.approx(1.0)
    assert rec["branch_weight"] / rec["shortcut_weight"] == pytest.approx(rec["alpha"] ** 1.5)
    with pytest.raises(SigpropError):
        jacobian_stats("residual", 4, n, m=1)
    with pytest.raises(SigpropError):
        jacobian_stats("other", 4, n)


# --------------------------------------------------------------------------- structure


def test_detect_structure():
    g = build_graph(expand_template(Template(template="resnet", depth=18, shortcut_weight=0.8, version=2)), "relu")
    st = detect_structure(g)
    assert (st.kind, st.depth, st.m) == ("residual", 8, 2)
    assert st.branch_scale == pytest.approx(0.6 / 0.8) and st.alpha == pytest.approx(0.75)
    st = detect_structure(
        build_graph(expand_template(Template(template="resnet", depth=50, shortcut_weight=0.5)), "relu")
    )
    assert (st.kind, st.depth, st.m) == ("residual", 16, 3)
    st = detect_structure(build_graph(expand_template(Template(template="densenet", depth=40)), "relu"))
    assert st.kind == "dense" and st.alpha == 1.0
    st = detect_structure(
        build_graph(expand_template(Template(template="mlp", depth=5, width=64, input_shape=[10])), "relu")
    )
    assert (st.kind, st.depth, st.width) == ("vanilla", 6, 64)
    mixed = Graph.model_validate(
        {
            "nodes": [
                {"id": "x", "op": "input", "shape": [8]},
                {"id": "a", "op": "dense", "units": 8, "inputs": ["x"]},
                {"id": "s", "op": "sum", "inputs": ["x", "a"]},
                {"id": "c", "op": "concat", "inputs": ["s", "x"]},
                {"id": "out", "op": "output", "inputs": ["c"]},
            ]
        }
    )
    assert detect_structure(build_graph(mixed, "relu")) is None
