"""The token mixer of one ``attention`` node, with the shaped initializations installable.

:class:`ShapedAttention` computes, for queries, keys and values of shape ``(B, T, H * d_head)``
and per head,

    A = identity * I + diag(scale) softmax(logits + bias) - centre * softmax(mask),
    out = A v,

where ``logits = Q K^T / sqrt(d_head)`` (``Q K^T / (temperature * sqrt(d_model * d_head))`` once a
shaped-attention answer is installed), ``bias`` an additive logit bias and ``mask`` the bias of plain
(causal or full) attention. Its default state (``bias`` = the plain mask, ``scale`` = 1, ``identity``
= ``centre`` = 0) is plain softmax attention, ``F.scaled_dot_product_attention(q, k, v,
is_causal=causal)``.

:meth:`ShapedAttention.load_init` installs an answer's attention initialization
(``sigprop.schemas.attention_init.AttentionInit``, expanded from the answer's generator by
``expand_attention``), so that with zero query weights the matrix at initialization is exactly
``AttentionInit.matrix()``:

- E-SPA / U-SPA ("Deep Transformers without Shortcuts: Modifying Self-attention for Faithful Signal
  Propagation", He, Martens et al., arXiv:2302.10322, section 3): ``bias = log P``, ``scale = D``,
  the row sums of the Cholesky ratio ``A = D P``;
- Value-SkipInit (same paper, section 4): ``A = alpha I + beta softmax(logits + mask)`` with
  ``alpha`` and ``beta`` trainable scalars (1 and 0 at initialization);
- shaped attention ("The Shaped Transformer", Noci et al., arXiv:2306.17759):
  ``A = I + softmax(Q K^T / tau) - softmax(mask)``, ``tau = tau_0 sqrt(d_model * d_head)``.

The matrices are stored for ``max_len`` tokens; a shorter sequence uses their leading block, which
for causal attention is exactly the matrix of the shorter sequence.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...schemas.attention_init import AttentionInit, mask_bias

__all__ = ["ShapedAttention", "ShapedMultiheadAttention", "split_heads", "merge_heads"]


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, T, H * d) -> (B, H, T, d)``."""
    b, t, width = x.shape
    return x.view(b, t, heads, width // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, d) -> (B, T, H * d)``."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


class ShapedAttention(nn.Module):
    """Multi-head attention's token mixing (no projections): ``forward(q, k, v)`` with tensors of
    shape ``(B, T, heads * d_head)`` returns ``A v`` of the same shape (module docstring).

    ``d_model`` is the width of the residual stream shaped attention's temperature scales with
    (default: the width of ``q``). The buffers ``bias`` (``max_len x max_len``), ``scale``
    (``max_len``), ``identity``, ``centre``, ``temperature`` and ``shaped`` hold the installed state;
    ``alpha`` and ``beta`` are Value-SkipInit's trainable scalars (frozen at 1 otherwise).
    """

    def __init__(self, heads: int, max_len: int, causal: bool = True, d_model: int | None = None):
        super().__init__()
        if heads < 1 or max_len < 1:
            raise ValueError(f"ShapedAttention needs heads >= 1 and max_len >= 1, got {heads} and {max_len}")
        self.heads = int(heads)
        self.max_len = int(max_len)
        self.causal = bool(causal)
        self.d_model = None if d_model is None else int(d_model)
        plain = torch.as_tensor(mask_bias(self.max_len, self.causal), dtype=torch.float32)
        self.register_buffer("mask", plain, persistent=False)
        self.register_buffer("bias", plain.clone())
        self.register_buffer("scale", torch.ones(self.max_len))
        self.register_buffer("identity", torch.tensor(0.0))
        self.register_buffer("centre", torch.tensor(0.0))
        self.register_buffer("temperature", torch.tensor(1.0))
        self.register_buffer("shaped", torch.tensor(False))
        self.alpha = nn.Parameter(torch.tensor(1.0), requires_grad=False)
        self.beta = nn.Parameter(torch.tensor(1.0), requires_grad=False)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, max_len={self.max_len}, causal={self.causal}, d_model={self.d_model}"

    @torch.no_grad()
    def load_init(self, init: AttentionInit, value_skipinit: bool | None = None) -> ShapedAttention:
        """Install an answer's attention matrix at initialization (``expand_attention``'s result).

        ``value_skipinit`` (default: recognised from ``init``: no centring, a uniform scale and the
        plain mask as bias) makes ``alpha`` = ``init.identity`` and ``beta`` = ``init.scale`` the
        trainable Value-SkipInit scalars; otherwise they are frozen at 1.
        """
        t = init.bias.shape[0]
        if init.bias.shape != (t, t) or init.scale.shape != (t,):
            raise ValueError(f"an AttentionInit of shapes {init.bias.shape} and {init.scale.shape} is not T x T and T")
        if t != self.max_len:
            raise ValueError(f"the attention init is for {t} tokens, this ShapedAttention for max_len={self.max_len}")
        if bool(init.causal) != self.causal:
            raise ValueError(f"the attention init has causal={init.causal}, this ShapedAttention causal={self.causal}")
        plain = mask_bias(t, self.causal)
        if value_skipinit is None:
            value_skipinit = (
                init.centre == 0.0 and np.all(init.scale == init.scale[0]) and np.array_equal(init.bias, plain)
            )
        bias = torch.as_tensor(np.asarray(init.bias, dtype=np.float64), dtype=self.bias.dtype)
        self.bias.copy_(bias)
        self.centre.fill_(float(init.centre))
        self.temperature.fill_(float(init.temperature))
        self.shaped.fill_(bool(init.centre != 0.0))
        if value_skipinit:
            self.identity.fill_(1.0)
            self.scale.fill_(1.0)
            self.alpha.fill_(float(init.identity))
            self.beta.fill_(float(init.scale[0]))
        else:
            self.identity.fill_(float(init.identity))
            self.scale.copy_(torch.as_tensor(np.asarray(init.scale, dtype=np.float64), dtype=self.scale.dtype))
            self.alpha.fill_(1.0)
            self.beta.fill_(1.0)
        self.alpha.requires_grad_(bool(value_skipinit))
        self.beta.requires_grad_(bool(value_skipinit))
        return self

    def logit_scale(self, d_head: int, width: int) -> float:
        """The factor on ``Q K^T``: ``1/sqrt(d_head)``, or ``1/(temperature sqrt(d_model d_head))``
        for shaped attention."""
        if bool(self.shaped):
            d_model = self.d_model if self.d_model is not None else width
            return 1.0 / (float(self.temperature) * math.sqrt(d_model * d_head))
        return 1.0 / math.sqrt(d_head)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, width = q.shape
        if t > self.max_len:
            raise ValueError(f"a sequence of {t} tokens is longer than this ShapedAttention's max_len={self.max_len}")
        if width % self.heads or v.shape[-1] % self.heads:
            raise ValueError(f"widths {width} and {v.shape[-1]} are not divisible by heads={self.heads}")
        d_head = width // self.heads
        qh, kh, vh = (split_heads(x, self.heads) for x in (q, k, v))
        bias = self.bias[:t, :t].to(q.dtype)
        mixed = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=self.logit_scale(d_head, width))
        scale = (self.beta * self.scale[:t]).to(q.dtype)
        out = scale[:, None] * mixed
        identity = self.alpha * self.identity
        if bool(self.identity != 0.0) or self.alpha.requires_grad:
            out = out + identity.to(q.dtype) * vh
        if bool(self.centre != 0.0):
            out = out - self.centre.to(q.dtype) * _plain_mean(vh, self.causal)
        return merge_heads(out)

    @torch.no_grad()
    def matrix(self, seq_len: int | None = None) -> torch.Tensor:
        """A at zero logits (zero queries): what the module mixes tokens with at initialization."""
        t = self.max_len if seq_len is None else int(seq_len)
        eye = torch.eye(t)
        mixed = torch.softmax(self.bias[:t, :t], dim=-1)
        a = (self.beta * self.scale[:t])[:, None] * mixed + self.alpha * self.identity * eye
        return a - self.centre * torch.softmax(self.mask[:t, :t], dim=-1)


def _plain_mean(v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(mask) v over the token axis (-2): the running mean for causal attention, the mean
    otherwise."""
    if causal:
        count = torch.arange(1, v.shape[-2] + 1, dtype=v.dtype, device=v.device)
        return torch.cumsum(v, dim=-2) / count[:, None]
    return v.mean(dim=-2, keepdim=True).expand_as(v)


class ShapedMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` (``batch_first=True``, self-attention) with its token mixing done
    by a :class:`ShapedAttention`: the same parameters (``in_proj_weight``, ``in_proj_bias``,
    ``out_proj``), so ``apply`` swaps it in at the module's path. Called as the module it replaces
    (``att(x, x, x, ...)``: masks and flags are the ShapedAttention's own now) and returns
    ``(output, None)``."""

    def __init__(self, mha: nn.MultiheadAttention, attention: ShapedAttention):
        super().__init__()
        self.embed_dim, self.num_heads, self.batch_first = mha.embed_dim, mha.num_heads, True
        self.in_proj_weight = mha.in_proj_weight
        self.in_proj_bias = mha.in_proj_bias
        self.out_proj = mha.out_proj
        self.attention = attention

    def forward(self, query, key=None, value=None, *args, **kwargs):
        q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        return self.out_proj(self.attention(q, k, v)), None
