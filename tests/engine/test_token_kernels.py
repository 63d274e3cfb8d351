"""``sigprop.engine.maps.token_kernels``: the attention schedules of "Deep Transformers without Shortcuts"
(He, Martens et al., arXiv:2302.10322, section 3) and the exact token-kernel maps of a transformer's
ops at infinite width, checked against formulas written out here, numpy's linear algebra,
``scipy.integrate.quad`` and seeded Monte Carlo. (Finite-width networks: test_token_kernels_monte_carlo.py.)
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import integrate

from sigprop.engine.maps import token_kernels as tk
from sigprop.engine.maps.activations import get_activation, transformed
from sigprop.engine.maps.qc_maps import HermiteCMap, leaky_relu_c_map, local_stats
from sigprop.errors import SigpropError
from sigprop.schemas.activations import SMOOTH_ACTIVATIONS
from sigprop.schemas.attention_init import expand_attention, kernel_matrix

SQRT_2PI = math.sqrt(2.0 * math.pi)


def exp_kernel(gamma: float, t: int) -> np.ndarray:
    i = np.arange(t)
    return np.exp(-gamma * np.abs(i[:, None] - i[None, :]))


# --------------------------------------------------------------------------- schedules


def test_schedule_reproduces_the_papers_construction():
    """E-SPA (arXiv:2302.10322 section 3.1): gamma_l = -1/2 log(1 - (1 - e^{-2 gamma_L})^(l/L)), the
    Cholesky diagonal alpha_l = alpha_L^(l/L), and the generators' attention matrices A_l = L_l
    L_(l-1)^(-1) carry orthonormal tokens through Sigma_l = exp(-gamma_l |i - j|) to Sigma_L."""
    final, layers, t = 0.005, 12, 48
    gammas = tk.espa_schedule(final, layers)
    paper = [-0.5 * math.log(1.0 - (1.0 - math.exp(-2.0 * final)) ** (l / layers)) for l in range(1, layers + 1)]
    assert np.allclose(gammas, paper, rtol=1e-13, atol=0)
    assert gammas[-1] == final and np.all(np.diff(gammas) < 0)
    diagonals = [entry["diagonal"] for entry in tk.shaping_schedule("e-spa", layers, final_gamma=final)]
    alpha_final = math.sqrt(1.0 - math.exp(-2.0 * final))
    assert np.allclose(diagonals, [alpha_final ** (l / layers) for l in range(1, layers + 1)], rtol=1e-13)
    sigma = np.eye(t)
    for gen, gamma in zip(tk.shaping_generators("e-spa", layers, final_gamma=final), gammas, strict=True):
        a = expand_attention(gen, t, causal=True).matrix()
        assert np.all(a >= 0.0)
        sigma = tk.attention_token_kernel(sigma, a)
        assert np.allclose(sigma, exp_kernel(gamma, t), rtol=0, atol=1e-11)
    assert np.allclose(sigma, kernel_matrix(tk.shaping_target("e-spa", layers, final_gamma=final), t), atol=1e-11)


def espa_matrix_closed_form(gamma_target: float, gamma_source: float | None, t: int) -> np.ndarray:
    """A = L(rho') L(rho)^(-1) entry by entry, rho = e^(-gamma), s = sqrt(1 - rho^2): A_00 = 1,
    A_ii = s'/s, A_ij = rho'^(i-j-1) (s'/s)(rho' - rho) for 1 <= j < i, A_i0 = rho'^(i-1) (rho' -
    rho s'/s); a source of None (orthonormal tokens) gives L(rho') itself."""
    rp = math.exp(-gamma_target)
    sp = math.sqrt(1.0 - rp * rp)
    a = np.zeros((t, t))
    if gamma_source is None:
        for i in range(t):
            a[i, 0] = rp**i
            for j in range(1, i + 1):
                a[i, j] = sp * rp ** (i - j)
        return a
    r = math.exp(-gamma_source)
    s = math.sqrt(1.0 - r * r)
    a[0, 0] = 1.0
    for i in range(1, t):
        a[i, i] = sp / s
        a[i, 0] = rp ** (i - 1) * (rp - r * sp / s)
        for j in range(1, i):
            a[i, j] = rp ** (i - j - 1) * (sp / s) * (rp - r)
    return a


@pytest.mark.parametrize("layers, final", [(4, 0.005), (6, 0.05)])
def test_espa_attention_matrices_match_the_closed_form(layers, final):
    t = 40
    gammas = tk.espa_schedule(final, layers)
    for l, gen in enumerate(tk.shaping_generators("e-spa", layers, final_gamma=final)):
        a = expand_attention(gen, t, causal=True).matrix()
        closed = espa_matrix_closed_form(gammas[l], None if l == 0 else gammas[l - 1], t)
        assert np.allclose(a, closed, rtol=1e-12, atol=1e-13)


def test_espa_row_sums_approach_the_location_dependent_rescaling():
    """D_i = sum_j A_ij -> sqrt((1 + rho')(1 - rho) / ((1 + rho)(1 - rho'))) far from the first token."""
    gamma, gamma_prev, t = 0.05, 0.1, 600
    gen = {
        "form": "cholesky_ratio",
        "target": {"family": "exponential", "gamma": gamma},
        "source": {"family": "exponential", "gamma": gamma_prev},
    }
    init = expand_attention(gen, t, causal=True)
    rp, r = math.exp(-gamma), math.exp(-gamma_prev)
    limit = math.sqrt((1 + rp) * (1 - r) / ((1 + r) * (1 - rp)))
    assert limit > 1.0 and init.scale[0] == pytest.approx(1.0)
    assert init.scale[-1] == pytest.approx(limit, rel=1e-9)
    assert np.all(np.diff(init.scale[1:]) > 0)  # it grows towards the limit


def test_uspa_schedule_and_matrices():
    final, layers, t = 0.8, 5, 16
    rhos = tk.uspa_schedule(final, layers)
    assert np.allclose(1.0 - rhos, [(1.0 - final) ** (l / layers) for l in range(1, layers + 1)], rtol=1e-13)
    assert rhos[-1] == final and np.all(np.diff(rhos) > 0)
    entries = tk.shaping_schedule("u-spa", layers, final_rho=final)
    assert [e["rho"] for e in entries] == rhos.tolist()
    assert np.allclose([e["diagonal"] for e in entries], np.sqrt(1.0 - rhos))
    sigma = np.eye(t)
    for gen, rho in zip(tk.shaping_generators("u-spa", layers, final_rho=final), rhos, strict=True):
        a = expand_attention(gen, t, causal=True).matrix()
        assert np.all(a >= 0.0)
        sigma = tk.attention_token_kernel(sigma, a)
        assert np.allclose(sigma, (1 - rho) * np.eye(t) + rho, atol=1e-12)
    assert tk.shaping_target("u-spa", layers, final_rho=final) == {"family": "uniform", "rho": final}


def test_generators_are_what_expand_attention_reads():
    gens = tk.shaping_generators("e-spa", 3, final_gamma=0.01)
    g = tk.espa_schedule(0.01, 3)
    assert gens[0] == {
        "form": "cholesky_ratio",
        "target": {"family": "exponential", "gamma": g[0]},
        "source": {"family": "identity"},
    }
    assert gens[2]["source"] == {"family": "exponential", "gamma": g[1]}
    assert gens[2]["target"] == {"family": "exponential", "gamma": 0.01}
    for shaping in ("value-skipinit", "shaped"):
        gens = tk.shaping_generators(shaping, 4, temperature=2.0)
        assert len(gens) == 4
        for a in tk.attention_matrices(gens, 10, causal=True):
            assert np.allclose(a, np.eye(10))
        assert tk.shaping_schedule(shaping, 4) == [] and tk.shaping_target(shaping, 4) == {"family": "identity"}
    assert tk.shaping_generators("shaped", 1, temperature=2.0) == [{"form": "shaped", "temperature": 2.0}]
    assert tk.shaping_generators("value-skipinit", 1) == [{"form": "value_skipinit", "alpha": 1.0, "beta": 0.0}]


@pytest.mark.parametrize(
    "call",
    [
        lambda: tk.shaping_generators("espa", 3),
        lambda: tk.shaping_generators("e-spa", 0),
        lambda: tk.shaping_generators("e-spa", 2.0),
        lambda: tk.espa_schedule(0.0, 3),
        lambda: tk.espa_schedule(float("nan"), 3),
        lambda: tk.uspa_schedule(1.0, 3),
        lambda: tk.uspa_schedule(-0.1, 3),
        lambda: tk.shaping_generators("shaped", 2, temperature=0.0),
    ],
)
def test_bad_schedule_arguments_are_refused(call):
    with pytest.raises(SigpropError) as err:
        call()
    assert err.value.code == "invalid_request" and err.value.hint


def test_a_single_layer_schedule_is_the_final_kernel():
    assert tk.espa_schedule(0.3, 1).tolist() == [0.3]
    assert tk.uspa_schedule(0.5, 1).tolist() == [0.5]


# --------------------------------------------------------------------------- linear maps, layer norm


def test_dense_attention_and_sum_maps():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 9))
    k = x @ x.T / 9
    assert np.allclose(tk.dense_token_kernel(k, 2.0, 0.3), 2.0 * k + 0.3)
    a = np.tril(rng.random((6, 6)))
    out = tk.attention_token_kernel(k, a)
    assert np.allclose(out, (a @ x) @ (a @ x).T / 9) and np.array_equal(out, out.T)
    k2 = np.eye(6)
    assert np.allclose(tk.sum_token_kernel([k, k2], [0.25, 0.75]), 0.25 * k + 0.75 * k2)
    with pytest.raises(ValueError):
        tk.sum_token_kernel([k], [0.5, 0.5])
    with pytest.raises(ValueError):
        tk.dense_token_kernel(np.ones((2, 3)))


def test_dense_map_against_wide_random_layers():
    """weight_var K + bias_var: the mean over random layers of width 4096 (one bias per layer,
    shared by the tokens), within 4 standard errors."""
    rng = np.random.default_rng(2)
    t, n, nets = 4, 4096, 6
    x = rng.standard_normal((t, 64))
    k = x @ x.T / 64
    samples = []
    for _ in range(nets):
        w = rng.standard_normal((64, n)) * math.sqrt(1.5 / 64)
        b = rng.standard_normal(n) * math.sqrt(0.2)
        y = x @ w + b
        samples.append(y @ y.T / n)
    samples = np.array(samples)
    se = samples.std(axis=0, ddof=1) / math.sqrt(nets)
    assert np.all(np.abs(samples.mean(axis=0) - tk.dense_token_kernel(k, 1.5, 0.2)) <= 4 * se + 1e-3)


def test_layer_norm_is_the_normalization_of_each_tokens_features():
    """An identity of finite features: per token subtract the feature mean, divide by the std."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 50)) * rng.uniform(0.5, 2.0, (7, 1)) + rng.normal(size=(7, 1))
    k, m = x @ x.T / 50, x.mean(axis=1)
    z = (x - m[:, None]) / x.std(axis=1)[:, None]
    assert np.allclose(tk.layer_norm_token_kernel(k, m), z @ z.T / 50, rtol=0, atol=1e-13)
    y = x - m[:, None]
    assert np.allclose(tk.layer_norm_token_kernel(y @ y.T / 50), z @ z.T / 50, atol=1e-13)
    # a constant token (a zero one here) comes out as 0, as PyTorch's (x - mean) / sqrt(var + eps)
    k0 = np.zeros((3, 3))
    k0[:2, :2] = k[:2, :2]
    out = tk.layer_norm_token_kernel(k0, np.array([m[0], m[1], 0.0]))
    assert np.allclose(out[:2, :2], (z @ z.T / 50)[:2, :2], atol=1e-13)
    assert np.all(out[2] == 0.0) and np.all(out[:, 2] == 0.0)
    with pytest.raises(ValueError):
        tk.layer_norm_token_kernel(np.eye(2), np.array([2.0, 0.0]))


# --------------------------------------------------------------------------- activations


def quad_pair(phi, kinks, qi: float, qj: float, kij: float) -> float:
    """E[phi(u) phi(v)], u = a z1, v = b (c z1 + s z2), by nested scipy quad: over z2 outside,
    over z1 inside split at both factors' kinks (z1 = x / a and z1 = (x / b - s z2) / c), the outer
    one split where those meet (an independent reference, accurate also for c near 1)."""
    a, b = math.sqrt(qi), math.sqrt(qj)
    c = kij / (a * b)
    s = math.sqrt(1.0 - c * c)

    def f(x):
        return float(phi(np.array([x]))[0])

    def inner(z2):
        pts = {x / a for x in kinks} | ({(x / b - s * z2) / c for x in kinks} if c else set())
        return integrate.quad(
            lambda z1: f(a * z1) * f(b * (c * z1 + s * z2)) * math.exp(-0.5 * z1 * z1),
            -12,
            12,
            points=sorted(p for p in pts if abs(p) < 12) or None,
            epsabs=1e-15,
            limit=200,
        )[0]

    meet = {(x / b - c * y / a) / s for x in kinks for y in kinks} if s > 0 else set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", integrate.IntegrationWarning)
        return integrate.quad(
            lambda z2: inner(z2) * math.exp(-0.5 * z2 * z2),
            -12,
            12,
            points=sorted(p for p in meet if abs(p) < 12) or None,
            epsabs=1e-15,
            limit=200,
        )[0] / (2.0 * math.pi)


def quad_mean(act, q: float, power: int = 1) -> float:
    """E[phi(sqrt(q) z)^power] by scipy quad split at the kinks."""
    root = math.sqrt(q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", integrate.IntegrationWarning)
        return _quad_mean(act, root, power)


def _quad_mean(act, root: float, power: int) -> float:
    return integrate.quad(
        lambda z: act.fn(np.array([root * z]))[0] ** power * math.exp(-0.5 * z * z) / SQRT_2PI,
        -12,
        12,
        points=[x / root for x in act.kinks if abs(x / root) < 12] or None,
        epsabs=1e-15,
        epsrel=1e-14,
        limit=200,
    )[0]


def two_tokens(qi, qj, c):
    kij = c * math.sqrt(qi * qj)
    return np.array([[qi, kij], [kij, qj]])


# (name, catalogue params, transformation (input_scale, input_shift, output_scale, output_shift))
ACTIVATIONS = [
    ("tanh", {}, (0.207, -0.567, 6.5, 0.5186)),  # TAT-like
    ("elu", {}, (0.7, 0.3, 1.1, 0.1)),
    ("softsign", {}, None),
    ("gelu", {}, (1.5, -0.5, 1.0, 0.0)),
    ("selu", {}, None),
    ("relu", {}, (1.3, 0.4, 0.8, -0.2)),  # a shifted ReLU (DKS): not positively homogeneous
    ("cst", {"tau": 0.3, "m": 1.0}, None),
]
CASES = [(1.02, 0.97, 0.995), (0.3, 4.0, 0.9), (1.5, 2.0, -0.6), (1.0, 1.1, 0.99999)]


def build(name, params, tr):
    act = get_activation(name, **params)
    return act if tr is None else transformed(act, *tr)


@pytest.mark.parametrize("name, params, tr", ACTIVATIONS[:4])
def test_activation_kernel_against_nested_quadrature(name, params, tr):
    act = build(name, params, tr)
    for qi, qj, c in CASES[:2]:
        got = tk.activation_token_kernel(two_tokens(qi, qj, c), act)[0, 1]
        assert got == pytest.approx(quad_pair(act.fn, act.kinks, qi, qj, c * math.sqrt(qi * qj)), abs=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("name, params, tr", ACTIVATIONS)
def test_activation_kernel_against_nested_quadrature_sweep(name, params, tr):
    act = build(name, params, tr)
    for qi, qj, c in CASES + [(0.2, 5.0, 0.5), (5.0, 5.0, 0.999)]:
        got = tk.activation_token_kernel(two_tokens(qi, qj, c), act)
        assert got[0, 1] == pytest.approx(quad_pair(act.fn, act.kinks, qi, qj, c * math.sqrt(qi * qj)), abs=1e-10)
        assert got[0, 0] == pytest.approx(quad_mean(act, qi, 2), abs=1e-10)


@pytest.mark.parametrize("name, params, tr", ACTIVATIONS)
def test_activation_kernel_against_monte_carlo(name, params, tr):
    """1e6 seeded Gaussian pairs at unequal variances, within 5 standard errors."""
    act = build(name, params, tr)
    rng = np.random.default_rng(4)
    k = np.array([[0.6, 0.5, -0.3], [0.5, 1.7, 0.2], [-0.3, 0.2, 2.5]])
    samples = rng.multivariate_normal(np.zeros(3), k, size=1_000_000, method="cholesky")
    f = act.fn(samples)
    prods = np.einsum("ni,nj->nij", f[:100_000], f[:100_000])  # for the standard errors
    se = prods.std(axis=0) / math.sqrt(len(samples))
    mc = f.T @ f / len(samples)
    assert np.all(np.abs(tk.activation_token_kernel(k, act) - mc) <= 5 * se + 1e-12)
    mean_se = f.std(axis=0) / math.sqrt(len(samples))
    assert np.all(np.abs(tk.activation_token_mean(np.diag(k), act) - f.mean(axis=0)) <= 5 * mean_se)


def test_relu_family_closed_form_is_the_arc_cosine_kernel():
    """E[relu(u) relu(v)] = sqrt(q_i q_j) (sin t + (pi - t) cos t) / (2 pi), t = arccos c (Cho and
    Saul); a leaky ReLU phi_a = relu(x) - a relu(-x) and any scale of it follow by bilinearity."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 4)) * rng.uniform(0.3, 2.0, (9, 1))
    k = x @ x.T / 4
    q = np.diag(k)
    c = np.clip(k / np.sqrt(np.outer(q, q)), -1, 1)
    t = np.arccos(c)

    def arccos_kernel(cos, theta):
        return np.sqrt(np.outer(q, q)) * (np.sin(theta) + (np.pi - theta) * cos) / (2 * np.pi)

    relu_relu = arccos_kernel(c, t)
    relu_negrelu = arccos_kernel(-c, np.pi - t)  # E[relu(u) relu(-v)]: correlation -c
    assert np.allclose(tk.activation_token_kernel(k, get_activation("relu")), relu_relu, rtol=1e-13, atol=1e-15)
    a, g = 0.3, 1.7
    leaky = g * g * (relu_relu + a * a * relu_relu - 2 * a * relu_negrelu)
    act = transformed(get_activation("leaky_relu", negative_slope=a), output_scale=g)
    assert np.allclose(tk.activation_token_kernel(k, act), leaky, rtol=1e-12, atol=1e-14)
    assert np.allclose(tk.activation_token_mean(q, act), g * (1 - a) * np.sqrt(q) / SQRT_2PI)


def test_equal_diagonals_give_the_engines_scalar_c_map():
    """All q equal: K'_ij = Q(q) C(c_ij), Q and C the engine's (``local_stats``, ``HermiteCMap``,
    TAT equation 9 for the Leaky ReLU), for TAT answers' transformed activations."""
    c = np.array([[1.0, 0.3, -0.5], [0.3, 1.0, 0.95], [-0.5, 0.95, 1.0]])
    tanh = get_activation("tanh")
    tat = {"input_scale": 0.207, "input_shift": -0.567, "output_scale": 6.5, "output_shift": 0.5186}
    act = tk.answer_activation("tanh", tat)
    for q in (1.0, 2.3):
        scaled = dict(tat, input_scale=tat["input_scale"] * math.sqrt(q))
        cmap = HermiteCMap(tanh, **scaled)
        second = local_stats(tanh, **scaled).second
        expected = second * cmap(c.ravel()).reshape(3, 3)
        assert np.allclose(tk.activation_token_kernel(q * c, act), expected, rtol=0, atol=1e-12)
    a = 0.4
    act = tk.answer_activation("leaky_relu", {"negative_slope": a, "output_scale": math.sqrt(2 / (1 + a * a))})
    for q in (1.0, 0.7):
        assert np.allclose(tk.activation_token_kernel(q * c, act), q * leaky_relu_c_map(c, a), rtol=1e-14, atol=1e-15)


def test_activation_mean_against_quadrature():
    act = build(*ACTIVATIONS[1])
    q = np.array([0.2, 1.0, 4.0, 1.0])
    got = tk.activation_token_mean(q, act)
    for qi, g in zip(q, got, strict=True):
        assert g == pytest.approx(quad_mean(act, qi), abs=1e-12)


def test_answer_activation_reads_an_answers_fields():
    act = tk.answer_activation("leaky_relu", {"negative_slope": 0.2, "output_scale": 2.0, "sigma_w2": 1.0, "q_1": 1.0})
    assert np.allclose(act.fn(np.array([-1.0, 3.0])), [-0.4, 6.0])
    act = tk.answer_activation(
        "tanh", {"input_scale": 0.5, "input_shift": 0.1, "output_scale": 3.0, "output_shift": -0.2}
    )
    assert act.fn(np.array([0.4]))[0] == pytest.approx(3.0 * (math.tanh(0.3) - 0.2))
    assert tk.answer_activation("gelu", {"input_scale": None}).fn(np.array([1.0]))[0] == pytest.approx(
        0.8413447460685429
    )


def test_activation_kernel_is_symmetric_and_exact_on_the_diagonal():
    gens = tk.shaping_generators("e-spa", 3, final_gamma=0.02)
    k = np.eye(20)
    for a in tk.attention_matrices(gens, 20, causal=True):
        k = tk.attention_token_kernel(k, a)
    k = k * np.linspace(0.8, 1.3, 20)[:, None] * np.linspace(0.8, 1.3, 20)[None, :]
    for name, params, tr in ACTIVATIONS[:3]:
        act = build(name, params, tr)
        out = tk.activation_token_kernel(k, act)
        assert np.array_equal(out, out.T)
        q = np.diag(k)
        second = [quad_mean(act, qi, 2) for qi in q[[0, -1]]]
        assert np.allclose(np.diag(out)[[0, -1]], second, rtol=0, atol=1e-11)


@pytest.mark.parametrize(
    "name, params, tr", ACTIVATIONS + [("leaky_relu", {"negative_slope": 0.2}, (1.0, 0.0, 1.3, 0.0))]
)
def test_degenerate_tokens(name, params, tr):
    """A repeated token (c = 1), a negated one (c = -1) and a zero token: one-dimensional integrals."""
    act = build(name, params, tr)
    q = 1.7
    k = np.array([[q, q, -q, 0.0], [q, q, -q, 0.0], [-q, -q, q, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = tk.activation_token_kernel(k, act)
    root = math.sqrt(q)
    f0 = float(act.fn(np.zeros(1))[0])

    def quad1(g):
        pts = sorted({x / root for x in act.kinks} | {-x / root for x in act.kinks})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", integrate.IntegrationWarning)
            return integrate.quad(
                lambda z: g(z) * math.exp(-0.5 * z * z) / SQRT_2PI, -12, 12, points=pts or None, epsabs=1e-15, limit=200
            )[0]

    def phi(x):
        return float(act.fn(np.array([x]))[0])

    second = quad1(lambda z: phi(root * z) ** 2)
    assert out[0, 1] == pytest.approx(second, abs=1e-10) and out[0, 0] == pytest.approx(second, abs=1e-10)
    assert out[0, 2] == pytest.approx(quad1(lambda z: phi(root * z) * phi(-root * z)), abs=1e-10)
    assert out[0, 3] == pytest.approx(f0 * quad1(lambda z: phi(root * z)), abs=1e-10)
    assert out[3, 3] == pytest.approx(f0 * f0, abs=1e-14)


def test_too_many_pairs_to_integrate_are_refused():
    """Softsign on E-SPA's strongly correlated tokens: every pair needs the direct integration."""
    k = exp_kernel(0.01, 12)
    act = get_activation("softsign")
    out = tk.activation_token_kernel(k, act)
    with pytest.raises(SigpropError) as err:
        tk.activation_token_kernel(k, act, max_integrated_pairs=10)
    assert err.value.code == "graph_too_large" and "66 token pairs" in err.value.message and err.value.hint
    assert np.array_equal(tk.activation_token_kernel(k, act, max_integrated_pairs=66), out)
    # an analytic activation's series is enough however correlated the tokens
    assert tk.activation_token_kernel(k, get_activation("tanh"), max_integrated_pairs=0).shape == (12, 12)


@pytest.mark.parametrize(
    "name, params, tr", [ACTIVATIONS[5], ACTIVATIONS[6], ("leaky_relu", {"negative_slope": 0.1}, (0.8, 0.0, 1.4, 0.0))]
)
def test_direct_integration_agrees_with_the_closed_forms(name, params, tr):
    """``pair_expectation`` (conditional Gaussian ramps, one-dimensional rule) against the closed
    forms (Owen's T; the arc-cosine kernel), pair by pair."""
    from sigprop.engine.maps.token_activation import pair_expectation

    act = build(name, params, tr)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 3)) * rng.uniform(0.4, 2.0, (5, 1))
    k = x @ x.T / 3
    k[4, :4] = k[:4, 4] = 0.9995 * k[3, :4] * math.sqrt(k[4, 4] / k[3, 3])  # token 4 nearly token 3
    k[4, 3] = k[3, 4] = 0.9995 * math.sqrt(k[3, 3] * k[4, 4])
    closed = tk.activation_token_kernel(k, act)
    q = np.diag(k)
    for i in range(5):
        for j in range(i + 1, 5):
            c = k[i, j] / math.sqrt(q[i] * q[j])
            assert closed[i, j] == pytest.approx(pair_expectation(act, math.sqrt(q[i]), math.sqrt(q[j]), c), abs=1e-11)


def test_a_long_leaky_relu_espa_stack_is_fast():
    """T = 256 tokens through 72 E-SPA attention layers, each followed by TAT's Leaky ReLU (the
    least of three tries: a busy machine's pauses are not the code's): about 0.4 s on one core of
    the 2-core CI box, bounded at 2 s for a loaded one."""
    import time

    mats = tk.attention_matrices(tk.shaping_generators("e-spa", 72), 256, causal=True)
    act = tk.answer_activation("leaky_relu", {"negative_slope": 0.9, "output_scale": math.sqrt(2 / 1.81)})
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        k = np.eye(256)
        for a in mats:
            k = tk.activation_token_kernel(tk.attention_token_kernel(k, a), act)
        best = min(best, time.perf_counter() - start)
        if best < 2.0:
            break
    assert best < 2.0, best
    assert np.all(np.isfinite(k)) and k[0, 0] == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SMOOTH_ACTIVATIONS if n != "silu"])
def test_every_smooth_catalogue_activation_to_1e_10(name):
    """The catalogue's smooth activations, untransformed, at q in [0.2, 5] and |c| up to 0.99999
    (measured: 5e-12 at worst, asinh)."""
    act = get_activation(name)
    for qi, qj, c in [(0.2, 5.0, 0.5), (1.0, 1.0, 0.99), (0.2, 0.25, 0.99999), (5.0, 4.0, 0.99999), (3.0, 0.5, -0.9)]:
        got = tk.activation_token_kernel(two_tokens(qi, qj, c), act)[0, 1]
        assert got == pytest.approx(quad_pair(act.fn, act.kinks, qi, qj, c * math.sqrt(qi * qj)), abs=1e-10)


def test_elu_family_is_read_off_the_transformed_activation():
    """ELU and SELU, however transformed (a negative input scale too), are P + Q E(a (x - x0))."""
    from sigprop.engine.maps.token_exponential import elu_family

    for act in [
        build(*ACTIVATIONS[1]),
        get_activation("selu"),
        transformed(get_activation("elu", alpha=0.5), -1.3, 0.2, 2.0, 0.4),
    ]:
        fam = elu_family(act)
        x = np.linspace(-6, 6, 101)
        assert fam is not None and np.allclose(fam(x), act.fn(x), rtol=1e-13, atol=1e-13)
    assert elu_family(get_activation("tanh")) is None and elu_family(get_activation("elu", alpha=0.0)) is None
