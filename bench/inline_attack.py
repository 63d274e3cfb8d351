"""What the inline lane costs others under attack (issue 25's lane, issue 26's threat model).

Small cold solves run in the API process (``service/api/inline_lane.py``) within a cooperative
budget. A client with a valid request can make every one of its solves exhaust that budget: an
unreachable TAT tanh target costs a 100 ms root search. This script runs ``sigprop serve
--workers 2`` (embedded store) twice, with the lane (the default) and without it
(``SIGPROP_INLINE_SOLVE_COST=0``), each time for ``--seconds`` with ``--attackers`` clients sending
such requests back to back, while three other clients measure: a cache hit every 10 ms, ``/readyz``
every 10 ms, and a small cold solve (a new MLP-100 target) every 50 ms. It prints their latencies
side by side, and the lane's counters (``sigprop_inline_solves_total``).

    .venv/bin/python bench/inline_attack.py                 # about 80 s
    .venv/bin/python bench/inline_attack.py --seconds 60 --attackers 8

Everything runs on this machine: on 2 cores the attackers saturate it with or without the lane, so
the maxima say more about the machine than the service; compare the p99 columns.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import Server  # noqa: E402
from report import table  # noqa: E402

MLP = {"template": "mlp", "depth": 100, "width": 512}
HIT = {"graph": MLP, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.9}}


def _attack(base: str, stop: threading.Event, counter) -> None:
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            # past tanh's reach by proof (C''(1) < 4 input_scale^2 C'(1); tests/service/test_inline_lane.py's
            # UNREACHABLE): the root search spends its whole evaluation budget
            tau = 1e8 + next(counter)
            body = {"graph": MLP, "method": "tat", "activation": "tanh", "targets": {"tau": tau}}
            c.post(f"{base}/v1/solve", json=body)


def _probe(base: str, stop: threading.Event, out: list, path: str, body=None, every: float = 0.01, new_target=False):
    n = itertools.count(1)
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            payload = {**HIT, "targets": {"eta": 0.5 + next(n) * 1e-7}} if new_target else body
            start = time.perf_counter()
            if payload is None:
                c.get(base + path)
            else:
                c.post(base + path, json=payload)
            out.append(time.perf_counter() - start)
            time.sleep(every)


def run(inline: bool, seconds: float, attackers: int) -> tuple[dict, str]:
    tmp = Path(tempfile.mkdtemp(prefix="sigprop-inline-attack-"))
    saved = os.environ.get("SIGPROP_INLINE_SOLVE_COST")
    if not inline:
        os.environ["SIGPROP_INLINE_SOLVE_COST"] = "0"
    server = Server(2, None, tmp / "server.log")
    try:
        server.wait_ready()
        base = server.base
        httpx.post(f"{base}/v1/solve", json=HIT, timeout=60)
        stop, counter = threading.Event(), itertools.count()
        hits: list[float] = []
        ready: list[float] = []
        colds: list[float] = []
        threads = [threading.Thread(target=_attack, args=(base, stop, counter)) for _ in range(attackers)]
        threads += [
            threading.Thread(target=_probe, args=(base, stop, hits, "/v1/solve", HIT)),
            threading.Thread(target=_probe, args=(base, stop, ready, "/readyz")),
            threading.Thread(target=_probe, args=(base, stop, colds, "/v1/solve", None, 0.05, True)),
        ]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        lane = [
            line.split("{", 1)[1].replace('"}', "").replace('outcome="', "")
            for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines()
            if line.startswith("sigprop_inline_solves_total{")
        ]
        return {"hits": hits, "readyz": ready, "small cold solves": colds}, ", ".join(lane)
    finally:
        server.stop()
        if saved is None:
            os.environ.pop("SIGPROP_INLINE_SOLVE_COST", None)
        else:
            os.environ["SIGPROP_INLINE_SOLVE_COST"] = saved


def _cell(v: list[float]) -> str:
    ms = sorted(x * 1000 for x in v)
    return f"{statistics.median(ms):.1f} / {ms[int(len(ms) * 0.99)]:.1f} / {ms[-1]:.0f} ms (n {len(ms)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--attackers", type=int, default=4)
    args = ap.parse_args(argv)
    rows, notes = [], []
    results = {}
    for inline in (True, False):
        label = "inline lane" if inline else "no inline lane"
        print(f"running {label} for {args.seconds:g} s ...", file=sys.stderr, flush=True)
        results[label], counters = run(inline, args.seconds, args.attackers)
        notes.append(f"{label}: sigprop_inline_solves_total {counters}")
    for what in ("hits", "readyz", "small cold solves"):
        rows.append([what, *(_cell(results[label][what]) for label in results)])
    print(table(["measured (p50 / p99 / max)", *results], rows, set()))
    print(f"\n{args.attackers} clients sending unreachable TAT tanh targets back to back; " + "; ".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
