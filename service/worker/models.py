"""PyTorch networks for validation runs, built from any canonical contract graph.

``build_model(graph, n_classes)`` turns a canonical :class:`~sigprop.engine.graph.build.NetworkGraph`
into an ordinary ``torch.nn.Module`` (:class:`GraphModel`) that executes the graph node by node:

=================  ==================================================================
dense              ``nn.Linear(fan_in, units, bias)``
conv               ``nn.Conv2d`` with the node's kernel and stride; padding ``'same'`` is
                   ``padding='same'`` at stride 1 and the computed symmetric padding otherwise
activation         a module for the node's ``fn`` (PyTorch's own for relu, leaky_relu, tanh,
                   softplus, gelu, gelu_tanh, swish/silu, elu, selu, sigmoid, softsign;
                   sigprop's ``TransformedActivation`` with default parameters for the rest,
                   e.g. the sparsifying relu_tau, soft_threshold, crelu, cst)
sum                ``NormalizedSum`` with the graph's weights (or plain ``x + f(x)``)
concat             ``torch.cat(..., dim=1)``
avg/max_pool       ``nn.AvgPool2d`` / ``nn.MaxPool2d``; max_pool on features: ``PairMax`` (adjacent pairs)
global_avg_pool    a mean over the spatial dims
flatten            ``torch.flatten(x, 1)``
dropout, identity  ``nn.Dropout(rate)``, ``nn.Identity()``
attention          ``sigprop.client.torch.attention.ShapedAttention(heads, seq_len, causal)``
                   called with the node's q, k, v inputs (plain causal softmax attention until
                   an answer's initialization is loaded into it)
layer_norm         ``nn.LayerNorm(width)`` over each token's features (affine identity at init)
rms_norm           ``nn.RMSNorm(width, eps=1e-6)`` over the last axis (scale 1 at init)
mul                ``Product``: the elementwise product of its two inputs
=================  ==================================================================

In a sequence graph (input ``[T, D]``, ``"sequence": true``) tensors are ``(batch, T, features)``:
dense layers act per token on the last axis. The model of a sequence graph has no class output
(``n_classes=None``); ``sigprop.worker.charlm`` puts an embedding before it and a head after it.

Module paths are the graph's node ids: an id ``block_group_0.block_0.conv_1`` is the submodule
``conv_1`` of container ``block_0`` of container ``block_group_0``, so ``graph_from_module`` on the
model gives back the graph's own ids for every weighted layer, activation and sum, and an answer
solved for the graph applies to the model by id. Ids that cannot be module paths (characters such
as ``:`` or ``/``, names of ``nn.Module`` attributes, names torch.fx gives to function calls) get
the path ``m<canonical index>_<id with unsafe characters replaced>``; ``GraphModel.paths`` maps
every node id to its path either way.

:func:`build_solved` is the user-facing route: it extracts the model's graph with
``sigprop.client.torch.graph_from_module``, checks it is the validated graph (same structure,
shapes and sum weights), and applies the answer with ``sigprop.client.torch.apply``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from ..client.torch import ApplyReport, NormalizedSum, TransformedActivation, apply, graph_from_module, native_module
from ..client.torch.attention import ShapedAttention
from ..engine.graph.build import AFFINE, NetworkGraph, build_graph
from ..errors import SigpropError
from ..schemas.activations import PIECEWISE_LINEAR_ACTIVATIONS, SPARSE_ACTIVATIONS
from ..schemas.graph import Graph
from ..schemas.ops import OP_TABLE, SOURCE
from ..schemas.solve import Solution

__all__ = [
    "GraphModel",
    "build_model",
    "activation_module",
    "he_init",
    "build_solved",
    "Built",
    "structure_digest",
    "RELU_FAMILY",
    "SPARSE_ACTIVATIONS",
    "MODULE_BUILDERS",
]

# the activations whose dead units (never on the active side) a validation counts
RELU_FAMILY = PIECEWISE_LINEAR_ACTIVATIONS

_SEGMENT = re.compile(r"^[A-Za-z0-9_]+$")
# names torch.fx gives the nodes GraphModel.forward creates outside modules (the input placeholder,
# torch.cat, Tensor.mean, torch.flatten): graph_from_module ids those nodes by name, so a module
# path equal to one of them would be renamed in the extracted graph
_FX_NAMES = re.compile(r"^(x|cat|mean|flatten|output)(_\d+)?$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


def activation_module(fn: str) -> nn.Module:
    """A module computing the activation ``fn`` (the catalogue's names; 'silu' = 'swish'): PyTorch's
    own where it has one, else sigprop's ``TransformedActivation``, with the catalogue's defaults."""
    native = native_module(fn)  # raises unsupported_activation for an unknown name
    return native if native is not None else TransformedActivation(fn)


class _Container(nn.Module):
    """Holds the modules of dotted ids (``block_0.conv_1``); never called itself."""

    def forward(self, *args):  # pragma: no cover - containers are never called
        raise RuntimeError("a GraphModel container is not callable")


def _reserved(seg: str, top: bool) -> bool:
    if top and (_FX_NAMES.match(seg) or seg.startswith("sigprop_")):
        return True
    return hasattr(torch.fx.GraphModule, seg) or seg in ("meta", "training", "graph", "code")


def _input_shape(graph: NetworkGraph) -> tuple[int, ...]:
    """The shape of the graph's one input node (a validation network takes one)."""
    inputs = [nd for nd in graph.nodes if nd.kind == SOURCE]
    if len(inputs) != 1:
        raise SigpropError(
            "unsupported_op",
            f"the graph has {len(inputs)} input nodes",
            "a validation network takes one input: merge the inputs into one node",
        )
    return tuple(int(s) for s in inputs[0].shape)


def _check_output(graph: NetworkGraph, n_classes: int) -> None:
    """The graph's output must be a vector of one logit per class of the dataset."""
    out_shape = graph.nodes[graph.output].shape
    if len(out_shape) != 1 or out_shape[0] != n_classes:
        last = next((nd for nd in reversed(graph.nodes[: graph.output + 1]) if nd.kind == AFFINE), None)
        what = (
            f"its last weighted layer '{last.user_id}' has {last.shape[0]} "
            f"{'channels' if OP_TABLE[last.op].spatial else 'units'}"
            if last is not None
            else "it has no weighted layer"
        )
        raise SigpropError(
            "invalid_request",
            f"the graph's output has shape {list(out_shape)} ({what}) but the dataset has {n_classes} classes",
            f"end the graph with a dense layer of {n_classes} units: set the template's 'classes' to "
            f"{n_classes}, or the last dense layer's 'units' to {n_classes}",
        )


def _input(model, nd, ins, in_shape, activation, residual):
    return "input", None


def _dense(model, nd, ins, in_shape, activation, residual):
    # per token in a sequence graph ([T, D]): the features are the last axis
    mod = nn.Linear(int(in_shape[-1]), int(nd.attrs["units"]), bias=bool(nd.attrs["bias"]))
    model.weighted.append(nd.user_id)
    return "module", mod


def _conv(model, nd, ins, in_shape, activation, residual):
    mod = nn.Conv2d(
        int(in_shape[0]),
        int(nd.attrs["channels"]),
        kernel_size=tuple(nd.attrs["kernel"]),
        stride=tuple(nd.attrs["stride"]),
        padding=_torch_padding(nd.user_id, nd.attrs, in_shape),
        bias=bool(nd.attrs["bias"]),
    )
    model.weighted.append(nd.user_id)
    return "module", mod


def _activation(model, nd, ins, in_shape, activation, residual):
    mod = activation_module(activation or nd.attrs["fn"])
    model.activations.append(nd.user_id)
    return "module", mod


def _sum(model, nd, ins, in_shape, activation, residual):
    weights = [1.0] * len(ins) if residual == "plain" else list(nd.attrs["weights"])
    mod = NormalizedSum(len(ins), weights)
    model.sums.append(nd.user_id)
    return "sum", mod


def _pool(cls):
    def build(model, nd, ins, in_shape, activation, residual):
        attrs = nd.attrs
        return "module", cls(
            kernel_size=tuple(attrs["kernel"]), stride=tuple(attrs["stride"]), padding=attrs.get("padding", 0)
        )

    return build


def _attention(model, nd, ins, in_shape, activation, residual):
    seq_len, width = (int(v) for v in in_shape)
    mod = ShapedAttention(int(nd.attrs.get("heads", 1)), seq_len, bool(nd.attrs.get("causal", True)), d_model=width)
    model.attentions.append(nd.user_id)
    return "attention", mod


def _layer_norm(model, nd, ins, in_shape, activation, residual):
    mod = nn.LayerNorm(int(in_shape[-1]))
    model.norms.append(nd.user_id)
    return "module", mod


def _rms_norm(model, nd, ins, in_shape, activation, residual):
    mod = nn.RMSNorm(int(in_shape[-1]), eps=1e-6)
    model.norms.append(nd.user_id)
    return "module", mod


class Product(nn.Module):
    """The elementwise product of two tensors of one shape (a ``mul`` node: a gated MLP's gate)."""

    def forward(self, a, b):
        return a * b


class PairMax(nn.Module):
    """max_pool of kernel 2 on features: the maximum of adjacent pairs of the last axis (per example on
    [features], per token on [tokens, features]); the ``max_pool_pairs`` row a ``max_pool`` on features is."""

    def forward(self, x):
        return x.unflatten(-1, (-1, 2)).amax(-1)


def _run(how: str):
    """A node run by ``GraphModel.forward`` itself, with no module."""
    return lambda model, nd, ins, in_shape, activation, residual: (how, None)


# The torch module of each op of the op table (``schemas.ops.OP_TABLE``; a test checks every op has
# one): (model, node, inputs, the first input's shape, activation override, residual mode) ->
# (how ``GraphModel.forward`` runs the node, its module or None), noting weighted, activation, sum,
# attention and norm nodes in the model.
MODULE_BUILDERS = {
    "input": _input,
    "dense": _dense,
    "conv": _conv,
    "activation": _activation,
    "sum": _sum,
    "concat": _run("concat"),
    "avg_pool": _pool(nn.AvgPool2d),
    "max_pool": _pool(nn.MaxPool2d),
    "max_pool_pairs": lambda model, nd, ins, in_shape, activation, residual: ("module", PairMax()),
    "global_avg_pool": _run("global_avg_pool"),
    "flatten": _run("flatten"),
    "dropout": lambda model, nd, ins, in_shape, activation, residual: ("module", nn.Dropout(float(nd.attrs["rate"]))),
    "identity": lambda model, nd, ins, in_shape, activation, residual: ("module", nn.Identity()),
    "attention": _attention,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "mul": lambda model, nd, ins, in_shape, activation, residual: ("product", Product()),
    "output": _run("pass"),
}


def _node_module(
    model: GraphModel, graph: NetworkGraph, nd, activation: str | None, residual: str
) -> tuple[str, nn.Module | None]:
    """(how the forward pass runs the node, its module or None), from its op's builder."""
    ins = tuple(nd.inputs)
    in_shape = graph.nodes[ins[0]].shape if ins else None
    build = MODULE_BUILDERS.get(nd.op)
    if build is None:  # pragma: no cover - build_graph admits no other op
        raise SigpropError("unsupported_op", f"node '{nd.user_id}' has op {nd.op!r}", "")
    return build(model, nd, ins, in_shape, activation, residual)


class GraphModel(nn.Module):
    """A contract graph as a ``torch.nn.Module`` (see the module docstring).

    Attributes: ``paths`` (node id -> module path, for every node with a module), ``weighted``
    (ids of dense/conv nodes, canonical order), ``activations``, ``sums``, ``attentions`` and
    ``norms`` (ids), ``input_shape`` (the graph's input shape) and ``n_classes`` (None for a
    sequence graph's model, whose output is the last token stream).
    """

    def __init__(
        self, graph: NetworkGraph, n_classes: int | None, *, activation: str | None = None, residual: str = "graph"
    ):
        super().__init__()
        if residual not in ("graph", "plain"):
            raise ValueError(f"residual must be 'graph' or 'plain', not {residual!r}")
        # own attributes first: a node id equal to one of them then gets a fallback path
        self.paths: dict[str, str] = {}
        self.weighted: list[str] = []
        self.activations: list[str] = []
        self.sums: list[str] = []
        self.attentions: list[str] = []
        self.norms: list[str] = []
        self.n_classes = None if n_classes is None else int(n_classes)
        self._plan: list[tuple[int, str, Any, tuple[int, ...]]] = []

        self.input_shape = _input_shape(graph)
        if self.n_classes is not None:
            _check_output(graph, self.n_classes)
        self._output = graph.output

        for nd in graph.nodes:
            ins = tuple(nd.inputs)
            kind, mod = _node_module(self, graph, nd, activation, residual)
            if mod is not None:
                self.paths[nd.user_id] = self._place(nd.index, nd.user_id, mod)
            self._plan.append((nd.index, kind, mod, ins))

    def _place(self, index: int, uid: str, mod: nn.Module) -> str:
        segs = uid.split(".")
        ok = (
            all(_SEGMENT.match(s) for s in segs)
            and not _reserved(segs[0], top=True)
            and not any(_reserved(s, top=False) for s in segs[1:])
        )
        if ok:
            parent: nn.Module = self
            for s in segs[:-1]:
                child = parent._modules.get(s)
                if child is None:
                    if hasattr(parent, s):
                        ok = False
                        break
                    child = _Container()
                    parent.add_module(s, child)
                elif not isinstance(child, _Container):
                    ok = False  # the prefix is itself a layer's id
                    break
                parent = child
            if ok and segs[-1] not in parent._modules and not hasattr(parent, segs[-1]):
                parent.add_module(segs[-1], mod)
                return uid
        path = f"m{index}_{_UNSAFE.sub('_', uid)}"[:120]
        self.add_module(path, mod)
        return path

    def module_of(self, node_id: str) -> nn.Module:
        return self.get_submodule(self.paths[node_id])

    def forward(self, x):
        vals: dict[int, Any] = {}
        for idx, kind, mod, ins in self._plan:
            if kind == "input":
                v = x
            elif kind == "module":
                v = mod(vals[ins[0]])
            elif kind == "sum":
                v = mod(*[vals[i] for i in ins])
            elif kind == "attention":
                v = mod(vals[ins[0]], vals[ins[1]], vals[ins[2]])
            elif kind == "product":
                v = mod(vals[ins[0]], vals[ins[1]])
            elif kind == "concat":
                v = torch.cat([vals[i] for i in ins], dim=1)
            elif kind == "global_avg_pool":
                v = vals[ins[0]].mean((2, 3))
            elif kind == "flatten":
                v = torch.flatten(vals[ins[0]], 1)
            else:  # output
                v = vals[ins[0]]
            vals[idx] = v
        return vals[self._output]


def _torch_padding(nid: str, attrs: dict, in_shape) -> Any:
    padding = attrs["padding"]
    kernel, stride = attrs["kernel"], attrs["stride"]
    if padding == "valid":
        return 0
    if not isinstance(padding, str):
        return int(padding)
    if list(stride) == [1, 1]:
        return "same"
    pads = []
    for k, s, n in zip(kernel, stride, in_shape[1:], strict=False):
        out = math.ceil(n / s)
        total = max((out - 1) * s + k - n, 0)
        for p in (total // 2, (total + 1) // 2):
            if (n + 2 * p - k) // s + 1 == out:
                pads.append(p)
                break
        else:
            raise SigpropError(
                "unsupported_op",
                f"conv node '{nid}' (kernel {kernel}, stride {stride}, padding 'same') "
                f"needs asymmetric padding on a {list(in_shape[1:])} map, which nn.Conv2d cannot do",
                "use an odd kernel, stride 1, or an integer padding",
            )
    return tuple(pads)


def build_model(
    graph: NetworkGraph, n_classes: int | None, *, activation: str | None = None, residual: str = "graph"
) -> GraphModel:
    """A ``GraphModel`` executing ``graph``; its output must have ``n_classes`` units.

    ``activation`` replaces every node's ``fn`` (the He baseline uses 'relu'); ``residual='plain'``
    makes every sum an unnormalized ``x + f(x)`` instead of the graph's weighted sum. Parameters
    have PyTorch's default initialization (seed with ``torch.manual_seed`` first).
    """
    return GraphModel(graph, n_classes, activation=activation, residual=residual)


def he_init(model: GraphModel) -> None:
    """Kaiming-normal weights (fan_in, ReLU gain) and zero biases on every dense and conv layer."""
    with torch.no_grad():
        for nid in model.weighted:
            m = model.module_of(nid)
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                m.bias.zero_()


# -- the graph a model extracts to, compared with the graph it was built from ---------------------


def structure_digest(graph: NetworkGraph) -> str:
    """A digest of the graph's structure that is independent of node ids, of the order of sum
    inputs, and of the few spellings ``graph_from_module`` normalizes: conv ``padding`` (the
    output shape is compared instead), a ``flatten`` of a vector (an identity), activation
    functions (a solve replaces them all), and a 2-d input shape ``[a, b]`` (``[a, b, 1]``)."""

    def shape(s) -> list[int]:
        s = [int(v) for v in s]
        return s + [1] if len(s) == 2 else s

    h: list[str] = []
    for nd in graph.nodes:
        op, attrs = nd.op, dict(nd.attrs)
        ins = [h[i] for i in nd.inputs]
        if op == "activation":
            attrs = {}
        elif op == "conv":
            attrs.pop("padding", None)
        elif op == "flatten" and len(graph.nodes[nd.inputs[0]].shape) == 1:
            op = "identity"
        elif op == "input":
            attrs = {"shape": shape(nd.shape)}
        elif op == "sum":
            ins = sorted(zip(ins, (round(float(w), 9) for w in attrs.pop("weights")), strict=False))
        payload = json.dumps([op, attrs, shape(nd.shape), ins], sort_keys=True, default=str)
        h.append(hashlib.sha256(payload.encode()).hexdigest())
    return h[graph.output]


@dataclass
class Built:
    """A solved network ready to train, and how it was made."""

    model: nn.Module  # the GraphModule apply returned
    paths: dict[str, str]  # graph node id -> module path in ``model``
    weighted: list[str]
    activations: list[str]
    report: ApplyReport
    extracted_graph: dict  # what graph_from_module gave for the untransformed model
    solution: Solution  # the answer as applied (layer ids translated to module paths)
    notes: list[str] = field(default_factory=list)


def _translate(solution: Solution, graph: NetworkGraph, paths: dict[str, str]) -> tuple[Solution, list[str]]:
    """The answer with its layer and sum ids (residual beta, ``sum_scales``) replaced by the model's module paths.

    A layer is matched by its canonical node index (``LayerInit.node``) when that node is a
    weighted layer of ``graph`` (so an answer stored under another graph's ids with the same key
    still applies), else by id."""
    sol = solution.model_copy(deep=True)
    notes: list[str] = []
    for layer in sol.layers:
        nd = graph.nodes[layer.node] if 0 <= layer.node < graph.n else None
        uid = nd.user_id if nd is not None and nd.op == layer.op else layer.id
        if uid != layer.id:
            notes.append(f"answer layer '{layer.id}' matched to graph node '{uid}' by its canonical index {layer.node}")
        layer.id = paths.get(uid, uid)
    rb = sol.trainable.residual_beta if sol.trainable is not None else None
    if rb is not None:
        rb.sums = [paths.get(s, s) for s in rb.sums]
    if sol.sum_scales:
        sol.sum_scales = {paths.get(s, s): v for s, v in sol.sum_scales.items()}
    return sol, notes


def build_solved(
    graph: NetworkGraph,
    solution: Solution,
    n_classes: int | None,
    example_input: torch.Tensor,
    *,
    seed: int | None = None,
) -> Built:
    """``solution`` applied to the graph's network the way a user does it.

    Builds the ``GraphModel`` (activations from the graph), extracts its graph with
    ``graph_from_module``, checks the extracted graph has the structure of ``graph``, and calls
    ``apply(model, solution, graph=<extracted>, example_input=...)``.
    """
    base = build_model(graph, n_classes)
    extracted = graph_from_module(base, example_input)
    ext_net = build_graph(Graph.model_validate(extracted), default_activation=solution.activation)
    if structure_digest(ext_net) != structure_digest(graph):
        raise RuntimeError(
            "the graph extracted from the validation model differs from the validated graph "
            f"({ext_net.n} vs {graph.n} nodes); this is a bug in sigprop.worker.models"
        )
    sol, notes = _translate(solution, graph, base.paths)
    report = apply(base, sol, graph=extracted, example_input=example_input, seed=seed)
    if report.missing_layers:
        raise SigpropError(
            "invalid_request",
            f"the answer's layer(s) {', '.join(report.missing_layers[:5])} do not match the graph's weighted layers",
            "validate an answer solved for this graph: " + "; ".join(report.warnings[:3]),
        )
    return Built(
        report.model, dict(base.paths), list(base.weighted), list(base.activations), report, extracted, sol, notes
    )
