"""Agreement with dks and solve times, in one run, for what dks computes beyond TAT/DKS with one smooth function.

Run from the repository root: ``.venv/bin/python bench/dks_parity_bench.py`` (about 2-5 minutes).

For each case: one sigprop ``solve()`` (request validation included) and one
``dks.base.activation_transform._get_activations_params`` with the ``subnet_max_func`` written for
the same network (tests/engine/test_reference_dks_parity.py builds both), each timed once (dks loads its
cached quadrature roots in a warm-up before the first case; sigprop's time includes request
validation, template expansion and the subnetwork analysis). "max rel" is the largest relative
difference over the parameters (absolute below 1e-10, for parameters that are 0). For ReLU, and
Leaky ReLU with a shifted kink, dks's 100,000-point rule integrates the kink with an O(1/n)
error; "split" reruns dks with its rule split at the kink (dks's algorithm unchanged), which
isolates that error.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine import test_reference_dks_parity as par  # noqa: E402
from tests.engine.test_reference_dks_mixed import FNS, TARGETS, mixed_graph, solve_mixed  # noqa: E402

KEYS = ("negative_slope", "input_scale", "input_shift", "output_scale", "output_shift")


def max_rel(ours: dict, ref: dict) -> float:
    out = 0.0
    for k, v in ref.items():
        d = abs(ours[k] - v)
        out = max(out, d / abs(v) if abs(v) > 1e-10 else d)
    return out


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def dks_timed(names, arch, dks_kw=(), tat_kw=(), split=False):
    par.dks_params.cache_clear()
    return timed(lambda: par.dks_params(tuple(names), arch, tuple(dks_kw), tuple(tat_kw), split))


def single_cases():
    for name in ("relu", "leaky_relu"):
        for zeta in par.ZETAS:
            for arch in par.ARCHS:
                yield f"DKS {name}, zeta {zeta}", name, arch, (("zeta", zeta),), (("c_slope_1_target", zeta),)
    for name in ("softplus", "leaky_relu"):
        for arch in par.ARCHS:
            yield (
                f"DKS {name}, zeta 1.5, local_q_slope 0.97",
                name,
                arch,
                (("local_q_slope", 0.97), ("zeta", 1.5)),
                (("c_slope_1_target", 1.5), ("local_q_slope_target", 0.97)),
            )


def main() -> None:
    par.dks_params(("softplus",), ("mlp", 5), (("c_slope_1_target", 1.5),))  # dks warm-up: quadrature roots
    rows = []
    for label, name, arch, targets, dks_kw in single_cases():
        request = {"graph": par.graph_of(arch), "method": "dks", "activation": name, "targets": dict(targets)}
        sol, t_ours = timed(lambda: par.solve(par.SolveRequest.model_validate(request)))  # noqa: B023
        ours = {k: getattr(sol, k) for k in KEYS if getattr(sol, k) is not None}
        ref, t_dks = dks_timed([name], arch, dks_kw)
        kinked = name == "relu" or (name == "leaky_relu" and abs(ours["input_shift"]) > 1e-10)
        split = f"{max_rel(ours, dks_timed([name], arch, dks_kw, split=True)[0][name]):.1e}" if kinked else ""
        rows.append((label, par.arch_id(arch), name, t_ours, t_dks, f"{max_rel(ours, ref[name]):.1e}", split))
    for method in ("dks", "tat"):
        for arch in par.ARCHS:
            graph = mixed_graph(par.graph_of(arch))
            sol, t_ours = timed(lambda: solve_mixed(graph, method))  # noqa: B023
            _, _, dks_kw, tat_kw = TARGETS[method]
            ref, t_dks = dks_timed(FNS, arch, dks_kw, tat_kw)
            err = max(max_rel(sol.activations[fn].transform(), {k: ref[fn][k] for k in KEYS[1:]}) for fn in FNS)
            target = "zeta 1.5" if method == "dks" else "tau 0.3"
            rows.append(
                (
                    f"{method.upper()} tanh+softplus, {target}",
                    par.arch_id(arch),
                    "both",
                    t_ours,
                    t_dks,
                    f"{err:.1e}",
                    "",
                )
            )
    print("| case | network | function | sigprop s | dks s | max rel vs dks | vs dks, kink split |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for label, arch, name, t1, t2, err, split in rows:
        print(f"| {label} | {arch} | {name} | {t1:.2f} | {t2:.2f} | {err} | {split} |")
    print(f"\nnumpy {np.__version__}; one run per case, on a shared machine")


if __name__ == "__main__":
    main()
