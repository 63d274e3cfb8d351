"""Applying an answer to a sequence model (``sequence`` input, ``attention`` and ``layer_norm`` nodes).

What :func:`apply_sequence` changes, on a deep copy traced with torch.fx (``apply`` sends sequence
models here; its code for MLPs and CNNs is untouched):

* every attention node's token mixing becomes a :class:`~.attention.ShapedAttention` with the
  answer's generator installed (``attention.layers``, expanded by
  ``sigprop.schemas.attention_init.expand_attention``): the ``F.scaled_dot_product_attention`` call
  and its head plumbing are replaced by one module call on the q, k, v Linear outputs; an
  ``nn.MultiheadAttention`` becomes a :class:`~.attention.ShapedMultiheadAttention` at its path,
  keeping its parameters;
* every dense node is initialized as the answer's layer entry says (a fused qkv Linear and the
  packed ``in_proj`` of nn.MultiheadAttention row block by row block); the query weights and biases
  are zero for E-SPA, U-SPA and Value-SkipInit ("Deep Transformers without Shortcuts", He, Martens
  et al., arXiv:2302.10322, sections 3-4): the logits are then the installed bias alone, so the
  attention matrix at initialization is exactly ``AttentionInit.matrix()``;
* activations and sums as for every model (``TransformedActivation``, ``NormalizedSum``);
* LayerNorm affine parameters are reset to the identity (weight 1, bias 0), an RMSNorm's weight to
  1, what the answer's ``layer_norm`` and ``rms_norm`` nodes assume; products (``mul``) have no
  parameters and stay as they are.
"""

from __future__ import annotations

import copy
import json
import operator
import re
from collections.abc import Mapping
from types import SimpleNamespace

import torch
from torch import nn

from ...schemas.attention_init import expand_attention
from ...schemas.shapings import zero_query_shapings
from ...schemas.solve import LayerInit, Solution
from ..solution import as_solution
from .attention import ShapedAttention, ShapedMultiheadAttention
from .extraction import extract
from .rewrite import (
    ApplyReport,
    LayerChange,
    _apply_activations,
    _apply_output,
    _apply_sums,
    _example_from_graph,
    _reinit,
    _report_uncovered,
    _Rewrite,
)
from .sequence import SequenceExtraction

__all__ = ["apply_sequence", "answer_part", "is_sequence_graph", "ZERO_QUERY_SHAPINGS"]

# the shapings whose query starts at zero (``schemas.shapings``)
ZERO_QUERY_SHAPINGS = zero_query_shapings()


def answer_part(solution, key: str):
    """The answer's top-level ``key`` as plain JSON data (None when absent), whatever form the
    answer came in (``Solution``, its JSON, a dict)."""
    if isinstance(solution, (str, bytes)):
        solution = json.loads(solution)
    if isinstance(solution, Mapping):
        return solution.get(key)
    value = getattr(solution, key, None)
    if value is None and getattr(solution, "model_extra", None):
        value = solution.model_extra.get(key)
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json", exclude_none=True)
    return value


def is_sequence_graph(graph) -> bool:
    """Whether a graph's input is a ``sequence`` input."""
    if not isinstance(graph, Mapping):
        return False
    return any(nd.get("op") == "input" and nd.get("sequence") for nd in graph.get("nodes", []))


def _layer_note(layer: LayerInit, part) -> str | None:
    """Why answer layer ``layer`` does not fit dense part ``part``, else None."""
    m = part.module
    fan_in = m.embed_dim if part.packed else m.in_features
    if layer.op != "dense" or layer.fan_in != fan_in or layer.fan_out != part.hi - part.lo:
        return (
            f"answer layer '{layer.id}' is a {layer.op} {layer.fan_in} -> {layer.fan_out} but '{part.path}' rows "
            f"{part.lo}:{part.hi} are a dense {fan_in} -> {part.hi - part.lo}; not applied"
        )
    return None


def _rows(part) -> SimpleNamespace:
    """The weight and bias rows of a dense part, as views _reinit writes through."""
    m = part.module
    w = m.in_proj_weight if part.packed else m.weight
    b = m.in_proj_bias if part.packed else m.bias
    return SimpleNamespace(weight=w[part.lo : part.hi], bias=None if b is None else b[part.lo : part.hi])


def _apply_dense(rw: _Rewrite, ext: SequenceExtraction, sol: Solution, generator, zero_queries: set) -> set[int]:
    """Initialize every dense part the answer lists; zero the query parts in ``zero_queries``.
    Returns the ids of the modules wholly initialized."""
    done: dict[int, set] = {}
    by_id = {layer.id: layer for layer in sol.layers}
    for gid, part in ext.parts.items():
        layer = by_id.pop(gid, None)
        if gid in zero_queries:
            with torch.no_grad():
                rows = _rows(part)
                rows.weight.zero_()
                if rows.bias is not None:
                    rows.bias.zero_()
            bias = "zeros" if rows.bias is not None else "none"
            rw.report.layers.append(LayerChange(gid, part.path, "dense", "zeros (query)", 0.0, 0.0, bias))
        elif layer is None:
            continue
        else:
            why = _layer_note(layer, part)
            if why is not None:
                rw.report.missing_layers.append(layer.id)
                rw.report.warnings.append(why)
                continue
            bias = _reinit(_rows(part), layer, generator)
            rw.report.layers.append(
                LayerChange(
                    gid, part.path, "dense", layer.distribution, layer.gain, layer.weight_variance, bias,
                    layer.bias_variance,
                )
            )  # fmt: skip
        done.setdefault(id(part.module), set()).add((part.lo, part.hi))
    for layer in by_id.values():
        rw.report.missing_layers.append(layer.id)
        rw.report.warnings.append(f"answer layer '{layer.id}' ({layer.op}) has no Linear in the model; not applied")
    whole = set()
    for part in ext.parts.values():
        m = part.module
        rows = 3 * m.embed_dim if part.packed else m.out_features
        if sum(hi - lo for lo, hi in done.get(id(m), ())) == rows:
            whole.add(id(m))
    return whole


def _install(rw: _Rewrite, ext: SequenceExtraction, generators: dict) -> list:
    """Replace every attention site's token mixing by a ShapedAttention with its answer's
    generator; returns the (site, module, generator) installed."""
    gm, graph = rw.gm, rw.gm.graph
    installed = []
    for gid, site in ext.sites.items():
        own = isinstance(site.module, ShapedAttention)  # the model's own: the answer installed in place
        mixer = site.module if own else ShapedAttention(site.heads, site.seq_len, site.causal, d_model=site.d_model)
        gen = generators.get(gid)
        if gen is None:
            rw.report.missing_layers.append(gid)
            rw.report.warnings.append(f"attention '{gid}' has no generator in the answer: left as plain attention")
        else:
            init = expand_attention(gen, mixer.max_len, site.causal)
            mixer.load_init(init, gen.get("form") == "value_skipinit")
        if own:
            path = site.node.target
        elif site.module is not None:  # nn.MultiheadAttention: swapped at its path, same parameters
            gm.add_submodule(site.node.target, ShapedMultiheadAttention(site.module, mixer))
            path = f"{site.node.target}.attention"
        else:
            path = "sigprop_attn_" + re.sub(r"[^A-Za-z0-9_]", "_", gid)
            while hasattr(gm, path):
                path += "_"
            gm.add_submodule(path, mixer)
            with graph.inserting_before(site.merged):
                args = []
                for lin, part in zip(site.linears, site.parts, strict=True):
                    if part.lo == 0 and part.hi == part.module.out_features:
                        args.append(lin)
                    else:  # a block of a fused qkv Linear's output
                        cut = (Ellipsis, slice(part.lo, part.hi))
                        args.append(graph.call_function(operator.getitem, (lin, cut)))
                call = graph.call_module(path, tuple(args))
            site.merged.replace_all_uses_with(call)
            rw.out_of_place.append(f"attention '{gid}' ({site.node.name})")
        installed.append((site, path, gen))
    unknown = sorted(set(generators) - set(ext.sites))
    if unknown:
        rw.report.warnings.append(f"answer attention layers not in the model: {', '.join(unknown[:10])}")
    return installed


def _reset_layer_norms(ext: SequenceExtraction, report: ApplyReport) -> set[int]:
    """LayerNorm and RMSNorm affine parameters at the identity (weight 1, bias 0): what the answer's
    ``layer_norm`` and ``rms_norm`` nodes are."""
    done = set()
    ops = {nd["id"]: nd["op"] for nd in ext.graph["nodes"]}
    for gid, (_node, m) in ext.layer_norms.items():
        if m is None or not m.elementwise_affine:
            continue
        bias = getattr(m, "bias", None)  # nn.RMSNorm has none
        with torch.no_grad():
            m.weight.fill_(1.0)
            if bias is not None:
                bias.zero_()
        done.add(id(m))
        what = "affine parameters reset to the identity (weight 1, bias 0)" if bias is not None else "weight reset to 1"
        report.notes.append(f"{ops.get(gid, 'layer_norm')} '{gid}': {what}")
    return done


def _probes(ext: SequenceExtraction, report: ApplyReport, installed: list) -> dict[str, tuple[str, str]]:
    """Graph id -> (module path in the rewritten model, op): the nodes diagnose can hook."""
    probes: dict[str, tuple[str, str]] = {}
    zeroed = {c.id for c in report.layers if c.distribution.startswith("zeros")}
    for gid, part in ext.parts.items():
        if not part.packed and part.lo == 0 and part.hi == part.module.out_features:
            probes[gid] = (part.path, "query" if gid in zeroed else "dense")
    for site, path, _ in installed:
        probes[site.gid] = (path, "attention")
    for c in report.activations:
        probes[c.id] = (c.module, "activation")
    for c in report.sums:
        probes[c.id] = (c.module, "sum")
    ops = {nd["id"]: nd["op"] for nd in ext.graph["nodes"]}
    for gid, (node, m) in ext.layer_norms.items():
        if m is not None:
            probes[gid] = (node.target, ops.get(gid, "layer_norm"))
    order = {nd["id"]: k for k, nd in enumerate(ext.graph["nodes"])}
    return dict(sorted(probes.items(), key=lambda kv: order.get(kv[0], len(order))))


def apply_sequence(
    model: nn.Module,
    solution,
    *,
    graph: Mapping | None,
    example_input: torch.Tensor | None,
    inplace: bool,
    seed: int | None,
    residual: str,
) -> ApplyReport:
    """``apply`` for a sequence model (module docstring)."""
    if inplace:
        raise ValueError(
            "apply(inplace=True) is not available for sequence models: the attention calls live in forward's code, "
            "which only the rewritten GraphModule changes. Use inplace=False (the default) and train report.model"
        )
    sol = as_solution(solution)
    attention = answer_part(solution, "attention") or {}
    generators = {entry["node"]: entry["generator"] for entry in attention.get("layers", [])}
    shaping = attention.get("shaping")
    target = copy.deepcopy(model)
    if example_input is None:
        if graph is None:
            raise ValueError("apply needs example_input or the graph the answer was solved for")
        example_input = _example_from_graph(dict(graph), target)
    ext = extract(target, example_input, allow_unsupported=True, keep_fn=False, warn=False)
    if not isinstance(ext, SequenceExtraction):
        raise ValueError("the answer is for a sequence graph but the model does not read as a sequence model")
    report = ApplyReport(model=ext.gm, method=sol.method, activation=sol.activation, residual=residual)
    report.warnings.extend(f"not applied: {w}" for w in ext.warnings)
    if ext.sites and not generators:
        report.warnings.append(
            "the answer has no attention generators (request 'attention'): attention left as plain softmax attention"
        )
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    solved_nodes = {nd["id"]: nd for nd in (dict(graph) if graph is not None else ext.graph).get("nodes", [])}
    rw = _Rewrite(ext, report)
    _apply_activations(rw, sol, solved_nodes)
    _apply_sums(rw, sol, solved_nodes, residual)
    zero = {site.parts[0].gid for site in ext.sites.values()} if shaping in ZERO_QUERY_SHAPINGS else set()
    initialized = _apply_dense(rw, ext, sol, generator, zero)
    installed = _install(rw, ext, generators)
    initialized |= {id(site.module) for site in ext.sites.values() if isinstance(site.module, ShapedAttention)}
    for site, path, gen in installed:
        form = gen.get("form") if gen else "plain"
        report.notes.append(
            f"attention '{site.gid}': {path} = ShapedAttention(heads={site.heads}, causal={site.causal}), {form}"
        )
    initialized |= _reset_layer_norms(ext, report)
    _apply_output(rw, sol)
    _report_uncovered(target, ext, initialized, report)
    gm = ext.gm
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    gm.train(model.training)
    gm.sigprop_sequence = {
        "graph": copy.deepcopy(dict(graph) if graph is not None else ext.graph),
        "attention": {site.gid: path for site, path, _ in installed},
        "probes": _probes(ext, report, installed),
    }
    return report
