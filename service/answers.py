"""Answer text as the service and the CLI send it: a cached canonical answer relabelled for the
request at hand.

The engine computes each answer once on the anonymized graph (``engine.solve.solve_canonical``);
the cache holds that text, and every request with the same key is served it relabelled with its
own node ids and its own graph warnings, with ``"cached"`` set as it was served. Working on the
text keeps the cache-hit path free of model validation unless warnings must be added.
"""

from __future__ import annotations

from .engine.limits import Limits
from .engine.solve import Prepared, prepare, relabel_text, solve_canonical
from .schemas.solve import Solution, SolveRequest


def personalize_json(canonical_json: str, ids, graph_warnings=(), cached: bool = False) -> str:
    """The request's answer text from the canonical answer text (byte-identical to the CLI's)."""
    text = relabel_text(canonical_json, ids)
    if cached:
        text = text.replace('"cached":false', '"cached":true', 1)
    if graph_warnings:
        answer = Solution.model_validate_json(text)
        answer.warnings = list(graph_warnings) + answer.warnings
        text = answer.to_json()
    return text


def personalize(canonical: Solution, ids, graph_warnings=()) -> Solution:
    """``personalize_json`` on a canonical ``Solution`` object."""
    return Solution.model_validate_json(personalize_json(canonical.to_json(), ids, graph_warnings))


def solve_json(request: SolveRequest, limits: Limits | None = None) -> str:
    """The answer as the CLI prints it and POST /v1/solve sends it (apart from "cached")."""
    return prepared_json(prepare(request, limits))


def prepared_json(prep: Prepared) -> str:
    """``solve_json`` of a request prepared already (``sigprop.preparation``)."""
    return personalize_json(solve_canonical(prep).to_json(), prep.ids, prep.graph.warnings)
