"""The solve path behind POST /v1/solve: cache lookup, single flight, solve, store, degrade.

Kept free of HTTP so it reads as the product's logic: routers call it from a worker thread.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from pydantic import ValidationError

from ..cache import CacheUnavailable, SolutionCache, new_record
from ..engine.solve import personalize, prepare, solve_canonical
from ..errors import SigpropError
from ..requests import parse_solve_request
from ..schemas.solve import Solution
from .observability import CACHE, SOLVE_SECONDS

log = logging.getLogger("sigprop")
_POLL_S = 0.02


@dataclass
class SolveOutcome:
    body: str       # the answer JSON, byte-identical to `sigprop solve` apart from "cached"
    cached: bool
    key: str


class SolutionService:
    def __init__(self, cache: SolutionCache, max_nodes: int, lock_timeout_s: float, wait_timeout_s: float):
        self.cache = cache
        self.max_nodes = max_nodes
        self.lock_timeout_s = lock_timeout_s
        self.wait_timeout_s = wait_timeout_s

    # -- cache access that degrades instead of failing -----------------------------------------
    def _lookup(self, key: str, warnings: list[str], count_hit: bool = True) -> Solution | None:
        try:
            rec = self.cache.get(key, count_hit=count_hit)
        except CacheUnavailable:
            CACHE.labels("error").inc()
            if not warnings:
                warnings.append("the solution cache is unreachable: this answer was solved without it and is not stored")
            return None
        if rec is None:
            return None
        try:
            return Solution.model_validate_json(rec.answer)
        except ValidationError:
            log.warning("corrupt cache entry recomputed", extra={"fields": {"key": key}})
            return None

    def solve(self, data) -> SolveOutcome:
        request = parse_solve_request(data)
        nodes = getattr(request.graph, "nodes", None)
        if nodes is not None and len(nodes) > self.max_nodes:
            raise _too_large(len(nodes), self.max_nodes)
        prep = prepare(request)
        if prep.graph.n > self.max_nodes:
            raise _too_large(prep.graph.n, self.max_nodes)

        notes: list[str] = []
        canonical = self._lookup(prep.key, notes)
        cached = canonical is not None
        if cached:
            CACHE.labels("hit").inc()
        else:
            if not notes:
                CACHE.labels("miss").inc()
            canonical, cached = self._solve_once(prep, data, notes)
        answer = personalize(canonical, prep.ids, list(prep.graph.warnings) + notes)
        answer.cached = cached
        return SolveOutcome(answer.to_json(), cached, prep.key)

    def _solve_once(self, prep, data, notes: list[str]) -> tuple[Solution, bool]:
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
                    break
                found = self._lookup(prep.key, notes, count_hit=True)
                if found is not None:
                    CACHE.labels("hit").inc()
                    return found, True
                if time.monotonic() > deadline:
                    break  # the other solver is stuck or slow: solve here too
                time.sleep(_POLL_S)
        try:
            start = time.perf_counter()
            canonical = solve_canonical(prep)
            SOLVE_SECONDS.labels(prep.request.method).observe(time.perf_counter() - start)
            if not notes:
                try:
                    self.cache.put(new_record(prep.key, canonical.to_json(), json.dumps(data, separators=(",", ":")),
                                              prep.ids, prep.request.method, prep.request.activation))
                except CacheUnavailable:
                    notes.append("the solution cache is unreachable: this answer was solved without it and is not stored")
            return canonical, False
        finally:
            if token is not None:
                self.cache.release(prep.key, token)

    # -- stored solutions -------------------------------------------------------------------------
    def get(self, key: str) -> dict:
        rec = self.cache.get(key, count_hit=False)
        if rec is None:
            raise SigpropError("not_found", f"no stored solution has key {key}",
                               "POST the request to /v1/solve, or list keys with GET /v1/solutions")
        answer = personalize(Solution.model_validate_json(rec.answer), rec.ids)
        answer.cached = True
        return {**rec.summary(), "request": json.loads(rec.request), "answer": json.loads(answer.to_json())}

    def list(self, offset: int, limit: int, method: str | None, activation: str | None) -> dict:
        total, records = self.cache.list(offset, limit, method, activation)
        return {"total": total, "offset": offset, "limit": limit, "items": [r.summary() for r in records]}

    def delete(self, key: str) -> dict:
        if not self.cache.delete(key):
            raise SigpropError("not_found", f"no stored solution has key {key}", "list keys with GET /v1/solutions")
        return {"key": key, "deleted": True}


def _too_large(n: int, limit: int) -> SigpropError:
    return SigpropError("graph_too_large", f"the graph has {n} nodes, more than this service's limit of {limit}",
                        "split the network, use a smaller template depth, or raise SIGPROP_MAX_NODES on your own deployment")
