"""One character-level LM validation (``"task": "charlm"``, issue 28), run in process: a skipless,
normalization-free transformer with E-SPA + TAT leaky_relu against the same transformer with
shortcuts (solved, normalization-free) and a standard pre-LN transformer, same steps, batches,
optimizer and schedule (``sigprop.worker.charlm``).

Run from the repository root:

    .venv/bin/python bench/charlm_bench.py                         # depth 8, width 64, T 64, 300 steps
    .venv/bin/python bench/charlm_bench.py --depth 12 --width 128 --steps 1000

The table (final train / validation loss per arm, in nats per byte, and wall time) goes to stdout;
the whole result (curves included) to bench/results/charlm_bench.json (git-ignored). docs/benchmarks.md
quotes a measured run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sigprop.engine.solve import solve
from sigprop.engine.templates.expand import expand_template
from sigprop.schemas.graph import Template
from sigprop.schemas.solve import SolveRequest
from sigprop.worker.charlm import run_charlm_validation

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--eta", type=float, default=0.3, help="TAT's eta for the MLP blocks' leaky_relu")
    ap.add_argument("--shaping", default="e-spa")
    ap.add_argument("--arms", default="solved,shortcuts,standard")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="train only these arms (comma-separated): one process per arm")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "charlm_bench.json"))
    args = ap.parse_args()

    template = {
        "template": "transformer",
        "depth": args.depth,
        "seq_len": args.seq_len,
        "width": args.width,
        "heads": args.heads,
    }
    sreq = {
        "graph": template,
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": args.eta},
        "attention": {"shaping": args.shaping},
    }
    sol = solve(SolveRequest.model_validate(sreq))
    graph = expand_template(Template.model_validate(template), max_nodes=100_000).model_dump(
        mode="json", by_alias=True, exclude_none=True
    )
    request = {
        "solve": sreq,
        "task": "charlm",
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "arms": args.arms.split(","),
    }
    if args.lr is not None:
        request["lr"] = args.lr
    last = [0.0]

    def progress(p: dict) -> None:
        if time.monotonic() - last[0] > 30:
            last[0] = time.monotonic()
            print(f"  {p['run']}: step {p['run_step']}/{p['run_total']} loss {p['loss']}", flush=True)

    t0 = time.perf_counter()
    only = tuple(args.only.split(",")) if args.only else None
    res = run_charlm_validation(request, graph, sol, progress=progress, only_arms=only)
    wall = time.perf_counter() - t0
    cfg = res["config"]
    print(
        f"\ncharlm: depth {args.depth}, width {args.width}, heads {args.heads}, seq_len {args.seq_len}, "
        f"{cfg['steps']} steps x batch {cfg['batch_size']}, {cfg['optimizer']} lr {cfg['lr']:g} "
        f"(warm-up {cfg['warmup_steps']}, cosine), clip {cfg['clip_norm']}, seed {args.seed}, "
        f"torch threads {torch.get_num_threads()}, corpus {res['dataset']['digest'][:12]} "
        f"({res['dataset']['n_train']} + {res['dataset']['n_validation']} bytes), wall {wall:.0f} s\n"
    )
    print("| arm | final train loss | final validation loss | bits/byte | next-byte acc | diverged | train s |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, run in res["runs"].items():
        if "error" in run:
            print(f"| {name} | error: {run['error']['message']} | | | | | |")
            continue
        print(
            f"| {name} | {run['final_train_loss']:.4f} | {run['final_validation_loss']:.4f} | "
            f"{run['final_validation_bits_per_byte']:.3f} | {run['final_test_accuracy']:.3f} | {run['diverged']} | "
            f"{run['train_time_s']:.0f} |"
        )
    print("\nvalidation loss along training (step: " + ", ".join(res["runs"]) + ")")
    runs = [r for r in res["runs"].values() if "validation_loss" in r]
    for i, step in enumerate(runs[0]["validation_loss"]["steps"] if runs else []):
        print(f"  {step}: " + ", ".join(f"{r['validation_loss']['values'][i]:.3f}" for r in runs))
    print("\n" + res["summary"]["text"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
