"""The graphs of issue 24's table, and variants (long skips, shared streams, pass-through chains,
concatenated copies): each is exact against Monte Carlo at width 512 (q, C(0) and C(0.5) at the
output within 3 standard errors + 0.01, with the answer's ``sum_scales`` applied as the PyTorch and
Keras adapters apply them), or is refused, and then, under ``"assumptions": "warn"``, warned with
``assumptions.holds: false`` and really mispredicted. Dropout: exact in evaluation mode, warned for
training mode, and the warning's figures (q x 1/(1 - p), covariance unchanged) measured.

The Monte Carlo runs are ``slow`` (``pytest -m slow``; set OPENBLAS_NUM_THREADS=1 on a shared
machine: the 512 x 512 QR per layer is many times slower with oversubscribed BLAS threads). The
default suite checks the same graphs' structure outcomes (``test_*_outcomes``), and ``test_atoms``
the coefficients and the C map against closed forms.
"""

from __future__ import annotations

import zlib

import pytest

from sigprop.errors import SigpropError

from ..mc_networks import output_statistics, solve_request
from .test_monte_carlo_structures import C0S, WIDTH, G, check, predicted, request

TAT = ("tat", "softplus", {"tau": 0.5})


def copy_blocks(blocks=1, via="dropout", rate=0.0):
    """sum(z, via(z)) blocks: z = dense(act(x)) from the second block on."""
    g = G([WIDTH])
    x = g.dense("x")
    for k in range(blocks):
        z = g.dense(g.act(x)) if k else x
        c = g.add(via, [z], **({"rate": rate} if via == "dropout" else {}))
        x = g.add("sum", [z, c])
    return g.graph(g.dense(g.act(x)))


def pass_through_chain():
    """A copy through identity -> flatten -> dropout, summed with the stream and a fresh branch."""
    g = G([WIDTH])
    z = g.dense(g.act(g.dense("x")))
    c = g.add("dropout", [g.add("flatten", [g.add("identity", [z])])], rate=0.0)
    r = g.dense(g.act(z))
    x = g.add("sum", [z, c, r])
    return g.graph(g.dense(g.act(x)))


def copy_sums_in_a_row(sums=4):
    """A stream summed with a copy of itself four times in a row (identity, dropout, flatten,
    identity), no layer between: the atom's coefficient doubles at each sum."""
    g = G([WIDTH])
    x = g.dense("x")
    for k in range(sums):
        via = ("identity", "dropout", "flatten", "identity")[k % 4]
        x = g.add("sum", [x, g.add(via, [x], **({"rate": 0.0} if via == "dropout" else {}))])
    return g.graph(g.dense(g.act(x)))


def shared_stream_three_sums():
    """One stream x0 added again into each of three later sums of a residual chain."""
    g = G([WIDTH])
    x0 = g.dense(g.act(g.dense("x")))
    x = x0
    for _ in range(3):
        x = g.add("sum", [x, x0, g.dense(g.act(x))])
    return g.graph(g.dense(g.act(x)))


def concat_copy():
    """A stream concatenated with its own copy, read by an activation then a dense layer: each
    coordinate is still Gaussian, and no sum adds the two halves."""
    g = G([WIDTH])
    z = g.dense(g.act(g.dense("x")))
    c = g.add("concat", [z, g.add("identity", [z])])
    return g.graph(g.dense(g.act(g.dense(g.act(c)))))


def unet_concat():
    """U-Net with concatenated skips; the last two levels concatenate a sum with an atom that sum
    already holds (concat(sum(u, e), e))."""
    g = G([WIDTH])
    x0 = g.dense("x")
    e1 = g.dense(g.act(x0))
    e2 = g.dense(g.act(e1))
    b = g.dense(g.act(e2))
    u1 = g.dense(g.act(g.add("concat", [b, e2])))
    u0 = g.dense(g.act(g.add("concat", [g.add("sum", [u1, e1]), e1])))
    d0 = g.add("concat", [g.add("sum", [u0, x0]), x0])
    return g.graph(g.dense(g.act(d0)))


def nested(at_output=False):
    """sum(x1, sum(x1, F(x1)))."""
    g = G([WIDTH])
    x1 = g.dense("x")
    inner = g.add("sum", [x1, g.dense(g.act(x1))])
    x = g.add("sum", [x1, inner])
    return g.graph(x if at_output else g.dense(g.act(x)))


def long_skip_three_sums(blocks=3):
    """A stream x0 enters a residual chain and is added again after ``blocks`` sums."""
    g = G([WIDTH])
    x0 = g.dense("x")
    x = x0
    for _ in range(blocks):
        x = g.add("sum", [x, g.dense(g.act(g.dense(g.act(x))))], weights=[0.8, 0.6])
    x = g.add("sum", [x, x0])
    return g.graph(g.dense(g.act(x)))


def diamond():
    """x0 added into two sums A and B that are added together (U-Net/FPN style)."""
    g = G([WIDTH])
    x0 = g.dense(g.act(g.dense("x")))
    a = g.add("sum", [x0, g.dense(g.act(x0))])
    b = g.add("sum", [x0, g.dense(g.act(x0))])
    x = g.add("sum", [a, b])
    return g.graph(g.dense(g.act(x)))


def fpn():
    """Laterals of three backbone stages, a top-down path of identity copies, a head summing all levels."""
    g = G([WIDTH])
    c1 = g.dense("x")
    c2 = g.dense(g.act(c1))
    c3 = g.dense(g.act(c2))
    l1, l2, l3 = (g.dense(g.act(c)) for c in (c1, c2, c3))
    p3 = l3
    p2 = g.add("sum", [l2, g.add("identity", [p3])])
    p1 = g.add("sum", [l1, g.add("identity", [p2])])
    head = g.add("sum", [p1, p2, p3])
    return g.graph(g.dense(g.act(head)))


def unet():
    """Encoder-decoder with long skips; the last decoder sum adds the previous decoder level and an
    encoder level that the previous one already holds."""
    g = G([WIDTH])
    x0 = g.dense("x")
    e1 = g.dense(g.act(x0))
    e2 = g.dense(g.act(e1))
    b = g.dense(g.act(e2))
    d2 = g.add("sum", [b, e2])
    d1 = g.add("sum", [g.dense(g.act(d2)), e1])
    d0 = g.add("sum", [g.add("identity", [d1]), x0, e1])
    return g.graph(g.dense(g.act(d0)))


def feature_sum_at_output():
    """sum(z, act(z)) at the output."""
    g = G([WIDTH])
    z = g.dense(g.act(g.dense("x")))
    return g.graph(g.add("sum", [z, g.act(z)]))


def feature_sum_blocks(blocks=4):
    """Blocks sum(z, act(z)) -> dense, then an activation."""
    g = G([WIDTH])
    x = g.dense("x")
    for _ in range(blocks):
        x = g.dense(g.add("sum", [x, g.act(x)]))
    return g.graph(g.dense(g.act(x)))


EXACT = [
    ("sum_z_dropout_z", lambda: copy_blocks(1), True),
    ("sum_z_identity_z", lambda: copy_blocks(1, "identity"), True),
    ("sum_z_flatten_z", lambda: copy_blocks(1, "flatten"), True),
    ("sum_z_dropout_z_rate_0.5_eval", lambda: copy_blocks(1, rate=0.5), True),
    ("four_dropout_blocks", lambda: copy_blocks(4), True),
    ("four_identity_blocks", lambda: copy_blocks(4, "identity"), True),
    ("four_flatten_blocks", lambda: copy_blocks(4, "flatten"), True),
    ("copy_sums_in_a_row", copy_sums_in_a_row, True),
    ("nested_sums", nested, True),
    ("nested_sums_at_output", lambda: nested(True), True),
    ("pass_through_chain", pass_through_chain, True),
    ("long_skip_three_sums", long_skip_three_sums, True),
    ("diamond", diamond, True),
    ("shared_stream_three_sums", shared_stream_three_sums, True),
    ("concat_copy", concat_copy, False),
    ("unet_concat", unet_concat, False),
    ("fpn", fpn, True),
    ("unet", unet, True),
]
REFUSED = [
    ("sum_z_act_z_at_output", feature_sum_at_output),
    ("four_sum_z_act_z_blocks", feature_sum_blocks),
]


@pytest.mark.parametrize("name,build,rescaled", EXACT, ids=[c[0] for c in EXACT])
def test_exact_outcomes(name, build, rescaled):
    graph, ans = solve_request(request(build(), *TAT))
    assert ans.assumptions.holds and not ans.assumptions.violations
    assert bool(ans.sum_scales) == rescaled


@pytest.mark.parametrize("name,build", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_outcomes(name, build):
    with pytest.raises(SigpropError) as err:
        solve_request(request(build(), *TAT))
    assert err.value.code == "unsupported_structure" and err.value.status == 422
    _, ans = solve_request(request(build(), *TAT, assumptions="warn"))
    assert not ans.assumptions.holds and ans.assumptions.violations


ROWS: list[tuple] = []  # (graph, quantity, predicted, mean, se): printed by the slow run for the closing note


@pytest.mark.slow
@pytest.mark.parametrize("name,build,rescaled", EXACT, ids=[c[0] for c in EXACT])
def test_exact_against_monte_carlo_width_512(name, build, rescaled):
    graph, ans = solve_request(request(build(), *TAT))
    stats = output_statistics(graph, ans, C0S, nets=20, pairs=16, seed=zlib.crc32(name.encode()))
    rows = check(ans, stats)
    for row in rows:
        print(f"MC {name}: {row[0]} predicted {row[1]:.4f} measured {row[2]:.4f} +- {row[3]:.4f}")


@pytest.mark.slow
@pytest.mark.parametrize("name,build", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_are_really_mispredicted_width_512(name, build):
    graph, ans = solve_request(request(build(), *TAT, assumptions="warn"))
    stats = output_statistics(graph, ans, C0S, nets=20, pairs=16, seed=zlib.crc32(name.encode()))
    c, q = stats["c"][0.0], stats["q"]
    for c0, est in stats["c"].items():
        print(f"MC {name} (warned): C({c0}) predicted {predicted(ans, c0):.4f} measured {est.mean:.4f} +- {est.se:.4f}")
    print(f"MC {name} (warned): q predicted 1 measured {q.mean:.4f} +- {q.se:.4f}")
    assert abs(c.mean - predicted(ans, 0.0)) > 3 * c.se + 0.02 or abs(q.mean - 1) > 3 * q.se + 0.2


# ------------------------------------------------------------------ dropout in training mode


def dropout_mlp(layers=4, rate=0.5):
    """x -> dense -> [act -> dropout(rate) -> dense] x layers (the issue: q 16.7 in training mode)."""
    g = G([WIDTH])
    x = g.dense("x")
    for _ in range(layers):
        x = g.dense(g.add("dropout", [g.act(x)], rate=rate))
    return g.graph(x)


def test_dropout_is_warned_and_its_training_mode_is_what_the_warning_says():
    """The answer holds in evaluation mode and says so; in training mode each input draws its own
    mask: right after the dropout q is 1/(1 - p) = 2 times the evaluation value and the covariance is
    unchanged (c times 1 - p), and the network's output q is far from the answer's."""
    graph, ans = solve_request(request(dropout_mlp(), *TAT))
    assert ans.assumptions.holds
    (note,) = [w for w in ans.warnings if w.startswith("dropout (")]
    assert "evaluation mode" in note and "1/(1 - p)" in note
    first = next(nd.user_id for nd in graph.nodes if nd.op == "dropout")
    at = {
        mode: output_statistics(graph, ans, (0.5,), nets=4, pairs=8, seed=3, at=first, dropout_training=mode)
        for mode in (False, True)
    }
    assert at[True]["q"].mean / at[False]["q"].mean == pytest.approx(2.0, rel=0.03)
    assert at[True]["c"][0.5].mean / at[False]["c"][0.5].mean == pytest.approx(0.5, rel=0.03)
    out = output_statistics(graph, ans, (0.0,), nets=4, pairs=8, seed=4, dropout_training=True)
    assert out["q"].mean > 8.0


@pytest.mark.slow
def test_dropout_mlp_against_monte_carlo_width_512_in_both_modes():
    graph, ans = solve_request(request(dropout_mlp(), *TAT))
    rows = check(ans, output_statistics(graph, ans, C0S, nets=20, pairs=16, seed=21))  # evaluation mode: exact
    for row in rows:
        print(f"MC dropout_mlp (eval): {row[0]} predicted {row[1]:.4f} measured {row[2]:.4f} +- {row[3]:.4f}")
    train = output_statistics(graph, ans, C0S, nets=20, pairs=16, seed=22, dropout_training=True)
    for c0, est in train["c"].items():
        pred = predicted(ans, c0)
        print(f"MC dropout_mlp (train, warned): C({c0}) predicted {pred:.4f} measured {est.mean:.4f} +- {est.se:.4f}")
    q = train["q"]
    print(f"MC dropout_mlp (train, warned): q predicted 1 measured {q.mean:.4f} +- {q.se:.4f}")
    assert abs(q.mean - 1) > 3 * q.se + 0.2
