"""Bring a standard model into a form the kernel theory covers: no normalization layers and, for
torchvision-style ResNets, pre-activation residual blocks.

The theory behind every answer (TAT paper, arXiv:2203.08120, section 2.3) assumes each activation
reads a Gaussian input: a dense/conv output or a normalized sum of such outputs. Two things in
common models break this:

* normalization layers (BatchNorm, GroupNorm, LayerNorm, InstanceNorm): the methods replace what
  they do, so they are removed (``nn.Identity``);
* torchvision's ResNet blocks are post-activation: ``relu(bn2(conv2(relu(bn1(conv1(x))))) + x)``.
  Without BatchNorm the identity shortcut then carries post-activation features into the next
  activation, and q grows block by block (to 5-180 at the logits of a ResNet-18). The rewrite is the
  pre-activation layout of the rescaled ResNets the papers use (dks's ``BlockV2``): each block computes
  ``conv2(act(conv1(act(x)))) + shortcut`` with ``shortcut = x``, or ``downsample(act(x))`` for a
  projection; the stem is ``conv1 -> maxpool`` and one activation follows the last block. The same
  conv modules (and their weights, until ``apply`` re-initializes them) are reused.
"""

from __future__ import annotations

import copy

from torch import nn

from .rewrite import ConvertReport

__all__ = ["ConvertReport", "normalization_free"]

NORMALIZATION = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LocalResponseNorm,
)


class PreActBlock(nn.Module):
    """``convs[-1](act(... convs[0](act(x)))) + shortcut``; ``shortcut`` is ``x`` or
    ``downsample(act(x))``. The add is traced as a sum that ``apply`` normalizes."""

    def __init__(self, convs: list[nn.Module], downsample: nn.Module | None, activation: nn.Module):
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.acts = nn.ModuleList(copy.deepcopy(activation) for _ in convs)
        self.downsample = downsample

    def forward(self, x):
        a = self.acts[0](x)
        shortcut = x if self.downsample is None else self.downsample(a)
        out = self.convs[0](a)
        for act, conv in zip(self.acts[1:], self.convs[1:], strict=True):
            out = conv(act(out))
        return out + shortcut


class PreActResNet(nn.Module):
    """torchvision's ResNet in the pre-activation layout: stem ``conv1 -> maxpool``, the blocks,
    then ``act -> avgpool -> flatten -> fc``."""

    def __init__(self, net: nn.Module, activation: nn.Module):
        super().__init__()
        self.conv1, self.maxpool = net.conv1, net.maxpool
        self.layer1, self.layer2, self.layer3, self.layer4 = net.layer1, net.layer2, net.layer3, net.layer4
        self.final_act = copy.deepcopy(activation)
        self.avgpool, self.fc = net.avgpool, net.fc

    def forward(self, x):
        x = self.maxpool(self.conv1(x))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(self.final_act(x)).flatten(1))


_STEM = ("conv1", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc")


def _is_resnet(m: nn.Module) -> bool:
    return all(hasattr(m, name) for name in _STEM)


def _block_convs(block: nn.Module) -> list[nn.Module] | None:
    """A torchvision BasicBlock's (conv1, conv2) or Bottleneck's (conv1, conv2, conv3), else None."""
    if not all(hasattr(block, name) for name in ("conv1", "conv2", "downsample")):
        return None
    names = ["conv1", "conv2"] + (["conv3"] if hasattr(block, "conv3") else [])
    return [getattr(block, name) for name in names]


def _remove_normalization(model: nn.Module, report: ConvertReport) -> None:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, NORMALIZATION):
                setattr(module, child_name, nn.Identity())
                report.removed.append(f"{name}.{child_name}" if name else child_name)


def _downsample(block: nn.Module) -> nn.Module | None:
    ds = block.downsample
    if ds is None:
        return None
    kept = [m for m in (ds if isinstance(ds, nn.Sequential) else [ds]) if not isinstance(m, nn.Identity)]
    return kept[0] if len(kept) == 1 else nn.Sequential(*kept)


def _preactivation(net: nn.Module, report: ConvertReport) -> nn.Module:
    activation = getattr(net, "relu", None) or nn.ReLU()
    activation = type(activation)() if isinstance(activation, nn.ReLU) else copy.deepcopy(activation)
    for lname in ("layer1", "layer2", "layer3", "layer4"):
        layer = getattr(net, lname)
        for i, block in enumerate(layer):
            convs = _block_convs(block)
            if convs is None:
                report.notes.append(f"{lname}.{i} is not a torchvision BasicBlock/Bottleneck: left as it is")
                continue
            layer[i] = PreActBlock(convs, _downsample(block), activation)
            report.rewritten.append(f"{lname}.{i}")
    report.notes.append(
        "stem: conv1 -> maxpool (its activation moved into the first block); one activation "
        "after the last block, before avgpool"
    )
    return PreActResNet(net, activation)


def normalization_free(model: nn.Module, *, preactivation: bool = False) -> ConvertReport:
    """A converted copy of ``model`` (the original is untouched) and a report of every change.

    Normalization layers become ``nn.Identity``. With ``preactivation=True`` a torchvision-style
    ResNet (``conv1``, ``maxpool``, ``layer1``..``layer4`` of BasicBlock/Bottleneck, ``avgpool``,
    ``fc``) is rewritten into the pre-activation layout the kernel theory covers (module docstring);
    for any other model the flag raises ``ValueError``. A HuggingFace GPT-2 or Llama model keeps
    its class: its norms become ``nn.Identity`` and its blocks lose their residual shortcuts
    (``huggingface_apply.normalization_free_hf``; ``removed`` and ``rewritten`` name them).
    """
    from .huggingface import is_huggingface

    if is_huggingface(model):  # norms and shortcuts, the HuggingFace class kept (huggingface_apply.py)
        if preactivation:
            raise ValueError("preactivation=True rewrites torchvision-style ResNets, not HuggingFace models")
        from .huggingface_apply import normalization_free_hf

        return normalization_free_hf(model)
    net = copy.deepcopy(model)
    report = ConvertReport(net)
    _remove_normalization(net, report)
    if preactivation:
        if not _is_resnet(net):
            raise ValueError(
                "preactivation=True rewrites torchvision-style ResNets (conv1, maxpool, layer1..layer4, "
                "avgpool, fc); this model is not one"
            )
        report.model = _preactivation(net, report)
    return report
