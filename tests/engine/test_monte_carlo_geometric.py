"""``geometric`` against random ReLU networks built from its own answer (issue 34): Gaussian weights
with the answer's ``init_second_moment`` times its ``alpha`` on each layer's output, the answer's
``sum_scales`` on the sums it rescales, inputs at its ``input_second_moment`` and the logits times
its ``output_scale``. The output second moment the answer states (``output_second_moment``, so the
logits' standard deviation 0.05 of Appendix F) must be the mean over networks within 3 standard
errors + 0.01 (relative), for an MLP, a residual net with unequal weights, streams reused later (the
issue's graph: 0.05 stated, 0.0925 +- 0.003 measured before ``sum_scales``) and concatenated
branches. The width-512 sweeps are ``slow`` (``pytest -m slow``); the default run takes width 128.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from sigprop.engine.methods.geometric import OUTPUT_STD
from sigprop.errors import SigpropError

from ..mc_networks import estimate, solve_request
from .test_monte_carlo_structures import G, request


def mlp(width, depth=4):
    g = G([width])
    x = g.dense("x", width)
    for _ in range(depth):
        x = g.dense(g.act(x), width)
    return g.graph(x)


def residual(width, blocks=4, weights=(0.8, 0.6)):
    """Pre-activation residual blocks with unequal weights."""
    g = G([width])
    x = g.dense("x", width)
    for _ in range(blocks):
        x = g.add("sum", [x, g.dense(g.act(g.dense(g.act(x), width)), width)], weights=list(weights))
    return g.graph(g.dense(g.act(x), width))


def reused_two_blocks_later(width, weights=(0.8, 0.6)):
    """The issue's graph: a stream x0 goes through two residual blocks and is added again into the third."""
    g = G([width])
    x0 = g.dense(g.act(g.dense("x", width)), width)
    x1 = g.add("sum", [x0, g.dense(g.act(x0), width)], weights=list(weights))
    x2 = g.add("sum", [x1, g.dense(g.act(x1), width)], weights=list(weights))
    x3 = g.add("sum", [x2, x0, g.dense(g.act(x2), width)])
    return g.graph(g.dense(g.act(x3), width))


def reused_stream(width):
    """One stream x0 added again into each of three later sums (the EoC Monte Carlo's graph)."""
    g = G([width])
    x0 = g.dense(g.act(g.dense("x", width)), width)
    x = x0
    for _ in range(3):
        x = g.add("sum", [x, x0, g.dense(g.act(x), width)])
    return g.graph(g.dense(g.act(x), width))


def concat_branches(width):
    """Inception-style: two branches of one stream (one and two layers deep) concatenated."""
    g = G([width])
    s = g.act(g.dense("x", width))
    a = g.dense(s, width // 2)
    b = g.dense(g.act(g.dense(s, width)), width // 2)
    c = g.add("concat", [a, b])
    return g.graph(g.dense(g.act(g.dense(g.act(c), width)), width))


def geometric(graph, **extra):
    return {**request(graph, "geometric", "relu", {}), **extra}


def forward(graph, ans, x, rng):
    """One random network from the answer; returns the logits (output times ``output_scale``)."""
    layers = {lay.id: lay for lay in ans.layers}
    scales = ans.sum_scales or {}
    vals = [None] * graph.n
    for nd in graph.nodes:
        ins = [vals[i] for i in nd.inputs]
        if nd.op == "input":
            h = x
        elif nd.op == "dense":
            lay = layers[nd.user_id]
            w = rng.standard_normal((lay.fan_out, lay.fan_in)) * math.sqrt(lay.weight_variance)
            h = lay.alpha * (ins[0] @ w.T)  # biases are zeros at initialization
        elif nd.op == "activation":
            h = np.maximum(ins[0], 0.0)
        elif nd.op == "sum":
            s = scales.get(nd.user_id, 1.0)
            h = sum(s * wt * v for wt, v in zip(nd.attrs["weights"], ins, strict=True))
        elif nd.op == "concat":
            h = np.concatenate(ins, axis=1)
        elif nd.op in ("identity", "output"):
            h = ins[0]
        else:
            raise NotImplementedError(nd.op)
        vals[nd.index] = h
    return ans.logits_scale * vals[graph.output]


def measure(graph, ans, nets, batch, seed):
    """The logits' mean square over networks (each: over a batch of inputs and the units)."""
    rng = np.random.default_rng(seed)
    width = graph.nodes[0].shape[0]
    per = []
    for _ in range(nets):
        x = rng.standard_normal((batch, width)) * math.sqrt(ans.input_second_moment)
        per.append(float(np.mean(forward(graph, ans, x, rng) ** 2)))
    return estimate(per)


def check(name, graph, ans, nets, batch):
    """Stated against measured: the logits' second moment relative to the stated one (0.05^2)."""
    stated = OUTPUT_STD**2  # the answer's logits_scale puts the output at this standard deviation
    est = measure(graph, ans, nets, batch, zlib.crc32(name.encode()))
    ratio, se = est.mean / stated, est.se / stated
    print(
        f"MC geometric {name}: std stated {math.sqrt(stated):.4f} measured {math.sqrt(est.mean):.4f} "
        f"(second moment x {ratio:.4f} +- {se:.4f}); sum_scales {ans.sum_scales}"
    )
    assert abs(ratio - 1.0) <= 3 * se + 0.01, (name, ratio, se)
    return ratio, se


CASES = [
    ("mlp", mlp, False),
    ("residual_unequal", residual, False),
    ("reused_two_blocks_later", reused_two_blocks_later, True),
    ("reused_stream", reused_stream, True),
    ("concat_branches", concat_branches, False),
]


@pytest.mark.parametrize("name,build,rescaled", CASES, ids=[c[0] for c in CASES])
def test_stated_output_moment_matches_random_networks(name, build, rescaled):
    graph, ans = solve_request(geometric(build(128)))
    assert bool(ans.sum_scales) == rescaled
    check(name, graph, ans, nets=30, batch=16)


@pytest.mark.slow
@pytest.mark.parametrize("name,build,rescaled", CASES, ids=[c[0] for c in CASES])
def test_stated_output_moment_matches_random_networks_width_512(name, build, rescaled):
    graph, ans = solve_request(geometric(build(512)))
    assert bool(ans.sum_scales) == rescaled
    check(name, graph, ans, nets=40, batch=32)


def test_no_sum_scales_without_shared_atoms_and_answers_unchanged():
    """Graphs where no atom reaches a sum twice keep their answers: no ``sum_scales``."""
    for build in (mlp, residual, concat_branches):
        _, ans = solve_request(geometric(build(64)))
        assert ans.sum_scales is None


def test_a_sum_whose_shared_atom_cancels_is_refused():
    """sum(z, identity(z)) with weights [w, -w] is zero: no factor restores its second moment."""
    g = G([32])
    z = g.dense(g.act(g.dense("x", 32)), 32)
    w = math.sqrt(0.5)
    s = g.add("sum", [z, g.add("identity", [z])], weights=[w, -w])
    with pytest.raises(SigpropError) as err:
        solve_request(geometric(g.graph(g.dense(g.act(s), 32))))
    assert err.value.code == "unsupported_structure"


def gradient_gammas(graph, ans, nets, batch, seed):
    """Per layer outside a branch (its gamma ratio read at itself, Appendix E.1), equation 1 measured
    with alpha = 1: n_in E[x^2]^2 E[Delta y^2] / E[y^2], Delta y_out at y_out's moment (A2), by
    backpropagation through random networks with the answer's effective weights and ``sum_scales``."""
    rng = np.random.default_rng(seed)
    rows = {lay.id: lay for lay in ans.layers if lay.id in _outside_branches(ans)}
    scales = ans.sum_scales or {}
    per: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(nets):
        x = rng.standard_normal((batch, graph.nodes[0].shape[0])) * math.sqrt(ans.input_second_moment)
        vals, ws = [None] * graph.n, {}
        for nd in graph.nodes:
            ins = [vals[i] for i in nd.inputs]
            if nd.op == "input":
                vals[nd.index] = x
            elif nd.op == "dense":
                lay = {lay.id: lay for lay in ans.layers}[nd.user_id]
                ws[nd.index] = rng.standard_normal((lay.fan_out, lay.fan_in)) * math.sqrt(lay.weight_second_moment)
                vals[nd.index] = ins[0] @ ws[nd.index].T
            elif nd.op == "activation":
                vals[nd.index] = np.maximum(ins[0], 0.0)
            elif nd.op == "sum":
                s = scales.get(nd.user_id, 1.0)
                vals[nd.index] = sum(s * w * v for w, v in zip(nd.attrs["weights"], ins, strict=True))
            else:
                vals[nd.index] = ins[0]
        grads = [np.zeros_like(v) for v in vals]
        # the recursion's Delta y_out: at y_out's second moment (A2), independent of the forward pass
        # (the gradient independence its backward moments assume; Delta y_out = y_out itself correlates
        # J^T J y with y, which a finite product of random matrices turns into a depth-dependent excess)
        out = vals[graph.output]
        grads[graph.output] = rng.standard_normal(out.shape) * (OUTPUT_STD / ans.logits_scale)
        for nd in reversed(graph.nodes):
            g = grads[nd.index]
            for slot, i in enumerate(nd.inputs):
                if nd.op == "dense":
                    grads[i] += g @ ws[nd.index]
                elif nd.op == "activation":
                    grads[i] += g * (vals[i] > 0)
                elif nd.op == "sum":
                    grads[i] += scales.get(nd.user_id, 1.0) * nd.attrs["weights"][slot] * g
                else:
                    grads[i] += g
        for nd in graph.nodes:
            if nd.user_id in rows:
                x2 = np.mean(vals[nd.inputs[0]] ** 2)
                ratio = np.mean(grads[nd.index] ** 2) / np.mean(vals[nd.index] ** 2)
                per[nd.user_id].append(float(rows[nd.user_id].fan_in * x2 * x2 * ratio))
    return {k: estimate(v) for k, v in per.items()}


def _outside_branches(ans):
    # the answer does not say which layers sit in a branch; these graphs' dominator layers are the
    # stem (its first two dense layers) and the head (the last)
    ids = [lay.id for lay in ans.layers]
    return {ids[0], ids[1], ids[-1]}


@pytest.mark.parametrize(
    "name,build", [("reused_stream", reused_stream), ("reused_two_blocks_later", reused_two_blocks_later)]
)
def test_gradient_moments_are_those_of_the_rescaled_network(name, build):
    """The gammas (equation 1, alpha = 1) of the layers whose ratio is read at themselves come from the
    gradient pass composed over atoms, with ``sum_scales``: they match backpropagation."""
    graph, ans = solve_request(geometric(build(128)))
    measured = gradient_gammas(graph, ans, nets=12, batch=8, seed=zlib.crc32(name.encode()))
    stated = {lay.id: lay.gamma / lay.alpha**4 for lay in ans.layers}
    for lid, est in measured.items():
        print(
            f"MC geometric {name} {lid}: gamma (alpha = 1) stated {stated[lid]:.4g} "
            f"measured {est.mean:.4g} +- {est.se:.2g}"
        )
        assert abs(est.mean / stated[lid] - 1.0) <= 3 * est.se / stated[lid] + 0.05, (lid, stated[lid], est)
