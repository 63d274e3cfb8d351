"""The shortcuts that make a cold solve cheap give the answers of the slow ways they replace.

- fused activation jets (``activation_jets``) against the three closed forms;
- the wide-panel rule of the Q/C statistics against the narrow rule it replaced and a much finer one;
- the early-stopped Hermite series against the full 96-term series;
- the bracketed Newton iteration with complex-step derivatives (``roots``) against Brent's method
  on the same functions, for TAT's negative slope and DKS's per-layer slope;
- the chain implementation of the network program (running value, one real pass with forward
  derivatives for TReLU, closed forms) against the general one on the same graph and the complex
  step (``tests/engine/test_program_contract.py`` compares whole answers);
- the closed-form TReLU statistics, the two-buffer chain map and the cumulative-product Hermite
  series evaluation against quadrature, the per-layer map and Horner's rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize as sp_opt

from sigprop.engine.maps import qc_maps
from sigprop.engine.maps.activation_jets import JETS
from sigprop.engine.maps.activations import get_activation
from sigprop.engine.maps.qc_maps import HermiteCMap, _z_kinks, moment_rule
from sigprop.engine.maps.quadrature import SERIES_RULE, gaussian_rule
from sigprop.engine.methods import deep_kernel_shaping, tat
from sigprop.engine.methods.roots import complex_step, newton_bracketed
from sigprop.engine.network.program import chain_program, compile_program, general_program
from sigprop.engine.solve import prepare, solve
from sigprop.schemas.solve import SolveRequest

X = np.concatenate(
    [
        np.linspace(-1e3, 1e3, 2001),
        np.linspace(-40, 40, 8001),
        np.geomspace(1e-12, 1, 100),
        -np.geomspace(1e-12, 1, 100),
    ]
)


@pytest.mark.parametrize("name", sorted(JETS))
def test_jet_equals_closed_forms(name):
    act = get_activation(name)
    assert act.jet is JETS[name]
    for got, want in zip(act.jet(X), (act.fn(X), act.d1(X), act.d2(X)), strict=True):
        # the same formulas; only the order of a few products differs (gelu_tanh: k x x vs k (x x))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    # _node_values scales phi' and phi'' in place: a jet's arrays must be new, and its own
    x = X.copy()
    out = act.jet(x)
    for i, a in enumerate(out):
        assert a.flags.owndata and a.flags.writeable
        assert not np.shares_memory(a, x) and not any(np.shares_memory(a, b) for b in out[i + 1 :])


def test_parameterized_and_transformed_activations_have_no_jet():
    from sigprop.engine.maps.activations import transformed

    assert get_activation("elu", alpha=0.5).jet is None
    assert transformed(get_activation("swish"), 0.5, 0.1, 2.0, 0.3).jet is None


def _moments(act, a, b, z, w):
    u = a * z + b
    f, d1, d2 = act.fn(u), a * act.d1(u), a * a * act.d2(u)
    m = np.array([w @ f, w @ (f * f), w @ d1, w @ (d1 * d1), w @ (d2 * d2), w @ (f * d1 * z)])
    # each moment against its natural scale: sqrt(Q), Q, sqrt(E phi'^2), E phi'^2, E phi''^2, sqrt(Q E phi'^2)
    scale = np.array([np.sqrt(m[1]), m[1], np.sqrt(m[3]), m[3], max(m[4], 1e-300), np.sqrt(m[1] * m[3])])
    return m, scale


SMOOTH = ["softplus", "tanh", "gelu", "swish", "elu", "selu", "sigmoid", "erf", "atan", "softsign", "gelu_tanh"]


@pytest.mark.parametrize("name", SMOOTH)
def test_wide_rule_moments_match_a_much_finer_rule(name):
    """The Q/C statistics' rule (16-node panels up to width 2, aligned with the bend only above
    UNALIGNED_BELOW or at kinks) against panels of at most 1/8 aligned with the bend: every moment
    to 1e-13 of its scale, input scales 1e-3 to 100, shifts -2.9 to 1.7."""
    act = get_activation(name)
    worst = 0.0
    for a in (1e-3, 0.05, 0.3, 0.5, 0.75, 1.0, 3.0, 30.0, 100.0):
        for b in (0.0, 0.3, -1.0, 1.7, -2.9):
            kinks = _z_kinks(act, a, b)
            fine, scale = _moments(act, a, b, *gaussian_rule(kinks, scale=a, widest=0.125, tail=12.0))
            wide, _ = _moments(act, a, b, *moment_rule(act, a, b))
            worst = max(worst, float(np.max(np.abs(wide - fine) / scale)))
    assert worst < 1e-13
    assert len(gaussian_rule(_z_kinks(act, 0.5, 0.2), scale=0.5)[0]) < 300  # what makes it cheap


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("softplus", dict(input_scale=0.3, input_shift=0.2, output_scale=3.0, output_shift=-0.5)),
        ("tanh", dict(input_scale=0.5)),
        ("tanh", dict(input_scale=0.78, input_shift=0.2)),  # analytic strip of 2: the wide rule's trial runs out
        ("tanh", dict(input_scale=0.3, input_shift=1.7)),  # quiet after 22 terms on the wide rule
        ("tanh", dict(input_scale=3.0)),
        ("gelu_tanh", dict(input_scale=0.05)),
        ("swish", dict(input_scale=0.2, input_shift=0.1)),
        ("gelu", dict(input_scale=1.3, input_shift=-0.4)),
        ("relu", {}),
    ],
)
def test_early_stopped_series_equals_full_series(name, params, monkeypatch):
    """The series as served (from the moments' wide rule when phi_hat is analytic in a wide strip
    and goes quiet within 24 terms, else from the series rule, stopped once quiet) against all 96
    terms on the series rule."""
    act = get_activation(name)
    short = HermiteCMap(act, **params)
    monkeypatch.setattr(qc_maps, "_QUIET_BELOW", 0.0)  # never quiet: all 96 terms, as before
    full = HermiteCMap(act, **params)
    c = np.linspace(-1.0, 1.0, 201)
    np.testing.assert_allclose(short(c), full(c), rtol=0, atol=8e-16)  # a few ulps of C
    assert short.tail == pytest.approx(full.tail, abs=2e-15)  # for a smooth phi_hat: the rounding of Q(1) - sum a_k^2
    assert short(np.array([1.0]))[0] == pytest.approx(1.0, abs=1e-15)
    widest, tail = SERIES_RULE
    assert widest <= 0.5 and tail >= 11.0  # the series' rule keeps the narrow panels


def test_complex_step_derivative():
    v, d = complex_step(lambda z: z**3 + 2 * z, 1.5)
    assert v == 1.5**3 + 3.0 and d == pytest.approx(3 * 1.5**2 + 2, rel=1e-15)


def test_newton_bracketed_falls_back_to_bisection():
    # a flat start (zero slope) and a step out of the bracket both bisect instead
    f = lambda x: (np.arctan(10 * (x - 0.3)), 10 / (1 + 100 * (x - 0.3) ** 2))  # noqa: E731
    assert newton_bracketed(f, -5.0, 5.0, 4.9) == pytest.approx(0.3, abs=1e-15)
    assert newton_bracketed(lambda x: (x * x - 2.0, 0.0), 0.0, 2.0, 1.0) == pytest.approx(np.sqrt(2.0), abs=1e-14)


GRAPHS = [
    {"template": "mlp", "depth": 100},
    {"template": "mlp", "depth": 3},
    {"template": "resnet", "depth": 50, "version": 2, "shortcut_weight": 0.8},
    {"template": "densenet", "depth": 121},
]


def _program(graph):
    req = SolveRequest.model_validate(
        {"graph": graph, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.5}}
    )
    return compile_program(prepare(req).graph)


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: f"{g['template']}-{g['depth']}")
def test_tat_negative_slope_matches_brent(graph):
    program = _program(graph)
    for eta in (0.85, 0.5, 0.1):
        if eta > tat.max_c_value(program, 0.0):
            continue
        a = tat.solve_tat_leaky_relu(program, eta)
        ref = sp_opt.brentq(lambda s: tat.max_c_value(program, s) - eta, 0.0, 1.0, xtol=1e-15, rtol=1e-15)
        assert a == pytest.approx(ref, abs=1e-15)
        assert abs(tat.max_c_value(program, a) - eta) <= abs(tat.max_c_value(program, ref) - eta) + 1e-16


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: f"{g['template']}-{g['depth']}")
def test_dks_local_slope_matches_brent(graph):
    program = _program(graph)
    for zeta in (1.0001, 1.5, 12.0, 1e6):
        s = deep_kernel_shaping.local_slope_target(program, zeta)
        hi = 2.0
        while deep_kernel_shaping.max_slope(program, hi) < zeta:
            hi *= 2.0
        ref = sp_opt.brentq(lambda x: deep_kernel_shaping.max_slope(program, x) - zeta, 1.0, hi, xtol=1e-15, rtol=1e-15)
        assert s == pytest.approx(ref, rel=1e-15)
        got = abs(deep_kernel_shaping.max_slope(program, s) - zeta)
        assert got <= abs(deep_kernel_shaping.max_slope(program, ref) - zeta) + 4 * np.spacing(zeta)


@pytest.mark.parametrize(
    "graph",
    [{"template": "mlp", "depth": 100}, {"template": "mlp", "depth": 1}, {"template": "cnn", "depth": 8}],
    ids=lambda g: f"{g['template']}-{g['depth']}",
)
def test_chain_program_is_what_the_general_analysis_finds(graph):
    g = prepare(
        SolveRequest.model_validate({"graph": graph, "method": "tat", "activation": "tanh", "targets": {"tau": 0.3}})
    ).graph
    assert all(len(nd.inputs) <= 1 for nd in g.nodes)
    chain, general = chain_program(g), general_program(g)
    assert type(compile_program(g)) is type(chain) is not type(general)
    assert (chain.regions, chain.depth) == (general.regions, general.depth) == (g.n - 1, g.depth())
    assert (chain.output, chain.user_ids) == (general.output, general.user_ids)
    # the running-value pass gives what the node-table pass gives, for scalars, complex steps and arrays
    r = lambda y, _slot: 0.3 + 0.6 * y + 0.1 * y * y  # noqa: E731
    for x in (0.0, complex(0.5, 1e-30), np.linspace(-1.0, 1.0, 7)):
        np.testing.assert_array_equal(chain.global_map(x, r), general.global_map(x, r))
        np.testing.assert_array_equal(chain.maximize(x, r), general.maximize(x, r))
    # the chain's candidates leave out the affine layers' repeats, never a value
    found = [complex(v) for v in general.candidate_values(complex(0.5, 1e-30), r)]
    assert {complex(v) for v in chain.candidate_values(complex(0.5, 1e-30), r)} == set(found)
    # a map that falls after a few layers: a subnetwork short of the whole network attains the max
    for bump in (lambda y, _slot: 0.5 + 0.4 * y, lambda y, _slot: 0.9 - y * y):
        assert chain.argmax(0.0, bump) == general.argmax(0.0, bump)
        assert chain.maximize(0.0, bump) == general.maximize(0.0, bump)
    # DKS's slope function in closed form on a chain (s^L) against the general pass
    for slope in (1.0, 1.004, 1.3, 2.0, 0.9):
        assert chain.max_slope(slope) == pytest.approx(general.max_slope(slope), rel=1e-13)
        np.testing.assert_allclose(
            chain.max_slope_and_derivative(slope), general.max_slope_and_derivative(slope), rtol=1e-12
        )
    for slope, curv in ((1.004, 0.02), (1.0, 0.3), ([1.2, 1.0], [0.0, 0.5]), (0.9, 0.1), (1.1, -0.2)):
        np.testing.assert_allclose(
            chain.max_slope_and_curvature(slope, curv), general.max_slope_and_curvature(slope, curv), rtol=1e-13
        )
    for zeta in (1.0001, 1.5, 1e6):
        assert deep_kernel_shaping.local_slope_target(chain, zeta) == pytest.approx(
            deep_kernel_shaping.local_slope_target(general, zeta), rel=2e-16
        )
    assert chain.curvature_multiplier() == general.curvature_multiplier() == g.depth()
    # the maximizer notes: the chain's shortcuts where its maps never lower their input, and the
    # general argmax where they can (a slope below 1 shrinks, a negative curvature falls)
    for slopes, curvs in (([1.0], [0.2]), ([1.3], [0.0]), ([0.9], [-0.1])):
        assert chain.slope_maximizer(slopes) == general.slope_maximizer(slopes)
        assert chain.curvature_maximizer(curvs) == general.curvature_maximizer(curvs)
    for a in (0.0, 0.5, 1.0):
        assert chain.c0_maximizer(a) == general.c0_maximizer(a) == "the whole network"
    if chain.depth > 1:  # 0 -> 0.9 -> 0.09 -> ..: the first activation's subnetwork is the largest
        assert chain.argmax(0.0, lambda y, _slot: 0.9 - y * y) == f"from the input to {chain.user_ids[2]!r}"
        assert chain.slope_maximizer([0.9]) == f"from the input to {chain.user_ids[1]!r}"
    with pytest.raises(ValueError, match="not a chain"):
        chain_program(
            prepare(
                SolveRequest.model_validate(
                    {"graph": {"template": "resnet", "depth": 18}, "method": "eoc", "activation": "tanh"}
                )
            ).graph
        )


@pytest.mark.parametrize("depth", [1, 3, 100, 1000])
def test_chain_trelu_pass_matches_the_general_pass(depth):
    """The chain's mu_f^0 (one real pass with forward derivatives) against the general program's
    pass over the same chain, with the complex step."""
    g = prepare(
        SolveRequest.model_validate(
            {"graph": {"template": "mlp", "depth": depth}, "method": "tat", "activation": "leaky_relu"}
        )
    ).graph
    general, chain = general_program(g), chain_program(g)
    for a in (0.0, 0.2, 0.57, 0.95, 1.0):
        v, d = chain.max_c0_and_derivative(a)
        ref_v, ref_d = general.max_c0_and_derivative(a)
        assert v == pytest.approx(ref_v, rel=0, abs=4e-16)
        # a Newton slope: the two round differently once c is near 1 (ReLU, a thousand layers)
        assert d == pytest.approx(ref_d, rel=1e-9 if depth > 100 else 1e-12, abs=1e-15)
        assert tat.max_c_value(chain, a) == v
        assert tat.max_c_value(general, a) == pytest.approx(v, rel=0, abs=4e-16)
    # the complex step through the general pass is the derivative (against a central difference)
    h = 1e-6
    fd = (general.max_c0(0.5 + h) - general.max_c0(0.5 - h)) / (2 * h)
    assert general.max_c0_and_derivative(0.5)[1] == pytest.approx(fd, rel=1e-7)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 1.0])
def test_closed_form_trelu_statistics_match_quadrature(a):
    scale = float(np.sqrt(2.0 / (1.0 + a * a)))
    got = qc_maps.leaky_relu_stats(a, scale)
    want = qc_maps.local_stats(get_activation("leaky_relu", negative_slope=a), output_scale=scale)
    for name in ("mean", "second", "d1_mean", "d1_sq", "d2_sq", "q_slope_1"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=0, abs=2e-15), name
    for one in (got.q_1, got.q_slope_1, got.c_slope_1):  # equation 9's normalization
        assert one == pytest.approx(1.0, abs=1e-15)
    assert got.c_0 == pytest.approx(qc_maps.rectifier_k(a), abs=1e-16)


def test_two_buffer_chain_map_equals_the_layer_by_layer_map():
    rows = np.tile(np.append(np.linspace(-1.0, 1.0, 33), 0.0), (2, 1))
    ks = qc_maps.rectifier_k(np.array([[0.57], [0.0]]))
    want = rows
    for _ in range(100):
        want = qc_maps.rectifier_c_map(want, ks)
    got = qc_maps.rectifier_chain_map(rows, ks, 100)
    np.testing.assert_array_equal(got, want)
    assert rows[0, 0] == -1.0 and rows[0, -1] == 0.0  # the input is not overwritten
    np.testing.assert_array_equal(qc_maps.rectifier_chain_map(rows, ks, 0), rows)


@pytest.mark.parametrize(
    "name, params",
    [
        ("swish", dict(input_scale=1.1, input_shift=0.2, output_scale=1.3)),
        ("tanh", {}),
        ("relu", {}),
        # DKS's solved swish and TAT's softplus on MLP-100: near-linear, short series
        ("swish", dict(input_scale=0.1294936, input_shift=0.3494754, output_scale=11.50455, output_shift=-0.2088933)),
        ("softplus", dict(input_scale=0.1779, input_shift=-0.5, output_scale=8.0, output_shift=-0.474)),
    ],
)
def test_hermite_map_evaluation_equals_horner(name, params):
    table = HermiteCMap(get_activation(name), **params)
    c = np.linspace(-1.0, 1.0, 101)
    horner = np.polynomial.polynomial.polyval(c, table.coefficients)
    np.testing.assert_allclose(table(c), horner, rtol=0, atol=9e-16)
    np.testing.assert_allclose(table(c[:7]), horner[:7], rtol=0, atol=9e-16)  # another sample size
    np.testing.assert_allclose(table(c), horner, rtol=0, atol=9e-16)  # its buffer reused
    layered = c
    for k in range(1, 51):
        layered = table(layered)
        if k == 7:  # below qc_maps._COMPOSE_FROM: layer by layer, the same numbers
            np.testing.assert_array_equal(table.iterate(c, 7), layered)
    if len(table.coefficients) > qc_maps._COMPOSE_TERMS:  # a long series: layer by layer
        np.testing.assert_array_equal(table.iterate(c, 50), layered)
        return
    # a chain's global map through C^4: the same map to rounding
    np.testing.assert_allclose(table.iterate(c, 50), layered, rtol=0, atol=2e-14)
    np.testing.assert_array_equal(table.iterate(c, 0), c)
    square = qc_maps.self_composed(table.coefficients)
    assert (square >= 0).all() and square.sum() == pytest.approx(1.0, abs=1e-15)
    np.testing.assert_allclose(np.polynomial.polynomial.polyval(c, square), table(table(c)), rtol=0, atol=1e-15)


def test_repeated_points_are_evaluated_once(monkeypatch):
    """scipy's root evaluates its start three times, and a polished root is evaluated again in the
    other coordinates: the conditions remember the last point, and the answer is unchanged."""
    from sigprop.engine.maps import transform

    calls = []
    real = transform._conditions
    monkeypatch.setattr(transform, "_conditions", lambda *a: calls.append(a[-1].tobytes()) or real(*a))
    sol = transform.solve_transform(get_activation("swish"), c_slope_1=1.5 ** (1 / 100), c_0=0.0)
    assert all(a != b for a, b in zip(calls, calls[1:], strict=False))  # no point twice in a row
    monkeypatch.setattr(transform.LastPoint, "__call__", lambda self, p: real(self.act, self.c_0, self.targets, p))
    assert transform.solve_transform(get_activation("swish"), c_slope_1=1.5 ** (1 / 100), c_0=0.0) == sol


def test_a_step_into_saturation_gives_nan_not_an_exception():
    """hybr can step far into tanh's saturation, where phi + delta is 0 on every node: the step's
    statistics are NaN (the search moves on), as numpy's 1 / 0 made them before shaped_stats."""
    shift, scale, st = qc_maps.shaped_stats(get_activation("tanh"), 0.9847258163312043, -789.4644914590344, 1.0)
    assert scale == np.inf and np.isnan(st.q_slope_1)
    ans = solve(
        SolveRequest.model_validate(
            {"graph": {"template": "mlp", "depth": 1}, "method": "dks", "activation": "tanh", "targets": {"zeta": 1.5}}
        )
    )
    assert ans.c_slope_1 == pytest.approx(1.5, rel=1e-12)


@pytest.mark.parametrize("scale", [1e-13, 0.01, 0.13, 0.75, 1.0, 1.7, 3.0, -2.5, 40.0])
def test_unaligned_rule_is_the_general_rule_without_kinks(scale):
    from sigprop.engine.maps.quadrature import unaligned_rule

    z, w = unaligned_rule(scale)
    z2, w2 = gaussian_rule(scale=scale)
    np.testing.assert_array_equal(z, z2)
    np.testing.assert_array_equal(w, w2)


def test_chain_slope_power_overflows_to_inf_as_the_pass_does():
    request = {"graph": {"template": "mlp", "depth": 2000}, "method": "dks", "activation": "tanh"}
    g = prepare(SolveRequest.model_validate({**request, "targets": {"zeta": 1.5}})).graph
    chain, general = chain_program(g), general_program(g)
    assert deep_kernel_shaping.max_slope(chain, 2.0) == deep_kernel_shaping.max_slope(general, 2.0) == np.inf
    assert deep_kernel_shaping.local_slope_target(chain, 1.5) == pytest.approx(1.5 ** (1 / 2000), rel=1e-15)


def test_composed_global_map_is_as_accurate_as_layer_by_layer():
    """DKS's solved swish on 100 layers: the C^4 route and the layer-by-layer route, each against
    the same polynomial iterated in extended precision."""
    table = HermiteCMap(
        get_activation("swish"),
        input_scale=0.1294936,
        input_shift=0.3494754,
        output_scale=11.50455,
        output_shift=-0.2088933,
    )
    c = np.append(np.linspace(-1.0, 1.0, 33), 0.0)
    exact = c.astype(np.longdouble)
    coef = table.coefficients.astype(np.longdouble)
    layered = c
    for _ in range(100):
        exact = np.polynomial.polynomial.polyval(exact, coef)
        layered = table(layered)
    composed = table.iterate(c, 100)
    err_composed = float(np.max(np.abs(composed - exact)))
    err_layered = float(np.max(np.abs(layered - exact)))
    assert err_composed <= max(2.0 * err_layered, 1e-14)
