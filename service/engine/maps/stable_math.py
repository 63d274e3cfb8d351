"""Elementwise building blocks of the activations that neither overflow nor lose relative
accuracy in the tails: shared by the closed forms (``activations``) and their fused jets
(``activation_jets``)."""

from __future__ import annotations

import math

import numpy as np

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)

# exp(-a) for a above this is below the smallest normal double: answer exactly 0 instead of
# computing a subnormal (which would raise under np.errstate(under="raise")).
EXP_CUTOFF = 700.0


def arr(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def exp_neg(a: np.ndarray) -> np.ndarray:
    """exp(-a) for a >= 0, exactly 0 where it would underflow."""
    return np.where(a > EXP_CUTOFF, 0.0, np.exp(-np.minimum(a, EXP_CUTOFF)))


def sig_pair(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sigmoid(x), sigmoid(-x)) without cancellation or overflow."""
    e = exp_neg(np.abs(x))  # in [0, 1]
    big = 1.0 / (1.0 + e)  # sigmoid(|x|)
    small = e * big  # sigmoid(-|x|), relative accuracy kept for large |x|
    pos = x >= 0
    return np.where(pos, big, small), np.where(pos, small, big)


def normal_pdf(x: np.ndarray) -> np.ndarray:
    return INV_SQRT_2PI * exp_neg(0.5 * x * x)
