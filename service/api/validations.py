"""The logic behind ``/v1/validations`` (contract section 4; the routes are
``routers/validations.py``), free of HTTP: submit, follow, list and cancel validation trainings.

A submission takes a ``ValidationRequest``: ``{"solve": <a /v1/solve request>}`` is solved first
(through the same cache and single flight as ``POST /v1/solve``) and ``{"key": ...}`` loads a
stored solution, so the job carries the graph and the answer and a worker never needs the solver
or the cache. A cancel removes a queued job at once (200, ``cancelled``) and asks a running one to
stop (202, still ``running`` until its job notices, within about a second, or its worker kills it
after the cancel grace); a job already final is answered unchanged (200).

With ``SIGPROP_REDIS_URL`` the jobs go to RQ and ``sigprop worker`` processes run them; without it
a thread pool in this process runs them and the state lives in the embedded SQLite file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from typing import Protocol

import redis
from pydantic import ValidationError

from ..engine.templates.expand import expand_template
from ..errors import SigpropError
from ..requests import invalid_request, load_json, parse_solve_request
from ..schemas.graph import Template
from ..schemas.validation import ValidationRequest
from ..storage import (
    ACTIVE,
    RedisValidationStore,
    SqliteValidationStore,
    UnreadableRecord,
    ValidationStore,
    retention,
    sqlite_path,
    write_refused,
)
from ..worker.charlm_plan import plan_charlm
from ..worker.classify_plan import plan_classify
from ..worker.dataset_policy import DatasetPolicy, graph_input_shape
from ..worker.local import LocalRunner
from ..worker.queue import RedisQueue
from .auth import EVERYONE, Viewer
from .observability import STORAGE
from .solutions import SolutionService

DATASETS = ("digits", "synthetic", "stdlib")


class Runner(Protocol):
    """What runs the jobs: ``worker.queue.RedisQueue`` (RQ) or ``worker.local.LocalRunner``."""

    def submit(self, vid: str, payload: dict) -> None: ...

    def cancel(self, vid: str) -> None:
        """Take a queued job off the queue (its record is already ``cancelled``)."""
        ...

    def outcome(self, vid: str) -> tuple[str, str] | None:
        """How the runner ended a job still active in the store, if it did: (status, reason)."""
        ...

    def close(self) -> None: ...


def _unavailable(exc: Exception) -> SigpropError:
    if write_refused(exc):
        return SigpropError(
            "storage_full",
            "the validation store refuses writes right now (full or read-only): the validation was not accepted",
            "retry later; nothing was queued, so resubmitting "
            "cannot run it twice. Operators: free memory or disk, or lower SIGPROP_VALIDATION_MAX_* "
            "and SIGPROP_CACHE_MAX_*",
            503,
        )
    return SigpropError(
        "queue_unavailable",
        f"the validation store cannot be reached right now ({type(exc).__name__})",
        "retry shortly",
        503,
    )


def _not_found(vid: str) -> SigpropError:
    return SigpropError("not_found", f"no validation has id {vid}", "list validations with GET /v1/validations")


# the submitting key's tenant (auth.tenant_of), kept in the stored request and never shown: the
# stores' create() takes the request as it is, so ownership needs no new field in either store
OWNER = "submitted_by"
HIDDEN_ERROR = "(hidden: send an API key to see this validation's error)"
HIDDEN_DATASET = "(an .npz file)"


def redact(rec: dict) -> dict:
    """A validation record as shown without an API key: no raw error text and no dataset file name
    (in the request and in the results)."""
    out = dict(rec)
    if out.get("error"):
        out["error"] = HIDDEN_ERROR
    req = out.get("request")
    if isinstance(req, dict) and str(req.get("dataset", "")).lower().endswith(".npz"):
        out["request"] = {**req, "dataset": HIDDEN_DATASET}
        res = out.get("results")
        if isinstance(res, dict) and isinstance(res.get("dataset"), dict):
            out["results"] = {**res, "dataset": {**res["dataset"], "name": HIDDEN_DATASET}}
    return out


def _check_dataset(name: str) -> None:
    if name in DATASETS or name.endswith(".npz"):
        return
    raise SigpropError(
        "invalid_request",
        f"dataset: {name!r} is not a dataset",
        "use 'digits', 'synthetic', 'stdlib' (text, task 'charlm'), or the name of an .npz file in "
        "SIGPROP_DATASETS_DIR (arrays x_train, y_train, x_test, y_test)",
    )


def _parse(body: bytes) -> tuple[dict, ValidationRequest]:
    data = load_json(body, 'send {"solve": <a /v1/solve request>} or {"key": "<solution key>"}, plus dataset and steps')
    if not isinstance(data, dict):
        raise SigpropError(
            "invalid_request",
            "the request body must be a JSON object",
            'send {"solve": <a /v1/solve request>} or {"key": "<solution key>"}, plus dataset and steps',
        )
    try:
        req = ValidationRequest.model_validate(data)
    except ValidationError as exc:
        if exc.errors()[0].get("loc", ())[:1] == ("solve",) and isinstance(data.get("solve"), dict):
            parse_solve_request(data["solve"])  # raises the code POST /v1/solve answers (invalid_graph, ...)
        raise invalid_request(exc, "see ValidationRequest in the OpenAPI description at /docs") from None
    _check_dataset(req.dataset)
    return data, req


def _wire_graph(solve_request, max_nodes: int) -> dict:
    g = solve_request.graph
    if isinstance(g, Template):
        g = expand_template(g, max_nodes=max_nodes)
    return g.model_dump(mode="json", by_alias=True, exclude_none=True)


class Validations:
    """The logic behind the routes, free of HTTP (called from the app's worker threads)."""

    def __init__(
        self,
        store: ValidationStore,
        queue: Runner,
        solutions: SolutionService,
        local: bool,
        policy: DatasetPolicy | None = None,
    ):
        self.store, self.queue, self.solutions, self.local = store, queue, solutions, local
        # with no policy given: no datasets folder (.npz off) and the settings' default bounds
        self.policy = policy or DatasetPolicy(None, 256_000_000, 16_384)

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except (redis.RedisError, sqlite3.Error, OSError) as exc:
            if write_refused(exc):
                STORAGE.labels("refused_validation").inc()
            raise _unavailable(exc) from None
        except UnreadableRecord as exc:  # a damaged record: answered as missing, never a 500
            raise SigpropError(
                "not_found", f"the stored record is unreadable ({exc})", "list validations with GET /v1/validations"
            ) from None

    def prepare(self, body: bytes, client: str | None = None) -> tuple[str, dict, dict]:
        """Validate and resolve a submission: (solution key, request as stored, job payload). Solving
        happens here; nothing is created, so a solve that times out leaves no job behind. A cold
        solve counts against ``client``'s cold-solve budget like one from POST /v1/solve."""
        data, req = _parse(body)
        if req.dataset != "synthetic":  # names and files: refused before anything is solved
            self.policy.check(req.dataset, None)
        if req.solve is not None:
            outcome = self.solutions.solve(json.dumps(data["solve"], separators=(",", ":")).encode(), client)
            graph = _wire_graph(req.solve, self.solutions.limits.max_nodes)
            key, answer = outcome.key, json.loads(outcome.body)
            solve_request = data["solve"]
        else:
            record = self.solutions.get(req.key)  # not_found when there is no such solution
            key, answer = req.key, record["answer"]
            graph = _wire_graph(parse_solve_request(record["request"]), self.solutions.limits.max_nodes)
            solve_request = record["request"]
        if req.dataset == "synthetic":  # its input shape is the graph's, known once the solve checked it
            self.policy.check(req.dataset, graph_input_shape(graph))
        self.policy.check_fit(req.dataset, graph)  # input size and classes: refused now, not on the worker
        request = req.model_dump(mode="json", by_alias=True, exclude_none=True)
        payload = {"request": request, "graph": graph, "solution": answer}
        if req.task == "charlm":
            plan_charlm(request, graph)  # a transformer graph, within the cost bounds: refused now
            payload["solve_request"] = solve_request  # the shortcuts arm is solved with the same fields
        else:
            plan_classify(request, graph)  # its training work and memory, within bounds: refused now
        return key, request, payload

    def submit(self, prepared: tuple[str, dict, dict], tenant: str | None = None) -> dict:
        """Create and enqueue; the record belongs to ``tenant`` (the submitting key's, auth.Viewer)."""
        key, request, payload = prepared
        vid = uuid.uuid4().hex
        trimmed = getattr(self.store, "trimmed", 0)
        stored = {**request, OWNER: tenant} if tenant is not None else request
        self._guard(self.store.create, vid, key, stored, time.time(), os.getpid() if self.local else None)
        if getattr(self.store, "trimmed", 0) > trimmed:  # retention removed old final validations
            STORAGE.labels("evicted_validations").inc(self.store.trimmed - trimmed)
        try:
            self.queue.submit(vid, payload)
        except (redis.RedisError, OSError) as exc:
            try:
                if write_refused(exc):
                    # Redis refuses writes, so marking it failed would fail too; a delete is still
                    # allowed, and a job the client was refused should not show as queued forever.
                    self.store.discard(vid, key)
                else:
                    self.store.update(
                        vid,
                        {
                            "status": "failed",
                            "ended": time.time(),
                            "error": "could not be queued: the queue was unreachable",
                        },
                        only_if=ACTIVE,
                    )
            except (redis.RedisError, OSError):
                pass
            raise _unavailable(exc) from None
        return {"id": vid, "status": "queued"}

    def get(self, vid: str, viewer: Viewer = EVERYONE) -> dict:
        """The record of ``vid`` as ``viewer`` may see it: 404 unless it is theirs (or an admin's
        view); with a key, with its error text and dataset name, else as :func:`redact` shows it."""
        rec = self._owned(vid, viewer)
        if rec["status"] in ACTIVE:
            outcome = self._guard(self.queue.outcome, vid)
            if outcome is not None:  # the queue ended it and no callback recorded that: reflect it
                status, reason = outcome
                if status == "failed":
                    self._guard(self.store.record_failure, vid, reason, False)
                else:
                    self._guard(self.store.mark_cancelled, vid, f"stopped by its worker ({status})")
                rec = self._owned(vid, viewer)
        return _shown(rec, viewer)

    def _owned(self, vid: str, viewer: Viewer) -> dict:
        rec = self._guard(self.store.get, vid)
        if rec is None or not viewer.may_see(_owner(rec)):
            raise _not_found(vid)  # someone else's: answered as missing, never 403
        return rec

    def _visible(self, items: list[dict], viewer: Viewer) -> list[dict]:
        """The summaries ``viewer`` may see. Summaries carry no owner, so a non-admin's page reads
        each record (at most the page's ``limit``, 500) until the stores index owners."""
        if viewer.may_see(None):  # admin, or no keys: everything
            return items
        if viewer.tenant is None:
            return []
        mine = []
        for item in items:
            rec = self._guard(self.store.get, item["id"])
            if rec is not None and viewer.may_see(_owner(rec)):
                mine.append(item)
        return mine

    def list(self, offset: int, limit: int, viewer: Viewer = EVERYONE) -> dict:
        """One page of the newest-first index, with only ``viewer``'s validations in it: ``total``
        counts the index (every tenant's), so paging by offset walks it whole."""
        total, items = self._guard(self.store.list, offset, limit)
        items = self._visible(items, viewer)
        return {
            "total": total,
            "offset": offset,
            "limit": limit,
            "items": items if viewer.full else [redact(i) for i in items],
        }

    def list_for_key(self, key: str, limit: int = 50, viewer: Viewer = EVERYONE) -> dict:
        """The validations of one stored solution, newest first (an index by solution key), those
        ``viewer`` may see."""
        total, items = self._guard(self.store.list_for_key, key, limit)
        items = self._visible(items, viewer)
        if not viewer.may_see(None):
            total = len(items)
        shown = items if viewer.full else [redact(i) for i in items]
        return {"total": total, "key": key, "limit": limit, "items": shown}

    def cancel(self, vid: str, viewer: Viewer = EVERYONE) -> tuple[int, dict]:
        """Cancel ``vid`` for its owner or an admin (404 for anyone else)."""
        self._owned(vid, viewer)
        before = self._guard(self.store.request_cancel, vid, time.time())
        if before is None:
            raise _not_found(vid)
        if before == "queued":  # cancelled now: take it off the queue too
            self._guard(self.queue.cancel, vid)
        return (202 if before == "running" else 200), self.get(vid, viewer)

    def close(self) -> None:
        self.queue.close()
        self.store.close()


def _owner(rec: dict) -> str | None:
    req = rec.get("request")
    owner = req.get(OWNER) if isinstance(req, dict) else None
    return owner if isinstance(owner, str) else None


def _shown(rec: dict, viewer: Viewer) -> dict:
    """``rec`` without its owner, and redacted for a caller without a key."""
    req = rec.get("request")
    if isinstance(req, dict) and OWNER in req:
        rec = {**rec, "request": {k: v for k, v in req.items() if k != OWNER}}
    return rec if viewer.full else redact(rec)


def make_validations(settings, solutions: SolutionService) -> Validations:
    """The validations of these settings (``close()`` them on shutdown): RQ with Redis, else the
    embedded store and a local thread pool (failing the jobs a dead process left behind first)."""
    policy = DatasetPolicy.from_settings(settings)
    if settings.redis_url:
        timeout = max(settings.redis_timeout_s, 2.0)
        connection = redis.Redis.from_url(settings.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout)
        queue = RedisQueue(
            connection, settings.validation_queue, settings.validation_timeout_s, settings.validation_retries
        )
        return Validations(
            RedisValidationStore(connection, **retention(settings)), queue, solutions, local=False, policy=policy
        )
    store = SqliteValidationStore(sqlite_path(settings), **retention(settings))
    store.fail_orphans()
    runner = LocalRunner(store, settings.validation_local_workers, settings.validation_timeout_s, policy)
    return Validations(store, runner, solutions, local=True, policy=policy)
