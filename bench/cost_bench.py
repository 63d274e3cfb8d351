"""One cost model for every method (issue 26): each method on the adversarial graphs, solved or
refused by price.

Run from the repository root:

    .venv/bin/python bench/cost_bench.py              # every graph and method, ~1-2 minutes
    .venv/bin/python bench/cost_bench.py --quick      # the 3,000-block ladders only
    .venv/bin/python bench/cost_bench.py --methods geometric tat

The graphs (``tests/adversarial_graphs.py``): the issue's ladder (h0 = dense(x), then N blocks of
act -> dense -> sum(d_i, h0)), the input-summing ladder (every block's sum takes the network
input), one sum or concat of many branches, a deep chain given node by node and as the 40-byte
``mlp`` template, a long chain whose end meets its first layer in thousands of sums, thousands of
sums read at the end of a long chain of identity ops, a long chain of average pools, and skips
nested like a U-Net's (each layer joined with its mirror across the network).

Each request first goes through the service's admission with the default settings
(``SolutionService.begin`` without a cache: the body's price, size limits, the graph build): a
refusal is timed there (goal under 50 ms). An admitted request is timed as a solver process runs
it, request validation + graph build + solve + the answer's JSON, with the per-(alpha, beta)
tables cleared first (goal under 3 s, on the wall clock; the CPU time is shown beside it, as it
changes least on a busy shared machine). An answer that is a contract error (an unreachable target)
counts as an answer: its cost was bounded as well. The table goes to stdout and, as markdown, to
bench/results/cost_bench.md (git-ignored).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import fmt_t, machine, sigprop_state, table  # noqa: E402  (bench/ is the script's folder)

from sigprop.api.admission import graph_cost  # noqa: E402
from sigprop.api.solutions import SolutionService  # noqa: E402
from sigprop.engine.maps.qc_maps import clear_caches  # noqa: E402
from sigprop.engine.solve import prepare, solve_canonical  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402
from sigprop.schemas.solve import SolveRequest  # noqa: E402
from sigprop.settings import Settings  # noqa: E402
from tests.adversarial_graphs import (  # noqa: E402
    METHOD_REQUESTS,
    deep_chain,
    fan_in,
    input_ladder,
    ladder,
    late_sums,
    mirrored_skips,
    pool_chain,
    request,
    sums_after_identities,
)

SOLVE_GOAL_S = 3.0
REFUSE_GOAL_S = 0.05


def graphs(quick: bool) -> list[tuple[str, dict]]:
    out = [("ladder 3,000 blocks", ladder(3000)), ("input-summing ladder 3,000 blocks", input_ladder(3000))]
    if quick:
        return out
    return out + [
        ("ladder 6,000 blocks", ladder(6000)),
        ("input-summing ladder 10,000 blocks", input_ladder(10_000)),
        ("sum of 1,024 branches", fan_in(1024)),
        ("concat of 1,024 branches", fan_in(1024, "concat")),
        ("sum of 3,000 branches", fan_in(3000)),
        ("deep chain 10,000 layers, node by node", deep_chain(10_000)),
        ("deep chain 10,000 layers, mlp template", {"template": "mlp", "depth": 10_000, "width": 8}),
        ("chain 8,000 then 3,000 sums with its first layer", late_sums(8000, 3000)),
        ("8,000 identities then 4,000 residual sums", sums_after_identities(8000, 4000)),
        ("12,000 average pools in a chain", pool_chain(12_000)),
        ("mirrored skips (U-Net-like), 1,000 levels", mirrored_skips(1000)),
        ("mirrored skips (U-Net-like), 7,000 levels", mirrored_skips(7000)),
        (
            "densenet-4870 growth 1, template",
            {"template": "densenet", "depth": 4870, "growth_rate": 1, "input_shape": [1, 4, 4]},
        ),
    ]


def admission(service: SolutionService, body: bytes) -> tuple[float, SigpropError] | None:
    """(seconds, the error) when the service refuses the body before solving it, else None."""
    t0 = time.perf_counter()
    try:
        service.begin(body)
    except SigpropError as exc:
        return time.perf_counter() - t0, exc
    except AttributeError:  # admitted and built: it reached the (absent) cache
        return None
    return None


def solve_once(req: dict) -> tuple[float, float, str]:
    """A cold solve as a solver process runs it: (seconds, CPU seconds, "ok" or the contract
    error's code). The CPU time is what a busy shared machine changes least."""
    clear_caches()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        solve_canonical(prepare(SolveRequest.model_validate(req))).to_json()
        outcome = "ok"
    except SigpropError as exc:
        outcome = f"{exc.status} {exc.code}"
    return time.perf_counter() - t0, time.process_time() - c0, outcome


def row(service: SolutionService, label: str, graph: dict, method: str, repeats: int) -> list[str]:
    req = request(graph, method)
    body = json.dumps(req).encode()
    cost = graph_cost(graph)
    size = f"{cost[0]:,} + {cost[1]:,}" if cost else "-"
    refused = admission(service, body)
    if refused is not None:
        t, exc = min((admission(service, body) or refused for _ in range(3)), key=lambda r: r[0])
        ok = t < REFUSE_GOAL_S
        what = f"refused by price in {t * 1000:.1f} ms ({exc.status} {exc.code})"
        return [label, method, f"{len(body):,}", size, what, f"< {REFUSE_GOAL_S * 1000:g} ms", _verdict(ok)]
    runs = [solve_once(req) for _ in range(repeats)]
    t = statistics.median(r[0] for r in runs)
    cpu = statistics.median(r[1] for r in runs)
    what = f"{fmt_t(t)}, CPU {fmt_t(cpu)} ({runs[0][2]})"
    return [label, method, f"{len(body):,}", size, what, f"< {SOLVE_GOAL_S:g} s", _verdict(t < SOLVE_GOAL_S)]


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 3,000-block ladders only")
    ap.add_argument("--repeats", type=int, default=1, help="solves per admitted case (median)")
    ap.add_argument("--methods", nargs="+", default=list(METHOD_REQUESTS), choices=list(METHOD_REQUESTS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cost_bench.md"))
    args = ap.parse_args(argv)
    gc.freeze()  # as a solver process does with what it imported (sigprop.api.solver_preload)
    settings = Settings()
    service = SolutionService(None, 1.0, 1.0, limits=settings.limits())
    env = f"{machine()}; {sigprop_state(ROOT)}; default limits (max cost {settings.max_solve_cost:,} nodes + edges)"
    print(env, flush=True)
    rows = []
    for label, graph in graphs(args.quick):
        for method in args.methods:
            print(f"  {label}, {method} ...", end="", flush=True, file=sys.stderr)
            rows.append(row(service, label, graph, method, args.repeats))
            print(f" {rows[-1][4]}", file=sys.stderr)
    head = ["graph", "method", "body bytes", "nodes + edges", f"answer (median of {args.repeats})", "goal", "result"]
    text = table(head, rows, right={2, 3})
    passed = sum(r[-1] == "PASS" for r in rows)
    print(f"\n{text}\n\n{passed} of {len(rows)} goals met.")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# sigprop cost bench\n\n{env}\n\n{text}\n\n{passed} of {len(rows)} goals met.\n")
    print(f"written to {out}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
