"""Load-test the HTTP service with wrk: cache hits and cold solves of POST /v1/solve.

Run from the repository root (needs the load tool wrk, Debian package ``wrk``, and a Redis on
127.0.0.1:6379):

    .venv/bin/python bench/http_bench.py                 # six wrk runs of 15 s, about 2 minutes
    .venv/bin/python bench/http_bench.py --duration 5    # shorter runs
    .venv/bin/python bench/http_bench.py --profile       # then py-spy the workers under cache hits

First, the hit ratio (``--ratio-only``: nothing else): cache hits of ``sigprop serve`` against a
bare FastAPI app whose one route reads the body and returns the same answer bytes, served by the
same uvicorn options (``sigprop.api.server.uvicorn_options``: workers, parser, event loop,
TCP_NODELAY), wrk -t2 -c8, alternating ``--ratio-runs`` times (default 2) each; it prints their
requests/s, the ratio (goal >= 0.8) and sigprop's hit p50 at 8 connections (goal < 3 ms).

The script starts ``sigprop serve --workers 2`` on a free loopback port with
``SIGPROP_REDIS_URL=redis://127.0.0.1:6379/13`` (database 13 is flushed first), waits for
``/readyz``, and runs wrk (``--latency``, a Lua script for the POST body) against:

1. cache hits: one 100-layer MLP TAT Leaky ReLU request (template ``mlp``, depth 100, width 512,
   eta 0.9), solved once before the run, then sent over and over (-t2 -c16);
2. the same over a single connection (-t1 -c1): the latency of a hit without queueing;
3. cold solves: the same network, but every request carries a new eta (0.5 + n * 1e-9, n unique
   across wrk threads), so every request misses the cache, solves and stores;
4. cache hits with the same network written node by node (the template's expansion with its own
   node ids) instead of as a template: same cache key, but a ~16 KB body (203 nodes) to receive
   and hash;
5. and 6. cache hits (template, then node by node) whose bytes differ on every request (JSON
   whitespace spelling a counter): the same cache entry, but the service's memo of bodies it has
   seen never matches, so every request is parsed, validated, expanded and canonicalized (what
   the first request of each new client body costs).

``--cold-ratio`` (nothing else; no wrk, no Redis): cold MLP-100 solves over HTTP (``sigprop serve``
with the embedded store, one request at a time) against the same solves in-process
(``sigprop.solve``), alternating, per case (TAT softplus, DKS swish, TAT leaky_relu); it prints
the medians and their ratio (goal <= 1.5, issue 25). See ``bench/cold_ratio.py``.

It parses wrk's output into a markdown table (requests/s, p50/p90/p99 latency, the workers' CPU
time per request, errors = non-2xx responses + socket errors, the goal and PASS/MISS), prints it
and writes it, with the environment line (including the load average) and wrk's raw output, to
bench/results/http_bench.md (git-ignored). The server and everything else the script starts are
stopped at the end, also on error or Ctrl-C; only loopback addresses are used, and every wrk run
is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent

# bench/ is the script's folder on sys.path; load_test.py imports the server and wrk helpers from here too
from bench_server import (  # noqa: E402, F401
    _OPENER,
    LOOPBACK,
    BareServer,
    Server,
    _flush,
    _stored,
    cache_counts,
    check,
    free_port,
    http,
    inline_counts,
)
from cold_ratio import cold_ratio  # noqa: E402
from profiling import PROFILE_CATEGORIES, categorize, profile_hits  # noqa: E402, F401
from report import fmt_t, machine, sigprop_state, table  # noqa: E402
from wrk import (  # noqa: E402, F401
    ETA_MARK,
    LUA_THREAD_IDS,
    WrkResult,
    cpu_seconds,
    lua_cold,
    lua_fixed,
    lua_new_bytes,
    lua_str,
    parse_wrk,
    run_wrk,
)

from sigprop.engine.templates.expand import expand_template  # noqa: E402
from sigprop.schemas.graph import Template  # noqa: E402

HIT_P50_GOAL_S = 0.005  # goal: a cache hit answers in under 5 ms (median) ...
HIT_RPS_GOAL = 1000.0  # ... and the service sustains at least 1,000 hits per second
RATIO_GOAL = 0.8  # hits/s of sigprop serve over the bare app's requests/s, same uvicorn options
RATIO_P50_GOAL_S = 0.003  # and a hit's median at 8 connections

MLP = {"template": "mlp", "depth": 100, "width": 512}
HIT_REQUEST = {"graph": MLP, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.9}}


# ---------------------------------------------------------------- request bodies


def node_by_node_request() -> dict:
    """The 100-layer MLP as a raw graph: the template's expansion, with ids of our own."""
    graph = json.loads(expand_template(Template.model_validate(MLP)).model_dump_json(by_alias=True, exclude_none=True))
    rename = {nd["id"]: f"n{i:03d}_{nd['op']}" for i, nd in enumerate(graph["nodes"])}
    for nd in graph["nodes"]:
        nd["id"] = rename[nd["id"]]
        if "inputs" in nd:
            nd["inputs"] = [rename[i] for i in nd["inputs"]]
    return {**HIT_REQUEST, "graph": graph}


# ---------------------------------------------------------------- formatting


def environment(args) -> str:
    try:
        wrk_version = subprocess.run(["wrk", "--version"], capture_output=True, text=True, timeout=5).stdout.split()[1]
    except (OSError, subprocess.SubprocessError, IndexError):
        wrk_version = "?"
    from importlib.metadata import version

    libs = ", ".join(f"{p} {version(p)}" for p in ("fastapi", "uvicorn", "pydantic", "redis"))
    return (
        f"python {platform.python_version()}, {libs}, wrk {wrk_version}; {machine()}; "
        f"server: sigprop serve --workers {args.workers}, Redis {args.redis_url}; "
        f"wrk -t{args.threads} -c{args.connections} -d{args.duration}s; {sigprop_state(ROOT)}"
    )


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=int, default=15, help="seconds per wrk run")
    ap.add_argument("--threads", type=int, default=2, help="wrk threads")
    ap.add_argument("--connections", type=int, default=16, help="wrk connections")
    ap.add_argument("--timeout", type=int, default=5, help="wrk's per-request timeout, seconds")
    ap.add_argument("--workers", type=int, default=2, help="sigprop serve --workers")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/13", help="flushed before the run; loopback only")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="then py-spy the workers under cache hits (needs py-spy: .venv/bin/pip install py-spy)",
    )
    ap.add_argument("--ratio-runs", type=int, default=2, help="alternating wrk runs of each server (hit ratio)")
    ap.add_argument("--ratio-only", action="store_true", help="only the hit ratio against the bare app")
    ap.add_argument(
        "--cold-ratio", action="store_true", help="only cold solves over HTTP against in-process (embedded store)"
    )
    ap.add_argument("--cold-rounds", type=int, default=5, help="alternating rounds per case (--cold-ratio)")
    ap.add_argument("--cold-requests", type=int, default=20, help="requests per round and side (--cold-ratio)")
    ap.add_argument(
        "--cpu",
        type=int,
        default=None,
        help="--cold-ratio: run the server and the in-process side on this one CPU (see bench/README.md)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "http_bench.md"))
    return ap.parse_args(argv)


def preflight(args) -> int | None:
    """None when wrk is on PATH and the loopback Redis was flushed; else the exit status (with a message)."""
    if shutil.which("wrk") is None:
        print(
            "wrk (the HTTP load tool) is not on PATH. Install it, e.g. on Debian/Ubuntu:\n\n"
            "    apt-get install -y wrk\n\n(macOS: brew install wrk), then run this script again.",
            file=sys.stderr,
        )
        return 2
    if urlparse(args.redis_url).hostname not in LOOPBACK:
        print(f"--redis-url must point at a loopback address (it is flushed): {args.redis_url}", file=sys.stderr)
        return 2
    import redis

    try:
        r = redis.Redis.from_url(args.redis_url, socket_timeout=2, socket_connect_timeout=2)
        r.flushdb()
        r.close()
    except redis.RedisError as exc:
        print(
            f"cannot reach Redis at {args.redis_url} ({exc}); start one, e.g. redis-server --port 6379", file=sys.stderr
        )
        return 2
    return None


def _terminate(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through main's finally, which stops the server


def build_cases(args, raw: dict, hit_body: str, raw_body: str) -> list[tuple]:
    """(label, Lua script, kind, body bytes, wrk threads, wrk connections) of every wrk run."""
    return [
        (
            "cache hit, mlp-100 template",
            lua_fixed(HIT_REQUEST),
            "hit",
            len(hit_body),
            args.threads,
            args.connections,
        ),
        ("cache hit, mlp-100 template, 8 connections", lua_fixed(HIT_REQUEST), "hit", len(hit_body), 2, 8),
        ("cache hit, mlp-100 template, 1 connection", lua_fixed(HIT_REQUEST), "hit-1", len(hit_body), 1, 1),
        (
            "cold solve, mlp-100 template, new eta per request",
            lua_cold(HIT_REQUEST, args.threads),
            "cold",
            len(hit_body) + 4,
            args.threads,
            args.connections,
        ),
        (
            f"cache hit, mlp-100 node by node ({len(raw['graph']['nodes'])} nodes)",
            lua_fixed(raw),
            "hit-raw",
            len(raw_body),
            args.threads,
            args.connections,
        ),
        (
            "cache hit, mlp-100 template, new bytes per request",
            lua_new_bytes(HIT_REQUEST, args.threads),
            "hit-new",
            len(hit_body) + 24,
            args.threads,
            args.connections,
        ),
        (
            "cache hit, mlp-100 node by node, new bytes per request",
            lua_new_bytes(raw, args.threads),
            "hit-new",
            len(raw_body) + 24,
            args.threads,
            args.connections,
        ),
    ]


def run_case(server: Server, url: str, args, tmp: Path, i: int, case: tuple, workers: list[int], notes: list[str]):
    """One wrk run: (case, WrkResult, kind, body size, wrk -t, wrk -c, CPU s/request, hits/misses)."""
    label, lua, kind, size, threads, conns = case
    print(f"  {label} ...", end="", flush=True, file=sys.stderr)
    stored_before = _stored(args.redis_url)
    counts0 = cache_counts(server)
    cpu0 = cpu_seconds(workers)
    res = run_wrk(url, lua, args, tmp, f"case{i}", threads, conns)
    cpu1 = cpu_seconds(workers)
    time.sleep(0.5)  # requests wrk cut off at the end finish (their solves are short)
    counts1 = cache_counts(server)
    hits_misses = f"{counts1['hit'] - counts0['hit']:.0f} / {counts1['miss'] - counts0['miss']:.0f}" + (
        f" ({counts1['error'] - counts0['error']:.0f} errors)" if counts1["error"] > counts0["error"] else ""
    )
    print(f" {res.rps:.0f} requests/s", file=sys.stderr)
    if server.proc.poll() is not None:
        raise RuntimeError(f"the server died during '{label}':\n{server.log_tail()}")
    if kind == "cold":
        # Every solve stores one record (one hash): the number of new keys is the number of
        # distinct requests that really were solved, not served from the cache.
        stored = _stored(args.redis_url) - stored_before
        notes.append(
            f"cold solves: {stored} new stored solutions for {res.requests} requests counted by wrk "
            "(every request a distinct key; wrk does not count the requests still in flight when "
            "it stops, which are solved and stored too)"
        )
    cpu = (cpu1 - cpu0) / res.requests if cpu0 is not None and cpu1 is not None and res.requests else None
    return (label, res, kind, f"{size / 1000:.1f} KB", threads, conns, cpu, hits_misses)


def run_cases(server: Server, args, tmp: Path, results: list[tuple], notes: list[str]) -> str:
    """Checks the answers the cases rely on, runs every case into ``results`` and, with --profile,
    returns the profile of the cache-hit path ("" without)."""
    url = server.base + "/v1/solve"
    # the answers the cases rely on: a stored entry, and the node-by-node graph on the same key
    first = check(server, HIT_REQUEST, False, "warm-up")
    check(server, HIT_REQUEST, True, "hit check")
    raw = node_by_node_request()
    raw_key = check(server, raw, True, "node-by-node hit check")["key"]
    if raw_key != first["key"]:
        raise RuntimeError(f"the node-by-node graph has key {raw_key}, the template {first['key']}")
    answer_bytes = len(json.dumps(first["answer"], separators=(",", ":")))
    hit_body = json.dumps(HIT_REQUEST, separators=(",", ":"))
    raw_body = json.dumps(raw, separators=(",", ":"))

    notes.append(hit_ratio(server, url, args, tmp))
    if not args.ratio_only:
        cases = build_cases(args, raw, hit_body, raw_body)
        workers = server.pids()
        for i, case in enumerate(cases):
            results.append(run_case(server, url, args, tmp, i, case, workers, notes))
    notes.append(f"answer size {answer_bytes / 1000:.1f} KB (the 100-layer answer carries per-layer initializations)")
    if args.profile:
        print("  profiling the workers under cache hits ...", file=sys.stderr)
        return profile_hits(server, url, lua_fixed(HIT_REQUEST), args, tmp)
    return ""


def hit_bytes(url: str) -> tuple[bytes, str]:
    """The exact bytes (and key header) of a cache hit's answer: what the bare app returns."""
    req = urllib.request.Request(
        url, data=json.dumps(HIT_REQUEST).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with _OPENER.open(req, timeout=30) as r:
        return r.read(), r.headers.get("X-Sigprop-Key", "")


def hit_ratio(server: Server, url: str, args, tmp: Path) -> str:
    """Cache hits of ``sigprop serve`` against a bare FastAPI app returning the same bytes from the
    same uvicorn options, wrk -t2 -c8, alternating (sigprop, bare, sigprop, bare, ...) so that a
    change in the machine's load touches both; returns the table with the ratio and hit p50."""
    answer, key = hit_bytes(url)
    bare = BareServer(args.workers, answer, key, tmp / "bare.log")
    runs: dict[str, list[WrkResult]] = {"sigprop serve": [], "bare FastAPI": []}
    try:
        bare.wait_ready()
        lua = lua_fixed(HIT_REQUEST)
        for i in range(args.ratio_runs):
            for name, base in (("sigprop serve", server.base), ("bare FastAPI", bare.base)):
                print(f"  hit ratio: {name}, run {i + 1} ...", end="", flush=True, file=sys.stderr)
                res = run_wrk(base + "/v1/solve", lua, args, tmp, f"ratio{i}", 2, 8)
                print(f" {res.rps:.0f} requests/s, p50 {fmt_t(res.pct.get(50))}", file=sys.stderr)
                runs[name].append(res)
    finally:
        bare.stop()
    return ratio_report(runs)


def ratio_report(runs: dict[str, list[WrkResult]]) -> str:
    rows = []
    for name, results in runs.items():
        rows.append(
            [
                name,
                ", ".join(f"{r.rps:,.0f}" for r in results),
                f"{statistics.mean(r.rps for r in results):,.0f}",
                ", ".join(fmt_t(r.pct.get(50)) for r in results),
                str(sum(r.errors for r in results)),
            ]
        )
    ours, bare = (statistics.mean(r.rps for r in rs) for rs in runs.values())
    ratio = ours / bare if bare else 0.0
    # each sigprop run over the bare run right after it: the machine's load drifts less within a pair
    pairs = [a.rps / b.rps for a, b in zip(*runs.values(), strict=False) if b.rps]
    p50 = statistics.median(r.pct.get(50, 1e9) for r in runs["sigprop serve"])
    verdict = "PASS" if ratio >= RATIO_GOAL and p50 < RATIO_P50_GOAL_S else "MISS"
    t = table(["server (wrk -t2 -c8, alternating)", "requests/s per run", "mean", "p50 per run", "errors"], rows, {2})
    return (
        f"hit ratio against the serving stack:\n\n{t}\n\nratio {ratio:.2f} of the means (goal >= {RATIO_GOAL}; "
        f"per pair: {', '.join(f'{p:.2f}' for p in pairs)}), sigprop hit "
        f"p50 at 8 connections {fmt_t(p50)} (goal < {fmt_t(RATIO_P50_GOAL_S)}): {verdict}\n"
    )


RESULT_HEADERS = [
    "case",
    "body",
    "wrk -t/-c",
    "requests/s",
    "p50",
    "p90",
    "p99",
    "server CPU / request",
    "cache hits / misses",
    "errors (non-2xx + socket)",
    "goal",
    "result",
]
EXPLAIN = (
    "Latency is wrk's, per request (closed loop: each connection sends its next request when the "
    "previous answer arrives, so with c connections p50 is about c / throughput). Server CPU / request: "
    "user + system time of the uvicorn worker processes during the run divided by the requests wrk "
    "counted (Redis and wrk not included). Cache hits / misses: the server's own counters "
    "(/metrics, all workers) over the run. Goals: cache hits p50 < 5 ms and >= 1,000 "
    "requests/s with no errors; the 1-connection row is the latency without queueing. The "
    "node-by-node row is the same cache entry as the template rows (same key): the difference is the "
    "cost of receiving, hashing and (on a memo miss) validating and canonicalizing a big graph body."
)


def result_row(result: tuple) -> list:
    """One row of the results table, with the goal and PASS/MISS of the hit cases."""
    label, res, kind, size, threads, conns, cpu, hits_misses = result
    p50_ok = res.pct.get(50, 1e9) < HIT_P50_GOAL_S and res.errors == 0
    if kind == "hit":
        goal = f"p50 < {HIT_P50_GOAL_S * 1e3:g} ms, >= {HIT_RPS_GOAL:,.0f}/s"
        verdict = "PASS" if p50_ok and res.rps >= HIT_RPS_GOAL else "MISS"
    elif kind == "hit-1":
        goal, verdict = f"p50 < {HIT_P50_GOAL_S * 1e3:g} ms (no queueing)", "PASS" if p50_ok else "MISS"
    else:
        goal, verdict = "- (for information)", "-"
    err = str(res.errors) + (f" ({res.non2xx} non-2xx; {res.socket_detail})" if res.socket_errors else "")
    return [
        label,
        size,
        f"{threads}/{conns}",
        f"{res.rps:,.0f}",
        fmt_t(res.pct.get(50)),
        fmt_t(res.pct.get(90)),
        fmt_t(res.pct.get(99)),
        fmt_t(cpu),
        hits_misses,
        err,
        goal,
        verdict,
    ]


def nagle_hint(results: list[tuple]) -> str:
    # One keep-alive connection that waits ~40 ms per answer although the answer costs ~1 ms of CPU:
    # Nagle's algorithm meeting delayed ACKs. Say so, rather than leave a mystery.
    one = next((r for r in results if r[2] == "hit-1"), None)
    if one and 0.038 <= one[1].pct.get(50, 0) <= 0.05 and one[6] is not None and one[6] < 0.01:
        return (
            "Hint: a ~40-48 ms floor on one keep-alive connection while the server spends "
            f"{fmt_t(one[6])} of CPU per request is the signature of Nagle's algorithm meeting delayed ACKs: "
            "the accepted sockets lack TCP_NODELAY (uvicorn --workers N; see bench/README.md)."
        )
    return ""


def report(env: str, results: list[tuple], notes: list[str], profile: str, out_path: str) -> None:
    """Prints the results table, notes and profile, and writes them with wrk's raw output to ``out_path``."""
    rows = [result_row(r) for r in results]
    # --ratio-only: no case table, only the ratio (a note)
    t = f"{table(RESULT_HEADERS, rows, right={1, 2, 3, 4, 5, 6, 7, 8, 9})}\n\n{EXPLAIN}" if rows else ""
    hint = nagle_hint(results)
    raw_out = "\n".join(f"### wrk: {r[0]}\n\n```\n{r[1].raw.strip()}\n```\n" for r in results)
    md = f"# sigprop HTTP benchmark\n\n{env}\n\n{t}\n\n" + "".join(f"* {n}\n" for n in notes)
    if hint:
        md += f"\n{hint}\n"
    if profile:
        md += f"\n## Profile of the cache-hit path\n\n{profile}\n"
    md += f"\n{raw_out}"
    print()
    if t:
        print(f"{t}\n")
    for n in notes:
        print(f"* {n}")
    if hint:
        print(f"\n{hint}")
    if profile:
        print(f"\n{profile}")
    hits = [r for r in rows if r[-1] != "-"]
    if hits:
        print(f"\n{sum(r[-1] == 'PASS' for r in hits)} of {len(hits)} goals met.")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    print(f"written to {out}")


def main_cold_ratio(args) -> int:
    """``--cold-ratio``: ``sigprop serve`` on the embedded store, cold solves against in-process.
    ``--cpu``: this process, and so the server it starts (affinity is inherited), on one CPU."""
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    pinned = f"both sides on CPU {args.cpu}; " if args.cpu is not None else ""
    env = (
        f"python {platform.python_version()}; {machine()}; server: sigprop serve --workers {args.workers}, "
        f"embedded store; {pinned}{sigprop_state(ROOT)}"
    )
    print(env, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="sigprop-cold-ratio-"))
    server = None
    try:
        server = Server(args.workers, None, tmp / "server.log")
        server.wait_ready()
        text, ok = cold_ratio(server.base, args.cold_rounds, args.cold_requests)
        lane = inline_counts(server)
        # a solve past the inline budget (a pause of the API process: a full collection, the VM)
        # closes the lane for ten times its time, and the solves meanwhile cross to a solver process
        text += (
            f"\nthe API process's inline lane: {lane['done']:.0f} solves done, {lane['over_budget']:.0f} over "
            f"budget, {lane['busy']:.0f} busy (the rest in a solver process)\n"
        )
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{text}\n{'goal met' if ok else 'goal missed'}")
    out = Path(args.out).with_name("http_cold_ratio.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# sigprop cold solves, HTTP against in-process\n\n{env}\n\n{text}")
    print(f"written to {out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cold_ratio:
        signal.signal(signal.SIGTERM, _terminate)
        return main_cold_ratio(args)
    status = preflight(args)
    if status is not None:
        return status
    signal.signal(signal.SIGTERM, _terminate)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, _terminate)

    env = environment(args)
    print(env, flush=True)
    sys.stderr.flush()
    tmp = Path(tempfile.mkdtemp(prefix="sigprop-http-bench-"))
    server = None
    results: list[tuple] = []  # (case, WrkResult, kind, body size, wrk -t, wrk -c, CPU s/request, hits/misses)
    notes: list[str] = []
    profile = ""
    try:
        server = Server(args.workers, args.redis_url, tmp / "server.log")
        server.wait_ready()
        profile = run_cases(server, args, tmp, results, notes)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        _flush(args.redis_url)  # the cold solves leave tens of MB of answers in Redis

    report(env, results, notes, profile, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
