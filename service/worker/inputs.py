"""What ``run_validation`` accepts, turned into typed inputs: the training fields of a validation
request, the answer to validate and the graph that was solved, each rejected with a contract error
saying what is accepted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from ..engine.templates import expand_template
from ..errors import SigpropError
from ..requests import invalid_request
from ..schemas.graph import Graph, Template
from ..schemas.solve import Solution
from ..schemas.validation import ValidationRequest

_TRAIN_FIELDS = ("dataset", "steps", "batch_size", "optimizer", "lr", "seed", "baselines")


def _training_config(request: Any) -> ValidationRequest:
    """The training fields of a validation request (its solve/key part is the caller's business)."""
    if isinstance(request, ValidationRequest):
        data = request.model_dump()
    elif isinstance(request, Mapping):
        data = dict(request)
    else:
        raise SigpropError(
            "invalid_request",
            f"the validation request is a {type(request).__name__}, not an object",
            'send {"solve": {...}, "dataset": "digits", "steps": 200, ...}',
        )
    fields = {k: data[k] for k in _TRAIN_FIELDS if k in data and data[k] is not None}
    try:
        return ValidationRequest.model_validate({**fields, "key": "0" * 64})
    except ValidationError as exc:
        raise invalid_request(
            exc, "steps >= 1, batch_size >= 1, optimizer 'sgd' or 'adam', lr > 0, baselines among 'he', 'eoc', 'plain'"
        ) from None


def _as_solution(solution: Any) -> Solution:
    if isinstance(solution, Solution):
        return solution
    try:
        if isinstance(solution, (str, bytes)):
            return Solution.model_validate_json(solution)
        if isinstance(solution, Mapping):
            return Solution.model_validate(dict(solution))
    except ValidationError as exc:
        raise SigpropError(
            "invalid_request",
            f"the solution to validate is not a valid answer: {exc.errors()[0]['msg']}",
            "validate an answer of POST /v1/solve",
        ) from None
    raise TypeError(f"solution must be a Solution, its JSON or a dict, not {type(solution).__name__}")


def _as_graph(graph: Any) -> Graph:
    if isinstance(graph, Graph):
        return graph
    if isinstance(graph, Template):
        return expand_template(graph)
    try:
        if isinstance(graph, Mapping) and "template" in graph:
            return expand_template(Template.model_validate(dict(graph)))
        return Graph.model_validate(graph)
    except ValidationError as exc:
        raise invalid_request(
            exc, "give the graph that was solved (sigprop.graph/v1) or its template", "graph", "invalid_graph"
        ) from None


def _request_init(request: Any, solution: Solution) -> str:
    solve = request.get("solve") if isinstance(request, Mapping) else getattr(request, "solve", None)
    if isinstance(solve, Mapping) and solve.get("init") in ("orthogonal", "gaussian"):
        return solve["init"]
    if solve is not None and getattr(solve, "init", None) in ("orthogonal", "gaussian"):
        return solve.init
    return "gaussian" if any(la.distribution == "gaussian" for la in solution.layers) else "orthogonal"
