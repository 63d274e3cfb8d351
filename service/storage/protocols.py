"""The two stores the service keeps, as protocols both backends implement (``redis_backend``,
``sqlite_backend``): solutions by canonical key, and validation jobs by id."""

from __future__ import annotations

from typing import Any, Protocol

from .health import StorageHealth
from .records import Checksum, Record


class SolutionCache(Protocol):
    """Canonical answers by key, and the single-flight lock: the first process to ask for a missing
    key solves it; the others wait for the stored answer (or for the lock to expire, if that
    solver died). Redis errors surface as ``CacheUnavailable``."""

    backend: str  # "redis" or "sqlite"
    checksum: Checksum  # plain SHA-256, or HMAC-SHA256 with SIGPROP_CACHE_SECRET
    health: StorageHealth  # the writes this process saw refused (full or read-only store)
    max_bytes: int  # SIGPROP_CACHE_MAX_BYTES: a record over it is refused by put (0: no bound)

    def get(self, key: str, count_hit: bool = True) -> Record | None:
        """The whole record (counting a hit unless told not to, and unless the store refuses the
        write: then it is read without counting), or None, also for a record that does not read."""
        ...

    def get_answer(self, key: str) -> str | None:
        """Just the canonical answer, counting a hit: the hot path of POST /v1/solve.

        None when missing or corrupt (its checksum does not match): the caller solves again and
        the new answer overwrites the entry."""
        ...

    def put(self, record: Record) -> None:
        """Store ``record`` (its checksum is the cache's own), then evict the least recently used
        others while over the retention bounds. Raises ``StorageFull`` when the store refuses the
        write or the record alone is over the byte bound (its text is the answer's warning)."""
        ...

    def stats(self) -> dict:
        """``entries`` and ``bytes`` as the retention bounds count them, and the bounds."""
        ...

    def writable(self) -> bool:
        """Whether the store takes writes now (``/readyz``'s ``storage``); ``CacheUnavailable``
        when it cannot be reached."""
        ...

    def delete(self, key: str) -> bool:
        """True when there was such a record."""
        ...

    def list(self, offset: int, limit: int, method: str | None, activation: str | None) -> tuple[int, list[Record]]:
        """Records newest first, optionally of one method and/or activation, with the total count."""
        ...

    def list_summaries(
        self,
        offset: int,
        limit: int,
        method: str | None = None,
        activation: str | None = None,
        key_prefix: str | None = None,
    ) -> tuple[int, list[dict]]:
        """Like ``list`` (newest first, total count), but summaries only (``Record.summary()``'s
        fields), read without loading whole records, and optionally only keys starting with
        ``key_prefix``. The dashboard's table; its pages stay fast with large answers."""
        ...

    def counts(self, field: str, names) -> dict[str, int]:
        """How many stored solutions have each of ``names`` as ``field`` (``method`` or
        ``activation``); names with none are left out. The dashboard's filter choices."""
        ...

    def ping(self) -> bool: ...

    def acquire(self, key: str, ttl_s: float) -> str | None:
        """The single-flight lock of ``key`` for ``ttl_s`` seconds: a token, or None when held."""
        ...

    def release(self, key: str, token: str) -> None: ...

    def close(self) -> None: ...

    def hot_answers(self) -> Any:
        """This process's coherent memory of hot answers (``hot.HotAnswers``), or None where the
        backend cannot keep one coherent across processes (SQLite: every hit reads the file)."""
        ...


class ValidationStore(Protocol):
    """Validation jobs. Records are dicts with the ValidationJob fields (``records.decode_validation``);
    ``finish``, ``mark_cancelled`` and ``record_failure`` come from ``records.ValidationTransitions``."""

    backend: str  # "redis" or "sqlite"

    def create(self, vid: str, key: str, request: dict, created: float, owner: int | None = None) -> None:
        """A new ``queued`` record; then final records past the retention bounds are removed."""
        ...

    def trim(self, now: float, cap: int = 100) -> int:
        """Remove up to ``cap`` final validations past the retention bounds; how many it removed."""
        ...

    def discard(self, vid: str, key: str) -> None:
        """Remove a record that was never accepted (its job could not be queued)."""
        ...

    def get(self, vid: str) -> dict | None: ...

    def list(self, offset: int, limit: int) -> tuple[int, list[dict]]:
        """Summaries (no request, no results), newest first, with the total count."""
        ...

    def list_for_key(self, key: str, limit: int) -> tuple[int, list[dict]]:
        """The validations of solution ``key``, newest first (summaries, as ``list`` gives them)."""
        ...

    def start(self, vid: str, device: str) -> int:
        """Mark an attempt started: returns its number (1, 2, ...), or 0 when the job must not run
        (cancelled, already final, or unknown; a pending cancel turns it ``cancelled`` here)."""
        ...

    def update(self, vid: str, fields: dict[str, Any], only_if: tuple[str, ...]) -> bool:
        """Set ``fields`` (None deletes) if the status is one of ``only_if``; True if it did."""
        ...

    def set_progress(self, vid: str, progress: dict) -> None: ...

    def request_cancel(self, vid: str, now: float) -> str | None:
        """Cancel: a queued job becomes ``cancelled`` at once; a running one gets the cancel flag its
        job polls; a final one is left as it is. Returns the status *before* the call (None: no
        such job)."""
        ...

    def cancel_requested(self, vid: str) -> float | None:
        """When a cancel was requested (epoch seconds), or None."""
        ...

    def finish(self, vid: str, results: dict) -> bool:
        """A running job's results: ``finished`` (False when it was no longer running)."""
        ...

    def mark_cancelled(self, vid: str, note: str) -> bool: ...

    def record_failure(self, vid: str, reason: str, will_retry: bool) -> str | None:
        """An attempt failed: back to ``queued`` when it will be retried, else ``failed``; a job with
        a pending cancel ends ``cancelled`` instead. Returns the status written (None: no change)."""
        ...

    def close(self) -> None: ...
