"""What the retention bound does with the deepest answers (the 10,000-layer, width-1 MLP).

Run from the repository root (needs redis-server):

    .venv/bin/python bench/storage_bench.py                 # about a minute
    .venv/bin/python bench/storage_bench.py --copies 400 --max-bytes 536870912

It solves ``{"graph":{"template":"mlp","depth":10000,"width":1},...}`` once (timed), then starts
a private ``redis-server`` and writes ``--copies`` copies of that record under keys of their own
through ``RedisSolutionCache.put`` with the byte bound ``--max-bytes`` (the default of
``SIGPROP_CACHE_MAX_BYTES``), as that many different deep requests would. It reports the request
and answer sizes, how many records the bound keeps, the cache's byte count against the bound,
Redis's ``used_memory``, the time of a put below and at the bound (where each put evicts) and of a
hit (``get_answer``), medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sigprop.engine.solve import prepare, solve_canonical  # noqa: E402
from sigprop.requests import parse_solve_request  # noqa: E402
from sigprop.storage import RedisSolutionCache, new_record  # noqa: E402
from tests.service_fixtures import start_redis  # noqa: E402

REQUEST = {
    "graph": {"template": "mlp", "depth": 10000, "width": 1},
    "method": "tat",
    "activation": "leaky_relu",
    "targets": {"eta": 0.9},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=400)
    ap.add_argument("--max-bytes", type=int, default=512 * 1024 * 1024)
    args = ap.parse_args()
    body = json.dumps(REQUEST, separators=(",", ":"))
    start = time.perf_counter()
    prep = prepare(parse_solve_request(json.loads(body)))
    answer = solve_canonical(prep).to_json()
    solve_s = time.perf_counter() - start
    rec = new_record(prep.key, answer, body, prep.ids, "tat", "leaky_relu")
    print(
        f"request {len(body)} bytes; answer {len(answer):,} bytes; record size {rec.size:,} bytes; "
        f"solve {solve_s:.2f} s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis(Path(tmp))
        try:
            cache = RedisSolutionCache(server.url, timeout_s=30, max_bytes=args.max_bytes)
            base = int(cache.r.info("memory")["used_memory"])
            below, at, keys = [], [], []
            for i in range(args.copies):
                rec.key = f"{i:08x}".ljust(64, "0")
                rec.created = time.time()
                full = cache.stats()["bytes"] + rec.size > args.max_bytes
                t = time.perf_counter()
                cache.put(rec)
                (at if full else below).append(time.perf_counter() - t)
                keys.append(rec.key)
            stats = cache.stats()
            used = int(cache.r.info("memory")["used_memory"]) - base
            hits = []
            for key in keys[-50:]:
                t = time.perf_counter()
                assert cache.get_answer(key) is not None
                hits.append(time.perf_counter() - t)
            print(
                f"bound {args.max_bytes:,} bytes: {stats['entries']} of {args.copies} records kept, "
                f"{stats['bytes']:,} bytes counted, Redis used_memory +{used:,} bytes "
                f"({used / max(stats['entries'], 1):,.0f} per record)"
            )
            print(
                f"put below the bound: median {statistics.median(below) * 1e3:.1f} ms ({len(below)}); "
                f"at the bound (evicting): median {statistics.median(at) * 1e3:.1f} ms ({len(at)})"
                if at
                else "the bound was never reached"
            )
            print(f"hit (get_answer of a 1.8 MB answer): median {statistics.median(hits) * 1e3:.1f} ms")
            cache.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
