"""Cold solves over HTTP against the same solves in-process (``http_bench.py --cold-ratio``).

The service's own overhead on a cold request (admission, preparation, the hop to a solver process,
the store write) is what this measures: ``sigprop serve`` with the embedded store (SQLite, no
Redis) answers cold MLP-100 requests one at a time on one keep-alive connection, and
``sigprop.solve`` answers the same kind of request in this process. Every request carries a target
no request before it had (the base value plus a counter times 1e-7), so every HTTP request misses
the cache and is solved and stored. After a warm-up of both sides, the runs alternate (HTTP batch,
in-process batch, HTTP batch, ...) so a change in the machine's load touches both, and the ratio
is the median HTTP latency over the median in-process time, per case. Goal (issue 25): at most 1.5.
"""

from __future__ import annotations

import http.client
import itertools
import json
import statistics
import sys
import time
from urllib.parse import urlparse

COLD_RATIO_GOAL = 1.5
MLP = {"template": "mlp", "depth": 100, "width": 512}
# (label, method, activation, target name, base value)
CASES = (
    ("TAT softplus mlp-100", "tat", "softplus", "tau", 0.3),
    ("DKS swish mlp-100", "dks", "swish", "zeta", 1.5),
    ("TAT leaky_relu mlp-100", "tat", "leaky_relu", "eta", 0.9),
)
_COUNTER = itertools.count(1)


def cold_request(method: str, activation: str, target: str, base: float) -> dict:
    """A request no earlier one equals: its target moves by 1e-7 per call."""
    return {
        "graph": MLP,
        "method": method,
        "activation": activation,
        "targets": {target: base + next(_COUNTER) * 1e-7},
    }


def _http_times(base_url: str, case: tuple, n: int) -> list[float]:
    """Latency of ``n`` cold requests, one at a time on one keep-alive connection."""
    _, method, activation, target, value = case
    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    times = []
    try:
        for _ in range(n):
            body = json.dumps(cold_request(method, activation, target, value)).encode()
            start = time.perf_counter()
            conn.request("POST", "/v1/solve", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            times.append(time.perf_counter() - start)
            if resp.status != 200 or b'"cached":false' not in data:
                raise RuntimeError(f"{case[0]}: expected a cold 200, got {resp.status}: {data[:300]!r}")
    finally:
        conn.close()
    return times


def _inprocess_times(case: tuple, n: int) -> list[float]:
    import sigprop

    _, method, activation, target, value = case
    times = []
    for _ in range(n):
        request = cold_request(method, activation, target, value)
        start = time.perf_counter()
        sigprop.solve(request)
        times.append(time.perf_counter() - start)
    return times


def cold_ratio(base_url: str, rounds: int, n: int) -> tuple[str, bool]:
    """The table of medians and ratios per case, and whether every case met the goal."""
    from report import fmt_t, table

    for case in CASES:  # warm-up: both sides' lazy tables, the solver processes, the store
        _http_times(base_url, case, 3)
        _inprocess_times(case, 3)
    rows, ok = [], True
    for case in CASES:
        http_t: list[float] = []
        local_t: list[float] = []
        ratios = []
        for i in range(rounds):
            print(f"  cold ratio: {case[0]}, round {i + 1} ...", end="", flush=True, file=sys.stderr)
            h = _http_times(base_url, case, n)
            p = _inprocess_times(case, n)
            http_t += h
            local_t += p
            ratios.append(statistics.median(h) / statistics.median(p))
            print(f" http {fmt_t(statistics.median(h))}, in-process {fmt_t(statistics.median(p))}", file=sys.stderr)
        ratio = statistics.median(http_t) / statistics.median(local_t)
        ok = ok and ratio <= COLD_RATIO_GOAL
        rows.append(
            [
                case[0],
                fmt_t(statistics.median(http_t)),
                fmt_t(statistics.median(local_t)),
                f"{ratio:.2f}",
                ", ".join(f"{r:.2f}" for r in ratios),
                "PASS" if ratio <= COLD_RATIO_GOAL else "MISS",
            ]
        )
    headers = ["case", "HTTP p50", "in-process p50", "ratio", "ratio per round", f"goal <= {COLD_RATIO_GOAL}"]
    t = table(headers, rows, {1, 2, 3})
    note = (
        f"cold solves, {rounds} alternating rounds of {n} requests per side and case, every request a new "
        "target (HTTP: sigprop serve, embedded store, one keep-alive connection; in-process: sigprop.solve)"
    )
    return f"{t}\n\n{note}\n", ok
