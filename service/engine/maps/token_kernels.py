"""Token kernels of a transformer at initialization, at infinite width: the attention schedules and
the exact maps of each op on the T x T token kernel.

A sequence of T tokens, each a vector of width n, has the token kernel Sigma_ij = x_i . x_j / n
(the paper's "kernel matrix" of one sequence). At infinite width every op of a transformer block
maps it exactly, as "Deep Transformers without Shortcuts: Modifying Self-attention for Faithful
Signal Propagation" (He, Martens et al., arXiv:2302.10322) section 2 sets out:

- a dense layer with weights of variance weight_var / fan_in and biases of variance bias_var
  shared by all tokens: Sigma -> weight_var Sigma + bias_var (``dense_token_kernel``);
- attention whose logits vanish at initialization (zero queries, section 3; the width-dependent
  temperature of "The Shaped Transformer", Noci et al., arXiv:2306.17759): a fixed matrix A,
  Sigma -> A Sigma A^T (``attention_token_kernel``; A from ``sigprop.schemas.attention_init``);
- an elementwise activation: Sigma'_ij = E[phi(u) phi(v)] with (u, v) ~ N(0, [[S_ii, S_ij], [S_ij,
  S_jj]]) (section 2, the dual kernel; ``activation_token_kernel``, in ``token_activation``);
- a sum of branches that each end in an independent zero-mean dense layer: the kernels add with
  the coefficients w_k^2 of ``sigprop.schemas.kernels.sum_coefficients`` (``sum_token_kernel``);
- layer normalization over features, per token (``layer_norm_token_kernel``);
- RMS normalization over features, per token (``rms_norm_token_kernel``);
- the elementwise product of two streams with independent atoms (``product_token_kernel``).

The E-SPA schedule (section 3.1): Sigma_l = exp(-gamma_l |i - j|) after attention layer l of L,
from orthonormal tokens (Sigma_0 = I), with every layer multiplying the Cholesky factor's diagonal
alpha_l = sqrt(1 - exp(-2 gamma_l)) by the same alpha_L^(1 / L), i.e. alpha_l = alpha_L^(l / L) and

    gamma_l = -1/2 log(1 - (1 - exp(-2 gamma_L))^(l / L)),

each layer's A_l = L_l L_(l-1)^(-1) mapping Sigma_(l-1) to Sigma_l. The default final gamma_L =
0.005 is the default of a public re-implementation of the paper. The U-SPA schedule, Sigma_l =
(1 - rho_l) I + rho_l 1 1^T, is ours by analogy: 1 - rho_l = (1 - rho_L)^(l / L) (the factor's
diagonal far from the first token is sqrt(1 - rho), multiplied by the same factor per layer), with
the default final rho_L = 0.8 also ours.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ...errors import SigpropError
from ...schemas.activations import activation_info
from ...schemas.attention_init import expand_attention
from ...schemas.shapings import DEFAULT_FINAL_GAMMA, DEFAULT_FINAL_RHO, SHAPINGS
from .activations import Activation, get_activation, transformed
from .token_activation import activation_token_kernel, activation_token_mean

__all__ = [
    "SHAPINGS",
    "DEFAULT_FINAL_GAMMA",
    "DEFAULT_FINAL_RHO",
    "espa_schedule",
    "uspa_schedule",
    "shaping_generators",
    "shaping_schedule",
    "shaping_target",
    "attention_matrices",
    "dense_token_kernel",
    "attention_token_kernel",
    "sum_token_kernel",
    "layer_norm_token_kernel",
    "product_token_kernel",
    "rms_norm_token_kernel",
    "activation_token_kernel",
    "activation_token_mean",
    "answer_activation",
]


_TRANSFORM_KEYS = ("input_scale", "input_shift", "output_scale", "output_shift")
_TRANSFORM_IDENTITY = {"input_scale": 1.0, "input_shift": 0.0, "output_scale": 1.0, "output_shift": 0.0}


def _layer_count(layers) -> int:
    if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)) or layers < 1:
        raise SigpropError(
            "invalid_request",
            f"an attention schedule needs a positive whole number of attention layers, got {layers!r}",
            "count the graph's attention nodes",
        )
    return int(layers)


def espa_schedule(final_gamma: float, layers: int) -> np.ndarray:
    """gamma_1 .. gamma_L of E-SPA (arXiv:2302.10322 section 3.1): alpha_l = alpha_L^(l / L) for the
    Cholesky factor's diagonal alpha = sqrt(1 - exp(-2 gamma)), so gamma_l = -1/2 log(1 - (1 -
    exp(-2 gamma_L))^(l / L)); decreasing in l, gamma_L = ``final_gamma`` exactly."""
    n = _layer_count(layers)
    gamma = float(final_gamma)
    if not (math.isfinite(gamma) and gamma > 0.0):
        raise SigpropError(
            "invalid_request",
            f"final_gamma must be a finite number > 0, got {final_gamma!r}",
            f"the last layer's kernel is exp(-gamma |i - j|); the paper's default is {DEFAULT_FINAL_GAMMA}",
        )
    # alpha_L^2 = 1 - exp(-2 gamma_L); alpha_l^2 = (alpha_L^2)^(l / L); gamma_l = -1/2 log(1 - alpha_l^2)
    log_alpha2 = math.log(-math.expm1(-2.0 * gamma))
    fractions = np.arange(1, n + 1) / n
    out = -0.5 * np.log1p(-np.exp(fractions * log_alpha2))
    out[-1] = gamma
    return out


def uspa_schedule(final_rho: float, layers: int) -> np.ndarray:
    """rho_1 .. rho_L of U-SPA: 1 - rho_l = (1 - rho_L)^(l / L) (ours, by analogy with E-SPA's
    schedule: the factor's diagonal sqrt(1 - rho) shrinks by the same factor per layer);
    increasing in l, rho_L = ``final_rho`` exactly."""
    n = _layer_count(layers)
    rho = float(final_rho)
    if not (math.isfinite(rho) and 0.0 <= rho < 1.0):
        raise SigpropError(
            "invalid_request",
            f"final_rho must be a number in [0, 1), got {final_rho!r}",
            f"the last layer's kernel is (1 - rho) I + rho 1 1^T; the default is {DEFAULT_FINAL_RHO}",
        )
    fractions = np.arange(1, n + 1) / n
    out = -np.expm1(fractions * math.log1p(-rho))
    out[-1] = rho
    return out


def _shaping(shaping: str) -> str:
    if shaping not in SHAPINGS:
        raise SigpropError(
            "invalid_request",
            f"unknown attention shaping {shaping!r}",
            f"use one of {', '.join(SHAPINGS)}",
        )
    return shaping


def _families(shaping: str, layers: int, final_gamma: float, final_rho: float) -> list[dict]:
    """Sigma_1 .. Sigma_L of a Cholesky-ratio shaping as kernel-family dicts."""
    if shaping == "e-spa":
        return [{"family": "exponential", "gamma": float(g)} for g in espa_schedule(final_gamma, layers)]
    return [{"family": "uniform", "rho": float(r)} for r in uspa_schedule(final_rho, layers)]


def shaping_generators(
    shaping: str,
    layers: int,
    *,
    final_gamma: float = DEFAULT_FINAL_GAMMA,
    final_rho: float = DEFAULT_FINAL_RHO,
    temperature: float = 1.0,
) -> list[dict]:
    """One generator per attention layer, in network order, exactly as
    ``sigprop.schemas.attention_init.expand_attention`` reads it: E-SPA and U-SPA map Sigma_(l-1) to
    Sigma_l (layer 1's source is the identity, orthonormal tokens; arXiv:2302.10322 section 3);
    Value-SkipInit is alpha = 1, beta = 0 (section 4); shaped attention has the temperature tau_0."""
    shaping = _shaping(shaping)
    n = _layer_count(layers)
    if shaping == "value-skipinit":
        return [{"form": "value_skipinit", "alpha": 1.0, "beta": 0.0} for _ in range(n)]
    if shaping == "shaped":
        tau = float(temperature)
        if not (math.isfinite(tau) and tau > 0.0):
            raise SigpropError(
                "invalid_request",
                f"temperature must be a finite number > 0, got {temperature!r}",
                "shaped attention divides its logits by temperature * sqrt(d_model * d_head); 1 is the default",
            )
        return [{"form": "shaped", "temperature": tau} for _ in range(n)]
    targets = _families(shaping, n, final_gamma, final_rho)
    sources = [{"family": "identity"}] + targets[:-1]
    return [{"form": "cholesky_ratio", "target": t, "source": s} for t, s in zip(targets, sources, strict=True)]


def shaping_schedule(
    shaping: str, layers: int, *, final_gamma: float = DEFAULT_FINAL_GAMMA, final_rho: float = DEFAULT_FINAL_RHO
) -> list[dict]:
    """The schedule an answer reports, one entry per attention layer without its node id: E-SPA
    {"gamma": gamma_l, "diagonal": sqrt(1 - exp(-2 gamma_l))}, U-SPA {"rho": rho_l, "diagonal":
    sqrt(1 - rho_l)}; empty for Value-SkipInit and shaped attention (the identity at init)."""
    shaping = _shaping(shaping)
    n = _layer_count(layers)
    if shaping == "e-spa":
        return [
            {"gamma": float(g), "diagonal": math.sqrt(-math.expm1(-2.0 * g))} for g in espa_schedule(final_gamma, n)
        ]
    if shaping == "u-spa":
        return [{"rho": float(r), "diagonal": math.sqrt(1.0 - r)} for r in uspa_schedule(final_rho, n)]
    return []


def shaping_target(
    shaping: str, layers: int, *, final_gamma: float = DEFAULT_FINAL_GAMMA, final_rho: float = DEFAULT_FINAL_RHO
) -> dict:
    """The schedule's last kernel Sigma_L as a family dict (``attention_init.kernel_matrix`` reads
    it); the identity for Value-SkipInit and shaped attention."""
    shaping = _shaping(shaping)
    if shaping in ("e-spa", "u-spa"):
        return _families(shaping, layers, final_gamma, final_rho)[-1]
    _layer_count(layers)
    return {"family": "identity"}


def attention_matrices(generators: Sequence[Mapping], seq_len: int, causal: bool) -> list[np.ndarray]:
    """A_l at initialization for each generator (``attention_init.expand_attention``)."""
    return [expand_attention(dict(g), seq_len, causal).matrix() for g in generators]


# --------------------------------------------------------------------------- linear maps


def _square(k) -> np.ndarray:
    k = np.asarray(k, dtype=np.float64)
    if k.ndim != 2 or k.shape[0] != k.shape[1]:
        raise ValueError(f"a token kernel is a square T x T matrix, got shape {k.shape}")
    return k


def dense_token_kernel(k, weight_var: float = 1.0, bias_var: float = 0.0) -> np.ndarray:
    """weight_var * K + bias_var: a dense layer with weights of variance weight_var / fan_in and a
    bias of variance bias_var, the same bias vector added to every token (so it correlates them)."""
    return weight_var * _square(k) + bias_var


def attention_token_kernel(k, a) -> np.ndarray:
    """A K A^T: token mixing by the fixed attention matrix A at initialization
    (arXiv:2302.10322 section 3, "the kernel matrix after attention is A Sigma A^T")."""
    k, a = _square(k), _square(a)
    out = a @ k @ a.T
    return 0.5 * (out + out.T)  # exactly symmetric (the two products round differently)


def sum_token_kernel(kernels: Sequence, coefficients: Sequence[float]) -> np.ndarray:
    """sum_k coefficient_k K_k: a sum whose cross terms vanish, with the kernel coefficients w_k^2
    of ``sigprop.schemas.kernels.sum_coefficients`` (or ``atom_coefficients``)."""
    kernels, coefficients = list(kernels), list(coefficients)
    if not kernels or len(kernels) != len(coefficients):
        raise ValueError(f"{len(kernels)} kernels with {len(coefficients)} coefficients")
    out = float(coefficients[0]) * _square(kernels[0])
    for c, k in zip(coefficients[1:], kernels[1:], strict=True):
        out = out + float(c) * _square(k)
    return out


def layer_norm_token_kernel(k, mean=None) -> np.ndarray:
    """Layer normalization over features, per token, at infinite width (affine identity at init):
    token i's features lose their mean m_i and are divided by their standard deviation, so
    K'_ij = (K_ij - m_i m_j) / sqrt(v_i v_j), v_i = K_ii - m_i^2. ``mean``: the per-token feature
    means (0 after a dense or attention output, ``activation_token_mean`` after an activation)."""
    k = _square(k)
    m = np.zeros(k.shape[0]) if mean is None else np.asarray(mean, dtype=np.float64)
    centred = k - np.outer(m, m)
    var = np.diag(centred).copy()
    if np.any(var < -1e-12 * np.maximum(np.diag(k), 1.0)):
        raise ValueError("layer_norm: a token's feature mean squared exceeds its second moment")
    # a token whose features are constant (variance 0) comes out as 0, as (x - mean) / sqrt(var + eps) does
    live = var > 0.0
    root = np.where(live, np.sqrt(np.where(live, var, 1.0)), np.inf)
    out = centred / np.outer(root, root)
    np.fill_diagonal(out, np.where(live, 1.0, 0.0))
    return out


def rms_norm_token_kernel(k) -> np.ndarray:
    """RMS normalization over features, per token, at infinite width (scale 1 at init): token i's
    features are divided by their root mean square sqrt(K_ii), so K'_ij = K_ij / sqrt(K_ii K_jj),
    whatever the means (nothing is subtracted). A token whose features are all zero stays zero."""
    k = _square(k)
    d = np.diag(k).copy()
    live = d > 0.0
    root = np.where(live, np.sqrt(np.where(live, d, 1.0)), np.inf)
    out = k / np.outer(root, root)
    np.fill_diagonal(out, np.where(live, 1.0, 0.0))
    return out


def product_token_kernel(ku, kv) -> np.ndarray:
    """The elementwise product of two streams whose atoms are independent (two dense layers reading one
    stream: independent weights): E[u_i v_i u_j v_j] = E[u_i u_j] E[v_i v_j], the Hadamard product."""
    return _square(ku) * _square(kv)


def max_pair_token_kernel(k) -> tuple[np.ndarray, np.ndarray]:
    """(kernel, per-token mean) of max(a, b) over adjacent features of a zero-mean Gaussian stream with
    token kernel ``k`` (two units of a dense layer: independent entries): K'_ij = sqrt(K_ii K_jj)
    C(K_ij / sqrt(K_ii K_jj)) with C(c) = c/2 + (sqrt(1 - c^2) + c arcsin c)/pi, and mean sqrt(K_ii / pi)."""
    k = _square(k)
    d = np.sqrt(np.maximum(np.diag(k), 0.0))
    scale = np.outer(d, d)
    c = np.clip(np.divide(k, scale, out=np.zeros_like(k), where=scale > 0), -1.0, 1.0)
    return scale * (c / 2.0 + (np.sqrt(1.0 - c * c) + c * np.arcsin(c)) / np.pi), d / np.sqrt(np.pi)


# --------------------------------------------------------------------------- activations


def answer_activation(name: str, params: Mapping[str, float | None]) -> Activation:
    """phi_hat(x) = output_scale (phi(input_scale x + input_shift) + output_shift) from an answer's
    fields (``Solution`` or ``ActivationParams``): the catalogue's parameters of phi (negative_slope,
    alpha, tau, m) and the transformation; a transformation key that is missing or None is the
    identity's (1, 0, 1, 0). E.g. TAT's Leaky ReLU: ``{"negative_slope": a, "output_scale": g}``."""
    own = activation_info(name).defaults  # the answer's other fields (sigma_w2, q_1, ..) are not phi's
    act = get_activation(name, **{k: params[k] for k in own if params.get(k) is not None})
    given = {k: params.get(k) for k in _TRANSFORM_KEYS}
    if all(v is None for v in given.values()):
        return act
    return transformed(act, **{k: _TRANSFORM_IDENTITY[k] if v is None else float(v) for k, v in given.items()})
