"""The token-kernel price of U-SPA and E-SPA transformers against their measured solve times, two
solves at once (issue 35: U-SPA took 2-3 times its price, its generators' BLAS running outside
the one-thread guard).

    .venv/bin/python bench/attention_price_bench.py               # about a minute
    .venv/bin/python bench/attention_price_bench.py --concurrency 1 --cases u-spa:100:256

Each case is solved as a solver process solves it (parse, admission, template expansion, build,
solve, the answer's JSON) in ``--concurrency`` processes at once, each with BLAS at its library's
default thread count, as an API process left it before the fix, after one warm-up solve (``engine.limits.token_work`` is
the price, in ns of one core; ``preparation.solve_price`` converts it for the lanes). It prints the
slowest of the concurrent solves, the price, and their ratio, with the machine's load.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = ["e-spa:30:256", "u-spa:30:256", "e-spa:100:256", "u-spa:100:256", "u-spa:100:128", "u-spa:190:256"]


def request(shaping: str, depth: int, seq_len: int) -> dict:
    graph = {"template": "transformer", "depth": depth, "seq_len": seq_len, "width": 512, "heads": 8}
    targets = {"eta": 0.9}
    return {
        "graph": graph,
        "method": "tat",
        "activation": "leaky_relu",
        "targets": targets,
        "attention": {"shaping": shaping},
    }


def _solve(case: str, out) -> None:
    from sigprop.engine.limits import token_work
    from sigprop.engine.solve import solve_canonical
    from sigprop.preparation import prepare_data
    from sigprop.schemas.ops import ATTENTION
    from sigprop.settings import Settings

    shaping, depth, seq_len = case.split(":")
    lifted = Settings(max_token_work=10**12).limits()
    solve_canonical(prepare_data(request(shaping, 30, 16), lifted))  # warm: lazy imports, tables
    start = time.perf_counter()
    # the token-work budget lifted: the price is compared with the time whether or not it admits
    prep = prepare_data(request(shaping, int(depth), int(seq_len)), lifted)
    solve_canonical(prep).to_json()
    took = time.perf_counter() - start
    g = prep.graph
    attention = sum(1 for nd in g.nodes if nd.kind == ATTENTION)
    out.put((took, token_work(int(seq_len), attention, g.n - attention, shaping)))


def measure(case: str, concurrency: int) -> tuple[float, float]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_solve, args=(case, out)) for _ in range(concurrency)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return max(r[0] for r in results), results[0][1]


def _admitted(work: int) -> str:
    from sigprop.settings import Settings

    return "yes" if work <= Settings().max_token_work else "no (413)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=CASES, help="shaping:blocks:T")
    args = ap.parse_args(argv)
    print(f"load {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, {args.concurrency} solves at once")
    print("| case | solve (slowest) | price | solve / price | admitted |\n| --- | --- | --- | --- | --- |")
    for case in args.cases:
        took, work = measure(case, args.concurrency)
        price = work / 1e9
        print(f"| {case} | {took:.2f} s | {price:.2f} s | {took / price:.2f} | {_admitted(work)} |", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
