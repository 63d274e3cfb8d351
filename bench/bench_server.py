"""``sigprop serve`` for the HTTP benchmarks: starting and stopping it on a free loopback port,
requests to it, its cache counters, and the Redis database it uses.

Imported by ``bench/http_bench.py`` and ``bench/load_test.py`` (bench/ is the script's folder on
sys.path).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# the bare app's route: FastAPI reads the annotation by name (this module has postponed annotations)
from fastapi import Request as _Request
from fastapi import Response

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# No proxies, whatever the environment says: every request here goes to our own loopback server.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, body: dict | None = None, timeout: float = 30.0):
    """(status, headers, parsed JSON body) for a loopback request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


class Server:
    """``sigprop serve`` in its own process group, so stopping it stops its workers too."""

    def __init__(self, workers: int, redis_url: str | None, log_path: Path):
        """``redis_url`` None: the embedded store (SQLite), in a folder beside ``log_path``."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        # serve would make its own prometheus folder for several workers and leave it behind: give
        # it one inside our temporary folder, removed with it.
        metrics_dir = log_path.parent / "metrics"
        metrics_dir.mkdir(exist_ok=True)
        # wrk's connections all come from one address: the per-client cold-solve limit is off here
        env = {
            **os.environ,
            "SIGPROP_REDIS_URL": redis_url or "",
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
            "SIGPROP_RATE_LIMIT_COLD_SOLVES": "0",
        }
        if redis_url is None:
            del env["SIGPROP_REDIS_URL"]
            env["SIGPROP_DATA_DIR"] = str(log_path.parent / "store")
        exe = Path(sys.executable).with_name("sigprop")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "sigprop.cli"]
        self.proc = subprocess.Popen(
            cmd + ["serve", "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(workers)],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sigprop serve exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                status, _, body = http("GET", self.base + "/readyz", timeout=2.0)
                if status == 200:
                    return
                last = f"{status} {body}"
            except (OSError, ValueError) as exc:
                last = str(exc)
            time.sleep(0.25)
        raise RuntimeError(f"/readyz not ready after {timeout_s:g} s (last: {last}):\n{self.log_tail()}")

    def pids(self) -> list[int]:
        """The uvicorn worker processes (children of the server, not multiprocessing's resource tracker)."""
        try:
            out = subprocess.run(
                ["ps", "-o", "pid=,args=", "--ppid", str(self.proc.pid)], capture_output=True, text=True, timeout=5
            ).stdout
            return [int(line.split()[0]) for line in out.splitlines() if "resource_tracker" not in line]
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return []

    def log_tail(self, n: int = 40) -> str:
        self.log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGINT, 35.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)  # the server's own session: itself and its workers
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # workers that outlived their parent (they share its process group)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


class BareServer(Server):
    """The baseline of the hit-path ratio: a bare FastAPI app whose only route, ``POST /v1/solve``,
    reads the body, parses nothing and returns fixed answer bytes, under the uvicorn options
    ``sigprop serve`` runs with (``sigprop.api.server.uvicorn_options``: workers, parser, event
    loop, TCP_NODELAY). What it answers per second is the most the serving stack allows."""

    def __init__(self, workers: int, answer: bytes, key: str, log_path: Path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        answer_path = log_path.with_suffix(".answer")
        answer_path.write_bytes(answer)
        env = {**os.environ, "BENCH_BARE_ANSWER": str(answer_path), "BENCH_BARE_KEY": key}
        code = f"import bench_server; bench_server.serve_bare({self.port}, {workers})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT / "bench",
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the bare server exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if http("POST", self.base + "/v1/solve", {})[0] == 200:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the bare server is not up after {timeout_s:g} s:\n{self.log_tail()}")


def bare_app():
    """The bare baseline app (``BareServer``): the same answer bytes and key header as a cache hit."""
    from fastapi import FastAPI

    answer = Path(os.environ["BENCH_BARE_ANSWER"]).read_bytes()
    headers = {"X-Sigprop-Key": os.environ["BENCH_BARE_KEY"]}
    app = FastAPI()

    @app.post("/v1/solve")
    async def solve(request: _Request):
        await request.body()
        return Response(answer, media_type="application/json", headers=headers)

    return app


def serve_bare(port: int, workers: int) -> None:
    import uvicorn

    from sigprop.api.server import uvicorn_options

    uvicorn.run(
        "bench_server:bare_app",
        factory=True,
        app_dir=str(ROOT / "bench"),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        **uvicorn_options(workers),
    )


def counter_sums(server: Server, counter: str, label: str, names: tuple[str, ...]) -> dict[str, float]:
    """One of the server's counters from /metrics, by its one label, summed over its workers."""
    req = urllib.request.Request(server.base + "/metrics")
    with _OPENER.open(req, timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(names, 0.0)
    for name, value in re.findall(rf'^{counter}\{{{label}="(\w+)"\}}\s+([0-9.e+]+)', text, re.M):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def cache_counts(server: Server) -> dict[str, float]:
    """The server's own cache counters (hit, miss, error)."""
    return counter_sums(server, "sigprop_cache_total", "result", ("hit", "miss", "error"))


def inline_counts(server: Server) -> dict[str, float]:
    """The server's inline-lane outcomes (done, over_budget, busy): how many cold solves ran in the
    API process, and how many fell back to a solver process."""
    return counter_sums(server, "sigprop_inline_solves_total", "outcome", ("done", "over_budget", "busy"))


def check(server: Server, body: dict, expect_cached: bool | None, what: str) -> dict:
    status, headers, answer = http("POST", server.base + "/v1/solve", body)
    if status != 200:
        raise RuntimeError(f"{what}: POST /v1/solve answered {status}: {answer}")
    if expect_cached is not None and answer.get("cached") is not expect_cached:
        raise RuntimeError(f"{what}: expected cached={expect_cached}, got {answer.get('cached')}")
    return {"key": headers.get("X-Sigprop-Key") or headers.get("x-sigprop-key"), "answer": answer}


def _flush(url: str) -> None:
    import redis

    try:
        r = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        r.flushdb()
        r.close()
    except redis.RedisError:
        pass


def _stored(url: str, settle_s: float = 5.0) -> int:
    """Solutions stored in the cache, once the solves still running (holding a lock) have finished."""
    import redis

    r = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        deadline = time.monotonic() + settle_s
        while any(True for _ in r.scan_iter("sigprop:lock:*", count=1000)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return sum(1 for _ in r.scan_iter("sigprop:sol:*", count=1000))
    finally:
        r.close()
