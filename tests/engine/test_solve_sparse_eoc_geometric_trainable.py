"""sparse_eoc and geometric through the whole engine and the CLI: the contract keys carry the solved values;
and the trainable options (TReLU slope, residual betas) marked in the answer and its key."""

import json
import math
import subprocess
import sys

import pytest
from scipy.stats import norm

from sigprop.engine.solve import solve
from sigprop.errors import SigpropError
from sigprop.schemas import SolveRequest


def _solve(activation, **targets):
    return solve(
        SolveRequest.model_validate(
            {
                "graph": {"template": "mlp", "depth": 30, "width": 64},
                "method": "sparse_eoc",
                "activation": activation,
                "targets": targets,
            }
        )
    )


def test_crelu_answer_has_the_papers_parameters():
    ans = _solve("crelu", sparsity=0.8, v_slope=0.7)
    # Table 2 / Table 5 of the sparsity paper: s = 0.8, V'(q*) = 0.7 -> tau = 0.84, m = 1.27
    assert round(ans.tau, 2) == 0.84 and round(ans.m, 2) == 1.27
    assert ans.tau == pytest.approx(norm.ppf(0.8), abs=1e-12)  # eq. 57 with q* = 1
    assert ans.v_slope == pytest.approx(0.7, abs=1e-10)
    assert ans.chi_1 == pytest.approx(1.0, abs=1e-10)
    assert ans.sparsity == pytest.approx(0.8, abs=1e-12)
    assert ans.only_stable is True and [fp.stable for fp in ans.fixed_points] == [True]
    # V(q*) = q* on the sampled variance map
    v_at_1 = [v for q, v in zip(ans.v_map.q, ans.v_map.v, strict=True) if abs(q - 1.0) < 1e-9]
    assert v_at_1 and v_at_1[0] == pytest.approx(1.0, abs=1e-9)
    # Appendix A: L (sigma_w2 - 1 - s_1), s_1 = -1 (Gaussian) and 0 (orthogonal)
    assert ans.jacobian_spectrum_variance["gaussian"] == pytest.approx(30 * ans.sigma_w2, rel=1e-12)
    assert ans.jacobian_spectrum_variance["orthogonal"] == pytest.approx(30 * (ans.sigma_w2 - 1), rel=1e-12)
    # issue 34: the layer reading the input is q-preserving (sigma_w^2 = q* / 1, no bias) so the first
    # pre-activation is at q*; every layer reading an activation has the EoC pair
    first, *rest = ans.layers
    assert first.bias == "zeros" and first.weight_variance * first.fan_in == pytest.approx(ans.q_star)
    assert all(layer.bias == "gaussian" and layer.bias_variance == ans.sigma_b2 for layer in rest)
    assert all(layer.q == pytest.approx(ans.q_star) for layer in ans.layers) and ans.output_q == ans.q_star
    assert ans.c_map.global_[-1] == pytest.approx(1.0, abs=1e-9)


def test_unclipped_kinds_always_warn_about_instability():
    ans = _solve("soft_threshold", sparsity=0.6)
    assert ans.m is None and ans.v_slope == pytest.approx(1.0, abs=1e-10)
    assert ans.v_curvature > 0
    assert any("unstable" in w for w in ans.warnings)
    assert ans.only_stable is False


@pytest.mark.parametrize(
    "activation,targets,code",
    [
        ("tanh", {"sparsity": 0.6}, "unsupported_activation"),
        ("crelu", {"sparsity": 0.8}, "invalid_target"),  # clipped kinds need v_slope
        ("crelu", {"v_slope": 0.7}, "invalid_target"),  # sparsity is required
        ("relu_tau", {"sparsity": 0.6, "v_slope": 0.7}, "invalid_target"),
        ("crelu", {"sparsity": 1.2, "v_slope": 0.7}, "invalid_target"),
        ("crelu", {"sparsity": 0.8, "v_slope": 0.7, "eta": 0.9}, "invalid_target"),
    ],
)
def test_bad_sparse_requests_are_rejected(activation, targets, code):
    with pytest.raises(SigpropError) as err:
        _solve(activation, **targets)
    assert err.value.code == code and err.value.hint


def test_cli_prints_the_same_answer(tmp_path):
    req = {
        "graph": {"template": "mlp", "depth": 30, "width": 64},
        "method": "sparse_eoc",
        "activation": "cst",
        "targets": {"sparsity": 0.7, "v_slope": 0.5},
    }
    path = tmp_path / "req.json"
    path.write_text(json.dumps(req))
    out = subprocess.run(
        [sys.executable, "-m", "sigprop.cli", "solve", str(path)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == solve(SolveRequest.model_validate(req)).to_json()
    assert round(json.loads(out.stdout)["m"], 2) == 0.81  # Table 2: CST s = 0.7, V' = 0.5 -> m = 0.81


def test_geometric_answer_balances_gamma_and_lists_alpha():
    graph = {"template": "mlp", "depth": 3, "width": 384, "input_shape": [784]}
    ans = solve(SolveRequest.model_validate({"graph": graph, "method": "geometric", "activation": "relu"}))
    assert ans.gamma_ratio == pytest.approx(1.0, abs=1e-9)
    gammas = [layer.gamma for layer in ans.layers]
    assert max(gammas) / min(gammas) == pytest.approx(1.0, abs=1e-9)
    first = ans.layers[0]
    # GR equation 7 with c = 2: E[W^2] = 2 / sqrt(fan_in fan_out)
    assert first.weight_second_moment == pytest.approx(2 / math.sqrt(784 * 384), rel=1e-12)
    assert first.distribution == "gaussian" and first.weight_variance == pytest.approx(first.gain**2, rel=1e-12)
    assert ans.input_second_moment == pytest.approx(1 / math.sqrt(784), rel=1e-12)  # section 6.3, k0 = 1
    assert ans.sigma_w2 is None and ans.negative_slope is None  # absent parameters are omitted


def test_geometric_rejects_non_homogeneous_activations():
    with pytest.raises(SigpropError) as err:
        solve(
            SolveRequest.model_validate(
                {"graph": {"template": "mlp", "depth": 3}, "method": "geometric", "activation": "tanh"}
            )
        )
    assert err.value.code == "unsupported_activation"


def test_trainable_options_are_marked_in_the_answer_and_the_key():
    base = {
        "graph": {"template": "resnet", "depth": 18, "shortcut_weight": 0.8},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.7},
    }
    plain = solve(SolveRequest.model_validate(base))
    trainable = {"negative_slope": True, "residual_beta": "per_layer"}
    marked = solve(SolveRequest.model_validate({**base, "trainable": trainable}))
    assert plain.trainable is None and marked.key != plain.key
    assert marked.negative_slope == plain.negative_slope  # the solve itself is unchanged
    assert marked.trainable.negative_slope is True
    beta = marked.trainable.residual_beta
    assert beta.mode == "per_layer" and beta.blocks == 8 and len(beta.sums) == 8  # ResNet-18: 8 blocks
    assert beta.scale == pytest.approx(0.5 / math.sqrt(8), rel=1e-12)  # x + beta / sqrt(L) F(x), beta = 0.5


def test_trainable_beta_without_residual_sums_warns():
    ans = solve(
        SolveRequest.model_validate(
            {
                "graph": {"template": "mlp", "depth": 20},
                "method": "tat",
                "activation": "leaky_relu",
                "targets": {"eta": 0.5},
                "trainable": {"residual_beta": "global"},
            }
        )
    )
    assert ans.trainable.residual_beta is None and any("no" in w and "residual" in w for w in ans.warnings)
