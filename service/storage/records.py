"""What the stores hold, and the helpers both backends share.

Solutions: a :class:`Record` is the canonical answer (``Solution`` JSON on the anonymized graph,
see ``engine.solve.personalize``), the request that produced it, the ids of that request's nodes
(so ``GET /v1/solutions/{key}`` can name them), its creation time, the sigprop version, a hit
counter and the answer's SHA-256: an entry whose checksum does not match is treated as missing,
recomputed and overwritten, never served. Keys already include the engine version, so a new solver
never reads old answers.

Validations: a record is a dict with the ``ValidationJob`` fields. Statuses go ``queued`` ->
``running`` -> ``finished`` | ``failed`` | ``cancelled``; a failed attempt with retries left goes
back to ``queued``. Every status change is a conditional update (compare-and-set on ``status``), so
a late writer (a worker finishing after a cancel, a failure hook after a success) never overwrites
a final state; :class:`ValidationTransitions` writes the shared transitions on top of each
backend's ``update``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from .. import __version__

log = logging.getLogger("sigprop")

TERMINAL = ("finished", "failed", "cancelled")
ACTIVE = ("queued", "running")
MAX_ERROR_CHARS = 2000


# -- solutions ---------------------------------------------------------------------------------------


class CacheUnavailable(Exception):
    """The cache backend cannot be reached; callers degrade to solving without it."""


class StorageFull(CacheUnavailable):
    """The store answers reads but refuses this write: Redis over ``maxmemory`` under
    ``noeviction``, a read-only replica, SQLite on a full disk or a read-only file, or an entry
    larger than the cache's bound. Its text is the warning a solve answered without storing carries.
    A subclass of ``CacheUnavailable``, so a caller that only knows outages still degrades."""


@dataclass
class Record:
    key: str
    answer: str  # canonical Solution JSON
    request: str  # the request JSON that produced it
    ids: list[str]  # that request's node ids by canonical index
    created: float
    version: str
    method: str
    activation: str
    hits: int = 0
    digest: str = ""  # sha256 of answer: a corrupt entry is detected and recomputed, never served

    def summary(self) -> dict:
        try:
            answer = json.loads(self.answer)
        except ValueError:  # a damaged answer: list what the record says about itself
            answer = None
        if not isinstance(answer, dict):
            answer = {
                "targets": summary_part(self.answer, "targets") or {},
                "graph_summary": summary_part(self.answer, "graph_summary"),
            }
        return {
            "key": self.key,
            "created": self.created,
            "sigprop_version": self.version,
            "method": self.method,
            "activation": self.activation,
            "targets": answer.get("targets", {}),
            "graph_summary": answer.get("graph_summary"),
            "hits": self.hits,
        }

    @property
    def size(self) -> int:
        """What the record costs the store, as the retention bound counts it: the bytes of its
        answer, request and ids (the fields that grow with the graph; the rest is under 200 bytes)."""
        return len(self.answer.encode()) + len(self.request.encode()) + len(json.dumps(self.ids))


class Checksum:
    """The answer's checksum: SHA-256, or with a server secret (``SIGPROP_CACHE_SECRET``)
    HMAC-SHA256, written ``hmac-sha256:<hex>``. Only a checksum of the configured kind verifies, so
    someone who can write to the store but does not know the secret cannot store an answer that is
    served: a tampered entry with a recomputed plain checksum is treated as corrupt and recomputed.
    Turning the secret on (or changing it) makes every older entry recompute once, on its next hit."""

    KEYED = "hmac-sha256:"

    def __init__(self, secret: str | None = None):
        self._key = secret.encode() if secret else None

    @property
    def keyed(self) -> bool:
        return self._key is not None

    def digest(self, answer: str) -> str:
        if self._key is None:
            return hashlib.sha256(answer.encode()).hexdigest()
        return self.KEYED + hmac.new(self._key, answer.encode(), hashlib.sha256).hexdigest()

    def verify(self, answer: str, digest) -> bool:
        return isinstance(digest, str) and hmac.compare_digest(self.digest(answer), digest)


PLAIN = Checksum()


def answer_digest(answer: str) -> str:
    return PLAIN.digest(answer)


def checked_answer(key: str, answer: str | None, digest: str | None, checksum: Checksum = PLAIN) -> str | None:
    """``answer`` when its checksum matches ``digest``; None when missing or corrupt (logged)."""
    if answer is None:
        return None
    if not checksum.verify(answer, digest):
        log.warning("corrupt cache entry: checksum mismatch, recomputing", extra={"fields": {"key": key}})
        return None
    return answer


def too_large_note(size: int, bound: int) -> str:
    return (
        f"this answer takes {size:,} bytes, more than the cache holds (SIGPROP_CACHE_MAX_BYTES = {bound:,}): "
        "it was solved without storing it"
    )


def new_record(
    key: str, canonical_json: str, request_json: str, ids: list[str], method: str, activation: str
) -> Record:
    return Record(
        key=key,
        answer=canonical_json,
        request=request_json,
        ids=ids,
        created=time.time(),
        version=__version__,
        method=method,
        activation=activation,
        digest=answer_digest(canonical_json),
    )


def json_object(fragment: str | None) -> dict | None:
    """A ``{...}`` fragment of JSON parsed, or None when empty, invalid or not an object."""
    if not fragment:
        return None
    try:
        value = json.loads(fragment)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def summary_part(answer: str, name: str) -> dict | None:
    """The flat object ``"name": {...}`` of a serialized answer (``targets``, ``graph_summary``),
    parsed without parsing the whole answer (a large graph's answer is hundreds of KB).

    A quote inside a JSON string is always escaped, so ``"name":{`` occurs only as a real key;
    both objects hold numbers only, so the first ``}`` after it closes them. None if absent."""
    start = answer.find(f'"{name}":{{')
    if start < 0:
        return None
    start += len(name) + 3
    end = answer.find("}", start)
    return json_object(answer[start : end + 1]) if end > 0 else None


def stored_time(value) -> float | None:
    """A stored epoch time as a finite float, or None when it does not read as one."""
    try:
        t = float(value.decode() if isinstance(value, bytes) else value)
    except (TypeError, ValueError):
        return None
    return t if math.isfinite(t) else None


def stored_count(value) -> int:
    """A stored counter (``hits``): 0 when it does not read as a whole number (a damaged counter
    costs the statistic, never the record)."""
    try:
        return max(0, int(value.decode() if isinstance(value, bytes) else value or 0))
    except (TypeError, ValueError):
        return 0


def _text(value) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def decode_record(key: str, fields: dict) -> Record | None:
    """A stored solution (field name -> bytes or SQLite value) as a ``Record``, or None when a field
    it cannot do without is missing or of the wrong type (logged): such a record is skipped by the
    lists and answered as not found, and the next cold solve of its key overwrites it."""
    texts = {f: _text(fields.get(f)) for f in ("answer", "request", "ids", "version", "method", "activation")}
    created = stored_time(fields.get("created"))
    try:
        ids = json.loads(texts["ids"]) if texts["ids"] is not None else None
    except ValueError:
        ids = None
    if None in texts.values() or created is None or not isinstance(ids, list):
        bad = sorted(
            [f for f, v in texts.items() if v is None]
            + (["created"] if created is None else [])
            + (["ids"] if not isinstance(ids, list) else [])
        )
        log.warning("unreadable cache entry: skipped", extra={"fields": {"key": key, "fields": bad}})
        return None
    return Record(
        key=key,
        answer=texts["answer"],
        request=texts["request"],
        ids=[str(i) for i in ids],
        created=created,
        version=texts["version"],
        method=texts["method"],
        activation=texts["activation"],
        hits=stored_count(fields.get("hits")),
        digest=_text(fields.get("digest")) or "",
    )


def summary_row(key: str, created, version, method, activation, hits, targets, graph_summary) -> dict | None:
    """One solution summary as ``Record.summary()`` gives it, from separately read fields; None
    (the row is skipped, logged) when ``created`` does not read as a time."""
    when = stored_time(created)
    if when is None:
        log.warning("unreadable cache entry: skipped", extra={"fields": {"key": key, "fields": ["created"]}})
        return None
    return {
        "key": key,
        "created": when,
        "sigprop_version": _text(version) or "",
        "method": _text(method) or "",
        "activation": _text(activation) or "",
        "targets": targets or {},
        "graph_summary": graph_summary,
        "hits": stored_count(hits),
    }


# -- validations -------------------------------------------------------------------------------------

FIELDS = (
    "id",
    "status",
    "key",
    "request",
    "created",
    "started",
    "ended",
    "attempts",
    "device",
    "error",
    "progress",
    "results",
)
SUMMARY_FIELDS = ("id", "status", "key", "created", "started", "ended", "attempts", "device", "error", "progress")


def finite_json(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None, so it serializes to strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            return finite_json(value.item())
        except (TypeError, ValueError):
            pass
    return value


def dumps(value: Any) -> str:
    return json.dumps(finite_json(value), separators=(",", ":"), allow_nan=False, default=str)


class UnreadableRecord(ValueError):
    """A stored validation whose id, status or creation time cannot be read: lists skip it and
    ``GET /v1/validations/{id}`` answers 404 saying so, never a 500."""


def _json_field(value, default, kind: type):
    """A JSON field of a stored record, or ``default`` when it does not parse or is not ``kind``."""
    try:
        parsed = json.loads(value) if value not in (None, "") else default
    except (TypeError, ValueError):
        return default
    return parsed if isinstance(parsed, kind) else default


def decode_validation(raw: dict[str, Any]) -> dict[str, Any]:
    """A stored validation (strings or SQLite values) as the ValidationJob fields. Optional fields
    of the wrong type read as absent; raises ``UnreadableRecord`` when id, status or created do."""
    vid, status, created = raw.get("id"), raw.get("status"), stored_time(raw.get("created"))
    if not isinstance(vid, str) or status not in ACTIVE + TERMINAL or created is None:
        raise UnreadableRecord(f"validation {vid if isinstance(vid, str) else '?'}: id, status or created unreadable")
    out: dict[str, Any] = {"id": vid, "status": status, "key": _text(raw.get("key")) or "", "created": created}
    for f in ("started", "ended"):
        out[f] = stored_time(raw.get(f)) if raw.get(f) not in (None, "") else None
    out["attempts"] = stored_count(raw.get("attempts"))
    for f in ("device", "error"):
        v = raw.get(f)
        out[f] = v if isinstance(v, str) and v != "" else None
    out["progress"] = _json_field(raw.get("progress"), {}, dict)
    if "request" in raw:
        out["request"] = _json_field(raw.get("request"), {}, dict)
    if "results" in raw:
        out["results"] = _json_field(raw.get("results"), None, dict)
    return out


def decode_validations(rows) -> list[dict[str, Any]]:
    """``decode_validation`` of each row, skipping (and logging) the unreadable ones."""
    out = []
    for raw in rows:
        try:
            out.append(decode_validation(raw))
        except UnreadableRecord as exc:
            log.warning("unreadable validation record: skipped", extra={"fields": {"reason": str(exc)}})
    return out


class ValidationTransitions:
    """The status changes both validation stores share, written with their ``get``, ``update`` and
    ``cancel_requested`` (see ``protocols.ValidationStore``)."""

    def finish(self, vid: str, results: dict) -> bool:
        return self.update(
            vid,
            {"status": "finished", "results": dumps(results), "ended": time.time(), "error": None},
            only_if=("running",),
        )

    def mark_cancelled(self, vid: str, note: str) -> bool:
        return self.update(
            vid, {"status": "cancelled", "ended": time.time(), "error": note[:MAX_ERROR_CHARS]}, only_if=ACTIVE
        )

    def record_failure(self, vid: str, reason: str, will_retry: bool) -> str | None:
        """An attempt failed: back to ``queued`` when it will be retried, else ``failed``; a job with
        a pending cancel ends ``cancelled`` instead. Returns the status written (None: no change)."""
        rec = self.get(vid)
        if rec is None or rec["status"] not in ACTIVE:
            return None
        n = rec["attempts"]
        if self.cancel_requested(vid) is not None:
            return "cancelled" if self.mark_cancelled(vid, f"cancelled on request (attempt {n}: {reason})") else None
        if will_retry:
            ok = self.update(
                vid,
                {"status": "queued", "error": f"attempt {n} failed: {reason}; retrying"[:MAX_ERROR_CHARS]},
                only_if=ACTIVE,
            )
            return "queued" if ok else None
        ok = self.update(
            vid,
            {
                "status": "failed",
                "ended": time.time(),
                "error": f"failed after {n} attempt(s): {reason}"[:MAX_ERROR_CHARS],
            },
            only_if=ACTIVE,
        )
        return "failed" if ok else None
