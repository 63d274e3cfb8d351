"""DKS with ReLU near the centred ReLU's C'(1) = 1 / (1 - 1/pi) = 1.4669422.

There the root's input scale runs to infinity (shift +1 below the value, -1 above it), far outside
the box dks searches (|alpha| <= 1e3), so dks's search refused targets 1.4667 to 1.4672 at depth 1.
Every per-layer target solves; the conditions are checked here by scipy.integrate.quad, not by the
engine's rule.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate as sp_int

from sigprop.engine.solve import solve
from sigprop.errors import SigpropError
from sigprop.requests import parse_solve_request

CENTRED = 1.0 / (1.0 - 1.0 / math.pi)


def dks_relu(zeta: float, depth: int = 1):
    body = {"graph": {"template": "mlp", "depth": depth}, "method": "dks", "activation": "relu"}
    return solve(parse_solve_request({**body, "targets": {"zeta": zeta}}))


def gauss(f, kink: float) -> float:
    """E[f(z)], z ~ N(0, 1), by adaptive quadrature split at the kink."""
    g = lambda z: f(z) * math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)  # noqa: E731
    pts = sorted({-12.0, kink, 12.0}) if -12.0 < kink < 12.0 else [-12.0, 12.0]
    pieces = zip(pts, pts[1:], strict=False)
    return sum(sp_int.quad(g, a, b, epsabs=1e-14, epsrel=1e-13, limit=200)[0] for a, b in pieces)


def conditions(ans) -> tuple[float, float, float]:
    """(Q(1), C(0), C'(1)) of output_scale * (relu(input_scale z + input_shift) + output_shift)."""
    a, b, g, d = ans.input_scale, ans.input_shift, ans.output_scale, ans.output_shift
    kink = -b / a
    f = lambda z: g * (max(a * z + b, 0.0) + d)  # noqa: E731
    df = lambda z: g * a * (a * z + b > 0.0)  # noqa: E731
    q = gauss(lambda z: f(z) ** 2, kink)
    return q, gauss(f, kink) ** 2 / q, gauss(lambda z: df(z) ** 2, kink) / q


@pytest.mark.parametrize("target", [1.4665, 1.4669, 1.46694, 1.4670, 1.4675])
def test_targets_at_the_centred_relu_solve(target):
    ans = dks_relu(target)
    assert ans.local_c_slope_1 == pytest.approx(target, abs=1e-13)
    assert ans.input_shift == (1.0 if target < CENTRED else -1.0)
    q, c0, slope = conditions(ans)
    assert q == pytest.approx(1.0, abs=1e-9)
    assert abs(c0) < 1e-9
    assert slope == pytest.approx(target, abs=1e-9)


def test_the_whole_window_solves_and_the_scale_grows_towards_the_centre():
    targets = np.round(np.arange(1.4660, 1.46801, 1e-4), 6)
    scales = [dks_relu(float(t)).input_scale for t in targets]
    below = [s for t, s in zip(targets, scales, strict=True) if t < CENTRED]
    above = [s for t, s in zip(targets, scales, strict=True) if t > CENTRED]
    assert below == sorted(below) and above == sorted(above, reverse=True)


def test_exactly_the_centred_value_is_the_centred_relu():
    ans = dks_relu(CENTRED)
    assert (ans.input_scale, ans.input_shift) == (1.0, 0.0)
    q, c0, slope = conditions(ans)
    assert slope == pytest.approx(CENTRED, abs=1e-9) and abs(c0) < 1e-9


def test_deeper_network_in_the_window():
    """Per-layer 1.4669 on a 10-layer MLP: zeta = 1.4669^10."""
    ans = dks_relu(1.4669**10, depth=10)
    assert ans.local_c_slope_1 == pytest.approx(1.4669, abs=1e-12)
    assert conditions(ans)[2] == pytest.approx(1.4669, abs=1e-9)


def test_beyond_double_precision_the_answer_gives_the_supremum():
    with pytest.raises(SigpropError) as err:
        dks_relu(1e4)
    assert err.value.code == "unreachable_target"
    assert "runs from 1" in err.value.message and "smaller zeta" in err.value.hint
