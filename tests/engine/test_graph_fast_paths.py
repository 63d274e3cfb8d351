"""The graph pipeline's fast paths against the definitions they replace: the structural hash that
orders sum inputs, the canonical JSON the cache key hashes, the request key, and the template
nodes a solve request expands to. Any difference would change canonical graphs or cache keys."""

from __future__ import annotations

import hashlib
import json
import math
import random

import pytest

from sigprop import ENGINE_VERSION
from sigprop.engine.graph import build as G
from sigprop.engine.solve import prepare, request_key
from sigprop.engine.templates.expand import expand_template, expand_template_nodes
from sigprop.errors import SigpropError
from sigprop.requests import parse_solve_request
from sigprop.schemas import Graph, Template
from sigprop.schemas import ops as K

from .test_templates import ALL_TEMPLATES


def reference_sum_order(topo, default_activation) -> dict:
    """The structural hash as first written: model_dump and json.dumps per node."""
    digest, ordered = {}, {}
    for nd in topo:
        # an identity's "unsupported" note (added later) is no structure: never hashed
        attrs = nd.model_dump(exclude={"id", "inputs", "weights", "unsupported"})
        if nd.op == "input" and not attrs["sequence"]:  # added later: written only when true
            del attrs["sequence"]
        if nd.op == "activation":
            attrs["fn"] = nd.fn or default_activation
        ins, weights = list(nd.inputs), None
        if nd.op == "sum":
            n = len(ins)
            w = list(nd.weights) if nd.weights is not None and len(nd.weights) == n else [1.0 / math.sqrt(n)] * n
            pairs = sorted(zip(ins, w, strict=False), key=lambda p: (digest[p[0]], p[1]))
            ins, weights = [p[0] for p in pairs], [p[1] for p in pairs]
            if nd.weights is not None and len(nd.weights) != n:
                weights = list(nd.weights)
            ordered[nd.id] = (ins, weights)
        key = json.dumps([attrs, [digest[i] for i in ins], weights], sort_keys=True, default=str)
        digest[nd.id] = hashlib.sha256(key.encode()).hexdigest()
    return ordered


def reference_key(graph: G.NetworkGraph, request) -> str:
    payload = {
        "engine": ENGINE_VERSION,
        "graph": graph.canonical(),
        "method": request.method,
        "activation": request.activation,
        "targets": {k: float(v) for k, v in request.targets.model_dump(exclude_none=True).items()},
        "init": request.init,
        "c_map_points": request.c_map_points,
    }
    if request.trainable is not None:
        payload["trainable"] = request.trainable.model_dump()
    if request.assumptions != "strict":
        payload["assumptions"] = request.assumptions
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def random_nodes(rng: random.Random) -> list[dict]:
    """A valid graph of every op, with every attribute spelled in its odd ways (lists, ints for
    floats, -0.0, explicit defaults), sums over like and unlike branches."""
    c = rng.choice([2, 3])
    nodes = [{"id": "x", "op": "input", "shape": [c, 6, 6]}, {"id": "y", "op": "input", "shape": [c, 6, 6]}]
    maps = ["x", "y"]
    for i in range(rng.randint(2, 14)):
        p = f"n{i}"
        src = rng.choice(maps[-4:])
        kind = rng.random()
        if kind < 0.3:
            conv = {"id": p, "op": "conv", "inputs": [src], "channels": c}
            conv.update(rng.choice([{}, {"kernel": [1, 3]}, {"kernel": 1, "stride": 1, "padding": 0}, {"bias": False}]))
            nodes.append(conv)
        elif kind < 0.5:
            nodes.append({"id": p, "op": "activation", "inputs": [src], **rng.choice([{}, {"fn": "tanh"}])})
        elif kind < 0.6:
            nodes.append({"id": p, "op": "dropout", "inputs": [src], **rng.choice([{}, {"rate": -0.0}, {"rate": 0}])})
        elif kind < 0.7:
            nodes.append({"id": p, "op": "identity", "inputs": [src]})
        else:
            k = rng.choice([2, 2, 3])
            ins = [rng.choice(maps[-5:]) for _ in range(k)]
            weights = rng.choice([None, [k**-0.5] * k, [1, 0] + [0] * (k - 2), [0.6, -0.8] + [0.0] * (k - 2)])
            nodes.append({"id": p, "op": "sum", "inputs": ins, **({"weights": weights} if weights else {})})
        maps.append(p)
    nodes += [
        {"id": "pool", "op": rng.choice(["avg_pool", "max_pool"]), "inputs": [maps[-1]], "kernel": 2, "padding": 1},
        {"id": "gap", "op": "global_avg_pool", "inputs": ["pool"]},
        {"id": "head", "op": "dense", "inputs": ["gap"], "units": 3, "bias": rng.choice([True, False])},
        {"id": "out", "op": "output", "inputs": ["head"]},
    ]
    if rng.random() < 0.5:
        nodes.append({"id": "cat", "op": "concat", "inputs": ["x", "y"]})  # dead
    return nodes


@pytest.mark.parametrize("seed", range(40))
def test_structural_hash_orders_sums_as_defined(seed):
    rng = random.Random(seed)
    graph = Graph.model_validate({"nodes": random_nodes(rng)})
    for default in ("leaky_relu", None):
        assert G._canonical_sum_order(graph.nodes, default) == reference_sum_order(graph.nodes, default)


@pytest.mark.parametrize("seed", range(40))
def test_canonical_json_and_key_as_defined(seed):
    rng = random.Random(seed)
    nodes = random_nodes(rng)
    body = {"method": "tat", "activation": "softplus", "targets": {"tau": 0.3}, "assumptions": "warn"}
    req = parse_solve_request({"graph": {"nodes": nodes}, **body})
    prep = prepare(req)
    text = json.dumps(prep.graph.canonical(), sort_keys=True, separators=(",", ":"))
    assert prep.graph.canonical_json() == text
    assert prep.key == request_key(prep.graph, req) == reference_key(prep.graph, req)
    rng.shuffle(nodes)  # Kahn's order instead of the listing's
    assert prepare(parse_solve_request({"graph": {"nodes": nodes}, **body})).key == prep.key


@pytest.mark.parametrize(
    "value",
    ["relu", "a\"b", "back\\slash", "tab\t", "\x7f", "é", "", 0, -3, 2**70, True, False, None, 0.5, -0.0, 1e300,
     float("nan"), float("inf"), [1, [2, "x"]], (1.5, None), {"b": 1, "a": [0.1]}],
)  # fmt: skip
def test_json_matches_json_dumps(value):
    assert G._json(value) == json.dumps(value, sort_keys=True, default=str)


def test_rows_match_json_dumps_for_unusual_attributes():
    odd = [
        G.Node(0, "x", "input", K.SOURCE, (), {"shape": [3]}, (3,)),
        G.Node(1, "d", "dense", K.AFFINE, (0,), {"units": True, "bias": 1}, (1,)),
        G.Node(2, "a", "activation", K.ACT, (1,), {"fn": "not an activation"}, (1,)),
        G.Node(3, "s", "sum", K.SUM, (1, 2), {"weights": [1, -0.0]}, (1,)),
        G.Node(4, "s", "sum", K.SUM, (1, 2), {"weights": [0.6, float("nan")]}, (1,)),
        G.Node(5, "o", "output", K.PASS, (4,), {"op": "shadowed"}, (1,)),
    ]
    for nd in odd:
        assert G._row_json(nd) == json.dumps(
            {"op": nd.op, "inputs": list(nd.inputs), **nd.attrs}, sort_keys=True, separators=(",", ":")
        )


def test_node_model_fields_are_what_model_dump_writes():
    # _attrs_text names a node's attributes from model_fields instead of dumping every node
    graph = Graph.model_validate({"nodes": random_nodes(random.Random(0)) + random_nodes(random.Random(1))})
    for nd in graph.nodes:
        assert sorted(type(nd).model_fields) == sorted(nd.model_dump())


@pytest.mark.parametrize("kw", ALL_TEMPLATES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_template_nodes_build_the_expanded_graph(kw):
    t = Template(**kw)
    full = expand_template(t)
    fast = expand_template_nodes(t).nodes
    assert len(fast) == len(full.nodes)
    for a, b in zip(fast, full.nodes, strict=True):
        assert type(a).__name__ == type(b).__name__ and type(a).model_fields == type(b).model_fields
        assert a.__dict__ == b.__dict__
    x, y = G.build_graph(expand_template_nodes(t), "relu"), G.build_graph(full, "relu")
    assert x.nodes == y.nodes and x.warnings == y.warnings
    # the sequential flag (build_graph's shortcut) is set exactly for graphs of one path
    reads_previous = all(b.inputs == [a.id] for a, b in zip(full.nodes, full.nodes[1:], strict=False))
    assert expand_template_nodes(t).sequential == reads_previous
    assert reads_previous or kw["template"] not in ("mlp", "cnn")  # (a ResNet without shortcuts is one too)
    with pytest.raises(SigpropError) as fast_error:  # templates leave fn to the request
        G.build_graph(expand_template_nodes(t), None)
    with pytest.raises(SigpropError) as full_error:
        G.build_graph(full, None)
    assert fast_error.value.to_dict() == full_error.value.to_dict()


def test_template_nodes_errors_are_expand_template_errors():
    for kw in ({"template": "densenet", "growth_rate": 999_999}, {"template": "mlp", "depth": 2, "width": 7}):
        t = Template(**kw)
        try:
            expected = expand_template(t)
        except SigpropError as err:
            with pytest.raises(SigpropError) as info:
                expand_template_nodes(t)
            assert info.value.to_dict() == err.to_dict()
        else:
            assert [n.__dict__ for n in expand_template_nodes(t).nodes] == [n.__dict__ for n in expected.nodes]


def test_structural_hash_of_a_sequence_graph_as_defined():
    nodes = [{"id": "x", "op": "input", "shape": [4, 8], "sequence": True}]
    for i, src in enumerate(["x", "d0", "s1"]):
        nodes += [{"id": f"d{i}", "op": "dense", "inputs": [src], "units": 8},
                  {"id": f"s{i + 1}", "op": "sum", "inputs": [src, f"d{i}"]}]  # fmt: skip
    nodes.append({"id": "out", "op": "output", "inputs": ["s3"]})
    graph = Graph.model_validate({"nodes": nodes})
    assert G._canonical_sum_order(graph.nodes, None) == reference_sum_order(graph.nodes, None)
