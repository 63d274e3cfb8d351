"""The solution page's graph diagram: SVG geometry, layered by longest path from the inputs.

The page draws the graph on the server: x is a node's level (the longest path from an input),
the nodes of a level are ordered by the mean position of their inputs and centred, and edges that
skip levels are arcs. Paths are made of numbers only; tooltips are plain text the template escapes.
"""

from __future__ import annotations

from typing import Any

from ..schemas.ops import ACT, CONCAT, OP_TABLE, SOURCE, SUM

MAX_DIAGRAM_NODES = 1000  # larger graphs: the diagram shows the input end, this many nodes
# the diagram's geometry, in pixels: spacing between levels and rows (shrunk down to the minimum
# for long or wide graphs), and the size it aims at before it scrolls
DIAGRAM_DX, DIAGRAM_MIN_DX, DIAGRAM_DY, DIAGRAM_MIN_DY = 30.0, 9.0, 28.0, 8.0
DIAGRAM_WIDTH, DIAGRAM_HEIGHT, DIAGRAM_PAD = 1180.0, 320.0, 16.0

# one colour per op (its row's), so the diagram's legend reads as the graph's vocabulary
OP_COLORS = {op: row.color for op, row in OP_TABLE.items()}
# a marker per kind (a circle for the others); the output, the contract's one terminal node, as the input
KIND_SHAPES = {SOURCE: "diamond", SUM: "sum", CONCAT: "square", ACT: "triangle"}
OP_SHAPES = {op: KIND_SHAPES[row.kind] for op, row in OP_TABLE.items() if row.kind in KIND_SHAPES} | {
    "output": "diamond"
}
NODE_ATTRS = (
    "units",
    "channels",
    "kernel",
    "stride",
    "padding",
    "fn",
    "weights",
    "shape",
    "rate",
    "bias",
    "sequence",
    "heads",
    "causal",
)


def wire_nodes(request: Any) -> tuple[list[dict], str | None]:
    """The solved graph's nodes as plain dicts (a template expanded), or ([], why not)."""
    graph = request.get("graph") if isinstance(request, dict) else None
    if isinstance(graph, dict) and "template" in graph:
        from pydantic import ValidationError

        from ..engine.templates.expand import expand_template
        from ..errors import SigpropError
        from ..schemas.graph import Template
        from ..settings import offline_limits

        try:
            expanded = expand_template(Template.model_validate(graph), max_nodes=offline_limits().max_nodes)
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
        lines.append(
            "inputs: " + ", ".join(str(s) for s in ins[:6]) + (f", ... ({len(ins)} in all)" if len(ins) > 6 else "")
        )
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
    levels_total = max((level[i] for i in order), default=-1) + 1
    shown = _shown(nodes, order, level, max_nodes, levels_total, notes)
    slot = _positions(shown, preds, level)
    levels_shown = max((level[i] for i in shown), default=0) + 1
    half = max((abs(v) for v in slot.values()), default=0.0)
    # spacing shrinks for long or wide graphs so the drawing stays a few thousand pixels at most
    dx = max(DIAGRAM_MIN_DX, min(DIAGRAM_DX, DIAGRAM_WIDTH / max(levels_shown, 1)))
    dy = max(DIAGRAM_MIN_DY, min(DIAGRAM_DY, DIAGRAM_HEIGHT / max(2 * half + 1, 1)))
    # room above the top row for the highest arc (an arc peaks ``_lift`` above its higher end)
    top = DIAGRAM_PAD + dy * (half + max(1.2, _lift(_longest_skip(shown, preds, level), 1.0) + 0.4))

    def xy(i: int) -> tuple[float, float]:
        return DIAGRAM_PAD + level[i] * dx, top + slot[i] * dy

    drawn, ops = _markers(nodes, shown, xy)
    lines, arcs = _edges(shown, preds, level, xy, dy)
    width = 2 * DIAGRAM_PAD + (levels_shown - 1) * dx
    height = top + dy * (half + 0.8) + DIAGRAM_PAD + 14
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10**9) if s * dx >= 36)
    ticks = [{"x": round(DIAGRAM_PAD + lv * dx, 1), "label": lv} for lv in range(0, levels_shown, step)]
    return {
        "nodes": drawn,
        "lines": "".join(lines),
        "arcs": "".join(arcs),
        "width": round(width, 1),
        "height": round(height, 1),
        "axis_y": round(height - 10, 1),
        "ticks": ticks,
        "notes": notes,
        "legend": [{"op": op, "color": color} for op, color in ops.items()],
        "levels": levels_total,
        "count": len(nodes),
        "shown": len(shown),
    }


def _shown(
    nodes: list[dict], order: list[int], level: list[int], max_nodes: int, levels_total: int, notes: list[str]
) -> list[int]:
    """The nodes drawn: all of ``order``, or over ``max_nodes`` the first levels (a note says so)."""
    if len(order) <= max_nodes:
        return order
    by_level = sorted(order, key=lambda i: level[i])
    cut = level[by_level[max_nodes]]  # the first level that no longer fits whole
    shown = [i for i in order if level[i] < cut]
    if len(shown) < max_nodes // 2:  # a very wide level: take part of it rather than stop short of it
        shown = by_level[:max_nodes]
    last = max(level[i] for i in shown)
    notes.append(
        f"the graph has {len(nodes):,} nodes: the diagram shows the {len(shown):,} nearest the input "
        f"(levels 0 to {last:,} of {levels_total:,})"
    )
    return shown


def _markers(nodes: list[dict], shown: list[int], xy) -> tuple[list[dict], dict[str, str]]:
    """(one marker per shown node, the legend's colour per op in order of appearance)."""
    drawn, ops = [], {}
    for i in shown:
        op = str(nodes[i].get("op"))
        x, y = xy(i)
        known = op in OP_COLORS
        ops.setdefault(op if known else "other", OP_COLORS.get(op, "#495057"))
        shape = OP_SHAPES.get(op, "circle")
        drawn.append(
            {
                "x": round(x, 1),
                "y": round(y, 1),
                "d": _shape_path(shape, x, y),
                "shape": shape,
                "color": OP_COLORS.get(op, "#495057"),
                "title": _title(nodes[i]),
            }
        )
    return drawn, ops


def _edges(shown: list[int], preds: list[list[int]], level: list[int], xy, dy: float) -> tuple[list[str], list[str]]:
    """(straight edges between neighbouring levels, arcs over longer skips) as SVG path pieces."""
    keep = set(shown)
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
                lift = _lift(level[i] - level[j], dy)
                arcs.append(f"M{x0:.1f},{y0:.1f}Q{(x0 + x1) / 2:.1f},{min(y0, y1) - 2 * lift:.1f} {x1:.1f},{y1:.1f}")
    return lines, arcs


def _lift(skip: int, dy: float) -> float:
    """How far an arc over ``skip`` levels rises above its higher end (its control point sits twice
    as high); 0 for an edge between neighbouring levels, which is a straight line."""
    return dy * (0.9 + 0.12 * min(skip, 12)) if skip > 1 else 0.0


def _longest_skip(shown: list[int], preds: list[list[int]], level: list[int]) -> int:
    keep = set(shown)
    return max((level[i] - level[j] for i in shown for j in preds[i] if j in keep), default=0)


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
