"""``bench/http_bench.py --profile``: py-spy the server's workers under cache hits and split the
samples into categories of where the time goes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from report import fmt_t, table  # bench/ is the script's folder on sys.path
from wrk import cpu_seconds, run_wrk

if TYPE_CHECKING:
    from bench_server import Server

# Where a sample of a worker's stack goes: the first category with a frame matching one of its
# patterns (py-spy raw stacks: "function (file:line)" joined by ";").
PROFILE_CATEGORIES = [
    (
        "hit from this process's memory (solve_fastpath middleware, storage/hot.py)",
        ["SolveFastPath", "hot_hit", "storage/hot.py"],
    ),
    ("re-validate cached answer (Solution.model_validate_json in _lookup)", ["model_validate_json"]),
    ("personalize_json (relabel #placeholders, cached flag)", ["personalize_json"]),
    ("cache get (Redis EVAL get_answer, redis-py)", ["get_answer", "(redis/"]),
    (
        "parse JSON / validate request / prepare: expand template, build_graph, key (memo miss)",
        ["_load_json", "parse_solve_request", "prepare (", "build_graph", "expand_template", "request_key"],
    ),
    ("service other (sha256 of body, memo lookup)", ["SolutionService.solve"]),
    ("prometheus metrics (multiprocess mmap files)", ["prometheus_client"]),
    ("JSON request log line", ["(logging/", "JsonFormatter"]),
    ("read request body", ["Request.body", "limited_receive", "RequestResponseCycle.receive"]),
    (
        "send response (h11 serialize, socket write)",
        ["RequestResponseCycle.send", "Response.__call__", "_SelectorSocketTransport.write"],
    ),
    ("parse HTTP request (uvicorn h11 data_received)", ["H11Protocol", "HttpToolsProtocol", "(h11/", "_read_ready"]),
    (
        "thread-pool hand-off (run_in_executor, futures, wake-ups)",
        [
            "concurrent/futures",
            "run_in_executor",
            "call_soon_threadsafe",
            "_write_to_self",
            "_read_from_self",
            "wait_for",
            "(threading.py",
        ],
    ),
    (
        "FastAPI/Starlette routing and middleware",
        ["(fastapi/", "(starlette/", "observability.py", "api/app.py", "proxy_headers"],
    ),
    ("asyncio event loop", ["(asyncio/", "selectors.py"]),
]


def categorize(raw_files: list[Path]) -> tuple[int, dict[str, int]]:
    counts: dict[str, int] = {}
    total = 0
    for f in raw_files:
        for line in f.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            stack, _, n = line.rpartition(" ")
            try:
                n = int(n)
            except ValueError:
                continue
            total += n
            cat = next((c for c, pats in PROFILE_CATEGORIES if any(p in stack for p in pats)), "other")
            counts[cat] = counts.get(cat, 0) + n
    return total, counts


def profile_hits(server: Server, url: str, lua: str, args, tmp: Path) -> str:
    """py-spy (GIL samples) of every worker under the cache-hit load, split into categories."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists() and shutil.which(spy) is None:
        return "py-spy is not installed: `.venv/bin/pip install py-spy`, then run with --profile again."
    workers = server.pids()
    seconds = max(3, args.duration - 4)
    outs = [tmp / f"pyspy_{pid}.txt" for pid in workers]
    spies = []
    try:
        for pid, out in zip(workers, outs, strict=False):
            spies.append(
                subprocess.Popen(
                    [
                        spy,
                        "record",
                        "-p",
                        str(pid),
                        "-d",
                        str(seconds),
                        "-r",
                        "200",
                        "-f",
                        "raw",
                        "--gil",
                        "--nonblocking",
                        "-o",
                        str(out),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        cpu0, t0 = cpu_seconds(workers), time.monotonic()
        res = run_wrk(url, lua, args, tmp, "profile", args.threads, args.connections)
        cpu1, wall = cpu_seconds(workers), time.monotonic() - t0
        errors = []
        for p in spies:
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                err = b"timed out"
            if p.returncode:
                errors.append(err.decode(errors="replace").strip()[-300:])
    finally:
        for p in spies:
            if p.poll() is None:
                p.kill()
                p.wait()
    total, counts = categorize([o for o in outs if o.exists()])
    if not total:
        return "py-spy recorded no samples (it needs ptrace rights: root, or CAP_SYS_PTRACE): " + "; ".join(errors)
    per_request = (cpu1 - cpu0) / res.requests if cpu0 is not None and cpu1 is not None and res.requests else None
    busy = (
        f"; the workers were busy {(cpu1 - cpu0) / (wall * len(workers)) * 100:.0f}% of the wall time"
        if per_request is not None
        else ""
    )
    rows = [
        [cat, f"{n / total * 100:.1f}%", fmt_t(per_request * n / total) if per_request else "-"]
        for cat, n in sorted(counts.items(), key=lambda kv: -kv[1])
    ]
    return (
        f"py-spy --gil, {total} samples of {len(workers)} workers over {seconds} s while wrk sent cache hits "
        f"({res.rps:,.0f} requests/s under the profiler, {fmt_t(per_request)} of worker CPU per request{busy}). "
        "Share: of the samples, i.e. of the time a worker held the GIL (its Python CPU time); per request: "
        "that share of the measured CPU per request.\n\n" + table(["where", "share", "per request"], rows, right={1, 2})
    )
