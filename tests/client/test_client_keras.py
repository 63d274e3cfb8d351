"""``sigprop.client.keras`` on real Keras 3 models (JAX backend), engine in-process.

End to end: ``graph_from_keras`` -> solve -> ``apply`` -> ``diagnose``, for a Functional
pre-activation ResNet with weighted adds and a Sequential CNN. A finite-width network deviates from
the answer's q and c by a few ``1/sqrt(width)`` (one network's mean direction biases every
location alike), so the check is over independent re-initializations: the mean error at every
node must lie within 4 standard errors of 0 (plus 0.01 for the interpolation of the C map). The
same check on the model before ``apply`` must fail, so the test can.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover - another test file imported keras first
    pytest.skip("these tests run Keras on the JAX backend", allow_module_level=True)
from keras import layers  # noqa: E402

from sigprop.client.keras import TransformedActivation, WeightedSum, apply, diagnose, graph_from_keras  # noqa: E402
from sigprop.engine.solve import solve  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402
from sigprop.schemas.solve import SolveRequest  # noqa: E402

MODELS = 8


def preact_resnet(c: int = 32, blocks: int = 2, hw: int = 6, plain: bool = False) -> keras.Model:
    """Pre-activation blocks x -> 0.8 x + 0.6 conv(relu(conv(relu(x)))) (``plain``: Add() of the two)."""
    inp = keras.Input((hw, hw, 3))
    x = layers.Conv2D(c, 3, padding="same", name="stem")(inp)
    for b in range(blocks):
        h = layers.ReLU(name=f"b{b}_a1")(x)
        h = layers.Conv2D(c, 3, padding="same", name=f"b{b}_c1")(h)
        h = layers.Activation("relu", name=f"b{b}_a2")(h)
        h = layers.Conv2D(c, 3, padding="same", name=f"b{b}_c2")(h)
        if plain:
            x = layers.Add(name=f"b{b}_add")([x, h])
        else:
            x = layers.Add(name=f"b{b}_add")([layers.Rescaling(0.8)(x), layers.Rescaling(0.6)(h)])
    x = layers.GlobalAveragePooling2D(name="gap")(layers.ReLU(name="head_act")(x))
    return keras.Model(inp, layers.Dense(10, name="fc")(x))


def sequential_cnn(c: int = 32, hw: int = 6) -> keras.Sequential:
    return keras.Sequential(
        [
            keras.Input((hw, hw, 3)),
            layers.Conv2D(c, 3, padding="same", activation="relu", name="c1"),
            layers.MaxPooling2D(name="pool"),
            layers.Conv2D(c, 3, padding="same", activation="relu", name="c2"),
            layers.Flatten(name="flat"),
            layers.Dropout(0.1, name="drop"),
            layers.Dense(128, activation="relu", name="fc1"),
            layers.Dense(10, name="fc2"),
        ]
    )


def _solve(graph: dict, eta: float, **kw):
    return solve(SolveRequest(graph=graph, method="tat", activation="leaky_relu", targets={"eta": eta}, **kw))


def _ops(graph: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for nd in graph["nodes"]:
        out[nd["op"]] = out.get(nd["op"], 0) + 1
    return out


def _mc_check(diags) -> tuple[float, float]:
    """Largest |mean error| / (4 SE + 0.01) over the nodes with a prediction, for q and for c."""
    rows = [i for i, r in enumerate(diags[0].layers) if r.q_predicted is not None and r.c_predicted is not None]
    worst = []
    for attr in ("q_error", "c_error"):
        errs = np.array([[getattr(d.layers[i], attr) for i in rows] for d in diags])
        se = errs.std(axis=0, ddof=1) / np.sqrt(len(diags))
        worst.append(float(np.max(np.abs(errs.mean(axis=0)) / (4 * se + 0.01))))
    return worst[0], worst[1]


def test_functional_preactivation_resnet_graph_apply_and_monte_carlo():
    model = preact_resnet()
    graph = graph_from_keras(model)
    assert _ops(graph) == {
        "input": 1, "conv": 5, "activation": 5, "sum": 2, "global_avg_pool": 1, "dense": 1, "output": 1
    }  # fmt: skip
    nodes = {nd["id"]: nd for nd in graph["nodes"]}
    assert graph["nodes"][0]["shape"] == [3, 6, 6]  # channels last -> the contract's [C, H, W]
    assert nodes["b0_add"]["inputs"] == ["stem", "b0_c2"] and nodes["b0_add"]["weights"] == [0.8, 0.6]
    assert nodes["b1_a1"]["inputs"] == ["b0_add"]  # the shortcut reads the sum, unscaled
    assert nodes["stem"] == {
        "id": "stem", "op": "conv", "inputs": [graph["nodes"][0]["id"]], "channels": 32, "kernel": [3, 3],
        "stride": [1, 1], "padding": "same", "bias": True,
    }  # fmt: skip
    sol = _solve(graph, eta=0.3)
    x = np.random.default_rng(0).standard_normal((8, 6, 6, 3)).astype("float32")
    runs, before = [], []
    for seed in range(MODELS):
        report = apply(model, sol, seed=seed)
        assert report.complete and len(report.layers) == 6 and len(report.activations) == 5, report.summary()
        assert report.sums == []  # the model already computes 0.8 x + 0.6 h: left alone
        if seed == 0:
            assert graph_from_keras(report.model) == graph  # the clone has the same ids
        runs.append(diagnose(report.model, sol, x, input_c=0.0, same_locations=True, seed=seed))
        if seed < 3:
            before.append(diagnose(model, sol, x, input_c=0.0, same_locations=True, seed=seed))
    print("\n" + str(runs[0]))
    out = {r.id: r for r in runs[0].layers}["output"]
    assert out.c_predicted == pytest.approx(runs[0].c_global, abs=1e-3)
    assert out.c_predicted == pytest.approx(0.3, abs=0.01)  # C(0) = eta, the TAT target
    q_ratio, c_ratio = _mc_check(runs)
    print(f"over {MODELS} models: worst |mean error| / (4 SE + 0.01): q {q_ratio:.3f}, c {c_ratio:.3f}")
    assert q_ratio < 1 and c_ratio < 1
    assert max(_mc_check(before)) > 1  # the model as it was (ReLU, Keras's init) is caught
    c0 = np.mean([{r.id: r for r in d.layers}["output"].c_empirical for d in runs])
    print(f"output C(0): measured {c0:.4f}, answer {out.c_predicted:.4f}")


def test_sequential_cnn_fused_activations_plain_adds_and_monte_carlo():
    model = sequential_cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Sequential with one function: no warning
        graph = graph_from_keras(model)
    ids = [nd["id"] for nd in graph["nodes"]]
    assert ids[1:3] == ["c1", "c1/activation"] and "pool" in ids and "drop" in ids
    nodes = {nd["id"]: nd for nd in graph["nodes"]}
    assert nodes["pool"] == {
        "id": "pool", "op": "max_pool", "inputs": ["c1/activation"], "kernel": [2, 2], "stride": [2, 2]
    }  # fmt: skip
    assert nodes["flat"]["op"] == "flatten" and nodes["drop"]["rate"] == pytest.approx(0.1)
    sol = _solve(graph, eta=0.5)
    x = np.random.default_rng(1).standard_normal((8, 6, 6, 3)).astype("float32")
    runs = []
    for seed in range(MODELS):
        report = apply(model, sol, seed=seed)
        assert report.complete and len(report.activations) == 3, report.summary()
        assert graph_from_keras(report.model) == graph  # same ids and graph after apply
        runs.append(diagnose(report.model, sol, x, input_c=0.0, same_locations=True, seed=seed))
    print("\n" + str(runs[0]))
    q_ratio, c_ratio = _mc_check(runs)
    print(f"over {MODELS} models: worst |mean error| / (4 SE + 0.01): q {q_ratio:.3f}, c {c_ratio:.3f}")
    assert q_ratio < 1 and c_ratio < 1
    out = {r.id: r for r in runs[0].layers}["output"]
    assert out.c_predicted == pytest.approx(0.5, abs=0.01)


def test_plain_add_becomes_the_normalized_sum_and_the_clone_saves(tmp_path):
    model = preact_resnet(blocks=1, plain=True)  # the kernel shapes of the tests above: no new XLA builds
    graph = graph_from_keras(model)
    add = next(nd for nd in graph["nodes"] if nd["op"] == "sum")
    assert add["weights"] == pytest.approx([2**-0.5] * 2)
    sol = _solve(graph, eta=0.3)
    report = apply(model, sol, seed=0)
    assert len(report.sums) == 1 and isinstance(report.model.get_layer("b0_add"), WeightedSum)
    assert isinstance(report.model.get_layer("b0_a1").activation, TransformedActivation)
    for lay in sol.layers:  # Orthogonal Delta / SUO exactly: gain times orthonormal columns or rows, zero off-centre
        w = np.asarray(report.model.get_layer(lay.id).kernel, dtype=np.float64)
        centre = w[1, 1] if w.ndim == 4 else w
        gram = centre.T @ centre if centre.shape[0] >= centre.shape[1] else centre @ centre.T
        np.testing.assert_allclose(gram, lay.gain**2 * np.eye(len(gram)), atol=1e-5 * lay.gain**2, err_msg=lay.id)
        if w.ndim == 4:
            assert np.abs(w).sum() == pytest.approx(np.abs(centre).sum())
    x = np.random.default_rng(0).standard_normal((2, 6, 6, 3)).astype("float32")
    path = tmp_path / "solved.keras"
    report.model.save(path)
    again = keras.models.load_model(path)
    np.testing.assert_allclose(np.asarray(again(x)), np.asarray(report.model(x)), rtol=1e-5)  # eager: no XLA build
    assert json.dumps(graph_from_keras(again)) == json.dumps(graph_from_keras(report.model))
    assert apply(model, sol, seed=0).model.get_layer("stem").get_weights()[0].std() == pytest.approx(
        report.model.get_layer("stem").get_weights()[0].std()
    )  # seeded


def test_nested_sequential_blocks_inline_with_prefixed_ids():
    """Residual branches written as nested Sequential models: the same graph (request key) as the flat
    ResNet, ids '<block>/<layer>', and apply + diagnose reach the inner layers."""
    from sigprop.engine.solve import prepare

    def branch(b: int) -> keras.Sequential:
        return keras.Sequential(
            [
                layers.ReLU(name=f"n{b}_a1"),
                layers.Conv2D(32, 3, padding="same", name=f"n{b}_c1"),
                layers.ReLU(name=f"n{b}_a2"),
                layers.Conv2D(32, 3, padding="same", name=f"n{b}_c2"),
            ],
            name=f"branch{b}",
        )

    inp = keras.Input((6, 6, 3))
    x = layers.Conv2D(32, 3, padding="same", name="n_stem")(inp)
    for b in range(2):
        x = layers.Add(name=f"n{b}_add")([layers.Rescaling(0.8)(x), layers.Rescaling(0.6)(branch(b)(x))])
    x = layers.GlobalAveragePooling2D()(layers.ReLU()(x))
    model = keras.Model(inp, layers.Dense(10)(x))
    graph = graph_from_keras(model)
    ids = [nd["id"] for nd in graph["nodes"]]
    assert "branch0/n0_c1" in ids and "branch1/n1_a2" in ids

    def key(g):
        return prepare(SolveRequest(graph=g, method="tat", activation="leaky_relu", targets={"eta": 0.3})).key

    assert key(graph) == key(graph_from_keras(preact_resnet()))
    sol = _solve(graph, eta=0.3)
    x = np.random.default_rng(0).standard_normal((8, 6, 6, 3)).astype("float32")
    runs = []
    for seed in range(MODELS):
        report = apply(model, sol, seed=seed)
        assert report.complete and len(report.layers) == 6 and len(report.activations) == 5, report.summary()
        runs.append(diagnose(report.model, sol, x, input_c=0.0, same_locations=True, seed=seed))
    assert graph_from_keras(report.model) == graph
    assert max(_mc_check(runs)) < 1


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda x: layers.BatchNormalization(name="bn")(x), r"BatchNormalization 'bn' is not supported: a normal"),
        (
            lambda x: layers.Conv2DTranspose(4, 3, kernel_initializer="zeros", name="up")(x),
            r"Conv2DTranspose 'up' is not supported",
        ),
        (lambda x: layers.Activation("softmax", name="sm")(x), r"Activation 'sm' .* 'softmax' is not one"),
        (
            lambda x: layers.Conv2D(4, 3, dilation_rate=2, kernel_initializer="zeros", name="dil")(x),
            r"Conv2D 'dil' .* dilated",
        ),
        (lambda x: layers.Lambda(lambda t: t * 2, name="lam")(x), r"Lambda 'lam' is not supported"),
        (
            lambda x: layers.Rescaling(0.5)(layers.Conv2D(4, 1, kernel_initializer="zeros", name="cv")(x)),
            r"reads 'cv' multiplied by 0.5",
        ),
    ],
)
def test_unknown_layers_are_refused_by_name(build, match):
    inp = keras.Input((6, 6, 3))
    first = layers.Conv2D(4, 1, kernel_initializer="zeros", name="first")(inp)  # zeros: no random kernels to build
    model = keras.Model(inp, layers.Flatten()(layers.Conv2D(4, 1, kernel_initializer="zeros")(build(first))))
    with pytest.raises(SigpropError, match=match) as err:
        graph_from_keras(model)
    assert err.value.code == "unsupported_op" and err.value.hint


@pytest.mark.parametrize("where", ["layer", "fused"])
def test_an_activation_outside_the_catalogue_is_named_with_the_supported_ones(where):
    from sigprop.schemas.activations import ACTIVATION_NAMES

    inp = keras.Input((6,))
    if where == "layer":
        h = layers.Activation("mish", name="m")(layers.Dense(4, name="d")(inp))
    else:
        h = layers.Dense(4, activation="mish", name="d")(inp)
    model = keras.Model(inp, layers.Dense(2, name="out")(h))
    with pytest.raises(SigpropError) as err:
        graph_from_keras(model)
    message = err.value.message
    assert "activation 'mish' is not one the sigprop catalogue knows; supported: " in message, message
    assert message.endswith(", ".join(ACTIVATION_NAMES)) and "TransformedActivation(name)" in err.value.hint


def test_unbuilt_sequential_subclassed_models_and_sequence_dense_are_refused():
    with pytest.raises(SigpropError, match="not built"):
        graph_from_keras(keras.Sequential([layers.Dense(4)]))

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = layers.Dense(4)

        def call(self, x):
            return self.d(x)

    sub = Sub()
    sub(np.zeros((1, 3), "float32"))
    with pytest.raises(SigpropError, match="subclassed keras.Model"):
        graph_from_keras(sub)
    seq = keras.Sequential([keras.Input((5, 8)), layers.Dense(4, name="tok")])
    with pytest.raises(SigpropError, match=r"Dense 'tok' .* sequence models are not supported yet"):
        graph_from_keras(seq)


def test_written_ops_scalings_and_concatenation():
    inp = keras.Input((32,), name="x")
    a = layers.Dense(32, name="d1")(inp)
    h = layers.Dense(32, name="d2")(layers.Activation("tanh", name="t1")(a))
    s = (a + h) / np.sqrt(2.0)  # keras.ops on symbolic tensors
    y = layers.Concatenate(name="cat")([s, layers.Dense(32, name="d3")(layers.LeakyReLU(0.1, name="lr")(s))])
    model = keras.Model(inp, layers.Dense(10, name="out")(layers.Activation("tanh", name="t2")(y)))
    with pytest.warns(UserWarning, match="several activation functions"):
        graph = graph_from_keras(model)
    nodes = {nd["id"]: nd for nd in graph["nodes"]}
    add = next(nd for nd in graph["nodes"] if nd["op"] == "sum")
    assert add["inputs"] == ["d1", "d2"] and add["weights"] == pytest.approx([2**-0.5] * 2)
    assert nodes["cat"]["op"] == "concat" and nodes["cat"]["inputs"] == [add["id"], "d3"]
    kept = graph_from_keras(model, keep_fn=True)
    assert {nd["id"]: nd.get("fn") for nd in kept["nodes"] if nd["op"] == "activation"} == {
        "t1": "tanh", "lr": "leaky_relu", "t2": "tanh"
    }  # fmt: skip


def test_transformed_activation_matches_the_engine_for_every_catalogue_function():
    from sigprop.engine.maps.activations import get_activation, transformed
    from sigprop.schemas.activations import CATALOGUE

    z = np.linspace(-6, 6, 1201)
    params = {"negative_slope": 0.2, "alpha": 1.3, "tau": 0.3, "m": 1.5}
    for name, info in CATALOGUE.items():
        p = {k: params[k] for k in info.defaults}
        fn = TransformedActivation(name, 1.3, -0.2, 0.9, 0.1, p)
        ref = transformed(get_activation(name, **p), 1.3, -0.2, 0.9, 0.1)
        got = np.asarray(fn(keras.ops.convert_to_tensor(z.astype("float32"))), dtype=np.float64)
        np.testing.assert_allclose(got, ref(z), rtol=2e-6, atol=2e-6, err_msg=name)  # float32 on the backend


def test_import_without_keras_says_how_to_install():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['keras'] = None\n"
        "try:\n    import sigprop.client.keras\nexcept ImportError as e:\n    print('IMPORT-ERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "IMPORT-ERROR" in out.stdout and "pip install 'sigprop[keras]'" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
def test_monte_carlo_at_width_128_over_16_models():
    """The default-suite checks at 4x the width and twice the models: every node's mean error over 16
    networks within 4 standard errors (+0.01) of 0, pooled nodes included (input_c = 0, same locations)."""
    for model, eta in ((preact_resnet(c=128, blocks=3), 0.3), (sequential_cnn(c=128), 0.5)):
        sol = _solve(graph_from_keras(model), eta=eta)
        x = np.random.default_rng(0).standard_normal((16, 6, 6, 3)).astype("float32")
        runs = [
            diagnose(apply(model, sol, seed=s).model, sol, x, input_c=0.0, same_locations=True, seed=s)
            for s in range(16)
        ]
        q_ratio, c_ratio = _mc_check(runs)
        out = [{r.id: r for r in d.layers}["output"] for d in runs]
        qs, cs = np.array([r.q_empirical for r in out]), np.array([r.c_empirical for r in out])
        print(
            f"\n{model.name}: output q {qs.mean():.4f} +- {qs.std(ddof=1) / 4:.4f} (answer {out[0].q_predicted:.4f}), "
            f"C(0) {cs.mean():.4f} +- {cs.std(ddof=1) / 4:.4f} (answer {out[0].c_predicted:.4f}); worst ratio "
            f"q {q_ratio:.3f}, c {c_ratio:.3f}"
        )
        assert q_ratio < 1 and c_ratio < 1


def test_one_channel_inputs_diagnose_within_the_stated_noise_and_a_skipped_apply_is_named():
    """MNIST-shaped ``[B, H, W, 1]`` inputs: the pair is +-1 with a share of signs flipped (q = 1,
    cosine ``input_c``), the prediction the matching mixture, and the applied CNN is within its
    stated noise at every node; the same model before ``apply`` is flagged at its first layer."""
    from sigprop.client.keras.diagnose import input_pair

    x = np.random.default_rng(2).standard_normal((16, 8, 8, 1)).astype("float32")
    x1, x2 = input_pair(x, 0.5, seed=0)
    assert np.all(np.abs(x1) == 1) and float((x2 * x2).mean()) == pytest.approx(1.0)
    cos = (x1 * x2).reshape(16, -1).mean(axis=1)
    assert np.allclose(cos, 0.5, atol=1.0 / 64 + 1e-6)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            layers.Conv2D(64, 3, padding="same", activation="relu", name="c1"),
            layers.Flatten(name="flat"),
            layers.Dense(256, activation="relu", name="fc1"),
            layers.Dense(256, activation="relu", name="fc2"),
            layers.Dense(10, name="out"),
        ]
    )
    graph = graph_from_keras(model)
    sol = _solve(graph, eta=0.5)
    diag = diagnose(apply(model, sol, seed=0).model, sol, x, input_c=0.5)
    assert diag.ok and not diag.warnings, str(diag)
    # every row states its noise, but for the orthogonal 1 -> 64 conv: an isometry, its q is exact
    assert all(r.q_noise or abs(r.q_error) < 1e-5 for r in diag.layers if r.op != "input"), str(diag)
    assert {r.id for r in diag.layers if r.op != "input" and not r.q_noise} == {"c1"}, str(diag)
    unapplied = diagnose(model, sol, x, input_c=0.5)  # Keras's own initialization and plain ReLUs
    assert not unapplied.ok and "node 'c1' (conv)" in unapplied.warnings[0], str(unapplied)
    assert "does not have the answer's initialization" in unapplied.warnings[0]


def test_plain_add_of_a_stream_and_its_dropout_copy_takes_the_answers_sum_scales():
    """``Add()([z, Dropout(z)])`` adds one atom through two paths: the answer's ``sum_scales`` (1/sqrt 2)
    multiply the normalized weights, so the clone's add has q = 1 where the graph's weights give 2."""
    inp = keras.Input((64,))
    z = layers.Dense(256, name="lin")(layers.Activation("softplus", name="a0")(layers.Dense(256, name="stem")(inp)))
    s = layers.Add(name="add")([z, layers.Dropout(0.1, name="drop")(z)])
    model = keras.Model(inp, layers.Dense(10, name="head")(layers.Activation("softplus", name="a1")(s)))
    graph = graph_from_keras(model)
    sol = solve(SolveRequest(graph=graph, method="tat", activation="softplus", targets={"tau": 0.5}))
    assert sol.sum_scales == {"add": pytest.approx(2**-0.5)}
    report = apply(model, sol, seed=0)
    (change,) = report.sums
    assert "graph x sum_scales" in change and report.model.get_layer("add").coefficients == pytest.approx([0.5, 0.5])
    x = np.random.default_rng(99).standard_normal((64, 64)).astype("float32")  # not apply's stream (seed 0)
    at_add = keras.Model(report.model.inputs, report.model.get_layer("add").output)
    assert float(np.mean(np.asarray(at_add([x])) ** 2)) == pytest.approx(1.0, abs=0.1)
