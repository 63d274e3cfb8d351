"""What every framework adapter shares, with no framework imported: the torch, Keras, Flax and ONNX
readers each walk their own model, then end the same way.

- :class:`Unsupported`: an op the graph cannot express, with what it is and what to do;
- :func:`clean_id`: a framework's name for a layer as a contract node id;
- :func:`finish_graph`: the extraction's tail (one function per activation, the service's
  structure rules, as warnings or a refusal);
- :class:`ApplyReport`: what ``apply`` changed, for the adapters that rewrite a model (PyTorch, Keras).
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..schemas.graph import Graph
from ..schemas.structure import check_structure, wire_structure

__all__ = ["ApplyReport", "Unsupported", "clean_id", "finish_graph"]

# the contract's node ids: printable, no spaces, at most 128 characters
_ID_BAD = re.compile(r"[^A-Za-z0-9_.:\-/\[\]]")
_ID_MAX = 128


class Unsupported(Exception):
    """An op the graph cannot express: ``why`` says what it is, ``hint`` what to do. Each adapter
    subclasses it with the hint that names its own framework's covered layers."""

    default_hint = "replace or remove the op, or write the graph by hand"

    def __init__(self, why: str, hint: str | None = None):
        super().__init__(why)
        self.why = why
        self.hint = hint if hint is not None else self.default_hint


def clean_id(raw: str) -> str:
    """``raw`` as a node id: characters outside the contract's set become ``_``; a name over the
    length limit keeps its head and a hash of the whole, so two long names stay apart."""
    s = _ID_BAD.sub("_", raw) or "node"
    if len(s) > _ID_MAX:
        s = s[: _ID_MAX - 9] + "-" + hashlib.sha1(raw.encode()).hexdigest()[:8]
    return s


def check_assumptions(assumptions: str) -> None:
    if assumptions not in ("strict", "warn"):
        raise ValueError("assumptions must be 'strict' or 'warn'")


def finish_graph(graph: dict, fns: Iterable[str], *, keep_fn: bool, assumptions: str, stacklevel: int = 3) -> None:
    """The end of every ``graph_from_*``: warn when the model uses several activation functions and
    the graph names none (a solve would transform each as the request's one function), then apply
    the service's structure rules (``schemas.structure``): under ``assumptions="strict"`` a graph
    outside the theory raises the service's ``unsupported_structure``, under ``"warn"`` each
    finding is a warning. ``stacklevel`` points the warnings at the user's call."""
    check_assumptions(assumptions)
    own = sorted({f for f in fns if f})
    if len(own) > 1 and not keep_fn:
        warnings.warn(
            f"the model uses several activation functions ({', '.join(own)}); without keep_fn=True the graph "
            "names none, so a solve transforms every activation as the request's one function. "
            "Pass keep_fn=True to solve each function with its own parameters",
            stacklevel=stacklevel,
        )
    ids, report = wire_structure(Graph.model_validate(graph))
    for note in check_structure(ids, report, assumptions):
        warnings.warn(note, stacklevel=stacklevel)


@dataclass
class ApplyReport:
    """What ``apply`` changed and what it could not do. ``model`` is the solved model; each entry
    of ``activations``, ``layers`` and ``sums`` prints as one line of :meth:`summary` (an adapter's
    own change records define ``__str__``)."""

    model: object
    method: str
    activation: str
    activations: list = field(default_factory=list)
    layers: list = field(default_factory=list)
    sums: list = field(default_factory=list)
    missing_layers: list[str] = field(default_factory=list)  # answer layer ids with no layer in the model
    uninitialized: list[str] = field(default_factory=list)  # layers with weights the answer did not cover
    notes: list[str] = field(default_factory=list)  # things the caller must do (input scale, ...)
    warnings: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True when every answer layer was applied and every layer with weights was covered."""
        return not self.missing_layers and not self.uninitialized

    def summary(self) -> str:
        lines = [
            f"sigprop apply ({self.method}, {self.activation}): {len(self.activations)} activation(s) "
            f"transformed, {len(self.layers)} layer(s) re-initialized, {len(self.sums)} add(s) rewritten"
        ]
        lines += [f"  activation {a}" for a in self.activations]
        lines += [f"  layer {a}" for a in self.layers]
        lines += [f"  sum {a}" for a in self.sums]
        lines += self._extra_lines()
        lines += [f"  MISSING: answer layer '{i}' has no layer in the model" for i in self.missing_layers]
        lines += [f"  NOT INITIALIZED: {m}" for m in self.uninitialized]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _extra_lines(self) -> list[str]:
        """An adapter's own lines between the changes and what is missing (PyTorch: calibrations)."""
        return []
