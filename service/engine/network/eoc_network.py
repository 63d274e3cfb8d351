"""Edge of Chaos over a whole graph: each weighted layer's variances from what it reads, so that q is
q* at every Gaussian node and the global C map composes at q* like TAT's and DKS's.

The paper's analysis (TAT paper section 3 and Table 1's EOC column; "Deep neural network
initialization with sparsity inducing activations", arXiv:2402.16184, equations 2-6) is of a chain
activation -> weighted layer, every layer with the same (sigma_w^2, sigma_b^2): with
sigma_w^2 = 1 / E[phi'(sqrt(q*) z)^2] and sigma_b^2 from V(q*) = q*, the layer after an activation
maps q* to V(q*) = q* and has chi_1 = 1. A weighted layer that reads no activation (it reads the
network input, a sum, another weighted layer, or a concatenation of those) has no phi: the same
sigma_w^2 would multiply q by 2.15 for tanh, which a C map taken at q* does not describe (issue 34).
Such a layer is *q-preserving* here: sigma_w^2 = q* / q_in and no bias, so its output is at q*
(q_in = 1 for the network input by the contract's input convention, q* for Gaussian nodes), and
its correlation is its input's.

Every node then holds one of a few kinds of values (``node_kinds``): the input (q = 1), a Gaussian
node at q* (a weighted layer's output, or a normalized sum or concatenation of them: the atom pass
of ``schemas.atoms`` gives sum_a c_a^2 = 1, with its ``sum_scales``), or the output of function k's
activations (q = E[phi_k(sqrt(q*) z)^2]). Sums and concatenations are exact on normalized C values
only where all their parts hold the same q, so a weighted layer or the output that reads a mix of
kinds (two functions' features, a feature and a Gaussian node, the input and a Gaussian node when
q* != 1) is outside what the answer can predict: ``mixed`` names it, and the method refuses it or
answers ``holds: false``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from ...schemas.ops import ACT, AFFINE, ATTENTION, CONCAT, MAX_PAIR, NORM, OP_TABLE, PASS, PRODUCT, SOURCE, SUM
from ..graph.build import NetworkGraph
from ..maps.activations import Activation
from ..methods.eoc import EOCSolution, variance_map

INPUT, GAUSS = "input", "gauss"
# an rms_norm's output: q = 1 whatever it reads, its correlation its input's
NORMED = "normed"
# a product's kind is the tuple (PRODUCT, kinds of its first factor, kinds of its second): q = q_u q_v;
# a max pair's (MAX_PAIR, kinds of its input): q = its input's (E[max(a, b)^2] = q for Gaussian a, b)
# V'(q*)^depth from which an unstable q* makes an answer not hold: a deviation of q from q* (a finite
# width's sampling noise) at least doubles over the network
DRIFT_LIMIT = 2.0  # the other kind is a function slot (int): that function's features


def _union(nd, out: list[frozenset], slot: dict) -> frozenset:
    return frozenset().union(*(out[i] for i in nd.inputs))


def _first(nd, out: list[frozenset], slot: dict) -> frozenset:
    return out[nd.inputs[0]]


def _norm(nd, out: list[frozenset], slot: dict) -> frozenset:
    # rms_norm: q = 1 (a layer_norm, which centres, is a sequence graph's and never reaches EoC)
    return _first(nd, out, slot) if OP_TABLE[nd.op].centres else frozenset([NORMED])


def _product(nd, out: list[frozenset], slot: dict) -> frozenset:
    return frozenset([(PRODUCT, out[nd.inputs[0]], out[nd.inputs[1]])])


def _max_pair(nd, out: list[frozenset], slot: dict) -> frozenset:
    return frozenset([(MAX_PAIR, out[nd.inputs[0]])])


# what a node of each op kind holds, from the node, the earlier nodes' values and the function slots
NODE_KIND_RULES = {
    SOURCE: lambda nd, out, slot: frozenset([INPUT]),
    AFFINE: lambda nd, out, slot: frozenset([GAUSS]),
    ACT: lambda nd, out, slot: frozenset([slot[nd.attrs["fn"]]]),
    SUM: _union,
    CONCAT: _union,
    PASS: _first,  # identity, dropout (evaluation mode), flatten, pooling, output
    NORM: _norm,
    ATTENTION: _first,
    PRODUCT: _product,
    MAX_PAIR: _max_pair,
}


def node_kinds(graph: NetworkGraph) -> list[frozenset]:
    """What each node's value is made of: ``INPUT``, ``GAUSS`` or activation function slots (in
    ``activation_fns`` order). Linear ops take the union of their inputs' kinds."""
    slot = {fn: i for i, fn in enumerate(graph.activation_fns())}
    out: list[frozenset] = []
    for nd in graph.nodes:
        out.append(NODE_KIND_RULES[nd.kind](nd, out, slot))
    return out


@dataclass(frozen=True)
class LayerPlan:
    """One weighted layer: its variances and the q of its output."""

    sigma_w2: float
    sigma_b2: float
    q: float


@dataclass(frozen=True)
class NetworkPlan:
    layers: dict[int, LayerPlan]  # affine node -> its plan
    mixed: tuple[int, ...]  # affine nodes (and the output) reading a mix of kinds: not exact
    output_kind: frozenset  # what the output holds
    output_q: float | None  # its q (None where mixed)
    no_bias: frozenset  # function slots read by a layer without bias: their readers are q-preserving
    # function slots whose features an rms_norm or a mul reads: the pass carries phi's own normalized C
    # map there (the product and the norm need it), so every layer reading them is q-preserving too
    own_map: frozenset = frozenset()

    @property
    def own(self) -> frozenset:
        """The function slots whose pass value is phi's own C map (``no_bias`` and ``own_map``)."""
        return self.no_bias | self.own_map


def kind_q(kind, q_star: float, sols: list[EOCSolution]) -> float:
    """q of a node of one kind: 1 (input), q* (Gaussian), or E[phi_k(sqrt(q*) z)^2] = (q* - sigma_b^2) / sigma_w^2
    for function k's features (from V(q*) = q*)."""
    if kind in (INPUT, NORMED):
        return 1.0
    if kind == GAUSS:
        return q_star
    if isinstance(kind, tuple) and kind[0] == MAX_PAIR:  # q passes through a window of two
        return set_q(kind[1], q_star, sols)
    if isinstance(kind, tuple):  # a product: q = q_u q_v (independent factors)
        return set_q(kind[1], q_star, sols) * set_q(kind[2], q_star, sols)
    s = sols[kind]
    return (q_star - s.sigma_b2) / s.sigma_w2


def set_q(kind_set, q_star: float, sols: list[EOCSolution]) -> float:
    """q of a node whose value is made of ``kind_set``: one kind's, or the common q of the input, rms_norm
    outputs (q = 1) and Gaussian nodes (q*) where they agree; nan for a mix of different q."""
    if len(kind_set) == 1:
        return kind_q(next(iter(kind_set)), q_star, sols)
    if kind_set <= {INPUT, NORMED, GAUSS} and (GAUSS not in kind_set or q_star == 1.0):
        return 1.0
    return math.nan


def plan_network(graph: NetworkGraph, sols: list[EOCSolution]) -> NetworkPlan:
    """Each weighted layer's (sigma_w^2, sigma_b^2) from what it reads (module docstring). A layer
    reading an rms_norm (q = 1), a product (q = q_u q_v) or a max pair (its input's q) is q-preserving
    from that q; an activation reading an rms_norm's output at q = 1 != q* is ``mixed`` (its local map
    is taken at q*)."""
    q_star = sols[0].q_star
    kinds = node_kinds(graph)

    def uniform(kind_set) -> bool:
        # one q among the parts: one kind, or the input next to Gaussian nodes when both are at q = 1
        return not math.isnan(set_q(kind_set, q_star, sols))

    def slots(kind_set) -> set:
        out = set()
        for k in kind_set:
            if isinstance(k, int):
                out.add(k)
            elif isinstance(k, tuple):
                out |= slots(k[1]) | (slots(k[2]) if len(k) > 2 else set())
        return out

    own_map = set()
    for nd in graph.nodes:
        if nd.kind in (NORM, PRODUCT, MAX_PAIR):
            for i in nd.inputs:
                own_map |= slots(kinds[i])

    affine = [nd for nd in graph.nodes if nd.kind == AFFINE]
    # a function whose features a bias-less layer reads: EoC needs sigma_b^2 for V(q*) = q*, so
    # every layer reading that function is q-preserving instead (its C map is phi's own, normalized)
    no_bias = {
        next(iter(kinds[nd.inputs[0]]))
        for nd in affine
        if len(kinds[nd.inputs[0]]) == 1
        and isinstance(next(iter(kinds[nd.inputs[0]])), int)
        and not nd.attrs.get("bias", True)
    }
    layers, mixed = {}, []
    for nd in graph.nodes:
        if nd.kind == ACT and NORMED in kinds[nd.inputs[0]] and q_star != 1.0:
            mixed.append(nd.index)
    for nd in affine:
        reads = kinds[nd.inputs[0]]
        (first,) = reads if len(reads) == 1 else (GAUSS,)
        if not uniform(reads):
            mixed.append(nd.index)
            layers[nd.index] = LayerPlan(1.0, 0.0, math.nan)
        elif isinstance(first, int) and first not in no_bias and first not in own_map:  # EoC's pair: V(q*) = q*
            s = sols[first]
            layers[nd.index] = LayerPlan(s.sigma_w2, s.sigma_b2, q_star)
        else:  # q-preserving: sigma_w^2 = q* / q_in, no bias
            layers[nd.index] = LayerPlan(q_star / set_q(reads, q_star, sols), 0.0, q_star)
    out = kinds[graph.output]
    if not uniform(out):
        mixed.append(graph.output)
    out_q = set_q(out, q_star, sols) if uniform(out) else None
    return NetworkPlan(layers, tuple(mixed), out, out_q, frozenset(no_bias), frozenset(own_map - no_bias))


def c_map_layer(sol: EOCSolution, table, q_star: float, biased: bool = True):
    """Function k's activation and the weighted layer reading it, as one local C map at q*:
    c -> (sigma_w^2 E[phi(u) phi(v)] + sigma_b^2) / q* with u, v of variance q* and correlation c
    (sparsity paper equations 4-6 at q = q*); without the bias (q-preserving readers) phi's own
    normalized C map, E[phi(u) phi(v)] / E[phi(u)^2] (``table``)."""
    if not biased:
        return table
    q_post = (q_star - sol.sigma_b2) / sol.sigma_w2 if sol.sigma_w2 else 0.0
    return lambda c: (sol.sigma_w2 * q_post * table(c) + sol.sigma_b2) / q_star


def output_correlation(values: np.ndarray, plan: NetworkPlan, sols: list[EOCSolution]) -> np.ndarray:
    """The global pass composes each activation with the layer reading it; where the output is
    function k's features themselves, undo that layer: c = (C q* - sigma_b^2) / (q* - sigma_b^2)."""
    (kind,) = plan.output_kind if len(plan.output_kind) == 1 else (GAUSS,)
    if not isinstance(kind, int) or kind in plan.own:  # (without the bias the pass ends at phi's own C map)
        return values
    s = sols[kind]
    return (values * s.q_star - s.sigma_b2) / (s.q_star - s.sigma_b2)


def global_c_map(program, plan: NetworkPlan, sols: list[EOCSolution], tables: list, grid: np.ndarray):
    """The local maps (``c_map_layer`` per function) and the global C map at q* on ``grid`` with C(0)
    appended, composed over the program and its atoms (TAT paper section 2.3: sums atom by atom)."""
    q_star = sols[0].q_star
    maps = [c_map_layer(s, t, q_star, k not in plan.own) for k, (s, t) in enumerate(zip(sols, tables, strict=True))]
    values = program.global_map(np.append(grid, 0.0), lambda c, slot: maps[slot](c))
    return maps, np.clip(output_correlation(values, plan, sols), -1.0, 1.0)


def fixed_points(act: Activation, sol: EOCSolution, q_max_factor: float = 50.0, points: int = 160) -> list[tuple]:
    """The fixed points V(q) = q on (0, q_max_factor q*] with their stability |V'(q)| < 1, ascending
    (sparsity paper section 2: q converges to a stable one, away from an unstable one). Crossings
    are sign changes of V(q) - q on a log grid, refined by brentq; q* itself is always one."""
    qs = sol.q_star * np.logspace(-4, math.log10(q_max_factor), points)
    gap = variance_map(act, qs, sol.sigma_w2, sol.sigma_b2) - qs

    def f(q: float) -> float:
        return float(variance_map(act, q, sol.sigma_w2, sol.sigma_b2)[0]) - q

    found = [sol.q_star]
    for i in np.nonzero(np.sign(gap[:-1]) * np.sign(gap[1:]) < 0)[0]:
        q = brentq(f, qs[i], qs[i + 1], xtol=1e-12 * qs[i])
        if all(abs(q - p) > 1e-6 * p for p in found):
            found.append(q)
    out = []
    for q in sorted(found):
        h = 1e-5 * q  # V'(q) by a central difference: smooth enough for the sign of |V'| - 1
        slope = (f(q + h) - f(q - h)) / (2 * h) + 1.0
        out.append((float(q), bool(abs(slope) < 1.0 - 1e-9)))
    return out


def unstable_note(act: Activation, sol: EOCSolution, depth: int, fps: list[tuple]) -> list[str]:
    """Where V'(q*) > 1: q = q* at every node holds only for inputs exactly at q = 1; a relative
    error e of q grows by V'(q*) per layer (first order), V'(q*)^depth over the network."""
    if sol.v_slope <= 1.0 + 1e-9:
        return []
    grow = sol.v_slope**depth
    above = [q for q, st in fps if st and q > sol.q_star]
    below = [q for q, st in fps if st and q < sol.q_star]
    where = (
        f"above q* q runs to the stable fixed point {above[0]:.4g}" if above else "above q* q grows past 50 q*"
    ) + (f", below it to {below[0]:.4g}" if below else ", below it towards 0")
    return [
        f"q* = {sol.q_star:g} is an unstable fixed point of '{act.name}''s variance map (V'(q*) = {sol.v_slope:.4g}): "
        f"q = q* at every layer holds only for inputs at exactly q = 1; a relative error of q grows by V'(q*) per "
        f"layer, {grow:.3g}x over the network's {depth} layers (1% at the input: {min(grow, 1e6):.3g}% at the output, "
        f"to first order); {where} (fixed_points)"
        + (
            ": past doubling, the answer's q and C map do not hold for finite networks (assumptions.holds is false)"
            if grow >= DRIFT_LIMIT
            else ""
        )
        + ". Choose another q_star (v_slope < 1) for a stable one"
    ]
