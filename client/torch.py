"""PyTorch adapter: extract a sigprop graph from a ``torch.nn.Module`` and apply an answer to it.

    import torch
    from sigprop.client import Client
    from sigprop.client.torch import apply, graph_from_module

    graph = graph_from_module(model, torch.randn(8, 784))
    with Client("http://127.0.0.1:8000") as sp:
        sol = sp.solve(graph, "tat", "leaky_relu", {"eta": 0.9})
    report = apply(model, sol, graph=graph, example_input=torch.randn(8, 784))
    net = report.model          # the rewritten torch.fx.GraphModule: train this one
    print(report.summary())

``graph_from_module`` traces ``forward`` with ``torch.fx.symbolic_trace`` (so ``forward`` must be
traceable: no data-dependent Python control flow) and runs shape propagation on
``example_input`` to get every tensor's shape. Node ids are the module qualified names for module
calls (``net.3``, ``layer1.0.conv1``) and the fx node names otherwise (``x``, ``add_1``, ``output``).

``apply`` rewrites a copy of the model (``inplace=False``, the default) with torch.fx:

* every activation becomes a :class:`TransformedActivation`
  ``output_scale * (phi(input_scale * x + input_shift) + output_shift)`` of the answer's activation
  (a ReLU network solved with ``tat``/``leaky_relu`` gets Tailored ReLUs);
* every traced ``a + b`` (``+``, ``+=``, ``torch.add``, ``Tensor.add``) becomes a
  :class:`NormalizedSum`: **the add then computes the normalized sum** ``w_a a + w_b b`` with the
  graph's weights (``1/sqrt(2)`` each when the graph gives none), which is what the kernel analysis
  assumes; with a trainable residual beta in the answer it computes ``x + beta / sqrt(L) F(x)``;
* every weighted layer the answer lists is re-initialized as it says (scale-corrected uniform
  orthogonal, Orthogonal Delta for convolutions, or Gaussian; biases zero, Gaussian or none), matched
  by id; a geometric answer's conditioning multiplier ``alpha`` is inserted after its layer and its
  ``logits_scale`` on the output.

Ops the graph cannot express stay in the rewritten model exactly as they were (they were identities
for the solve) and are reported.

The :class:`ApplyReport` lists every change and everything that was *not* done: layers in the
answer with no module in the model, weighted modules the answer does not cover (normalization
layers kept under ``allow_unsupported``, modules never called in ``forward``), and notes.

Importing this module needs PyTorch: ``pip install 'sigprop[torch]'``.
"""

from __future__ import annotations

try:
    import torch
    import torch.fx
    import torch.nn.functional as F
    from torch import nn
    from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "sigprop.client.torch needs PyTorch, which is not installed: pip install 'sigprop[torch]'"
    ) from _exc

import copy
import inspect
import math
import operator
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..errors import SigpropError
from ..schemas.solve import LayerInit, Solution

__all__ = [
    "graph_from_module",
    "apply",
    "ApplyReport",
    "ActivationChange",
    "LayerChange",
    "SumChange",
    "TransformedActivation",
    "NormalizedSum",
    "activation_function",
    "ACTIVATION_FUNCTIONS",
]

_ID_BAD = re.compile(r"[^A-Za-z0-9_.:\-/\[\]]")
_ID_MAX = 128


# =============================================================================================
# Activations: exactly the engine's definitions (sigprop.engine.activations), in torch
# =============================================================================================

_SELU_LAMBDA = 1.0507009873554804934193349852946
_SELU_ALPHA = 1.6732632423543772848170429916717


def _leaky(x, negative_slope):
    return torch.where(x > 0, x, negative_slope * x)


def _softplus(x):
    # log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)): exact everywhere (F.softplus is linear above 20)
    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-torch.abs(x)))


def _bentid(x):
    return 0.5 * (x * x) / (torch.sqrt(x * x + 1.0) + 1.0) + x


def _elu(x, alpha):
    return torch.where(x > 0, x, alpha * torch.expm1(torch.clamp(x, max=0)))


# name -> (phi(x, **params), parameter defaults); the same names and defaults as the engine
ACTIVATION_FUNCTIONS: dict[str, tuple[Any, dict[str, float]]] = {
    "tanh": (lambda x: torch.tanh(x), {}),
    "sigmoid": (lambda x: torch.sigmoid(x), {}),
    "softplus": (_softplus, {}),
    "erf": (lambda x: torch.erf(x), {}),
    "atan": (lambda x: torch.atan(x), {}),
    "asinh": (lambda x: torch.asinh(x), {}),
    "softsign": (lambda x: x / (1.0 + torch.abs(x)), {}),
    "bentid": (_bentid, {}),
    "swish": (lambda x: x * torch.sigmoid(x), {}),
    "gelu": (lambda x: F.gelu(x), {}),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), {}),
    "elu": (_elu, {"alpha": 1.0}),
    "selu": (lambda x: _SELU_LAMBDA * _elu(x, _SELU_ALPHA), {}),
    "relu": (lambda x: torch.clamp(x, min=0), {}),
    "leaky_relu": (_leaky, {"negative_slope": 0.01}),
    # Price et al., equations (7)-(10)
    "relu_tau": (lambda x, tau: torch.clamp(x - tau, min=0), {"tau": 1.0}),
    "soft_threshold": (lambda x, tau: torch.sign(x) * torch.clamp(torch.abs(x) - tau, min=0), {"tau": 1.0}),
    "crelu": (lambda x, tau, m: torch.minimum(torch.clamp(x - tau, min=0), torch.as_tensor(m, dtype=x.dtype)),
              {"tau": 1.0, "m": 1.0}),
    "cst": (lambda x, tau, m: torch.sign(x) * torch.minimum(torch.clamp(torch.abs(x) - tau, min=0),
                                                           torch.as_tensor(m, dtype=x.dtype)),
            {"tau": 1.0, "m": 1.0}),
}
_ALIASES = {"silu": "swish"}


def activation_function(name: str):
    """``(phi, defaults)`` for an activation name (PyTorch naming, as the service uses)."""
    key = _ALIASES.get(name, name)
    if key not in ACTIVATION_FUNCTIONS:
        raise SigpropError("unsupported_activation", f"unknown activation {name!r}",
                           "supported activations: " + ", ".join(list(ACTIVATION_FUNCTIONS) + list(_ALIASES)))
    return ACTIVATION_FUNCTIONS[key]


class TransformedActivation(nn.Module):
    """``phi_hat(x) = output_scale * (phi(input_scale * x + input_shift) + output_shift)``.

    ``phi`` is the activation called ``name`` with the engine's exact definition; ``negative_slope``
    (leaky_relu), ``alpha`` (elu), ``tau`` and ``m`` (relu_tau, soft_threshold, crelu, cst) are its
    parameters. With ``trainable_slope=True`` the Leaky ReLU slope is an ``nn.Parameter`` (the
    trainable TReLU of the trainable-TAT paper); all other values are fixed floats.
    """

    def __init__(self, name: str, *, input_scale: float = 1.0, input_shift: float = 0.0, output_scale: float = 1.0,
                 output_shift: float = 0.0, negative_slope: float | None = None, alpha: float | None = None,
                 tau: float | None = None, m: float | None = None, trainable_slope: bool = False):
        super().__init__()
        self.name = _ALIASES.get(name, name)
        self._phi, defaults = activation_function(self.name)
        given = {"negative_slope": negative_slope, "alpha": alpha, "tau": tau, "m": m}
        self._params = {k: float(given[k]) if given[k] is not None else float(v) for k, v in defaults.items()}
        if trainable_slope and self.name != "leaky_relu":
            raise ValueError(f"a trainable slope needs leaky_relu, not {self.name!r}")
        if trainable_slope:
            self.negative_slope = nn.Parameter(torch.tensor(self._params.pop("negative_slope")))
        self.input_scale = float(input_scale)
        self.input_shift = float(input_shift)
        self.output_scale = float(output_scale)
        self.output_shift = float(output_shift)

    @classmethod
    def from_solution(cls, solution: Solution, *, trainable_slope: bool | None = None,
                      defaults: Mapping[str, float] | None = None) -> "TransformedActivation":
        """The answer's transformed activation. Parameters the answer omits come from ``defaults``
        (e.g. the slope of the model's own LeakyReLU), then the engine's defaults."""
        defaults = dict(defaults or {})
        if trainable_slope is None:
            trainable_slope = bool(solution.trainable and solution.trainable.negative_slope)

        def pick(key, value):
            return value if value is not None else defaults.get(key)

        one = lambda v, d: d if v is None else v  # noqa: E731
        name = _ALIASES.get(solution.activation, solution.activation)
        _, known = activation_function(name)
        return cls(name, input_scale=one(solution.input_scale, 1.0), input_shift=one(solution.input_shift, 0.0),
                   output_scale=one(solution.output_scale, 1.0), output_shift=one(solution.output_shift, 0.0),
                   negative_slope=pick("negative_slope", solution.negative_slope) if "negative_slope" in known else None,
                   alpha=defaults.get("alpha") if "alpha" in known else None,
                   tau=pick("tau", solution.tau) if "tau" in known else None,
                   m=pick("m", solution.m) if "m" in known else None,
                   trainable_slope=bool(trainable_slope) and name == "leaky_relu")

    @property
    def params(self) -> dict[str, float]:
        out = dict(self._params)
        if isinstance(getattr(self, "negative_slope", None), nn.Parameter):
            out["negative_slope"] = float(self.negative_slope.detach())
        return out

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        """The untransformed activation."""
        params = dict(self._params)
        if isinstance(getattr(self, "negative_slope", None), nn.Parameter):
            params["negative_slope"] = self.negative_slope
        return self._phi(x, **params)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale != 1.0:
            x = self.input_scale * x
        if self.input_shift != 0.0:
            x = x + self.input_shift
        y = self.phi(x)
        if self.output_shift != 0.0:
            y = y + self.output_shift
        if self.output_scale != 1.0:
            y = self.output_scale * y
        return y

    def extra_repr(self) -> str:
        p = ", ".join(f"{k}={v:.6g}" for k, v in self.params.items())
        return (f"{self.name}{'(' + p + ')' if p else ''}, input_scale={self.input_scale:.6g}, "
                f"input_shift={self.input_shift:.6g}, output_scale={self.output_scale:.6g}, "
                f"output_shift={self.output_shift:.6g}")


class NormalizedSum(nn.Module):
    """``sum_i weights[i] * inputs[i]``, the contract's normalized sum (sum of squares 1; equal
    weights ``1/sqrt(n)`` when ``weights`` is None).

    With ``beta`` (a float, or an ``nn.Parameter`` shared between the sums of a global beta) and
    ``blocks`` = L, it is the residual sum ``x + beta / sqrt(L) * F(x)`` of the trainable-TAT paper
    instead, ``x`` being input number ``shortcut`` and ``F(x)`` the other one.
    """

    def __init__(self, n: int = 2, weights: Iterable[float] | None = None, *, beta: float | torch.Tensor | None = None,
                 blocks: int | None = None, shortcut: int = 0, trainable_beta: bool = True):
        super().__init__()
        self.n = int(n)
        if weights is None:
            weights = [1.0 / math.sqrt(self.n)] * self.n
        self.weights = [float(w) for w in weights]
        if len(self.weights) != self.n:
            raise ValueError(f"{self.n} inputs but {len(self.weights)} weights")
        self.shortcut = int(shortcut)
        self.blocks = blocks
        if beta is None:
            self.beta = None
        else:
            if self.n != 2 or not blocks:
                raise ValueError("a residual beta needs exactly two inputs and the number of blocks L")
            if isinstance(beta, nn.Parameter):
                self.beta = beta
            elif trainable_beta:
                self.beta = nn.Parameter(torch.tensor(float(beta)))
            else:
                self.register_buffer("beta", torch.tensor(float(beta)))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        if len(xs) != self.n:
            raise TypeError(f"NormalizedSum expects {self.n} inputs, got {len(xs)}")
        if self.beta is not None:
            other = 1 - self.shortcut
            return xs[self.shortcut] + (self.beta / math.sqrt(self.blocks)) * xs[other]
        out = self.weights[0] * xs[0]
        for w, x in zip(self.weights[1:], xs[1:]):
            out = out + w * x
        return out

    def extra_repr(self) -> str:
        if self.beta is not None:
            return f"x{self.shortcut} + beta / sqrt({self.blocks}) * F, beta={float(self.beta.detach()):.6g}"
        return "weights=[" + ", ".join(f"{w:.6g}" for w in self.weights) + "]"


# =============================================================================================
# Graph extraction
# =============================================================================================

_ACT_MODULES: dict[type, str] = {
    nn.ReLU: "relu", nn.LeakyReLU: "leaky_relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.Softplus: "softplus",
    nn.SiLU: "swish", nn.ELU: "elu", nn.SELU: "selu", nn.Softsign: "softsign",
}
_ACT_FUNCTIONS: dict[Any, str] = {
    F.relu: "relu", torch.relu: "relu", F.relu_: "relu", torch.relu_: "relu",
    F.leaky_relu: "leaky_relu", F.leaky_relu_: "leaky_relu",
    torch.tanh: "tanh", F.tanh: "tanh", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
    F.softplus: "softplus", F.silu: "swish", F.elu: "elu", F.elu_: "elu", F.selu: "selu", torch.selu: "selu",
    F.softsign: "softsign", torch.erf: "erf", torch.special.erf: "erf", torch.atan: "atan", torch.asinh: "asinh",
    F.gelu: "gelu",
}
_ACT_METHODS = {"relu": "relu", "relu_": "relu", "tanh": "tanh", "tanh_": "tanh", "sigmoid": "sigmoid",
                "sigmoid_": "sigmoid", "erf": "erf", "erf_": "erf", "atan": "atan", "asinh": "asinh"}
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_"}
_CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate}
_FLATTEN_FUNCTIONS = {torch.flatten, torch.reshape}
_FLATTEN_METHODS = {"flatten", "view", "reshape"}
_IDENTITY_METHODS = {"contiguous", "clone", "detach", "float", "to", "type_as"}
_IDENTITY_FUNCTIONS = {torch.clone}
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, torch.dropout}
_POOL_MODULES = {nn.MaxPool1d: "max_pool", nn.MaxPool2d: "max_pool", nn.AvgPool1d: "avg_pool", nn.AvgPool2d: "avg_pool"}
_POOL_FUNCTIONS = {F.max_pool1d: "max_pool", F.max_pool2d: "max_pool", F.avg_pool1d: "avg_pool",
                   F.avg_pool2d: "avg_pool"}
_ADAPTIVE_FUNCTIONS = {F.adaptive_avg_pool1d, F.adaptive_avg_pool2d}
_MEAN = {torch.mean}

_UNSUPPORTED_HINT = ("the graph covers dense and conv layers, activations, sums, channel concatenations, pooling, "
                     "flatten, dropout and identity: replace or remove the op, write the graph by hand, or pass "
                     "allow_unsupported=True to treat it as the identity (the answer then ignores what it does)")
_NORM_HINT = ("TAT and DKS networks are normalization-free: remove it (the answer's initialization and transformed "
              "activations do its job), or pass allow_unsupported=True to treat it as the identity (the answer then "
              "ignores what it does)")
_NORM_MODULES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
                 nn.LocalResponseNorm, nn.RMSNorm)


class _Tracer(torch.fx.Tracer):
    """Keeps sigprop's own modules as leaves, so an applied model can be extracted again."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, (TransformedActivation, NormalizedSum)):
            return True
        return super().is_leaf_module(m, qualname)


@dataclass
class _Entry:
    node: torch.fx.Node
    gid: str
    op: str  # contract op
    inputs: list  # data input fx nodes, in argument order
    attrs: dict
    desc: str  # what the torch node is, for messages
    module: nn.Module | None = None
    fn: str | None = None  # activation function of the original model
    fn_params: dict = field(default_factory=dict)
    unsupported: str | None = None  # why, when mapped to identity under allow_unsupported


@dataclass
class _Extraction:
    gm: torch.fx.GraphModule
    graph: dict
    entries: dict  # fx node -> _Entry
    value: dict  # fx node -> graph id of the value it computes
    warnings: list[str]
    traced_modules: set  # qualified names of modules called in forward


def _clean_id(raw: str) -> str:
    s = _ID_BAD.sub("_", raw) or "node"
    if len(s) > _ID_MAX:
        import hashlib
        s = s[: _ID_MAX - 9] + "-" + hashlib.sha1(raw.encode()).hexdigest()[:8]
    return s


def _tensor_shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    if isinstance(meta, TensorMetadata):
        return tuple(int(d) for d in meta.shape)
    return None


def _contract_shape(shape: tuple[int, ...]) -> list[int] | None:
    """[B, F] -> [F]; [B, C, L] -> [C, L, 1] (1-d feature maps); [B, C, H, W] -> [C, H, W]."""
    if len(shape) == 2:
        return [shape[1]]
    if len(shape) == 3:
        return [shape[1], shape[2], 1]
    if len(shape) == 4:
        return list(shape[1:])
    return None


def _pair(v, one_d: bool) -> list[int]:
    if isinstance(v, (tuple, list)):
        v = [int(x) for x in v]
        return [v[0], 1] if one_d else (v * 2 if len(v) == 1 else v[:2])
    return [int(v), 1] if one_d else [int(v), int(v)]


def _arg(node: torch.fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


class _Unsupported(Exception):
    def __init__(self, why: str, hint: str = _UNSUPPORTED_HINT):
        super().__init__(why)
        self.why = why
        self.hint = hint


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", repr(t))
    return f"{mod}.{name}" if mod and not mod.startswith("_operator") else name


def _describe(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
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
        raise _Unsupported(f"grouped convolution (groups={m.groups})",
                           "the kernel analysis covers dense convolutions only (groups=1)")
    if any(int(d) != 1 for d in m.dilation):
        raise _Unsupported(f"dilated convolution (dilation={tuple(m.dilation)})", "use dilation=1")
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
            raise _Unsupported(
                f"convolution padding {tuple(pad)} with kernel {tuple(kernel[:len(pad)])}",
                "the graph's padding is 'same', 'valid' or one integer for both axes; for Conv1d use "
                "padding 0 or (kernel - 1) // 2 with an odd kernel")
    return {"channels": int(m.out_channels), "kernel": kernel, "stride": stride, "padding": padding,
            "bias": m.bias is not None}


def _pool_attrs(kernel, stride, padding, dilation, ceil_mode, one_d: bool, what: str) -> dict:
    pads = padding if isinstance(padding, (tuple, list)) else [padding]
    if any(int(p) != 0 for p in pads):
        raise _Unsupported(f"{what} with padding {padding}", "the graph's pooling has no padding; use padding=0")
    dils = dilation if isinstance(dilation, (tuple, list)) else [dilation]
    if any(int(d) != 1 for d in dils):
        raise _Unsupported(f"{what} with dilation {dilation}", "use dilation=1")
    if ceil_mode:
        raise _Unsupported(f"{what} with ceil_mode=True", "use ceil_mode=False")
    k = _pair(kernel, one_d)
    s = _pair(stride if stride not in (None, [], ()) else kernel, one_d)
    return {"kernel": k, "stride": s}


def _adaptive(out_size, in_shape, one_d: bool) -> tuple[str, dict]:
    sizes = out_size if isinstance(out_size, (tuple, list)) else [out_size] * (1 if one_d else 2)
    spatial = list(in_shape[2:])
    sizes = [spatial[i] if s is None else int(s) for i, s in enumerate(sizes)]
    if all(s == 1 for s in sizes):
        return "global_avg_pool", {}
    if all(h % s == 0 for h, s in zip(spatial, sizes)):
        k = [h // s for h, s in zip(spatial, sizes)]
        k = [k[0], 1] if one_d else k
        return "avg_pool", {"kernel": k, "stride": list(k)}
    raise _Unsupported(f"adaptive average pooling to {tuple(sizes)} from {tuple(spatial)}",
                       "use an output size that divides the input size, or 1 (global average pooling)")


def _flatten_like(in_shape, out_shape) -> tuple[str, dict]:
    if in_shape == out_shape:
        return "identity", {}
    if (len(out_shape) == 2 and len(in_shape) >= 2 and out_shape[0] == in_shape[0]
            and out_shape[1] == math.prod(in_shape[1:])):
        return "flatten", {}
    raise _Unsupported(f"reshape from {list(in_shape)} to {list(out_shape)}",
                       "only flattening all but the batch dimension is covered ([B, ...] -> [B, features])")


def _classify(node: torch.fx.Node, gm: torch.fx.GraphModule, data_in: list, shapes: dict) -> tuple[str, dict, dict]:
    """(contract op, attributes, extra) of one data node; raises _Unsupported."""
    extra: dict = {}
    op, attrs = _classify_op(node, gm, data_in, shapes, extra)
    return op, attrs, extra


def _classify_op(node, gm, data_in: list, shapes: dict, extra: dict) -> tuple[str, dict]:
    out_shape = shapes[node]
    in_shape = shapes[data_in[0]] if data_in else None

    def act(fn: str, **params):
        extra["fn"] = fn
        extra["fn_params"] = {k: float(v) for k, v in params.items() if v is not None}
        return "activation", {"fn": fn}

    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        extra["module"] = m
        if isinstance(m, TransformedActivation):
            return act(m.name, **m.params)
        if isinstance(m, NormalizedSum):
            if m.beta is not None:
                raise _Unsupported("a residual-beta sum x + beta/sqrt(L) F(x) is not a normalized sum",
                                   "extract the graph from the model before apply()")
            return "sum", {"weights": list(m.weights)}
        if isinstance(m, nn.Linear):
            if len(in_shape) != 2:
                raise _Unsupported(f"Linear applied to a tensor of shape {list(in_shape)}",
                                   "the graph's dense layers take [batch, features]; flatten first")
            return "dense", {"units": int(m.out_features), "bias": m.bias is not None}
        if isinstance(m, (nn.Conv1d, nn.Conv2d)) and type(m) in (nn.Conv1d, nn.Conv2d):
            return "conv", _conv_attrs(m, in_shape, out_shape)
        for cls, fn in _ACT_MODULES.items():
            if type(m) is cls:
                if isinstance(m, nn.Softplus) and float(m.beta) != 1.0:
                    raise _Unsupported(f"Softplus with beta={m.beta}", "use beta=1 (the engine's softplus)")
                return act(fn, negative_slope=getattr(m, "negative_slope", None), alpha=getattr(m, "alpha", None)
                           if isinstance(m, nn.ELU) else None)
        if type(m) is nn.GELU:
            return act("gelu_tanh" if m.approximate == "tanh" else "gelu")
        if isinstance(m, _DROPOUT_MODULES):
            return "dropout", {"rate": float(m.p)}
        if type(m) is nn.Identity:
            return "identity", {}
        if type(m) is nn.Flatten:
            return _flatten_like(in_shape, out_shape)
        if type(m) in _POOL_MODULES:
            op = _POOL_MODULES[type(m)]
            one_d = type(m) in (nn.MaxPool1d, nn.AvgPool1d)
            return op, _pool_attrs(m.kernel_size, m.stride, m.padding, getattr(m, "dilation", 1),
                                   m.ceil_mode, one_d, type(m).__name__)
        if type(m) in (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d):
            return _adaptive(m.output_size, in_shape, type(m) is nn.AdaptiveAvgPool1d)
        if isinstance(m, _NORM_MODULES):
            raise _Unsupported(f"{type(m).__name__} is a normalization layer, which the Q/C map analysis does not "
                               "model", _NORM_HINT)
        if isinstance(m, nn.MultiheadAttention):
            raise _Unsupported("attention is not covered by the Q/C map analysis")
        raise _Unsupported(f"{type(m).__name__} is not an op of the sigprop graph")

    target = node.target
    method = node.op == "call_method"
    if (not method and target in _ADD_FUNCTIONS) or (method and target in _ADD_METHODS):
        alpha = node.kwargs.get("alpha", 1)
        if len(data_in) != 2 or any(not isinstance(a, torch.fx.Node) for a in node.args[:2]):
            raise _Unsupported("an add of a tensor and a constant (a bias shift)",
                               "only sums of two network tensors map to a normalized 'sum' node")
        if alpha != 1:
            raise _Unsupported(f"torch.add with alpha={alpha}", "use a plain a + b")
        if shapes[data_in[0]] != shapes[data_in[1]]:
            raise _Unsupported(f"an add that broadcasts {list(shapes[data_in[0]])} and {list(shapes[data_in[1]])}",
                               "the graph's sums add tensors of one shape")
        return "sum", {}
    if not method and target in _CAT_FUNCTIONS:
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = _arg(node, 1, "dim", 0)
        rank = len(out_shape)
        if dim is None or (int(dim) % rank) != 1:
            raise _Unsupported(f"concatenation along dim {dim}", "the graph concatenates channels/features (dim=1)")
        if any(not isinstance(t, torch.fx.Node) or t not in shapes for t in tensors):
            raise _Unsupported("a concatenation with a constant tensor", "concatenate network tensors only")
        return "concat", {}
    if (not method and target in _ACT_FUNCTIONS) or (method and target in _ACT_METHODS):
        fn = _ACT_METHODS[target] if method else _ACT_FUNCTIONS[target]
        if fn == "gelu":
            return act("gelu_tanh" if _arg(node, 1, "approximate", "none") == "tanh" else "gelu")
        if fn == "leaky_relu":
            return act(fn, negative_slope=_arg(node, 1, "negative_slope", 0.01))
        if fn == "elu":
            return act(fn, alpha=_arg(node, 1, "alpha", 1.0))
        if fn == "softplus":
            beta = _arg(node, 1, "beta", 1.0)
            if float(beta) != 1.0:
                raise _Unsupported(f"softplus with beta={beta}", "use beta=1 (the engine's softplus)")
        return act(fn)
    if (not method and target in _FLATTEN_FUNCTIONS) or (method and target in _FLATTEN_METHODS):
        return _flatten_like(in_shape, out_shape)
    if (method and target in _IDENTITY_METHODS) or (not method and target in _IDENTITY_FUNCTIONS):
        if in_shape != out_shape:
            raise _Unsupported(f"{target} changes the shape")
        return "identity", {}
    if not method and target in _DROPOUT_FUNCTIONS:
        return "dropout", {"rate": float(_arg(node, 1, "p", 0.5))}
    if not method and target in _POOL_FUNCTIONS:
        one_d = target in (F.max_pool1d, F.avg_pool1d)
        kernel = _arg(node, 1, "kernel_size")
        stride = _arg(node, 2, "stride")
        padding = _arg(node, 3, "padding", 0)
        if target in (F.max_pool1d, F.max_pool2d):
            dilation, ceil_mode = _arg(node, 4, "dilation", 1), _arg(node, 5, "ceil_mode", False)
        else:
            dilation, ceil_mode = 1, _arg(node, 4, "ceil_mode", False)
        return _POOL_FUNCTIONS[target], _pool_attrs(kernel, stride, padding, dilation, ceil_mode, one_d, _target_name(node))
    if not method and target in _ADAPTIVE_FUNCTIONS:
        return _adaptive(_arg(node, 1, "output_size"), in_shape, target is F.adaptive_avg_pool1d)
    if (not method and target in _MEAN) or (method and target == "mean"):
        dims = _arg(node, 1, "dim")
        rank = len(in_shape)
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        if rank in (3, 4) and sorted(int(d) % rank for d in dims) == list(range(2, rank)):
            return "global_avg_pool", {}
        raise _Unsupported(f"a mean over dims {dims} of a rank-{rank} tensor",
                           "only a mean over all spatial dims (global average pooling) is covered")
    raise _Unsupported("it is not an op of the sigprop graph")


def _run_shape_prop(gm: torch.fx.GraphModule, example_input) -> None:
    modes = {m: m.training for m in gm.modules()}
    try:
        gm.eval()  # no running-statistics updates, no dropout while we only look at shapes
        with torch.no_grad():
            ShapeProp(gm).propagate(example_input)
    finally:
        for m, mode in modes.items():
            m.training = mode


def _trace(model: nn.Module) -> torch.fx.GraphModule:
    try:
        # optional forward arguments (mask=None, ...) are traced at their defaults, so code like
        # `if mask is not None:` takes the branch the default takes
        params = list(inspect.signature(model.forward).parameters.values())
        concrete = {p.name: p.default for p in params[1:]
                    if p.default is not inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    except (TypeError, ValueError):
        concrete = {}
    try:
        tracer = _Tracer()
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as exc:  # fx raises TraceError, TypeError, NotImplementedError, ...
        raise SigpropError(
            "unsupported_op", f"torch.fx could not trace {type(model).__name__}.forward: {exc}",
            "make forward traceable (no Python control flow on tensor values), or write the graph by hand") from exc
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    gm.train(model.training)
    return gm


def _extract(model: nn.Module, example_input, allow_unsupported: bool, keep_fn: bool,
             warn: bool = True) -> _Extraction:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_input, torch.Tensor):
        raise TypeError("example_input must be one batched tensor, e.g. torch.randn(8, 784)")
    if example_input.dim() not in (2, 3, 4):
        raise SigpropError("invalid_graph", f"example_input has shape {list(example_input.shape)}",
                           "give a batched input: [batch, features], [batch, channels, length] or "
                           "[batch, channels, height, width]")
    gm = _trace(model)
    # forward's first argument is the network input; further arguments must have defaults
    # (e.g. mask=None) and are left at them
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    required = [n for n in placeholders if not n.args]
    if not placeholders or len(required) > 1 or (required and required[0] is not placeholders[0]):
        raise SigpropError("unsupported_op", f"forward takes {len(required)} required inputs "
                           f"({', '.join(n.name for n in required)})",
                           "the graph has one input: wrap the model so forward takes one tensor")
    data_input = placeholders[0]
    _run_shape_prop(gm, example_input)

    shapes: dict = {}  # data nodes (tensor values computed from the input) -> torch shape
    entries: dict = {}
    value: dict = {}
    nodes_out: list[dict] = []
    used_ids: set[str] = set()
    module_calls: dict[str, int] = {}
    notes: list[str] = []
    traced_modules: set[str] = set()

    def new_id(raw: str) -> str:
        base = _clean_id(raw)
        gid, k = base, 1
        while gid in used_ids:
            gid = f"{base}:{k}"
            k += 1
        used_ids.add(gid)
        return gid

    tuple_src: dict = {}  # multi-output (tuple) nodes -> their data inputs

    def data_args(node) -> list:
        out: list = []

        def visit(a):  # map_arg walks args and kwargs, nested lists, tuples and dicts included
            if a in shapes:
                out.append(a)
            elif a in tuple_src:
                out.extend(x for x in tuple_src[a] if x not in out)
            return a
        torch.fx.node.map_arg((node.args, node.kwargs), visit)
        return out

    def depends_on_data(node) -> bool:
        found = []

        def visit(a):
            if a in shapes or a.meta.get("_sigprop_data"):
                found.append(a)
            return a
        torch.fx.node.map_arg((node.args, node.kwargs), visit)
        return bool(found)

    out_node = None
    for node in gm.graph.nodes:
        if node.op == "call_module":
            traced_modules.add(node.target)
        if node.op == "placeholder" and node is not data_input:
            continue  # an optional argument left at its default: not on the data path
        if node.op == "placeholder":
            shape = _tensor_shape(node)
            gid = new_id(node.name)
            shapes[node] = shape
            value[node] = gid
            cshape = _contract_shape(shape)
            nodes_out.append({"id": gid, "op": "input", "shape": cshape})
            entries[node] = _Entry(node, gid, "input", [], {"shape": cshape}, f"input '{node.name}'")
            continue
        if node.op == "output":
            out_node = node
            continue
        if node.op == "get_attr" or not depends_on_data(node):
            continue  # constants: not part of the data path
        shape = _tensor_shape(node)
        if shape is None:
            # sizes, shapes, tuples: not a tensor on the data path (a tuple result is flagged where used)
            node.meta["_sigprop_data"] = True
            if isinstance(node.meta.get("tensor_meta"), (tuple, list)):
                tuple_src[node] = data_args(node)
            continue
        ins = data_args(node)
        tuple_args = [a for a in node.all_input_nodes if a in tuple_src]
        why = (_Unsupported(f"it takes part of the multi-output result of '{tuple_args[0].name}' "
                            f"({_describe(tuple_args[0], gm)})") if tuple_args else None)
        shapes[node] = shape
        desc = _describe(node, gm)
        extra: dict = {}
        try:
            if why is not None:
                raise why
            if not ins:
                raise _Unsupported("it has no input from the network")
            op, attrs, extra = _classify(node, gm, ins, shapes)
        except _Unsupported as exc:
            if not allow_unsupported:
                raise SigpropError("unsupported_op", f"node '{_clean_id(node.target if node.op == 'call_module' else node.name)}' "
                                   f"({desc}) is not supported: {exc.why}", exc.hint) from None
            msg = (f"node '{_clean_id(node.target if node.op == 'call_module' else node.name)}' ({desc}) is not "
                   f"supported ({exc.why}); treated as the identity")
            if len(ins) > 1:
                msg += f" of its first input (dropped inputs: {', '.join(a.name for a in ins[1:])})"
            if ins and shapes[ins[0]] != shape:
                msg += f"; it changes the shape {list(shapes[ins[0]])} -> {list(shape)}, which the graph does not see"
            notes.append(msg)
            if warn:
                warnings.warn(msg, stacklevel=3)
            op, attrs, extra = "identity", {}, {"unsupported": exc.why}
            ins = ins[:1]
            if not ins:  # a tensor made from nothing on the data path: leave it out
                del shapes[node]
                continue
        if node.op == "call_module":
            k = module_calls.get(node.target, 0)
            module_calls[node.target] = k + 1
            raw = node.target if k == 0 else f"{node.target}:{k}"
        else:
            raw = node.name
        gid = new_id(raw)
        value[node] = gid
        entry = _Entry(node, gid, op, ins, attrs, desc, module=extra.get("module"), fn=extra.get("fn"),
                       fn_params=extra.get("fn_params", {}), unsupported=extra.get("unsupported"))
        entries[node] = entry
        wire = {"id": gid, "op": op, "inputs": [value[a] for a in ins]}
        if op == "activation":
            if keep_fn:
                wire["fn"] = attrs["fn"]
        else:
            wire.update(attrs)
        if op == "sum" and "weights" not in attrs:
            n = len(ins)
            wire["weights"] = [1.0 / math.sqrt(n)] * n
        nodes_out.append(wire)

    # the output
    result = out_node.args[0] if out_node is not None and out_node.args else None
    if not isinstance(result, torch.fx.Node) or result not in shapes:
        got = "several values" if isinstance(result, (tuple, list, dict)) else "no tensor computed from the input"
        raise SigpropError("unsupported_op", f"forward returns {got}",
                           "the graph has exactly one output: return one tensor (merge heads with a concat or sum)")
    gid = new_id(out_node.name)
    nodes_out.append({"id": gid, "op": "output", "inputs": [value[result]]})
    entries[out_node] = _Entry(out_node, gid, "output", [result], {}, "output")
    value[out_node] = gid

    graph = {"schema": "sigprop.graph/v1", "nodes": nodes_out}
    _check_graph(graph, entries)
    return _Extraction(gm, graph, entries, value, notes, traced_modules)


def _check_graph(graph: dict, entries: dict) -> None:
    """Validate with the engine's own graph rules and check each layer's fan-in against the module."""
    from ..engine.graph import build_graph
    from ..schemas.graph import Graph

    try:
        net = build_graph(Graph.model_validate(graph), default_activation="relu")
    except SigpropError as exc:
        raise SigpropError(exc.code, f"the graph extracted from the model is not valid: {exc.message}",
                           exc.hint or "check the ops the message names") from None
    by_id = {nd.user_id: nd for nd in net.nodes}
    for e in entries.values():
        if e.op not in ("dense", "conv") or e.gid not in by_id:
            continue
        nd = by_id[e.gid]
        fan_in = net.nodes[nd.inputs[0]].shape[0]
        want = e.module.in_features if e.op == "dense" else e.module.in_channels
        if fan_in != want:
            raise SigpropError("unsupported_op",
                               f"node '{e.gid}' ({e.desc}) expects {want} input features but the graph gives it "
                               f"{fan_in}: something before it changes shapes in a way the graph does not see",
                               "check the nodes treated as the identity (allow_unsupported) before this layer")


def graph_from_module(model: nn.Module, example_input: torch.Tensor, *, allow_unsupported: bool = False,
                      keep_fn: bool = False) -> dict:
    """The ``sigprop.graph/v1`` graph of ``model`` (a JSON-ready dict), traced with ``torch.fx``.

    Maps ``nn.Linear`` to ``dense``; ``nn.Conv2d`` to ``conv`` and ``nn.Conv1d`` to ``conv`` on a
    ``[channels, length, 1]`` map (kernel ``[k, 1]``); activation modules and calls (ReLU,
    LeakyReLU, Tanh, Sigmoid, Softplus, GELU, SiLU, ELU, SELU, Softsign; ``F.relu``, ``torch.tanh``,
    ``x.relu()``, ...) to ``activation``; an add of two tensors (``+``, ``+=``, ``torch.add``) to a
    ``sum`` with equal weights ``1/sqrt(2)`` (``apply`` makes the add compute exactly that normalized
    sum); ``torch.cat(..., dim=1)`` to ``concat``; max/avg pooling to ``max_pool``/``avg_pool``,
    adaptive average pooling to 1 and a spatial mean to ``global_avg_pool``; flatten/view/reshape to
    ``[batch, features]`` to ``flatten``; dropout to ``dropout``; ``nn.Identity`` to ``identity``; the
    input to ``input`` with ``shape = example_input.shape[1:]`` (``[C, L, 1]`` for a 1-d input).

    Activation nodes carry no ``fn`` unless ``keep_fn=True``: a solve replaces every activation with
    the request's (transformed) activation, and a ``fn`` naming the model's own function (``relu``)
    would make the service solve that function instead.

    Anything else (normalization layers, attention, multiplications, constants added to the data)
    raises ``SigpropError("unsupported_op")`` naming the node; with ``allow_unsupported=True`` such
    a node becomes an ``identity`` node and a warning says so.
    """
    return _extract(model, example_input, allow_unsupported, keep_fn).graph


# =============================================================================================
# Applying an answer
# =============================================================================================

@dataclass
class ActivationChange:
    id: str
    module: str  # path of the new module in the rewritten model
    was: str  # what it replaced, e.g. "ReLU module 'net.1'"
    now: str  # repr of the transformed activation


@dataclass
class LayerChange:
    id: str
    module: str
    op: str
    distribution: str
    gain: float  # multiplier on the orthonormal matrix, or the Gaussian standard deviation
    weight_variance: float
    bias: str  # what was done to the bias: zeros, gaussian, none (the module has no bias), ...
    bias_variance: float = 0.0
    alpha: float | None = None  # conditioning multiplier inserted after the layer (geometric)


@dataclass
class SumChange:
    id: str
    module: str
    was: str
    weights: list[float]
    residual_beta: str | None = None  # "x + beta/sqrt(L) F(x)" description when the answer asks for it


@dataclass
class ApplyReport:
    """What ``apply`` changed and what it could not do. ``model`` is the rewritten GraphModule."""

    model: nn.Module
    method: str
    activation: str
    activations: list[ActivationChange] = field(default_factory=list)
    layers: list[LayerChange] = field(default_factory=list)
    sums: list[SumChange] = field(default_factory=list)
    missing_layers: list[str] = field(default_factory=list)  # answer layer ids with no module in the model
    uninitialized: list[str] = field(default_factory=list)  # modules with parameters the answer did not cover
    notes: list[str] = field(default_factory=list)  # things the caller must do (input scale, ...)
    warnings: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True when every answer layer was applied and every parametrized module was covered."""
        return not self.missing_layers and not self.uninitialized

    def summary(self) -> str:
        lines = [f"sigprop apply ({self.method}, {self.activation}): {len(self.activations)} activation(s) "
                 f"transformed, {len(self.layers)} layer(s) re-initialized, {len(self.sums)} add(s) rewritten"]
        lines += [f"  activation {c.id}: {c.was} -> {c.now}" for c in self.activations]
        lines += [f"  layer {c.id} ({c.module}): {c.distribution}, gain {c.gain:.6g}, bias {c.bias}"
                  + (f", alpha {c.alpha:.6g}" if c.alpha is not None else "") for c in self.layers]
        lines += [f"  sum {c.id}: {c.was} -> " + (c.residual_beta or f"weights {[round(w, 6) for w in c.weights]}")
                  for c in self.sums]
        lines += [f"  MISSING: answer layer '{i}' has no module in the model" for i in self.missing_layers]
        lines += [f"  NOT INITIALIZED: {m}" for m in self.uninitialized]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _as_solution(solution) -> Solution:
    if isinstance(solution, Solution):
        return solution
    if isinstance(solution, (str, bytes)):
        return Solution.model_validate_json(solution)
    if isinstance(solution, Mapping):
        return Solution.model_validate(dict(solution))
    raise TypeError(f"solution must be a Solution, its JSON or a dict, not {type(solution).__name__}")


def _example_from_graph(graph: dict, model: nn.Module) -> torch.Tensor:
    shape = next((nd.get("shape") for nd in graph.get("nodes", []) if nd.get("op") == "input"), None)
    if not shape:
        raise ValueError("apply needs example_input (the graph has no input node with a shape)")
    candidates = [list(shape)]
    if len(shape) == 3 and shape[2] == 1:
        candidates.insert(0, list(shape[:2]))  # a 1-d feature map [C, L, 1] is a [B, C, L] tensor
    last = None
    for cand in candidates:
        x = torch.randn(2, *cand)
        try:
            modes = {m: m.training for m in model.modules()}
            model.eval()
            with torch.no_grad():
                model(x)
            return x
        except Exception as exc:  # the wrong rank: try the next candidate
            last = exc
        finally:
            for m, mode in modes.items():
                m.training = mode
    raise ValueError(f"apply could not build an input of shape {shape} for the model ({last}); pass example_input")


def _reinit(module: nn.Module, layer: LayerInit, generator: torch.Generator | None) -> str:
    """Initialize ``module.weight`` (and bias) as ``layer`` says; returns what was done to the bias."""
    w = module.weight
    with torch.no_grad():
        if layer.distribution == "gaussian":
            w.normal_(0.0, layer.gain, generator=generator)
        elif layer.distribution == "scaled_uniform_orthogonal" and w.dim() == 2:
            # torch weights are [out, in]: orthogonal_ gives orthonormal rows (out <= in) or columns
            # (out > in); the answer's gain carries max(sqrt(out/in), 1) * sqrt(sigma_w2)
            torch.nn.init.orthogonal_(w, gain=layer.gain, generator=generator)
        elif layer.distribution in ("orthogonal_delta", "scaled_uniform_orthogonal"):
            spatial = list(w.shape[2:])
            if any(s % 2 != 1 for s in spatial):
                raise SigpropError("invalid_request", f"Orthogonal Delta initialization of '{layer.id}' needs odd "
                                   f"kernel sizes, got {spatial}", "ask for init 'gaussian' or use an odd kernel")
            centre = w.new_empty(w.shape[0], w.shape[1])
            torch.nn.init.orthogonal_(centre, gain=layer.gain, generator=generator)
            w.zero_()
            w[(slice(None), slice(None)) + tuple((s - 1) // 2 for s in spatial)] = centre
        else:  # pragma: no cover - the schema allows nothing else
            raise SigpropError("invalid_request", f"unknown distribution {layer.distribution!r}", "")
        b = getattr(module, "bias", None)
        if b is None:
            return "none" if layer.bias == "none" else f"none (the module has no bias; the answer says {layer.bias})"
        if layer.bias == "gaussian" and layer.bias_variance > 0:
            b.normal_(0.0, math.sqrt(layer.bias_variance), generator=generator)
            return "gaussian"
        b.zero_()
        return "zeros" if layer.bias != "none" else "zeros (the answer's graph has no bias; the module's is zeroed)"


def _shortcut_index(node: torch.fx.Node, args: list) -> int:
    """Which input of a residual add is the shortcut x: the one the other is computed from."""
    def ancestors(n):
        seen, stack = set(), [n]
        while stack:
            cur = stack.pop()
            for a in cur.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    stack.append(a)
        return seen
    a0, a1 = ancestors(args[0]), ancestors(args[1])
    if args[0] in a1 and args[1] not in a0:
        return 0
    if args[1] in a0 and args[0] not in a1:
        return 1
    # projection shortcuts: the shorter branch (fewer ops since the fork) is the shortcut
    return 0 if len(a0) <= len(a1) else 1


def apply(model: nn.Module, solution, *, graph: Mapping | None = None, example_input: torch.Tensor | None = None,
          inplace: bool = False, seed: int | None = None) -> ApplyReport:
    """Rewrite ``model`` as ``solution`` (an answer of ``POST /v1/solve`` for ``graph_from_module(model)``) says.

    Works on a deep copy unless ``inplace=True`` (then the parameters of ``model`` itself are
    re-initialized and the returned GraphModule shares them). ``graph`` is the graph that was
    solved (its sum weights are used; default: extracted again); ``example_input`` is needed for
    shape propagation (default: a random batch of the graph's input shape). ``seed`` makes the
    re-initialization reproducible. Returns an :class:`ApplyReport`; ``report.model`` is the
    rewritten ``torch.fx.GraphModule`` to train.
    """
    sol = _as_solution(solution)
    target = model if inplace else copy.deepcopy(model)
    if example_input is None:
        if graph is None:
            raise ValueError("apply needs example_input or the graph the answer was solved for")
        example_input = _example_from_graph(dict(graph), target)
    ext = _extract(target, example_input, allow_unsupported=True, keep_fn=False, warn=False)
    gm = ext.gm
    report = ApplyReport(model=gm, method=sol.method, activation=sol.activation)
    report.warnings.extend(f"not applied: {w}" for w in ext.warnings)
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None

    solved_graph = dict(graph) if graph is not None else ext.graph
    solved_nodes = {nd["id"]: nd for nd in solved_graph.get("nodes", [])}
    by_id = {e.gid: e for e in ext.entries.values()}
    if graph is not None:
        extra_ids = sorted(set(solved_nodes) - set(by_id))
        missing_ids = sorted(set(by_id) - set(solved_nodes))
        if extra_ids or missing_ids:
            report.warnings.append(
                "the graph passed to apply differs from the model's: "
                + (f"ids not in the model: {', '.join(extra_ids[:10])}" if extra_ids else "")
                + ("; " if extra_ids and missing_ids else "")
                + (f"model nodes not in the graph: {', '.join(missing_ids[:10])}" if missing_ids else ""))

    module_uses: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module_uses[node.target] = module_uses.get(node.target, 0) + 1

    replaced: dict = {}  # fx nodes erased by the rewrite -> the nodes that took their place

    def resolve(n):
        while n in replaced:
            n = replaced[n]
        return n

    # -- activations -------------------------------------------------------------------------
    for e in list(ext.entries.values()):
        if e.op != "activation":
            continue
        node = e.node
        defaults = e.fn_params if e.fn == _ALIASES.get(sol.activation, sol.activation) else {}
        new = TransformedActivation.from_solution(sol, defaults=defaults)
        if node.op == "call_module" and module_uses.get(node.target) == 1:
            gm.add_submodule(node.target, new)  # replaces it in place: same path
            path = node.target
        else:
            path = f"sigprop_act_{node.name}"
            gm.add_submodule(path, new)
            with gm.graph.inserting_after(node):
                repl = gm.graph.call_module(path, args=(resolve(e.inputs[0]),))
            node.replace_all_uses_with(repl)
            gm.graph.erase_node(node)
            replaced[node] = repl
            e.node = repl
        report.activations.append(ActivationChange(e.gid, path, e.desc, f"TransformedActivation({new.extra_repr()})"))

    # -- sums ----------------------------------------------------------------------------------
    rb = sol.trainable.residual_beta if sol.trainable is not None else None
    beta_sums = set(rb.sums) if rb is not None else set()
    shared_beta = nn.Parameter(torch.tensor(float(rb.init))) if rb is not None and rb.mode == "global" else None
    for e in list(ext.entries.values()):
        if e.op != "sum":
            continue
        node = e.node
        wire = solved_nodes.get(e.gid, {})
        n = len(e.inputs)
        weights = wire.get("weights") or [1.0 / math.sqrt(n)] * n
        wire_inputs = wire.get("inputs")
        if wire_inputs and sorted(wire_inputs) == sorted(ext.value[a] for a in e.inputs) and wire.get("weights"):
            # match weights to inputs by id (a hand-edited graph may list them in another order)
            pool = list(zip(wire_inputs, wire["weights"]))
            weights = []
            for a in e.inputs:
                k = next(i for i, (gid, _) in enumerate(pool) if gid == ext.value[a])
                weights.append(float(pool.pop(k)[1]))
        if len(weights) != n:
            report.warnings.append(f"sum '{e.gid}': the graph gives {len(weights)} weights for {n} inputs; "
                                   "equal weights used")
            weights = [1.0 / math.sqrt(n)] * n
        beta_desc = None
        if e.gid in beta_sums and n == 2:
            sc = _shortcut_index(node, [resolve(a) for a in e.inputs])
            beta = shared_beta if shared_beta is not None else float(rb.init)
            mod = NormalizedSum(2, weights, beta=beta, blocks=rb.blocks, shortcut=sc)
            beta_desc = (f"{ext.value[e.inputs[sc]]} + beta / sqrt({rb.blocks}) * {ext.value[e.inputs[1 - sc]]} "
                         f"(beta {rb.mode}, initially {rb.init:g})")
        else:
            mod = NormalizedSum(n, weights)
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), NormalizedSum) \
                and module_uses.get(node.target) == 1:
            path = node.target
            gm.add_submodule(path, mod)
        else:
            path = f"sigprop_sum_{node.name}"
            gm.add_submodule(path, mod)
            with gm.graph.inserting_after(node):
                repl = gm.graph.call_module(path, args=tuple(resolve(a) for a in e.inputs))
            node.replace_all_uses_with(repl)
            gm.graph.erase_node(node)
            replaced[node] = repl
            e.node = repl
        report.sums.append(SumChange(e.gid, path, e.desc, list(mod.weights), beta_desc))
    unmatched_beta = sorted(beta_sums - {s.id for s in report.sums})
    if unmatched_beta:
        report.warnings.append(f"residual-beta sums not found in the model: {', '.join(unmatched_beta)}")

    # -- layers --------------------------------------------------------------------------------
    done_modules: dict[int, str] = {}
    initialized: set[int] = set()
    for layer in sol.layers:
        e = by_id.get(layer.id)
        if e is None or e.op not in ("dense", "conv") or e.module is None:
            report.missing_layers.append(layer.id)
            report.warnings.append(f"answer layer '{layer.id}' ({layer.op}) has no "
                                   f"{'matching weighted ' if e is not None else ''}module in the model; not applied")
            continue
        m = e.module
        if e.op != layer.op:
            report.missing_layers.append(layer.id)
            report.warnings.append(f"answer layer '{layer.id}' is a {layer.op} but the model's is a {e.op}; not applied")
            continue
        want_in = m.in_features if e.op == "dense" else m.in_channels
        want_out = m.out_features if e.op == "dense" else m.out_channels
        if layer.fan_out != want_out or layer.fan_in not in (want_in, want_in * math.prod(m.weight.shape[2:])):
            report.missing_layers.append(layer.id)
            report.warnings.append(f"answer layer '{layer.id}' has fan-in/out {layer.fan_in}/{layer.fan_out} but "
                                   f"module '{e.node.target}' is {want_in} -> {want_out}; not applied")
            continue
        if id(m) in done_modules:
            report.warnings.append(f"layer '{layer.id}' shares its module '{e.node.target}' with "
                                   f"'{done_modules[id(m)]}' (weight sharing): initialized once, as '{done_modules[id(m)]}'")
            continue
        bias_done = _reinit(m, layer, generator)
        done_modules[id(m)] = layer.id
        initialized.add(id(m))
        alpha = layer.alpha if layer.alpha is not None and layer.alpha != 1.0 else None
        if alpha is not None:
            node = e.node
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(operator.mul, (node, float(alpha)))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
        report.layers.append(LayerChange(layer.id, str(e.node.target), layer.op, layer.distribution, layer.gain,
                                         layer.weight_variance, bias_done, layer.bias_variance, alpha))

    # -- output multiplier, notes --------------------------------------------------------------
    if sol.logits_scale is not None and sol.logits_scale != 1.0:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        src = out.args[0]
        with gm.graph.inserting_before(out):
            scaled = gm.graph.call_function(operator.mul, (src, float(sol.logits_scale)))
        out.replace_input_with(src, scaled)
        report.notes.append(f"the network output is multiplied by logits_scale = {sol.logits_scale:.6g}")
    if sol.input_second_moment is not None:
        report.notes.append(f"scale the network input so that E[x^2] = {sol.input_second_moment:.6g} "
                            "(geometric initialization, GR section 6.3); apply does not touch the data")
    report.notes.extend(f"answer warning: {w}" for w in sol.warnings)
    if sol.method in ("tat", "dks", "eoc", "sparse_eoc"):
        q = sol.q_star if sol.q_star is not None else 1.0
        report.notes.append(f"the kernel analysis assumes inputs with mean squared value q = {q:.6g} per example")

    # -- modules the answer did not cover ------------------------------------------------------
    for name, mod in target.named_modules():
        own = [p for p in mod.parameters(recurse=False)]
        if not own or id(mod) in initialized or isinstance(mod, (TransformedActivation, NormalizedSum)):
            continue
        if name not in ext.traced_modules:
            why = "never called in forward"
        elif any(e.module is mod and e.op in ("dense", "conv") for e in ext.entries.values()):
            why = "a weighted layer the answer does not list"
        elif any(e.module is mod and e.unsupported for e in ext.entries.values()):
            why = "unsupported op treated as the identity; its parameters are unchanged"
        else:
            why = "its parameters are unchanged"
        report.uninitialized.append(f"{name} ({type(mod).__name__}): {why}")
    if report.uninitialized:
        report.warnings.append("modules with parameters left as they were: "
                               + "; ".join(report.uninitialized[:10]))

    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    gm.train(model.training)
    return report
