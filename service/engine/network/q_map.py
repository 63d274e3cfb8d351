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
times as much at the output, and finite-width networks drift from the predicted kernel (a 6-block
norm-free SwiGLU network at width 256 spreads log q over tokens 0.21, 0.44, ... 8.2, block by block).
``Q'(1) < 1`` for the gate's activation would compensate, but it is not reachable near the
identity for the usual gates (swish: no stable transformation with Q'(1) = 0.7 and DKS's C'(1)).

``global_q_slopes`` is the d log q / d log q_in of every node at q = 1, one rule per op kind (the
op table's kinds, like every walk of the graph): linear layers, attention (linear in its values at
q = 1 with zero-initialized queries) and max pairs (E[max^2] = q) pass it on; an activation
multiplies it by its own Q'(1); a norm resets it to 0 (it sets q whatever it reads); a normalized
sum and a concatenation average their inputs' (exact for inputs with no cross terms; between their
inputs' slopes otherwise); a product adds its factors'.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...schemas.kernels import concat_coefficients, sum_coefficients
from ...schemas.ops import ACT, AFFINE, ATTENTION, CONCAT, MAX_PAIR, NORM, PASS, PRODUCT, SOURCE, SUM
from ..graph.build import NetworkGraph

# a global Q'(1) beyond this, at some node, is worth a warning: q = 1 amplifies finite-width
# deviations of q by more than 2x there (one gated block without a norm already reaches 2)
UNSTABLE_Q_SLOPE = 2.0 - 1e-9


def _mean(values, coefficients) -> float:
    total = sum(coefficients) or 1.0
    return sum(c * v for c, v in zip(coefficients, values, strict=True)) / total


# d log q / d log q_in at q = 1 of a node of each kind, from the slopes of its inputs (module docstring)
Q_SLOPE_RULES = {
    SOURCE: lambda nd, ins, local, nodes: 1.0,
    PASS: lambda nd, ins, local, nodes: ins[0],
    AFFINE: lambda nd, ins, local, nodes: ins[0],
    # the values are the last input; the keys and the (zero-initialized) queries do not scale the output
    ATTENTION: lambda nd, ins, local, nodes: ins[-1],
    MAX_PAIR: lambda nd, ins, local, nodes: ins[0],
    ACT: lambda nd, ins, local, nodes: local[nd.attrs["fn"]] * ins[0],
    NORM: lambda nd, ins, local, nodes: 0.0,
    SUM: lambda nd, ins, local, nodes: _mean(ins, sum_coefficients(nd.attrs["weights"])),
    CONCAT: lambda nd, ins, local, nodes: _mean(ins, concat_coefficients(nodes[i].width for i in nd.inputs)),
    PRODUCT: lambda nd, ins, local, nodes: ins[0] + ins[1],
}


def global_q_slopes(graph: NetworkGraph, local_q_slope: Mapping[str, float]) -> list[float]:
    """d log q / d log q_in at q = 1 of every node (canonical order), for activations of per-function
    local Q'(1) ``local_q_slope`` (a function's name to its transformed Q'(1) at 1)."""
    out: list[float] = []
    for nd in graph.nodes:
        out.append(float(Q_SLOPE_RULES[nd.kind](nd, [out[i] for i in nd.inputs], local_q_slope, graph.nodes)))
    return out


def unstable_q_warnings(graph: NetworkGraph, local_q_slope: Mapping[str, float]) -> list[str]:
    """One warning when products make the global Q map's slope at q = 1 reach ``UNSTABLE_Q_SLOPE``
    somewhere (module docstring), naming the node where it is largest; none for graphs without
    products (no other kind raises it above 1)."""
    if not any(nd.kind == PRODUCT for nd in graph.nodes) or not any(nd.kind == ACT for nd in graph.nodes):
        return []
    slopes = global_q_slopes(graph, local_q_slope)
    worst = max(range(len(slopes)), key=slopes.__getitem__)
    if slopes[worst] < UNSTABLE_Q_SLOPE:
        return []
    products = sum(1 for nd in graph.nodes if nd.kind == PRODUCT)
    return [
        f"q = 1 is an unstable fixed point of this network: the global Q map's slope Q_f'(1) reaches "
        f"{slopes[worst]:.4g} at {graph.nodes[worst].user_id!r} (DKS and TAT keep it at 1). Each 'mul' "
        f"({products} here) adds its factors' slopes, 2 for an activation times a linear stream, and no "
        "norm between them resets it; the prediction is exact at infinite width, but a finite-width "
        "network's deviations of q from 1 grow by up to that factor, so its kernels drift from the "
        "answer's. Keep a norm before each gated block (rms_norm or layer_norm), as Llama's blocks do"
    ]


def answer_q_slopes(graph: NetworkGraph, answer) -> dict[str, float] | None:
    """Each function's Q'(1) from a TAT or DKS answer (``activations`` when it has several, else its
    ``q_slope_1``); None for answers whose q is not held at 1 (EoC's q*, geometric)."""
    if answer.method not in ("tat", "dks"):
        return None
    if answer.activations:
        return {name: p.q_slope_1 for name, p in answer.activations.items() if p.q_slope_1 is not None}
    if answer.q_slope_1 is None:
        return None
    return dict.fromkeys(graph.activation_fns(), answer.q_slope_1)
