"""The ``densenet`` template (``engine.templates.expand`` describes it): DenseNet-BC without batch norm,
after torchvision's ``DenseNet``."""

from __future__ import annotations

from sigprop.schemas import Template

from .builder import _BIAS, TemplateSize, _bad, _Builder, _image_shape, _param

# torchvision's densenet121/169/201 and the paper's DenseNet-264 (ImageNet, 4 blocks).
DENSENET_IMAGENET_CONFIGS: dict[int, tuple[int, ...]] = {
    121: (6, 12, 24, 16),
    169: (6, 12, 32, 32),
    201: (6, 12, 48, 32),
    264: (6, 12, 64, 48),
}


DENSENET_DESCRIPTION = (
    "DenseNet-BC without batch norm. Depth 121/169/201/264: the ImageNet networks; "
    "any other depth 6n+4: the CIFAR network with three blocks of n layers."
)
DENSENET_PARAMETERS = (
    _param(
        "depth",
        "integer",
        "121, 169, 201, 264 (ImageNet) or 6n+4 (CIFAR, e.g. 40, 100, 190)",
        default=121,
        allowed=sorted(DENSENET_IMAGENET_CONFIGS) + ["6n+4"],
    ),
    _param("growth_rate", "integer", "channels each dense layer adds", default=32, minimum=1),
    _param(
        "input_shape",
        "array of integers",
        "[channels, height, width]; default [3, 224, 224] (ImageNet depths) or [3, 32, 32] (CIFAR)",
        lengths=[3],
    ),
    _param(
        "classes",
        "integer",
        "units of the classifier; default 1000 (ImageNet depths) or 10 (CIFAR)",
        default=None,
        minimum=1,
    ),
    _BIAS,
)


def _densenet_blocks(depth: int) -> tuple[tuple[int, ...], bool] | None:
    """(layers per dense block, ImageNet network?) of a DenseNet depth; None when unsupported."""
    if depth in DENSENET_IMAGENET_CONFIGS:
        return DENSENET_IMAGENET_CONFIGS[depth], True
    if depth >= 10 and (depth - 4) % 6 == 0:
        n = (depth - 4) // 6
        return (n, n, n), False
    return None


def densenet_size(t: Template) -> TemplateSize | None:
    found = _densenet_blocks(t.depth if t.depth is not None else 121)
    if found is None:
        return None
    blocks, imagenet = found
    layers, stem = sum(blocks), (1 if imagenet else 0)  # the ImageNet stem's max_pool
    nodes = 2 + stem + 5 * layers + 3 * (len(blocks) - 1) + 4
    # every node but the input has one input, except the concat after layer i of a block: i + 1
    concat_extra = sum(n * (n + 1) // 2 for n in blocks)
    return TemplateSize(nodes, 2 * layers + len(blocks), max(blocks) + 1, nodes - 1 + concat_extra)


def densenet(t: Template) -> _Builder:
    depth = t.depth if t.depth is not None else 121
    growth = t.growth_rate if t.growth_rate is not None else 32
    bias = True if t.bias is None else t.bias
    found = _densenet_blocks(depth)
    if found is None:
        raise _bad(
            f"densenet depth {depth} is not supported",
            "give 'depth' as 121, 169, 201 or 264 (ImageNet DenseNet-BC), or 6n+4 with n >= 1 "
            "(CIFAR DenseNet-BC with three blocks of n layers, e.g. 40, 100, 190)",
        )
    blocks, imagenet = found
    classes = t.classes if t.classes is not None else (1000 if imagenet else 10)
    shape = _image_shape(t, [3, 224, 224] if imagenet else [3, 32, 32])

    b = _Builder("densenet")
    x = b.input(shape)
    if imagenet:
        # torchvision: conv0 (7x7 / 2, 2k channels) -> norm0 -> relu0 -> pool0 (3 / 2); norm0 and relu0
        # dropped (see the module docstring)
        x = b.conv("conv0", x, 2 * growth, 7, 2, bias)
        x = b.pool("pool0", "max_pool", x, 3, 2)
    else:
        x = b.conv("conv0", x, 2 * growth, 3, 1, bias)
    for bi, n_layers in enumerate(blocks, start=1):
        features = [x]
        for li in range(1, n_layers + 1):
            p = f"denseblock{bi}.denselayer{li}."
            y = b.act(f"{p}act1", x)
            y = b.conv(f"{p}conv1", y, 4 * growth, 1, 1, bias)
            y = b.act(f"{p}act2", y)
            y = b.conv(f"{p}conv2", y, growth, 3, 1, bias)
            features.append(y)
            x = b.concat(f"denseblock{bi}.concat{li}", features)
        if bi < len(blocks):
            p = f"transition{bi}."
            channels = b.shapes[x][0] // 2
            x = b.act(f"{p}act", x)
            x = b.conv(f"{p}conv", x, channels, 1, 1, bias)
            x = b.pool(f"{p}pool", "avg_pool", x, 2, 2)
    x = b.act("final_act", x)
    b.head(x, classes, bias, pool=True)
    return b


# -- the registry ---------------------------------------------------------------------------------
