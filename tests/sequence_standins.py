"""Torch sequence models a new user brings, for tests/service/test_error_messages.py's refusals: attention the
sequence graph cannot hold, attention written out by hand, and a GPT-2-shaped stand-in for
HuggingFace's GPT2Model (``transformers`` is not a dependency). Import after
``pytest.importorskip("torch")``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Attention(nn.Module):  # attention, then its tokens flattened: no sequence graph holds that
    def __init__(self):
        super().__init__()
        self.att, self.head = nn.MultiheadAttention(16, 2, batch_first=True), nn.Linear(128, 4)

    def forward(self, x):
        return self.head(self.att(x, x, x)[0].flatten(1))


class _Sdpa(nn.Module):  # q, k, v are the input itself, not dense layers
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(128, 4)

    def forward(self, x):
        return self.head(F.scaled_dot_product_attention(x, x, x).flatten(1))


class _TokenNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(128, 4)

    def forward(self, x):
        return self.head(self.norm(x).flatten(1))


def sequence_models() -> dict:
    """Case -> (model on [2, 8, 16], what the message names, what it says)."""
    encoder = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    return {
        "attention": (
            _Attention(),
            "node 'flatten' (Tensor.flatten() call 'flatten')",
            "a flatten in a sequence model",
        ),
        "sdpa": (_Sdpa(), "node 'scaled_dot_product_attention'", "its query is computed by placeholder 'x', not by an"),
        "layernorm": (_TokenNorm(), "node 'flatten'", "a flatten in a sequence model"),
        "encoder": (encoder, "module 'TransformerEncoderLayer' (TransformerEncoderLayer: attention)", "yet"),
    }


class CausalSelfAttention(nn.Module):
    """Attention as GPT-2's and nanoGPT's eager code write it: Linear q, k, v split into heads by
    view/transpose, softmax(q @ k^T / sqrt(d)) @ v. fx traces it; the graph cannot hold it."""

    def __init__(self, d: int = 16, h: int = 2):
        super().__init__()
        self.h, self.qkv, self.proj = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        w = torch.softmax((q @ k.transpose(-2, -1)) / (d // self.h) ** 0.5, dim=-1)
        return self.proj((w @ v).transpose(1, 2).reshape(b, t, d))


class HandWrittenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = CausalSelfAttention()  # not named *Attention*: found by what it computes
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x):
        x = x + self.mixer(x)
        return x + self.mlp(x)


class Conv1D(nn.Module):
    """HuggingFace's Conv1D: a Linear with its weight transposed, computed by addmm on [B * T, D]."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight, self.bias = nn.Parameter(torch.randn(nx, nf) * 0.02), nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(x.size()[:-1] + (self.nf,))


class GPT2Attention(nn.Module):
    """GPT2Attention's eager path: fused c_attn, heads by view/transpose, a causal-mask buffer sliced
    by the sizes, optional past/mask/cache arguments, a tuple out."""

    def __init__(self, d: int = 16, h: int = 2, n_pos: int = 32):
        super().__init__()
        self.d, self.h, self.c_attn, self.c_proj = d, h, Conv1D(3 * d, d), Conv1D(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(n_pos, n_pos, dtype=torch.bool))[None, None])

    def forward(self, x, layer_past=None, attention_mask=None, use_cache=False):
        q, k, v = self.c_attn(x).split(self.d, 2)
        q, k, v = (z.view(z.size()[:-1] + (self.h, -1)).transpose(1, 2) for z in (q, k, v))
        if layer_past is not None:
            k = torch.cat((layer_past[0], k), dim=-2)
        w = q @ k.transpose(-1, -2) / (v.size(-1) ** 0.5)
        ql, kl = q.size(-2), k.size(-2)
        w = torch.where(self.bias[:, :, kl - ql : kl, :kl], w, torch.finfo(w.dtype).min)
        if attention_mask is not None:
            w = w + attention_mask
        a = (torch.softmax(w, -1) @ v).transpose(1, 2).reshape(x.shape)
        return self.c_proj(a), ((k, v) if use_cache else None)


class GPT2Model(nn.Module):
    """GPT2Model's layout: token and position embeddings on token ids, a pre-LN block, a dict or a
    tuple out."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(50, 16), nn.Embedding(32, 16)
        self.ln, self.attn = nn.LayerNorm(16), GPT2Attention()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, return_dict=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(-1)).unsqueeze(0)
        h = self.wte(input_ids) + self.wpe(position_ids)
        h = h + self.attn(self.ln(h), attention_mask=attention_mask)[0]
        return {"last_hidden_state": h} if return_dict else (h,)
