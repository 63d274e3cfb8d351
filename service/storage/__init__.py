"""The service's stores: solutions by canonical key (the cache) and validation jobs by id.

``protocols`` says what every backend provides, ``records`` what they hold and the helpers they
share (checksums, strict JSON, the validation status transitions); each database has one module:
``redis_backend`` (``SIGPROP_REDIS_URL`` set) and ``sqlite_backend`` (the embedded default, a
SQLite file under ``SIGPROP_DATA_DIR``). Nothing here knows about HTTP or about job queues.
"""

from __future__ import annotations

from pathlib import Path

from .health import StorageHealth, write_refused
from .protocols import SolutionCache, ValidationStore
from .records import ACTIVE, TERMINAL, CacheUnavailable, Checksum, Record, StorageFull, UnreadableRecord, new_record
from .redis_backend import RedisSolutionCache
from .redis_validations import RedisValidationStore
from .sqlite_backend import SqliteSolutionCache, SqliteValidationStore, connect_sqlite

__all__ = [
    "ACTIVE",
    "TERMINAL",
    "CacheUnavailable",
    "Checksum",
    "Record",
    "RedisSolutionCache",
    "RedisValidationStore",
    "SolutionCache",
    "SqliteSolutionCache",
    "SqliteValidationStore",
    "StorageFull",
    "StorageHealth",
    "UnreadableRecord",
    "ValidationStore",
    "connect_sqlite",
    "make_cache",
    "new_record",
    "retention",
    "sqlite_path",
    "write_refused",
]


def sqlite_path(settings) -> Path:
    """The embedded store's file: solutions and validations share it."""
    return Path(settings.data_dir) / "solutions.sqlite3"


def make_cache(settings) -> SolutionCache:
    """The solution cache these settings name: Redis when ``redis_url`` is set, else SQLite, with
    the retention bounds and the checksum's secret of the settings."""
    secret = settings.cache_secret.get_secret_value() if settings.cache_secret else None
    bounds = {
        "max_entries": settings.cache_max_entries,
        "max_bytes": settings.cache_max_bytes,
        "checksum": Checksum(secret or None),
    }
    if settings.redis_url:
        return RedisSolutionCache(settings.redis_url, settings.redis_timeout_s, **bounds)
    return SqliteSolutionCache(sqlite_path(settings), **bounds)


def retention(settings) -> dict:
    """The validation stores' retention bounds (keyword arguments) of these settings."""
    return {"max_age_s": settings.validation_max_age_days * 86_400, "max_records": settings.validation_max_records}
