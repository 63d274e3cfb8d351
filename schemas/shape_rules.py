"""The contract's shape rules for ``sigprop.graph/v1`` (contract section 1), one function per op:
the shape of a node given its inputs' shapes. The op table (``schemas.ops``) names each op's rule;
``schemas.shapes`` applies them to a graph.
"""

from __future__ import annotations

import math

from .errors import SigpropError
from .kernels import sum_coefficients

__all__ = [
    "SUM_WEIGHT_TOLERANCE",
    "Shape",
    "attention_shape",
    "concat_shape",
    "conv_shape",
    "dense_shape",
    "flatten_shape",
    "global_pool_shape",
    "input_shape",
    "norm_shape",
    "pair_pool_shape",
    "pool_shape",
    "product_shape",
    "rms_norm_shape",
    "same_shape",
    "sum_shape",
]

SUM_WEIGHT_TOLERANCE = 1e-6

Shape = tuple[int, ...]


def _invalid(message: str, hint: str) -> SigpropError:
    return SigpropError("invalid_graph", message, hint)


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _conv_out(size: int, kernel: int, stride: int, padding) -> int:
    if padding == "same":
        return math.ceil(size / stride)
    pad = 0 if padding == "valid" else int(padding)
    return (size + 2 * pad - kernel) // stride + 1


def _sequence_refusal(nd, what: str) -> SigpropError:
    return SigpropError(
        "unsupported_structure",
        f"{nd.op} node '{nd.id}' {what} a token stream: sequence graphs take dense, activation, attention, "
        "layer_norm, rms_norm, mul, sum, dropout and identity nodes",
        "token streams have shape [tokens, features]; mixing tokens other than by an 'attention' node "
        "(convolution, pooling, flattening, concatenation) is not covered",
    )


def dense_shape(nd, in_shapes: list[Shape]) -> Shape:
    s = in_shapes[0]
    if len(s) == 2:  # a token stream [tokens, features]: the layer acts per token
        return (s[0], nd.units)
    if len(s) != 1:
        raise _invalid(
            f"dense node '{nd.id}' gets a feature map of shape {list(s)}",
            "insert a 'flatten' or 'global_avg_pool' node before a dense layer",
        )
    return (nd.units,)


def conv_shape(nd, in_shapes: list[Shape]) -> Shape:
    s = in_shapes[0]
    if len(s) == 2:
        raise _sequence_refusal(nd, "reads")
    if len(s) != 3:
        raise _invalid(
            f"conv node '{nd.id}' gets a vector of shape {list(s)}",
            "conv layers take [channels, height, width] inputs; give the input node a 3-element shape",
        )
    (kh, kw), (sh, sw) = _pair(nd.kernel), _pair(nd.stride)
    h, w = _conv_out(s[1], kh, sh, nd.padding), _conv_out(s[2], kw, sw, nd.padding)
    if h < 1 or w < 1:
        raise _invalid(
            f"conv node '{nd.id}' shrinks a {s[1]}x{s[2]} map to nothing",
            "use padding 'same', a smaller kernel or stride, or a larger input",
        )
    return (nd.channels, h, w)


def pool_shape(nd, in_shapes: list[Shape]) -> Shape:
    s = in_shapes[0]
    if len(s) == 2:
        raise _sequence_refusal(nd, "reads")
    if len(s) != 3:
        raise _invalid(
            f"{nd.op} node '{nd.id}' gets a vector of shape {list(s)}",
            "pooling needs a [channels, height, width] input",
        )
    kh, kw = _pair(nd.kernel)
    sh, sw = _pair(nd.stride if nd.stride is not None else nd.kernel)
    pad = getattr(nd, "padding", 0)
    if 2 * pad > min(kh, kw):
        raise _invalid(
            f"{nd.op} node '{nd.id}' pads {pad} with a {kh}x{kw} kernel",
            "padding may be at most half the kernel size (as in PyTorch)",
        )
    h, w = (s[1] + 2 * pad - kh) // sh + 1, (s[2] + 2 * pad - kw) // sw + 1
    if h < 1 or w < 1:
        raise _invalid(f"{nd.op} node '{nd.id}' shrinks a {s[1]}x{s[2]} map to nothing", "use a smaller pooling kernel")
    return (s[0], h, w)


def pair_pool_shape(nd, in_shapes: list[Shape]) -> Shape:
    """max_pool on [features] or per token on [tokens, features]: the maximum of adjacent pairs of
    features, so kernel 2, stride 2, no padding, an even number of features (the op table's
    ``max_pool_pairs`` row; a window of two is what the theory has in closed form)."""
    s = in_shapes[0]
    stride = nd.stride if nd.stride is not None else nd.kernel
    if _pair(nd.kernel) != (2, 2) or _pair(stride) != (2, 2) or getattr(nd, "padding", 0):
        raise _invalid(
            f"{nd.op} node '{nd.id}' on features of shape {list(s)} has kernel {nd.kernel}, stride {stride}, "
            f"padding {getattr(nd, 'padding', 0)}",
            "on [features] or a token stream max_pool takes adjacent pairs: kernel 2, stride 2 (the default), "
            "no padding; wider windows pool a [channels, height, width] map",
        )
    if s[-1] % 2:
        raise _invalid(
            f"{nd.op} node '{nd.id}' pairs {s[-1]} features, an odd number",
            "give the layer before it an even number of units",
        )
    return tuple(s[:-1]) + (s[-1] // 2,)


def global_pool_shape(nd, in_shapes: list[Shape]) -> Shape:
    s = in_shapes[0]
    if len(s) == 2:
        raise _sequence_refusal(nd, "reads")
    if len(s) != 3:
        raise _invalid(
            f"global_avg_pool node '{nd.id}' gets a vector of shape {list(s)}",
            "it needs a [channels, height, width] input",
        )
    return (s[0],)


def sum_shape(nd, in_shapes: list[Shape]) -> Shape:
    s = in_shapes[0]
    if in_shapes.count(s) != len(in_shapes):
        raise _invalid(
            f"sum node '{nd.id}' adds shapes {[list(x) for x in in_shapes]}",
            "all inputs of a sum must have the same shape",
        )
    n = len(in_shapes)
    weights = nd.weights if nd.weights is not None else [1.0 / math.sqrt(n)] * n
    if len(weights) != n:
        raise _invalid(f"sum node '{nd.id}' has {n} inputs but {len(weights)} weights", "give one weight per input")
    sq = sum(sum_coefficients(weights))  # the sum's q for inputs at q = 1
    if abs(sq - 1.0) > SUM_WEIGHT_TOLERANCE:
        norm = math.sqrt(sq) if sq > 0 else 1.0
        raise _invalid(
            f"sum node '{nd.id}' weights have sum of squares {sq:.6g}, not 1",
            f"normalize them, e.g. {[round(w / norm, 6) for w in weights]}, or omit them for equal weights",
        )
    return s


def concat_shape(nd, in_shapes: list[Shape]) -> Shape:
    s = in_shapes[0]
    if any(len(x) == 2 for x in in_shapes):
        raise _sequence_refusal(nd, "joins")
    if len({len(x) for x in in_shapes}) != 1 or (len(s) == 3 and len({x[1:] for x in in_shapes}) != 1):
        raise _invalid(
            f"concat node '{nd.id}' joins shapes {[list(x) for x in in_shapes]}",
            "concatenation is along channels: inputs need equal rank and equal height and width",
        )
    return (sum(x[0] for x in in_shapes),) + tuple(s[1:])


def flatten_shape(nd, in_shapes: list[Shape]) -> Shape:
    s = in_shapes[0]
    if len(s) == 2:
        raise _sequence_refusal(nd, "reads")
    return (math.prod(s),)


def norm_shape(nd, in_shapes: list[Shape]) -> Shape:
    s = in_shapes[0]
    if len(s) != 2:
        raise _invalid(
            f"layer_norm node '{nd.id}' gets shape {list(s)}, not a token stream",
            'layer_norm normalizes each token of a sequence: give the input node "sequence": true and shape '
            "[tokens, features]",
        )
    return s


def rms_norm_shape(nd, in_shapes: list[Shape]) -> Shape:
    """RMSNorm: per token on a token stream [tokens, features], per example on [features]."""
    s = in_shapes[0]
    if len(s) == 3:
        raise _invalid(
            f"rms_norm node '{nd.id}' gets a feature map of shape {list(s)}",
            "rms_norm normalizes over features: apply it to [features] (after 'flatten' or 'global_avg_pool') or to "
            "a token stream [tokens, features]",
        )
    return s


def product_shape(nd, in_shapes: list[Shape]) -> Shape:
    """An elementwise product: two inputs of one shape."""
    if len(in_shapes) != 2 or in_shapes[0] != in_shapes[1]:
        raise _invalid(
            f"mul node '{nd.id}' multiplies shapes {[list(x) for x in in_shapes]}",
            "mul takes exactly two inputs of the same shape (e.g. two dense nodes with equal units reading one node)",
        )
    return in_shapes[0]


def attention_shape(nd, in_shapes: list[Shape]) -> Shape:
    """Query, key and value: token streams of one shape whose features the heads divide."""
    if any(len(x) != 2 for x in in_shapes):
        raise _invalid(
            f"attention node '{nd.id}' reads shapes {[list(x) for x in in_shapes]}, not token streams",
            'attention mixes tokens: give the input node "sequence": true and shape [tokens, features]',
        )
    s = in_shapes[0]
    if in_shapes.count(s) != 3:
        raise _invalid(
            f"attention node '{nd.id}' reads query, key and value of shapes {[list(x) for x in in_shapes]}",
            "query, key and value must be dense nodes with equal units reading the same node",
        )
    if s[1] % nd.heads:
        raise _invalid(
            f"attention node '{nd.id}' has {nd.heads} heads for {s[1]} features",
            "the query/key/value units must be a multiple of heads",
        )
    return s


def input_shape(nd, in_shapes: list[Shape]) -> Shape:
    return tuple(nd.shape)


def same_shape(nd, in_shapes: list[Shape]) -> Shape:
    """Ops that keep their (first) input's shape: activations, dropout, identity, output."""
    return in_shapes[0]
