"""Where the kernel (Q/C map) theory covers a graph, and what an answer predicts where it does not.

The local Q and C maps of an activation (TAT paper, "Deep Learning without Shortcuts: Shaping the
Kernel with Tailored Rectifiers", arXiv:2203.08120, equations 4-5) are Gaussian expectations: they
describe the activation only when its input is, at infinite width, a zero-mean Gaussian field. A
fresh zero-mean weight matrix makes that so (an affine output is Gaussian given its input), and a
normalized sum or a concatenation of such outputs stays Gaussian. Section 2.3 of the paper restricts
itself to exactly this family: "networks comprising of combined layers, and normalized sums between
the output of multiple affine layers". Everything the answer claims (the global C map, C_f(0),
C''_f(1), q = 1 at the output) is derived under it.

Outside it the claims are wrong at any width, not approximately right. An activation whose input
holds post-activation features (an identity shortcut from an activation, as in post-activation "v1"
residual blocks and torchvision's ResNet; an activation on a shortcut; two activations in a row; a
concatenation carrying an activation's output) sees a skewed, non-zero-mean input, and its output's
mean square drifts from what the Q map says, geometrically over blocks: a v1-style network of 8
blocks solved for C_f(0) = 0.8 measures 0.85 with q near 70 at the output.

``structure_report`` finds every such activation in one pass over the graph (O(nodes + edges)).
Pooling is reported separately: the answer's C map is per spatial location, and average pooling is
exact only when the pooled locations see the same input.

The rules live on the shared floor so that the client can check a graph it extracted from a model
(``sigprop.client.torch.graph_from_module``) with the same rules and messages as the service.
Functions take nodes in topological order, each with ``op`` and ``inputs`` (indices of earlier
nodes): the engine's canonical nodes as they are, a wire graph through ``wire_structure``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import SigpropError
from .graph import Graph

__all__ = [
    "SUBNETWORK_CONVENTION",
    "StructureReport",
    "Violation",
    "check_structure",
    "pooling_warnings",
    "structure_report",
    "wire_structure",
]

_AFFINE = ("dense", "conv")
_MIX = ("sum", "concat")

MAX_NAMED = 6  # nodes named in a message; the count says how many more
SUBNETWORK_CONVENTION = "single-entry single-exit"


@dataclass(frozen=True)
class Violation:
    """An activation whose input is not Gaussian, and why: ``source`` is the activation (or the
    network input) whose output reaches it with no weighted layer between, ``via`` the sum or
    concatenation it travels through (None when it arrives directly)."""

    activation: int
    source: int
    via: int | None


@dataclass(frozen=True)
class StructureReport:
    violations: tuple[Violation, ...]
    avg_pools: tuple[int, ...]
    max_pools: tuple[int, ...]
    convolutional: bool
    ops: tuple[str, ...]  # by node index

    @property
    def holds(self) -> bool:
        return not self.violations


def structure_report(nodes: Sequence) -> StructureReport:
    """Every activation whose input is not an affine output or a normalized sum/concatenation of
    affine outputs (pass-through nodes such as flatten, dropout and pooling are transparent).
    ``nodes``: in topological order, each with ``op`` and ``inputs`` (indices)."""
    # witness[v]: None if v's output is Gaussian, else (source, via) explaining why not
    witness: list[tuple[int, int | None] | None] = [None] * len(nodes)
    violations = []
    for index, nd in enumerate(nodes):
        if nd.op in ("activation", "input"):
            if nd.op == "activation" and witness[nd.inputs[0]] is not None:
                source, via = witness[nd.inputs[0]]
                violations.append(Violation(index, source, via))
            witness[index] = (index, None)
        elif nd.op in _AFFINE:
            witness[index] = None
        elif nd.op in _MIX:
            bad = next((witness[i] for i in nd.inputs if witness[i] is not None), None)
            witness[index] = None if bad is None else (bad[0], index)
        else:  # pass-through: flatten, dropout, identity, pooling, output
            witness[index] = witness[nd.inputs[0]]
    ops = [nd.op for nd in nodes]
    return StructureReport(
        violations=tuple(violations),
        avg_pools=tuple(i for i, op in enumerate(ops) if op in ("avg_pool", "global_avg_pool")),
        max_pools=tuple(i for i, op in enumerate(ops) if op == "max_pool"),
        convolutional="conv" in ops,
        ops=tuple(ops),
    )


@dataclass(frozen=True)
class _WireNode:
    op: str
    inputs: tuple[int, ...]


def wire_structure(graph: Graph) -> tuple[list[str], StructureReport]:
    """The ids (in topological order) and the structure report of a wire graph whose ids and inputs
    are already valid (e.g. one ``schemas.shapes.infer_shapes`` accepted)."""
    by_id = {nd.id: nd for nd in graph.nodes}
    order: list[str] = []
    state: dict[str, int] = {}
    for root in by_id:  # iterative post-order DFS over inputs: a topological order
        stack = [(root, 0)]
        while stack:
            nid, pos = stack.pop()
            if pos == 0 and state.get(nid):
                continue
            state[nid] = 1
            ins = by_id[nid].inputs
            if pos < len(ins):
                stack.append((nid, pos + 1))
                if not state.get(ins[pos]):
                    stack.append((ins[pos], 0))
            else:
                state[nid] = 2
                order.append(nid)
    index = {nid: i for i, nid in enumerate(order)}
    nodes = [_WireNode(by_id[nid].op, tuple(index[i] for i in by_id[nid].inputs)) for nid in order]
    return order, structure_report(nodes)


def _names(ids: Sequence[str], indices) -> str:
    indices = list(indices)
    shown = ", ".join(repr(ids[i]) for i in indices[:MAX_NAMED])
    return shown + (f" and {len(indices) - MAX_NAMED} more" if len(indices) > MAX_NAMED else "")


def _cause(ids: Sequence[str], report: StructureReport, v: Violation) -> tuple[str, str]:
    """(what happens at this activation, the fix) for one violation."""
    act, source = ids[v.activation], ids[v.source]
    if report.ops[v.source] == "input":
        return (
            f"activation {act!r} reads the network input {source!r} with no weighted layer before it",
            "put a dense or conv layer between the input and the first activation",
        )
    if v.via is None:
        return (
            f"activation {act!r} reads the output of activation {source!r} with no weighted layer between",
            "merge the two activations into one, or put a weighted layer between them",
        )
    via = ids[v.via]
    if report.ops[v.via] == "concat":
        return (
            f"activation {act!r} reads concatenation {via!r}, which carries the output of activation {source!r}",
            "end every concatenated branch with a weighted layer (for a DenseNet stem: conv -> pool, "
            "with no activation before the first dense block)",
        )
    return (
        f"activation {act!r} reads sum {via!r}, which adds the output of activation "
        f"{source!r} with no weighted layer on that branch (a post-activation residual block, or an "
        "activation on the shortcut)",
        "use the pre-activation layout (each residual branch starts with its activation and the sum adds "
        "affine outputs, as in the resnet template's version 2), or put a projection (1x1 conv or dense) "
        "on the shortcut",
    )


def check_structure(ids: Sequence[str], report: StructureReport, mode: str) -> list[str]:
    """Raise ``unsupported_structure`` (mode "strict") or return the warnings (mode "warn");
    ``ids`` names the report's nodes by index."""
    if report.holds:
        return []
    first, fix = _cause(ids, report, report.violations[0])
    acts = _names(ids, [v.activation for v in report.violations])
    count = len(report.violations)
    why = (
        "the Q/C maps assume each activation's input is Gaussian: an affine output, or a normalized sum or "
        "concatenation of affine outputs (TAT paper section 2.3); post-activation features are skewed and not "
        "zero-mean, so q drifts from 1 and the C map differs at any width"
    )
    if mode == "strict":
        raise SigpropError(
            "unsupported_structure",
            f"{count} activation(s) outside the kernel theory ({acts}): {first}; {why}",
            f'{fix}; or send "assumptions": "warn" to solve anyway with warnings',
        )
    return [
        f"assumptions not met at {count} activation(s) ({acts}): {first}; {why}. Past these nodes the answer's "
        "predictions do not hold: the global C map (c_map, c_f_0, network_c_f_0, c_curv_1, c_slope_1) and "
        "q = 1 at the output. Fix: " + fix
    ]


def pooling_warnings(ids: Sequence[str], report: StructureReport) -> list[str]:
    out = []
    if report.avg_pools:
        # counted, not named: the warning is the same for every naming of the graph
        out.append(
            f"average pooling ({len(report.avg_pools)} node(s)) is treated as the identity on the Q/C maps, "
            "which is exact only when every pooled location sees the same input: the C map is per spatial "
            "location, and for inputs whose locations differ the pooled output's q and c values differ from it "
            "(cross-location correlations are not modelled)"
        )
    if report.max_pools:
        pools = [ids[i] for i in report.max_pools]
        out.append(
            f"max_pool is not covered by the Q/C map theory and is treated as the identity ({', '.join(pools[:5])})"
        )
    return out
