"""The slope of the network's global Q map at q = 1, and where it makes q = 1 unstable.

DKS asks Q(1) = 1 and Q'(1) = 1 of every layer (arXiv:2110.01765, as restated in "Deep Learning
without Shortcuts: Shaping the Kernel with Tailored Rectifiers", Zhang et al., arXiv:2203.08120,
section 4), so that the global Q map Q_f (section 2.3: the layers' maps composed) has
Q_f(1) = 1 and Q_f'(1) = 1: a q value perturbed away from 1 by a finite-width layer stays as far
from 1 as it was, neither growing nor shrinking. TAT's rectifiers have Q(q) = q outright
(section 4: "a better guarantee on the stability of Q_f w.r.t. random perturbations of the q values
at each layer").

That reasoning holds for chains and normalized sums. A product node (``mul``, a gated MLP's
``act(W_1 x) * (W_3 x)``) breaks it: at q = 1 its Q map is Q_u(q) Q_v(q), so its log-slope is the sum
of its factors', 1 + 1 = 2 for a transformed activation times a linear stream. Each such product
on a path doubles the slope; with no norm between them, L gated blocks give Q_f'(1) = 2^L. Then
q = 1 is still the fixed point the infinite-width prediction sits on, exactly, but an unstable
one: a token's or an example's q, off by the usual O(1/sqrt(width)) at one layer, is off 2^L
times as much at the output, and finite-width networks drift from the predicted kernel (the
6-block normalization-free Llama at width 1024, dks zeta 73.6: the output tokens' q spans 0.39 to
76 over 8 networks, where the answer predicts 0.008 to 1; ``tests/engine/test_q_map.py`` measures
the slope itself by Monte Carlo).
``Q'(1) < 1`` for the gate's activation would compensate, but it is not reachable near the
identity for the usual gates (swish: no stable transformation with Q'(1) = 0.7 and DKS's C'(1)).

``global_q_slopes`` is the d log q / d log q_in of every node at q = 1, one rule per op kind (the
op table's kinds, like every walk of the graph): linear layers, attention (linear in its values at
q = 1 with zero-initialized queries) and max pairs (E[max^2] = q) pass it on; an activation
multiplies it by its own Q'(1); a norm resets it to 0 (it sets q whatever it reads); a normalized
sum averages its atoms' (``global_q_slopes``), a concatenation its inputs' by width; a product adds
its factors'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...schemas.activations import canonical_name
from ...schemas.kernels import concat_coefficients
from ...schemas.ops import ACT, AFFINE, ATTENTION, CONCAT, MAX_PAIR, NORM, PASS, PRODUCT, SOURCE, SUM
from ...schemas.structure import structure_report
from ..graph.build import NetworkGraph

# a global Q'(1) beyond this, at some node, is worth a warning: q = 1 amplifies finite-width
# deviations of q by more than 2x there (one gated block without a norm already reaches 2)
UNSTABLE_Q_SLOPE = 2.0 - 1e-9


def _mean(values, coefficients) -> float:
    total = sum(coefficients) or 1.0
    return sum(c * v for c, v in zip(coefficients, values, strict=True)) / total


@dataclass
class _Walk:
    """What the rules read: every node's slope so far, its expansion over atoms (``global_q_slopes``),
    the functions' local Q'(1) and the graph's nodes."""

    slopes: list[float]
    expansions: list[dict[int, float]]
    local: Mapping[str, float]
    nodes: list


def _own(slope: float):
    return slope, None  # the node is an atom of its own


def _sum(nd, w: _Walk):
    """A sum mixes its atoms, not its inputs: its q is sum_a c_a^2 q_a over the atoms a with the
    coefficients merged, so its slope is the c_a^2-weighted mean of theirs."""
    acc: dict[int, float] = {}
    for i, weight in zip(nd.inputs, nd.attrs["weights"], strict=True):
        for a, c in w.expansions[i].items():
            acc[a] = acc.get(a, 0.0) + weight * c
    return _mean([w.slopes[a] for a in acc], [c * c for c in acc.values()]), acc


# a node of each kind: (d log q / d log q_in at q = 1, its expansion over atoms or None for an atom of
# its own), from the walk so far (module docstring)
Q_SLOPE_RULES = {
    SOURCE: lambda nd, w: _own(1.0),
    PASS: lambda nd, w: (w.slopes[nd.inputs[0]], w.expansions[nd.inputs[0]]),
    AFFINE: lambda nd, w: _own(w.slopes[nd.inputs[0]]),
    # the values are the last input; the keys and the (zero-initialized) queries do not scale the output
    ATTENTION: lambda nd, w: _own(w.slopes[nd.inputs[-1]]),
    MAX_PAIR: lambda nd, w: _own(w.slopes[nd.inputs[0]]),
    ACT: lambda nd, w: _own(w.local[nd.attrs["fn"]] * w.slopes[nd.inputs[0]]),
    NORM: lambda nd, w: _own(0.0),
    SUM: _sum,
    CONCAT: lambda nd, w: _own(
        _mean([w.slopes[i] for i in nd.inputs], concat_coefficients(w.nodes[i].width for i in nd.inputs))
    ),
    PRODUCT: lambda nd, w: _own(w.slopes[nd.inputs[0]] + w.slopes[nd.inputs[1]]),
}


def global_q_slopes(graph: NetworkGraph, local_q_slope: Mapping[str, float]) -> list[float]:
    """d log q / d log q_in at q = 1 of every node (canonical order), for activations of per-function
    local Q'(1) ``local_q_slope`` (a function's name to its transformed Q'(1) at 1).

    Sums are composed over atoms (``schemas.atoms``, the expansion the C maps compose over), so
    x + F(x) + x counts x once with its coefficients merged. An expansion stops at every node that is
    not linear, a norm included (its q is fixed whatever it reads, where the atom pass sees through
    it at q = 1), and at the atom pass's private nodes (their cone reaches the rest only through
    them), which keeps expansions as small as that pass's."""
    private = structure_report(graph.nodes).atoms.private
    w = _Walk([], [], local_q_slope, graph.nodes)
    for v, nd in enumerate(graph.nodes):
        slope, expansion = Q_SLOPE_RULES[nd.kind](nd, w)
        w.slopes.append(float(slope))
        w.expansions.append({v: 1.0} if expansion is None or (nd.kind == SUM and private[v]) else expansion)
    return w.slopes


def unstable_q_warnings(graph: NetworkGraph, local_q_slope: Mapping[str, float]) -> list[str]:
    """One warning when products make the global Q map's slope at q = 1 reach ``UNSTABLE_Q_SLOPE``
    somewhere (module docstring), naming the node where it is largest; none for graphs without
    products (no other kind raises it above 1)."""
    products = sum(1 for nd in graph.nodes if nd.kind == PRODUCT)
    if not products:
        return []
    slopes = global_q_slopes(graph, local_q_slope)
    worst = max(range(len(slopes)), key=slopes.__getitem__)
    if slopes[worst] < UNSTABLE_Q_SLOPE:
        return []
    return [
        f"q = 1 is an unstable fixed point of this network: the global Q map's slope Q_f'(1) reaches "
        f"{slopes[worst]:.4g} at {graph.nodes[worst].user_id!r} (DKS and TAT keep it at 1). Each 'mul' "
        f"({products} here) adds its factors' slopes, 2 for an activation times a linear stream, and no "
        "norm between them resets it; the prediction is exact at infinite width, but a finite-width "
        "network's deviations of q from 1 grow by up to that factor, so its kernels drift from the "
        "answer's. Keep a norm before each gated block (rms_norm or layer_norm), as Llama's blocks do"
    ]


def answer_q_slopes(graph: NetworkGraph, answer) -> dict[str, float] | None:
    """Each of the graph's functions' Q'(1) from a TAT or DKS answer, looked up as
    ``Solution.for_function`` looks up a transformation (``activations`` under the canonical name
    when the answer has several, else its top level); None for answers whose q is not held at 1
    (EoC's q*, geometric) or that state no Q'(1)."""
    if answer.method not in ("tat", "dks"):
        return None
    per = answer.activations or {}
    out = {}
    for fn in graph.activation_fns():
        own = per.get(canonical_name(fn) or fn)
        slope = own.q_slope_1 if own is not None else answer.q_slope_1
        if slope is None:
            return None
        out[fn] = slope
    return out
