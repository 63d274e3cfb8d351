"""The Redis solution cache (``SIGPROP_REDIS_URL`` set), in the Redis that the API processes, the
rate limiter and the RQ workers share (validations: ``redis_validations``).

Solutions: the hash ``sigprop:sol:{key}`` per record, the sorted sets ``sigprop:index`` (key by
creation time) and ``sigprop:index:method:{m}`` / ``sigprop:index:activation:{a}`` for the
filters, and ``sigprop:lock:{key}`` for the single-flight lock. Calls time out quickly and raise
``CacheUnavailable``, so a Redis outage degrades solves instead of hanging them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid

import redis

from . import redis_config, redis_scripts
from .health import NOT_STORED, StorageHealth, write_refused
from .hot import HotAnswers
from .records import (
    PLAIN,
    CacheUnavailable,
    Checksum,
    StorageFull,
    checked_answer,
    decode_record,
    json_object,
    stored_count,
    summary_row,
    too_large_note,
)

log = logging.getLogger("sigprop")


class RedisSolutionCache:
    """Solutions in Redis; every call raises ``CacheUnavailable`` when Redis cannot be reached, and
    a write Redis refuses (full, read-only) raises ``StorageFull``.

    Retention: ``max_entries`` and ``max_bytes`` (0: no bound) are enforced on every put, inside the
    put's script, by evicting the least recently used records (``sigprop:lru``: last hit or
    creation) together with their index entries; the hit path only moves its key in that order."""

    backend = "redis"
    _PREFIX = "sigprop:"
    _RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
    EVICT_PER_PUT = 1000  # most records one put evicts (amortized: a put evicts what it pushed over)

    def __init__(
        self,
        url: str,
        timeout_s: float = 0.5,
        *,
        max_entries: int = 0,
        max_bytes: int = 0,
        checksum: Checksum = PLAIN,
        health: StorageHealth | None = None,
    ):
        self.url, self.timeout_s = url, timeout_s
        self.r = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            health_check_interval=5,
        )
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.checksum = checksum
        self.health = health or StorageHealth()
        self._scripts = {
            name: self.r.register_script(getattr(redis_scripts, name))
            for name in ("GET_ANSWER", "GET_ALL", "PUT", "DELETE", "BACKFILL", "COUNT_HITS")
        }
        self._backfilled = False
        self._hot: HotAnswers | None = None

    def hot_answers(self) -> HotAnswers:
        """This process's memory of hot answers over this cache (``hot.py``), made on first use."""
        if self._hot is None:
            self._hot = HotAnswers(self.url, self._PREFIX, self.checksum, self.timeout_s, self._count_hits, self.health)
        return self._hot

    def _count_hits(self, keys: list[str], args: list) -> int:
        """``redis_scripts.COUNT_HITS`` on the cache's own connections; raises redis errors."""
        return int(self._scripts["COUNT_HITS"](keys=keys, args=args))

    def _k(self, *parts: str) -> str:
        return self._PREFIX + ":".join(parts)

    def _call(self, fn, *args, **kwargs):
        if self.health.suspended:  # a call just timed out: fail at once (StorageHealth.lost)
            raise CacheUnavailable("Redis did not answer a moment ago (timeout or lost connection)")
        return self._reach(fn, *args, **kwargs)

    def _reach(self, fn, *args, **kwargs):
        """``fn`` against Redis, its failures as the cache's exceptions; a call that times out or
        loses its connection suspends the others for ``StorageHealth.lost_s``."""
        try:
            out = fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self.health.lost()
            raise CacheUnavailable(str(exc)) from None
        except redis.ResponseError as exc:
            if write_refused(exc):
                raise StorageFull(NOT_STORED) from None
            # anything else Redis refuses (a key of the wrong type where an index should be): the
            # cache is unusable for this call, which degrades like an outage rather than a 500
            raise CacheUnavailable(f"Redis refused the call: {exc}") from None
        if self.health.lost_until:  # Redis answered (the readiness probe, after an outage): calls wait again
            self.health.reached()
        return out

    def _hit_note(self, key: str, note) -> None:
        note = note.decode() if isinstance(note, bytes) else (note or "")
        if note == "refused":
            self.health.refused("hit_count")
        elif note:
            log.warning("cache entry %s: %s", note, key)

    def _flush_hits(self) -> None:
        """This process's pending hit counts, written before it reads counts back."""
        if self._hot is not None:
            self._hot.flush()

    def get(self, key, count_hit=True):
        self._flush_hits()
        flat, note = self._call(
            self._scripts["GET_ALL"],
            keys=[self._k("sol", key), self._k("lru")],
            args=[key, repr(time.time()), "1" if count_hit else "0"],
        )
        self._hit_note(key, note)
        h = {k.decode(errors="replace"): v for k, v in zip(flat[::2], flat[1::2], strict=False)}
        return decode_record(key, h) if "answer" in h else None

    def get_answer(self, key):
        answer, digest, note = self._call(
            self._scripts["GET_ANSWER"], keys=[self._k("sol", key), self._k("lru")], args=[key, repr(time.time())]
        )
        self._hit_note(key, note)
        try:
            answer = answer.decode() if answer is not None else None
        except UnicodeDecodeError:
            return None  # not UTF-8, so not an answer sigprop wrote: recomputed and overwritten
        return checked_answer(
            key, answer, digest.decode(errors="replace") if digest is not None else None, self.checksum
        )

    def put(self, rec):
        size = rec.size
        if self.max_bytes and size > self.max_bytes:
            raise StorageFull(too_large_note(size, self.max_bytes))
        fields = {
            "answer": rec.answer,
            "request": rec.request,
            "ids": json.dumps(rec.ids),
            "created": repr(rec.created),
            "version": rec.version,
            "method": rec.method,
            "activation": rec.activation,
            "hits": rec.hits,
            "digest": self.checksum.digest(rec.answer),
            "size": size,
        }
        args = [self._PREFIX, rec.key, repr(rec.created), size, self.max_entries, self.max_bytes, self.EVICT_PER_PUT]
        for name, value in fields.items():
            args += [name, value]
        keys = [
            self._k("sol", rec.key),
            self._k("index"),
            self._k("index", "method", rec.method),
            self._k("index", "activation", rec.activation),
            self._k("lru"),
            self._k("bytes"),
        ]
        # this process's pending hits first: eviction then sees their keys' true LRU order (hits
        # pending in other processes move their keys within hot.FLUSH_S)
        self._flush_hits()
        try:
            self._backfill()
            evicted = self._call(self._scripts["PUT"], keys=keys, args=args)
        except StorageFull:
            self.health.refused("store")
            raise
        self.health.stored()
        self.health.evicted("solutions", int(evicted))

    def _backfill(self, chunk: int = 1000) -> None:
        """Once per process: give records stored before retention existed a size and an LRU entry
        (``redis_scripts.BACKFILL``), unless another process already finished that (the marker)."""
        if self._backfilled:
            return
        if not self._call(self.r.exists, self._k("retention")):
            start = 0
            while True:
                n = self._call(
                    self._scripts["BACKFILL"],
                    keys=[self._k("index"), self._k("lru"), self._k("bytes")],
                    args=[self._PREFIX, start, chunk],
                )
                if n < chunk:
                    break
                start += chunk
            self._call(self.r.set, self._k("retention"), "1")
        self._backfilled = True

    def delete(self, key):
        if self._hot is not None:
            self._hot.drop(key)  # at once here; the other processes hear of it from Redis (hot.py)
        return bool(self._call(self._scripts["DELETE"], keys=[self._k("sol", key)], args=[self._PREFIX, key]))

    def stats(self) -> dict:
        """How many records the cache holds and their bytes, as the retention bounds count them."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zcard(self._k("index"))
        pipe.get(self._k("bytes"))
        entries, size = self._call(pipe.execute)
        return {
            "entries": int(entries),
            "bytes": stored_count(size),
            "max_entries": self.max_entries,
            "max_bytes": self.max_bytes,
        }

    def list(self, offset, limit, method=None, activation=None):
        def run():
            sets = [self._k("index")]
            if method:
                sets = [self._k("index", "method", method)]
            if activation:
                sets.append(self._k("index", "activation", activation))
            if len(sets) == 1:
                total = self.r.zcard(sets[0])
                keys = self.r.zrevrange(sets[0], offset, offset + limit - 1)
            else:
                both = self.r.zinter(sets, withscores=True)  # newest first below
                both.sort(key=lambda kv: -kv[1])
                total = len(both)
                keys = [k for k, _ in both[offset : offset + limit]]
            return total, [k.decode(errors="replace") for k in keys]

        total, keys = self._call(run)
        records = [self.get(k, count_hit=False) for k in keys]
        return total, [r for r in records if r is not None]

    # The summary fields of one record, with targets and graph_summary cut out of the answer
    # inside Redis (as summary_part does), so a page of summaries never ships whole answers.
    _SUMMARY = """
local h = redis.call('hmget', KEYS[1], 'created', 'version', 'method', 'activation', 'hits', 'answer')
if not h[1] then return false end
local a = h[6] or ''
local function part(name)
  local s, e = string.find(a, '"' .. name .. '":{', 1, true)
  if not s then return '' end
  local close = string.find(a, '}', e, true)
  if not close then return '' end
  return string.sub(a, e, close)
end
return {h[1], h[2] or '', h[3] or '', h[4] or '', h[5] or '0', part('targets'), part('graph_summary')}
"""

    def _index_sets(self, method, activation) -> list[str]:
        sets = [self._k("index", "method", method)] if method else [self._k("index")]
        if activation:
            sets.append(self._k("index", "activation", activation))
        return sets

    def _page_keys(self, offset, limit, method, activation, key_prefix) -> tuple[int, list[bytes]]:
        sets = self._index_sets(method, activation)
        if not key_prefix and len(sets) == 1:
            pipe = self.r.pipeline(transaction=False)
            pipe.zcard(sets[0])
            pipe.zrevrange(sets[0], offset, offset + limit - 1)
            total, keys = pipe.execute()
            return total, keys
        if key_prefix and len(key_prefix) >= 64 and len(sets) == 1:  # a whole key: one lookup
            found = self.r.zscore(sets[0], key_prefix) is not None
            return int(found), ([key_prefix.encode()] if found and offset == 0 else [])
        if key_prefix:
            # Redis matches the prefix while it scans the index (ZSCAN MATCH), so only the matches
            # travel: a few milliseconds for 10,000 solutions. Keys are hashes, so a lexical index
            # would help only this search, and not the newest-first order the page shows.
            pattern = re.sub(r"([*?\[\]\\])", r"\\\1", key_prefix) + "*"
            pairs = list(dict(self.r.zscan_iter(sets[0], match=pattern, count=10_000)).items())  # ZSCAN may repeat
            if len(sets) > 1:
                pipe = self.r.pipeline(transaction=False)
                for k, _ in pairs:
                    pipe.zscore(sets[1], k)
                pairs = [kv for kv, found in zip(pairs, pipe.execute(), strict=False) if found is not None]
        else:  # both filters: the intersection of the two indexes, O(n) in Redis
            pairs = self.r.zinter(sets, withscores=True)
        pairs.sort(key=lambda kv: -kv[1])  # newest first
        return len(pairs), [k for k, _ in pairs[offset : offset + limit]]

    def list_summaries(self, offset, limit, method=None, activation=None, key_prefix=None):
        self._flush_hits()

        def run():
            total, keys = self._page_keys(offset, limit, method, activation, key_prefix)
            script = self.r.register_script(self._SUMMARY)
            pipe = self.r.pipeline(transaction=False)
            for k in keys:
                script(keys=[self._k("sol", k.decode())], client=pipe)
            # raise_on_error=False: a key holding something other than a hash (WRONGTYPE) is one
            # unreadable row, skipped, not a failed page
            return total, list(zip(keys, pipe.execute(raise_on_error=False), strict=False)) if keys else []

        total, rows = self._call(run)
        items = []
        for k, fields in rows:
            if not fields or isinstance(fields, Exception):
                continue  # deleted between the index read and the record read, or not a hash
            created, version, method_, activation_, hits, targets, summary = (
                f.decode(errors="replace") for f in fields
            )
            row = summary_row(
                k.decode(errors="replace"),
                created,
                version,
                method_,
                activation_,
                hits,
                json_object(targets),
                json_object(summary),
            )
            if row is not None:
                items.append(row)
        return total, items

    def counts(self, field, names):
        names = list(names)

        def run():
            pipe = self.r.pipeline(transaction=False)
            for name in names:
                pipe.zcard(self._k("index", field, name))
            return pipe.execute()

        return {name: n for name, n in zip(names, self._call(run), strict=False) if n}

    def ping(self):
        try:
            return bool(self.r.ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    def config_state(self):
        """Whether Redis' own settings can drop accepted work (``redis_config.check``): for
        ``/readyz``; ``CacheUnavailable`` when Redis does not answer."""
        return self._reach(redis_config.check, self.r)

    def writable(self) -> bool:
        """Whether Redis takes a write now (a probe key with a short expiry). OOM and READONLY are
        states of the whole server, so a probe that succeeds also ends a degraded spell."""
        try:  # not suspended by a recent timeout: this probe is what finds Redis back
            self._reach(self.r.set, self._k("probe"), repr(time.time()), px=10_000)
        except StorageFull:
            return False
        self.health.stored()
        return True

    def acquire(self, key, ttl_s):
        token = uuid.uuid4().hex
        ok = self._call(self.r.set, self._k("lock", key), token, nx=True, px=int(ttl_s * 1000))
        return token if ok else None

    def release(self, key, token):
        try:
            self.r.eval(self._RELEASE, 1, self._k("lock", key), token)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            # a stall outlasting the release: released once Redis answers, not held for the lock's
            # whole expiry (the key's next request waited 30 s for it, then answered 503)
            threading.Thread(target=self._release_later, args=(key, token), daemon=True).start()

    def _release_later(self, key, token, every_s: float = 0.5, give_up_s: float = 120.0) -> None:
        until = time.monotonic() + give_up_s
        while time.monotonic() < until:
            time.sleep(every_s)
            try:
                self.r.eval(self._RELEASE, 1, self._k("lock", key), token)  # only if still ours
                return
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                continue
            except redis.RedisError:
                return

    def close(self):
        if self._hot is not None:
            self._hot.close()  # pending hit counts are written first
        self.r.close()
