"""How a sum and a concatenation combine their inputs' kernels: the one table the engine's C maps,
the geometric solver's second moments and the client's predictions read.

Both ops are linear, so every second-moment quantity of their output (the mean square q, the
covariance q c of two inputs' features, a gradient's second moment) is a fixed combination of the
inputs' with non-negative coefficients:

- a sum ``sum_i w_i x_i`` of inputs whose cross terms vanish (each ends in an independent
  zero-mean weight matrix) has coefficients ``w_i^2``: the normalized-sum rule of "Deep Learning
  without Shortcuts: Shaping the Kernel with Tailored Rectifiers" (arXiv:2203.08120), section 2.3
  and Appendix B.4, and the ``sum_i w_i^2`` of "Scaling laws for the principled design,
  initialization, and preconditioning of ReLU networks" (GR paper), Appendix B, in both passes;
- a sum that one atom reaches through several paths is mixed over atoms, not inputs: the atom's
  coefficients add *before* squaring (``schemas.atoms``), so its coefficients are ``c_a^2``;
- a concatenation of inputs of widths ``n_i`` (units or channels) averages its coordinates, so its
  coefficients are ``n_i / sum_j n_j`` (TAT paper Appendix B.4: "the width-weighted average").

Each function returns the coefficients in the order of its arguments. Plain floats: no numpy, so
the client's diagnosis reads the same rules as the service.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["sum_coefficients", "atom_coefficients", "concat_coefficients"]


def sum_coefficients(weights: Iterable[float]) -> tuple[float, ...]:
    """``w_i^2`` of a sum with weights ``w_i`` of inputs with no cross terms."""
    return tuple(w * w for w in weights)


def atom_coefficients(coefficients: Iterable[float], *, normalized: bool = False) -> tuple[float, ...]:
    """``c_a^2`` of a sum written as ``sum_a c_a a`` over independent atoms; ``normalized``: divided
    by their total (a C map mixes kernels of inputs at q = 1: the result is a C value again)."""
    squares = tuple(c * c for c in coefficients)
    if not normalized:
        return squares
    total = sum(squares) or 1.0
    return tuple(s / total for s in squares)


def concat_coefficients(widths: Iterable[float]) -> tuple[float, ...]:
    """``n_i / sum_j n_j`` of a concatenation of inputs of widths ``n_i``: per-coordinate averages."""
    widths = tuple(widths)
    total = float(sum(widths))
    return tuple(n / total for n in widths)
