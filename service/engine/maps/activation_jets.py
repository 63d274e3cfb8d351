"""(phi, phi', phi'') of a catalogue activation in one pass, sharing the work the three closed
forms of ``activations`` each redo (one exponential and one sigmoid pair instead of three).

A root search evaluates all three on the same quadrature nodes at every new (alpha, beta)
(``qc_maps._node_values``), and with a few hundred nodes the cost is numpy's per-call overhead,
so sharing intermediates is what makes an evaluation cheaper. Each jet is the same formula as the
closed forms with the shared parts computed once; the tests compare every jet with ``fn``, ``d1``
and ``d2`` over |x| <= 1e3. Only parameterless activations have one (``Activation.jet``); the rest take three calls.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy.special import erf as _erf
from scipy.special import expit as _expit
from scipy.special import log_expit as _log_expit
from scipy.special import ndtr as _ndtr

from ...schemas.activations import GELU_TANH_K
from .stable_math import SQRT_2_OVER_PI, TWO_OVER_SQRT_PI, exp_neg, normal_pdf, sig_pair

Jet = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _sig_parts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """sigmoid(x), sigmoid(-x) and their product sigmoid'(x): scipy's expit, one call each, keeps
    the relative accuracy of the small one in either tail (the where-based pair of ``stable_math``
    takes a dozen numpy calls, most of a jet's time on a few hundred nodes)."""
    s, t = _expit(x), _expit(-x)
    return s, t, s * t


def softplus_jet(x):
    s, _, st = _sig_parts(x)
    return -_log_expit(-x), s, st  # softplus(x) = -log sigmoid(-x), stable in both tails


def swish_jet(x):
    s, t, st = _sig_parts(x)
    # phi'' = s (1 - s) (2 + x (1 - 2 s)), with 1 - 2 s = t - s = -tanh(x / 2)
    return x * s, s * (1.0 + x * t), st * (2.0 - x * (s - t))


def sigmoid_jet(x):
    s, t, st = _sig_parts(x)
    return s, st, st * (t - s)


def tanh_jet(x):
    th = np.tanh(x)
    e = exp_neg(2.0 * np.abs(x))
    sech2 = 4.0 * e / ((1.0 + e) * (1.0 + e))  # relatively accurate in the tails, unlike 1 - th^2
    return th, sech2, -2.0 * th * sech2


def gelu_jet(x):
    p = _ndtr(x)
    pdf = normal_pdf(x)
    return x * p, p + x * pdf, pdf * (2.0 - x * x)


def gelu_tanh_jet(x):
    c, k = SQRT_2_OVER_PI, GELU_TANH_K
    x2 = x * x
    two_u = 2.0 * c * x * (1.0 + k * x2)
    du, ddu = c * (1.0 + 3.0 * k * x2), 6.0 * c * k * x
    s, t = sig_pair(two_u)
    st = s * t
    # (s t)' = 2 u' s t (1 - 2 s), with 1 - 2 s = -tanh(u)
    return x * s, s + 2.0 * x * st * du, 2.0 * st * (2.0 * du + x * (2.0 * -np.tanh(0.5 * two_u) * du * du + ddu))


def erf_jet(x):
    g = TWO_OVER_SQRT_PI * exp_neg(x * x)
    return _erf(x), g, -2.0 * x * g


JETS: dict[str, Jet] = {
    "softplus": softplus_jet,
    "swish": swish_jet,
    "sigmoid": sigmoid_jet,
    "tanh": tanh_jet,
    "gelu": gelu_jet,
    "gelu_tanh": gelu_tanh_jet,
    "erf": erf_jet,
}

# Half-width of the strip around the real axis in which phi is analytic: the distance of its
# nearest complex singularity (sigmoid, softplus, swish: poles at i pi; tanh: at i pi / 2).
# gelu and erf are entire but grow like exp(y^2 / 2) off the axis, which slows convergence the
# same way, so they take tanh's pi / 2; gelu_tanh's poles, where sqrt(2/pi) (x + k x^3) = i pi / 2
# has no purely imaginary root, are taken at a conservative 1. The tests check each against a
# much finer rule. For phi(alpha z + beta) the strip is this over
# |alpha| wide, which is what decides how wide quadrature panels may be (``qc_maps.moment_rule``).
ANALYTIC_STRIP: dict[Jet, float] = {
    softplus_jet: np.pi,
    swish_jet: np.pi,
    sigmoid_jet: np.pi,
    tanh_jet: np.pi / 2,
    gelu_jet: np.pi / 2,
    gelu_tanh_jet: 1.0,
    erf_jet: np.pi / 2,
}
