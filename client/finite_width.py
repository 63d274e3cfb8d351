"""Finite-width fluctuations of a network's kernel at initialization, layer by layer: the theory
behind the noise ``diagnose`` states (framework-free, numpy; what is averaged, and how the
covariances here become the noise of those averages: ``sigprop.client.sampling_noise``).

At infinite width the kernel K_ab = y_a . y_b / n of any inputs follows the answer's maps exactly.
At width n each layer's units are i.i.d. given the layer's input (rows of a weight matrix), so a
measured kernel is a mean over n units and fluctuates by O(1/n) around the map of the kernel
before it, and the deviations of successive layers compound through the maps' Jacobians ("The
Principles of Deep Learning Theory", Roberts, Yaida and Hanin, arXiv:2106.10165, chapter 4: the
four-point vertex of a deep network grows linearly with depth, eq. 4.118). For i.i.d. weights and
one input of a ReLU network this gives Var(q_L) / q^2 = prod_l (1 + kappa / n_l) - 1, about
exp(sum_l kappa / n_l) - 1 with kappa = E phi^4 / (E phi^2)^2 - 1 = 5 (Hanin and Nica, "Products
of Many Large Random Matrices and Gradients in Deep Neural Networks", arXiv:1812.05994, Theorem 1).
Per layer, with h a unit's pre-activations over the inputs (h ~ N(0, K)):

- a dense/conv layer adds Wishart noise nu (K_ac K_bd + K_ad K_bc) / n to its output kernel, nu = 1
  for Gaussian weights; an orthogonal matrix preserves every inner product exactly (nu = 0) unless
  it projects, n_out < n_in, where nu = 1 - n_out / n_in (the finite-population correction of
  sampling n_out of n_in directions) and its fixed trace takes (2 / n_in) K_ab K_cd off;
- an activation maps the kernel by its Jacobian and adds the per-unit covariance of
  phi(h_a) phi(h_b) *less its part along the quadratics h_c h_d*, which are the dense layer's: an
  orthogonal layer fixes their mean over units exactly, and for Gaussian weights the part comes
  back as the Wishart noise above. The part removed is the degree-2 Hermite component, whose
  coefficients are the map's Jacobian (the Gaussian is an exponential family in h h^T). For one
  input of a leaky ReLU of slope a this leaves kappa_orth = 3 (1 - a^2)^2 / (1 + a^2)^2 per layer
  (3 for ReLU, against its Gaussian kappa = 5; 0 for the identity), the project's default
  orthogonal initialization's share;
- a sum of branches that end in independent weights adds their cross term, of variance
  K_i K_j / n; attention at initialization (a fixed token mixing A) maps dK -> A dK A^T; a layer
  norm (or an RMSNorm) rescales each token (example) by its measured spread, so its q is exact and
  only its correlations fluctuate; a product of two independent factors (a gated MLP's gate) takes
  K_v dK_u + K_u dK_v plus its units' cross term, Var(u_a u_b) Var(v_a v_b) / n; flattening and
  pooling average over locations.

The Jacobians and maps are 2-D Gaussian expectations (Gauss-Hermite; phi tabulated, phi' by central
differences, so any activation works, kinks included; Price's theorem and a rescaling identity
give dPhi/dK without phi''). The noise propagates linearly: ``PROBES`` realizations of every
layer's noise (a Gaussian unit each, scaled by 1 / sqrt(n)) are carried along the graph through the
Jacobians; the q of each input moves only with its own q upstream, so its covariance is also
carried exactly, source by source (no Monte-Carlo error: with thousands of inputs its cross terms
nearly cancel).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ..schemas.attention_init import expand_attention
from ..schemas.graph import Graph
from ..schemas.kernels import concat_coefficients
from ..schemas.ops import ACT, AFFINE, ATTENTION, CONCAT, NORM, OP_TABLE, PRODUCT, SOURCE, SUM
from ..schemas.shapes import infer_shapes

__all__ = ["propagate", "PROBES"]

PROBES = 1024  # noise realizations: the stated standard deviations are good to about 1 / sqrt(2 PROBES)
_QUAD = 16  # Gauss-Hermite nodes per axis of the 2-D expectations (a noise, needed to a few %)
_STEP = 1e-3  # of phi's table: linear interpolation is exact to ~1e-7 relative for smooth phi
_REACH = 12.0  # the table's half-width in standard deviations (nodes beyond weigh under 1e-30)
_ORTHOGONAL = ("scaled_uniform_orthogonal", "orthogonal_delta")

Phi = Callable[[np.ndarray], np.ndarray]


# -- Gaussian expectations of phi over pairs of inputs ---------------------------------------------


def _rule() -> tuple[np.ndarray, np.ndarray]:
    z, w = np.polynomial.hermite_e.hermegauss(_QUAD)
    return z, w / w.sum()


_Z, _W = _rule()


class _Table:
    """phi and phi' tabulated on [-reach, reach] with step ``_STEP`` (read by linear interpolation):
    one call of the framework's function per activation, not per pair; phi' by central differences
    of the table (exact to O(step^2) where phi is smooth, and good in float32 too)."""

    def __init__(self, phi: Phi, reach: float):
        self.reach = reach
        self.x = np.arange(-reach, reach + _STEP / 2, _STEP)
        self.f = np.asarray(phi(self.x), np.float64)
        self.g = np.gradient(self.f, _STEP)

    def __call__(self, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        u = np.clip((h + self.reach) / _STEP, 0.0, len(self.x) - 1.000001)
        i = u.astype(np.intp)
        t = u - i
        return self.f[i] + t * (self.f[i + 1] - self.f[i]), self.g[i] + t * (self.g[i + 1] - self.g[i])


def _table(phi: Phi, tables: dict, scale: float) -> _Table:
    """The table of ``phi`` reaching ``_REACH`` standard deviations of the widest input at ``scale``."""
    t = tables.get(id(phi))
    if t is None or t.reach < _REACH * scale:
        t = tables[id(phi)] = _Table(phi, _REACH * max(scale, 1.0))
    return t


@dataclass(frozen=True)
class _ActMap:
    """An activation at one kernel: its output kernel and mean, and their Jacobians."""

    out: np.ndarray  # Phi_ab = E phi(h_a) phi(h_b)
    jx: np.ndarray  # dPhi_ab / dK_ab
    ja: np.ndarray  # dPhi_ab / dK_aa (row a's own variance)
    mean: np.ndarray  # E phi(h_a)
    jm: np.ndarray  # dE phi(h_a) / dK_aa
    rq: np.ndarray  # E R_a R_c of the q residuals R_a = phi_a^2 - Phi_aa - dPhi_aa/dK_aa (h_a^2 - K_aa)


def _act_map(tab: _Table, k: np.ndarray, chunk: int = 512) -> _ActMap:
    """Price's theorem: dPhi_ab/dK_ab = E phi'_a phi'_b; rescaling h_a by l gives
    2 K_aa dPhi/dK_aa + K_ab dPhi/dK_ab = E phi'_a h_a phi_b, hence dPhi/dK_aa without phi''.
    Gauss-Hermite in h_a = s_a z1, h_b = s_b (rho z1 + sqrt(1 - rho^2) z2)."""
    m = k.shape[0]
    d = np.clip(np.diag(k), 0.0, None)
    sd = np.sqrt(d)
    h1 = sd[:, None] * _Z[None, :]  # [m, Q]: h_a on the first axis's nodes
    f1, g1 = tab(h1)
    w1 = f1 * _W, g1 * _W, g1 * h1 * _W  # weighted by the first axis's weights
    ia, ib = np.triu_indices(m)
    out, jx, ja, jb, ff, fh, hf = (np.zeros(len(ia)) for _ in range(7))
    for s in range(0, len(ia), chunk):
        a, b = ia[s : s + chunk], ib[s : s + chunk]
        rho = np.where(sd[a] * sd[b] > 0, k[a, b] / np.maximum(sd[a] * sd[b], 1e-300), 0.0).clip(-1.0, 1.0)
        inner = rho[:, None, None] * _Z[None, :, None] + np.sqrt(1.0 - rho * rho)[:, None, None] * _Z[None, None, :]
        hb = sd[b][:, None, None] * inner  # [p, Q1, Q2]
        fb, gb = tab(hb)
        fb2, gb2, hgb2 = fb @ _W, gb @ _W, (gb * hb) @ _W  # the second axis integrated: [p, Q1]
        out[s : s + chunk] = np.sum(w1[0][a] * fb2, axis=1)
        jx[s : s + chunk] = np.sum(w1[1][a] * gb2, axis=1)
        ea, eb = np.sum(w1[2][a] * fb2, axis=1), np.sum(f1[a] * _W * hgb2, axis=1)
        sq_b, hsq_b = (fb * fb) @ _W, (hb * hb) @ _W
        ff[s : s + chunk] = np.sum(w1[0][a] * f1[a] * sq_b, axis=1)  # E phi_a^2 phi_b^2
        fh[s : s + chunk] = np.sum(w1[0][a] * f1[a] * hsq_b, axis=1)  # E phi_a^2 h_b^2
        hf[s : s + chunk] = np.sum(_W * h1[a] * h1[a] * sq_b, axis=1)  # E h_a^2 phi_b^2
        kab = k[a, b]
        with np.errstate(divide="ignore", invalid="ignore"):
            ja[s : s + chunk] = np.where(d[a] > 0, (ea - kab * jx[s : s + chunk]) / (2 * d[a]), 0.0)
            jb[s : s + chunk] = np.where(d[b] > 0, (eb - kab * jx[s : s + chunk]) / (2 * d[b]), 0.0)
    full = [np.zeros((m, m)) for _ in range(3)]
    for f, v in zip(full, (out, jx, ja), strict=True):
        f[ia, ib] = v
    full[0][ib, ia], full[1][ib, ia] = out, jx
    full[2][ib, ia] = jb  # entry (b, a): its "own" row is b
    mean = f1 @ _W
    with np.errstate(divide="ignore", invalid="ignore"):
        jm = np.where(d > 0, (g1 * h1) @ _W / (2 * d), 0.0)
    # the q residuals' covariance: E[R_a R_c] from the pair moments (E h_a^2 h_c^2 - K_aa K_cc = 2 K_ac^2)
    phi2, jq = np.diag(full[0]), np.diag(full[1]) + 2 * np.diag(full[2])
    e_ff, e_fh = np.zeros((m, m)), np.zeros((m, m))  # E phi_a^2 phi_c^2, E phi_a^2 h_c^2
    e_ff[ia, ib] = e_ff[ib, ia] = ff
    e_fh[ia, ib], e_fh[ib, ia] = fh, hf
    rq = (
        e_ff
        - np.outer(phi2, phi2)
        - jq[None, :] * (e_fh - np.outer(phi2, d))
        - jq[:, None] * (e_fh.T - np.outer(d, phi2))
        + np.outer(jq, jq) * 2 * k * k
    )
    return _ActMap(full[0], full[1], full[2], mean, jm, rq)


@dataclass(frozen=True)
class Entries:
    """Which kernel entries the probes carry: ``a[i], b[i]`` of entry i, ``diag[a]`` the index of
    (a, a). The maps act entry by entry, so a measurement that reads only the diagonal and each
    pair's own entry needs only those (attention, which mixes tokens, needs them all)."""

    a: np.ndarray
    b: np.ndarray
    diag: np.ndarray

    @classmethod
    def of(cls, m: int, pairs: bool) -> Entries:
        if pairs:  # (a, a) for every input, then each pair's (2p, 2p + 1)
            a = np.concatenate([np.arange(m), np.arange(0, m, 2)])
            b = np.concatenate([np.arange(m), np.arange(1, m, 2)])
        else:
            a, b = np.triu_indices(m)
        pos = {(int(i), int(j)): n for n, (i, j) in enumerate(zip(a, b, strict=True))}
        return cls(a, b, np.array([pos[(i, i)] for i in range(m)]))

    def full(self, dk: np.ndarray) -> np.ndarray:
        """[R, m, m] symmetric matrices from [R, entries] (every entry carried)."""
        m = len(self.diag)
        out = np.zeros((dk.shape[0], m, m))
        out[:, self.a, self.b] = dk
        out[:, self.b, self.a] = dk
        return out


def _act_linear(am: _ActMap, dk: np.ndarray, e: Entries) -> np.ndarray:
    """The Jacobian of the kernel map applied to fluctuations ``dk`` ([R, entries])."""
    diag = dk[:, e.diag]
    own = (e.a == e.b)[None, :]
    # on the diagonal dK_ab, dK_aa and dK_bb are one variable, counted once in each coefficient
    jx = np.where(own, am.jx[e.a, e.b] + 2 * am.ja[e.a, e.b], am.jx[e.a, e.b])
    return jx * dk + np.where(own, 0.0, am.ja[e.a, e.b] * diag[:, e.a] + am.ja[e.b, e.a] * diag[:, e.b])


# -- one realization of each layer's noise per probe ----------------------------------------------


def _units(k: np.ndarray, r: int, rng, *, with_z: bool = False):
    """``r`` Gaussian units h ~ N(0, k) ([r, m]; k may be singular), and with ``with_z`` the
    standard normals they are made of, one per non-zero eigenvalue of k ([r, rank])."""
    vals, vecs = np.linalg.eigh(0.5 * (k + k.T))
    live = vals > 1e-12 * max(1.0, float(vals.max(initial=0.0)))
    root = vecs[:, live] * np.sqrt(vals[live])
    z = rng.standard_normal((r, int(live.sum())))
    return (z @ root.T, z) if with_z else z @ root.T


@dataclass
class _State:
    kernel: np.ndarray  # infinite-width kernel of the representative inputs
    mean: np.ndarray  # per-input feature mean
    dk: np.ndarray  # [R, entries] fluctuations of the carried entries, one row per probe
    dm: np.ndarray  # [R, m]
    shape: tuple[int, ...]  # the representatives' layout shape
    # the inputs' q fluctuations exactly: source -> A, dq = sum_s A xi_s with Cov(xi_s) = sources[s]
    # (each input's q moves only with its own q upstream); None after an op that mixes in other entries
    qa: dict[int, np.ndarray] | None
    entries: Entries
    # draws of one unit's values over the inputs given the infinite-width kernels upstream ([r, m]),
    # as ``units(r, rng)``; None: Gaussian with this kernel and mean (``_sampler``)
    units: Callable | None = None


def _sampler(st: _State) -> Callable:
    """How one unit of ``st`` is drawn: its own sampler, else a Gaussian of its kernel and mean."""
    if st.units is not None:
        return st.units
    k, mean = st.kernel, st.mean

    def gaussian(r: int, rng) -> np.ndarray:
        return _units(k - np.outer(mean, mean), r, rng) + mean

    return gaussian


def _width(shape, sequence: bool) -> int:
    return int(shape[-1] if sequence else shape[0])


def _scaled(qa, left) -> dict | None:
    """``qa`` with every coefficient multiplied on the left (a vector: per input; a matrix)."""
    if qa is None:
        return None
    return {s: (left[:, None] * a if np.ndim(left) == 1 else left @ a) for s, a in qa.items()}


def _merged(parts: list[tuple[float, dict | None]]) -> dict | None:
    if any(qa is None for _, qa in parts):
        return None
    out: dict[int, np.ndarray] = {}
    for w, qa in parts:
        for s, a in qa.items():
            out[s] = out[s] + w * a if s in out else w * a
    return out


def _source(qa: dict | None, sources: list, cov: np.ndarray) -> dict | None:
    """``qa`` with a new independent source of q noise of covariance ``cov`` (identity coefficient)."""
    if qa is None:
        return None
    sources.append(cov)
    return {**qa, len(sources) - 1: np.eye(cov.shape[0])}


def _dense(st: _State, s: float, b: float, nu: float, n: int, fan: int, rng, sources: list) -> _State:
    """Wishart noise nu (K_ac K_bd + K_ad K_bc) / n; an orthogonal projection (``fan`` = n_in > 0)
    also fixes its trace, which takes (2 / n_in) K_ab K_cd off (the fourth moments of a Haar
    projection; it matters once the inputs measured span a good part of the n_in dimensions).
    A Gaussian bias of variance ``b`` is in the Wishart noise of Gaussian weights (each unit is
    N(0, s K + b)); next to an orthogonal matrix (``fan`` > 0) it adds its own, per unit
    b_i (u_a + u_b) + b_i^2 - b with u ~ N(0, s K) the matrix's part (eoc's layers after an activation)."""
    k = s * st.kernel + b
    kw = s * st.kernel if fan else k  # what the weights' noise is of: with orthogonal weights, not the bias
    dk = s * st.dk
    e = st.entries
    qa = _scaled(st.qa, np.full(len(k), s))
    if nu > 0 and n > 0:
        h, z = _units(kw, dk.shape[0], rng, with_z=True)
        noise = h[:, e.a] * h[:, e.b] - kw[e.a, e.b]
        rank = z.shape[1]
        if fan and rank:
            # minus lam (|z|^2 - rank) K: Cov(W, |z|^2) = 2 K and Var |z|^2 = 2 rank, so the covariance
            # loses (4 lam - 2 rank lam^2) K K = (2 / fan) K K at this root of rank lam^2 - 2 lam + 1 / fan
            lam = (1.0 - math.sqrt(max(0.0, 1.0 - rank / fan))) / rank
            noise = noise - lam * (np.sum(z * z, axis=1) - rank)[:, None] * kw[e.a, e.b]
        dk = dk + math.sqrt(nu / n) * noise
        d = np.diag(kw)
        qa = _source(qa, sources, nu / n * (2 * kw * kw - (2.0 / fan if fan else 0.0) * np.outer(d, d)))
    if fan and b > 0 and n > 0:
        u = _units(kw, dk.shape[0], rng)
        bias = math.sqrt(b) * rng.standard_normal((dk.shape[0], 1))
        dk = dk + (bias * (u[:, e.a] + u[:, e.b]) + bias * bias - b) / math.sqrt(n)
        qa = _source(qa, sources, (4 * b * kw + 2 * b * b) / n)
    return _State(k, np.zeros_like(st.mean), dk, np.zeros_like(st.dm), st.shape, qa, e, lambda r, g: _units(k, r, g))


def _activation(st: _State, tab: _Table, n: int, rng, sources: list) -> _State:
    am = _act_map(tab, st.kernel)
    e = st.entries
    h = _units(st.kernel, st.dk.shape[0], rng)
    f = tab(h)[0]
    g = h[:, e.a] * h[:, e.b] - st.kernel[e.a, e.b]
    resid = f[:, e.a] * f[:, e.b] - am.out[e.a, e.b] - _act_linear(am, g, e)
    resid_m = f - am.mean - am.jm * g[:, e.diag]
    dk = _act_linear(am, st.dk, e) + resid / math.sqrt(n)
    dm = am.jm * st.dk[:, e.diag] + resid_m / math.sqrt(n)
    qa = _source(_scaled(st.qa, np.diag(am.jx) + 2 * np.diag(am.ja)), sources, am.rq / n)
    pre = _sampler(st)
    return _State(am.out, am.mean, dk, dm, st.shape, qa, e, lambda r, g: tab(pre(r, g))[0])


def _product(su: _State, sv: _State, n: int, rng, sources: list) -> _State:
    """``mul(u, v)`` of factors whose units are independent given the layers upstream (their own
    weights): K = K_u o K_v, and over n units (1/n) sum_i X_i Y_i with X_i = u_ia u_ib, Y_i = v_ia v_ib
    fluctuates by K_v dK_u + K_u dK_v (each factor's own fluctuation, upstream and its layer's) plus
    the units' cross term (1/n) sum_i (X_i - K_u)(Y_i - K_v), of variance Var X Var Y / n, drawn from
    the factors' units (``_sampler``: an activation of a Gaussian unit, a Gaussian unit)."""
    e = su.entries
    ku, kv = su.kernel, sv.kernel
    r = su.dk.shape[0]
    draw_u, draw_v = _sampler(su), _sampler(sv)
    u, v = draw_u(r, rng), draw_v(r, rng)
    xu, xv = u[:, e.a] * u[:, e.b] - ku[e.a, e.b], v[:, e.a] * v[:, e.b] - kv[e.a, e.b]
    dk = kv[e.a, e.b] * su.dk + ku[e.a, e.b] * sv.dk + xu * xv / math.sqrt(n)
    dm = sv.mean * su.dm + su.mean * sv.dm + (u - su.mean) * (v - sv.mean) / math.sqrt(n)
    qa = _merged([(1.0, _scaled(su.qa, np.diag(kv))), (1.0, _scaled(sv.qa, np.diag(ku)))])
    if qa is not None:  # the cross term's covariance over the inputs' q, from many unit draws
        big = 8192
        x2, y2 = draw_u(big, rng) ** 2 - np.diag(ku), draw_v(big, rng) ** 2 - np.diag(kv)
        qa = _source(qa, sources, (x2.T @ x2 / big) * (y2.T @ y2 / big) / n)
    units = lambda count, g: draw_u(count, g) * draw_v(count, g)  # noqa: E731
    return _State(ku * kv, su.mean * sv.mean, dk, dm, su.shape, qa, e, units)


def _sum(states: list[_State], weights: list[float], n: int, rng, sources: list) -> _State:
    k = sum(w * w * s.kernel for w, s in zip(weights, states, strict=True))
    dk = sum(w * w * s.dk for w, s in zip(weights, states, strict=True))
    mean = sum(w * s.mean for w, s in zip(weights, states, strict=True))
    dm = sum(w * s.dm for w, s in zip(weights, states, strict=True))
    qa = _merged([(w * w, s.qa) for w, s in zip(weights, states, strict=True)])
    r = dk.shape[0]
    for i in range(len(states)):  # the branches' cross terms x_i . x_j / n: zero mean, variance K_i K_j / n
        for j in range(i + 1, len(states)):
            u, v = _units(states[i].kernel, r, rng), _units(states[j].kernel, r, rng)
            e = states[0].entries
            wij = weights[i] * weights[j]
            dk = dk + wij * (u[:, e.a] * v[:, e.b] + v[:, e.a] * u[:, e.b]) / math.sqrt(n)
            qa = _source(qa, sources, 4 * wij * wij * states[i].kernel * states[j].kernel / n)
    return _State(k, mean, dk, dm, states[0].shape, qa, states[0].entries)


def _concat(states: list[_State], coef) -> _State:
    def mix(field):
        return sum(c * getattr(p, field) for c, p in zip(coef, states, strict=True))

    qa = _merged(list(zip(coef, [p.qa for p in states], strict=True)))
    return _State(mix("kernel"), mix("mean"), mix("dk"), mix("dm"), states[0].shape, qa, states[0].entries)


def _layer_norm(st: _State, centres: bool = True) -> _State:
    """Per token (input): centre its features (a row's ``centres``: layer_norm, not rms_norm) and
    divide by their measured spread, linearized. Each input's q is then exactly 1 (no q noise: its
    diagonal fluctuation cancels, and ``qa`` starts afresh); its correlations keep their noise, less
    the part that moved q. rms_norm keeps the feature mean, divided by the root mean square."""
    k, e = st.kernel, st.entries
    m = st.mean if centres else np.zeros_like(st.mean)
    dm = st.dm if centres else np.zeros_like(st.dm)
    var = np.clip(np.diag(k) - m * m, 1e-300, None)
    root = np.sqrt(var)
    out = (k - np.outer(m, m)) / np.outer(root, root)
    dv = st.dk[:, e.diag] - 2 * m * dm
    centred = st.dk - dm[:, e.a] * m[e.b] - m[e.a] * dm[:, e.b]
    scaled = centred / (root[e.a] * root[e.b])
    dk = scaled - 0.5 * out[e.a, e.b] * (dv[:, e.a] / var[e.a] + dv[:, e.b] / var[e.b])
    if centres:
        mean, dmean, units = np.zeros_like(m), np.zeros_like(st.dm), None
    else:  # x / rms(x): the mean over units scales with it
        mean = st.mean / root
        dmean = st.dm / root - 0.5 * mean * dv / var
        draw = _sampler(st)
        units = lambda r, g: draw(r, g) / root  # noqa: E731
    return _State(out, mean, dk, dmean, st.shape, {}, e, units)


def _attention(st: _State, a: np.ndarray) -> _State:
    """A K A^T within each set of tokens (block diagonal over the sets)."""
    sets, t = st.shape
    big = np.kron(np.eye(sets), a)
    e = st.entries
    dk = (big @ e.full(st.dk) @ big.T)[:, e.a, e.b]
    return _State(big @ st.kernel @ big.T, big @ st.mean, dk, st.dm @ big.T, st.shape, None, e)


def _to_features(st: _State, pooled: bool) -> _State:
    """A map's locations averaged into per-example features (the representatives sample k_l of
    them): a flatten's inner product is the mean over locations of each location's own products.
    A global average pool's mixes every pair of locations, whose fluctuations the few sampled
    locations do not give (nor is its prediction exact unless the locations agree): its kernel is
    kept, its fluctuations are not (NaN)."""
    k_e, k_l, _ = st.shape
    m = k_e * k_l * 2
    idx = np.arange(m).reshape(k_e, k_l, 2)
    avg = np.zeros((2 * k_e, m))
    for e in range(k_e):
        for h in range(2):
            avg[2 * e + h, idx[e, :, h]] = 1.0 / k_l
    new = Entries.of(2 * k_e, pairs=True)
    if pooled:  # a global pool (the row's ``pool``), not a flatten
        dk = np.full((st.dk.shape[0], len(new.a)), np.nan)
        return _State(avg @ st.kernel @ avg.T, avg @ st.mean, dk, st.dm @ avg.T, (k_e, 1, 2), None, new)
    pick = np.zeros((2 * k_e, 2 * k_e, m, m))  # flatten: K(e h, e' h') = mean_l K(e l h, e' l h')
    for e in range(2 * k_e):
        for f in range(2 * k_e):
            for loc in range(k_l):
                pick[e, f, idx[e // 2, loc, e % 2], idx[f // 2, loc, f % 2]] = 1.0 / k_l
    kernel = np.einsum("efab,ab->ef", pick, st.kernel)
    old = st.entries
    pos = {(int(i), int(j)): n for n, (i, j) in enumerate(zip(old.a, old.b, strict=True))}
    dk = np.zeros((st.dk.shape[0], len(new.a)))
    for n, (i, j) in enumerate(zip(new.a, new.b, strict=True)):
        for loc in range(k_l):
            key = tuple(sorted((int(idx[i // 2, loc, i % 2]), int(idx[j // 2, loc, j % 2]))))
            dk[:, n] += st.dk[:, pos[key]] / k_l
    return _State(kernel, avg @ st.mean, dk, st.dm @ avg.T, (k_e, 1, 2), _scaled(st.qa, avg), new)


# -- the walk --------------------------------------------------------------------------------------


def _phi_of(phi, nid: str) -> Phi | None:
    return phi.get(nid) if isinstance(phi, Mapping) else phi


def propagate(
    graph: dict, sol, kernel: np.ndarray, shape: tuple, phi, reduce, *, probes: int = PROBES, seed: int = 0
) -> dict:
    """Graph id -> ``reduce(kernel, dk, shape, cov_q)`` of every node, for representative inputs of
    Gram matrix ``kernel`` (x_a . x_b / features) laid out as ``shape``: ``(examples, locations, 2)``
    (pairs; a map's locations are averaged where it turns into features) or ``(sets, tokens)`` (a
    sequence graph). The node's ``kernel`` is the representatives' infinite-width kernel, ``dk``
    realizations of its finite-width fluctuation, one row per probe: [probes, m, m] for a sequence,
    [probes, 3m / 2] for pairs (each input's q, then each pair's own entry: :class:`Entries`; NaN
    after a global pool of sampled locations), ``cov_q`` the exact covariance of
    the representatives' q fluctuations (None where an op mixes other entries into q: a global pool,
    attention, a layer norm). ``phi``: the answer's transformed activation as a numpy function of an
    array (or graph id -> one, for several); an activation without one is taken as the identity."""
    g = Graph.model_validate(graph)
    shapes = infer_shapes(g)
    sequence = len(shape) == 2
    layers = {layer.id: layer for layer in sol.layers}
    attention = {a.node: a.generator for a in (sol.attention.layers if getattr(sol, "attention", None) else [])}
    rng = np.random.default_rng(seed)
    m = kernel.shape[0]
    sources: list[np.ndarray] = []
    # a sequence's probes carry all m (m + 1) / 2 entries: fewer for long ones (error 1 / sqrt(2 probes))
    probes = probes if not sequence or m <= 48 else max(128, int(probes * (48 / m) ** 2))
    readers: dict[str, int] = {}
    for nd in graph["nodes"]:
        for i in nd.get("inputs", []):
            readers[i] = readers.get(i, 0) + 1
    states: dict[str, _State] = {}

    def m_of(st: _State) -> int:
        return st.kernel.shape[0]

    tables: dict[int, _Table] = {}

    def source(nd, ins):
        e = Entries.of(m, pairs=not sequence)
        zeros = np.zeros((probes, len(e.a))), np.zeros((probes, m))
        return _State(np.array(kernel, np.float64), np.zeros(m), *zeros, tuple(shape), {}, e)

    def affine(nd, ins):
        return _dense(states[ins[0]], *_affine(layers.get(nd["id"]), shapes, nd, ins[0], sequence), rng, sources)

    def activation(nd, ins):
        f = _phi_of(phi, nd["id"])
        src = states[ins[0]]
        scale = math.sqrt(max(float(np.max(np.diag(src.kernel), initial=0.0)), 0.0))
        width = _width(shapes[nd["id"]], sequence)
        return src if f is None else _activation(src, _table(f, tables, scale), width, rng, sources)

    def add(nd, ins):
        weights = nd.get("weights") or [1.0 / math.sqrt(len(ins))] * len(ins)
        return _sum([states[i] for i in ins], list(weights), _width(shapes[nd["id"]], sequence), rng, sources)

    def concat(nd, ins):
        return _concat([states[i] for i in ins], concat_coefficients(_width(shapes[i], sequence) for i in ins))

    def mixing(nd, ins):
        t = shapes[nd["id"]][0]
        gen = attention.get(nd["id"])
        a = np.eye(t) if gen is None else expand_attention(dict(gen), t, bool(nd.get("causal", False))).matrix()
        return _attention(states[ins[-1]], a)

    def norm(nd, ins):
        return _layer_norm(states[ins[0]], OP_TABLE[nd["op"]].centres)

    def product(nd, ins):
        return _product(states[ins[0]], states[ins[1]], _width(shapes[nd["id"]], sequence), rng, sources)

    def passing(nd, ins):
        # pooling over locations, identity, dropout, output, a flatten of features: the value itself;
        # a map turned into features (the row's ``to_features``) averages its locations
        row, src = OP_TABLE[nd["op"]], states[ins[0]]
        if row.to_features and not sequence and src.shape[1] > 1:
            return _to_features(src, bool(row.pool))
        return src

    handlers = {SOURCE: source, AFFINE: affine, ACT: activation, SUM: add, CONCAT: concat}
    handlers |= {ATTENTION: mixing, NORM: norm, PRODUCT: product}
    out = {}
    for nd in graph["nodes"]:
        nid, ins = nd["id"], nd.get("inputs", [])
        st = handlers.get(OP_TABLE[nd["op"]].kind, passing)(nd, ins)
        states[nid] = st
        cov_q = None
        if st.qa is not None:
            cov_q = sum((a @ sources[i] @ a.T for i, a in st.qa.items()), np.zeros((m_of(st),) * 2))
        out[nid] = reduce(st.kernel, st.entries.full(st.dk) if sequence else st.dk, st.shape, cov_q)
        for i in ins:  # free what no later node reads: each state holds [probes, m, m] numbers
            readers[i] -= 1
            if readers[i] == 0:
                del states[i]
    return out


def _affine(layer, shapes: dict, nd: dict, src: str, sequence: bool) -> tuple[float, float, float, int, int]:
    """(sigma_w^2, sigma_b^2, nu, n_out, fan) of a dense or conv node: nu is the share of the Wishart
    noise its weights add (1 Gaussian, 1 - n_out / n_in orthogonal, 0 when it preserves norms), fan
    the n_in of an orthogonal matrix (0 for Gaussian weights: no trace constraint)."""
    n_out, n_in = _width(shapes[nd["id"]], sequence), _width(shapes[src], sequence)
    if layer is None:  # a layer the answer does not list: PyTorch-style i.i.d. weights, q kept
        return 1.0, 0.0, 1.0, n_out, 0
    s, b = layer.weight_variance * layer.fan_in, layer.bias_variance
    if layer.distribution not in _ORTHOGONAL:
        return s, b, 1.0, n_out, 0
    fan = n_in if layer.distribution == "orthogonal_delta" else layer.fan_in
    return s, b, max(0.0, 1.0 - n_out / fan), n_out, fan
