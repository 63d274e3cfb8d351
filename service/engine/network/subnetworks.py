"""The generalized map U_{f,r} of a DAG and the subnetwork maximizing function M_{f,r}.

TAT paper Appendix B.2: M_{f,r}(x) = max over subnetworks g of f of U_{g,r}(x), where U_{g,r} is
the global C map of g with the local C map replaced by a non-decreasing r (rules of B.4:
composition composes, affine layers are the identity, nonlinear layers are r, a normalized sum
with weights w_i is sum_i w_i^2 U_i, and a concatenation is the width-weighted average, which is
how its C map combines its inputs' maps).

A subnetwork is a single-entry single-exit region (s, t): every path from the inputs to t passes
through s (s dominates t), and every node of the region other than s feeds only nodes of the
region (t post-dominates them), so the region has one input layer and one output layer (footnote
4 of the paper). Because U_{g o h} >= U_g, U_h (B.2), only the largest region ending at each node
t matters: its entry s*(t) is the highest dominator of t for which the region stays single-exit.
The regions are found from the dominator and post-dominator trees in about linear time for the
usual architectures, so the whole M_{f,r} needs one forward pass over the network plus one pass
over each branch that cannot compose into a larger subnetwork (a residual branch, a dense layer
of a DenseNet): exactly the subnetworks B.5 says need visiting, derived from the graph rather than
written by hand as dks users do today.

Subnetworks nested inside each other (a skip from each layer to its mirror across the network)
each need a pass of their own, so those passes grow with the square of the nesting depth; they
are priced as their regions are walked (``STEPS_PER_COST``, ``STEPS_FLOOR``) and past the budget
the maximization is refused with 413 ``graph_too_large``, while the whole network's pass (the
global map) is still available.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from ...errors import SigpropError
from ...schemas.kernels import atom_coefficients, concat_coefficients, sum_coefficients
from ...schemas.ops import ACT, AFFINE, ATTENTION, CONCAT, MAX_PAIR, NORM, PASS, PRODUCT, SOURCE, SUM
from ...schemas.structure import StructureReport
from ..graph.build import NetworkGraph

# r(value, fn_slot) -> value: the local map standing in for each nonlinear layer, given the
# index of the layer's activation function in ``NetworkGraph.activation_fns()``.
LocalMap = Callable[[object, int], object]
# product(value_u, value_v) -> value: what a pass carries through a ``mul`` node (kind ``product``)
Product = Callable[[object, object], object]

_OP_PASS, _OP_ACT, _OP_MIX, _OP_MUL, _OP_PAIR = 0, 1, 2, 3, 4


def value_product(u, v):
    """A product's C map from its factors' (independent atoms; ``schemas.atoms``): C = C_u C_v."""
    return u * v


def slope_product(u, v):
    """A product's C'(1) from its factors' slopes at the fixed point 1 (C_u(1) = C_v(1) = 1):
    (C_u C_v)'(1) = C_u'(1) + C_v'(1)."""
    return u + v


def jet_product(u, v):
    """A product's (C'(1), C''(1)) pair carried as the complex number y1 + i y2 (``program``'s
    ``max_slope_and_curvature``): (u1 + v1, u2 + 2 u1 v1 + v2), the product rule at C(1) = 1."""
    return (u.real + v.real) + 1j * (u.imag + 2.0 * u.real * v.real + v.imag)


def max_pair_value(c):
    """A max pair's C map (``schemas.ops.pair_max_c``) on a number, a complex number (the complex step)
    or a numpy array, elementwise: c/2 + (sqrt(1 - c^2) + c arcsin c)/pi."""
    if np.iscomplexobj(c):
        return c / 2.0 + (np.sqrt(1.0 - c * c) + c * np.arcsin(c)) / np.pi
    c = np.clip(c, -1.0, 1.0)
    return c / 2.0 + (np.sqrt(1.0 - c * c) + c * np.arcsin(c)) / np.pi


def max_pair_slope(y):
    """A max pair's C'(1) = 1: the slope pass carries its input's slope unchanged."""
    return y


def max_pair_jet(y):
    """C''(1) of a max pair is infinite (C'(c) = 1/2 + arcsin(c)/pi, whose slope 1/(pi sqrt(1 - c^2))
    diverges at 1): no curvature pass carries it."""
    raise SigpropError(
        "unsupported_structure",
        "the graph has a max_pool of feature pairs: its C map c/2 + (sqrt(1 - c^2) + c arcsin c)/pi has C'(1) = 1 "
        "but an infinite C''(1), so the curvature conditions of DKS and of TAT for smooth activations do not apply",
        "use TAT with 'leaky_relu' (target eta) or 'eoc', which need only the C map; or avg_pool",
    )


# a pass is named by its product rule; the max pair's rule in the same pass (value, slope, curvature jet)
PAIR_RULES: dict = {value_product: max_pair_value, slope_product: max_pair_slope, jet_product: max_pair_jet}


# The passes M_{f,r} needs visit at most this many steps per node + edge (plus the floor): real
# architectures need under one (ResNets, DenseNets, ladders: 0.3-0.9), while subnetworks nested
# inside each other (a skip from each layer to its mirror across the network) need one pass each,
# quadratic in the depth. Past the budget the maximization is refused (413) instead of run.
STEPS_PER_COST = 2
STEPS_FLOOR = 50_000


@dataclass(frozen=True)
class _Group:
    start: int | None  # entry node; None = the network's inputs (the whole network f)
    steps: tuple  # (node, op, inputs, coefficients or fn slot) in topological order
    endpoints: tuple[int, ...]  # nodes t whose largest subnetwork starts at ``start``


@dataclass(frozen=True)
class SubnetworkProgram:
    """M_{f,r} compiled for repeated evaluation with different r (one per solver iteration)."""

    # the groups, or what raises when they are over the step budget (``_over_budget``)
    group_source: tuple[_Group, ...] | Callable[[], tuple[_Group, ...]]
    # the number of largest subnetworks, one per endpoint
    regions: int
    output: int
    user_ids: tuple[str, ...]
    # the most nonlinear layers on a path from an input to the output (``NetworkGraph.depth``)
    depth: int
    # the whole network's group (groups[0]), kept apart when the other groups are over the step
    # budget: a pass over the whole network (the global map) never needs them
    whole: _Group | None = None

    @property
    def groups(self) -> tuple[_Group, ...]:
        groups = self.group_source
        if callable(groups):
            groups = groups()
            object.__setattr__(self, "group_source", groups)  # a cache: the program's value is unchanged
        return groups

    @property
    def has_products(self) -> bool:
        """Whether some node is a product (``mul``): its passes then need the pass's product rule."""
        group = self.whole if self.whole is not None else self.groups[0]
        return any(op == _OP_MUL for _, op, _, _ in group.steps)

    @property
    def has_max_pairs(self) -> bool:
        """Whether some node is a max pair (``max_pool`` of feature pairs): its passes then need the pass's rule."""
        group = self.whole if self.whole is not None else self.groups[0]
        return any(op == _OP_PAIR for _, op, _, _ in group.steps)

    def global_map(self, x, r: LocalMap, product: Product = value_product):
        """U_{f,r}(x) for the whole network f (with r the local C map: the global C map C_f)."""
        vals = self._run(self.whole if self.whole is not None else self.groups[0], x, r, product)
        return vals[self.output]

    def endpoint_values(self, x, r: LocalMap, product: Product = value_product) -> list:
        """U_{g,r}(x) of every largest subnetwork g: what M_{f,r}(x) is the maximum of."""
        found = []
        for g in self.groups:
            vals = self._run(g, x, r, product)
            found.extend(vals[t] for t in g.endpoints)
        return found

    def maximize(self, x, r: LocalMap, product: Product = value_product):
        """M_{f,r}(x); x may be a float or a numpy array (evaluated elementwise)."""
        found = self.endpoint_values(x, r, product)
        if len(found) == 1:
            return found[0]
        # one reduction instead of a numpy call per endpoint (thousands on a ladder); the same
        # maximum, elementwise for an array x
        return np.maximum.reduce(np.asarray(found))

    def argmax(self, x: float, r: LocalMap, product: Product = value_product) -> str:
        """A readable name of the subnetwork that attains M_{f,r}(x)."""
        whole = self._run(self.groups[0], x, r, product)  # group 0 is the whole network's: U_{f,r}(x) too
        best, name = float(whole[self.output]), "the whole network"
        for i, g in enumerate(self.groups):
            vals = whole if i == 0 else self._run(g, x, r, product)
            for t in g.endpoints:
                if vals[t] > best * (1 + 1e-12) + 1e-15:
                    best = vals[t]
                    name = (
                        "the whole network"
                        if (g.start is None and t == self.output)
                        else (
                            f"from {'the input' if g.start is None else repr(self.user_ids[g.start])} "
                            f"to {self.user_ids[t]!r}"
                        )
                    )
        return name

    @staticmethod
    def _run(group: _Group, x, r: LocalMap, product: Product = value_product) -> dict:
        vals: dict[int, object] = {}
        if group.start is not None:
            vals[group.start] = x
        for node, op, ins, arg in group.steps:
            if op == _OP_PASS:
                vals[node] = x if ins is None else vals[ins]
            elif op == _OP_ACT:
                vals[node] = r(vals[ins], arg)
            elif op == _OP_MUL:
                vals[node] = product(vals[ins[0]], vals[ins[1]])
            elif op == _OP_PAIR:
                vals[node] = PAIR_RULES[product](vals[ins])
            else:
                acc = 0.0
                for i, coef in zip(ins, arg, strict=False):
                    acc = acc + coef * vals[i]
                vals[node] = acc
        return vals


def _dominators(preds: list[list[int]], root: int) -> tuple[list[int], list[int]]:
    """Immediate dominators of a DAG whose nodes are numbered in topological order from ``root``'s side
    (``root`` = ``len(preds)``: the virtual node before every source), and the depths in their tree.

    A node's immediate dominator is the nearest common ancestor, in the dominator tree built so
    far, of its inputs. Walking up one tree edge at a time costs the depth difference, which a
    long chain whose end meets an early node in thousands of sums makes quadratic; each node
    therefore also keeps a skew-binary jump pointer (Myers, "An applicative random-access stack",
    1983), fixed when the node is added, so each walk takes O(log depth) steps."""
    n = len(preds)
    if root != n:
        raise ValueError(f"the root is the virtual node len(preds) = {n}, not {root}")
    idom = [root] * n
    up = [root] * (n + 1)  # idom with the root appended, the root its own parent
    jump = [root] * (n + 1)
    level = [0] * n + [-1]  # depth in the dominator tree; the root's is -1

    def lca(a: int, b: int) -> int:
        while a != b:
            if level[a] < level[b]:
                a, b = b, a
            if level[a] > level[b]:  # climb a to b's depth, by its jump when that does not overshoot
                j = jump[a]
                a = j if level[j] >= level[b] else up[a]
            elif jump[a] != jump[b]:  # equal depths, so equal jump depths: the common one is above both
                a, b = jump[a], jump[b]
            else:
                a, b = up[a], up[b]
        return a

    for v in range(n):
        ps = preds[v]
        d = ps[0] if ps else root
        for p in ps[1:]:
            d = lca(d, p)
            if d == root:
                break
        idom[v] = up[v] = d
        level[v] = level[d] + 1
        j = jump[d]
        jump[v] = jump[j] if level[d] - level[j] == level[j] - level[jump[j]] else d
    return idom, level[:n]


def _valid_steps(preds: list[list[int]], idom: list[int], pdom: Callable[[int, int], bool], root: int) -> list[bool]:
    """For each node s (in topological order), whether every node of the region between idom(s)
    and s (on a path idom(s) -> s, idom(s) excluded) is post-dominated by s.

    The walk back from s jumps over what is known already: for a node v of the region whose own
    step is valid, everything between idom(v) and v is post-dominated by v, hence by s, so the walk
    goes on from idom(v) instead of v's inputs. A node where the fan-out of one node to thousands
    of sums meets (the "ladder") is then visited once per sum, not once per node before it:
    each walk visits the dominator-tree path between s and idom(s) plus the inputs of the nodes
    with an invalid step, about linear in nodes + edges for the usual architectures (the old
    walk of whole regions was quadratic on the ladder)."""
    valid = [False] * len(preds)
    for s in range(len(preds)):
        d = idom[s]
        seen = {s}
        stack = [p for p in preds[s] if p != d]
        ok = True
        while stack and ok:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if not pdom(s, v):
                ok = False
            elif valid[v]:
                if idom[v] != d and idom[v] != root:
                    stack.append(idom[v])
            else:
                stack.extend(p for p in preds[v] if p != d)
        valid[s] = ok
    return valid


def _euler_intervals(parent: list[int], root: int) -> tuple[list[int], list[int]]:
    """Entry and exit times of a pre-order walk of the tree of ``parent`` (nodes 0..n-1, ``root`` =
    n, every parent numbered above its children): u is in v's subtree iff tin[v] <= tin[u] and
    tout[u] <= tout[v]. O(n), with no stack: subtree sizes bottom-up (children come first), then
    each node takes the next free slot of its parent's interval top-down. The post-dominator
    tree qualifies: a node's post-dominator lies downstream, so later in canonical order."""
    n = len(parent)
    size = [1] * (n + 1)
    for v in range(n):
        size[parent[v]] += size[v]
    tin = [0] * (n + 1)
    tout = [0] * (n + 1)
    tout[root] = size[root]
    cursor = [0] * (n + 1)
    cursor[root] = 1
    for v in range(n - 1, -1, -1):
        p = parent[v]
        t = cursor[p]
        cursor[p] = t + size[v]
        tin[v] = t
        tout[v] = t + size[v]
        cursor[v] = t + 1
    return tin, tout


def _pass_step(nodes, v, nd, fn_slot: dict[str, int]) -> tuple:
    return (v, _OP_PASS, nd.inputs[0], None)


# the evaluation step of a node of each op kind, from the nodes, its index, the node and the function slots
STEP_RULES = {
    SOURCE: lambda nodes, v, nd, fn_slot: (v, _OP_PASS, None, None),
    ACT: lambda nodes, v, nd, fn_slot: (v, _OP_ACT, nd.inputs[0], fn_slot[nd.attrs["fn"]]),
    SUM: lambda nodes, v, nd, fn_slot: (v, _OP_MIX, nd.inputs, sum_coefficients(nd.attrs["weights"])),
    CONCAT: lambda nodes, v, nd, fn_slot: (
        v,
        _OP_MIX,
        nd.inputs,
        concat_coefficients(nodes[i].width for i in nd.inputs),
    ),
    PASS: _pass_step,
    AFFINE: _pass_step,
    NORM: _pass_step,
    ATTENTION: _pass_step,
    # the product of its factors' values, by the pass's product rule (``value_product``, ``slope_product``,
    # ``jet_product``)
    PRODUCT: lambda nodes, v, nd, fn_slot: (v, _OP_MUL, nd.inputs, None),
    # a fixed nonlinearity: the pass's max-pair rule (``PAIR_RULES``) on its input's value
    MAX_PAIR: lambda nodes, v, nd, fn_slot: (v, _OP_PAIR, nd.inputs[0], None),
}


def _step(nodes, v: int, fn_slot: dict[str, int]) -> tuple:
    """The evaluation step of node v: (node, op, inputs, the mix coefficients, an activation's
    function slot, or None)."""
    nd = nodes[v]
    return STEP_RULES[nd.kind](nodes, v, nd, fn_slot)


def _shared_steps(nodes, members, start: int | None, report: StructureReport) -> dict[int, tuple]:
    """The steps of the shared sums among ``members`` (a group's nodes in topological order), over
    atoms: an atom that reaches a sum through several paths has its coefficients added before
    squaring, so the sum's C is sum_a c_a^2 C_a / sum_a c_a^2 over the atoms a, not sum_i w_i^2 C_i
    over its inputs (``schemas.atoms``). Expansions are relative to the group's entry, which
    plays the atom for everything before it (every path from the inputs passes through it);
    private sums are atoms for what follows (their cone is theirs alone), and unless shared their
    own steps stay input-wise."""
    private = report.atoms.private
    exp: dict[int, dict] = {} if start is None else {start: {start: 1.0}}
    steps = {}
    for v in members:
        nd = nodes[v]
        if nd.kind == SUM and (v in report.shared_sums or not private[v]):
            scale = report.sum_scales.get(v, 1.0)
            acc: dict[int, float] = {}
            for i, w in zip(nd.inputs, nd.attrs["weights"], strict=True):
                for a, c in exp[i].items():
                    acc[a] = acc.get(a, 0.0) + scale * w * c
            exp[v] = acc
            if v in report.shared_sums:
                steps[v] = (v, _OP_MIX, tuple(acc), atom_coefficients(acc.values(), normalized=True))
            if private[v]:  # closed again: an atom for what follows, its value computed just above
                exp[v] = {v: 1.0}
        elif nd.kind in (PASS, NORM):  # a norm at q = 1 (TAT, DKS) passes its input through
            exp[v] = exp[nd.inputs[0]]
        else:  # affine outputs, activations, concatenations, inputs, private sums: atoms
            exp[v] = {v: 1.0}
    return steps


def compile_subnetworks(graph: NetworkGraph, report: StructureReport | None = None) -> SubnetworkProgram:
    """Find the largest subnetwork ending at each node and compile the passes M_{f,r} needs.

    Cost: near-linear in nodes + edges. The dominator and post-dominator trees (``_dominators``),
    the Euler intervals and the climbs are linear or near it on these graphs; the single-exit
    test of each step is ``_valid_steps`` (jumps over solved regions); each group's region is
    walked once. Evaluating M_{f,r} then costs the sum of the groups' sizes per point.

    ``report`` (the graph's ``structure_report``): its shared sums compose atom by atom
    (``_shared_steps``); without it every sum is taken as a normalized sum of uncorrelated inputs.

    This is the general implementation of the network program (``program.GeneralProgram``)."""
    fn_slot = {fn: i for i, fn in enumerate(graph.activation_fns())}
    n = graph.n
    nodes = graph.nodes
    preds = [list(nd.inputs) for nd in nodes]
    succs = graph.consumers()
    root = n

    idom, _ = _dominators(preds, root)
    # Post-dominators: the same computation on the reversed graph (node k -> n-1-k), sink = output.
    rev_preds = [[n - 1 - s for s in succs[n - 1 - k]] for k in range(n)]
    ridom, _ = _dominators(rev_preds, root)
    ipdom = [root if ridom[n - 1 - v] == root else n - 1 - ridom[n - 1 - v] for v in range(n)]

    # Euler intervals of the post-dominator tree: t post-dominates v iff v is in t's subtree.
    tin, tout = _euler_intervals(ipdom, root)

    def pdom(t: int, v: int) -> bool:
        return tin[t] <= tin[v] and tout[v] <= tout[t]

    def region(start: int, ends, limit: int | None = None) -> set[int] | None:
        """Nodes on paths from ``start`` (exclusive; root = the inputs) to any of ``ends``; None
        as soon as they are more than ``limit``."""
        seen = set(ends)
        stack = list(ends)
        while stack:
            v = stack.pop()
            for p in preds[v]:
                if p != start and p not in seen:
                    seen.add(p)
                    stack.append(p)
            if limit is not None and len(seen) > limit:
                return None
        return seen

    # valid_step[s]: the region between idom(s) and s leaves only through s.
    valid_step = _valid_steps(preds, idom, pdom, root)

    # s*(t): climb the dominator tree while the region stays single-exit, jumping over the part
    # already solved for the node climbed onto (everything it post-dominates, t does too).
    best_start: list[int | None] = [None] * n
    for t in range(n):
        if nodes[t].kind == SOURCE:
            best_start[t] = root  # the trivial region (inputs, t): lets climbs jump past inputs
            continue
        if not valid_step[t]:
            continue
        cand = idom[t]
        while cand != root and pdom(t, cand) and valid_step[cand] and best_start[cand] is not None:
            cand = best_start[cand]
        best_start[t] = cand

    by_start: dict[int, list[int]] = {}
    for t in range(n):
        if best_start[t] is not None and nodes[t].kind != SOURCE:
            by_start.setdefault(best_start[t], []).append(t)
    by_start.setdefault(root, [graph.output])
    if graph.output not in by_start[root]:
        by_start[root].append(graph.output)

    # activation slots resolved now, so evaluation needs no lookups; a node's step is the same in
    # every group that holds it. The groups' steps are counted against the budget as their regions
    # are walked, so a graph over it costs the budget, not the quadratic walk (the whole
    # network's group, first, is at most every node).
    edges = sum(len(p) for p in preds)
    budget = STEPS_PER_COST * (n + edges) + STEPS_FLOOR
    left = budget
    step_of: dict[int, tuple] = {}
    groups: list[_Group] = []
    for start in sorted(by_start, key=lambda s: -1 if s == root else s):
        ends = by_start[start]
        members = region(start, ends, left if groups else None)
        if members is None:
            break
        steps = []
        members = sorted(members - {start})
        shared = {}
        if report is not None and report.shared_sums and not report.shared_sums.isdisjoint(members):
            shared = _shared_steps(nodes, members, None if start == root else start, report)
        for v in members:
            step = shared.get(v) or step_of.get(v)
            if step is None:
                step = step_of[v] = _step(nodes, v, fn_slot)
            steps.append(step)
        left -= len(steps)
        groups.append(_Group(None if start == root else start, tuple(steps), tuple(sorted(ends))))
    over = len(groups) < len(by_start)
    return SubnetworkProgram(
        partial(_over_budget, n, edges, len(by_start), budget) if over else tuple(groups),
        sum(len(ends) for ends in by_start.values()),
        graph.output,
        tuple(nd.user_id for nd in nodes),
        graph.depth(),
        whole=groups[0] if over else None,
    )


def _over_budget(nodes: int, edges: int, groups: int, budget: int) -> tuple[_Group, ...]:
    """The groups of a program over the step budget: refused when a method needs them."""
    raise SigpropError(
        "graph_too_large",
        f"the graph nests its {groups} largest subnetworks so deeply that maximizing over them "
        f"would visit more than {budget} nodes ({STEPS_PER_COST} per node and edge of its {nodes} nodes "
        f"and {edges} edges, plus {STEPS_FLOOR}), each nested subnetwork in a pass of its own",
        "skips that each join a layer with its mirror across the network (a very deep U-Net) nest "
        "subnetworks quadratically: use fewer nested levels, or method 'eoc' or 'geometric', which "
        "do not maximize over subnetworks",
    )
