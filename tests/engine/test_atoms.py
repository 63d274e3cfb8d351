"""The atom pass (``schemas.atoms``): coefficients against hand-computed ones, the structures it
puts outside the theory, its cost bound, and the engine's C map of sums of shared atoms against
the closed form sum_a c_a^2 C_a. Fast: no Monte Carlo here (``test_monte_carlo_structures`` has it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sigprop.errors import SigpropError
from sigprop.schemas import atoms
from sigprop.schemas.atoms import atom_pass
from sigprop.schemas.graph import Graph
from sigprop.schemas.structure import check_structure, wire_structure

R = 1 / math.sqrt(2)


class Net:
    """Nodes in topological order for ``atom_pass``: ops, inputs, sum weights."""

    def __init__(self):
        self.ops, self.ins, self.ws = ["input"], [()], [None]

    def add(self, op, *inputs, weights=None):
        self.ops.append(op)
        self.ins.append(tuple(inputs))
        self.ws.append(weights)
        return len(self.ops) - 1

    def run(self):
        return atom_pass(self.ops, self.ins, self.ws)


@pytest.mark.parametrize("copy", ["dropout", "identity", "flatten"])
def test_a_copy_through_a_pass_through_op_adds_its_coefficients(copy):
    n = Net()
    z = n.add("dense", 0)
    s = n.add("sum", z, n.add(copy, z))
    p = n.run()
    assert p.mixes[s] == pytest.approx({z: 1.0})  # (1/sqrt2 + 1/sqrt2) z, rescaled by 1/sqrt2
    assert p.scales == {s: pytest.approx(R)} and p.shared == {s}
    assert not p.bad_sums


def test_nested_sum_has_the_issue_s_closed_form():
    """sum(x1, sum(x1, F(x1))): q = (1/sqrt2 + 1/2)^2 + 1/4 = 1.707 with the graph's weights."""
    n = Net()
    x1 = n.add("dense", 0)
    f = n.add("dense", n.add("activation", x1))
    inner = n.add("sum", x1, f)
    outer = n.add("sum", x1, inner)
    p = n.run()
    q = (R + 0.5) ** 2 + 0.25
    assert q == pytest.approx(1.7071, abs=1e-4)
    assert p.scales == {outer: pytest.approx(1 / math.sqrt(q))}
    assert p.mixes[outer] == pytest.approx({x1: (R + 0.5) / math.sqrt(q), f: 0.5 / math.sqrt(q)})
    assert p.mixes[inner] == pytest.approx({x1: R, f: R})  # no shared atom: the weights stand


def test_a_stream_added_into_two_sums_that_meet_again():
    """U-Net / FPN style: x0 goes into sums A and B, and A and B are added: x0 has coefficient 1."""
    n = Net()
    x0 = n.add("dense", 0)
    f = n.add("dense", n.add("activation", x0))
    g = n.add("dense", n.add("activation", x0))
    a, b = n.add("sum", x0, f), n.add("sum", x0, g)
    c = n.add("sum", a, b)
    p = n.run()
    norm = 1.0 + 0.25 + 0.25
    assert p.scales == {c: pytest.approx(1 / math.sqrt(norm))}
    k = 1 / math.sqrt(norm)
    assert p.mixes[c] == pytest.approx({x0: k, f: 0.5 * k, g: 0.5 * k})


def test_preactivation_residual_streams_are_private_atoms():
    """Each stream of a pre-activation ResNet reaches the rest of the graph through its sum alone:
    every expansion has one term, and no sum is rescaled."""
    n = Net()
    x = n.add("dense", 0)
    for _ in range(50):
        r = n.add("dense", n.add("activation", n.add("dense", n.add("activation", x))))
        x = n.add("sum", x, r, weights=[0.8, 0.6])
    p = n.run()
    assert not p.scales and not p.shared and not p.bad_sums
    assert max(len(e) for e in p.expansions) == 1
    assert atoms.expansion_bound(n.ops, n.ins, p.private) == len(n.ops)


def test_a_feature_added_to_its_own_input_is_outside_the_theory():
    """sum(z, act(z)): the cross term E[z phi(z)] is not zero (the issue measures q 1.85)."""
    n = Net()
    z = n.add("dense", 0)
    a = n.add("activation", z)
    s = n.add("sum", z, a)
    (bad,) = n.run().bad_sums
    assert (bad.node, bad.feature, bad.partner, bad.second) == (s, a, z, False)


def test_a_feature_added_to_a_copy_of_its_input_is_outside_the_theory():
    n = Net()
    z = n.add("dense", 0)
    s = n.add("sum", n.add("identity", z), n.add("activation", n.add("dropout", z)))
    assert [b.node for b in n.run().bad_sums] == [s]


def test_two_features_in_one_sum_are_outside_the_theory():
    n = Net()
    z1, z2 = n.add("dense", 0), n.add("dense", 0)
    s = n.add("sum", n.add("activation", z1), n.add("activation", z2))
    (bad,) = n.run().bad_sums
    assert bad.node == s and bad.second


def test_a_feature_added_to_an_independent_atom_is_exact():
    """sum(act(x), dense(...)) at the output: uncorrelated, zero-mean Gaussian branch: q and C follow
    the normalized-sum rule (an activation reading it is still outside: ``test_five_patterns``)."""
    n = Net()
    z = n.add("dense", 0)
    a = n.add("activation", z)
    r = n.add("dense", n.add("activation", n.add("dense", a)))
    n.add("sum", a, r)
    p = n.run()
    assert not p.bad_sums and not p.scales


def _wire(nodes):
    return {"schema": "sigprop.graph/v1", "nodes": nodes}


def _report(nodes):
    return wire_structure(Graph.model_validate(_wire(nodes)))


X = {"id": "x", "op": "input", "shape": [8]}


def d(i, src):
    return {"id": i, "op": "dense", "inputs": [src], "units": 8}


def act(i, src):
    return {"id": i, "op": "activation", "inputs": [src]}


def out(src):
    return {"id": "out", "op": "output", "inputs": [src]}


FIVE = {
    # post-activation residual block: the identity shortcut carries a post-activation feature
    "post_activation_residual": (
        [X, d("d0", "x"), act("a0", "d0"), d("d1", "a0"), act("a1", "d1"), d("d2", "a1")]
        + [{"id": "s", "op": "sum", "inputs": ["a0", "d2"]}, act("a2", "s"), d("head", "a2"), out("head")],
        "a2",
        "s",
        "pre-activation",
    ),
    "activation_on_shortcut": (
        [X, d("d0", "x"), act("a0", "d0"), d("d1", "a0"), act("sc", "d0")]
        + [{"id": "s", "op": "sum", "inputs": ["sc", "d1"]}, act("a2", "s"), d("head", "a2"), out("head")],
        "a2",
        "s",
        "pre-activation",
    ),
    "two_activations_in_a_row": (
        [X, d("d0", "x"), act("a0", "d0"), act("a1", "a0"), d("head", "a1"), out("head")],
        "a1",
        None,
        "merge the two activations",
    ),
    "concat_carrying_an_activation": (
        [X, d("d0", "x"), act("a0", "d0"), d("d1", "a0")]
        + [{"id": "c", "op": "concat", "inputs": ["a0", "d1"]}, act("a1", "c"), d("head", "a1"), out("head")],
        "a1",
        "c",
        "concatenated branch",
    ),
    "activation_on_the_input": (
        [X, act("a0", "x"), d("head", "a0"), out("head")],
        "a0",
        None,
        "between the input and the first activation",
    ),
}


@pytest.mark.parametrize("name", sorted(FIVE))
def test_five_patterns_fall_out_of_the_pass(name):
    nodes, flagged, via, fix = FIVE[name]
    ids, report = _report(nodes)
    assert not report.holds
    (v,) = report.violations
    assert ids[v.activation] == flagged and (ids[v.via] if v.via is not None else None) == via
    with pytest.raises(SigpropError) as err:
        check_structure(ids, report, "strict")
    assert err.value.code == "unsupported_structure" and err.value.status == 422
    assert repr(flagged) in err.value.message and fix in err.value.hint
    if via == "s":
        assert "normalization_free(model, preactivation=True)" in err.value.hint
    (note,) = check_structure(ids, report, "warn")
    assert note.startswith("assumptions not met")


def test_feature_sum_refusal_names_the_sum_and_the_fix():
    nodes = [X, d("z", "x"), act("a", "z"), {"id": "s", "op": "sum", "inputs": ["z", "a"]}, out("s")]
    ids, report = _report(nodes)
    assert not report.holds and report.flagged == [ids.index("s")] and not report.violations
    with pytest.raises(SigpropError) as err:
        check_structure(ids, report, "strict")
    assert "'s'" in err.value.message and "E[z phi(z)]" in err.value.message
    assert "weighted layer" in err.value.hint and "preactivation=True" in err.value.hint


def test_wire_structure_reads_sum_weights_and_dropout_rates():
    nodes = [
        X,
        d("z", "x"),
        {"id": "dz", "op": "dropout", "inputs": ["z"], "rate": 0.5},
        {"id": "s", "op": "sum", "inputs": ["z", "dz"], "weights": [0.6, 0.8]},
        out("s"),
    ]
    ids, report = _report(nodes)
    assert report.holds and report.dropouts == (ids.index("dz"),)
    assert report.sum_scales == {ids.index("s"): pytest.approx(1 / 1.4)}


def test_the_cost_is_bounded_before_the_pass(monkeypatch):
    """A stream copied into a long chain of sums and added back at the end keeps every expansion
    open: the integer bound refuses it before any dictionary is built."""
    n = Net()
    z = n.add("dense", 0)
    x = n.add("dropout", z)
    for _ in range(40):
        x = n.add("sum", x, n.add("dense", n.add("activation", x)))
    n.add("sum", x, z)
    p = n.run()
    assert len(p.mixes[len(n.ops) - 1]) == 41  # z and the 40 fresh atoms, all still open
    monkeypatch.setattr(atoms, "MAX_TERMS", 200)
    with pytest.raises(SigpropError) as err:
        n.run()
    assert err.value.code == "graph_too_large" and "coefficients" in err.value.message


# ------------------------------------------------------------------ the engine's C map of shared sums


def _solve(nodes, **extra):
    from ..mc_networks import solve_request

    body = {"graph": _wire(nodes), "method": "tat", "activation": "softplus", "targets": {"tau": 0.5}, **extra}
    return solve_request(body)[1]


def test_engine_c_map_composes_shared_atoms():
    """sum(x1, sum(x1, F(x1))) at the output: C = c1^2 c + c2^2 C_local(c) with the renormalized
    coefficients (x1 = dense(x) has the input's c; F = dense(act(x1)) the local map's)."""
    nodes = [X, d("x1", "x"), act("a", "x1"), d("f", "a")]
    nodes += [
        {"id": "inner", "op": "sum", "inputs": ["x1", "f"]},
        {"id": "outer", "op": "sum", "inputs": ["x1", "inner"]},
    ]
    ans = _solve(nodes + [out("outer")])
    q = (R + 0.5) ** 2 + 0.25
    assert ans.assumptions.holds and ans.sum_scales == {"outer": pytest.approx(1 / math.sqrt(q))}
    c, local, glob = (np.array(v) for v in (ans.c_map.c, ans.c_map.local, ans.c_map.global_))
    want = ((R + 0.5) ** 2 * c + 0.25 * local) / q
    np.testing.assert_allclose(glob, want, atol=1e-9)
    assert any("sum_scales" in w for w in ans.warnings)


def test_engine_c_map_of_a_copy_is_the_copied_stream_s():
    nodes = [X, d("z0", "x"), act("a", "z0"), d("z", "a"), {"id": "dz", "op": "dropout", "inputs": ["z"], "rate": 0.3}]
    nodes += [{"id": "s", "op": "sum", "inputs": ["z", "dz"]}, act("b", "s"), d("head", "b"), out("head")]
    ans = _solve(nodes)
    assert ans.assumptions.holds and ans.sum_scales == {"s": pytest.approx(R)}
    plain = _solve([X, d("z0", "x"), act("a", "z0"), d("z", "a"), act("b", "z"), d("head", "b"), out("head")])
    np.testing.assert_allclose(ans.c_map.global_, plain.c_map.global_, atol=1e-9)
    assert any("evaluation mode" in w for w in ans.warnings)  # dropout with a rate: eval-mode predictions


def test_feature_sum_is_refused_by_the_service_and_warned_on_request():
    nodes = [X, d("z", "x"), act("a", "z"), {"id": "s", "op": "sum", "inputs": ["z", "a"]}, out("s")]
    with pytest.raises(SigpropError) as err:
        _solve(nodes)
    assert err.value.code == "unsupported_structure"
    ans = _solve(nodes, assumptions="warn")
    assert not ans.assumptions.holds and ans.assumptions.violations == ["s"]


def test_diagnose_predicts_shared_sums_atom_by_atom():
    """The client's per-node predictions (what ``diagnose`` compares against) mix a shared sum over
    its atoms with the answer's sum scales: q = 1 there, and C at the output is the answer's C map."""
    from sigprop.client.diagnosis import predict

    nodes = [X, d("x1", "x"), act("a", "x1"), d("f", "a")]
    nodes += [
        {"id": "inner", "op": "sum", "inputs": ["x1", "f"]},
        {"id": "outer", "op": "sum", "inputs": ["x1", "inner"]},
        out("outer"),
    ]
    ans = _solve(nodes)
    pred = predict(_wire(nodes), ans, 0.5, same_locations=True)
    assert pred["outer"].q == pytest.approx(1.0, abs=1e-9)
    i = ans.c_map.c.index(0.5)
    assert pred["out"].c == pytest.approx(ans.c_map.global_[i], abs=1e-6)


def test_a_concatenation_sharing_atoms_with_another_term_is_named_as_such():
    nodes = [X, d("a", "x"), d("b", "x"), d("c", "x")]
    nodes += [
        {"id": "ab", "op": "concat", "inputs": ["a", "b"]},
        {"id": "ac", "op": "concat", "inputs": ["a", "c"]},
        {"id": "s", "op": "sum", "inputs": ["ab", "ac"]},
        out("s"),
    ]
    ids, report = _report(nodes)
    (bad,) = report.bad_sums
    assert bad.concat and ids[bad.node] == "s"
    with pytest.raises(SigpropError) as err:
        check_structure(ids, report, "strict")
    assert "concatenation" in err.value.message and "feature" not in err.value.message.split(";")[0]


def test_correlated_features_are_bounded_too(monkeypatch):
    """x_k = sum(x_{k-1}, act(x_{k-1})), with x_0 added again at the end so that no stream closes:
    every feature is correlated with every atom before it; the sets that say so count against the
    same limit."""
    n = Net()
    x0 = x = n.add("dense", 0)
    for _ in range(30):
        x = n.add("sum", x, n.add("activation", x))
    n.add("sum", x, x0)
    assert len(n.run().bad_sums) == 31
    bound = atoms.expansion_bound(n.ops, n.ins, atoms.private_nodes(n.ops, n.ins))
    monkeypatch.setattr(atoms, "MAX_TERMS", bound + 50)  # the coefficients fit; the reach sets do not
    with pytest.raises(SigpropError) as err:
        n.run()
    assert err.value.code == "graph_too_large" and "post-activation features" in err.value.message


def _random_dag(rng) -> Net:
    n = Net()
    n.add("dense", 0)
    for _ in range(40):
        k = len(n.ops)
        op = rng.choice(["dense", "activation", "sum", "sum", "identity", "concat"], p=[0.3, 0.25, 0.2, 0.1, 0.1, 0.05])
        pick = lambda: int(rng.integers(max(0, k - 8), k))  # noqa: E731 - recent nodes: long chains, some fan-out
        if op in ("sum", "concat"):
            ins = [pick() for _ in range(int(rng.integers(2, 4)))]
            ws = None
            if op == "sum" and rng.random() < 0.5:
                w = rng.random(len(ins)) + 0.1
                ws = list(w / np.linalg.norm(w))
            n.add(str(op), *ins, weights=ws)
        else:
            n.add(str(op), pick())
    return n


def _random_blocks(rng) -> Net:
    """Residual-style blocks, mostly private streams, with copies, long skips, feature sums and
    concatenations mixed in."""
    n = Net()
    x = n.add("dense", 0)
    streams = [x]
    for _ in range(12):
        kind = rng.choice(["preact", "preact", "copy", "long", "feature", "postact", "concat"])
        if kind == "preact":
            x = n.add("sum", x, n.add("dense", n.add("activation", x)), weights=[0.8, 0.6])
        elif kind == "copy":
            x = n.add("sum", x, n.add("identity", x))
        elif kind == "long":
            x = n.add("sum", x, streams[int(rng.integers(len(streams)))])
        elif kind == "feature":
            x = n.add("sum", x, n.add("activation", x))
        elif kind == "postact":
            x = n.add("activation", n.add("sum", x, n.add("dense", n.add("activation", x))))
        else:
            x = n.add("concat", x, n.add("dense", n.add("activation", x)))
        streams.append(x)
    n.add("dense", n.add("activation", x))
    return n


@pytest.mark.parametrize("seed", range(60))
def test_private_atoms_change_nothing_but_the_cost(seed, monkeypatch):
    """On random DAGs, the pass with private nodes collapsed into atoms finds the same sum scales,
    shared sums, first uncovered sum and witnesses as the pass that expands everything down to
    dense/input/activation atoms."""
    rng = np.random.default_rng(seed)
    n = _random_dag(rng) if seed % 2 else _random_blocks(rng)
    fast = n.run()
    monkeypatch.setattr(atoms, "private_nodes", lambda ops, ins, consumers=None: [False] * len(ops))
    full = n.run()
    assert fast.scales.keys() == full.scales.keys()
    for v, s in full.scales.items():
        assert fast.scales[v] == pytest.approx(s, rel=1e-12)
    assert fast.shared == full.shared
    # the same first uncovered sum; past it the full expansion also flags later sums that only
    # carry the same correlated pair along (the private pass names the sum where it arises)
    first = [min((b.node for b in p.bad_sums), default=None) for p in (fast, full)]
    assert first[0] == first[1] and {b.node for b in fast.bad_sums} <= {b.node for b in full.bad_sums}
    assert [w is None for w in fast.witness] == [w is None for w in full.witness]


def test_a_stream_closes_again_after_a_shared_sum():
    """An early sum(z, dropout(z)) does not keep every later expansion open: once the copy has met
    its stream again, the sum is private, and 3000 residual blocks later the pass holds about one
    coefficient per node (the bound says so before the pass)."""
    n = Net()
    z = n.add("dense", 0)
    x = first = n.add("sum", z, n.add("dropout", z))
    for _ in range(3000):
        x = n.add("sum", x, n.add("dense", n.add("activation", x)), weights=[0.8, 0.6])
    p = n.run()
    assert p.private[first] and p.scales == {first: pytest.approx(R)}
    assert max(len(e) for e in p.expansions) == 1
    assert atoms.expansion_bound(n.ops, n.ins, p.private) == len(n.ops)
