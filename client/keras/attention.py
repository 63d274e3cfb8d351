"""Why ``graph_from_keras`` refuses Keras attention layers (issue 36), named once.

``keras.layers.MultiHeadAttention`` (and ``Attention``, ``GroupedQueryAttention``) computes
``softmax(q k^T / sqrt(d) + mask)`` with a boolean mask only. A sigprop answer for a sequence model
mixes tokens at initialization with a fixed matrix: E-SPA and U-SPA need an additive logit bias
``log P`` and a per-row rescaling ``D`` (``A = D P``), Value-SkipInit and shaped attention an identity
term. Zeroing the query kernel leaves the layer's uniform (causal) average, not the answer's matrix,
and the Keras adapter's ``apply`` sets weights and activations on the user's model: it cannot change
what the layer computes. So the layer is refused by name, with the way out.
"""

from __future__ import annotations

__all__ = ["ATTENTION_LAYERS", "ATTENTION_WHY", "ATTENTION_HINT"]

ATTENTION_LAYERS = ("MultiHeadAttention", "GroupedQueryAttention", "Attention", "AdditiveAttention")
ATTENTION_WHY = (
    "Keras attention mixes tokens by softmax(q k^T / sqrt(d)) under a boolean mask only; the answer's shaped "
    "attention needs a fixed logit bias log P and a row rescaling D (E-SPA, U-SPA) or an identity term "
    "(Value-SkipInit, shaped attention), which the layer cannot compute and apply (weights and activations "
    "only) cannot install"
)
ATTENTION_HINT = (
    "write the model with sigprop's attention in PyTorch (sigprop.client.torch.attention.ShapedAttention, or "
    "nn.MultiheadAttention, which apply replaces) or Flax (sigprop.client.jax.attention.ShapedAttention)"
)
