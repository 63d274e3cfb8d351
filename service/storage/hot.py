"""Hot answers in process memory, kept coherent with Redis, and hit counts written in batches.

A cache hit of POST /v1/solve used to cost a Redis round trip (the answer and its checksum out, the
hit counted in) and a SHA-256 of the whole answer. ``HotAnswers`` keeps the answers this process
served most recently in memory, each checked against its checksum once, when it is read from Redis,
and counts their hits in memory (``flush`` writes them: every ``FLUSH_S`` from a background thread,
before this process reads stored hit counts, and at shutdown).

Coherence comes from Redis' server-assisted client-side caching: the connection that reads answers
into memory has ``CLIENT TRACKING`` on, redirected to a second connection subscribed to
``__redis__:invalidate``. Whenever a key it read changes (a DELETE through any process, a
retention eviction, a rewrite, a FLUSHDB, an edit by hand), Redis pushes the key's name there, and
every hit served from memory first reads what was pushed, without blocking. An invalidation that
has reached this process is therefore applied before its next hit; on one host Redis writes it
before it answers the DELETE, so a hit that arrives after a DELETE was answered is never served
the deleted answer. Two backstops bound staleness where delivery fails: a broken or unreadable
invalidation connection drops the whole memory (hits go to Redis again until it is re-made), and
no entry is served from memory more than ``MAX_AGE_S`` after it was read from Redis.

Hit counts are eventually exact: a batch that cannot be written (Redis down) is kept and retried,
up to ``MAX_PENDING`` keys (a batch whose reply was lost to a timeout after Redis ran it is counted
twice); a batch Redis refuses (full, read-only) is dropped and reported, as a
refused hit count was before; counts for a record deleted meanwhile, or deleted and stored again,
are dropped (each count names the record's creation time). A hit moves its
key in the LRU order when its batch is written, to the time of its last hit; a process writes its
pending batch before each of its puts, so the evictions a put makes see that process's hits, and
hits pending in other processes reach the order within ``FLUSH_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import redis

from . import redis_scripts
from .records import Checksum

log = logging.getLogger("sigprop")

FLUSH_S = 1.0  # how often pending hit counts are written
MAX_AGE_S = 5.0  # the longest an answer is served from memory without reading it from Redis again
MAX_BYTES = 32 << 20  # answer text held per process (answers and their personalized copies)
MAX_VIEWS = 8  # personalized copies kept per answer (one per request body seen)
MAX_PENDING = 100_000  # keys with pending hit counts kept while Redis cannot take them
RETRY_S = 1.0  # how long after a failure the tracking connections are made again
_CHANNEL = "__redis__:invalidate"


@dataclass
class _Entry:
    text: str  # the canonical answer, checksum verified
    created: bytes  # the record's creation time as stored: its hits are counted on this record only
    read_at: float  # monotonic time it was read from Redis
    views: dict = field(default_factory=dict)  # body digest -> personalized answer bytes

    @property
    def size(self) -> int:
        return len(self.text) + sum(len(v) for v in self.views.values())


class HotAnswers:
    """This process's memory of hot answers for a ``RedisSolutionCache`` (see the module doc)."""

    def __init__(self, url: str, prefix: str, checksum: Checksum, timeout_s: float, count_fallback, health):
        self._url, self._prefix, self._timeout_s = url, prefix, timeout_s
        self.checksum = checksum
        self._count_fallback = count_fallback  # writes a batch through the cache's own client
        self._health = health
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # the entries and the invalidation connection
        self._io = threading.Lock()  # the tracking connection
        self._sub = self._track = None
        self._retry_at = 0.0
        self._seq = 0  # invalidation messages applied: a read that saw one land is not kept
        self.flushes = 0  # FLUSHDB / FLUSHALL invalidations seen (each dropped the whole memory)
        self._pending: dict[tuple, list] = {}  # (key, created) -> [hits, last hit (epoch s)]
        self._pending_lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._closed = threading.Event()

    # -- the hit path: memory only ---------------------------------------------------------------
    def hit(self, key: str, view: bytes | None = None) -> tuple[str, bytes | None] | None:
        """(canonical answer, personalized bytes for ``view`` if kept) from memory, counting the
        hit; None when not in memory. Never blocks on I/O: it reads pushed invalidations first."""
        with self._lock:
            if self._sub is None or not self._drain():
                return None
            entry = self._entries.get(key)
            if entry is None:
                return None
            if time.monotonic() - entry.read_at > MAX_AGE_S:
                self._remove(key)
                return None
            self._entries.move_to_end(key)
        self.count(key, entry.created)
        return entry.text, entry.views.get(view) if view is not None else None

    def keep_view(self, key: str, text: str, view: bytes, body: bytes) -> None:
        """Remember ``body``, the answer ``text`` of ``key`` personalized for the request body
        ``view``, while ``text`` is still the answer in memory."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.text is not text or view in entry.views:
                return
            if len(entry.views) >= MAX_VIEWS:
                self._bytes -= len(entry.views.pop(next(iter(entry.views))))
            entry.views[view] = body
            self._bytes += len(body)
            self._shrink()

    # -- reading into memory (a worker thread) ---------------------------------------------------
    def fetch(self, key: str) -> str | None:
        """The verified answer from memory or one tracked read of Redis, counting the hit; None
        when this cannot tell (not stored, damaged, Redis unreachable: the caller asks the cache,
        which says which and counts the hit itself)."""
        found = self.hit(key)
        if found is not None:
            return found[0]
        if self._health.suspended or not self._connected():  # Redis just timed out: no wait here
            return None
        with self._lock:
            seq = self._seq
        try:
            with self._io:
                if self._track is None:  # dropped by a failure in another thread just now
                    return None
                self._track.send_command("HMGET", self._prefix + "sol:" + key, "answer", "digest", "created")
                answer, digest, created = self._track.read_response()
        except redis.ResponseError:
            return None  # not a hash (a damaged entry): the cache's own read says so and repairs
        except (redis.RedisError, OSError, ValueError):
            self._health.lost()  # the cache's own calls fail at once for a moment too
            self._down()
            return None
        text = self._verified(answer, digest)
        if text is None or created is None:
            return None
        self._keep(key, _Entry(text, created, time.monotonic()), seq)
        self.count(key, created)
        return text

    def _verified(self, answer, digest) -> str | None:
        if answer is None or digest is None:
            return None
        try:
            text, digest = answer.decode(), digest.decode()
        except UnicodeDecodeError:
            return None
        return text if self.checksum.verify(text, digest) else None  # once per read, not per hit

    def _keep(self, key: str, entry: _Entry, seq: int) -> None:
        with self._lock:
            # an invalidation that landed while we read may be about this key: do not keep the
            # answer (it is still served this once; it was current when Redis read it)
            if self._sub is None or not self._drain() or self._seq != seq or entry.size > MAX_BYTES // 4:
                return
            self._remove(key)
            self._entries[key] = entry
            self._bytes += entry.size
            self._shrink()

    def drop(self, key: str) -> None:
        with self._lock:
            self._remove(key)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size

    def _shrink(self) -> None:
        while self._bytes > MAX_BYTES and self._entries:
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.size

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Bytes of the answers (and their views) held now."""
        return self._bytes

    # -- invalidation ----------------------------------------------------------------------------
    def _drain(self) -> bool:
        """Apply every invalidation Redis has pushed (lock held). False, with the memory dropped,
        when the invalidation connection failed: nothing can be served from memory then."""
        try:
            while self._sub.can_read(timeout=0):
                self._apply(self._sub.read_response())
        except (redis.RedisError, OSError, ValueError):
            self._drop_all()
            return False
        return True

    def _apply(self, message) -> None:
        if not isinstance(message, list) or len(message) != 3 or message[0] != b"message":
            return  # a subscribe confirmation
        self._seq += 1
        keys = message[2]
        if keys is None:  # FLUSHDB, FLUSHALL (of any database: tracking ignores them): every key
            self.flushes += 1
            self._entries.clear()
            self._bytes = 0
            return
        sol = (self._prefix + "sol:").encode()
        for k in keys if isinstance(keys, list) else [keys]:
            if isinstance(k, bytes) and k.startswith(sol):
                self._remove(k[len(sol) :].decode(errors="replace"))

    def _connected(self) -> bool:
        """Whether the two tracking connections are up (made again at most every ``RETRY_S``)."""
        with self._lock:
            if self._sub is not None:
                return True
            if time.monotonic() < self._retry_at or self._closed.is_set():
                return False
            self._retry_at = time.monotonic() + RETRY_S
        try:
            sub, track = self._connect()
        except (redis.RedisError, OSError, ValueError) as exc:
            log.debug("hot answers: no tracking connection (%s)", exc)
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
                self._health.lost()
            return False
        with self._lock, self._io:
            self._sub, self._track = sub, track
            self._entries.clear()
            self._bytes = 0
        return True

    def _connect(self):
        # RESP2 on both: invalidations arrive as pub/sub messages on the redirect connection
        pool = redis.ConnectionPool.from_url(
            self._url, protocol=2, socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s
        )
        sub, track = pool.make_connection(), pool.make_connection()
        sub.connect()
        sub.send_command("CLIENT", "ID")
        sub_id = sub.read_response()
        sub.send_command("SUBSCRIBE", _CHANNEL)
        sub.read_response()
        track.connect()
        # NOLOOP: this connection's own hit-count writes do not invalidate what it read
        track.send_command("CLIENT", "TRACKING", "ON", "REDIRECT", sub_id, "NOLOOP")
        if track.read_response() not in (b"OK", "OK"):
            raise redis.RedisError("CLIENT TRACKING refused")
        return sub, track

    def _down(self) -> None:
        with self._lock:
            self._drop_all()

    def _drop_all(self) -> None:
        """Forget everything and close the connections (lock held): invalidations may be lost."""
        self._entries.clear()
        self._bytes = 0
        for conn in (self._sub, self._track):
            if conn is not None:
                try:
                    conn.disconnect()
                except (redis.RedisError, OSError):
                    pass
        self._sub = self._track = None
        self._retry_at = time.monotonic() + RETRY_S

    # -- hit counts --------------------------------------------------------------------------------
    def count(self, key: str, created: bytes) -> None:
        """One hit on the record of ``key`` created at ``created`` (a record deleted and stored
        again is another record: hits of the old one are not added to the new one)."""
        with self._pending_lock:
            slot = self._pending.get((key, created))
            if slot is None:
                if len(self._pending) >= MAX_PENDING:
                    return  # Redis has been away long: this hit goes uncounted
                self._pending[(key, created)] = [1, time.time()]
            else:
                slot[0] += 1
                slot[1] = time.time()
        if self._flusher is None:
            self._start_flusher()

    def pending(self) -> int:
        with self._pending_lock:
            return sum(n for n, _ in self._pending.values())

    def flush(self) -> None:
        """Write the pending hit counts (kept for the next flush if Redis cannot be reached)."""
        with self._pending_lock:
            batch, self._pending = self._pending, {}
        if not batch:
            return
        if self._health.suspended:  # Redis just timed out: kept for the next flush, no wait now
            self._requeue(batch)
            return
        try:
            refused = self._write(batch)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            self._health.lost()
            self._requeue(batch)
            return
        except redis.RedisError as exc:  # refused (full, read-only): counted as refused, not kept
            log.debug("hit counts not written: %s", exc)
            refused = len(batch)
        if refused:
            self._health.refused("hit_count")

    def _write(self, batch: dict) -> int:
        keys = [self._prefix + "lru"] + [self._prefix + "sol:" + k for k, _ in batch]
        args: list = []
        for (k, created), (n, last) in batch.items():
            args += [k, n, repr(last), created]
        if self._connected():
            try:
                with self._io:
                    if self._track is not None:
                        self._track.send_command("EVAL", redis_scripts.COUNT_HITS, len(keys), *keys, *args)
                        return int(self._track.read_response())
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                self._down()  # written through the cache's own connections below
        return int(self._count_fallback(keys, args))

    def _requeue(self, batch: dict) -> None:
        with self._pending_lock:
            for k, (n, last) in batch.items():
                slot = self._pending.get(k)
                if slot is not None:
                    slot[0] += n
                elif len(self._pending) < MAX_PENDING:
                    self._pending[k] = [n, last]

    def _start_flusher(self) -> None:
        with self._pending_lock:
            if self._flusher is not None or self._closed.is_set():
                return
            self._flusher = threading.Thread(target=self._flush_loop, name="sigprop-hits", daemon=True)
        self._flusher.start()

    def _flush_loop(self) -> None:
        while not self._closed.wait(FLUSH_S):
            try:
                self.flush()
                with self._lock:  # keeps the invalidation connection's buffer short when idle
                    if self._sub is not None:
                        self._drain()
            except Exception:  # noqa: BLE001 - the flusher must outlive any one bad batch
                log.exception("hit count flush failed")

    def close(self) -> None:
        """Write what is pending and close the connections."""
        self._closed.set()
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - shutting down: the counts are lost, the process is not
            log.exception("hit count flush at shutdown failed")
        self._down()
