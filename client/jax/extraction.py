"""A ``sigprop.graph/v1`` graph from a Flax (linen) module, read off the jaxpr of ``module.apply``.

Why the jaxpr and not Flax's module tree: the tree only sees module calls (``nn.Dense``,
``nn.Conv``), while a network's residual adds, concatenations, activations and pooling are plain
functions (``x + y``, ``jnp.concatenate``, ``nn.relu``, ``nn.avg_pool``) that no module hook sees.
The jaxpr has the whole data flow, and because the params are arguments of the traced function,
every ``dot_general`` / ``conv_general_dilated`` names the exact params leaf it multiplies by: the
id -> params-path mapping comes out exact, for any nesting of modules.

The jaxpr is interpreted once on the example input with the real params (nested ``jit`` and
``custom_jvp`` calls inlined). Each value is the input, a params-derived value, a constant, or a
network value: a graph node, times a scalar factor, possibly through a pending chain of elementwise
ops. An elementwise chain is resolved where a structural op reads it, by evaluating it on probe
points: ``s * phi(t)`` for a catalogue activation ``phi`` (``leaky_relu`` and ``elu`` with their
parameter fitted) becomes an ``activation`` node, ``a * t`` a scalar factor (``(x + y) / sqrt(2)``
is a normalized sum, ``jnp.mean`` a global average pool), anything else an unsupported op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ...schemas.errors import SigpropError
from ...schemas.graph import unsupported_note
from ..adapters import check_assumptions, finish_graph
from .activations import activation_fn  # the catalogue's exact phi
from .fused import FUSED_HINT, drop_fused, fused_split
from .sequence import ATTENTION_HINT, dense_on_tokens, norm_step, sequence_step, settle, written_out_attention

_INLINE = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"}
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "neg", "max", "min", "tanh", "logistic", "exp", "exp2", "expm1", "log",
    "log1p", "integer_pow", "pow", "sqrt", "rsqrt", "erf", "erfc", "abs", "sign", "select_n", "ge", "gt",
    "le", "lt", "eq", "ne", "convert_element_type", "atan", "asinh", "square", "copy", "copy_p", "not", "and",
    "or", "stop_gradient", "clamp", "sin", "cos", "cbrt", "reduce_precision",
}  # fmt: skip
_RESHAPES = {"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims"}
_PROBE = np.concatenate([np.linspace(-6.0, 6.0, 121), [-0.01, 0.01, 0.3, -0.3]])
_NOTE_SCALED = "the graph does not model a scale factor"


@dataclass
class _Net:
    """A network value: ``factor * node`` (through ``chain`` when an elementwise chain is pending)."""

    node: str
    factor: float = 1.0
    chain: Any = None  # f(base value) -> value, the pending elementwise ops
    base: Any = None  # the value the chain starts from


@dataclass
class FlaxExtraction:
    graph: dict
    mapping: dict  # answer layer id -> params path (tuple of keys, without "params")
    values: dict = field(default_factory=dict)  # graph id -> its value on the example input
    warnings: list[str] = field(default_factory=list)


def _catalogue() -> list[tuple[str, Any, dict]]:
    names = ["relu", "tanh", "sigmoid", "softplus", "gelu", "gelu_tanh", "swish", "selu", "softsign", "erf", "atan"]
    return [(n, activation_fn(n), {}) for n in names + ["asinh", "bentid"]]


def _classify(f: np.ndarray) -> tuple[str, dict, float] | None:
    """(catalogue activation, params, output factor s) of probe values ``f = s * phi(_PROBE)``, or None."""
    t = _PROBE  # t[0] = -6, t[50] = -1, t[60] = 0, t[70] = 1
    tol = 1e-5 * max(1.0, float(np.max(np.abs(f))))  # gelu and gelu_tanh differ by 5e-4
    cands = _catalogue()
    pos = f[70]  # phi(1) * s
    if pos != 0:  # leaky_relu: f = s * where(t > 0, t, a t); elu: f(-6) = s * alpha * expm1(-6)
        a = float(f[50] / -pos)
        cands.append(("leaky_relu", None, {"negative_slope": a}))
        alpha = float(f[0] / (pos * math.expm1(-6.0)))  # t[0] = -6
        cands.append(("elu", None, {"alpha": alpha}))
    for name, fn, params in cands:
        fn = fn or activation_fn(name, **params)
        phi = np.asarray(fn(jnp.asarray(t, jnp.float32)), np.float64)
        denom = float(phi @ phi)
        if denom == 0:
            continue
        s = float(phi @ f) / denom
        if s > 0 and np.max(np.abs(f - s * phi)) < tol:
            s = 1.0 if abs(s - 1.0) < 1e-4 else s  # float32 round-off of an unscaled activation
            if name == "leaky_relu" and abs(params["negative_slope"]) < 1e-6:
                return "relu", {}, s
            return name, params, s
    return None


class _Walker:
    """Interprets the jaxpr, building the graph as it goes."""

    def __init__(self, allow_unsupported: bool, sequence: bool = False):
        self.allow = allow_unsupported
        self.sequence = sequence  # a [B, T, D] input: per-token layers, attention, layer norms (sequence.py)
        self.nodes: list[dict] = []
        self.ids: set[str] = set()
        self.mapping: dict[str, tuple] = {}
        self.values: dict[str, Any] = {}
        self.warnings: list[str] = []
        self.kind: dict = {}  # var -> _Net | ("param", path) | "const"
        self.env: dict = {}
        self.materialized: dict = {}  # var of a resolved chain -> its node
        self.module_types: dict[tuple, str] = {}  # Flax module path -> its class name
        self.scope = ""  # the name stack of the equation being read ("Model/Block_0/LayerNorm_0")

    # -- values ------------------------------------------------------------------------------------
    def read(self, v):
        return v.val if isinstance(v, Literal) else self.env[v]

    def kind_of(self, v):
        return "const" if isinstance(v, Literal) else self.kind.get(v, "const")

    def new_node(self, base_id: str, nd: dict, value) -> str:
        gid, k = base_id, 1
        while gid in self.ids:
            gid, k = f"{base_id}_{k}", k + 1
        self.ids.add(gid)
        self.nodes.append({"id": gid, **nd})
        self.values[gid] = value
        return gid

    def modules_at(self) -> list[tuple[str, str]]:
        """(path, class name) of the Flax modules the current equation runs in, outermost first."""
        parts = [p for p in self.scope.split("/") if p][1:]  # the first is the top module's class
        path: tuple = ()
        out = []
        for p in parts:
            p = p.split("(")[-1].rstrip(")")  # jit(leaky_relu) and the like are not modules
            if path + (p,) not in self.module_types:
                break
            path += (p,)
            out.append(("/".join(path), self.module_types[path]))
        return out

    def module_at(self) -> tuple[str, str] | None:
        """(path, class name) of the innermost Flax module the current equation runs in."""
        chain = self.modules_at()
        return chain[-1] if chain else None

    def unsupported(self, why: str, hint: str = "") -> str:
        """Raise for an op the graph cannot express, or under allow_unsupported warn and return what
        it was (the note of the identity that ``stand_in`` puts in its place)."""
        chain = self.modules_at()
        # an attention module's own Dense layers are named by the attention module (the way out is its hint)
        at = next((m for m in chain if "Attention" in m[1]), chain[-1] if chain else None)
        kind = at[1] if at else ""
        if at is None:
            where = "the Flax model's own code (its __call__, outside any submodule)"
        else:
            where = f"the Flax module '{at[0]}' ({kind})"
        if "Norm" in kind and not hint:
            hint = (
                f"{kind} is a normalization layer, which the Q/C map analysis does not model: TAT and DKS "
                "networks are normalization-free, remove it (the answer's initialization and transformed "
                "activations do its job), or pass allow_unsupported=True to treat it as the identity"
            )
        elif "Attention" in kind:
            hint = ATTENTION_HINT
        if not self.allow:
            raise SigpropError(
                "unsupported_op",
                f"{where} is not supported: it computes {why}, which the sigprop graph cannot express",
                hint
                or "use dense/conv layers, activations, adds, concatenations, pooling and reshapes; "
                "or pass allow_unsupported=True to treat it as the identity",
            )
        self.warnings.append(f"{where}: {why}: treated as the identity")
        return f"{where}: {why}"

    def stand_in(self, note: str, src: _Net, value, factor: float | None = None) -> _Net:
        """An ``identity`` node reading ``src`` in place of an op the graph cannot express, with the
        note on it: the graph itself says so, and every answer for it warns, whoever sends it.
        ``value``: the model's value there; ``factor``: its scale over the node's (``src``'s)."""
        factor = src.factor if factor is None else factor
        at = self.module_at()
        nd = {"op": "identity", "inputs": [src.node], "unsupported": unsupported_note(note)}
        return _Net(self.new_node(at[0].lower() if at else "unsupported", nd, value / factor), factor)

    def resolve(self, v, for_what: str, scaled_ok: bool = False) -> _Net:
        """The node ``v`` stands for, its pending elementwise chain turned into an activation node."""
        net = self.kind_of(v)
        if not isinstance(net, _Net):
            raise SigpropError("unsupported_op", f"{for_what} reads no network value", "")
        if net.chain is not None:
            net = self.materialize(v, net)
        if not scaled_ok and abs(net.factor - 1.0) > 1e-6:
            self.warnings.append(
                f"'{net.node}' enters {for_what} multiplied by {net.factor:.6g}: {_NOTE_SCALED} "
                "(the answer assumes it is not scaled; for a sum, divide by the norm of its weights)"
            )
        return net

    def materialize(self, v, net: _Net) -> _Net:
        """Resolve a pending elementwise chain: a scalar factor, or an activation node.

        Any nonlinear elementwise function of one value is an activation (the graph's activation
        nodes name no function: the request's transformed activation replaces it), so a model
        written with the answer's ``transformed_activation`` extracts to the same graph as the
        original; a catalogue function only gives the node its name."""
        if v in self.materialized:
            return self.materialized[v]
        f = _probe_chain(net, np.asarray(net.base))  # as a function of the base value, factor * node
        slope, shift = np.polyfit(_PROBE, f, 1)
        if np.max(np.abs(f - slope * _PROBE - shift)) < 1e-5 * max(1.0, float(np.max(np.abs(f)))):
            a = net.factor * float(slope)
            out = _Net(net.node, 1.0 if abs(a - 1.0) < 1e-5 else a)
            if abs(shift) > 1e-6 * max(1.0, abs(slope)):
                out = self.stand_in(self.unsupported(f"a constant shift of '{net.node}'"), out, self.env[v])
        else:
            if abs(net.factor - 1.0) > 1e-6:
                self.warnings.append(f"'{net.node}' enters an activation multiplied by {net.factor:.6g}")
            kind = _classify(f)
            nd = {"op": "activation", "inputs": [net.node]}
            out = _Net(self.new_node(f"{kind[0]}_act" if kind else "act", nd, self.env[v]))
        self.materialized[v] = out
        self.kind[v] = out
        return out


def _probe_chain(net: _Net, base: np.ndarray) -> np.ndarray:
    """The chain on the probe points, in slices of the base's shape (which its ops may need)."""
    chunks = []
    for start in range(0, len(_PROBE), base.size):
        probe = np.resize(_PROBE[start:], base.shape).astype(base.dtype)
        chunks.append(np.asarray(net.chain(jnp.asarray(probe))).reshape(-1)[: len(_PROBE) - start])
    return np.concatenate(chunks).astype(np.float64)


def _structural(w: _Walker, eqn, ins: list, out) -> None:
    """One op that is not elementwise: a layer, a sum, a concat, pooling, a reshape, or unsupported."""
    prim, p = eqn.primitive.name, eqn.params
    kinds = [w.kind_of(v) for v in eqn.invars]
    data = [(v, k) for v, k in zip(eqn.invars, kinds, strict=True) if isinstance(k, _Net)]
    ov = eqn.outvars[0]
    if prim in ("dot_general", "conv_general_dilated") and len(data) == 1 and isinstance(kinds[1], tuple):
        return _layer(w, eqn, data[0][0], kinds[1][1], out)
    if w.sequence and len(data) == 1 and prim in _RESHAPES and np.shape(out) != np.shape(w.read(data[0][0])):
        note = w.unsupported(
            f"a {prim} of a token stream to shape {list(np.shape(out))} (attention heads split out by hand?)",
            ATTENTION_HINT,
        )
        w.kind[ov] = w.stand_in(note, w.resolve(data[0][0], prim, scaled_ok=True), out)
        return None
    if w.sequence and len(data) == 1 and prim in ("split", "slice") and not fused_split(w, eqn, data[0][0], _Net):
        w.unsupported(f"a {prim} of the features of '{w.resolve(data[0][0], prim, scaled_ok=True).node}'", FUSED_HINT)
    elif w.sequence and len(data) == 1 and prim in ("split", "slice"):
        return None
    if w.sequence and written_out_attention(eqn, len(data)):
        note = w.unsupported("a product of two network values (attention scores or mixing written out)", ATTENTION_HINT)
        w.kind[ov] = w.stand_in(note, w.resolve(data[0][0], prim, scaled_ok=True), out, 1.0)
        return None
    if prim == "mul" and len(data) == 2:
        return _product(w, data, out, ov)
    if prim == "add" and len(data) == 2:
        a, b = (w.resolve(v, "a sum", scaled_ok=True) for v, _ in data)
        norm = math.hypot(a.factor, b.factor)
        nd = {"op": "sum", "inputs": [a.node, b.node], "weights": [a.factor / norm, b.factor / norm]}
        w.kind[ov] = _Net(w.new_node("add", nd, out / norm), norm)
        return None
    others = [k for k in kinds if not isinstance(k, _Net)]
    if prim == "add" and len(data) == 1 and len(others) == 1 and isinstance(others[0], tuple):
        return _bias(w, data[0][0], out, ov)
    if prim == "concatenate" and len(data) == len(kinds) > 1 and p["dimension"] == len(np.shape(out)) - 1:
        srcs = [w.resolve(v, "a concatenation") for v, _ in data]
        nd = {"op": "concat", "inputs": [s.node for s in srcs]}
        w.kind[ov] = _Net(w.new_node("concat", nd, out))
        return None
    if len(data) != 1 or any(isinstance(k, _Net) for k in kinds if k is not data[0][1]):
        return _unsupported(w, prim, data, out, ov)
    src = w.resolve(data[0][0], prim, scaled_ok=prim in ("reshape", "reduce_sum", "reduce_window_sum"))
    shape_in, shape_out = np.shape(w.read(data[0][0])), np.shape(out)
    op = _pool_or_shape(prim, p, shape_in, shape_out)
    if op is None:
        return _unsupported(w, prim, data, out, ov)
    name, attrs, factor = op
    if name == "identity":
        w.kind[ov] = _Net(src.node, src.factor)
        return None
    gid = w.new_node(name, {"op": name, "inputs": [src.node], **attrs}, out / (src.factor * factor))
    w.kind[ov] = _Net(gid, src.factor * factor)
    return None


def _product(w: _Walker, data: list, out, ov) -> None:
    """``u * v`` of two network values of one shape (a gated MLP's gate): a ``mul`` node."""
    shapes = [np.shape(w.read(v)) for v, _ in data]
    if shapes[0] != shapes[1]:
        return _unsupported(w, f"a product that broadcasts {list(shapes[0])} and {list(shapes[1])}", data, out, ov)
    a, b = (w.resolve(v, "a product", scaled_ok=True) for v, _ in data)
    factor = a.factor * b.factor
    w.kind[ov] = _Net(w.new_node("mul", {"op": "mul", "inputs": [a.node, b.node]}, out / factor), factor)
    return None


def _pool_or_shape(prim: str, p: dict, shape_in, shape_out) -> tuple[str, dict, float] | None:
    """(op, attributes, factor of the model's value over the node's) of a pooling or reshape op."""
    if prim == "reshape" or prim == "squeeze" or prim == "expand_dims":
        if len(shape_out) == 2 and shape_out[0] == shape_in[0] and shape_out[1] == math.prod(shape_in[1:]):
            return ("identity", {}, 1.0) if len(shape_in) == 2 else ("flatten", {}, 1.0)
        return ("identity", {}, 1.0) if tuple(shape_in) == tuple(shape_out) else None
    if prim == "reduce_sum" and len(shape_in) == 4 and tuple(p["axes"]) == (1, 2):
        return "global_avg_pool", {}, float(shape_in[1] * shape_in[2])
    if prim in ("reduce_window_max", "reduce_window_sum") and len(shape_in) == 4:
        dims, strides, pad = p["window_dimensions"], p["window_strides"], p["padding"]
        if dims[0] != 1 or dims[3] != 1 or strides[0] != 1 or strides[3] != 1:
            return None
        pads = {pad[1][0], pad[1][1], pad[2][0], pad[2][1]}
        if len(pads) != 1:
            return None
        attrs = {"kernel": [dims[1], dims[2]], "stride": [strides[1], strides[2]]}
        attrs.update({"padding": pads.pop()} if pads != {0} else {})
        if prim == "reduce_window_max":
            return "max_pool", attrs, 1.0
        return "avg_pool", attrs, float(dims[1] * dims[2])
    return None


def _layer(w: _Walker, eqn, v, path: tuple, out) -> None:
    src = w.resolve(v, "a layer")
    kernel = np.shape(w.read(eqn.invars[1]))
    module = tuple(k for k in path[:-1] if k != "params") if path[0] == "params" else tuple(path[:-1])
    gid_base = "/".join(str(k) for k in module).lower() or "layer"
    if eqn.primitive.name == "dot_general":
        per_token = w.sequence and dense_on_tokens(eqn, kernel, np.shape(w.read(v)), np.shape(out))
        if len(np.shape(out)) != 2 and not per_token:
            what = (
                f"a Dense layer on a tensor of shape {list(np.shape(out))[:-1] + ['features']} (per token or location)"
            )
            return _unsupported(w, what, [(v, src)], out, eqn.outvars[0])
        nd = {"op": "dense", "inputs": [src.node], "units": int(kernel[-1]), "bias": False}
    else:
        nd = _conv_node(w, eqn, src, kernel, out)
        if nd is None:
            return _unsupported(w, "a convolution of this kind", [(v, src)], out, eqn.outvars[0])
    gid = w.new_node(gid_base, nd, out)
    w.mapping[gid] = module
    w.kind[eqn.outvars[0]] = _Net(gid)
    return None


def _conv_node(w: _Walker, eqn, src: _Net, kernel, out) -> dict | None:
    p = eqn.params
    if (
        p["feature_group_count"] != 1
        or any(d != 1 for d in p["rhs_dilation"])
        or any(d != 1 for d in p["lhs_dilation"])
    ):
        return None
    if len(kernel) != 4 or tuple(p["dimension_numbers"].lhs_spec) != (0, 3, 1, 2):
        return None  # NHWC images with HWIO kernels, as flax.linen.Conv makes them
    stride = [int(s) for s in p["window_strides"]]
    pads = [tuple(int(a) for a in pr) for pr in p["padding"]]
    size_in, size_out = np.shape(w.read(eqn.invars[0]))[1:3], np.shape(out)[1:3]
    if all(a == 0 and b == 0 for a, b in pads):
        padding: Any = "valid"
    elif all(o == math.ceil(i / s) for i, o, s in zip(size_in, size_out, stride, strict=True)) and all(
        k % 2 == 1 for k in kernel[:2]
    ):
        padding = "same"
    elif len({x for pr in pads for x in pr}) == 1:
        padding = pads[0][0]
    else:
        return None
    ch = int(kernel[3])
    return {"op": "conv", "inputs": [src.node], "channels": ch, "kernel": [int(kernel[0]), int(kernel[1])],
            "stride": stride, "padding": padding, "bias": False}  # fmt: skip


def _bias(w: _Walker, v, out, ov) -> None:
    net = w.kind_of(v)
    last = w.nodes[-1] if w.nodes else None
    if net.chain is None and net.factor == 1.0 and last is not None and last["id"] == net.node and "bias" in last:
        last["bias"] = True
        w.values[net.node] = out
        w.kind[ov] = _Net(net.node)
        return None
    return _unsupported(w, "a learned shift added outside a Dense/Conv layer", [(v, net)], out, ov)


def _unsupported(w: _Walker, what: str, data: list, out, ov) -> None:
    note = w.unsupported(f"{what} (on {', '.join(repr(k.node) for _, k in data) or 'no network value'})")
    if data:
        w.kind[ov] = w.stand_in(note, w.resolve(data[0][0], what, scaled_ok=True), out)
    return None


def _link(k, ratio: float) -> Any:
    """How an operand of an elementwise op is computed from the chain's base (None: a constant);
    ``ratio``: the operand's base over the chain's (``0.2 * x`` in ``where(x > 0, x, 0.2 * x)``)."""
    if not isinstance(k, _Net):
        return None
    chain = k.chain
    if ratio == 1.0:
        return chain if chain is not None else (lambda b: b)
    if chain is None:
        return lambda b: ratio * b
    return lambda b: chain(ratio * b)


def _rescale(w: _Walker, eqn, kinds: list, net: _Net) -> bool:
    """A network value times or divided by a scalar constant: only its factor changes (so that
    ``(x + y) / sqrt(2)`` is the normalized sum itself, not a function applied to it)."""
    name = eqn.primitive.name
    if name not in ("mul", "div") or len(kinds) != 2:
        return False
    k = 0 if isinstance(kinds[0], _Net) else 1
    other = w.read(eqn.invars[1 - k])
    if isinstance(kinds[1 - k], _Net) or np.size(other) != 1 or (name == "div" and k == 1):
        return False
    c = float(np.asarray(other).reshape(()))
    if c == 0.0:
        return False
    w.kind[eqn.outvars[0]] = _Net(net.node, net.factor * c if name == "mul" else net.factor / c)
    return True


def _elementwise(w: _Walker, eqn, out) -> bool:
    """Extend a pending chain when every network operand is the same value; False otherwise."""
    kinds = [w.kind_of(v) for v in eqn.invars]
    nets = [(v, k) for v, k in zip(eqn.invars, kinds, strict=True) if isinstance(k, _Net)]
    if not nets or eqn.primitive.name not in _ELEMENTWISE or any(isinstance(k, tuple) for k in kinds):
        return False  # a params operand (a bias, a learned slope) is no fixed elementwise function
    roots = {k.node for _, k in nets}
    if len(roots) != 1 or np.shape(out) != np.shape(w.env[nets[0][0]]):
        return False
    first = nets[0][1]
    if first.chain is None and _rescale(w, eqn, kinds, first):
        return True
    base = first.base if first.chain is not None else w.env[nets[0][0]]
    # every operand's base is the same node times its own factor: a multiple of the chain's base
    ratios = []
    for v, k in nets:
        own = k.base if k.chain is not None else w.env[v]
        ratio = k.factor / first.factor
        if own is not base:
            if np.shape(own) != np.shape(base) or not np.allclose(
                np.asarray(own), ratio * np.asarray(base), rtol=1e-5, atol=1e-6
            ):
                return False
        ratios.append(1.0 if abs(ratio - 1.0) < 1e-12 else ratio)
    it = iter(ratios)  # in operand order, as nets is
    parts = [_link(k, next(it)) if isinstance(k, _Net) else None for k in kinds]
    consts = [None if isinstance(k, _Net) else w.read(v) for v, k in zip(eqn.invars, kinds, strict=True)]
    prim, params = eqn.primitive, dict(eqn.params)

    def chain(b, parts=parts, consts=consts):
        args = [f(b) if f is not None else c for f, c in zip(parts, consts, strict=True)]
        return prim.bind(*args, **params)

    w.kind[eqn.outvars[0]] = _Net(first.node, first.factor, chain, base)
    return True


def _run(w: _Walker, jaxpr, args: list, outer: str = "") -> list:
    for var, val in zip(jaxpr.invars, args, strict=True):
        w.env[var] = val
    for eqn in jaxpr.eqns:
        ins = [w.read(v) for v in eqn.invars]
        name = eqn.primitive.name
        scope = str(eqn.source_info.name_stack)
        w.scope = f"{outer}/{scope}" if outer and scope else outer or scope
        if w.sequence and sequence_step(w, eqn, ins, _Net):
            continue
        if not w.sequence and norm_step(w, eqn, ins, _Net, ("RMSNorm",)):  # per example on [B, F]
            continue
        if name in _INLINE:
            closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
            inner = closed.jaxpr if hasattr(closed, "jaxpr") else closed
            consts = list(getattr(closed, "consts", []))
            for cv, c in zip(inner.constvars, consts, strict=True):
                w.env[cv] = c
            for iv, ov in zip(inner.invars, eqn.invars, strict=True):
                w.kind[iv] = w.kind_of(ov)
            outs = _run(w, inner, ins, w.scope)
            for ov, iv, val in zip(eqn.outvars, inner.outvars, outs, strict=True):
                w.env[ov] = val
                w.kind[ov] = w.kind_of(iv)
            continue
        outs = eqn.primitive.bind(*ins, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for ov, val in zip(eqn.outvars, outs, strict=True):
            w.env[ov] = val
        kinds = [w.kind_of(v) for v in eqn.invars]
        if not any(isinstance(k, _Net) for k in kinds):
            params = [k for k in kinds if isinstance(k, tuple)]
            for ov in eqn.outvars:
                w.kind[ov] = params[0] if params else "const"
        elif not _elementwise(w, eqn, outs[0]):
            _structural(w, eqn, ins, outs[0])
    return [w.read(v) for v in jaxpr.outvars]


def _traced(module, variables, x, types: dict):
    """The jaxpr of ``module.apply``, recording each submodule's path and class (so that an
    unsupported op is named by the module computing it, not by a jaxpr primitive)."""
    try:
        from flax import linen
    except ImportError:  # pragma: no cover - graph_from_flax is only called with Flax modules
        linen = None

    def record(next_fun, args, kwargs, context):
        types[tuple(context.module.path)] = type(context.module).__name__
        return next_fun(*args, **kwargs)

    if linen is None:
        return jax.make_jaxpr(lambda v, x: module.apply(v, x))(variables, x)
    with linen.intercept_methods(record):
        return jax.make_jaxpr(lambda v, x: module.apply(v, x))(variables, x)


def extract_flax(module, variables, example_input, *, allow_unsupported: bool = False) -> FlaxExtraction:
    """Trace ``module.apply(variables, example_input)`` and read the graph off its jaxpr."""
    x = jnp.asarray(example_input)
    if x.ndim not in (2, 3, 4):
        raise SigpropError(
            "invalid_graph",
            f"example_input has shape {list(x.shape)}",
            "give [B, F], a sequence [B, T, D] or NHWC [B, H, W, C]",
        )
    w = _Walker(allow_unsupported, sequence=x.ndim == 3)
    closed = _traced(module, variables, x, w.module_types)
    leaves = jax.tree_util.tree_flatten_with_path(variables)[0]
    if x.ndim == 3:  # tokens first, features last; Dense layers act per token
        gid = w.new_node("x", {"op": "input", "shape": [int(x.shape[1]), int(x.shape[2])], "sequence": True}, x)
    else:
        shape = [int(x.shape[1])] if x.ndim == 2 else [int(x.shape[3]), int(x.shape[1]), int(x.shape[2])]
        gid = w.new_node("x", {"op": "input", "shape": shape}, x)
    inv = closed.jaxpr.invars
    for var, (path, _) in zip(inv[:-1], leaves, strict=True):
        w.kind[var] = ("param", tuple(getattr(k, "key", getattr(k, "name", k)) for k in path))
    w.kind[inv[-1]] = _Net(gid)
    for cv, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
        w.env[cv] = c
    outs = _run(w, closed.jaxpr, [leaf for _, leaf in leaves] + [x])
    if len(outs) != 1:
        raise SigpropError("unsupported_op", f"apply returns {len(outs)} values", "return one array")
    settle(w, closed.jaxpr.outvars[0], _Net)  # a model ending in a LayerNorm
    last = w.resolve(closed.jaxpr.outvars[0], "the output")
    w.new_node("output", {"op": "output", "inputs": [last.node]}, w.values[last.node])
    drop_fused(w)  # a fused qkv Dense is its blocks
    for nd in w.nodes:
        nd.pop("fn_params", None)
    graph = {"schema": "sigprop.graph/v1", "nodes": w.nodes}
    return FlaxExtraction(graph, w.mapping, w.values, w.warnings)


def _variables(module, variables, example_input):
    if variables is not None:
        return variables
    return module.init(jax.random.PRNGKey(0), jnp.asarray(example_input))


def graph_from_flax(
    module, example_input, variables=None, *, allow_unsupported: bool = False, assumptions: str = "strict"
) -> tuple[dict, dict]:
    """``(graph, mapping)`` of a ``flax.linen`` module: the ``sigprop.graph/v1`` graph (a dict) and
    answer layer id -> params path (``{"dense_0": ("Dense_0",), "block_0/conv_1": ("Block_0",
    "Conv_1")}``), which :func:`sigprop.client.jax.apply_to_params` takes as its ``mapping``.

    ``example_input``: one batch, ``[B, features]`` or NHWC ``[B, H, W, C]`` (Flax's layout; the
    graph's input shape is ``[C, H, W]``). ``variables``: the model's variables (default:
    ``module.init`` with key 0; only shapes matter). Dense/Conv layers become ``dense``/``conv``
    named after their module path (lower case), activations (any catalogue function, however it is
    written) ``activation``, ``x + y`` a ``sum`` (weights from scalar factors on its inputs:
    ``(x + y) / sqrt(2)`` and ``a * x + b * y`` with a^2 + b^2 = 1 are normalized sums),
    ``jnp.concatenate`` on the channel axis ``concat``, ``u * v`` of two network values of one shape
    ``mul`` (a gated MLP's gate), ``nn.RMSNorm`` ``rms_norm``, ``nn.max_pool``/``nn.avg_pool``/``jnp.mean``
    over H, W pooling, reshapes to ``[B, features]`` ``flatten``. A value that reaches an activation
    or a layer scaled (a plain ``x + y`` is sqrt(2) times the normalized sum the graph assumes)
    gets a warning: JAX code cannot be rewritten, so the model must compute what the graph says.
    Anything else raises ``SigpropError("unsupported_op")`` (``allow_unsupported=True``: an
    ``identity`` node with an ``unsupported`` note, and a warning; every answer warns of it too).
    The graph is checked with the service's structure rules (``assumptions="warn"`` warns instead of
    raising ``unsupported_structure``).

    A sequence ``[B, T, D]`` gives a sequence graph (input ``{"shape": [T, D], "sequence": true}``):
    ``nn.Dense`` per token, ``sigprop.client.jax.attention.ShapedAttention`` on three Dense layers of
    one input (or the blocks of a fused qkv Dense, ``fused``) an ``attention`` node, ``nn.LayerNorm``
    a ``layer_norm`` node; the mapping also names their modules (``sequence``).
    """
    import warnings

    check_assumptions(assumptions)
    ext = extract_flax(
        module, _variables(module, variables, example_input), example_input, allow_unsupported=allow_unsupported
    )
    for note in ext.warnings:
        warnings.warn(note, stacklevel=2)
    # a Flax graph names no function (apply_to_params cannot change the model's), so no keep_fn
    finish_graph(ext.graph, (), keep_fn=False, assumptions=assumptions)
    return ext.graph, ext.mapping
