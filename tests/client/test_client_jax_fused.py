"""A fused qkv ``nn.Dense`` in a Flax sequence model (issue 36): one Dense of ``3 * width`` units cut
with ``jnp.split`` into queries, keys and values is read as three dense nodes ``<id>.q/.k/.v`` feeding
the attention node, ``apply_to_params`` initializes the fused kernel's three column blocks by their
nodes' answers, and the output token kernel of the applied network is the answer's."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
import jax.numpy as jnp  # noqa: E402

from sigprop.client import jax as sjax  # noqa: E402
from sigprop.client.jax.attention import ShapedAttention  # noqa: E402
from sigprop.client.jax.fused import Columns  # noqa: E402
from sigprop.client.token_diagnosis import orthonormal_tokens  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402


class Block(nn.Module):
    width: int
    heads: int
    seq_len: int
    fused: bool = True
    act: object = nn.relu
    cut: str = "split"

    @nn.compact
    def __call__(self, x):
        side = 0.0  # a fused output also read whole (by a Dense "side"): refused
        if self.fused:
            qkv = nn.Dense(3 * self.width, name="qkv")(x)
            if self.cut == "split":
                q, k, v = jnp.split(qkv, 3, axis=-1)
            else:  # slices, and the fused output also read whole: refused
                w = self.width
                q, k, v = qkv[..., :w], qkv[..., w : 2 * w], qkv[..., 2 * w :]
                side = nn.Dense(self.width, name="side")(qkv) if self.cut == "whole" else side
        else:
            q, k, v = (nn.Dense(self.width, name=n)(x) for n in ("q", "k", "v"))
        y = nn.Dense(self.width, name="proj")(ShapedAttention(self.heads, self.seq_len, True, name="attn")(q, k, v))
        return nn.Dense(self.width, name="fc2")(self.act(nn.Dense(2 * self.width, name="fc1")(y))) + side


class GPT(nn.Module):
    depth: int = 2
    width: int = 16
    heads: int = 2
    seq_len: int = 8
    fused: bool = True
    act: object = nn.relu
    cut: str = "split"

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = Block(self.width, self.heads, self.seq_len, self.fused, self.act, self.cut, name=f"b{i}")(x)
        return x


def _solve(graph):
    import sigprop

    return sigprop.solve(graph, "tat", "leaky_relu", {"eta": 0.3}, attention={"shaping": "e-spa", "final_gamma": 0.3})


def test_a_fused_qkv_dense_is_three_dense_nodes_feeding_attention():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 16))
    graph, mapping = sjax.graph_from_flax(GPT(), x)
    plain, _ = sjax.graph_from_flax(GPT(fused=False), x)
    ops = [(nd["id"], nd["op"], nd.get("inputs"), nd.get("units")) for nd in graph["nodes"]]
    assert ops[:5] == [
        ("x", "input", None, None),
        ("b0/qkv.q", "dense", ["x"], 16),
        ("b0/qkv.k", "dense", ["x"], 16),
        ("b0/qkv.v", "dense", ["x"], 16),
        ("b0/attn", "attention", ["b0/qkv.q", "b0/qkv.k", "b0/qkv.v"], None),
    ]
    assert "b0/qkv" not in {nd["id"] for nd in graph["nodes"]} and "b0/qkv" not in mapping

    def strip(g):  # the same graph as three Dense layers, ids aside
        return [{k: v for k, v in nd.items() if k not in ("id", "inputs")} for nd in g["nodes"]]

    assert strip(graph) == strip(plain)
    assert mapping["b0/qkv.k"] == Columns(("b0", "qkv"), 16, 32)


def test_a_fused_dense_also_read_whole_is_refused_by_name():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 16))
    with pytest.raises(SigpropError, match=r"'b0/qkv' is cut into blocks .* also read whole") as err:
        sjax.graph_from_flax(GPT(depth=1, cut="whole"), x)
    assert err.value.code == "unsupported_op"
    graph, _ = sjax.graph_from_flax(GPT(depth=1, cut="slice"), x)  # slices alone are blocks too
    assert [nd["id"] for nd in graph["nodes"]][1:4] == ["b0/qkv.q", "b0/qkv.k", "b0/qkv.v"]


def test_apply_initializes_the_fused_kernels_blocks_and_diagnose_agrees():
    t, width, networks = 8, 64, 4
    x = jnp.asarray(orthonormal_tokens(8, t, width), jnp.float32)
    graph, mapping = sjax.graph_from_flax(GPT(width=width, seq_len=t), x)
    sol = _solve(graph)
    model = GPT(width=width, seq_len=t, act=sjax.transformed_activation(sol))
    variables = model.init(jax.random.PRNGKey(0), x)
    applied, report = sjax.apply_to_params(variables, sol, mapping, jax.random.PRNGKey(1))
    assert report.ok, str(report)
    assert not report.uncovered_kernels and not report.warnings, str(report)
    kernel = np.asarray(applied["params"]["b0"]["qkv"]["kernel"])
    assert not np.any(kernel[:, :width])  # E-SPA's zero queries
    for block in (kernel[:, width : 2 * width], kernel[:, 2 * width :]):  # keys and values: scaled orthogonal
        gram = block.T @ block
        np.testing.assert_allclose(gram / gram[0, 0], np.eye(width), atol=1e-4)
    # the same blocks as the answer gives the three Dense layers of the unfused twin, key for key
    plain_graph, plain_map = sjax.graph_from_flax(GPT(width=width, seq_len=t, fused=False), x)
    twin = GPT(width=width, seq_len=t, fused=False, act=sjax.transformed_activation(sol))
    plain_sol = _solve(plain_graph)
    plain, _ = sjax.apply_to_params(twin.init(jax.random.PRNGKey(0), x), plain_sol, plain_map, jax.random.PRNGKey(1))
    np.testing.assert_allclose(kernel[:, 2 * width :], plain["params"]["b0"]["v"]["kernel"], atol=1e-6)

    one = sjax.diagnose(model.bind(applied), sol, x)
    assert one.noise_source == "stated" and one.ok, str(one)
    keys = [jax.random.PRNGKey(100 + s) for s in range(networks)]
    nets = [model.bind(sjax.apply_to_params(variables, sol, mapping, k)[0]) for k in keys]
    diag = sjax.diagnose(nets, sol, x)
    assert diag.ok, str(diag)  # within Student's t at 3 sigma for 4 networks + 0.02, entry by entry
    # the unfused twin applied with the same keys computes the same network: the same measured kernel
    twin_vars = twin.init(jax.random.PRNGKey(0), x)
    twins = [twin.bind(sjax.apply_to_params(twin_vars, plain_sol, plain_map, k)[0]) for k in keys]
    np.testing.assert_allclose(sjax.diagnose(twins, plain_sol, x).measured, diag.measured, atol=1e-5)
    ratio = float(np.max(np.abs(diag.error) / diag.noise))
    print(
        f"fused qkv Flax GPT (width {width}, T {t}, e-spa): one network max |error| {one.max_error:.3f}; "
        f"{networks} networks max |error| {diag.max_error:.3f}, max |error| / SE {ratio:.2f}"
    )
