"""Retention bounds: the least recently used solutions are evicted with their index entries, so
``GET /v1/solutions``, the dashboard and the counts agree afterwards (both backends); an answer
larger than the byte bound is answered and not stored; final validations past their bounds are
removed, active ones never; rate-limit and lock keys keep their expiries."""

from __future__ import annotations

import re
import time

import pytest
import redis
from fastapi.testclient import TestClient

from sigprop.api.app import create_app
from sigprop.settings import Settings
from sigprop.storage import ACTIVE, RedisValidationStore, SqliteValidationStore

from ..service_fixtures import SHARED_REDIS_URL, flush_shared_redis, shared_redis_or_skip

BACKENDS = ["sqlite", "redis"]


def _req(eta: float, depth: int = 4) -> dict:
    return {
        "graph": {"template": "mlp", "depth": depth, "width": 8},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": eta},
    }


def _app(backend: str, tmp_path, **bounds):
    url = None
    if backend == "redis":
        shared_redis_or_skip()
        flush_shared_redis()
        url = SHARED_REDIS_URL
    return create_app(Settings(data_dir=tmp_path / "data", redis_url=url, **bounds))


def _consistent(c: TestClient, app, expected: set[str]) -> None:
    """The list, its filters, the dashboard, the counts and the store's own books all say ``expected``."""
    listed = c.get("/v1/solutions", params={"limit": 100}).json()
    assert listed["total"] == len(expected) and {i["key"] for i in listed["items"]} == expected, listed
    for params in ({"method": "tat"}, {"activation": "leaky_relu"}, {"method": "tat", "activation": "leaky_relu"}):
        assert c.get("/v1/solutions", params=params).json()["total"] == len(expected), params
    page = c.get("/dashboard").text
    shown = set(re.findall(r'href="/dashboard/solutions/([0-9a-f]{64})"', page))
    assert shown == expected, (shown, expected)
    assert f"of {len(expected)} solution" in page
    assert f"tat ({len(expected)})" in page and f"leaky_relu ({len(expected)})" in page
    cache = app.state.cache
    assert cache.counts("method", ["tat"]) == {"tat": len(expected)}
    stats = cache.stats()
    assert stats["entries"] == len(expected), stats
    sizes = [cache.get(k, count_hit=False).size for k in expected]
    assert stats["bytes"] == sum(sizes), (stats, sizes)
    if cache.backend == "redis":
        r = cache.r
        assert {k.decode().rsplit(":", 1)[1] for k in r.scan_iter("sigprop:sol:*")} == expected
        assert {k.decode() for k in r.zrange("sigprop:lru", 0, -1)} == expected
        assert r.zcard("sigprop:index:method:tat") == r.zcard("sigprop:index:activation:leaky_relu") == len(expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entry_bound_evicts_least_recently_used_with_its_index_entries(backend, tmp_path):
    app = _app(backend, tmp_path, cache_max_entries=3)
    with TestClient(app) as c:
        key = {}
        for name, eta in (("a", 0.30), ("b", 0.31), ("c", 0.32)):
            key[name] = c.post("/v1/solve", json=_req(eta)).json()["key"]
        _consistent(c, app, {key["a"], key["b"], key["c"]})
        time.sleep(0.01)
        assert c.post("/v1/solve", json=_req(0.30)).json()["cached"] is True  # a is used again: b is the oldest
        key["d"] = c.post("/v1/solve", json=_req(0.33)).json()["key"]
        _consistent(c, app, {key["a"], key["c"], key["d"]})
        key["e"] = c.post("/v1/solve", json=_req(0.34)).json()["key"]
        _consistent(c, app, {key["a"], key["d"], key["e"]})
        assert c.get(f"/v1/solutions/{key['b']}").status_code == 404
        assert c.get(f"/dashboard/solutions/{key['b']}").status_code == 404
        again = c.post("/v1/solve", json=_req(0.31))  # an evicted answer is solved and stored again
        assert again.status_code == 200 and again.json()["cached"] is False
        _consistent(c, app, {key["b"], key["d"], key["e"]})
        metrics = c.get("/metrics").text
        assert re.search(r'sigprop_storage_events_total\{event="evicted_solutions"\} [3-9]', metrics)


@pytest.mark.parametrize("backend", BACKENDS)
def test_byte_bound_and_an_answer_larger_than_it(backend, tmp_path):
    probe = _app("sqlite", tmp_path / "probe")
    with TestClient(probe) as c:
        one = probe.state.cache.get(c.post("/v1/solve", json=_req(0.3, depth=200)).json()["key"], count_hit=False).size
    app = _app(backend, tmp_path, cache_max_bytes=int(2.5 * one))
    with TestClient(app) as c:
        keys = [c.post("/v1/solve", json=_req(0.3 + i / 100, depth=200)).json()["key"] for i in range(4)]
        _consistent(c, app, set(keys[2:]))  # two fit under 2.5 answers' bytes
        assert app.state.cache.stats()["bytes"] <= 2.5 * one
        big = c.post("/v1/solve", json=_req(0.3, depth=1000))
        assert big.status_code == 200 and big.json()["cached"] is False
        assert any("more than the cache holds" in w for w in big.json()["warnings"]), big.json()["warnings"]
        _consistent(c, app, set(keys[2:]))  # nothing evicted for an answer that is not stored


def test_rate_limit_and_lock_keys_keep_their_expiries(tmp_path):
    app = _app("redis", tmp_path, cache_max_entries=2)
    with TestClient(app) as c:
        for i in range(4):
            assert c.post("/v1/solve", json=_req(0.3 + i / 100)).status_code == 200
        r = app.state.cache.r
        limits = list(r.scan_iter("sigprop-ratelimit*"))
        assert limits and all(r.pttl(k) > 0 for k in limits)
        token = app.state.cache.acquire("f" * 64, 30)
        assert token and 0 < r.pttl("sigprop:lock:" + "f" * 64) <= 30_000
        app.state.cache.release("f" * 64, token)


def _store(backend: str, tmp_path, **bounds):
    if backend == "redis":
        shared_redis_or_skip()
        flush_shared_redis()
        return RedisValidationStore(redis.Redis.from_url(SHARED_REDIS_URL), **bounds)
    return SqliteValidationStore(tmp_path / "v.sqlite3", **bounds)


def _finish(store, vid: str) -> None:
    assert store.update(vid, {"status": "finished", "ended": time.time(), "results": "{}"}, only_if=ACTIVE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_count_bound_removes_oldest_final_ones_only(backend, tmp_path):
    store = _store(backend, tmp_path, max_records=3)
    now = time.time()
    for i in range(3):
        store.create(f"v{i}", "k" * 64, {"i": i}, now + i)
        _finish(store, f"v{i}")
    store.create("v3", "k" * 64, {}, now + 3)
    store.create("v4", "k" * 64, {}, now + 4)
    total, items = store.list(0, 50)
    assert total == 3 and [j["id"] for j in items] == ["v4", "v3", "v2"]
    assert store.list_for_key("k" * 64, 50)[0] == 3
    assert store.get("v0") is None and store.get("v1") is None
    # v3 and v4 are still queued: over the bound, but an accepted job is never removed
    store.create("v5", "k" * 64, {}, now + 5)
    store.create("v6", "k" * 64, {}, now + 6)
    assert {j["id"] for j in store.list(0, 50)[1]} == {"v3", "v4", "v5", "v6"}
    store.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_age_bound(backend, tmp_path):
    store = _store(backend, tmp_path, max_age_s=3600)
    now = time.time()
    store.create("old-final", "k" * 64, {}, now - 7200)
    _finish(store, "old-final")
    store.create("old-running", "k" * 64, {}, now - 7200)
    store.create("new", "k" * 64, {}, now)
    assert {j["id"] for j in store.list(0, 50)[1]} == {"old-running", "new"}
    assert store.list(0, 50)[0] == store.list_for_key("k" * 64, 50)[0] == 2
    store.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_records_stored_before_retention_are_counted_and_evicted(backend, tmp_path):
    """A store written by an older sigprop (no sizes, no LRU order) is brought under the bounds."""
    from sigprop.storage import RedisSolutionCache, SqliteSolutionCache, new_record

    old = [new_record(f"{i:x}" * 64, '{"targets":{}}', "{}", ["in", "out"], "tat", "relu") for i in range(1, 5)]
    for i, rec in enumerate(old):
        rec.created = 1000.0 + i
    if backend == "redis":
        shared_redis_or_skip()
        flush_shared_redis()
        r = redis.Redis.from_url(SHARED_REDIS_URL)
        for rec in old:  # what an older sigprop's put wrote
            r.hset(
                f"sigprop:sol:{rec.key}",
                mapping={
                    "answer": rec.answer,
                    "request": rec.request,
                    "ids": '["in", "out"]',
                    "created": repr(rec.created),
                    "version": rec.version,
                    "method": "tat",
                    "activation": "relu",
                    "hits": 0,
                    "digest": rec.digest,
                },
            )
            for index in ("sigprop:index", "sigprop:index:method:tat", "sigprop:index:activation:relu"):
                r.zadd(index, {rec.key: rec.created})
        cache = RedisSolutionCache(SHARED_REDIS_URL, max_entries=3)
    else:
        import sqlite3

        path = tmp_path / "old.sqlite3"
        db = sqlite3.connect(path)
        db.execute(
            "CREATE TABLE solutions (key TEXT PRIMARY KEY, answer TEXT NOT NULL, request TEXT NOT NULL, "
            "ids TEXT NOT NULL, created REAL NOT NULL, version TEXT NOT NULL, method TEXT NOT NULL, "
            "activation TEXT NOT NULL, hits INTEGER NOT NULL DEFAULT 0, digest TEXT NOT NULL DEFAULT '')"
        )
        db.executemany(
            "INSERT INTO solutions VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
            [(x.key, x.answer, x.request, '["in", "out"]', x.created, x.version, "tat", "relu", x.digest) for x in old],
        )
        db.commit()
        db.close()
        cache = SqliteSolutionCache(path, max_entries=3)
    new = new_record("f" * 64, '{"targets":{}}', "{}", ["in", "out"], "tat", "relu")
    cache.put(new)
    total, items = cache.list(0, 10)
    assert total == 3 and {i.key for i in items} == {new.key, old[3].key, old[2].key}
    assert cache.stats() == {
        "entries": 3,
        "bytes": sum(x.size for x in (new, old[3], old[2])),
        "max_entries": 3,
        "max_bytes": 0,
    }
    assert cache.counts("method", ["tat"]) == {"tat": 3}
    cache.close()
