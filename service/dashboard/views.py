"""What the dashboard's pages show, computed from stored solutions and validations (no HTTP here).

Everything a page embeds for its plots is built here as plain lists and dicts; the templates put
it into ``<script type="application/json">`` through Jinja's ``tojson`` (which escapes ``<``,
``>``, ``&`` and ``'``) and ``static/dashboard.js`` hands it to plotly. Strings that plotly shows
(trace names, hover text) are HTML-escaped here too, because plotly reads a few tags (``<b>``,
``<br>``) in them: a node id from a corrupted record stays text everywhere. The graph diagram is
SVG that the template writes from the geometry computed here: paths made of numbers only, and
tooltips that Jinja escapes.

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

METHODS: tuple[str, ...] = get_args(Method)
MAX_DIAGRAM_NODES = 1000      # larger graphs: the diagram shows the input end, this many nodes
MAX_UNTRANSFORMED_NODES = 2000  # larger graphs: the untransformed C map is not computed here
MAX_LAYER_ROWS = 200          # rows of the per-layer initialization table; the JSON has them all
# the diagram's geometry, in pixels: spacing between levels and rows (shrunk down to the minimum
# for long or wide graphs), and the size it aims at before it scrolls
DIAGRAM_DX, DIAGRAM_MIN_DX, DIAGRAM_DY, DIAGRAM_MIN_DY = 30.0, 9.0, 28.0, 8.0
DIAGRAM_WIDTH, DIAGRAM_HEIGHT, DIAGRAM_PAD = 1180.0, 320.0, 16.0
HEX = frozenset("0123456789abcdef")

# one colour per op, so the diagram's legend reads as the graph's vocabulary
OP_COLORS = {
    "input": "#2b8a3e", "output": "#c92a2a", "dense": "#1971c2", "conv": "#1864ab", "activation": "#f08c00",
    "sum": "#7048e8", "concat": "#ae3ec9", "avg_pool": "#0b7285", "max_pool": "#0c8599",
    "global_avg_pool": "#15aabf", "flatten": "#868e96", "dropout": "#adb5bd", "identity": "#868e96",
}
OP_SHAPES = {"input": "diamond", "output": "diamond", "sum": "sum", "concat": "square", "activation": "triangle"}
NODE_ATTRS = ("units", "channels", "kernel", "stride", "padding", "fn", "weights", "shape", "rate", "bias")

PARAMETER_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("Transformed activation", ("negative_slope", "input_scale", "input_shift", "output_scale", "output_shift",
                                "tau", "m")),
    ("Initialization", ("sigma_w2", "sigma_b2", "q_star", "input_second_moment", "logits_scale", "gamma_ratio")),
    ("Achieved, recomputed from the answer", ("c_f_0", "network_c_f_0", "c_curv_1", "c_slope_1", "q_1", "q_slope_1",
                                              "local_c_0", "local_c_slope_1", "local_c_curv_1", "v_slope",
                                              "v_curvature", "chi_1", "sparsity", "only_stable")),
]
PARAMETER_NOTES = {
    "negative_slope": "TReLU negative slope", "input_scale": "alpha in output_scale * (phi(alpha x + beta) + delta)",
    "input_shift": "beta", "output_scale": "gamma", "output_shift": "delta", "tau": "threshold of the sparsifying activation",
    "m": "clip level", "sigma_w2": "weight variance scale (weights ~ sigma_w2 / fan_in)", "sigma_b2": "bias variance",
    "q_star": "fixed point of the variance map", "q_1": "Q(1)", "q_slope_1": "Q'(1)", "local_c_0": "one layer's C(0)",
    "local_c_slope_1": "one layer's C'(1)", "local_c_curv_1": "one layer's C''(1)", "v_slope": "V'(q*)",
    "v_curvature": "V''(q*)", "chi_1": "chi_1 = C'(1) of one layer",
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
        "total": total, "offset": offset, "limit": limit,
        "first_row": offset + 1 if total and offset < total else 0, "last_row": min(offset + limit, total),
        "page": offset // limit + 1, "pages": max(1, -(-total // limit)),
        "first": 0 if offset > 0 else None, "prev": max(0, offset - limit) if offset > 0 else None,
        "next": offset + limit if offset + limit < total else None, "last": last if offset < last else None,
    }


# =============================================================================================
# The graph diagram: layered by longest path from the inputs
# =============================================================================================

def wire_nodes(request: Any) -> tuple[list[dict], str | None]:
    """The solved graph's nodes as plain dicts (a template expanded), or ([], why not)."""
    graph = request.get("graph") if isinstance(request, dict) else None
    if isinstance(graph, dict) and "template" in graph:
        from pydantic import ValidationError

        from ..engine.templates import expand_template
        from ..errors import SigpropError
        from ..schemas.graph import Template
        try:
            expanded = expand_template(Template.model_validate(graph))
        except (ValidationError, SigpropError) as exc:
            return [], f"the stored template no longer expands ({type(exc).__name__})"
        return [nd.model_dump(mode="json", by_alias=True, exclude_none=True) for nd in expanded.nodes], None
    nodes = graph.get("nodes") if isinstance(graph, dict) else None
    if not isinstance(nodes, list):
        return [], "the stored request has no graph to draw"
    return [nd for nd in nodes if isinstance(nd, dict)], None


def _levels(nodes: list[dict]) -> tuple[list[int], list[list[int]], list[int]]:
    """(topological order, predecessors, level): level 0 for sources, else 1 + the deepest
    predecessor's (the longest path from an input). Nodes on a cycle, which a valid graph never
    has, are left out of the order."""
    index: dict[str, int] = {}
    for i, nd in enumerate(nodes):
        index.setdefault(str(nd.get("id")), i)
    preds = []
    for nd in nodes:
        ins = nd.get("inputs")
        preds.append([index[str(s)] for s in ins if str(s) in index] if isinstance(ins, list) else [])
    users: list[list[int]] = [[] for _ in nodes]
    indegree = [len(p) for p in preds]
    for i, p in enumerate(preds):
        for j in p:
            users[j].append(i)
    ready = [i for i, d in enumerate(indegree) if d == 0]
    order: list[int] = []
    level = [0] * len(nodes)
    while ready:
        i = ready.pop()
        order.append(i)
        for u in users[i]:
            level[u] = max(level[u], level[i] + 1)
            indegree[u] -= 1
            if indegree[u] == 0:
                ready.append(u)
    return order, preds, level


def _title(nd: dict) -> str:
    """The node's tooltip: id, op, attributes and inputs, one per line (plain text: the template
    escapes it)."""
    lines = [str(nd.get("id")), f"op: {nd.get('op')}"]
    for attr in NODE_ATTRS:
        if attr in nd:
            lines.append(f"{attr}: {nd[attr]}")
    ins = nd.get("inputs")
    if isinstance(ins, list) and ins:
        lines.append("inputs: " + ", ".join(str(s) for s in ins[:6]) + (f", ... ({len(ins)} in all)" if len(ins) > 6 else ""))
    return "\n".join(lines)


def diagram(nodes: list[dict], max_nodes: int = MAX_DIAGRAM_NODES) -> dict:
    """The graph as SVG geometry (the page draws it on the server: thousands of nodes cost the
    browser nothing like a plotting library would). x is the level, the longest path from an
    input; the nodes of a level are ordered by the mean position of their inputs (fewer crossings)
    and centred; edges that skip levels (shortcuts, dense connections) are arcs, so they do not
    hide behind the nodes they pass. Graphs over ``max_nodes`` show their first levels, with a note."""
    order, preds, level = _levels(nodes)
    notes = []
    if len(order) < len(nodes):
        notes.append(f"{len(nodes) - len(order)} node(s) sit on a cycle and are not drawn")
    shown = order
    levels_total = max((level[i] for i in order), default=-1) + 1
    if len(order) > max_nodes:
        by_level = sorted(order, key=lambda i: level[i])
        cut = level[by_level[max_nodes]]  # the first level that no longer fits whole
        shown = [i for i in order if level[i] < cut]
        if len(shown) < max_nodes // 2:  # a very wide level: take part of it rather than stop short of it
            shown = by_level[:max_nodes]
        last = max(level[i] for i in shown)
        notes.append(f"the graph has {len(nodes):,} nodes: the diagram shows the {len(shown):,} nearest the input "
                     f"(levels 0 to {last:,} of {levels_total:,})")
    keep = set(shown)
    slot = _positions(shown, preds, level)
    levels_shown = max((level[i] for i in shown), default=0) + 1
    half = max((abs(v) for v in slot.values()), default=0.0)
    # spacing shrinks for long or wide graphs so the drawing stays a few thousand pixels at most
    dx = max(DIAGRAM_MIN_DX, min(DIAGRAM_DX, DIAGRAM_WIDTH / max(levels_shown, 1)))
    dy = max(DIAGRAM_MIN_DY, min(DIAGRAM_DY, DIAGRAM_HEIGHT / max(2 * half + 1, 1)))
    top = DIAGRAM_PAD + dy * (half + 1.2)  # room above the middle row for the arcs

    def xy(i: int) -> tuple[float, float]:
        return DIAGRAM_PAD + level[i] * dx, top + slot[i] * dy

    drawn, ops = [], {}
    for i in shown:
        op = str(nodes[i].get("op"))
        x, y = xy(i)
        known = op in OP_COLORS
        ops.setdefault(op if known else "other", OP_COLORS.get(op, "#495057"))
        shape = OP_SHAPES.get(op, "circle")
        drawn.append({"x": round(x, 1), "y": round(y, 1), "d": _shape_path(shape, x, y), "shape": shape,
                      "color": OP_COLORS.get(op, "#495057"), "title": _title(nodes[i])})
    lines, arcs = [], []
    for i in shown:
        x1, y1 = xy(i)
        for j in preds[i]:
            if j not in keep:
                continue
            x0, y0 = xy(j)
            if level[i] - level[j] <= 1:
                lines.append(f"M{x0:.1f},{y0:.1f}L{x1:.1f},{y1:.1f}")
            else:  # an arc above both ends, higher for longer skips
                lift = dy * (0.9 + 0.12 * min(level[i] - level[j], 12))
                arcs.append(f"M{x0:.1f},{y0:.1f}Q{(x0 + x1) / 2:.1f},{min(y0, y1) - 2 * lift:.1f} {x1:.1f},{y1:.1f}")
    width = 2 * DIAGRAM_PAD + (levels_shown - 1) * dx
    height = top + dy * (half + 0.8) + DIAGRAM_PAD + 14
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10**9) if s * dx >= 36)
    ticks = [{"x": round(DIAGRAM_PAD + lv * dx, 1), "label": lv} for lv in range(0, levels_shown, step)]
    return {"nodes": drawn, "lines": "".join(lines), "arcs": "".join(arcs), "width": round(width, 1),
            "height": round(height, 1), "axis_y": round(height - 10, 1), "ticks": ticks, "notes": notes,
            "legend": [{"op": op, "color": color} for op, color in ops.items()],
            "levels": levels_total, "count": len(nodes), "shown": len(shown)}


def _shape_path(shape: str, x: float, y: float) -> str:
    """A node's marker as one absolute SVG path (numbers only). Plain paths rather than <use> of a
    shared shape: each <use> is a shadow tree, and with 2,000 of them the page's warm load in
    chromium went from 103 ms to 147 ms (bench/dashboard_bench.py)."""
    if shape == "diamond":
        return f"M{x:.1f},{y - 6.5:.1f}l6.5,6.5l-6.5,6.5l-6.5,-6.5z"
    if shape == "triangle":
        return f"M{x - 4.5:.1f},{y - 5.5:.1f}l10.5,5.5l-10.5,5.5z"
    if shape == "square":
        return f"M{x - 4.5:.1f},{y - 4.5:.1f}h9v9h-9z"
    circle = f"M{x - 5.5:.1f},{y:.1f}a5.5,5.5 0 1,0 11,0a5.5,5.5 0 1,0 -11,0z"
    if shape == "sum":  # a circle with a plus cut out of it (fill-rule evenodd)
        return circle + f"M{x - 3.5:.1f},{y - 0.8:.1f}h2.7v-2.7h1.6v2.7h2.7v1.6h-2.7v2.7h-1.6v-2.7h-2.7z"
    return f"M{x - 5:.1f},{y:.1f}a5,5 0 1,0 10,0a5,5 0 1,0 -10,0z"


def _positions(shown: list[int], preds: list[list[int]], level: list[int]) -> dict[int, float]:
    """Each node's row within its level: centred on 0, ordered by the mean row of its inputs."""
    by_level: dict[int, list[int]] = {}
    for i in shown:
        by_level.setdefault(level[i], []).append(i)
    y: dict[int, float] = {}
    for lv in sorted(by_level):
        members = by_level[lv]

        def barycentre(i: int) -> float:
            placed = [y[j] for j in preds[i] if j in y]
            return sum(placed) / len(placed) if placed else 0.0
        members.sort(key=lambda i: (barycentre(i), i))
        mid = (len(members) - 1) / 2
        for rank, i in enumerate(members):
            y[i] = rank - mid
    return y


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

    from ..engine.activations import get_activation
    from ..engine.qc_maps import HermiteCMap
    from ..engine.solve import prepare
    from ..engine.subnetworks import compile_subnetworks
    from ..requests import parse_solve_request

    prep = prepare(parse_solve_request(request))
    table = HermiteCMap(get_activation(answer["activation"]))
    program = compile_subnetworks(prep.graph)
    return program.global_map(np.asarray(grid, dtype=float), lambda c, _slot: table(c)).tolist()


def c_map_panel(key: str, answer: dict, request: dict, max_nodes: int = MAX_UNTRANSFORMED_NODES) -> dict | None:
    """The global C map against the identity and the untransformed network's (TAT Figure 2)."""
    cm = answer.get("c_map")
    if not isinstance(cm, dict) or not isinstance(cm.get("c"), list):
        return None
    c = cm["c"]
    series = [{"name": "identity (C(c) = c)", "y": c, "dash": "dot", "color": "#868e96"}]
    if isinstance(cm.get("global"), list):
        series.append({"name": "solved network (global C map)", "y": cm["global"], "color": "#1971c2", "width": 3})
    if isinstance(cm.get("local"), list):
        series.append({"name": "one layer (local C map)", "y": cm["local"], "color": "#2b8a3e", "dash": "dash",
                       "visible": "legendonly"})
    notes = []
    untransformed = cm.get("untransformed")
    method = answer.get("method")
    if isinstance(untransformed, list):
        notes.append("the untransformed network's C map is the answer's own (c_map.untransformed)")
    elif method not in ("tat", "dks"):
        notes.append(f"{method} does not transform the activation, so there is no untransformed network to "
                     "compare with: the plot shows the network's C map at this initialization")
    else:
        nodes = _dict(answer.get("graph_summary")).get("nodes")
        nodes = nodes if isinstance(nodes, int) else 0
        if nodes > max_nodes:
            notes.append(f"the untransformed network's C map is not in this answer and is not computed here for a "
                         f"graph of {nodes:,} nodes (limit {max_nodes:,}): the plot shows what the answer has")
        else:
            try:
                untransformed = _UNTRANSFORMED.get(key, lambda: _compute_untransformed(request, answer, c))
                notes.append(f"the untransformed network's C map was computed here with the engine: the same graph "
                             f"with plain {answer.get('activation')}, each layer's C map taken at q = 1")
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
    points = [fp for fp in _list(answer.get("fixed_points")) if isinstance(fp, dict) and isinstance(fp.get("q"), (int, float))]
    shown = [fp for fp in points if fp["q"] <= top * 1.0001]
    return {"q": vm["q"], "v": vm["v"], "q_star": answer.get("q_star"),
            "stable": [fp["q"] for fp in shown if fp.get("stable")],
            "unstable": [fp["q"] for fp in shown if not fp.get("stable")],
            "fixed_points": points, "hidden": len(points) - len(shown)}


def gr_panel(answer: dict) -> dict | None:
    """Geometric: each weighted layer's GR scaling gamma and multiplier alpha (GR paper)."""
    layers = [la for la in _list(answer.get("layers")) if isinstance(la, dict) and la.get("gamma") is not None]
    if not layers:
        return None
    return {"x": list(range(1, len(layers) + 1)), "gamma": [la["gamma"] for la in layers],
            "alpha": [la.get("alpha") for la in layers], "text": [_esc(la.get("id")) for la in layers],
            "gamma_ratio": answer.get("gamma_ratio")}


def parameter_groups(answer: dict) -> list[dict]:
    fields = Solution.model_fields
    groups = []
    for title, names in PARAMETER_GROUPS:
        rows = [{"name": n, "value": answer[n],
                 "note": PARAMETER_NOTES.get(n) or (fields[n].description if n in fields else None) or ""}
                for n in names if answer.get(n) is not None]
        if rows:
            groups.append({"title": title, "rows": rows})
    return groups


def solution_view(key: str, record: dict, max_diagram_nodes: int = MAX_DIAGRAM_NODES,
                  max_untransformed_nodes: int = MAX_UNTRANSFORMED_NODES) -> dict:
    """Everything the solution page shows, from ``SolutionService.get``'s record."""
    answer = record.get("answer") if isinstance(record.get("answer"), dict) else {}
    request = record.get("request") if isinstance(record.get("request"), dict) else {}
    nodes, why_not = wire_nodes(request)
    graph = diagram(nodes, max_diagram_nodes) if nodes else None
    layers = [la for la in _list(answer.get("layers")) if isinstance(la, dict)]
    geometric = any(la.get("gamma") is not None for la in layers)
    return {
        "key": key, "record": record, "answer": answer, "request": request,
        "summary": _dict(answer.get("graph_summary")) or _dict(record.get("graph_summary")),
        "parameters": parameter_groups(answer),
        "warnings": [w for w in _list(answer.get("warnings")) if isinstance(w, str)],
        "jacobian": _dict(answer.get("jacobian")) or None, "trainable": _dict(answer.get("trainable")) or None,
        "layers": layers[:MAX_LAYER_ROWS], "layers_total": len(layers), "geometric": geometric,
        "graph_note": why_not, "graph": graph,
        "plots": {"c_map": c_map_panel(key, answer, request, max_untransformed_nodes),
                  "v_map": v_map_panel(answer), "gr": gr_panel(answer)},
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
    return {"id": job.get("id"), "status": job.get("status"), "progress": progress, "percent": percent,
            "created": job.get("created"), "started": job.get("started"), "ended": job.get("ended"),
            "error": job.get("error"), "device": job.get("device"), "attempts": job.get("attempts")}


def validation_view(job: dict) -> dict:
    """Everything the validation page shows: the runs' curves, gradient norms per layer at the
    first and the last recorded step, empirical C values against the predicted one."""
    results = job.get("results") if isinstance(job.get("results"), dict) else {}
    runs = results.get("runs") if isinstance(results.get("runs"), dict) else {}
    loss, accuracy, grads, cvalues, rows = [], [], [], [], []
    for name, run in runs.items():
        if not isinstance(run, dict):
            continue
        rows.append({"name": name, "description": run.get("description"),
                     "final_test_accuracy": run.get("final_test_accuracy"), "final_test_loss": run.get("final_test_loss"),
                     "steps_done": run.get("steps_done"), "diverged": run.get("diverged"),
                     "wall_time_s": run.get("wall_time_s"), "parameters": run.get("parameters"),
                     "error": (run.get("error") or {}).get("message") if isinstance(run.get("error"), dict) else None})
        # plot labels are escaped (plotly reads a few tags in them); table cells are escaped by Jinja
        if (c := _curve(run.get("loss"))) is not None:
            loss.append({"name": _esc(name), **c})
        if (c := _curve(run.get("test_accuracy"))) is not None:
            accuracy.append({"name": _esc(name), **c})
        grads.extend(_grad_series(name, run.get("grad_norms")))
        if (cv := _c_series(name, run.get("c_values"))) is not None:
            cvalues.append(cv)
    summary = results.get("summary") if isinstance(results.get("summary"), dict) else {}
    request = job.get("request") if isinstance(job.get("request"), dict) else {}
    return {
        "job": job, "status": progress_view(job), "request": request, "results": results,
        "runs": rows, "summary_text": summary.get("text") if isinstance(summary.get("text"), str) else None,
        "config": results.get("config") if isinstance(results.get("config"), dict) else None,
        "dataset": results.get("dataset") if isinstance(results.get("dataset"), dict) else None,
        "plots": {"loss": loss, "accuracy": accuracy, "grad_norms": grads, "c_values": cvalues},
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
        out.append({"name": _esc(f"{name}, step {r.get('step')}"), "run": _esc(name), "layers": [_esc(i) for i in ids],
                    "x": list(range(1, len(ids) + 1)), "y": [r["norms"][i] for i in ids],
                    "last": r is picked[-1] and len(picked) > 1})
    return out


def _c_series(name: str, cv: Any) -> dict | None:
    """Empirical C values per weighted layer for orthogonal inputs, and the predicted output value."""
    if not isinstance(cv, dict) or not isinstance(cv.get("layers"), dict):
        return None
    ids = list(cv["layers"])
    return {"name": _esc(name), "label": name, "layers": [_esc(i) for i in ids], "x": list(range(1, len(ids) + 1)),
            "y": [cv["layers"][i] for i in ids], "output": cv.get("output"), "predicted": cv.get("predicted_output"),
            "deviation": cv.get("deviation"), "site": str(cv.get("output_site") or "")}
