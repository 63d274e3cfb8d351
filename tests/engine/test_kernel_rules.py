"""``sigprop.schemas.kernels``: the one table of how sums and concatenations combine kernels, which
the engine's C maps, the geometric solver and the client's predictions all read."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from sigprop.client.diagnosis import predict
from sigprop.engine.solve import solve
from sigprop.schemas.kernels import atom_coefficients, concat_coefficients, sum_coefficients
from sigprop.schemas.solve import SolveRequest


def test_the_coefficients():
    assert sum_coefficients([0.6, 0.8]) == pytest.approx((0.36, 0.64), abs=1e-15)
    assert sum(sum_coefficients([1 / math.sqrt(3)] * 3)) == pytest.approx(1.0, abs=1e-15)
    assert concat_coefficients([16, 48]) == (0.25, 0.75)
    # an atom reached through two paths with weight 1/sqrt(2) each: its coefficients add first
    assert atom_coefficients([2 / math.sqrt(2), 0.5]) == pytest.approx((2.0, 0.25))
    assert atom_coefficients([2 / math.sqrt(2), 0.5], normalized=True) == pytest.approx((2 / 2.25, 0.25 / 2.25))
    assert atom_coefficients([0.0, 0.0], normalized=True) == (0.0, 0.0)


def test_the_table_stays_in_the_light_part_of_the_package():
    code = "import sys, sigprop.schemas.kernels; sys.exit('numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_engine_and_client_compose_unequal_concats_and_sums_alike():
    """A concatenation of widths 8 and 24 followed by a sum: the client's prediction at the output,
    composed with the table from the answer's local map, is the engine's global C map (at a sampled
    c, so only the interpolation of the inner activations' maps separates them)."""
    d = lambda i, x, u: {"id": i, "op": "dense", "inputs": [x], "units": u}  # noqa: E731
    a = lambda i, x: {"id": i, "op": "activation", "inputs": [x]}  # noqa: E731
    # the branches differ (an activation on one only), so the concatenation's weights matter
    nodes = [{"id": "x", "op": "input", "shape": [16]}, d("p", "x", 8), d("q", "x", 24), a("ap", "p")]
    nodes += [d("p2", "ap", 8), d("q2", "q", 24), {"id": "cat", "op": "concat", "inputs": ["p2", "q2"]}]
    nodes += [a("ac", "cat"), d("r", "ac", 32), d("s0", "x", 32)]
    nodes += [{"id": "s", "op": "sum", "inputs": ["r", "s0"], "weights": [0.8, 0.6]}, a("as", "s"), d("y", "as", 4)]
    nodes += [{"id": "out", "op": "output", "inputs": ["y"]}]
    graph = {"schema": "sigprop.graph/v1", "nodes": nodes}
    sol = solve(SolveRequest(graph=graph, method="dks", activation="softplus", targets={"zeta": 1.5}))
    i = len(sol.c_map.c) // 3
    c0 = sol.c_map.c[i]
    pred = predict(graph, sol, c0, same_locations=True)
    assert pred["cat"].q == pytest.approx(1.0, rel=1e-9)
    # at "cat": 1/4 of the coordinates went through the activation's C map, 3/4 saw c0 alone
    local = sol.c_map.local[i]
    assert pred["cat"].c == pytest.approx(0.25 * local + 0.75 * c0, abs=1e-12)
    assert pred["out"].c == pytest.approx(sol.c_map.global_[i], abs=5e-4)  # measured 9e-5
