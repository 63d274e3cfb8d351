"""Cold solves over HTTP against the same solves in-process (``http_bench.py --cold-ratio``).

The service's own overhead on a cold request (admission, preparation, the hop to a solver process,
the store write) is what this measures: ``sigprop serve`` with the embedded store (SQLite, no
Redis) answers cold MLP-100 requests one at a time on one keep-alive connection, and
``sigprop.solve`` answers the same kind of request in this process. Every request carries a target
no request before it had (the base value plus a counter times 1e-7), so every HTTP request misses
the cache and is solved and stored. After a warm-up of both sides, the two alternate request by
request (HTTP, in-process, HTTP, ...) so a change in the machine's load touches both, and the
ratio is the median HTTP latency over the median in-process time, per case. Goal (issue 25): at most 1.5.
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
_SETTLE_S = 0.005


def cold_request(method: str, activation: str, target: str, base: float) -> dict:
    """A request no earlier one equals: its target moves by 1e-7 per call."""
    return {
        "graph": MLP,
        "method": method,
        "activation": activation,
        "targets": {target: base + next(_COUNTER) * 1e-7},
    }


class _Http:
    """One keep-alive connection to the server's POST /v1/solve."""

    def __init__(self, base_url: str):
        url = urlparse(base_url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)

    def solve(self, case: tuple) -> float:
        """Seconds a cold request takes, sent to the answer read."""
        label, method, activation, target, value = case
        body = json.dumps(cold_request(method, activation, target, value)).encode()
        start = time.perf_counter()
        self.conn.request("POST", "/v1/solve", body, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        took = time.perf_counter() - start
        if resp.status != 200 or b'"cached":false' not in data:
            raise RuntimeError(f"{label}: expected a cold 200, got {resp.status}: {data[:300]!r}")
        return took

    def close(self) -> None:
        self.conn.close()


def _inprocess(case: tuple) -> float:
    import sigprop

    _, method, activation, target, value = case
    request = cold_request(method, activation, target, value)
    start = time.perf_counter()
    sigprop.solve(request)
    return time.perf_counter() - start


def _pairs(client: _Http, case: tuple, n: int) -> tuple[list[float], list[float]]:
    """``n`` cold requests each way, alternating request by request (HTTP, in-process, ...), so
    both sides see the same load on a shared machine."""
    http_t, local_t = [], []
    for _ in range(n):
        http_t.append(client.solve(case))
        time.sleep(_SETTLE_S)  # the server's work after the answer (its store write) is not timed in-process
        local_t.append(_inprocess(case))
        time.sleep(_SETTLE_S)
    return http_t, local_t


def cold_ratio(base_url: str, rounds: int, n: int) -> tuple[str, bool]:
    """The table of medians and ratios per case, and whether every case met the goal."""
    from report import fmt_t, table

    client = _Http(base_url)
    rows, ok = [], True
    try:
        for case in CASES:  # warm-up: both sides' lazy tables, the solver processes, the store
            _pairs(client, case, 5)
        for case in CASES:
            http_t: list[float] = []
            local_t: list[float] = []
            ratios = []
            for i in range(rounds):
                print(f"  cold ratio: {case[0]}, round {i + 1} ...", end="", flush=True, file=sys.stderr)
                h, p = _pairs(client, case, n)
                http_t += h
                local_t += p
                ratios.append(statistics.median(h) / statistics.median(p))
                print(f" http {fmt_t(statistics.median(h))}, in-process {fmt_t(statistics.median(p))}", file=sys.stderr)
            ok = _row(rows, case, http_t, local_t, ratios) and ok
    finally:
        client.close()
    headers = ["case", "HTTP p50", "in-process p50", "ratio", "ratio per round", f"goal <= {COLD_RATIO_GOAL}"]
    t = table(headers, rows, {1, 2, 3})
    note = (
        f"cold solves, {rounds} rounds of {n} requests per side and case, HTTP and in-process alternating "
        "request by request, every request a new target (HTTP: sigprop serve, embedded store, one "
        "keep-alive connection; in-process: sigprop.solve)"
    )
    return f"{t}\n\n{note}\n", ok


def _row(rows: list, case: tuple, http_t: list[float], local_t: list[float], ratios: list[float]) -> bool:
    from report import fmt_t

    ratio = statistics.median(http_t) / statistics.median(local_t)
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
    return ratio <= COLD_RATIO_GOAL
