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

from ..cache import CacheUnavailable, SolutionCache, answer_digest, new_record
from ..engine.solve import personalize_json, prepare, solve_canonical
from ..errors import SigpropError
from ..requests import parse_solve_request
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
    def __init__(self, cache: SolutionCache, max_nodes: int, lock_timeout_s: float, wait_timeout_s: float):
        # body digest -> canonical key and ids: a pure function of the bytes (and the engine
        # version), so repeated bodies skip validation, template expansion and canonicalization.
        self._memo: OrderedDict[bytes, _Parsed] = OrderedDict()
        self._memo_lock = threading.Lock()
        self.cache = cache
        self.max_nodes = max_nodes
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

    def solve(self, body: bytes) -> SolveOutcome:
        digest = hashlib.sha256(body).digest()
        with self._memo_lock:
            parsed = self._memo.get(digest)
        notes: list[str] = []
        if parsed is not None:
            text = self._lookup(parsed.key, notes)
            if text is not None:
                CACHE.labels("hit").inc()
                return SolveOutcome(personalize_json(text, parsed.ids, parsed.graph_warnings, cached=True), True, parsed.key)

        data = _load_json(body)
        request = parse_solve_request(data)
        nodes = getattr(request.graph, "nodes", None)
        if nodes is not None and len(nodes) > self.max_nodes:
            raise _too_large(len(nodes), self.max_nodes)
        prep = prepare(request)
        if prep.graph.n > self.max_nodes:
            raise _too_large(prep.graph.n, self.max_nodes)
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
            text, cached = self._solve_once(prep, data, notes)
        answer = personalize_json(text, parsed.ids, parsed.graph_warnings + tuple(notes), cached=cached)
        return SolveOutcome(answer, cached, prep.key)

    def _solve_once(self, prep, data, notes: list[str]) -> tuple[str, bool]:
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


def _load_json(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise SigpropError("invalid_request", "the request body is not valid JSON",
                           "send a JSON object with graph, method, activation and targets") from None


def _too_large(n: int, limit: int) -> SigpropError:
    return SigpropError("graph_too_large", f"the graph has {n} nodes, more than this service's limit of {limit}",
                        "split the network, use a smaller template depth, or raise SIGPROP_MAX_NODES on your own deployment")
