"""Structured JSON logs with a request id, and Prometheus metrics (prometheus_client).

Every request gets one log line at INFO, except cache hits of ``POST /v1/solve``, at DEBUG
(``SIGPROP_LOG_LEVEL=debug`` shows them): at thousands of hits a second the line cost more than
the hit.

With several uvicorn workers, ``sigprop serve`` points PROMETHEUS_MULTIPROC_DIR at a shared
folder so ``/metrics`` aggregates every worker (the library's multiprocess mode).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time
import uuid

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from starlette.requests import ClientDisconnect

from .http_guards import send_error

REQUESTS = Counter("sigprop_requests_total", "HTTP requests", ["route", "method", "status"])
LATENCY = Histogram(
    "sigprop_request_seconds",
    "HTTP request latency",
    ["route", "method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
# The method label is a closed set: a made-up method answers 405 under "other", so no client can
# grow /metrics by inventing methods.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
CACHE = Counter("sigprop_cache_total", "solution cache lookups", ["result"])  # hit, miss, error
# refused_hit_count, refused_store, refused_validation (the store refused a write: full or
# read-only), evicted_solutions, evicted_validations (retention bounds)
STORAGE = Counter("sigprop_storage_events_total", "writes the store refused, and records retention removed", ["event"])
SOLVE_SECONDS = Histogram(
    "sigprop_solve_seconds",
    "engine solve time",
    ["method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

INLINE_SOLVES = Counter(
    "sigprop_inline_solves_total",
    "small cold solves tried in the API process (api/inline_lane.py): done, over_budget (handed on), busy",
    ["outcome"],
)

# What each API process holds, sampled by probe_state.py; "livesum": with several workers, the sum
# over the live ones. part: hot_answers, body_memo, solver_processes (their resident memory),
# api_process (this process's resident memory).
MEMORY_BYTES = Gauge("sigprop_memory_bytes", "bytes held, by part", ["part"], multiprocess_mode="livesum")
MEMORY_ENTRIES = Gauge("sigprop_memory_entries", "entries held, by part", ["part"], multiprocess_mode="livesum")
SOLVER_PROCESSES = Gauge("sigprop_solver_processes", "solver processes alive", multiprocess_mode="livesum")
OPEN_CONNECTIONS = Gauge("sigprop_open_connections", "open client connections", multiprocess_mode="livesum")
# reason: header_timeout, body_timeout, cap (connections.py)
CONNECTIONS_SHED = Counter("sigprop_connections_shed_total", "client connections closed by the server", ["reason"])


def metrics_payload() -> tuple[bytes, str]:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST


def forget_this_process() -> None:
    """Drop this process's live gauges from the shared metrics folder at exit, so that a restarted
    worker's sizes are not summed with those of the one it replaced."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(os.getpid())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str) -> logging.Logger:
    logger = logging.getLogger("sigprop")
    if not any(isinstance(h.formatter, JsonFormatter) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    return logger


# A request id is this process's random prefix and a counter: unique like a uuid4, without
# reading the system's random source on every request. A forked child draws a prefix of its own.
_ID_PREFIX = uuid.uuid4().hex[:20]
_ID_COUNTER = itertools.count()


def _new_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER) & 0xFFFFFFFFFFFF:012x}"


def _new_id_prefix() -> None:
    global _ID_PREFIX
    _ID_PREFIX = uuid.uuid4().hex[:20]


os.register_at_fork(after_in_child=_new_id_prefix)


# the labelled metric children by (route, method, status): ``labels()`` takes a lock and builds
# its key on every call. Bounded: routes and methods are closed sets, statuses a few dozen.
_CHILDREN: dict[tuple, tuple] = {}


def _count_request(route: str, method: str, status: int, elapsed: float) -> None:
    children = _CHILDREN.get((route, method, status))
    if children is None:
        children = _CHILDREN[(route, method, status)] = (
            REQUESTS.labels(route, method, str(status)),
            LATENCY.labels(route, method),
        )
    children[0].inc()
    children[1].observe(elapsed)


class RequestContextMiddleware:
    """Request id (echoed in X-Request-ID), one JSON log line and the metrics of every request."""

    def __init__(self, app, logger: logging.Logger):
        self.app = app
        self.logger = logger

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or _new_id()
        if not all(c.isalnum() or c in "-_." for c in rid):
            rid = _new_id()
        scope.setdefault("state", {})["request_id"] = rid
        start = time.perf_counter()
        status = [500]
        method = scope["method"] if scope["method"] in HTTP_METHODS else "other"

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message.setdefault("headers", []).append((b"x-request-id", rid.encode()))
            await send(message)

        try:
            if method == "other":
                await _unknown_method(send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            # the client left before its body was whole, or was shed at its body deadline
            # (connections.py): there is no one to answer, and nothing went wrong here
            status[0] = 499  # nginx's "client closed request"
        finally:
            elapsed = time.perf_counter() - start
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            _count_request(path, method, status[0], elapsed)
            # A cache hit is the service's most frequent and least interesting request: its line
            # goes out at DEBUG, so at the default level it costs neither formatting nor a write.
            level = logging.DEBUG if scope["state"].get("cache_hit") else logging.INFO
            if self.logger.isEnabledFor(level):
                self._log(level, scope, rid, path, status[0], elapsed)

    def _log(self, level: int, scope, rid: str, route: str, status: int, elapsed: float) -> None:
        fields = {
            "request_id": rid,
            "method": scope["method"][:16],
            "path": scope["path"],
            "route": route,
            "status": status,
            "ms": round(elapsed * 1000, 3),
        }
        self.logger.log(level, "request", extra={"fields": fields})


class BodyLimitMiddleware:
    """Reject bodies over ``limit`` bytes with 413 before they are read into memory."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _too_large(send, self.limit)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await _too_large(send, self.limit)


class _BodyTooLarge(Exception):
    pass


async def _too_large(send, limit: int):
    await send_error(
        send,
        413,
        "payload_too_large",
        f"the request body is over {limit} bytes",
        "send a smaller graph, use a template, or raise SIGPROP_MAX_BODY_BYTES",
    )


async def _unknown_method(send):
    allowed = ", ".join(sorted(HTTP_METHODS))
    await send_error(
        send,
        405,
        "method_not_allowed",
        "this service does not know that HTTP method",
        f"use one of {allowed}",
        headers=((b"allow", allowed.encode()),),
    )
