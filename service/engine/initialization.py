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

from ..schemas.solve import LayerInit
from .graph import AFFINE, NetworkGraph

_LAYERS = TypeAdapter(list[LayerInit])


def layer_inits(graph: NetworkGraph, init: str, sigma_w2: float = 1.0, sigma_b2: float = 0.0) -> list[LayerInit]:
    layers = []
    for nd in graph.nodes:
        if nd.kind != AFFINE:
            continue
        in_channels = graph.nodes[nd.inputs[0]].shape[0]
        out_channels = nd.shape[0]
        kernel = nd.attrs.get("kernel")
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
        if not nd.attrs.get("bias", True):
            bias = "none"
        else:
            bias = "gaussian" if sigma_b2 > 0 else "zeros"
        layers.append(
            dict(
                id=nd.user_id,
                node=nd.index,
                op=nd.op,
                fan_in=fan_in,
                fan_out=out_channels,
                kernel=kernel,
                distribution=dist,
                gain=gain,
                weight_variance=variance,
                bias=bias,
                bias_variance=sigma_b2 if bias == "gaussian" else 0.0,
            )
        )
    # one validation of the whole list (pydantic-core's loop) costs half as much as a model per layer
    return _LAYERS.validate_python(layers)
