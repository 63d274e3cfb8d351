"""``apply_to_params`` refuses to change nothing: a mapping that matches no kernel raises
``NothingApplied`` naming what matched nothing, rather than returning the old tree with a report
whose ``ok`` nobody reads. The answers come from the engine in-process (no server needed)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from sigprop.client import jax as sjax  # noqa: E402
from sigprop.engine.solve import solve  # noqa: E402
from sigprop.schemas.solve import SolveRequest  # noqa: E402


def _mlp_answer(depth: int = 3, width: int = 16):
    nodes = [{"id": "x", "op": "input", "shape": [width]}]
    prev = "x"
    for i in range(depth):
        nodes += [
            {"id": f"dense_{i}", "op": "dense", "inputs": [prev], "units": width},
            {"id": f"act_{i}", "op": "activation", "inputs": [f"dense_{i}"]},
        ]
        prev = f"act_{i}"
    nodes.append({"id": "out", "op": "output", "inputs": [prev]})
    graph = {"schema": "sigprop.graph/v1", "nodes": nodes}
    return solve(SolveRequest(graph=graph, method="tat", activation="leaky_relu", targets={"eta": 0.5}))


def _params(depth: int = 3, width: int = 16) -> dict:
    return {f"Dense_{i}": {"kernel": jnp.zeros((width, width)), "bias": jnp.zeros((width,))} for i in range(depth)}


def test_a_mapping_that_matches_nothing_raises_naming_it():
    sol = _mlp_answer()
    with pytest.raises(sjax.NothingApplied) as err:
        # ids as the graph has them, paths that are not in the tree
        sjax.apply_to_params(_params(), sol, {f"dense_{i}": f"Dense{i}" for i in range(3)}, jax.random.PRNGKey(0))
    msg = str(err.value)
    assert "changed nothing" in msg and "dense_0 -> Dense0" in msg, msg
    assert not err.value.report.changed and len(err.value.report.not_found) == 3

    with pytest.raises(sjax.NothingApplied, match=r"not layers of the answer: 'Dense_0'"):
        # the common slip: mapping None (ids = paths) where the tree's names differ from the graph's
        sjax.apply_to_params(_params(), sol, {"Dense_0": "Dense_0"}, jax.random.PRNGKey(0))
    with pytest.raises(sjax.NothingApplied, match="the mapping is empty"):
        sjax.apply_to_params(_params(), sol, {}, jax.random.PRNGKey(0))
    with pytest.raises(sjax.NothingApplied, match="shape disagrees"):
        sjax.apply_to_params(_params(width=8), sol, {"dense_1": "Dense_1"}, jax.random.PRNGKey(0))
    assert issubclass(sjax.NothingApplied, ValueError)


def test_a_partial_match_still_returns_its_report():
    sol = _mlp_answer()
    new, report = sjax.apply_to_params(_params(), sol, {"dense_0": "Dense_0"}, jax.random.PRNGKey(0))
    assert not report.ok and report.unmapped_layers == ["dense_1", "dense_2"]
    assert [c.path for c in report.changed] == [("Dense_0", "kernel"), ("Dense_0", "bias")]
    assert float(jnp.abs(new["Dense_0"]["kernel"]).sum()) > 0
