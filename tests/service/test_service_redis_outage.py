"""The service keeps answering while its Redis is down, and recovers when Redis is back.

A private redis-server (spare loopback port, nothing kept on disk) backs a real `sigprop serve`.
The test stops Redis under the running server, checks that solves degrade (200, answered without the
cache, with a warning) while /readyz reports 503, restarts Redis on the same port and checks that the
server uses it again without a restart of its own.
"""

from __future__ import annotations

import time

import httpx
import pytest

from ..inprocess import readyz_when
from ..service_fixtures import assert_error, metric_value, running_service, start_redis, strip_cached

REQ_A = {
    "graph": {"template": "mlp", "depth": 5, "width": 32},
    "method": "tat",
    "activation": "leaky_relu",
    "targets": {"eta": 0.4},
}
REQ_B = {**REQ_A, "targets": {"eta": 0.41}}
REQ_C = {**REQ_A, "targets": {"eta": 0.42}}
DEGRADED_LATENCY_S = 5.0  # an outage must not hang requests (SIGPROP_REDIS_TIMEOUT_S is 0.5 s)
RECOVERY_S = 10.0


def _cache_warning(answer: dict) -> list[str]:
    return [w for w in answer["warnings"] if "cache" in w and "unreachable" in w]


@pytest.fixture
def redis_server(tmp_path):
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def service(tmp_path, redis_server):
    env = {"SIGPROP_REDIS_URL": redis_server.url, "SIGPROP_REDIS_TIMEOUT_S": "0.5"}
    with running_service(tmp_path / "svc", env) as svc:
        yield svc


def _solve(c: httpx.Client, req: dict) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = c.post("/v1/solve", json=req)
    return r, time.monotonic() - start


def _wait_ready(c: httpx.Client, timeout_s: float) -> float:
    start = time.monotonic()
    while True:
        r = c.get("/readyz")
        if r.status_code == 200:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"/readyz still {r.status_code} {r.text}"
        time.sleep(0.1)


def test_redis_outage_degrades_and_recovers(tmp_path, redis_server, service):
    c = service.client()
    assert c.get("/readyz").json()["cache"] == "redis"

    # 1. Redis up: solved and stored, then served from the cache.
    first, _ = _solve(c, REQ_A)
    assert first.status_code == 200, first.text
    a = first.json()
    assert a["cached"] is False and not _cache_warning(a)
    again, _ = _solve(c, REQ_A)
    assert again.json()["cached"] is True
    assert c.get(f"/v1/solutions/{a['key']}").status_code == 200

    # 2. Redis down (SIGTERM, waited for): answers still come, solved without the cache.
    redis_server.stop()
    assert not redis_server.ping()

    r, elapsed = _solve(c, REQ_B)
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["cached"] is False
    assert _cache_warning(b), b["warnings"]
    assert elapsed < DEGRADED_LATENCY_S, elapsed

    ready = readyz_when(c, lambda r: r.status_code == 503)
    assert ready.status_code == 503, ready.text
    assert ready.json()["cache_reachable"] is False and ready.json()["status"] == "not_ready"
    assert c.get("/healthz").status_code == 200  # alive, just not ready

    # the request the cache held is solved again, with the same answer
    r, elapsed = _solve(c, REQ_A)
    assert r.status_code == 200, r.text
    a_down = r.json()
    assert a_down["cached"] is False and _cache_warning(a_down)
    assert elapsed < DEGRADED_LATENCY_S, elapsed
    assert {**a_down, "warnings": None, "cached": None} == {**a, "warnings": None, "cached": None}

    # errors in bad requests are still the contract's, not 5xx
    bad = c.post("/v1/solve", content=b"not json", headers={"Content-Type": "application/json"})
    assert_error(bad, 422, "invalid_request")

    metrics = c.get("/metrics").text
    assert (metric_value(metrics, "sigprop_cache_total", {"result": "error"}) or 0) >= 2

    # 3. Redis back on the same port. It kept nothing on disk (--save "" --appendonly no), so the
    #    entries stored before the outage are gone: that is expected, not a bug.
    server2 = start_redis(tmp_path / "redis2", port=redis_server.port)
    try:
        recovered_in = _wait_ready(c, RECOVERY_S)
        assert c.get("/readyz").json()["cache_reachable"] is True

        r, _ = _solve(c, REQ_C)
        assert r.status_code == 200, r.text
        cc = r.json()
        assert cc["cached"] is False and not _cache_warning(cc), cc["warnings"]
        r2, _ = _solve(c, REQ_C)
        assert r2.status_code == 200 and r2.json()["cached"] is True
        assert strip_cached(r2.text) == strip_cached(r.text)
        assert c.get(f"/v1/solutions/{cc['key']}").status_code == 200

        # A's entry did not survive the restart: solved again (and stored again)
        assert_error(c.get(f"/v1/solutions/{a['key']}"), 404, "not_found")
        r, _ = _solve(c, REQ_A)
        assert r.json()["cached"] is False and not _cache_warning(r.json())
        assert _solve(c, REQ_A)[0].json()["cached"] is True
    finally:
        server2.stop()
    print(f"readyz recovered {recovered_in:.2f} s after redis-server restarted")


def test_stored_solutions_during_outage_answer_503_not_500(redis_server, service):
    key = service.client().post("/v1/solve", json=REQ_A).json()["key"]
    redis_server.stop()
    for path in ("/v1/solutions", f"/v1/solutions/{key}"):
        # a connection per request: after the unhandled exception uvicorn drops the connection
        with httpx.Client(base_url=service.base_url, timeout=10) as c:
            r = c.get(path)
        assert r.status_code == 503, (path, r.status_code, r.text[:200])
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "hint"}
