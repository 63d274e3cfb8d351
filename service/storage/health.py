"""Whether the store takes writes, and what the service does when it does not.

A store can answer reads and refuse writes: Redis over ``maxmemory`` under ``noeviction`` (OOM), a
read-only replica (READONLY), a Redis whose last snapshot failed (MISCONF), SQLite on a full disk or
a read-only file. The service then keeps answering: hits are served without counting them, cold
solves are answered with a warning and not stored, validation submissions get 503 ``storage_full``
(``api.validations``). :class:`StorageHealth` remembers the refusals so ``/readyz`` can say
``"storage": "degraded"`` and the metrics can count them (its listeners).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable

log = logging.getLogger("sigprop")

# Redis error codes that mean "reachable, but this write is refused"
_REDIS_REFUSALS = ("OOM", "READONLY", "MISCONF", "NOREPLICAS")
# SQLite result codes (their names, Python 3.11+) that mean the same
_SQLITE_REFUSALS = ("SQLITE_FULL", "SQLITE_READONLY", "SQLITE_IOERR", "SQLITE_CANTOPEN")

# how long calls fail fast after one could not reach the store (StorageHealth.lost)
LOST_S = 1.0

NOT_STORED = (
    "the solution cache refuses writes (full or read-only): this answer was solved without it and is not stored"
)


def write_refused(exc: BaseException) -> bool:
    """True when ``exc`` says the store refused a write rather than failed to answer."""
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", "") or ""
        text = str(exc).lower()
        return name.startswith(_SQLITE_REFUSALS) or "disk is full" in text or "readonly database" in text
    try:
        import redis
    except ImportError:  # pragma: no cover - redis is a dependency of the service
        return False
    if isinstance(exc, (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).lstrip().startswith(_REDIS_REFUSALS)


class StorageHealth:
    """One process's record of refused writes. ``degraded`` is true while the last refusal is
    newer than the last write that succeeded and younger than ``recent_s`` (the store may have been
    freed meanwhile; the probe in ``writable()`` says for sure)."""

    def __init__(self, recent_s: float = 60.0, lost_s: float = LOST_S):
        self.recent_s = recent_s
        self.refused_at = 0.0
        self.stored_at = 0.0
        # after a call timed out or lost its connection, calls fail at once until then (monotonic)
        self.lost_s = lost_s
        self.lost_until = 0.0
        self._listeners: list[Callable[[str, int], None]] = []
        self._lock = threading.Lock()

    def listen(self, fn: Callable[[str, int], None]) -> None:
        """Call ``fn(event, n)`` on each event: ``refused_hit_count``, ``refused_store``,
        ``evicted_solutions``, ``evicted_validations`` (the app counts them in its metrics)."""
        self._listeners.append(fn)

    def _emit(self, event: str, n: int = 1) -> None:
        for fn in self._listeners:
            try:
                fn(event, n)
            except Exception:  # noqa: BLE001 - a metrics hiccup must not fail the request it counts
                log.exception("storage event listener failed")

    def refused(self, what: str) -> None:
        with self._lock:
            first = not self.degraded
            self.refused_at = time.time()
        if first:
            log.warning("storage refuses writes (%s): serving without storing", what)
        self._emit(f"refused_{what}")

    def stored(self) -> None:
        with self._lock:
            self.stored_at = time.time()

    def evicted(self, what: str, n: int) -> None:
        if n:
            self._emit(f"evicted_{what}", n)

    def lost(self) -> None:
        """A call could not reach the store (timeout, connection lost): for ``lost_s`` the calls
        that would wait for it fail at once instead (``suspended``), so during a Redis stall a
        request pays at most one socket timeout, not one per call it makes."""
        self.lost_until = time.monotonic() + self.lost_s

    def reached(self) -> None:
        """A call reached the store: it is back, so calls wait for it again (ends ``lost``)."""
        self.lost_until = 0.0

    @property
    def suspended(self) -> bool:
        return time.monotonic() < self.lost_until

    @property
    def degraded(self) -> bool:
        return self.refused_at > self.stored_at and time.time() - self.refused_at < self.recent_s
