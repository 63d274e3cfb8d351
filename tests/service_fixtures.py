"""Helpers for the end-to-end service tests: real `sigprop serve` processes and real Redis servers.

Everything listens on 127.0.0.1 only. Every process is started in its own session (process group),
so stopping it also stops whatever it spawned (uvicorn's worker processes), and is stopped with
SIGTERM, then SIGKILL if it does not exit in time. Callers own the objects these helpers return and
must call ``stop()`` (the test modules do so in fixture finalizers).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

LOOPBACK = "127.0.0.1"


def _test_redis_url() -> str:
    """The machine's shared Redis, with a database of its own for these tests: db 14, or the one
    SIGPROP_TEST_REDIS_URL names (so two checkouts can run their suites at once without flushing
    each other). Under ``pytest -n N`` worker k takes the database k after it (mod 16: 14 and 15
    for the suite's two workers), as every worker flushes its own."""
    url = os.environ.get("SIGPROP_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ... under pytest-xdist
    base, _, db = url.rpartition("/")
    if worker.startswith("gw") and worker[2:].isdigit() and db.isdigit():
        url = f"{base}/{(int(db) + int(worker[2:])) % 16}"
    return url


SHARED_REDIS_URL = _test_redis_url()
SERVER_START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

# Serialized answers differ in exactly this field between a fresh solve and a cache hit.
_CACHED = re.compile(r'"cached":(true|false)')


# -- small utilities ----------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def strip_cached(body: str | bytes) -> str:
    """The answer text with its one ``"cached":...`` field blanked out (asserts there is exactly one)."""
    text = body.decode() if isinstance(body, bytes) else body
    blanked, n = _CACHED.subn('"cached":_', text)
    assert n == 1, f"expected exactly one top-level 'cached' field, found {n}"
    return blanked


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    """The contract's error shape: exactly {"error": {"code", "message", "hint"}}, strings, no 5xx."""
    assert response.status_code < 500, f"5xx for a rejected request: {response.status_code} {response.text[:500]}"
    assert response.status_code == status, (
        f"expected {status} {code}, got {response.status_code}: {response.text[:500]}"
    )
    assert response.headers["content-type"].startswith("application/json"), response.headers["content-type"]
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"code", "message", "hint"}, err
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["hint"], str), err
    return err


def _stop_group(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the process group we created for ``proc``; SIGKILL it if it does not exit in time."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # Children of the leader (uvicorn workers) may outlive it: make sure the whole group is gone.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process immune to SIGKILL
        pass


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no log>"


# -- the sigprop service ------------------------------------------------------------------------


def service_env(overrides: dict[str, str | None]) -> dict[str, str]:
    """The environment for a server: ours minus any SIGPROP_* / multiprocess-metrics settings, plus
    ``overrides`` (a value of None removes the variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIGPROP_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


@dataclass
class Service:
    proc: subprocess.Popen
    port: int
    log_path: Path
    env: dict[str, str]
    workers: int
    clients: list[httpx.Client] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def client(self, **kwargs) -> httpx.Client:
        """An httpx client for this server (closed by ``stop``)."""
        kwargs.setdefault("timeout", 30.0)
        c = httpx.Client(base_url=self.base_url, **kwargs)
        self.clients.append(c)
        return c

    def log(self) -> str:
        return _tail(self.log_path)

    def wait_ready(self, timeout_s: float = SERVER_START_TIMEOUT_S, path: str = "/readyz") -> float:
        """Poll ``path`` until it answers 200; return the seconds it took."""
        return _wait_http(self, path, timeout_s)

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()
        _stop_group(self.proc)


def _wait_http(svc: Service, path: str, timeout_s: float) -> float:
    start = time.monotonic()
    deadline = start + timeout_s
    last = "no answer yet"
    with httpx.Client(base_url=svc.base_url, timeout=2.0) as c:
        while True:
            if svc.proc.poll() is not None:
                raise RuntimeError(
                    f"sigprop serve exited with {svc.proc.returncode} before {path} answered 200:\n{svc.log()}"
                )
            try:
                r = c.get(path)
                if r.status_code == 200:
                    return time.monotonic() - start
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.TransportError as exc:
                last = repr(exc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not answer 200 within {timeout_s:g} s (last: {last}):\n{svc.log()}")
            time.sleep(0.05)


def start_service(
    tmp_dir: Path,
    env: dict[str, str | None],
    workers: int = 1,
    ready: bool = True,
    timeout_s: float = SERVER_START_TIMEOUT_S,
    attempts: int = 3,
    cli: str = "sigprop.cli",
) -> Service:
    """Start ``python -m sigprop.cli serve`` on a free loopback port and wait for /healthz (and
    /readyz when ``ready``). ``env`` overrides go on top of a SIGPROP_*-free copy of ours; ``cli``
    is the module run (``tests.fake_sigprop``: the same command with the sleep-only trainer).
    A start that loses its port to another process (the port is picked before the bind) is retried."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    full_env = service_env(env)
    last_error: Exception | None = None
    for _attempt in range(attempts):
        port = free_port()
        log_path = tmp_dir / f"sigprop-serve-{port}.log"
        log = open(log_path, "wb")
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    cli,
                    "serve",
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(port),
                    "--workers",
                    str(workers),
                ],
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        svc = Service(proc, port, log_path, full_env, workers)
        try:
            _wait_http(svc, "/healthz", timeout_s)
            if ready:
                _wait_http(svc, "/readyz", timeout_s)
            return svc
        except BaseException as exc:
            svc.stop()
            last_error = exc
            if isinstance(exc, RuntimeError) and "address already in use" in svc.log().lower():
                continue  # lost the port race: try another port
            raise
    raise RuntimeError(f"could not start sigprop serve after {attempts} attempts") from last_error


# -- Redis --------------------------------------------------------------------------------------


@contextlib.contextmanager
def running_service(tmp_dir: Path, env: dict[str, str | None] | None = None, **kwargs) -> Iterator[Service]:
    """The server most test modules start: ``sigprop serve`` on the embedded store in ``tmp_dir``
    (no Redis unless ``env`` names one), ``env`` on top, stopped on exit; ``kwargs`` go to
    :func:`start_service`."""
    svc = start_service(
        tmp_dir, {"SIGPROP_REDIS_URL": None, "SIGPROP_DATA_DIR": str(tmp_dir / "data"), **(env or {})}, **kwargs
    )
    try:
        yield svc
    finally:
        svc.stop()


def shared_redis_or_skip(url: str = SHARED_REDIS_URL):
    """A client for the shared Redis database the tests use, or skip the test if there is no Redis."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        client.close()
        pytest.skip(f"no Redis at {url}: {exc}")
    return client


def flush_shared_redis(url: str = SHARED_REDIS_URL) -> None:
    """Empty only the tests' own database (FLUSHDB on db 14, never FLUSHALL)."""
    client = shared_redis_or_skip(url)
    try:
        client.flushdb()
    finally:
        client.close()


@dataclass
class RedisServer:
    proc: subprocess.Popen
    port: int
    workdir: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def ping(self) -> bool:
        import redis

        c = redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(c.ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False
        finally:
            c.close()

    def stop(self) -> None:
        """SIGTERM and wait: the port is free again once this returns."""
        _stop_group(self.proc)


def start_redis(
    workdir: Path, port: int | None = None, timeout_s: float = 10.0, persist: bool = False, extra: tuple = ()
) -> RedisServer:
    """A private ``redis-server`` on a spare loopback port that keeps nothing on disk, or with
    ``persist`` an append-only file in ``workdir`` synced on every write (as docker-compose runs
    it), so a server killed and started again on the same ``workdir`` and port has every
    acknowledged write. ``extra``: more of its options (later ones win: ``--appendonly yes``)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log_path = workdir / f"redis-{port}.log"
    durability = ["--appendonly", "yes", "--appendfsync", "always"] if persist else ["--appendonly", "no"]
    log = open(log_path, "ab")
    try:
        proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(port),
                "--bind",
                LOOPBACK,
                "--save",
                "",
                *durability,
                "--dir",
                str(workdir),
                "--daemonize",
                "no",
                "--logfile",
                "",
                *extra,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()
    server = RedisServer(proc, port, workdir, log_path)
    deadline = time.monotonic() + timeout_s
    while not server.ping():
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"redis-server on port {port} did not start:\n{_tail(log_path)}")
        time.sleep(0.02)
    return server


# -- metrics ------------------------------------------------------------------------------------


def metric_value(metrics_text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample in Prometheus text format, or None if absent (labels must match exactly)."""
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if got == (labels or {}):
            return float(m.group(4))
    return None


def requests_by_pid(prom_dir: Path) -> dict[int, float]:
    """sigprop_requests_total per worker process, read from prometheus_client's multiprocess files.
    Lets a test see which uvicorn worker answered on a connection."""
    from prometheus_client.mmap_dict import MmapedDict

    out: dict[int, float] = {}
    for path in prom_dir.glob("counter_*.db"):
        pid = int(path.stem.split("_")[-1])
        for attempt in range(50):
            try:  # a worker may be creating the file right now: retry until it is readable
                values = list(MmapedDict.read_all_values_from_file(str(path)))
                break
            except (struct.error, ValueError, OSError):
                if attempt == 49:
                    raise
                time.sleep(0.01)
        out[pid] = sum(value for key, value, *_ in values if json.loads(key)[1] == "sigprop_requests_total")
    return out
