"""``sigprop.client.jax.graph_from_flax`` and ``diagnose`` on real ``flax.linen`` models: the graph and
the id -> params-path mapping come from the jaxpr of ``module.apply``, ``apply_to_params`` takes the
mapping as it is, and the applied Flax network measures what the answer predicts (engine in-process).

Tolerances as in tests/client/test_client_torch_diagnose.py: hidden-layer q within 0.12 and c within 0.06
of the prediction, for one network of width 512 (MLP) and for the mean over 6 networks of 64
channels x 64 locations (ResNet: one such network's c wanders by 0.05-0.1 over 9 layers)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest

jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sigprop.client import jax as sjax  # noqa: E402
from sigprop.engine.solve import solve  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402
from sigprop.schemas.solve import SolveRequest  # noqa: E402

from ..solving import solve_graph  # noqa: E402


class MLP(nn.Module):
    depth: int = 10
    width: int = 512
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = self.act(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


class PreActBlock(nn.Module):
    c: int
    act: Callable
    normalized: bool = True

    @nn.compact
    def __call__(self, x):
        h = nn.Conv(self.c, (3, 3))(self.act(x))
        h = nn.Conv(self.c, (3, 3))(self.act(h))
        return (x + h) / jnp.sqrt(2.0) if self.normalized else x + h


class ResNet(nn.Module):
    c: int = 64
    blocks: int = 4
    act: Callable = nn.relu
    normalized: bool = True

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.c, (3, 3))(x)
        for _ in range(self.blocks):
            x = PreActBlock(self.c, self.act, self.normalized)(x)
        x = jnp.mean(self.act(x), axis=(1, 2))
        return nn.Dense(10)(x)


class DenseNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(64)(x)
        for _ in range(3):
            h = jnp.concatenate([h, nn.Dense(32)(nn.gelu(h))], axis=-1)
        return nn.Dense(10)(nn.gelu(h))


NETWORKS = 6


_solve = partial(solve_graph, eta=0.6)


def _ops(graph: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for nd in graph["nodes"]:
        out[nd["op"]] = out.get(nd["op"], 0) + 1
    return out


def test_flax_mlp_graph_mapping_apply_and_diagnose():
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 256))
    model = MLP()
    variables = model.init(jax.random.PRNGKey(0), x)
    graph, mapping = sjax.graph_from_flax(model, x, variables)
    assert _ops(graph) == {"input": 1, "dense": 11, "activation": 10, "output": 1}
    assert graph["nodes"][0] == {"id": "x", "op": "input", "shape": [256]}
    assert graph["nodes"][1] == {"id": "dense_0", "op": "dense", "inputs": ["x"], "units": 512, "bias": True}
    assert mapping == {f"dense_{i}": (f"Dense_{i}",) for i in range(11)}

    sol = _solve(graph)
    params, report = sjax.apply_to_params(variables, sol, mapping, jax.random.PRNGKey(2))  # no hand mapping
    assert report.ok and len(report.changed) == 22, str(report)

    solved = MLP(act=sjax.transformed_activation(sol))  # the same params tree, the answer's activation
    graph2, mapping2 = sjax.graph_from_flax(solved, x, params)
    assert mapping2 == mapping and _ops(graph2) == _ops(graph)
    diag = sjax.diagnose(solved.bind(params), sol, x, input_c=0.5)
    print("\n" + str(diag))
    hidden = [r for r in diag.layers if r.id not in ("dense_10", "output")]
    assert max(abs(r.q_error) for r in hidden) < 0.12
    assert max(abs(r.c_error) for r in hidden) < 0.06
    assert {r.id: r for r in diag.layers}["output"].c_predicted == pytest.approx(diag.c_global, abs=1e-3)
    # the unapplied model (Flax's default init, plain ReLU) is caught
    assert sjax.diagnose((model, variables), sol, x).max_q_error(("activation",)) > 0.3


# -m slow: 40 s loaded, mostly XLA compiles; sums are also checked by the concatenation and unnormalized-add tests
@pytest.mark.slow
def test_flax_preactivation_resnet_sums_and_nested_paths():
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 8, 8, 8))
    model = ResNet()
    variables = model.init(jax.random.PRNGKey(0), x)
    graph, mapping = sjax.graph_from_flax(model, x, variables)
    ops = _ops(graph)
    assert ops["sum"] == 4 and ops["conv"] == 9 and ops["activation"] == 9 and ops["global_avg_pool"] == 1, ops
    sums = [nd for nd in graph["nodes"] if nd["op"] == "sum"]
    assert all(nd["weights"] == pytest.approx([2**-0.5] * 2) for nd in sums)
    assert sums[0]["inputs"] == ["conv_0", "preactblock_0/conv_1"]
    assert mapping["preactblock_2/conv_0"] == ("PreActBlock_2", "Conv_0")
    conv = next(nd for nd in graph["nodes"] if nd["id"] == "preactblock_0/conv_0")
    assert conv["kernel"] == [3, 3] and conv["padding"] == "same" and conv["channels"] == 64
    assert graph["nodes"][0]["shape"] == [8, 8, 8]

    sol = _solve(graph, eta=0.3)
    solved = ResNet(act=sjax.transformed_activation(sol))
    runs = []
    for key in range(NETWORKS):  # 64 channels: one network's c wanders by ~0.05-0.1, so average
        params, report = sjax.apply_to_params(variables, sol, mapping, jax.random.PRNGKey(key))
        assert report.ok, str(report)
        runs.append(sjax.diagnose(solved.bind(params), sol, x, input_c=0.0, seed=key))
    print("\n" + str(runs[0]))
    rows = [i for i, r in enumerate(runs[0].layers) if r.op in ("conv", "activation", "sum")]
    assert runs[0].scope == "location" and len(rows) == 22
    q_err = [abs(sum(run.layers[i].q_error for run in runs) / NETWORKS) for i in rows]
    c_err = [abs(sum(run.layers[i].c_error for run in runs) / NETWORKS) for i in rows]
    print(f"mean over {NETWORKS} networks: max |q error| {max(q_err):.4f}, max |c error| {max(c_err):.4f}")
    assert max(q_err) < 0.12 and max(c_err) < 0.06
    pooled = {r.id: r for r in runs[0].layers}["global_avg_pool"]
    assert pooled.note.startswith("after pooling")  # random locations: the pooled prediction does not hold


def test_an_unnormalized_add_is_named_and_other_ops_are_refused():
    x = jnp.ones((2, 8, 8, 4))
    with pytest.warns(UserWarning, match=r"'add' enters an activation multiplied by 1.41421"):
        sjax.graph_from_flax(ResNet(c=8, blocks=2, normalized=False), x)

    class WithLayerNorm(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(nn.LayerNorm()(nn.Dense(8)(x)))

    with pytest.raises(SigpropError) as err:
        sjax.graph_from_flax(WithLayerNorm(), jnp.ones((2, 4)))
    # flax names the outer Dense first (Dense_0): the LayerNorm's mean reads Dense_1's output
    assert err.value.code == "unsupported_op" and "reduce_sum (on 'dense_1')" in err.value.message


def test_concatenation_and_gelu():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16))
    graph, mapping = sjax.graph_from_flax(DenseNet(), x)
    ops = _ops(graph)
    assert ops["concat"] == 3 and ops["dense"] == 5 and ops["activation"] == 4, ops
    acts = [nd["id"] for nd in graph["nodes"] if nd["op"] == "activation"]
    assert acts[0] == "gelu_tanh_act"  # flax's nn.gelu is the tanh approximation
    assert len(mapping) == 5
    sol = solve(SolveRequest(graph=graph, method="tat", activation="softplus", targets={"tau": 0.3}))
    assert sol.assumptions.holds


# -- Leaky ReLU however it is written, and unsupported modules named ------------------------------


def _leaky_nn(x):
    return nn.leaky_relu(x, negative_slope=0.2)


def _leaky_where(x):
    return jnp.where(x > 0, x, 0.1 * x)


@pytest.mark.parametrize(
    "act,slope", [(_leaky_nn, 0.2), (jax.nn.leaky_relu, 0.01), (_leaky_where, 0.1)], ids=["nn", "jax.nn", "where"]
)
def test_leaky_relu_is_an_activation_however_it_is_written(act, slope):
    """nn.leaky_relu and jax.nn.leaky_relu are a select between x and slope * x: the scaled branch
    is the same node times a factor, so the select is one elementwise function of it."""
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
    graph, _ = sjax.graph_from_flax(MLP(depth=2, width=32, act=act), x)
    assert _ops(graph) == {"input": 1, "dense": 3, "activation": 2, "output": 1}
    assert [nd["id"] for nd in graph["nodes"] if nd["op"] == "activation"] == ["leaky_relu_act", "leaky_relu_act_1"]
    from sigprop.client.jax.extraction import _PROBE, _classify

    assert _classify(np.asarray(act(jnp.asarray(_PROBE, jnp.float32)), np.float64))[1] == {
        "negative_slope": pytest.approx(slope, rel=1e-5)
    }


def test_a_flax_mlp_with_nn_leaky_relu_extracts_solves_applies_and_diagnoses():
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 128))
    model = MLP(depth=6, width=256, act=_leaky_nn)
    variables = model.init(jax.random.PRNGKey(0), x)
    graph, mapping = sjax.graph_from_flax(model, x, variables)
    sol = solve(SolveRequest(graph=graph, method="tat", activation="leaky_relu", targets={"eta": 0.6}))
    params, report = sjax.apply_to_params(variables, sol, mapping, jax.random.PRNGKey(2))
    assert report.ok, str(report)
    solved = MLP(depth=6, width=256, act=sjax.transformed_activation(sol))
    assert sjax.graph_from_flax(solved, x, params)[0] == graph  # the transformed function extracts alike
    diag = sjax.diagnose(solved.bind(params), sol, x, input_c=0.5)
    assert diag.ok and not diag.warnings, str(diag)
    checked = [r for r in diag.layers if r.q_noise and not r.note]
    assert len(checked) >= 10 and all(abs(r.q_error) <= 5 * r.q_noise for r in checked), str(diag)
    # the answer's weights with the model's own nn.leaky_relu: the activation was not swapped in
    plain = sjax.diagnose(model.bind(params), sol, x, input_c=0.5)
    assert not plain.ok and plain.warnings[0].startswith("node 'leaky_relu_act' (activation)"), str(plain)
    assert "not the answer's transformed activation" in plain.warnings[0]


class _WithLayerNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.LayerNorm(name="norm")(nn.Dense(8)(x))))


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(x) / nn.Dense(8)(x)  # a quotient of two network values (a product is a mul node)


class _Gated(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(_Block()(x))


def test_unsupported_ops_are_named_by_their_flax_module_and_type():
    x = jnp.ones((4, 6))
    with pytest.raises(SigpropError) as info:
        sjax.graph_from_flax(_WithLayerNorm(), x)
    err = info.value
    assert err.code == "unsupported_op" and "the Flax module 'norm' (LayerNorm) is not supported" in err.message
    assert "normalization layer" in err.hint and "normalization-free" in err.hint
    with pytest.raises(SigpropError) as info:
        sjax.graph_from_flax(_Gated(), x)
    assert "the Flax module '_Block_0' (_Block)" in info.value.message, info.value.message
    with pytest.raises(SigpropError) as info:  # a sequence input reads per token, up to the same gate
        sjax.graph_from_flax(_Gated(), jnp.ones((2, 5, 6)))
    assert "the Flax module '_Block_0' (_Block)" in info.value.message, info.value.message


def test_ops_treated_as_the_identity_are_warned_of_in_the_answer():
    """allow_unsupported puts an identity with a note where the gate was: the answer warns of it."""
    import sigprop

    with pytest.warns(UserWarning, match="treated as the identity"):
        graph, _ = sjax.graph_from_flax(_Gated(), jnp.ones((4, 6)), allow_unsupported=True)
    stand_in = [nd for nd in graph["nodes"] if nd.get("unsupported")]
    assert [(nd["id"], nd["op"]) for nd in stand_in] == [("_block_0", "identity")], graph["nodes"]
    assert "the Flax module '_Block_0' (_Block)" in stand_in[0]["unsupported"]
    sol = sigprop.solve(graph, "eoc", "tanh")
    warned = [w for w in sol.warnings if "'_block_0'" in w]
    assert len(warned) == 1 and "_Block" in warned[0] and "identity" in warned[0], sol.warnings


@pytest.mark.parametrize("shape", [(6, 28, 28, 1), (6, 784), (6, 12, 40), (6, 8, 8, 3)])
def test_input_pairs_have_q_one_and_the_cosine_for_any_shape(shape):
    """As the torch adapter's: one channel (NHWC [N, 28, 28, 1]) gets +-1 signs, a share flipped."""
    x1, x2 = sjax.input_pair(jax.random.normal(jax.random.PRNGKey(0), shape) * 3 + 1, 0.5)
    a, b = np.asarray(x1, np.float64).reshape(shape[0], -1), np.asarray(x2, np.float64).reshape(shape[0], -1)
    np.testing.assert_allclose((a * a).mean(1), 1.0, atol=1e-5)
    np.testing.assert_allclose((b * b).mean(1), 1.0, atol=1e-5)
    cos = (a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1))
    np.testing.assert_allclose(cos, 0.5, atol=1.0 / a.shape[1] + 1e-6)
