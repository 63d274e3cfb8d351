"""Named networks that expand server-side to a ``sigprop.graph/v1`` graph (contract section 1).

A user may write ``{"template": "resnet", "depth": 50, "shortcut_weight": 0.5}`` wherever a graph
goes; :func:`expand_template` turns it into the node-by-node :class:`~sigprop.schemas.Graph` that a
hand-written graph of the same network would be (:func:`expand_template_nodes`, faster, the nodes as
the graph engine reads them: what a solve request's template becomes). The expansion is a pure
function of the template: node ids are deterministic (dotted names after the reference
implementations, e.g. ``block_group_1.block_0.conv_1``) and nodes come in topological order.

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
    entirely, as the reference does. The default is ``RESNET_SHORTCUT_WEIGHT`` = sqrt(1/2): equal
    branches, the weights a ``sum`` node takes when it names none, because a ResNet without
    shortcuts surprises everyone who asks for one (the reference's default is 0: the TAT paper's
    point is training without them; ask for ``"shortcut_weight": 0`` to get that network).
    Version 2 matches the reference model node for node.
    Version 1 expands to the reference's post-activation network as it is, because a template
    must equal the hand-written graph of its network; with shortcuts (``shortcut_weight > 0``) its
    identity shortcuts carry post-activation features into the activation after each sum, which
    the kernel theory does not cover, so solving it answers ``unsupported_structure`` (or, with
    ``"assumptions": "warn"``, an answer whose warnings say which predictions fail). Version 2 is
    the layout to use; version 1 without shortcuts is a plain network and fine. Version 1 follows
    the reference too, with one deliberate difference: with
    ``shortcut_weight == 0`` the reference ``BlockV1`` returns its last conv *without* the
    block's closing activation (``else: return out``), while its ``subnet_max_func`` (the
    function its DKS/TAT transformation is solved from) counts one activation per block in
    every case. Here every v1 block ends with an activation, so the graph's C map agrees with
    the reference ``subnet_max_func`` (and a ``shortcut_weight`` of 0 and of 1e-9 give nearly
    the same network).
``transformer``
    Self-attention + MLP blocks on a token stream, shortcuts and pre-LN norms as switches
    (``engine.templates.transformer``).
``densenet``
    DenseNet-BC (bottleneck layers, compression 0.5) without batch norm, after torchvision's
    ``DenseNet``: depths 121/169/201/264 are the ImageNet networks (stem conv 7x7 stride 2 ->
    max_pool 3 stride 2, four dense blocks); any other depth ``6n + 4`` is the
    CIFAR network (stem conv 3x3, three dense blocks of ``n`` layers, no pooling in the stem).
    A dense layer is activation -> conv 1x1 (4 * growth_rate) -> activation -> conv 3x3
    (growth_rate), followed by a ``concat`` of the block input and every layer output so far;
    a transition is activation -> conv 1x1 (half the channels) -> avg_pool 2 stride 2; the head
    is activation -> global_avg_pool -> dense(classes) -> output. The ImageNet stem has no
    activation (torchvision's relu0 after its norm0): without batch norm, its output would reach
    every activation of the first dense block through the concatenations, as post-activation
    features outside the kernel theory (``sigprop.schemas.structure``); each dense layer starts with its own
    activation, as in a pre-activation ResNet. The depth names the weighted layers (120 convs and
    the classifier for DenseNet-121), as in the DenseNet paper.

Registry
--------
Each template is one :class:`TemplateSpec` in ``TEMPLATES``: its name, description, documented
parameters (which are also the only ``Template`` fields it accepts), its expander and its exact
size from the parameters. Adding a template is adding one entry (and its name to
``sigprop.schemas.Template``). Expansion refuses templates over the node limit its caller passes
(``max_nodes``, from the ``engine.limits.Limits`` the caller built from its settings; default
``DEFAULT_MAX_NODES``), the same limit the service checks with :func:`template_size` before it
expands anything.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from sigprop.errors import SigpropError
from sigprop.schemas import Graph, Template
from sigprop.schemas.graph import TEMPLATE_FIELDS, TEMPLATE_NAMES

from ..limits import DEFAULT_MAX_NODES
from .builder import (
    _BIAS,
    _DEPTH_LIMIT,
    TemplateNodes,
    TemplateSize,
    _bad,
    _Builder,
    _image_shape,
    _param,
    _require_depth,
)
from .densenet import DENSENET_DESCRIPTION, DENSENET_PARAMETERS, densenet, densenet_size
from .transformer import (
    TRANSFORMER_DESCRIPTION,
    TRANSFORMER_PARAMETERS,
    TRANSFORMER_RULES,
    transformer,
    transformer_size,
)

# Expansion guard besides the node limit (``max_nodes``): the quadratic concat lists of a very deep
# CIFAR DenseNet are cut off well before they get slow.
MAX_TEMPLATE_EDGES = 1_000_000  # also keeps every concat under the schema's 4096 inputs

# ModifiedResNet.CONFIGS of dks/examples/haiku/modified_resnet.py, verbatim.
RESNET_CONFIGS: dict[int, dict[str, Any]] = {
    18: {
        "blocks_per_group": (2, 2, 2, 2),
        "bottleneck": False,
        "channels_per_group": (64, 128, 256, 512),
        "use_projection": (False, True, True, True),
    },
    34: {
        "blocks_per_group": (3, 4, 6, 3),
        "bottleneck": False,
        "channels_per_group": (64, 128, 256, 512),
        "use_projection": (False, True, True, True),
    },
    50: {
        "blocks_per_group": (3, 4, 6, 3),
        "bottleneck": True,
        "channels_per_group": (256, 512, 1024, 2048),
        "use_projection": (True, True, True, True),
    },
    101: {
        "blocks_per_group": (3, 4, 23, 3),
        "bottleneck": True,
        "channels_per_group": (256, 512, 1024, 2048),
        "use_projection": (True, True, True, True),
    },
    152: {
        "blocks_per_group": (3, 8, 36, 3),
        "bottleneck": True,
        "channels_per_group": (256, 512, 1024, 2048),
        "use_projection": (True, True, True, True),
    },
    200: {
        "blocks_per_group": (3, 24, 36, 3),
        "bottleneck": True,
        "channels_per_group": (256, 512, 1024, 2048),
        "use_projection": (True, True, True, True),
    },
}
RESNET_STRIDES = (1, 2, 2, 2)
# The resnet template's default shortcut weight: equal branches, sqrt(1/2) each, as a `sum` node
# without weights (see the module docstring for why it is not the reference's 0).
RESNET_SHORTCUT_WEIGHT = math.sqrt(0.5)


# Every field a template may take, in the order of Template (errors list unknown ones in this order).
_ALL_FIELDS = tuple(f for f in Template.model_fields if f != "template")


# -- mlp ------------------------------------------------------------------------------------------

_MLP_DESCRIPTION = (
    "Fully connected network: depth x (dense(width) -> activation), then dense(classes). "
    "A [channels, height, width] input is flattened first."
)
_MLP_PARAMETERS = (
    _param(
        "depth", "integer", "number of hidden layers (activation nodes)", required=True, minimum=1, maximum=_DEPTH_LIMIT
    ),
    _param("width", "integer", "units of every hidden dense layer", default=512, minimum=1),
    _param(
        "input_shape", "array of integers", "[features] or [channels, height, width]; default [width]", lengths=[1, 3]
    ),
    _param("classes", "integer", "units of the last dense layer", default=10, minimum=1),
    _BIAS,
)


def _mlp_size(t: Template) -> TemplateSize | None:
    if t.depth is None:
        return None
    flatten = 1 if t.input_shape is not None and len(t.input_shape) == 3 else 0
    nodes = 2 * t.depth + 3 + flatten
    return TemplateSize(nodes, t.depth, 1, nodes - 1)


def _mlp(t: Template) -> _Builder:
    depth = _require_depth(t, "hidden layers (activation nodes)", '{"template": "mlp", "depth": 20}')
    width = t.width if t.width is not None else 512
    classes = t.classes if t.classes is not None else 10
    bias = True if t.bias is None else t.bias
    shape = list(t.input_shape) if t.input_shape is not None else [width]
    if len(shape) not in (1, 3):
        raise _bad(
            f"input_shape {shape} is neither [features] nor [channels, height, width]",
            f"give input_shape as [features], e.g. [{width}], or [channels, height, width]",
        )
    b = _Builder("mlp")
    x = b.input(shape)
    if len(shape) == 3:
        x = b.simple("flatten", "flatten", x)
    for i in range(depth):
        x = b.dense(f"dense_{i}", x, width, bias)
        x = b.act(f"act_{i}", x)
    b.head(x, classes, bias, pool=False)
    return b


# -- cnn ------------------------------------------------------------------------------------------

_CNN_DESCRIPTION = (
    "Plain convolutional network: depth x (conv 3x3 stride 1 'same' (width channels) -> "
    "activation), then global_avg_pool and dense(classes)."
)
_CNN_PARAMETERS = (
    _param("depth", "integer", "number of conv + activation layers", required=True, minimum=1, maximum=_DEPTH_LIMIT),
    _param("width", "integer", "channels of every conv layer", default=64, minimum=1),
    _param("input_shape", "array of integers", "[channels, height, width]", default=[3, 32, 32], lengths=[3]),
    _param("classes", "integer", "units of the last dense layer", default=10, minimum=1),
    _BIAS,
)


def _cnn_size(t: Template) -> TemplateSize | None:
    if t.depth is None:
        return None
    nodes = 2 * t.depth + 4
    return TemplateSize(nodes, t.depth, 1, nodes - 1)


def _cnn(t: Template) -> _Builder:
    depth = _require_depth(t, "conv + activation layers", '{"template": "cnn", "depth": 20}')
    width = t.width if t.width is not None else 64
    classes = t.classes if t.classes is not None else 10
    bias = True if t.bias is None else t.bias
    shape = _image_shape(t, [3, 32, 32])
    b = _Builder("cnn")
    x = b.input(shape)
    for i in range(depth):
        x = b.conv(f"conv_{i}", x, width, 3, 1, bias)
        x = b.act(f"act_{i}", x)
    b.head(x, classes, bias, pool=True)
    return b


# -- resnet ---------------------------------------------------------------------------------------

_RESNET_DESCRIPTION = (
    "DeepMind's modified ResNet (dks examples/haiku/modified_resnet.py) without batch norm: "
    "residual branches weighted sqrt(1 - shortcut_weight^2), shortcuts shortcut_weight (default sqrt(1/2): "
    "equal branches); shortcut_weight 0 removes the shortcuts (a plain deep network)."
)
_RESNET_PARAMETERS = (
    _param("depth", "integer", "ResNet depth", required=True, allowed=sorted(RESNET_CONFIGS)),
    _param(
        "version",
        "integer",
        "1: post-activation blocks (outside the kernel theory when shortcut_weight > 0: "
        "solves answer unsupported_structure); 2: pre-activation blocks",
        default=2,
        allowed=[1, 2],
    ),
    _param(
        "shortcut_weight",
        "number",
        "weight of the shortcut branch; default sqrt(1/2) (equal branches); 0 removes it",
        default=RESNET_SHORTCUT_WEIGHT,
        minimum=0.0,
        maximum=1.0,
    ),
    _param("input_shape", "array of integers", "[channels, height, width]", default=[3, 224, 224], lengths=[3]),
    _param("classes", "integer", "units of the logits layer", default=1000, minimum=1),
    _BIAS,
)


def _shortcut_weight(t: Template) -> float:
    return float(t.shortcut_weight) if t.shortcut_weight is not None else RESNET_SHORTCUT_WEIGHT


def _resnet_size(t: Template) -> TemplateSize | None:
    cfg = RESNET_CONFIGS.get(t.depth) if t.depth is not None else None
    if cfg is None:
        return None
    v2 = (t.version if t.version is not None else 2) == 2
    shortcut = _shortcut_weight(t) != 0.0
    convs = 3 if cfg["bottleneck"] else 2
    blocks = sum(cfg["blocks_per_group"])
    projections = sum(1 for g in range(4) if cfg["use_projection"][g]) if shortcut else 0
    per_block = 2 * convs + (1 if shortcut else 0)  # convs, activations (v1: convs - 1, then act_out)
    stem = 3 if v2 else 4  # input, initial_conv, (v1: initial_act), max_pool
    head = 4 if v2 else 3  # (v2: final_act), global_avg_pool, logits, output
    nodes = stem + blocks * per_block + projections + head
    sums = blocks if shortcut else 0  # two inputs each; every other node but the input has one
    return TemplateSize(nodes, blocks * convs + 1, 2 if shortcut else 1, nodes - 1 + sums)


def _resnet(t: Template) -> _Builder:
    allowed = ", ".join(str(d) for d in sorted(RESNET_CONFIGS))
    if t.depth is None:
        raise _bad("template 'resnet' needs 'depth'", f"give 'depth', one of {allowed}")
    if t.depth not in RESNET_CONFIGS:
        raise _bad(f"resnet depth {t.depth} is not supported", f"give 'depth' as one of {allowed}")
    cfg = RESNET_CONFIGS[t.depth]
    v2 = (t.version if t.version is not None else 2) == 2
    w = _shortcut_weight(t)
    if not 0.0 <= w <= 1.0:  # the schema already bounds it; a hand-made Template might not
        raise _bad(
            f"shortcut_weight {w} is outside [0, 1]", "give shortcut_weight between 0 and 1 (0 removes the shortcuts)"
        )
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
    return b


# -- densenet -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TemplateSpec:
    """Everything about one template: ``GET /v1/templates`` lists ``name``, ``description`` and
    ``parameters``; the parameters' names are the only ``Template`` fields it accepts; ``expand``
    builds its nodes in a ``_Builder`` (once the fields are checked and ``size`` is within the
    limits), and ``size`` is its exact size from the parameters alone (None when they are invalid
    or missing)."""

    name: str
    description: str
    parameters: tuple[dict, ...]
    expand: Callable[[Template], _Builder]
    size: Callable[[Template], TemplateSize | None]
    # JSON Schema rules between its parameters (the OpenAPI description adds them to its branch)
    rules: tuple[dict, ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        # the wire's list (schemas.graph.TEMPLATE_FIELDS); its parameters describe exactly these
        return TEMPLATE_FIELDS[self.name]

    def describe(self) -> dict:
        return {"name": self.name, "description": self.description, "parameters": copy.deepcopy(list(self.parameters))}


TEMPLATES: dict[str, TemplateSpec] = {
    spec.name: spec
    for spec in (
        TemplateSpec("mlp", _MLP_DESCRIPTION, _MLP_PARAMETERS, _mlp, _mlp_size),
        TemplateSpec("resnet", _RESNET_DESCRIPTION, _RESNET_PARAMETERS, _resnet, _resnet_size),
        TemplateSpec("densenet", DENSENET_DESCRIPTION, DENSENET_PARAMETERS, densenet, densenet_size),
        TemplateSpec("cnn", _CNN_DESCRIPTION, _CNN_PARAMETERS, _cnn, _cnn_size),
        TemplateSpec(
            "transformer",
            TRANSFORMER_DESCRIPTION,
            TRANSFORMER_PARAMETERS,
            transformer,
            transformer_size,
            TRANSFORMER_RULES,
        ),
    )
}


def describe_templates() -> list[dict]:
    """The templates and their parameters (defaults, allowed values), as ``GET /v1/templates`` lists them.

    Returns a fresh JSON-serializable list (one dict per template, in ``TEMPLATE_NAMES`` order)
    with keys ``name``, ``description`` and ``parameters``; each parameter has ``name``, ``type``,
    ``required``, ``default`` (``None`` when required or when it depends on other parameters, as
    the parameter's ``description`` says) and, where they apply, ``allowed``, ``minimum``,
    ``maximum`` and ``lengths`` (the list lengths an array may have).
    """
    return [spec.describe() for spec in TEMPLATES.values()]


def template_size(t: Template) -> tuple[int, int, int] | None:
    """(nodes, depth, largest fan-in) of the graph ``t`` expands to, computed from its parameters
    alone (exactly, in microseconds), so a service can refuse an oversized template before building
    it. ``depth`` counts nonlinear layers on the longest path, the fan-in is that of the widest
    sum or concat (1 when there is none). None when the parameters are invalid or missing
    (``expand_template`` says why)."""
    spec = TEMPLATES.get(t.template)
    size = spec.size(t) if spec is not None else None
    return None if size is None else (size.nodes, size.depth, size.fan_in)


def _check_size(t: Template, size: TemplateSize, max_nodes: int) -> None:
    if size.nodes > max_nodes or size.edges > MAX_TEMPLATE_EDGES:
        raise SigpropError(
            "graph_too_large",
            f"template '{t.template}' with depth {t.depth} expands to {size.nodes} nodes and {size.edges} edges",
            f"templates expand to at most {max_nodes} nodes (SIGPROP_MAX_NODES) "
            f"and {MAX_TEMPLATE_EDGES} edges: use a smaller depth",
        )


def expand_template(t: Template, *, max_nodes: int = DEFAULT_MAX_NODES) -> Graph:
    """The node-by-node graph (schema ``sigprop.graph/v1``) of a template: ``expand_template_nodes``
    validated as one graph, so the two expansions are one.

    Raises ``SigpropError("invalid_request", ...)`` for an unknown template, a parameter that does
    not apply to the template, a missing required parameter or an unsupported value (the hint
    lists what is allowed), and ``SigpropError("graph_too_large", ...)`` when the expansion would
    exceed ``max_nodes`` nodes or ``MAX_TEMPLATE_EDGES`` edges.
    """
    nodes = expand_template_nodes(t, max_nodes=max_nodes)
    try:
        return nodes.graph()
    except ValidationError as exc:  # a check of the whole graph that no single node fails
        raise _invalid_expansion(t, exc) from None


def expand_template_nodes(
    t: Template, *, max_nodes: int = DEFAULT_MAX_NODES, size: TemplateSize | None = None
) -> TemplateNodes:
    """``expand_template(t).nodes`` as far as ``engine.graph.build.build_graph`` reads them (the same
    fields, as plain attributes; ``_Builder.engine_nodes``), built several times faster: what a
    solve request's template expands to. ``size``: the template's size when the caller computed
    it already (admission did). Raises as ``expand_template``."""
    builder = _expand(t, max_nodes, size)
    found = builder.engine_nodes()
    if found is None:
        try:
            return TemplateNodes.of(builder.nodes, builder.graph().nodes)  # raises the schema's error
        except ValidationError as exc:
            raise _invalid_expansion(t, exc) from None
    return found


def _expand(t: Template, max_nodes: int, size: TemplateSize | None = None) -> _Builder:
    """The template's nodes, once its fields and its size are checked (see ``expand_template``)."""
    name = t.template
    spec = TEMPLATES.get(name)
    if spec is None:
        raise _bad(f"unknown template '{name}'", f"use one of {', '.join(TEMPLATE_NAMES)}")
    extra = [f for f in _ALL_FIELDS if f not in spec.fields and getattr(t, f, None) is not None]
    if extra:
        raise _bad(
            f"template '{name}' does not take {', '.join(repr(f) for f in extra)}",
            f"template '{name}' takes {', '.join(spec.fields)}",
        )
    if size is None:
        size = spec.size(t)
    if size is not None:  # None: invalid parameters, which the expander reports
        _check_size(t, size, max_nodes)
    return spec.expand(t)


def _invalid_expansion(t: Template, exc: ValidationError) -> SigpropError:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return _bad(
        f"template '{t.template}' expands to an invalid graph: {first.get('msg')} at {where}",
        "use smaller or default parameter values",
    )
