"""Named networks that expand server-side to a ``sigprop.graph/v1`` graph (contract section 1).

A user may write ``{"template": "resnet", "depth": 50, "shortcut_weight": 0.5}`` wherever a graph
goes; :func:`expand_template` turns it into the node-by-node :class:`~sigprop.schemas.Graph` that a
hand-written graph of the same network would be. The expansion is a pure function of the template:
node ids are deterministic (dotted names after the reference implementations, e.g.
``block_group_1.block_0.conv_1``) and nodes come in topological order, each after its inputs.

Every ``activation`` node omits ``fn``, so it takes the request's ``activation``. Weighted sums
carry explicit weights with sum of squares 1.

Templates
---------
``mlp``
    input -> depth x (dense(width) -> activation) -> dense(classes) -> output. An input of shape
    ``[channels, height, width]`` is flattened first.
``cnn``
    input -> depth x (conv 3x3 stride 1 'same' (width channels) -> activation) -> global_avg_pool
    -> dense(classes) -> output.
``resnet``
    DeepMind's "modified ResNet" of the dks package (``dks/examples/haiku/modified_resnet.py``:
    ``BlockV1``, ``BlockV2``, ``ModifiedResNet``), without batch norm, whose shortcut and
    residual branches are weighted ``shortcut_weight`` and ``sqrt(1 - shortcut_weight**2)``.
    ``shortcut_weight == 0`` removes the shortcut branches (and their projection convs)
    entirely, as the reference does. Version 2 matches the reference model node for node.
    Version 1 follows the reference too, with one deliberate difference: with
    ``shortcut_weight == 0`` the reference ``BlockV1`` returns its last conv *without* the
    block's closing activation (``else: return out``), while its ``subnet_max_func`` (the
    function its DKS/TAT transformation is solved from) counts one activation per block in
    every case. Here every v1 block ends with an activation, so the graph's C map agrees with
    the reference ``subnet_max_func`` (and a ``shortcut_weight`` of 0 and of 1e-9 give nearly
    the same network).
``densenet``
    DenseNet-BC (bottleneck layers, compression 0.5) without batch norm, after torchvision's
    ``DenseNet``: depths 121/169/201/264 are the ImageNet networks (stem conv 7x7 stride 2 ->
    activation -> max_pool 3 stride 2, four dense blocks); any other depth ``6n + 4`` is the
    CIFAR network (stem conv 3x3, three dense blocks of ``n`` layers, no pooling in the stem).
    A dense layer is activation -> conv 1x1 (4 * growth_rate) -> activation -> conv 3x3
    (growth_rate), followed by a ``concat`` of the block input and every layer output so far;
    a transition is activation -> conv 1x1 (half the channels) -> avg_pool 2 stride 2; the head
    is activation -> global_avg_pool -> dense(classes) -> output.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from pydantic import ValidationError

from sigprop.errors import SigpropError
from sigprop.schemas import GRAPH_SCHEMA, Graph, Template

TEMPLATE_NAMES = ("mlp", "resnet", "densenet", "cnn")

# Expansion guards: the schema lets ``depth`` go to 100000 (an MLP of that depth is ~200k nodes);
# the quadratic concat lists of a very deep CIFAR DenseNet are cut off well before they get slow.
MAX_TEMPLATE_NODES = 250_000
MAX_TEMPLATE_EDGES = 1_000_000  # also keeps every concat under the schema's 4096 inputs

# ModifiedResNet.CONFIGS of dks/examples/haiku/modified_resnet.py, verbatim.
RESNET_CONFIGS: dict[int, dict[str, Any]] = {
    18: {"blocks_per_group": (2, 2, 2, 2), "bottleneck": False,
         "channels_per_group": (64, 128, 256, 512), "use_projection": (False, True, True, True)},
    34: {"blocks_per_group": (3, 4, 6, 3), "bottleneck": False,
         "channels_per_group": (64, 128, 256, 512), "use_projection": (False, True, True, True)},
    50: {"blocks_per_group": (3, 4, 6, 3), "bottleneck": True,
         "channels_per_group": (256, 512, 1024, 2048), "use_projection": (True, True, True, True)},
    101: {"blocks_per_group": (3, 4, 23, 3), "bottleneck": True,
          "channels_per_group": (256, 512, 1024, 2048), "use_projection": (True, True, True, True)},
    152: {"blocks_per_group": (3, 8, 36, 3), "bottleneck": True,
          "channels_per_group": (256, 512, 1024, 2048), "use_projection": (True, True, True, True)},
    200: {"blocks_per_group": (3, 24, 36, 3), "bottleneck": True,
          "channels_per_group": (256, 512, 1024, 2048), "use_projection": (True, True, True, True)},
}
RESNET_STRIDES = (1, 2, 2, 2)

# torchvision's densenet121/169/201 and the paper's DenseNet-264 (ImageNet, 4 blocks).
DENSENET_IMAGENET_CONFIGS: dict[int, tuple[int, ...]] = {
    121: (6, 12, 24, 16),
    169: (6, 12, 32, 32),
    201: (6, 12, 48, 32),
    264: (6, 12, 64, 48),
}

# Which Template fields each template reads; any other field set is rejected, not ignored.
_PARAMS: dict[str, tuple[str, ...]] = {
    "mlp": ("depth", "width", "input_shape", "classes", "bias"),
    "cnn": ("depth", "width", "input_shape", "classes", "bias"),
    "resnet": ("depth", "version", "shortcut_weight", "input_shape", "classes", "bias"),
    "densenet": ("depth", "growth_rate", "input_shape", "classes", "bias"),
}
_ALL_FIELDS = ("depth", "width", "input_shape", "version", "shortcut_weight", "growth_rate", "classes", "bias")

_DEPTH_LIMIT = 100_000  # Template.depth's schema bound


def _param(name: str, type_: str, description: str, *, required: bool = False, default: Any = None,
           allowed: list | None = None, minimum: float | None = None, maximum: float | None = None) -> dict:
    p: dict[str, Any] = {"name": name, "type": type_, "required": required, "default": default}
    if allowed is not None:
        p["allowed"] = allowed
    if minimum is not None:
        p["minimum"] = minimum
    if maximum is not None:
        p["maximum"] = maximum
    p["description"] = description
    return p


_BIAS = _param("bias", "boolean", "whether dense and conv layers have a bias", default=True)

_DESCRIPTIONS: list[dict] = [
    {
        "name": "mlp",
        "description": "Fully connected network: depth x (dense(width) -> activation), then dense(classes). "
                       "A [channels, height, width] input is flattened first.",
        "parameters": [
            _param("depth", "integer", "number of hidden layers (activation nodes)", required=True,
                   minimum=1, maximum=_DEPTH_LIMIT),
            _param("width", "integer", "units of every hidden dense layer", default=512, minimum=1),
            _param("input_shape", "array of integers",
                   "[features] or [channels, height, width]; default [width]", default=None),
            _param("classes", "integer", "units of the last dense layer", default=10, minimum=1),
            _BIAS,
        ],
    },
    {
        "name": "resnet",
        "description": "DeepMind's modified ResNet (dks examples/haiku/modified_resnet.py) without batch norm: "
                       "residual branches weighted sqrt(1 - shortcut_weight^2), shortcuts shortcut_weight; "
                       "shortcut_weight 0 removes the shortcuts (a plain deep network).",
        "parameters": [
            _param("depth", "integer", "ResNet depth", required=True, allowed=sorted(RESNET_CONFIGS)),
            _param("version", "integer", "1: post-activation blocks; 2: pre-activation blocks",
                   default=2, allowed=[1, 2]),
            _param("shortcut_weight", "number", "weight of the shortcut branch; 0 removes it", default=0.0,
                   minimum=0.0, maximum=1.0),
            _param("input_shape", "array of integers", "[channels, height, width]", default=[3, 224, 224]),
            _param("classes", "integer", "units of the logits layer", default=1000, minimum=1),
            _BIAS,
        ],
    },
    {
        "name": "densenet",
        "description": "DenseNet-BC without batch norm. Depth 121/169/201/264: the ImageNet networks; "
                       "any other depth 6n+4: the CIFAR network with three blocks of n layers.",
        "parameters": [
            _param("depth", "integer", "121, 169, 201, 264 (ImageNet) or 6n+4 (CIFAR, e.g. 40, 100, 190)",
                   default=121, allowed=sorted(DENSENET_IMAGENET_CONFIGS) + ["6n+4"]),
            _param("growth_rate", "integer", "channels each dense layer adds", default=32, minimum=1),
            _param("input_shape", "array of integers",
                   "[channels, height, width]; default [3, 224, 224] (ImageNet depths) or [3, 32, 32] (CIFAR)",
                   default=None),
            _param("classes", "integer", "units of the classifier; default 1000 (ImageNet depths) or 10 (CIFAR)",
                   default=None, minimum=1),
            _BIAS,
        ],
    },
    {
        "name": "cnn",
        "description": "Plain convolutional network: depth x (conv 3x3 stride 1 'same' (width channels) -> "
                       "activation), then global_avg_pool and dense(classes).",
        "parameters": [
            _param("depth", "integer", "number of conv + activation layers", required=True,
                   minimum=1, maximum=_DEPTH_LIMIT),
            _param("width", "integer", "channels of every conv layer", default=64, minimum=1),
            _param("input_shape", "array of integers", "[channels, height, width]", default=[3, 32, 32]),
            _param("classes", "integer", "units of the last dense layer", default=10, minimum=1),
            _BIAS,
        ],
    },
]


def describe_templates() -> list[dict]:
    """The templates and their parameters (defaults, allowed values), as ``GET /v1/templates`` lists them.

    Returns a fresh JSON-serializable list (one dict per template, in ``TEMPLATE_NAMES`` order)
    with keys ``name``, ``description`` and ``parameters``; each parameter has ``name``, ``type``,
    ``required``, ``default`` (``None`` when required or when it depends on other parameters, as
    the parameter's ``description`` says) and, where they apply, ``allowed``, ``minimum``,
    ``maximum``.
    """
    return copy.deepcopy(_DESCRIPTIONS)


def _bad(message: str, hint: str) -> SigpropError:
    return SigpropError("invalid_request", message, hint)


class _Builder:
    """Appends nodes in topological order and tracks each node's shape (as the graph engine infers it)."""

    def __init__(self, template: str):
        self.template = template
        self.nodes: list[dict] = []
        self.shapes: dict[str, tuple[int, ...]] = {}

    def _add(self, node: dict, shape: tuple[int, ...]) -> str:
        nid = node["id"]
        assert nid not in self.shapes, nid  # ids are generated; a clash is a bug here
        self.nodes.append(node)
        self.shapes[nid] = shape
        return nid

    def _too_small(self, nid: str) -> SigpropError:
        first = self.nodes[0]["shape"]
        return _bad(f"input_shape {first} is too small for template '{self.template}': "
                    f"node '{nid}' would shrink the feature map to nothing",
                    "give a larger input height and width (or leave input_shape out for the default)")

    def input(self, shape: list[int]) -> str:
        return self._add({"id": "input", "op": "input", "shape": list(shape)}, tuple(shape))

    def dense(self, nid: str, src: str, units: int, bias: bool) -> str:
        return self._add({"id": nid, "op": "dense", "inputs": [src], "units": units, "bias": bias}, (units,))

    def conv(self, nid: str, src: str, channels: int, kernel: int, stride: int, bias: bool) -> str:
        _, h, w = self.shapes[src]
        h, w = math.ceil(h / stride), math.ceil(w / stride)  # padding "same"
        return self._add({"id": nid, "op": "conv", "inputs": [src], "channels": channels, "kernel": kernel,
                          "stride": stride, "padding": "same", "bias": bias}, (channels, h, w))

    def pool(self, nid: str, op: str, src: str, kernel: int, stride: int) -> str:
        c, h, w = self.shapes[src]
        h, w = (h - kernel) // stride + 1, (w - kernel) // stride + 1  # no padding
        if h < 1 or w < 1:
            raise self._too_small(nid)
        return self._add({"id": nid, "op": op, "inputs": [src], "kernel": kernel, "stride": stride}, (c, h, w))

    def act(self, nid: str, src: str) -> str:
        return self._add({"id": nid, "op": "activation", "inputs": [src]}, self.shapes[src])

    def sum(self, nid: str, srcs: list[str], weights: list[float]) -> str:
        return self._add({"id": nid, "op": "sum", "inputs": list(srcs), "weights": list(weights)},
                         self.shapes[srcs[0]])

    def concat(self, nid: str, srcs: list[str]) -> str:
        first = self.shapes[srcs[0]]
        channels = sum(self.shapes[s][0] for s in srcs)
        return self._add({"id": nid, "op": "concat", "inputs": list(srcs)}, (channels,) + first[1:])

    def simple(self, nid: str, op: str, src: str) -> str:
        shape = self.shapes[src]
        if op == "flatten":
            shape = (math.prod(shape),)
        elif op == "global_avg_pool":
            shape = (shape[0],)
        return self._add({"id": nid, "op": op, "inputs": [src]}, shape)

    def head(self, src: str, classes: int, bias: bool, pool: bool) -> None:
        if pool:
            src = self.simple("global_avg_pool", "global_avg_pool", src)
        src = self.dense("logits", src, classes, bias)
        self.simple("output", "output", src)


def _require_depth(t: Template, what: str, example: str) -> int:
    if t.depth is None:
        raise _bad(f"template '{t.template}' needs 'depth'", f"give 'depth', the number of {what}, e.g. {example}")
    return t.depth


def _image_shape(t: Template, default: list[int]) -> list[int]:
    shape = list(t.input_shape) if t.input_shape is not None else list(default)
    if len(shape) != 3:
        raise _bad(f"template '{t.template}' needs an image input, got input_shape {shape}",
                   f"give input_shape as [channels, height, width], e.g. {default}, or leave it out")
    return shape


def _check_size(nodes: int, edges: int, t: Template) -> None:
    if nodes > MAX_TEMPLATE_NODES or edges > MAX_TEMPLATE_EDGES:
        raise SigpropError("graph_too_large",
                           f"template '{t.template}' with depth {t.depth} expands to about {nodes} nodes and {edges} edges",
                           f"templates expand to at most {MAX_TEMPLATE_NODES} nodes and {MAX_TEMPLATE_EDGES} edges: "
                           "use a smaller depth")


def _mlp(t: Template) -> list[dict]:
    depth = _require_depth(t, "hidden layers (activation nodes)", "{\"template\": \"mlp\", \"depth\": 20}")
    width = t.width if t.width is not None else 512
    classes = t.classes if t.classes is not None else 10
    bias = True if t.bias is None else t.bias
    shape = list(t.input_shape) if t.input_shape is not None else [width]
    if len(shape) not in (1, 3):
        raise _bad(f"input_shape {shape} is neither [features] nor [channels, height, width]",
                   f"give input_shape as [features], e.g. [{width}], or [channels, height, width]")
    _check_size(2 * depth + 5, 2 * depth + 4, t)
    b = _Builder("mlp")
    x = b.input(shape)
    if len(shape) == 3:
        x = b.simple("flatten", "flatten", x)
    for i in range(depth):
        x = b.dense(f"dense_{i}", x, width, bias)
        x = b.act(f"act_{i}", x)
    b.head(x, classes, bias, pool=False)
    return b.nodes


def _cnn(t: Template) -> list[dict]:
    depth = _require_depth(t, "conv + activation layers", "{\"template\": \"cnn\", \"depth\": 20}")
    width = t.width if t.width is not None else 64
    classes = t.classes if t.classes is not None else 10
    bias = True if t.bias is None else t.bias
    shape = _image_shape(t, [3, 32, 32])
    _check_size(2 * depth + 4, 2 * depth + 3, t)
    b = _Builder("cnn")
    x = b.input(shape)
    for i in range(depth):
        x = b.conv(f"conv_{i}", x, width, 3, 1, bias)
        x = b.act(f"act_{i}", x)
    b.head(x, classes, bias, pool=True)
    return b.nodes


def _resnet(t: Template) -> list[dict]:
    allowed = ", ".join(str(d) for d in sorted(RESNET_CONFIGS))
    if t.depth is None:
        raise _bad("template 'resnet' needs 'depth'", f"give 'depth', one of {allowed}")
    if t.depth not in RESNET_CONFIGS:
        raise _bad(f"resnet depth {t.depth} is not supported", f"give 'depth' as one of {allowed}")
    cfg = RESNET_CONFIGS[t.depth]
    v2 = (t.version if t.version is not None else 2) == 2
    w = float(t.shortcut_weight) if t.shortcut_weight is not None else 0.0
    if not 0.0 <= w <= 1.0:  # the schema already bounds it; a hand-made Template might not
        raise _bad(f"shortcut_weight {w} is outside [0, 1]", "give shortcut_weight between 0 and 1 (0 removes the shortcuts)")
    residual_w = math.sqrt(1.0 - w * w)
    classes = t.classes if t.classes is not None else 1000
    bias = True if t.bias is None else t.bias
    shape = _image_shape(t, [3, 224, 224])
    bottleneck = cfg["bottleneck"]
    div = 4 if bottleneck else 1

    b = _Builder("resnet")
    x = b.input(shape)
    # ModifiedResNet.__call__: initial conv (64 channels, 7x7, stride 2), v1 only: activation, max pool 3/2.
    x = b.conv("initial_conv", x, 64, 7, 2, bias)
    if not v2:
        x = b.act("initial_act", x)
    x = b.pool("max_pool", "max_pool", x, 3, 2)

    for g in range(4):
        channels = cfg["channels_per_group"][g]
        # the convs of one block, after BlockV1/BlockV2.__init__: (channels, kernel, stride)
        for j in range(cfg["blocks_per_group"][g]):
            stride = RESNET_STRIDES[g] if j == 0 else 1
            project = j == 0 and cfg["use_projection"][g] and w != 0.0
            if bottleneck:
                convs = [(channels // div, 1, 1), (channels // div, 3, stride), (channels, 1, 1)]
            else:
                convs = [(channels, 3, stride), (channels, 3, 1)]
            p = f"block_group_{g}.block_{j}."
            shortcut = x
            if v2:
                # BlockV2.__call__: activation before every conv; the projection reads the first activation.
                for i, (ch, k, s) in enumerate(convs):
                    x = b.act(f"{p}act_{i}", x)
                    if i == 0 and project:
                        shortcut = b.conv(f"{p}shortcut_conv", x, channels, 1, stride, bias)
                    x = b.conv(f"{p}conv_{i}", x, ch, k, s, bias)
                if w != 0.0:
                    x = b.sum(f"{p}sum", [shortcut, x], [w, residual_w])
            else:
                # BlockV1.__call__: projection of the block input; activations between the convs,
                # and one after the (weighted) sum.
                if project:
                    shortcut = b.conv(f"{p}shortcut_conv", x, channels, 1, stride, bias)
                for i, (ch, k, s) in enumerate(convs):
                    x = b.conv(f"{p}conv_{i}", x, ch, k, s, bias)
                    if i < len(convs) - 1:
                        x = b.act(f"{p}act_{i}", x)
                if w != 0.0:
                    x = b.sum(f"{p}sum", [shortcut, x], [w, residual_w])
                # (the reference omits this activation when w == 0; see the module docstring)
                x = b.act(f"{p}act_out", x)
    if v2:
        x = b.act("final_act", x)
    b.head(x, classes, bias, pool=True)
    return b.nodes


def _densenet(t: Template) -> list[dict]:
    depth = t.depth if t.depth is not None else 121
    growth = t.growth_rate if t.growth_rate is not None else 32
    bias = True if t.bias is None else t.bias
    imagenet = depth in DENSENET_IMAGENET_CONFIGS
    if imagenet:
        blocks = DENSENET_IMAGENET_CONFIGS[depth]
    else:
        if depth < 10 or (depth - 4) % 6 != 0:
            raise _bad(f"densenet depth {depth} is not supported",
                       "give 'depth' as 121, 169, 201 or 264 (ImageNet DenseNet-BC), or 6n+4 with n >= 1 "
                       "(CIFAR DenseNet-BC with three blocks of n layers, e.g. 40, 100, 190)")
        n = (depth - 4) // 6
        blocks = (n, n, n)
    classes = t.classes if t.classes is not None else (1000 if imagenet else 10)
    shape = _image_shape(t, [3, 224, 224] if imagenet else [3, 32, 32])
    layers = sum(blocks)
    _check_size(5 * layers + 3 * len(blocks) + 9,
                4 * layers + sum(k * (k + 3) // 2 for k in blocks) + 3 * len(blocks) + 8, t)

    b = _Builder("densenet")
    x = b.input(shape)
    if imagenet:
        # torchvision: conv0 (7x7 / 2, 2k channels) -> norm0 -> relu0 -> pool0 (3 / 2), norm0 dropped.
        x = b.conv("conv0", x, 2 * growth, 7, 2, bias)
        x = b.act("act0", x)
        x = b.pool("pool0", "max_pool", x, 3, 2)
    else:
        x = b.conv("conv0", x, 2 * growth, 3, 1, bias)
    for bi, n_layers in enumerate(blocks, start=1):
        features = [x]
        for li in range(1, n_layers + 1):
            p = f"denseblock{bi}.denselayer{li}."
            y = b.act(f"{p}act1", x)
            y = b.conv(f"{p}conv1", y, 4 * growth, 1, 1, bias)
            y = b.act(f"{p}act2", y)
            y = b.conv(f"{p}conv2", y, growth, 3, 1, bias)
            features.append(y)
            x = b.concat(f"denseblock{bi}.concat{li}", features)
        if bi < len(blocks):
            p = f"transition{bi}."
            channels = b.shapes[x][0] // 2
            x = b.act(f"{p}act", x)
            x = b.conv(f"{p}conv", x, channels, 1, 1, bias)
            x = b.pool(f"{p}pool", "avg_pool", x, 2, 2)
    x = b.act("final_act", x)
    b.head(x, classes, bias, pool=True)
    return b.nodes


_EXPANDERS = {"mlp": _mlp, "cnn": _cnn, "resnet": _resnet, "densenet": _densenet}


def template_size(t: Template) -> tuple[int, int, int] | None:
    """(nodes, depth, largest fan-in) of the graph ``t`` expands to, computed from its parameters
    alone (exactly, in microseconds), so a service can refuse an oversized template before building
    it. ``depth`` counts nonlinear layers on the longest path, the fan-in is that of the widest
    sum or concat (1 when there is none). None when the parameters are invalid or missing
    (``expand_template`` says why)."""
    name = t.template
    if name in ("mlp", "cnn"):
        if t.depth is None:
            return None
        if name == "mlp":
            flatten = 1 if t.input_shape is not None and len(t.input_shape) == 3 else 0
            return 2 * t.depth + 3 + flatten, t.depth, 1
        return 2 * t.depth + 4, t.depth, 1
    if name == "resnet":
        cfg = RESNET_CONFIGS.get(t.depth) if t.depth is not None else None
        if cfg is None:
            return None
        v2 = (t.version if t.version is not None else 2) == 2
        shortcut = (t.shortcut_weight or 0.0) != 0.0
        convs = 3 if cfg["bottleneck"] else 2
        blocks = sum(cfg["blocks_per_group"])
        projections = sum(1 for g in range(4) if cfg["use_projection"][g]) if shortcut else 0
        per_block = 2 * convs + (1 if shortcut else 0)  # convs, activations (v1: convs - 1, then act_out)
        stem = 3 if v2 else 4                             # input, initial_conv, (v1: initial_act), max_pool
        head = 4 if v2 else 3                             # (v2: final_act), global_avg_pool, logits, output
        return stem + blocks * per_block + projections + head, blocks * convs + 1, 2 if shortcut else 1
    if name == "densenet":
        depth = t.depth if t.depth is not None else 121
        if depth in DENSENET_IMAGENET_CONFIGS:
            blocks, imagenet = DENSENET_IMAGENET_CONFIGS[depth], True
        elif depth >= 10 and (depth - 4) % 6 == 0:
            n = (depth - 4) // 6
            blocks, imagenet = (n, n, n), False
        else:
            return None
        layers, stem = sum(blocks), (2 if imagenet else 0)
        nodes = 2 + stem + 5 * layers + 3 * (len(blocks) - 1) + 4
        return nodes, (1 if imagenet else 0) + 2 * layers + len(blocks), max(blocks) + 1
    return None


def expand_template(t: Template) -> Graph:
    """The node-by-node graph (schema ``sigprop.graph/v1``) of a template.

    Raises ``SigpropError("invalid_request", ...)`` for an unknown template, a parameter that does
    not apply to the template, a missing required parameter or an unsupported value (the hint
    lists what is allowed), and ``SigpropError("graph_too_large", ...)`` when the expansion would
    exceed ``MAX_TEMPLATE_NODES`` nodes or ``MAX_TEMPLATE_EDGES`` edges.
    """
    name = t.template
    if name not in _EXPANDERS:
        raise _bad(f"unknown template '{name}'", f"use one of {', '.join(TEMPLATE_NAMES)}")
    extra = [f for f in _ALL_FIELDS if f not in _PARAMS[name] and getattr(t, f, None) is not None]
    if extra:
        raise _bad(f"template '{name}' does not take {', '.join(repr(f) for f in extra)}",
                   f"template '{name}' takes {', '.join(_PARAMS[name])}")
    nodes = _EXPANDERS[name](t)
    try:
        return Graph.model_validate({"schema": GRAPH_SCHEMA, "nodes": nodes})
    except ValidationError as exc:  # e.g. a channel count past the schema's bounds
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise _bad(f"template '{name}' expands to an invalid graph: {first.get('msg')} at {where}",
                   "use smaller or default parameter values") from None
