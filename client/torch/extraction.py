"""Graph extraction: a ``torch.nn.Module`` traced with ``torch.fx`` to a ``sigprop.graph/v1`` graph.

:func:`graph_from_module` is the public entry; :func:`extract` also keeps what ``apply`` needs to
rewrite the traced model: the ``torch.fx.GraphModule``, which fx node became which graph node, and
what was treated as the identity (:class:`Extraction`, defined with the trace a session keeps in
``traced``).
"""

from __future__ import annotations

import inspect

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from ...schemas.errors import SigpropError
from ...schemas.graph import Graph
from ...schemas.shapes import infer_shapes
from ..adapters import check_assumptions, finish_graph
from .attention import ShapedAttention
from .huggingface import check_ids, is_huggingface, read_huggingface
from .modules import NormalizedSum, TransformedActivation
from .ops import NotYet, hand_written_attention, sequence_module
from .sequence import extract_sequence, is_sequence_trace
from .traced import Entry, Extraction, Trace, TracedGraph
from .walk import Walker

__all__ = ["graph_from_module", "extract", "Entry", "Extraction"]


class _Tracer(torch.fx.Tracer):
    """Keeps sigprop's own modules as leaves, so an applied model can be extracted again."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, (TransformedActivation, NormalizedSum, ShapedAttention)):
            return True
        return super().is_leaf_module(m, qualname)


def _run_shape_prop(gm: torch.fx.GraphModule, example_input) -> None:
    modes = {m: m.training for m in gm.modules()}
    try:
        gm.eval()  # no running-statistics updates, no dropout while we only look at shapes
        with torch.no_grad():
            ShapeProp(gm).propagate(example_input)
    finally:
        for m, mode in modes.items():
            m.training = mode


def _trace(model: nn.Module) -> torch.fx.GraphModule:
    try:
        # optional forward arguments (mask=None, ...) are traced at their defaults, so code like
        # `if mask is not None:` takes the branch the default takes
        params = list(inspect.signature(model.forward).parameters.values())
        concrete = {
            p.name: p.default
            for p in params[1:]
            if p.default is not inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
    except (TypeError, ValueError):
        concrete = {}
    try:
        tracer = _Tracer()
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError, ...
        raise SigpropError(
            "unsupported_op",
            f"torch.fx could not trace {type(model).__name__}.forward: {exc}",
            "make forward traceable (no Python control flow on tensor values), or write the graph by hand",
        ) from exc
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    gm.train(model.training)
    return gm


def extract(model: nn.Module, example_input, allow_unsupported: bool, keep_fn: bool, warn: bool = True) -> Extraction:
    """The model's graph and what apply needs to rewrite the traced model (see :class:`Extraction`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_input, torch.Tensor):
        raise TypeError("example_input must be one batched tensor, e.g. torch.randn(8, 784)")
    if example_input.dim() not in (2, 3, 4):
        raise SigpropError(
            "invalid_graph",
            f"example_input has shape {list(example_input.shape)}",
            "give a batched input: [batch, features], [batch, channels, length] or [batch, channels, height, width]",
        )
    _refuse_sequence_modules(model)
    try:
        gm = _trace(model)
    except SigpropError as exc:
        _refuse_attention_by_name(model, exc.__cause__)  # a trace error inside HuggingFace code says little
        raise
    # forward's first argument is the network input; further arguments must have defaults
    # (e.g. mask=None) and are left at them
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    required = [n for n in placeholders if not n.args]
    if not placeholders or len(required) > 1 or (required and required[0] is not placeholders[0]):
        raise SigpropError(
            "unsupported_op",
            f"forward takes {len(required)} required inputs ({', '.join(n.name for n in required)})",
            "the graph has one input: wrap the model so forward takes one tensor",
        )
    _run_shape_prop(gm, example_input)
    if example_input.dim() == 3:  # before the walk, which would stop at the head plumbing or, allowed, drop it
        why = hand_written_attention(gm)
        if why is not None:
            raise SigpropError("unsupported_op", why, NotYet("").hint)
    if is_sequence_trace(gm, example_input):
        ext = extract_sequence(gm, example_input, allow_unsupported, keep_fn, warn)
        _check_graph(ext.graph, {})
        return ext
    walker = Walker(gm, allow_unsupported, keep_fn, warn)
    graph = walker.run(placeholders[0])
    _check_graph(graph, walker.entries)
    return Extraction(gm, graph, walker.entries, walker.value, walker.notes, walker.traced_modules)


def _refuse_sequence_modules(model: nn.Module) -> None:
    """torch's Transformer blocks, refused by type before tracing: torch.fx cannot trace
    nn.TransformerEncoderLayer (control flow on tensors), so the trace's error would not say what
    is wrong. (nn.MultiheadAttention and F.scaled_dot_product_attention are read by
    ``sequence``.)"""
    for name, m in model.named_modules():
        what = None if isinstance(m, nn.MultiheadAttention) else sequence_module(m, by_name=False)
        if what is not None:
            raise SigpropError(
                "unsupported_op",
                f"module '{name or type(model).__name__}' ({what}) is not supported yet",
                NotYet("").hint,
            )


def _refuse_attention_by_name(model: nn.Module, trace_error: BaseException | None) -> None:
    """After a failed trace: a module class named ``*Attention*`` (HuggingFace's GPT2Attention,
    BertSelfAttention) is refused by name, with fx's own error after it."""
    for name, m in model.named_modules():
        what = sequence_module(m, by_name=bool(name))  # the model's own class name is the user's choice
        if what is not None:
            raise SigpropError(
                "unsupported_op",
                f"module '{name or type(model).__name__}' ({what}) is not supported yet"
                + (
                    f" (and torch.fx could not trace the model: {type(trace_error).__name__}: {trace_error})"
                    if trace_error is not None
                    else ""
                ),
                NotYet("").hint,
            )


def _check_graph(graph: dict, entries: dict) -> None:
    """Validate by the contract's graph rules and check each layer's fan-in against the module."""
    try:
        shapes = infer_shapes(Graph.model_validate(graph))
    except SigpropError as exc:
        raise SigpropError(
            exc.code,
            f"the graph extracted from the model is not valid: {exc.message}",
            exc.hint or "check the ops the message names",
        ) from None
    inputs = {nd["id"]: nd.get("inputs", []) for nd in graph["nodes"]}
    for e in entries.values():
        if e.op not in ("dense", "conv") or e.gid not in shapes:
            continue
        fan_in = shapes[inputs[e.gid][0]][0]
        want = e.module.in_features if e.op == "dense" else e.module.in_channels
        if fan_in != want:
            raise SigpropError(
                "unsupported_op",
                f"node '{e.gid}' ({e.desc}) expects {want} input features but the graph gives it "
                f"{fan_in}: something before it changes shapes in a way the graph does not see",
                "check the nodes treated as the identity (allow_unsupported) before this layer",
            )


def graph_from_module(
    model: nn.Module,
    example_input: torch.Tensor,
    *,
    allow_unsupported: bool = False,
    keep_fn: bool = False,
    assumptions: str = "strict",
) -> dict:
    """The ``sigprop.graph/v1`` graph of ``model`` (a JSON-ready dict), traced with ``torch.fx``.

    Maps ``nn.Linear`` to ``dense``; ``nn.Conv2d`` to ``conv`` and ``nn.Conv1d`` to ``conv`` on a
    ``[channels, length, 1]`` map (kernel ``[k, 1]``); activation modules and calls (ReLU,
    LeakyReLU, Tanh, Sigmoid, Softplus, GELU, SiLU, ELU, SELU, Softsign; ``F.relu``, ``torch.tanh``,
    ``x.relu()``, ...) to ``activation``; an add of two tensors (``+``, ``+=``, ``torch.add``) to a
    ``sum`` with equal weights ``1/sqrt(2)`` (``apply`` makes the add compute exactly that normalized
    sum); ``torch.cat(..., dim=1)`` to ``concat``; max/avg pooling to ``max_pool``/``avg_pool``,
    adaptive average pooling to 1 and a spatial mean to ``global_avg_pool``; flatten/view/reshape to
    ``[batch, features]`` to ``flatten``; dropout to ``dropout``; ``nn.Identity`` to ``identity``; the
    input to ``input`` with ``shape = example_input.shape[1:]`` (``[C, L, 1]`` for a 1-d input);
    ``nn.RMSNorm`` over the features (and ``F.rms_norm`` without a weight) to ``rms_norm`` (``apply``
    resets its weight to 1); a product of two traced tensors of one shape (``*``, ``torch.mul``,
    ``x.mul(y)``: a gated MLP's gate) to ``mul`` (a tensor times a constant is a scale, not a product).

    Activation nodes carry no ``fn`` unless ``keep_fn=True``: a solve replaces every activation with
    the request's (transformed) activation, and a ``fn`` naming the model's own function (``relu``)
    would make the service solve that function instead. That is why ``keep_fn`` stays off by
    default: the usual request replaces the model's function (a ReLU model solved as TAT's
    ``leaky_relu``, or as a smooth function), and with the model's ``relu`` on every node that
    request would solve ReLU, which TAT refuses, and change every cached key. A model that mixes
    functions gets a warning without ``keep_fn``; with ``keep_fn=True`` each node keeps its function,
    the answer carries one parameter set per function (``activations``), and ``apply`` puts each on
    the modules computing it.

    Anything else (other normalization layers, scalings by constants, constants added to the data)
    raises ``SigpropError("unsupported_op")`` naming the node; with ``allow_unsupported=True`` such
    a node becomes an ``identity`` node and a warning says so. The node's ``unsupported`` note says
    what it stands for, so every answer for the graph warns of it too (contract section 1).

    The graph is checked against the kernel theory's assumptions with the service's own rules
    (``sigprop.schemas.structure``): a post-activation residual block (torchvision's ResNet), an
    activation on a shortcut or two activations in a row raise ``SigpropError("unsupported_structure")``
    naming the nodes, as ``POST /v1/solve`` would; ``assumptions="warn"`` returns the graph with a
    warning instead (send the same ``assumptions`` with the solve). ``normalization_free(model,
    preactivation=True)`` rewrites torchvision-style ResNets into the covered pre-activation layout.

    The dict returned is a :class:`~sigprop.client.torch.traced.TracedGraph`: it also keeps this
    trace, which ``apply(model, sol, graph=graph)`` reuses instead of tracing ``model`` again
    (while ``model`` is made of the same modules); its copies and pickles are plain dicts.
    """
    check_assumptions(assumptions)
    if is_huggingface(model):  # read by module, not traced (huggingface.py)
        read = read_huggingface(model, check_ids(model, example_input))
        for nd in read.graph["nodes"] if keep_fn else ():
            if nd["op"] == "activation":
                nd["fn"] = read.fn
        finish_graph(read.graph, [read.fn], keep_fn=keep_fn, assumptions=assumptions)
        return read.graph
    ext = extract(model, example_input, allow_unsupported, keep_fn)
    fns = (e.fn for e in ext.entries.values() if e.op == "activation")
    finish_graph(ext.graph, fns, keep_fn=keep_fn, assumptions=assumptions)
    return TracedGraph(ext.graph, Trace.of(ext, model, example_input.shape[1:]), model)
