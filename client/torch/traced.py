"""What one trace of a model is worth keeping: ``graph_from_module`` -> ``apply`` -> ``diagnose``
trace the model once.

Tracing (``torch.fx``), shape propagation and the op-by-op classification are the expensive and
fragile part of every client call, and each call used to redo them. A :class:`Trace` keeps their
result without holding the model: the fx graph (a copy no module owns), and each graph node's
entry by fx node *name* and module *path*. :meth:`Trace.bind` turns it back into an
:class:`Extraction` of a given model (the model itself, or a deep copy of it, which
has the same paths) in a fraction of a trace.

Where a trace is kept:

* :class:`TracedGraph`, the ``dict`` ``graph_from_module`` returns: the graph, as before, with the
  trace of the model it came from. ``apply(model, sol, graph=graph)`` reuses it when ``model`` is
  that model, still made of the same modules, and ``example_input`` (when given) has the traced
  shape; otherwise it traces again. Copies, pickles and JSON of it are plain dicts: the trace
  stays with the object ``graph_from_module`` returned.
* :func:`remember` / :func:`recall`: ``apply`` keeps the trace of the model it returns (the
  rewritten GraphModule, or the model itself under ``inplace=True``), with the answer's graph ids,
  for ``diagnose``.

A model is "the same" while its modules are (the same objects at the same paths) and, for a
GraphModule, its graph has the same nodes: what a trace depends on besides ``forward``'s code,
which nothing here can see change (a model whose ``forward`` is replaced after the trace must be
traced again: pass ``graph=None`` or a plain dict).
"""

from __future__ import annotations

import copy
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn

__all__ = ["Entry", "Extraction", "Trace", "TracedGraph", "trace_of", "remember", "recall", "applied_extraction"]


@dataclass
class Entry:
    """One graph node of a traced model: the fx node computing it and what apply needs of it."""

    node: torch.fx.Node
    gid: str
    op: str  # contract op
    inputs: list  # data input fx nodes, in argument order
    attrs: dict
    desc: str  # what the torch node is, for messages
    module: nn.Module | None = None
    fn: str | None = None  # activation function of the original model
    fn_params: dict = field(default_factory=dict)
    unsupported: str | None = None  # why, when mapped to identity under allow_unsupported


@dataclass
class Extraction:
    """A traced model: its GraphModule, the graph, and which fx node is which graph node."""

    gm: torch.fx.GraphModule
    graph: dict
    entries: dict  # fx node -> Entry
    value: dict  # fx node -> graph id of the value it computes
    warnings: list[str]
    traced_modules: set  # qualified names of modules called in forward


@dataclass(frozen=True)
class _EntryRecord:
    key: str  # the fx node the extraction files it under: its node, or what reads that node's value
    name: str  # the fx node's name (unique in its graph)
    gid: str
    op: str
    inputs: tuple[str, ...]  # fx node names
    attrs: dict
    desc: str
    fn: str | None
    fn_params: dict
    unsupported: str | None


@dataclass(frozen=True)
class Trace:
    """An extraction without its model (see the module docstring)."""

    fx_graph: torch.fx.Graph  # owned by no module
    class_name: str
    graph: dict  # the wire graph, activation nodes without ``fn``
    entries: tuple[_EntryRecord, ...]
    value: dict  # fx node name -> graph id of the value it computes
    warnings: tuple[str, ...]
    traced_modules: frozenset
    input_shape: tuple[int, ...]  # the traced input's shape without the batch
    signature: tuple = field(default=(), compare=False)

    @classmethod
    def of(cls, ext: Extraction, model: nn.Module, input_shape) -> Trace:
        """The trace of ``ext``, ``model``'s extraction for inputs of shape ``[batch, *input_shape]``."""
        nodes = [
            {k: v for k, v in nd.items() if not (k == "fn" and nd["op"] == "activation")} for nd in ext.graph["nodes"]
        ]
        records = tuple(
            _EntryRecord(
                key.name,
                e.node.name,
                e.gid,
                e.op,
                tuple(a.name for a in e.inputs),
                dict(e.attrs),
                e.desc,
                e.fn,
                dict(e.fn_params),
                e.unsupported,
            )
            for key, e in ext.entries.items()
        )
        return cls(
            copy.deepcopy(ext.gm.graph),
            type(ext.gm).__name__,
            {**ext.graph, "nodes": nodes},
            records,
            {n.name: gid for n, gid in ext.value.items()},
            tuple(ext.warnings),
            frozenset(ext.traced_modules),
            tuple(int(d) for d in input_shape),
            signature(model),
        )

    def fits(self, model: nn.Module, example_input: torch.Tensor | None) -> bool:
        """Whether this trace is ``model``'s as it is now, for inputs like ``example_input``."""
        if example_input is not None and tuple(example_input.shape[1:]) != self.input_shape:
            return False
        return signature(model) == self.signature

    def bind(self, model: nn.Module) -> Extraction:
        """The extraction of ``model`` (the traced model, or a deep copy of it) this trace describes:
        a fresh GraphModule over ``model``'s modules, without tracing."""
        fx_graph = copy.deepcopy(self.fx_graph)
        gm = torch.fx.GraphModule(model, fx_graph, self.class_name)
        gm.train(model.training)
        by_name = {n.name: n for n in fx_graph.nodes}
        entries = {}
        for r in self.entries:
            node = by_name[r.name]
            module = gm.get_submodule(node.target) if node.op == "call_module" else None
            entries[by_name[r.key]] = Entry(
                node,
                r.gid,
                r.op,
                [by_name[a] for a in r.inputs],
                dict(r.attrs),
                r.desc,
                module=module,
                fn=r.fn,
                fn_params=dict(r.fn_params),
                unsupported=r.unsupported,
            )
        value = {by_name[name]: gid for name, gid in self.value.items()}
        graph = copy.deepcopy(self.graph)
        return Extraction(gm, graph, entries, value, list(self.warnings), set(self.traced_modules))


def signature(model: nn.Module) -> tuple:
    """What a trace of ``model`` depends on that can change without a new model object: which
    module sits at which path, and a GraphModule's nodes."""
    modules = tuple((name, id(m)) for name, m in model.named_modules())
    if isinstance(model, torch.fx.GraphModule):
        return modules, tuple((n.name, n.op, str(n.target)) for n in model.graph.nodes)
    return modules, ()


class TracedGraph(dict):
    """The graph dict of ``graph_from_module``, keeping the trace of the model it came from.

    It is the JSON-ready graph (send it, dump it, edit it: ``apply`` reads its sum weights as it
    reads any graph's); ``copy.copy``, ``copy.deepcopy`` and ``pickle`` give plain dicts."""

    def __init__(self, graph: dict, trace: Trace, model: nn.Module):
        super().__init__(graph)
        self._sigprop_trace = trace
        self._sigprop_model = weakref.ref(model)

    def trace_for(self, model: nn.Module, example_input: torch.Tensor | None) -> Trace | None:
        """The kept trace when it is ``model``'s as it is now (see :meth:`Trace.fits`), else None."""
        if self._sigprop_model() is not model or not self._sigprop_trace.fits(model, example_input):
            return None
        return self._sigprop_trace

    def __copy__(self):
        return dict(self)

    def __deepcopy__(self, memo):
        return copy.deepcopy(dict(self), memo)

    def __reduce__(self):
        return (dict, (dict(self),))


# Models apply returned -> the trace of each, with the solved graph's ids. Weak keys: the entry goes
# with the model, and a Trace holds no reference to it (an unowned fx graph, module paths).
_APPLIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember(model: nn.Module, trace: Trace) -> None:
    _APPLIED[model] = trace


def recall(model: nn.Module, example_input: torch.Tensor | None) -> Trace | None:
    """The trace ``apply`` kept of ``model``, when it still fits it (:meth:`Trace.fits`)."""
    trace = _APPLIED.get(model)
    return trace if trace is not None and trace.fits(model, example_input) else None


def trace_of(graph, model: nn.Module, example_input: torch.Tensor | None) -> Trace | None:
    """The trace a graph passed to ``apply`` carries of ``model``, or None (a plain dict, another
    model, a model changed since)."""
    return graph.trace_for(model, example_input) if isinstance(graph, TracedGraph) else None


def applied_extraction(ext: Extraction, resolve: Callable, sums: dict, traced_names: set[str]) -> Extraction:
    """The extraction of the network ``apply`` rewrote from ``ext`` (``resolve``: an erased fx node
    -> its replacement; ``sums``: sum id -> (the weights it now computes, whether it is a
    residual-beta sum); ``traced_names``: the fx nodes of the trace), for ``diagnose``: the solved
    graph's ids on the nodes that now compute them, each keyed by the fx node whose value the
    network reads (after any multiplier apply inserted: a calibration's, a geometric alpha), sums
    with their new weights (a residual-beta sum is no normalized sum: outside the graph, as a new
    trace sees it)."""
    entries, value, nodes = {}, {}, []
    wire = {nd["id"]: nd for nd in ext.graph["nodes"]}
    for e in ext.entries.values():
        node = resolve(e.node)
        read = node
        while len(read.users) == 1:  # through the multipliers apply inserted after it
            (user,) = read.users
            if user.name in traced_names or user.target is not operator.mul:
                break
            read = user
        ins = [node.args[0]] if e.op == "output" else [resolve(a) for a in e.inputs]
        module = ext.gm.get_submodule(node.target) if node.op == "call_module" else e.module
        nd, op, unsupported = {k: v for k, v in wire[e.gid].items() if k != "fn"}, e.op, e.unsupported
        weights, beta = sums.get(e.gid, (None, False))
        if beta:
            op, ins = "identity", ins[:1]
            unsupported = "a residual-beta sum x + beta/sqrt(L) F(x) is not a normalized sum"
            nd = {"id": e.gid, "op": op, "inputs": nd["inputs"][:1]}
        elif weights is not None:
            nd["weights"] = weights
        nodes.append(nd)
        entries[read] = Entry(node, e.gid, op, ins, e.attrs, e.desc, module, e.fn, e.fn_params, unsupported)
        value[read] = e.gid
    graph = {**ext.graph, "nodes": nodes}
    return Extraction(ext.gm, graph, entries, value, list(ext.warnings), set(ext.traced_modules))
