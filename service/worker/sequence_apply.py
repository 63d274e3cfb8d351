"""An answer applied to the ``GraphModel`` of a sequence (transformer) graph, in place.

The graph is the validated graph itself, so every node id is a module path of the model
(``GraphModel.paths``): nothing has to be traced or matched. What is applied is what
``sigprop.client.torch.apply`` applies, with the client's own pieces:

* every answer layer (``LayerInit``): the client's re-initialization (orthogonal or Gaussian weights
  with the answer's gain, biases as it says; the query layers' zero weights of E-SPA, U-SPA and
  Value-SkipInit are the answer's layer entries);
* every activation: ``TransformedActivation.from_solution`` (TAT's TReLU, DKS's transformed
  functions);
* every sum: the graph's weights (already in ``NormalizedSum``) times the answer's ``sum_scales``;
* every attention node: the answer's generator expanded with
  ``sigprop.schemas.attention_init.expand_attention`` and loaded with ``ShapedAttention.load_init``
  ("Deep Transformers without Shortcuts", He, Martens et al., arXiv:2302.10322, section 3).

Why not ``apply`` itself: ``apply`` rewrites a traced copy, and finds attention through the
adapter's extraction of sequence models; the worker's model is built from the graph, so it is
applied directly and the returned report says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..client.torch import NormalizedSum, TransformedActivation
from ..client.torch.apply import _reinit
from ..errors import SigpropError
from ..schemas.attention_init import expand_attention
from ..schemas.solve import Solution
from .models import GraphModel

__all__ = ["SequenceApplied", "apply_sequence_solution", "attention_layers"]


@dataclass
class SequenceApplied:
    """What :func:`apply_sequence_solution` did (the facts a validation reports)."""

    layers: list[str] = field(default_factory=list)
    activations: list[str] = field(default_factory=list)
    sums: list[str] = field(default_factory=list)
    attentions: dict[str, str] = field(default_factory=dict)  # node id -> generator form
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "how": "applied to the graph's own model by node id (sigprop.worker.sequence_apply)",
            "complete": not self.warnings,
            "layers": len(self.layers),
            "activations": len(self.activations),
            "sums": len(self.sums),
            "attention": self.attentions,
            "warnings": list(self.warnings),
        }


def _get(obj, key: str, default=None):
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def attention_layers(solution: Solution) -> dict[str, dict]:
    """{attention node id: generator} of the answer's ``attention.layers`` (contract, issue 28)."""
    att = _get(solution, "attention")
    if att is None and solution.model_extra:
        att = solution.model_extra.get("attention")
    out = {}
    for entry in _get(att, "layers", None) or ():
        gen = _get(entry, "generator")
        if hasattr(gen, "model_dump"):
            gen = gen.model_dump(mode="json", exclude_none=True)
        out[str(_get(entry, "node"))] = dict(gen)
    return out


def apply_sequence_solution(model: GraphModel, solution: Solution, *, seed: int | None = None) -> SequenceApplied:
    """Apply ``solution`` to ``model`` (built from the graph the answer was solved for) in place."""
    done = SequenceApplied()
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    for layer in solution.layers:
        path = model.paths.get(layer.id)
        if path is None or layer.id not in model.weighted:
            done.warnings.append(f"answer layer '{layer.id}' is not a weighted layer of the model; not applied")
            continue
        _reinit(model.get_submodule(path), layer, generator)
        done.layers.append(layer.id)
    missing = sorted(set(model.weighted) - set(done.layers))
    if missing:
        done.warnings.append(f"layers without an answer entry keep PyTorch's default init: {', '.join(missing[:8])}")
    for nid in model.activations:
        _swap(model, nid, TransformedActivation.from_solution(solution))
        done.activations.append(nid)
    scales = solution.sum_scales or {}
    for nid in model.sums:
        if nid in scales:
            old = model.module_of(nid)
            _swap(model, nid, NormalizedSum(len(old.weights), [scales[nid] * float(w) for w in old.weights]))
        done.sums.append(nid)
    generators = attention_layers(solution)
    for nid in model.attentions:
        gen = generators.get(nid)
        if gen is None:
            raise SigpropError(
                "invalid_request",
                f"the answer has no attention initialization for node '{nid}'",
                "validate an answer solved for this graph with an 'attention' shaping",
            )
        att = model.module_of(nid)
        att.load_init(expand_attention(gen, att.max_len, att.causal))
        done.attentions[nid] = str(gen.get("form"))
    return done


def _swap(model: GraphModel, nid: str, new: torch.nn.Module) -> None:
    """Replace the module of node ``nid`` (at its path, and in the model's forward plan) by ``new``."""
    path = model.paths[nid]
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, name)
    setattr(parent, name, new)
    model._plan = [(idx, kind, new if mod is old else mod, ins) for idx, kind, mod, ins in model._plan]
