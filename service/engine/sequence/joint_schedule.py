"""U-SPA's joint schedule: attention targets chosen with the MLP blocks' C maps, so that the whole
network's output token kernel is the requested one (issue 37).

The paper's schedule ("Deep Transformers without Shortcuts: Modifying Self-attention for Faithful
Signal Propagation", He, Martens et al., arXiv:2302.10322, section 3) moves the token kernel by
attention alone: A_l maps Sigma_(l-1) to Sigma_l. The MLP blocks between attention layers then raise
every correlation again (their C maps have C(c) >= c on [0, 1], and C(0) > 0), so the next A_l, built
for Sigma_(l-1), reads a more correlated kernel than it was built for, and its location-dependent
rescaling D turns the surplus into q: at T = 64 with 12 blocks and eta 0.8, q per token grows to
1.66 and the mean correlation to 0.956 against U-SPA's 0.8.

Uniform kernels U_rho = (1 - rho) I + rho 1 1^T are closed under every per-token op of a skipless
stack: an entrywise map (activation, a norm of tokens with equal means and diagonals, a product) sends
U_rho to U_(g(rho)) with g the map's value on one pair of tokens at q = 1. So with the block map g_l
(attention l's output correlation -> the next attention's input correlation, or the output's) the
schedule can be solved exactly:

- boundaries rho_0 <= rho_1 <= .. <= rho_L = final_rho, rho_l the correlation after block l, planned
  like the paper's (1 - rho_l shrinks by one factor per block) from wherever the stack stands:
  1 - rho_l = (1 - rho_(l-1)) ((1 - rho_L) / (1 - rho_(l-1)))^(1 / (L - l + 1));
- attention l's target kappa_l = g_l^(-1)(rho_l), its source U_(rho_(l-1)): A_l = L(U_kappa) L(U_rho)^(-1),
  non-negative when kappa_l >= rho_(l-1) (the paper's Theorem 1: the target at least as correlated
  as the source);
- where the MLP alone already raises rho_(l-1) past the plan (g_l(rho_(l-1)) > rho_l), the attention is
  the identity (kappa_l = rho_(l-1)) and the remaining blocks are re-planned from g_l(rho_(l-1)).

The MLP blocks alone (every attention the identity) take orthonormal tokens to the correlation
g_L(..g_1(0)..), the *floor*; for TAT's skipless stacks that is C_f(0) = eta. The requested final_rho is
reachable iff the floor is at most final_rho: otherwise ``unreachable_target``, naming the floor.

The block maps g_l are read off the real graph, not re-derived: one walk of the exact token program
(``token_program``) with every attention the identity and a probe kernel whose off-diagonal entries
are a grid of correlations in [0, 1) gives G_l(c), the correlation at attention l's value input (and
at the output) of the stack started at correlation c; then g_l = G_(l+1) o G_l^(-1), exact up to the
monotone (PCHIP) interpolation of G on the grid. The answer's prediction is the exact propagation of
the generators built here, so the interpolation only moves the target by ~1e-9, never the prediction.

Skipless means: each attention node's value input, and the output, depend on the token stream only
through the previous attention node (or, for the first, the input). With shortcuts the block input
is added back after the attention, the kernel at a boundary is a function of two correlations, and
``joint_schedule`` returns why it does not apply (``skipless_reason``); the caller keeps the paper's
schedule and says so in the answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.interpolate import PchipInterpolator
from scipy.optimize import brentq

from ...errors import SigpropError
from ...schemas.ops import ATTENTION, SOURCE
from ..graph.build import NetworkGraph
from .token_program import TokenKernelProgram, TokenValue, token_correlations

__all__ = [
    "JointSchedule",
    "JointExponentialSchedule",
    "joint_uspa_schedule",
    "joint_espa_schedule",
    "mean_correlation",
    "skipless_reason",
    "probe_correlations",
]

# probe correlations: dense near 1, where deep stacks' G_l live
_PROBE_TOKENS = 48
_TOLERANCE = 1e-9


@dataclass(frozen=True)
class JointSchedule:
    """U-SPA's joint schedule: per attention layer its source and target correlations."""

    sources: tuple[float, ...]  # rho_(l-1): the kernel at attention l's value input
    targets: tuple[float, ...]  # kappa_l: attention l's output kernel
    boundaries: tuple[float, ...]  # rho_l: the kernel at the next attention's input (the output for l = L)
    floor: float  # the correlation the MLP blocks alone reach (every attention the identity)

    def generators(self) -> list[dict]:
        """One ``cholesky_ratio`` generator per attention layer (``schemas.attention_init``)."""
        return [
            {"form": "cholesky_ratio", "target": _uniform(t), "source": _uniform(s)}
            for s, t in zip(self.sources, self.targets, strict=True)
        ]


def _uniform(rho: float) -> dict:
    return {"family": "identity"} if rho == 0.0 else {"family": "uniform", "rho": float(rho)}


def skipless_reason(graph: NetworkGraph, attention: Sequence[int]) -> str | None:
    """None when every attention node's value input, and the output, reach the token stream only
    through the previous attention node (the first: through the input); else why not, naming the node."""
    nodes = graph.nodes
    frontier: list[frozenset[int]] = []
    for nd in nodes:
        if nd.kind in (SOURCE, ATTENTION):
            frontier.append(frozenset((nd.index,)))
        else:
            frontier.append(frozenset().union(*(frontier[i] for i in nd.inputs)) if nd.inputs else frozenset())
    source = next(nd.index for nd in nodes if nd.kind == SOURCE)
    previous = [source, *attention]
    readers = [(nodes[a].inputs[2], repr(nodes[a].user_id)) for a in attention] + [(graph.output, "the output")]
    for (value, name), before in zip(readers, previous, strict=True):
        reached = frontier[value]
        if reached != {before}:
            others = sorted(nodes[i].user_id for i in reached - {before})
            return (
                f"{name} reads the token stream of {', '.join(repr(o) for o in others)} besides "
                f"{nodes[before].user_id!r} (a shortcut around an attention node)"
            )
    return None


def probe_correlations(tokens: int = _PROBE_TOKENS) -> np.ndarray:
    """The grid of probe correlations in [0, 1), denser towards 1 (one per token pair)."""
    pairs = tokens * (tokens - 1) // 2
    u = np.linspace(0.0, 1.0, pairs, endpoint=False)
    return 1.0 - (1.0 - u) ** 2


def _probe_kernel(c: np.ndarray, tokens: int) -> np.ndarray:
    k = np.eye(tokens)
    iu = np.triu_indices(tokens, 1)
    k[iu] = c
    k.T[iu] = c
    return k


def block_curves(
    graph: NetworkGraph,
    attention: Sequence[int],
    dense: dict,
    sum_scales: dict,
    r: Callable[[TokenValue, int], TokenValue],
) -> tuple[np.ndarray, np.ndarray]:
    """(c, G) with G[l] the correlation at attention l's value input (G[L]: at the output) of the stack
    with every attention the identity, started at correlation c (module docstring)."""
    tokens = _PROBE_TOKENS
    c = probe_correlations(tokens)
    iu = np.triu_indices(tokens, 1)
    eye = np.eye(tokens)
    program = TokenKernelProgram(graph, {a: eye for a in attention}, dense, sum_scales)
    at = {a: i for i, a in enumerate(attention)}
    curves = np.empty((len(attention) + 1, c.size))

    def visit(index: int, value: TokenValue) -> None:
        if index in at:
            curves[at[index]] = token_correlations(value.kernel)[iu]

    out = program.walk(_probe_kernel(c, tokens), r, visit)
    curves[-1] = token_correlations(out.kernel)[iu]
    return c, curves


class _Curve:
    """G on the probe grid, monotone: evaluated and inverted by PCHIP interpolation."""

    def __init__(self, c: np.ndarray, g: np.ndarray):
        g = np.maximum.accumulate(np.clip(g, -1.0, 1.0))
        keep = np.concatenate(([True], np.diff(g) > 1e-15))
        self.c, self.g = c[keep], g[keep]
        self._fwd = PchipInterpolator(self.c, self.g) if self.c.size > 1 else None
        self._inv = PchipInterpolator(self.g, self.c) if self.c.size > 1 else None

    def __call__(self, c: float) -> float:
        return float(self.values(np.array([c]))[0])

    def inverse(self, g: float) -> float:
        return float(self.inverses(np.array([g]))[0])

    def values(self, c: np.ndarray) -> np.ndarray:
        """G at an array of correlations."""
        return _monotone(np.asarray(c, dtype=float), self.c, self.g, self._fwd)

    def inverses(self, g: np.ndarray) -> np.ndarray:
        """G^-1 at an array of correlations."""
        return _monotone(np.asarray(g, dtype=float), self.g, self.c, self._inv)


def _monotone(x: np.ndarray, xs: np.ndarray, ys: np.ndarray, pchip) -> np.ndarray:
    """A monotone map tabulated at (xs, ys): PCHIP inside the table, its first value below it, and a
    straight line from its last point to (1, 1) above it (G(1) = 1: one token pair at correlation 1)."""
    out = np.full(x.shape, ys[0])
    if pchip is not None:
        inside = (x > xs[0]) & (x < xs[-1])
        out[inside] = pchip(x[inside])
    tail = x >= xs[-1]
    out[tail] = ys[-1] + (x[tail] - xs[-1]) / (1.0 - xs[-1]) * (1.0 - ys[-1])
    return out


def _floor_below(g: list[_Curve], target: float, refused: str, ask: str) -> float:
    """The correlation the MLP blocks alone reach (every attention the identity), refused with
    ``unreachable_target`` when it exceeds the target: non-negative attention only raises it."""
    floor = g[-1](0.0)
    if floor > target + _TOLERANCE:
        raise SigpropError(
            "unreachable_target",
            f"{refused}: the MLP blocks alone (every attention the identity) already raise every token "
            f"correlation to {floor:.6g}, and attention that a softmax can give (non-negative) only raises it further",
            f"for tat on a skipless stack that floor is C_f(0) = eta, so eta <= {target:.6g} solves; or {ask}, "
            'or use "schedule": "paper"',
        )
    return floor


def joint_uspa_schedule(c: np.ndarray, curves: np.ndarray, final_rho: float) -> JointSchedule:
    """The joint schedule from the probe curves (``block_curves``) for the final correlation
    ``final_rho`` (module docstring); ``unreachable_target`` when the MLP blocks alone exceed it."""
    layers = curves.shape[0] - 1
    g = [_Curve(c, row) for row in curves]
    floor = _floor_below(
        g, final_rho, f"u-spa's joint schedule cannot end at final_rho = {final_rho:.6g}", "ask for a larger final_rho"
    )
    rho = g[0](0.0)
    sources, targets, boundaries = [], [], []
    for layer in range(layers):
        remaining = layers - layer
        if rho >= final_rho:
            plan = rho
        else:
            plan = 1.0 - (1.0 - rho) * ((1.0 - final_rho) / (1.0 - rho)) ** (1.0 / remaining)
        if remaining == 1:
            plan = final_rho
        here, there = g[layer], g[layer + 1]
        start = here.inverse(rho)  # the probe correlation whose stack stands at rho here
        reached = there(start)  # the next boundary with this attention the identity
        if reached >= plan - _TOLERANCE:
            kappa, nxt = rho, reached
        else:
            kappa = max(rho, here(there.inverse(plan)))
            nxt = plan
        sources.append(_clean(rho))
        targets.append(_clean(kappa))
        boundaries.append(_clean(nxt))
        rho = nxt
    if rho > final_rho + 1e-6:
        raise SigpropError(
            "unreachable_target",
            f"u-spa's joint schedule overshoots final_rho = {final_rho:.6g}: the MLP blocks raise the token "
            f"correlation to {rho:.6g} after the attention that the earlier blocks needed",
            'ask for a larger final_rho, a smaller eta, or use "schedule": "paper"',
        )
    return JointSchedule(tuple(sources), tuple(targets), tuple(boundaries), _clean(floor))


def _clean(x: float) -> float:
    """A correlation in [0, 1): tiny negatives of rounding are 0."""
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"joint schedule: a non-finite correlation {x!r}")
    return min(max(x, 0.0), 1.0 - 1e-15)


# --------------------------------------------------------------------------- E-SPA


@dataclass(frozen=True)
class JointExponentialSchedule:
    """E-SPA's joint schedule: per attention layer the exponential target gamma (``betas``), the
    source it reads (``sources``: the exponential part's gamma, inf for the identity, and the floor),
    and the design's mean correlation after the block (``block_means``)."""

    betas: tuple[float, ...]
    sources: tuple[tuple[float, float], ...]  # (gamma, floor) of attention l's input
    block_means: tuple[float, ...]
    target_mean: float  # the requested exp(-gamma_L |i - j|)'s mean correlation over the T tokens
    floor: float  # the MLP blocks alone (every attention the identity): every correlation
    output_lags: np.ndarray  # the design's output correlation at lags 0..T-1

    def leading_mean(self, tokens: int) -> float:
        """The design's mean output correlation over the first ``tokens`` tokens (what the exact
        propagation of the leading block can be compared with)."""
        return mean_correlation(self.output_lags[:tokens])

    def generators(self) -> list[dict]:
        out = []
        for beta, (gamma, floor) in zip(self.betas, self.sources, strict=True):
            source = {"family": "identity"} if math.isinf(gamma) else {"family": "exponential", "gamma": gamma}
            g = {"form": "cholesky_ratio", "target": {"family": "exponential", "gamma": beta}, "source": source}
            if floor > 0.0:
                g["source_floor"] = floor
            out.append(g)
        return out


def mean_correlation(lag_values: np.ndarray) -> float:
    """The mean over token pairs i != j of a T x T Toeplitz kernel given by its values at lags 0..T-1."""
    t = lag_values.size
    if t < 2:
        return 1.0
    k = np.arange(1, t)
    return float(2.0 * np.sum((t - k) * lag_values[1:]) / (t * (t - 1)))


def _row_sum_limit(beta: float, gamma: float) -> float:
    """D_inf, the row sums of L(exp(-beta |i-j|)) L(exp(-gamma |i-j|))^-1 far from the first token:
    sqrt((1 - r_s) / (1 + r_s) (1 + r_t) / (1 - r_t)), r = exp(-gamma) (the AR(1) factors of
    ``attention_init.exponential_cholesky``; r_s = 0 for the identity)."""
    rt = math.exp(-beta)
    rs = 0.0 if math.isinf(gamma) else math.exp(-gamma)
    return math.sqrt((1.0 - rs) / (1.0 + rs) * (1.0 + rt) / -math.expm1(-beta))


def joint_espa_schedule(
    c: np.ndarray, curves: np.ndarray, final_gamma: float, seq_len: int, aim: float | None = None
) -> JointExponentialSchedule:
    """E-SPA's joint schedule (issue 37). The MLP blocks give every pair of tokens a floor f (their
    C(0) > 0), which exp(-gamma |i - j|) has not, and a Cholesky ratio between floored kernels needs
    negative weights. So each attention is the paper's ratio L(Sigma_beta) L(Sigma_gamma)^-1 between
    the exponential parts, its rows rescaled for the floored source f 1 1^T + (1 - f) Sigma_gamma it
    reads (``attention_init``'s ``source_floor``): non-negative, q = 1 at every token. Far from the
    first token its output is f' + (1 - f') exp(-beta tau), f' = f D^2 / (f D^2 + 1 - f) with D the
    ratio's row sum; the block's C map g_l then gives the next input, refitted to the family (floor
    g_l(f'), the exponential part's gamma from the lag-1 correlation).

    Each block's beta is the root that puts the block's mean correlation m_l over the T tokens on the
    plan 1 - m_l = (1 - m_(l-1)) ((1 - m_L) / (1 - m_(l-1)))^(1 / (L - l + 1)), U-SPA's, from where the
    stack stands; the last block's on the requested kernel's mean m_L. (The paper's gammas keep the
    first blocks' attention idle while the MLPs add their floor, then take large steps, whose row
    sums vary most near the first tokens: at T = 64, 12 blocks, eta 0.5 the diagonal dipped to 0.89,
    against 0.95 with equal steps.) Where the MLP alone already passes the plan, the attention is the
    identity (beta = the source's gamma). The requested shape is not kept (the floor), its mean
    correlation is, up to the family fit; ``aim`` replaces m_L in the plan (the caller's correction
    from the exact prediction of the leading tokens, ``leading_mean``). The answer's prediction is
    the exact propagation of these matrices."""
    layers = curves.shape[0] - 1
    g = [_Curve(c, row) for row in curves]
    lags = np.arange(seq_len, dtype=float)
    target_mean = mean_correlation(np.exp(-final_gamma * lags))
    floor = _floor_below(
        g,
        target_mean,
        f"e-spa's joint schedule cannot reach final_gamma = {final_gamma:.6g}, whose kernel has mean token "
        f"correlation {target_mean:.6g} over {seq_len} tokens",
        "ask for a smaller final_gamma (a more correlated kernel)",
    )
    final = target_mean if aim is None else min(max(aim, floor), 1.0 - 1e-9)

    def block(layer: int, beta: float, f: float, gamma: float) -> tuple[np.ndarray, float, float]:
        d = _row_sum_limit(beta, gamma)
        lifted = f * d * d / (f * d * d + 1.0 - f)
        here, there = g[layer], g[layer + 1]
        after = there.values(here.inverses(lifted + (1.0 - lifted) * np.exp(-beta * lags)))
        f_next = float(there.values(here.inverses(np.array([lifted])))[0])
        if seq_len < 2 or after[1] <= f_next:
            return after, f_next, math.inf
        return after, f_next, -math.log(min((after[1] - f_next) / (1.0 - f_next), 1.0 - 1e-15))

    f, gamma = _clean(g[0](0.0)), math.inf
    betas, sources, means = [], [], []
    for layer in range(layers):
        widest = gamma if math.isfinite(gamma) else 50.0  # beta = the source's gamma: A = I

        now, remaining = (means[-1] if means else f), layers - layer
        plan = final if remaining == 1 else 1.0 - (1.0 - now) * ((1.0 - final) / (1.0 - now)) ** (1.0 / remaining)

        def excess(log_beta: float, layer=layer, f=f, gamma=gamma, plan=plan) -> float:
            return mean_correlation(block(layer, math.exp(log_beta), f, gamma)[0]) - plan

        if seq_len < 2 or excess(math.log(widest)) >= 0.0:
            beta = widest
        elif excess(math.log(1e-9)) <= 0.0:
            beta = 1e-9
        else:
            beta = math.exp(brentq(excess, math.log(1e-9), math.log(widest), xtol=1e-12))
        betas.append(beta)
        sources.append((gamma, f))
        after, f, gamma = block(layer, beta, f, gamma)
        f = _clean(f)
        means.append(mean_correlation(after))
    return JointExponentialSchedule(tuple(betas), tuple(sources), tuple(means), target_mean, _clean(floor), after)
