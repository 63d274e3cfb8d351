"""The compose stack's reverse proxy (docker/nginx.conf; issue 26): it sheds slow clients, refuses
oversized bodies in the API's error shape, and replaces X-Forwarded-For so that the API, which
trusts the proxy, always counts a request against the address nginx saw.

With nginx installed (Debian's ``nginx-light``), the configuration is checked with ``nginx -t``
and run for real, in front of ``sigprop serve`` on loopback: the same file, with the upstream,
the listening address and the file paths pointed at this test's, and the slow-client timeouts
scaled down from 10 s and 15 s to 1 s so the test takes seconds. Without nginx these are skipped;
the file's settings are still checked against the API's."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from sigprop.settings import Settings

from ..inprocess import mlp
from ..service.test_slow_clients import PARTIAL_HEADERS, healthz_seconds, open_half_open, wait_all_closed
from ..service_fixtures import LOOPBACK, _stop_group, assert_error, free_port, start_service

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "docker" / "nginx.conf"


def directive(name: str) -> str:
    found = re.findall(rf"^\s*{name}\s+([^;]+);", NGINX_CONF.read_text(), re.M)
    assert len(found) == 1, (name, found)
    return found[0].strip()


def seconds(value: str) -> float:
    assert value.endswith("s"), value
    return float(value[:-1])


def test_the_proxy_settings_are_tighter_than_the_api_s():
    defaults = Settings.model_fields
    assert seconds(directive("client_header_timeout")) <= defaults["header_timeout_s"].default
    assert seconds(directive("client_body_timeout")) <= defaults["body_timeout_s"].default
    size = directive("client_max_body_size")
    assert size.endswith("m") and int(size[:-1]) * 1024 * 1024 >= defaults["max_body_bytes"].default
    assert directive("limit_conn") == "per_client 64" and directive("reset_timedout_connection") == "on"
    # the client's own X-Forwarded-For is replaced, never appended to
    assert directive("proxy_set_header X-Forwarded-For") == "$remote_addr"
    assert "proxy_add_x_forwarded_for" not in NGINX_CONF.read_text()
    assert directive("proxy_request_buffering") == "on"  # a stalled body never reaches the API
    assert seconds(directive("proxy_read_timeout")) > defaults["solve_timeout_s"].default
    # everything nginx writes is under /tmp (the container's tmpfs), and it never daemonizes itself
    assert directive("pid").startswith("/tmp/") and "daemon" not in NGINX_CONF.read_text()
    for temp in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        assert directive(f"{temp}_temp_path").startswith("/tmp/")


def nginx() -> str:
    exe = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if exe is None:
        pytest.skip("nginx is not installed (apt-get install nginx-light)")
    return exe


def local_conf(tmp_path: Path, upstream_port: int, port: int) -> Path:
    """docker/nginx.conf pointed at this test's API, port and folder, with 1 s client timeouts."""
    text = NGINX_CONF.read_text().replace(" /tmp/", f" {tmp_path}/")
    replacements = [
        ("server api:8000;", f"server {LOOPBACK}:{upstream_port};"),
        ("listen 8080;", f"listen {LOOPBACK}:{port};"),
        ("worker_processes auto;", "worker_processes 1;"),
        ("error_log /dev/stderr warn;", f"error_log {tmp_path}/error.log warn;"),
        ("client_header_timeout 10s;", "client_header_timeout 1s;"),
        ("client_body_timeout 15s;", "client_body_timeout 1s;"),
    ]
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    conf = tmp_path / "nginx.conf"
    conf.write_text(text)
    os.chmod(tmp_path, 0o777)  # nginx's worker may run as another user when this runs as root
    return conf


def test_nginx_accepts_the_configuration(tmp_path):
    conf = local_conf(tmp_path, 8000, free_port())
    proc = subprocess.run([nginx(), "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_nginx_in_front_of_the_api_sheds_slow_clients_and_names_the_client(tmp_path):
    exe = nginx()
    svc = start_service(
        tmp_path / "api",
        {
            "SIGPROP_DATA_DIR": str(tmp_path / "d"),
            "SIGPROP_SOLVE_PROCESSES": "0",
            "SIGPROP_TRUSTED_PROXIES": LOOPBACK,
            "SIGPROP_RATE_LIMIT_COLD_SOLVES": "2/minute",
        },
    )
    port = free_port()
    folder = tmp_path / "nginx"
    folder.mkdir()
    conf = local_conf(folder, svc.port, port)
    proxy = subprocess.Popen(
        [exe, "-p", str(folder), "-c", str(conf), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    conns: list[socket.socket] = []
    try:
        base = f"http://{LOOPBACK}:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.get(base + "/proxy-health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proxy.poll() is None, (folder / "error.log").read_text()
            time.sleep(0.05)
        with httpx.Client(base_url=base, timeout=30) as c:
            # every request counts against the address nginx saw, whatever the client claims
            codes = [
                c.post("/v1/solve", json=mlp(3, eta=0.1 + 0.01 * i), headers={"X-Forwarded-For": f"10.9.{i}.9"})
                for i in range(3)
            ]
            assert [r.status_code for r in codes] == [200, 200, 429], [r.text[:200] for r in codes]
            assert_error(codes[2], 429, "rate_limited")
            big = json.dumps({"pad": "x" * 2_200_000})
            assert_error(
                c.post("/v1/solve", content=big, headers={"content-type": "application/json"}), 413, "payload_too_large"
            )
        # slow clients: held by nginx, not by the API, and dropped at nginx's header deadline
        start = time.monotonic()
        conns = open_half_open(port, 300)
        # probes from another address: nginx allows one address 64 requests in flight, and the
        # stalled bodies above are in flight (their headers are in), so this one is at its limit
        assert all(healthz_seconds(port, source="127.0.0.2") < 1.0 for _ in range(3))
        left = wait_all_closed(conns, start + 8)
        print(
            f"\n300 half-open connections through nginx all closed after {time.monotonic() - start:.1f} s ({left} left)"
        )
        assert left == 0
        slow = socket.create_connection((LOOPBACK, port), timeout=5)
        slow.sendall(PARTIAL_HEADERS + b"Content-Length: 100\r\n\r\n{")  # a stalled body
        t0 = time.monotonic()
        assert wait_all_closed([slow], t0 + 5) == 0
        slow.close()
    finally:
        for s in conns:
            s.close()
        _stop_group(proxy)
        svc.stop()
