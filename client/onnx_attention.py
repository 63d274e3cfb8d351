"""Attention in ONNX sequence models, for ``sigprop.client.onnx.graph_from_onnx``.

A model whose input is ``[batch, tokens, features]`` is read as a sequence model (per-token
``MatMul``/``Gemm`` -> ``dense``, ``LayerNormalization`` over the features -> ``layer_norm``). Its
attention is found in one of two forms, before the nodes are read:

- the pattern exporters write for ``softmax(q k^T / sqrt(d_head) + mask) v``: a ``MatMul`` of two
  network tensors (the scores), scalar ``Mul``/``Div`` and an additive mask (``Add`` of a constant
  tensor, or ``Where`` on a constant condition: ``masked_fill``), ``Softmax`` over the last axis, and
  a ``MatMul`` of the probabilities by the values;
- the opset-23 ``Attention`` op (``torch.onnx.export(..., opset_version=23)`` writes
  ``F.scaled_dot_product_attention`` as one), on 4-d heads or 3-d inputs with ``q_num_heads``.

Queries, keys and values are traced back through the head plumbing (``Reshape``, ``Transpose``,
``Split``/``Slice`` of a fused qkv layer, scalar ``Mul``/``Div``) to dense layers, and the output
forward through ``Transpose``/``Reshape`` to ``[batch, tokens, heads * d_head]``. The plumbing is
not guessed from the op types: the model is run once on a random input (``onnx.reference``) and
each head tensor must equal its dense output (or the block of a fused one) split into heads, the
merged output the attention's output merged, the mask exactly causal or absent, the total logit
scale ``1/sqrt(d_head)``. A fused qkv layer becomes three dense nodes ``<id>.q``, ``<id>.k``,
``<id>.v`` (their ``params`` entries carry ``"columns": [lo, hi]``, the block of the layer's output
features). Anything in the pattern that cannot be mapped is refused by name: an additive bias that
is not a mask (relative position terms, ALiBi), a mask other than the causal one, a custom scale,
a softcap, grouped-query heads, attention dropout, cross-attention, a past key/value cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..schemas.errors import SigpropError
from .onnx_io import torch_id

__all__ = ["AttentionSite", "find_attention", "find_sites", "emit_attention", "has_attention", "ATTENTION_HINT"]

ATTENTION_HINT = (
    "sequence models map per-token MatMul/Gemm, LayerNormalization over the features, activations, adds and "
    "self-attention (softmax(q k^T / sqrt(d_head) [+ causal mask]) v on dense q, k, v split into heads, or "
    "the opset-23 Attention op): export the model with those, or write the graph by hand"
)
_PLUMBING = {"Reshape", "Transpose", "Split", "Slice", "Squeeze", "Unsqueeze", "Identity", "Cast"}
_MERGE = {"Reshape", "Transpose", "Identity", "Flatten"}
_SHAPE = ("Shape", "Size")  # ops that read a tensor's shape only: off the data path
_MASKED = -1e4  # a logit at or below this is a masked position


@dataclass
class Source:
    """Where a query, key or value comes from: rows ``lo:hi`` of the features of ``tensor``."""

    tensor: str
    lo: int
    hi: int
    factor: float  # the scalar the head tensor carries (an exporter's sqrt(scale) on q and k)


@dataclass
class AttentionSite:
    core: onnx.NodeProto  # the Softmax or the Attention node
    sources: tuple[Source, Source, Source]  # q, k, v
    heads: int
    causal: bool
    merged: str  # the tensor holding the output merged to [B, T, heads * d_head]
    region: set = field(default_factory=set)  # id() of every ONNX node the attention node stands for
    anchor: int = -1  # index of the region's last node in the graph's order


def _refuse(node, why: str, hint: str = ATTENTION_HINT) -> SigpropError:
    return SigpropError("unsupported_op", f"ONNX node '{node.name or node.output[0]}' ({node.op_type}): {why}", hint)


def has_attention(model) -> bool:
    return any(n.op_type in ("Softmax", "Attention") for n in model.graph.node)


def _values(model, input_name: str, dims: list) -> dict:
    """Every tensor's value on one random input (batch 2 where the batch is symbolic)."""
    from onnx.reference import ReferenceEvaluator

    shape = [d if isinstance(d, int) and d > 0 else 2 for d in dims]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    try:
        return ReferenceEvaluator(model).run(None, {input_name: x}, intermediate=True)
    except Exception as exc:  # noqa: BLE001 - the reference runtime raises many types
        raise SigpropError(
            "unsupported_op",
            f"the ONNX model could not be run to check its attention's head layout ({type(exc).__name__}: {exc})",
            ATTENTION_HINT,
        ) from None


def _shape_only(imp, node, depth: int = 0) -> bool:
    """Whether only the shape of ``node``'s output is used (a Shape of it, or of what it feeds)."""
    if node.op_type in _SHAPE:
        return True
    outs = {o.name for o in imp.model.graph.output}
    users = [u for o in node.output if o for u in imp.consumers.get(o, [])]
    return depth < 8 and not any(o in outs for o in node.output) and all(_shape_only(imp, u, depth + 1) for u in users)


def _fit(a: np.ndarray, b: np.ndarray) -> float | None:
    """``f`` with ``a = f b`` to float32 round-off, or None."""
    if a.shape != b.shape:
        return None
    a, b = a.astype(np.float64), b.astype(np.float64)
    bb = float((b * b).sum())
    if bb == 0.0:
        return None
    f = float((a * b).sum()) / bb
    return f if float(np.max(np.abs(a - f * b))) <= 1e-4 * max(1.0, float(np.max(np.abs(a)))) else None


def _split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    b, t, c = x.shape
    return x.reshape(b, t, heads, c // heads).transpose(0, 2, 1, 3)


def _merge_heads(y: np.ndarray) -> np.ndarray:
    b, h, t, d = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, t, h * d)


class _Finder:
    def __init__(self, imp, values: dict, data: set):
        self.imp, self.values, self.data = imp, values, data
        self.producer = {o: n for n in imp.model.graph.node for o in n.output}
        self.index = {id(n): k for k, n in enumerate(imp.model.graph.node)}

    def scalar(self, node, data_in: str) -> float | None:
        other = [i for i in node.input if i != data_in]
        c = self.imp.const(other[0]) if len(other) == 1 else None
        if c is None and len(other) == 1 and other[0] not in self.data:
            c = self.values.get(other[0])
        return float(np.asarray(c).reshape(())) if c is not None and np.size(c) == 1 else None

    def back(self, t: str, region: set) -> str:
        """The tensor a head tensor is plumbed from: through reshapes, splits and scalar factors."""
        while t in self.producer:
            node = self.producer[t]
            ins = [i for i in node.input if i in self.data]
            if len(ins) != 1:
                break
            if node.op_type in ("Mul", "Div") and self.scalar(node, ins[0]) is None:
                break
            if node.op_type not in _PLUMBING | {"Mul", "Div"}:
                break
            region.add(id(node))
            t = ins[0]
        return t

    def source(self, core, head: str, heads: int, role: str, region: set, transposed: bool = False) -> Source:
        t = self.back(head, region)
        src, got = self.values[t], np.asarray(self.values[head])
        if transposed:
            got = np.swapaxes(got, -1, -2)
        if src.ndim != 3 or got.ndim not in (3, 4):
            raise _refuse(core, f"its {role} is not computed from a [batch, tokens, features] tensor")
        width = got.shape[-1] * (got.shape[1] if got.ndim == 4 else 1)
        for lo in range(0, src.shape[-1] - width + 1, width):
            block = src[..., lo : lo + width]
            f = _fit(got, _split_heads(block, heads) if got.ndim == 4 else block)
            if f is not None:
                return Source(t, lo, lo + width, f)
        raise _refuse(
            core,
            f"its {role} is not a dense layer's output (or a block of a fused one) split into {heads} heads "
            "with view(B, T, heads, d_head).transpose(1, 2)",
        )

    def merge(self, core, out: str, region: set) -> str:
        y = np.asarray(self.values[out])
        if y.ndim == 3:
            return out
        want, cur = _merge_heads(y), out
        while True:
            users = self.imp.consumers.get(cur, [])
            if len(users) != 1 or users[0].op_type not in _MERGE:
                break
            region.add(id(users[0]))
            cur = users[0].output[0]
            v = np.asarray(self.values[cur])
            if v.shape == want.shape and np.allclose(v, want, atol=1e-6):
                return cur
        raise _refuse(core, "its output is not merged back to [batch, tokens, heads * d_head] before any other op")

    def mask(self, core, logits: np.ndarray, scores: np.ndarray | None) -> tuple[bool, float]:
        """(causal, logit scale) from the softmax's input and the raw scores q k^T."""
        masked = logits <= _MASKED
        t = logits.shape[-1]
        pattern = masked.reshape(-1, logits.shape[-2], t)
        if not (pattern == pattern[:1]).all():
            raise _refuse(core, "a mask that differs between examples or heads (a padding mask?)")
        pattern = pattern[0]
        causal = bool(pattern.any())
        if causal and not (pattern == np.triu(np.ones((logits.shape[-2], t), bool), k=1 + t - logits.shape[-2])).all():
            raise _refuse(core, "a mask other than the causal one", "use no mask or the causal mask")
        if scores is None:
            return causal, 1.0
        keep = ~masked
        f = _fit(np.where(keep, logits, 0.0), np.where(keep, scores, 0.0))
        if f is None:
            raise _refuse(
                core,
                "an additive bias on the attention logits that is not a mask (relative position terms, ALiBi)",
                "the graph's attention is softmax(q k^T / sqrt(d_head)) with at most the causal mask",
            )
        return causal, f

    def softmax(self, sm) -> AttentionSite:
        imp, region = self.imp, {id(sm)}
        rank = len(np.shape(self.values[sm.input[0]]))
        axis = int(next((onnx.helper.get_attribute_value(a) for a in sm.attribute if a.name == "axis"), -1))
        if axis % rank != rank - 1:
            raise _refuse(sm, f"a Softmax over axis {axis}, not over the keys (the last axis)")
        t, scale = sm.input[0], 1.0
        while t in self.producer and self.producer[t].op_type != "MatMul":
            node = self.producer[t]
            ins = [i for i in node.input if i in self.data]
            if len(ins) != 1 or node.op_type not in ("Mul", "Div", "Add", "Sub", "Where", "Cast", "Identity"):
                raise _refuse(sm, f"its logits come from a {node.op_type} ('{node.name}') the attention pattern lacks")
            region.add(id(node))
            t = ins[0]
        scores = self.producer.get(t)
        if scores is None or not all(i in self.data for i in scores.input):
            raise _refuse(sm, "a Softmax whose logits are not a product of two network tensors (q k^T)")
        region.add(id(scores))
        users = imp.consumers.get(sm.output[0], [])
        while len(users) == 1 and users[0].op_type in ("Identity", "Cast"):
            region.add(id(users[0]))
            users = imp.consumers.get(users[0].output[0], [])
        if len(users) == 1 and users[0].op_type == "Dropout":
            raise _refuse(sm, "attention dropout", "export in eval mode, or with dropout 0")
        if len(users) != 1 or users[0].op_type != "MatMul" or users[0].input[1] not in self.data:
            raise _refuse(sm, "its probabilities are not multiplied by the values (softmax(...) @ v) alone")
        mix = users[0]
        region.add(id(mix))
        out = np.asarray(self.values[mix.output[0]])
        if out.ndim != 4:
            raise _refuse(sm, f"attention on rank-{out.ndim} tensors", "split heads to [batch, heads, tokens, d_head]")
        heads, d_head = out.shape[1], out.shape[3]
        q = self.source(sm, scores.input[0], heads, "query", region)
        k = self.source(sm, scores.input[1], heads, "key", region, transposed=True)
        v = self.source(sm, mix.input[1], heads, "value", region)
        causal, c = self.mask(sm, np.asarray(self.values[sm.input[0]]), np.asarray(self.values[scores.output[0]]))
        scale = c * q.factor * k.factor
        if abs(scale * math.sqrt(d_head) - 1.0) > 1e-4:
            raise _refuse(sm, f"a softmax scale of {scale:.6g}, not 1/sqrt(d_head) = {1 / math.sqrt(d_head):.6g}")
        merged = self.merge(sm, mix.output[0], region)
        return self.site(sm, (q, k, v), heads, causal, merged, region)

    def attention_op(self, node) -> AttentionSite:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        if len(node.input) > 4 and any(node.input[4:]):
            raise _refuse(node, "a past key/value cache", "export without the cache")
        if any(self.imp.consumers.get(o) for o in node.output[1:] if o):
            raise _refuse(node, "its present key/value or attention weights are used")
        if float(a.get("softcap", 0.0)) != 0.0:
            raise _refuse(node, "a softcap on the logits", "export without softcap")
        qh, kvh = a.get("q_num_heads"), a.get("kv_num_heads")
        q_val = np.asarray(self.values[node.input[0]])
        heads = int(q_val.shape[1]) if q_val.ndim == 4 else int(qh or 0)
        kv = np.asarray(self.values[node.input[1]])
        if (qh and kvh and qh != kvh) or (kv.ndim == 4 and kv.shape[1] != heads) or not heads:
            raise _refuse(node, "grouped-query attention (fewer key/value heads than query heads)")
        region = {id(node)}
        q = self.source(node, node.input[0], heads, "query", region)
        k = self.source(node, node.input[1], heads, "key", region)
        v = self.source(node, node.input[2], heads, "value", region)
        d_head = (q.hi - q.lo) // heads
        causal = bool(int(a.get("is_causal", 0)))
        if len(node.input) > 3 and node.input[3]:
            if node.input[3] in self.data:
                raise _refuse(node, "a mask computed from the data")
            m = np.asarray(self.values[node.input[3]])
            logits = np.where(m, 0.0, -np.inf) if m.dtype == bool else m.astype(np.float64)
            if np.any((logits > _MASKED) & (logits != 0.0)):
                raise _refuse(
                    node, "an additive bias on the logits that is not a mask (relative position terms, ALiBi)"
                )
            t = q_val.shape[-2]
            full = np.broadcast_to(logits, (*logits.shape[:-2], t, logits.shape[-1]) if logits.ndim >= 2 else (t, t))
            causal = causal or self.mask(node, full, None)[0]
        scale = float(a["scale"]) if "scale" in a else 1.0 / math.sqrt(d_head)
        if abs(scale * q.factor * k.factor * math.sqrt(d_head) - 1.0) > 1e-4:
            raise _refuse(node, "a custom softmax scale", "use the default 1/sqrt(d_head)")
        merged = self.merge(node, node.output[0], region)
        return self.site(node, (q, k, v), heads, causal, merged, region)

    def site(self, core, sources, heads, causal, merged, region) -> AttentionSite:
        if abs(sources[2].factor - 1.0) > 1e-4:
            raise _refuse(core, f"its values are scaled by {sources[2].factor:.6g}")
        if len({(s.tensor, s.lo, s.hi) for s in sources}) != 3:
            raise _refuse(core, "two of its query, key and value are the same dense output")
        if sources[0].hi - sources[0].lo != sources[1].hi - sources[1].lo:
            raise _refuse(core, "its query and key differ in width")
        for n in self.imp.model.graph.node:  # the plumbing is the attention's alone
            if id(n) in region:
                for o in n.output:
                    if o != merged and any(
                        id(u) not in region and not _shape_only(self.imp, u) for u in self.imp.consumers.get(o, [])
                    ):
                        raise _refuse(core, f"a tensor of its head plumbing ('{o}') is also read elsewhere")
        anchor = max(self.index[i] for i in region)
        return AttentionSite(core, sources, heads, causal, merged, region, anchor)


def find_attention(imp, input_name: str, dims: list) -> list[AttentionSite]:
    """Every attention site of an ONNX sequence model (module docstring); raises on what it cannot map."""
    g = imp.model.graph
    data = {input_name}
    for node in g.node:  # the tensors computed from the input
        if node.op_type not in _SHAPE and any(i in data for i in node.input):
            data.update(o for o in node.output if o)
    values = _values(imp.model, input_name, dims)
    finder = _Finder(imp, values, data)
    sites = []
    for node in g.node:
        if node.op_type == "Softmax" and node.input[0] in data:
            sites.append(finder.softmax(node))
        elif node.op_type == "Attention" and node.input[0] in data:
            sites.append(finder.attention_op(node))
    cuts: dict[str, set] = {}
    for s in sites:
        for src in s.sources:
            cuts.setdefault(src.tensor, set()).add((src.lo, src.hi))
    for s in sites:
        for src in s.sources:
            whole = (0, int(np.shape(values[src.tensor])[-1]))
            if cuts[src.tensor] != {whole}:
                region = set().union(*(x.region for x in sites))
                if any(id(u) not in region and not _shape_only(imp, u) for u in imp.consumers.get(src.tensor, [])):
                    raise _refuse(s.core, f"'{src.tensor}' is cut into queries, keys and values and also read whole")
    return sites


def find_sites(imp, name: str, dims: list) -> None:
    """Record every attention site of a sequence model on the importer (its region and fused cuts)."""
    if not has_attention(imp.model):
        return
    for site in find_attention(imp, name, dims):
        imp.region.update((i, site) for i in site.region)
        for src, role in zip(site.sources, "qkv", strict=True):
            imp.cuts.setdefault(src.tensor, []).append((src.lo, src.hi, role))


def emit_attention(imp, site: AttentionSite, val_type) -> None:
    """The attention node of a site, on its query, key and value dense nodes."""
    ins = []
    for src, role in zip(site.sources, ("query", "key", "value"), strict=True):
        gid = imp.part_gid.get((src.tensor, src.lo, src.hi))
        v = imp.vals.get(src.tensor)
        if gid is None and v is not None and v.factor == 1.0 and imp.entries[v.gid]["op"] == "dense":
            gid = v.gid
        if gid is None:
            raise SigpropError(
                "unsupported_op",
                f"ONNX node '{site.core.name}' ({site.core.op_type}): its {role} '{src.tensor}' is not a dense "
                "layer's output (a MatMul by an initializer, with its bias)",
                ATTENTION_HINT,
            )
        ins.append(gid)
    reads = {tuple(imp.entries[g]["node"]["inputs"]) for g in ins}
    if len(reads) != 1:
        raise SigpropError(
            "unsupported_op",
            f"ONNX node '{site.core.name}' ({site.core.op_type}): cross-attention, its query, key and value "
            f"dense layers ({', '.join(ins)}) read different tensors",
            "self-attention only: q, k and v are dense layers of one input",
        )
    base = imp.dense_base.get(ins[0], ins[0])
    # the q layer's parent module (as graph_from_module names it), else the Softmax/Attention node's name
    named = "." in base and "/" not in base
    name = base.rsplit(".", 1)[0] if named else torch_id(site.core) or site.core.name or "attention"
    gid = imp.new_id(name)
    imp.emit(gid, "attention", ins, heads=int(site.heads), causal=bool(site.causal))
    imp.vals[site.merged] = val_type(gid)
