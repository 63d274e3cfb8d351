"""Applying an answer to a torch model: activations, sums, initializations, rewritten with torch.fx.

See the package docstring (``sigprop.client.torch``) for what :func:`apply` changes; its
:class:`ApplyReport` lists every change and everything that was not done. The steps are in
``rewrite``; sequence models go to ``sequence_apply``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn

from ..calibration import Calibration
from ..solution import as_solution
from .extraction import extract
from .huggingface import is_huggingface
from .huggingface_apply import apply_huggingface
from .rewrite import (
    ActivationChange,
    ApplyReport,
    LayerChange,
    SumChange,
    _apply_activations,
    _apply_layers,
    _apply_output,
    _apply_sums,
    _calibrate,
    _example_from_graph,
    _graph_mismatch,
    _report_uncovered,
    _reset_norms,
    _Rewrite,
)
from .sequence import SequenceExtraction
from .sequence_apply import answer_part, apply_sequence, is_sequence_graph
from .traced import Trace, applied_extraction, remember, trace_of

__all__ = ["apply", "ApplyReport", "ActivationChange", "LayerChange", "SumChange", "Calibration"]


def _commit_in_place(model: nn.Module, target: nn.Module, rw: _Rewrite) -> None:
    """Make ``model`` itself compute the rewritten network ``rw.gm`` built on its copy ``target``.

    Only called when every change was a module swap at the module's own path: the re-initialized
    parameters are copied into ``model``'s tensors (so optimizers and references to them stay
    valid), then each swapped module is set at its path in ``model``."""
    swapped = set(rw.swapped)
    state = {
        k: v for k, v in target.state_dict(keep_vars=False).items() if not any(k.startswith(p + ".") for p in swapped)
    }
    with torch.no_grad():
        own = model.state_dict(keep_vars=True)
        for k, v in state.items():
            own[k].copy_(v)
    for path in rw.swapped:
        model.set_submodule(path, rw.gm.get_submodule(path))


def _refuse_in_place(rw: _Rewrite) -> None:
    """ValueError naming what ``model``'s own forward code computes and the rewrite cannot reach."""
    shown = "; ".join(rw.out_of_place[:8]) + (
        f"; and {len(rw.out_of_place) - 8} more" if len(rw.out_of_place) > 8 else ""
    )
    raise ValueError(
        "apply(inplace=True) cannot make the model itself compute the solved network: these changes live in its "
        f"forward code, which only the rewritten GraphModule changes: {shown}. Use inplace=False (the default) "
        "and train report.model; inplace=True works when every activation and sum is a module of its own "
        "(nn.ReLU, sigprop's NormalizedSum) called once. The model was left unchanged"
    )


def _apply_sequence(model, solution, graph, example_input, inplace, seed, residual) -> ApplyReport:
    return apply_sequence(
        model,
        solution,
        graph=graph,
        example_input=example_input,
        inplace=inplace,
        seed=seed,
        residual=residual,
    )


def apply(
    model: nn.Module,
    solution,
    *,
    graph: Mapping | None = None,
    example_input: torch.Tensor | None = None,
    inplace: bool = False,
    seed: int | None = None,
    residual: Literal["graph", "recommended"] = "graph",
    calibrate: bool = True,
) -> ApplyReport:
    """Rewrite ``model`` as ``solution`` (an answer of ``POST /v1/solve`` for ``graph_from_module(model)``) says.

    Works on a deep copy and returns the rewritten ``torch.fx.GraphModule`` as ``report.model``.
    ``inplace=True`` makes ``model`` itself compute the solved network instead (``report.model``
    is then ``model``): its activation and sum modules are swapped at their own paths and its
    parameters re-initialized in place, so its class, ``state_dict`` keys and existing references
    to its parameters stay. That is only possible when every change is such a swap; an add or an
    activation written in ``forward``'s code (``out + x``, ``F.relu``), a module called at several
    places, or an inserted multiplier (geometric ``alpha``, ``logits_scale``) can only be changed
    in the GraphModule, so then ``inplace=True`` raises ValueError naming them and leaves
    ``model`` untouched (re-initializing its weights while its ReLUs and plain adds stay would give
    a network that is neither the old one nor the solved one).

    ``graph`` is the graph that was solved (its sum weights are used; default: extracted again).
    The graph ``graph_from_module(model, ...)`` returned carries its trace, which is reused while
    ``model`` is made of the same modules (and ``example_input``, if given, has the traced shape):
    ``model`` is then not traced again (``sigprop.client.torch.traced``). The model returned keeps
    its own trace, with the solved graph's ids, for :func:`diagnose`.

    ``example_input`` is needed for shape propagation (default: a random batch of the graph's input
    shape). Given, it also calibrates (``calibrate=True``, the default) the ops whose effect on q
    the answer cannot predict (``sigprop.client.calibration``): max pooling, average pooling of
    locations that differ, ops treated as the identity, and the nodes the answer names as outside
    its predictions. Each one's output is measured on the batch (eval mode) and brought to the q
    the answer predicts there by a factor on the kernel of the layer(s) that read it, else on the
    kernel and bias of the layer that feeds it (pooling), else by a multiplier inserted after it.
    The batch should look like the data (a few examples at least; Gaussian at the answer's input
    q for the answer's own setting). ``report.calibrations`` names each op, its measured effect
    and factor; the model carries them (``sigprop_calibrations``) for :func:`diagnose`.

    ``seed`` makes the re-initialization reproducible. ``residual="recommended"`` weights
    every two-input add with the answer's ``jacobian.recommended`` shortcut and branch weights
    (the per-layer-Jacobian paper's scaling for this depth and width) instead of the solved graph's;
    the report's sums and notes say so (ValueError when the answer carries no recommendation).
    """
    if residual not in ("graph", "recommended"):
        raise ValueError(f"residual must be 'graph' or 'recommended', not {residual!r}")
    sol = as_solution(solution)
    if is_huggingface(model):  # the same HuggingFace class back (huggingface_apply.py)
        if inplace:
            raise ValueError("apply(inplace=True) is not available for HuggingFace models: use the copy it returns")
        return apply_huggingface(
            model, solution, graph=graph, example_input=example_input, seed=seed, residual=residual
        )
    if is_sequence_graph(graph) or answer_part(solution, "attention"):
        return _apply_sequence(model, solution, graph, example_input, inplace, seed, residual)
    target = copy.deepcopy(model)
    measure_on = example_input if calibrate else None
    kept = trace_of(graph, model, example_input)  # graph_from_module's trace of this model, if it still fits
    if kept is not None:
        ext = kept.bind(target)  # the copy has the model's paths: the same extraction, not traced again
    else:
        if example_input is None:
            if graph is None:
                raise ValueError("apply needs example_input or the graph the answer was solved for")
            example_input = _example_from_graph(dict(graph), target)
        ext = extract(target, example_input, allow_unsupported=True, keep_fn=False, warn=False)
        if isinstance(ext, SequenceExtraction):  # no graph given: the model says it is a sequence model
            return _apply_sequence(model, solution, graph, example_input, inplace, seed, residual)
    traced_names = {n.name for n in ext.gm.graph.nodes}
    report = ApplyReport(model=ext.gm, method=sol.method, activation=sol.activation, residual=residual)
    report.warnings.extend(f"not applied: {w}" for w in ext.warnings)
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    solved_nodes = {nd["id"]: nd for nd in (dict(graph) if graph is not None else ext.graph).get("nodes", [])}
    mismatch = _graph_mismatch(solved_nodes, ext) if graph is not None else None
    if mismatch is not None:
        report.warnings.append(mismatch)

    rw = _Rewrite(ext, report)
    _apply_activations(rw, sol, solved_nodes)
    _apply_sums(rw, sol, solved_nodes, residual)
    initialized = _apply_layers(rw, sol, generator)
    initialized |= _reset_norms(ext, report)
    _apply_output(rw, sol)
    _calibrate(rw, sol, measure_on)
    _report_uncovered(target, ext, initialized, report)

    gm = ext.gm
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    gm.train(model.training)
    gm.sigprop_calibrations = list(report.calibrations)
    sums = {c.id: (list(c.weights), c.residual_beta is not None) for c in report.sums}
    applied = applied_extraction(ext, rw.resolve, sums, traced_names)
    input_shape = kept.input_shape if kept is not None else tuple(example_input.shape[1:])
    if inplace:
        if rw.out_of_place:
            _refuse_in_place(rw)
        _commit_in_place(model, target, rw)
        model.sigprop_calibrations = list(report.calibrations)
        report.model = model
    remember(report.model, Trace.of(applied, report.model, input_shape))
    return report
