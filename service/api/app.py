"""The FastAPI application: routers, error handlers, middleware (contract sections 2-3)."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import ENGINE_VERSION, __version__
from ..cache import CacheUnavailable, make_cache
from ..engine.solve import solve
from ..engine.templates import TEMPLATE_NAMES, describe_templates, expand_template
from ..errors import SigpropError
from ..schemas.graph import Template
from ..schemas.solve import ErrorResponse, Solution, SolveRequest
from ..schemas.validation import ValidationRequest
from ..settings import Settings, get_settings
from .auth import KeyChecker, client_identity, open_access
from .observability import BodyLimitMiddleware, RequestContextMiddleware, configure_logging, metrics_payload
from .ratelimit import make_limits
from .dashboard import dashboard_router
from .solutions import SolutionService
from .validations import validations_router

ERRORS = {code: {"model": ErrorResponse} for code in (401, 403, 404, 413, 422, 503)}
LIMITED = {429: {"model": ErrorResponse, "description": "rate_limited: over the client's budget; see Retry-After",
                 "headers": {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}}}


def _error(err: SigpropError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)


_HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


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


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logger = configure_logging(settings.log_level)
    cache = make_cache(settings)
    limit_cold, limit_validations = make_limits(settings)
    service = SolutionService(cache, settings.max_nodes, settings.lock_timeout_s, settings.solve_timeout_s,
                              max_depth=settings.max_depth, max_fan_in=settings.max_fan_in,
                              limit_cold=limit_cold if limit_cold.enabled else None)
    # Solves run here, off the event loop, so a slow one cannot block other requests.
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="sigprop-solve")
    require_key = KeyChecker(settings.api_keys)
    # SIGPROP_KEYS_FOR_READS: the same checker guards POST /v1/solve and every read (FastAPI runs a
    # dependency once per request, so a route that needs the key anyway checks it once)
    read_key = require_key if settings.keys_for_reads else open_access
    identify = lambda request: client_identity(request, require_key)  # noqa: E731
    state = {"warm": False}

    @asynccontextmanager
    async def lifespan(_app):
        # One tiny solve imports and exercises the engine before readyz says ready.
        await asyncio.get_running_loop().run_in_executor(pool, lambda: solve(SolveRequest.model_validate(
            {"graph": {"template": "mlp", "depth": 2, "width": 4}, "method": "tat", "activation": "leaky_relu",
             "targets": {"eta": 0.1}})))
        state["warm"] = True
        yield
        validations.close()  # local (no-Redis) validations still running end "failed": interrupted
        pool.shutdown(wait=True)  # in-flight solves finish before the process exits
        cache.close()

    app = FastAPI(title="sigprop", version=__version__, lifespan=lifespan,
                  description="Solve activation transformations and initializations for any network graph.")
    app.state.settings = settings
    app.state.cache = cache
    app.state.service = service

    @app.exception_handler(SigpropError)
    async def sigprop_error(_request, err: SigpropError):
        return _error(err)

    @app.exception_handler(CacheUnavailable)
    async def cache_down(_request, exc: CacheUnavailable):
        return _error(SigpropError("cache_unavailable", "the solution store cannot be reached right now",
                                   "retry shortly; POST /v1/solve keeps answering without the store", 503))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(SigpropError("invalid_request", f"{where}: {first.get('msg', 'invalid value')}",
                                   "see the OpenAPI description at /docs for this endpoint's parameters"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err = SigpropError("not_found", "no such endpoint", "see /docs for the endpoints", 404)
        elif exc.status_code == 405:
            # RFC 9110 wants Allow; Starlette's names only the first route on the path, so list all
            allow = _allowed_methods(request) or (exc.headers or {}).get("Allow", "")
            err = SigpropError("method_not_allowed", "this endpoint does not take that HTTP method",
                               f"this endpoint takes {allow}" if allow else "see /docs", 405,
                               headers={"Allow": allow} if allow else None)
        else:
            err = SigpropError("http_error", str(exc.detail), "see /docs", exc.status_code)
        return _error(err)

    async def run(fn, *args):
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(pool, fn, *args), timeout=settings.solve_timeout_s)
        except asyncio.TimeoutError:
            raise SigpropError("solve_timeout", f"the solve took longer than {settings.solve_timeout_s:g} s",
                               "try a smaller graph or retry later; the answer is cached once it finishes") from None

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(read_key)])

    @v1.post("/solve", response_model=Solution, responses={**ERRORS, **LIMITED},
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/SolveRequest"}}}}})
    async def post_solve(request: Request):
        outcome = await run(service.solve, await request.body(), identify(request))
        return Response(outcome.body, media_type="application/json", headers={"X-Sigprop-Key": outcome.key})

    @v1.get("/solutions", responses=ERRORS)
    async def list_solutions(offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
                             limit: Annotated[int, Query(ge=1, le=500)] = 50,
                             method: Annotated[str | None, Query(max_length=32, pattern=r"^[A-Za-z0-9_]+$")] = None,
                             activation: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_]+$")] = None):
        return await run(service.list, offset, limit, method, activation)

    @v1.get("/solutions/{key}", responses=ERRORS)
    async def get_solution(key: Annotated[str, Path(max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]):
        return await run(service.get, key)

    @v1.delete("/solutions/{key}", responses=ERRORS, dependencies=[Depends(require_key)])
    async def delete_solution(key: Annotated[str, Path(max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]):
        return await run(service.delete, key)

    @v1.get("/templates")
    async def templates():
        return describe_templates()

    @v1.get("/templates/{name}", responses=ERRORS)
    async def template(name: str, request: Request):
        if name not in TEMPLATE_NAMES:
            raise SigpropError("not_found", f"no template named '{name}'", f"templates: {', '.join(TEMPLATE_NAMES)}")
        params: dict = {"template": name}
        for k, v in request.query_params.items():
            if k == "input_shape":
                try:
                    v = json.loads(v)
                except (ValueError, RecursionError):
                    raise SigpropError("invalid_request", f"input_shape={v[:100]!r} is not a JSON list",
                                       "write it as input_shape=[3,32,32]") from None
            params[k] = v
        try:
            t = Template.model_validate(params)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "query"
            raise SigpropError("invalid_request", f"{where}: {first.get('msg')}",
                               f"see GET /v1/templates for the parameters of '{name}'") from None
        service.check_size(t)  # from the parameters, before building anything (graph_too_large)
        return json.loads(expand_template(t).model_dump_json(by_alias=True))

    app.include_router(v1)
    validations_routes, validations = validations_router(settings, service, require_key, run,
                                                         limit=limit_validations, identify=identify)
    app.include_router(validations_routes, dependencies=[Depends(read_key)])
    app.include_router(dashboard_router(settings, service, validations, dependencies=[Depends(read_key)]))

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "version": __version__, "engine_version": ENGINE_VERSION}

    @app.get("/readyz")
    async def readyz():
        cache_ok = await asyncio.get_running_loop().run_in_executor(pool, cache.ping)
        body = {"status": "ready" if cache_ok and state["warm"] else "not_ready", "cache": cache.backend,
                "cache_reachable": cache_ok, "engine_warm": state["warm"]}
        return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        payload, ctype = metrics_payload()
        return Response(payload, media_type=ctype)

    def openapi_with_request_model():
        # POST /v1/solve reads the raw body (memoized by digest), so FastAPI does not see its
        # model: put SolveRequest and its parts into the components the route's schema refers to.
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (SolveRequest, ValidationRequest):  # POST /v1/validations reads its raw body too
                request_schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
                components.update(request_schema.pop("$defs", {}))
                components[model.__name__] = request_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi_with_request_model
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, logger=logger)
    return app
