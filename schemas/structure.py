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

``structure_report`` finds every such activation, and every sum that adds a feature to something
correlated with it, from one linear pass that writes each node over independent atoms
(``atoms.atom_pass``): the patterns above are what that pass finds, not a list it checks. The same
pass finds sums an atom reaches through several paths and the scale that renormalizes them.
Pooling is reported separately: the answer's C map is per spatial location, and average pooling is
exact only when the pooled locations see the same input.

The rules live on the shared floor so that the client can check a graph it extracted from a model
(``sigprop.client.torch.graph_from_module``) with the same rules and messages as the service.
Functions take nodes in topological order, each with ``op`` and ``inputs`` (indices of earlier
nodes): the engine's canonical nodes as they are, a wire graph through ``wire_structure``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .atoms import AtomPass, BadSum, atom_pass
from .errors import SigpropError
from .graph import Graph
from .ops import ACT, AFFINE, CONCAT, EXACT, MAX_PAIR, OP_TABLE, PRODUCT, SOURCE, SUM, row_at

__all__ = [
    "SUBNETWORK_CONVENTION",
    "StructureReport",
    "Violation",
    "check_structure",
    "dropout_notes",
    "pooling_warnings",
    "structure_report",
    "sum_scale_notes",
    "wire_structure",
]

MAX_NAMED = 6  # nodes named in a message; the count says how many more
SUBNETWORK_CONVENTION = "single-entry single-exit"


@dataclass(frozen=True)
class Violation:
    """An activation whose input is not Gaussian, and why: ``source`` is the feature (an activation's
    output or the network input) that reaches it with no weighted layer between, ``via`` the sum or
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
    # sums with no exact Gaussian description (a feature added to something correlated with it)
    bad_sums: tuple[BadSum, ...] = ()
    # sum node -> factor on its weights that restores the normalized sum (shared atoms)
    sum_scales: dict = field(default_factory=dict)
    # sums an atom reaches through several paths: their C map composes atom by atom
    shared_sums: frozenset = frozenset()
    atoms: AtomPass | None = None
    dropouts: tuple[int, ...] = ()  # dropout nodes with a non-zero rate

    @property
    def holds(self) -> bool:
        return not self.violations and not self.bad_sums

    @property
    def flagged(self) -> list[int]:
        """The nodes named as outside the theory: the activations, then the sums."""
        return [v.activation for v in self.violations] + [b.node for b in self.bad_sums]


def _attrs(nd) -> dict:
    return getattr(nd, "attrs", None) or {}


def structure_report(nodes: Sequence) -> StructureReport:
    """Every activation whose input is not a Gaussian combination of atoms, and every sum with no
    exact Gaussian description, from one ``atoms.atom_pass`` (O(nodes + edges) for the usual
    architectures, bounded before it starts). ``nodes``: in topological order, each with ``op``,
    ``inputs`` (indices) and, for sums and dropout, ``attrs`` (``weights``, ``rate``)."""
    ops = tuple(nd.op for nd in nodes)
    rows = [OP_TABLE[op] for op in ops]
    found = atom_pass(
        ops,
        [nd.inputs for nd in nodes],
        [_attrs(nd).get("weights") if row.kind == SUM else None for nd, row in zip(nodes, rows, strict=True)],
    )
    violations = []
    for index, nd in enumerate(nodes):
        # an activation or a max pair (a fixed nonlinearity) reads a Gaussian input, or it is outside the theory
        if rows[index].kind in (ACT, MAX_PAIR) and found.witness[nd.inputs[0]] is not None:
            source, via = found.witness[nd.inputs[0]]
            violations.append(Violation(index, source, via))
    return StructureReport(
        violations=tuple(violations),
        avg_pools=tuple(i for i, row in enumerate(rows) if row.pool == "mean"),
        max_pools=tuple(i for i, row in enumerate(rows) if row.pool == "max"),
        convolutional=any(row.kind == AFFINE and row.spatial for row in rows),
        ops=ops,
        bad_sums=found.bad_sums,
        sum_scales=found.scales,
        shared_sums=found.shared,
        atoms=found,
        # random nodes that are on (a dropout at a positive rate): their row's coverage is not exact there
        dropouts=tuple(
            i for i, row in enumerate(rows) if row.stochastic and row.coverage(_attrs(nodes[i]), ()).verdict != EXACT
        ),
    )


@dataclass(frozen=True)
class _WireNode:
    op: str
    inputs: tuple[int, ...]
    attrs: dict


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
    ops = _resolved_ops(graph, order, by_id)
    nodes = [
        _WireNode(
            ops[nid],
            tuple(index[i] for i in by_id[nid].inputs),
            {k: getattr(by_id[nid], k) for k in ("weights", "rate") if hasattr(by_id[nid], k)},
        )
        for nid in order
    ]
    return order, structure_report(nodes)


def _resolved_ops(graph: Graph, order: list[str], by_id: dict) -> dict[str, str]:
    """Each node's row op: a wire op with a ``features`` row resolves by its input's shape (``ops.row_at``)."""
    ops = {nid: by_id[nid].op for nid in order}
    if not any(OP_TABLE[op].features for op in ops.values()):
        return ops
    from .shapes import infer_shapes  # shapes import this floor's ops only; loaded where needed

    shapes = infer_shapes(graph)
    for nid, op in ops.items():
        ins = by_id[nid].inputs
        if OP_TABLE[op].features and ins and ins[0] in shapes:
            ops[nid] = row_at(op, [shapes[ins[0]]]).op
    return ops


def _names(ids: Sequence[str], indices) -> str:
    indices = list(indices)
    shown = ", ".join(repr(ids[i]) for i in indices[:MAX_NAMED])
    return shown + (f" and {len(indices) - MAX_NAMED} more" if len(indices) > MAX_NAMED else "")


_PREACT_FIX = (
    "use the pre-activation layout (each residual branch starts with its activation and the sum adds "
    "affine outputs, as in the resnet template's version 2; for a torchvision-style PyTorch ResNet, "
    "sigprop.client.torch.normalization_free(model, preactivation=True) rewrites it so), or put a projection "
    "(1x1 conv or dense) on the shortcut"
)


def _cause(ids: Sequence[str], report: StructureReport, v: Violation) -> tuple[str, str]:
    """(what happens at this activation, the fix) for one violation."""
    act, source = ids[v.activation], ids[v.source]
    if OP_TABLE[report.ops[v.activation]].kind == MAX_PAIR:  # a max_pool of feature pairs: a fixed nonlinearity
        return (
            f"max_pool {act!r} pairs features of {source!r}, which is not Gaussian (the network input, or a "
            "feature with no weighted layer between): its closed form holds for Gaussian entries only",
            "put a dense layer before the max_pool (max(a, b) of two units of one dense layer is exact)",
        )
    if OP_TABLE[report.ops[v.source]].kind == SOURCE:
        return (
            f"activation {act!r} reads the network input {source!r} with no weighted layer before it",
            "put a dense or conv layer between the input and the first activation",
        )
    if v.via is None and OP_TABLE[report.ops[v.source]].kind == PRODUCT:
        return (
            f"activation {act!r} reads the product {source!r} with no weighted layer between (a product of two "
            "streams is not Gaussian)",
            "put a dense layer after the mul node (a gated MLP's down projection) before any activation",
        )
    if v.via is None:
        return (
            f"activation {act!r} reads the output of activation {source!r} with no weighted layer between",
            "merge the two activations into one, or put a weighted layer between them",
        )
    via = ids[v.via]
    if OP_TABLE[report.ops[v.via]].kind == CONCAT:
        return (
            f"activation {act!r} reads concatenation {via!r}, which carries the output of activation {source!r}",
            "end every concatenated branch with a weighted layer (for a DenseNet stem: conv -> pool, "
            "with no activation before the first dense block)",
        )
    return (
        f"activation {act!r} reads sum {via!r}, which adds the output of activation "
        f"{source!r} with no weighted layer on that branch (a post-activation residual block, or an "
        "activation on the shortcut)",
        _PREACT_FIX,
    )


def _sum_cause(ids: Sequence[str], report: StructureReport, b: BadSum) -> tuple[str, str]:
    """(what happens at this sum, the fix) for a sum with no exact Gaussian description."""
    node, feat, other = ids[b.node], ids[b.feature], ids[b.partner]
    if b.product:
        why = (
            f"mul {node!r} multiplies {feat!r} and {other!r}, which share atoms (the same weighted layer, input or "
            "activation reaches both): E[u v u' v'] does not factor into E[u u'] E[v v'], so q = q_u q_v and "
            "C = C_u C_v do not hold"
        )
        return why, (
            "give each factor its own weighted layer reading the shared stream (a gated MLP: "
            "mul(act(dense1(x)), dense2(x)))"
        )
    source = OP_TABLE[report.ops[b.feature]].kind == SOURCE
    what = "the network input" if source else f"the post-activation feature {feat!r}"
    if b.concat:
        why = (
            f"sum {node!r} adds concatenation {feat!r} and {other!r}, which share atoms: the correlation of "
            "each concatenated part with the other term is not modelled"
        )
        return why, "put a weighted layer on one of the two branches before the sum"
    if b.second:
        why = (
            f"sum {node!r} adds {what} and another non-Gaussian term {other!r}: their means multiply into its "
            "mean square"
        )
    else:
        why = (
            f"sum {node!r} adds {what} and {other!r}, which is correlated with it (the activation's own input, "
            "or a copy of it): the cross term E[z phi(z)] is not zero, so q and the C map differ from the "
            "normalized-sum rule"
        )
    return why, "put a weighted layer (dense or conv) on the activation's branch before the sum; " + _PREACT_FIX


def check_structure(ids: Sequence[str], report: StructureReport, mode: str) -> list[str]:
    """Raise ``unsupported_structure`` (mode "strict") or return the warnings (mode "warn");
    ``ids`` names the report's nodes by index."""
    if report.holds:
        return []
    if report.violations:
        first, fix = _cause(ids, report, report.violations[0])
    else:
        first, fix = _sum_cause(ids, report, report.bad_sums[0])
    named = _names(ids, report.flagged)
    count = len(report.flagged)
    why = (
        "the Q/C maps assume each activation's input, and each branch of a sum, is a Gaussian combination of "
        "independent atoms (affine outputs; TAT paper section 2.3); post-activation features are skewed, not "
        "zero-mean and correlated with their own input, so q drifts from 1 and the C map differs at any width"
    )
    if mode == "strict":
        raise SigpropError(
            "unsupported_structure",
            f"{count} node(s) outside the kernel theory ({named}): {first}; {why}",
            f'{fix}; or send "assumptions": "warn" to solve anyway with warnings',
        )
    return [
        f"assumptions not met at {count} node(s) ({named}): {first}; {why}. Past these nodes the answer's "
        "predictions do not hold: the global C map (c_map, c_f_0, network_c_f_0, c_curv_1, c_slope_1) and "
        "q = 1 at the output. Fix: " + fix
    ]


def sum_scale_notes(ids: Sequence[str], report: StructureReport) -> list[str]:
    """Say where the answer's ``sum_scales`` change a sum, and why."""
    if not report.sum_scales:
        return []
    shown = _names(ids, sorted(report.sum_scales))
    return [
        f"{len(report.sum_scales)} sum(s) ({shown}) add the same atom through several paths (a copy through "
        "identity, dropout or flatten, a nested sum, a stream added into two sums): its coefficients add before "
        "squaring, so with the graph's weights q is not 1 there. The answer's sum_scales multiply those sums' "
        "weights to restore the normalized sum the method assumes (the PyTorch and Keras adapters' apply does; a "
        "JAX model takes them from sum_weights(solution, graph)); the C map, q and the solve hold for the rescaled "
        "network"
    ]


def dropout_notes(ids: Sequence[str], report: StructureReport) -> list[str]:
    """Dropout is the identity at evaluation; in training mode with rate p each input draws its own
    mask, which scales q by 1/(1 - p) and leaves the cross-covariance of two inputs unchanged."""
    if not report.dropouts:
        return []
    return [
        f"dropout ({_names(ids, report.dropouts)}) is the identity in the answer's maps: the predictions hold "
        "in evaluation mode. In training mode with rate p, each input draws its own mask, so q after it is "
        "scaled by 1/(1 - p) while the covariance of two inputs is unchanged (their c is scaled by 1 - p), and "
        "every later activation sees that larger q"
    ]


def pooling_warnings(ids: Sequence[str], report: StructureReport) -> list[str]:
    out = []
    if report.avg_pools:
        # counted, not named: the warning is the same for every naming of the graph
        out.append(
            f"average pooling ({len(report.avg_pools)} node(s)) is treated as the identity on the Q/C maps, "
            "which is exact only when every pooled location sees the same input: the C map is per spatial "
            "location, and for inputs whose locations differ the pooled output's q and c values differ from it "
            "(cross-location correlations are not modelled); where the window is larger than one location the "
            "answer does not predict past it (assumptions.holds is false; a client's example_input calibration "
            "measures the node)"
        )
    if report.max_pools:
        pools = [ids[i] for i in report.max_pools]
        out.append(
            f"max_pool is not covered by the Q/C map theory and is treated as the identity ({', '.join(pools[:5])}): "
            "past a window larger than one location the answer does not predict q or c (assumptions.holds is "
            "false; measured at width 512 after a 3 x 3 max_pool: q 2.61, C 0.74 where the map says 1, 0.24)"
        )
    return out
