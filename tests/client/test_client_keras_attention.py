"""``graph_from_keras`` refuses Keras attention layers by name, with the reason (issue 36): the layer's
softmax mixing cannot compute the answer's matrix at initialization, and apply cannot change it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover - another test file imported keras first
    pytest.skip("these tests run Keras on the JAX backend", allow_module_level=True)
from keras import layers  # noqa: E402

from sigprop.client.keras import graph_from_keras  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402


def test_multi_head_attention_is_refused_by_name_with_the_reason_and_the_way_out():
    inp = keras.Input((8, 16))
    h = layers.MultiHeadAttention(num_heads=2, key_dim=8, name="mha")(inp, inp, use_causal_mask=True)
    model = keras.Model(inp, layers.Dense(16, name="out")(h))
    with pytest.raises(SigpropError) as err:
        graph_from_keras(model)
    e = err.value
    assert e.code == "unsupported_op" and "'mha'" in e.message and "MultiHeadAttention" in e.message
    assert "boolean mask" in e.message and "log P" in e.message  # why: the answer's matrix needs a logit bias
    assert "sigprop.client.torch.attention.ShapedAttention" in e.hint and "sigprop.client.jax" in e.hint
