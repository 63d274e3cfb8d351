"""Edge of Chaos initialization, the classic baseline (TAT paper section 3, Table 1 EOC column;
sparsity paper section 2, equations 2-4).

For pre-activations h = W x + b with W_ij ~ N(0, sigma_w^2 / fan_in) and b_i ~ N(0, sigma_b^2),
the variance map is V(q) = sigma_w^2 E[phi(sqrt(q) z)^2] + sigma_b^2 and the correlation map's
slope at c = 1 is chi_1 = sigma_w^2 E[phi'(sqrt(q*) z)^2]. EOC picks the pair with chi_1 = 1 and
V(q*) = q*:

    sigma_w^2 = 1 / E[phi'(sqrt(q*) z)^2],    sigma_b^2 = q* - sigma_w^2 E[phi(sqrt(q*) z)^2].

ReLU gives (2, 0) for every q*. Derivatives of V use Gaussian integration by parts,
d/dq E[g(sqrt(q) z)] = E[g'(sqrt(q) z) z] / (2 sqrt(q)), so only phi' and phi'' are needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import SigpropError
from .activations import Activation
from .quadrature import gaussian_rule


@dataclass(frozen=True)
class EOCSolution:
    q_star: float
    sigma_w2: float
    sigma_b2: float
    chi_1: float
    v_slope: float
    v_curvature: float | None  # None where phi'' has Dirac parts (piecewise-linear activations)


def _moments(act: Activation, q: float):
    s = math.sqrt(q)
    z, w = gaussian_rule([k / s for k in act.kinks], scale=s)
    u = s * z
    f, d1, d2 = act.fn(u), act.d1(u), act.d2(u)
    return z, w, f, d1, d2


def variance_map(act: Activation, q, sigma_w2: float, sigma_b2: float):
    """V(q) = sigma_w^2 E[phi(sqrt(q) z)^2] + sigma_b^2 (equation 2 of the sparsity paper)."""
    out = []
    for qi in np.atleast_1d(q):
        _, w, f, _, _ = _moments(act, float(qi))
        out.append(sigma_w2 * float(w @ (f * f)) + sigma_b2)
    return np.array(out)


def _bias_needed(act: Activation, q: float) -> float:
    _, w, f, d1, _ = _moments(act, q)
    return q - float(w @ (f * f)) / float(w @ (d1 * d1))


def _bias_hint(act: Activation, q_star: float) -> str:
    """Where sigma_b^2 >= 0 is found among a few other q*, or that none of them has it (softplus:
    E[phi^2] > q E[phi'^2] at every q, so its Edge of Chaos would need a negative bias variance)."""
    for q in (10.0 * q_star, 100.0 * q_star, 0.1 * q_star, 0.01 * q_star):
        if _bias_needed(act, q) >= 0.0:
            return f"choose another q_star: q_star = {q:g} has sigma_b^2 = {_bias_needed(act, q):.4g} >= 0"
    return (
        f"'{act.name}' needs sigma_b^2 < 0 at every q_star tried (0.01x to 100x): choose an activation "
        "with an Edge of Chaos (tanh, erf, elu, selu, gelu), or method 'tat' or 'dks'"
    )


def solve_eoc(act: Activation, q_star: float = 1.0) -> EOCSolution:
    if not (q_star > 0 and math.isfinite(q_star)):
        raise SigpropError(
            "invalid_target",
            f"q_star = {q_star} is not a positive number",
            "q_star is the fixed point of the variance map; the default is 1",
        )
    z, w, f, d1, d2 = _moments(act, q_star)
    d1_sq = float(w @ (d1 * d1))
    if d1_sq <= 0:
        raise SigpropError(
            "unreachable_target",
            f"'{act.name}' has zero derivative almost everywhere at q* = {q_star}",
            "choose another q_star or activation",
        )
    sigma_w2 = 1.0 / d1_sq
    sigma_b2 = q_star - sigma_w2 * float(w @ (f * f))
    if sigma_b2 < -1e-12 * max(1.0, q_star):
        raise SigpropError(
            "unreachable_target",
            f"no Edge of Chaos initialization of '{act.name}' has q* = {q_star}: "
            f"it would need sigma_b^2 = {sigma_b2:.6g} < 0",
            _bias_hint(act, q_star),
        )
    if sigma_b2 <= 1e-12 * max(1.0, q_star):
        # within rounding of 0 either way: a cancellation residue of q* - sigma_w^2 E[phi^2] (ReLU
        # at any q*), not a bias to initialize (and not one whose sign depends on the BLAS build)
        sigma_b2 = 0.0
    s = math.sqrt(q_star)
    fd1z = float(w @ (f * d1 * z))
    v_slope = sigma_w2 * fd1z / s
    v_curv = None
    if act.smooth:
        # V''(q) = sigma_w^2 / (2q) * (E[(phi'^2 + phi phi'')(u) z^2] - E[phi phi'(u) z] / sqrt(q))
        v_curv = sigma_w2 / (2 * q_star) * (float(w @ ((d1 * d1 + f * d2) * z * z)) - fd1z / s)
    return EOCSolution(q_star, sigma_w2, sigma_b2, sigma_w2 * d1_sq, v_slope, v_curv)


# The network input's q (mean square per feature), as for every method (contract section 1).
INPUT_Q = 1.0
# q within this of q* is q*: the C map moves by about a tenth as much, far below what a finite
# network resolves. Each other q costs a C map table (2.5 ms for tanh): tanh's q settles in 15
# layers, elu's (v_slope 0.86) in 88
Q_SETTLED = 1e-6
# distinct C map tables a pass may build per function; past them q has not settled at q*
# (an unstable fixed point, v_slope > 1) and the nearest table stands in, with a warning
MAX_Q_TABLES = 128


class KernelPass:
    """The global C map of an Edge of Chaos network from its input, where q is not q* yet.

    The input has q = INPUT_Q, so the first weighted layer gives q_1 = sigma_w^2 INPUT_Q + sigma_b^2,
    not q*; later layers move q towards q* by V (equation 3 of "Deep neural network initialization
    with sparsity inducing activations", arXiv:2402.16184). Equation 6 there assumes q = q* already;
    before that the correlation map depends on the q it reads (equations 4-5):
    c' = (sigma_w^2 E[phi(u) phi(v)] + sigma_b^2) / V(q), with u, v of variance q and correlation c.
    So a pass carries the unnormalized kernel: the vector (q c_1, .., q c_n, q). Normalized sums
    and concatenations act on both parts with the same coefficients (w_i^2, the width shares), so
    the subnetwork program's linear steps carry it unchanged; ``__call__`` is the layer map
    (activation and the weighted layer reading it), and ``first`` the weighted layer reading the input.
    """

    def __init__(self, acts: list[Activation], sols: list[EOCSolution], terms: int = 96):
        self.acts, self.sols, self.terms = acts, sols, terms
        self.q_star = sols[0].q_star
        self.tables: list[dict[float, tuple]] = [{} for _ in acts]
        self.unsettled = False

    def _table(self, slot: int, q: float):
        from .qc_maps import HermiteCMap

        if abs(q - self.q_star) <= Q_SETTLED * self.q_star:
            q = self.q_star
        tables = self.tables[slot]
        found = tables.get(q)
        if found is None:
            if len(tables) >= MAX_Q_TABLES:
                self.unsettled = True
                keys = np.fromiter(tables, float, len(tables))
                return tables[float(keys[np.argmin(np.abs(np.log(keys / q)))])]
            _, w, f, _, _ = _moments(self.acts[slot], q)
            table = HermiteCMap(self.acts[slot], input_scale=math.sqrt(q), terms=self.terms)
            found = tables[q] = (table, float(w @ (f * f)))
        return found

    def first(self, value: np.ndarray, bias: bool, slot: int) -> np.ndarray:
        """The weighted layer reading the network input, with the scales of function ``slot``."""
        sol = self.sols[slot]
        return sol.sigma_w2 * value + (sol.sigma_b2 if bias else 0.0)

    def __call__(self, value: np.ndarray, slot: int) -> np.ndarray:
        q = float(value[-1])
        table, second = self._table(slot, q)
        sw2, sb2 = self.sols[slot].sigma_w2, self.sols[slot].sigma_b2
        out = np.empty_like(value)
        out[:-1] = sw2 * second * table(value[:-1] / q) + sb2
        out[-1] = sw2 * second + sb2
        return out


def input_layer_bias(graph) -> bool | None:
    """Whether the weighted layers reading the network input carry a bias: True or False when
    every path from an input meets a weighted layer first and those agree, else None."""
    from .graph import AFFINE, PASS, SOURCE

    readers = graph.consumers()
    stack = [nd.index for nd in graph.nodes if nd.kind == SOURCE]
    seen, found = set(), set()
    while stack:
        v = stack.pop()
        for u in readers[v]:
            nd = graph.nodes[u]
            if nd.kind == AFFINE:
                found.add(bool(nd.attrs.get("bias", True)))
            elif nd.kind == PASS and u not in seen:
                seen.add(u)
                stack.append(u)
            elif nd.kind != PASS:
                return None
    return found.pop() if len(found) == 1 else None


def network_c_map(
    program, graph, acts, sols, grid: np.ndarray, first_slot: int, terms: int = 96
) -> tuple[np.ndarray, list[str]]:
    """C_f on ``grid`` for inputs of q = INPUT_Q, every layer composed from the first (``KernelPass``),
    and the notes where that is not exact. Also sparse EoC's (its V and C maps are EoC's)."""
    maps = KernelPass(acts, sols, terms)
    value = np.append(INPUT_Q * grid, INPUT_Q)
    bias = input_layer_bias(graph)
    notes = []
    if bias is None:
        notes.append(
            "the network input reaches a sum, concat or activation without a weighted layer, or through "
            "layers with and without a bias: the global C map takes the input's correlation as the first "
            "layer's"
        )
    else:
        value = maps.first(value, bias, first_slot)
    out = program.global_map(value, maps)
    if maps.unsettled:
        notes.append(
            f"q does not settle at q* = {maps.q_star:g} (v_slope = {sols[0].v_slope:.4g}): past "
            f"{MAX_Q_TABLES} distinct values of q the global C map uses the nearest one's C map"
        )
    return np.clip(out[:-1] / out[-1], -1.0, 1.0), notes
