"""Geometric initialization and GR scaling for ReLU-family networks (GR-scaling paper:
"Scaling laws for the principled design, initialization, and preconditioning of ReLU networks",
arXiv:1906.04267).

The paper balances the diagonal blocks of the Hessian at initialization. Its measure of a block is
the GR scaling of a weighted layer, Proposition 3 and its convolutional form, equation 1:

    gamma_l = alpha_l^4 b n_l^in k_l^2 rho_l^2 E[x_l^2]^2 E[Delta y_l^2] / E[y_l^2]      (1)

(b = 1: section 3.1 works at batch size 1; rho_l^2 = output positions; k_l^2 = kh * kw; n_l^in =
input channels or features). A network is *preconditioned* when gamma_l is the same for every
layer. For ReLU-family layers (positively homogeneous of degree 1: Table 1) the geometric-mean
initialization does it for chains of equal kernel size:

    E[W_l^2] = c / sqrt(n_l^in n_l^out)                  dense (equation 7)
    E[W_l^2] = c / (k_l^2 sqrt(n_l^in n_l^out))          conv  (Remark 6)

with n^in, n^out the *channel* counts of a convolution (section 5 and Appendix B write n^in and
k^2 separately; the conv value equals c / sqrt((n^in k^2)(n^out k^2)), the geometric mean of the
fans counted as channels * k^2, so both readings give the same number). c = 2 for ReLU (equation
7, Proposition 7: also balances the biases); for a Leaky ReLU of slope a, c = 2 / (1 + a^2), the
inverse of its second-moment gain (1 + a^2) / 2.

How the second moments are computed (Appendix B, assumptions A1-A3 of section 3.2): per-element
non-central second moments are pushed forward from the input and backward from the output with

    dense   E[y^2] = n^in E[W^2] E[x^2]                 E[Dx^2] = n^out E[W^2] E[Dy^2]
    conv    E[y^2] = n^in k^2 E[W^2] E[x^2]             E[Dx^2] = n^out k^2 E[W^2] E[Dy^2] P_out / P_in
    act     both multiplied by the gain (1 + a^2) / 2   (equation 3)
    sum     sum_i w_i^2 (.)_i, both ways (uncorrelated inputs; where a stream reaches a sum through
            several paths the answer's sum_scales make it so: ``geometric_atoms``)
    concat  forward: channel-weighted average; backward: each input gets the output's moment
    avg_pool (kernel K taps): forward / K, backward (P_out / P_in) / K   (entries independent and
            centred: the model under which Table 1 marks average pooling as scale preserving)
    max_pool: forward unchanged, backward routed to one input (P_out / P_in); Table 1: breaks
            the scaling, so a warning is given

(P = number of spatial positions; the P_out / P_in factor is the stride correction of the
backward pass, which makes strided convolutions scale preserving as section 7 states). At the
output, E[Delta y^2] = E[y^2]: the least-squares loss with the targets dropped (assumption A2,
Appendix A).

Residual and dense branches (Appendix E.1). The ratio E[Delta y_l^2] / E[y_l^2] in equation 1
stands for the upper Hessian R_l applied to a random vector, and equals it only where the rest
of the network depends on y_l alone. E.1: for a layer inside a residual branch the ratio "may be
computed further up the network, as long as any scaling in between is corrected for" (the factor
s^4). Here that is done for any graph: the ratio is taken at the nearest node z downstream of
y_l through which every input-output path passes (a dominator of the output), and corrected by
the forward and backward second-moment gains of the linear map y_l -> z,

    E[Delta y_l^2] / E[y_l^2]  ->  g_fwd(y_l -> z) g_bwd(z -> y_l) E[Delta z^2] / E[z^2].

For a residual branch ending in a sum with branch weight w this is w^4 E[Dz^2] / E[z^2], E.1's
s^4 factor; for a chain z = y_l and nothing changes. The conditioning multipliers alpha_l of
section 5 then equalize the gammas: gamma_l scales with alpha_l^4 while the weights are drawn
with second moment E[W_l^2] / alpha_l^2, so the forward pass is unchanged (Appendix E). This
reproduces E.1's alpha^2 = (k_1 / k_0) s^2 / (1 + s^2), its final-layer alpha^2 = k s^2 / (1 + s^2),
the 1 / sqrt(3) of the bottleneck block, and the kernel-size correction alpha_l^2 ~ 1 / k_l of
sections 5 and 8.1. The alphas are normalized so the largest is 1 (the paper's examples only
scale down); any common factor is equally valid (Appendix E: "beta_0 may be chosen arbitrarily").

Input and output (sections 6.3, 6.4). Biases and weights of the first layer have equal GR scaling
when E[x_0^2] = 1 / sqrt(n_0 k_0^2) (section 6.3); with a conditioning multiplier alpha_0 on the
first layer (whose weight gamma scales as alpha_0^4 while its bias gamma does not) this becomes
1 / (alpha_0^2 sqrt(n_0 k_0^2)). The output second moment follows from the forward pass, and the
output scale is the fixed factor that brings the output to standard deviation 0.05 (Appendix F;
section 6.4: 0.01 to 0.1 "appear to work well").

Activations. Table 1 marks sigmoid and tanh (and every activation that is not positively
homogeneous) as breaking the scaling, and the derivation needs homogeneity twice: the constant
c and the halving of both moments (equation 3) come from it, and so does the exactness of the
Gauss-Newton form of each block (Appendix A.1: the network above a layer is piecewise linear).
For such activations there is no geometric initialization to give, so they are rejected with
``unsupported_activation`` instead of answered with numbers the paper does not support.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...errors import SigpropError
from ...schemas.atoms import AtomPass, atom_pass
from ...schemas.kernels import concat_coefficients, sum_coefficients
from ...schemas.ops import ACT, AFFINE, CONCAT, MAX_PAIR, NORM, PRODUCT, SOURCE, SUM, rule
from ..graph.build import NetworkGraph, correlated_sum_warnings, pass_sources
from ..maps.activations import Activation, get_activation
from ..network.subnetworks import _dominators
from . import geometric_atoms as shared

# Appendix F: the logits are scaled to standard deviation 0.05 at initialization.
OUTPUT_STD = 0.05


@dataclass(frozen=True)
class GeometricSolution:
    """Geometric initialization of every weighted layer and its predicted GR scaling.

    ``layers`` holds one dict per dense/conv layer in canonical order with keys ``id``, ``node``,
    ``op``, ``fan_in``, ``fan_out`` (channels for convs), ``kernel`` ([kh, kw], None for dense),
    ``weight_second_moment`` (equation 7 / Remark 6: the second moment of the effective weight
    alpha_l W_l), ``alpha``, ``init_second_moment`` (weight_second_moment / alpha^2: what W_l is
    drawn with when the layer output is multiplied by alpha_l), ``gamma`` (equation 1 with
    alpha), ``gamma_uncorrected`` (alpha = 1), ``gamma_bias`` (Appendix D) and ``in_branch``
    (True where the gamma ratio was taken further up the network, Appendix E.1).
    """

    activation: str
    c: float
    layers: list[dict]
    input_second_moment: float
    output_second_moment: float
    output_scale: float
    gamma_ratio: float
    gamma_ratio_uncorrected: float
    warnings: list[str] = field(default_factory=list)
    # sum node index -> factor on its weights where an atom reaches it through several paths
    # (``geometric_atoms``): with it, the sum's second moment is the recursion's
    sum_scales: dict[int, float] = field(default_factory=dict)


def _resolve(activation: str | Activation) -> Activation:
    return activation if isinstance(activation, Activation) else get_activation(activation)


def _homogeneous_gain(act: Activation, where: str) -> float:
    """(phi(1)^2 + phi(-1)^2) / 2: the second-moment gain of a positively homogeneous activation on
    a symmetric input, forward and backward alike (equation 3: 1/2 for ReLU)."""
    if not act.positively_homogeneous:
        raise SigpropError(
            "unsupported_activation",
            "geometric initialization needs a positively homogeneous activation (ReLU family); "
            f"{where} uses '{act.name}'",
            "Table 1 of the GR-scaling paper: sigmoid, tanh and other non-homogeneous activations break the scaling; "
            "use 'relu' or 'leaky_relu', or the 'tat', 'dks' or 'eoc' methods for smooth activations",
        )
    up, down = float(act.fn(1.0)), float(act.fn(-1.0))
    return 0.5 * (up * up + down * down)


def _positions(shape) -> int:
    return math.prod(shape[1:]) if len(shape) == 3 else 1


def _rules(graph: NetworkGraph, gains: dict[int, float], w2: dict[int, float]):
    """Per node and input slot: (forward, backward) multipliers of the per-element second moments,
    from each op's row (its kind, its window and what a pool takes of it)."""
    nodes = graph.nodes
    rules: list[list[tuple[float, float]]] = []
    for nd in nodes:
        ins = [nodes[i] for i in nd.inputs]
        row = rule(nd.op)
        if nd.kind == AFFINE:
            x = ins[0]
            taps = row.window(nd.attrs, x.shape)  # a conv's kernel taps, 1 for dense
            ratio = _positions(nd.shape) / _positions(x.shape)
            fwd = x.shape[0] * taps * w2[nd.index]
            bwd = nd.shape[0] * taps * w2[nd.index] * ratio
            rules.append([(fwd, bwd)])
        elif nd.kind == ACT:
            rules.append([(gains[nd.index], gains[nd.index])])
        elif nd.kind == SUM:
            rules.append([(f, f) for f in sum_coefficients(nd.attrs["weights"])])
        elif nd.kind == CONCAT:
            rules.append([(f, 1.0) for f in concat_coefficients(x.shape[0] for x in ins)])
        elif row.pool == "mean":  # avg_pool: its kernel taps; global_avg_pool: every location
            pin, pout = _positions(ins[0].shape), _positions(nd.shape)
            taps = row.window(nd.attrs, ins[0].shape)
            rules.append([(1.0 / taps, pout / pin / taps)])
        elif row.pool == "max":
            rules.append([(1.0, _positions(nd.shape) / _positions(ins[0].shape))])
        else:  # input, flatten, dropout (identity at initialization), identity, output
            rules.append([(1.0, 1.0)] * len(ins))
    return rules


def _refuse_unscaled(graph: NetworkGraph) -> None:
    """The GR scaling propagates second moments linearly through every node (Proposition 3): an
    rms_norm (which resets them to 1) or a product of two streams (m_u m_v) breaks it; a max_pool of
    feature pairs keeps the second moment but its features' means and its gradients (half the entries)
    are not in the GR rules."""
    if any(nd.kind == MAX_PAIR for nd in graph.nodes):
        raise SigpropError(
            "unsupported_structure",
            "geometric initialization does not cover max_pool over pairs of features: its output is a feature "
            "with a non-zero mean (sqrt(q/pi)) whose second-moment and gradient rules are not the GR paper's",
            "use method 'eoc' or 'tat' with 'leaky_relu' for graphs with max_pool on [features]",
        )
    found = sorted({nd.op for nd in graph.nodes if nd.kind in (NORM, PRODUCT)})
    if found:
        # the graph here is anonymized: the count and the ops name what to change
        raise SigpropError(
            "unsupported_structure",
            f"geometric initialization does not cover {' or '.join(found)} nodes: the GR scaling propagates "
            "per-element second moments linearly, which a normalization (q -> 1) or a product of two streams "
            "(m_u m_v) does not",
            "use method 'eoc', 'dks' or 'tat' for graphs with rms_norm or mul nodes",
        )


def _forward(graph: NetworkGraph, rules, seed: dict[int, float]) -> list[float]:
    """Per-element second moments pushed forward; ``seed`` fixes the values at some nodes."""
    m = [0.0] * graph.n
    for nd in graph.nodes:
        if nd.index in seed:
            m[nd.index] = seed[nd.index]
        else:
            m[nd.index] = sum(f * m[i] for i, (f, _) in zip(nd.inputs, rules[nd.index], strict=False))
    return m


def _backward(graph: NetworkGraph, rules, start: int, value: float) -> list[float]:
    """Per-element second moments of the gradient pulled back from node ``start``."""
    d = [0.0] * graph.n
    d[start] = value
    for nd in reversed(graph.nodes[: start + 1]):
        if d[nd.index] == 0.0:
            continue
        for i, (_, b) in zip(nd.inputs, rules[nd.index], strict=False):
            d[i] += b * d[nd.index]
    return d


def _output_dominators(graph: NetworkGraph) -> list[int]:
    """Nodes every input-output path passes through, in canonical (topological) order."""
    idom, _ = _dominators([list(nd.inputs) for nd in graph.nodes], graph.n)
    chain, v = [], graph.output
    while v != graph.n:
        chain.append(v)
        v = idom[v]
    return sorted(chain)


def _activation_gains(graph: NetworkGraph, act: Activation, gain: float, warnings: list[str]) -> dict[int, float]:
    """Each activation node's second-moment gain (a graph may name other homogeneous functions)."""
    gains: dict[int, float] = {}
    other: set[str] = set()
    for nd in graph.nodes:
        if nd.kind == ACT:
            fn = nd.attrs["fn"]
            a = act if fn == act.name else get_activation(fn)
            gains[nd.index] = _homogeneous_gain(a, f"activation node '{nd.user_id}'")
            if abs(gains[nd.index] - gain) > 1e-12:
                other.add(fn)
    if other:
        warnings.append(
            f"activation(s) {', '.join(sorted(other))} have another second-moment gain than '{act.name}': "
            f"the weight gammas stay balanced for any common c, but the biases balance only for c = 1/gain "
            "(Proposition 7)"
        )
    return gains


def _pooling_warnings(graph: NetworkGraph) -> list[str]:
    nodes, out = graph.nodes, []
    pools = [nd.user_id for nd in nodes if rule(nd.op).pool == "max"]
    if pools:
        out.append(
            f"max_pool breaks the GR scaling (Table 1): {', '.join(pools[:5])}; it is modelled as routing "
            "(forward second moment kept, gradient sent to one input), which understates the max, so "
            "gammas of the layers below it are approximate; a strided conv or avg_pool keeps the scaling"
        )
    mean_pools = []
    source = pass_sources(nodes)
    for nd in nodes:
        if rule(nd.op).pool == "mean" and nodes[source[nd.inputs[0]]].kind == ACT:
            mean_pools.append(nd.user_id)
    if mean_pools:
        out.append(
            f"average pooling of activations ({', '.join(mean_pools[:5])}) is modelled as in Table 1 "
            "(pooled entries independent and centred); post-ReLU features have a non-zero mean, so in "
            "practice the pooled second moment is larger (up to about K/pi times over K positions), "
            "which raises the gammas of the layers after the pool; measure nu_l (section 4) to check"
        )
    return out


def _gamma_ratios(graph: NetworkGraph, layers, segment, m, d) -> tuple[dict[int, float], dict[int, bool]]:
    """E[Delta y^2] / E[y^2] per layer, through the nearest output dominator at or after it (so a
    layer inside a residual branch is measured through its block), and whether it sits in a branch.

    The layers measured through one dominator z are those after the dominator before it; every
    path from such a layer to z stays between the two, so one reverse pass over that segment gives
    the gains of all of them (``segment(lo, z, ys)``, ``_segment_gains``): linear in nodes plus edges,
    where a pass per layer was quadratic on a ladder whose blocks all end in sums with one early node."""
    cuts = _output_dominators(graph)
    by_cut: dict[int, list[int]] = {}
    at = 0
    for nd in layers:  # canonical (topological) order, as the cuts are
        while cuts[at] < nd.index:
            at += 1
        by_cut.setdefault(cuts[at], []).append(nd.index)
    ratio: dict[int, float] = {}
    in_branch: dict[int, bool] = {}
    for z, ys in by_cut.items():
        inner = [y for y in ys if y != z]
        if inner and m[z] != 0.0:
            g_fwd, g_bwd = segment(inner[0], z, inner)
        for y in ys:
            if z == y or m[z] == 0.0:
                ratio[y] = d[y] / m[y] if m[y] > 0 else 0.0
            else:
                ratio[y] = g_fwd[y - inner[0]] * g_bwd[y - inner[0]] * d[z] / m[z]
            in_branch[y] = z != y
    return ratio, in_branch


def _segment_gains(graph: NetworkGraph, rules, lo: int, z: int) -> tuple[list[float], list[float]]:
    """For every node y in [lo, z]: the forward gain of the second moment from y to z and the
    backward gain from z to y (the sums over the paths y -> z of the products of the forward,
    respectively backward, multipliers), indexed y - lo. One reverse pass: the forward gains are
    the adjoint of the forward recursion, pulled back from z like the backward moments."""
    fwd = [0.0] * (z - lo + 1)
    bwd = [0.0] * (z - lo + 1)
    fwd[-1] = bwd[-1] = 1.0
    for nd in reversed(graph.nodes[lo : z + 1]):
        f, b = fwd[nd.index - lo], bwd[nd.index - lo]
        if f == 0.0 and b == 0.0:
            continue
        for i, (fi, bi) in zip(nd.inputs, rules[nd.index], strict=False):
            if i >= lo:
                fwd[i - lo] += fi * f
                bwd[i - lo] += bi * b
    return fwd, bwd


def _balancing_alphas(graph: NetworkGraph, raw: dict[int, float], warnings: list[str]) -> dict[int, float]:
    """alpha_l = (min gamma / gamma_l)^(1/4) (section 5): every live layer's gamma equal to the smallest."""
    live = [g for g in raw.values() if g > 0]
    dead = [graph.nodes[i].user_id for i, g in raw.items() if not g > 0]
    if dead:
        warnings.append(
            f"layer(s) {', '.join(dead[:5])} have gamma 0 (their output is weighted 0 on the way to the "
            "output); no conditioning multiplier can balance them and they are left at alpha = 1"
        )
    g_min = min(live) if live else 1.0
    alpha = {}
    for i, g in raw.items():
        a = (g_min / g) ** 0.25 if g > 0 else 1.0
        alpha[i] = 1.0 if abs(a - 1.0) < 1e-12 else a
    return alpha


def solve_geometric(
    graph: NetworkGraph,
    activation: str | Activation,
    *,
    input_second_moment: float | None = None,
    output_std: float = OUTPUT_STD,
    atoms: AtomPass | None = None,
) -> GeometricSolution:
    """Geometric initialization (equation 7, Remark 6), conditioning multipliers (section 5,
    Appendix E, E.1), input and output scaling (sections 6.3, 6.4) and the GR scaling gamma_l of
    every weighted layer (Proposition 3, equation 1); see the module docstring.

    ``activation`` names the request's activation (or is an :class:`Activation` built with its
    parameters, e.g. a Leaky ReLU slope); it fixes c = 1 / gain. ``input_second_moment`` defaults
    to the recommended one, at which the returned gammas are evaluated. ``atoms``: the graph's
    ``schemas.atoms`` pass, when the caller has it (computed here otherwise). Where an atom reaches a
    sum through several paths the answer prescribes ``sum_scales`` (``geometric_atoms``).
    """
    act = _resolve(activation)
    gain = _homogeneous_gain(act, "the request")
    c = 1.0 / gain
    nodes = graph.nodes
    _refuse_unscaled(graph)
    warnings = list(graph.warnings)
    gains = _activation_gains(graph, act, gain, warnings)

    layers = [nd for nd in nodes if nd.kind == AFFINE]
    if not layers:
        raise SigpropError(
            "invalid_graph",
            "the graph has no dense or conv layer to initialize",
            "geometric initialization sets the weights of dense and conv layers",
        )
    w2, info = _layer_weights(nodes, layers, c)
    warnings += _pooling_warnings(graph)

    rules = _rules(graph, gains, w2)
    m = _forward(graph, rules, {nd.index: 1.0 for nd in nodes if nd.kind == SOURCE})
    comp = _shared_atoms(graph, rules, m, atoms)
    if comp is None:
        d = _backward(graph, rules, graph.output, m[graph.output])  # A2: Delta y_out = y_out
        segment = lambda lo, z, ys: _segment_gains(graph, rules, lo, z)  # noqa: E731
    else:  # the recursion's forward moments hold with comp.scales; gradients compose over atoms
        d = shared.backward(graph, rules, comp, graph.output, m[graph.output])
        segment = _shared_segment(graph, rules, comp)
        warnings.append(_scales_note(graph, comp))
    ratio, in_branch = _gamma_ratios(graph, layers, segment, m, d)
    raw = {}
    for nd in layers:
        n_in, _, taps, pos = info[nd.index]
        x = m[nd.inputs[0]]
        raw[nd.index] = n_in * taps * pos * x * x * ratio[nd.index]  # equation 1, alpha = b = 1
    alpha = _balancing_alphas(graph, raw, warnings)

    t = _input_moment(layers[0], info, alpha, input_second_moment)
    # Everything is homogeneous in the input moment t: m and d scale as t (A2), gamma as t^2.
    out_m = m[graph.output] * t
    out_scale = output_std / math.sqrt(out_m) if out_m > 0 else 1.0

    result = [_layer_row(nd, info, w2, alpha, raw, ratio, in_branch, t) for nd in layers]
    return GeometricSolution(
        activation=act.name,
        c=c,
        layers=result,
        input_second_moment=t,
        output_second_moment=out_m,
        output_scale=out_scale,
        gamma_ratio=_spread(result, "gamma"),
        gamma_ratio_uncorrected=_spread(result, "gamma_uncorrected"),
        warnings=warnings,
        sum_scales=dict(comp.scales) if comp is not None else {},
    )


def _shared_atoms(graph: NetworkGraph, rules, m, atoms: AtomPass | None) -> shared.Composition | None:
    """The composition over atoms where some atom reaches a sum through several paths, else None
    (the recursion is exact as it is). ``atoms``: the structure report's pass, when the caller has it."""
    if atoms is None:
        weights = [nd.attrs.get("weights") if nd.kind == SUM else None for nd in graph.nodes]
        atoms = atom_pass([nd.op for nd in graph.nodes], [nd.inputs for nd in graph.nodes], weights)
    if not atoms.shared:
        return None
    comp = shared.compose(graph, rules, m, atoms.private)
    return comp if comp.merged else None


def _shared_segment(graph: NetworkGraph, rules, comp: shared.Composition):
    """Segment gains composed over atoms where the segment holds a sum an atom reached twice (only
    there can a perturbation reach a node through two linear paths), the recursion's elsewhere."""

    def segment(lo: int, z: int, ys):
        if any(lo <= v <= z for v in comp.merged):
            return shared.segment_gains(graph, rules, comp, lo, z, ys)
        return _segment_gains(graph, rules, lo, z)

    return segment


def _scales_note(graph: NetworkGraph, comp: shared.Composition) -> str:
    names = [graph.nodes[v].user_id for v in sorted(comp.merged)]
    return (
        f"{len(names)} sum(s) ({', '.join(names[:5])}) add the same stream through several paths: its "
        "coefficients add before squaring, so the sum's second moment is not sum_i w_i^2 m_i; the answer's "
        "sum_scales multiply those sums' weights so it is, and the gradients and gammas are those of the "
        "rescaled network"
    )


def unscaled_sum_warnings(graph: NetworkGraph, sol: GeometricSolution) -> list[str]:
    """The correlated-sum warnings (``correlated_sum_warnings``) of the sums ``sum_scales`` leaves alone."""
    done = tuple(f"sum node '{graph.nodes[v].user_id}'" for v in sol.sum_scales)
    return [n for n in correlated_sum_warnings(graph.nodes) if not (done and n.startswith(done))]


def _layer_weights(nodes, layers, c: float) -> tuple[dict[int, float], dict[int, tuple[int, int, int, int]]]:
    """Each weighted layer's weight second moment (equation 7, Remark 6) and its
    (fan_in, fan_out, kernel taps, positions)."""
    w2: dict[int, float] = {}
    info: dict[int, tuple[int, int, int, int]] = {}
    for nd in layers:
        n_in, n_out = nodes[nd.inputs[0]].shape[0], nd.shape[0]
        taps = rule(nd.op).window(nd.attrs, nodes[nd.inputs[0]].shape)  # a conv's kernel taps, 1 for dense
        w2[nd.index] = c / (taps * math.sqrt(n_in * n_out))  # equation 7, Remark 6
        info[nd.index] = (n_in, n_out, taps, _positions(nd.shape))
    return w2, info


def _input_moment(first, info: dict, alpha: dict, input_second_moment: float | None) -> float:
    """The input second moment t: the given one, else the recommended 1 / sqrt(n_0 k_0^2) (section 6.3)."""
    n0, _, k0sq, _ = info[first.index]
    t = (
        1.0 / (alpha[first.index] ** 2 * math.sqrt(n0 * k0sq))  # section 6.3
        if input_second_moment is None
        else float(input_second_moment)
    )
    if input_second_moment is None and not (t > 0 and math.isfinite(t)):
        # the first layer's multiplier is 0 or not finite: the gammas span more than a double
        raise SigpropError(
            "invalid_graph",
            "the GR scalings of this graph's layers span more than a double's range, so no "
            "conditioning multipliers balance them (its second moments grow or shrink geometrically "
            "along its depth)",
            "a sum with weights 1 doubles the second moment: weight residual sums so their squares add "
            "to 1 (e.g. [0.8, 0.6]), and keep an activation between stacked dense or conv layers",
        )
    if not (t > 0 and math.isfinite(t)):
        raise SigpropError(
            "invalid_target",
            f"input_second_moment = {input_second_moment} is not a positive number",
            "omit it for the recommended 1 / sqrt(n_0 k_0^2) of section 6.3",
        )
    return t


def _layer_row(nd, info: dict, w2: dict, alpha: dict, raw: dict, ratio: dict, in_branch: dict, t: float) -> dict:
    """One weighted layer's entry of ``GeometricSolution.layers``, at input second moment ``t``."""
    i = nd.index
    n_in, n_out, taps, pos = info[i]
    a = alpha[i]
    return {
        "id": nd.user_id,
        "node": i,
        "op": nd.op,
        "fan_in": n_in,
        "fan_out": n_out,
        "kernel": list(nd.attrs["kernel"]) if rule(nd.op).spatial else None,
        "weight_second_moment": w2[i],
        "alpha": a,
        "init_second_moment": w2[i] / (a * a),
        "gamma": a**4 * raw[i] * t * t,
        "gamma_uncorrected": raw[i] * t * t,
        "gamma_bias": pos * ratio[i],  # Appendix D: rho^2 E[Dy^2] / E[y^2], invariant in t
        "in_branch": in_branch[i],
    }


def _spread(result: list[dict], key: str) -> float:
    """Largest over smallest positive ``key`` across the layers (1 when there is none)."""
    vals = [r[key] for r in result if r[key] > 0]
    return max(vals) / min(vals) if vals else 1.0
