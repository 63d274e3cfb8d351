"""Bounded connections everywhere (issue 35), against ``sigprop serve`` itself: no ``Server``
banner and ``nosniff`` on the wire; a header block over ``SIGPROP_MAX_HEADER_BYTES`` gets 431 and
a closed connection, not a parser buffering it; the metrics port has the API's header deadline and
connection cap (it had none: 1,000 half-open connections grew its server to 997 threads)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from ..service_fixtures import LOOPBACK, free_port, running_service


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    env = {
        "SIGPROP_METRICS_PORT": str(free_port()),
        "SIGPROP_HEADER_TIMEOUT_S": "1",
        "SIGPROP_MAX_CONNECTIONS": "32",
        "SIGPROP_MAX_HEADER_BYTES": "16384",
    }
    with running_service(tmp_path_factory.mktemp("bounds"), env) as s:
        yield s


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _read_all(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def _closed(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout_s`` having sent nothing."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_no_server_banner_and_nosniff(svc):
    r = httpx.get(f"{svc.base_url}/healthz")
    assert "server" not in r.headers, r.headers
    assert r.headers["x-content-type-options"] == "nosniff"


def test_a_header_block_over_the_limit_gets_431(svc):
    with socket.create_connection((LOOPBACK, svc.port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(64):  # 1 MiB of headers in 16 KiB pieces, never ending
                s.sendall(b"X-Filler: " + b"a" * 16_000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _read_all(s, 5)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    assert httpx.get(f"{svc.base_url}/healthz").status_code == 200  # the server is unharmed
    # a header block within the limit is answered as before
    assert httpx.get(f"{svc.base_url}/healthz", headers={"x-filler": "a" * 8000}).status_code == 200


def test_the_metrics_port_has_the_apis_deadline_and_cap(svc):
    metrics = f"http://{LOOPBACK}:{svc.env['SIGPROP_METRICS_PORT']}/metrics"
    assert httpx.get(metrics).status_code == 200
    before = _threads(svc.proc.pid)
    half_open = []
    for _ in range(100):
        s = socket.create_connection((LOOPBACK, int(svc.env["SIGPROP_METRICS_PORT"])), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        half_open.append(s)
    try:
        time.sleep(0.5)
        # no thread per connection, and a scrape still answers past the cap (32)
        assert _threads(svc.proc.pid) <= before + 4, (before, _threads(svc.proc.pid))
        assert httpx.get(metrics, timeout=5).status_code == 200
        # the header deadline (1 s) closes every one of them, without an answer
        deadline = time.monotonic() + 5
        for s in half_open:
            assert _closed(s, max(0.1, deadline - time.monotonic())), "a half-open connection left open"
    finally:
        for s in half_open:
            s.close()
