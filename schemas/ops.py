"""The op table: one row per op of ``sigprop.graph/v1``, the one place an op is defined.

Every walk of a graph reads an op's row instead of naming the op: the engine's graph builder
(arity, shape, canonical attributes), the atom pass (``schemas.atoms``), the C-map programs of TAT
and DKS, the EoC and sparse-EoC networks, the token-kernel program of sequence graphs, the geometric
solver's moments, the Jacobian's structure, the client's ``diagnose`` predictions, its calibration
and finite-width noise, and the dashboard's diagram. This is the layout of neural-tangents'
``stax``, where each layer is one (init, apply, kernel) definition and ``serial``/``parallel``
compose them; here a row names its *kind*, the rule every walk has one implementation of, and the
op's own parameters of it (shape, attributes, window, coverage).

Kinds, by what an op does to the atoms of ``schemas.atoms`` (every node is a combination of
independent atoms; TAT paper, "Deep Learning without Shortcuts: Shaping the Kernel with Tailored
Rectifiers", arXiv:2203.08120, section 2.3 and Appendix B.4):

- ``source``: the network input, a feature atom at q = 1 (the contract's input convention);
- ``affine``: a dense or conv layer with fresh zero-mean weights: a fresh Gaussian atom, whose q and
  C are ``sigma_w^2 q + sigma_b^2`` over its fan-in (equation 4's affine part);
- ``act``: an elementwise nonlinearity: a feature, exact when its input is Gaussian (equations 4-5);
- ``sum``, ``concat``: linear combinations (``schemas.kernels``);
- ``pass``: the same atoms, as far as the kernel of one location goes (identity, dropout, flatten,
  and pools, whose coverage says when a window of several locations makes it inexact: the
  correlation between locations is the input's, not the graph's);
- ``norm``: per-token (or per-example) normalization by the root mean square over features: the
  same atoms scaled by 1/sqrt(q) at infinite width;
- ``attention``: token mixing (shaped attention, ``engine.sequence``);
- ``product``: the elementwise product of two streams (the gate of SwiGLU/GeGLU): a feature (not
  Gaussian), exact when its factors' atoms are independent: q = q_u q_v, C = C_u C_v, a token kernel
  the Hadamard product K_u o K_v (factors sharing atoms are refused by the atom pass);
- ``max_pair``: the maximum of two adjacent features (``max_pool`` with a window of two on [features]
  or per token): a fixed nonlinearity, a feature like an activation's output. max(a, b) =
  (a + b)/2 + |a - b|/2, and for a, b Gaussian of equal variance q the two halves are independent, so
  q passes through; for independent entries (two units of a dense layer) the C map is
  C(c) = c/2 + (sqrt(1 - c^2) + c arcsin c)/pi (C(0) = 1/pi, C'(1) = 1, C''(1) infinite) and the
  mean sqrt(q/pi) (``pair_max_c`` below).

A wire op whose theory differs by what it reads names the row standing for it on [features] or a
token stream (``OpRule.features``; ``row_at`` resolves it): ``max_pool`` on a [channels, h, w] map is
the ``pass`` row (a window of locations, whose correlation is the input's), on features the
``max_pool_pairs`` row (kind ``max_pair``). Graph builders store the resolved row's op on the node.

``coverage`` says, for a node with given attributes and input shape, whether the theory is exact
there by the row alone (``exact``), measured by calibration (``calibrated``), or outside the theory
(``refused``), with the reason; the atom pass adds the graph-level conditions (Gaussian inputs of
activations, uncorrelated sums).

Plain Python, no numpy: the client reads the same rows as the service.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import shape_rules as rules

__all__ = [
    "ACT",
    "AFFINE",
    "ATTENTION",
    "CALIBRATED",
    "CONCAT",
    "EXACT",
    "KINDS",
    "MAX_PAIR",
    "NORM",
    "OP_TABLE",
    "PASS",
    "PRODUCT",
    "REFUSED",
    "SOURCE",
    "SUM",
    "Coverage",
    "OpRule",
    "canonical_attrs",
    "ops_of_kind",
    "pair_max_c",
    "row_at",
    "rule",
]

SOURCE, PASS, AFFINE, ACT, SUM, CONCAT = "source", "pass", "affine", "act", "sum", "concat"
ATTENTION, NORM, PRODUCT, MAX_PAIR = "attention", "norm", "product", "max_pair"
KINDS = (SOURCE, PASS, AFFINE, ACT, SUM, CONCAT, ATTENTION, NORM, PRODUCT, MAX_PAIR)

EXACT, CALIBRATED, REFUSED = "exact", "calibrated", "refused"


@dataclass(frozen=True)
class Coverage:
    verdict: str  # EXACT, CALIBRATED or REFUSED
    reason: str = ""


_EXACT = Coverage(EXACT)


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


@dataclass(frozen=True)
class OpRule:
    """One op's definition (see the module docstring)."""

    op: str
    kind: str
    # (fewest, most) inputs; None: no upper bound
    arity: tuple[int, int | None] = (1, 1)
    # the node's shape from its wire node and its inputs' shapes (``schemas.shape_rules``)
    shape: Callable = rules.same_shape
    # canonical attributes from the wire node and its number of inputs (what the cache key hashes)
    attrs: Callable[..., dict] = field(default=lambda nd, n: {})
    # entries of its input each output entry reads, from canonical attributes and the input's shape
    # (a layer's spatial taps, a pool's window; 1 for everything elementwise)
    window: Callable[[Mapping, tuple], int] = field(default=lambda attrs, in_shape: 1)
    # the theory's verdict at a node from its canonical attributes and input shape (module docstring);
    # the atom pass adds the graph-level conditions
    coverage: Callable[[Mapping, tuple], Coverage] = field(default=lambda attrs, in_shape: _EXACT)
    # whether ``diagnose`` shows the node in its table (ops that change nothing are not shown)
    shown: bool = True
    # the dashboard diagram's colour, so its legend reads as the graph's vocabulary
    color: str = "#868e96"
    # in the order of the contract's description of the op
    summary: str = ""
    # what a pool takes of its window: "mean" or "max" ("" for an op that is not a pool)
    pool: str = ""
    # an op over the locations of a feature map (channels, height, width): a convolution, a pool
    spatial: bool = False
    # a norm that subtracts the feature mean before it scales (layer_norm; rms_norm does not)
    centres: bool = False
    # random in training mode (dropout): measured, not predicted, when it is on
    stochastic: bool = False
    # one input, and f(a y) = a f(y) for every a > 0: a positive factor on its input is the same factor
    # on its output (calibration puts a node's factor into the layer feeding it through such ops)
    homogeneous: bool = False
    # turns a feature map into per-example features: the cosine of two examples after it is the mean
    # over locations of the locations' (flatten; a global pool averages the locations first)
    to_features: bool = False
    # the network's output (one per graph)
    sink: bool = False
    # the row standing for this op on [features] or a token stream (``row_at``); "" for none
    features: str = ""
    # not a wire op: a row a wire op resolves to (``features``)
    wire: bool = True


def _pooled(op: str, window: Callable[[Mapping, tuple], int]) -> Callable[[Mapping, tuple], Coverage]:
    def coverage(attrs: Mapping, in_shape: tuple) -> Coverage:
        n = window(attrs, in_shape)
        if n <= 1:
            return _EXACT
        return Coverage(
            CALIBRATED,
            f"{op} over {n} locations: their correlation is the input's, not the graph's "
            "(exact only for locations that see the same input; calibration measures it)",
        )

    return coverage


def _pair_coverage(attrs: Mapping, in_shape: tuple) -> Coverage:
    # the shape rule admits windows of two only; the atom pass adds that the input is Gaussian
    return _EXACT


def pair_max_c(c):
    """The C map of the maximum of two independent entries of equal variance, at correlation ``c`` of
    each entry between two inputs: E[max(a, b) max(a', b')] / q = c/2 + (sqrt(1 - c^2) + c arcsin c)/pi
    (max = (a + b)/2 + |a - b|/2; the halves are independent, E[|u| |u'|] the arc-cosine kernel of
    degree 1 at correlation c). Plain ``math`` for a real number; numpy arrays and complex numbers (the
    complex step) go through ``numpy`` by duck typing (``engine.network.subnetworks.max_pair_value``)."""
    c = min(1.0, max(-1.0, float(c)))
    return c / 2.0 + (math.sqrt(1.0 - c * c) + c * math.asin(c)) / math.pi


def _dropout_coverage(attrs: Mapping, in_shape: tuple) -> Coverage:
    if attrs.get("rate", 0.0) > 0:
        return Coverage(CALIBRATED, "dropout at a positive rate scales q by 1/(1 - rate) in training mode")
    return _EXACT


def _sum_attrs(nd, n: int) -> dict:
    weights = nd.weights if nd.weights is not None else [1.0 / math.sqrt(n)] * n
    return {"weights": [float(w) for w in weights]}


def _conv_attrs(nd, n: int) -> dict:
    return {
        "channels": nd.channels,
        "kernel": list(_pair(nd.kernel)),
        "stride": list(_pair(nd.stride)),
        "padding": nd.padding,
        "bias": nd.bias,
    }


def _pool_attrs(nd, n: int) -> dict:
    stride = nd.stride if nd.stride is not None else nd.kernel
    # padding only when given, so graphs without it keep their canonical form and cache keys
    return {
        "kernel": list(_pair(nd.kernel)),
        "stride": list(_pair(stride)),
        **({"padding": nd.padding} if nd.padding else {}),
    }


def _input_attrs(nd, n: int) -> dict:
    # "sequence" only when set, so graphs without token streams keep their canonical form and cache keys
    return {"shape": list(nd.shape), **({"sequence": True} if getattr(nd, "sequence", False) else {})}


def _kernel_taps(attrs: Mapping, in_shape: tuple) -> int:
    kernel = attrs.get("kernel")
    return math.prod(kernel) if kernel else 1


def _all_locations(attrs: Mapping, in_shape: tuple) -> int:
    return math.prod(in_shape[1:]) if len(in_shape) > 1 else 1


_ROWS = (
    OpRule("input", SOURCE, (0, 0), rules.input_shape, _input_attrs, color="#2b8a3e", summary="the network input"),
    OpRule(
        "dense",
        AFFINE,
        shape=rules.dense_shape,
        attrs=lambda nd, n: {"units": nd.units, "bias": nd.bias},
        color="#1971c2",
        summary="a fully connected layer (per token on a token stream)",
    ),
    OpRule(
        "conv",
        AFFINE,
        shape=rules.conv_shape,
        attrs=_conv_attrs,
        window=_kernel_taps,
        color="#1864ab",
        summary="a 2-d convolution",
        spatial=True,
    ),
    OpRule(
        "activation",
        ACT,
        attrs=lambda nd, n: {"fn": nd.fn},
        color="#f08c00",
        summary="an elementwise activation function",
    ),
    OpRule(
        "sum",
        SUM,
        (2, None),
        rules.sum_shape,
        _sum_attrs,
        color="#7048e8",
        summary="a weighted sum, squares of weights summing to 1",
    ),
    OpRule(
        "concat",
        CONCAT,
        (2, None),
        rules.concat_shape,
        color="#ae3ec9",
        summary="concatenation along features or channels",
    ),
    OpRule(
        "avg_pool",
        PASS,
        shape=rules.pool_shape,
        attrs=_pool_attrs,
        window=_kernel_taps,
        coverage=_pooled("avg_pool", _kernel_taps),
        color="#0b7285",
        summary="the mean over a window of locations",
        homogeneous=True,
        pool="mean",
        spatial=True,
    ),
    OpRule(
        "max_pool",
        PASS,
        shape=rules.pool_shape,
        attrs=_pool_attrs,
        window=_kernel_taps,
        coverage=_pooled("max_pool", _kernel_taps),
        color="#0c8599",
        summary="the maximum over a window of locations",
        homogeneous=True,
        pool="max",
        spatial=True,
        features="max_pool_pairs",
    ),
    OpRule(
        "max_pool_pairs",
        MAX_PAIR,
        shape=rules.pair_pool_shape,
        attrs=_pool_attrs,
        window=lambda attrs, in_shape: 2,
        coverage=_pair_coverage,
        color="#0c8599",
        summary="the maximum of adjacent pairs of features (max_pool of kernel 2 on [features] or per token)",
        homogeneous=True,
        wire=False,
    ),
    OpRule(
        "global_avg_pool",
        PASS,
        shape=rules.global_pool_shape,
        window=_all_locations,
        coverage=_pooled("global_avg_pool", _all_locations),
        color="#15aabf",
        summary="the mean over all locations",
        homogeneous=True,
        to_features=True,
        pool="mean",
        spatial=True,
    ),
    OpRule(
        "flatten",
        PASS,
        shape=rules.flatten_shape,
        shown=False,
        summary="a feature map as one vector",
        homogeneous=True,
        to_features=True,
    ),
    OpRule(
        "dropout",
        PASS,
        attrs=lambda nd, n: {"rate": nd.rate},
        coverage=_dropout_coverage,
        shown=False,
        color="#adb5bd",
        summary="dropout (the identity at evaluation)",
        homogeneous=True,
        stochastic=True,
    ),
    OpRule("identity", PASS, shown=False, summary="the identity", homogeneous=True),
    OpRule("output", PASS, color="#c92a2a", summary="the network output", sink=True),
    OpRule(
        "attention",
        ATTENTION,
        (3, 3),
        rules.attention_shape,
        lambda nd, n: {"heads": nd.heads, "causal": nd.causal},
        color="#e8590c",
        summary="self-attention's token mixing of query, key and value",
    ),
    OpRule(
        "layer_norm",
        NORM,
        shape=rules.norm_shape,
        color="#5c940d",
        summary="per-token normalization over the features",
        centres=True,
    ),
    OpRule(
        "rms_norm",
        NORM,
        shape=rules.rms_norm_shape,
        color="#66a80f",
        summary="division by the root mean square over the features, per token or per example",
    ),
    OpRule(
        "mul",
        PRODUCT,
        (2, 2),
        rules.product_shape,
        color="#d6336c",
        summary="the elementwise product of two streams of one shape (a gated MLP's gate)",
    ),
)

OP_TABLE: dict[str, OpRule] = {row.op: row for row in _ROWS}


def rule(op: str) -> OpRule:
    """The row of ``op``; ``KeyError`` for an op the table does not define."""
    return OP_TABLE[op]


def row_at(op: str, in_shapes) -> OpRule:
    """The row of wire op ``op`` for inputs of ``in_shapes``: its ``features`` row where the first input
    is [features] or a token stream [tokens, features], else its own."""
    row = OP_TABLE[op]
    if row.features and in_shapes and len(in_shapes[0]) < 3:
        return OP_TABLE[row.features]
    return row


def ops_of_kind(*kinds: str) -> frozenset[str]:
    """The ops whose kind is one of ``kinds``."""
    return frozenset(row.op for row in _ROWS if row.kind in kinds)


def canonical_attrs(nd, n: int) -> dict:
    """A wire node's canonical attributes, given its number of inputs."""
    return OP_TABLE[nd.op].attrs(nd, n)


def kind_of(op: object) -> str | None:
    """The kind of ``op`` from raw JSON (any value), or None when it names no op of the table."""
    row = OP_TABLE.get(op) if isinstance(op, str) else None
    return row.kind if row is not None else None
