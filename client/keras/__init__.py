"""Keras 3 adapter: extract a sigprop graph from a ``Sequential`` or Functional model and apply an answer.

    import keras
    from sigprop.client import Client
    from sigprop.client.keras import apply, diagnose, graph_from_keras

    graph = graph_from_keras(model)
    with Client("http://127.0.0.1:8000") as sp:
        sol = sp.solve(graph, "tat", "leaky_relu", {"eta": 0.9})
    report = apply(model, sol, seed=0)
    net = report.model          # a re-initialized clone with the transformed activations: train this one
    print(report.summary())
    print(diagnose(net, sol, x_batch))

``graph_from_keras`` reads the model's graph of layer calls (``extraction``); ``apply`` clones the
model with ``keras.models.clone_model`` (``apply``): activations become the answer's
:class:`TransformedActivation`, plain adds a :class:`WeightedSum` with the graph's weights, every
layer the answer lists gets its kernel and bias re-initialized; ``diagnose`` measures the applied
model's per-node q and c against the answer (``sigprop.client.diagnosis``). Works on any Keras
backend (the tests run JAX); layouts are Keras's, channels last.

Importing this package needs Keras 3: ``pip install 'sigprop[keras]'`` (and a backend: JAX,
PyTorch or TensorFlow). Like the other adapters it imports nothing of the service.
"""

from __future__ import annotations

try:
    import keras
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "sigprop.client.keras needs Keras 3, which is not installed: pip install 'sigprop[keras]'"
    ) from _exc

if not keras.__version__.startswith("3."):  # pragma: no cover - tf.keras 2 has another graph API
    raise ImportError(f"sigprop.client.keras needs Keras 3, found keras {keras.__version__}: pip install 'keras>=3'")

from .apply import ApplyReport, apply
from .diagnose import diagnose, input_pair
from .extraction import graph_from_keras
from .layers import TransformedActivation, WeightedSum

__all__ = [
    "graph_from_keras",
    "apply",
    "ApplyReport",
    "diagnose",
    "input_pair",
    "TransformedActivation",
    "WeightedSum",
]
