"""Bounded load test: mixed cache hits and cold solves of POST /v1/solve, at least 500
requests per second, no errors, at most 60 s of load.

Run from the repository root (needs wrk, Debian package ``wrk``, and a Redis on 127.0.0.1:6379):

    .venv/bin/python bench/load_test.py                  # 3 s calibration, 40 s paced, 15 s saturating
    .venv/bin/python bench/load_test.py --duration 10    # shorter

It starts ``sigprop serve --workers 2`` on a loopback port with ``SIGPROP_REDIS_URL`` pointing at
database 14 (flushed before and after), solves the hot set once, and runs wrk twice:

1. **paced**: ``--connections`` connections, each waiting a fixed delay between requests so the
   offered load is about ``--rate`` requests/s (wrk is a closed-loop tool; the delay makes it an
   approximately constant-rate one; a 3 s calibration run first measures the answer latency at
   that load, which the delay leaves room for). The traffic: every ``--cold-every``-th request is a cold
   solve (a 100-layer MLP with a new eta: a new key, solved and stored), the others cycle over a
   hot set of twelve different cached requests (MLPs, ResNets, a DenseNet, a CNN; TAT, DKS, EoC,
   sparse EoC, geometric). Latency here is the latency at that load.
2. **saturating**: the same mix with no delay, to show the headroom above the target.

The verdict: PASS when the paced run achieved at least 500 requests/s with zero errors (non-2xx
and socket errors) and the server's counters show the expected hits and misses. All load comes
from one address, so the per-client cold-solve rate limit is set out of the way
(``SIGPROP_RATE_LIMIT_COLD_SOLVES=0``); its cost when on is one Redis round trip per cold solve.
Exit status 0 on PASS, 1 on MISS.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import LOOPBACK, Server, _flush, cache_counts, http  # noqa: E402
from report import fmt_t, machine, sigprop_state, table  # noqa: E402
from wrk import ETA_MARK, LUA_THREAD_IDS, lua_str, run_wrk  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RPS_GOAL = 500.0
CALIBRATION_S = 3
SATURATING_S = 15

HOT_SET = [
    {
        "graph": {"template": "mlp", "depth": 100, "width": 512},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.9},
    },
    {
        "graph": {"template": "mlp", "depth": 50, "width": 256},
        "method": "tat",
        "activation": "softplus",
        "targets": {"tau": 0.3},
    },
    {
        "graph": {"template": "mlp", "depth": 50, "width": 256},
        "method": "dks",
        "activation": "tanh",
        "targets": {"zeta": 1.5},
    },
    {"graph": {"template": "mlp", "depth": 20, "width": 128}, "method": "eoc", "activation": "tanh", "targets": {}},
    {
        "graph": {"template": "mlp", "depth": 20, "width": 128},
        "method": "sparse_eoc",
        "activation": "relu_tau",
        "targets": {"sparsity": 0.5},
    },
    {
        "graph": {"template": "mlp", "depth": 10, "width": 64},
        "method": "geometric",
        "activation": "relu",
        "targets": {},
    },
    {
        "graph": {"template": "resnet", "depth": 50, "version": 2, "shortcut_weight": 0.8},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.9},
    },
    {
        "graph": {"template": "resnet", "depth": 101, "version": 2, "shortcut_weight": 0.8},
        "method": "tat",
        "activation": "softplus",
        "targets": {"tau": 0.3},
    },
    {
        "graph": {"template": "resnet", "depth": 18, "version": 1, "shortcut_weight": 0.0},  # v1: no shortcut
        "method": "dks",
        "activation": "gelu",
        "targets": {"zeta": 1.5},
    },
    {
        "graph": {"template": "densenet", "depth": 121},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.8},
    },
    {
        "graph": {"template": "cnn", "depth": 20, "width": 64},
        "method": "tat",
        "activation": "swish",
        "targets": {"tau": 0.3},
    },
    {
        "graph": {"template": "mlp", "depth": 200, "width": 512},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": 0.95},
    },
]
COLD = {
    "graph": {"template": "mlp", "depth": 100, "width": 512},
    "method": "tat",
    "activation": "leaky_relu",
    "targets": {"eta": ETA_MARK},
}


def lua_mixed(threads: int, cold_every: int, delay_ms: int, eta_base: float) -> str:
    """Request n (counted per thread, numbered across threads) is a cold solve (eta = eta_base +
    n * 1e-9: give each run its own base, so no run meets another's answers) when n is a multiple
    of ``cold_every``, else hot request n mod 12. ``delay_ms`` > 0 paces each connection."""
    hot = ",\n".join(lua_str(json.dumps(r, separators=(",", ":"))) for r in HOT_SET)
    head, tail = json.dumps(COLD, separators=(",", ":")).split(f'"{ETA_MARK}"')
    return f"""
local threads = {threads}
{LUA_THREAD_IDS}local hot = {{
{hot}
}}
local head = {lua_str(head)}
local tail = {lua_str(tail)}
local counter = 0
local headers = {{["Content-Type"] = "application/json"}}
function delay()
  return {delay_ms}
end
function request()
  counter = counter + 1
  local n = counter * threads + tid
  if n % {cold_every} == 0 then
    return wrk.format("POST", nil, headers, head .. string.format("%.12f", {eta_base} + n * 1e-9) .. tail)
  end
  return wrk.format("POST", nil, headers, hot[(n % #hot) + 1])
end
"""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--duration", type=int, default=40, help="seconds of the paced run (plus 3 s calibration, 15 s saturating)"
    )
    ap.add_argument("--rate", type=float, default=560.0, help="offered requests/s of the paced run")
    ap.add_argument("--connections", type=int, default=64, help="wrk connections")
    ap.add_argument("--threads", type=int, default=2, help="wrk threads")
    ap.add_argument("--cold-every", type=int, default=20, help="one cold solve every this many requests")
    ap.add_argument("--workers", type=int, default=2, help="sigprop serve --workers")
    ap.add_argument("--timeout", type=int, default=5, help="wrk's per-request timeout, seconds")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/14", help="flushed before and after; loopback only")
    args = ap.parse_args(argv)
    if CALIBRATION_S + args.duration + SATURATING_S > 60:
        ap.error(f"the load test is bounded to 60 s of load: --duration at most {60 - CALIBRATION_S - SATURATING_S}")
    return args


def calibrate(url: str, args, tmp: Path, cycle_ms: float) -> int:
    """The paced run's per-request delay in ms: each connection's cycle is its delay plus the
    answer's latency, which a short calibration run measures at about the target load."""
    guess = max(0, round(cycle_ms) - 5)
    calib = run_wrk(
        url,
        lua_mixed(args.threads, args.cold_every, guess, 0.2),
        args,
        tmp,
        "calibration",
        args.threads,
        args.connections,
        duration=CALIBRATION_S,
    )
    latency_ms = max(0.0, args.connections * 1000.0 / max(calib.rps, 1.0) - guess)
    delay_ms = max(0, round(cycle_ms - latency_ms))
    print(
        f"  calibration ({CALIBRATION_S} s, {guess} ms delay): {calib.rps:.0f} requests/s, "
        f"so {latency_ms:.1f} ms per answer; paced delay {delay_ms} ms",
        file=sys.stderr,
    )
    return delay_ms


def run_load(server: Server, url: str, args, tmp: Path, run: tuple) -> tuple[list, bool]:
    """One wrk run of the mix: (its table row without the verdict, whether it met the goal)."""
    name, duration, delay, eta_base = run
    print(f"  {name} ({duration} s) ...", end="", flush=True, file=sys.stderr)
    before = cache_counts(server)
    res = run_wrk(
        url,
        lua_mixed(args.threads, args.cold_every, delay, eta_base),
        args,
        tmp,
        name,
        args.threads,
        args.connections,
        duration=duration,
    )
    time.sleep(0.5)
    after = cache_counts(server)
    hits, misses = after["hit"] - before["hit"], after["miss"] - before["miss"]
    print(f" {res.rps:.0f} requests/s", file=sys.stderr)
    if server.proc.poll() is not None:
        raise RuntimeError(f"the server died during the {name} run:\n{server.log_tail()}")
    ok = res.errors == 0 and res.rps >= RPS_GOAL and misses > 0 and hits > 0
    offered = f"~{args.rate:.0f}/s ({delay} ms delay)" if delay else "as fast as answered"
    row = [
        name,
        f"{duration} s",
        offered,
        f"{res.rps:,.0f}",
        f"{res.requests:,}",
        fmt_t(res.pct.get(50)),
        fmt_t(res.pct.get(90)),
        fmt_t(res.pct.get(99)),
        f"{hits:,.0f} / {misses:,.0f}",
        str(res.errors),
    ]
    return row, ok


def run_all(server: Server, args, tmp: Path, cycle_ms: float, rows: list) -> str:
    """Caches the hot set, calibrates, then the paced and saturating runs into ``rows``; the paced run's verdict."""
    for req in HOT_SET:  # the hot set is cached before the load starts
        status, _, body = http("POST", server.base + "/v1/solve", req)
        if status != 200:
            raise RuntimeError(f"could not solve a hot request: {status} {body}")
    url = server.base + "/v1/solve"
    delay_ms = calibrate(url, args, tmp, cycle_ms)
    verdict = "MISS"
    runs = [("paced", args.duration, delay_ms, 0.3), ("saturating", SATURATING_S, 0, 0.4)]
    for run in runs:
        row, ok = run_load(server, url, args, tmp, run)
        if run[0] == "paced":
            verdict = "PASS" if ok else "MISS"
        rows.append(row + [verdict if run[0] == "paced" else "-"])
    return verdict


def report(rows: list, verdict: str, args) -> None:
    headers = [
        "run",
        "length",
        "offered",
        "requests/s",
        "requests",
        "p50",
        "p90",
        "p99",
        "cache hits / misses",
        "errors",
        f">= {RPS_GOAL:.0f}/s, 0 errors",
    ]
    print()
    print(table(headers, rows, right={1, 3, 4, 5, 6, 7, 8, 9}))
    print(
        f"\nmix: 1 cold solve (mlp-100, new eta) every {args.cold_every} requests, the rest cycling over "
        f"{len(HOT_SET)} cached requests; errors = non-2xx responses + socket errors (wrk)"
    )
    print(f"\nload test: {verdict}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not on PATH; install it (Debian: apt-get install -y wrk)", file=sys.stderr)
        return 2
    from urllib.parse import urlparse

    if urlparse(args.redis_url).hostname not in LOOPBACK:
        print(f"--redis-url must be a loopback address (it is flushed): {args.redis_url}", file=sys.stderr)
        return 2
    _flush(args.redis_url)

    # Each connection's cycle is its delay plus the answer's latency; a 3 s calibration run
    # measures that latency at about the target load, and the paced run's delay subtracts it.
    cycle_ms = args.connections * 1000.0 / args.rate
    env = (
        f"{machine()}; server: sigprop serve --workers {args.workers}, Redis {args.redis_url}; "
        f"wrk -t{args.threads} -c{args.connections}; {sigprop_state(ROOT)}"
    )
    print(env, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="sigprop-load-"))
    server = None
    rows: list = []
    verdict = "MISS"
    try:
        server = Server(args.workers, args.redis_url, tmp / "server.log")
        server.wait_ready()
        verdict = run_all(server, args, tmp, cycle_ms, rows)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        _flush(args.redis_url)

    report(rows, verdict, args)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
