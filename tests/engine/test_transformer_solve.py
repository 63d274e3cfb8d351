"""Sequence graphs end to end (issue 28): the transformer template, E-SPA / U-SPA / Value-SkipInit /
shaped attention solved with TAT in-process, by ``sigprop solve`` and over HTTP, the answer's
generators, and its predicted output token kernel against an independent dense numpy propagation.

The reference propagation below is written from the papers, not from the engine: "Deep Transformers
without Shortcuts" (He, Martens et al., arXiv:2302.10322) section 3 for E-SPA (Sigma_l =
exp(-gamma_l |i - j|), A_l = chol(Sigma_l) chol(Sigma_(l-1))^-1, the schedule alpha_l = alpha_L^(l/L)),
and the arc-cosine kernel of Leaky ReLU for the MLP blocks (numpy's Cholesky, explicit formulas).
"""

from __future__ import annotations

import json
import math
import time

import httpx
import numpy as np
import pytest

import sigprop
from sigprop.cli import main
from sigprop.engine.limits import MAX_TOKEN_KERNEL
from sigprop.engine.templates.expand import TEMPLATES, expand_template
from sigprop.errors import SigpropError
from sigprop.schemas import Template
from sigprop.schemas.attention_init import expand_attention

from ..service_fixtures import start_service


def request(shaping: dict | None = None, eta: float = 0.3, **template) -> dict:
    graph = {"template": "transformer", "depth": 3, "seq_len": 6, "width": 16, "heads": 2, **template}
    body = {"graph": graph, "method": "tat", "activation": "leaky_relu", "targets": {"eta": eta}}
    if shaping is not None:
        body["attention"] = shaping
    return body


ESPA = {"shaping": "e-spa"}
ESPA_PAPER = {"shaping": "e-spa", "schedule": "paper"}  # the paper's construction, which the reference is
W_SKIP = math.sqrt(0.5)  # the template's default shortcut weight


# -- the independent reference ---------------------------------------------------------------------


def leaky_relu_kernel(k: np.ndarray, a: float, scale: float) -> np.ndarray:
    """E[phi(u) phi(v)] for phi = scale * leaky_relu_a, (u, v) ~ N(0, [[K_ii, K_ij], [K_ij, K_jj]]):
    sqrt(K_ii K_jj) scale^2 ((1 + a^2)/2 c + (1 - a)^2 / (2 pi) (sqrt(1 - c^2) - c arccos c))."""
    d = np.sqrt(np.diag(k))
    c = np.clip(k / np.outer(d, d), -1.0, 1.0)
    g = np.sqrt(1.0 - c * c) - c * np.arccos(c)
    return scale**2 * np.outer(d, d) * ((1 + a * a) / 2 * c + (1 - a) ** 2 / (2 * math.pi) * g)


def espa_matrices(final_gamma: float, layers: int, t: int) -> list[np.ndarray]:
    """The paper's E-SPA matrices from numpy's Cholesky factors."""
    alpha_last = math.sqrt(1 - math.exp(-2 * final_gamma))
    idx = np.arange(t)
    lag = np.abs(idx[:, None] - idx[None, :])
    previous = np.eye(t)
    out = []
    for layer in range(1, layers + 1):
        gamma = -0.5 * math.log(1 - alpha_last ** (2 * layer / layers))
        sigma = np.exp(-gamma * lag)
        out.append(np.linalg.cholesky(sigma) @ np.linalg.inv(np.linalg.cholesky(previous)))
        previous = sigma
    return out


def uspa_matrices(final_rho: float, layers: int, t: int) -> list[np.ndarray]:
    previous, out = np.eye(t), []
    for layer in range(1, layers + 1):
        rho = 1 - (1 - final_rho) ** (layer / layers)
        sigma = (1 - rho) * np.eye(t) + rho
        out.append(np.linalg.cholesky(sigma) @ np.linalg.inv(np.linalg.cholesky(previous)))
        previous = sigma
    return out


def reference_output(mixers, a: float, scale: float, shortcuts=False, norms=False, w_skip=W_SKIP):
    """The transformer template's token kernel from orthonormal tokens, op by op (dense layers keep
    the kernel: q-preserving weights, zero biases)."""
    w_branch = math.sqrt(1 - w_skip**2)
    h = np.eye(mixers[0].shape[0])

    def ln(k):
        d = np.sqrt(np.diag(k))
        return k / np.outer(d, d)

    for a_l in mixers:
        x = a_l @ (ln(h) if norms else h) @ a_l.T
        if shortcuts:
            x = w_skip**2 * h + w_branch**2 * x
        m = leaky_relu_kernel(ln(x) if norms else x, a, scale)
        h = w_skip**2 * x + w_branch**2 * m if shortcuts else m
    return h


# -- template ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shortcuts", [False, True])
@pytest.mark.parametrize("norms", [False, True])
def test_template_expands_with_the_documented_ids_and_size(shortcuts, norms):
    t = Template(template="transformer", depth=2, seq_len=8, width=16, heads=2, shortcuts=shortcuts, norms=norms)
    graph = expand_template(t)
    ids = [nd.id for nd in graph.nodes]
    block = ["q", "k", "v", "attn", "proj", "fc1", "act", "fc2"]
    block += ["res1", "res2"] if shortcuts else []
    block += ["ln1", "ln2"] if norms else []
    assert sorted(ids) == sorted(["x", "out"] + [f"b{i}.{n}" for i in range(2) for n in block])
    size = TEMPLATES["transformer"].size(t)
    assert size.nodes == len(graph.nodes) and size.edges == sum(len(nd.inputs) for nd in graph.nodes)
    by_id = {nd.id: nd for nd in graph.nodes}
    assert by_id["x"].shape == [8, 16] and by_id["x"].sequence is True
    assert by_id["b1.attn"].inputs == ["b1.q", "b1.k", "b1.v"] and by_id["b1.attn"].causal is True
    assert by_id["b0.fc1"].units == 64
    if shortcuts:
        w = by_id["b0.res2"].weights
        assert w[0] == pytest.approx(math.sqrt(0.5)) and w[0] ** 2 + w[1] ** 2 == pytest.approx(1.0)


def test_template_refuses_heads_that_do_not_divide_width():
    with pytest.raises(SigpropError, match="multiple of heads"):
        expand_template(Template(template="transformer", depth=1, width=10, heads=3))


# -- solving -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shortcuts,norms", [(False, False), (True, True), (True, False), (False, True)])
def test_espa_output_kernel_equals_an_independent_numpy_propagation(shortcuts, norms):
    answer = sigprop.solve(request(ESPA_PAPER, shortcuts=shortcuts, norms=norms))
    tk = answer.token_kernel
    assert tk.input == "orthonormal" and tk.tokens == 6 and tk.leading is None
    mixers = espa_matrices(0.005, 3, 6)
    want = reference_output(mixers, answer.negative_slope, answer.output_scale, shortcuts, norms)
    np.testing.assert_allclose(np.array(tk.output), want, rtol=1e-9, atol=1e-12)
    # the schedule: the paper's gammas, the last one the target
    gammas = [s.gamma for s in tk.schedule]
    assert gammas[-1] == pytest.approx(0.005) and gammas == sorted(gammas, reverse=True)
    assert tk.target == {"family": "exponential", "gamma": pytest.approx(0.005)}
    assert [s.node for s in tk.schedule] == ["b0.attn", "b1.attn", "b2.attn"]


def test_uspa_output_kernel_equals_an_independent_numpy_propagation():
    answer = sigprop.solve(request({"shaping": "u-spa", "final_rho": 0.6, "schedule": "paper"}))
    want = reference_output(uspa_matrices(0.6, 3, 6), answer.negative_slope, answer.output_scale)
    np.testing.assert_allclose(np.array(answer.token_kernel.output), want, rtol=1e-9, atol=1e-12)
    assert answer.token_kernel.target == {"family": "uniform", "rho": pytest.approx(0.6)}


def test_attention_only_stack_reaches_the_espa_target_exactly():
    # with the identity as the MLP's activation (eta = 0: negative slope 1), the stack is attention
    # alone, and the construction maps I to Sigma_L exactly
    answer = sigprop.solve(request(ESPA, eta=0.0))
    t = np.arange(6)
    target = np.exp(-0.005 * np.abs(t[:, None] - t[None, :]))
    np.testing.assert_allclose(np.array(answer.token_kernel.output), target, atol=1e-10)


def test_generators_expand_with_attention_init_to_the_papers_matrices():
    answer = sigprop.solve(request(ESPA_PAPER))
    layers = answer.attention.layers
    assert answer.attention.shaping == "e-spa" and answer.attention.parameters == {"final_gamma": 0.005}
    assert [x.node for x in layers] == ["b0.attn", "b1.attn", "b2.attn"]
    for generator, want in zip((x.generator for x in layers), espa_matrices(0.005, 3, 6), strict=True):
        init = expand_attention(generator, 6, causal=True)
        np.testing.assert_allclose(init.matrix(), want, atol=1e-12)
        assert np.all(init.scale > 0)


def test_initializations_zero_queries_and_count_features_not_tokens():
    answer = sigprop.solve(request(ESPA))
    layers = {x.id: x for x in answer.layers}
    assert set(layers) == {f"b{i}.{n}" for i in range(3) for n in ("q", "k", "v", "proj", "fc1", "fc2")}
    assert layers["b0.q"].weight_variance == 0.0 and layers["b0.q"].gain == 0.0
    assert layers["b0.k"].distribution == "scaled_uniform_orthogonal" and layers["b0.k"].weight_variance == 1 / 16
    assert (layers["b0.fc1"].fan_in, layers["b0.fc1"].fan_out) == (16, 64)
    assert (layers["b0.fc2"].fan_in, layers["b0.fc2"].fan_out) == (64, 16)
    assert all(x.bias == "zeros" for x in answer.layers)


@pytest.mark.parametrize("shaping", [{"shaping": "value-skipinit"}, {"shaping": "shaped", "temperature": 2.0}])
def test_identity_at_init_gives_the_entrywise_mlp_composition(shaping):
    # A = I: orthonormal tokens stay a pair of inputs at c = 0 through the MLP blocks alone, so every
    # off-diagonal entry is the network's C_f(0) and the diagonal q = 1
    answer = sigprop.solve(request(shaping))
    k = np.array(answer.token_kernel.output)
    np.testing.assert_allclose(np.diag(k), 1.0, atol=1e-12)
    off = k[~np.eye(6, dtype=bool)]
    np.testing.assert_allclose(off, answer.network_c_f_0, atol=1e-12)
    assert answer.token_kernel.schedule == [] and answer.token_kernel.target == {"family": "identity"}
    form = "value_skipinit" if shaping["shaping"] == "value-skipinit" else "shaped"
    assert {x.generator["form"] for x in answer.attention.layers} == {form}
    for x in answer.attention.layers:
        np.testing.assert_allclose(expand_attention(x.generator, 6, causal=True).matrix(), np.eye(6), atol=1e-12)


def test_activations_are_solved_with_attention_as_a_pass_through():
    # the MLP blocks alone: the same TAT negative slope as an MLP of the same depth
    mlp = sigprop.solve({"graph": {"template": "mlp", "depth": 3}, "method": "tat", "activation": "leaky_relu",
                         "targets": {"eta": 0.3}})  # fmt: skip
    answer = sigprop.solve(request(ESPA))
    assert answer.negative_slope == pytest.approx(mlp.negative_slope, rel=1e-12)
    assert answer.c_f_0 == pytest.approx(0.3)


def test_long_sequences_return_the_exact_leading_block():
    t = MAX_TOKEN_KERNEL + 8
    # the paper's generators do not depend on T (the joint schedule's aim at the T tokens' mean correlation)
    long = sigprop.solve(request(ESPA_PAPER, seq_len=t))
    short = sigprop.solve(request(ESPA_PAPER, seq_len=MAX_TOKEN_KERNEL))
    assert long.token_kernel.output is None and long.token_kernel.leading_tokens == MAX_TOKEN_KERNEL
    assert any(f"at most {MAX_TOKEN_KERNEL} tokens" in w for w in long.warnings)
    # the generators are the same for any length, and a prefix of tokens never reads later tokens
    assert long.attention == short.attention
    np.testing.assert_allclose(long.token_kernel.leading, short.token_kernel.output, rtol=1e-12)


def test_key_depends_on_the_shaping_and_not_on_defaults_spelled_out():
    a = sigprop.solve(request(ESPA)).key
    assert sigprop.solve(request({"shaping": "e-spa", "final_gamma": 0.005})).key == a
    assert sigprop.solve(request({"shaping": "e-spa", "final_gamma": 0.01})).key != a
    assert sigprop.solve(request({"shaping": "u-spa"})).key != a


def test_dks_solves_a_transformer_too():
    body = request(ESPA)
    body.update(method="dks", activation="tanh", targets={"zeta": 1.5})
    answer = sigprop.solve(body)
    assert answer.input_scale is not None and np.isfinite(np.array(answer.token_kernel.output)).all()


# -- refusals ----------------------------------------------------------------------------------------


def _graph(nodes: list[dict]) -> dict:
    return {"graph": {"nodes": nodes}, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.3},
            "attention": ESPA}  # fmt: skip


def _attention_graph(q_src="x", conv=False) -> list[dict]:
    nodes = [{"id": "x", "op": "input", "shape": [4, 8], "sequence": True},
             {"id": "y", "op": "dense", "inputs": ["x"], "units": 8}]  # fmt: skip
    for n, src in (("q", q_src), ("k", "x"), ("v", "x")):
        nodes.append({"id": n, "op": "dense", "inputs": [src], "units": 8})
    nodes += [{"id": "a", "op": "attention", "inputs": ["q", "k", "v"], "heads": 2},
              {"id": "p", "op": "dense", "inputs": ["a"], "units": 8}]  # fmt: skip
    if conv:
        nodes.append({"id": "c", "op": "conv", "inputs": ["p"], "channels": 4})
    nodes.append({"id": "o", "op": "output", "inputs": ["c" if conv else "p"]})
    return nodes


def _refused(body: dict) -> SigpropError:
    with pytest.raises(SigpropError) as err:
        sigprop.solve(body)
    return err.value


def test_attention_without_the_attention_key_is_refused():
    body = request()
    err = _refused(body)
    assert err.code == "invalid_request" and "b0.attn" in err.message and "e-spa" in err.hint


def test_cross_attention_is_refused_naming_the_node():
    err = _refused(_graph(_attention_graph(q_src="y")))
    assert err.code == "unsupported_structure" and "cross-attention" in err.message and "'a'" in err.message


def test_conv_in_a_sequence_graph_is_refused():
    err = _refused(_graph(_attention_graph(conv=True)))
    assert err.status == 422 and "conv node 'c'" in err.message and "token stream" in err.message


def test_eoc_with_attention_is_refused():
    body = request(ESPA)
    body.update(method="eoc", activation="tanh", targets={})
    err = _refused(body)
    assert err.code == "unsupported_method" and "tat" in err.hint


def test_attention_key_without_attention_nodes_is_refused():
    body = {"graph": {"template": "mlp", "depth": 2}, "method": "tat", "activation": "leaky_relu",
            "targets": {"eta": 0.3}, "attention": ESPA}  # fmt: skip
    assert _refused(body).code == "invalid_request"


def test_keys_of_another_shaping_are_refused():
    err = _refused(request({"shaping": "e-spa", "final_rho": 0.5}))
    assert err.code == "invalid_request" and "final_rho" in err.message


@pytest.mark.parametrize(
    "template,what",
    [({"depth": 1000, "seq_len": 4096, "width": 8, "heads": 1}, "token-kernel"),
     ({"depth": 1, "seq_len": 100_000, "width": 8, "heads": 1}, "tokens")],
)  # fmt: skip
def test_huge_sequences_are_priced_and_refused_before_solving(template, what):
    start = time.perf_counter()
    err = _refused(request(ESPA, **template))
    assert err.code == "graph_too_large" and err.status == 413 and what in err.message
    assert time.perf_counter() - start < 2.0


# -- the CLI and HTTP ----------------------------------------------------------------------------------


def test_cli_solves_a_transformer_with_the_attention_flag(capsys):
    flags = ["--template", "transformer", "--depth", "3", "--param", "seq_len=6", "--param", "width=16",
             "--param", "heads=2", "--method", "tat", "--activation", "leaky_relu", "--eta", "0.3"]  # fmt: skip
    assert main(["solve", *flags, "--attention", "u-spa"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer == json.loads(sigprop.solve(request({"shaping": "u-spa"})).to_json())
    assert main(["solve", *flags, "--attention", '{"shaping": "e-spa", "final_gamma": 0.01}']) == 0
    assert json.loads(capsys.readouterr().out)["attention"]["parameters"] == {"final_gamma": 0.01}


KEYS = "tk-engine-key-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc-transformer")
    svc = start_service(tmp, {"SIGPROP_DATA_DIR": str(tmp / "data"), "SIGPROP_API_KEYS": KEYS,
                              "SIGPROP_REDIS_URL": None})  # fmt: skip
    yield svc
    svc.stop()


def test_http_solves_espa_and_uspa_and_expands_the_template(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEYS}"}, timeout=30) as client:
        for shaping in (ESPA, {"shaping": "u-spa"}):
            r = client.post("/v1/solve", json=request(shaping))
            assert r.status_code == 200, r.text
            assert r.json() == json.loads(sigprop.solve(request(shaping)).to_json())
        r = client.get("/v1/templates/transformer", params={"depth": 2, "seq_len": 8, "width": 16, "heads": 2,
                                                            "shortcuts": "true"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert {nd["id"] for nd in r.json()["nodes"]} >= {"b1.res2", "b1.attn", "x", "out"}
        r = client.post("/v1/solve", json=request())
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
        r = client.post("/v1/solve", json=request(ESPA, depth=1000, seq_len=4096, width=8, heads=1))
        assert r.status_code == 413 and r.json()["error"]["code"] == "graph_too_large"


def test_token_program_reduces_kernels_to_the_largest_token_correlation():
    from sigprop.engine.graph.build import build_graph
    from sigprop.engine.sequence.token_program import TokenKernelProgram, TokenValue, max_token_correlation

    graph = build_graph(expand_template(Template(template="transformer", depth=2, seq_len=5, width=8, heads=2)), "relu")
    mixers = dict(zip([nd.index for nd in graph.nodes if nd.op == "attention"], espa_matrices(0.01, 2, 5), strict=True))
    program = TokenKernelProgram(graph, mixers)
    relu = lambda v, _slot: TokenValue(leaky_relu_kernel(v.kernel, 0.0, math.sqrt(2.0)))  # noqa: E731
    out = program.global_map(np.eye(5), relu).kernel
    want = reference_output(list(mixers.values()), 0.0, math.sqrt(2.0))
    np.testing.assert_allclose(out, want, rtol=1e-12)
    values = program.candidate_values(np.eye(5), relu)
    assert len(values) == graph.n and values[0] == 0.0  # orthonormal input tokens
    assert max(values) == pytest.approx(max_token_correlation(out)) and values[-1] == max(values)
    assert program.argmax(np.eye(5), relu) == "the whole network"


def test_the_expansion_solved_by_hand_is_the_template():
    body = request(ESPA, shortcuts=True, norms=True)
    graph = expand_template(Template(**body["graph"])).model_dump(mode="json", by_alias=True, exclude_none=True)
    graph["nodes"].reverse()  # any order
    template, by_hand = sigprop.solve(body), sigprop.solve({**body, "graph": graph})
    assert by_hand.key == template.key and by_hand.to_json() == template.to_json()


def test_token_limits_are_settings(tmp_path):
    from sigprop.settings import Settings

    limits = Settings(data_dir=tmp_path, max_seq_len=16, max_token_work=123).limits()
    assert (limits.max_seq_len, limits.max_token_work) == (16, 123)
    from sigprop.preparation import prepare_data

    with pytest.raises(SigpropError, match="limit of 16"):
        prepare_data(request(ESPA, seq_len=17), limits)


def test_a_token_wise_network_without_attention_solves_with_an_entrywise_token_kernel():
    # a sequence graph of per-token dense layers and activations only: no `attention` key is needed,
    # the answer has no attention section, and every off-diagonal entry is the MLP's C_f(0)
    nodes = [
        {"id": "x", "op": "input", "shape": [8, 16], "sequence": True},
        {"id": "d1", "op": "dense", "inputs": ["x"], "units": 16},
        {"id": "a1", "op": "activation", "inputs": ["d1"]},
        {"id": "d2", "op": "dense", "inputs": ["a1"], "units": 16},
        {"id": "o", "op": "output", "inputs": ["d2"]},
    ]
    sol = sigprop.solve({"nodes": nodes}, "tat", "leaky_relu", {"eta": 0.2})
    assert sol.attention is None and sol.token_kernel.schedule == []
    out = np.array(sol.token_kernel.output)
    assert np.allclose(np.diag(out), 1.0) and np.allclose(out[~np.eye(8, dtype=bool)], sol.c_f_0)


def _nested_reuse(seq_len: int | None) -> dict:
    x = {"id": "x", "op": "input", "shape": [64] if seq_len is None else [seq_len, 64]}
    if seq_len is not None:
        x["sequence"] = True
    return {
        "nodes": [
            x,
            {"id": "x1", "op": "dense", "inputs": ["x"], "units": 64},
            {"id": "a0", "op": "activation", "inputs": ["x1"]},
            {"id": "f", "op": "dense", "inputs": ["a0"], "units": 64},
            {"id": "s1", "op": "sum", "inputs": ["x1", "f"]},
            {"id": "s2", "op": "sum", "inputs": ["x1", "s1"]},  # x1 reaches s2 through two paths
            {"id": "a1", "op": "activation", "inputs": ["s2"]},
            {"id": "d2", "op": "dense", "inputs": ["a1"], "units": 64},
            {"id": "o", "op": "output", "inputs": ["d2"]},
        ]
    }


def test_a_reused_stream_in_a_sequence_graph_composes_over_atoms_like_the_scalar_engine():
    # sum(x1, sum(x1, F(x1))): x1's coefficients add before squaring, and the answer's sum_scales
    # renormalize s2. Token-wise, every off-diagonal entry of the output kernel is the C map of a pair
    # of orthogonal inputs, which the scalar engine computes over atoms: they must agree (the
    # independent-branch rule gave 0.3166 here, against 0.3)
    scalar = sigprop.solve(_nested_reuse(None), "tat", "leaky_relu", {"eta": 0.3})
    tokens = sigprop.solve(_nested_reuse(8), "tat", "leaky_relu", {"eta": 0.3})
    assert tokens.sum_scales == scalar.sum_scales and set(tokens.sum_scales) == {"s2"}
    out = np.array(tokens.token_kernel.output)
    assert np.allclose(np.diag(out), 1.0, atol=1e-12)
    assert np.allclose(out[~np.eye(8, dtype=bool)], scalar.network_c_f_0, atol=1e-12)


def test_a_reused_stream_around_attention_matches_a_width_512_monte_carlo():
    # d0 feeds the attention's value and is added twice (s1, then s2 again: a shared atom whose
    # coefficients, one a token-mixing matrix, add before the kernel is formed); s3 adds a fresh
    # branch to s2. 32 numpy networks of width 512 built from the answer, orthonormal tokens
    from sigprop.schemas.attention_init import expand_attention

    t, n = 8, 512
    nodes = [
        {"id": "x", "op": "input", "shape": [t, n], "sequence": True},
        {"id": "d0", "op": "dense", "inputs": ["x"], "units": n},
        *({"id": p, "op": "dense", "inputs": ["d0"], "units": n} for p in ("q", "k", "v")),
        {"id": "att", "op": "attention", "inputs": ["q", "k", "v"], "heads": 4, "causal": True},
        {"id": "s1", "op": "sum", "inputs": ["d0", "att"]},
        {"id": "s2", "op": "sum", "inputs": ["d0", "s1"]},
        {"id": "a1", "op": "activation", "inputs": ["s2"]},
        {"id": "f", "op": "dense", "inputs": ["a1"], "units": n},
        {"id": "s3", "op": "sum", "inputs": ["f", "s2"]},
        {"id": "a2", "op": "activation", "inputs": ["s3"]},
        {"id": "o", "op": "dense", "inputs": ["a2"], "units": n},
        {"id": "out", "op": "output", "inputs": ["o"]},
    ]
    attention = {"shaping": "e-spa", "final_gamma": 0.3}
    sol = sigprop.solve({"nodes": nodes}, "tat", "leaky_relu", {"eta": 0.3}, attention=attention)
    assert set(sol.sum_scales) == {"s2"}
    predicted = np.array(sol.token_kernel.output)
    a_mix = expand_attention(sol.attention.layers[0].generator, t, True).matrix()
    slope, out_scale, scales = sol.negative_slope, sol.output_scale, sol.sum_scales

    def phi(z):
        return out_scale * np.where(z > 0, z, slope * z)

    rng, w = np.random.default_rng(0), 1 / math.sqrt(2)
    kernels = []
    for _ in range(32):
        x = math.sqrt(n) * np.linalg.qr(rng.standard_normal((n, t)))[0].T
        dense = lambda h: h @ (rng.standard_normal((n, n)) / math.sqrt(n))  # noqa: E731
        d0 = dense(x)
        s1 = w * d0 + w * (a_mix @ dense(d0))
        s2 = scales["s2"] * (w * d0 + w * s1)
        s3 = w * dense(phi(s2)) + w * s2
        out = dense(phi(s3))
        kernels.append(out @ out.T / n)
    kernels = np.array(kernels)
    se = kernels.std(axis=0, ddof=1) / math.sqrt(len(kernels))
    assert np.all(np.abs(kernels.mean(axis=0) - predicted) <= 3 * se + 0.02)


@pytest.mark.parametrize("shortcuts", [True, False])
def test_private_atoms_merge_exactly_and_keep_a_residual_stream_short(shortcuts, monkeypatch):
    """A residual stream's private atoms are merged into one (``TokenKernelProgram._merge_private``):
    the output kernel is the one the unmerged expansion gives (1e-12), and no stream holds more than
    two terms, where without merging block l's stream holds l atoms (L^2 T^3 work: a 1,257-block
    transformer took minutes)."""
    from sigprop.engine.graph.build import build_graph
    from sigprop.engine.sequence.token_program import TokenKernelProgram, TokenValue

    blocks, tokens = 12, 6
    t = Template(template="transformer", depth=blocks, seq_len=tokens, width=8, heads=2, shortcuts=shortcuts)
    graph = build_graph(expand_template(t), "relu")
    attention = [nd.index for nd in graph.nodes if nd.op == "attention"]
    mixers = dict(zip(attention, espa_matrices(0.01, blocks, tokens), strict=True))
    relu = lambda v, _slot: TokenValue(leaky_relu_kernel(v.kernel, 0.0, math.sqrt(2.0)), v.mean)  # noqa: E731
    longest = [0]
    real = TokenKernelProgram._merge_private

    def merge(e, atoms, held, name):
        out = real(e, atoms, held, name)
        longest[0] = max(longest[0], len(out))
        return out

    monkeypatch.setattr(TokenKernelProgram, "_merge_private", staticmethod(merge))
    merged = TokenKernelProgram(graph, mixers).global_map(np.eye(tokens), relu).kernel
    assert longest[0] <= 2
    monkeypatch.setattr(TokenKernelProgram, "_merge_private", staticmethod(lambda e, *_: e))
    unmerged = TokenKernelProgram(graph, mixers).global_map(np.eye(tokens), relu).kernel
    np.testing.assert_allclose(merged, unmerged, rtol=1e-12, atol=1e-15)


def test_the_token_price_counts_every_node_and_attentions_cube():
    from sigprop.engine.limits import DEFAULT_MAX_TOKEN_WORK, TOKEN_NODE_PRICE, TOKEN_PAIR_PRICE, token_work

    k = MAX_TOKEN_KERNEL
    assert token_work(10**6, 1, 0) == k**3 + TOKEN_NODE_PRICE + TOKEN_PAIR_PRICE * k * k  # tokens past K cost K
    assert token_work(16, 0, 100) == 100 * (TOKEN_NODE_PRICE + TOKEN_PAIR_PRICE * 256)
    # the issue-28 goal (72 causal blocks at T = 2048) fits the default budget; schemathesis's
    # 1,257-block transformer at T = 128 (minutes before private atoms were merged) is refused
    blocks = Template(template="transformer", depth=72, seq_len=2048, width=64, heads=4)
    # (eta 0.1: the joint schedule needs the MLP blocks' floor below exp(-0.005 |i - j|)'s mean, 0.176 at T = 2048)
    blocks = blocks.model_dump(exclude={"template"}, exclude_none=True)
    assert sigprop.solve(request(ESPA, eta=0.1, **blocks)).token_kernel
    err = _refused(request(ESPA, depth=1257, seq_len=128, width=64, heads=4))
    assert err.code == "graph_too_large" and str(DEFAULT_MAX_TOKEN_WORK)[:1] in err.message


def _deepest_admitted(seq_len: int, **params) -> int:
    """The most blocks the default limits admit for a transformer template (priced from its
    parameters, before it is built)."""
    from sigprop.preparation import check_template
    from sigprop.settings import offline_limits

    def admitted(depth: int) -> bool:
        try:
            # priced for E-SPA's default (joint) schedule, as the request below is
            template = Template(template="transformer", depth=depth, seq_len=seq_len, **params)
            check_template(template, offline_limits(), "e-spa")
        except SigpropError:
            return False
        return True

    lo, hi = 1, 100_000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if admitted(mid) else (lo, mid - 1)
    return lo


@pytest.mark.slow  # the deepest transformers the default price admits, timed: about 20 s
@pytest.mark.parametrize("seq_len", [16, 64, 128, 256])
def test_the_deepest_admitted_transformer_solves_in_seconds(seq_len):
    """Every cost is bounded before work starts: the deepest transformer the price admits (a block
    more is refused) solves in under 10 s (2.5-4.5 s on the 2-core development machine)."""
    params = {"width": 64, "heads": 4, "shortcuts": True}
    depth = _deepest_admitted(seq_len, **params)
    assert _refused(request(ESPA, depth=depth + 1, seq_len=seq_len, **params)).code == "graph_too_large"
    req = request(ESPA, depth=depth, seq_len=seq_len, **params)
    req.update(method="tat", activation="softplus", targets={"tau": 0.3})
    start = time.perf_counter()
    sigprop.solve(req)
    took = time.perf_counter() - start
    print(f"\ntransformer depth {depth} at T = {seq_len}: {took:.2f} s")
    assert took < 10.0
