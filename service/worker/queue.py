"""Validation jobs: their state, the queue that runs them, and the code a job runs.

A validation's state is one record (``status``, ``progress``, ``results``, ``device``, ``error``,
``attempts``, ``created``/``started``/``ended``, plus the request and the solution key), kept
without expiry in one of two stores:

* Redis (``SIGPROP_REDIS_URL`` set): the hash ``sigprop:val:{id}`` and the sorted set
  ``sigprop:validations`` (id by creation time) that ``GET /v1/validations`` pages through, plus
  one sorted set per solution, ``sigprop:validations:key:{solution key}``, that the dashboard's
  solution page reads (``list_for_key``; validations stored before it existed are added to it
  once per process). Jobs go
  through the RQ queue ``sigprop-validations``; ``sigprop worker`` processes run them (see
  ``worker.py`` for retries and the recovery of jobs whose worker died).
* the embedded SQLite file (no Redis): the table ``validations`` (indexed by creation time and by
  solution key) next to the cached solutions, and
  a thread pool inside the API process runs the jobs (:class:`LocalRunner`).

Every status change is a conditional update (compare-and-set on ``status``), so a late writer
(a worker finishing after a cancel, a failure hook after a success) never overwrites a final
state. Statuses: ``queued`` -> ``running`` -> ``finished`` | ``failed`` | ``cancelled``; a failed
attempt with retries left goes back to ``queued``.

Nothing here imports torch at module level: the API imports this module too.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import sqlite3
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ..cache import connect_sqlite

log = logging.getLogger("sigprop")

QUEUE_NAME = "sigprop-validations"
TERMINAL = ("finished", "failed", "cancelled")
ACTIVE = ("queued", "running")
# A test hook: "module:function" used instead of sigprop.worker.training.run_validation. Only the
# test suite sets it (tests/fake_training.py); it is deliberately not a documented setting.
FUNCTION_ENV = "SIGPROP_VALIDATION_FUNCTION"
_PROGRESS_EVERY_S = 0.25   # at most this often a job's progress is written to the store
_CANCEL_POLL_S = 0.25      # at most this often cancelled() reads the store
_MAX_ERROR_CHARS = 2000


# -- helpers --------------------------------------------------------------------------------------

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


def reason_from_traceback(exc_string: str) -> str:
    """The last line of a formatted traceback (``RuntimeError: boom``), or the whole text."""
    lines = [ln.strip() for ln in (exc_string or "").strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "unknown error"
    return last.removeprefix("sigprop.errors.SigpropError: ")[:_MAX_ERROR_CHARS]  # "invalid_request: ..."


def pick_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``: what the job trains on and reports."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_function() -> Callable:
    """The training function: ``sigprop.worker.training.run_validation`` (imported here, lazily:
    it needs torch), or the test hook named by ``SIGPROP_VALIDATION_FUNCTION``."""
    spec = os.environ.get(FUNCTION_ENV)
    if spec:
        module, _, name = spec.partition(":")
        return getattr(importlib.import_module(module), name or "run")
    from .training import run_validation
    return run_validation


# -- stores -----------------------------------------------------------------------------------------

_FIELDS = ("id", "status", "key", "request", "created", "started", "ended", "attempts", "device", "error",
           "progress", "results")
_SUMMARY_FIELDS = ("id", "status", "key", "created", "started", "ended", "attempts", "device", "error", "progress")


def _decode(raw: dict[str, Any]) -> dict[str, Any]:
    """A stored record (strings or SQLite values) as the ValidationJob fields."""
    out: dict[str, Any] = {"id": raw["id"], "status": raw["status"], "key": raw.get("key") or ""}
    for f in ("created", "started", "ended"):
        v = raw.get(f)
        out[f] = float(v) if v not in (None, "") else None
    out["attempts"] = int(raw.get("attempts") or 0)
    for f in ("device", "error"):
        v = raw.get(f)
        out[f] = v if v not in (None, "") else None
    out["progress"] = json.loads(raw.get("progress") or "{}")
    if "request" in raw:
        out["request"] = json.loads(raw.get("request") or "{}")
    if "results" in raw:
        out["results"] = json.loads(raw["results"]) if raw.get("results") else None
    return out


class ValidationStore:
    """What both backends provide. Records are dicts with the ValidationJob fields."""

    backend = "none"

    def create(self, vid: str, key: str, request: dict, created: float, owner: int | None = None) -> None: ...
    def get(self, vid: str) -> dict | None: ...
    def list(self, offset: int, limit: int) -> tuple[int, list[dict]]: ...
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
    def close(self) -> None: ...

    # -- transitions shared by both backends ------------------------------------------------------
    def finish(self, vid: str, results: dict) -> bool:
        return self.update(vid, {"status": "finished", "results": dumps(results), "ended": time.time(),
                                 "error": None}, only_if=("running",))

    def mark_cancelled(self, vid: str, note: str) -> bool:
        return self.update(vid, {"status": "cancelled", "ended": time.time(), "error": note[:_MAX_ERROR_CHARS]},
                           only_if=ACTIVE)

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
            ok = self.update(vid, {"status": "queued", "error": f"attempt {n} failed: {reason}; retrying"[:_MAX_ERROR_CHARS]},
                             only_if=ACTIVE)
            return "queued" if ok else None
        ok = self.update(vid, {"status": "failed", "ended": time.time(),
                               "error": f"failed after {n} attempt(s): {reason}"[:_MAX_ERROR_CHARS]}, only_if=ACTIVE)
        return "failed" if ok else None


class RedisValidationStore(ValidationStore):
    backend = "redis"
    INDEX = "sigprop:validations"
    # one sorted set per solution key (validation id by creation time), for list_for_key
    KEY_INDEX = "sigprop:validations:key:"

    # KEYS[1] record; ARGV[1] comma-separated allowed statuses; ARGV[2] n pairs to set; then the
    # pairs; then fields to delete.
    _UPDATE = """
local s = redis.call('hget', KEYS[1], 'status')
if not s then return 0 end
local ok = false
for st in string.gmatch(ARGV[1], '[^,]+') do if st == s then ok = true end end
if not ok then return 0 end
local n = tonumber(ARGV[2])
for i = 0, n - 1 do redis.call('hset', KEYS[1], ARGV[3 + 2 * i], ARGV[4 + 2 * i]) end
for i = 3 + 2 * n, #ARGV do redis.call('hdel', KEYS[1], ARGV[i]) end
return 1
"""
    # ARGV: now, device
    _START = """
local h = redis.call('hmget', KEYS[1], 'status', 'cancel')
if not h[1] then return 0 end
if h[1] ~= 'queued' and h[1] ~= 'running' then return 0 end
if h[2] then
  redis.call('hset', KEYS[1], 'status', 'cancelled', 'ended', ARGV[1], 'error', 'cancelled on request before it started')
  return 0
end
local n = redis.call('hincrby', KEYS[1], 'attempts', 1)
redis.call('hset', KEYS[1], 'status', 'running', 'started', ARGV[1], 'device', ARGV[2], 'progress', '{}')
return n
"""
    _CANCEL = """
local h = redis.call('hmget', KEYS[1], 'status', 'cancel')
if not h[1] then return false end
if h[1] == 'queued' then
  redis.call('hset', KEYS[1], 'status', 'cancelled', 'ended', ARGV[1], 'cancel', ARGV[1],
             'error', 'cancelled on request before it started')
end
if h[1] == 'running' and not h[2] then redis.call('hset', KEYS[1], 'cancel', ARGV[1]) end
return h[1]
"""

    def __init__(self, connection):
        self.r = connection

    @staticmethod
    def key(vid: str) -> str:
        return f"sigprop:val:{vid}"

    def create(self, vid, key, request, created, owner=None):
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.key(vid), mapping={"id": vid, "status": "queued", "key": key, "request": dumps(request),
                                          "created": repr(created), "attempts": 0, "progress": "{}"})
        pipe.zadd(self.INDEX, {vid: created})
        pipe.zadd(self.KEY_INDEX + key, {vid: created})
        pipe.execute()

    @staticmethod
    def _text(h: dict) -> dict:
        return {k.decode(): v.decode() for k, v in h.items()}

    def get(self, vid):
        h = self.r.hgetall(self.key(vid))
        return _decode(self._text(h)) if h.get(b"status") else None

    def list(self, offset, limit):
        pipe = self.r.pipeline(transaction=False)
        pipe.zcard(self.INDEX)
        pipe.zrevrange(self.INDEX, offset, offset + limit - 1)
        total, ids = pipe.execute()
        return total, self._summaries(ids)

    def _summaries(self, ids) -> list[dict]:
        pipe = self.r.pipeline(transaction=False)
        for vid in ids:
            pipe.hmget(self.key(vid.decode()), *_SUMMARY_FIELDS)
        items = []
        for values in pipe.execute():
            raw = {f: (v.decode() if v is not None else None) for f, v in zip(_SUMMARY_FIELDS, values)}
            if raw["status"]:
                items.append(_decode(raw))
        return items

    def list_for_key(self, key, limit):
        self._index_by_key()
        pipe = self.r.pipeline(transaction=False)
        pipe.zcard(self.KEY_INDEX + key)
        pipe.zrevrange(self.KEY_INDEX + key, 0, limit - 1)
        total, ids = pipe.execute()
        return total, self._summaries(ids)

    _indexed_by_key = False

    def _index_by_key(self, chunk: int = 1000) -> None:
        """Once per process: add validations created before the per-key index existed (or by an
        older sigprop) to it. ZADD is idempotent, so concurrent runs do no harm."""
        if self._indexed_by_key:
            return
        start = 0
        while True:
            rows = self.r.zrange(self.INDEX, start, start + chunk - 1, withscores=True)
            if not rows:
                break
            pipe = self.r.pipeline(transaction=False)
            for vid, _ in rows:
                pipe.hget(self.key(vid.decode()), "key")
            keys = pipe.execute()
            pipe = self.r.pipeline(transaction=False)
            for (vid, created), key in zip(rows, keys):
                if key:
                    pipe.zadd(self.KEY_INDEX + key.decode(), {vid: created})
            pipe.execute()
            start += chunk
        self._indexed_by_key = True

    def start(self, vid, device):
        return int(self.r.eval(self._START, 1, self.key(vid), repr(time.time()), device))

    def update(self, vid, fields, only_if):
        sets = [(k, v) for k, v in fields.items() if v is not None]
        dels = [k for k, v in fields.items() if v is None]
        args: list[Any] = [",".join(only_if), len(sets)]
        for k, v in sets:
            args += [k, repr(v) if isinstance(v, float) else str(v)]
        args += dels
        return bool(self.r.eval(self._UPDATE, 1, self.key(vid), *args))

    def set_progress(self, vid, progress):
        self.update(vid, {"progress": dumps(progress)}, only_if=("running",))

    def request_cancel(self, vid, now):
        out = self.r.eval(self._CANCEL, 1, self.key(vid), repr(now))
        return out.decode() if isinstance(out, bytes) else out

    def cancel_requested(self, vid):
        v = self.r.hget(self.key(vid), "cancel")
        return float(v) if v else None

    def close(self):
        self.r.close()


class SqliteValidationStore(ValidationStore):
    """The embedded store: the ``validations`` table in the solutions' SQLite file."""

    backend = "sqlite"
    _COLS = ", ".join(_FIELDS)

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._local = threading.local()
        self._db().executescript("""
            CREATE TABLE IF NOT EXISTS validations (
                id TEXT PRIMARY KEY, status TEXT NOT NULL, key TEXT NOT NULL, request TEXT NOT NULL,
                created REAL NOT NULL, started REAL, ended REAL, attempts INTEGER NOT NULL DEFAULT 0,
                device TEXT, error TEXT, progress TEXT NOT NULL DEFAULT '{}', results TEXT,
                cancel REAL, owner INTEGER);
            CREATE INDEX IF NOT EXISTS validations_created ON validations (created);
            CREATE INDEX IF NOT EXISTS validations_key ON validations (key, created);
        """)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = connect_sqlite(self.path)
            db.row_factory = sqlite3.Row
            self._local.db = db
        return db

    def create(self, vid, key, request, created, owner=None):
        self._db().execute("INSERT INTO validations (id, status, key, request, created, owner) VALUES (?, 'queued', ?, ?, ?, ?)",
                           (vid, key, dumps(request), created, owner))

    def get(self, vid):
        row = self._db().execute(f"SELECT {self._COLS} FROM validations WHERE id = ?", (vid,)).fetchone()
        return _decode(dict(row)) if row else None

    def list(self, offset, limit):
        db = self._db()
        total = db.execute("SELECT COUNT(*) FROM validations").fetchone()[0]
        rows = db.execute(f"SELECT {', '.join(_SUMMARY_FIELDS)} FROM validations ORDER BY created DESC, rowid DESC "
                          "LIMIT ? OFFSET ?", (limit, offset)).fetchall()
        return total, [_decode(dict(r)) for r in rows]

    def list_for_key(self, key, limit):
        db = self._db()
        total = db.execute("SELECT COUNT(*) FROM validations WHERE key = ?", (key,)).fetchone()[0]
        rows = db.execute(f"SELECT {', '.join(_SUMMARY_FIELDS)} FROM validations WHERE key = ? "
                          "ORDER BY created DESC, rowid DESC LIMIT ?", (key, limit)).fetchall()
        return total, [_decode(dict(r)) for r in rows]

    def start(self, vid, device):
        db, now = self._db(), time.time()
        row = db.execute("UPDATE validations SET status = 'running', started = ?, device = ?, attempts = attempts + 1, "
                         "progress = '{}' WHERE id = ? AND status IN ('queued', 'running') AND cancel IS NULL "
                         "RETURNING attempts", (now, device, vid)).fetchone()
        if row:
            return int(row[0])
        db.execute("UPDATE validations SET status = 'cancelled', ended = ?, error = 'cancelled on request before it started' "
                   "WHERE id = ? AND status IN ('queued', 'running')", (now, vid))
        return 0

    def update(self, vid, fields, only_if):
        cols = ", ".join(f"{k} = ?" for k in fields)
        marks = ", ".join("?" for _ in only_if)
        cur = self._db().execute(f"UPDATE validations SET {cols} WHERE id = ? AND status IN ({marks})",
                                 (*fields.values(), vid, *only_if))
        return cur.rowcount > 0

    def set_progress(self, vid, progress):
        self.update(vid, {"progress": dumps(progress)}, only_if=("running",))

    def request_cancel(self, vid, now):
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            row = db.execute("SELECT status, cancel FROM validations WHERE id = ?", (vid,)).fetchone()
            if row is None:
                return None
            status = row["status"]
            if status == "queued":
                db.execute("UPDATE validations SET status = 'cancelled', ended = ?, cancel = ?, "
                           "error = 'cancelled on request before it started' WHERE id = ?", (now, now, vid))
            elif status == "running" and row["cancel"] is None:
                db.execute("UPDATE validations SET cancel = ? WHERE id = ?", (now, vid))
            return status
        finally:
            db.execute("COMMIT")

    def cancel_requested(self, vid):
        row = self._db().execute("SELECT cancel FROM validations WHERE id = ?", (vid,)).fetchone()
        return float(row[0]) if row and row[0] is not None else None

    def fail_orphans(self) -> int:
        """Jobs left queued or running by an API process that no longer exists (a restart): they
        end ``failed`` with the reason, instead of showing ``running`` forever."""
        db = self._db()
        rows = db.execute("SELECT id, owner FROM validations WHERE status IN ('queued', 'running')").fetchall()
        n = 0
        for row in rows:
            if row["owner"] is not None and not _alive(int(row["owner"])):
                n += self.update(row["id"], {
                    "status": "failed", "ended": time.time(),
                    "error": "interrupted: the service process that ran it exited before it finished; submit it again"},
                    only_if=ACTIVE)
        return n

    def close(self):
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- running a job ---------------------------------------------------------------------------------

class _Hooks:
    """The ``progress`` and ``cancelled`` callbacks a job gets, throttled so a job may call them
    every step without hammering the store."""

    def __init__(self, store: ValidationStore, vid: str, deadline: float | None, stopping: Callable[[], bool] | None):
        self.store, self.vid, self.deadline, self.stopping = store, vid, deadline, stopping
        self._pending: dict | None = None
        self._last_write = 0.0
        self._last_poll = 0.0
        self.stopped = False
        self.timed_out = False

    def progress(self, info: dict) -> None:
        self._pending = dict(info)
        now = time.monotonic()
        if now - self._last_write >= _PROGRESS_EVERY_S:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if self._pending is not None:
            try:
                self.store.set_progress(self.vid, self._pending)
            except Exception as exc:  # noqa: BLE001 - a store blip must not kill an hour of training
                log.warning("validation %s: progress not stored (%s)", self.vid, exc)
                return
            self._pending = None
            self._last_write = now if now is not None else time.monotonic()

    def cancelled(self) -> bool:
        if self.stopped:
            return True
        now = time.monotonic()
        if self.deadline is not None and now > self.deadline:
            self.timed_out = self.stopped = True
        elif self.stopping is not None and self.stopping():
            self.stopped = True
        elif now - self._last_poll >= _CANCEL_POLL_S:
            self._last_poll = now
            try:
                self.stopped = self.store.cancel_requested(self.vid) is not None
            except Exception as exc:  # noqa: BLE001 - asked again at the next poll
                log.warning("validation %s: cancel flag not readable (%s)", self.vid, exc)
        return self.stopped


class Interrupted(Exception):
    """A local job stopped by its deadline or by the service shutting down (not by a user)."""


def execute(store: ValidationStore, vid: str, payload: dict, *, deadline: float | None = None,
            stopping: Callable[[], bool] | None = None) -> str:
    """Run one attempt of validation ``vid``: the code every job runs, in an RQ work horse or in
    the API's local pool. Returns the status it ended in; an exception from the training function
    propagates (the caller records the failure and decides about a retry) unless a cancel was
    requested, in which case the job ends ``cancelled``."""
    device = pick_device()
    attempt = store.start(vid, device)
    if attempt == 0:
        log.info("validation %s not started: cancelled or already final", vid)
        return "skipped"
    from ..schemas.solve import Solution

    fn = load_function()
    hooks = _Hooks(store, vid, deadline, stopping)
    try:
        results = fn(payload["request"], payload["graph"], Solution.model_validate(payload["solution"]),
                     progress=hooks.progress, cancelled=hooks.cancelled, device=device)
    except BaseException:
        hooks.flush()
        if store.cancel_requested(vid) is not None:
            store.mark_cancelled(vid, "cancelled on request while running")
            return "cancelled"
        if hooks.timed_out:
            raise Interrupted("timed out: the job ran longer than SIGPROP_VALIDATION_TIMEOUT_S") from None
        if hooks.stopped:
            raise Interrupted("interrupted: the service shut down while it ran; submit it again") from None
        raise
    hooks.flush()
    if not isinstance(results, dict):
        results = {"value": results}
    if store.finish(vid, results):
        return "finished"
    return "skipped"


def rq_job(vid: str, payload: dict) -> None:
    """The function RQ runs in the work horse (enqueued by :class:`RedisQueue`)."""
    from rq import get_current_job
    from rq.timeouts import JobTimeoutException

    from ..errors import SigpropError

    job = get_current_job()
    try:
        execute(RedisValidationStore(job.connection), vid, payload)
    except (JobTimeoutException, SigpropError):
        # A job that ran out of time would only run out of time again, and a rejected request
        # (a missing .npz, a graph the trainer cannot build) is rejected again: no retry.
        job.retries_left = 0
        raise


# -- queues ----------------------------------------------------------------------------------------

class RedisQueue:
    """Jobs on the RQ queue, run by ``sigprop worker`` processes."""

    def __init__(self, connection, name: str = QUEUE_NAME, timeout_s: int = 3600, retries: int = 2):
        from rq import Queue
        from rq.serializers import JSONSerializer

        self.r = connection
        self.queue = Queue(name, connection=connection, serializer=JSONSerializer)
        self.timeout_s, self.retries = timeout_s, retries

    def submit(self, vid: str, payload: dict) -> None:
        from rq import Retry

        self.queue.enqueue(rq_job, vid, payload, job_id=vid, job_timeout=self.timeout_s,
                           retry=Retry(max=self.retries) if self.retries > 0 else None,
                           result_ttl=86_400, failure_ttl=7 * 86_400,
                           description=f"sigprop validation {vid}")

    def cancel(self, vid: str) -> None:
        """Take a queued job off the queue (the record is already ``cancelled``; a worker that
        dequeued it meanwhile sees that and does not run it)."""
        from rq.exceptions import InvalidJobOperation, NoSuchJobError
        from rq.job import Job
        from rq.serializers import JSONSerializer

        try:
            Job.fetch(vid, connection=self.r, serializer=JSONSerializer).cancel()
        except (NoSuchJobError, InvalidJobOperation):
            pass

    def rq_outcome(self, vid: str, settle_s: float = 5.0) -> tuple[str, str] | None:
        """For a record still queued/running: RQ's final status of the job when RQ says it ended
        more than ``settle_s`` ago (so the worker's own hooks had their chance), as
        (status, reason); else None. Covers workers that run without sigprop's hooks."""
        from rq.utils import utcparse

        status, ended = self.r.hmget(f"rq:job:{vid}", "status", "ended_at")
        if status is None or status.decode() not in ("failed", "stopped", "canceled"):
            return None
        if ended:
            try:
                if time.time() - utcparse(ended.decode()).timestamp() < settle_s:
                    return None
            except ValueError:
                pass
        reason = "the worker reported the job failed"
        try:
            from rq.job import Job
            from rq.serializers import JSONSerializer

            result = Job.fetch(vid, connection=self.r, serializer=JSONSerializer).latest_result()
            if result is not None and result.exc_string:
                reason = reason_from_traceback(result.exc_string)
        except Exception:  # noqa: BLE001 - best effort: the status alone is enough
            pass
        return status.decode(), reason

    def close(self) -> None:
        pass


class LocalRunner:
    """No Redis: jobs run in a thread pool inside the API process, one attempt each (no retries;
    a job the process could not finish ends ``failed`` with the reason)."""

    def __init__(self, store: SqliteValidationStore, workers: int = 1, timeout_s: float = 3600.0):
        self.store, self.timeout_s = store, timeout_s
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sigprop-validation")
        self.futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def submit(self, vid: str, payload: dict) -> None:
        with self._lock:
            self.futures[vid] = self.pool.submit(self._run, vid, payload)

    def _run(self, vid: str, payload: dict) -> None:
        try:
            execute(self.store, vid, payload, deadline=time.monotonic() + self.timeout_s,
                    stopping=self._stopping.is_set)
        except BaseException as exc:  # noqa: BLE001 - recorded on the job, never lost in a thread
            from ..errors import SigpropError

            if isinstance(exc, SigpropError):
                reason = f"{exc.code}: {exc.message}"
            elif isinstance(exc, Interrupted):
                reason = str(exc)
            else:
                reason = f"{type(exc).__name__}: {exc}"
                log.exception("validation %s failed", vid)
            self.store.record_failure(vid, reason, will_retry=False)
        finally:
            with self._lock:
                self.futures.pop(vid, None)

    def cancel(self, vid: str) -> None:
        with self._lock:
            fut = self.futures.get(vid)
        if fut is not None:
            fut.cancel()  # not started yet: it never will; running: the job polls its cancel flag

    def close(self) -> None:
        """Stop: running jobs see cancelled() and end ``failed`` ("interrupted"), queued ones too."""
        self._stopping.set()
        with self._lock:
            pending = list(self.futures)
        for vid in pending:
            fut = self.futures.get(vid)
            if fut is not None and fut.cancel():
                self.store.record_failure(vid, "interrupted: the service shut down before it started; submit it again",
                                          will_retry=False)
        self.pool.shutdown(wait=True, cancel_futures=True)
