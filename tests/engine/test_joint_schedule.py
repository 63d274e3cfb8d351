"""U-SPA's joint schedule (issue 37): attention targets solved with the MLP blocks' C maps, so that the
output token kernel is the requested (1 - rho) I + rho 1 1^T with q = 1 at every token.

The reference below is independent of the engine: the closed-form arc-cosine C map of the TAT Leaky
ReLU, the schedule written out from the module's definition (boundaries planned like the paper's,
attention targets kappa_l = C^-1(rho_l) by bisection), numpy's Cholesky for the matrices, and the
op-by-op propagation of ``test_transformer_solve.reference_output``.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import brentq

import sigprop
from sigprop.engine.solve import prepare
from sigprop.errors import SigpropError
from sigprop.schemas.attention_init import expand_attention
from sigprop.schemas.solve import SolveRequest

from .test_transformer_solve import leaky_relu_kernel, reference_output, uspa_matrices


def body(depth=12, seq_len=64, eta=0.5, schedule=None, final_rho=None, **template):
    attention = {"shaping": "u-spa"}
    if schedule is not None:
        attention["schedule"] = schedule
    if final_rho is not None:
        attention["final_rho"] = final_rho
    graph = {"template": "transformer", "depth": depth, "seq_len": seq_len, "width": 64, "heads": 4, **template}
    targets = {"eta": eta}
    return {"graph": graph, "method": "tat", "activation": "leaky_relu", "targets": targets, "attention": attention}


def c_map(answer):
    a, s = answer.negative_slope, answer.output_scale
    return lambda c: float(leaky_relu_kernel(np.array([[1.0, c], [c, 1.0]]), a, s)[0, 1])


def reference_schedule(cmap, layers: int, final_rho: float) -> tuple[list[float], list[float]]:
    """(kappa_l, rho_l) written out from the definition: plan the boundary like the paper, attention
    supplies what the MLP's C map does not; the identity where the MLP alone overshoots."""
    rho, kappas, boundaries = 0.0, [], []
    for layer in range(layers):
        remaining = layers - layer
        plan = 1 - (1 - rho) * ((1 - final_rho) / (1 - rho)) ** (1 / remaining)
        if cmap(rho) >= plan:
            kappa, rho = rho, cmap(rho)
        else:
            kappa = brentq(lambda k: cmap(k) - plan, rho, 1.0, xtol=1e-14)
            rho = plan
        kappas.append(kappa)
        boundaries.append(rho)
    return kappas, boundaries


def uniform_ratio(target: float, source: float, t: int) -> np.ndarray:
    lt = np.linalg.cholesky((1 - target) * np.eye(t) + target)
    ls = np.linalg.cholesky((1 - source) * np.eye(t) + source)
    return lt @ np.linalg.inv(ls)


@pytest.mark.parametrize(
    "depth, seq_len, eta, final_rho",
    [(12, 64, 0.5, 0.8), (12, 64, 0.8, 0.8), (24, 64, 0.5, 0.8), (6, 16, 0.3, 0.6)],
)
def test_joint_schedule_matches_the_closed_form_reference(depth, seq_len, eta, final_rho):
    answer = sigprop.solve(body(depth, seq_len, eta, final_rho=final_rho))
    assert answer.attention.schedule == "joint" and not answer.warnings
    kappas, boundaries = reference_schedule(c_map(answer), depth, final_rho)
    got = answer.token_kernel.schedule
    np.testing.assert_allclose([s.rho for s in got], kappas, atol=1e-7)
    np.testing.assert_allclose([s.block_rho for s in got], boundaries, atol=1e-7)
    assert boundaries[-1] == pytest.approx(final_rho, abs=1e-12)
    # the generators are the uniform Cholesky ratios source rho_(l-1) -> target kappa_l ...
    mixers = [uniform_ratio(k, s, seq_len) for k, s in zip(kappas, [0.0, *boundaries[:-1]], strict=True)]
    for layer, want in zip(answer.attention.layers, mixers, strict=True):
        a = expand_attention(layer.generator, seq_len, causal=True).matrix()
        np.testing.assert_allclose(a, want, atol=1e-6)
        assert a.min() >= 0.0  # what a softmax can give (D softmax(B))
    # ... and the output kernel is exactly the requested one, q = 1 at every token
    out = np.array(answer.token_kernel.output)
    reference = reference_output(mixers, answer.negative_slope, answer.output_scale)
    np.testing.assert_allclose(out, reference, atol=1e-6)
    np.testing.assert_allclose(out, (1 - final_rho) * np.eye(seq_len) + final_rho, atol=1e-9)


def test_the_issues_deep_row_keeps_q_and_the_target():
    # T = 256, 72 blocks: eta 0.9 is refused (below); eta 0.5 and 0.8 solve exactly
    for eta in (0.5, 0.8):
        out = np.array(sigprop.solve(body(72, 256, eta)).token_kernel.output)
        np.testing.assert_allclose(np.diag(out), 1.0, atol=1e-9)
        np.testing.assert_allclose(out, 0.2 * np.eye(256) + 0.8, atol=1e-8)


def test_an_eta_above_the_target_is_refused_naming_the_largest_that_solves():
    with pytest.raises(SigpropError) as e:
        sigprop.solve(body(72, 256, 0.9))
    assert e.value.code == "unreachable_target"
    assert "0.9" in e.value.message and "eta <= 0.8" in e.value.hint
    # the largest eta named solves (it is the boundary: the MLP blocks alone reach final_rho exactly,
    # every attention the identity)
    answer = sigprop.solve(body(12, 16, 0.8))
    assert [s.rho for s in answer.token_kernel.schedule][1:] == pytest.approx(
        [s.block_rho for s in answer.token_kernel.schedule][:-1], abs=1e-9
    )
    with pytest.raises(SigpropError, match="unreachable_target|0.85"):
        sigprop.solve(body(12, 16, 0.85))


def test_pre_ln_blocks_keep_the_target_too():
    answer = sigprop.solve(body(12, 64, 0.5, norms=True))
    assert answer.attention.schedule == "joint" and not answer.warnings
    out = np.array(answer.token_kernel.output)
    np.testing.assert_allclose(out, 0.2 * np.eye(64) + 0.8, atol=1e-9)


def test_with_shortcuts_the_answer_says_why_the_paper_schedule_is_used():
    answer = sigprop.solve(body(4, 16, 0.3, shortcuts=True))
    assert answer.attention.schedule == "paper"
    assert any("skipless" in w and "'b1.attn'" in w for w in answer.warnings), answer.warnings
    paper = sigprop.solve(body(4, 16, 0.3, schedule="paper", shortcuts=True))
    assert answer.token_kernel.output == paper.token_kernel.output


def test_the_papers_schedule_stays_reachable():
    answer = sigprop.solve(body(3, 6, 0.3, schedule="paper", final_rho=0.6))
    assert answer.attention.schedule == "paper"
    want = reference_output(uspa_matrices(0.6, 3, 6), answer.negative_slope, answer.output_scale)
    np.testing.assert_allclose(np.array(answer.token_kernel.output), want, rtol=1e-9, atol=1e-12)
    assert all(s.block_rho is None for s in answer.token_kernel.schedule)


def test_the_default_schedule_written_out_is_the_same_key():
    implicit = prepare(SolveRequest.model_validate(body(3, 6))).key
    explicit = prepare(SolveRequest.model_validate(body(3, 6, schedule="joint"))).key
    paper = prepare(SolveRequest.model_validate(body(3, 6, schedule="paper"))).key
    assert implicit == explicit != paper


@pytest.mark.parametrize(
    "attention, says",
    [
        ({"shaping": "shaped", "schedule": "paper"}, "takes no schedule"),
        # priced before it is validated: schemathesis found a 500 here (the price looked the shaping up)
        ({"shaping": "shaped", "schedule": "joint"}, "takes no schedule"),
        ({"shaping": "value-skipinit", "schedule": "joint"}, "takes no schedule"),
        ({"shaping": "u-spa", "schedule": "both"}, "schedule"),
    ],
)
def test_a_schedule_the_shaping_does_not_offer_is_refused(attention, says):
    b = body(3, 6)
    b["attention"] = attention
    with pytest.raises(SigpropError) as e:
        sigprop.solve(b)
    assert e.value.code == "invalid_request" and says in e.value.message


# -- E-SPA -------------------------------------------------------------------------------------------


def espa_body(depth=12, seq_len=64, eta=0.5, **template):
    b = body(depth, seq_len, eta, **template)
    b["attention"] = {"shaping": "e-spa"}
    return b


def floored_ratio(generator: dict, t: int) -> np.ndarray:
    """The generator's matrix written out with numpy: the paper's ratio between the exponential kernels,
    each row divided so that the floored source f 11^T + (1 - f) Sigma_s keeps a unit diagonal."""
    lag = np.abs(np.arange(t)[:, None] - np.arange(t)[None, :])
    kernel = {"identity": lambda fam: np.eye(t), "exponential": lambda fam: np.exp(-fam["gamma"] * lag)}
    source = kernel[generator["source"]["family"]](generator["source"])
    target = kernel[generator["target"]["family"]](generator["target"])
    a = np.linalg.cholesky(target) @ np.linalg.inv(np.linalg.cholesky(source))
    f = generator.get("source_floor", 0.0)
    floored = f + (1 - f) * source
    return a / np.sqrt(np.einsum("ij,jk,ik->i", a, floored, a))[:, None]


@pytest.mark.parametrize(
    "depth, seq_len, eta",
    # the issue's E-SPA rows (eta 0.9 at T = 256 is refused below) and T = 64 with 24 blocks
    [(12, 64, 0.8), (12, 64, 0.5), (24, 64, 0.8), (24, 64, 0.5), (72, 256, 0.5)],
)
def test_espa_joint_keeps_q_and_the_mean_correlation(depth, seq_len, eta):
    answer = sigprop.solve(espa_body(depth, seq_len, eta))
    tk = answer.token_kernel
    assert answer.attention.schedule == "joint"
    out = np.array(tk.output)
    diag = np.diag(out)
    assert 0.9 <= diag.min() and diag.max() <= 1.02, (diag.min(), diag.max())  # the issue asks [0.8, 1.25]
    d = np.sqrt(diag)
    corr = out / np.outer(d, d)
    mean = (corr.sum() - seq_len) / (seq_len * (seq_len - 1))
    lags = np.arange(1, seq_len)
    want = 2 * np.sum((seq_len - lags) * np.exp(-0.005 * lags)) / (seq_len * (seq_len - 1))
    assert tk.target_mean == pytest.approx(want, rel=1e-12) and tk.predicted_mean == pytest.approx(mean, abs=1e-12)
    assert abs(mean - want) < 0.005, (mean, want)  # the issue asks 0.05; measured <= 0.0008
    for layer in answer.attention.layers:
        a = expand_attention(layer.generator, seq_len, causal=True).matrix()
        assert a.min() >= 0.0  # what a softmax can give


def test_espa_joint_prediction_equals_an_independent_propagation():
    answer = sigprop.solve(espa_body(6, 16, 0.5))
    mixers = [floored_ratio(x.generator, 16) for x in answer.attention.layers]
    assert any(x.generator.get("source_floor", 0) > 0 for x in answer.attention.layers)
    for x, want in zip(answer.attention.layers, mixers, strict=True):
        np.testing.assert_allclose(expand_attention(x.generator, 16, causal=True).matrix(), want, atol=1e-9)
    reference = reference_output(mixers, answer.negative_slope, answer.output_scale)
    np.testing.assert_allclose(np.array(answer.token_kernel.output), reference, atol=1e-10)


def test_espa_joint_refuses_an_eta_above_the_target_mean_naming_the_largest():
    with pytest.raises(SigpropError) as e:
        sigprop.solve(espa_body(72, 256, 0.9))
    assert e.value.code == "unreachable_target" and "eta <= 0.67995" in e.value.hint, e.value.hint
    with pytest.raises(SigpropError) as e:
        sigprop.solve(espa_body(24, 64, 0.92))
    assert "eta <= 0.8998" in e.value.hint
    answer = sigprop.solve(espa_body(24, 64, 0.895))  # just under the named bound: solves
    assert abs(answer.token_kernel.predicted_mean - answer.token_kernel.target_mean) < 0.005


def test_a_floor_outside_0_1_is_refused_by_the_expansion():
    g = {"form": "cholesky_ratio", "target": {"family": "exponential", "gamma": 0.1}, "source": {"family": "identity"}}
    with pytest.raises(ValueError, match="source_floor"):
        expand_attention({**g, "source_floor": 1.0}, 8, causal=True)
    # a floor of 0 is the paper's ratio
    np.testing.assert_array_equal(
        expand_attention({**g, "source_floor": 0.0}, 8, True).matrix(), expand_attention(g, 8, True).matrix()
    )


def test_the_joint_schedule_is_priced_before_it_runs():
    from sigprop.engine.limits import PROBE_TOKENS, token_work

    paper = token_work(256, 72, 576, "e-spa", "paper")
    probe = token_work(PROBE_TOKENS, 72, 576)  # the probe walk: a propagation over PROBE_TOKENS tokens
    assert token_work(256, 72, 576, "e-spa") == token_work(256, 72, 576, "e-spa", "joint") == 2 * paper + probe
    assert token_work(256, 72, 576, "u-spa") == token_work(256, 72, 576, "u-spa", "paper") + probe
    assert token_work(256, 72, 576, "shaped") == token_work(256, 72, 576)


@pytest.mark.parametrize("shaping", ["e-spa", "u-spa"])
def test_rms_norm_blocks_keep_the_target(shaping):
    from sigprop.engine.templates.expand import expand_template
    from sigprop.schemas import Template

    graph = expand_template(
        Template(template="transformer", depth=12, seq_len=64, width=64, heads=4, norms=True), max_nodes=10_000
    ).model_dump(by_alias=True, exclude_none=True)
    for node in graph["nodes"]:
        if node["op"] == "layer_norm":
            node["op"] = "rms_norm"
    assert sum(n["op"] == "rms_norm" for n in graph["nodes"]) == 24
    answer = sigprop.solve({**body(), "graph": graph, "attention": {"shaping": shaping}})
    tk = answer.token_kernel
    assert answer.attention.schedule == "joint"
    np.testing.assert_allclose(np.diag(np.array(tk.output)), 1.0, atol=1e-9)  # normalized blocks, TAT keeps q = 1
    assert abs(tk.predicted_mean - tk.target_mean) < (1e-9 if shaping == "u-spa" else 0.01)


def test_espa_joint_past_the_predicted_tokens_keeps_the_whole_sequences_mean():
    # T = 512: the answer's kernel covers the leading 256 tokens, the target the 512; the design's
    # correction compares like with like (a comparison of the leading 256 with the 512-token target
    # left the whole sequence at 0.415 for a target of 0.499)
    t = 512
    answer = sigprop.solve(espa_body(12, t, 0.2))
    mixers = [floored_ratio(x.generator, t) for x in answer.attention.layers]
    out = reference_output(mixers, answer.negative_slope, answer.output_scale)
    d = np.sqrt(np.diag(out))
    mean = ((out / np.outer(d, d)).sum() - t) / (t * (t - 1))
    assert abs(mean - answer.token_kernel.target_mean) < 0.01, (mean, answer.token_kernel.target_mean)
    np.testing.assert_allclose(np.array(answer.token_kernel.leading), out[:256, :256], atol=1e-9)
    assert 0.95 <= np.diag(out).min() and np.diag(out).max() <= 1.05
