"""``/v1/validations`` (contract section 4): submit, follow, list and cancel validation trainings.

``POST /v1/validations`` (API key required) takes a ``ValidationRequest``: ``{"solve": <a /v1/solve
request>}`` is solved first (through the same cache and single flight as ``POST /v1/solve``) and
``{"key": ...}`` loads a stored solution, so the job carries the graph and the answer and a worker
never needs the solver or the cache. It answers 202 ``{"id", "status": "queued"}``.

``GET /v1/validations/{id}`` answers a ``ValidationJob``; ``GET /v1/validations`` lists jobs newest
first (paginated); ``DELETE /v1/validations/{id}`` (key required) cancels: a queued job is removed
at once (200, ``cancelled``), a running one is asked to stop (202, still ``running`` until its job
notices, within about a second, or its worker kills it after the cancel grace); a job already
final is answered unchanged (200).

With ``SIGPROP_REDIS_URL`` the jobs go to RQ and ``sigprop worker`` processes run them; without it
a thread pool in this process runs them and the state lives in the embedded SQLite file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Annotated, Literal

import redis
from fastapi import APIRouter, Depends, Path as PathParam, Query, Request, Response
from pydantic import BaseModel, ValidationError

from ..engine.templates import expand_template
from ..errors import SigpropError
from ..requests import load_json, parse_solve_request
from ..schemas.graph import Template
from ..schemas.solve import ErrorResponse
from ..schemas.validation import ValidationJob, ValidationRequest, ValidationSummary
from ..worker.queue import (ACTIVE, LocalRunner, RedisQueue, RedisValidationStore, SqliteValidationStore,
                            ValidationStore)
from .solutions import SolutionService

ERRORS = {code: {"model": ErrorResponse} for code in (401, 403, 404, 413, 422, 503)}
LIMITED = {429: {"model": ErrorResponse, "description": "rate_limited: over the client's budget; see Retry-After",
                 "headers": {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}}}
DATASETS = ("digits", "synthetic")
ValidationId = Annotated[str, PathParam(max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class Accepted(BaseModel):
    id: str
    status: Literal["queued"] = "queued"


class ValidationList(BaseModel):
    total: int
    offset: int
    limit: int
    items: list[ValidationSummary]


def _unavailable(exc: Exception) -> SigpropError:
    return SigpropError("queue_unavailable", f"the validation store cannot be reached right now ({type(exc).__name__})",
                        "retry shortly", 503)


def _not_found(vid: str) -> SigpropError:
    return SigpropError("not_found", f"no validation has id {vid}", "list validations with GET /v1/validations")


def _check_dataset(name: str) -> None:
    if name in DATASETS or name.endswith(".npz"):
        return
    raise SigpropError("invalid_request", f"dataset: {name!r} is not a dataset",
                       "use 'digits', 'synthetic', or the path of an .npz file on the worker "
                       "(arrays x_train, y_train, x_test, y_test)")


def _parse(body: bytes) -> tuple[dict, ValidationRequest]:
    data = load_json(body, "send {\"solve\": <a /v1/solve request>} or {\"key\": \"<solution key>\"}, plus dataset and steps")
    if not isinstance(data, dict):
        raise SigpropError("invalid_request", "the request body must be a JSON object",
                           "send {\"solve\": <a /v1/solve request>} or {\"key\": \"<solution key>\"}, plus dataset and steps")
    try:
        req = ValidationRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = tuple(first.get("loc", ()))
        if loc[:1] == ("solve",) and isinstance(data.get("solve"), dict):
            parse_solve_request(data["solve"])  # raises the code POST /v1/solve answers (invalid_graph, ...)
        where = ".".join(str(p) for p in loc) or "request"
        raise SigpropError("invalid_request", f"{where}: {first.get('msg', 'invalid value')}",
                           "see ValidationRequest in the OpenAPI description at /docs") from None
    _check_dataset(req.dataset)
    return data, req


def _wire_graph(solve_request) -> dict:
    g = solve_request.graph
    if isinstance(g, Template):
        g = expand_template(g)
    return g.model_dump(mode="json", by_alias=True, exclude_none=True)


class Validations:
    """The logic behind the routes, free of HTTP (called from the app's worker threads)."""

    def __init__(self, store: ValidationStore, queue, solutions: SolutionService, local: bool):
        self.store, self.queue, self.solutions, self.local = store, queue, solutions, local

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except (redis.RedisError, sqlite3.Error, OSError) as exc:
            raise _unavailable(exc) from None

    def prepare(self, body: bytes, client: str | None = None) -> tuple[str, dict, dict]:
        """Validate and resolve a submission: (solution key, request as stored, job payload). Solving
        happens here; nothing is created, so a solve that times out leaves no job behind. A cold
        solve counts against ``client``'s cold-solve budget like one from POST /v1/solve."""
        data, req = _parse(body)
        if req.solve is not None:
            outcome = self.solutions.solve(json.dumps(data["solve"], separators=(",", ":")).encode(), client)
            key, answer, graph = outcome.key, json.loads(outcome.body), _wire_graph(req.solve)
        else:
            record = self.solutions.get(req.key)  # not_found when there is no such solution
            key, answer = req.key, record["answer"]
            graph = _wire_graph(parse_solve_request(record["request"]))
        request = req.model_dump(mode="json", by_alias=True, exclude_none=True)
        return key, request, {"request": request, "graph": graph, "solution": answer}

    def submit(self, prepared: tuple[str, dict, dict]) -> dict:
        key, request, payload = prepared
        vid = uuid.uuid4().hex
        self._guard(self.store.create, vid, key, request, time.time(), os.getpid() if self.local else None)
        try:
            self.queue.submit(vid, payload)
        except (redis.RedisError, OSError) as exc:
            try:
                self.store.update(vid, {"status": "failed", "ended": time.time(),
                                        "error": "could not be queued: the queue was unreachable"}, only_if=ACTIVE)
            except (redis.RedisError, OSError):
                pass
            raise _unavailable(exc) from None
        return {"id": vid, "status": "queued"}

    def get(self, vid: str) -> dict:
        rec = self._guard(self.store.get, vid)
        if rec is None:
            raise _not_found(vid)
        if rec["status"] in ACTIVE and isinstance(self.queue, RedisQueue):
            outcome = self._guard(self.queue.rq_outcome, vid)
            if outcome is not None:  # RQ ended it without sigprop's worker hooks: reflect that
                status, reason = outcome
                if status == "failed":
                    self._guard(self.store.record_failure, vid, reason, False)
                else:
                    self._guard(self.store.mark_cancelled, vid, f"stopped by its worker ({status})")
                rec = self._guard(self.store.get, vid)
        return rec

    def list(self, offset: int, limit: int) -> dict:
        total, items = self._guard(self.store.list, offset, limit)
        return {"total": total, "offset": offset, "limit": limit, "items": items}

    def list_for_key(self, key: str, limit: int = 50) -> dict:
        """The validations of one stored solution, newest first (an index by solution key)."""
        total, items = self._guard(self.store.list_for_key, key, limit)
        return {"total": total, "key": key, "limit": limit, "items": items}

    def cancel(self, vid: str) -> tuple[int, dict]:
        before = self._guard(self.store.request_cancel, vid, time.time())
        if before is None:
            raise _not_found(vid)
        if before == "queued":  # cancelled now: take it off the queue too
            self._guard(self.queue.cancel, vid)
        return (202 if before == "running" else 200), self.get(vid)

    def close(self) -> None:
        self.queue.close()
        self.store.close()


def make_validations(settings, solutions: SolutionService) -> Validations:
    if settings.redis_url:
        timeout = max(settings.redis_timeout_s, 2.0)
        connection = redis.Redis.from_url(settings.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout)
        queue = RedisQueue(connection, settings.validation_queue, settings.validation_timeout_s, settings.validation_retries)
        return Validations(RedisValidationStore(connection), queue, solutions, local=False)
    store = SqliteValidationStore(Path(settings.data_dir) / "solutions.sqlite3")
    store.fail_orphans()
    runner = LocalRunner(store, settings.validation_local_workers, settings.validation_timeout_s)
    return Validations(store, runner, solutions, local=True)


def validations_router(settings, solutions: SolutionService, require_key, run, *, limit=None,
                       identify=None) -> tuple[APIRouter, Validations]:
    """The ``/v1/validations`` routes and the object behind them (``close()`` it on shutdown).
    ``run(fn, *args)`` runs blocking work off the event loop (the app's thread pool);
    ``identify(request)`` names the client and ``limit(identity)`` counts a submission against its
    budget (raises rate_limited), when given."""
    v = make_validations(settings, solutions)
    router = APIRouter(prefix="/v1/validations", tags=["validations"])

    @router.post("", status_code=202, response_model=Accepted, responses={**ERRORS, **LIMITED},
                 dependencies=[Depends(require_key)],
                 openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                     "schema": {"$ref": "#/components/schemas/ValidationRequest"}}}}})
    async def submit_validation(request: Request, response: Response):
        client = identify(request) if identify is not None else None
        if limit is not None and limit.enabled:
            await run(limit, client)  # the limiter may talk to Redis: off the event loop
        prepared = await run(v.prepare, await request.body(), client)
        out = await run(v.submit, prepared)
        response.headers["Location"] = f"/v1/validations/{out['id']}"
        return out

    @router.get("", response_model=ValidationList, responses=ERRORS)
    async def list_validations(offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
                               limit: Annotated[int, Query(ge=1, le=500)] = 50):
        return await run(v.list, offset, limit)

    @router.get("/{vid}", response_model=ValidationJob, responses=ERRORS)
    async def get_validation(vid: ValidationId):
        return await run(v.get, vid)

    @router.delete("/{vid}", response_model=ValidationJob, responses={**ERRORS, 202: {"model": ValidationJob}},
                   dependencies=[Depends(require_key)])
    async def cancel_validation(vid: ValidationId, response: Response):
        status, job = await run(v.cancel, vid)
        response.status_code = status
        return job

    return router, v
