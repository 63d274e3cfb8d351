"""The token mixer of one ``attention`` node for Flax, with the shaped initializations installable.

:class:`ShapedAttention` (a ``flax.linen`` module) is the JAX twin of
``sigprop.client.torch.attention.ShapedAttention``: for queries, keys and values of shape
``(B, T, H * d_head)`` and per head it computes

    A = alpha * identity * I + beta * diag(scale) softmax(logits + bias) - centre * softmax(mask),
    out = A v,

with ``logits = Q K^T / sqrt(d_head)`` (``Q K^T / (temperature * sqrt(d_model * d_head))`` once a
shaped-attention answer is installed), ``bias`` an additive logit bias and ``mask`` the bias of
plain (causal or full) attention. Its default state (``bias`` = the plain mask, ``scale`` = 1,
``identity`` = ``centre`` = 0, ``alpha`` = ``beta`` = 1) is plain softmax attention,
``flax.linen.dot_product_attention`` with a causal mask when ``causal``.

The installed state lives in the variable collection ``"shaping"`` (never trained: pass the whole
variables dict to ``apply``); ``sigprop.client.jax.shaping.install_init`` writes an answer's matrix
at initialization (``sigprop.schemas.attention_init.expand_attention``) into it
(``sigprop.client.jax.apply_to_params`` does so for every attention node of an answer), so that
with zero query weights the module mixes tokens with exactly ``AttentionInit.matrix()``:

- E-SPA / U-SPA ("Deep Transformers without Shortcuts: Modifying Self-attention for Faithful Signal
  Propagation", He, Martens et al., arXiv:2302.10322, section 3): ``bias = log P``, ``scale = D``,
  the row sums of the Cholesky ratio ``A = D P``;
- Value-SkipInit (same paper, section 4): ``A = alpha I + beta softmax(logits + mask)``; ``alpha``
  and ``beta`` are trainable ``"params"`` when the module is built with ``value_skipinit=True``
  (JAX decides what is trained by the variables' collection, fixed when the module is built; the
  torch module flips ``requires_grad`` at ``load_init`` instead);
- shaped attention ("The Shaped Transformer", Noci et al., arXiv:2306.17759):
  ``A = I + softmax(Q K^T / tau) - softmax(mask)``, ``tau = tau_0 sqrt(d_model * d_head)``.

The matrices are stored for ``max_len`` tokens; a shorter sequence uses their leading block, which
for causal attention is exactly the matrix of the shorter sequence.

The mixing itself is ``shaping.mixing_function``, one jitted call the extraction recognizes.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax.numpy as jnp

from ...schemas.attention_init import mask_bias
from .shaping import COLLECTION, attention_matrix, install_init, mixing_function

__all__ = ["ShapedAttention", "install_init", "attention_matrix"]


class ShapedAttention(nn.Module):
    """Multi-head attention's token mixing (no projections): ``__call__(q, k, v)`` with arrays of
    shape ``(B, T, heads * d_head)`` returns ``A v`` of the same shape (module docstring).

    ``max_len``: the longest sequence (the stored matrices are ``max_len x max_len``); ``d_model``:
    the width of the residual stream shaped attention's temperature scales with (default: the width
    of ``q``); ``value_skipinit``: ``alpha`` and ``beta`` are trainable ``"params"`` (else frozen in
    ``"shaping"``, at 1 unless an answer's Value-SkipInit is installed there).
    """

    heads: int
    max_len: int
    causal: bool = True
    d_model: int | None = None
    value_skipinit: bool = False

    @nn.compact
    def __call__(self, q, k, v):
        if self.heads < 1 or self.max_len < 1:
            raise ValueError(f"ShapedAttention needs heads >= 1 and max_len >= 1, got {self.heads} and {self.max_len}")
        b, t, width = q.shape
        if t > self.max_len:
            raise ValueError(f"a sequence of {t} tokens is longer than this ShapedAttention's max_len={self.max_len}")
        if width % self.heads or v.shape[-1] % self.heads:
            raise ValueError(f"widths {width} and {v.shape[-1]} are not divisible by heads={self.heads}")
        n = self.max_len
        causal = self.causal
        var = functools.partial(self.variable, COLLECTION)
        bias = var("bias", lambda: jnp.asarray(mask_bias(n, causal), jnp.float32)).value
        scale = var("scale", lambda: jnp.ones((n,), jnp.float32)).value
        identity = var("identity", lambda: jnp.zeros((), jnp.float32)).value
        centre = var("centre", lambda: jnp.zeros((), jnp.float32)).value
        temperature = var("temperature", lambda: jnp.ones((), jnp.float32)).value
        shaped = var("shaped", lambda: jnp.zeros((), jnp.bool_)).value
        var("causal", lambda: jnp.asarray(causal))  # read by install_init
        if self.value_skipinit:
            alpha = self.param("alpha", nn.initializers.ones, ())
            beta = self.param("beta", nn.initializers.ones, ())
        else:
            alpha = var("alpha", lambda: jnp.ones((), jnp.float32)).value
            beta = var("beta", lambda: jnp.ones((), jnp.float32)).value
        mix = mixing_function(int(self.heads), bool(causal), None if self.d_model is None else int(self.d_model))
        return mix(q, k, v, bias, scale, identity, centre, temperature, shaped, alpha, beta)
