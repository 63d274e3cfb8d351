"""The solve path behind POST /v1/solve: cache lookup, single flight, solve, store, degrade.

Kept free of HTTP so it reads as the product's logic: routers call it from a worker thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from ..cache import CacheUnavailable, SolutionCache, answer_digest, new_record
from ..engine.solve import personalize_json, prepare, solve_canonical
from ..engine.templates import template_size
from ..errors import SigpropError
from ..requests import SOLVE_HINT, load_json, parse_solve_request
from ..schemas.graph import Template
from .observability import CACHE, SOLVE_SECONDS

log = logging.getLogger("sigprop")
_POLL_S = 0.02
_MEMO_SIZE = 4096
CACHE_DOWN = "the solution cache is unreachable: this answer was solved without it and is not stored"


@dataclass(frozen=True)
class _Parsed:
    """What a request body canonicalizes to: enough to serve a cache hit without parsing it again."""

    key: str
    ids: tuple[str, ...]
    graph_warnings: tuple[str, ...]


@dataclass
class SolveOutcome:
    body: str       # the answer JSON, byte-identical to `sigprop solve` apart from "cached"
    cached: bool
    key: str


class SolutionService:
    def __init__(self, cache: SolutionCache, max_nodes: int, lock_timeout_s: float, wait_timeout_s: float, *,
                 max_depth: int = 10_000, max_fan_in: int = 1024, limit_cold: Callable[[str | None], None] | None = None):
        # body digest -> canonical key and ids: a pure function of the bytes (and the engine
        # version), so repeated bodies skip validation, template expansion and canonicalization.
        self._memo: OrderedDict[bytes, _Parsed] = OrderedDict()
        self._memo_lock = threading.Lock()
        self.cache = cache
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.max_fan_in = max_fan_in
        # called with the client's identity right before a cold solve; raises rate_limited (429)
        self.limit_cold = limit_cold
        self.lock_timeout_s = lock_timeout_s
        self.wait_timeout_s = wait_timeout_s

    # -- cache access that degrades instead of failing -----------------------------------------
    def _lookup(self, key: str, warnings: list[str]) -> str | None:
        """The canonical answer JSON from the cache, or None (missing, corrupt, or cache down)."""
        try:
            text = self.cache.get_answer(key)
        except CacheUnavailable:
            CACHE.labels("error").inc()
            if not warnings:
                warnings.append(CACHE_DOWN)
            return None
        return text

    def solve(self, body: bytes, client: str | None = None) -> SolveOutcome:
        """The answer to a request body. ``client`` is who a cold solve is counted against by
        ``limit_cold`` (None: not limited); cache hits are never counted."""
        digest = hashlib.sha256(body).digest()
        with self._memo_lock:
            parsed = self._memo.get(digest)
        notes: list[str] = []
        if parsed is not None:
            text = self._lookup(parsed.key, notes)
            if text is not None:
                CACHE.labels("hit").inc()
                return SolveOutcome(personalize_json(text, parsed.ids, parsed.graph_warnings, cached=True), True, parsed.key)

        data = load_json(body, SOLVE_HINT)
        request = parse_solve_request(data)
        self.check_size(request.graph)
        prep = prepare(request)
        if prep.graph.n > self.max_nodes:
            raise _too_large(prep.graph.n, self.max_nodes)
        depth = prep.graph.depth()
        if depth > self.max_depth:
            raise _too_deep(depth, self.max_depth)
        parsed = _Parsed(prep.key, tuple(prep.ids), tuple(prep.graph.warnings))
        with self._memo_lock:
            self._memo[digest] = parsed
            if len(self._memo) > _MEMO_SIZE:
                self._memo.popitem(last=False)

        notes = []
        text = self._lookup(prep.key, notes)
        cached = text is not None
        if cached:
            CACHE.labels("hit").inc()
        else:
            if not notes:
                CACHE.labels("miss").inc()
            text, cached = self._solve_once(prep, data, notes, client)
        answer = personalize_json(text, parsed.ids, parsed.graph_warnings + tuple(notes), cached=cached)
        return SolveOutcome(answer, cached, prep.key)

    def check_size(self, graph) -> None:
        """Refuse a graph over the limits before any work on it: a hand-written graph's node count
        and fan-ins, a template's size from its parameters alone (``graph_too_large``, 413)."""
        if isinstance(graph, Template):
            size = template_size(graph)
            if size is None:
                return  # invalid parameters: the expansion says why
            nodes, depth, fan_in = size
            if nodes > self.max_nodes:
                raise _too_large(nodes, self.max_nodes, f"template '{graph.template}' expands to")
            if depth > self.max_depth:
                raise _too_deep(depth, self.max_depth, f"template '{graph.template}' expands to")
            if fan_in > self.max_fan_in:
                raise _fan_in(f"a concat of template '{graph.template}'", fan_in, self.max_fan_in)
            return
        if len(graph.nodes) > self.max_nodes:
            raise _too_large(len(graph.nodes), self.max_nodes)
        for nd in graph.nodes:
            if nd.op in ("sum", "concat") and len(nd.inputs) > self.max_fan_in:
                raise _fan_in(f"{nd.op} node '{nd.id}'", len(nd.inputs), self.max_fan_in)

    def _solve_once(self, prep, data, notes: list[str], client: str | None = None) -> tuple[str, bool]:
        """Single flight: one solver per key across processes; the others read its answer."""
        token = None
        if not notes:  # the cache answered the lookup, so it can hold the lock too
            deadline = time.monotonic() + self.wait_timeout_s
            while True:
                try:
                    token = self.cache.acquire(prep.key, self.lock_timeout_s)
                except CacheUnavailable:
                    break
                if token is not None:
                    # Another solver may have stored the answer between our miss and our lock.
                    found = self._lookup(prep.key, notes)
                    if found is not None:
                        self.cache.release(prep.key, token)
                        CACHE.labels("hit").inc()
                        return found, True
                    break
                found = self._lookup(prep.key, notes)
                if found is not None:
                    CACHE.labels("hit").inc()
                    return found, True
                if time.monotonic() > deadline:
                    break  # the other solver is stuck or slow: solve here too
                time.sleep(_POLL_S)
        try:
            if self.limit_cold is not None:
                self.limit_cold(client)  # a cold solve from here on: count it (429 when over budget)
            start = time.perf_counter()
            canonical = solve_canonical(prep).to_json()
            SOLVE_SECONDS.labels(prep.request.method).observe(time.perf_counter() - start)
            if not notes:
                try:
                    self.cache.put(new_record(prep.key, canonical, json.dumps(data, separators=(",", ":")),
                                              prep.ids, prep.request.method, prep.request.activation))
                except CacheUnavailable:
                    notes.append(CACHE_DOWN)
            return canonical, False
        finally:
            if token is not None:
                self.cache.release(prep.key, token)

    # -- stored solutions -------------------------------------------------------------------------
    def get(self, key: str) -> dict:
        rec = self.cache.get(key, count_hit=False)
        if rec is None or rec.digest != answer_digest(rec.answer):
            raise SigpropError("not_found", f"no stored solution has key {key}",
                               "POST the request to /v1/solve, or list keys with GET /v1/solutions")
        answer = personalize_json(rec.answer, rec.ids, cached=True)
        return {**rec.summary(), "request": json.loads(rec.request), "answer": json.loads(answer)}

    def list(self, offset: int, limit: int, method: str | None, activation: str | None) -> dict:
        total, records = self.cache.list(offset, limit, method, activation)
        return {"total": total, "offset": offset, "limit": limit, "items": [r.summary() for r in records]}

    def delete(self, key: str) -> dict:
        if not self.cache.delete(key):
            raise SigpropError("not_found", f"no stored solution has key {key}", "list keys with GET /v1/solutions")
        return {"key": key, "deleted": True}


def _too_large(n: int, limit: int, what: str = "the graph has") -> SigpropError:
    return SigpropError("graph_too_large", f"{what} {n} nodes, more than this service's limit of {limit}",
                        "split the network, use a smaller template depth, or raise SIGPROP_MAX_NODES on your own deployment")


def _too_deep(depth: int, limit: int, what: str = "the graph has") -> SigpropError:
    return SigpropError("graph_too_large",
                        f"{what} {depth} nonlinear layers on its longest path, more than this service's limit of {limit}",
                        "use a smaller depth, or raise SIGPROP_MAX_DEPTH on your own deployment")


def _fan_in(what: str, n: int, limit: int) -> SigpropError:
    return SigpropError("graph_too_large", f"{what} has {n} inputs, more than this service's limit of {limit}",
                        "join the inputs in a tree of smaller sums or concats, or raise SIGPROP_MAX_FAN_IN on your own deployment")
