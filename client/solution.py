"""The answer as both adapters take it: a ``Solution``, its JSON text or a parsed dict."""

from __future__ import annotations

from collections.abc import Mapping

from ..schemas.solve import Solution


def as_solution(solution) -> Solution:
    """``solution`` as a ``Solution``: what ``Client.solve`` returns, the answer's JSON (str or
    bytes, e.g. from ``sigprop solve``) or that JSON parsed into a dict."""
    if isinstance(solution, Solution):
        return solution
    if isinstance(solution, (str, bytes)):
        return Solution.model_validate_json(solution)
    if isinstance(solution, Mapping):
        return Solution.model_validate(dict(solution))
    raise TypeError(f"expected a sigprop Solution (or its JSON / dict), got {type(solution).__name__}")
