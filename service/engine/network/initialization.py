"""Per-layer weight initialization that realizes the kernel analysis (TAT paper Appendix D).

Scale-corrected uniform orthogonal (SUO): for an m x k matrix (k = fan-in), (X X^T)^{-1/2} X with
X ~ N(0, 1) entries (transposed construction when m > k), times max(sqrt(m / k), 1), so the layer
keeps q values. Convolutions use Orthogonal Delta: only the centre tap of each filter is non-zero,
an SUO matrix over (out_channels, in_channels), so the network acts per location (section 2.3).
The alternative is Gaussian fan-in, N(0, sigma_w^2 / fan_in). Biases are zero for TAT and DKS
(sigma_b^2 = 0) and N(0, sigma_b^2) for Edge of Chaos.
"""

from __future__ import annotations

import math

from pydantic import TypeAdapter

from ...schemas.ops import AFFINE
from ...schemas.solve import LayerInit
from ..graph.build import NetworkGraph

_LAYERS = TypeAdapter(list[LayerInit])


def layer_inits(graph: NetworkGraph, init: str, sigma_w2: float = 1.0, sigma_b2: float = 0.0) -> list[LayerInit]:
    nodes = graph.nodes
    # a deep network repeats a few layer shapes: each shape's fields are worked out once
    shared: dict[tuple, dict] = {}
    layers = []
    for nd in nodes:
        if nd.kind != AFFINE:
            continue
        kernel = nd.attrs.get("kernel")
        bias = nd.attrs.get("bias", True)
        shape = (nodes[nd.inputs[0]].shape[0], nd.shape[0], nd.op, None if kernel is None else tuple(kernel), bias)
        fields = shared.get(shape)
        if fields is None:
            fields = shared[shape] = _layer_fields(shape[0], shape[1], nd.op, kernel, bias, init, sigma_w2, sigma_b2)
        layers.append({"id": nd.user_id, "node": nd.index, **fields})
    # one validation of the whole list (pydantic-core's loop) costs half as much as a model per layer
    return _LAYERS.validate_python(layers)


def _layer_fields(
    in_channels: int, out_channels: int, op: str, kernel, bias: bool, init: str, sigma_w2: float, sigma_b2: float
) -> dict:
    """A layer's fields other than its id and node index."""
    taps = kernel[0] * kernel[1] if kernel else 1
    if init == "gaussian":
        fan_in = in_channels * taps
        dist, gain = "gaussian", math.sqrt(sigma_w2 / fan_in)
        variance = sigma_w2 / fan_in
    else:
        # Delta initialization: the kernel analysis sees a dense layer over channels.
        fan_in = in_channels
        dist = "orthogonal_delta" if kernel else "scaled_uniform_orthogonal"
        gain = max(math.sqrt(out_channels / in_channels), 1.0) * math.sqrt(sigma_w2)
        variance = sigma_w2 / in_channels
        if kernel and (kernel[0] % 2 == 0 or kernel[1] % 2 == 0):
            dist, fan_in = "gaussian", in_channels * taps
            gain, variance = math.sqrt(sigma_w2 / fan_in), sigma_w2 / fan_in
    if not bias:
        bias_kind = "none"
    else:
        bias_kind = "gaussian" if sigma_b2 > 0 else "zeros"
    return dict(
        op=op,
        fan_in=fan_in,
        fan_out=out_channels,
        kernel=kernel,
        distribution=dist,
        gain=gain,
        weight_variance=variance,
        bias=bias_kind,
        bias_variance=sigma_b2 if bias_kind == "gaussian" else 0.0,
    )
