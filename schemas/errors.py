"""The one exception type sigprop raises for rejected requests, in the engine, the service and
the client alike.

Each carries the contract's error object (``code``, ``message``, ``hint``) and the HTTP status it
maps to, so the CLI, the HTTP app and the client all speak the same error shape. It lives here, on
the floor the client shares with the service, so that the client can raise it without importing
the service; ``sigprop.errors`` re-exports it for the service's code.
"""

from __future__ import annotations

# Contract codes (section 3) and the status each answers with. Add, never rename.
HTTP_STATUS = {
    "invalid_request": 422,
    "invalid_graph": 422,
    "unsupported_op": 422,
    "unsupported_structure": 422,
    "unsupported_activation": 422,
    "unsupported_method": 422,
    "invalid_target": 422,
    "unreachable_target": 422,
    "graph_too_large": 413,
    "dataset_too_large": 413,
    "validation_too_large": 413,
    "payload_too_large": 413,
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "rate_limited": 429,
    "solve_timeout": 503,
    "cache_unavailable": 503,
    "storage_full": 503,
    "method_not_allowed": 405,
    "unsupported_media_type": 415,
    "headers_too_large": 431,
}


class SigpropError(Exception):
    """A request sigprop rejects, with a message saying what is wrong and a hint what to do."""

    # Its public name: tracebacks spell it out (the validation queue strips the
    # "sigprop.errors.SigpropError: " prefix from a failed job's reason) and pickles look it up there.
    __module__ = "sigprop.errors"

    def __init__(
        self, code: str, message: str, hint: str = "", status: int | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.hint = hint
        self.status = status if status is not None else HTTP_STATUS.get(code, 422)
        self.headers = headers  # extra HTTP response headers (Retry-After, WWW-Authenticate)

    def __str__(self) -> str:
        # The hint is half the error: a traceback, a log line or ``print(err)`` shows what to do too.
        return f"{self.code}: {self.message}" + (f" (hint: {self.hint})" if self.hint else "")

    def to_dict(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "hint": self.hint}}
