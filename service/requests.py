"""Turn untrusted JSON into a ``SolveRequest``, mapping pydantic's errors onto the contract's codes.

Shared by the CLI and the HTTP app so both reject the same input with the same error object.
"""

from __future__ import annotations

from pydantic import ValidationError

from .errors import SigpropError
from .schemas.graph import OPS
from .schemas.solve import SolveRequest


def _where(loc) -> str:
    return ".".join(str(p) for p in loc) or "request"


def error_from_validation(exc: ValidationError) -> SigpropError:
    """The most specific contract error for a pydantic ValidationError (first problem wins)."""
    errs = exc.errors(include_url=False)
    first = errs[0]
    loc = tuple(first.get("loc", ()))
    where = _where(loc)
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more problem(s))" if len(errs) > 1 else ""
    if first.get("type") == "union_tag_invalid" or (loc and loc[-1] == "op"):
        return SigpropError("unsupported_op", f"{where}: {msg}", f"supported ops: {', '.join(OPS)}")
    if loc[:1] == ("graph",):
        return SigpropError("invalid_graph", f"{where}: {msg}{more}",
                            "a graph is {\"schema\": \"sigprop.graph/v1\", \"nodes\": [...]} or a template such as "
                            "{\"template\": \"mlp\", \"depth\": 50}; see the contract's op table for node attributes")
    if loc[:1] == ("targets",):
        return SigpropError("invalid_target", f"{where}: {msg}{more}",
                            "targets are finite numbers among eta, tau, zeta, sparsity, v_slope, q_star")
    if loc[:1] == ("method",):
        return SigpropError("unsupported_method", f"{where}: {msg}", "method is one of tat, dks, eoc, sparse_eoc, geometric")
    return SigpropError("invalid_request", f"{where}: {msg}{more}",
                        "a solve request is {\"graph\": ..., \"method\": ..., \"activation\": ..., \"targets\": {...}}")


def parse_solve_request(data) -> SolveRequest:
    if not isinstance(data, dict):
        raise SigpropError("invalid_request", "the request body must be a JSON object",
                           "send {\"graph\": ..., \"method\": ..., \"activation\": ..., \"targets\": {...}}")
    try:
        return SolveRequest.model_validate(data)
    except ValidationError as exc:
        raise error_from_validation(exc) from None
