"""The embedded backends (no ``SIGPROP_REDIS_URL``): solutions and validations in one SQLite
file under ``SIGPROP_DATA_DIR``, shared safely by the threads and processes of ``sigprop serve``.

Solutions: the table ``solutions`` (indexed by creation time, method and activation) and the
table ``locks`` for the single-flight lock. Validations: the table ``validations`` (indexed by
creation time and by solution key) next to them; the API process that created a job owns it
(``owner``), and a job whose owner exited before it ended is failed at the next start
(:meth:`SqliteValidationStore.fail_orphans`).
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path

from .health import NOT_STORED, StorageHealth, write_refused
from .records import (
    ACTIVE,
    FIELDS,
    PLAIN,
    SUMMARY_FIELDS,
    CacheUnavailable,
    Checksum,
    Record,
    StorageFull,
    ValidationTransitions,
    checked_answer,
    decode_record,
    decode_validation,
    decode_validations,
    dumps,
    summary_part,
    summary_row,
    too_large_note,
)


def connect_sqlite(path: str) -> sqlite3.Connection:
    """A connection to the embedded store's file, shared by several threads' and processes'
    connections: autocommit, WAL (readers never wait for the writer), a 10 s busy timeout."""
    db = sqlite3.connect(path, timeout=10.0, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


class _SqliteFile:
    """One connection per thread to a store's SQLite file (``connect_sqlite``), created on first
    use; ``SCHEMA`` is applied when the store opens."""

    SCHEMA = ""
    ROW_FACTORY = None

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._local = threading.local()
        self._db().executescript(self.SCHEMA)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = connect_sqlite(self.path)
            db.row_factory = self.ROW_FACTORY
            self._local.db = db
        return db

    def close(self) -> None:
        """Close this thread's connection (the others close with their threads)."""
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


def _guarded(fn):
    """SQLite errors of a cache call as the cache's exceptions: a refused write (disk full,
    read-only file) is ``StorageFull``, anything else ``CacheUnavailable``; never a 500."""

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except sqlite3.Error as exc:
            if write_refused(exc):
                raise StorageFull(NOT_STORED) from None
            raise CacheUnavailable(f"the SQLite cache failed: {exc}") from None

    return call


class SqliteSolutionCache(_SqliteFile):
    """The embedded default: one SQLite file under SIGPROP_DATA_DIR, safe across processes.

    Retention: ``max_entries`` and ``max_bytes`` (0: no bound) are enforced on every put by
    deleting the least recently used rows (``used``: last hit or creation, indexed); triggers keep
    the row count and byte total in ``solution_stats``, so checking a bound reads one row."""

    backend = "sqlite"
    SCHEMA = """
        CREATE TABLE IF NOT EXISTS solutions (
            key TEXT PRIMARY KEY, answer TEXT NOT NULL, request TEXT NOT NULL, ids TEXT NOT NULL,
            created REAL NOT NULL, version TEXT NOT NULL, method TEXT NOT NULL, activation TEXT NOT NULL,
            hits INTEGER NOT NULL DEFAULT 0, digest TEXT NOT NULL DEFAULT '');
        CREATE INDEX IF NOT EXISTS solutions_created ON solutions (created);
        CREATE INDEX IF NOT EXISTS solutions_method_created ON solutions (method, created);
        CREATE INDEX IF NOT EXISTS solutions_activation_created ON solutions (activation, created);
        CREATE TABLE IF NOT EXISTS locks (key TEXT PRIMARY KEY, token TEXT NOT NULL, expires REAL NOT NULL);
        CREATE TABLE IF NOT EXISTS probe (id INTEGER PRIMARY KEY, at REAL NOT NULL);
    """
    # Added to files written before retention existed, in one transaction (see _migrate).
    RETENTION = (
        "ALTER TABLE solutions ADD COLUMN size INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE solutions ADD COLUMN used REAL NOT NULL DEFAULT 0",
        "UPDATE solutions SET size = length(CAST(answer AS BLOB)) + length(CAST(request AS BLOB)) "
        "+ length(CAST(ids AS BLOB)), used = created",
        "CREATE INDEX solutions_used ON solutions (used)",
        "CREATE TABLE solution_stats (id INTEGER PRIMARY KEY CHECK (id = 0), entries INTEGER NOT NULL, "
        "bytes INTEGER NOT NULL)",
        "INSERT INTO solution_stats SELECT 0, COUNT(*), COALESCE(SUM(size), 0) FROM solutions",
        "CREATE TRIGGER solutions_added AFTER INSERT ON solutions BEGIN "
        "UPDATE solution_stats SET entries = entries + 1, bytes = bytes + new.size WHERE id = 0; END",
        "CREATE TRIGGER solutions_removed AFTER DELETE ON solutions BEGIN "
        "UPDATE solution_stats SET entries = entries - 1, bytes = bytes - old.size WHERE id = 0; END",
        "CREATE TRIGGER solutions_resized AFTER UPDATE OF size ON solutions BEGIN "
        "UPDATE solution_stats SET bytes = bytes - old.size + new.size WHERE id = 0; END",
    )
    EVICT_PER_PUT = 1000

    def hot_answers(self) -> None:
        return None  # no invalidation channel between processes: hits read the file

    def __init__(
        self,
        path: Path,
        *,
        max_entries: int = 0,
        max_bytes: int = 0,
        checksum: Checksum = PLAIN,
        health: StorageHealth | None = None,
    ):
        super().__init__(path)
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.checksum = checksum
        self.health = health or StorageHealth()
        self._migrate()

    def _migrate(self) -> None:
        db = self._db()
        if "size" in {row[1] for row in db.execute("PRAGMA table_info(solutions)")}:
            return  # migrated already: no write lock taken, so a read-only file still opens
        db.execute("BEGIN IMMEDIATE")  # one process adds the columns; the others then see them
        try:
            columns = {row[1] for row in db.execute("PRAGMA table_info(solutions)")}
            if "size" not in columns:
                for statement in self.RETENTION:
                    db.execute(statement)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    _COLS = "key, answer, request, ids, created, version, method, activation, hits, digest"

    @staticmethod
    def _record(row) -> Record | None:
        return decode_record(row[0], dict(zip(SqliteSolutionCache._COLS.split(", "), row, strict=True)))

    @_guarded
    def get_answer(self, key):
        db = self._db()
        try:  # one statement: a hit is counted exactly when the row is found
            row = db.execute(
                "UPDATE solutions SET hits = hits + 1, used = ? WHERE key = ? RETURNING answer, digest",
                (time.time(), key),
            ).fetchone()
        except sqlite3.OperationalError as exc:
            if not write_refused(exc):
                raise
            self.health.refused("hit_count")  # the hit is served; only its count is lost
            row = db.execute("SELECT answer, digest FROM solutions WHERE key = ?", (key,)).fetchone()
        if not row or not isinstance(row[0], str):
            return None
        return checked_answer(key, row[0], row[1], self.checksum)

    @_guarded
    def get(self, key, count_hit=True):
        db = self._db()
        row = None
        if count_hit:
            try:
                row = db.execute(
                    f"UPDATE solutions SET hits = hits + 1, used = ? WHERE key = ? RETURNING {self._COLS}",
                    (time.time(), key),
                ).fetchone()
            except sqlite3.OperationalError as exc:
                if not write_refused(exc):
                    raise
                self.health.refused("hit_count")
                count_hit = False
        if not count_hit:
            row = db.execute(f"SELECT {self._COLS} FROM solutions WHERE key = ?", (key,)).fetchone()
        return self._record(row) if row else None

    @_guarded
    def put(self, rec):
        size = rec.size
        if self.max_bytes and size > self.max_bytes:
            raise StorageFull(too_large_note(size, self.max_bytes))
        db = self._db()
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    f"INSERT INTO solutions ({self._COLS}, size, used) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET answer = excluded.answer, request = excluded.request, "
                    "ids = excluded.ids, created = excluded.created, version = excluded.version, "
                    "method = excluded.method, activation = excluded.activation, hits = excluded.hits, "
                    "digest = excluded.digest, size = excluded.size, used = excluded.used",
                    (
                        rec.key,
                        rec.answer,
                        rec.request,
                        json.dumps(rec.ids),
                        rec.created,
                        rec.version,
                        rec.method,
                        rec.activation,
                        rec.hits,
                        self.checksum.digest(rec.answer),
                        size,
                        rec.created,
                    ),
                )
                evicted = self._evict(db, rec.key)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            if write_refused(exc):
                self.health.refused("store")
            raise
        self.health.stored()
        self.health.evicted("solutions", evicted)

    def _evict(self, db: sqlite3.Connection, keep: str) -> int:
        """Delete the least recently used rows (not ``keep``, the one just written) while over a
        bound; the triggers keep solution_stats in step."""
        if not (self.max_entries or self.max_bytes):
            return 0
        entries, size = db.execute("SELECT entries, bytes FROM solution_stats WHERE id = 0").fetchone()
        over_n = entries - self.max_entries if self.max_entries else 0
        over_b = size - self.max_bytes if self.max_bytes else 0
        if over_n <= 0 and over_b <= 0:
            return 0
        victims = []
        for key, vsize in db.execute(
            "SELECT key, size FROM solutions WHERE key != ? ORDER BY used LIMIT ?", (keep, self.EVICT_PER_PUT)
        ):
            if over_n <= 0 and over_b <= 0:
                break
            victims.append(key)
            over_n, over_b = over_n - 1, over_b - (vsize or 0)
        db.executemany("DELETE FROM solutions WHERE key = ?", [(k,) for k in victims])
        return len(victims)

    @_guarded
    def delete(self, key):
        return self._db().execute("DELETE FROM solutions WHERE key = ?", (key,)).rowcount > 0

    @_guarded
    def stats(self) -> dict:
        """How many records the cache holds and their bytes, as the retention bounds count them."""
        entries, size = self._db().execute("SELECT entries, bytes FROM solution_stats WHERE id = 0").fetchone()
        return {"entries": entries, "bytes": size, "max_entries": self.max_entries, "max_bytes": self.max_bytes}

    @_guarded
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
        rows = db.execute(
            f"SELECT {self._COLS} FROM solutions {clause} ORDER BY created DESC LIMIT ? OFFSET ?",
            args + [limit, offset],
        ).fetchall()
        return total, [r for r in map(self._record, rows) if r is not None]

    @_guarded
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
        rows = db.execute(
            f"SELECT key, created, version, method, activation, hits, answer FROM solutions {clause} "
            "ORDER BY created DESC LIMIT ? OFFSET ?",
            args + [limit, offset],
        ).fetchall()
        items = []
        for row in rows:
            answer = row[6] if isinstance(row[6], str) else ""
            item = summary_row(*row[:6], summary_part(answer, "targets"), summary_part(answer, "graph_summary"))
            if item is not None:
                items.append(item)
        return total, items

    @_guarded
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

    def writable(self) -> bool:
        """Whether the file takes a write now (a one-row probe table), and no larger write was
        refused recently: a full disk may still take the probe's few bytes."""
        try:
            self._db().execute("INSERT OR REPLACE INTO probe (id, at) VALUES (0, ?)", (time.time(),))
        except sqlite3.Error as exc:
            if write_refused(exc):
                return False
            raise CacheUnavailable(str(exc)) from None
        return not self.health.degraded

    @_guarded
    def acquire(self, key, ttl_s):
        token, now = uuid.uuid4().hex, time.time()
        # one statement, so one write transaction: taken when free or expired, else left as it is
        cur = self._db().execute(
            "INSERT INTO locks (key, token, expires) VALUES (?, ?, ?) ON CONFLICT (key) DO UPDATE"
            " SET token = excluded.token, expires = excluded.expires WHERE locks.expires < ?",
            (key, token, now + ttl_s, now),
        )
        return token if cur.rowcount == 1 else None

    def release(self, key, token):
        try:
            self._db().execute("DELETE FROM locks WHERE key = ? AND token = ?", (key, token))
        except sqlite3.Error:
            pass  # the lock expires by itself


class SqliteValidationStore(_SqliteFile, ValidationTransitions):
    """The embedded store: the ``validations`` table in the solutions' SQLite file."""

    backend = "sqlite"
    _COLS = ", ".join(FIELDS)
    ROW_FACTORY = sqlite3.Row
    SCHEMA = """
        CREATE TABLE IF NOT EXISTS validations (
            id TEXT PRIMARY KEY, status TEXT NOT NULL, key TEXT NOT NULL, request TEXT NOT NULL,
            created REAL NOT NULL, started REAL, ended REAL, attempts INTEGER NOT NULL DEFAULT 0,
            device TEXT, error TEXT, progress TEXT NOT NULL DEFAULT '{}', results TEXT,
            cancel REAL, owner INTEGER);
        CREATE INDEX IF NOT EXISTS validations_created ON validations (created);
        CREATE INDEX IF NOT EXISTS validations_key ON validations (key, created);
    """

    def __init__(self, path: Path, *, max_age_s: float = 0, max_records: int = 0):
        super().__init__(path)
        # retention (0: no bound): final validations older than max_age_s, or beyond the newest
        # max_records, are removed when a new one is created; active ones never are
        self.max_age_s, self.max_records = max_age_s, max_records
        self.trimmed = 0

    def create(self, vid, key, request, created, owner=None):
        self._db().execute(
            "INSERT INTO validations (id, status, key, request, created, owner) VALUES (?, 'queued', ?, ?, ?, ?)",
            (vid, key, dumps(request), created, owner),
        )
        if self.max_age_s or self.max_records:
            self.trim(created)

    def trim(self, now: float, cap: int = 100) -> int:
        """Remove final validations past the retention bounds, at most ``cap`` per call (each
        create removes about what it adds: amortized, never a full scan)."""
        db, final = self._db(), "status IN ('finished', 'failed', 'cancelled')"
        n = 0
        if self.max_age_s:
            n += db.execute(
                f"DELETE FROM validations WHERE id IN (SELECT id FROM validations WHERE created < ? "
                f"AND {final} ORDER BY created LIMIT ?)",
                (now - self.max_age_s, cap),
            ).rowcount
        if self.max_records:
            over = db.execute("SELECT COUNT(*) FROM validations").fetchone()[0] - self.max_records
            if over > 0:
                n += db.execute(
                    f"DELETE FROM validations WHERE id IN (SELECT id FROM validations WHERE {final} "
                    "ORDER BY created LIMIT ?)",
                    (min(over, cap),),
                ).rowcount
        self.trimmed += n
        return n

    def discard(self, vid: str, key: str) -> None:
        """Remove a record that was never accepted (its job could not be started)."""
        self._db().execute("DELETE FROM validations WHERE id = ?", (vid,))

    def get(self, vid):
        row = self._db().execute(f"SELECT {self._COLS} FROM validations WHERE id = ?", (vid,)).fetchone()
        return decode_validation(dict(row)) if row else None

    def list(self, offset, limit):
        db = self._db()
        total = db.execute("SELECT COUNT(*) FROM validations").fetchone()[0]
        rows = db.execute(
            f"SELECT {', '.join(SUMMARY_FIELDS)} FROM validations ORDER BY created DESC, rowid DESC LIMIT ? OFFSET ?",
            (limit, offset),
        ).fetchall()
        return total, decode_validations(dict(r) for r in rows)

    def list_for_key(self, key, limit):
        db = self._db()
        total = db.execute("SELECT COUNT(*) FROM validations WHERE key = ?", (key,)).fetchone()[0]
        rows = db.execute(
            f"SELECT {', '.join(SUMMARY_FIELDS)} FROM validations WHERE key = ? "
            "ORDER BY created DESC, rowid DESC LIMIT ?",
            (key, limit),
        ).fetchall()
        return total, decode_validations(dict(r) for r in rows)

    def start(self, vid, device):
        db, now = self._db(), time.time()
        row = db.execute(
            "UPDATE validations SET status = 'running', started = ?, device = ?, attempts = attempts + 1, "
            "progress = '{}' WHERE id = ? AND status IN ('queued', 'running') AND cancel IS NULL "
            "RETURNING attempts",
            (now, device, vid),
        ).fetchone()
        if row:
            return int(row[0])
        db.execute(
            "UPDATE validations SET status = 'cancelled', ended = ?, error = 'cancelled on request before it started' "
            "WHERE id = ? AND status IN ('queued', 'running')",
            (now, vid),
        )
        return 0

    def update(self, vid, fields, only_if):
        cols = ", ".join(f"{k} = ?" for k in fields)
        marks = ", ".join("?" for _ in only_if)
        cur = self._db().execute(
            f"UPDATE validations SET {cols} WHERE id = ? AND status IN ({marks})", (*fields.values(), vid, *only_if)
        )
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
                db.execute(
                    "UPDATE validations SET status = 'cancelled', ended = ?, cancel = ?, "
                    "error = 'cancelled on request before it started' WHERE id = ?",
                    (now, now, vid),
                )
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
                n += self.update(
                    row["id"],
                    {
                        "status": "failed",
                        "ended": time.time(),
                        "error": "interrupted: the service process that ran it exited before it finished; "
                        "submit it again",
                    },
                    only_if=ACTIVE,
                )
        return n


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
