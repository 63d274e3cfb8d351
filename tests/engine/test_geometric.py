"""Geometric initialization and GR scaling (sigprop.engine.methods.geometric) against the GR-scaling paper:
equal gammas (Proposition 3, equation 1) for an MLP and the strided AlexNet of Appendix F, the
closed forms of equation 7 and Remark 6, sections 6.3 / 6.4, Appendix E / E.1, Table 1, and a
Monte Carlo check that the weight-to-gradient ratios nu_l of section 4 come out equal."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sigprop.engine.graph.build import build_graph
from sigprop.engine.maps.activations import get_activation
from sigprop.engine.methods.geometric import OUTPUT_STD, solve_geometric
from sigprop.errors import SigpropError
from sigprop.schemas import Graph

ACT = {"op": "activation"}


def chain(input_shape, layers, activation="relu"):
    nodes = [{"id": "x", "op": "input", "shape": list(input_shape)}]
    prev = "x"
    for i, layer in enumerate(layers):
        nid = layer.get("id", f"n{i}")
        nodes.append({**layer, "id": nid, "inputs": [prev]})
        prev = nid
    nodes.append({"id": "out", "op": "output", "inputs": [prev]})
    return build_graph(Graph.model_validate({"nodes": nodes}), activation)


def mlp(widths):
    layers = []
    for i, w in enumerate(widths[1:]):
        layers.append({"op": "dense", "units": w, "id": f"d{i}"})
        if i < len(widths) - 2:
            layers.append({**ACT, "id": f"a{i}"})
    return chain([widths[0]], layers)


def alexnet():
    """Appendix F: the strided AlexNet for 32x32 CIFAR-10 (max pooling replaced by striding,
    'equal' padding, ReLU after every conv and hidden linear layer, average pooling to 1x1)."""
    return chain(
        [3, 32, 32],
        [
            {"op": "conv", "channels": 64, "kernel": 11, "stride": 1, "id": "conv1"},
            ACT,
            {"op": "conv", "channels": 192, "kernel": 5, "stride": 2, "id": "conv2"},
            ACT,
            {"op": "conv", "channels": 384, "kernel": 3, "stride": 2, "id": "conv3"},
            ACT,
            {"op": "conv", "channels": 256, "kernel": 3, "id": "conv4"},
            ACT,
            {"op": "conv", "channels": 256, "kernel": 3, "id": "conv5"},
            ACT,
            {"op": "global_avg_pool"},
            {"op": "dense", "units": 4096, "id": "fc1"},
            ACT,
            {"op": "dense", "units": 4096, "id": "fc2"},
            ACT,
            {"op": "dense", "units": 10, "id": "fc3"},
        ],
    )


def rel_spread(values):
    values = np.asarray(values, dtype=float)
    return float(values.max() / values.min() - 1.0)


# --------------------------------------------------------------------------- balanced gammas


def test_mlp_gammas_equal_without_correction():
    sol = solve_geometric(mlp([784, 384, 64, 10]), "relu")
    assert [l["id"] for l in sol.layers] == ["d0", "d1", "d2"]
    assert rel_spread([l["gamma_uncorrected"] for l in sol.layers]) < 1e-9  # Proposition 5
    assert rel_spread([l["gamma"] for l in sol.layers]) < 1e-9
    assert all(l["alpha"] == 1.0 for l in sol.layers)
    assert sol.gamma_ratio == pytest.approx(1.0, abs=1e-9)
    assert sol.warnings == []
    # Proposition 7 (c = 2): the biases are balanced too, and section 6.3's input moment balances
    # the weights against the biases.
    assert rel_spread([l["gamma_bias"] for l in sol.layers]) < 1e-9
    assert sol.layers[0]["gamma"] == pytest.approx(sol.layers[0]["gamma_bias"], rel=1e-12)


def test_deeper_mlp_with_bottlenecks_is_balanced():
    sol = solve_geometric(mlp([100, 400, 50, 200, 30, 300, 10]), "relu")
    assert rel_spread([l["gamma_uncorrected"] for l in sol.layers]) < 1e-9


def test_alexnet_gammas_equal_after_alpha_correction():
    sol = solve_geometric(alexnet(), "relu")
    ids = [l["id"] for l in sol.layers]
    assert ids == ["conv1", "conv2", "conv3", "conv4", "conv5", "fc1", "fc2", "fc3"]
    kernel = {"conv1": 11, "conv2": 5, "conv3": 3, "conv4": 3, "conv5": 3}
    k = np.array([kernel.get(i, 1) for i in ids], dtype=float)
    gamma = np.array([l["gamma"] for l in sol.layers])
    raw = np.array([l["gamma_uncorrected"] for l in sol.layers])
    alpha = np.array([l["alpha"] for l in sol.layers])
    assert rel_spread(gamma) < 1e-9
    assert sol.gamma_ratio == pytest.approx(1.0, abs=1e-9)
    # Without alpha the strided chain is balanced up to the kernel area (section 5: "Sequences of
    # convolutions are well-scaled against each other as long as the kernel size remains the
    # same"; strides and average pooling preserve the scaling, Table 1) ...
    assert rel_spread(raw / k**2) < 1e-9
    assert sol.gamma_ratio_uncorrected == pytest.approx(121.0, rel=1e-9)
    # ... and the conditioning multipliers correct it with alpha^4 k^2 = const (alpha^2 ~ 1/k).
    assert np.allclose(alpha**2 * k, 1.0, rtol=1e-12)
    # the forward pass is unchanged: the stored weights absorb 1 / alpha^2
    for l in sol.layers:
        assert l["init_second_moment"] * l["alpha"] ** 2 == pytest.approx(l["weight_second_moment"], rel=1e-12)
    assert not any(l["in_branch"] for l in sol.layers)


# --------------------------------------------------------------------------- closed forms


def test_weight_second_moments_closed_form():
    sol = solve_geometric(alexnet(), "relu")
    by_id = {l["id"]: l for l in sol.layers}
    # Remark 6: c / (k^2 sqrt(n_in n_out)) with channel counts as the fans
    assert by_id["conv1"]["weight_second_moment"] == pytest.approx(2 / (121 * math.sqrt(3 * 64)), rel=1e-14)
    assert by_id["conv2"]["weight_second_moment"] == pytest.approx(2 / (25 * math.sqrt(64 * 192)), rel=1e-14)
    assert by_id["conv5"]["weight_second_moment"] == pytest.approx(2 / (9 * 256), rel=1e-14)
    assert (by_id["conv2"]["fan_in"], by_id["conv2"]["fan_out"], by_id["conv2"]["kernel"]) == (64, 192, [5, 5])
    # equation 7
    assert by_id["fc1"]["weight_second_moment"] == pytest.approx(2 / math.sqrt(256 * 4096), rel=1e-14)
    assert by_id["fc3"]["weight_second_moment"] == pytest.approx(2 / math.sqrt(4096 * 10), rel=1e-14)
    assert by_id["fc1"]["kernel"] is None and by_id["fc1"]["fan_in"] == 256
    # Leaky ReLU: c = 2 / (1 + a^2)
    leaky = get_activation("leaky_relu", negative_slope=0.2)
    sol = solve_geometric(mlp([784, 384, 64, 10]), leaky)
    assert sol.c == pytest.approx(2 / 1.04, rel=1e-14)
    assert sol.layers[1]["weight_second_moment"] == pytest.approx(2 / 1.04 / math.sqrt(384 * 64), rel=1e-14)
    assert rel_spread([l["gamma_uncorrected"] for l in sol.layers]) < 1e-9


def test_input_and_output_scaling():
    sol = solve_geometric(mlp([784, 384, 64, 10]), "relu")
    assert sol.input_second_moment == pytest.approx(1 / math.sqrt(784), rel=1e-14)  # section 6.3
    # section 6.4: post-ReLU moments telescope to sqrt(n_0 / n_out) E[x_0^2]; the last linear
    # layer then multiplies by n_in E[W^2] = 2 sqrt(64 / 10)
    x2 = math.sqrt(784 / 64) * sol.input_second_moment
    assert sol.output_second_moment == pytest.approx(2 * math.sqrt(64 / 10) * x2, rel=1e-12)
    assert sol.output_scale * math.sqrt(sol.output_second_moment) == pytest.approx(OUTPUT_STD, rel=1e-12)
    # a given input moment moves every gamma by the same factor (t^2) and keeps the balance
    other = solve_geometric(mlp([784, 384, 64, 10]), "relu", input_second_moment=1.0)
    for a, b in zip(sol.layers, other.layers, strict=False):
        assert b["gamma"] / a["gamma"] == pytest.approx(784.0, rel=1e-9)
    # conv input: 1 / sqrt(n_0 k_0^2) for a first layer without conditioning multiplier
    cnn = chain(
        [3, 16, 16],
        [
            {"op": "conv", "channels": 32, "kernel": 3},
            ACT,
            {"op": "conv", "channels": 32, "kernel": 3},
            ACT,
            {"op": "global_avg_pool"},
            {"op": "dense", "units": 10},
        ],
    )
    sol = solve_geometric(cnn, "relu")
    assert sol.layers[0]["alpha"] == pytest.approx(1 / math.sqrt(3))
    assert sol.input_second_moment == pytest.approx(1 / (sol.layers[0]["alpha"] ** 2 * math.sqrt(3 * 9)), rel=1e-12)
    assert sol.layers[0]["gamma"] == pytest.approx(sol.layers[0]["gamma_bias"], rel=1e-9)


# --------------------------------------------------------------------------- Appendix E, E.1

IDENTITY = get_activation("leaky_relu", negative_slope=1.0)  # c = 1: E.1's linear setting


@pytest.mark.parametrize("k0,k1,s", [(7, 3, 0.5), (3, 3, 1.0), (1, 3, 0.2), (5, 1, 2.0)])
def test_mixed_residual_and_non_residual_alpha(k0, k1, s):
    ws, wb = 1 / math.sqrt(1 + s * s), s / math.sqrt(1 + s * s)
    g = build_graph(
        Graph.model_validate(
            {
                "nodes": [
                    {"id": "x", "op": "input", "shape": [1, 16, 16]},
                    {"id": "c0", "op": "conv", "channels": 1, "kernel": k0, "inputs": ["x"]},
                    {"id": "c1", "op": "conv", "channels": 1, "kernel": k1, "inputs": ["c0"]},
                    {"id": "z", "op": "sum", "inputs": ["c0", "c1"], "weights": [ws, wb]},
                    {"id": "out", "op": "output", "inputs": ["z"]},
                ]
            }
        ),
        "relu",
    )
    sol = solve_geometric(g, IDENTITY)
    a = {l["id"]: l for l in sol.layers}
    # E.1: alpha^2 = (k_1 / k_0) s^2 / (1 + s^2) for the non-residual conv, the residual one at 1
    assert (a["c0"]["alpha"] / a["c1"]["alpha"]) ** 2 == pytest.approx(k1 / k0 * s * s / (1 + s * s), rel=1e-12)
    assert a["c1"]["in_branch"] and not a["c0"]["in_branch"]
    assert sol.gamma_ratio == pytest.approx(1.0, abs=1e-9)
    # E.1 "Final layer": a linear layer after the residual block, alpha^2 = k s^2 / (1 + s^2)
    g = build_graph(
        Graph.model_validate(
            {
                "nodes": [
                    {"id": "x", "op": "input", "shape": [1, 16, 16]},
                    {"id": "c1", "op": "conv", "channels": 1, "kernel": k1, "inputs": ["x"]},
                    {"id": "z", "op": "sum", "inputs": ["x", "c1"], "weights": [ws, wb]},
                    {"id": "lin", "op": "conv", "channels": 1, "kernel": 1, "inputs": ["z"]},
                    {"id": "out", "op": "output", "inputs": ["lin"]},
                ]
            }
        ),
        "relu",
    )
    a = {l["id"]: l["alpha"] for l in solve_geometric(g, IDENTITY).layers}
    assert (a["lin"] / a["c1"]) ** 2 == pytest.approx(k1 * s * s / (1 + s * s), rel=1e-12)


def bottleneck_resnet(scales):
    nodes = [{"id": "x", "op": "input", "shape": [64, 8, 8]}]
    prev = "x"
    for b, s in enumerate(scales):
        ws, wb = 1 / math.sqrt(1 + s * s), s / math.sqrt(1 + s * s)
        nodes += [
            {"id": f"b{b}.c0", "op": "conv", "channels": 16, "kernel": 1, "inputs": [prev]},
            {"id": f"b{b}.a0", "op": "activation", "inputs": [f"b{b}.c0"]},
            {"id": f"b{b}.c1", "op": "conv", "channels": 16, "kernel": 3, "inputs": [f"b{b}.a0"]},
            {"id": f"b{b}.a1", "op": "activation", "inputs": [f"b{b}.c1"]},
            {"id": f"b{b}.c2", "op": "conv", "channels": 64, "kernel": 1, "inputs": [f"b{b}.a1"]},
            {"id": f"b{b}.sum", "op": "sum", "inputs": [prev, f"b{b}.c2"], "weights": [ws, wb]},
            {"id": f"b{b}.act", "op": "activation", "inputs": [f"b{b}.sum"]},
        ]
        prev = f"b{b}.act"
    nodes.append({"id": "out", "op": "output", "inputs": [prev]})
    return build_graph(Graph.model_validate({"nodes": nodes}), "relu")


def test_bottleneck_blocks_get_one_over_sqrt3_on_the_3x3_conv():
    # Appendix E: y_1 = C_1(x_1) / (sqrt(3) beta) in a bottleneck block; with a flat s, beta = 1.
    sol = solve_geometric(bottleneck_resnet([0.3] * 4), "relu")
    for l in sol.layers:
        assert l["alpha"] ** 2 == pytest.approx(1 / 3 if l["id"].endswith("c1") else 1.0, rel=1e-12)
        assert l["in_branch"]
    assert sol.gamma_ratio == pytest.approx(1.0, abs=1e-9)
    # unequal block scales are corrected too (gammas computed, not assumed)
    assert solve_geometric(bottleneck_resnet([0.2, 0.5, 1.0]), "relu").gamma_ratio == pytest.approx(1.0, abs=1e-9)


# --------------------------------------------------------------------------- Table 1


@pytest.mark.parametrize("fn", ["tanh", "sigmoid", "gelu", "softplus", "relu_tau"])
def test_non_homogeneous_activations_are_rejected(fn):
    with pytest.raises(SigpropError) as err:
        solve_geometric(mlp([20, 10, 5]), fn)
    assert err.value.code == "unsupported_activation"
    assert "Table 1" in err.value.hint
    # also when only one node uses it
    g = chain([20], [{"op": "dense", "units": 10}, {"op": "activation", "fn": fn}, {"op": "dense", "units": 5}])
    with pytest.raises(SigpropError) as err:
        solve_geometric(g, "relu")
    assert err.value.code == "unsupported_activation"


def test_max_pool_and_pooled_relu_warn():
    g = chain(
        [3, 16, 16],
        [
            {"op": "conv", "channels": 8, "kernel": 3},
            ACT,
            {"op": "max_pool", "kernel": 2},
            {"op": "conv", "channels": 8, "kernel": 3},
            ACT,
            {"op": "global_avg_pool"},
            {"op": "dense", "units": 10},
        ],
    )
    sol = solve_geometric(g, "relu")
    assert any("max_pool breaks the GR scaling" in w for w in sol.warnings)
    assert any("average pooling of activations" in w for w in sol.warnings)
    assert sol.gamma_ratio == pytest.approx(1.0, abs=1e-9)


def test_graph_without_weights_is_rejected():
    with pytest.raises(SigpropError) as err:
        solve_geometric(chain([4], [ACT]), "relu")
    assert err.value.code == "invalid_graph"


# --------------------------------------------------------------------------- Monte Carlo (section 4)


def weight_gradient_ratios(widths, second_moments, input_moment, output_scale, draws, batch, rng):
    """nu_l = E[Delta W_l^2] / E[W_l^2] (section 4) of a Gaussian ReLU MLP, batch size 1 (section
    3.1): per-sample gradients of 0.5 ||s y - t||^2 with t ~ N(0, 1), averaged over samples and draws.
    For one sample E_ij[(Delta y_i x_j)^2] = mean(Delta y^2) mean(x^2) exactly."""
    n_layers = len(widths) - 1
    acc = np.zeros(n_layers)
    for _ in range(draws):
        ws = [rng.standard_normal((widths[i + 1], widths[i])) * math.sqrt(second_moments[i]) for i in range(n_layers)]
        h = rng.standard_normal((batch, widths[0])) * math.sqrt(input_moment)
        xs, masks = [], []
        for i, w in enumerate(ws):
            xs.append(h)
            y = h @ w.T
            if i < n_layers - 1:
                masks.append(y > 0)
                h = np.maximum(y, 0.0)
            else:
                h = y
        dy = output_scale * (output_scale * h - rng.standard_normal(h.shape))
        for i in reversed(range(n_layers)):
            acc[i] += np.mean(np.mean(dy**2, axis=1) * np.mean(xs[i] ** 2, axis=1))
            if i > 0:
                dy = (dy @ ws[i]) * masks[i - 1]
    return acc / draws / np.asarray(second_moments)


def test_monte_carlo_weight_to_gradient_ratios_are_equal():
    widths = [784, 384, 64, 10]
    sol = solve_geometric(mlp(widths), "relu")
    rng = np.random.default_rng(20240611)
    moments = [l["weight_second_moment"] for l in sol.layers]
    nu = weight_gradient_ratios(widths, moments, sol.input_second_moment, sol.output_scale, 24, 128, rng)
    # Proposition 4: nu_l = gamma_l, equal across layers for the geometric initialization
    assert rel_spread(nu) < 0.10, nu
    # the check has teeth: He fan-in initialization (equation 5) is far from balanced
    fan_in = [2.0 / widths[i] for i in range(len(widths) - 1)]
    nu_fan_in = weight_gradient_ratios(widths, fan_in, sol.input_second_moment, sol.output_scale, 8, 128, rng)
    assert rel_spread(nu_fan_in) > 1.0, nu_fan_in
