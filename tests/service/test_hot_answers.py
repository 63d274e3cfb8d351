"""Hot answers in process memory (``sigprop.storage.hot``): checked once, counted in batches that
become exact, relabelled per request, and never served after a DELETE, an eviction or tampering,
also in another worker process. Real Redis (the shared test database), no fakes."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest

from sigprop.api.solutions import SolutionService
from sigprop.engine.templates.expand import expand_template
from sigprop.schemas.graph import Template
from sigprop.storage import Checksum, RedisSolutionCache, new_record

from ..service_fixtures import (
    SHARED_REDIS_URL,
    flush_shared_redis,
    requests_by_pid,
    shared_redis_or_skip,
    start_service,
    strip_cached,
)

MLP = {"template": "mlp", "depth": 3, "width": 8}
KEY = "hot-answers-test-key-0123456789"
ADMIN_KEY = "hot-answers-admin-key-0123456789"  # deleting a cached solution takes an admin key
REQUEST = {"graph": MLP, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.4}}


def _body(request: dict) -> bytes:
    return json.dumps(request, separators=(",", ":")).encode()


def _renamed(request: dict) -> dict:
    """The same network written node by node with ids of its own: same key, other ids."""
    graph = json.loads(expand_template(Template.model_validate(MLP)).model_dump_json(by_alias=True, exclude_none=True))
    rename = {nd["id"]: f"layer_{i}_{nd['op']}" for i, nd in enumerate(graph["nodes"])}
    for nd in graph["nodes"]:
        nd["id"] = rename[nd["id"]]
        if "inputs" in nd:
            nd["inputs"] = [rename[i] for i in nd["inputs"]]
    return {**request, "graph": graph}


@pytest.fixture
def redis_client():
    flush_shared_redis()
    r = shared_redis_or_skip()
    yield r
    r.close()


@pytest.fixture
def keyed_cache(redis_client):
    cache = RedisSolutionCache(SHARED_REDIS_URL, checksum=Checksum("a-server-secret-of-ours"))
    yield cache
    cache.close()


def _undisturbed(hot, scenario, tries: int = 3) -> None:
    """Run ``scenario`` until no FLUSHDB landed during it. Other test runs share this Redis and
    flush their own databases; client tracking ignores databases, so their flushes also (rightly)
    empty this process's memory, which a scenario about serving from memory cannot tell apart from
    a bug."""
    for attempt in range(tries):
        before = hot.flushes
        try:
            scenario()
            return
        except AssertionError:
            if hot.flushes == before or attempt == tries - 1:
                raise


class _CountingChecksum(Checksum):
    def __init__(self, secret):
        super().__init__(secret)
        self.verified = 0

    def verify(self, answer, digest):
        self.verified += 1
        return super().verify(answer, digest)


def test_checksum_is_verified_once_per_entry_and_tampering_is_refused(redis_client):
    checksum = _CountingChecksum("a-server-secret-of-ours")
    cache = RedisSolutionCache(SHARED_REDIS_URL, checksum=checksum)
    try:
        service = SolutionService(cache, 60.0, 30.0, hot=cache.hot_answers())
        first = service.solve(_body(REQUEST))
        assert first.cached is False

        def served_from_memory():
            checksum.verified = 0
            hits = [service.hot_hit(_body(REQUEST)) or service.solve(_body(REQUEST)) for _ in range(20)]
            assert all(h.cached for h in hits)
            assert checksum.verified == 1  # read from Redis once, then served from memory
            assert service.hot_hit(_body(REQUEST)) is not None

        _undisturbed(cache.hot_answers(), served_from_memory)
        # someone who can write to Redis but lacks the secret stores another answer with a
        # recomputed plain checksum: Redis tells the process, which reads and refuses it
        sol = f"sigprop:sol:{first.key}"
        forged = redis_client.hget(sol, "answer").decode().replace('"eta":0.4', '"eta":0.41')
        redis_client.hset(sol, mapping={"answer": forged, "digest": hashlib.sha256(forged.encode()).hexdigest()})
        assert service.hot_hit(_body(REQUEST)) is None
        again = service.solve(_body(REQUEST))
        assert again.cached is False  # recomputed and stored over the forged entry
        assert strip_cached(again.body) == strip_cached(first.body)
    finally:
        cache.close()


def test_batched_hit_counts_become_exact_across_processes(keyed_cache, redis_client):
    rec = new_record("k" * 64, '{"cached":false}', "{}", [], "tat", "leaky_relu")
    keyed_cache.put(rec)
    # two workers' memories of the same store
    other = RedisSolutionCache(SHARED_REDIS_URL, checksum=Checksum("a-server-secret-of-ours"))
    try:
        mine, theirs = keyed_cache.hot_answers(), other.hot_answers()
        for _ in range(7):
            assert mine.fetch(rec.key) == rec.answer
        for _ in range(5):
            assert theirs.fetch(rec.key) == rec.answer
        mine.flush()
        theirs.flush()
        assert int(redis_client.hget(f"sigprop:sol:{rec.key}", "hits")) == 12
        # the LRU order moved to the last hit, not left at the creation time
        assert redis_client.zscore("sigprop:lru", rec.key) > rec.created
        # a reader of this process sees its own pending hits
        assert mine.fetch(rec.key) == rec.answer
        assert keyed_cache.get(rec.key, count_hit=False).hits == 13

        # hits pending for a record deleted meanwhile are dropped, never re-create it
        assert theirs.fetch(rec.key) == rec.answer
        assert keyed_cache.delete(rec.key)
        theirs.flush()
        assert not redis_client.exists(f"sigprop:sol:{rec.key}")
        assert redis_client.zscore("sigprop:lru", rec.key) is None
    finally:
        other.close()


def test_memory_is_dropped_on_delete_eviction_and_flush(keyed_cache, redis_client):
    other = RedisSolutionCache(SHARED_REDIS_URL, checksum=Checksum("a-server-secret-of-ours"))
    try:
        hot = keyed_cache.hot_answers()
        recs = [new_record(c * 64, f'{{"n":"{c}"}}', "{}", [], "tat", "leaky_relu") for c in "abc"]
        for rec in recs:
            keyed_cache.put(rec)

        def in_memory():
            for rec in recs:
                assert hot.fetch(rec.key) == rec.answer
            assert all(hot.hit(rec.key) is not None for rec in recs)

        _undisturbed(hot, in_memory)

        assert other.delete(recs[0].key)  # a DELETE through another process
        assert hot.hit(recs[0].key) is None
        assert hot.fetch(recs[0].key) is None

        other.max_entries = 1  # another process's put evicts the least recently used
        other.put(new_record("d" * 64, '{"n":"d"}', "{}", [], "tat", "leaky_relu"))
        assert hot.hit(recs[1].key) is None and hot.hit(recs[2].key) is None

        assert hot.fetch("d" * 64) is not None
        redis_client.flushdb()
        assert hot.hit("d" * 64) is None
    finally:
        other.close()


def test_each_request_gets_its_own_node_ids_from_memory(keyed_cache):
    service = SolutionService(keyed_cache, 60.0, 30.0, hot=keyed_cache.hot_answers())
    template, renamed = _body(REQUEST), _body(_renamed(REQUEST))
    assert service.solve(template).cached is False
    expected = {b: service.solve(b).body for b in (template, renamed)}  # hits, personalized per body
    assert expected[template] != expected[renamed]

    def personalized_from_memory():
        assert service.solve(template).cached  # (back) in memory
        for _ in range(3):
            for body in (template, renamed):
                outcome = service.hot_hit(body)
                assert outcome is not None and outcome.cached
                assert json.loads(outcome.body) == json.loads(expected[body])
        assert b"layer_1_" in service.hot_hit(renamed).body and b"layer_1_" not in service.hot_hit(template).body

    _undisturbed(keyed_cache.hot_answers(), personalized_from_memory)


def test_redis_outage_drops_memory(tmp_path):
    from ..service_fixtures import start_redis

    server = start_redis(tmp_path)
    cache = RedisSolutionCache(server.url, timeout_s=0.5)
    try:
        rec = new_record("e" * 64, '{"n":"e"}', "{}", [], "tat", "leaky_relu")
        cache.put(rec)
        hot = cache.hot_answers()
        assert hot.fetch(rec.key) == rec.answer
        server.stop()
        # the invalidation connection is gone, so nothing is served from memory any more
        assert hot.hit(rec.key) is None
        assert hot.fetch(rec.key) is None
        hot.count(rec.key, b"1")
        hot.flush()  # cannot be written now: kept for later, not lost, not raised
        assert hot.pending() == 2  # the fetch's hit and this one
    finally:
        cache.close()


# -- two worker processes ------------------------------------------------------------------------


def _clients_by_worker(svc, prom) -> dict[int, httpx.Client]:
    """One keep-alive connection to each of the two workers (seen in the per-process metrics)."""
    found: dict[int, httpx.Client] = {}
    for _ in range(60):
        c = httpx.Client(base_url=svc.base_url, timeout=60.0)
        before = requests_by_pid(prom)
        assert c.get("/healthz").status_code == 200
        changed = [p for p, v in requests_by_pid(prom).items() if v > before.get(p, 0)]
        if len(changed) == 1 and changed[0] not in found:
            found[changed[0]] = c
        else:
            c.close()
        if len(found) == 2:
            return found
    pytest.fail("could not reach both workers")


def test_delete_is_not_served_from_another_workers_memory(tmp_path, redis_client):
    prom = tmp_path / "prom"
    prom.mkdir()
    env = {
        "SIGPROP_DATA_DIR": str(tmp_path / "data"),
        "SIGPROP_REDIS_URL": SHARED_REDIS_URL,
        "PROMETHEUS_MULTIPROC_DIR": str(prom),
        "SIGPROP_RATE_LIMIT_COLD_SOLVES": "0",
        "SIGPROP_API_KEYS": KEY,
        "SIGPROP_ADMIN_KEYS": ADMIN_KEY,
    }
    svc = start_service(tmp_path, env, workers=2)
    clients = {}
    try:
        clients = _clients_by_worker(svc, prom)
        a, b = clients.values()
        assert a.post("/v1/solve", json=REQUEST).json()["cached"] is False
        for _ in range(3):  # both workers now hold the answer in memory
            assert a.post("/v1/solve", json=REQUEST).json()["cached"] is True
            assert b.post("/v1/solve", json=REQUEST).json()["cached"] is True
        key = a.post("/v1/solve", json=REQUEST).headers["x-sigprop-key"]
        for deleter, reader in ((a, b), (b, a)):
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            assert deleter.delete(f"/v1/solutions/{key}", headers=admin).status_code == 200
            # the other worker must not answer from its memory: it solves again
            assert reader.post("/v1/solve", json=REQUEST).json()["cached"] is False
            assert reader.post("/v1/solve", json=REQUEST).json()["cached"] is True
            assert deleter.post("/v1/solve", json=REQUEST).json()["cached"] is True
    finally:
        for c in clients.values():
            c.close()
        svc.stop()  # graceful: each worker writes its pending hit counts on the way out
    # the last record was stored by the second round's reader, then hit twice: hits of the
    # deleted records, still pending in either worker, are not added to it
    assert int(redis_client.hget(f"sigprop:sol:{key}", "hits")) == 2


# -- the app: hits from memory answer before routing, like the route ------------------------------


def _app(tmp_path, **settings):
    from sigprop.api.app import create_app
    from sigprop.settings import Settings

    return create_app(Settings(data_dir=tmp_path / "data", redis_url=SHARED_REDIS_URL, api_keys=KEY, **settings))


def test_hits_from_memory_answer_as_the_route_does(tmp_path, redis_client, monkeypatch):
    from fastapi.testclient import TestClient

    app = _app(tmp_path)
    with TestClient(app) as c:
        solutions = app.state.solutions
        served = []
        real = solutions.hot_hit
        monkeypatch.setattr(solutions, "hot_hit", lambda body: served.append(real(body)) or served[-1])
        assert c.post("/v1/solve", json=REQUEST).json()["cached"] is False

        def from_memory():
            routed = c.post("/v1/solve", json=REQUEST)  # read into memory by the route
            served.clear()
            fast = c.post("/v1/solve", json=REQUEST)
            assert served and served[-1] is not None  # answered by the middleware
            assert fast.content == routed.content
            assert [(k, v) for k, v in fast.headers.items() if k != "x-request-id"] == [
                (k, v) for k, v in routed.headers.items() if k != "x-request-id"
            ]
            assert fast.headers["x-request-id"] != routed.headers["x-request-id"]

        _undisturbed(app.state.cache.hot_answers(), from_memory)
        metrics = c.get("/metrics").text
        assert 'sigprop_requests_total{method="POST",route="/v1/solve",status="200"}' in metrics


def test_hits_need_the_key_when_reads_do(tmp_path, redis_client):
    from fastapi.testclient import TestClient

    app = _app(tmp_path, keys_for_reads=True)
    with TestClient(app) as c:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.post("/v1/solve", json=REQUEST, headers=auth).json()["cached"] is False
        for _ in range(3):
            assert c.post("/v1/solve", json=REQUEST, headers=auth).json()["cached"] is True
            assert c.post("/v1/solve", json=REQUEST).status_code == 401


def test_hits_from_memory_take_only_json(tmp_path, redis_client):
    """The JSON-only rule (415) holds for answers served from memory too: a cross-origin "simple"
    POST of a cached request is refused, not answered."""
    from fastapi.testclient import TestClient

    app = _app(tmp_path)
    with TestClient(app) as c:
        for _ in range(3):
            assert c.post("/v1/solve", json=REQUEST).status_code == 200
        body = json.dumps(REQUEST)
        for content_type in (None, "text/plain"):
            headers = {"content-type": content_type} if content_type else {}
            r = c.post("/v1/solve", content=body, headers=headers)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
            assert r.headers["x-content-type-options"] == "nosniff"


def test_hits_are_logged_at_debug_everything_else_at_info(tmp_path, redis_client):
    import logging

    from fastapi.testclient import TestClient

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.getMessage() == "request":
                lines.append((record.levelno, record.fields["route"], record.fields["status"]))

    app = _app(tmp_path, log_level="DEBUG")
    handler = Keep()
    logging.getLogger("sigprop").addHandler(handler)
    try:
        with TestClient(app) as c:
            for _ in range(4):
                c.post("/v1/solve", json=REQUEST)
            c.get("/healthz")
    finally:
        logging.getLogger("sigprop").removeHandler(handler)
    solve = [level for level, route, _ in lines if route == "/v1/solve"]
    assert solve == [logging.INFO] + [logging.DEBUG] * 3  # the cold solve, then three hits
    assert (logging.INFO, "/healthz", 200) in lines
