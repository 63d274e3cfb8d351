"""The solve path behind POST /v1/solve: cache lookup, single flight, solve, store, degrade.

Kept free of HTTP so it reads as the product's logic. ``hot_hit`` runs on the event loop and
answers, without I/O, a body seen before whose answer is in this process's memory
(``storage/hot.py``, Redis only); everything else runs in a worker thread, in two steps:
``begin`` (memo, admission, canonicalization, cache lookup: answers hits) and ``finish`` (single
flight and the cold solve, which runs in a ``coldpool.SolverPool`` process that is killed at the
deadline). A body the memo knows (likely a hit) begins in the threads hits use; a new one runs
both steps in one of the threads that wait for cold solves (``deps.Offload.solve``).

Admission comes before any work that grows with the request (``sigprop.preparation``, against
``limits``): the cost (nodes plus edges, from a template's parameters or by counting the wire
graph) is checked against ``max_cost`` and the client's cold-solve budget is checked (without
counting) before the graph is built; the body memo is bounded in bytes and only remembers admitted
requests. A request is prepared once, here or (a large body, or a template past ``small_cost``) in
a solver process, and the solver process that solves it receives the prepared form. A cold
answer is stored before it is sent, so an answer that was not stored says so (a warning): the
write was once left until after the send, and a Redis stall starting in between lost an answer
whose reply said nothing (issue 35).

A cold solve carries its price (``preparation.solve_price``: nodes plus edges of the built graph,
and a sequence graph's token-kernel work): at most ``small_cost``, it may take the solver pool's
small lane, so large solves queued ahead never hold it up; a larger one counts against its share's
cap on concurrent large solves. Solves start in turn by client (``coldlanes.Lanes``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..answers import personalize_json
from ..engine.limits import Limits
from ..engine.solve import Prepared, solve_canonical
from ..errors import SigpropError
from ..preparation import Admitted, admit, prepare_admitted, prepare_payload, solve_price
from ..requests import SOLVE_HINT, load_json
from ..storage import CacheUnavailable, SolutionCache, StorageFull, new_record
from ..storage.hot import HotAnswers
from ..storage.records import PLAIN
from .admission import BodyMemo, check_body_cost
from .coldpool import SolverPool, solve_prepared, timeout_error
from .inline_lane import InlineLane
from .observability import CACHE, SOLVE_SECONDS, STORAGE

# the Settings defaults of nodes, depth and fan-in (no price): what a service built without
# the app's limits, e.g. in a test, admits against
DEFAULT_LIMITS = Limits(max_depth=10_000, max_fan_in=1024)

log = logging.getLogger("sigprop")
_POLL_S = 0.02
# how long a read or delete of a key waits for a write in flight (a cold answer is stored just after
# it is sent, its single-flight lock held until then): milliseconds, unless a solve of it is running
_PENDING_WRITE_WAIT_S = 2.0
_QUICK_BYTES = 64 << 10  # bodies larger than this get a cost bound from their bytes first
_IN_THREAD_BYTES = 32 << 10  # larger bodies are parsed and prepared in a solver process
_HITS = CACHE.labels("hit")  # the hot path's counter, labelled once
CACHE_DOWN = "the solution cache is unreachable: this answer was solved without it and is not stored"


@dataclass(frozen=True)
class _Parsed:
    """What a request body canonicalizes to: enough to serve a cache hit without parsing it again."""

    key: str
    ids: tuple[str, ...]
    graph_warnings: tuple[str, ...]


@dataclass
class ColdSolve:
    """A request ``begin`` could not answer from the cache: what ``finish`` needs to solve it."""

    parsed: _Parsed
    prep: Prepared  # the request prepared once (here or in a solver process): what the solver solves
    request_text: str  # the request as stored with its answer (compact JSON)
    notes: list[str]
    client: str | None
    cost: int  # the solve's price (``preparation.solve_price``): whether it may take the small lane

    @property
    def method(self) -> str:
        return self.prep.request.method

    @property
    def activation(self) -> str:
        return self.prep.request.activation


@dataclass
class SolveOutcome:
    body: str | bytes  # the answer JSON, byte-identical to `sigprop solve` apart from "cached"
    cached: bool
    key: str


class SolutionService:
    def __init__(
        self,
        cache: SolutionCache,
        lock_timeout_s: float,
        wait_timeout_s: float,
        *,
        limits: Limits = DEFAULT_LIMITS,
        limit_cold: Callable[[str | None], None] | None = None,
        memo_bytes: int = 64 << 20,
        solver: SolverPool | None = None,
        solve_timeout_s: float | None = None,
        hot: HotAnswers | None = None,
        small_cost: int = 0,
        inline: InlineLane | None = None,
    ):
        # body digest -> canonical key and ids: a pure function of the bytes (and the engine
        # version), so repeated bodies skip validation, template expansion and canonicalization.
        self._memo = BodyMemo(memo_bytes)
        self.cache = cache
        # every request is admitted against these (sigprop.preparation); the app's come from
        # Settings.limits, the one place the environment's limits are read
        self.limits = limits
        # called with the client's identity right before a cold solve; raises rate_limited (429).
        # Its ``precheck`` (when it has one) refuses a client already over budget, without counting.
        self.limit_cold = limit_cold
        self.lock_timeout_s = lock_timeout_s
        self.wait_timeout_s = wait_timeout_s
        health = getattr(cache, "health", None)
        if health is not None:  # refused writes and evictions, counted in the metrics
            health.listen(lambda event, n: STORAGE.labels(event).inc(n))
        self.solver = solver  # None: solve in the calling thread (offline use, tests)
        # hot answers in this process's memory, coherent with Redis (storage/hot.py): hits of
        # bodies seen before are answered on the event loop, with no I/O (``hot_hit``)
        self.hot = hot
        self.solve_timeout_s = solve_timeout_s if solve_timeout_s is not None else wait_timeout_s
        # a cold solve of at most this many nodes + edges may take the solver pool's small lane
        self.small_cost = small_cost
        # small solves tried in this process before a solver process is asked (None: never)
        self.inline = inline

    def memory(self) -> dict[str, int]:
        """What this process holds for its answers, in bytes and entries (``/metrics``)."""
        hot = self.hot
        return {
            "hot_answers": hot.bytes if hot is not None else 0,
            "hot_answers_entries": len(hot) if hot is not None else 0,
            "body_memo": self._memo.bytes,
            "body_memo_entries": len(self._memo),
        }

    # -- cache access that degrades instead of failing -----------------------------------------
    def hot_hit(self, body: bytes) -> SolveOutcome | None:
        """The answer to a body seen before whose answer is in memory (``storage/hot.py``), else
        None (``begin`` then answers it). No I/O and no thread: the event loop calls it."""
        if self.hot is None or len(body) > _QUICK_BYTES:
            return None  # hashing a large body would hold the event loop: ``begin`` does it in a thread
        digest = hashlib.sha256(body).digest()
        parsed = self._memo.get(digest)
        if parsed is None:
            return None
        found = self.hot.hit(parsed.key, digest)
        if found is None:
            return None
        _HITS.inc()
        text, answer = found
        if answer is None:  # first hit of this body since its answer came into memory
            answer = personalize_json(text, parsed.ids, parsed.graph_warnings, cached=True).encode()
            self.hot.keep_view(parsed.key, text, digest, answer)
        return SolveOutcome(answer, True, parsed.key)

    def _hit(self, text: str, parsed: _Parsed, digest: bytes) -> SolveOutcome:
        """A cache hit's answer; kept in memory for the next hit of the same body."""
        CACHE.labels("hit").inc()
        answer = personalize_json(text, parsed.ids, parsed.graph_warnings, cached=True)
        if self.hot is not None:
            self.hot.keep_view(parsed.key, text, digest, answer.encode())
        return SolveOutcome(answer, True, parsed.key)

    def _lookup(self, key: str, warnings: list[str], hot: bool = False) -> str | None:
        """The canonical answer JSON from the cache, or None (missing, corrupt, or cache down).
        ``hot``: from memory or one tracked read when it can be (the hit then counted in a batch)."""
        if hot and self.hot is not None:
            text = self.hot.fetch(key)
            if text is not None:
                return text
        try:
            text = self.cache.get_answer(key)
        except CacheUnavailable:
            CACHE.labels("error").inc()
            if not warnings:
                warnings.append(CACHE_DOWN)
            return None
        return text

    def solve(self, body: bytes, client: str | None = None, deadline: float | None = None) -> SolveOutcome:
        """The answer to a request body. ``client`` is who a cold solve is counted against by
        ``limit_cold`` (None: not limited); cache hits are never counted."""
        step = self.begin(body, client)
        return step if isinstance(step, SolveOutcome) else self.finish(step, deadline)

    def knows(self, body: bytes) -> bool:
        """Whether the memo holds this body (a cache hit is likely). Cheap enough for the event
        loop: a body over ``_QUICK_BYTES`` is not hashed here, and counts as unknown."""
        return len(body) <= _QUICK_BYTES and self._memo.get(hashlib.sha256(body).digest()) is not None

    def begin(self, body: bytes, client: str | None = None) -> SolveOutcome | ColdSolve:
        """A cache hit's answer, or what ``finish`` needs to solve the request. Admission comes
        first: for a large new body, the client's cold-solve budget (not counted yet) and a cost
        bound from its bytes; then size limits and cost from the parsed body alone; only then is
        the graph built and canonicalized (for a large body, in a solver process)."""
        digest = hashlib.sha256(body).digest()
        parsed = self._memo.get(digest)
        notes: list[str] = []
        if parsed is not None:
            text = self._lookup(parsed.key, notes, hot=True)
            if text is not None:
                return self._hit(text, parsed, digest)

        precheck = getattr(self.limit_cold, "precheck", None)
        large = parsed is None and self.solver is not None and len(body) > _IN_THREAD_BYTES
        if large and precheck is not None:
            # a new body that costs real work to parse and build: a client already over its
            # cold-solve budget gets its 429 first (not counted). Small bodies cost milliseconds:
            # they are built, and a cache hit (same key, other bytes) still answers.
            precheck(client)
        if self.limits.max_cost is not None and len(body) > _QUICK_BYTES:
            # lower bounds from the bytes, before parsing
            check_body_cost(body, self.limits.max_cost, self.limits.max_fan_in)
        if large:
            prep, request_text = self._prepare_remote(body, client)
        else:
            data = load_json(body, SOLVE_HINT)
            admitted = admit(data, self.limits)  # before validating or building the graph
            if parsed is None and self._heavy_template(admitted):
                if precheck is not None:
                    precheck(client)
                prep, request_text = self._prepare_remote(admitted, client)
            else:
                prep = prepare_admitted(admitted, self.limits)
                request_text = json.dumps(data, separators=(",", ":"))
        parsed = _Parsed(prep.key, tuple(prep.ids), tuple(prep.graph.warnings))
        self._memo.put(digest, parsed)

        notes = []
        text = self._lookup(parsed.key, notes, hot=True)
        if text is None:
            if not notes:
                CACHE.labels("miss").inc()
            return ColdSolve(
                parsed, prep, request_text, notes, client, solve_price(prep.graph, shaping_of(prep), schedule_of(prep))
            )
        return self._hit(text, parsed, digest)

    def _heavy_template(self, admitted: Admitted) -> bool:
        """Whether an admitted template expands past the small-solve cost: built in a solver
        process, not here where it would hold the GIL every other request needs (six 10,000-layer
        MLP templates built here held another client's small cold solve for over a second)."""
        return self.solver is not None and admitted.template is not None and admitted.cost > self.small_cost

    def _prepare_remote(self, payload: bytes | Admitted, client: str | None) -> tuple[Prepared, str]:
        """``preparation.prepare_payload`` in a solver process: the body crosses once, and the
        prepared request comes back (compactly pickled) for the lookup and the solve."""
        return self.solver.call(
            prepare_payload, (payload, self.limits), self.solve_timeout_s, what="preparing the request", client=client
        )

    def finish(self, cold: ColdSolve, deadline: float | None = None) -> SolveOutcome:
        """Solve what ``begin`` missed (single flight; killed at ``deadline``, a monotonic time).
        The answer is stored before it is returned, so its warnings say when it was not stored."""
        if deadline is None:
            deadline = time.monotonic() + self.solve_timeout_s
        text, cached = self._solve_once(cold, deadline)
        answer = personalize_json(text, cold.parsed.ids, cold.parsed.graph_warnings + tuple(cold.notes), cached=cached)
        return SolveOutcome(answer, cached, cold.parsed.key)

    def _solve_once(self, cold: ColdSolve, deadline: float) -> tuple[str, bool]:
        """Single flight: one solver per key across processes; the others read its answer. The
        answer is stored (or a note says why not) before the lock is released and it is returned."""
        key, notes = cold.parsed.key, cold.notes
        token = None
        if not notes:  # the cache answered the lookup, so it can hold the lock too
            wait_until = min(time.monotonic() + self.wait_timeout_s, deadline)
            while True:
                try:
                    token = self.cache.acquire(key, self.lock_timeout_s)
                except CacheUnavailable:
                    break
                if token is not None:
                    # Another solver may have stored the answer between our miss and our lock.
                    found = self._lookup(key, notes)
                    if found is not None:
                        self.cache.release(key, token)
                        CACHE.labels("hit").inc()
                        return found, True
                    break
                found = self._lookup(key, notes)
                if found is not None:
                    CACHE.labels("hit").inc()
                    return found, True
                if time.monotonic() > wait_until:
                    break  # the other solver is stuck or slow: solve here too
                time.sleep(_POLL_S)
        try:
            if self.limit_cold is not None:
                self.limit_cold(cold.client)  # a cold solve from here on: count it (429 when over budget)
            start = time.perf_counter()
            canonical = self._compute(cold, deadline)
            SOLVE_SECONDS.labels(cold.method).observe(time.perf_counter() - start)
            if notes:
                return canonical, False
            record = new_record(key, canonical, cold.request_text, list(cold.parsed.ids), cold.method, cold.activation)
            try:  # within the Redis timeout: a stall makes this answer "not stored", never silent
                self.cache.put(record)
            except StorageFull as exc:  # reachable but full or read-only: answered, not stored
                notes.append(str(exc))
            except CacheUnavailable:
                CACHE.labels("error").inc()
                notes.append(CACHE_DOWN)
            return canonical, False
        finally:
            if token is not None:
                self.cache.release(key, token)

    def _compute(self, cold: ColdSolve, deadline: float) -> str:
        """The canonical answer JSON: in this thread when the inline lane takes it within its budget
        (``inline_lane.py``), else in a solver process killed at ``deadline``; in this thread when
        there is no solver pool."""
        if self.solver is None:
            return solve_canonical(cold.prep).to_json()
        if self.inline is not None:
            text = self.inline.try_solve(cold.prep, cold.cost)
            if text is not None:
                return text
        left = deadline - time.monotonic()
        if left <= 0:
            raise timeout_error(self.solve_timeout_s)
        return self.solver.call(
            solve_prepared,
            (cold.prep,),
            left,
            timeout_s=self.solve_timeout_s,
            client=cold.client,
            small=cold.cost <= self.small_cost,
        )

    # -- stored solutions -------------------------------------------------------------------------
    def _settled(self, key: str) -> str | None:
        """The key's single-flight lock once a write in flight has released it (a cold answer is
        stored after it is sent), waiting at most ``_PENDING_WRITE_WAIT_S``: the token to release,
        or None when the wait ran out or the lock cannot be had."""
        until = time.monotonic() + _PENDING_WRITE_WAIT_S
        while True:
            try:
                token = self.cache.acquire(key, self.lock_timeout_s)
            except CacheUnavailable:
                return None
            if token is not None or time.monotonic() > until:
                return token
            time.sleep(_POLL_S)

    def stored(self, key: str):
        """The verified stored record of ``key``; ``not_found`` when there is none or it is damaged."""
        rec = self.cache.get(key, count_hit=False)
        if rec is None:  # perhaps just answered, its write not yet done: a client reads what it was sent
            token = self._settled(key)
            if token is not None:
                self.cache.release(key, token)
            rec = self.cache.get(key, count_hit=False)
        if rec is None or not getattr(self.cache, "checksum", PLAIN).verify(rec.answer, rec.digest):
            raise SigpropError(
                "not_found",
                f"no stored solution has key {key}",
                "POST the request to /v1/solve, or list keys with GET /v1/solutions",
            )
        return rec

    def get(self, key: str) -> dict:
        rec = self.stored(key)
        try:
            answer = json.loads(personalize_json(rec.answer, rec.ids, cached=True))
        except ValueError:  # checksummed but not JSON: nothing sigprop wrote; shown as missing
            raise SigpropError(
                "not_found",
                f"the stored solution {key} is unreadable",
                "POST its request to /v1/solve to store it again",
            ) from None
        try:
            request = json.loads(rec.request)
        except ValueError:  # the answer is intact: show it, without the request it came from
            request = None
        return {**rec.summary(), "request": request, "answer": answer}

    def list(self, offset: int, limit: int, method: str | None, activation: str | None) -> dict:
        total, records = self.cache.list(offset, limit, method, activation)
        return {"total": total, "offset": offset, "limit": limit, "items": [r.summary() for r in records]}

    def delete(self, key: str) -> dict:
        # under the key's lock, so an answer's write still in flight lands before, not after, the delete
        token = self._settled(key)
        try:
            deleted = self.cache.delete(key)
        finally:
            if token is not None:
                self.cache.release(key, token)
        if not deleted:
            raise SigpropError("not_found", f"no stored solution has key {key}", "list keys with GET /v1/solutions")
        return {"key": key, "deleted": True}


def shaping_of(prep: Prepared) -> str | None:
    """The attention shaping a prepared request names (None: not a sequence request)."""
    return getattr(prep.request.attention, "shaping", None)


def schedule_of(prep: Prepared) -> str | None:
    """The attention schedule a prepared request solves for (None: not a sequence request)."""
    attention = prep.request.attention
    return attention.schedule_name() if attention is not None else None


def graph_size(graph) -> int:
    """Nodes plus edges of a built graph: the cost admission priced, now exact."""
    return graph.n + sum(len(nd.inputs) for nd in graph.nodes)
