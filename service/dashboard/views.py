"""What the dashboard's pages show, computed from stored solutions and validations (no HTTP here).

Everything a page embeds for its plots is built here as plain lists and dicts; the templates put
it into ``<script type="application/json">`` through Jinja's ``tojson`` (which escapes ``<``,
``>``, ``&`` and ``'``) and ``static/dashboard.js`` hands it to plotly. Strings that plotly shows
(trace names, hover text) are HTML-escaped here too, because plotly reads a few tags (``<b>``,
``<br>``) in them: a node id from a corrupted record stays text everywhere. The graph diagram is
SVG that the template writes from the geometry computed in :mod:`.diagram`: paths made of numbers
only, and tooltips that Jinja escapes.

Stored records are read defensively: a legacy or corrupted record (ids the API would refuse, a
request that no longer validates, results of another shape) shows what can be shown, with a
note, and never fails the page.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
import threading
from collections import OrderedDict
from typing import Any, get_args

from ..schemas.solve import Method, Solution
from .diagram import MAX_DIAGRAM_NODES, diagram, wire_nodes

METHODS: tuple[str, ...] = get_args(Method)
MAX_UNTRANSFORMED_NODES = 2000  # larger graphs: the untransformed C map is not computed here
MAX_LAYER_ROWS = 200  # rows of the per-layer initialization table; the JSON has them all
HEX = frozenset("0123456789abcdef")


PARAMETER_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    (
        "Transformed activation",
        ("negative_slope", "input_scale", "input_shift", "output_scale", "output_shift", "tau", "m"),
    ),
    ("Initialization", ("sigma_w2", "sigma_b2", "q_star", "input_second_moment", "logits_scale", "gamma_ratio")),
    (
        "Achieved, recomputed from the answer",
        (
            "c_f_0",
            "network_c_f_0",
            "c_curv_1",
            "c_slope_1",
            "q_1",
            "q_slope_1",
            "local_c_0",
            "local_c_slope_1",
            "local_c_curv_1",
            "v_slope",
            "v_curvature",
            "chi_1",
            "sparsity",
            "only_stable",
        ),
    ),
]
PARAMETER_NOTES = {
    "negative_slope": "TReLU negative slope",
    "input_scale": "alpha in output_scale * (phi(alpha x + beta) + delta)",
    "input_shift": "beta",
    "output_scale": "gamma",
    "output_shift": "delta",
    "tau": "threshold of the sparsifying activation",
    "m": "clip level",
    "sigma_w2": "weight variance scale (weights ~ sigma_w2 / fan_in)",
    "sigma_b2": "bias variance",
    "q_star": "fixed point of the variance map",
    "q_1": "Q(1)",
    "q_slope_1": "Q'(1)",
    "local_c_0": "one layer's C(0)",
    "local_c_slope_1": "one layer's C'(1)",
    "local_c_curv_1": "one layer's C''(1)",
    "v_slope": "V'(q*)",
    "v_curvature": "V''(q*)",
    "chi_1": "chi_1 = C'(1) of one layer",
}


# =============================================================================================
# Formatting (also registered as Jinja filters)
# =============================================================================================


def fmt_num(value: Any, digits: int = 6) -> str:
    """A number with ``digits`` significant digits; booleans and text as they are; None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def fmt_time(epoch: Any) -> str:
    """Epoch seconds as UTC, to the second."""
    try:
        return _dt.datetime.fromtimestamp(float(epoch), _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
        return "-"


def fmt_targets(targets: Any) -> str:
    if not isinstance(targets, dict) or not targets:
        return "-"
    return ", ".join(f"{k} = {fmt_num(v, 4)}" for k, v in targets.items())


def fmt_duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "-"
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=False)


def _dict(value: Any) -> dict:
    """``value`` if it is a dict, else {} (stored records are not trusted to have their shape)."""
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    """``value`` if it is a list, else []."""
    return value if isinstance(value, list) else []


# =============================================================================================
# The list page
# =============================================================================================


def parse_search(text: str | None, activations) -> dict:
    """The search box: a key prefix (hex), or the name of a method or an activation (as if its
    filter were chosen). Anything else matches nothing, with a note saying what it accepts."""
    q = (text or "").strip().lower()
    if not q:
        return {}
    if q in METHODS:
        return {"method": q}
    if q in activations:
        return {"activation": q}
    if set(q) <= HEX:
        return {"key_prefix": q}
    return {"nothing": True}


def pagination(total: int, offset: int, limit: int) -> dict:
    """Offsets of the first, previous, next and last pages (None where there is none)."""
    last = max(0, (total - 1) // limit * limit) if total else 0
    return {
        "total": total,
        "offset": offset,
        "limit": limit,
        "first_row": offset + 1 if total and offset < total else 0,
        "last_row": min(offset + limit, total),
        "page": offset // limit + 1,
        "pages": max(1, -(-total // limit)),
        "first": 0 if offset > 0 else None,
        "prev": max(0, offset - limit) if offset > 0 else None,
        "next": offset + limit if offset + limit < total else None,
        "last": last if offset < last else None,
    }


# =============================================================================================
# The solution page
# =============================================================================================


class _Memo:
    """A small thread-safe LRU for values that are a pure function of a solution key."""

    def __init__(self, size: int = 256):
        self.size, self.data, self.lock = size, OrderedDict(), threading.Lock()

    def get(self, key, compute):
        with self.lock:
            if key in self.data:
                self.data.move_to_end(key)
                return self.data[key]
        value = compute()
        with self.lock:
            self.data[key] = value
            if len(self.data) > self.size:
                self.data.popitem(last=False)
        return value


_UNTRANSFORMED = _Memo()


def _compute_untransformed(request: dict, answer: dict, grid: list[float]) -> list[float]:
    """The global C map of the same graph with the untransformed activation: each layer's local
    C map at q = 1 (the normalized map of phi itself), composed over the graph by the engine."""
    import numpy as np

    from ..engine.maps.activations import get_activation
    from ..engine.maps.qc_maps import HermiteCMap
    from ..engine.network.program import compile_program
    from ..engine.solve import prepare
    from ..requests import parse_solve_request
    from ..schemas.structure import structure_report

    prep = prepare(parse_solve_request(request))
    table = HermiteCMap(get_activation(answer["activation"]))
    # the same composition as the answer's: sums of shared atoms mix over atoms
    program = compile_program(prep.graph, structure_report(prep.graph.nodes))
    return program.global_map(np.asarray(grid, dtype=float), lambda c, _slot: table(c)).tolist()


def c_map_panel(key: str, answer: dict, request: dict, max_nodes: int = MAX_UNTRANSFORMED_NODES) -> dict | None:
    """The global C map against the identity and the untransformed network's (TAT Figure 2)."""
    cm = answer.get("c_map")
    if not isinstance(cm, dict) or not isinstance(cm.get("c"), list):
        return None
    c = cm["c"]
    series = [{"name": "identity (C(c) = c)", "y": c, "dash": "dot", "color": "#868e96"}]
    if isinstance(cm.get("global"), list):
        # zoom: the page insets this curve on its own scale (a TAT curve spans 0.9..1 of [-1, 1])
        series.append(
            {"name": "solved network (global C map)", "y": cm["global"], "color": "#1971c2", "width": 3, "zoom": True}
        )
    if isinstance(cm.get("local"), list):
        series.append(
            {
                "name": "one layer (local C map)",
                "y": cm["local"],
                "color": "#2b8a3e",
                "dash": "dash",
                "visible": "legendonly",
            }
        )
    notes = []
    untransformed = cm.get("untransformed")
    method = answer.get("method")
    if isinstance(untransformed, list):
        notes.append("the untransformed network's C map is the answer's own (c_map.untransformed)")
    elif method not in ("tat", "dks"):
        notes.append(
            f"{method} does not transform the activation, so there is no untransformed network to "
            "compare with: the plot shows the network's C map at this initialization"
        )
    else:
        nodes = _dict(answer.get("graph_summary")).get("nodes")
        nodes = nodes if isinstance(nodes, int) else 0
        if nodes > max_nodes:
            notes.append(
                f"the untransformed network's C map is not in this answer and is not computed here for a "
                f"graph of {nodes:,} nodes (limit {max_nodes:,}): the plot shows what the answer has"
            )
        else:
            try:
                untransformed = _UNTRANSFORMED.get(key, lambda: _compute_untransformed(request, answer, c))
                notes.append(
                    f"the untransformed network's C map was computed here with the engine: the same graph "
                    f"with plain {answer.get('activation')}, each layer's C map taken at q = 1"
                )
            except Exception as exc:  # noqa: BLE001 - a stored request that no longer solves: show the rest
                untransformed = None
                notes.append(f"the untransformed network's C map could not be computed ({type(exc).__name__})")
    if isinstance(untransformed, list):
        series.append({"name": "untransformed network", "y": untransformed, "color": "#c92a2a", "width": 2})
    return {"c": c, "series": series, "notes": notes}


def v_map_panel(answer: dict) -> dict | None:
    """Sparse EoC: V(q) against the identity with the fixed points marked (sparsity paper Fig. 2)."""
    vm = answer.get("v_map")
    if not isinstance(vm, dict) or not isinstance(vm.get("q"), list) or not isinstance(vm.get("v"), list):
        return None
    qs = [q for q in vm["q"] if isinstance(q, (int, float))]
    top = max(qs) if qs else 0.0
    points = [
        fp for fp in _list(answer.get("fixed_points")) if isinstance(fp, dict) and isinstance(fp.get("q"), (int, float))
    ]
    shown = [fp for fp in points if fp["q"] <= top * 1.0001]
    return {
        "q": vm["q"],
        "v": vm["v"],
        "q_star": answer.get("q_star"),
        "stable": [fp["q"] for fp in shown if fp.get("stable")],
        "unstable": [fp["q"] for fp in shown if not fp.get("stable")],
        "fixed_points": points,
        "hidden": len(points) - len(shown),
    }


def gr_panel(answer: dict) -> dict | None:
    """Geometric: each weighted layer's GR scaling gamma and multiplier alpha (GR paper)."""
    layers = [la for la in _list(answer.get("layers")) if isinstance(la, dict) and la.get("gamma") is not None]
    if not layers:
        return None
    return {
        "x": list(range(1, len(layers) + 1)),
        "gamma": [la["gamma"] for la in layers],
        "alpha": [la.get("alpha") for la in layers],
        "text": [_esc(la.get("id")) for la in layers],
        "gamma_ratio": answer.get("gamma_ratio"),
    }


def parameter_groups(answer: dict) -> list[dict]:
    fields = Solution.model_fields
    groups = []
    for title, names in PARAMETER_GROUPS:
        rows = [
            {
                "name": n,
                "value": answer[n],
                "note": PARAMETER_NOTES.get(n) or (fields[n].description if n in fields else None) or "",
            }
            for n in names
            if answer.get(n) is not None
        ]
        if rows:
            groups.append({"title": title, "rows": rows})
    return groups


def solution_view(
    key: str,
    record: dict,
    max_diagram_nodes: int = MAX_DIAGRAM_NODES,
    max_untransformed_nodes: int = MAX_UNTRANSFORMED_NODES,
) -> dict:
    """Everything the solution page shows, from ``SolutionService.get``'s record."""
    answer = record.get("answer") if isinstance(record.get("answer"), dict) else {}
    request = record.get("request") if isinstance(record.get("request"), dict) else {}
    nodes, why_not = wire_nodes(request)
    graph = diagram(nodes, max_diagram_nodes) if nodes else None
    layers = [la for la in _list(answer.get("layers")) if isinstance(la, dict)]
    geometric = any(la.get("gamma") is not None for la in layers)
    return {
        "key": key,
        "record": record,
        "answer": answer,
        "request": request,
        "summary": _dict(answer.get("graph_summary")) or _dict(record.get("graph_summary")),
        "parameters": parameter_groups(answer),
        "warnings": [w for w in _list(answer.get("warnings")) if isinstance(w, str)],
        "jacobian": _dict(answer.get("jacobian")) or None,
        "trainable": _dict(answer.get("trainable")) or None,
        "layers": layers[:MAX_LAYER_ROWS],
        "layers_total": len(layers),
        "geometric": geometric,
        "graph_note": why_not,
        "graph": graph,
        "plots": {
            "c_map": c_map_panel(key, answer, request, max_untransformed_nodes),
            "v_map": v_map_panel(answer),
            "gr": gr_panel(answer),
        },
    }


# =============================================================================================
# The validation page
# =============================================================================================


def _curve(obj: Any) -> dict | None:
    if isinstance(obj, dict) and isinstance(obj.get("steps"), list) and isinstance(obj.get("values"), list):
        return {"steps": obj["steps"], "values": obj["values"]}
    return None


def progress_view(job: dict) -> dict:
    """The part of a job the page polls: status, progress (with a percentage), times, error."""
    progress = job.get("progress") if isinstance(job.get("progress"), dict) else {}
    step, total = progress.get("step"), progress.get("total")
    percent = None
    if isinstance(step, (int, float)) and isinstance(total, (int, float)) and total > 0:
        percent = max(0.0, min(100.0, 100.0 * step / total))
    if job.get("status") == "finished":
        percent = 100.0
    return {
        "id": job.get("id"),
        "status": job.get("status"),
        "progress": progress,
        "percent": percent,
        "created": job.get("created"),
        "started": job.get("started"),
        "ended": job.get("ended"),
        "error": job.get("error"),
        "device": job.get("device"),
        "attempts": job.get("attempts"),
    }


def validation_view(job: dict) -> dict:
    """Everything the validation page shows: the runs' curves, gradient norms per layer at the
    first and the last recorded step, empirical C values against the predicted one; for a
    character-level LM validation (``task`` 'charlm') the validation-loss curves of its arms."""
    results = job.get("results") if isinstance(job.get("results"), dict) else {}
    runs = results.get("runs") if isinstance(results.get("runs"), dict) else {}
    loss, accuracy, grads, cvalues, rows, validation_loss = [], [], [], [], [], []
    for name, run in runs.items():
        if not isinstance(run, dict):
            continue
        rows.append(
            {
                "name": name,
                "description": run.get("description"),
                "final_test_accuracy": run.get("final_test_accuracy"),
                "final_test_loss": run.get("final_test_loss"),
                "final_train_loss": run.get("final_train_loss"),
                "steps_done": run.get("steps_done"),
                "diverged": run.get("diverged"),
                "wall_time_s": run.get("wall_time_s"),
                "parameters": run.get("parameters"),
                "error": (run.get("error") or {}).get("message") if isinstance(run.get("error"), dict) else None,
            }
        )
        # plot labels are escaped (plotly reads a few tags in them); table cells are escaped by Jinja
        if (c := _curve(run.get("loss"))) is not None:
            loss.append({"name": _esc(name), **c})
        if (c := _curve(run.get("test_accuracy"))) is not None:
            accuracy.append({"name": _esc(name), **c})
        if (c := _curve(run.get("validation_loss"))) is not None:
            validation_loss.append({"name": _esc(name), **c})
        grads.extend(_grad_series(name, run.get("grad_norms")))
        if (cv := _c_series(name, run.get("c_values"))) is not None:
            cvalues.append(cv)
    summary = results.get("summary") if isinstance(results.get("summary"), dict) else {}
    request = job.get("request") if isinstance(job.get("request"), dict) else {}
    task = results.get("task") or request.get("task")
    return {
        "task": task if task in ("classify", "charlm") else "classify",
        "job": job,
        "status": progress_view(job),
        "request": request,
        "results": results,
        "runs": rows,
        "summary_text": summary.get("text") if isinstance(summary.get("text"), str) else None,
        "config": results.get("config") if isinstance(results.get("config"), dict) else None,
        "dataset": results.get("dataset") if isinstance(results.get("dataset"), dict) else None,
        "plots": {
            "loss": loss,
            "accuracy": accuracy,
            "grad_norms": grads,
            "c_values": cvalues,
            "validation_loss": validation_loss,
        },
        "has_results": bool(results),
    }


def _grad_series(name: str, records: Any) -> list[dict]:
    """Per-layer gradient norms of one run at its first and last recorded steps."""
    if not isinstance(records, list):
        return []
    good = [r for r in records if isinstance(r, dict) and isinstance(r.get("norms"), dict) and r["norms"]]
    picked = good[:1] + (good[-1:] if len(good) > 1 else [])
    out = []
    for r in picked:
        ids = list(r["norms"])
        out.append(
            {
                "name": _esc(f"{name}, step {r.get('step')}"),
                "run": _esc(name),
                "layers": [_esc(i) for i in ids],
                "x": list(range(1, len(ids) + 1)),
                "y": [r["norms"][i] for i in ids],
                "last": r is picked[-1] and len(picked) > 1,
            }
        )
    return out


def _c_series(name: str, cv: Any) -> dict | None:
    """Empirical C values per weighted layer for orthogonal inputs, and the predicted output value."""
    if not isinstance(cv, dict) or not isinstance(cv.get("layers"), dict):
        return None
    ids = list(cv["layers"])
    return {
        "name": _esc(name),
        "label": name,
        "layers": [_esc(i) for i in ids],
        "x": list(range(1, len(ids) + 1)),
        "y": [cv["layers"][i] for i in ids],
        "output": cv.get("output"),
        "predicted": cv.get("predicted_output"),
        "deviation": cv.get("deviation"),
        "site": str(cv.get("output_site") or ""),
    }
