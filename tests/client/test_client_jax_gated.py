"""``rms_norm`` and ``mul`` in the Flax adapter (issue 34): ``nn.RMSNorm`` regions of the jaxpr are
``rms_norm`` nodes (on ``[B, F]`` too) and ``u * v`` of two network values a ``mul`` node;
``apply_to_params`` sets the RMSNorm scale to 1; ``diagnose`` of a gated MLP (eoc, tanh, width 256)
passes, and with a plain ReLU as the gate's function it is flagged."""

from __future__ import annotations

from collections.abc import Callable

import pytest

jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
import jax.numpy as jnp  # noqa: E402

from sigprop.client import jax as sjax  # noqa: E402

from ..solving import solve_graph  # noqa: E402


class Gated(nn.Module):
    """dense -> act -> dense -> RMSNorm -> down(gate_fn(gate(h)) * up(h)) -> dense -> act -> dense."""

    width: int = 256
    act: Callable = jnp.tanh
    gate: Callable = nn.silu

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.width)(self.act(nn.Dense(self.width)(x)))
        h = nn.RMSNorm()(h)
        h = nn.Dense(self.width)(self.gate(nn.Dense(self.width)(h)) * nn.Dense(self.width)(h))
        return nn.Dense(self.width)(self.act(nn.Dense(self.width)(h)))


def test_a_flax_gated_mlp_with_rms_norm_is_read_applied_and_diagnosed():
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 64))
    model = Gated()
    variables = model.init(jax.random.PRNGKey(0), x)
    variables = jax.tree_util.tree_map_with_path(
        lambda p, v: v * 2.0 if "RMSNorm_0" in jax.tree_util.keystr(p) else v, variables
    )  # a trained scale: apply_to_params resets it
    graph, mapping = sjax.graph_from_flax(model, x, variables)
    nodes = {nd["id"]: nd for nd in graph["nodes"]}
    assert nodes["rmsnorm_0"]["op"] == "rms_norm" and mapping["rmsnorm_0"] == ("RMSNorm_0",)
    assert nodes["mul"] == {"id": "mul", "op": "mul", "inputs": ["swish_act", "dense_4"]}
    sol = solve_graph(graph, "eoc", "tanh", {})
    assert sol.assumptions.holds and all("an rms_norm or a mul reads" in w for w in sol.warnings), sol.warnings
    params, report = sjax.apply_to_params(variables, sol, mapping, jax.random.PRNGKey(2))
    assert float(jnp.max(jnp.abs(params["params"]["RMSNorm_0"]["scale"] - 1.0))) == 0.0, str(report)
    t = sjax.transformed_activation(sol)
    diag = sjax.diagnose(Gated(act=t, gate=t).bind(params), sol, x, input_c=0.5)
    assert diag.ok and diag.verdict().startswith("verdict: PASS"), str(diag)
    rows = {r.id: r for r in diag.layers}
    assert rows["rmsnorm_0"].q_noise == 0.0 and rows["mul"].c_noise > 0
    bad = sjax.diagnose(Gated(act=t, gate=nn.relu).bind(params), sol, x, input_c=0.5)
    assert not bad.ok and bad.verdict().startswith("verdict: FAIL"), str(bad)
