"""Rate limits: cold solves and validation submissions per client (its valid API key,
else its address), 429 ``rate_limited`` with Retry-After; cache hits are never limited. With Redis
the budget is shared by every API process; when that Redis is down the limiter counts in process
memory and solves keep answering.
"""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from pydantic import ValidationError

from sigprop.api.ratelimit import RateLimit, RateLimited
from sigprop.settings import Settings, parse_rate_limit

from ..inprocess import KEY_ONE, KEY_TWO, app_client, bearer, eoc, mlp, validation
from ..service_fixtures import assert_error, free_port, start_redis, start_service


def assert_limited(r: httpx.Response, window_s: int = 60) -> int:
    err = assert_error(r, 429, "rate_limited")
    assert err["hint"] and "retry after" in err["hint"]
    retry = r.headers["retry-after"]
    assert retry.isdigit() and 1 <= int(retry) <= window_s, retry
    return int(retry)


# -- in-process (memory storage) --------------------------------------------------------------------


def test_the_fourth_cold_solve_is_limited_and_hits_never_are(tmp_path):
    with app_client(tmp_path, rate_limit_cold_solves="3/minute") as c:
        solved = []
        for q in (1.0, 1.5, 2.0):
            r = c.post("/v1/solve", json=eoc(q))
            assert r.status_code == 200 and r.json()["cached"] is False, r.text
            solved.append(r.text)
        r = c.post("/v1/solve", json=eoc(2.5))
        retry = assert_limited(r)
        assert retry >= 50  # the three solves were just now: the window has most of a minute to go
        assert "cold solves" in r.json()["error"]["message"]
        # already-solved requests keep answering from the cache, however many
        for _ in range(10):
            for q in (1.0, 1.5, 2.0):
                r = c.post("/v1/solve", json=eoc(q))
                assert r.status_code == 200 and r.json()["cached"] is True, r.text
        # ... and so does the same network written another way (same key, new body bytes)
        body = eoc(1.0)
        body["graph"] = c.get("/v1/templates/mlp", params={"depth": 2, "width": 4}).json()
        r = c.post("/v1/solve", json=body)
        assert r.status_code == 200 and r.json()["cached"] is True, r.text
        assert_limited(c.post("/v1/solve", json=eoc(3.0)))
        # a request that is invalid is rejected as before, not counted or limited
        assert_error(c.post("/v1/solve", json={**eoc(3.0), "method": "magic"}), 422, "unsupported_method")


def test_each_api_key_has_its_own_budget(tmp_path):
    with app_client(tmp_path, rate_limit_cold_solves="2/minute") as c:
        for q in (1.0, 1.1):
            assert c.post("/v1/solve", json=eoc(q), headers=bearer(KEY_ONE)).status_code == 200
        assert_limited(c.post("/v1/solve", json=eoc(1.2), headers=bearer(KEY_ONE)))
        # another key: a budget of its own
        for q in (1.2, 1.3):
            assert c.post("/v1/solve", json=eoc(q), headers=bearer(KEY_TWO)).status_code == 200
        assert_limited(c.post("/v1/solve", json=eoc(1.4), headers=bearer(KEY_TWO)))
        # no key, or an invalid one: the client's address, a third budget
        assert c.post("/v1/solve", json=eoc(1.4)).status_code == 200
        assert c.post("/v1/solve", json=eoc(1.5), headers=bearer("not-a-key")).status_code == 200
        assert_limited(c.post("/v1/solve", json=eoc(1.6)))


def test_validations_are_limited_per_key(tmp_path):
    with app_client(tmp_path, rate_limit_validations="2/minute") as c:
        for _ in range(2):
            assert c.post("/v1/validations", json=validation(), headers=bearer(KEY_ONE)).status_code == 202
        r = c.post("/v1/validations", json=validation(), headers=bearer(KEY_ONE))
        assert_limited(r)
        assert "validation submissions" in r.json()["error"]["message"]
        assert c.post("/v1/validations", json=validation(), headers=bearer(KEY_TWO)).status_code == 202
        # the limit is for submissions only: following and listing jobs (with a key: they are the
        # key's own) is not limited
        for _ in range(5):
            assert c.get("/v1/validations", headers=bearer(KEY_ONE)).status_code == 200


def test_a_validations_cold_solve_counts_against_the_cold_budget(tmp_path):
    with app_client(tmp_path, rate_limit_cold_solves="1/minute") as c:
        assert c.post("/v1/solve", json=mlp(eta=0.3), headers=bearer(KEY_ONE)).status_code == 200
        # its solve is a cache hit: accepted
        assert c.post("/v1/validations", json=validation(mlp(eta=0.3)), headers=bearer(KEY_ONE)).status_code == 202
        # a new network: a cold solve over the key's budget
        assert_limited(c.post("/v1/validations", json=validation(mlp(eta=0.31)), headers=bearer(KEY_ONE)))
        assert c.post("/v1/validations", json=validation(mlp(eta=0.31)), headers=bearer(KEY_TWO)).status_code == 202


@pytest.mark.parametrize("spec", ["", "0", " 0 "])
def test_an_empty_limit_disables_it(tmp_path, spec):
    with app_client(tmp_path, rate_limit_cold_solves=spec, rate_limit_validations=spec) as c:
        for i in range(8):
            assert c.post("/v1/solve", json=eoc(1.0 + i / 10)).status_code == 200


def test_limits_are_validated_at_startup(tmp_path):
    for bad in ("lots", "3/fortnight", "-1/minute", "minute", "3/minute;"):
        with pytest.raises(ValidationError, match="rate limit"):
            Settings(data_dir=tmp_path, rate_limit_cold_solves=bad)
    with pytest.raises(ValidationError, match="rate limit"):
        Settings(data_dir=tmp_path, rate_limit_validations="0/minute")
    ok = Settings(
        data_dir=tmp_path, rate_limit_cold_solves="10/second;600/hour", rate_limit_validations="30 per minute"
    )
    assert [str(i) for i in parse_rate_limit(ok.rate_limit_cold_solves)] == ["10 per 1 second", "600 per 1 hour"]


def test_openapi_documents_429(tmp_path):
    with app_client(tmp_path) as c:
        paths = c.get("/openapi.json").json()["paths"]
    for path in ("/v1/solve", "/v1/validations"):
        assert "429" in paths[path]["post"]["responses"], path
        assert "Retry-After" in paths[path]["post"]["responses"]["429"]["headers"]


def test_limiter_falls_back_to_memory_when_its_redis_is_unreachable(caplog):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    limit = RateLimit("test", "tests", "3/minute", "hint", redis_url=dead, redis_timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="sigprop"):
        start = time.perf_counter()
        for _ in range(3):
            limit.check("addr:1")
        with pytest.raises(RateLimited) as info:
            limit.check("addr:1")
        elapsed = time.perf_counter() - start
    assert info.value.status == 429 and int(info.value.headers["Retry-After"]) >= 1
    warnings = [r for r in caplog.records if "rate limiter" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per outage, not per request
    assert elapsed < 1.0, elapsed  # after the first failure Redis is not retried for a while
    limit.check(None)  # internal callers (no identity) are never limited


# -- real servers on Redis ----------------------------------------------------------------------------


@pytest.fixture
def private_redis(tmp_path):
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


def test_redis_budget_is_shared_by_two_api_processes(tmp_path, private_redis):
    from .test_service_http import _clients_on_both_workers

    prom = tmp_path / "prom"
    prom.mkdir()
    svc = start_service(
        tmp_path / "svc",
        {
            "SIGPROP_REDIS_URL": private_redis.url,
            "SIGPROP_DATA_DIR": str(tmp_path / "data"),
            "SIGPROP_RATE_LIMIT_COLD_SOLVES": "3/minute",
            "PROMETHEUS_MULTIPROC_DIR": str(prom),
        },
        workers=2,
    )
    svc.prom_dir = prom
    clients, owner = [], {}
    try:
        clients, owner = _clients_on_both_workers(svc, 4)
        pids = sorted({p for p in owner.values() if p is not None})
        a = next(clients[i] for i, p in owner.items() if p == pids[0])
        b = next(clients[i] for i, p in owner.items() if p == pids[1])
        # two cold solves on one process, one on the other: three in all
        assert a.post("/v1/solve", json=eoc(1.0)).status_code == 200
        assert a.post("/v1/solve", json=eoc(1.1)).status_code == 200
        assert b.post("/v1/solve", json=eoc(1.2)).status_code == 200
        # the second process has seen one cold solve itself; the shared budget is spent
        assert_limited(b.post("/v1/solve", json=eoc(1.3)))
        assert_limited(a.post("/v1/solve", json=eoc(1.3)))
        for c in (a, b):  # hits on both processes
            assert c.post("/v1/solve", json=eoc(1.0)).json()["cached"] is True
        keys = private_redis_keys(private_redis)
        assert keys and all(k.startswith(b"sigprop-ratelimit") for k in keys), keys
        assert not any(b"sec-key" in k for k in keys)
    finally:
        for c in clients:
            c.close()
        svc.stop()


def private_redis_keys(server) -> list[bytes]:
    import redis

    r = redis.Redis(host="127.0.0.1", port=server.port)
    try:
        return [k for k in r.keys("*") if b"ratelimit" in k]
    finally:
        r.close()


def test_solves_keep_answering_when_the_limiters_redis_is_down(tmp_path, private_redis):
    svc = start_service(
        tmp_path / "svc",
        {
            "SIGPROP_REDIS_URL": private_redis.url,
            "SIGPROP_DATA_DIR": str(tmp_path / "data"),
            "SIGPROP_REDIS_TIMEOUT_S": "0.5",
            "SIGPROP_RATE_LIMIT_COLD_SOLVES": "3/minute",
        },
    )
    try:
        c = svc.client(headers=bearer("no-such-key"))
        assert c.post("/v1/solve", json=eoc(1.0)).status_code == 200
        private_redis.stop()
        # the cache and the limiter are both down: answered, degraded, counted in memory
        for q in (2.0, 2.1, 2.2):
            start = time.monotonic()
            r = c.post("/v1/solve", json=eoc(q))
            assert r.status_code == 200, r.text
            assert any("unreachable" in w for w in r.json()["warnings"])
            assert time.monotonic() - start < 5.0
        assert_limited(c.post("/v1/solve", json=eoc(2.3)))
        assert "rate limiter: Redis unreachable" in svc.log()
    finally:
        svc.stop()
