"""HuggingFace ``transformers`` GPT-2 and Llama models read as sequence graphs (issue 36).

``graph_from_module(model, ids)`` sends ``GPT2LMHeadModel``, ``GPT2Model``, ``LlamaForCausalLM`` and
``LlamaModel`` here (``ids``: a LongTensor ``[batch, tokens]``). The models are not traced: a reader
per family walks their modules, whose layout ``transformers`` fixes, and maps each part to graph
ops. The graph's ``sequence`` input (id ``embeddings``) is the embeddings' output (``wte + wpe`` for
GPT-2, ``embed_tokens`` for Llama); dropout is the identity.

- GPT-2 block ``h.i``: ``ln_1`` layer_norm; ``attn.c_attn`` (a ``Conv1D``: a transposed Linear with
  q|k|v fused) three dense nodes ``attn.c_attn.q/.k/.v``; ``attn`` attention (heads, causal);
  ``attn.c_proj`` dense; the residual sum ``residual_1``; ``ln_2``; ``mlp.c_fc`` dense, ``mlp.act``
  activation (``gelu_new`` is the catalogue's ``gelu_tanh``), ``mlp.c_proj`` dense, ``residual_2``;
  then ``ln_f`` and the ``lm_head`` dense.
- Llama layer ``layers.i``: ``input_layernorm`` rms_norm; ``self_attn.q_proj/k_proj/v_proj``
  dense; ``self_attn`` attention; ``o_proj``; ``residual_1``; ``post_attention_layernorm``;
  ``mlp.gate_proj`` dense, ``mlp.act_fn`` activation, ``mlp.up_proj`` dense, ``mlp.mul`` (the
  SwiGLU gate), ``mlp.down_proj`` dense; ``residual_2``; then ``norm`` and ``lm_head``. Rotary
  embeddings act on queries and keys only: with zero queries at initialization the attention is
  the mask's average whatever the rotation, so they are not in the graph. Grouped-query attention
  (``num_key_value_heads < num_attention_heads``): the key and value dense nodes have the query's
  units, as if each key-value head were computed once per query head it serves. A repeated value
  head has the kernel of its copy coordinate by coordinate, and the keys do not matter at zero
  queries, so the infinite-width kernel is the model's; the finite-width noise is that of the
  ``num_key_value_heads * head_dim`` independent value coordinates.

Residual adds are HuggingFace's plain ``x + F(x)``, which ``apply`` leaves as they are. Every reader
of the residual stream but the next add is a norm, which does not see the stream's scale, so the
graph's sums are the normalized weighting that computes the same stream up to a scale
(``sigprop.client.scaled_sums``): ``[sqrt(l / (l + 1)), sqrt(1 / (l + 1))]`` for the l-th add
after the embeddings (``[1/sqrt(2), 1/sqrt(2)]``, then ``[sqrt(2/3), sqrt(1/3)]``, ...). A model
with shortcuts but no norms (its adds read by dense layers) is refused: the stream's scale would
then matter. ``normalization_free`` (``huggingface_apply``) removes both.

Refused by name: other HuggingFace architectures, cross-attention (``add_cross_attention``),
activations outside the catalogue, and sequences longer than the model's positions. This module
never imports ``transformers`` itself: a model is recognised only when ``transformers`` is already
imported (it must be, for the model to exist).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from ...schemas.errors import SigpropError
from ..scaled_sums import ScaledSums

__all__ = ["HF_CLASSES", "HFPart", "HFRead", "is_huggingface", "read_huggingface", "hf_activation", "check_ids"]

# the model classes read, by family
HF_CLASSES = {
    "GPT2LMHeadModel": "gpt2",
    "GPT2Model": "gpt2",
    "LlamaForCausalLM": "llama",
    "LlamaModel": "llama",
}
_HINT = (
    "sigprop reads HuggingFace GPT2LMHeadModel, GPT2Model, LlamaForCausalLM and LlamaModel (docs/transformers.md); "
    "write other architectures with nn.Linear and F.scaled_dot_product_attention, or write the graph by hand"
)
# HuggingFace activation names (ACT2FN) -> the catalogue's
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "swish",
    "swish": "swish",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
}


def is_huggingface(model) -> bool:
    """Whether ``model`` is a ``transformers`` model (without importing ``transformers``)."""
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(model, nn.Module):
        return False
    base = getattr(tf, "PreTrainedModel", None)
    return base is not None and isinstance(model, base)


def hf_activation(name: str, where: str) -> str:
    """The catalogue name of a HuggingFace activation name (``config.activation_function``)."""
    if name not in _ACTIVATIONS:
        raise SigpropError(
            "unsupported_op",
            f"module '{where}' computes the HuggingFace activation {name!r}, which has no catalogue entry",
            f"use one of {', '.join(sorted(_ACTIVATIONS))}",
        )
    return _ACTIVATIONS[name]


@dataclass
class HFPart:
    """A dense node: rows ``lo:hi`` of an ``nn.Linear``'s weight, or columns of a ``Conv1D``'s
    (GPT-2's transposed Linear, weight ``[in, out]``). ``units`` is the graph's (grouped-query
    keys and values: the query's, ``repeat`` times the module's rows)."""

    gid: str
    path: str
    module: nn.Module
    lo: int
    hi: int
    conv1d: bool
    units: int
    role: str = "dense"  # "query", "key", "value", "dense", "head"

    @property
    def repeat(self) -> int:
        return self.units // (self.hi - self.lo)


@dataclass
class HFRead:
    """What the reader found: the graph and, by graph id, the modules apply changes."""

    family: str
    graph: dict
    seq_len: int
    width: int
    parts: dict = field(default_factory=dict)  # dense gid -> HFPart
    attention: dict = field(default_factory=dict)  # attention gid -> dict(path, heads, kv_heads, d_model)
    norms: dict = field(default_factory=dict)  # layer_norm / rms_norm gid -> module path
    activations: dict = field(default_factory=dict)  # activation gid -> module path (the act module)
    sums: dict = field(default_factory=dict)  # sum gid -> block path
    embeddings: list = field(default_factory=list)  # embedding module paths
    embed_out: str = ""  # the module whose output is the graph's input
    fn: str = ""  # the catalogue activation the model computes
    prefix: str = ""  # path of the bare model inside a *ForCausalLM / *LMHeadModel


def check_ids(model: nn.Module, ids) -> int:
    """The token count of an example batch of ids (a LongTensor ``[batch, tokens]``)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
        raise TypeError(
            f"a HuggingFace {type(model).__name__} reads token ids: give a LongTensor [batch, tokens], "
            f"not {type(ids).__name__}"
            + (f" of shape {list(ids.shape)} and dtype {ids.dtype}" if isinstance(ids, torch.Tensor) else "")
        )
    t = int(ids.shape[1])
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit is not None and t > int(limit):
        raise SigpropError(
            "invalid_graph",
            f"{t} tokens is more than {type(model).__name__}'s {limit} positions",
            "give an example batch no longer than the model's positions",
        )
    return t


class _Builder:
    def __init__(self, read: HFRead):
        self.read, self.nodes, self.sums = read, [], ScaledSums()

    def add(self, gid: str, op: str, inputs: list, **attrs) -> str:
        self.nodes.append({"id": gid, "op": op, "inputs": list(inputs), **attrs})
        return gid

    def dense(self, gid, src, path, module, lo=0, hi=None, units=None, role="dense") -> str:
        conv1d = type(module).__name__ == "Conv1D"
        out = int(module.weight.shape[1] if conv1d else module.weight.shape[0])
        hi = out if hi is None else hi
        units = hi - lo if units is None else units
        self.read.parts[gid] = HFPart(gid, path, module, lo, hi, conv1d, units, role)
        return self.add(gid, "dense", [src], units=int(units), bias=getattr(module, "bias", None) is not None)

    def norm(self, src: str, path: str, module: nn.Module) -> str:
        name = type(module).__name__
        if isinstance(module, nn.Identity):
            return src
        if isinstance(module, nn.LayerNorm):
            op = "layer_norm"
        elif name.endswith("RMSNorm") or isinstance(module, nn.RMSNorm):
            op = "rms_norm"
        else:
            raise SigpropError("unsupported_op", f"module '{path}' ({name}) is not a LayerNorm or RMSNorm", _HINT)
        self.read.norms[path] = path
        return self.add(path, op, [src])

    def residual(self, gid: str, block: str, stream: str, branch: str, block_module: nn.Module) -> str:
        if getattr(block_module, "sigprop_skipless", False):
            return branch
        node = {"id": gid, "op": "sum", "inputs": [stream, branch]}
        self.nodes.append(node)
        self.sums.add(node, [stream, branch], [1.0, 1.0])
        self.read.sums[gid] = block
        return gid

    def finish(self, stream: str, final_norm: str, head_path: str | None, head: nn.Module | None) -> dict:
        if final_norm == stream and self.read.sums:
            raise SigpropError(
                "unsupported_op",
                f"the residual stream of {self.read.family} is read by '{head_path or 'the output'}' without a norm",
                "with shortcuts, keep the norms; normalization_free(model) removes norms and shortcuts together",
            )
        out = final_norm
        if head is not None:
            out = self.dense(head_path, final_norm, head_path, head, role="head")
        self.add("output", "output", [out])
        self.sums.finalize()
        return {"schema": "sigprop.graph/v1", "nodes": self.nodes}


def _refuse_norm_free_shortcuts(block_path: str, block: nn.Module, norms: tuple) -> None:
    if getattr(block, "sigprop_skipless", False):
        return
    if any(isinstance(m, nn.Identity) for m in norms):
        raise SigpropError(
            "unsupported_op",
            f"module '{block_path}' ({type(block).__name__}) keeps its residual adds without its norms: the adds' "
            "output is read by dense layers, where the stream's growing scale matters",
            "with shortcuts, keep the norms; normalization_free(model) removes norms and shortcuts together",
        )


def _read_gpt2(model: nn.Module, read: HFRead) -> dict:
    cfg = model.config
    base, prefix = (model.transformer, "transformer.") if hasattr(model, "transformer") else (model, "")
    read.prefix, read.embeddings, read.embed_out = prefix, [f"{prefix}wte", f"{prefix}wpe"], f"{prefix}drop"
    read.fn = hf_activation(cfg.activation_function, f"{prefix}h.0.mlp.act")
    b = _Builder(read)
    stream = b.add("embeddings", "input", [], shape=[read.seq_len, read.width], sequence=True)
    del b.nodes[-1]["inputs"]
    for i, block in enumerate(base.h):
        p = f"{prefix}h.{i}"
        if getattr(cfg, "add_cross_attention", False) or hasattr(block, "crossattention"):
            raise SigpropError(
                "unsupported_op",
                f"module '{p}.crossattention' (GPT2Attention, cross-attention: config.add_cross_attention=True) "
                "is not supported: its keys and values read the encoder's states, which the graph does not have",
                "self-attention only: build the model with add_cross_attention=False",
            )
        _refuse_norm_free_shortcuts(p, block, (block.ln_1, block.ln_2))
        attn, e = block.attn, int(block.attn.embed_dim)
        a = b.norm(stream, f"{p}.ln_1", block.ln_1)
        qkv = [
            b.dense(f"{p}.attn.c_attn.{r}", a, f"{p}.attn.c_attn", attn.c_attn, k * e, (k + 1) * e, role=role)
            for k, (r, role) in enumerate((("q", "query"), ("k", "key"), ("v", "value")))
        ]
        att = b.add(f"{p}.attn", "attention", qkv, heads=int(attn.num_heads), causal=True)
        read.attention[att] = {"path": f"{p}.attn", "heads": int(attn.num_heads), "kv_heads": int(attn.num_heads)}
        proj = b.dense(f"{p}.attn.c_proj", att, f"{p}.attn.c_proj", attn.c_proj)
        stream = b.residual(f"{p}.residual_1", p, stream, proj, block)
        h = b.norm(stream, f"{p}.ln_2", block.ln_2)
        fc = b.dense(f"{p}.mlp.c_fc", h, f"{p}.mlp.c_fc", block.mlp.c_fc)
        act = b.add(f"{p}.mlp.act", "activation", [fc])
        read.activations[act] = f"{p}.mlp.act"
        out = b.dense(f"{p}.mlp.c_proj", act, f"{p}.mlp.c_proj", block.mlp.c_proj)
        stream = b.residual(f"{p}.residual_2", p, stream, out, block)
    final = b.norm(stream, f"{prefix}ln_f", base.ln_f)
    head = getattr(model, "lm_head", None)
    return b.finish(stream, final, "lm_head" if head is not None else None, head)


def _read_llama(model: nn.Module, read: HFRead) -> dict:
    cfg = model.config
    base, prefix = (model.model, "model.") if hasattr(model, "lm_head") else (model, "")
    read.prefix, read.embeddings, read.embed_out = prefix, [f"{prefix}embed_tokens"], f"{prefix}embed_tokens"
    read.fn = hf_activation(cfg.hidden_act, f"{prefix}layers.0.mlp.act_fn")
    b = _Builder(read)
    stream = b.add("embeddings", "input", [], shape=[read.seq_len, read.width], sequence=True)
    del b.nodes[-1]["inputs"]
    for i, layer in enumerate(base.layers[: cfg.num_hidden_layers]):
        p = f"{prefix}layers.{i}"
        _refuse_norm_free_shortcuts(p, layer, (layer.input_layernorm, layer.post_attention_layernorm))
        if (
            getattr(cfg, "sliding_window", None)
            or getattr(cfg, "layer_types", None) not in (None, [])
            and any(t != "full_attention" for t in cfg.layer_types)
        ):
            raise SigpropError(
                "unsupported_op",
                f"module '{p}.self_attn' ({type(layer.self_attn).__name__}, sliding-window attention)"
                " is not supported: "
                "the graph's attention is causal over every earlier token",
                "use full causal attention",
            )
        sa = layer.self_attn
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        width_q = heads * int(sa.head_dim)
        a = b.norm(stream, f"{p}.input_layernorm", layer.input_layernorm)
        q = b.dense(f"{p}.self_attn.q_proj", a, f"{p}.self_attn.q_proj", sa.q_proj, role="query")
        k = b.dense(f"{p}.self_attn.k_proj", a, f"{p}.self_attn.k_proj", sa.k_proj, units=width_q, role="key")
        v = b.dense(f"{p}.self_attn.v_proj", a, f"{p}.self_attn.v_proj", sa.v_proj, units=width_q, role="value")
        att = b.add(f"{p}.self_attn", "attention", [q, k, v], heads=heads, causal=True)
        read.attention[att] = {"path": f"{p}.self_attn", "heads": heads, "kv_heads": kv}
        proj = b.dense(f"{p}.self_attn.o_proj", att, f"{p}.self_attn.o_proj", sa.o_proj)
        stream = b.residual(f"{p}.residual_1", p, stream, proj, layer)
        h = b.norm(stream, f"{p}.post_attention_layernorm", layer.post_attention_layernorm)
        mlp = layer.mlp
        gate = b.dense(f"{p}.mlp.gate_proj", h, f"{p}.mlp.gate_proj", mlp.gate_proj)
        act = b.add(f"{p}.mlp.act_fn", "activation", [gate])
        read.activations[act] = f"{p}.mlp.act_fn"
        up = b.dense(f"{p}.mlp.up_proj", h, f"{p}.mlp.up_proj", mlp.up_proj)
        mul = b.add(f"{p}.mlp.mul", "mul", [act, up])
        out = b.dense(f"{p}.mlp.down_proj", mul, f"{p}.mlp.down_proj", mlp.down_proj)
        stream = b.residual(f"{p}.residual_2", p, stream, out, layer)
    final = b.norm(stream, f"{prefix}norm", base.norm)
    head = getattr(model, "lm_head", None)
    return b.finish(stream, final, "lm_head" if head is not None else None, head)


def read_huggingface(model: nn.Module, seq_len: int) -> HFRead:
    """The graph of a HuggingFace GPT-2 or Llama model for ``seq_len`` tokens and the modules of
    its nodes (module docstring); other HuggingFace models are refused by name."""
    name = type(model).__name__
    family = HF_CLASSES.get(name)
    if family is None:
        attn = next(
            (f"'{p}' ({type(m).__name__})" for p, m in model.named_modules() if "Attention" in type(m).__name__), None
        )
        raise SigpropError(
            "unsupported_op",
            f"HuggingFace {name} is not supported"
            + (f" (its attention module {attn} has no reader)" if attn else "")
            + ": only the GPT-2 and Llama families are mapped to graph ops",
            _HINT,
        )
    width = int(model.config.hidden_size)
    read = HFRead(family, {}, int(seq_len), width)
    read.graph = _read_gpt2(model, read) if family == "gpt2" else _read_llama(model, read)
    return read
