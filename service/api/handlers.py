"""Every error answers the contract's ``{"error": {"code", "message", "hint"}}``: sigprop's own
errors, a cache that cannot be reached, FastAPI's validation errors and Starlette's HTTP errors
(unknown paths, methods a path does not take)."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import SigpropError
from ..requests import invalid_request
from ..storage import CacheUnavailable

_HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def error_response(err: SigpropError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)


def _allowed_methods(request: Request) -> str:
    """The documented methods of the request's path, for a 405's Allow header (RFC 9110).
    Starlette's own header names only the first route on the path (GET, not GET and DELETE)."""
    table = getattr(request.app.state, "allow_table", None)
    if table is None:
        table = []
        for path, ops in request.app.openapi().get("paths", {}).items():
            pattern = re.compile("^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path)) + "$")
            table.append((pattern, {m.upper() for m in ops if m in _HTTP_METHODS}))
        request.app.state.allow_table = table
    methods: set[str] = set()
    for pattern, ops in table:
        if pattern.match(request.url.path):
            methods |= ops
    return ", ".join(sorted(methods))


async def sigprop_error(_request: Request, err: SigpropError) -> JSONResponse:
    return error_response(err)


CACHE_DOWN_ERROR = SigpropError(
    "cache_unavailable",
    "the solution store cannot be reached right now",
    "retry shortly; POST /v1/solve keeps answering without the store",
    503,
)


async def cache_down(_request: Request, _exc: CacheUnavailable) -> JSONResponse:
    return error_response(CACHE_DOWN_ERROR)


async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(
        invalid_request(exc, "see the OpenAPI description at /docs for this endpoint's parameters", default="")
    )


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        err = SigpropError("not_found", "no such endpoint", "see /docs for the endpoints", 404)
    elif exc.status_code == 405:
        # RFC 9110 wants Allow; Starlette's names only the first route on the path, so list all
        allow = _allowed_methods(request) or (exc.headers or {}).get("Allow", "")
        err = SigpropError(
            "method_not_allowed",
            "this endpoint does not take that HTTP method",
            f"this endpoint takes {allow}" if allow else "see /docs",
            405,
            headers={"Allow": allow} if allow else None,
        )
    else:
        err = SigpropError("http_error", str(exc.detail), "see /docs", exc.status_code)
    return error_response(err)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(SigpropError, sigprop_error)
    app.add_exception_handler(CacheUnavailable, cache_down)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
