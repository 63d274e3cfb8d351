"""What each traced torch op is in the contract's graph: its op and attributes, or why it has none.

:func:`classify` maps one node of a ``torch.fx`` trace (a module call, a function or a method
call) to a ``sigprop.graph/v1`` op with its attributes, or raises :class:`Unsupported` with the
reason and a hint.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from ...schemas.activations import ACTIVATION_NAMES
from .. import adapters
from .modules import ACT_MODULES, NormalizedSum, TransformedActivation

__all__ = ["Unsupported", "NotYet", "classify", "describe", "sequence_module", "hand_written_attention", "rms_norm"]

_ACT_FUNCTIONS: dict[Any, str] = {
    F.relu: "relu",
    torch.relu: "relu",
    F.relu_: "relu",
    torch.relu_: "relu",
    F.leaky_relu: "leaky_relu",
    F.leaky_relu_: "leaky_relu",
    torch.tanh: "tanh",
    F.tanh: "tanh",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    F.softplus: "softplus",
    F.silu: "swish",
    F.elu: "elu",
    F.elu_: "elu",
    F.selu: "selu",
    torch.selu: "selu",
    F.softsign: "softsign",
    torch.erf: "erf",
    torch.special.erf: "erf",
    torch.atan: "atan",
    torch.asinh: "asinh",
    F.gelu: "gelu",
}
_ACT_METHODS = {
    "relu": "relu",
    "relu_": "relu",
    "tanh": "tanh",
    "tanh_": "tanh",
    "sigmoid": "sigmoid",
    "sigmoid_": "sigmoid",
    "erf": "erf",
    "erf_": "erf",
    "atan": "atan",
    "asinh": "asinh",
}
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_"}
# a product of two network tensors is a ``mul`` node; a tensor times a constant is a scale (not an op of
# the graph: refused as before, or the identity under allow_unsupported)
_MUL_FUNCTIONS = {operator.mul, operator.imul, torch.mul, torch.multiply}
_MUL_METHODS = {"mul", "mul_", "multiply", "multiply_", "__mul__", "__rmul__"}
_CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate}
_FLATTEN_FUNCTIONS = {torch.flatten, torch.reshape}
_FLATTEN_METHODS = {"flatten", "view", "reshape"}
_IDENTITY_METHODS = {"contiguous", "clone", "detach", "float", "to", "type_as"}
_IDENTITY_FUNCTIONS = {torch.clone}
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, torch.dropout}
_POOL_MODULES = {nn.MaxPool1d: "max_pool", nn.MaxPool2d: "max_pool", nn.AvgPool1d: "avg_pool", nn.AvgPool2d: "avg_pool"}
_POOL_FUNCTIONS = {
    F.max_pool1d: "max_pool",
    F.max_pool2d: "max_pool",
    F.avg_pool1d: "avg_pool",
    F.avg_pool2d: "avg_pool",
}
_ADAPTIVE_FUNCTIONS = {F.adaptive_avg_pool1d, F.adaptive_avg_pool2d}
_MEAN = {torch.mean}

# torch's elementwise activations the catalogue lacks (nn.Mish, nn.Hardswish, nn.ReLU6, ...): the modules
# of torch.nn.modules.activation that act on each entry alone, and their functions (F.mish, F.hardswish_)
_NOT_ELEMENTWISE = ("MultiheadAttention", "Softmax", "Softmax2d", "LogSoftmax", "Softmin", "GLU")
_OTHER_ACT_MODULES = tuple(
    c
    for c in vars(nn.modules.activation).values()
    if isinstance(c, type)
    and issubclass(c, nn.Module)
    and c.__module__ == nn.modules.activation.__name__
    and c.__name__ not in _NOT_ELEMENTWISE
    and c not in ACT_MODULES
    and c is not nn.GELU
)
_OTHER_ACT_FUNCTIONS = {
    fn: f"F.{c.__name__.lower()}"
    for c in _OTHER_ACT_MODULES
    for fn in (getattr(F, c.__name__.lower(), None), getattr(F, c.__name__.lower() + "_", None))
    if fn is not None
}

_UNSUPPORTED_HINT = (
    "the graph covers dense and conv layers, activations, sums, channel concatenations, pooling, "
    "flatten, dropout and identity: replace or remove the op, write the graph by hand, or pass "
    "allow_unsupported=True to treat it as the identity (the answer then ignores what it does)"
)
_NORM_HINT = (
    "TAT and DKS networks are normalization-free (the answer's initialization and transformed activations "
    "do the normalization's job): for a torchvision-style ResNet, "
    "sigprop.client.torch.normalization_free(model, preactivation=True) drops the normalization layers and "
    "rewrites its post-activation blocks into the covered pre-activation layout; for any other model, "
    "normalization_free(model) drops them (nn.Identity). Or pass allow_unsupported=True to treat it as "
    "the identity (the answer then ignores what it does)"
)
_NORM_MODULES = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)


def _pair(v, one_d: bool) -> list[int]:
    if isinstance(v, (tuple, list)):
        v = [int(x) for x in v]
        return [v[0], 1] if one_d else (v * 2 if len(v) == 1 else v[:2])
    return [int(v), 1] if one_d else [int(v), int(v)]


def _arg(node: torch.fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


class Unsupported(adapters.Unsupported):
    """An op the graph cannot express: ``why`` says what it is, ``hint`` what to do."""

    default_hint = _UNSUPPORTED_HINT


def _unknown_activation(name: str) -> Unsupported:
    """An elementwise activation outside the catalogue (nn.Mish, F.hardswish): named with the
    catalogue's list, and the way out is one of those, not the identity (which drops a nonlinearity)."""
    modules = [
        f"nn.{c.__name__}" + (f" ({n})" if n.replace("_", "") != c.__name__.lower() else "")
        for c, n in ACT_MODULES.items()
    ]
    return Unsupported(
        f"{name} is not a supported activation; supported: {', '.join(ACTIVATION_NAMES)}",
        f"replace it with one of those: PyTorch's {', '.join(modules)}, nn.GELU, or "
        "sigprop.client.torch.TransformedActivation(name) for any name listed; or write the graph by hand",
    )


_SEQUENCE_HINT = (
    "sequence models are covered when written with the ops of a sequence graph, on a [batch, tokens, "
    "features] input: Linear layers per token, activations, sums, LayerNorm over the features and "
    "self-attention (F.scaled_dot_product_attention on Linear q/k/v with view/transpose head plumbing, or "
    "nn.MultiheadAttention(batch_first=True) called as att(x, x, x)); torch's nn.Transformer* blocks and "
    "HuggingFace models are not supported yet (write the blocks by hand). A model that flattens its "
    "tokens first (x.flatten(1)) before its Linear layers is an MLP and is covered"
)


class NotYet(Unsupported):
    """A sequence-model construct outside what the sequence graph reads: refused even under
    ``allow_unsupported`` (treating attention or a per-token layer as the identity gives an answer
    for a different network)."""

    def __init__(self, why: str):
        super().__init__(why, _SEQUENCE_HINT)


_ATTENTION_FUNCTIONS = {F.scaled_dot_product_attention, F.multi_head_attention_forward}


def sequence_module(m: nn.Module, by_name: bool = True) -> str | None:
    """What a module is when it is attention or a Transformer block (None otherwise), by type:
    torch's own and (``by_name``) any class named ``*Attention*`` (HuggingFace's GPT2Attention,
    BertSelfAttention)."""
    kinds = (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
             nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)  # fmt: skip
    if isinstance(m, kinds) or (by_name and "Attention" in type(m).__name__):
        return f"{type(m).__name__}: attention"
    return None


_PRODUCT_FUNCTIONS = {operator.matmul, torch.matmul, torch.bmm, torch.baddbmm, torch.einsum}
_PRODUCT_METHODS = {"matmul", "bmm", "baddbmm", "__matmul__"}


def hand_written_attention(gm: torch.fx.GraphModule) -> str | None:
    """Why a traced model on ``[batch, tokens, features]`` holds attention written out by hand
    (``q @ k.transpose(-1, -2)``, ``torch.bmm``, ``torch.einsum`` of two tensors both computed from
    the input, as GPT-2's and nanoGPT's eager attention are), else None. The sequence graph reads
    attention only as ``F.scaled_dot_product_attention`` or ``nn.MultiheadAttention``; the walker
    would otherwise stop at the head plumbing (``view`` to ``[B, T, H, d]``) with a flatten hint, or,
    under ``allow_unsupported``, treat the product as the identity of one factor and solve another
    network."""
    data: set = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if not data:
                data.add(node)
            continue
        ins = [a for a in node.all_input_nodes if a in data]
        if not ins:
            continue
        data.add(node)
        product = (node.op == "call_function" and node.target in _PRODUCT_FUNCTIONS) or (
            node.op == "call_method" and node.target in _PRODUCT_METHODS
        )
        if product and len(set(ins)) >= 2:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            where = f" in module '{stack[-1][0]}' ({stack[-1][1].__name__})" if stack else ""
            return (
                f"node '{node.name}' ({describe(node, gm)}){where} multiplies two tensors computed from the input "
                "(attention written out by hand: q @ k^T, then the weights @ v), which is not supported yet; "
                "write it as F.scaled_dot_product_attention(q, k, v, is_causal=...) on Linear q, k and v"
            )
    return None


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", repr(t))
    return f"{mod}.{name}" if mod and not mod.startswith("_operator") else name


def describe(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    if node.op == "call_module":
        return f"{type(gm.get_submodule(node.target)).__name__} module '{node.target}'"
    if node.op == "call_method":
        return f"Tensor.{node.target}() call '{node.name}'"
    if node.op == "call_function":
        return f"{_target_name(node)}() call '{node.name}'"
    return f"{node.op} '{node.name}'"


def _conv_attrs(m: nn.Module, in_shape, out_shape) -> dict:
    one_d = isinstance(m, nn.Conv1d)
    if m.groups != 1:
        raise Unsupported(
            f"grouped convolution (groups={m.groups})", "the kernel analysis covers dense convolutions only (groups=1)"
        )
    if any(int(d) != 1 for d in m.dilation):
        raise Unsupported(f"dilated convolution (dilation={tuple(m.dilation)})", "use dilation=1")
    kernel = _pair(m.kernel_size, one_d)
    stride = _pair(m.stride, one_d)
    if isinstance(m.padding, str):
        padding = m.padding
    else:
        pad = [int(p) for p in m.padding]
        half = [(k - 1) // 2 for k in kernel[: len(pad)]]
        odd = all(k % 2 == 1 for k in kernel[: len(pad)])
        if all(p == 0 for p in pad):
            padding = "valid"
        elif odd and pad == half:
            padding = "same"  # same output size as the contract's 'same' for odd kernels, any stride
        elif not one_d and len(set(pad)) == 1:
            padding = pad[0]
        else:
            raise Unsupported(
                f"convolution padding {tuple(pad)} with kernel {tuple(kernel[: len(pad)])}",
                "the graph's padding is 'same', 'valid' or one integer for both axes; for Conv1d use "
                "padding 0 or (kernel - 1) // 2 with an odd kernel",
            )
    return {
        "channels": int(m.out_channels),
        "kernel": kernel,
        "stride": stride,
        "padding": padding,
        "bias": m.bias is not None,
    }


def _pool_attrs(kernel, stride, padding, dilation, ceil_mode, one_d: bool, what: str) -> dict:
    pads = [int(p) for p in (padding if isinstance(padding, (tuple, list)) else [padding])]
    if len(set(pads)) > 1 or (one_d and len(pads) > 1):
        raise Unsupported(f"{what} with padding {padding}", "the graph's pooling pads every side alike: one integer")
    dils = dilation if isinstance(dilation, (tuple, list)) else [dilation]
    if any(int(d) != 1 for d in dils):
        raise Unsupported(f"{what} with dilation {dilation}", "use dilation=1")
    if ceil_mode:
        raise Unsupported(f"{what} with ceil_mode=True", "use ceil_mode=False")
    k = _pair(kernel, one_d)
    s = _pair(stride if stride not in (None, [], ()) else kernel, one_d)
    if one_d and pads[0]:
        raise Unsupported(f"{what} with padding {padding}", "1-d pooling runs on a [C, L, 1] map: use padding=0")
    return {"kernel": k, "stride": s, **({"padding": pads[0]} if pads[0] else {})}


def _adaptive(out_size, in_shape, one_d: bool) -> tuple[str, dict]:
    sizes = out_size if isinstance(out_size, (tuple, list)) else [out_size] * (1 if one_d else 2)
    spatial = list(in_shape[2:])
    sizes = [spatial[i] if s is None else int(s) for i, s in enumerate(sizes)]
    if all(s == 1 for s in sizes):
        return "global_avg_pool", {}
    if all(h % s == 0 for h, s in zip(spatial, sizes, strict=False)):
        k = [h // s for h, s in zip(spatial, sizes, strict=False)]
        k = [k[0], 1] if one_d else k
        return "avg_pool", {"kernel": k, "stride": list(k)}
    raise Unsupported(
        f"adaptive average pooling to {tuple(sizes)} from {tuple(spatial)}",
        "use an output size that divides the input size, or 1 (global average pooling)",
    )


def _flatten_like(in_shape, out_shape) -> tuple[str, dict]:
    if in_shape == out_shape:
        return "identity", {}
    if (
        len(out_shape) == 2
        and len(in_shape) >= 2
        and out_shape[0] == in_shape[0]
        and out_shape[1] == math.prod(in_shape[1:])
    ):
        return "flatten", {}
    raise Unsupported(
        f"reshape from {list(in_shape)} to {list(out_shape)}",
        "only flattening all but the batch dimension is covered ([B, ...] -> [B, features])",
    )


def _act(extra: dict, fn: str, **params) -> tuple[str, dict]:
    extra["fn"] = fn
    extra["fn_params"] = {k: float(v) for k, v in params.items() if v is not None}
    return "activation", {"fn": fn}


def classify(node: torch.fx.Node, gm: torch.fx.GraphModule, data_in: list, shapes: dict) -> tuple[str, dict, dict]:
    """(contract op, attributes, extra) of one data node; raises :class:`Unsupported`.

    ``extra`` carries what apply needs later: the called ``module``, and for activations the
    model's own function ``fn`` with its parameters ``fn_params``."""
    extra: dict = {}
    out_shape = shapes[node]
    in_shape = shapes[data_in[0]] if data_in else None
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        extra["module"] = m
        op, attrs = _classify_module(m, in_shape, out_shape, extra)
    else:
        op, attrs = _classify_call(node, data_in, shapes, extra)
    return op, attrs, extra


def _classify_module(m: nn.Module, in_shape, out_shape, extra: dict) -> tuple[str, dict]:
    if isinstance(m, TransformedActivation):
        return _act(extra, m.name, **m.params)
    if isinstance(m, NormalizedSum):
        if m.beta is not None:
            raise Unsupported(
                "a residual-beta sum x + beta/sqrt(L) F(x) is not a normalized sum",
                "extract the graph from the model before apply()",
            )
        return "sum", {"weights": list(m.weights)}
    if isinstance(m, nn.Linear):
        if len(in_shape) != 2:
            raise NotYet(
                f"Linear applied to each token of a {list(in_shape)} tensor (a {len(in_shape)}-D Linear) is not "
                "supported yet"
            )
        return "dense", {"units": int(m.out_features), "bias": m.bias is not None}
    if isinstance(m, (nn.Conv1d, nn.Conv2d)) and type(m) in (nn.Conv1d, nn.Conv2d):
        return "conv", _conv_attrs(m, in_shape, out_shape)
    if type(m) in ACT_MODULES:
        if isinstance(m, nn.Softplus) and float(m.beta) != 1.0:
            raise Unsupported(f"Softplus with beta={m.beta}", "use beta=1 (the engine's softplus)")
        return _act(
            extra,
            ACT_MODULES[type(m)],
            negative_slope=getattr(m, "negative_slope", None),
            alpha=getattr(m, "alpha", None) if isinstance(m, nn.ELU) else None,
        )
    if type(m) is nn.GELU:
        return _act(extra, "gelu_tanh" if m.approximate == "tanh" else "gelu")
    if isinstance(m, _DROPOUT_MODULES):
        return "dropout", {"rate": float(m.p)}
    if type(m) is nn.Identity:
        return "identity", {}
    if type(m) is nn.Flatten:
        return _flatten_like(in_shape, out_shape)
    if type(m) in _POOL_MODULES:
        one_d = type(m) in (nn.MaxPool1d, nn.AvgPool1d)
        return _POOL_MODULES[type(m)], _pool_attrs(
            m.kernel_size, m.stride, m.padding, getattr(m, "dilation", 1), m.ceil_mode, one_d, type(m).__name__
        )
    if type(m) in (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d):
        return _adaptive(m.output_size, in_shape, type(m) is nn.AdaptiveAvgPool1d)
    if isinstance(m, nn.RMSNorm):
        return rms_norm(list(m.normalized_shape), in_shape, "nn.RMSNorm")
    if isinstance(m, nn.LayerNorm) and len(in_shape) == 3 and list(m.normalized_shape) == [in_shape[-1]]:
        raise NotYet(f"LayerNorm over the features of each token of a {list(in_shape)} tensor is not supported yet")
    if isinstance(m, _NORM_MODULES):
        raise Unsupported(
            f"{type(m).__name__} is a normalization layer, which the Q/C map analysis does not model", _NORM_HINT
        )
    if sequence_module(m):
        raise NotYet(f"{sequence_module(m)} is not supported yet")
    if isinstance(m, _OTHER_ACT_MODULES):
        raise _unknown_activation(f"nn.{type(m).__name__}")
    raise Unsupported(f"{type(m).__name__} is not an op of the sigprop graph")


def _add(node: torch.fx.Node, data_in: list, shapes: dict) -> tuple[str, dict]:
    alpha = node.kwargs.get("alpha", 1)
    if len(data_in) != 2 or any(not isinstance(a, torch.fx.Node) for a in node.args[:2]):
        raise Unsupported(
            "an add of a tensor and a constant (a bias shift)",
            "only sums of two network tensors map to a normalized 'sum' node",
        )
    if alpha != 1:
        raise Unsupported(f"torch.add with alpha={alpha}", "use a plain a + b")
    if shapes[data_in[0]] != shapes[data_in[1]]:
        raise Unsupported(
            f"an add that broadcasts {list(shapes[data_in[0]])} and {list(shapes[data_in[1]])}",
            "the graph's sums add tensors of one shape",
        )
    return "sum", {}


def rms_norm(normalized: list, in_shape, what: str) -> tuple[str, dict]:
    """An RMSNorm over the features: of each example ``[B, F]`` or each token ``[B, T, F]``.
    Its weight (``elementwise_affine``) is what the answer's ``rms_norm`` node takes as 1: ``apply``
    resets it, as it resets a LayerNorm's affine parameters."""
    if in_shape is None or len(in_shape) not in (2, 3) or [int(d) for d in normalized] != [in_shape[-1]]:
        raise Unsupported(
            f"{what} over {list(normalized)} of a {list(in_shape or ())} tensor (not over the features of each "
            "example or token)",
            "the graph's rms_norm divides each example's [features] (or each token's) by their root mean "
            "square: normalize over the last axis of a [batch, features] or [batch, tokens, features] tensor",
        )
    return "rms_norm", {}


def _rms_norm_call(node: torch.fx.Node, in_shape) -> tuple[str, dict]:
    if _arg(node, 2, "weight") is not None:
        raise Unsupported(
            "F.rms_norm with a weight",
            "use nn.RMSNorm (apply resets its weight to 1, what the graph's rms_norm node is) or no weight",
        )
    shape = _arg(node, 1, "normalized_shape")
    shape = [shape] if isinstance(shape, int) else list(shape or [])
    return rms_norm(shape, in_shape, "F.rms_norm")


def _mul(node: torch.fx.Node, data_in: list, shapes: dict) -> tuple[str, dict] | None:
    """A product of two network tensors (a gated MLP's gate); None for a tensor times a constant
    (a scale: not a ``mul`` node)."""
    if len(data_in) != 2 or any(not isinstance(a, torch.fx.Node) for a in node.args[:2]):
        return None
    if shapes[data_in[0]] != shapes[data_in[1]]:
        raise Unsupported(
            f"a product that broadcasts {list(shapes[data_in[0]])} and {list(shapes[data_in[1]])}",
            "the graph's mul multiplies two tensors of one shape elementwise (a gated MLP: act(W1 x) * (W2 x))",
        )
    return "mul", {}


def _activation_call(node: torch.fx.Node, fn: str, extra: dict) -> tuple[str, dict]:
    """An activation function or method; the model's own parameters go to ``extra``."""
    if fn == "gelu":
        return _act(extra, "gelu_tanh" if _arg(node, 1, "approximate", "none") == "tanh" else "gelu")
    if fn == "leaky_relu":
        return _act(extra, fn, negative_slope=_arg(node, 1, "negative_slope", 0.01))
    if fn == "elu":
        return _act(extra, fn, alpha=_arg(node, 1, "alpha", 1.0))
    if fn == "softplus":
        beta = _arg(node, 1, "beta", 1.0)
        if float(beta) != 1.0:
            raise Unsupported(f"softplus with beta={beta}", "use beta=1 (the engine's softplus)")
    return _act(extra, fn)


def _global_mean(node: torch.fx.Node, in_shape) -> tuple[str, dict]:
    dims = _arg(node, 1, "dim")
    rank = len(in_shape)
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if rank in (3, 4) and sorted(int(d) % rank for d in dims) == list(range(2, rank)):
        return "global_avg_pool", {}
    raise Unsupported(
        f"a mean over dims {dims} of a rank-{rank} tensor",
        "only a mean over all spatial dims (global average pooling) is covered",
    )


def _concat(node: torch.fx.Node, shapes: dict) -> tuple[str, dict]:
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = _arg(node, 1, "dim", 0)
    if dim is None or (int(dim) % len(shapes[node])) != 1:
        raise Unsupported(f"concatenation along dim {dim}", "the graph concatenates channels/features (dim=1)")
    if any(not isinstance(t, torch.fx.Node) or t not in shapes for t in tensors):
        raise Unsupported("a concatenation with a constant tensor", "concatenate network tensors only")
    return "concat", {}


def _pool_call(node: torch.fx.Node) -> tuple[str, dict]:
    target = node.target
    one_d = target in (F.max_pool1d, F.avg_pool1d)
    kernel, stride, padding = _arg(node, 1, "kernel_size"), _arg(node, 2, "stride"), _arg(node, 3, "padding", 0)
    if target in (F.max_pool1d, F.max_pool2d):
        dilation, ceil_mode = _arg(node, 4, "dilation", 1), _arg(node, 5, "ceil_mode", False)
    else:
        dilation, ceil_mode = 1, _arg(node, 4, "ceil_mode", False)
    return _POOL_FUNCTIONS[target], _pool_attrs(kernel, stride, padding, dilation, ceil_mode, one_d, _target_name(node))


def _classify_call(node: torch.fx.Node, data_in: list, shapes: dict, extra: dict) -> tuple[str, dict]:
    target, method = node.target, node.op == "call_method"
    out_shape = shapes[node]
    in_shape = shapes[data_in[0]] if data_in else None
    adds, acts, flattens, identities = (
        (_ADD_METHODS, _ACT_METHODS, _FLATTEN_METHODS, _IDENTITY_METHODS)
        if method
        else (_ADD_FUNCTIONS, _ACT_FUNCTIONS, _FLATTEN_FUNCTIONS, _IDENTITY_FUNCTIONS)
    )
    if target in adds:
        return _add(node, data_in, shapes)
    if target in (_MUL_METHODS if method else _MUL_FUNCTIONS):
        product = _mul(node, data_in, shapes)
        if product is not None:
            return product
    if target in acts:
        return _activation_call(node, acts[target], extra)
    if target in flattens:
        return _flatten_like(in_shape, out_shape)
    if target in identities:
        if in_shape != out_shape:
            raise Unsupported(f"{target} changes the shape")
        return "identity", {}
    if (method and target == "mean") or (not method and target in _MEAN):
        return _global_mean(node, in_shape)
    if not method and target in _CAT_FUNCTIONS:
        return _concat(node, shapes)
    if not method and target in _DROPOUT_FUNCTIONS:
        return "dropout", {"rate": float(_arg(node, 1, "p", 0.5))}
    if not method and target in _POOL_FUNCTIONS:
        return _pool_call(node)
    if not method and target in _ADAPTIVE_FUNCTIONS:
        return _adaptive(_arg(node, 1, "output_size"), in_shape, target is F.adaptive_avg_pool1d)
    if not method and target in _ATTENTION_FUNCTIONS:
        raise NotYet(f"F.{getattr(target, '__name__', 'attention')} (attention) is not supported yet")
    if not method and target in (F.linear,) and in_shape is not None and len(in_shape) != 2:
        raise NotYet(f"F.linear applied to each token of a {list(in_shape)} tensor is not supported yet")
    if not method and target is F.rms_norm:
        return _rms_norm_call(node, in_shape)
    if not method and target is F.layer_norm and in_shape is not None and len(in_shape) == 3:
        raise NotYet(f"F.layer_norm over the features of each token of a {list(in_shape)} tensor is not supported yet")
    if not method and target in _OTHER_ACT_FUNCTIONS:
        raise _unknown_activation(_OTHER_ACT_FUNCTIONS[target])
    raise Unsupported("it is not an op of the sigprop graph")
