"""Rate limits per client for the work that costs: cold solves and validation submissions.

Built on the ``limits`` library, with its moving-window strategy (exact: no bursts at window
boundaries, and Retry-After is when the oldest counted request leaves the window). With
``SIGPROP_REDIS_URL`` the counters live in that Redis, so every API process behind a load balancer
shares one budget per client; without it they live in process memory. A client is its API key when it sends a valid
one (keyed by the key's SHA-256 digest, never the key itself), else its address.

The limiter must never take the service down with it: when its Redis cannot be reached it counts
in process memory instead (a warning is logged) and tries Redis again a few seconds later, so
solves keep answering during a Redis outage.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from limits import RateLimitItem
from limits.errors import StorageError
from limits.storage import MemoryStorage, RedisStorage
from limits.strategies import MovingWindowRateLimiter

from ..errors import SigpropError
from ..settings import parse_rate_limit

log = logging.getLogger("sigprop")
REDIS_RETRY_S = 5.0  # after a Redis failure, count in memory this long before trying Redis again
KEY_PREFIX = "sigprop-ratelimit"

# A callable the solve path calls right before a cold solve: raises ``rate_limited`` when the
# client (an identity string, or None for internal callers, which are never limited) is over budget.
Check = Callable[[str | None], None]


class RateLimited(SigpropError):
    def __init__(self, what: str, item: RateLimitItem, retry_after: int, hint: str):
        super().__init__(
            "rate_limited",
            f"too many {what} from this client: the limit is {item}",
            f"retry after {retry_after} s; {hint}",
            429,
            headers={"Retry-After": str(retry_after)},
        )


class RateLimit:
    """One budget (e.g. cold solves) per client identity. ``check(identity)`` counts one request
    and raises ``RateLimited`` (429, with ``Retry-After``) when the client is over the limit."""

    def __init__(
        self, name: str, what: str, spec: str, hint: str, redis_url: str | None = None, redis_timeout_s: float = 0.5
    ):
        self.name, self.what, self.hint = name, what, hint
        self.items = parse_rate_limit(spec)
        self.memory = MovingWindowRateLimiter(MemoryStorage())
        self.shared = None
        if self.items and redis_url:
            storage = RedisStorage(
                redis_url,
                key_prefix=KEY_PREFIX,
                wrap_exceptions=True,
                socket_timeout=redis_timeout_s,
                socket_connect_timeout=redis_timeout_s,
            )
            self.shared = MovingWindowRateLimiter(storage)
        self._redis_down_until = 0.0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.items)

    def __call__(self, identity: str | None) -> None:
        self.check(identity)

    def check(self, identity: str | None) -> None:
        if not self.items or identity is None:
            return
        if self.shared is not None and time.monotonic() >= self._redis_down_until:
            try:
                self._hit(self.shared, identity)
                if self._redis_down_until:
                    with self._lock:
                        if self._redis_down_until:
                            self._redis_down_until = 0.0
                            log.warning("rate limiter: Redis answers again; %s are counted in Redis", self.what)
                return
            except RateLimited:
                raise
            except (StorageError, OSError) as exc:
                with self._lock:
                    first = not self._redis_down_until
                    self._redis_down_until = time.monotonic() + REDIS_RETRY_S
                if first:
                    log.warning(
                        "rate limiter: Redis unreachable (%s); counting %s in this process's memory "
                        "until it answers again",
                        type(getattr(exc, "storage_error", exc)).__name__,
                        self.what,
                    )
        self._hit(self.memory, identity)

    def exhausted(self, identity: str | None) -> RateLimited | None:
        """The 429 ``identity`` gets while it has no budget left, counting nothing (else None). Reads
        the counters :meth:`check` writes: Redis's, or this process's while Redis is unreachable."""
        if not self.items or identity is None:
            return None
        limiter = self.memory
        if self.shared is not None and time.monotonic() >= self._redis_down_until:
            limiter = self.shared
        try:
            for item in self.items:
                if not limiter.test(item, self.name, identity):
                    stats = limiter.get_window_stats(item, self.name, identity)
                    return RateLimited(self.what, item, max(1, math.ceil(stats.reset_time - time.time())), self.hint)
        except (StorageError, OSError):
            return None  # Redis is down: check() notices and counts in memory
        return None

    def precheck(self, identity: str | None) -> None:
        """Raise ``RateLimited`` when the client has no budget left, without counting anything:
        called before the expensive steps of a request that may turn out to be a cache hit."""
        limited = self.exhausted(identity)
        if limited is not None:
            raise limited

    def _hit(self, limiter: MovingWindowRateLimiter, identity: str) -> None:
        for item in self.items:
            if not limiter.hit(item, self.name, identity):
                stats = limiter.get_window_stats(item, self.name, identity)
                retry = max(1, math.ceil(stats.reset_time - time.time()))
                raise RateLimited(self.what, item, retry, self.hint)

    def reset(self) -> None:
        """Forget every count in this process's memory (tests)."""
        self.memory.storage.reset()


class Limits(NamedTuple):
    cold_solves: RateLimit
    validations: RateLimit
    failed_auth: RateLimit | None = None


def make_limits(settings) -> Limits:
    """The cold-solve and validation budgets of these settings."""
    url, timeout = settings.redis_url, settings.redis_timeout_s
    cold = RateLimit(
        "cold-solves",
        "cold solves (requests not in the cache)",
        settings.rate_limit_cold_solves,
        "answers already in the cache are never limited; send your own API key for a budget of your "
        "own, or raise SIGPROP_RATE_LIMIT_COLD_SOLVES on your own deployment",
        url,
        timeout,
    )
    validations = RateLimit(
        "validations",
        "validation submissions",
        settings.rate_limit_validations,
        "each validation trains networks for minutes; wait for the ones you submitted "
        "(GET /v1/validations), or raise SIGPROP_RATE_LIMIT_VALIDATIONS on your own deployment",
        url,
        timeout,
    )
    failed = RateLimit(
        "failed-auth",
        "requests with a wrong API key",
        settings.rate_limit_failed_auth,
        "check the key you send; keys are listed in the server's SIGPROP_API_KEYS",
        url,
        timeout,
    )
    return Limits(cold, validations, failed)
