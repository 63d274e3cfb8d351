"""Latency and limits of the running service: no Nagle delay with several workers (uvicorn binds
the shared socket with protocol 0, so asyncio does not set TCP_NODELAY; sigprop's protocol class
sets it per connection: service/api/server.py), and the solve timeout."""

import statistics
import time

from ..service_fixtures import start_service


def test_keep_alive_requests_with_two_workers_are_not_delayed(tmp_path):
    svc = start_service(tmp_path, {"SIGPROP_DATA_DIR": str(tmp_path / "data")}, workers=2)
    try:
        with svc.client() as client:
            client.get("/healthz")
            times = []
            for _ in range(30):
                start = time.perf_counter()
                assert client.get("/healthz").status_code == 200
                times.append(time.perf_counter() - start)
        # Nagle plus a delayed ACK costs ~40 ms per response; without it a loopback round trip is ~1 ms.
        assert statistics.median(times) < 0.015, statistics.median(times)
    finally:
        svc.stop()


def test_a_solve_past_the_timeout_answers_503_and_the_server_keeps_serving(tmp_path):
    # depth 20000 is past the default SIGPROP_MAX_DEPTH (10000) and its 80,000 nodes + edges past the
    # default SIGPROP_MAX_SOLVE_COST (50000): both raised here, this test wants a slow solve
    svc = start_service(
        tmp_path,
        {
            "SIGPROP_DATA_DIR": str(tmp_path / "data"),
            "SIGPROP_SOLVE_TIMEOUT_S": "0.05",
            "SIGPROP_MAX_DEPTH": "20000",
            "SIGPROP_MAX_SOLVE_COST": "200000",
        },
    )
    try:
        with svc.client(timeout=30) as client:
            slow = {
                "graph": {"template": "mlp", "depth": 20000, "width": 8},
                "method": "tat",
                "activation": "softplus",
                "targets": {"tau": 0.3},
            }
            r = client.post("/v1/solve", json=slow)
            assert r.status_code == 503
            err = r.json()["error"]
            assert err["code"] == "solve_timeout" and err["hint"]
            assert client.get("/healthz").status_code == 200
            quick = {"graph": {"template": "mlp", "depth": 3, "width": 8}, "method": "eoc", "activation": "relu"}
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # the pool is shared with the abandoned solve; it finishes
                r = client.post("/v1/solve", json=quick)
                if r.status_code == 200:
                    break
                time.sleep(0.2)
            assert r.status_code == 200 and r.json()["sigma_w2"] == 2.0
    finally:
        svc.stop()
