"""SolutionCache: canonical answers by key, in Redis or (no Redis configured) an embedded SQLite file.

A record is the canonical answer (``Solution`` JSON on the anonymized graph, see
``engine.solve.personalize``), the request that produced it, the ids of that request's nodes (so
``GET /v1/solutions/{key}`` can name them), its creation time, the sigprop version and a hit
counter. Keys already include the engine version, so a new solver never reads old answers.

Both backends also provide the single-flight lock: the first process to ask for a missing key
solves it; the others wait for the stored answer (or for the lock to expire, if that solver died).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from . import __version__


log = logging.getLogger("sigprop")


def answer_digest(answer: str) -> str:
    return hashlib.sha256(answer.encode()).hexdigest()


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
    try:
        value = json.loads(answer[start:end + 1]) if end > 0 else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def summary_row(key: str, created, version, method, activation, hits, targets, graph_summary) -> dict:
    """One solution summary as ``Record.summary()`` gives it, from separately read fields."""
    return {"key": key, "created": float(created), "sigprop_version": version, "method": method,
            "activation": activation, "targets": targets or {}, "graph_summary": graph_summary, "hits": int(hits or 0)}


class CacheUnavailable(Exception):
    """The cache backend cannot be reached; callers degrade to solving without it."""


@dataclass
class Record:
    key: str
    answer: str            # canonical Solution JSON
    request: str           # the request JSON that produced it
    ids: list[str]         # that request's node ids by canonical index
    created: float
    version: str
    method: str
    activation: str
    hits: int = 0
    digest: str = ""       # sha256 of answer: a corrupt entry is detected and recomputed, never served

    def summary(self) -> dict:
        answer = json.loads(self.answer)
        return {"key": self.key, "created": self.created, "sigprop_version": self.version, "method": self.method,
                "activation": self.activation, "targets": answer.get("targets", {}),
                "graph_summary": answer.get("graph_summary"), "hits": self.hits}


class SolutionCache:
    """Interface both backends implement."""

    backend = "none"

    def get(self, key: str, count_hit: bool = True) -> Record | None: ...
    def get_answer(self, key: str) -> str | None:
        """Just the canonical answer, counting a hit: the hot path of POST /v1/solve.

        None when missing or corrupt (its checksum does not match): the caller solves again and
        the new answer overwrites the entry."""
        ...

    @staticmethod
    def _checked(key: str, answer: str | None, digest: str | None) -> str | None:
        if answer is None:
            return None
        if digest != answer_digest(answer):
            log.warning("corrupt cache entry: checksum mismatch, recomputing", extra={"fields": {"key": key}})
            return None
        return answer
    def put(self, record: Record) -> None: ...
    def delete(self, key: str) -> bool: ...
    def list(self, offset: int, limit: int, method: str | None, activation: str | None) -> tuple[int, list[Record]]: ...
    def list_summaries(self, offset: int, limit: int, method: str | None = None, activation: str | None = None,
                       key_prefix: str | None = None) -> tuple[int, list[dict]]:
        """Like ``list`` (newest first, total count), but summaries only (``Record.summary()``'s
        fields), read without loading whole records, and optionally only keys starting with
        ``key_prefix``. The dashboard's table; its pages stay fast with large answers."""
        ...
    def counts(self, field: str, names) -> dict[str, int]:
        """How many stored solutions have each of ``names`` as ``field`` (``method`` or
        ``activation``); names with none are left out. The dashboard's filter choices."""
        ...
    def ping(self) -> bool: ...
    def acquire(self, key: str, ttl_s: float) -> str | None: ...
    def release(self, key: str, token: str) -> None: ...
    def close(self) -> None: ...


class RedisSolutionCache(SolutionCache):
    backend = "redis"
    _PREFIX = "sigprop:"
    _RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"

    def __init__(self, url: str, timeout_s: float = 0.5):
        self.r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      retry_on_timeout=False, health_check_interval=5)

    def _k(self, *parts: str) -> str:
        return self._PREFIX + ":".join(parts)

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise CacheUnavailable(str(exc)) from None

    # Count a hit only on an existing entry, atomically: a blind HINCRBY on a missing key would
    # create a stray hash, and deleting that could race with a solver storing the real entry.
    _GET_ANSWER = ("local a = redis.call('hmget', KEYS[1], 'answer', 'digest') "
                   "if a[1] then redis.call('hincrby', KEYS[1], 'hits', 1) end return a")
    _GET_ALL = ("if redis.call('exists', KEYS[1]) == 1 and ARGV[1] == '1' then "
                "redis.call('hincrby', KEYS[1], 'hits', 1) end return redis.call('hgetall', KEYS[1])")

    def get(self, key, count_hit=True):
        flat = self._call(self.r.eval, self._GET_ALL, 1, self._k("sol", key), "1" if count_hit else "0")
        h = dict(zip(flat[::2], flat[1::2]))
        if b"answer" not in h:
            return None
        return Record(key=key, answer=h[b"answer"].decode(), request=h[b"request"].decode(),
                      ids=json.loads(h[b"ids"]), created=float(h[b"created"]), version=h[b"version"].decode(),
                      method=h[b"method"].decode(), activation=h[b"activation"].decode(), hits=int(h.get(b"hits", 0)),
                      digest=h.get(b"digest", b"").decode())

    def get_answer(self, key):
        answer, digest = self._call(self.r.eval, self._GET_ANSWER, 1, self._k("sol", key))
        return self._checked(key, answer.decode() if answer is not None else None,
                             digest.decode() if digest is not None else None)

    def put(self, rec):
        def run():
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(self._k("sol", rec.key), mapping={
                "answer": rec.answer, "request": rec.request, "ids": json.dumps(rec.ids), "created": repr(rec.created),
                "version": rec.version, "method": rec.method, "activation": rec.activation, "hits": rec.hits,
                "digest": rec.digest})
            pipe.zadd(self._k("index"), {rec.key: rec.created})
            pipe.zadd(self._k("index", "method", rec.method), {rec.key: rec.created})
            pipe.zadd(self._k("index", "activation", rec.activation), {rec.key: rec.created})
            pipe.execute()
        self._call(run)

    def delete(self, key):
        def run():
            h = self.r.hmget(self._k("sol", key), "method", "activation")
            pipe = self.r.pipeline(transaction=True)
            pipe.delete(self._k("sol", key))
            pipe.zrem(self._k("index"), key)
            if h[0] is not None:
                pipe.zrem(self._k("index", "method", h[0].decode()), key)
                pipe.zrem(self._k("index", "activation", h[1].decode()), key)
            return pipe.execute()[0]
        return bool(self._call(run))

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
                keys = [k for k, _ in both[offset:offset + limit]]
            return total, [k.decode() for k in keys]
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
                pairs = [kv for kv, found in zip(pairs, pipe.execute()) if found is not None]
        else:  # both filters: the intersection of the two indexes, O(n) in Redis
            pairs = self.r.zinter(sets, withscores=True)
        pairs.sort(key=lambda kv: -kv[1])  # newest first
        return len(pairs), [k for k, _ in pairs[offset:offset + limit]]

    def list_summaries(self, offset, limit, method=None, activation=None, key_prefix=None):
        def run():
            total, keys = self._page_keys(offset, limit, method, activation, key_prefix)
            script = self.r.register_script(self._SUMMARY)
            pipe = self.r.pipeline(transaction=False)
            for k in keys:
                script(keys=[self._k("sol", k.decode())], client=pipe)
            return total, list(zip(keys, pipe.execute())) if keys else []
        total, rows = self._call(run)
        items = []
        for k, fields in rows:
            if not fields:
                continue  # deleted between the index read and the record read
            created, version, method_, activation_, hits, targets, summary = (f.decode() for f in fields)
            items.append(summary_row(k.decode(), created, version, method_, activation_, hits,
                                     _flat(targets), _flat(summary)))
        return total, items

    def counts(self, field, names):
        names = list(names)

        def run():
            pipe = self.r.pipeline(transaction=False)
            for name in names:
                pipe.zcard(self._k("index", field, name))
            return pipe.execute()
        return {name: n for name, n in zip(names, self._call(run)) if n}

    def ping(self):
        try:
            return bool(self.r.ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    def acquire(self, key, ttl_s):
        token = uuid.uuid4().hex
        ok = self._call(self.r.set, self._k("lock", key), token, nx=True, px=int(ttl_s * 1000))
        return token if ok else None

    def release(self, key, token):
        try:
            self.r.eval(self._RELEASE, 1, self._k("lock", key), token)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            pass  # the lock expires by itself

    def close(self):
        self.r.close()


def connect_sqlite(path: str) -> sqlite3.Connection:
    """A connection to the embedded store's file, shared by several threads' and processes'
    connections: autocommit, WAL (readers never wait for the writer), a 10 s busy timeout."""
    db = sqlite3.connect(path, timeout=10.0, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


class SqliteSolutionCache(SolutionCache):
    """The embedded default: one SQLite file under SIGPROP_DATA_DIR, safe across processes."""

    backend = "sqlite"

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._local = threading.local()
        with self._db() as db:
            db.executescript("""
                CREATE TABLE IF NOT EXISTS solutions (
                    key TEXT PRIMARY KEY, answer TEXT NOT NULL, request TEXT NOT NULL, ids TEXT NOT NULL,
                    created REAL NOT NULL, version TEXT NOT NULL, method TEXT NOT NULL, activation TEXT NOT NULL,
                    hits INTEGER NOT NULL DEFAULT 0, digest TEXT NOT NULL DEFAULT '');
                CREATE INDEX IF NOT EXISTS solutions_created ON solutions (created);
                CREATE INDEX IF NOT EXISTS solutions_method_created ON solutions (method, created);
                CREATE INDEX IF NOT EXISTS solutions_activation_created ON solutions (activation, created);
                CREATE TABLE IF NOT EXISTS locks (key TEXT PRIMARY KEY, token TEXT NOT NULL, expires REAL NOT NULL);
            """)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = connect_sqlite(self.path)
        return db

    @staticmethod
    def _record(row) -> Record:
        key, answer, request, ids, created, version, method, activation, hits, digest = row
        return Record(key, answer, request, json.loads(ids), created, version, method, activation, hits, digest)

    _COLS = "key, answer, request, ids, created, version, method, activation, hits, digest"

    def get_answer(self, key):
        row = self._db().execute("UPDATE solutions SET hits = hits + 1 WHERE key = ? RETURNING answer, digest",
                                 (key,)).fetchone()
        return self._checked(key, *row) if row else None

    def get(self, key, count_hit=True):
        db = self._db()
        if count_hit:  # one statement: a hit is counted exactly when the row is found
            row = db.execute(f"UPDATE solutions SET hits = hits + 1 WHERE key = ? RETURNING {self._COLS}", (key,)).fetchone()
        else:
            row = db.execute(f"SELECT {self._COLS} FROM solutions WHERE key = ?", (key,)).fetchone()
        return self._record(row) if row else None

    def put(self, rec):
        self._db().execute(
            f"INSERT OR REPLACE INTO solutions ({self._COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (rec.key, rec.answer, rec.request, json.dumps(rec.ids), rec.created, rec.version, rec.method,
             rec.activation, rec.hits, rec.digest))

    def delete(self, key):
        return self._db().execute("DELETE FROM solutions WHERE key = ?", (key,)).rowcount > 0

    def list(self, offset, limit, method=None, activation=None):
        where, args = [], []
        if method:
            where.append("method = ?")
            args.append(method)
        if activation:
            where.append("activation = ?")
            args.append(activation)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        db = self._db()
        total = db.execute(f"SELECT COUNT(*) FROM solutions {clause}", args).fetchone()[0]
        rows = db.execute(f"SELECT {self._COLS} FROM solutions {clause} ORDER BY created DESC LIMIT ? OFFSET ?",
                          args + [limit, offset]).fetchall()
        return total, [self._record(r) for r in rows]

    def list_summaries(self, offset, limit, method=None, activation=None, key_prefix=None):
        where, args = [], []
        for column, value in (("method", method), ("activation", activation)):
            if value:
                where.append(f"{column} = ?")
                args.append(value)
        if key_prefix:  # a range on the primary key's index: every key that starts with the prefix
            where.append("key >= ? AND key < ?")
            args += [key_prefix, key_prefix + "\U0010ffff"]
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        db = self._db()
        total = db.execute(f"SELECT COUNT(*) FROM solutions {clause}", args).fetchone()[0]
        rows = db.execute(f"SELECT key, created, version, method, activation, hits, answer FROM solutions {clause} "
                          "ORDER BY created DESC LIMIT ? OFFSET ?", args + [limit, offset]).fetchall()
        return total, [summary_row(*row[:6], summary_part(row[6], "targets"), summary_part(row[6], "graph_summary"))
                       for row in rows]

    def counts(self, field, names):
        if field not in ("method", "activation"):
            raise ValueError(f"no counts by {field!r}")
        wanted = set(names)
        rows = self._db().execute(f"SELECT {field}, COUNT(*) FROM solutions GROUP BY {field}").fetchall()
        return {name: n for name, n in rows if name in wanted}

    def ping(self):
        try:
            self._db().execute("SELECT 1").fetchone()
            return True
        except sqlite3.Error:
            return False

    def acquire(self, key, ttl_s):
        token, now = uuid.uuid4().hex, time.time()
        db = self._db()
        db.execute("DELETE FROM locks WHERE key = ? AND expires < ?", (key, now))
        cur = db.execute("INSERT OR IGNORE INTO locks (key, token, expires) VALUES (?, ?, ?)", (key, token, now + ttl_s))
        return token if cur.rowcount == 1 else None

    def release(self, key, token):
        self._db().execute("DELETE FROM locks WHERE key = ? AND token = ?", (key, token))

    def close(self):
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


def _flat(fragment: str) -> dict | None:
    """A ``{...}`` fragment cut out of an answer by ``RedisSolutionCache._SUMMARY``, parsed."""
    if not fragment:
        return None
    try:
        value = json.loads(fragment)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def make_cache(settings) -> SolutionCache:
    if settings.redis_url:
        return RedisSolutionCache(settings.redis_url, settings.redis_timeout_s)
    return SqliteSolutionCache(Path(settings.data_dir) / "solutions.sqlite3")


def new_record(key: str, canonical_json: str, request_json: str, ids: list[str], method: str, activation: str) -> Record:
    return Record(key=key, answer=canonical_json, request=request_json, ids=ids, created=time.time(),
                  version=__version__, method=method, activation=activation, digest=answer_digest(canonical_json))
