"""Issue 35's last two rows of the "other clients" table: connections that hold a server's
resources without finishing a request.

Runs ``sigprop serve --workers 2`` (Redis at ``--redis``, database 14, flushed first; a metrics
port) and, for each attack, measures a victim in the same seconds: a cache hit every 20 ms and
``GET /healthz`` every 20 ms. A baseline phase with no attack comes first. Attacks:

- ``halfopen``: 1,000 connections to the metrics port, each sending an unfinished request line and
  headers, then nothing (the server's threads, CPU and the victim's latency while they are held);
- ``headers``: 8 connections each streaming a header block of up to 150 MB to the API port (the
  server processes' memory, and what each connection got back).

    .venv/bin/python bench/connection_attack.py        # about a minute

Prints p50 / p99 in ms per victim column, the server's threads, CPU and resident memory, and the
machine's load average.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import Server, free_port  # noqa: E402

HIT_BODY = {
    "graph": {"template": "mlp", "depth": 10, "width": 64},
    "method": "tat",
    "activation": "leaky_relu",
    "targets": {"eta": 0.5},
}


_COUNT = threading.Lock()  # the header connections' statuses, counted from their threads


def _proc_stats(pids: list[int]) -> tuple[int, int, float]:
    """(threads, resident kB, CPU seconds) summed over ``pids``."""
    threads = rss = 0
    cpu = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("Threads:"):
                    threads += int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    rss += int(line.split()[1])
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return threads, rss, cpu


def _victim(base: str, seconds: float) -> tuple[list[float], list[float]]:
    hits, health = [], []
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base, timeout=30.0, trust_env=False) as c:
        while time.monotonic() < deadline:
            t = time.perf_counter()
            c.post("/v1/solve", json=HIT_BODY)
            hits.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            c.get("/healthz")
            health.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.02)
    return hits, health


def _pct(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):.0f} / {xs[int(0.99 * (len(xs) - 1))]:.0f}"


def _halfopen(port: int, n: int, stop: threading.Event, out: dict) -> None:
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nX-Slow: ")
            socks.append(s)
        except OSError:
            out["refused"] = out.get("refused", 0) + 1
    out["opened"] = len(socks)
    stop.wait()
    closed = 0
    for s in socks:
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    out["closed by the server"] = closed


def _headers(port: int, stop: threading.Event, out: dict, total_mb: int = 150) -> None:
    line = b"X-Pad: " + b"a" * 8185 + b"\r\n"
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\n")
        sent = 0
        while sent < total_mb * 2**20 and not stop.is_set():
            s.sendall(line)
            sent += len(line)
        reply = s.recv(200)
        status = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else "closed"
    except OSError as exc:
        status = type(exc).__name__
    with _COUNT:
        out[status] = out.get(status, 0) + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    args = ap.parse_args()
    metrics_port = free_port()
    os.environ["SIGPROP_METRICS_PORT"] = str(metrics_port)
    import redis

    redis.Redis.from_url(args.redis).flushdb()
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(2, args.redis, Path(tmp) / "serve.log")
        try:
            server.wait_ready()
            httpx.post(server.base + "/v1/solve", json=HIT_BODY, timeout=60, trust_env=False).raise_for_status()
            pids = [server.proc.pid, *server.pids()]
            rows = []
            for attack in ("baseline", "halfopen", "headers"):
                stop, out = threading.Event(), {}
                workers = []
                if attack == "halfopen":
                    workers = [threading.Thread(target=_halfopen, args=(metrics_port, 1000, stop, out))]
                elif attack == "headers":
                    workers = [threading.Thread(target=_headers, args=(server.port, stop, out)) for _ in range(8)]
                load0 = os.getloadavg()[0]
                for w in workers:
                    w.start()
                time.sleep(2 if workers else 0)
                peak = [0, 0]
                cpu0 = _proc_stats(pids)[2]
                t0 = time.monotonic()

                def sample(peak=peak, stop=stop):
                    while not stop.is_set():
                        th, rss, _ = _proc_stats(pids)
                        peak[0], peak[1] = max(peak[0], th), max(peak[1], rss)
                        time.sleep(0.2)

                sampler = threading.Thread(target=sample)
                sampler.start()
                hits, health = _victim(server.base, args.seconds)
                cpu = (_proc_stats(pids)[2] - cpu0) / (time.monotonic() - t0)
                stop.set()
                for w in (*workers, sampler):
                    w.join(60)
                rows.append(
                    f"| {attack} | {_pct(hits)} | {_pct(health)} | {peak[0]} | {cpu * 100:.0f}% | "
                    f"{peak[1] / 1024:.0f} MB | {out or {}} | {load0:.1f} -> {os.getloadavg()[0]:.1f} |"
                )
                print(rows[-1], flush=True)
            print()
            print(
                "| attack | hit p50 / p99 ms | /healthz | server threads (peak) | server CPU | server RSS (peak) "
                "| attacker | load 1 min |"
            )
            print("| --- | --- | --- | --- | --- | --- | --- | --- |")
            print("\n".join(rows))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
