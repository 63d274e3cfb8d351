"""A fused qkv ``nn.Dense`` in a Flax sequence model: one Dense of ``3 * d`` units whose output is cut
into queries, keys and values (``jnp.split(qkv, 3, axis=-1)`` or slices ``qkv[..., a:b]``).

The extraction reads each block of the output features as its own ``dense`` node, ``<id>.q``,
``<id>.k``, ``<id>.v`` (three equal blocks, in that order; other cuts ``<id>.<lo>_<hi>``), as the torch
adapter reads a fused qkv Linear; the fused node itself leaves the graph (a fused Dense also read whole
is refused). Its mapping entry is a :class:`Columns`: the module path and the block, and
``apply_to_params`` initializes the kernel's columns ``lo:hi`` (and the bias's entries ``lo:hi``) by
that node's answer, so the three parts of one kernel get their own initializations (zero queries for
E-SPA and U-SPA, orthogonal keys and values).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Columns", "FUSED_HINT", "fused_split", "drop_fused"]

FUSED_HINT = (
    "a sequence model cuts the features of a Dense's output only into blocks for attention (a fused qkv Dense, "
    "jnp.split(qkv, 3, axis=-1)); write the model without the cut"
)


@dataclass(frozen=True)
class Columns:
    """A mapping entry: columns ``lo:hi`` of the kernel (entries of the bias) of the Dense at ``path``."""

    path: tuple
    lo: int
    hi: int


def _blocks(eqn, shape) -> list[tuple[int, int]] | None:
    """The ``(lo, hi)`` feature blocks a ``split`` or ``slice`` of the last axis cuts, else None."""
    p, last = eqn.params, len(shape) - 1
    if eqn.primitive.name == "split":
        if int(p["axis"]) % len(shape) != last:
            return None
        bounds = np.cumsum([0, *p["sizes"]])
        return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    start, limit, strides = p["start_indices"], p["limit_indices"], p.get("strides")
    whole = all(int(s) == 0 and int(e) == d for s, e, d in zip(start[:-1], limit[:-1], shape[:-1], strict=True))
    if not whole or (strides is not None and any(int(s) != 1 for s in strides)):
        return None
    return [(int(start[-1]), int(limit[-1]))]


def fused_split(w, eqn, v, net_type) -> bool:
    """Blocks of a Dense's output features cut for attention: a dense node each (True), else False."""
    kind = w.kind_of(v)
    if not isinstance(kind, net_type) or kind.chain is not None or kind.factor != 1.0 or kind.node not in w.mapping:
        return False
    nd = next((n for n in w.nodes if n["id"] == kind.node), None)
    blocks = _blocks(eqn, np.shape(w.read(v)))
    if nd is None or nd["op"] != "dense" or blocks is None or isinstance(w.mapping[kind.node], Columns):
        return False
    parts = w.__dict__.setdefault("fused_parts", {})  # (fused id, lo, hi) -> part id
    units = int(nd["units"])
    for ov, (lo, hi) in zip(eqn.outvars, blocks, strict=True):
        gid = parts.get((kind.node, lo, hi))
        if gid is None:
            width = hi - lo
            role = "qkv"[lo // width] if units == 3 * width and lo % width == 0 else f"{lo}_{hi}"
            part = {"op": "dense", "inputs": list(nd["inputs"]), "units": width, "bias": nd["bias"]}
            gid = w.new_node(f"{kind.node}.{role}", part, w.env[ov])
            w.mapping[gid] = Columns(tuple(w.mapping[kind.node]), lo, hi)
            parts[(kind.node, lo, hi)] = gid
        w.kind[ov] = net_type(gid)
    return True


def drop_fused(w) -> None:
    """Remove each fused Dense cut into parts from the graph (refused where it is also read whole)."""
    fused = {key[0] for key in w.__dict__.get("fused_parts", {})}
    for gid in sorted(fused):
        readers = [n["id"] for n in w.nodes if gid in n.get("inputs", ())]
        if readers:
            w.unsupported(
                f"the Dense '{gid}' is cut into blocks (a fused q/k/v) and also read whole by '{readers[0]}'",
                "read a fused Dense only through its blocks (jnp.split(qkv, 3, axis=-1))",
            )
            continue
        w.nodes = [n for n in w.nodes if n["id"] != gid]
        w.mapping.pop(gid, None)
        w.values.pop(gid, None)
