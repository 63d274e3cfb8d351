"""The token-kernel implementation of the network program: the exact T x T propagation of a sequence.

``program.NetworkProgram`` describes a network through passes of a value along its graph; the
implementations there carry a scalar (or an elementwise numpy array) per input pair. This one
carries the T x T token kernel of one sequence, K_ij = E[x_i . x_j] / width at infinite width, with
the per-token feature mean next to it (``TokenValue``; a layer norm needs it), along the *full*
sequence graph, where attention mixes tokens (He, Martens et al., "Deep Transformers without
Shortcuts", arXiv:2302.10322, section 3; the per-op maps are ``token_kernels``'):

- dense: sigma_w^2 K + sigma_b^2 (the answer's weight and bias variance scales), mean 0;
- activation: the local map ``r(value, slot)`` of the function at that slot, entrywise with
  unequal diagonals (the caller builds it from ``token_kernels.activation_token_kernel``);
- attention: A K A^T with A the node's matrix at initialization, its value input's kernel;
- sum: the linear rule of ``schemas.kernels`` applied to whole kernels (``sum_coefficients``: cross
  terms vanish, each branch ending in fresh zero-mean weights), means summed with the weights;
- layer_norm: per-token centring and scaling (``token_kernels.layer_norm_token_kernel``);
- identity, dropout (evaluation mode), output: the value itself.

The reduction the program's maximizations compare is the largest correlation between two distinct
tokens, K_ij / sqrt(K_ii K_jj) for i != j, of the kernel at a node: ``candidate_values`` gives it at
every node (every subnetwork from the input to a node, as a chain's endpoints), ``argmax`` names
the node that attains the largest. Values are freed as soon as their last reader has run, so a
deep network holds a few kernels at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ..schemas.kernels import sum_coefficients
from .graph import ACT, AFFINE, ATTENTION, NORM, SOURCE, SUM, NetworkGraph
from .program import WHOLE_NETWORK, NetworkProgram, Repeat
from .token_kernels import attention_token_kernel, dense_token_kernel, layer_norm_token_kernel, sum_token_kernel

__all__ = ["TokenValue", "TokenKernelProgram", "max_token_correlation"]


@dataclass(frozen=True)
class TokenValue:
    """A stream's T x T kernel and its per-token feature mean (None: zero)."""

    kernel: np.ndarray
    mean: np.ndarray | None = None


TokenMap = Callable[[TokenValue, int], TokenValue]


def max_token_correlation(kernel: np.ndarray) -> float:
    """The largest K_ij / sqrt(K_ii K_jj) over distinct tokens i != j (-inf for one token)."""
    if kernel.shape[0] < 2:
        return -np.inf
    d = np.sqrt(np.diag(kernel))
    c = kernel / np.outer(d, d)
    np.fill_diagonal(c, -np.inf)
    return float(c.max())


class TokenKernelProgram(NetworkProgram):
    """The token-kernel program of a sequence graph (module docstring).

    ``mixers``: the attention nodes' matrices at initialization (T x T, for the T tokens the
    program propagates), by node index; ``dense``: (sigma_w^2, sigma_b^2) by dense node index
    (default (1, 0)); ``fn_slots``: the activation function of each slot, in the order of
    ``graph.activation_fns()``, which is what ``r`` receives."""

    def __init__(
        self,
        graph: NetworkGraph,
        mixers: Mapping[int, np.ndarray],
        dense: Mapping[int, tuple[float, float]] | None = None,
    ):
        self.graph = graph
        self.mixers = dict(mixers)
        self.dense = dict(dense or {})
        nodes = graph.nodes
        fn_slot = {fn: i for i, fn in enumerate(graph.activation_fns())}
        self.slots = {nd.index: fn_slot[nd.attrs["fn"]] for nd in nodes if nd.kind == ACT}
        self.regions, self.depth = graph.n - 1, graph.depth()
        self.output, self.user_ids = graph.output, tuple(nd.user_id for nd in nodes)
        self._readers = [len(c) for c in graph.consumers()]
        missing = [nd.user_id for nd in nodes if nd.kind == ATTENTION and nd.index not in self.mixers]
        if missing:
            raise ValueError(f"no attention matrix for {', '.join(missing)}")

    def _walk(self, x, r: TokenMap, visit: Callable[[int, TokenValue], None] | None = None) -> TokenValue:
        nodes, values = self.graph.nodes, {}
        readers = list(self._readers)
        start = x if isinstance(x, TokenValue) else TokenValue(np.asarray(x, dtype=float))
        for nd in nodes:
            ins = nd.inputs
            kind = nd.kind
            if kind == SOURCE:
                value = start
            elif kind == AFFINE:
                w, b = self.dense.get(nd.index, (1.0, 0.0))
                v = values[ins[0]]
                if w == 1.0 and b == 0.0:  # q-preserving weights, no bias: the kernel itself, mean 0
                    value = v if v.mean is None else TokenValue(v.kernel)
                else:
                    value = TokenValue(dense_token_kernel(v.kernel, w, b))
            elif kind == ACT:
                value = r(values[ins[0]], self.slots[nd.index])
            elif kind == ATTENTION:
                a, v = self.mixers[nd.index], values[ins[2]]
                value = TokenValue(attention_token_kernel(v.kernel, a), None if v.mean is None else a @ v.mean)
            elif kind == SUM:
                parts = [values[i] for i in ins]
                weights = nd.attrs["weights"]
                kernel = sum_token_kernel([p.kernel for p in parts], sum_coefficients(weights))
                means = [w * p.mean for w, p in zip(weights, parts, strict=True) if p.mean is not None]
                value = TokenValue(kernel, sum(means) if means else None)
            elif kind == NORM:
                v = values[ins[0]]
                value = TokenValue(layer_norm_token_kernel(v.kernel, v.mean))
            else:  # identity, dropout, output
                value = values[ins[0]]
            values[nd.index] = value
            if visit is not None:
                visit(nd.index, value)
            for i in ins:
                readers[i] -= 1
                if readers[i] == 0:
                    del values[i]
        return values[self.output]

    def global_map(self, x, r: TokenMap, repeat: Repeat | None = None) -> TokenValue:
        """The output's token value for the input kernel ``x`` (or ``TokenValue``)."""
        return self._walk(x, r)

    def candidate_values(self, x, r: TokenMap) -> list:
        found: list[float] = []
        self._walk(x, r, lambda _i, v: found.append(max_token_correlation(v.kernel)))
        return found

    def argmax(self, x, r: TokenMap) -> str:
        best: list = [-np.inf, self.output]

        def visit(i: int, v: TokenValue) -> None:
            c = max_token_correlation(v.kernel)
            if c > best[0] * (1 + 1e-12) + 1e-15:
                best[:] = [c, i]

        out = max_token_correlation(self._walk(x, r, visit).kernel)
        if best[0] <= out * (1 + 1e-12) + 1e-15:
            return WHOLE_NETWORK
        return f"from the input to {self.user_ids[best[1]]!r}"
