"""Finite-width random networks in numpy, built from a graph and an answer alone, for Monte Carlo
checks of what the answer predicts (TAT paper Appendix E.1: empirical c values against the C map).

Weights follow each layer entry of the answer: scale-corrected uniform orthogonal (SUO) matrices for
dense layers, Orthogonal Delta for convolutions (only the centre tap is non-zero, so a convolution
is the same channel matrix at every location, and a stride keeps every ``stride``-th location).
Activations are written here from their definitions, not taken from the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import erf

from sigprop.engine.solve import prepare
from sigprop.requests import parse_solve_request

RAW = {
    "softplus": lambda x: np.logaddexp(0.0, x),
    "tanh": np.tanh,
    "gelu": lambda x: 0.5 * x * (1.0 + erf(x / math.sqrt(2.0))),
    "erf": erf,
    "atan": np.arctan,
    "asinh": np.arcsinh,
    "softsign": lambda x: x / (1.0 + np.abs(x)),
    "bentid": lambda x: (np.sqrt(x * x + 1.0) - 1.0) / 2.0 + x,
    "swish": lambda x: x / (1.0 + np.exp(-x)),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0.0))),
    "selu": lambda x: 1.0507009873554805 * np.where(x > 0, x, 1.6732632423543772 * np.expm1(np.minimum(x, 0.0))),
    "relu": lambda x: np.maximum(x, 0.0),
    "leaky_relu": lambda x: np.where(x > 0, x, 0.01 * x),  # the catalogue's default slope (Edge of Chaos keeps it)
}


def phi_hat(ans):
    """The answer's transformed activation: output_scale (phi(input_scale x + input_shift) + output_shift)."""
    if ans.negative_slope is not None:
        a, g = ans.negative_slope, ans.output_scale
        return lambda x: g * np.where(x > 0, x, a * x)
    if ans.tau is not None:  # sparse Edge of Chaos: the clipped thresholds, equations (9)-(10)
        tau, m = ans.tau, ans.m
        return {
            "crelu": lambda x: np.clip(x - tau, 0.0, m),
            "cst": lambda x: np.sign(x) * np.clip(np.abs(x) - tau, 0.0, m),
            "relu_tau": lambda x: np.maximum(x - tau, 0.0),  # equation (7)
            "soft_threshold": lambda x: np.sign(x) * np.maximum(np.abs(x) - tau, 0.0),  # equation (8)
        }[ans.activation]
    raw = RAW[ans.activation]
    if ans.input_scale is None:  # Edge of Chaos: phi itself, with sigma_w2 and sigma_b2 in the layers
        return raw
    al, be, ga, de = ans.input_scale, ans.input_shift, ans.output_scale, ans.output_shift
    return lambda x: ga * (raw(al * x + be) + de)


def suo(m: int, k: int, gain: float, rng: np.random.Generator) -> np.ndarray:
    """An m x k matrix with orthonormal rows (m <= k) or columns (m > k), times ``gain`` (Haar: QR
    of a Gaussian matrix with the signs of R's diagonal fixed)."""
    if m > k:
        return suo(k, m, 1.0, rng).T * gain
    q, r = np.linalg.qr(rng.standard_normal((k, m)))
    q *= np.sign(np.diag(r))[None, :]
    return gain * q.T


@dataclass
class Probe:
    """Features recorded during one forward pass: by node id, arrays of shape (batch, channels[, h, w])."""

    values: dict


def forward(
    graph,
    ans,
    x: np.ndarray,
    rng: np.random.Generator,
    record=(),
    dropout_training: bool = False,
    mixers: dict | None = None,
) -> tuple[np.ndarray, Probe]:
    """Propagate a batch ``x`` through one random draw of the network; returns the output and the
    features of the nodes named in ``record``. Dropout is the identity (evaluation mode) unless
    ``dropout_training``: then every input draws its own mask and the kept values are divided by 1 - p.

    Sequence graphs: ``x`` is (batch, tokens, features), dense layers act on the last axis, and an
    attention node is its fixed matrix at initialization (``mixers``: T x T by node id, e.g. from
    ``sigprop.schemas.attention_init.expand_attention``: zero queries make the logits vanish)
    applied to its value input over the token axis."""
    layers = {lay.id: lay for lay in ans.layers}
    act = phi_hat(ans)
    vals: list[np.ndarray] = [None] * graph.n  # type: ignore[list-item]
    probe = Probe({})
    for nd in graph.nodes:
        ins = [vals[i] for i in nd.inputs]
        if nd.op == "input":
            h = x
        elif nd.op in ("dense", "conv"):
            lay = layers[nd.user_id]
            if lay.distribution == "gaussian":  # e.g. a sequence graph's zero query projections
                w = rng.standard_normal((lay.fan_out, lay.fan_in)) * math.sqrt(lay.weight_variance)
            else:
                assert lay.distribution in ("scaled_uniform_orthogonal", "orthogonal_delta")
                w = suo(lay.fan_out, lay.fan_in, lay.gain, rng)
            h = ins[0]
            if nd.op == "conv":
                sh, sw = nd.attrs["stride"]
                h = np.einsum("oc,bchw->bohw", w, h[:, :, ::sh, ::sw], optimize=True)
            else:
                h = h @ w.T
            if lay.bias == "gaussian":  # one draw per channel, shared by the batch and the locations
                b = rng.standard_normal(lay.fan_out) * math.sqrt(lay.bias_variance)
                h = h + (b if len(nd.shape) == 2 else b.reshape((1, -1) + (1,) * (h.ndim - 2)))
        elif nd.op == "activation":
            fn = nd.attrs.get("fn", ans.activation)
            if fn == ans.activation or fn is None:
                h = act(ins[0])
            elif ans.input_scale is None and ans.tau is None and ans.negative_slope is None:
                h = RAW[fn](ins[0])  # Edge of Chaos with several functions: each phi itself
            else:
                raise NotImplementedError(f"a second function {fn!r} in a transformed answer")
        elif nd.op == "sum":
            # the answer's sum_scales renormalize sums of shared atoms, as the adapters apply them
            scale = (ans.sum_scales or {}).get(nd.user_id, 1.0)
            h = sum(scale * wt * v for wt, v in zip(nd.attrs["weights"], ins, strict=False))
        elif nd.op == "rms_norm":  # over the features (the last axis), per example or per token
            h = ins[0] / np.sqrt(np.mean(ins[0] * ins[0], axis=-1, keepdims=True))
        elif nd.op == "layer_norm":
            c = ins[0] - ins[0].mean(axis=-1, keepdims=True)
            h = c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True))
        elif nd.op == "mul":
            h = ins[0] * ins[1]
        elif nd.op == "max_pool_pairs":  # max_pool of kernel 2 on features: adjacent pairs of the last axis
            h = np.maximum(ins[0][..., 0::2], ins[0][..., 1::2])
        elif nd.op == "attention":
            h = np.einsum("ts,bsf->btf", mixers[nd.user_id], ins[2])
        elif nd.op == "concat":
            h = np.concatenate(ins, axis=1)
        elif nd.op == "global_avg_pool":
            h = ins[0].mean(axis=(2, 3))
        elif nd.op == "avg_pool":
            (kh, kw), (sh, sw) = nd.attrs["kernel"], nd.attrs["stride"]
            b, c, hh, ww = ins[0].shape
            oh, ow = (hh - kh) // sh + 1, (ww - kw) // sw + 1
            h = np.zeros((b, c, oh, ow))
            for i in range(kh):
                for j in range(kw):
                    h += ins[0][:, :, i : i + sh * oh : sh, j : j + sw * ow : sw]
            h /= kh * kw
        elif nd.op == "flatten":
            h = ins[0].reshape(len(ins[0]), -1)
        elif nd.op == "dropout" and dropout_training and nd.attrs.get("rate", 0.0) > 0:
            p = nd.attrs["rate"]
            h = ins[0] * (rng.random(ins[0].shape) >= p) / (1.0 - p)
        elif nd.op in ("identity", "dropout", "output"):
            h = ins[0]
        else:
            raise NotImplementedError(nd.op)
        vals[nd.index] = h
        if nd.user_id in record:
            probe.values[nd.user_id] = h
    return vals[graph.output], probe


def correlated_pairs(pairs: int, c0: float, shape: tuple[int, ...], rng, same_locations: bool = True) -> np.ndarray:
    """2 * pairs inputs (x1, c0 x1 + sqrt(1 - c0^2) x2) with mean square 1 per location over channels
    and x1 . x2 = 0 at every location; with ``same_locations`` every location holds the same vector."""
    channels = shape[0]
    locations = 1 if (len(shape) == 1 or same_locations) else shape[1] * shape[2]
    # each pair's two directions: orthonormal columns of a channels x 2 Gaussian matrix, scaled to mean square 1
    base = np.linalg.qr(rng.standard_normal((pairs, locations, channels, 2)))[0] * math.sqrt(channels)
    x1, x2 = base[..., 0], base[..., 1]  # (pairs, locations, channels)
    out = np.empty((2 * pairs, channels, locations))
    out[0::2] = x1.transpose(0, 2, 1)
    out[1::2] = (c0 * x1 + math.sqrt(1 - c0 * c0) * x2).transpose(0, 2, 1)
    if len(shape) == 1:
        return out[:, :, 0]
    if same_locations:
        return (
            np.broadcast_to(out, (2 * pairs, channels, shape[1] * shape[2])).reshape((2 * pairs,) + tuple(shape)).copy()
        )
    return out.reshape((2 * pairs,) + tuple(shape))


def pair_cosines(h: np.ndarray) -> np.ndarray:
    """Cosine similarity of each pair (rows 2i, 2i + 1), per location for feature maps: (pairs, ...)."""
    a, b = h[0::2], h[1::2]
    return np.sum(a * b, axis=1) / np.sqrt(np.sum(a * a, axis=1) * np.sum(b * b, axis=1))


def mean_square(h: np.ndarray) -> np.ndarray:
    """q of each input (per location for feature maps): the mean square over channels."""
    return np.mean(h * h, axis=1)


@dataclass
class Estimate:
    mean: float
    se: float  # standard error over independent networks


def estimate(per_network: list[float]) -> Estimate:
    v = np.asarray(per_network, dtype=float)
    return Estimate(float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))))


def solve_request(body: dict):
    """The answer and the canonical graph (user ids kept) of one request."""
    from sigprop.engine.solve import solve

    request = parse_solve_request(body)
    return prepare(request).graph, solve(request)


def output_statistics(
    graph,
    ans,
    c0s,
    nets: int,
    pairs: int,
    seed: int,
    same_locations: bool = True,
    at: str | None = None,
    dropout_training: bool = False,
) -> dict:
    """Empirical c (per c0) and q at the output, or at node ``at``, over ``nets`` random networks."""
    rng = np.random.default_rng(seed)
    shape = tuple(graph.nodes[next(i for i, nd in enumerate(graph.nodes) if nd.op == "input")].shape)
    cs = {c0: [] for c0 in c0s}
    qs = []
    for _ in range(nets):
        xs = np.concatenate([correlated_pairs(pairs, c0, shape, rng, same_locations) for c0 in c0s])
        net_seed = int(rng.integers(2**63))
        net_rng = np.random.default_rng(net_seed)
        out, probe = forward(graph, ans, xs, net_rng, record=(at,) if at else (), dropout_training=dropout_training)
        h = probe.values[at] if at else out
        for j, c0 in enumerate(c0s):
            cs[c0].append(float(pair_cosines(h[2 * pairs * j : 2 * pairs * (j + 1)]).mean()))
        qs.append(float(mean_square(h).mean()))
    return {"c": {c0: estimate(v) for c0, v in cs.items()}, "q": estimate(qs)}
