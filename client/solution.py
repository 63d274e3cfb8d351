"""The answer as both adapters take it: a ``Solution``, its JSON text or a parsed dict."""

from __future__ import annotations

from collections.abc import Mapping

from ..schemas.solve import Solution


def as_solution(solution) -> Solution:
    """``solution`` as a ``Solution``: what ``Client.solve`` returns, the answer's JSON (str or
    bytes, e.g. from ``sigprop solve``) or that JSON parsed into a dict."""
    if isinstance(solution, Solution):
        return solution
    if isinstance(solution, (str, bytes)):
        return Solution.model_validate_json(solution)
    if isinstance(solution, Mapping):
        return Solution.model_validate(dict(solution))
    raise TypeError(f"expected a sigprop Solution (or its JSON / dict), got {type(solution).__name__}")


def tailoring(sol: Solution) -> tuple[float, float, float, float]:
    """``(input_scale, input_shift, output_scale, output_shift)`` of the answer's transformed
    activation; the ones it omits are the identity's (1, 0, 1, 0), so an Edge-of-Chaos or geometric
    answer's activation is plain phi."""

    def one(value, default: float) -> float:
        return default if value is None else float(value)

    return (
        one(sol.input_scale, 1.0),
        one(sol.input_shift, 0.0),
        one(sol.output_scale, 1.0),
        one(sol.output_shift, 0.0),
    )


def tailored(phi, x, input_scale: float, input_shift: float, output_scale: float, output_shift: float):
    """``phi_hat(x) = output_scale * (phi(input_scale * x + input_shift) + output_shift)``: the
    transformed activation of TAT and DKS ("Deep Learning without Shortcuts: Shaping the Kernel with
    Tailored Rectifiers", arXiv:2203.08120, section 4.2), for any array type with ``*`` and ``+``
    (torch, JAX, Keras tensors). Steps that are the identity are skipped, so an untransformed
    activation traces to the same ops as phi alone."""
    if input_scale != 1.0:
        x = input_scale * x
    if input_shift != 0.0:
        x = x + input_shift
    y = phi(x)
    if output_shift != 0.0:
        y = y + output_shift
    if output_scale != 1.0:
        y = output_scale * y
    return y
