"""Sequence models in the Flax extraction: attention calls, layer norms and per-token Dense layers.

``extraction`` reads a ``sigprop.graph/v1`` graph off the jaxpr of ``module.apply``; with a
``[B, T, D]`` input (tokens first, features last: the graph's input is ``{"shape": [T, D],
"sequence": true}``) these steps join it (the ops of issue 28's design, after "Deep Transformers
without Shortcuts: Modifying Self-attention for Faithful Signal Propagation", He, Martens et al.,
arXiv:2302.10322):

- a ``dot_general`` of a network value ``[B, T, D]`` by a ``[D, F]`` params kernel (``nn.Dense``
  applied per token) is a ``dense`` node;
- a call of ``sigprop.client.jax.shaping.mixing_function`` (what ``ShapedAttention`` runs; a
  single jitted call in the jaxpr, its name carrying ``heads`` and ``causal``) is an ``attention``
  node on its queries, keys and values, which must be Dense layers of one input; the mapping
  gives the module's path, where ``apply_to_params`` installs the answer's matrix at init;
- the equations of an ``nn.LayerNorm`` (``nn.RMSNorm``) module (found by the module path of their
  name stack) are one region: its output, where code outside the region reads it, is a
  ``layer_norm`` (``rms_norm``) node of its one input. Its value is checked against the plain
  per-token normalization (division by the root mean square) of the input (the affine identity the
  answer assumes at init). RMSNorm regions are read on ``[B, F]`` inputs too (``norm_step``).

Attention written out (``nn.dot_product_attention``, ``nn.MultiHeadDotProductAttention``,
``jax.nn.dot_product_attention``) is refused with a hint: random queries and keys do not give a
fixed token-mixing matrix at initialization, and JAX code cannot be rewritten to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .shaping import COLLECTION, parse_core_name

ATTENTION_HINT = (
    "use sigprop.client.jax.attention.ShapedAttention(heads, max_len, causal) as the token mixer on "
    "nn.Dense queries, keys and values of one input (it is plain softmax attention until an answer is "
    "installed): written-out attention (nn.dot_product_attention, nn.MultiHeadDotProductAttention) has "
    "random queries and keys, which give no fixed token mixing at initialization, and JAX code cannot be "
    "rewritten"
)


# the Flax norm modules read as graph nodes: class name -> (op, what its plain form computes)
NORMS = {"LayerNorm": "layer_norm", "RMSNorm": "rms_norm"}


@dataclass
class LayerNormPart:
    """A value computed inside one LayerNorm (RMSNorm) call from its network input ``source``."""

    region: str  # the norm module's path
    source: str  # the graph node it normalizes
    op: str = "layer_norm"  # or "rms_norm"


def layer_norm_module(w, classes=tuple(NORMS)) -> tuple[str, str] | None:
    """(path, op) of the norm module (LayerNorm, RMSNorm: ``classes``) the current equation runs in, if any."""
    at = w.module_at()
    return (at[0], NORMS[at[1]]) if at is not None and at[1] in classes else None


def settle(w, v, net_type) -> Any:
    """The kind of ``v``, a norm region's value turned into its ``layer_norm`` / ``rms_norm`` node (once)."""
    kind = w.kind_of(v)
    if not isinstance(kind, LayerNormPart):
        return kind
    value = w.read(v)
    gid = w.new_node(kind.region.lower() or kind.op, {"op": kind.op, "inputs": [kind.source]}, value)
    expected = _normalized(np.asarray(w.values[kind.source], np.float64), centre=kind.op == "layer_norm")
    off = float(np.max(np.abs(np.asarray(value, np.float64) - expected))) if np.shape(value) == expected.shape else 1.0
    if off > 1e-3:
        what = "per-token normalization" if kind.op == "layer_norm" else "division by the root mean square"
        w.warnings.append(
            f"the {'LayerNorm' if kind.op == 'layer_norm' else 'RMSNorm'} '{kind.region}' does not compute the plain "
            f"{what} of '{kind.source}' (off by {off:.3g}): the answer assumes scale 1 and bias 0 at initialization "
            "and the normalization over the feature axis"
        )
    w.mapping[gid] = tuple(kind.region.split("/"))  # apply_to_params sets its scale to 1 and bias to 0
    w.kind[v] = net_type(gid)
    return w.kind[v]


def _normalized(x: np.ndarray, eps: float = 1e-6, centre: bool = True) -> np.ndarray:
    """Flax's LayerNorm (``centre``) or RMSNorm with scale 1 and bias 0 over the last axis."""
    mean = x.mean(axis=-1, keepdims=True) if centre else 0.0
    var = np.maximum((x * x).mean(axis=-1, keepdims=True) - mean * mean, 0.0)
    return (x - mean) / np.sqrt(var + eps)


def norm_step(w, eqn, ins: list, net_type, classes=tuple(NORMS)) -> bool:
    """One equation inside a norm module (``classes``; a value of one read outside it is settled
    into its node first): True if handled. ``graph_from_flax`` reads RMSNorm on ``[B, F]`` too."""
    at = layer_norm_module(w, classes)
    region = at[0] if at is not None else None
    for v in eqn.invars:
        kind = w.kind_of(v)
        if isinstance(kind, LayerNormPart) and kind.region != region:
            settle(w, v, net_type)
    kinds = [w.kind_of(v) for v in eqn.invars]
    if at is None or not any(isinstance(k, (net_type, LayerNormPart)) for k in kinds):
        return False
    sources = {k.source for k in kinds if isinstance(k, LayerNormPart)}
    for v, k in zip(eqn.invars, kinds, strict=True):
        if isinstance(k, net_type):  # the region's input: LN(c x) = LN(x), so any factor will do
            sources.add(w.resolve(v, "a layer norm", scaled_ok=True).node)
    outs = _bind(eqn, ins)
    for ov, val in zip(eqn.outvars, outs, strict=True):
        w.env[ov] = val
        w.kind[ov] = LayerNormPart(region, next(iter(sources)), at[1])
    if len(sources) > 1:
        w.unsupported(f"a layer norm of several values ({', '.join(sorted(sources))})")
    return True


def sequence_step(w, eqn, ins: list, net_type) -> bool:
    """Handle one equation of a sequence model that plain extraction does not: True if handled.

    ``net_type``: ``extraction._Net`` (passed in, so that module is imported only one way)."""
    core = parse_core_name(str(eqn.params.get("name", ""))) if eqn.primitive.name in ("pjit", "jit") else None
    if core is not None:
        for v in eqn.invars:
            settle(w, v, net_type)
        _attention(w, eqn, ins, core, net_type)
        return True
    return norm_step(w, eqn, ins, net_type)


def _bind(eqn, ins: list) -> list:
    outs = eqn.primitive.bind(*ins, **eqn.params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _attention(w, eqn, ins: list, core: tuple[int, bool], net_type) -> None:
    """An ``attention`` node for one call of ShapedAttention's mixing function."""
    heads, causal = core
    outs = _bind(eqn, ins)
    for ov, val in zip(eqn.outvars, outs, strict=True):
        w.env[ov] = val
    kinds = [w.kind_of(v) for v in eqn.invars]
    ov = eqn.outvars[0]
    if not all(isinstance(k, net_type) for k in kinds[:3]) or any(isinstance(k, net_type) for k in kinds[3:]):
        data = [(v, k) for v, k in zip(eqn.invars, kinds, strict=True) if isinstance(k, net_type)]
        note = w.unsupported("attention whose queries, keys and values are not three network values", ATTENTION_HINT)
        if data:
            w.kind[ov] = w.stand_in(note, w.resolve(data[0][0], "attention", scaled_ok=True), outs[0], 1.0)
        return
    names = ("queries", "keys", "values")
    q, k, v = (
        w.resolve(var, f"attention's {n}", scaled_ok=n != "values")
        for var, n in zip(eqn.invars[:3], names, strict=True)
    )
    nodes = {nd["id"]: nd for nd in w.nodes}
    sources = {tuple(nodes[n.node].get("inputs", ())) for n in (q, k, v)}
    if any(nodes[n.node]["op"] != "dense" for n in (q, k, v)) or len(sources) != 1:
        note = w.unsupported(
            f"attention on '{q.node}', '{k.node}', '{v.node}': its queries, keys and values must be Dense layers "
            "of one input (cross-attention and transformed projections are outside the graph)",
            ATTENTION_HINT,
        )
        w.kind[ov] = w.stand_in(note, v, outs[0])
        return
    if len({q.node, k.node, v.node}) != 3:
        note = w.unsupported(
            f"attention on '{q.node}', '{k.node}', '{v.node}': queries, keys and values sharing one Dense output "
            "(the answer zeroes the query kernel, which would zero the keys or values with it)",
            "give queries, keys and values a Dense layer each",
        )
        w.kind[ov] = w.stand_in(note, v, outs[0])
        return
    path = kinds[3][1] if isinstance(kinds[3], tuple) else None
    module = tuple(path[1:-1]) if path and path[0] == COLLECTION else None
    base = "/".join(str(p) for p in module).lower() if module else "attention"
    nd = {"op": "attention", "inputs": [q.node, k.node, v.node], "heads": int(heads), "causal": bool(causal)}
    gid = w.new_node(base, nd, outs[0] / v.factor)
    if module is not None:
        w.mapping[gid] = module
    else:
        w.warnings.append(
            f"attention '{gid}' reads no '{COLLECTION}' variables (the mixing function called outside "
            "ShapedAttention?): apply_to_params cannot install its initialization"
        )
    w.kind[ov] = net_type(gid, v.factor)


def dense_on_tokens(eqn, kernel_shape, in_shape, out_shape) -> bool:
    """Whether a ``dot_general`` is ``nn.Dense`` applied per token: ``[B, T, D] x [D, F] -> [B, T, F]``."""
    dims = eqn.params["dimension_numbers"]
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dims
    return (
        len(kernel_shape) == 2
        and len(in_shape) == 3
        and len(out_shape) == 3
        and tuple(lhs_c) == (2,)
        and tuple(rhs_c) == (0,)
        and not tuple(lhs_b)
        and not tuple(rhs_b)
    )


def written_out_attention(eqn, n_network_operands: int) -> bool:
    """A product of two network values (``Q K^T`` or ``softmax(...) V`` written out)."""
    return eqn.primitive.name == "dot_general" and n_network_operands == 2


__all__ = [
    "ATTENTION_HINT",
    "LayerNormPart",
    "NORMS",
    "norm_step",
    "sequence_step",
    "settle",
    "dense_on_tokens",
    "written_out_attention",
]
