"""Graph validation (contract error codes), canonical keys, and the subnetwork maximizing function
M_{f,r} (TAT paper Appendix B.2-B.5), the latter against closed forms and a brute-force search
over every single-entry single-exit subnetwork."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from sigprop.engine.graph.build import build_graph
from sigprop.engine.maps.qc_maps import leaky_relu_c_map_scalar
from sigprop.engine.network.subnetworks import compile_subnetworks
from sigprop.engine.solve import prepare, solve
from sigprop.errors import SigpropError
from sigprop.requests import parse_solve_request
from sigprop.schemas import Graph
from sigprop.schemas.ops import ACT, CONCAT, SOURCE, SUM

SCHEMA = "sigprop.graph/v1"


def G(nodes) -> Graph:
    return Graph.model_validate({"schema": SCHEMA, "nodes": nodes})


def inp(i, shape):
    return {"id": i, "op": "input", "shape": list(shape)}


def dense(i, src, units, **kw):
    return {"id": i, "op": "dense", "inputs": [src], "units": units, **kw}


def act(i, src, **kw):
    return {"id": i, "op": "activation", "inputs": [src], **kw}


def out(i, src):
    return {"id": i, "op": "output", "inputs": [src]}


def build(nodes, activation="tanh"):
    return build_graph(G(nodes), default_activation=activation)


def graph_error(nodes) -> SigpropError:
    with pytest.raises(SigpropError) as info:
        build(nodes)
    err = info.value
    assert err.message and err.hint, "every error needs a message and a hint"
    assert err.to_dict() == {"error": {"code": err.code, "message": err.message, "hint": err.hint}}
    return err


def mlp_nodes(depth, width=16, names=None):
    names = names or {}
    n = lambda k: names.get(k, k)  # noqa: E731
    nodes = [inp(n("x"), [width])]
    prev = n("x")
    for i in range(depth):
        nodes.append(dense(n(f"fc{i}"), prev, width))
        nodes.append(act(n(f"a{i}"), n(f"fc{i}")))
        prev = n(f"a{i}")
    nodes.append(dense(n("head"), prev, 10))
    nodes.append(out(n("y"), n("head")))
    return nodes


# ------------------------------------------------------------------ validation errors

BASE = [inp("x", [8]), dense("d", "x", 8), act("a", "d"), out("o", "a")]


def test_valid_base_graph_builds():
    g = build(BASE)
    assert [nd.op for nd in g.nodes] == ["input", "dense", "activation", "output"]
    assert g.output == 3 and g.warnings == [] and g.depth() == 1


def test_duplicate_id():
    err = graph_error(BASE[:2] + [act("d", "d"), out("o", "d")])
    assert err.code == "invalid_graph" and "'d'" in err.message


def test_dangling_input():
    err = graph_error([inp("x", [8]), dense("d", "nope", 8), act("a", "d"), out("o", "a")])
    assert err.code == "invalid_graph" and "nope" in err.message


def test_two_outputs():
    err = graph_error(BASE + [out("o2", "d")])
    assert err.code == "invalid_graph" and "2 output" in err.message


def test_zero_outputs():
    err = graph_error(BASE[:3])
    assert err.code == "invalid_graph" and "0 output" in err.message


@pytest.mark.parametrize(
    "nodes",
    [
        [
            inp("x", [8]),
            {"id": "s", "op": "sum", "inputs": ["x", "b"]},
            dense("d", "s", 8),
            act("b", "d"),
            out("o", "b"),
        ],
        [inp("x", [8]), dense("d", "a", 8), act("a", "d"), out("o", "a")],
        [inp("x", [8]), {"id": "i", "op": "identity", "inputs": ["i"]}, out("o", "i")],
    ],
    ids=["through-sum", "two-cycle", "self-loop"],
)
def test_cycle(nodes):
    err = graph_error(nodes)
    assert err.code == "invalid_graph" and "cycle" in err.message


def test_sum_with_one_input():
    err = graph_error([inp("x", [8]), {"id": "s", "op": "sum", "inputs": ["x"]}, out("o", "s")])
    assert err.code == "invalid_graph" and "1 inputs" in err.message and "at least 2" in err.hint


def test_dense_with_two_inputs():
    err = graph_error(
        [
            inp("x", [8]),
            dense("d1", "x", 8),
            {"id": "d", "op": "dense", "inputs": ["x", "d1"], "units": 4},
            out("o", "d"),
        ]
    )
    assert err.code == "invalid_graph" and "2 inputs" in err.message


def test_dense_on_feature_map():
    err = graph_error([inp("x", [3, 8, 8]), dense("d", "x", 8), out("o", "d")])
    assert err.code == "invalid_graph" and "flatten" in err.hint


def test_sum_shape_mismatch():
    err = graph_error(
        [
            inp("x", [8]),
            dense("d", "x", 4),
            {"id": "s", "op": "sum", "inputs": ["x", "d"], "weights": [0.6, 0.8]},
            out("o", "s"),
        ]
    )
    assert err.code == "invalid_graph" and "[8]" in err.message and "[4]" in err.message


@pytest.mark.parametrize(
    "weights,normalized",
    [
        ([3.0, 4.0], "[0.6, 0.8]"),
        ([1.0, 1.0], "[0.707107, 0.707107]"),
        ([0.5, 0.5, 1.0], "[0.408248, 0.408248, 0.816497]"),
    ],
)
def test_non_normalized_sum_weights(weights, normalized):
    srcs = ["x", "d", "a"][: len(weights)]
    err = graph_error(
        [
            inp("x", [8]),
            dense("d", "x", 8),
            act("a", "d"),
            {"id": "s", "op": "sum", "inputs": srcs, "weights": weights},
            out("o", "s"),
        ]
    )
    assert err.code == "invalid_graph"
    assert normalized in err.hint
    assert f"{sum(w * w for w in weights):.6g}" in err.message


def test_sum_weights_within_tolerance_are_accepted():
    g = build(
        [
            inp("x", [8]),
            dense("d", "x", 8),
            {"id": "s", "op": "sum", "inputs": ["x", "d"], "weights": [0.6, 0.8 + 1e-8]},
            out("o", "s"),
        ]
    )
    assert g.nodes[2].attrs["weights"] == [0.6, 0.8 + 1e-8]


def test_concat_spatial_mismatch():
    err = graph_error(
        [
            inp("x", [3, 8, 8]),
            {"id": "c1", "op": "conv", "inputs": ["x"], "channels": 4, "stride": 2},
            {"id": "cat", "op": "concat", "inputs": ["x", "c1"]},
            out("o", "cat"),
        ]
    )
    assert err.code == "invalid_graph" and "[3, 8, 8]" in err.message and "[4, 4, 4]" in err.message


def test_concat_widths_add():
    g = build(
        [
            inp("x", [3, 8, 8]),
            {"id": "c1", "op": "conv", "inputs": ["x"], "channels": 5},
            {"id": "cat", "op": "concat", "inputs": ["x", "c1"]},
            out("o", "cat"),
        ]
    )
    assert g.nodes[-1].shape == (8, 8, 8)


# The contract's shape rules on the shared floor (sigprop.schemas.shapes, what the client checks an
# extracted graph with) must agree with build_graph's, shapes and messages alike.
SHAPE_RULE_CASES = {
    "duplicate-id": BASE[:2] + [act("d", "d"), out("o", "d")],
    "two-outputs": BASE + [out("o2", "d")],
    "zero-outputs": BASE[:3],
    "sum-one-input": [inp("x", [8]), {"id": "s", "op": "sum", "inputs": ["x"]}, out("o", "s")],
    "dense-two-inputs": [
        inp("x", [8]),
        dense("d1", "x", 8),
        {"id": "d", "op": "dense", "inputs": ["x", "d1"], "units": 4},
        out("o", "d"),
    ],
    "dense-on-map": [inp("x", [3, 8, 8]), dense("d", "x", 8), out("o", "d")],
    "conv-on-vector": [inp("x", [8]), {"id": "c", "op": "conv", "inputs": ["x"], "channels": 4}, out("o", "c")],
    "conv-to-nothing": [
        inp("x", [3, 2, 2]),
        {"id": "c", "op": "conv", "inputs": ["x"], "channels": 4, "kernel": 3, "padding": "valid"},
        out("o", "c"),
    ],
    "pool-on-vector": [inp("x", [8]), {"id": "p", "op": "max_pool", "inputs": ["x"]}, out("o", "p")],
    "pool-to-nothing": [
        inp("x", [3, 2, 2]),
        {"id": "p", "op": "avg_pool", "inputs": ["x"], "kernel": 3},
        out("o", "p"),
    ],
    "global-pool-on-vector": [inp("x", [8]), {"id": "g", "op": "global_avg_pool", "inputs": ["x"]}, out("o", "g")],
    "sum-shapes": [
        inp("x", [8]),
        dense("d", "x", 4),
        {"id": "s", "op": "sum", "inputs": ["x", "d"], "weights": [0.6, 0.8]},
        out("o", "s"),
    ],
    "sum-weights": [
        inp("x", [8]),
        dense("d", "x", 8),
        {"id": "s", "op": "sum", "inputs": ["x", "d"], "weights": [3.0, 4.0]},
        out("o", "s"),
    ],
    "sum-weight-count": [
        inp("x", [8]),
        dense("d", "x", 8),
        {"id": "s", "op": "sum", "inputs": ["x", "d"], "weights": [1.0]},
        out("o", "s"),
    ],
    "concat-maps": [
        inp("x", [3, 8, 8]),
        {"id": "c1", "op": "conv", "inputs": ["x"], "channels": 4, "stride": 2},
        {"id": "cat", "op": "concat", "inputs": ["x", "c1"]},
        out("o", "cat"),
    ],
    "valid-concat-pool-flatten": [
        inp("x", [3, 8, 8]),
        {"id": "c1", "op": "conv", "inputs": ["x"], "channels": 5, "kernel": [3, 1], "stride": [2, 1]},
        {"id": "p", "op": "max_pool", "inputs": ["x"], "kernel": [2, 1], "stride": [2, 1]},
        {"id": "cat", "op": "concat", "inputs": ["p", "c1"]},
        {"id": "f", "op": "flatten", "inputs": ["cat"]},
        {"id": "drop", "op": "dropout", "inputs": ["f"], "rate": 0.5},
        dense("d", "drop", 8),
        dense("dead", "x", 8, bias=False),
        out("o", "d"),
    ],
    "valid-padded-conv": [
        inp("x", [3, 8, 8]),
        {"id": "c", "op": "conv", "inputs": ["x"], "channels": 4, "stride": 2, "padding": 1},
        {"id": "g", "op": "global_avg_pool", "inputs": ["c"]},
        dense("d", "g", 8),
        out("o", "d"),
    ],
    "valid-unreachable-bad-shape": BASE[:3]
    + [dense("dead", "x", 8), {"id": "s", "op": "sum", "inputs": ["x", "dead"], "weights": [1.0, 1.0]}, out("o", "a")],
}


@pytest.mark.parametrize("name", list(SHAPE_RULE_CASES) + ["mlp", "resnet", "densenet", "cnn"])
def test_shared_shape_rules_agree_with_build_graph(name):
    from sigprop.engine.templates.expand import expand_template
    from sigprop.schemas import Template
    from sigprop.schemas.shapes import infer_shapes

    if name in SHAPE_RULE_CASES:
        graph = G(SHAPE_RULE_CASES[name])
    else:
        kw = {"resnet": {"depth": 18}, "densenet": {"depth": 121}}.get(name, {"depth": 3})
        graph = expand_template(Template(template=name, **kw))
    try:
        net = build_graph(graph, default_activation="relu")
    except SigpropError as exc:
        with pytest.raises(SigpropError) as info:
            infer_shapes(graph)
        assert (info.value.code, info.value.message, info.value.hint) == (exc.code, exc.message, exc.hint)
        return
    assert infer_shapes(graph) == {nd.user_id: nd.shape for nd in net.nodes}


def request(graph, **kw):
    base = {"graph": graph, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.5}}
    base.update(kw)
    return base


def parse_error(data) -> SigpropError:
    with pytest.raises(SigpropError) as info:
        parse_solve_request(data)
    err = info.value
    assert err.message and err.hint
    return err


def test_unknown_op_is_unsupported_op():
    nodes = [inp("x", [8]), {"id": "z", "op": "fourier", "inputs": ["x"]}, out("o", "z")]
    err = parse_error(request({"schema": SCHEMA, "nodes": nodes}))
    assert err.code == "unsupported_op"
    assert "fourier" in err.message and "dense" in err.hint


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_target_is_invalid_target(bad):
    err = parse_error(request({"schema": SCHEMA, "nodes": BASE}, targets={"eta": bad}))
    assert err.code == "invalid_target" and "targets.eta" in err.message


def test_unknown_target_key_is_invalid_target():
    err = parse_error(request({"schema": SCHEMA, "nodes": BASE}, targets={"eta": 0.5, "etta": 0.9}))
    assert err.code == "invalid_target" and "etta" in err.message


def test_graph_errors_surface_through_solve():
    bad = [inp("x", [8]), dense("d", "x", 8), act("a", "d"), out("o", "a"), out("o2", "d")]
    with pytest.raises(SigpropError) as info:
        solve(parse_solve_request(request({"schema": SCHEMA, "nodes": bad})))
    assert info.value.code == "invalid_graph" and info.value.status == 422


# ------------------------------------------------------------------ canonical key


def shuffled_renamed_mlp(depth, width=16, seed=0):
    ids = ["x"] + [f"{k}{i}" for i in range(depth) for k in ("fc", "a")] + ["head", "y"]
    rng = random.Random(seed)
    names = {k: f"n{rng.randrange(10**6)}_{j}" for j, k in enumerate(ids)}
    nodes = mlp_nodes(depth, width, names)
    rng.shuffle(nodes)
    return nodes, names


def solve_json(req) -> str:
    return solve(req).to_json()


def strip_layer_ids(answer_json: str) -> str:
    d = json.loads(answer_json)
    for layer in d["layers"]:
        layer["id"] = None
    return json.dumps(d)


@pytest.mark.parametrize(
    "req",
    [
        dict(method="tat", activation="leaky_relu", targets={"eta": 0.9}),
        dict(method="tat", activation="softplus", targets={"tau": 0.3}),
        dict(method="eoc", activation="tanh", targets={}),
    ],
    ids=["tat-lrelu", "tat-softplus", "eoc"],
)
def test_shuffled_renamed_mlp_same_key_and_answer(req):
    depth = 20
    plain = {"schema": SCHEMA, "nodes": mlp_nodes(depth)}
    nodes, names = shuffled_renamed_mlp(depth)
    other = {"schema": SCHEMA, "nodes": nodes}
    a = parse_solve_request({"graph": plain, **req})
    b = parse_solve_request({"graph": other, **req})
    assert prepare(a).key == prepare(b).key
    ja, jb = solve_json(a), solve_json(b)
    assert ja != jb  # the layer ids differ ...
    assert strip_layer_ids(ja) == strip_layer_ids(jb)  # ... and nothing else
    ids_a = [layer["id"] for layer in json.loads(ja)["layers"]]
    ids_b = [layer["id"] for layer in json.loads(jb)["layers"]]
    assert ids_b == [names[i] for i in ids_a] == [names[f"fc{i}"] for i in range(depth)] + [names["head"]]


def residual_nodes(w=0.6, units=16, bias=True, fn=None):
    extra = {"fn": fn} if fn else {}
    return [
        inp("x", [16]),
        dense("d0", "x", 16, bias=bias),
        act("a0", "d0", **extra),
        dense("d1", "a0", units),
        act("a1", "d1", **extra),
        dense("d2", "a1", 16),
        {"id": "s", "op": "sum", "inputs": ["d0", "d2"], "weights": [w, math.sqrt(1 - w * w)]},
        act("a2", "s", **extra),
        out("o", "a2"),
    ]


def key_of(nodes=None, **kw):
    nodes = nodes if nodes is not None else residual_nodes()
    return prepare(parse_solve_request(request({"schema": SCHEMA, "nodes": nodes}, **kw))).key


def test_key_changes_with_any_attribute():
    base = key_of()
    assert key_of() == base  # deterministic
    assert len(base) == 64 and int(base, 16) >= 0
    variants = [
        key_of(residual_nodes(units=17)),
        key_of(residual_nodes(w=0.8)),
        key_of(residual_nodes(bias=False)),
        key_of(targets={"eta": 0.55}),
        key_of(init="gaussian"),
        key_of(activation="tanh", targets={"tau": 0.3}),
        key_of(c_map_points=65),
        key_of(residual_nodes(fn="tanh")),
    ]
    assert base not in variants
    assert len(set(variants)) == len(variants)


def test_key_ignores_default_fn_spelled_out():
    assert key_of(residual_nodes(fn="leaky_relu")) == key_of()


def test_unreachable_node_is_dropped_with_a_warning():
    nodes = BASE[:3] + [dense("dead", "x", 5), act("dead_act", "dead"), out("o", "a")]
    g = build(nodes)
    assert g.n == 4 and [nd.user_id for nd in g.nodes] == ["x", "d", "a", "o"]
    assert len(g.warnings) == 1 and "dead" in g.warnings[0] and "dead_act" in g.warnings[0]
    assert g.canonical() == build(BASE).canonical()
    sol = solve(parse_solve_request(request({"schema": SCHEMA, "nodes": nodes}, targets={"eta": 0.2})))
    assert sol.warnings == g.warnings
    assert [layer.id for layer in sol.layers] == ["d"]


def test_an_identity_standing_for_an_unsupported_op_warns_in_every_answer_and_keeps_the_key():
    """An adapter's allow_unsupported identity carries what it stands for: every answer warns of it
    (live nodes only), the same key and numbers as the plain identity, a cached answer too."""
    import sigprop

    note = "BatchNorm1d module 'bn': a normalization layer"
    plain = [inp("x", [8]), dense("d", "x", 8), {"id": "bn", "op": "identity", "inputs": ["d"]}]
    plain += [act("a", "bn"), dense("d2", "a", 8), out("o", "d2")]
    noted = [dict(nd, unsupported=note) if nd["id"] == "bn" else nd for nd in plain]
    dead = {"id": "gone", "op": "identity", "inputs": ["x"], "unsupported": "not on the output's path"}
    graph = {"schema": SCHEMA, "nodes": noted + [dead]}
    assert key_of(noted) == key_of(plain)
    for _ in range(2):  # solved, then answered from the in-process cache (if any): warned both times
        sol = sigprop.solve(graph, "tat", "leaky_relu", {"eta": 0.2})
        warned = [w for w in sol.warnings if "'bn'" in w]
        assert len(warned) == 1 and note in warned[0] and "identity" in warned[0], sol.warnings
        assert not any("not on the output's path" in w for w in sol.warnings)  # a dead node: named as dropped
    bare = sigprop.solve({"schema": SCHEMA, "nodes": plain}, "tat", "leaky_relu", {"eta": 0.2})
    assert not any("identity in place" in w for w in bare.warnings)
    assert (sol.key, sol.layers) == (bare.key, bare.layers)


@pytest.mark.parametrize("note", ["", "two\nlines", "x" * 301])
def test_an_unsupported_note_is_one_short_line(note):
    nodes = [inp("x", [8]), {"id": "i", "op": "identity", "inputs": ["x"], "unsupported": note}, out("o", "i")]
    with pytest.raises(SigpropError) as info:
        parse_solve_request(request({"schema": SCHEMA, "nodes": nodes}))
    assert info.value.code in ("invalid_request", "invalid_graph") and "unsupported" in info.value.message


def test_only_an_identity_carries_an_unsupported_note():
    nodes = [inp("x", [8]), {"id": "f", "op": "flatten", "inputs": ["x"], "unsupported": "no"}, out("o", "f")]
    with pytest.raises(SigpropError):
        parse_solve_request(request({"schema": SCHEMA, "nodes": nodes}))


# ------------------------------------------------------------------ subnetworks: brute force


def brute_force_max(graph, x, r):
    """max over every single-entry single-exit region (s, t) of U_{g,r}(x), straight from the definitions."""
    n, nodes = graph.n, graph.nodes
    succ = graph.consumers()
    anc = [set() for _ in range(n)]
    for v in range(n):
        for p in nodes[v].inputs:
            anc[v] |= anc[p] | {p}
    desc = [set() for _ in range(n)]
    for v in reversed(range(n)):
        for c in succ[v]:
            desc[v] |= desc[c] | {c}
    sources = [v for v in range(n) if nodes[v].kind == SOURCE]

    def dominates(s, t):
        seen = set(v for v in sources if v != s)
        stack = list(seen)
        while stack:
            v = stack.pop()
            for c in succ[v]:
                if c != s and c not in seen:
                    seen.add(c)
                    stack.append(c)
        return t not in seen

    def value(region, s):
        val = {}
        if s is not None:
            val[s] = x
        for v in sorted(region):
            nd = nodes[v]
            if nd.kind == SOURCE:
                val[v] = x
            elif nd.kind == ACT:
                val[v] = r(val[nd.inputs[0]])
            elif nd.kind == SUM:
                val[v] = sum(w * w * val[i] for w, i in zip(nd.attrs["weights"], nd.inputs, strict=False))
            elif nd.kind == CONCAT:
                widths = [nodes[i].shape[0] for i in nd.inputs]
                val[v] = sum(wd * val[i] for wd, i in zip(widths, nd.inputs, strict=False)) / sum(widths)
            else:
                val[v] = val[nd.inputs[0]]
        return val

    best = -math.inf
    for t in range(n):
        if nodes[t].kind == SOURCE:
            continue
        for s in [None] + sorted(anc[t]):
            if s is None:
                region = anc[t] | {t}
            elif dominates(s, t):
                region = (desc[s] & anc[t]) | {t}
            else:
                continue
            if any(c not in region for v in region - {t} for c in succ[v]):
                continue
            best = max(best, value(region, s)[t])
    return best


def random_dag(seed, steps=18, width=6):
    rng = random.Random(seed)
    nodes = [inp("n0", [width])]
    widths = {"n0": width}
    for k in range(1, steps + 1):
        nid = f"n{k}"
        recent = [nd["id"] for nd in nodes[-5:]]
        op = rng.choice(["dense", "act", "act", "sum", "sum", "concat"])
        if op in ("sum", "concat"):
            first = rng.choice(recent)
            pool = [
                nd["id"] for nd in nodes if nd["id"] != first and (op == "concat" or widths[nd["id"]] == widths[first])
            ]
            if not pool:
                op = "act"
        if op == "dense":
            src = rng.choice(recent)
            nodes.append(dense(nid, src, width))
            widths[nid] = width
        elif op == "act":
            src = rng.choice(recent)
            nodes.append(act(nid, src))
            widths[nid] = widths[src]
        else:
            others = rng.sample(pool, min(len(pool), rng.choice([1, 1, 2])))
            srcs = [first] + others
            rng.shuffle(srcs)
            if op == "sum":
                raw = [rng.uniform(0.2, 1.0) for _ in srcs]
                norm = math.sqrt(sum(v * v for v in raw))
                nodes.append({"id": nid, "op": "sum", "inputs": srcs, "weights": [v / norm for v in raw]})
                widths[nid] = widths[first]
            else:
                nodes.append({"id": nid, "op": "concat", "inputs": srcs})
                widths[nid] = sum(widths[s] for s in srcs)
    nodes.append(out("out", nodes[-1]["id"]))
    return nodes


LOCAL_MAPS = [
    ("curvature", 0.0, lambda y: 1.0 + y),
    ("trelu", 0.0, lambda c: leaky_relu_c_map_scalar(c, 0.3)),
    ("relu", 0.2, lambda c: leaky_relu_c_map_scalar(c, 0.0)),
    ("slope", 1.0, lambda y: 1.3 * y),
]


@pytest.mark.parametrize("seed", range(40))
def test_maximize_equals_brute_force_on_random_dags(seed):
    g = build(random_dag(seed))
    prog = compile_subnetworks(g)
    for _, x, r in LOCAL_MAPS:
        want = brute_force_max(g, x, r)
        got = float(prog.maximize(x, lambda y, _s, r=r: r(y)))
        assert got == pytest.approx(want, rel=1e-12, abs=1e-14)


# ------------------------------------------------------------------ subnetworks: closed forms


def paper_resnet(blocks, w, transition=(), final_act=False, branch=3, width=8):
    """Rescaled ResNet of TAT eq 6: dense stem, blocks of `branch` (act, dense) layers with an identity
    shortcut, or (act, dense) in the shortcut of the `transition` blocks."""
    nodes = [inp("x", [width]), dense("stem", "x", width)]
    prev = "stem"
    for b in range(blocks):
        h = prev
        for i in range(branch):
            nodes += [act(f"b{b}.a{i}", h), dense(f"b{b}.d{i}", f"b{b}.a{i}", width)]
            h = f"b{b}.d{i}"
        sc = prev
        if b in transition:
            nodes += [act(f"b{b}.sa", prev), dense(f"b{b}.sd", f"b{b}.sa", width)]
            sc = f"b{b}.sd"
        nodes.append({"id": f"b{b}.sum", "op": "sum", "inputs": [sc, h], "weights": [w, math.sqrt(1 - w * w)]})
        prev = f"b{b}.sum"
    if final_act:
        nodes.append(act("final", prev))
        prev = "final"
    nodes.append(out("out", prev))
    return nodes


def curvature(prog):
    return float(prog.maximize(0.0, lambda y, _s: 1.0 + y))


@pytest.mark.parametrize("blocks,w", [(4, 0.8), (4, 0.9), (6, 0.5), (2, 0.3), (1, 0.6), (10, 0.95)])
def test_rescaled_resnet_curvature_is_b5_closed_form(blocks, w):
    """mu_f^2(C''(1)) / C''(1) = max{L (1 - w^2), 3} (TAT Appendix B.5), L = 3 * blocks."""
    prog = compile_subnetworks(build(paper_resnet(blocks, w)))
    L = 3 * blocks
    assert curvature(prog) == pytest.approx(max(L * (1 - w * w), 3.0), rel=1e-13)
    assert float(prog.global_map(0.0, lambda y, _s: 1.0 + y)) == pytest.approx(L * (1 - w * w), rel=1e-13)


@pytest.mark.parametrize("blocks,w", [(8, 0.8), (16, 0.5), (5, 0.95)])
def test_rescaled_resnet_with_transition_blocks_b5(blocks, w):
    """Four transition blocks with a nonlinear layer in the shortcut and a final nonlinear layer:
    U_f = [(L - 6)(1 - w^2) + 5] C''(1) with L = 3 * blocks + 2 (B.5), maximized with the branch's 3."""
    prog = compile_subnetworks(build(paper_resnet(blocks, w, transition=(0, 1, 2, 3), final_act=True)))
    L = 3 * blocks + 2
    uf = (L - 6) * (1 - w * w) + 5
    assert float(prog.global_map(0.0, lambda y, _s: 1.0 + y)) == pytest.approx(uf, rel=1e-13)
    assert curvature(prog) == pytest.approx(max(uf, 3.0), rel=1e-13)


@pytest.mark.parametrize("a,w", [(0.0, 0.8), (0.2, 0.95), (0.0, 0.3)])
def test_rescaled_resnet_c_map_is_eq7(a, w):
    """C map at 0 through the blocks: c <- w^2 c + (1 - w^2) C_R(c) (TAT eq 7), maximized with C_R(0)."""
    blocks = 5
    prog = compile_subnetworks(build(paper_resnet(blocks, w)))
    C = lambda c: leaky_relu_c_map_scalar(c, a)  # noqa: E731
    CR = lambda c: C(C(C(c)))  # noqa: E731
    c = 0.0
    for _ in range(blocks):
        c = w * w * c + (1 - w * w) * CR(c)
    r = lambda y, _s: leaky_relu_c_map_scalar(y, a)  # noqa: E731
    assert float(prog.global_map(0.0, r)) == pytest.approx(c, rel=1e-13)
    assert float(prog.maximize(0.0, r)) == pytest.approx(max(c, CR(0.0)), rel=1e-13)


def densenet_block(layers, k0, growth, image=False, final_act=True):
    if image:
        nodes = [inp("x", [3, 6, 6]), {"id": "x0", "op": "conv", "inputs": ["x"], "channels": k0}]
    else:
        nodes = [inp("x", [k0]), dense("x0", "x", k0)]
    feats, cur = ["x0"], "x0"
    for i in range(1, layers + 1):
        nodes.append(act(f"l{i}.a", cur))
        if image:
            nodes.append({"id": f"l{i}.c", "op": "conv", "inputs": [f"l{i}.a"], "channels": growth})
        else:
            nodes.append(dense(f"l{i}.c", f"l{i}.a", growth))
        feats.append(f"l{i}.c")
        nodes.append({"id": f"cat{i}", "op": "concat", "inputs": list(feats)})
        cur = f"cat{i}"
    if final_act:
        nodes.append(act("final", cur))
        cur = "final"
    nodes.append(out("out", cur))
    return nodes


def densenet_expected(layers, k0, growth, r, x):
    ys, cat = [], x
    for i in range(1, layers + 1):
        ys.append(r(cat))
        cat = (k0 * x + growth * sum(ys)) / (k0 + i * growth)
    return cat


@pytest.mark.parametrize("image", [False, True])
@pytest.mark.parametrize("layers,k0,growth", [(3, 16, 4), (5, 8, 8), (4, 64, 1)])
def test_densenet_concat_is_width_weighted(image, layers, k0, growth):
    for x, r in [
        (0.0, lambda y: 1.0 + y),
        (0.0, lambda c: leaky_relu_c_map_scalar(c, 0.1)),
        (0.4, lambda c: leaky_relu_c_map_scalar(c, 0.0)),
    ]:
        prog = compile_subnetworks(build(densenet_block(layers, k0, growth, image, final_act=False)))
        cat = densenet_expected(layers, k0, growth, r, x)
        assert float(prog.global_map(x, lambda y, _s: r(y))) == pytest.approx(cat, rel=1e-13)
        # a single dense layer is its own subnetwork (it composes with nothing larger)
        assert float(prog.maximize(x, lambda y, _s: r(y))) == pytest.approx(max(cat, r(x)), rel=1e-13)
        prog2 = compile_subnetworks(build(densenet_block(layers, k0, growth, image, final_act=True)))
        assert float(prog2.global_map(x, lambda y, _s: r(y))) == pytest.approx(r(cat), rel=1e-13)


def test_densenet_equal_weighting_would_differ():
    """Guard that the width weighting matters for the numbers above: 16 + 4 channels, not 1:1."""
    prog = compile_subnetworks(build(densenet_block(1, 16, 4, final_act=False)))
    assert float(prog.global_map(0.0, lambda y, _s: 1.0 + y)) == pytest.approx(4 / 20, rel=1e-14)


@pytest.mark.parametrize("depth", [1, 2, 7, 30])
def test_mlp_maximize_equals_global_map(depth):
    prog = compile_subnetworks(build(mlp_nodes(depth)))
    for _, x, r in LOCAL_MAPS:
        f = lambda y, _s, r=r: r(y)  # noqa: E731
        assert float(prog.maximize(x, f)) == float(prog.global_map(x, f))
    assert float(prog.global_map(0.0, lambda y, _s: 1.0 + y)) == depth
    c = 0.0
    for _ in range(depth):
        c = leaky_relu_c_map_scalar(c, 0.3)
    assert float(prog.global_map(0.0, lambda y, _s: leaky_relu_c_map_scalar(y, 0.3))) == pytest.approx(c, rel=1e-14)


def test_maximize_is_vectorized():
    prog = compile_subnetworks(build(paper_resnet(3, 0.7)))
    xs = np.array([0.0, 0.3, 0.9])
    f = lambda y, _s: np.asarray(y) * 0.5 + 0.5  # noqa: E731
    got = prog.maximize(xs, f)
    want = [float(prog.maximize(float(v), f)) for v in xs]
    assert np.allclose(got, want, rtol=0, atol=1e-15)
