"""Sum weights from the scalings a model writes around its adds, for the Keras and ONNX importers.

A model computes a weighted sum as scalings and a plain add: ``Add()([Rescaling(0.8)(x),
Rescaling(0.6)(h)])``, ``(x + h) / sqrt(2)``, ``Sum(Mul(x, 0.8), Mul(h, 0.6))``. An importer walks
the model keeping every tensor as ``factor * M(node)``, ``M`` being what the model's op for a graph
node computes; this module turns the factors into the graph's sums once every read is known:

* an add's input ``i`` reads ``f_i M(src_i)``, that is ``r_i G(src_i)`` with ``r_i = f_i / rho(src_i)``
  and ``rho = G / M`` the ratio of the graph node's value to the model's (1 for every node but a
  scaled sum);
* the factor ``g`` the other ops (activations, layers, the output) read the sum with is its output
  scale: the graph's weights are ``g r_i`` and ``rho(sum) = g``. Without such readers ``g`` is the one
  that makes the weights a normalized sum (only other sums read it);
* an add with ``r_i = 1`` that some op reads unscaled (and all read so) is a *plain* add: the graph
  gives it the equal weights ``1/sqrt(n)``, which the adapters' ``apply`` makes it compute
  (``graph_from_module``'s convention), so ``rho = 1``. One that only sums read is not: in
  ``0.8 * (a + b) / sqrt(2) + 0.6 * h`` the inner sum is ``(a + b) / sqrt(2)``, the outer ``[0.8, 0.6]``.

Weights that do not come out normalized are left so: the graph's shape rules then say which sum and
what normalized weights would be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..schemas.errors import SigpropError

__all__ = ["ScaledSums", "SumInfo"]


@dataclass
class SumInfo:
    """One sum: the graph node dict, its inputs' factors, the reads of its output, and the result."""

    node: dict
    sources: list[str]
    factors: list[float]
    reads: list[tuple[float, str, object]] = field(default_factory=list)  # (factor, reader, tensor) of other ops
    plain: bool = False
    scale: float = 1.0  # rho = G / M: what the model's add output is multiplied by to give the graph's value
    tensor: object = None  # a tensor holding exactly the graph's value, where a reader has one


class ScaledSums:
    """Collects the sums of one import; :meth:`finalize` writes their weights into the node dicts."""

    def __init__(self):
        self.sums: dict[str, SumInfo] = {}

    def is_sum(self, gid: str) -> bool:
        return gid in self.sums

    def add(self, node: dict, sources: list[str], factors: list[float]) -> SumInfo:
        info = SumInfo(node, list(sources), [float(f) for f in factors])
        self.sums[node["id"]] = info
        return info

    def read(self, gid: str, factor: float, reader: str, tensor=None) -> None:
        """An op other than a sum reads sum ``gid`` times ``factor`` (``tensor``: the value it reads)."""
        self.sums[gid].reads.append((float(factor), reader, tensor))

    def finalize(self) -> None:
        """Every sum's weights, in the order the sums were added (a sum's sources come before it)."""
        for gid, s in self.sums.items():
            r = [
                f / self.sums[src].scale if src in self.sums else f for src, f in zip(s.sources, s.factors, strict=True)
            ]
            scales = sorted({f for f, _, _ in s.reads})
            if len(scales) > 1 and scales[-1] - scales[0] > 1e-9 * max(1.0, abs(scales[-1])):
                readers = ", ".join(f"{reader} ({f:g})" for f, reader, _ in s.reads[:4])
                raise SigpropError(
                    "unsupported_op",
                    f"the sum '{gid}' is read with different scalings: {readers}",
                    "scale a sum's output once, right after it",
                )
            one = all(abs(x - 1.0) < 1e-12 for x in r)
            if one and scales and abs(scales[0] - 1.0) < 1e-12:
                s.plain, s.scale = True, 1.0
                s.node["weights"] = [1.0 / math.sqrt(len(r))] * len(r)
            else:
                norm = math.sqrt(sum(x * x for x in r))
                s.scale = scales[0] if scales else (1.0 / norm if norm > 0 else 1.0)
                s.node["weights"] = [s.scale * x for x in r]
            s.tensor = next((t for f, _, t in s.reads if abs(f - s.scale) < 1e-9 * max(1.0, s.scale)), None)
