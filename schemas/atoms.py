"""Every node of a graph as a linear combination of independent atoms: the positive form of the
kernel theory's coverage condition.

The local Q and C maps (TAT paper, "Deep Learning without Shortcuts: Shaping the Kernel with
Tailored Rectifiers", arXiv:2203.08120, equations 4-5) describe an activation exactly when its input
is, at infinite width, a zero-mean Gaussian field; section 2.3 gets one from "combined layers, and
normalized sums between the output of multiple affine layers". That condition can be checked by
construction. The output of a dense or conv layer with fresh zero-mean weights is a Gaussian *atom*,
uncorrelated with every other atom (its weights are independent of everything else); the network
input and every activation output are *features*: atoms too, but not Gaussian, and correlated with
the atoms their own input is made of. Sums, concatenations and pass-through ops (identity, dropout,
flatten, pooling) are linear, so one pass in topological order writes every node as sparse
coefficients over atoms, and then:

- the mean square of a node is ``sum_a c_a^2 q_a`` and its kernel ``sum_a c_a^2 q_a C_a / q`` when no
  two of its atoms are correlated: an atom reaching a sum through several paths (``sum(z,
  dropout(z))``, pass-through copies, nested sums ``sum(x1, sum(x1, F(x1)))``, a long skip added
  into two sums) is one atom whose coefficients add *before* squaring, so the normalized-sum rule
  ``q = sum_i w_i^2 q_i`` of the paper fails there (``sum(x1, sum(x1, F))`` has q 1.707, not 1);
- a node whose combination holds a feature is not Gaussian: an activation reading it is outside the
  theory (the five patterns of earlier rounds, post-activation residuals, an activation on a
  shortcut, two activations in a row, a concatenation carrying an activation, an activation on the
  network input, all fall out of this), and a sum adding a feature to something correlated with it
  (``sum(z, act(z))``: the cross term E[z phi(z)] is not zero) or two features (their means multiply)
  has no exact Gaussian description at all.

A product ``mul(u, v)`` (kind ``product``: a gated MLP's gate) is a feature like an activation's
output: exact when its factors' atoms are independent (their supports, what each is correlated with,
are disjoint: two dense layers reading one stream have independent weights), where
E[u v u' v'] = E[u u'] E[v v'] gives q = q_u q_v and C = C_u C_v; factors that share an atom
(``mul(x, x)``, ``mul(act(z), z)``) are a ``BadSum`` with ``product``, refused or warned as a bad sum is.

Where coefficients merged, the pass prescribes a *scale* of the sum's weights that restores
``sum_a c_a^2 = 1`` (every atom has q = 1 under the kernel methods' normalization, the network input
by the contract's input convention), so the sum is the normalized sum the method assumes and the
engine's C map composes it atom by atom (``SumStep``).

Cost: a node whose correlation cone is private (every node in it reaches the rest of the graph
through it alone: a residual stream of a pre-activation ResNet, any tree of sums, a stream after
a shared sum has closed again) becomes an atom itself, so expansions stay small;
``expansion_bound`` bounds the work in one integer pass before any dictionary is built
(``MAX_TERMS``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import SigpropError
from .ops import ACT, AFFINE, CONCAT, MAX_PAIR, PRODUCT, SOURCE, SUM, ops_of_kind

__all__ = ["MAX_TERMS", "AtomPass", "BadSum", "atom_pass", "expansion_bound", "private_nodes"]

MAX_TERMS = 2_000_000  # total coefficients the pass may hold: tens of MB, well under a second

# the ops of each kind the pass treats apart (every other kind passes its first input's atoms on)
_LINEAR = ops_of_kind(SUM, CONCAT)
_ATOM = ops_of_kind(AFFINE)
# a max pair (``max_pool`` of adjacent features) is a fixed elementwise-like nonlinearity: an activation here
_FEATURE = ops_of_kind(SOURCE, ACT, MAX_PAIR)
_SOURCES, _ACTS, _SUMS, _CONCATS = (
    ops_of_kind(SOURCE),
    ops_of_kind(ACT, MAX_PAIR),
    ops_of_kind(SUM),
    ops_of_kind(CONCAT),
)
_PRODUCTS = ops_of_kind(PRODUCT)


@dataclass(frozen=True)
class BadSum:
    """A sum with no exact Gaussian description: ``feature`` (a feature atom in it) is correlated
    with ``partner`` (another atom of the sum), or ``partner`` is a second feature (``second``);
    with ``concat``, neither is a feature: a concatenation shares atoms with another term, and its
    per-coordinate correlations are not modelled; with ``product``, ``node`` is a product whose two
    factors ``feature`` and ``partner`` share atoms (its moments do not factor)."""

    node: int
    feature: int
    partner: int
    second: bool
    concat: bool = False
    product: bool = False


@dataclass(frozen=True)
class AtomPass:
    # node -> {atom node: coefficient}, with the prescribed sum scales applied, as later nodes see it
    # (a private node is an atom of its own: {node: 1})
    expansions: tuple[dict, ...]
    # sum node -> its combination over the atoms before it, scales applied (what q and C mix)
    mixes: dict[int, dict]
    # node -> None if Gaussian, else (the feature reaching it, the sum/concat it passed or None)
    witness: tuple[tuple[int, int | None] | None, ...]
    # sum node -> the factor on its weights that restores the normalized sum (only where it is not 1)
    scales: dict[int, float]
    # sums where an atom arrives through several paths (their C composes atom by atom)
    shared: frozenset[int]
    bad_sums: tuple[BadSum, ...]
    private: tuple[bool, ...]


def _consumers(inputs: Sequence[Sequence[int]]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in inputs]
    for v, ins in enumerate(inputs):
        for i in ins:
            out[i].append(v)
    return out


def _carries(ops: Sequence[str], consumers: list[list[int]]) -> list[bool]:
    """Whether a node's value enters a linear combination that the pass tracks: it feeds a linear
    node (sum, concat, pass-through) or an activation, rather than only weighted layers."""
    weighted = [op in _ATOM for op in ops]
    return [not all(weighted[w] for w in out) for out in consumers]


def private_nodes(
    ops: Sequence[str], inputs: Sequence[Sequence[int]], consumers: list[list[int]] | None = None
) -> list[bool]:
    """Node v is private when every node of its correlation cone (what it is a linear function of,
    through linear ops and activations, back to dense/conv/input atoms) reaches the rest of the graph
    through v alone: then no later node can see its atoms but through v, and v can be one atom.

    "Reaches through v alone" is post-dominance in the graph of the edges correlation travels
    along (into linear nodes, and into activations whose output enters a combination): v is private
    iff it post-dominates its whole cone, i.e. iff the lowest common post-dominator P(v) of its cone
    is v itself, and P(v) = LCA(v, P(i) over its tracked inputs i). Post-dominators as in
    ``engine.network.subnetworks`` (a reverse pass, climbing by depth), so about linear for the usual
    graphs: a pre-activation residual stream, a tree of sums, and a stream after a shared sum has
    closed again are all private."""
    n = len(ops)
    consumers = _consumers(inputs) if consumers is None else consumers
    carries = _carries(ops, consumers)
    travels = [op not in _ATOM and (op not in _ACTS or c) for op, c in zip(ops, carries, strict=True)]
    exit_ = n
    ipdom = [exit_] * n
    depth = [0] * (n + 1)  # the exit is the root, depth 0; nodes below it from 1

    def lca(a: int, b: int) -> int:
        while a != b:
            if depth[a] >= depth[b]:
                a = ipdom[a] if a != exit_ else a
            else:
                b = ipdom[b] if b != exit_ else b
        return a

    for u in range(n - 1, -1, -1):
        d = -1
        for w in consumers[u]:
            if travels[w]:
                d = w if d == -1 else lca(d, w)
                if d == exit_:
                    break
        ipdom[u] = exit_ if d == -1 else d
        depth[u] = depth[ipdom[u]] + 1
    low = list(range(n))  # P(v): the lowest common post-dominator of v's cone
    private = [True] * n
    for v, op in enumerate(ops):
        if op in _ATOM or op in _SOURCES:
            continue
        if op in _ACTS and not carries[v]:
            continue  # its output only meets fresh weights: the cone ends here
        p = v
        for i in inputs[v]:
            p = lca(p, low[i])
        low[v] = p
        private[v] = p == v
    return private


def expansion_bound(ops: Sequence[str], inputs: Sequence[Sequence[int]], private: Sequence[bool]) -> int:
    """An upper bound on the coefficients ``atom_pass`` holds, in one integer pass."""
    size = [1] * len(ops)
    for v, op in enumerate(ops):
        if op in _ATOM or op in _FEATURE or op in _PRODUCTS or private[v]:
            size[v] = 1
        elif op in _SUMS:
            size[v] = sum(size[i] for i in inputs[v])
        elif op in _CONCATS:
            size[v] = 1 + sum(size[i] for i in inputs[v])  # its own atom, and what it hides
        else:
            size[v] = size[inputs[v][0]]
    return sum(size)


def atom_pass(ops: Sequence[str], inputs: Sequence[Sequence[int]], weights: Sequence) -> AtomPass:
    """Write each node (in topological order: ``inputs`` name earlier nodes) as coefficients over
    atoms. ``weights[v]``: a sum's weights (None: 1/sqrt(n) each), ignored for other nodes."""
    n = len(ops)
    if not any(op in _LINEAR or op in _PRODUCTS for op in ops):
        return _chain_pass(ops, inputs)
    consumers = _consumers(inputs)
    private = private_nodes(ops, inputs, consumers)
    bound = expansion_bound(ops, inputs, private)
    if bound > MAX_TERMS:
        raise SigpropError(
            "graph_too_large",
            f"the graph's shared streams need up to {bound} coefficients to analyse (limit {MAX_TERMS})",
            "add weighted layers on the branches that copy one stream into many sums, or split the graph",
        )
    carries = _carries(ops, consumers)
    mixes: dict[int, dict] = {}
    held = 0  # atoms held in ``reach`` sets: bounded as they grow (the integer pass counts coefficients)
    exp: list[dict] = [{}] * n
    witness: list[tuple[int, int | None] | None] = [None] * n
    # atoms correlated with an atom beyond itself (a feature: what its input is made of); empty
    # for dense/conv outputs and private composites
    reach: dict[int, frozenset] = {}
    feature = [False] * n
    scales: dict[int, float] = {}
    shared = set()
    bad: list[BadSum] = []
    for v, op in enumerate(ops):
        ins = inputs[v]
        if op in _ATOM:
            exp[v] = {v: 1.0}
            continue
        if op in _FEATURE:
            exp[v] = {v: 1.0}
            witness[v] = (v, None)
            feature[v] = True
            if op in _ACTS and carries[v]:  # its output enters a combination: who it is correlated with
                reach[v] = _support(exp[ins[0]], reach)
                held = _hold(held, reach[v], bound)
            continue
        if op in _PRODUCTS:
            # a feature (not Gaussian); exact only when the factors' supports are disjoint (module docstring)
            u, w = (_support(exp[i], reach) for i in ins)
            if ins[0] == ins[1] or not u.isdisjoint(w):
                bad.append(BadSum(v, ins[0], ins[1], False, product=True))
            exp[v] = {v: 1.0}
            witness[v] = (v, None)
            feature[v] = True
            if carries[v]:
                reach[v] = u | w
                held = _hold(held, reach[v], bound)
            continue
        if op in _SUMS:
            ws = weights[v] or [1.0 / math.sqrt(len(ins))] * len(ins)
            acc: dict[int, float] = {}
            merged = len(set(ins)) < len(ins)
            for i, w in zip(ins, ws, strict=True):
                for a, c in exp[i].items():
                    if a in acc:
                        merged = True
                        acc[a] += w * c
                    else:
                        acc[a] = w * c
            norm = sum(c * c for c in acc.values())
            if merged:
                shared.add(v)
                if norm > 0 and abs(norm - 1.0) > 1e-12:
                    scales[v] = 1.0 / math.sqrt(norm)
                    acc = {a: c * scales[v] for a, c in acc.items()}
            found = _bad_sum(v, acc, feature, reach)
            if found is not None:
                bad.append(found)
            exp[v] = mixes[v] = acc
        elif op in _CONCATS:
            # a concatenation is one atom (its coordinates come from different parts, so its kernel
            # is their width-weighted average); what it is made of stays visible through ``reach``
            exp[v] = {v: 1.0}
            if not private[v]:
                reach[v] = frozenset().union(*(_support(exp[i], reach) for i in ins))
                held = _hold(held, reach[v], bound)
        else:  # pass-through: flatten, dropout, identity, pooling, output
            exp[v] = exp[ins[0]]
            witness[v] = witness[ins[0]]
            continue
        if op in _LINEAR:
            bad_in = next((witness[i] for i in ins if witness[i] is not None), None)
            witness[v] = None if bad_in is None else (bad_in[0], v)
            feature[v] = bad_in is not None and op in _CONCATS
        if private[v] and op in _SUMS:
            feature[v] = witness[v] is not None
            exp[v] = {v: 1.0}  # its cone is its own: one atom from here on
    return AtomPass(tuple(exp), mixes, tuple(witness), scales, frozenset(shared), tuple(bad), tuple(private))


def _chain_pass(ops: Sequence[str], inputs: Sequence[Sequence[int]]) -> AtomPass:
    """The pass of a graph with no sum or concatenation: nothing combines, so every node is one
    atom (or a copy of one) and only the witnesses matter; ``expansions`` and ``private`` are left
    empty (nothing reads them without a sum). A plain loop: an MLP of 100,000 nodes is a cold
    request's common case."""
    witness: list[tuple[int, int | None] | None] = [None] * len(ops)
    for v, op in enumerate(ops):
        if op in _FEATURE:
            witness[v] = (v, None)
        elif op not in _ATOM:
            witness[v] = witness[inputs[v][0]]
    return AtomPass((), {}, tuple(witness), {}, frozenset(), (), ())


def _hold(held: int, added: frozenset, bound: int) -> int:
    held += len(added)
    if bound + held > MAX_TERMS:
        raise SigpropError(
            "graph_too_large",
            f"the graph's post-activation features are correlated with more than {MAX_TERMS} atoms in all",
            "add weighted layers after the activations whose outputs are added into sums or activations",
        )
    return held


def _support(expansion: dict, reach: dict) -> frozenset:
    """The atoms a combination is correlated with: its own, and what features among them reach."""
    out = set(expansion)
    for a in expansion:
        out.update(reach.get(a, ()))
    return frozenset(out)


def _bad_sum(v: int, acc: dict, feature: list[bool], reach: dict) -> BadSum | None:
    feats = [a for a in acc if feature[a]]
    if len(feats) >= 2:
        return BadSum(v, feats[0], feats[1], True)
    for a in acc:
        hidden = reach.get(a)
        if not hidden:
            continue
        for b in acc:
            if b != a and (b in hidden or hidden & reach.get(b, frozenset())):
                f = a if feature[a] else b
                return BadSum(v, f, b if f == a else a, False, not (feature[a] or feature[b]))
    return None
