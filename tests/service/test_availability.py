"""Staying up under expensive valid requests: cold solves in processes that are killed at their
timeout, admission before work (cost budget, rate limit, bounded memo), client identity behind
proxies, a closed set of method labels, and cache hits that stay fast while cold solves run
(over real HTTP, 2 workers on Redis)."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

import httpx
import pytest

from sigprop.api.admission import BodyMemo, graph_cost
from sigprop.api.coldpool import SolverPool, solve_request
from sigprop.errors import SigpropError

from ..inprocess import app_client, mlp
from ..service_fixtures import SHARED_REDIS_URL, flush_shared_redis, start_service

SOLVE = "/v1/solve"


def ladder(blocks: int, width: int = 8) -> dict:
    """K blocks of dense -> activation -> sum(network input, activation): one node feeds every sum."""
    nodes = [{"id": "input", "op": "input", "shape": [width]}]
    x = "input"
    for i in range(blocks):
        nodes += [
            {"id": f"d{i}", "op": "dense", "inputs": [x], "units": width},
            {"id": f"a{i}", "op": "activation", "inputs": [f"d{i}"]},
            {"id": f"s{i}", "op": "sum", "inputs": ["input", f"a{i}"]},
        ]
        x = f"s{i}"
    nodes.append({"id": "output", "op": "output", "inputs": [x]})
    return {"schema": "sigprop.graph/v1", "nodes": nodes}


def ladder_request(blocks: int, eta: float = 0.3) -> dict:
    # "warn": the sums add the network input to post-activation features, outside the kernel theory
    # (refused by default); these requests stand for long, valid solves
    return {
        "graph": ladder(blocks),
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": eta},
        "assumptions": "warn",
    }


# -- cold solves that can be stopped ---------------------------------------------------------------


def test_a_solve_past_its_timeout_is_killed_and_its_cpu_freed():
    pool = SolverPool(1)
    try:
        pool.warm()
        start = time.monotonic()
        with pytest.raises(SigpropError) as info:
            pool.call(solve_request, (ladder_request(10_000),), 0.5)  # seconds of work
        assert info.value.code == "solve_timeout" and info.value.status == 503
        pid = pool.last_killed_pid
        assert pid is not None
        while os.path.exists(f"/proc/{pid}") and time.monotonic() - start < 5:
            time.sleep(0.01)
        freed = time.monotonic() - start - 0.5
        assert not os.path.exists(f"/proc/{pid}"), "the killed solver process is still there"
        # a pool process outlives its jobs, so its being gone means it was killed; how soon is a
        # scheduling matter on a loaded machine (2.2 s seen with load 8 on 2 cores), and the kill's
        # latency is what the line below prints (129 ms on a lightly loaded machine)
        assert freed < 3.0, f"CPU freed {freed:.3f} s after the deadline"
        print(f"\nsolver process gone {freed * 1000:.0f} ms after the deadline")
        # and the pool keeps serving
        small = {"graph": {"template": "mlp", "depth": 3, "width": 8}, "method": "eoc", "activation": "relu"}
        assert json.loads(pool.call(solve_request, (small,), 20))["sigma_w2"] == 2.0
    finally:
        pool.shutdown()


def test_an_engine_error_in_a_solver_process_keeps_the_contract_shape():
    pool = SolverPool(1)
    try:
        with pytest.raises(SigpropError) as info:
            pool.call(solve_request, (ladder_request(5, eta=0.99),), 20)
        assert info.value.code == "unreachable_target" and info.value.hint
    finally:
        pool.shutdown()


# -- admission ---------------------------------------------------------------------------------------


def test_cost_is_known_before_building():
    assert graph_cost(ladder(3)) == (11, 3 * 4 + 1)
    densenet = {"template": "densenet", "depth": 4870, "growth_rate": 1, "input_shape": [1, 4, 4]}
    assert graph_cost(densenet) == (12177, 999974)


def test_over_budget_requests_are_refused_fast_with_the_setting_in_the_hint(tmp_path):
    densenet = {"template": "densenet", "depth": 4870, "growth_rate": 1, "input_shape": [1, 4, 4]}
    with app_client(tmp_path) as c:
        for graph in (ladder(10_000), densenet):
            body = json.dumps({**ladder_request(1), "graph": graph}).encode()
            times = []
            for _ in range(3):
                t = time.perf_counter()
                r = c.post(SOLVE, content=body, headers={"content-type": "application/json"})
                times.append(time.perf_counter() - t)
                assert r.status_code == 413, r.text[:300]
                err = r.json()["error"]
                assert err["code"] == "graph_too_large" and "SIGPROP_MAX_SOLVE_COST" in err["hint"]
            print(f"\nrefused in {min(times) * 1000:.1f} ms ({len(body)} bytes)")
            # built or solved, these take seconds to minutes; the 50 ms goal is bench/solve_bench.py's
            # to measure on a quiet machine, this only shows that no work was done
            assert min(times) < 0.5, times
        r = c.get("/v1/templates/densenet?depth=4870&growth_rate=1&input_shape=[1,4,4]")
        assert r.status_code == 413 and "SIGPROP_MAX_SOLVE_COST" in r.json()["error"]["hint"]


def test_a_client_over_its_cold_limit_gets_429_before_a_large_graph_is_parsed(tmp_path, monkeypatch):
    from sigprop.api import solutions

    parsed = []
    real = solutions.load_json
    monkeypatch.setattr(solutions, "load_json", lambda *a, **k: parsed.append(1) or real(*a, **k))
    with app_client(tmp_path, rate_limit_cold_solves="2/minute") as c:
        for eta in (0.1, 0.2):
            assert c.post(SOLVE, json=mlp(3, eta=eta)).status_code == 200
        n = len(parsed)
        big = json.dumps(ladder_request(1000)).encode()  # 176 KB: parsed and built in a solver process
        t = time.perf_counter()
        r = c.post(SOLVE, content=big, headers={"content-type": "application/json"})
        elapsed = time.perf_counter() - t
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        assert len(parsed) == n, "the body was parsed for a client already over its limit"
        print(f"\n429 for a {len(big)}-byte body in {elapsed * 1000:.1f} ms")
        assert c.post(SOLVE, json=mlp(3, eta=0.1)).status_code == 200  # a hit is never limited


def test_the_body_memo_is_bounded_in_bytes():
    from sigprop.api.solutions import _Parsed

    memo = BodyMemo(100_000)
    for i in range(1000):
        memo.put(i.to_bytes(4, "big"), _Parsed("k" * 64, tuple(f"node-{i}-{j}" for j in range(50)), ()))
    assert memo.bytes <= 100_000 and 0 < len(memo) < 1000
    assert memo.get((999).to_bytes(4, "big")) is not None and memo.get((0).to_bytes(4, "big")) is None


# -- identity and metric labels ----------------------------------------------------------------------


def test_junk_methods_get_405_and_no_new_metric_labels(tmp_path):
    with app_client(tmp_path) as c:
        c.request("JUNK", "/v1/solve")  # the 405's and /metrics' own series exist before the count starts
        c.get("/metrics")
        before = c.get("/metrics").text
        for i in range(300):
            r = c.request(f"JUNK{i}", "/v1/solve")
            assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        text = c.get("/metrics").text
        # the registry is the process's: what earlier tests left in it is not this test's business,
        # but 300 new method names must add no series (a few bytes for the counts' digits at most)
        assert len(text.encode()) - len(before.encode()) < 1_000, (len(before), len(text))
        assert "JUNK" not in text


@pytest.fixture
def redis_db():
    flush_shared_redis()
    yield SHARED_REDIS_URL
    flush_shared_redis()


def test_rotating_x_forwarded_for_does_not_escape_the_limit(tmp_path, redis_db):
    svc = start_service(
        tmp_path,
        {
            "SIGPROP_REDIS_URL": redis_db,
            "SIGPROP_DATA_DIR": str(tmp_path / "d"),
            "SIGPROP_RATE_LIMIT_COLD_SOLVES": "5/minute",
        },
    )
    try:
        with svc.client() as c:
            codes = [
                c.post(
                    SOLVE,
                    json=mlp(3, eta=0.05 + 0.01 * i),
                    headers={"X-Forwarded-For": f"10.0.{i}.1", "Forwarded": f"for=10.1.{i}.1"},
                ).status_code
                for i in range(10)
            ]
        assert codes.count(200) == 5 and codes.count(429) == 5, codes
    finally:
        svc.stop()


def test_a_trusted_proxy_names_the_client(tmp_path, redis_db):
    svc = start_service(
        tmp_path,
        {
            "SIGPROP_REDIS_URL": redis_db,
            "SIGPROP_DATA_DIR": str(tmp_path / "d"),
            "SIGPROP_RATE_LIMIT_COLD_SOLVES": "2/minute",
            "SIGPROP_TRUSTED_PROXIES": "127.0.0.1",
        },
    )
    try:
        with svc.client() as c:
            codes = [
                c.post(
                    SOLVE, json=mlp(3, eta=0.05 + 0.01 * i), headers={"X-Forwarded-For": f"10.0.{i // 2}.1"}
                ).status_code
                for i in range(6)
            ]
        assert codes == [200] * 6, codes  # two per forwarded client, each within its own limit
    finally:
        svc.stop()


# -- the "done when": hits and probes while 8 expensive cold solves run --------------------


@pytest.mark.slow  # a latency measurement: it needs the machine to itself (run with -m slow)
def test_cache_hits_and_readyz_stay_fast_while_eight_expensive_cold_solves_run(tmp_path, redis_db):
    svc = start_service(
        tmp_path,
        {
            "SIGPROP_REDIS_URL": redis_db,
            "SIGPROP_DATA_DIR": str(tmp_path / "d"),
            "SIGPROP_SOLVE_TIMEOUT_S": "5",
            "SIGPROP_RATE_LIMIT_COLD_SOLVES": "0",
        },
        workers=2,
    )
    try:
        hit = mlp(3, eta=0.4)
        with svc.client() as c:
            for _ in range(6):  # cached, and in both workers' memos
                assert c.post(SOLVE, json=hit).status_code == 200
        with svc.client() as c:  # the same loop with nothing else running, for comparison
            idle = []
            for _ in range(100):
                t0 = time.perf_counter()
                assert c.post(SOLVE, json=hit).status_code == 200
                idle.append(time.perf_counter() - t0)
        cold_codes: list[int] = []
        # serialized up front: this process's own JSON work must not hold the GIL the timing loop needs
        bodies = [json.dumps(ladder_request(3000, eta=0.2 + 0.01 * i)).encode() for i in range(8)]

        # one client for the eight threads, built before the timing: httpx builds an SSL context per
        # client (even for http), tens of milliseconds of this process's GIL each on a slow VM
        senders = httpx.Client(base_url=svc.base_url, timeout=30, limits=httpx.Limits(max_connections=8))

        def cold(i: int) -> None:
            r = senders.post(SOLVE, content=bodies[i], headers={"content-type": "application/json"})
            cold_codes.append(r.status_code)

        threads = [threading.Thread(target=cold, args=(i,)) for i in range(8)]
        hits, probes = [], []
        with svc.client(timeout=10) as c, senders:
            for t in threads:
                t.start()
            time.sleep(0.5)  # the cold solves are in flight
            while any(t.is_alive() for t in threads) and len(hits) < 400:
                t0 = time.perf_counter()
                r = c.post(SOLVE, json=hit)
                hits.append(time.perf_counter() - t0)
                assert r.status_code == 200 and r.json()["cached"] is True, r.text[:200]
                if len(hits) % 10 == 0:
                    t0 = time.perf_counter()
                    assert c.get("/readyz").status_code == 200
                    probes.append(time.perf_counter() - t0)
            for t in threads:
                t.join(60)
        p99 = statistics.quantiles(hits, n=100)[98] if len(hits) >= 2 else hits[0]
        print(
            f"\n{len(hits)} hits during the cold solves: median {statistics.median(hits) * 1000:.1f} ms, "
            f"p99 {p99 * 1000:.1f} ms; /readyz max {max(probes) * 1000:.1f} ms; cold answers {sorted(cold_codes)}; "
            f"idle: median {statistics.median(idle) * 1000:.1f} ms, "
            f"p99 {statistics.quantiles(idle, n=100)[98] * 1000:.1f} ms"
        )
        assert len(hits) >= 20
        assert p99 < 0.05, p99
        assert max(probes) < 0.1, probes
        assert set(cold_codes) <= {200, 503}, cold_codes
    finally:
        svc.stop()
