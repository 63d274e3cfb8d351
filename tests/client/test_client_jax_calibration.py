"""``sigprop.client.jax.apply_to_params(..., module=m, example_input=x)`` calibrates a Flax model's
max pooling as the torch adapter does (``sigprop.client.calibration``): the measured effect of a
2 x 2 max pool is E[M^2] = 1.5597 for M the maximum of 4 standard normals (the closed form of
tests/client/test_client_calibration.py), the factor goes into the params (the conv feeding the pool, the
conv reading the activation after it, the dense layer reading the global mean), and on a fresh
batch the next layer gets the answer's q. JAX code cannot be rewritten: a factor no layer can take
is reported, not applied."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
import jax.numpy as jnp  # noqa: E402

from sigprop.client import jax as sjax  # noqa: E402
from sigprop.engine.solve import solve  # noqa: E402
from sigprop.schemas.solve import SolveRequest  # noqa: E402

from .test_client_calibration import max_of_n_mean_square  # noqa: E402


class PoolCNN(nn.Module):
    c: int = 32
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x):
        x = nn.max_pool(nn.Conv(self.c, (3, 3))(x), (2, 2), strides=(2, 2))
        x = nn.Conv(self.c, (3, 3))(self.act(x))
        return nn.Dense(10)(jnp.mean(self.act(x), axis=(1, 2)))


class PooledShortcut(nn.Module):
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x):
        p = nn.max_pool(x, (2, 2), strides=(2, 2))
        h = nn.Conv(x.shape[-1], (3, 3))(self.act(nn.Conv(x.shape[-1], (3, 3))(p)))
        return nn.Dense(10)(jnp.mean((p + h) / jnp.sqrt(2.0), axis=(1, 2)))


def _graph(model, x):
    variables = model.init(jax.random.PRNGKey(0), x)
    graph, mapping = sjax.graph_from_flax(model, x, variables)
    sol = solve(SolveRequest(graph=graph, method="tat", activation="leaky_relu", targets={"eta": 0.2}))
    assert any("max_pool is not covered" in w for w in sol.warnings)
    return variables, graph, mapping, sol


def _q(model, params, x) -> dict[str, float]:
    """Mean square of every graph node's value on ``x``."""
    from sigprop.client.jax.extraction import extract_flax

    ext = extract_flax(model, params, x, allow_unsupported=True)
    return {k: float(np.mean(np.square(np.asarray(v, np.float64)))) for k, v in ext.values.items()}


def test_flax_max_pool_is_measured_and_the_next_layer_gets_the_answers_q():
    # one batch shape throughout (diagnose's pairs of 16 included): each new shape compiles anew
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 8, 8, 16))
    variables, graph, mapping, sol = _graph(PoolCNN(), x)
    solved = PoolCNN(act=sjax.transformed_activation(sol))
    key = jax.random.PRNGKey(2)
    params, report = sjax.apply_to_params(variables, sol, mapping, key, module=solved, example_input=x)
    cals = {c.id: c for c in report.calibrations}
    assert list(cals) == ["max_pool", "leaky_relu_act", "global_avg_pool"], str(report)
    assert cals["max_pool"].effect == pytest.approx(max_of_n_mean_square(4), abs=0.03)
    assert (cals["max_pool"].where, cals["max_pool"].layers) == ("feeds", ["conv_0"])
    assert cals["leaky_relu_act"].layers == ["conv_1"] and cals["global_avg_pool"].layers == ["dense_0"]
    assert "calibrated max_pool (max pooling)" in str(report)

    plain, _ = sjax.apply_to_params(variables, sol, mapping, key)  # the same draw, not calibrated
    k_cal, k_plain = (np.asarray(p["params"]["Conv_0"]["kernel"]) for p in (params, plain))
    assert np.allclose(k_cal, cals["max_pool"].factor * k_plain, rtol=1e-5, atol=1e-7)

    fresh = jax.random.normal(jax.random.PRNGKey(7), (32, 8, 8, 16))
    assert _q(solved, plain, fresh)["max_pool"] == pytest.approx(max_of_n_mean_square(4), abs=0.06)
    q = _q(solved, params, fresh)
    assert q["max_pool"] == pytest.approx(1.0, abs=0.06) and q["conv_1"] == pytest.approx(1.0, abs=0.12)

    diag = sjax.diagnose(solved.bind(params), sol, fresh[:16], calibrations=report.calibrations)
    assert "calibrated: measured q x1.5" in {r.id: r for r in diag.layers}["max_pool"].note


@pytest.mark.slow  # another model: its ops compile anew (10-20 s here); the torch twin is in the default suite
def test_flax_factor_no_layer_can_take_is_reported_not_applied():
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8, 8, 8))
    variables, graph, mapping, sol = _graph(PooledShortcut(), x)
    solved = PooledShortcut(act=sjax.transformed_activation(sol))
    params, report = sjax.apply_to_params(
        variables, sol, mapping, jax.random.PRNGKey(2), module=solved, example_input=x
    )
    pool = next(c for c in report.calibrations if c.id == "max_pool")
    assert pool.where == "none" and pool.factor == pytest.approx(max_of_n_mean_square(4) ** -0.5, rel=0.05)
    assert any(w.startswith("not calibrated: max_pool") and "by hand" in w for w in report.warnings)
