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
- sum: linear, so over *atoms* as in ``schemas.atoms``: every stream is a combination
  sum_a C_a x_a of independent atoms (the input, dense outputs, activation and layer-norm outputs),
  whose coefficient C_a is a number or, after attention, a T x T token-mixing matrix; its kernel is
  sum_a C_a K_a C_a^T. An atom that reaches a sum through several paths (a copy, a nested sum, a
  stream added into two sums) has its coefficients added before the kernel is formed, as the scalar
  engine does (``subnetworks._shared_steps``); where no atom is shared this is the ``w_i^2`` rule of
  ``schemas.kernels``. ``sum_scales`` (the answer's, by node index) multiply a sum's weights, as the
  adapters do;
- layer_norm: per-token centring and scaling (``token_kernels.layer_norm_token_kernel``); rms_norm
  (a norm whose row does not centre): scaling alone (``token_kernels.rms_norm_token_kernel``);
- mul (kind product): the Hadamard product of its factors' kernels and of their means, a new atom
  (the atom pass has checked that the factors' atoms are independent);
- max_pool of adjacent feature pairs (kind max_pair): K'_ij = sqrt(K_ii K_jj) C(K_ij / sqrt(K_ii K_jj)) with
  the closed-form C of ``schemas.ops.pair_max_c``, mean sqrt(K_ii / pi), a new atom
  (``token_kernels.max_pair_token_kernel``);
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

from ...schemas.ops import ACT, AFFINE, ATTENTION, CONCAT, MAX_PAIR, NORM, OP_TABLE, PASS, PRODUCT, SOURCE, SUM
from ..graph.build import NetworkGraph
from ..maps.token_kernels import (
    dense_token_kernel,
    layer_norm_token_kernel,
    max_pair_token_kernel,
    product_token_kernel,
    rms_norm_token_kernel,
)
from ..network.program import WHOLE_NETWORK, NetworkProgram, Repeat

__all__ = [
    "TokenValue",
    "TokenKernelProgram",
    "token_correlations",
    "max_token_correlation",
    "mean_token_correlation",
]


@dataclass(frozen=True)
class TokenValue:
    """A stream's T x T kernel and its per-token feature mean (None: zero)."""

    kernel: np.ndarray
    mean: np.ndarray | None = None


TokenMap = Callable[[TokenValue, int], TokenValue]
# a stream over atoms: atom node -> its coefficient, a number c (c I) or a T x T token-mixing matrix
Expansion = dict[int, "float | np.ndarray"]


def _scaled(c, coef: float):
    return coef * c


def _added(x, y):
    """x + y for coefficients: numbers stand for multiples of the identity."""
    if isinstance(x, float) and not isinstance(y, float):
        x = x * np.eye(y.shape[0])
    elif isinstance(y, float) and not isinstance(x, float):
        y = y * np.eye(x.shape[0])
    return x + y


def _mixed(a: np.ndarray, c):
    return a * c if isinstance(c, float) else a @ c


def _value(expansion: Expansion, atoms: Mapping[int, TokenValue]) -> TokenValue:
    """The kernel sum_a C_a K_a C_a^T and mean sum_a C_a m_a of a stream (atoms independent)."""
    if len(expansion) == 1:
        ((a, c),) = expansion.items()
        if isinstance(c, float) and c == 1.0:
            return atoms[a]
    kernel, mean = None, None
    for a, c in expansion.items():
        v = atoms[a]
        k = c * c * v.kernel if isinstance(c, float) else c @ v.kernel @ c.T
        kernel = k if kernel is None else kernel + k
        if v.mean is not None:
            m = c * v.mean if isinstance(c, float) else c @ v.mean
            mean = m if mean is None else mean + m
    return TokenValue(kernel, mean)


def token_correlations(kernel: np.ndarray) -> np.ndarray:
    """K_ij / sqrt(K_ii K_jj): the kernel's token correlations."""
    d = np.sqrt(np.diag(kernel))
    return kernel / np.outer(d, d)


def max_token_correlation(kernel: np.ndarray) -> float:
    """The largest K_ij / sqrt(K_ii K_jj) over distinct tokens i != j (-inf for one token)."""
    if kernel.shape[0] < 2:
        return -np.inf
    c = token_correlations(kernel)
    np.fill_diagonal(c, -np.inf)
    return float(c.max())


def mean_token_correlation(kernel: np.ndarray) -> float:
    """The mean K_ij / sqrt(K_ii K_jj) over distinct tokens i != j (1 for one token)."""
    t = kernel.shape[0]
    if t < 2:
        return 1.0
    c = token_correlations(kernel)
    return float((c.sum() - np.trace(c)) / (t * (t - 1)))


def _atom(atoms: dict, v: int, value: TokenValue) -> Expansion:
    atoms[v] = value
    return {v: 1.0}


def _source(prog, nd, streams, atoms, start, r) -> Expansion:
    return _atom(atoms, nd.index, start)


def _affine(prog, nd, streams, atoms, start, r) -> Expansion:
    w, b = prog.dense.get(nd.index, (1.0, 0.0))
    k = _value(streams[nd.inputs[0]], atoms).kernel
    # a fresh zero-mean weight matrix: a new atom, independent of everything before it
    return _atom(atoms, nd.index, TokenValue(k if w == 1.0 and b == 0.0 else dense_token_kernel(k, w, b)))


def _act(prog, nd, streams, atoms, start, r) -> Expansion:
    return _atom(atoms, nd.index, r(_value(streams[nd.inputs[0]], atoms), prog.slots[nd.index]))


def _norm(prog, nd, streams, atoms, start, r) -> Expansion:
    u = _value(streams[nd.inputs[0]], atoms)
    if not OP_TABLE[nd.op].centres:  # rms_norm: scaled, not centred; the mean scales with the features
        k = rms_norm_token_kernel(u.kernel)
        mean = None if u.mean is None else u.mean / np.sqrt(np.maximum(np.diag(u.kernel), 1e-300))
        return _atom(atoms, nd.index, TokenValue(k, mean))
    return _atom(atoms, nd.index, TokenValue(layer_norm_token_kernel(u.kernel, u.mean)))


def _product(prog, nd, streams, atoms, start, r) -> Expansion:
    u, v = (_value(streams[i], atoms) for i in nd.inputs)
    mean = None if u.mean is None or v.mean is None else u.mean * v.mean
    return _atom(atoms, nd.index, TokenValue(product_token_kernel(u.kernel, v.kernel), mean))


def _max_pair(prog, nd, streams, atoms, start, r) -> Expansion:
    # a fixed nonlinearity of a Gaussian stream (the atom pass has checked it): a new atom with a mean
    k, mean = max_pair_token_kernel(_value(streams[nd.inputs[0]], atoms).kernel)
    return _atom(atoms, nd.index, TokenValue(k, mean))


def _attention(prog, nd, streams, atoms, start, r) -> Expansion:
    a = prog.mixers[nd.index]
    return {t: _mixed(a, c) for t, c in streams[nd.inputs[2]].items()}


def _sum(prog, nd, streams, atoms, start, r) -> Expansion:
    scale = prog.sum_scales.get(nd.index, 1.0)
    e: Expansion = {}
    for i, w in zip(nd.inputs, nd.attrs["weights"], strict=True):
        for t, c in streams[i].items():
            term = _scaled(c, scale * w)
            e[t] = term if t not in e else _added(e[t], term)
    return e


def _pass(prog, nd, streams, atoms, start, r) -> Expansion:  # identity, dropout, output
    return streams[nd.inputs[0]]


def _concat(prog, nd, streams, atoms, start, r) -> Expansion:
    raise ValueError(f"concat node {nd.user_id!r}: token streams are not concatenated (the shape rule refuses it)")


# a node's token expansion by its op kind: (program, node, live streams, atoms, the input's value, the
# activations' token map) -> its expansion over atoms (new atoms are written into ``atoms``)
TOKEN_RULES = {
    SOURCE: _source,
    AFFINE: _affine,
    ACT: _act,
    NORM: _norm,
    ATTENTION: _attention,
    SUM: _sum,
    PASS: _pass,
    CONCAT: _concat,
    PRODUCT: _product,
    MAX_PAIR: _max_pair,
}


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
        sum_scales: Mapping[int, float] | None = None,
    ):
        self.graph = graph
        self.mixers = dict(mixers)
        self.dense = dict(dense or {})
        self.sum_scales = dict(sum_scales or {})
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
        nodes = self.graph.nodes
        readers = list(self._readers)
        atoms: dict[int, TokenValue] = {}  # the atoms some live stream still holds
        held: dict[int, int] = {}  # atom -> how many live streams hold it
        streams: dict[int, Expansion] = {}
        start = x if isinstance(x, TokenValue) else TokenValue(np.asarray(x, dtype=float))

        for nd in nodes:
            ins, v = nd.inputs, nd.index
            e = TOKEN_RULES[nd.kind](self, nd, streams, atoms, start, r)
            streams[v] = e
            for t in e:
                held[t] = held.get(t, 0) + 1
            if visit is not None:
                visit(v, _value(e, atoms))
            for i in ins:
                readers[i] -= 1
                if readers[i] == 0:
                    for t in streams.pop(i):
                        held[t] -= 1
                        if held[t] == 0:
                            del held[t], atoms[t]
            if len(e) > 1 and readers[v]:
                streams[v] = self._merge_private(e, atoms, held, ~v)
        return _value(streams[self.output], atoms)

    @staticmethod
    def _merge_private(e: Expansion, atoms: dict, held: dict, name: int) -> Expansion:
        """``e`` with the atoms no other live stream holds merged into one atom ``name``: they are
        independent of every other live atom and can only ever be read together from now on, so
        sum_a C_a x_a over them is itself an atom, with kernel sum_a C_a K_a C_a^T. Exact, and it
        keeps a residual stream at a term or two: without it the stream of block l carries l
        atoms, each mixed by every later attention node (L^2 T^3 work for L blocks)."""
        private = [t for t in e if held[t] == 1]
        if len(private) < 2:
            return e
        merged = _value({t: e[t] for t in private}, atoms)
        out = {t: c for t, c in e.items() if held[t] != 1}
        for t in private:
            del held[t], atoms[t]
        atoms[name], held[name], out[name] = merged, 1, 1.0
        return out

    def walk(self, x, r: TokenMap, visit: Callable[[int, TokenValue], None] | None = None) -> TokenValue:
        """The output's token value for the input kernel ``x``; ``visit(node index, value)`` sees every
        node's value on the way."""
        return self._walk(x, r, visit)

    def global_map(self, x, r: TokenMap, repeat: Repeat | None = None) -> TokenValue:
        """The output's token value for the input kernel ``x`` (or ``TokenValue``)."""
        return self._walk(x, r)

    def candidate_values(self, x, r: TokenMap, product=None) -> list:
        found: list[float] = []
        self._walk(x, r, lambda _i, v: found.append(max_token_correlation(v.kernel)))
        return found

    def argmax(self, x, r: TokenMap, product=None) -> str:
        best: list = [-np.inf, self.output]

        def visit(i: int, v: TokenValue) -> None:
            c = max_token_correlation(v.kernel)
            if c > best[0] * (1 + 1e-12) + 1e-15:
                best[:] = [c, i]

        out = max_token_correlation(self._walk(x, r, visit).kernel)
        if best[0] <= out * (1 + 1e-12) + 1e-15:
            return WHOLE_NETWORK
        return f"from the input to {self.user_ids[best[1]]!r}"
