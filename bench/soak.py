"""Memory soak: ``sigprop serve --workers 2`` on Redis under a steady, moderate mix of cache hits
and cold solves for ``--minutes`` (15 by default), sampling the resident memory (RSS) of every
process the server started (API workers, solver processes, the forkserver) and the memory gauges
of ``/metrics`` (``sigprop_memory_bytes`` by part). Issue 26 asks for RSS flat after warm-up.

    .venv/bin/python bench/soak.py                       # 15 min at 40 requests/s, 1 in 20 cold
    .venv/bin/python bench/soak.py --minutes 2 --rate 20 # a quick look

Loopback only; the Redis database given is flushed before and after. The verdict compares the
total RSS at the end of the warm-up (``--warmup-min``) with the end of the load, and prints it again
after ``--idle-s`` of no load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import Server, _flush  # noqa: E402
from load_test import HOT_SET  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")


def session_rss(sid: int) -> tuple[int, int]:
    """Total RSS in bytes, and the number of processes, of the session ``sid`` (the server's own:
    it was started with start_new_session, so its workers and solver processes are all in it)."""
    total = count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[3]) != sid:  # field 6 of stat: the session id
                continue
            with open(f"/proc/{entry}/statm", "rb") as f:
                total += int(f.read().split()[1]) * _PAGE
            count += 1
        except (OSError, ValueError, IndexError):
            continue
    return total, count


def memory_gauges(base: str) -> dict[str, float]:
    try:
        text = httpx.get(base + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(("sigprop_memory_bytes{", "sigprop_memory_entries{")):
            name, value = line.rsplit(" ", 1)
            out[name.replace("sigprop_memory_", "").replace('part="', "").replace('"}', "}")] = float(value)
    return out


def load(
    base: str, rate: float, cold_every: int, stop: threading.Event, counts: dict, offset: int, depth: int = 100
) -> None:
    """One paced client: ``rate`` requests/s, every ``cold_every``-th a new ``depth``-layer MLP."""
    period, n = 1.0 / rate, 0
    with httpx.Client(base_url=base, timeout=60) as c:
        next_at = time.monotonic()
        while not stop.is_set():
            n += 1
            if n % cold_every == 0:
                eta = 0.05 + 0.9 * ((offset * 1_000_003 + n) % 999_983) / 999_983
                body = {
                    "graph": {"template": "mlp", "depth": depth, "width": 64},
                    "method": "tat",
                    "activation": "leaky_relu",
                    "targets": {"eta": round(eta, 9)},
                }
            else:
                body = HOT_SET[n % len(HOT_SET)]
            try:
                status = c.post("/v1/solve", json=body).status_code
            except httpx.HTTPError:
                status = "error"
            counts[status] = counts.get(status, 0) + 1
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=15.0, help="minutes of load")
    ap.add_argument("--rate", type=float, default=40.0, help="requests/s in total")
    ap.add_argument("--clients", type=int, default=4, help="paced clients (keep-alive connections)")
    ap.add_argument("--cold-every", type=int, default=20, help="one cold solve every this many requests")
    ap.add_argument(
        "--cold-depth",
        type=int,
        default=100,
        help="layers of the cold solves' MLPs (deeper: larger answers, so the bounded memories fill sooner)",
    )
    ap.add_argument("--workers", type=int, default=2, help="sigprop serve --workers")
    ap.add_argument("--warmup-min", type=float, default=3.0, help="minutes of warm-up before the baseline")
    ap.add_argument("--sample-s", type=float, default=15.0, help="seconds between samples")
    ap.add_argument("--idle-s", type=float, default=30.0, help="seconds of no load before the last sample")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/14", help="flushed before and after; loopback")
    ap.add_argument("--json", type=Path, default=None, help="write the samples here")
    args = ap.parse_args()

    _flush(args.redis_url)
    tmp = Path(tempfile.mkdtemp(prefix="sigprop-soak-"))
    server = Server(args.workers, args.redis_url, tmp / "serve.log")
    stop = threading.Event()
    samples: list[dict] = []
    counts: dict = {}
    try:
        server.wait_ready()
        threads = [
            threading.Thread(
                target=load,
                args=(server.base, args.rate / args.clients, args.cold_every, stop, counts, i, args.cold_depth),
                daemon=True,
            )
            for i in range(args.clients)
        ]
        start = time.monotonic()
        for t in threads:
            t.start()

        def sample(phase: str) -> dict:
            rss, procs = session_rss(server.proc.pid)
            row = {
                "t_s": round(time.monotonic() - start, 1),
                "phase": phase,
                "rss_mb": round(rss / 1e6, 1),
                "processes": procs,
                "requests": dict(counts),
                **{k: round(v / 1e6, 2) if "entries" not in k else v for k, v in memory_gauges(server.base).items()},
            }
            samples.append(row)
            print(json.dumps(row), flush=True)
            return row

        end = start + args.minutes * 60
        warm_row = None
        while time.monotonic() < end:
            time.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
            row = sample("load")
            if warm_row is None and row["t_s"] >= args.warmup_min * 60:
                warm_row = row
        last_load = samples[-1]
        stop.set()
        for t in threads:
            t.join(timeout=70)
        time.sleep(args.idle_s)
        idle = sample("idle")
        warm_row = warm_row or samples[0]
        warm_min = warm_row["t_s"] / 60
        print(
            f"\nRSS over {last_load['processes']} processes: {warm_row['rss_mb']} MB after {warm_min:.1f} min "
            f"of warm-up, {last_load['rss_mb']} MB at the end of {args.minutes:g} min "
            f"({last_load['rss_mb'] - warm_row['rss_mb']:+.1f} MB), {idle['rss_mb']} MB after {args.idle_s:g} s idle; "
            f"requests {last_load['requests']}"
        )
        if args.json:
            args.json.write_text(json.dumps(samples, indent=1))
    finally:
        stop.set()
        server.stop()
        _flush(args.redis_url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
