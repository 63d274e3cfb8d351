"""Whether the Redis behind the service can drop work it accepted, from its own settings
(``CONFIG GET``), at start and in ``/readyz`` (docs/deployment.md, "Redis settings").

* ``maxmemory`` set with a ``maxmemory-policy`` other than ``noeviction``: Redis deletes keys when
  full, validations and queued jobs among them (``allkeys-lru`` evicted 5 of 5 accepted
  validations while ``/readyz`` said ok). Nothing the service does can notice in time, so the API
  refuses to start (:class:`UnsafeRedis`); a policy changed at run time makes ``/readyz`` report
  ``"redis_config": "unsafe"`` with the reason.
* no persistence (``save ""`` and ``appendonly no``), snapshots only, or ``appendfsync no``: a
  restart or crash of Redis loses what was written since the last snapshot or sync. That is a
  choice a deployment may make (the cache is rebuilt by solving again), so the service starts and
  ``/readyz`` reports ``"redis_config": "degraded"`` with the reason.
* ``CONFIG`` refused (managed Redis often renames or forbids it): ``"unknown"``, with a note that
  the settings could not be read; never an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis

log = logging.getLogger("sigprop")

OK, DEGRADED, UNSAFE, UNKNOWN = "ok", "degraded", "unsafe", "unknown"
_FIELDS = ("maxmemory", "maxmemory-policy", "save", "appendonly", "appendfsync")


class UnsafeRedis(RuntimeError):
    """The API does not start on a Redis that evicts keys (the message says what to set)."""


@dataclass(frozen=True)
class RedisConfigState:
    state: str  # ok, degraded (persistence can lose work), unsafe (eviction), unknown (CONFIG refused)
    reasons: tuple[str, ...] = field(default=())

    @property
    def note(self) -> str:
        return "; ".join(self.reasons)


def _read(connection) -> dict[str, str] | None:
    """The settings that matter, or None when ``CONFIG GET`` is refused (renamed, ACL, managed)."""
    values: dict[str, str] = {}
    for name in _FIELDS:
        try:
            got = connection.config_get(name)
        except redis.ResponseError:  # unknown command, NOPERM: a managed Redis
            return None
        for k, v in got.items():
            k = k.decode() if isinstance(k, bytes) else k
            values[k] = v.decode() if isinstance(v, bytes) else str(v)
    return values


def check(connection) -> RedisConfigState:
    """One look at the Redis settings; ``redis.ConnectionError``/``TimeoutError`` propagate (an
    unreachable Redis is the caller's other problem)."""
    values = _read(connection)
    if values is None:
        return RedisConfigState(
            UNKNOWN,
            (
                "CONFIG GET is not allowed on this Redis: its eviction policy and persistence cannot be "
                "checked; it must run maxmemory-policy noeviction (or no maxmemory) and appendonly yes "
                "(docs/deployment.md)",
            ),
        )
    unsafe, degraded = [], []
    maxmemory = int(values.get("maxmemory", "0") or 0)
    policy = values.get("maxmemory-policy", "noeviction")
    if maxmemory and policy != "noeviction":
        unsafe.append(
            f"maxmemory-policy {policy} with maxmemory {maxmemory} lets Redis evict keys, accepted "
            "validations and queued jobs among them: set maxmemory-policy noeviction"
        )
    aof = values.get("appendonly", "no") == "yes"
    snapshots = bool(values.get("save", "").strip())
    if not aof and not snapshots:
        degraded.append(
            'no persistence (save "" and appendonly no): a Redis restart loses every accepted '
            "validation, queued job and stored solution; set appendonly yes"
        )
    elif not aof:
        degraded.append(
            "snapshots only (appendonly no): a Redis crash loses what was accepted since the last "
            "snapshot; set appendonly yes"
        )
    elif values.get("appendfsync") == "no":
        degraded.append(
            "appendfsync no: a machine crash loses what the OS had not written yet (about 30 s); "
            "set appendfsync everysec (at most 1 s) or always"
        )
    if unsafe:
        return RedisConfigState(UNSAFE, tuple(unsafe + degraded))
    if degraded:
        return RedisConfigState(DEGRADED, tuple(degraded))
    return RedisConfigState(OK)


def check_at_start(connection) -> RedisConfigState | None:
    """The settings checked as the API starts: raises :class:`UnsafeRedis` on an evicting Redis,
    logs a warning for a persistence that can lose work or settings it cannot read; None when Redis
    does not answer now (an outage at start is served degraded, as any other)."""
    try:
        found = check(connection)
    except (redis.RedisError, OSError) as exc:
        log.warning("Redis settings not checked at start: Redis does not answer (%s)", exc)
        return None
    if found.state == UNSAFE:
        raise UnsafeRedis(
            "refusing to start: Redis can drop accepted work: " + found.note + " (docs/deployment.md, Redis settings)"
        )
    if found.state != OK:
        log.warning("Redis settings: %s: %s", found.state, found.note)
    return found
