"""The Redis validation store (``SIGPROP_REDIS_URL`` set).

Validations: the hash ``sigprop:val:{id}`` (no expiry), the sorted set ``sigprop:validations``
(id by creation time) that ``GET /v1/validations`` pages through, and one sorted set per
solution, ``sigprop:validations:key:{solution key}``, that the dashboard's solution page reads
(``list_for_key``; validations stored before it existed are added to it once per process).
Status changes are Lua scripts, so each compare-and-set is atomic.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import redis_scripts
from .records import (
    SUMMARY_FIELDS,
    ValidationTransitions,
    decode_validation,
    decode_validations,
    dumps,
)

log = logging.getLogger("sigprop")


class RedisValidationStore(ValidationTransitions):
    """Validations in Redis, on a connection the caller gives (the API shares it with the RQ queue)."""

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
  redis.call('hset', KEYS[1], 'status', 'cancelled', 'ended', ARGV[1],
             'error', 'cancelled on request before it started')
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

    def __init__(self, connection, *, max_age_s: float = 0, max_records: int = 0):
        self.r = connection
        # retention (0: no bound): final validations older than max_age_s, or beyond the newest
        # max_records, are removed when a new one is created; active ones never are
        self.max_age_s, self.max_records = max_age_s, max_records
        self.trimmed = 0  # removed by this process (the app's metrics read the difference)

    @staticmethod
    def key(vid: str) -> str:
        return f"sigprop:val:{vid}"

    def create(self, vid, key, request, created, owner=None):
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            self.key(vid),
            mapping={
                "id": vid,
                "status": "queued",
                "key": key,
                "request": dumps(request),
                "created": repr(created),
                "attempts": 0,
                "progress": "{}",
            },
        )
        pipe.zadd(self.INDEX, {vid: created})
        pipe.zadd(self.KEY_INDEX + key, {vid: created})
        pipe.execute()
        if self.max_age_s or self.max_records:
            self.trim(created)

    def trim(self, now: float, cap: int = 100) -> int:
        """Remove final validations past the retention bounds, at most ``cap`` per call: each
        create removes about what it adds, so the work is amortized and never a full scan."""
        cutoff = now - self.max_age_s if self.max_age_s else 0
        n = int(
            self.r.eval(
                redis_scripts.TRIM_VALIDATIONS,
                1,
                self.INDEX,
                repr(cutoff),
                self.max_records,
                self.key(""),
                self.KEY_INDEX,
                cap,
            )
        )
        self.trimmed += n
        return n

    def discard(self, vid: str, key: str) -> None:
        """Remove a record that was never accepted (its enqueue failed): a delete, which Redis
        allows even when it refuses writes."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.key(vid))
        pipe.zrem(self.INDEX, vid)
        pipe.zrem(self.KEY_INDEX + key, vid)
        pipe.execute()

    @staticmethod
    def _text(h: dict) -> dict:
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in h.items()}

    def get(self, vid):
        h = self.r.hgetall(self.key(vid))
        return decode_validation(self._text(h)) if h.get(b"status") else None

    def list(self, offset, limit):
        pipe = self.r.pipeline(transaction=False)
        pipe.zcard(self.INDEX)
        pipe.zrevrange(self.INDEX, offset, offset + limit - 1)
        total, ids = pipe.execute()
        return total, self._summaries(ids)

    def _summaries(self, ids) -> list[dict]:
        pipe = self.r.pipeline(transaction=False)
        for vid in ids:
            pipe.hmget(self.key(vid.decode()), *SUMMARY_FIELDS)
        rows = []
        for values in pipe.execute(raise_on_error=False):
            if isinstance(values, Exception):  # not a hash: unreadable, skipped
                continue
            raw = {
                f: (v.decode(errors="replace") if v is not None else None)
                for f, v in zip(SUMMARY_FIELDS, values, strict=False)
            }
            if raw["status"]:
                rows.append(raw)
        return decode_validations(rows)

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
            for (vid, created), key in zip(rows, keys, strict=False):
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
