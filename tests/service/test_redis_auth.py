"""Redis credentials: ``SIGPROP_REDIS_PASSWORD`` / ``SIGPROP_REDIS_USERNAME`` (or credentials in the
URL, ``rediss://`` for TLS) reach every Redis client: the API's cache and validation queue, its
rate limiter, and ``sigprop worker`` (its jobs and its ``--check``). Against a private Redis that
requires a password."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from sigprop.redis_url import redacted, with_credentials
from sigprop.settings import Settings

from ..inprocess import KEY_ONE, app_client, bearer, mlp, validation
from ..service_fixtures import _stop_group, _tail, service_env, start_redis

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "p@ss:w/rd with spaces-0123456789"


def test_credentials_are_merged_into_the_url():
    s = Settings(redis_url="redis://redis:6379/0", redis_password=PASSWORD)
    assert redis.Redis.from_url(s.redis_url).connection_pool.connection_kwargs["password"] == PASSWORD
    s = Settings(redis_url="rediss://cache:6380/2?ssl_cert_reqs=required", redis_username="sigprop", redis_password="x")
    assert s.redis_url == "rediss://sigprop:x@cache:6380/2?ssl_cert_reqs=required"
    pool = redis.Redis.from_url(s.redis_url).connection_pool
    assert pool.connection_class is redis.SSLConnection and pool.connection_kwargs["username"] == "sigprop"
    assert with_credentials("redis://u:own@h/0", "other", "other") == "redis://u:own@h/0"  # the URL's own win
    assert Settings(redis_url="redis://h/0").redis_url == "redis://h/0"
    assert PASSWORD not in repr(Settings(redis_password=PASSWORD, data_dir="/tmp"))
    assert redacted(s.redis_url) == "rediss://sigprop:***@cache:6380/2?ssl_cert_reqs=required"


@pytest.fixture
def locked_redis(tmp_path):
    server = start_redis(tmp_path / "redis")
    redis.Redis(port=server.port).config_set("requirepass", PASSWORD)
    yield server
    server.stop()


def _authed(server) -> redis.Redis:
    return redis.Redis(port=server.port, password=PASSWORD)


def test_the_api_uses_the_password_everywhere(locked_redis, tmp_path):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=locked_redis.port).ping()
    with app_client(tmp_path / "open", redis_url=locked_redis.url) as c:  # no password: not ready
        assert c.get("/readyz").status_code == 503
    with app_client(
        tmp_path / "app", redis_url=locked_redis.url, redis_password=PASSWORD, rate_limit_cold_solves="1000/minute"
    ) as c:
        assert c.get("/readyz").status_code == 200
        assert c.post("/v1/solve", json=mlp(eta=0.31)).status_code == 200
        r = c.post("/v1/validations", headers=bearer(KEY_ONE), json=validation())
        assert r.status_code == 202, r.text
        assert c.get(f"/v1/validations/{r.json()['id']}", headers=bearer(KEY_ONE)).json()["status"] == "queued"
    keys = {k.decode() for k in _authed(locked_redis).keys("*")}
    assert any(k.startswith("sigprop-ratelimit") for k in keys), keys  # the limiter counted in Redis
    assert "rq:queue:sigprop-validations" in keys, keys  # the job is on the queue


def test_the_worker_and_its_check_use_the_password(locked_redis, tmp_path):
    env = service_env(
        {"SIGPROP_REDIS_URL": locked_redis.url, "SIGPROP_REDIS_PASSWORD": PASSWORD, "PYTHONPATH": str(ROOT)}
    )
    check = [sys.executable, "-m", "sigprop.cli", "worker", "--check"]
    proc = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no worker of host" in proc.stderr, proc.stderr  # none running yet
    wrong = subprocess.run(
        check, env={**env, "SIGPROP_REDIS_PASSWORD": "wrong"}, capture_output=True, text=True, timeout=60
    )
    assert (
        wrong.returncode == 1
        and "Redis does not answer" in wrong.stderr
        and "wrong" not in wrong.stderr.split("Redis does not answer")[0]
    )
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "tests.fake_sigprop", "worker"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            proc = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60)
            if proc.returncode == 0:
                break
            assert worker.poll() is None and time.monotonic() < deadline, _tail(log_path)
            time.sleep(0.5)
        assert "worker(s) of host" in proc.stdout and PASSWORD not in proc.stdout + proc.stderr
    finally:
        _stop_group(worker)
    assert PASSWORD not in _tail(log_path, 100_000)
