"""In-process solve time of the ``transformer`` template (issue 28), next to the MLP figures.

Run from the repository root:

    .venv/bin/python bench/transformer_bench.py            # ~10-20 s
    .venv/bin/python bench/transformer_bench.py --repeats 3

Each row is one ``sigprop.solve`` of the request (parse, admission, template expansion, graph
build, TAT on the scalar view, the attention generators, the initializations and the token-kernel
propagation), median of ``--repeats`` runs after one warm-up, with OpenBLAS/MKL at their default
thread count and limited to one thread around the whole solve (the engine runs the token-kernel
propagation on one BLAS thread itself, ``engine.sequence.solve``: on the 2-core machine these
figures come from, shared with other work, BLAS threads mostly wait for each other).

What is computed: the activation (TAT leaky_relu, eta as listed) on the 72- or 12-block stack of
MLP blocks; one E-SPA or U-SPA generator per attention node (``attention.layers``), on the joint
schedule (issue 37: a probe walk of the graph, and for E-SPA one more exact propagation) or the
paper's; the schedule and target;
and the exact infinite-width token kernel of orthonormal input tokens through the whole network:
``token_kernel.output`` (T x T) for T <= 256, else ``token_kernel.leading``, the kernel of the first
256 tokens, exact for any T (attention at initialization is lower triangular or the identity, so a
prefix never reads later tokens). For T = 2048 that is 72 attention steps A K A^T and 72 entrywise
activation maps on 256 x 256 kernels; the full 2048 x 2048 kernel is neither computed nor returned.

The table goes to stdout and, as markdown, to bench/results/transformer_bench.md (git-ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import sigprop

ROOT = Path(__file__).resolve().parent.parent
GOAL_S = 1.0  # issue 28: 72 layers, T = 2048, in-process, under a second


def _transformer(depth: int, seq_len: int, eta: float, shaping: str = "e-spa", schedule: str = "joint") -> dict:
    return {
        "graph": {"template": "transformer", "depth": depth, "seq_len": seq_len, "width": 512, "heads": 8},
        "method": "tat",
        "activation": "leaky_relu",
        "targets": {"eta": eta},
        "attention": {"shaping": shaping, "schedule": schedule},
    }


# The joint schedule (issue 37, the default) against the paper's, same requests. At T = 2048 the
# requested exp(-0.005 |i - j|) has mean correlation 0.176, so the joint schedule needs eta <= 0.176
# (the MLP blocks' floor): eta 0.1 there. SPEED_RATIO: issue 37's "no shaping more than 3x slower
# than E-SPA at T = 256 with 72 blocks".
SPEED_RATIO = 3.0
CASES = [
    ("MLP-100, tat leaky_relu (reference)", {"graph": {"template": "mlp", "depth": 100}, "method": "tat",
                                              "activation": "leaky_relu", "targets": {"eta": 0.9}}, None),
    ("transformer 12 blocks, T = 64, E-SPA joint, eta 0.5", _transformer(12, 64, 0.5), None),
    ("transformer 12 blocks, T = 64, E-SPA paper, eta 0.5", _transformer(12, 64, 0.5, schedule="paper"), None),
    ("transformer 12 blocks, T = 64, U-SPA joint, eta 0.5", _transformer(12, 64, 0.5, "u-spa"), None),
    ("transformer 72 blocks, T = 256, E-SPA joint, eta 0.5", _transformer(72, 256, 0.5), None),
    ("transformer 72 blocks, T = 256, E-SPA paper, eta 0.5", _transformer(72, 256, 0.5, schedule="paper"), None),
    ("transformer 72 blocks, T = 256, U-SPA joint, eta 0.5", _transformer(72, 256, 0.5, "u-spa"), "ratio"),
    ("transformer 72 blocks, T = 256, U-SPA paper, eta 0.5", _transformer(72, 256, 0.5, "u-spa", "paper"), "ratio"),
    ("transformer 72 blocks, T = 2048, E-SPA joint, eta 0.1", _transformer(72, 2048, 0.1), GOAL_S),
    ("transformer 72 blocks, T = 2048, E-SPA paper, eta 0.1", _transformer(72, 2048, 0.1, schedule="paper"), GOAL_S),
    ("transformer 72 blocks, T = 2048, U-SPA joint, eta 0.1", _transformer(72, 2048, 0.1, "u-spa"), GOAL_S),
]  # fmt: skip


def _one_thread():
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=1)


def _time(body: dict, repeats: int) -> tuple[float, sigprop.Solution]:
    answer = sigprop.solve(body)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sigprop.solve(body)
        times.append(time.perf_counter() - start)
    return statistics.median(times), answer


def _computed(answer) -> str:
    tk = answer.token_kernel
    if tk is None:
        return "C map (scalar)"
    k = tk.tokens if tk.output is not None else tk.leading_tokens
    where = "output" if tk.output is not None else "leading"
    return f"{len(answer.attention.layers)} generators, {where} {k}x{k}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    header = "| case | computed | default BLAS threads (s) | 1 BLAS thread (s) | goal |"
    rows = [header, "| --- | --- | ---: | ---: | --- |"]
    met = True
    espa_256 = None
    for label, body, goal in CASES:
        default, answer = _time(body, args.repeats)
        limiter = _one_thread()
        with limiter if limiter is not None else contextlib.nullcontext():
            single = _time(body, args.repeats)[0] if limiter is not None else float("nan")
        best = min(default, single) if limiter is not None else default
        if label.startswith("transformer 72 blocks, T = 256, E-SPA joint"):
            espa_256 = best
        if goal == "ratio":
            ratio = best / espa_256
            verdict = f"{ratio:.2f}x E-SPA joint, < {SPEED_RATIO:g}x: {'met' if ratio < SPEED_RATIO else 'MISSED'}"
            met = met and ratio < SPEED_RATIO
        else:
            verdict = "" if goal is None else (f"< {goal:g} s: {'met' if best < goal else 'MISSED'}")
            met = met and (goal is None or best < goal)
        rows.append(f"| {label} | {_computed(answer)} | {default:.3f} | {single:.3f} | {verdict} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    print("\n" + table)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "transformer_bench.md").write_text(table + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
