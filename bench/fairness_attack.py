"""Issue 35's "other clients" table: what one client's cheap-to-send requests cost everyone else.

Runs ``sigprop serve --workers 2`` (Redis at ``--redis``, database 15, flushed first; two API keys,
the default rate limits) and, for each attack, measures a victim in the same minutes: a keyed
client sending a small cold solve (a new MLP-100 target) every 100 ms, a cache hit every 20 ms and
``GET /healthz`` every 20 ms. A baseline phase with no attack comes first. Attacks:

- ``templates``: 8 concurrent anonymous ``GET /v1/templates/mlp?depth=10000`` back to back;
- ``uspa``: 40 concurrent U-SPA solves (100 blocks, T 256, new targets) from one key;
- ``anon16``: 16 anonymous clients, each from its own source address (127.0.0.10-25), sending
  unreachable TAT tanh targets back to back (each a root search to the end of its budget);
- ``reads``: 8 concurrent ``GET /v1/solutions/{key}`` of a 1.8 MB stored answer, from one key.

    .venv/bin/python bench/fairness_attack.py                    # about 2 minutes
    .venv/bin/python bench/fairness_attack.py --seconds 20 --attacks templates reads

Prints p50 / p99 in ms per victim column, the attackers' status counts, and the machine's load
average (on a shared 2-core machine the figures are noisy: compare rows of one run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import Server  # noqa: E402

KEY_VICTIM, KEY_ATTACK = "victim-key-0123456789abcdef", "attack-key-0123456789abcdef"
MLP = {"template": "mlp", "depth": 100, "width": 512}
HIT = {"graph": MLP, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.9}}
# its stored answer is about 1.8 MB (one entry per layer)
LARGE = {
    "graph": {"template": "mlp", "depth": 10_000, "width": 64},
    "method": "tat",
    "activation": "leaky_relu",
    "targets": {"eta": 0.9},
}
_N = itertools.count(1)


def _uspa() -> dict:
    eta = 0.9 - next(_N) * 1e-6
    g = {"template": "transformer", "depth": 100, "seq_len": 256, "width": 512, "heads": 8}
    return {
        "graph": g,
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": eta},
        "attention": {"shaping": "u-spa"},
    }


def _unreachable() -> dict:
    """Past tanh's reach by proof (bench/inline_attack.py): the root search spends its whole budget."""
    return {"graph": MLP, "method": "tat", "activation": "tanh", "targets": {"tau": 1e8 + next(_N)}}


def _small() -> dict:
    return {**HIT, "targets": {"eta": 0.9 - next(_N) * 1e-6}}


async def _probe(c, stop, out, method, path, body=None, every=0.02, headers=None):
    while not stop.is_set():
        t = time.perf_counter()
        try:
            r = await c.request(method, path, json=body() if callable(body) else body, headers=headers)
            out.append((time.perf_counter() - t, r.status_code))
        except httpx.HTTPError:
            out.append((time.perf_counter() - t, 0))
        await asyncio.sleep(every)


async def _attacker(c, stop, counts, method, path, body=None, headers=None):
    while not stop.is_set():
        try:
            r = await c.request(method, path, json=body() if callable(body) else body, headers=headers, timeout=60)
            counts[r.status_code] += 1
            if r.status_code == 429:
                await asyncio.sleep(min(5.0, float(r.headers.get("retry-after", "1"))))
        except httpx.HTTPError:
            counts["error"] += 1


async def _attack(base: str, attack: str, seconds: float, large_key: str | None) -> dict:
    attack_h = {"Authorization": f"Bearer {KEY_ATTACK}"}
    stop = asyncio.Event()
    counts: collections.Counter = collections.Counter()
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    clients: list[httpx.AsyncClient] = []
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as a:
        if attack == "templates":
            tasks = [_attacker(a, stop, counts, "GET", "/v1/templates/mlp?depth=10000") for _ in range(8)]
        elif attack == "uspa":
            tasks = [_attacker(a, stop, counts, "POST", "/v1/solve", _uspa, attack_h) for _ in range(40)]
        elif attack == "anon16":  # each its own source address: 127.0.0.10 ... 127.0.0.25
            clients = [
                httpx.AsyncClient(
                    base_url=base,
                    timeout=60,
                    transport=httpx.AsyncHTTPTransport(local_address=f"127.0.0.{10 + i}"),
                )
                for i in range(16)
            ]
            tasks = [_attacker(ci, stop, counts, "POST", "/v1/solve", _unreachable) for ci in clients]
        else:  # reads
            path = f"/v1/solutions/{large_key}"
            tasks = [_attacker(a, stop, counts, "GET", path, None, attack_h) for _ in range(8)]
        running = [asyncio.create_task(t) for t in tasks]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.wait(running, timeout=65)
        for ci in clients:
            await ci.aclose()
    return dict(counts)


def _attack_process(base: str, attack: str, seconds: float, large_key: str | None, out) -> None:
    """The attackers, in a process of their own: reading their responses (megabytes each) in the
    victims' process would delay the victims' own measurements."""
    out.put(asyncio.run(_attack(base, attack, seconds, large_key)))


async def phase(base: str, seconds: float):
    victim = {"Authorization": f"Bearer {KEY_VICTIM}"}
    stop = asyncio.Event()
    cols = {"small cold solve": [], "hit": [], "/healthz": []}
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        tasks = [
            _probe(c, stop, cols["small cold solve"], "POST", "/v1/solve", _small, 0.1, victim),
            _probe(c, stop, cols["hit"], "POST", "/v1/solve", HIT, 0.02, victim),
            _probe(c, stop, cols["/healthz"], "GET", "/healthz", None, 0.02),
        ]
        running = [asyncio.create_task(t) for t in tasks]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.wait(running, timeout=65)
    return cols


def run_phase(base: str, attack: str | None, seconds: float, large_key: str | None):
    counts: dict = {}
    proc = None
    if attack is not None:
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=_attack_process, args=(base, attack, seconds, large_key, out))
        proc.start()
        time.sleep(1.0)  # the attack under way before the victims measure
    cols = asyncio.run(phase(base, seconds))
    if proc is not None:
        counts = out.get(timeout=120)
        proc.join(10)
    return cols, counts


def _cell(v) -> str:
    if not v:
        return "-"
    ms = sorted(t * 1000 for t, _ in v)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    bad = sum(1 for _, s in v if s != 200)
    return f"{statistics.median(ms):,.0f} / {p99:,.0f}" + (f" ({bad} not 200)" if bad else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--attacks", nargs="+", default=["templates", "uspa", "anon16", "reads"])
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="sigprop-fairness-"))
    import redis

    redis.Redis.from_url(args.redis).flushdb()
    os.environ["SIGPROP_API_KEYS"] = f"{KEY_VICTIM},{KEY_ATTACK}"
    server = Server(2, args.redis, tmp / "server.log")
    rows = []
    try:
        server.wait_ready()
        h = {"Authorization": f"Bearer {KEY_VICTIM}"}
        httpx.post(server.base + "/v1/solve", json=HIT, headers=h, timeout=60)
        r = httpx.post(server.base + "/v1/solve", json=LARGE, headers=h, timeout=60)
        assert r.status_code == 200, r.text[:300]
        time.sleep(1.0)
        items = httpx.get(server.base + "/v1/solutions?limit=5", timeout=30, headers=h).json()["items"]
        large_key = max(items, key=lambda it: it.get("bytes") or it.get("size") or 0)["key"]
        size = len(httpx.get(f"{server.base}/v1/solutions/{large_key}", timeout=30, headers=h).content)
        print(f"large stored solution: {size:,} bytes", flush=True)
        for attack in [None, *args.attacks]:
            load0 = os.getloadavg()[0]
            cols, counts = run_phase(server.base, attack, args.seconds, large_key)
            load = f"{load0:.1f} -> {os.getloadavg()[0]:.1f}"
            row = [attack or "baseline", *(_cell(v) for v in cols.values()), dict(counts), load]
            rows.append(row)
            print(" | ".join(str(x) for x in row), flush=True)
    finally:
        server.stop()
    print("\n| attack | small cold solve p50 / p99 ms | hit | /healthz | attacker statuses | load 1 min |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
