"""A store that answers but refuses writes: the service keeps answering.

* A private Redis filled to ``maxmemory`` under ``noeviction`` (every write answers OOM): cache hits
  and cold solves answer 200 (the cold one with a "not stored" warning), ``/readyz`` stays 200 with
  ``"storage": "degraded"``, the metrics count the refusals, a validation submission gets 503
  ``storage_full`` and leaves nothing behind, and once memory is freed everything is stored again.
* The embedded SQLite file made read-only (``PRAGMA query_only``) and full (``max_page_count``):
  the same answers.
"""

from __future__ import annotations

import time

import pytest
import redis
from fastapi.testclient import TestClient

from sigprop.api.app import create_app
from sigprop.settings import Settings
from sigprop.storage import sqlite_backend

from ..inprocess import readyz_when
from ..service_fixtures import metric_value, start_redis

KEY = "storage-full-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _req(eta: float, depth: int = 4) -> dict:
    return {
        "graph": {"template": "mlp", "depth": depth, "width": 8},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": eta},
    }


def _not_stored(answer: dict) -> list[str]:
    return [w for w in answer["warnings"] if "not stored" in w]


def _events(client: TestClient, event: str) -> float:
    return metric_value(client.get("/metrics").text, "sigprop_storage_events_total", {"event": event}) or 0.0


def _refused(response) -> dict:
    """503 storage_full in the contract's error shape (``assert_error`` is for 4xx only)."""
    assert response.status_code == 503, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "hint"}, body
    assert body["error"]["code"] == "storage_full" and body["error"]["hint"], body
    return body["error"]


def _fill(r: redis.Redis) -> int:
    """Fill Redis to its maxmemory with 64 KB values until it refuses a write; returns how many."""
    n = 0
    while True:
        try:
            r.set(f"filler:{n}", b"x" * 65536)
        except redis.exceptions.OutOfMemoryError:
            return n
        n += 1
        assert n < 10_000, "Redis never refused a write: is maxmemory set?"


@pytest.fixture
def full_redis(tmp_path):
    server = start_redis(tmp_path / "redis")
    r = redis.Redis.from_url(server.url)
    yield server, r
    r.close()
    server.stop()


def _check_degraded_answers(
    c: TestClient, hit_req: dict, cold_req: dict, hit_count_refused: bool = True, validation_refused: bool = True
) -> None:
    """What a full store must still answer: the hit, a cold solve, the lists and the probes."""
    hit = c.post("/v1/solve", json=hit_req)
    assert hit.status_code == 200, hit.text
    assert hit.json()["cached"] is True and not _not_stored(hit.json())
    cold = c.post("/v1/solve", json=cold_req)
    assert cold.status_code == 200, cold.text
    assert cold.json()["cached"] is False and _not_stored(cold.json()), cold.json()["warnings"]
    assert c.post("/v1/solve", json=cold_req).json()["cached"] is False  # it really was not stored
    ready = readyz_when(c, lambda r: r.json()["storage"] == "degraded")
    assert ready.status_code == 200, ready.text
    assert ready.json()["storage"] == "degraded" and ready.json()["status"] == "ready", ready.json()
    assert c.get("/v1/solutions", headers=AUTH).status_code == 200
    assert c.get("/dashboard", headers=AUTH).status_code == 200
    assert _events(c, "refused_store") >= 2
    assert _events(c, "refused_hit_count") >= 1 or not hit_count_refused
    if not validation_refused:
        return
    before = c.get("/v1/validations", headers=AUTH).json()["total"]
    refused = c.post(
        "/v1/validations",
        headers=AUTH,
        json={"key": hit.json()["key"], "dataset": "synthetic", "steps": 5, "batch_size": 32},
    )
    err = _refused(refused)
    assert "retry" in err["hint"]
    assert c.get("/v1/validations", headers=AUTH).json()["total"] == before  # nothing half-accepted is left behind


def test_redis_at_maxmemory_degrades_and_recovers(tmp_path, full_redis):
    server, r = full_redis
    settings = Settings(data_dir=tmp_path / "data", redis_url=server.url, api_keys=KEY, cache_max_bytes=0)
    with TestClient(create_app(settings)) as c:
        first = c.post("/v1/solve", json=_req(0.3))
        assert first.status_code == 200 and first.json()["cached"] is False
        assert c.get("/readyz").json()["storage"] == "ok"

        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", used + 4 * 1024 * 1024)
        fillers = _fill(r)
        # and keep it full: the server's own buffers shrink and grow, which could let one write in
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - 1024 * 1024)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            r.set("one-more", "x")

        _check_degraded_answers(c, _req(0.3), _req(0.31))
        hits_before = int(r.hget(f"sigprop:sol:{first.json()['key']}", "hits"))
        assert c.post("/v1/solve", json=_req(0.3)).json()["cached"] is True
        assert int(r.hget(f"sigprop:sol:{first.json()['key']}", "hits")) == hits_before  # served, not counted

        # memory freed: the next probe and the next cold solve store again, without a restart
        r.delete(*[f"filler:{i}" for i in range(fillers)])
        ready = readyz_when(c, lambda r: r.json()["storage"] == "ok")
        assert ready.status_code == 200 and ready.json()["storage"] == "ok", ready.json()
        cold = c.post("/v1/solve", json=_req(0.31))
        assert cold.status_code == 200 and not _not_stored(cold.json())
        assert c.post("/v1/solve", json=_req(0.31)).json()["cached"] is True
        listed = c.get("/v1/solutions", headers=AUTH).json()
        assert listed["total"] == 2 and len(listed["items"]) == 2
        assert (
            c.post(
                "/v1/validations",
                headers=AUTH,
                json={"key": first.json()["key"], "dataset": "synthetic", "steps": 5, "batch_size": 32},
            ).status_code
            == 202
        )


def test_redis_read_only_replica_degrades(tmp_path, full_redis):
    """A replica answers READONLY to every write: cold solves answer, not stored; /readyz degraded."""
    server, r = full_redis
    primary = start_redis(tmp_path / "primary")
    settings = Settings(data_dir=tmp_path / "data", redis_url=server.url, api_keys=KEY)
    try:
        with TestClient(create_app(settings)) as c:
            r.replicaof("127.0.0.1", primary.port)
            deadline = time.monotonic() + 10
            while r.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline, r.info("replication")
                time.sleep(0.05)
            ready = readyz_when(c, lambda r: r.json()["storage"] == "degraded")
            assert ready.status_code == 200 and ready.json()["storage"] == "degraded", ready.json()
            for _ in range(2):
                cold = c.post("/v1/solve", json=_req(0.33))
                assert cold.status_code == 200 and _not_stored(cold.json()), cold.text
            _refused(
                c.post(
                    "/v1/validations",
                    headers=AUTH,
                    json={"solve": _req(0.33), "dataset": "synthetic", "steps": 5, "batch_size": 32},
                )
            )
            r.replicaof("no", "one")
            assert readyz_when(c, lambda r: r.json()["storage"] == "ok").json()["storage"] == "ok"
            assert not _not_stored(c.post("/v1/solve", json=_req(0.33)).json())
    finally:
        primary.stop()


@pytest.fixture
def sqlite_limits(monkeypatch):
    """Per-connection SQLite limits the test turns on and off: every connection the cache hands out
    (one per thread) gets them applied before use."""
    limits = {"query_only": 0, "max_page_count": 1_073_741_823}
    real_db = sqlite_backend._SqliteFile._db

    def limited(self):
        db = real_db(self)
        db.execute(f"PRAGMA query_only = {limits['query_only']}")
        db.execute(f"PRAGMA max_page_count = {limits['max_page_count']}")
        return db

    monkeypatch.setattr(sqlite_backend._SqliteFile, "_db", limited)
    return limits


@pytest.mark.parametrize("limit", ["read-only", "disk full"])
def test_sqlite_refusing_writes_degrades_and_recovers(tmp_path, sqlite_limits, limit):
    settings = Settings(data_dir=tmp_path / "data", api_keys=KEY)
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/solve", json=_req(0.3)).status_code == 200
        if limit == "read-only":
            sqlite_limits["query_only"] = 1
        else:
            sqlite_limits["max_page_count"] = 1  # never below the file's size: it just cannot grow
        # a deep answer (tens of KB) needs new pages, which a full file cannot give
        # A full file still rewrites a row in place (the hit's count) and may fit a small validation
        # record in a page's free space: only writes that need new pages are refused.
        if limit == "disk full":
            # nothing refused yet (the hit's count fits in place): the first refused write is a cold
            # answer's, stored after it was sent (issue 25), so that answer cannot say so; the
            # refusal is counted, and from then on answers are stored before they go, with the warning
            before = _events(c, "refused_store")
            first = c.post("/v1/solve", json=_req(0.32, depth=300))
            assert first.status_code == 200 and first.json()["cached"] is False
            assert _events(c, "refused_store") == before + 1
            assert readyz_when(c, lambda r: r.json()["storage"] == "degraded").json()["storage"] == "degraded"
        _check_degraded_answers(
            c,
            _req(0.3),
            _req(0.31, depth=300),
            hit_count_refused=limit == "read-only",
            validation_refused=limit == "read-only",
        )

        sqlite_limits.update(query_only=0, max_page_count=1_073_741_823)
        cold = c.post("/v1/solve", json=_req(0.31, depth=300))
        assert cold.status_code == 200 and not _not_stored(cold.json())
        assert readyz_when(c, lambda r: r.json()["storage"] == "ok").json()["storage"] == "ok"
        assert c.post("/v1/solve", json=_req(0.31, depth=300)).json()["cached"] is True
