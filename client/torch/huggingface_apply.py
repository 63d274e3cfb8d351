"""Applying an answer to a HuggingFace GPT-2 or Llama model, keeping its class (issue 36).

``apply(model, sol, example_input=ids, seed=...)`` sends HuggingFace models here. The model returned
is a deep copy of the same class (``generate``, ``save_pretrained`` work) with:

* every attention module given a ``sigprop_mixer`` (a :class:`~.attention.ShapedAttention` holding the
  answer's matrix for the model's positions) and the model's attention implementation set to
  ``"sigprop"``, a function registered with ``transformers``' ``AttentionInterface`` that mixes the
  module's (rotated) queries, keys and values with it; grouped-query keys and values are repeated
  per query head as HuggingFace does; the KV cache of ``generate`` is read as the rows of the
  matrix of the new tokens. Query weights (and biases) are zero for E-SPA, U-SPA and
  Value-SkipInit, so the matrix at initialization is exactly the answer's;
* the MLP activation (``mlp.act``, ``mlp.act_fn``) a :class:`~.modules.TransformedActivation`;
* every dense node initialized as the answer says (GPT-2's fused ``c_attn`` block by block, its
  ``Conv1D`` weights transposed; grouped-query keys and values with the query's distribution on
  their own rows);
* norms at the identity (weight 1, bias 0); the residual adds left as HuggingFace writes them (the
  graph's sums describe them up to the stream's scale, which only norms read: ``huggingface``);
* the token (and position) embeddings drawn so the embeddings' output has mean square 1, the
  graph input's q; a tied LM head untied (``config.tie_word_embeddings = False``) and initialized as
  the answer's ``lm_head``: an embedding of mean square 1 is not a head of the answer's scale.

What was installed is written to ``model.config.sigprop`` (JSON: the activation, the attention
generators, the removed norms and shortcuts, the solved graph), so :func:`load_pretrained` rebuilds
it after ``save_pretrained``: ``from_pretrained`` alone gives the stock architecture (the
state dict's ``sigprop_mixer`` entries are then reported unused). :func:`normalization_free_hf`
is recipe 2's rewrite: norms to ``nn.Identity`` and blocks without shortcuts.
"""

from __future__ import annotations

import copy
import glob
import math
import os
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ...schemas.attention_init import expand_attention
from ...schemas.shapings import zero_query_shapings
from ..solution import as_solution
from .attention import ShapedAttention, _plain_mean
from .huggingface import HF_CLASSES, check_ids, read_huggingface
from .modules import TransformedActivation
from .rewrite import ActivationChange, ApplyReport, ConvertReport, LayerChange, _reinit

__all__ = ["apply_huggingface", "normalization_free_hf", "install", "load_pretrained", "forward_embeddings"]

_MAX_LEN = 2048  # the longest attention matrix stored (positions beyond it are refused at run time)


# -- the "sigprop" attention implementation -------------------------------------------------------


def _sigprop_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``transformers``' attention interface: ``query [B, H, tq, d]``, ``key``/``value``
    ``[B, H_kv, tk, d]`` -> ``([B, tq, H, d], None)``, mixing with the module's ``sigprop_mixer``
    (rows ``tk - tq .. tk`` of its matrix: the new tokens of a cached generation)."""
    mixer: ShapedAttention | None = getattr(module, "sigprop_mixer", None)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    tq, tk, d = query.shape[-2], key.shape[-2], query.shape[-1]
    mask = attention_mask[..., :tk] if isinstance(attention_mask, torch.Tensor) else None
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, -math.inf)
    if mixer is None:  # no answer installed here: plain causal attention
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, is_causal=mask is None)
        return out.transpose(1, 2).contiguous(), None
    if tk > mixer.max_len:
        raise ValueError(f"{tk} tokens is more than the {mixer.max_len} the sigprop attention matrices hold")
    off = tk - tq
    bias = mixer.bias[off:tk, :tk].to(query.dtype)
    if mask is not None:
        bias = bias + mask.to(query.dtype)
    scale = mixer.logit_scale(d, query.shape[1] * d)
    mixed = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale)
    out = (mixer.beta * mixer.scale[off:tk]).to(query.dtype)[:, None] * mixed
    if bool(mixer.identity != 0.0) or mixer.alpha.requires_grad:
        out = out + (mixer.alpha * mixer.identity).to(query.dtype) * value[..., off:tk, :]
    if bool(mixer.centre != 0.0):
        out = out - mixer.centre.to(query.dtype) * _plain_mean(value, True)[..., off:tk, :]
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("sigprop", _sigprop_attention)
    AttentionMaskInterface.register("sigprop", eager_mask)


# -- blocks without shortcuts ---------------------------------------------------------------------


def _gpt2_skipless(
    self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
    use_cache=False, past_key_values=None, **kwargs,
):  # fmt: skip
    """GPT2Block.forward without its two residual adds."""
    h = self.ln_1(hidden_states)
    cache = cache if cache is not None else past_key_values
    h, _ = self.attn(h, cache=cache, attention_mask=attention_mask, use_cache=use_cache, **kwargs)
    return self.mlp(self.ln_2(h))


def _llama_skipless(
    self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
    position_embeddings=None, past_key_values=None, **kwargs,
):  # fmt: skip
    """LlamaDecoderLayer.forward without its two residual adds."""
    h = self.input_layernorm(hidden_states)
    h, _ = self.self_attn(
        hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
        cache=cache if cache is not None else past_key_values, use_cache=use_cache,
        position_embeddings=position_embeddings, **kwargs,
    )  # fmt: skip
    return self.mlp(self.post_attention_layernorm(h))


def _skipless_class(cls: type) -> type:
    """A subclass of a block class whose forward has no shortcuts (kept at module level, by name,
    so a model holding one pickles)."""
    name = f"Skipless{cls.__name__}"
    found = globals().get(name)
    if found is None:
        forward = _gpt2_skipless if cls.__name__ == "GPT2Block" else _llama_skipless
        found = type(name, (cls,), {"forward": forward, "sigprop_skipless": True, "__module__": __name__})
        globals()[name] = found
    return found


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    family = HF_CLASSES[type(model).__name__]
    key = "h" if family == "gpt2" else "layers"
    return [(p, m) for p, m in model.named_modules() if p.rsplit(".", 2)[-2:-1] == [key] and p.split(".")[-1].isdigit()]


def _norm_paths(model: nn.Module) -> list[str]:
    family = HF_CLASSES[type(model).__name__]
    names = ("ln_1", "ln_2", "ln_f") if family == "gpt2" else ("input_layernorm", "post_attention_layernorm", "norm")
    return [p for p, m in model.named_modules() if p.split(".")[-1] in names and not isinstance(m, nn.Identity)]


def normalization_free_hf(model: nn.Module, *, skipless: bool = True) -> ConvertReport:
    """Recipe 2: a copy of a HuggingFace GPT-2 or Llama model without norms (``nn.Identity``) and,
    with ``skipless`` (the default; the graph refuses shortcuts without norms), blocks without
    residual shortcuts (their class a ``Skipless*`` subclass of the block's). The report names
    every norm removed and every block rewritten; ``config.sigprop`` records both for
    :func:`load_pretrained`."""
    if not skipless:
        raise ValueError("normalization_free of a HuggingFace model removes the shortcuts too (skipless=True)")
    read_huggingface(model, 1)  # refuses what the reader cannot map, by name
    net = copy.deepcopy(model)
    rec = dict(getattr(net.config, "sigprop", None) or {})
    removed = _norm_paths(net)
    rewritten = [p for p, m in _blocks(net) if not getattr(m, "sigprop_skipless", False)]
    rec["removed"] = sorted(set(rec.get("removed", [])) | set(removed))
    rec["skipless"] = sorted(set(rec.get("skipless", [])) | set(rewritten))
    net.config.sigprop = rec
    _install_structure(net)
    report = ConvertReport(net, removed=removed, shortcuts_removed=rewritten)
    report.notes.append(
        f"removed the residual shortcuts of {len(rewritten)} block(s): {', '.join(rewritten)} ({type(net).__name__} "
        "keeps its class; each block's is a Skipless* subclass of its own, rebuilt by "
        "sigprop.client.torch.load_pretrained after save_pretrained)"
    )
    _warn_gated(net, report)
    return report


def _warn_gated(net: nn.Module, report: ConvertReport) -> None:
    """A note and a warning for gated MLPs (Llama's SwiGLU) without norms: ``down(act(gate h) * up h)``
    multiplies two projections of the same stream, so a block about squares a token's scale (the q
    map's slope is about 2 at q = 1, against 1 for GPT-2's MLP) and a token's finite-width deviation
    of log q doubles per block (the answer's own warning states the slope, ``engine.network.q_map``):
    measured on the 6-block Llama at width 1024 (8 networks, 64 tokens, dks zeta 73.6), the output
    tokens' q ranges over 0.39 to 76."""
    gated = [p for p, m in net.named_modules() if hasattr(m, "gate_proj") and hasattr(m, "up_proj")]
    if not gated:
        return
    note = (
        f"{len(gated)} gated MLP(s) without norms ({gated[0]}{', ...' if len(gated) > 1 else ''}): "
        "act(gate_proj(h)) * up_proj(h) multiplies two projections of the same stream, so each block about "
        "squares a token's scale and a token's finite-width deviation of log q doubles per block (the q map's "
        "slope at q = 1 is 2^blocks; measured at 6 blocks, width 1024: output tokens' q from 0.39 to 76 over 8 "
        "networks); keep the norms (recipe 1) for gated MLPs"
    )
    report.notes.append(note)
    warnings.warn(note, stacklevel=4)  # the caller of normalization_free


# -- what config.sigprop records ------------------------------------------------------------------


def _install_structure(model: nn.Module) -> None:
    rec = getattr(model.config, "sigprop", None) or {}
    for path in rec.get("removed", []):
        if not isinstance(model.get_submodule(path), nn.Identity):
            model.set_submodule(path, nn.Identity())
    for path in rec.get("skipless", []):
        block = model.get_submodule(path)
        if not getattr(block, "sigprop_skipless", False):
            block.__class__ = _skipless_class(type(block))


def install(model: nn.Module) -> nn.Module:
    """Rebuild in ``model`` (a HuggingFace model of the right architecture) what ``config.sigprop``
    records: removed norms and shortcuts, the transformed activation, the attention mixers with their
    answer's matrices, the ``"sigprop"`` attention implementation. Weights are not touched."""
    rec = getattr(model.config, "sigprop", None) or {}
    _install_structure(model)
    if rec.get("activation"):
        for path in rec.get("activations", []):
            model.set_submodule(path, TransformedActivation(**rec["activation"]))
    for a in rec.get("attention", {}).values():
        mixer = ShapedAttention(a["heads"], a["max_len"], True, d_model=a["d_model"])
        gen = a.get("generator")
        if gen is not None:
            mixer.load_init(expand_attention(gen, a["max_len"], True), gen.get("form") == "value_skipinit")
        mixer.to(next(model.parameters()).device)
        model.get_submodule(a["path"]).add_module("sigprop_mixer", mixer)
    if rec.get("attention"):
        _register()
        model.config._attn_implementation_internal = "sigprop"
        for m in model.modules():  # sub-models holding their own config
            cfg = getattr(m, "config", None)
            if cfg is not None and cfg is not model.config and hasattr(cfg, "_attn_implementation_internal"):
                cfg._attn_implementation_internal = "sigprop"
    if rec.get("graph"):
        model.sigprop_sequence = {
            "graph": rec["graph"],
            "attention": {gid: f"{a['path']}.sigprop_mixer" for gid, a in rec.get("attention", {}).items()},
            "probes": _probes(rec),
            "huggingface": {"embed_out": rec["embed_out"]},
        }
    return model


def _probes(rec: dict) -> dict:
    probes = {}
    for nd in rec["graph"]["nodes"]:
        gid, op = nd["id"], nd["op"]
        if op in ("layer_norm", "rms_norm", "activation") and gid not in rec.get("removed", []):
            probes[gid] = (gid, op)
    return probes


def load_pretrained(path: str, cls: type | None = None, **kwargs) -> nn.Module:
    """``from_pretrained`` of a model ``apply`` (or ``normalization_free``) returned and
    ``save_pretrained`` wrote: the stock class loads the weights, :func:`install` rebuilds what
    ``config.sigprop`` records, and the state dict's sigprop entries (the mixers' matrices, a
    trained Value-SkipInit alpha and beta, a trainable slope) are loaded on top."""
    import transformers
    from safetensors.torch import load_file

    if cls is None:
        config = transformers.AutoConfig.from_pretrained(path)
        cls = getattr(transformers, (config.architectures or [""])[0], None)
        if cls is None:
            raise ValueError(f"the config at {path} names no transformers class ({config.architectures}); pass cls=")
    model = cls.from_pretrained(path, **kwargs)
    install(model)
    state = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        state.update(load_file(file))
    own = model.state_dict()
    extra = {k: v for k, v in state.items() if ("sigprop_mixer." in k or k.endswith("negative_slope")) and k in own}
    model.load_state_dict(extra, strict=False)
    return model


# -- apply ----------------------------------------------------------------------------------------


def _init_part(part, layer, generator) -> str:
    """Initialize a dense part's rows (``Conv1D`` columns) as answer layer ``layer`` says."""
    m = part.module
    rows, fan_in = part.hi - part.lo, int(m.weight.shape[0] if part.conv1d else m.weight.shape[1])
    has_bias = getattr(m, "bias", None) is not None
    tmp = SimpleNamespace(weight=torch.empty(rows, fan_in), bias=torch.empty(rows) if has_bias else None)
    bias = _reinit(tmp, layer, generator)
    with torch.no_grad():
        w = m.weight
        if part.conv1d:
            w[:, part.lo : part.hi] = tmp.weight.t().to(w)
        else:
            w[part.lo : part.hi] = tmp.weight.to(w)
        if has_bias:
            m.bias[part.lo : part.hi] = tmp.bias.to(m.bias)
    return bias


def _zero_part(part) -> None:
    m = part.module
    with torch.no_grad():
        if part.conv1d:
            m.weight[:, part.lo : part.hi] = 0.0
        else:
            m.weight[part.lo : part.hi] = 0.0
        if getattr(m, "bias", None) is not None:
            m.bias[part.lo : part.hi] = 0.0


def _untie_head(model: nn.Module, report: ApplyReport) -> None:
    head = getattr(model, "lm_head", None)
    emb = model.get_input_embeddings()
    if head is None or head.weight is not emb.weight:
        return
    head.weight = nn.Parameter(head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    for cfg in (getattr(model.config, "get_text_config", lambda: None)(),):
        if cfg is not None and cfg is not model.config:
            cfg.tie_word_embeddings = False
    report.notes.append(
        "lm_head untied from the token embeddings (config.tie_word_embeddings = False): the embeddings are drawn "
        "at mean square 1 (the graph input's q) and the head as the answer's lm_head, which one tied matrix cannot be"
    )


def _init_embeddings(model: nn.Module, read, generator, report: ApplyReport) -> None:
    std = 1.0 / math.sqrt(len(read.embeddings))
    with torch.no_grad():
        for path in read.embeddings:
            model.get_submodule(path).weight.normal_(0.0, std, generator=generator)
    report.notes.append(
        f"embeddings {', '.join(read.embeddings)} drawn N(0, {std**2:g}): the embeddings' output (the graph input) "
        "has mean square 1 per feature"
    )


def apply_huggingface(model: nn.Module, solution, *, graph, example_input, seed, residual: str) -> ApplyReport:
    """``apply`` for a HuggingFace GPT-2 or Llama model (module docstring)."""
    from .sequence_apply import answer_part

    if residual != "graph":
        raise ValueError("residual='recommended' is not available for HuggingFace models: their adds stay x + F(x)")
    sol = as_solution(solution)
    target = copy.deepcopy(model)
    if example_input is not None:
        t = check_ids(target, example_input)
    elif graph is not None:
        t = int(next(nd for nd in graph["nodes"] if nd["op"] == "input")["shape"][0])
    else:
        raise ValueError("apply needs example_input (token ids) or the graph the answer was solved for")
    read = read_huggingface(target, t)
    if graph is not None:
        ours, theirs = [nd["id"] for nd in read.graph["nodes"]], [nd["id"] for nd in graph["nodes"]]
        if ours != theirs:
            raise ValueError("the graph given is not this model's (graph_from_module(model, ids) gives its graph)")
    attention = answer_part(solution, "attention") or {}
    generators = {e["node"]: e["generator"] for e in attention.get("layers", [])}
    shaping = attention.get("shaping")
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    report = ApplyReport(model=target, method=sol.method, activation=sol.activation, residual=residual)
    act = TransformedActivation.from_solution(sol)
    limit = getattr(target.config, "max_position_embeddings", None) or getattr(target.config, "n_positions", t)
    max_len = max(t, min(int(limit), _MAX_LEN))
    rec = dict(getattr(target.config, "sigprop", None) or {})
    rec.update(
        version=1,
        activation={"name": act.name, "input_scale": act.input_scale, "input_shift": act.input_shift,
                    "output_scale": act.output_scale, "output_shift": act.output_shift, **act._params,
                    "trainable_slope": isinstance(getattr(act, "negative_slope", None), nn.Parameter)},
        activations=list(read.activations.values()),
        attention={gid: {"path": a["path"], "heads": a["heads"], "max_len": max_len, "d_model": read.width,
                         "generator": generators.get(gid)} for gid, a in read.attention.items()},
        graph=copy.deepcopy(dict(graph) if graph is not None else read.graph),
        embed_out=read.embed_out,
    )  # fmt: skip
    target.config.sigprop = rec
    install(target)
    for gid, path in read.activations.items():
        report.activations.append(ActivationChange(gid, path, f"{read.fn} ({read.family})", repr(act)))
    for gid, a in read.attention.items():
        gen = generators.get(gid)
        if gen is None:
            report.missing_layers.append(gid)
            report.warnings.append(f"attention '{gid}' has no generator in the answer: left as plain attention")
        form = gen.get("form") if gen else "plain"
        report.notes.append(
            f"attention '{gid}': {a['path']}.sigprop_mixer = ShapedAttention(heads={a['heads']}), {form}"
        )
    zero = {g for g, p in read.parts.items() if p.role == "query"} if shaping in zero_query_shapings() else set()
    by_id = {layer.id: layer for layer in sol.layers}
    for gid, part in read.parts.items():
        layer = by_id.pop(gid, None)
        if gid in zero:
            _zero_part(part)
            report.layers.append(LayerChange(gid, part.path, "dense", "zeros (query)", 0.0, 0.0, "zeros"))
            continue
        if layer is None:
            report.uninitialized.append(f"{part.path} rows {part.lo}:{part.hi} (not in the answer)")
            continue
        if layer.fan_out != part.units:
            report.missing_layers.append(gid)
            report.warnings.append(f"answer layer '{gid}' has {layer.fan_out} units, the model {part.units}")
            continue
        if gid == "lm_head":
            _untie_head(target, report)
        bias = _init_part(part, layer, generator)
        report.layers.append(
            LayerChange(gid, part.path, "dense", layer.distribution, layer.gain, layer.weight_variance, bias,
                        layer.bias_variance)
        )  # fmt: skip
        if part.repeat > 1:
            report.notes.append(
                f"'{gid}': {part.hi - part.lo} rows serve {part.units} query features (grouped-query attention: "
                f"each key-value head repeated {part.repeat} times)"
            )
    for layer in by_id.values():
        report.missing_layers.append(layer.id)
    _init_embeddings(target, read, generator, report)
    with torch.no_grad():
        for path in read.norms.values():
            m = target.get_submodule(path)
            m.weight.fill_(1.0)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()
    report.notes.append(f"{len(read.norms)} norm(s) at the identity (weight 1, bias 0)")
    if read.sums:
        report.notes.append(
            f"{len(read.sums)} residual add(s) kept as x + F(x): the graph's sums are the normalized weights that "
            "compute the same stream up to a scale, which only the norms after them read"
        )
    report.notes.append(
        "config.sigprop records the recipe: reload a saved model with sigprop.client.torch.load_pretrained(path)"
    )
    target.train(model.training)
    return report


def forward_embeddings(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's output (logits, or the last hidden state of a bare model) with the embeddings'
    output replaced by ``x`` ``[batch, tokens, width]``: what ``diagnose`` feeds an applied model."""
    info = model.sigprop_sequence["huggingface"]
    site = model.get_submodule(info["embed_out"])
    x = x.contiguous()
    hook = site.register_forward_hook(lambda _m, _i, _o: x.to(_o.dtype))
    try:
        ids = torch.zeros(x.shape[0], x.shape[1], dtype=torch.long, device=x.device)
        out = model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
