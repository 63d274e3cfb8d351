"""Damaged records never make a 500: solutions and validations whose fields are missing, of the
wrong type or not JSON are skipped by the lists, answered as not found or shown as far as they
read, on every endpoint and dashboard page that reads them, on both backends. And the keyed
checksum (``SIGPROP_CACHE_SECRET``): an entry tampered with and given a recomputed plain checksum
is recomputed, never served."""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import pytest
import redis
from fastapi.testclient import TestClient

from sigprop.api.app import create_app
from sigprop.api.auth import digest, tenant_of
from sigprop.api.validations import OWNER
from sigprop.settings import Settings

from ..service_fixtures import SHARED_REDIS_URL, flush_shared_redis, shared_redis_or_skip

BACKENDS = ["sqlite", "redis"]
KEY = "damaged-records-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# planted validations belong to KEY, as one it submitted would (others' are 404 to it, issue 35)
OWNED = json.dumps({OWNER: tenant_of(digest(KEY).hex())})
# solution field -> the damage done to it
SOLUTION_DAMAGE = {
    "hits": "lots",
    "created": "yesterday",
    "ids": "not json",
    "answer": '{"broken": ',
    "request": "not json",
    "method": None,
}
VALIDATION_DAMAGE = {"progress": "not json", "attempts": "many", "started": "soon", "results": "[1, 2]", "device": None}
UNREADABLE_VALIDATIONS = {"bad-created": {"created": "x"}, "bad-status": {"status": "weird"}}
# a request that does not read names no owner: shown to nobody but an admin key, never a 500
OWNERLESS_VALIDATIONS = {"bad-request": {"request": "not json"}, "list-request": {"request": "[1, 2]"}}


def _req(eta: float) -> dict:
    return {
        "graph": {"template": "mlp", "depth": 4, "width": 8},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": eta},
    }


def _app(backend: str, tmp_path, **settings):
    url = None
    if backend == "redis":
        shared_redis_or_skip()
        flush_shared_redis()
        url = SHARED_REDIS_URL
    return create_app(Settings(data_dir=tmp_path / "data", redis_url=url, api_keys=KEY, **settings))


class Store:
    """Raw writes into either backend, as damage or tampering would do them."""

    def __init__(self, app):
        self.cache = app.state.cache
        self.redis = redis.Redis.from_url(SHARED_REDIS_URL) if self.cache.backend == "redis" else None

    def set_solution(self, key: str, field: str, value) -> None:
        if self.redis is not None:
            if value is None:
                self.redis.hdel(f"sigprop:sol:{key}", field)
            else:
                self.redis.hset(f"sigprop:sol:{key}", field, value)
        else:  # SQLite columns are NOT NULL: a missing field reads as a number where text belongs
            self.cache._db().execute(
                f"UPDATE solutions SET {field} = ? WHERE key = ?", (12.5 if value is None else value, key)
            )

    def get_solution(self, key: str, field: str) -> str:
        if self.redis is not None:
            return self.redis.hget(f"sigprop:sol:{key}", field).decode()
        return self.cache._db().execute(f"SELECT {field} FROM solutions WHERE key = ?", (key,)).fetchone()[0]

    def plant_validation(self, vid: str, solution_key: str, damage: dict) -> None:
        fields = {
            "id": vid,
            "status": "finished",
            "key": solution_key,
            "request": OWNED,
            "created": repr(time.time()),
            "attempts": 1,
            "progress": "{}",
            "results": "{}",
        }
        fields.update(damage)
        if self.redis is not None:
            self.redis.hset(f"sigprop:val:{vid}", mapping={k: v for k, v in fields.items() if v is not None})
            self.redis.zadd("sigprop:validations", {vid: time.time()})
            self.redis.zadd(f"sigprop:validations:key:{solution_key}", {vid: time.time()})
        else:
            cols = ", ".join(fields)
            self.cache._db().execute(
                f"INSERT INTO validations ({cols}) VALUES ({', '.join('?' * len(fields))})", tuple(fields.values())
            )


def _no_5xx(c: TestClient, method: str, path: str, **kwargs) -> int:
    r = c.request(method, path, **kwargs)
    assert r.status_code < 500, f"{method} {path}: {r.status_code} {r.text[:300]}"
    return r.status_code


@pytest.mark.parametrize("backend", BACKENDS)
def test_damaged_records_never_500(backend, tmp_path):
    app = _app(backend, tmp_path)
    with TestClient(app, headers=AUTH) as c:  # stored submissions are read with a key (issue 35)
        store = Store(app)
        keys = {}
        for i, (field, value) in enumerate(SOLUTION_DAMAGE.items()):
            keys[field] = c.post("/v1/solve", json=_req(0.3 + i / 100)).json()["key"]
            store.set_solution(keys[field], field, value)
        intact = c.post("/v1/solve", json=_req(0.5)).json()["key"]
        if store.redis is not None:  # a key of another Redis type where a record's hash belongs
            keys["wrong type"] = "e" * 64
            store.redis.set("sigprop:sol:" + "e" * 64, "a string")
            for index in ("sigprop:index", "sigprop:lru", "sigprop:index:method:tat"):
                store.redis.zadd(index, {"e" * 64: time.time()})
        for name, damage in {
            "damaged-fields": VALIDATION_DAMAGE,
            **UNREADABLE_VALIDATIONS,
            **OWNERLESS_VALIDATIONS,
        }.items():
            store.plant_validation(name, keys["hits"], damage)

        for i, field in enumerate(SOLUTION_DAMAGE):  # every damaged request still answers 200
            r = c.post("/v1/solve", json=_req(0.3 + i / 100))
            assert r.status_code == 200, (field, r.text[:300])
            assert r.json()["cached"] is (field not in ("answer",)), field  # a broken answer is recomputed
        assert c.post("/v1/solve", json=_req(0.3)).status_code == 200  # the damaged counter was repaired
        listed = c.get("/v1/solutions", params={"limit": 100}).json()
        assert intact in {i["key"] for i in listed["items"]}
        hits = {i["key"]: i["hits"] for i in listed["items"]}
        assert isinstance(hits.get(keys["hits"], 0), int)
        for path in [
            "/v1/solutions?method=tat",
            "/v1/solutions?activation=leaky_relu&method=tat",
            "/dashboard",
            "/dashboard?method=tat",
            "/dashboard?q=leaky_relu",
            "/dashboard?q=e",
            "/v1/validations",
            "/dashboard/new",
        ]:
            assert _no_5xx(c, "GET", path) == 200, path
        for field, key in keys.items():
            for path in (f"/v1/solutions/{key}", f"/dashboard/solutions/{key}"):
                assert _no_5xx(c, "GET", path) in (200, 404), (field, path)
            _no_5xx(
                c,
                "POST",
                "/v1/validations",
                headers=AUTH,
                json={"key": key, "dataset": "synthetic", "steps": 5, "batch_size": 32},
            )
        assert c.get(f"/v1/solutions/{keys['hits']}").json()["hits"] >= 0
        listed_validations = c.get("/v1/validations").json()
        assert "damaged-fields" in {v["id"] for v in listed_validations["items"]}
        assert not {"bad-created", "bad-status", *OWNERLESS_VALIDATIONS} & {
            v["id"] for v in listed_validations["items"]
        }
        job = c.get("/v1/validations/damaged-fields").json()
        assert job["progress"] == {} and job["attempts"] == 0 and job["results"] is None
        for vid in OWNERLESS_VALIDATIONS:
            assert _no_5xx(c, "GET", f"/v1/validations/{vid}") == 404, vid
        for vid in ("damaged-fields", *UNREADABLE_VALIDATIONS, *OWNERLESS_VALIDATIONS):
            for path in (
                f"/v1/validations/{vid}",
                f"/dashboard/validations/{vid}",
                f"/dashboard/validations/{vid}.json",
            ):
                assert _no_5xx(c, "GET", path) in (200, 404), path


@pytest.mark.parametrize("backend", BACKENDS)
def test_keyed_checksum_rejects_a_tampered_entry(backend, tmp_path):
    app = _app(backend, tmp_path, cache_secret="a-server-secret-of-some-length")
    with TestClient(app, headers=AUTH) as c:
        store = Store(app)
        first = c.post("/v1/solve", json=_req(0.4)).json()
        key = first["key"]
        assert store.get_solution(key, "digest").startswith("hmac-sha256:")
        assert c.post("/v1/solve", json=_req(0.4)).json()["cached"] is True
        answer = store.get_solution(key, "answer")
        tampered = answer.replace('"negative_slope":0.', '"negative_slope":9.', 1)
        assert tampered != answer
        store.set_solution(key, "answer", tampered)
        store.set_solution(key, "digest", hashlib.sha256(tampered.encode()).hexdigest())  # a plain checksum
        again = c.post("/v1/solve", json=_req(0.4)).json()
        assert again["cached"] is False and again["negative_slope"] == first["negative_slope"] < 1
        assert c.get(f"/v1/solutions/{key}").json()["answer"]["negative_slope"] < 1
        # and the same tampering with the wrong secret's checksum
        store.set_solution(key, "answer", tampered)
        guessed = hmac.new(b"guess", tampered.encode(), hashlib.sha256).hexdigest()
        store.set_solution(key, "digest", "hmac-sha256:" + guessed)
        assert c.get(f"/v1/solutions/{key}").status_code == 404
        assert c.post("/v1/solve", json=_req(0.4)).json()["cached"] is False
        assert json.loads(store.get_solution(key, "answer"))["negative_slope"] < 1  # overwritten by the recompute
