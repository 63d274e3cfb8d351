"""``rms_norm`` and ``mul`` in the Keras adapter (issue 34): ``RMSNormalization`` on ``[B, F]`` is an
``rms_norm`` node, ``Multiply()([u, v])`` and ``u * v`` of two network tensors a ``mul`` node (a
tensor times a scalar stays a scale); ``apply`` sets the RMSNormalization scale to 1; ``diagnose`` of
a gated MLP (eoc, tanh, width 256) passes."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover - another test file imported keras first
    pytest.skip("these tests run Keras on the JAX backend", allow_module_level=True)
if not hasattr(keras.layers, "RMSNormalization"):  # pragma: no cover - Keras before 3.9
    pytest.skip("this Keras has no RMSNormalization", allow_module_level=True)
from keras import layers as L  # noqa: E402

from sigprop.client.keras import apply, diagnose, graph_from_keras  # noqa: E402

from ..solving import solve_graph  # noqa: E402


def _gated(w: int = 256):
    inp = keras.Input((64,), name="x")
    h = L.Dense(w, name="d2")(L.Activation("tanh", name="a1")(L.Dense(w, name="d1")(inp)))
    h = L.RMSNormalization(name="norm")(h)
    g = L.Activation("silu", name="silu")(L.Dense(w, name="gate")(h))
    m = L.Multiply(name="mul")([g, L.Dense(w, name="up")(h)])
    h = L.Activation("tanh", name="a3")(L.Dense(w, name="d3")(L.Dense(w, name="down")(m)))
    return keras.Model(inp, L.Dense(w, name="head")(h))


def test_a_keras_gated_mlp_is_read_applied_and_diagnosed():
    model = _gated()
    model.get_layer("norm").scale.assign(2 * np.ones(256, "float32"))
    with pytest.warns(UserWarning, match="several activation functions"):
        graph = graph_from_keras(model)
    nodes = {nd["id"]: nd for nd in graph["nodes"]}
    assert nodes["norm"]["op"] == "rms_norm" and nodes["mul"] == {"id": "mul", "op": "mul", "inputs": ["silu", "up"]}
    sol = solve_graph(graph, "eoc", "tanh", {})
    report = apply(model, sol, graph=graph, seed=0)
    assert np.all(np.asarray(report.model.get_layer("norm").scale) == 1.0)
    x = np.random.default_rng(12345).standard_normal((32, 64)).astype("float32")  # not apply's stream
    diag = diagnose(report.model, sol, x)
    assert diag.ok and diag.verdict().startswith("verdict: PASS"), str(diag)


def test_a_product_with_an_operator_is_mul_and_a_scalar_stays_a_scale():
    inp = keras.Input((8,))
    a, b = L.Dense(8)(inp), L.Dense(8)(inp)
    g = graph_from_keras(keras.Model(inp, L.Dense(4)(L.Activation("tanh")(a) * b)))
    assert [nd["op"] for nd in g["nodes"]].count("mul") == 1
    s = L.Dense(4)(L.Add()([L.Activation("tanh")(a) * 0.6, b * 0.8]))
    g = graph_from_keras(keras.Model(inp, s))
    assert "mul" not in [nd["op"] for nd in g["nodes"]]
    assert next(nd for nd in g["nodes"] if nd["op"] == "sum")["weights"] == pytest.approx([0.6, 0.8])
