"""Finite-width statistics of the per-layer Jacobian of random ReLU networks (per-layer-Jacobian
paper: "The effect of residual architecture on the per-layer gradient of deep networks").

Setting (section 3). Fully connected ReLU networks of width n (input included) with a fixed input
of unit norm, ||y^0||^2 = 1, and i.i.d. Gaussian weights of second moment c_2 = 2 alpha / fan_in
(alpha = 1 is He initialization; the last layer of a residual branch, which has no ReLU after it,
gets alpha / n so that every branch layer has second-moment gain alpha). The quantity is

    ||J^k||^2 = sum_ij (d y^L / d w^k_ij)^2                                          (1)

for the weights W^k of layer k, over the randomness of all weights. Three kinds of network:

``vanilla``   y^l = phi(W^l y^{l-1}), l = 1..L                                          (8)
``residual``  y^l = y^{l-1} + W^{lm} phi(... phi(W^{l1} y^{l-1})), L blocks of m layers  (9), (10)
``dense``     y^l = phi(W^l [y^0, ..., y^{l-1}]), fan-in l n                             (section 3)

Theorem 1 (forward-backward duality): with y_(k) the *reduced* network, all connections that
bypass W^k removed (Definition 1),

    E||J^k||^2 = E||y_(k)^L||^2 / c_2^k,
    var||y_(k)^L||^2 / c_4^k <= var||J^k||^2 <= var||y_(k)^L||^2 / (c_2^k)^2,         (16)

and var||J^k||^2 ~ var||y_(k)^L||^2 / (c_2^k)^2 for wide layers (equation 57). The mean is exact
and the upper bound holds, but the lower bound does not in general (see
:func:`vanilla_jacobian_moments`): at width 40, Monte Carlo variances of ResNets (m = 2) and
DenseNets come out at roughly 0.1 to 0.5 of the upper bound, for every depth, so the bracket pins the
growth in depth, not the level. For vanilla networks the exact variance is given. For Gaussian
weights c_4 = 3 c_2^2 (Delta = 0), and the moments of ||y_(k)^L||^2 are exact:

- vanilla (Lemma 2, equation 76): E||y^L||^2 = alpha^L, E||y^L||^4 = alpha^{2L} (1 + 5/n)^L.
- residual (Theorem 2, equations 77, 93-95): E||y^L||^2 = mu = alpha^m (1 + alpha^m)^{L-1},
  E||y^L||^4 = rho_G prod_{l != k} beta with beta = 1 + 2 alpha^m (1 + 2/n)
  + alpha^{2m} (1 + 5/n)^{m-1} (1 + 2/n) and rho_G = alpha^{2m} (1 + 5/n)^{m-1} (1 + 2/n).
- dense (Theorem 3, proof in section 7.5): the recursion of equations 96-110 for the sums
  S_l = sum_{j in A_l} ||y^j||^2 of a layer's inputs closes on E[S_l] and E[S_l^2]:
  E[||y^l||^2 | past] = alpha S_l / l and E[||y^l||^4 | past] = (alpha S_l / l)^2 (1 + 5/n),
  which is evaluated exactly (the paper's closed form, equation 122, has garbled indices).

Growth in depth (the bounds with unspecified constants C_1..C_4): vanilla exp[(5/2n) (L-1)] to
exp[(5/n) (L-1)] (Lemma 2, equation 17); residual exp[L rho_-^m / 2] to exp[2 L rho_+^{m/2}] with
rho_+- = alpha^2 (1 + 5/n) (Theorem 2, equation 19); dense L^{alpha-1} to L^{2(alpha-1)}
(Theorem 3, equation 21): constant for alpha = 1, so He initialization needs no depth scaling.

Residual branch scale. Theorem 2's text asks for "L rho_+^m kept constant"; its own upper bound
and mean mu = alpha^m (1 + alpha^m)^{L-1} stay bounded only when L rho_+^{m/2} (~ L alpha^m) is
bounded, which is the stronger condition (and implies L rho_+^m -> 0). ``residual_branch_scale``
therefore picks alpha with L rho_+^{m/2} = kappa: the branch output then has second moment
alpha^m ~ kappa / L of the shortcut's, the 1 / sqrt(L) branch scaling of the scaled-residuals
paper (x + beta / sqrt(L) F(x), section 2.2), now with the width correction (1 + 5/n)^{-m/2}.
The relative fluctuation var||J||^2 / E||J||^2^2 is then constant in depth, while E||J||^2
itself scales like alpha^{m-1} (a branch weighted down has smaller weight gradients).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from ...errors import SigpropError
from ...schemas.ops import ACT, AFFINE, CONCAT, OP_TABLE, SUM
from ...schemas.solve import JacobianSummary
from ..graph.build import NetworkGraph
from .subnetworks import _dominators

KINDS = ("vanilla", "residual", "dense")
GAUSSIAN_KURTOSIS = 3.0  # c_4 / c_2^2 of Gaussian weights (Delta = 0)


@dataclass(frozen=True)
class JacobianStats:
    """Predicted moments of ||J^k||^2 (equation 1) for layer ``layer`` of a depth-``depth`` network.

    ``output_mean`` / ``output_var`` are the moments of ||y_(k)^L||^2 (exact for Gaussian weights);
    ``mean`` = E||J^k||^2, ``var_lower`` / ``var_upper`` the bounds of Theorem 1 (the upper one is
    also the wide-layer value, equation 57); ``growth_law`` and ``growth_exponents`` give the
    depth dependence of the theorem for this kind (rates in the exponent, or polynomial powers).
    ``var_exact`` is the exact var||J^k||^2 of a vanilla network (:func:`vanilla_jacobian_moments`;
    None for the other kinds): Theorem 1's lower bound does not hold in general (see there).
    """

    kind: str
    depth: int
    width: int
    m: int
    alpha: float
    layer: int
    weight_second_moment: float
    output_mean: float
    output_var: float
    mean: float
    var_lower: float
    var_upper: float
    rho_plus: float
    growth_law: str
    growth_exponents: tuple[float, float]
    var_exact: float | None = None


@dataclass(frozen=True)
class Structure:
    """What ``detect_structure`` finds: the kind, depth L (layers, residual blocks or dense layers),
    width (smallest hidden width), m (weighted layers per residual branch), alpha (per-layer
    variance multiplier equivalent to the sum weights, alpha^m = (w_branch / w_shortcut)^2) and
    branch_scale w_branch / w_shortcut; ``notes`` say where the graph departs from the paper's."""

    kind: str
    depth: int
    width: int
    m: int = 1
    alpha: float = 1.0
    branch_scale: float | None = None
    notes: list[str] = field(default_factory=list)


def _check(kind: str, depth: int, width: int, m: int, alpha: float, layer: int) -> None:
    if kind not in KINDS:
        raise SigpropError("invalid_request", f"unknown network kind {kind!r}", f"kinds: {', '.join(KINDS)}")
    if not (isinstance(depth, int) and depth >= 1):
        raise SigpropError("invalid_request", f"depth must be a positive integer, got {depth!r}", "give L >= 1")
    if not (isinstance(width, int) and width >= 1):
        raise SigpropError("invalid_request", f"width must be a positive integer, got {width!r}", "give n >= 1")
    if kind == "residual" and not (isinstance(m, int) and m >= 2):
        raise SigpropError(
            "invalid_request",
            f"residual branches need m >= 2 layers, got {m!r}",
            "Theorem 2 covers branches of m >= 2 weighted layers",
        )
    if not (alpha > 0 and math.isfinite(alpha)):
        raise SigpropError(
            "invalid_request",
            f"alpha must be a positive number, got {alpha!r}",
            "alpha scales the weight variance, c_2 = 2 alpha / fan_in; 1 is He initialization",
        )
    if not (isinstance(layer, int) and 1 <= layer <= depth):
        raise SigpropError("invalid_request", f"layer must be in 1..{depth}, got {layer!r}", "layers count from 1")


def output_moments(
    kind: str, depth: int, width: int, m: int = 2, alpha: float = 1.0, layer: int = 1
) -> tuple[float, float]:
    """(E||y_(k)^L||^2, E||y_(k)^L||^4) of the reduced network for Gaussian weights, ||y^0||^2 = 1."""
    _check(kind, depth, width, m, alpha, layer)
    n, L, k = float(width), depth, layer
    if kind == "vanilla":  # Lemma 2, equations 62 and 76; the reduced network is the network
        return alpha**L, alpha ** (2 * L) * (1.0 + 5.0 / n) ** L
    if kind == "residual":  # Theorem 2, equations 77 and 93-95
        am = alpha**m
        rho_g = am * am * (1.0 + 5.0 / n) ** (m - 1) * (1.0 + 2.0 / n)
        beta = 1.0 + 2.0 * am * (1.0 + 2.0 / n) + rho_g
        return am * (1.0 + am) ** (L - 1), rho_g * beta ** (L - 1)
    # dense: layer l reads A_l (y^0..y^{l-1}; in the reduced network only y^k.. for l > k)
    s1, s2 = 1.0, 1.0  # E[S_l], E[S_l^2] with S_1 = ||y^0||^2 = 1
    mean = second = 0.0
    for l in range(1, L + 1):
        mean = alpha * s1 / l
        second = (alpha / l) ** 2 * (1.0 + 5.0 / n) * s2
        if l == k:  # connections bypassing W^k removed: later layers read y^k onwards only
            s1, s2 = mean, second
        else:  # S_{l+1} = S_l + ||y^l||^2, E[S_l ||y^l||^2] = (alpha / l) E[S_l^2]
            s1, s2 = s1 + mean, s2 + 2.0 * (alpha / l) * s2 + second
    return mean, second


def vanilla_jacobian_moments(depth: int, width: int, alpha: float = 1.0, layer: int = 1) -> tuple[float, float]:
    """Exact (E||J^k||^2, var||J^k||^2) of a vanilla Gaussian ReLU network, equation 8.

    Theorem 1's variance bracket does not hold in general: for L = k = 1, ||J^1||^2 is the number
    of active units, Binomial(n, 1/2), of variance n / 4, below its lower bound
    var||y^1||^2 / c_4 = 5 n / 12 (the proof's pairing of paths in equations 46-50 misses the
    Gaussian pairings of a row with itself). The exact moments follow from ||J^k||^2 = A B with
    A = ||y^{k-1}||^2 (Lemma 2) and B = ||D_L W_L ... W_{k+1} D_k||_F^2 independent of A (B's
    law depends on y^{k-1} only through the masks' symmetry). With P = M M^T for the partial
    product M and the sign symmetry E[z_t f(w_t)] = E[f(w_t)] / 2 for f even in row w_t, the pair
    u = E[(tr P)^2], v = E[tr P^2] obeys the linear recursion

        u' = c_2^2 [(n/2 + n(n-1)/4) u + n v],    v' = c_2^2 [(n/2) u + (n + n(n-1)/4) v],

    from P = D_k: u = n(n+1)/4, v = n/2 (a Binomial(n, 1/2) count).
    """
    _check("vanilla", depth, width, 2, alpha, layer)
    n, k = float(width), layer
    c2 = 2.0 * alpha / n
    ea, ea2 = alpha ** (k - 1), alpha ** (2 * (k - 1)) * (1.0 + 5.0 / n) ** (k - 1)
    eb, u, v = n / 2.0, n * (n + 1.0) / 4.0, n / 2.0
    pair = n * (n - 1.0) / 4.0
    for _ in range(k + 1, depth + 1):
        eb *= 0.5 * n * c2
        u, v = c2 * c2 * ((0.5 * n + pair) * u + n * v), c2 * c2 * (0.5 * n * u + (n + pair) * v)
    mean = ea * eb
    return mean, max(ea2 * u - mean * mean, 0.0)


def jacobian_stats(kind: str, depth: int, width: int, m: int = 2, alpha: float = 1.0, layer: int = 1) -> JacobianStats:
    """Mean and variance bounds of ||J^k||^2 (Theorem 1 with Lemma 2, Theorem 2 or Theorem 3).

    ``layer`` is k (1-based): a layer for vanilla and dense networks, a residual block for
    residual ones, where the statistics are those of a ReLU layer of the branch (k' < m, as in
    Theorem 2; they do not depend on k' or k there).
    """
    mu, fourth = output_moments(kind, depth, width, m, alpha, layer)
    n, L = float(width), depth
    var = max(fourth - mu * mu, 0.0)
    c2 = 2.0 * alpha / (layer * n if kind == "dense" else n)
    rho_p = alpha * alpha * (1.0 + 5.0 / n)
    if kind == "vanilla":
        law, exps = "exp(r (L - 1)), r from 5/(2n) to 5/n (Lemma 2)", (2.5 * (L - 1) / n, 5.0 * (L - 1) / n)
    elif kind == "residual":
        law = "exp(r), r from L rho_-^m / 2 to 2 L rho_+^(m/2) (Theorem 2)"
        exps = (0.5 * L * rho_p**m, 2.0 * L * rho_p ** (m / 2))
    else:
        law, exps = "L^p, p from alpha - 1 to 2 (alpha - 1) (Theorem 3)", (alpha - 1.0, 2.0 * (alpha - 1.0))
    return JacobianStats(
        kind=kind,
        depth=depth,
        width=width,
        m=m if kind == "residual" else 1,
        alpha=alpha,
        layer=layer,
        weight_second_moment=c2,
        output_mean=mu,
        output_var=var,
        mean=mu / c2,
        var_lower=var / (GAUSSIAN_KURTOSIS * c2 * c2),
        var_upper=var / (c2 * c2),
        rho_plus=rho_p,
        growth_law=law,
        growth_exponents=exps,
        var_exact=vanilla_jacobian_moments(depth, width, alpha, layer)[1] if kind == "vanilla" else None,
    )


def residual_branch_scale(depth: int, width: int, m: int = 2, kappa: float = 1.0) -> dict:
    """The residual scaling that keeps mean and variance of ||J||^2 bounded in depth (Theorem 2).

    alpha solves L rho_+^{m/2} = kappa with rho_+ = alpha^2 (1 + 5/n) (see the module docstring for
    why m/2 rather than the text's m). Returns alpha, rho_plus, ``branch_scale`` s = alpha^{m/2}
    (the factor on a He-initialized branch: x + s F(x)), the equivalent normalized sum weights
    ``shortcut_weight`` = 1 / sqrt(1 + s^2), ``branch_weight`` = s / sqrt(1 + s^2), and both
    L rho_+^{m/2} and L rho_+^m.
    """
    _check("residual", depth, width, m, 1.0, 1)
    if not (kappa > 0 and math.isfinite(kappa)):
        raise SigpropError(
            "invalid_request",
            f"kappa must be a positive number, got {kappa!r}",
            "kappa = L rho_+^(m/2) is the depth budget of the branches; 1 is the default",
        )
    n = float(width)
    alpha = (kappa / depth) ** (1.0 / m) / math.sqrt(1.0 + 5.0 / n)
    rho_p = alpha * alpha * (1.0 + 5.0 / n)
    s = alpha ** (m / 2)
    return {
        "alpha": alpha,
        "rho_plus": rho_p,
        "branch_scale": s,
        "shortcut_weight": 1.0 / math.sqrt(1.0 + s * s),
        "branch_weight": s / math.sqrt(1.0 + s * s),
        "L_rho_plus_half_m": depth * rho_p ** (m / 2),
        "L_rho_plus_m": depth * rho_p**m,
    }


def _affines_to(graph: NetworkGraph) -> list[int]:
    """Most weighted layers on a path from the inputs to each node (the node included), one
    topological pass: O(nodes + edges). A branch's count from an entry that dominates its end is
    then a difference: every path to the end passes the entry, so the longest one is the longest
    to the entry followed by the longest from it."""
    best = [0] * graph.n
    for nd in graph.nodes:
        best[nd.index] = max((best[i] for i in nd.inputs), default=0) + (1 if nd.kind == AFFINE else 0)
    return best


def detect_structure(graph: NetworkGraph) -> Structure | None:
    """Classify a graph as one of the paper's three kinds, or None.

    ``dense``: it has concat nodes (DenseNet feature reuse) and no sums. ``residual``: it has sums
    of two inputs, a shortcut (no weighted layer between the block input and the sum) and a branch
    of m weighted layers; alpha and the branch scale come from the sum weights. ``vanilla``: a
    chain without sums or concats. None for anything else (sums of three or more inputs, both
    sums and concats, no weighted layer, ...).

    Cost: O(nodes + edges) plus the dominator tree (``subnetworks._dominators``, near-linear on
    these graphs): a branch's weighted-layer count is a difference of one topological pass's
    longest-path counts, not a walk per sum, so fan-out from one node to thousands of sums (the
    "ladder") stays linear.
    """
    nodes = graph.nodes
    affines = [nd for nd in nodes if nd.kind == AFFINE]
    if not affines:
        return None
    hidden = [nd.shape[0] for nd in affines[:-1]] or [affines[-1].shape[0]]
    width = min(hidden)
    notes: list[str] = []
    if len(set(hidden)) > 1:
        notes.append(
            f"widths vary ({min(hidden)} to {max(hidden)}); width is the smallest, which bounds the variance growth"
        )
    acts = Counter(nd.attrs["fn"] for nd in nodes if nd.kind == ACT)
    if set(acts) - {"relu"}:
        notes.append(f"the theory is for ReLU; the graph uses {', '.join(sorted(acts))}")
    if any(OP_TABLE[nd.op].spatial for nd in affines):
        notes.append("convolutions are treated as fully connected layers over channels")
    sums = [nd for nd in nodes if nd.kind == SUM]
    concats = [nd for nd in nodes if nd.kind == CONCAT]
    if sums and concats:
        return None
    if concats:
        return Structure("dense", depth=len(concats), width=width, notes=notes)
    if not sums:
        return Structure("vanilla", depth=len(affines), width=width, notes=notes)

    idom, _ = _dominators([list(nd.inputs) for nd in nodes], graph.n)
    depth_to = _affines_to(graph)
    ms, scales, projections = [], [], 0
    for nd in sums:
        if len(nd.inputs) != 2:
            return None
        entry = idom[nd.index]
        if entry == graph.n:
            return None
        # entry dominates the sum, hence each of its inputs: weighted layers on the longest path entry -> i
        counts = [depth_to[i] - depth_to[entry] if i != entry else 0 for i in nd.inputs]
        if min(counts) > 0:
            projections += 1
        short = counts.index(min(counts))
        w_short, w_branch = nd.attrs["weights"][short], nd.attrs["weights"][1 - short]
        if w_short == 0:
            return None
        ms.append(max(counts))
        scales.append(abs(w_branch / w_short))
    m = Counter(ms).most_common(1)[0][0]
    if len(set(ms)) > 1:
        notes.append(f"branches have {sorted(set(ms))} weighted layers; m is the most common, {m}")
    if projections:
        notes.append(f"{projections} shortcut(s) contain a weighted layer (projection); treated as identity shortcuts")
    s = sorted(scales)[len(scales) // 2]
    if max(scales) - min(scales) > 1e-9 * max(scales):
        notes.append(f"branch scales vary ({min(scales):.4g} to {max(scales):.4g}); the median is reported")
    if m < 2:
        notes.append("single-layer branches: Theorem 2 needs m >= 2")
    alpha = s ** (2.0 / m) if s > 0 else 0.0
    return Structure("residual", depth=len(sums), width=width, m=m, alpha=alpha, branch_scale=s, notes=notes)


def summary(graph: NetworkGraph, act) -> JacobianSummary | None:
    """The finite-width Jacobian statistics, for ReLU-family graphs whose structure the theorems cover."""
    if act.name not in ("relu", "leaky_relu"):
        return None
    try:
        st = detect_structure(graph)
        if st is None:
            return None
        stats = jacobian_stats(st.kind, st.depth, st.width, st.m, st.alpha)
        rec = None
        if st.kind == "residual":
            r = residual_branch_scale(st.depth, st.width, st.m)
            rec = {k: r[k] for k in ("branch_scale", "shortcut_weight", "branch_weight", "alpha")}
        elif st.kind == "dense":
            rec = {"alpha": 1.0}
    except (SigpropError, ArithmeticError):
        # supplementary information: a graph outside the theorems' assumptions, or so deep that
        # the predicted moments overflow a float, gets none
        return None
    return JacobianSummary(
        kind=st.kind,
        depth=st.depth,
        width=st.width,
        m=stats.m,
        alpha=st.alpha,
        mean=stats.mean,
        var_upper=stats.var_upper,
        var_exact=stats.var_exact,
        growth_law=stats.growth_law,
        recommended=rec,
    )
