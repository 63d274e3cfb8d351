"""The app as ``uvicorn --factory sigprop.api.app:create_app`` builds it, not through ``sigprop
serve``: the same key check (a guessable key refuses to start) and the same trust of
``X-Forwarded-For`` (only from SIGPROP_TRUSTED_PROXIES, or uvicorn's own setting when the operator
set it; never from loopback by default, or a local client could name any address and multiply its
rate limits).

Most checks run uvicorn's own ``Config.load`` in-process (it calls the factory, then decides
whether to wrap the app in its proxy-headers middleware); two start a real uvicorn.
"""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import uvicorn
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from sigprop.settings import get_settings

from ..inprocess import KEYS, app_client, eoc
from ..service_fixtures import LOOPBACK, Service, _stop_group, _wait_http, free_port, service_env

FACTORY = "sigprop.api.app:create_app"


@pytest.fixture
def sigprop_env(monkeypatch, tmp_path):
    """SIGPROP_* settings for a factory call (``get_settings`` reads them once: cleared around)."""
    monkeypatch.setenv("SIGPROP_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SIGPROP_API_KEYS", KEYS)
    monkeypatch.delenv("SIGPROP_REDIS_URL", raising=False)
    monkeypatch.delenv("SIGPROP_TRUSTED_PROXIES", raising=False)
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


def _loaded(**options) -> uvicorn.Config:
    config = uvicorn.Config(FACTORY, factory=True, **options)
    config.load()
    return config


def test_factory_ignores_forwarded_headers_by_default(sigprop_env):
    config = _loaded()  # uvicorn's defaults: proxy_headers=True, forwarded_allow_ips from loopback
    assert config.proxy_headers is False
    assert not isinstance(config.loaded_app, ProxyHeadersMiddleware)


def test_factory_trusts_the_configured_proxies(sigprop_env):
    sigprop_env.setenv("SIGPROP_TRUSTED_PROXIES", " 10.0.0.5 , 192.168.0.0/16 ")
    config = _loaded()
    assert config.proxy_headers is True and config.forwarded_allow_ips == "10.0.0.5,192.168.0.0/16"
    assert isinstance(config.loaded_app, ProxyHeadersMiddleware)


def test_factory_keeps_uvicorns_own_setting_when_the_operator_chose_it(sigprop_env):
    config = _loaded(forwarded_allow_ips="10.1.2.3")  # uvicorn --forwarded-allow-ips 10.1.2.3
    assert config.proxy_headers is True and config.forwarded_allow_ips == "10.1.2.3"
    sigprop_env.setenv("FORWARDED_ALLOW_IPS", "127.0.0.1")  # the same through uvicorn's variable
    assert _loaded().proxy_headers is True
    assert _loaded(proxy_headers=False).proxy_headers is False  # --no-proxy-headers stays off


def _uvicorn(tmp_path, env: dict) -> Service:
    port = free_port()
    log_path = tmp_path / f"uvicorn-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", FACTORY, "--host", LOOPBACK, "--port", str(port)],
            env=service_env(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Service(proc, port, log_path, env, 1)


def test_uvicorn_factory_refuses_a_low_entropy_key(tmp_path):
    svc = _uvicorn(tmp_path, {"SIGPROP_API_KEYS": "passwordpassword", "SIGPROP_DATA_DIR": str(tmp_path / "d")})
    try:
        assert svc.proc.wait(timeout=60) != 0
        log = svc.log()
        assert "SIGPROP_API_KEYS: key 1 of 1 has only 7 distinct characters" in log, log
        assert "passwordpassword" not in log
    finally:
        _stop_group(svc.proc)


def test_uvicorn_factory_counts_a_local_client_by_its_address(tmp_path):
    """Three cold solves from loopback, each naming another X-Forwarded-For: one budget, not three."""
    env = {
        "SIGPROP_API_KEYS": KEYS,
        "SIGPROP_DATA_DIR": str(tmp_path / "data"),
        "SIGPROP_RATE_LIMIT_COLD_SOLVES": "2/minute",
    }
    svc = _uvicorn(tmp_path, env)
    try:
        _wait_http(svc, "/readyz", 60)
        c = svc.client()
        codes = [
            c.post("/v1/solve", json=eoc(1.0 + i / 10), headers={"X-Forwarded-For": f"203.0.113.{i}"}).status_code
            for i in range(3)
        ]
        assert codes == [200, 200, 429], (codes, svc.log())
    finally:
        svc.stop()


def test_the_app_freezes_its_start_up_heap_while_it_runs_and_unfreezes_it_at_shutdown(tmp_path):
    # a full collection of the unfrozen heap held the event loop for 60-70 ms (bench/README.md)
    before = gc.get_freeze_count()
    with app_client(tmp_path) as client:
        assert client.get("/healthz").status_code == 200
        assert gc.get_freeze_count() > before + 10_000  # the engine, FastAPI, pydantic: all of it
    assert gc.get_freeze_count() == 0
