"""Template expansion (sigprop.engine.templates.expand): structure, exact counts, errors, and the ResNet
cross-check against DeepMind's dks reference (examples/haiku/modified_resnet.py)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from sigprop.engine.templates.expand import RESNET_CONFIGS, TEMPLATE_NAMES, describe_templates, expand_template
from sigprop.errors import SigpropError
from sigprop.schemas import Graph, Template

from ..dks_reference import load_modified_resnet


def expand(**kw) -> Graph:
    return expand_template(Template(**kw))


def ops(g: Graph) -> Counter:
    return Counter(n.op for n in g.nodes)


def by_id(g: Graph) -> dict:
    return {n.id: n for n in g.nodes}


def max_path_activations(g: Graph) -> int:
    """Most activation nodes on any input -> output path (nodes are in topological order)."""
    best: dict[str, int] = {}
    for n in g.nodes:
        here = max((best[s] for s in n.inputs), default=0)
        best[n.id] = here + (n.op == "activation")
    return best[g.nodes[-1].id]


def projection_convs(g: Graph) -> list:
    """Convs feeding a sum's shortcut slot (inputs[0])."""
    nodes = by_id(g)
    return [nodes[n.inputs[0]] for n in g.nodes if n.op == "sum" and nodes[n.inputs[0]].op == "conv"]


def check_well_formed(g: Graph) -> None:
    ids = [n.id for n in g.nodes]
    assert len(ids) == len(set(ids)), "node ids must be unique"
    seen: set[str] = set()
    for n in g.nodes:
        for src in n.inputs:
            assert src in seen, f"{n.id} reads {src} before it is defined"
        seen.add(n.id)
    assert [n.op for n in g.nodes].count("output") == 1
    assert [n.op for n in g.nodes].count("input") == 1
    assert g.nodes[-1].op == "output" and g.nodes[0].op == "input"
    for n in g.nodes:
        if n.op == "activation":
            assert n.fn is None  # takes the request's activation
        if n.op == "sum":
            assert n.weights is not None and len(n.weights) == len(n.inputs)
            assert sum(w * w for w in n.weights) == pytest.approx(1.0, abs=1e-12)
    # the wire form round-trips through the schema
    wire = json.loads(g.model_dump_json(by_alias=True, exclude_none=True))
    assert wire["schema"] == "sigprop.graph/v1"
    assert Graph.model_validate(wire) == g


ALL_TEMPLATES = (
    [
        dict(template="mlp", depth=4),
        dict(template="mlp", depth=2, width=8, input_shape=[1, 28, 28], classes=3, bias=False),
        dict(template="cnn", depth=5),
        dict(template="densenet"),
        dict(template="densenet", depth=40, growth_rate=12),
    ]
    + [
        dict(template="resnet", depth=d, version=v, shortcut_weight=w)
        for d in (18, 50)
        for v in (1, 2)
        for w in (0.0, 0.5, 1.0)
    ]
    + [
        dict(template="transformer", depth=2, seq_len=8, width=16, heads=2),
        dict(
            template="transformer",
            depth=3,
            seq_len=5,
            width=12,
            heads=3,
            mlp_ratio=2,
            causal=False,
            shortcuts=True,
            norms=True,
            shortcut_weight=0.9,
        ),  # fmt: skip
    ]
)


@pytest.mark.parametrize("kw", ALL_TEMPLATES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_well_formed_and_deterministic(kw):
    g = expand(**kw)
    assert isinstance(g, Graph)
    check_well_formed(g)
    assert expand(**kw).model_dump() == g.model_dump()


# ---------------------------------------------------------------- mlp, cnn


def test_mlp_counts_and_defaults():
    g = expand(template="mlp", depth=7)
    c = ops(g)
    assert c["activation"] == 7 and c["dense"] == 8
    assert dict(c) == {"input": 1, "dense": 8, "activation": 7, "output": 1}
    assert max_path_activations(g) == 7
    nodes = g.nodes
    assert nodes[0].shape == [512]
    assert [n.units for n in nodes if n.op == "dense"] == [512] * 7 + [10]
    assert all(n.bias for n in nodes if n.op == "dense")


def test_mlp_image_input_is_flattened():
    g = expand(template="mlp", depth=2, width=16, input_shape=[1, 28, 28], classes=3, bias=False)
    assert [n.op for n in g.nodes] == [
        "input",
        "flatten",
        "dense",
        "activation",
        "dense",
        "activation",
        "dense",
        "output",
    ]
    assert [n.units for n in g.nodes if n.op == "dense"] == [16, 16, 3]
    assert not any(n.bias for n in g.nodes if n.op == "dense")


def test_mlp_input_shape_default_follows_width():
    assert expand(template="mlp", depth=1, width=33).nodes[0].shape == [33]


def test_cnn_counts():
    g = expand(template="cnn", depth=6, width=32)
    assert dict(ops(g)) == {"input": 1, "conv": 6, "activation": 6, "global_avg_pool": 1, "dense": 1, "output": 1}
    assert g.nodes[0].shape == [3, 32, 32]
    for n in g.nodes:
        if n.op == "conv":
            assert (n.channels, n.kernel, n.stride, n.padding) == (32, 3, 1, "same")
    assert g.nodes[-2].op == "dense" and g.nodes[-2].units == 10


# ---------------------------------------------------------------- resnet


def test_resnet50_v2_counts():
    g = expand(template="resnet", depth=50, version=2, shortcut_weight=0.5)
    c = ops(g)
    assert c["sum"] == 16  # 3 + 4 + 6 + 3 blocks
    assert len(projection_convs(g)) == 4  # first block of each group
    # v2 bottleneck: one activation before each of the 3 convs of the 16 blocks, plus the final
    # activation (none after the initial conv in v2): 3 * 16 + 1 = 49, all on the residual path.
    assert c["activation"] == 49
    assert max_path_activations(g) == 49
    assert c["conv"] == 1 + 3 * 16 + 4
    assert c["max_pool"] == 1 and c["global_avg_pool"] == 1 and c["dense"] == 1
    for s in (n for n in g.nodes if n.op == "sum"):
        assert s.weights == [0.5, math.sqrt(0.75)]
    nodes = by_id(g)
    # the projection reads the block's first activation (pre-activation shortcut)
    for p in projection_convs(g):
        assert nodes[p.inputs[0]].op == "activation"
        assert p.kernel == 1
    assert [p.stride for p in projection_convs(g)] == [1, 2, 2, 2]
    assert [p.channels for p in projection_convs(g)] == [256, 512, 1024, 2048]
    first = g.nodes[1]
    assert (first.op, first.channels, first.kernel, first.stride) == ("conv", 64, 7, 2)
    assert g.nodes[2].op == "max_pool" and (g.nodes[2].kernel, g.nodes[2].stride) == (3, 2)
    assert [n.op for n in g.nodes[-4:]] == ["activation", "global_avg_pool", "dense", "output"]
    assert g.nodes[-2].units == 1000 and g.nodes[0].shape == [3, 224, 224]


def test_resnet_v2_bottleneck_block_layout():
    g = expand(template="resnet", depth=50, version=2, shortcut_weight=0.5)
    convs = [
        (n.channels, n.kernel, n.stride)
        for n in g.nodes
        if n.op == "conv" and n.id.startswith("block_group_1.block_0.")
    ]
    # shortcut conv, then conv1x1(ch/4) -> conv3x3(ch/4, stride) -> conv1x1(ch)
    assert convs == [(512, 1, 2), (128, 1, 1), (128, 3, 2), (512, 1, 1)]


@pytest.mark.parametrize(
    "depth,acts,sums,projs",
    [
        (18, 17, 8, 3),
        (34, 33, 16, 3),
        (50, 49, 16, 4),
        (101, 100, 33, 4),
        (152, 151, 50, 4),
        (200, 199, 66, 4),
    ],
)
def test_resnet_v2_counts_all_depths(depth, acts, sums, projs):
    g = expand(template="resnet", depth=depth, shortcut_weight=0.3)
    assert ops(g)["activation"] == acts
    assert max_path_activations(g) == acts
    assert ops(g)["sum"] == sums
    assert len(projection_convs(g)) == projs


def test_resnet_has_equal_shortcuts_by_default():
    """A ResNet without shortcuts surprises: the default is sqrt(1/2), equal branches, the
    same graph (and so the same cache key) as that weight written out."""
    from sigprop.engine.solve import prepare
    from sigprop.requests import parse_solve_request

    g = expand(template="resnet", depth=50)
    assert ops(g)["sum"] == 16 and len(projection_convs(g)) == 4
    for s in (n for n in g.nodes if n.op == "sum"):
        assert s.weights == pytest.approx([math.sqrt(0.5), math.sqrt(0.5)])
    assert g == expand(template="resnet", depth=50, shortcut_weight=math.sqrt(0.5))

    def key(graph: dict) -> str:
        body = {"graph": graph, "method": "tat", "activation": "softplus", "targets": {"tau": 0.3}}
        return prepare(parse_solve_request(body)).key

    default = key({"template": "resnet", "depth": 18, "input_shape": [3, 32, 32]})
    explicit = key({"template": "resnet", "depth": 18, "input_shape": [3, 32, 32], "shortcut_weight": math.sqrt(0.5)})
    plain = key({"template": "resnet", "depth": 18, "input_shape": [3, 32, 32], "shortcut_weight": 0})
    assert default == explicit != plain


@pytest.mark.parametrize("version", [1, 2])
def test_resnet_w0_has_no_shortcuts(version):
    # shortcut_weight 0 (the reference's default, no longer the template's): a plain network
    g = expand(template="resnet", depth=50, version=version, shortcut_weight=0.0)
    c = ops(g)
    assert c["sum"] == 0
    assert c["conv"] == 1 + 3 * 16  # no projection convs either
    # a plain chain: every node feeds the next one
    for prev, n in zip(g.nodes, g.nodes[1:], strict=False):
        assert n.inputs == [prev.id]
    # v1: initial activation + (2 inside + 1 closing) per block = 49; v2: 3 per block + final = 49
    assert c["activation"] == 49


def test_resnet50_v1_structure():
    g = expand(template="resnet", depth=50, version=1, shortcut_weight=0.5)
    c = ops(g)
    assert c["sum"] == 16 and len(projection_convs(g)) == 4
    # initial activation + per block 2 between the convs + 1 after the sum: 1 + 3 * 16 = 49
    assert c["activation"] == 49 and max_path_activations(g) == 49
    nodes = by_id(g)
    assert [n.op for n in g.nodes[:4]] == ["input", "conv", "activation", "max_pool"]
    for s in (n for n in g.nodes if n.op == "sum"):
        # every v1 sum is followed by an activation, and its residual input is a conv
        assert nodes[s.inputs[1]].op == "conv"
    for p in projection_convs(g):
        # v1 projects the block input itself: the same node the block's first conv reads
        assert p.inputs == nodes[p.id.replace("shortcut_conv", "conv_0")].inputs
        assert nodes[p.inputs[0]].op in ("max_pool", "activation")
    # no final activation: the last block's closing activation feeds the pooling
    assert [n.op for n in g.nodes[-5:]] == ["sum", "activation", "global_avg_pool", "dense", "output"]


def test_resnet18_v1_counts():
    g = expand(template="resnet", depth=18, version=1, shortcut_weight=0.5)
    # initial + 8 blocks x (1 between the convs + 1 after the sum) = 17
    assert ops(g)["activation"] == 17 and ops(g)["sum"] == 8 and len(projection_convs(g)) == 3


def test_resnet_shortcut_weight_one():
    g = expand(template="resnet", depth=18, shortcut_weight=1.0)
    assert all(n.weights == [1.0, 0.0] for n in g.nodes if n.op == "sum")


# ---------------------------------------------------------------- cross-check with dks


def _load_reference():
    ref = load_modified_resnet()
    if ref is None:
        pytest.skip("dks reference (examples/haiku/modified_resnet.py) not installed")
    return ref


def relu_cmap(c: float) -> float:
    c = min(1.0, max(-1.0, c))
    return (math.sqrt(1.0 - c * c) + (math.pi - math.acos(c)) * c) / math.pi


def graph_cmap(g: Graph, c0: float, r) -> float:
    """The network's C map at c0 (q = 1 throughout): r at activations, weighted sums mix with
    squared weights, every other op is the identity."""
    val: dict[str, float] = {}
    for n in g.nodes:
        if n.op == "input":
            val[n.id] = c0
        elif n.op == "activation":
            val[n.id] = r(val[n.inputs[0]])
        elif n.op == "sum":
            val[n.id] = sum(w * w * val[s] for w, s in zip(n.weights, n.inputs, strict=False))
        else:
            assert len(n.inputs) == 1
            val[n.id] = val[n.inputs[0]]
    return val[g.nodes[-1].id]


def test_resnet_configs_match_reference():
    configs, _ = _load_reference()
    assert {
        d: {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in c.items()} for d, c in configs.items()
    } == RESNET_CONFIGS


@pytest.mark.parametrize("depth", sorted(RESNET_CONFIGS))
@pytest.mark.parametrize("w", [0.0, 0.3, 0.8])
def test_resnet_v2_cmap_matches_reference(depth, w):
    _, subnet_max_func = _load_reference()
    g = expand(template="resnet", depth=depth, version=2, shortcut_weight=w)
    k = 3 if RESNET_CONFIGS[depth]["bottleneck"] else 2
    for c0 in (-0.5, 0.0, 0.7):
        full = graph_cmap(g, c0, relu_cmap)
        res_branch = c0
        for _ in range(k):
            res_branch = relu_cmap(res_branch)
        ref = subnet_max_func(c0, relu_cmap, depth, w, resnet_v2=True)
        assert full > res_branch  # so the reference's max() is the whole network's C map
        assert full == pytest.approx(ref, abs=1e-12)


@pytest.mark.parametrize("depth", [18, 50, 152])
def test_resnet_v1_w0_cmap_matches_reference(depth):
    # With w = 0 the v1 network is a chain, so the reference's order of activations is immaterial.
    _, subnet_max_func = _load_reference()
    g = expand(template="resnet", depth=depth, version=1, shortcut_weight=0.0)
    for c0 in (-0.5, 0.0, 0.7):
        assert graph_cmap(g, c0, relu_cmap) == pytest.approx(
            subnet_max_func(c0, relu_cmap, depth, 0.0, resnet_v2=False), abs=1e-12
        )


# ---------------------------------------------------------------- densenet


def test_densenet121_counts():
    g = expand(template="densenet")
    c = ops(g)
    assert c["concat"] == 58  # 6 + 12 + 24 + 16 dense layers
    # 2 per dense layer (58) + 1 per transition (3) + final 1 = 120: the stem has no activation
    # (it would feed post-activation features to the first block's concatenations)
    assert c["activation"] == 120 and max_path_activations(g) == 120
    # stem conv + 2 per dense layer + 1 per transition = 120 convs, + 1 dense = 121 weighted layers
    assert c["conv"] == 120 and c["dense"] == 1
    assert c["avg_pool"] == 3 and c["max_pool"] == 1 and c["global_avg_pool"] == 1
    nodes = by_id(g)
    assert (nodes["conv0"].channels, nodes["conv0"].kernel, nodes["conv0"].stride) == (64, 7, 2)
    assert (nodes["pool0"].kernel, nodes["pool0"].stride) == (3, 2)
    # compression 0.5 in the transitions: 256 -> 128, 512 -> 256, 1024 -> 512; 1024 at the end
    assert [nodes[f"transition{i}.conv"].channels for i in (1, 2, 3)] == [128, 256, 512]
    assert all((nodes[f"transition{i}.pool"].kernel, nodes[f"transition{i}.pool"].stride) == (2, 2) for i in (1, 2, 3))
    assert nodes["logits"].units == 1000 and g.nodes[0].shape == [3, 224, 224]


def test_densenet_concat_inputs_in_creation_order():
    g = expand(template="densenet")
    nodes = by_id(g)
    last = nodes["denseblock1.concat6"]
    assert last.inputs == ["pool0"] + [f"denseblock1.denselayer{i}.conv2" for i in range(1, 7)]
    assert nodes["denseblock2.concat1"].inputs == ["transition1.pool", "denseblock2.denselayer1.conv2"]
    layer = [n for n in g.nodes if n.id.startswith("denseblock2.denselayer3.")]
    assert [(n.op, getattr(n, "channels", None), getattr(n, "kernel", None)) for n in layer] == [
        ("activation", None, None),
        ("conv", 128, 1),
        ("activation", None, None),
        ("conv", 32, 3),
    ]
    assert layer[0].inputs == ["denseblock2.concat2"]


@pytest.mark.parametrize("depth,concats", [(169, 82), (201, 98), (264, 130)])
def test_densenet_imagenet_depths(depth, concats):
    assert ops(expand(template="densenet", depth=depth))["concat"] == concats


def test_densenet_cifar():
    g = expand(template="densenet", depth=100, growth_rate=12)  # n = 16 layers per block
    c = ops(g)
    assert c["concat"] == 48 and c["avg_pool"] == 2 and c["max_pool"] == 0
    # no stem activation: 2 per layer + 1 per transition + final = 96 + 2 + 1
    assert c["activation"] == 99
    assert g.nodes[0].shape == [3, 32, 32]
    nodes = by_id(g)
    assert (nodes["conv0"].channels, nodes["conv0"].kernel, nodes["conv0"].stride) == (24, 3, 1)
    assert nodes["transition1.conv"].channels == (24 + 16 * 12) // 2
    assert nodes["logits"].units == 10


# ---------------------------------------------------------------- errors and description


@pytest.mark.parametrize(
    "kw,hint_has",
    [
        (dict(template="mlp"), "depth"),
        (dict(template="cnn"), "depth"),
        (dict(template="resnet"), "18, 34, 50, 101, 152, 200"),
        (dict(template="resnet", depth=42), "18, 34, 50, 101, 152, 200"),
        (dict(template="densenet", depth=122), "121, 169, 201 or 264"),
        (dict(template="densenet", depth=4), "6n+4"),
        (dict(template="resnet", depth=50, width=64), "depth, version, shortcut_weight"),
        (dict(template="mlp", depth=3, shortcut_weight=0.5), "depth, width"),
        (dict(template="densenet", version=2), "growth_rate"),
        (dict(template="cnn", depth=3, input_shape=[784]), "[channels, height, width]"),
        (dict(template="resnet", depth=50, input_shape=[3, 224]), "[channels, height, width]"),
        (dict(template="mlp", depth=3, input_shape=[28, 28]), "[features]"),
        (dict(template="resnet", depth=18, input_shape=[3, 4, 4]), "larger input"),
    ],
)
def test_bad_parameters(kw, hint_has):
    with pytest.raises(SigpropError) as info:
        expand(**kw)
    err = info.value
    assert err.code == "invalid_request" and err.status == 422
    assert err.message and hint_has in err.hint
    assert err.to_dict()["error"]["code"] == "invalid_request"


def test_too_deep_densenet_is_graph_too_large():
    with pytest.raises(SigpropError) as info:
        expand(template="densenet", depth=6 * 5000 + 4)
    assert info.value.code == "graph_too_large"


def test_the_template_names_and_fields_are_the_wires_and_the_engine_describes_exactly_them():
    """The names and per-template fields live in ``schemas.graph`` (the request parser lists them in
    its errors without importing the engine); the engine's registry and parameter descriptions
    must name the same ones, in the same order."""
    from typing import get_args

    from sigprop.engine.templates.expand import TEMPLATES
    from sigprop.schemas.graph import TEMPLATE_FIELDS
    from sigprop.schemas.graph import TEMPLATE_NAMES as WIRE_NAMES

    assert TEMPLATE_NAMES is WIRE_NAMES and tuple(TEMPLATES) == WIRE_NAMES
    assert get_args(Template.model_fields["template"].annotation) == WIRE_NAMES
    for name, spec in TEMPLATES.items():
        assert tuple(p["name"] for p in spec.parameters) == TEMPLATE_FIELDS[name] == spec.fields
        assert set(TEMPLATE_FIELDS[name]) <= set(Template.model_fields)


def test_describe_templates():
    d = describe_templates()
    json.dumps(d)
    assert tuple(t["name"] for t in d) == TEMPLATE_NAMES == ("mlp", "resnet", "densenet", "cnn", "transformer")
    params = {t["name"]: {p["name"]: p for p in t["parameters"]} for t in d}
    assert params["resnet"]["depth"]["allowed"] == [18, 34, 50, 101, 152, 200]
    assert params["resnet"]["depth"]["required"] is True
    assert params["resnet"]["version"]["default"] == 2
    assert params["resnet"]["shortcut_weight"]["default"] == math.sqrt(0.5)  # equal branches
    assert params["mlp"]["width"]["default"] == 512 and params["mlp"]["depth"]["required"] is True
    assert params["cnn"]["width"]["default"] == 64
    assert params["densenet"]["depth"]["default"] == 121
    assert params["densenet"]["growth_rate"]["default"] == 32
    # every documented parameter is a Template field, and each template takes only those
    for _name, ps in params.items():
        assert set(ps) <= set(Template.model_fields)
    d[0]["name"] = "changed"
    assert describe_templates()[0]["name"] == "mlp"  # a fresh copy each call
