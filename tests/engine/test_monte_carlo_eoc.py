"""Edge of Chaos is exact at every node (issue 34): each weighted layer's variances follow from what it
reads (EoC's pair after an activation, q-preserving after the input, a sum or another weighted layer),
so q is q* at every Gaussian node, and the answer's C map (C(0), C(0.5) at the output) and ``output_q``
match random networks built from the answer's own ``layers`` (``mc_networks``), as
``test_monte_carlo_shared_atoms`` checks for TAT and DKS. A layer that reads a mix of values at
different q is refused, or answered ``holds: false`` under ``"assumptions": "warn"``.

The width-512 Monte Carlo runs are ``slow`` (``pytest -m slow``; OPENBLAS_NUM_THREADS=1 on a shared
machine); the default ones take width 128 and a few networks, with the same rule (3 standard errors
+ 0.01) and their own larger standard errors.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from sigprop.errors import SigpropError

from ..mc_networks import output_statistics, solve_request
from .test_monte_carlo_structures import C0S, WIDTH, G, predicted, request


def sum_blocks(width=WIDTH, blocks=6):
    """The issue's first graph: blocks of sum(h, dense(act(h))) then sum(h, dense(h, bias=false))."""
    g = G([width])
    h = g.dense("x", width)
    for _ in range(blocks):
        h = g.add("sum", [h, g.dense(g.act(h), width)])
        h = g.add("sum", [h, g.add("dense", [h], units=width, bias=False)])
    return g.graph(h)


def factorised(width=WIDTH, layers=8, head=False):
    """The issue's factorised MLP: layers x (dense -> dense -> act), with ``head`` a dense at the end."""
    g = G([width])
    x = "x"
    for _ in range(layers):
        x = g.act(g.dense(g.dense(x, width), width))
    return g.graph(g.dense(x, width) if head else x)


def mlp(width=WIDTH, depth=20, bias=True):
    g = G([width])
    x = g.add("dense", ["x"], units=width, bias=bias)
    for _ in range(depth):
        x = g.add("dense", [g.act(x)], units=width, bias=bias)
    return g.graph(x)


def dense_after_sum(width=WIDTH, blocks=4):
    """A residual stream read by a dense layer after every sum (a projection between stages)."""
    g = G([width])
    x = g.dense("x", width)
    for _ in range(blocks):
        x = g.dense(g.add("sum", [x, g.dense(g.act(g.dense(g.act(x), width)), width)], weights=[0.8, 0.6]), width)
    return g.graph(g.dense(g.act(x), width))


def reused_stream(width=WIDTH):
    """One stream x0 added again into each of three later sums (shared atoms: ``sum_scales``)."""
    g = G([width])
    x0 = g.dense(g.act(g.dense("x", width)), width)
    x = x0
    for _ in range(3):
        x = g.add("sum", [x, x0, g.dense(g.act(x), width)])
    return g.graph(g.dense(g.act(x), width))


def input_skip(width=WIDTH):
    """The network input added into a sum without a weighted layer (q = 1 meets q*)."""
    g = G([width])
    x = g.add("sum", ["x", g.dense(g.act(g.dense("x", width)), width)])
    return g.graph(g.dense(g.act(g.dense(x, width)), width))


def mixed_concat(width=WIDTH):
    """A dense layer reading an activation's output concatenated with a weighted layer's."""
    g = G([width])
    c = g.add("concat", [g.act(g.dense("x", width)), g.dense("x", width)])
    return g.graph(g.dense(c, width))


# V'(q*)^depth >= 2 (swish 1.099^8 = 2.1): holds false, warned with the drift
UNSTABLE = [
    ("issue_mlp20_swish", mlp, "swish", {}),
    ("issue_mlp20_gelu", mlp, "gelu", {}),
    ("mlp8_swish", lambda: mlp(depth=8), "swish", {}),
]
SMOOTH = ["tanh", "erf", "atan", "asinh", "softsign", "bentid", "swish", "gelu", "gelu_tanh", "elu", "selu"]
EXACT = [
    ("issue_sum_blocks_tanh", sum_blocks, "tanh", {}),
    ("issue_factorised_tanh", factorised, "tanh", {}),
    ("issue_factorised_erf", factorised, "erf", {}),
    ("factorised_head_tanh", lambda: factorised(head=True), "tanh", {}),
    ("sum_blocks_erf_q_star_2", sum_blocks, "erf", {"q_star": 2.0}),
    ("dense_after_sum_tanh", dense_after_sum, "tanh", {}),
    ("dense_after_sum_selu", dense_after_sum, "selu", {}),
    ("reused_stream_tanh", reused_stream, "tanh", {}),
    ("input_skip_tanh", input_skip, "tanh", {}),
    ("mlp_no_bias_tanh", lambda: mlp(depth=8, bias=False), "tanh", {}),
    ("factorised_relu", factorised, "relu", {}),
    ("factorised_leaky_relu", factorised, "leaky_relu", {}),
] + [(f"mlp8_{fn}", lambda: mlp(depth=8), fn, {}) for fn in SMOOTH if fn != "swish"]


def eoc(build, fn, targets, **extra):
    return {**request(build(), "eoc", fn, targets, **extra), "c_map_points": 5}


def check(ans, stats):
    """C(0), C(0.5) and q at the output within 3 standard errors + 0.01 (q relative to q*)."""
    rows = []
    for c0, est in stats["c"].items():
        want = predicted(ans, c0)
        rows.append((f"C({c0})", want, est.mean, est.se))
        assert abs(est.mean - want) <= 3 * est.se + 0.01, (c0, want, est)
    q = stats["q"]
    rows.append(("q", ans.output_q, q.mean, q.se))
    assert abs(q.mean - ans.output_q) <= 3 * q.se + 0.01 * ans.q_star, q
    return rows


def test_each_layer_reads_its_own_variances():
    """EoC's pair only after an activation; after the input, a sum or another layer q* / q_in, no bias."""
    graph, ans = solve_request(eoc(sum_blocks, "tanh", {"q_star": 2.0}))
    ops = {nd.user_id: graph.nodes[nd.inputs[0]].op for nd in graph.nodes if nd.op == "dense"}
    for lay in ans.layers:
        sw2 = lay.weight_variance * lay.fan_in
        if ops[lay.id] == "activation":
            assert sw2 == pytest.approx(ans.sigma_w2) and lay.bias_variance == pytest.approx(ans.sigma_b2)
        else:
            want = 2.0 if ops[lay.id] == "input" else 1.0  # q* / 1 for the input, q* / q* after a sum
            assert sw2 == pytest.approx(want) and lay.bias in ("zeros", "none")
        assert lay.q == pytest.approx(2.0)
    assert ans.output_q == pytest.approx(2.0) and ans.assumptions.holds


def recursion(fn, sw2, sb2, c0, layers, q_star=1.0):
    """The factorised MLP ending in an activation, by 2-D Gauss-Hermite (nothing from the engine):
    q-preserving dense pairs keep (q*, q* c); act -> EoC dense maps the kernel by sw2 E[phi phi] + sb2."""
    from scipy.special import erf

    phi = {"tanh": np.tanh, "erf": erf}[fn]
    z, w = np.polynomial.hermite_e.hermegauss(200)
    w = w / w.sum()
    z1, z2 = np.meshgrid(z, z, indexing="ij")
    ww = np.outer(w, w)
    c = c0
    for k in range(layers):
        u, v = math.sqrt(q_star) * z1, math.sqrt(q_star) * (c * z1 + math.sqrt(1 - c * c) * z2)
        e_uv, e_uu = float(np.sum(ww * phi(u) * phi(v))), float(np.sum(ww * phi(u) ** 2))
        last = k == layers - 1
        # the next dense pair: the first reads the activation (EoC), the second a dense (identity)
        c = e_uv / e_uu if last else (sw2 * e_uv + sb2) / (sw2 * e_uu + sb2)
    return c, e_uu


@pytest.mark.parametrize("fn", ["tanh", "erf"])
def test_factorised_mlp_against_an_independent_recursion(fn):
    _, ans = solve_request(eoc(factorised, fn, {}))
    for c0, got in zip(ans.c_map.c, ans.c_map.global_, strict=True):
        if abs(c0) < 1:
            want, q = recursion(fn, ans.sigma_w2, ans.sigma_b2, c0, 8)
            assert abs(got - want) < 1e-8, c0
    assert ans.output_q == pytest.approx(q, rel=1e-9)


@pytest.mark.parametrize("fn", ["swish", "gelu"])
def test_unstable_q_star_is_warned_with_its_drift_and_fixed_points(fn):
    _, ans = solve_request(eoc(mlp, fn, {}))
    assert ans.v_slope > 1.0
    (note,) = [w for w in ans.warnings if "unstable fixed point" in w]
    assert f"{ans.v_slope**20:.3g}x over the network's 20 layers" in note
    assert any(fp.q == pytest.approx(1.0) and not fp.stable for fp in ans.fixed_points)
    assert not ans.assumptions.holds and ans.assumptions.violations == ["out"]
    _, stable = solve_request(eoc(mlp, "tanh", {}))
    assert not any("unstable" in w for w in stable.warnings) and stable.assumptions.holds
    assert [fp.stable for fp in stable.fixed_points if fp.q == pytest.approx(1.0)] == [True]


def test_a_mix_of_q_is_refused_or_warned():
    with pytest.raises(SigpropError) as err:
        solve_request(eoc(mixed_concat, "tanh", {}))
    assert err.value.code == "unsupported_structure" and "dense" in err.value.message
    _, ans = solve_request(eoc(mixed_concat, "tanh", {}, assumptions="warn"))
    assert not ans.assumptions.holds and ans.assumptions.violations
    # the input next to weighted layers is one q only at q* = 1
    assert solve_request(eoc(input_skip, "tanh", {}))[1].assumptions.holds
    with pytest.raises(SigpropError):
        solve_request(eoc(input_skip, "tanh", {"q_star": 2.0}))


QUICK = ["issue_sum_blocks_tanh", "issue_factorised_tanh", "reused_stream_tanh"]


@pytest.mark.parametrize("name,build,fn,targets", [c for c in EXACT if c[0] in QUICK], ids=QUICK)
def test_exact_against_monte_carlo_width_128(name, build, fn, targets):
    small = {
        "issue_sum_blocks_tanh": lambda: sum_blocks(128),
        "issue_factorised_tanh": lambda: factorised(128),
        "reused_stream_tanh": lambda: reused_stream(128),
    }[name]
    graph, ans = solve_request(eoc(small, fn, targets))
    assert ans.assumptions.holds
    check(ans, output_statistics(graph, ans, C0S, nets=4, pairs=8, seed=zlib.crc32(name.encode())))


@pytest.mark.slow
@pytest.mark.parametrize("name,build,fn,targets", EXACT, ids=[c[0] for c in EXACT])
def test_exact_against_monte_carlo_width_512(name, build, fn, targets):
    graph, ans = solve_request(eoc(build, fn, targets))
    assert ans.assumptions.holds
    stats = output_statistics(graph, ans, C0S, nets=20, pairs=16, seed=zlib.crc32(name.encode()))
    for row in check(ans, stats):
        print(f"MC eoc {name}: {row[0]} predicted {row[1]:.4f} measured {row[2]:.4f} +- {row[3]:.4f}")


@pytest.mark.slow
def test_mixed_is_really_mispredicted_width_512():
    graph, ans = solve_request(eoc(mixed_concat, "tanh", {}, assumptions="warn"))
    stats = output_statistics(graph, ans, C0S, nets=20, pairs=16, seed=7)
    print(
        f"MC eoc mixed_concat (warned): q {stats['q'].mean:.4f} +- {stats['q'].se:.4f}, C(0) {stats['c'][0.0].mean:.4f}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name,build,fn,targets", UNSTABLE, ids=[c[0] for c in UNSTABLE])
def test_unstable_is_warned_and_drifts_width_512(name, build, fn, targets):
    """holds: false with the drift warning; the measured q at the output is printed against q*."""
    graph, ans = solve_request(eoc(build, fn, targets))
    assert not ans.assumptions.holds and any("unstable fixed point" in w for w in ans.warnings)
    stats = output_statistics(graph, ans, C0S, nets=20, pairs=16, seed=zlib.crc32(name.encode()))
    for c0, est in stats["c"].items():
        print(
            f"MC eoc {name} (warned): C({c0}) predicted {predicted(ans, c0):.4f} "
            f"measured {est.mean:.4f} +- {est.se:.4f}"
        )
    print(
        f"MC eoc {name} (warned): q predicted {ans.output_q:.4f} measured {stats['q'].mean:.4f} +- {stats['q'].se:.4f}"
    )
