"""Graph extraction of sequence models: GPT-style blocks on ``[batch, tokens, features]`` tensors.

A model whose example input is ``[B, T, D]`` and which calls attention
(``F.scaled_dot_product_attention`` or ``nn.MultiheadAttention``), or applies ``nn.Linear`` /
``nn.LayerNorm`` / ``nn.RMSNorm`` to each token, is a sequence model: its graph has a ``sequence``
input ``[T, D]``, ``dense`` nodes acting per token, ``attention``, ``layer_norm`` and ``rms_norm``
nodes, and ``mul`` for the product of two token streams (a SwiGLU gate) (contract, issue 28;
"Deep Transformers without Shortcuts", He, Martens et al., arXiv:2302.10322).

Attention is read in two forms:

- ``F.scaled_dot_product_attention(q, k, v, is_causal=...)`` whose ``q``, ``k``, ``v`` are
  ``nn.Linear`` outputs (three Linears, or one fused ``qkv`` Linear cut with ``.split``/``.chunk``
  on the feature axis) brought to ``[B, heads, T, d_head]`` by the usual ``view``/``transpose``
  head plumbing, and whose output is merged back to ``[B, T, heads * d_head]``. The plumbing is
  not guessed from the op names: it is checked on the example input's recorded values (each
  head tensor must equal the Linear's output, cut and split into heads; the merged output must
  equal the attention's output merged), so a layout the graph would misread is refused.
- ``nn.MultiheadAttention`` (``batch_first=True``, self-attention ``att(x, x, x)``): its packed
  ``in_proj`` is three ``dense`` nodes ``<path>.q``, ``<path>.k``, ``<path>.v`` and its
  ``out_proj`` the dense node ``<path>.out_proj``.

Refused, naming the construct: cross-attention (q, k, v read different tensors), attention whose
q, k or v is not a Linear output, attention dropout, a custom softmax scale, masks other than
the causal one, and the ops a sequence graph cannot hold (convolutions, pooling, flatten, concat,
means over tokens).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from ...schemas.errors import SigpropError
from .attention import ShapedAttention, merge_heads, split_heads
from .ops import describe
from .sequence_checks import check_fan_in, record_values
from .traced import Entry, Extraction
from .walk import Walker, clean_id, tensor_shape

__all__ = ["SequenceExtraction", "AttentionSite", "DensePart", "is_sequence_trace", "extract_sequence", "SEQUENCE_HINT"]

SEQUENCE_HINT = (
    "sequence graphs hold per-token Linear layers, activations, sums, products of two streams, LayerNorm or "
    "RMSNorm over the features and "
    "self-attention (F.scaled_dot_product_attention on Linear q/k/v with view/transpose head plumbing, or "
    "nn.MultiheadAttention(batch_first=True) called as att(x, x, x)); write the model with those, or write "
    "the graph by hand"
)

_PLUMBING_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "split", "chunk", "flatten", "unflatten"}
_PLUMBING_FUNCTIONS = {
    operator.getitem,
    torch.split,
    torch.chunk,
    torch.transpose,
    torch.permute,
    torch.reshape,
    torch.flatten,
    torch.unflatten,
}
_SPLITS = {"split", "chunk", torch.split, torch.chunk}
_REFUSED_IN_SEQUENCES = ("conv", "max_pool", "avg_pool", "global_avg_pool", "flatten", "concat")


@dataclass
class DensePart:
    """A dense node computed by rows ``lo:hi`` of a Linear's weight (a fused qkv Linear, or the
    packed in_proj of nn.MultiheadAttention); ``lo, hi = 0, out_features`` for a whole Linear."""

    gid: str
    module: nn.Module  # the nn.Linear, or the nn.MultiheadAttention holding in_proj_weight
    lo: int
    hi: int
    path: str  # the module's path in the traced model
    packed: bool = False  # rows of nn.MultiheadAttention's in_proj_weight


@dataclass
class AttentionSite:
    """One attention node: the fx node computing it and where its q, k, v and output are."""

    gid: str
    node: torch.fx.Node  # the F.scaled_dot_product_attention call, or the nn.MultiheadAttention call
    merged: torch.fx.Node | None  # the node whose value is the merged [B, T, width] output (sdpa)
    parts: tuple[DensePart, DensePart, DensePart]  # q, k, v
    source: torch.fx.Node  # the fx node q, k and v read
    heads: int
    causal: bool
    seq_len: int
    d_model: int  # width of the stream q, k, v read
    module: nn.Module | None = None  # the nn.MultiheadAttention or ShapedAttention called, if any
    linears: tuple = ()  # the Linear fx nodes q, k, v are cut from (sdpa sites)


@dataclass
class SequenceExtraction(Extraction):
    """An :class:`Extraction` of a sequence model, with its attention sites and dense parts."""

    sites: dict = field(default_factory=dict)  # attention gid -> AttentionSite
    parts: dict = field(default_factory=dict)  # dense gid -> DensePart
    layer_norms: dict = field(default_factory=dict)  # layer_norm / rms_norm gid -> (fx node, module or None)


def _is_linear_3d(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    shape = tensor_shape(node)
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.Linear) and len(shape or ()) == 3


def is_sequence_trace(gm: torch.fx.GraphModule, example_input: torch.Tensor) -> bool:
    """Whether a shape-propagated trace is a sequence model's (module docstring)."""
    if example_input.dim() != 3:
        return False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            return True
        if node.op == "call_module":
            m = gm.get_submodule(node.target)
            if isinstance(m, nn.MultiheadAttention):
                return True
            if isinstance(m, (nn.Linear, nn.LayerNorm, nn.RMSNorm)) and len(tensor_shape(node) or ()) == 3:
                return True
        if node.op == "call_function" and node.target in (F.linear, F.layer_norm, F.rms_norm):
            shape = tensor_shape(node)
            if shape is not None and len(shape) == 3:
                return True
    return False


def _arg(node: torch.fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_plumbing(node) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_method":
        return node.target in _PLUMBING_METHODS
    return node.op == "call_function" and node.target in _PLUMBING_FUNCTIONS


def _refuse(node: torch.fx.Node, gm, why: str, hint: str = SEQUENCE_HINT) -> SigpropError:
    name = clean_id(node.target if node.op == "call_module" else node.name)
    return SigpropError("unsupported_op", f"node '{name}' ({describe(node, gm)}) is not supported: {why}", hint)


def _split_slice(split: torch.fx.Node, index: int, width: int, values: dict) -> tuple[int, int] | None:
    """Columns ``lo:hi`` of piece ``index`` of a ``split``/``chunk`` on the last axis, else None
    (sizes computed in forward, ``x.size(-1)``, are read from the recorded ``values``)."""

    def concrete(a):
        return torch.fx.node.map_arg(a, lambda n: values[n])

    is_chunk = split.target in ("chunk", torch.chunk)
    size = concrete(_arg(split, 1, "chunks" if is_chunk else "split_size_or_sections"))
    if size is None:
        size = concrete(split.kwargs.get("split_size"))
    dim = concrete(_arg(split, 2, "dim", 0))
    if not isinstance(dim, int) or dim not in (-1, 2):
        return None
    if is_chunk:
        step = math.ceil(width / int(size))
        sizes = [step] * int(size)
    elif isinstance(size, int):
        sizes = [size] * math.ceil(width / size)
    else:
        sizes = [int(s) for s in size]
    lo = sum(sizes[:index])
    return lo, min(lo + sizes[index], width)


class _SiteReader:
    """Finds the attention sites of a trace from its recorded values."""

    def __init__(self, gm: torch.fx.GraphModule, values: dict):
        self.gm, self.values = gm, values
        self.skip: set = set()  # plumbing nodes absorbed into attention nodes
        self.alias: dict = {}  # merged output node -> the attention node
        self.sites: dict = {}  # sdpa / MHA fx node -> dict(parts..., heads, causal)
        self.cuts: dict = {}  # Linear fx node -> {(lo, hi)}: the row ranges read as separate dense nodes

    def head_source(
        self, sdpa: torch.fx.Node, x: torch.fx.Node, role: str, heads: int | None = None
    ) -> tuple[torch.fx.Node, int, int, int]:
        """(Linear node, lo, hi, heads) of one head tensor of an sdpa call (``heads`` given: a
        ``[B, T, width]`` input of a ShapedAttention module, not split into heads)."""
        chain, cur, cut = [], x, None
        while _is_plumbing(cur):
            chain.append(cur)
            if cur.op == "call_function" and cur.target is operator.getitem:
                src = cur.args[0]
                if isinstance(src, torch.fx.Node) and src.target in _SPLITS and isinstance(cur.args[1], int):
                    cut = (src, cur.args[1])
            cur = cur.args[0] if cur.args else None
        if not isinstance(cur, torch.fx.Node) or not _is_linear_3d(cur, self.gm):
            what = describe(cur, self.gm) if isinstance(cur, torch.fx.Node) else "a constant"
            raise _refuse(
                sdpa,
                self.gm,
                f"its {role} is computed by {what}, not by an nn.Linear through view/transpose head plumbing: "
                "attention whose q, k, v are not dense layers of one input has no fixed matrix at initialization",
            )
        out = self.values[cur]
        width = out.shape[-1]
        lo, hi = 0, width
        if cut is not None:
            found = _split_slice(cut[0], cut[1], width, self.values)
            if found is None:
                raise _refuse(sdpa, self.gm, f"its {role} is cut from '{cur.name}' along an axis other than features")
            lo, hi = found
        head = self.values[x]
        if heads is not None:  # a ShapedAttention module's [B, T, width] input
            if not torch.equal(head, out[..., lo:hi]):
                raise _refuse(sdpa, self.gm, f"its {role} is not columns {lo}:{hi} of '{cur.name}'")
            self.skip.update(chain)
            return cur, lo, hi, heads
        heads = head.shape[1] if head.dim() == 4 else 0
        if heads < 1 or (hi - lo) % heads or not torch.equal(head, split_heads(out[..., lo:hi], heads)):
            raise _refuse(
                sdpa,
                self.gm,
                f"its {role} [{', '.join(map(str, head.shape))}] is not columns {lo}:{hi} of '{cur.name}' split into "
                "heads as x.view(B, T, heads, d_head).transpose(1, 2) does",
            )
        self.skip.update(chain)
        return cur, lo, hi, heads

    def causal_mask(self, node, mask, blocked: bool = False) -> bool:
        """Whether an attention mask argument is the causal one (True) or absent (False); else
        refused. A boolean mask is True where a token may attend (sdpa), or where it may not
        (``blocked``: nn.MultiheadAttention)."""
        if mask is None:
            return False
        value = self.values.get(mask) if isinstance(mask, torch.fx.Node) else mask
        if not isinstance(value, torch.Tensor):
            raise _refuse(node, self.gm, "its attention mask is not a tensor")
        t = value.shape[-1]
        upper = torch.ones(t, t, dtype=torch.bool).triu(1)
        if value.dtype == torch.bool:
            flat = value.reshape(-1, t, t)
            if value.shape[-2:] == (t, t) and all(torch.equal(m, upper if blocked else ~upper) for m in flat):
                return True
        elif torch.all(value[..., upper] == -math.inf) and torch.all(value[..., ~upper] == 0):
            return True
        raise _refuse(node, self.gm, "its attention mask is not the causal mask", "use is_causal=True or no mask")

    def read_sdpa(self, node: torch.fx.Node, module: ShapedAttention | None = None) -> None:
        """An F.scaled_dot_product_attention call, or (``module``) a ShapedAttention module call."""
        q, k, v = (_arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
        if module is not None:
            found = [self.head_source(node, x, r, module.heads) for x, r in ((q, "query"), (k, "key"), (v, "value"))]
            self.check_self_attention(node, found)
            for lin, lo, hi, _ in found:
                self.cuts.setdefault(lin, set()).add((lo, hi))
            self.sites[node] = {"found": found, "heads": module.heads, "causal": module.causal, "merged": None}
            return
        if float(_arg(node, 4, "dropout_p", 0.0) or 0.0) != 0.0:
            raise _refuse(node, self.gm, "attention dropout (dropout_p > 0)", "use dropout_p=0.0")
        if _arg(node, 6, "scale") is not None or _arg(node, 7, "enable_gqa", False):
            raise _refuse(node, self.gm, "a custom softmax scale or grouped-query attention", "use the defaults")
        causal = bool(_arg(node, 5, "is_causal", False)) or self.causal_mask(node, _arg(node, 3, "attn_mask"))
        found = [self.head_source(node, x, role) for x, role in ((q, "query"), (k, "key"), (v, "value"))]
        self.check_self_attention(node, found)
        merged = self.merged_output(node, found[0][3])
        for lin, lo, hi, _ in found:
            self.cuts.setdefault(lin, set()).add((lo, hi))
        self.sites[node] = {"found": found, "heads": found[0][3], "causal": causal, "merged": merged}
        self.alias[merged] = node

    def check_self_attention(self, node: torch.fx.Node, found: list) -> None:
        sources = {f[0].args[0] for f in found}
        if len(sources) != 1:
            raise _refuse(
                node,
                self.gm,
                "cross-attention: its query, key and value read different tensors",
                "self-attention only: q, k and v are Linear layers of one input",
            )
        if len({f[:3] for f in found}) != 3:
            raise _refuse(
                node,
                self.gm,
                "two of its query, key and value are the same Linear output",
                "give q, k and v their own Linear layers (or blocks of one fused qkv Linear)",
            )
        heads = {f[3] for f in found}
        if len(heads) != 1 or found[0][2] - found[0][1] != found[1][2] - found[1][1]:
            raise _refuse(node, self.gm, "its query, key and value differ in heads or q and k in width")

    def merged_output(self, node: torch.fx.Node, heads: int) -> torch.fx.Node:
        """The node whose value is the sdpa output merged back to ``[B, T, heads * d_head]``."""
        chain, cur = [], node
        want = merge_heads(self.values[node])
        while len(cur.users) == 1:
            (user,) = cur.users
            if not _is_plumbing(user):
                break
            cur = user
            chain.append(cur)
            value = self.values.get(cur)
            if isinstance(value, torch.Tensor) and value.dim() == 3 and torch.equal(value, want):
                self.skip.update(chain[:-1])
                return cur
        raise _refuse(
            node,
            self.gm,
            "its output is not merged back to [batch, tokens, heads * d_head] (y.transpose(1, 2).reshape(B, T, C)) "
            "before any other op",
        )

    def read_mha(self, node: torch.fx.Node, m: nn.MultiheadAttention) -> None:
        q, k, v = (_arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
        if not (q is k is v):
            raise _refuse(node, self.gm, "cross-attention: query, key and value are different tensors", "att(x, x, x)")
        if not m.batch_first:
            raise _refuse(
                node, self.gm, "nn.MultiheadAttention with batch_first=False", "construct it with batch_first=True"
            )
        if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn or m.dropout:
            raise _refuse(
                node,
                self.gm,
                "nn.MultiheadAttention with separate kdim/vdim, add_bias_kv, add_zero_attn or dropout",
                "use nn.MultiheadAttention(d, heads, batch_first=True) with the other options at their defaults",
            )
        if _arg(node, 3, "key_padding_mask") is not None:
            raise _refuse(node, self.gm, "a key_padding_mask", "pad-free sequences only")
        causal = bool(_arg(node, 7, "is_causal", False)) or self.causal_mask(node, _arg(node, 5, "attn_mask"), True)
        for user in node.users:
            if not (user.op == "call_function" and user.target is operator.getitem and user.args[1] in (0, 1)):
                raise _refuse(node, self.gm, "its result is used other than as att(x, x, x)[0]")
            if user.args[1] == 1 and user.users:
                raise _refuse(node, self.gm, "its attention weights are used", "use only att(x, x, x)[0]")
            if user.args[1] == 1:
                self.skip.add(user)
        self.sites[node] = {"heads": int(m.num_heads), "causal": causal, "module": m}


def read_sites(gm: torch.fx.GraphModule, values: dict) -> _SiteReader:
    reader = _SiteReader(gm, values)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            reader.read_sdpa(node)
        elif node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.MultiheadAttention):
            reader.read_mha(node, gm.get_submodule(node.target))
        elif node.op == "call_module" and isinstance(gm.get_submodule(node.target), ShapedAttention):
            reader.read_sdpa(node, gm.get_submodule(node.target))
    for lin, cuts in reader.cuts.items():
        whole = (0, reader.values[lin].shape[-1])
        if cuts != {whole}:
            bad = [u for u in lin.users if u not in reader.skip]
            if bad:
                raise _refuse(
                    lin, gm, f"its output is cut for attention and also read whole by '{bad[0].name}'", SEQUENCE_HINT
                )
    return reader


class _SequenceExtractor(Walker):
    """The extractor's walk with the sequence ops: per-token dense (whole or cut Linears),
    attention, layer_norm, and the head plumbing absorbed into attention nodes."""

    def __init__(self, gm, allow_unsupported: bool, keep_fn: bool, warn: bool, reader: _SiteReader):
        super().__init__(gm, allow_unsupported, keep_fn, warn)
        self.reader = reader
        self.sites: dict = {}
        self.parts: dict = {}
        self.layer_norms: dict = {}
        self.part_gid: dict = {}  # (Linear fx node, lo, hi) -> dense gid
        self.mha_out: dict = {}  # nn.MultiheadAttention call -> its out_proj dense gid
        self.roles = self._roles()

    def _roles(self) -> dict:
        roles = {}
        for site in self.reader.sites.values():
            for (lin, lo, hi, _), role in zip(site.get("found", ()), "qkv", strict=False):
                roles.setdefault((lin, lo, hi), role)
        return roles

    def add_input(self, node: torch.fx.Node) -> None:
        shape = tensor_shape(node)
        gid = self.new_id(node.name)
        self.shapes[node] = shape
        self.value[node] = gid
        wire = {"id": gid, "op": "input", "shape": [int(shape[1]), int(shape[2])], "sequence": True}
        self.nodes_out.append(wire)
        self.entries[node] = Entry(node, gid, "input", [], {"shape": wire["shape"]}, f"input '{node.name}'")

    def emit(self, node, gid: str, op: str, ins: list, attrs: dict, key=None, module=None) -> None:
        wire = {"id": gid, "op": op, "inputs": [self.value[a] if not isinstance(a, str) else a for a in ins], **attrs}
        self.nodes_out.append(wire)
        fx_ins = [a for a in ins if not isinstance(a, str)]
        self.entries[key if key is not None else node] = Entry(
            node, gid, op, fx_ins, attrs, describe(node, self.gm), module=module
        )

    def add_node(self, node: torch.fx.Node) -> None:
        reader, gm = self.reader, self.gm
        if node in reader.skip:
            node.meta["_sigprop_data"] = True
            return
        if node in reader.alias:  # the merged output of an sdpa call is the attention node's value
            self.shapes[node] = tensor_shape(node)
            self.value[node] = self.value[reader.alias[node]]
            return
        if node.op == "call_module":
            m = gm.get_submodule(node.target)
            if isinstance(m, nn.MultiheadAttention):
                return self.add_mha(node, m)
            if isinstance(m, ShapedAttention):
                return self.add_sdpa(node, m)
            if isinstance(m, nn.Linear) and len(tensor_shape(node) or ()) == 3:
                return self.add_linear(node, m)
            if isinstance(m, nn.LayerNorm):
                return self.add_layer_norm(node, m, list(m.normalized_shape))
        if node.op == "call_function" and node.target is F.layer_norm:
            return self.add_layer_norm(node, None, list(_arg(node, 1, "normalized_shape")))
        if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            return self.add_sdpa(node)
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in self.mha_out:
            self.shapes[node] = tensor_shape(node)
            self.value[node] = self.mha_out[node.args[0]]
            return
        before = len(self.nodes_out)
        super().add_node(node)
        op = self.nodes_out[-1]["op"] if len(self.nodes_out) > before else None
        if op in _REFUSED_IN_SEQUENCES:
            raise _refuse(
                node, gm, f"a {op} in a sequence model (sequence ops act per token or mix tokens by attention)"
            )
        if op == "rms_norm":  # apply resets an nn.RMSNorm's weight to 1 and diagnose probes it, as a LayerNorm
            self.layer_norms[self.nodes_out[-1]["id"]] = (
                node,
                gm.get_submodule(node.target) if node.op == "call_module" else None,
            )

    def add_linear(self, node: torch.fx.Node, m: nn.Linear) -> None:
        shape = tensor_shape(node)
        self.shapes[node] = shape
        (src,) = self.data_args(node)
        cuts = sorted(self.reader.cuts.get(node, {(0, m.out_features)}))
        if cuts == [(0, m.out_features)]:
            gid = self.new_id(node.target)
            self.value[node] = gid
            self.emit(node, gid, "dense", [src], {"units": int(m.out_features), "bias": m.bias is not None}, module=m)
            self.parts[gid] = DensePart(gid, m, 0, m.out_features, node.target)
            self.part_gid[(node, 0, m.out_features)] = gid
            return
        node.meta["_sigprop_data"] = True
        for k, (lo, hi) in enumerate(cuts):
            role = self.roles.get((node, lo, hi), str(k))
            gid = self.new_id(f"{node.target}.{role}")
            self.nodes_out.append(
                {"id": gid, "op": "dense", "inputs": [self.value[src]], "units": hi - lo, "bias": m.bias is not None}
            )
            self.parts[gid] = DensePart(gid, m, lo, hi, node.target)
            self.part_gid[(node, lo, hi)] = gid

    def attention_id(self, path: str, fallback: str) -> str:
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        return self.new_id(parent if parent and clean_id(parent) not in self.used_ids else fallback)

    def add_sdpa(self, node: torch.fx.Node, module: ShapedAttention | None = None) -> None:
        """An sdpa call (id: the q Linear's parent path) or a ShapedAttention module (id: its path)."""
        site = self.reader.sites[node]
        shape = tensor_shape(node)
        self.shapes[node] = shape
        found = site["found"]
        ins = [self.part_gid[(lin, lo, hi)] for lin, lo, hi, _ in found]
        gid = self.new_id(node.target) if module is not None else self.attention_id(found[0][0].target, node.name)
        self.value[node] = gid
        self.emit(node, gid, "attention", ins, {"heads": site["heads"], "causal": site["causal"]})
        src = found[0][0].args[0]
        parts = tuple(self.parts[g] for g in ins)
        t, d = self.shapes[src][1], self.shapes[src][2]
        self.sites[gid] = AttentionSite(
            gid,
            node,
            site["merged"],
            parts,
            src,
            site["heads"],
            site["causal"],
            t,
            d,
            module,
            tuple(f[0] for f in found),
        )

    def add_mha(self, node: torch.fx.Node, m: nn.MultiheadAttention) -> None:
        site = self.reader.sites[node]
        node.meta["_sigprop_data"] = True
        src = _arg(node, 0, "query")
        e = m.embed_dim
        bias = m.in_proj_bias is not None
        parts = []
        for k, role in enumerate("qkv"):
            gid = self.new_id(f"{node.target}.{role}")
            self.nodes_out.append({"id": gid, "op": "dense", "inputs": [self.value[src]], "units": e, "bias": bias})
            part = DensePart(gid, m, k * e, (k + 1) * e, node.target, packed=True)
            self.parts[gid] = part
            parts.append(part)
        gid = self.new_id(node.target)
        self.nodes_out.append(
            {"id": gid, "op": "attention", "inputs": [p.gid for p in parts], "heads": site["heads"],
             "causal": site["causal"]}
        )  # fmt: skip
        self.entries[node] = Entry(node, gid, "attention", [src], {}, describe(node, self.gm), module=m)
        proj = self.new_id(f"{node.target}.out_proj")
        out = m.out_proj
        self.nodes_out.append(
            {"id": proj, "op": "dense", "inputs": [gid], "units": int(out.out_features), "bias": out.bias is not None}
        )
        self.parts[proj] = DensePart(proj, out, 0, out.out_features, f"{node.target}.out_proj")
        self.mha_out[node] = proj
        t, d = self.shapes[src][1], self.shapes[src][2]
        self.sites[gid] = AttentionSite(gid, node, None, tuple(parts), src, site["heads"], site["causal"], t, d, m)

    def add_layer_norm(self, node: torch.fx.Node, m: nn.LayerNorm | None, normalized: list) -> None:
        shape = tensor_shape(node)
        if list(normalized) != [shape[-1]]:
            raise _refuse(node, self.gm, f"a LayerNorm over {normalized}, not over the features of each token")
        self.shapes[node] = shape
        (src, *_) = self.data_args(node)
        gid = self.new_id(node.target if node.op == "call_module" else node.name)
        self.value[node] = gid
        self.emit(node, gid, "layer_norm", [src], {}, module=m)
        self.layer_norms[gid] = (node, m)


def extract_sequence(gm, example_input, allow_unsupported: bool, keep_fn: bool, warn: bool) -> SequenceExtraction:
    """The graph of a traced, shape-propagated sequence model (module docstring)."""
    values = record_values(gm, example_input)
    reader = read_sites(gm, values)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    walker = _SequenceExtractor(gm, allow_unsupported, keep_fn, warn, reader)
    graph = walker.run(placeholders[0])
    check_fan_in(graph, walker.parts, SEQUENCE_HINT)
    return SequenceExtraction(
        gm,
        graph,
        walker.entries,
        walker.value,
        walker.notes,
        walker.traced_modules,
        sites=walker.sites,
        parts=walker.parts,
        layer_norms=walker.layer_norms,
    )
