"""A corrupt cache entry (its checksum does not match) is detected, recomputed and overwritten,
never served; on the real Redis (the tests' database) and the embedded SQLite cache."""

import json
import time

import pytest
import redis

from sigprop.api.solutions import SolutionService
from sigprop.storage import RedisSolutionCache, SqliteSolutionCache

from ..service_fixtures import SHARED_REDIS_URL, flush_shared_redis, shared_redis_or_skip

URL = SHARED_REDIS_URL
BODY = json.dumps(
    {
        "graph": {"template": "mlp", "depth": 8, "width": 16},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.5},
    }
).encode()


def _cache(backend, tmp_path):
    if backend == "redis":
        shared_redis_or_skip(URL)
        flush_shared_redis(URL)
        return RedisSolutionCache(URL)
    return SqliteSolutionCache(tmp_path / "c.sqlite3")


def _corrupt(cache, key):
    if isinstance(cache, RedisSolutionCache):
        r = redis.Redis.from_url(URL)
        answer = r.hget(f"sigprop:sol:{key}", "answer").decode()
        r.hset(f"sigprop:sol:{key}", "answer", answer.replace('"negative_slope":0.', '"negative_slope":9.'))
    else:
        db = cache._db()
        answer = db.execute("SELECT answer FROM solutions WHERE key = ?", (key,)).fetchone()[0]
        db.execute(
            "UPDATE solutions SET answer = ? WHERE key = ?",
            (answer.replace('"negative_slope":0.', '"negative_slope":9.'), key),
        )


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_corrupt_entry_is_recomputed_not_served(backend, tmp_path):
    cache = _cache(backend, tmp_path)
    svc = SolutionService(cache, 60, 30)
    first = svc.solve(BODY)
    assert not first.cached and svc.solve(BODY).cached
    _corrupt(cache, first.key)
    again = svc.solve(BODY)
    assert not again.cached  # the corrupt answer was not served
    assert json.loads(again.body)["negative_slope"] == json.loads(first.body)["negative_slope"] < 1
    assert svc.solve(BODY).cached  # and the recomputed answer replaced it
    assert svc.get(first.key)["answer"]["negative_slope"] < 1
    cache.close()


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_a_cold_answer_is_stored_before_it_is_returned(backend, tmp_path):
    """A cold answer is stored (and its single-flight lock released) before it comes back, so its
    warnings can say when it was not stored: a client that reads it back at once finds it, and a
    delete at once removes it for good."""
    cache = _cache(backend, tmp_path)
    svc = SolutionService(cache, 60, 30)
    for act in ("get", "delete"):
        body = json.dumps({**json.loads(BODY), "targets": {"eta": 0.41 if act == "get" else 0.42}}).encode()
        sent = svc.finish(svc.begin(body))
        assert not sent.cached and cache.get(sent.key, count_hit=False) is not None
        assert cache.acquire(sent.key, 1) is not None  # the lock is free again
        assert getattr(svc, act)(sent.key)["key"] == sent.key
        assert (cache.get(sent.key, count_hit=False) is None) == (act == "delete")


@pytest.mark.parametrize("backend", ["redis", "sqlite"])
def test_the_single_flight_lock_is_held_until_released_or_expired(backend, tmp_path):
    cache = _cache(backend, tmp_path)
    key = "c" * 64
    token = cache.acquire(key, 30)
    assert token
    assert cache.acquire(key, 30) is None  # held: nobody else takes it
    cache.release(key, "not-the-token")  # only its holder releases it
    assert cache.acquire(key, 30) is None
    cache.release(key, token)
    short = cache.acquire(key, 0.05)
    assert short and short != token
    time.sleep(0.1 if backend == "sqlite" else 0.15)
    taken = cache.acquire(key, 30)  # expired: the next one takes it over
    assert taken and taken != short
    cache.release(key, short)  # the expired holder's release leaves the new lock alone
    assert cache.acquire(key, 30) is None
    cache.release(key, taken)
