"""Keep-alive responses with several uvicorn workers come back without Nagle's 40 ms delay
(uvicorn binds the shared socket with protocol 0, so asyncio does not set TCP_NODELAY; sigprop's
protocol class sets it per connection: service/api/server.py)."""

import statistics
import time

from .service_fixtures import start_service


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
