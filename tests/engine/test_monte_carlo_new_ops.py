"""``rms_norm`` and ``mul`` (issue 34, proof by growth): exact against Monte Carlo through every walk.

- a dense graph, Edge of Chaos (tanh): blocks ``dense -> act -> dense -> rms_norm``, then a gated MLP
  block ``mul(act(dense1(h)), dense2(h)) -> dense`` (the gate's function erf), then ``act -> dense``:
  C(0), C(0.5) and q at the output and at a middle node (the graph cut there: every layer's variances
  follow from what it reads, so the prefix's answer is the same network's);
- a sequence graph, DKS (softplus) with E-SPA attention: pre-RMSNorm blocks with a SwiGLU-style MLP
  ``dense(mul(act(dense(ln)), dense(ln)))`` on residual sums: the token kernel at the output and at a
  middle node for orthonormal tokens (the answer's ``token_kernel``) and for tokens at cosine 0.5.

Networks are built from the answer's own ``layers`` by ``mc_networks`` (numpy, written from the ops'
definitions); attention is its fixed matrix at initialization (zero queries), from
``schemas.attention_init.expand_attention``. Rule: within 3 standard errors + 0.01. The width-512
runs are ``slow``; the default ones take width 128-192 and a few networks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sigprop.engine.sequence.solve import _activation_maps
from sigprop.engine.sequence.token_program import TokenKernelProgram, TokenValue
from sigprop.errors import SigpropError
from sigprop.schemas.attention_init import expand_attention
from sigprop.schemas.shapes import infer_shapes
from sigprop.schemas.structure import check_structure, wire_structure

from ..mc_networks import estimate, forward, output_statistics, solve_request
from .test_monte_carlo_structures import G, predicted

C0S = (0.0, 0.5)


def gated(width=128, blocks=3, cut=None):
    """EoC graph (a); ``cut``: end the graph at that block's rms_norm (a middle node)."""
    g = G([width])
    h = "x"
    for b in range(blocks):
        h = g.add("rms_norm", [g.dense(g.act(g.dense(h, width)), width)])
        if b == cut:
            return g.graph(h)
    m = g.add("mul", [g.add("activation", [g.dense(h, width)], fn="erf"), g.dense(h, width)])
    return g.graph(g.dense(g.act(g.dense(m, width)), width))


def eoc_request(graph):
    return {"graph": graph, "method": "eoc", "activation": "tanh", "targets": {}, "c_map_points": 5}


def check_dense(ans, stats, q):
    rows = []
    for c0, est in stats["c"].items():
        want = predicted(ans, c0)
        rows.append((f"C({c0})", want, est.mean, est.se))
        assert abs(est.mean - want) <= 3 * est.se + 0.01, (c0, want, est)
    est = stats["q"]
    rows.append(("q", q, est.mean, est.se))
    assert abs(est.mean - q) <= 3 * est.se + 0.01, (q, est)
    return rows


def run_dense(width, nets, pairs=16):
    rows = []
    for cut in (1, None):
        graph, ans = solve_request(eoc_request(gated(width, cut=cut)))
        # exact, and where a mul reads a function (the gate) it says why the layers reading it are q-preserving
        assert ans.assumptions.holds and (cut is not None or ans.warnings), ans.warnings
        assert all("an rms_norm or a mul reads" in w and "q-preserving" in w for w in ans.warnings), ans.warnings
        stats = output_statistics(graph, ans, C0S, nets, pairs, seed=7 + (cut or 0))
        rows += check_dense(ans, stats, ans.output_q)
    return rows


def test_eoc_gated_mlp_with_rms_norm_quick():
    run_dense(128, 6)


@pytest.mark.slow
def test_eoc_gated_mlp_with_rms_norm_width_512():
    print(run_dense(512, 16))


def transformer(width=128, tokens=4, blocks=2, weights=(0.8, 0.6)):
    """Pre-RMSNorm transformer blocks with a SwiGLU-style gated MLP (graph (b)); ``mid``: a middle node."""
    nodes = [{"id": "x", "op": "input", "shape": [tokens, width], "sequence": True}]

    def add(nid, op, inputs, **attrs):
        nodes.append({"id": nid, "op": op, "inputs": inputs, **attrs})
        return nid

    h = "x"
    for b in range(blocks):
        ln = add(f"b{b}.ln1", "rms_norm", [h])
        q, k, v = (add(f"b{b}.{r}", "dense", [ln], units=width) for r in "qkv")
        proj = add(f"b{b}.proj", "dense", [add(f"b{b}.attn", "attention", [q, k, v])], units=width)
        h = add(f"b{b}.res1", "sum", [h, proj], weights=list(weights))
        ln2 = add(f"b{b}.ln2", "rms_norm", [h])
        gate = add(f"b{b}.act", "activation", [add(f"b{b}.fc1", "dense", [ln2], units=width)])
        m = add(f"b{b}.mul", "mul", [gate, add(f"b{b}.fc3", "dense", [ln2], units=width)])
        h = add(f"b{b}.res2", "sum", [h, add(f"b{b}.fc2", "dense", [m], units=width)], weights=list(weights))
    add("out", "output", [h])
    return {"schema": "sigprop.graph/v1", "nodes": nodes}


def sequence_request(graph):
    return {
        "graph": graph,
        "method": "dks",
        "activation": "softplus",
        "targets": {"zeta": 2.2},
        "attention": {"shaping": "e-spa"},
    }


def tokens_at(cosine: float, t: int, n: int, rng) -> np.ndarray:
    """T x n tokens with X X^T / n = (1 - cosine) I + cosine 11^T exactly."""
    q, _ = np.linalg.qr(rng.standard_normal((n, t)))
    gram = (1 - cosine) * np.eye(t) + cosine * np.ones((t, t))
    return np.linalg.cholesky(gram) @ (math.sqrt(n) * q.T)


def run_sequence(width, nets, tokens=4, at=("b0.res2", "out")):
    return check_sequence(
        *solve_request(sequence_request(transformer(width, tokens))), width, nets, tokens, at, seed=11
    )


def check_sequence(graph, ans, width, nets, tokens, at, seed):
    """The token kernels a sequence answer states at the nodes ``at`` (its token program from inputs
    at each cosine of C0S) against ``nets`` random networks of ``width``: q and C of a few entries
    within 3 SE + 0.01. Returns (name, stated, measured mean, SE) rows."""
    assert ans.assumptions.holds, ans.warnings
    ids = {nd.user_id: nd.index for nd in graph.nodes}
    mixers = {
        lay.node: expand_attention(lay.generator, tokens, bool(graph.nodes[ids[lay.node]].attrs["causal"])).matrix()
        for lay in ans.attention.layers
    }
    dense = {nd.index: (1.0, 0.0) for nd in graph.nodes if nd.kind == "affine"}
    program = TokenKernelProgram(graph, {ids[k]: a for k, a in mixers.items()}, dense)
    r = _activation_maps(graph, ans)
    rng = np.random.default_rng(seed)
    rows = []
    for cosine in C0S:
        k0 = (1 - cosine) * np.eye(tokens) + cosine * np.ones((tokens, tokens))
        want: dict[str, np.ndarray] = {}
        out = program._walk(TokenValue(k0), r, lambda i, v: want.__setitem__(graph.nodes[i].user_id, v.kernel))
        want["out"] = out.kernel
        if cosine == 0.0:  # the answer's own token kernel is this propagation from orthonormal tokens
            assert np.allclose(ans.token_kernel.output, out.kernel, atol=1e-12)
        samples: dict[str, list] = {a: [] for a in at}
        for _ in range(nets):
            x = tokens_at(cosine, tokens, width, rng)[None]
            _, probe = forward(graph, ans, x, np.random.default_rng(int(rng.integers(2**63))), at, mixers=mixers)
            for a in at:
                h = probe.values[a][0]
                samples[a].append(h @ h.T / h.shape[-1])
        for a in at:
            s = np.asarray(samples[a])
            d = np.sqrt(np.einsum("nii->ni", s))
            cos = s / (d[:, :, None] * d[:, None, :])
            wd = np.sqrt(np.diag(want[a]))
            wcos = want[a] / np.outer(wd, wd)
            for i, j in ((0, 0), (tokens - 1, tokens - 1), (0, 1), (tokens - 2, tokens - 1), (0, tokens - 1)):
                est = estimate(list(s[:, i, j] if i == j else cos[:, i, j]))
                w = want[a][i, j] if i == j else wcos[i, j]
                name = f"{a} c={cosine} {'q' if i == j else 'C'}[{i},{j}]"
                rows.append((name, float(w), est.mean, est.se))
                assert abs(est.mean - w) <= 3 * est.se + 0.01, (name, w, est)
    return rows


def test_sequence_rms_norm_and_swiglu_quick():
    run_sequence(192, 24)


@pytest.mark.slow
def test_sequence_rms_norm_and_swiglu_width_512():
    for row in run_sequence(512, 48):
        print(row)


def _graph(nodes):
    return {"schema": "sigprop.graph/v1", "nodes": [{"id": "x", "op": "input", "shape": [16]}, *nodes]}


def test_a_mul_whose_factors_share_atoms_is_refused_or_warned():
    shared = _graph(
        [
            {"id": "z", "op": "dense", "inputs": ["x"], "units": 16},
            {"id": "a", "op": "activation", "inputs": ["z"]},
            {"id": "m", "op": "mul", "inputs": ["a", "z"]},
            {"id": "y", "op": "dense", "inputs": ["m"], "units": 16},
            {"id": "out", "op": "output", "inputs": ["y"]},
        ]
    )
    for method, fn, targets in (("eoc", "tanh", {}), ("dks", "softplus", {"zeta": 2.3})):
        body = {"graph": shared, "method": method, "activation": fn, "targets": targets}
        with pytest.raises(SigpropError) as err:
            solve_request(body)
        assert err.value.code == "unsupported_structure" and "'m'" in err.value.message and err.value.hint
        _, ans = solve_request({**body, "assumptions": "warn"})
        assert not ans.assumptions.holds and "m" in ans.assumptions.violations
    square = _graph([{"id": "m", "op": "mul", "inputs": ["x", "x"]}, {"id": "out", "op": "output", "inputs": ["m"]}])
    from sigprop.schemas import Graph

    ids, report = wire_structure(Graph.model_validate(square))
    assert not report.holds and report.bad_sums[0].product
    with pytest.raises(SigpropError):
        check_structure(ids, report, "strict")


def test_an_activation_reading_a_product_is_outside_the_theory():
    g = _graph(
        [
            {"id": "u", "op": "dense", "inputs": ["x"], "units": 16},
            {"id": "v", "op": "dense", "inputs": ["x"], "units": 16},
            {"id": "m", "op": "mul", "inputs": ["u", "v"]},
            {"id": "a", "op": "activation", "inputs": ["m"]},
            {"id": "out", "op": "output", "inputs": ["a"]},
        ]
    )
    with pytest.raises(SigpropError) as err:
        solve_request({"graph": g, "method": "eoc", "activation": "tanh", "targets": {}})
    assert err.value.code == "unsupported_structure" and "product 'm'" in err.value.message


def test_tat_smooth_and_geometric_refuse_a_product():
    body = {"graph": gated(16), "method": "tat", "activation": "softplus", "targets": {"tau": 0.5}}
    with pytest.raises(SigpropError) as err:
        solve_request(body)
    assert err.value.code == "unsupported_structure" and "dks" in err.value.hint
    with pytest.raises(SigpropError) as err:
        solve_request({"graph": _one_function(gated(16)), "method": "geometric", "activation": "relu", "targets": {}})
    assert err.value.code == "unsupported_structure" and "rms_norm" in err.value.message
    mul_only = _graph(
        [
            {"id": "u", "op": "dense", "inputs": ["x"], "units": 16},
            {"id": "a", "op": "activation", "inputs": ["u"]},
            {"id": "v", "op": "dense", "inputs": ["x"], "units": 16},
            {"id": "m", "op": "mul", "inputs": ["a", "v"]},
            {"id": "y", "op": "dense", "inputs": ["m"], "units": 16},
            {"id": "out", "op": "output", "inputs": ["y"]},
        ]
    )
    with pytest.raises(SigpropError) as err:
        solve_request({"graph": mul_only, "method": "geometric", "activation": "relu", "targets": {}})
    assert err.value.code == "unsupported_structure" and "mul nodes" in err.value.message


def _one_function(graph):
    for nd in graph["nodes"]:
        nd.pop("fn", None)
    return graph


@pytest.mark.parametrize(
    "nodes,what",
    [
        (
            [
                {"id": "u", "op": "dense", "inputs": ["x"], "units": 16},
                {"id": "v", "op": "dense", "inputs": ["x"], "units": 8},
                {"id": "m", "op": "mul", "inputs": ["u", "v"]},
            ],
            "mul node 'm'",
        ),
        ([{"id": "m", "op": "mul", "inputs": ["x"]}], "'m'"),
    ],
)
def test_mul_shapes_and_arity_are_checked(nodes, what):
    g = _graph([*nodes, {"id": "out", "op": "output", "inputs": [nodes[-1]["id"]]}])
    with pytest.raises(SigpropError) as err:
        solve_request({"graph": g, "method": "eoc", "activation": "tanh", "targets": {}})
    assert err.value.status // 100 == 4 and err.value.code == "invalid_graph" and what in err.value.message
    assert err.value.hint


def test_rms_norm_shape_is_checked_and_kept():
    conv = {
        "schema": "sigprop.graph/v1",
        "nodes": [
            {"id": "x", "op": "input", "shape": [3, 8, 8]},
            {"id": "n", "op": "rms_norm", "inputs": ["x"]},
            {"id": "out", "op": "output", "inputs": ["n"]},
        ],
    }
    from sigprop.schemas import Graph

    with pytest.raises(SigpropError) as err:
        infer_shapes(Graph.model_validate(conv))
    assert err.value.code == "invalid_graph" and "rms_norm node 'n'" in err.value.message and err.value.hint
    ok = _graph([{"id": "n", "op": "rms_norm", "inputs": ["x"]}, {"id": "out", "op": "output", "inputs": ["n"]}])
    shapes = infer_shapes(Graph.model_validate(ok))
    assert list(shapes["n"]) == [16]
