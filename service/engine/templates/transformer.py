"""The ``transformer`` template: a stack of self-attention + MLP blocks on a token stream.

After "Deep Transformers without Shortcuts: Modifying Self-attention for Faithful Signal
Propagation" (He, Martens et al., arXiv:2302.10322), whose point is training such stacks without
shortcuts and without normalization: both are switches here, off by default.

Block ``i`` (node ids as listed; ``h`` is the block input, ``x`` for the first block)::

    [b{i}.ln1 = layer_norm(h)]                              (norms: pre-LN)
    b{i}.q, b{i}.k, b{i}.v = dense(width) of ln1 (or h)
    b{i}.attn = attention(q, k, v; heads, causal)
    b{i}.proj = dense(width)
    [b{i}.res1 = w_skip h + w_branch proj]                  (shortcuts)
    [b{i}.ln2 = layer_norm(res1 or proj)]                   (norms)
    b{i}.fc1 = dense(mlp_ratio * width) -> b{i}.act -> b{i}.fc2 = dense(width)
    [b{i}.res2 = w_skip res1 + w_branch fc2]                (shortcuts)

then ``out``, the output node. The input ``x`` is a sequence of shape ``[seq_len, width]`` (the
embedding's output). With shortcuts, ``w_skip`` is ``shortcut_weight`` (default sqrt(1/2): equal
branches, the resnet template's default and a ``sum`` node's without weights) and
``w_branch = sqrt(1 - w_skip^2)``, so every sum is a normalized sum (q stays 1 without norms).
"""

from __future__ import annotations

import math

from sigprop.schemas import Template

from .builder import _DEPTH_LIMIT, TemplateSize, _bad, _Builder, _param, _require_depth

__all__ = [
    "TRANSFORMER_DESCRIPTION",
    "TRANSFORMER_PARAMETERS",
    "TRANSFORMER_RULES",
    "transformer",
    "transformer_param",
    "transformer_size",
]

DEFAULTS = {
    "seq_len": 128,
    "width": 512,
    "heads": 8,
    "mlp_ratio": 4,
    "causal": True,
    "shortcuts": False,
    "norms": False,
}
SHORTCUT_WEIGHT = math.sqrt(0.5)

TRANSFORMER_DESCRIPTION = (
    "Transformer blocks on a token stream [seq_len, width]: self-attention (dense q, k, v, proj) then an MLP "
    "(dense mlp_ratio*width -> activation -> dense width); shortcuts and pre-LN layer norms are switches, off by "
    "default (He et al., arXiv:2302.10322). Solving it needs the request's 'attention' shaping."
)
TRANSFORMER_PARAMETERS = (
    _param("depth", "integer", "number of blocks (attention + MLP)", required=True, minimum=1, maximum=_DEPTH_LIMIT),
    _param("seq_len", "integer", "tokens per sequence (T)", default=DEFAULTS["seq_len"], minimum=1),
    _param("width", "integer", "features per token (d_model)", default=DEFAULTS["width"], minimum=1),
    _param("heads", "integer", "attention heads; must divide width", default=DEFAULTS["heads"], minimum=1),
    _param("mlp_ratio", "integer", "hidden units of the MLP per width", default=DEFAULTS["mlp_ratio"], minimum=1),
    _param("causal", "boolean", "causal (decoder) attention", default=DEFAULTS["causal"]),
    _param("shortcuts", "boolean", "residual sums around attention and MLP", default=DEFAULTS["shortcuts"]),
    _param("norms", "boolean", "pre-LN layer norms before attention and MLP", default=DEFAULTS["norms"]),
    _param(
        "shortcut_weight",
        "number",
        "with shortcuts: weight of the skip branch (the residual branch gets sqrt(1 - w^2)); default sqrt(1/2)",
        default=SHORTCUT_WEIGHT,
        minimum=0.0,
        maximum=1.0,
    ),
)


# shortcut_weight only with shortcuts (the OpenAPI description states it; heads dividing width it cannot)
TRANSFORMER_RULES = (
    {
        "if": {"properties": {"shortcut_weight": {"type": "number"}}, "required": ["shortcut_weight"]},
        "then": {"properties": {"shortcuts": {"const": True}}, "required": ["shortcuts"]},
    },
)


def transformer_param(t: Template, name: str):
    """A parameter of the template, its default when not given."""
    value = getattr(t, name)
    return DEFAULTS[name] if value is None else value


def transformer_size(t: Template) -> TemplateSize | None:
    if t.depth is None:
        return None
    shortcuts, norms = transformer_param(t, "shortcuts"), transformer_param(t, "norms")
    # q, k, v, attn, proj, fc1, act, fc2 (+ res1, res2) (+ ln1, ln2)
    per_block = 8 + 2 * shortcuts + 2 * norms
    nodes = 2 + t.depth * per_block
    # inputs: q, k, v, proj, fc1, act, fc2 one each, attn three, (sums two each), (norms one each)
    edges = t.depth * (10 + 4 * shortcuts + 2 * norms) + 1
    return TemplateSize(nodes, t.depth, 2 if shortcuts else 1, edges)


def transformer(t: Template) -> _Builder:
    depth = _require_depth(t, "blocks (attention + MLP)", '{"template": "transformer", "depth": 12}')
    seq_len, width, heads, mlp_ratio, causal, shortcuts, norms = (
        transformer_param(t, name)
        for name in ("seq_len", "width", "heads", "mlp_ratio", "causal", "shortcuts", "norms")
    )
    hidden = mlp_ratio * width
    if width % heads:
        raise _bad(f"transformer width {width} is not a multiple of heads {heads}", "give a width that heads divides")
    w_skip = float(t.shortcut_weight) if t.shortcut_weight is not None else SHORTCUT_WEIGHT
    if t.shortcut_weight is not None and not shortcuts:
        raise _bad("shortcut_weight needs shortcuts", 'set "shortcuts": true, or leave shortcut_weight out')
    w_branch = math.sqrt(1.0 - w_skip * w_skip)
    b = _Builder("transformer")
    h = b._add({"id": "x", "op": "input", "shape": [seq_len, width], "sequence": True}, (seq_len, width))
    attention_key = ("attention", heads, type(heads), causal, type(causal))
    for i in range(depth):
        p = f"b{i}."
        a = _norm(b, p + "ln1", h) if norms else h
        qkv = [_dense(b, p + name, a, width) for name in ("q", "k", "v")]
        attn = b._add(
            {"id": p + "attn", "op": "attention", "inputs": qkv, "heads": heads, "causal": causal},
            (seq_len, width),
            attention_key,
        )
        x = _dense(b, p + "proj", attn, width)
        if shortcuts:
            x = b.sum(p + "res1", [h, x], [w_skip, w_branch])
        m = _norm(b, p + "ln2", x) if norms else x
        m = _dense(b, p + "fc1", m, hidden)
        m = b.act(p + "act", m)
        m = _dense(b, p + "fc2", m, width)
        h = b.sum(p + "res2", [x, m], [w_skip, w_branch]) if shortcuts else m
    b.simple("out", "output", h)
    return b


def _dense(b: _Builder, nid: str, src: str, units: int) -> str:
    key = ("dense", units, type(units), True, bool)
    seq_len = b.shapes[src][0]
    return b._add({"id": nid, "op": "dense", "inputs": [src], "units": units, "bias": True}, (seq_len, units), key)


def _norm(b: _Builder, nid: str, src: str) -> str:
    return b._add({"id": nid, "op": "layer_norm", "inputs": [src]}, b.shapes[src], ("layer_norm",))
