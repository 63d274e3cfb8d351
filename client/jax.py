"""JAX adapter: use a sigprop answer (``POST /v1/solve``) in a JAX / Flax / Haiku model.

Three things an answer tells a model, each usable on its own:

- :func:`transformed_activation` -- the activation to use, as a jax-traceable function
  ``phi_hat(x) = output_scale * (phi(input_scale * x + input_shift) + output_shift)`` (the dks
  convention of the contract), ``phi`` written exactly as the engine defines it
  (``sigprop.engine.activations``), including ``negative_slope`` of ``leaky_relu`` and the
  threshold ``tau`` / clip ``m`` of the sparsifying activations.
- Initializers with the Flax / Haiku / ``jax.nn.initializers`` signature
  ``init(key, shape, dtype=jnp.float32)``: :func:`scaled_uniform_orthogonal` (with Orthogonal
  Delta for conv kernels), :func:`gaussian`, and :func:`initializer_for` /
  :func:`bias_initializer_for`, which pick the one an answer's ``layers[]`` entry asks for.
- :func:`apply_to_params` -- re-initialize an existing params tree (nested dicts, Flax or Haiku
  style) from an answer, given which param path each answer layer id is, and report what changed
  and what was not covered.

Layouts are JAX's: dense kernels ``[in, out]``, conv kernels ``[kh, kw, in, out]`` (any number
of spatial axes first, input and output channels last), as in ``flax.linen.Dense`` / ``Conv`` and
``haiku.Linear`` / ``Conv2D``. Nothing here imports flax or haiku.

jax is an optional dependency: ``pip install 'sigprop[jax]'``.
"""

from __future__ import annotations

try:
    import jax
    import jax.numpy as jnp
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "sigprop.client.jax needs JAX, which is not installed: pip install 'sigprop[jax]'"
    ) from _exc

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import numpy as np

from sigprop.schemas import LayerInit, Solution

__all__ = [
    "ACTIVATIONS",
    "Initializer",
    "ParamChange",
    "ApplyReport",
    "activation_fn",
    "transformed_activation",
    "scaled_uniform_orthogonal",
    "gaussian",
    "zeros",
    "initializer_for",
    "bias_initializer_for",
    "apply_to_params",
]

Initializer = Callable[..., jax.Array]  # init(key, shape, dtype=jnp.float32) -> jax.Array
PathLike = Union[str, Sequence[Any]]

# --------------------------------------------------------------------------- activations

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_K = 0.044715
# sigprop.engine.activations.SELU_LAMBDA / SELU_ALPHA
_SELU_LAMBDA = 1.0507009873554804934193349852946
_SELU_ALPHA = 1.6732632423543772848170429916717


def _softplus(x):
    # max(x, 0) + log1p(exp(-|x|)), the engine's formula; jnp.logaddexp computes exactly that and
    # has the right derivative sigmoid(x) everywhere (jnp.maximum's is 1/2 at 0, jnp.abs's 0)
    return jnp.logaddexp(x, 0.0)


def _elu(x, alpha=1.0, scale=1.0):
    # expm1 only ever sees x <= 0, so neither branch (nor its gradient) overflows; the inner
    # where (not jnp.minimum, whose gradient at 0 is 1/2) gives phi'(0) = scale * alpha
    return scale * jnp.where(x > 0, x, alpha * jnp.expm1(jnp.where(x > 0, 0.0, x)))


def _gelu_tanh(x):
    return x * jax.nn.sigmoid(2.0 * _SQRT_2_OVER_PI * x * (1.0 + _GELU_TANH_K * x * x))


def _bentid(x):
    # (sqrt(x^2 + 1) - 1) / 2 + x, without cancellation near 0 (as the engine writes it)
    return 0.5 * (x * x) / (jnp.hypot(x, 1.0) + 1.0) + x


# Each entry: (names of the parameters the activation takes, with the engine's defaults;
# phi(x, **params)). The one-sided derivatives at the kinks follow the engine (and PyTorch):
# jnp.where with a strict inequality, never jnp.maximum / jnp.clip (whose gradient at a tie is 1/2).
_ACTS: dict[str, tuple[dict[str, float], Callable[..., jax.Array]]] = {
    "tanh": ({}, jnp.tanh),
    "sigmoid": ({}, jax.nn.sigmoid),
    "softplus": ({}, _softplus),
    "erf": ({}, jax.scipy.special.erf),
    "atan": ({}, jnp.arctan),
    "asinh": ({}, jnp.arcsinh),
    "softsign": ({}, lambda x: x / (1.0 + jnp.abs(x))),
    "bentid": ({}, _bentid),
    "swish": ({}, lambda x: x * jax.nn.sigmoid(x)),
    "gelu": ({}, lambda x: x * jax.scipy.special.ndtr(x)),
    "gelu_tanh": ({}, _gelu_tanh),
    "elu": ({"alpha": 1.0}, lambda x, alpha: _elu(x, alpha)),
    "selu": ({}, lambda x: _elu(x, _SELU_ALPHA, _SELU_LAMBDA)),
    "relu": ({}, lambda x: jnp.where(x > 0, x, 0.0)),
    "leaky_relu": ({"negative_slope": 0.01},
                   lambda x, negative_slope: jnp.where(x > 0, x, negative_slope * x)),
    "relu_tau": ({"tau": 1.0}, lambda x, tau: jnp.where(x > tau, x - tau, 0.0)),
    "soft_threshold": ({"tau": 1.0},
                       lambda x, tau: jnp.where(x > tau, x - tau, jnp.where(x < -tau, x + tau, 0.0))),
    "crelu": ({"tau": 1.0, "m": 1.0},
              lambda x, tau, m: jnp.where(x > tau, jnp.where(x - tau < m, x - tau, m), 0.0)),
    "cst": ({"tau": 1.0, "m": 1.0},
            lambda x, tau, m: jnp.where(
                jnp.abs(x) > tau,
                jnp.sign(x) * jnp.where(jnp.abs(x) - tau < m, jnp.abs(x) - tau, m),
                0.0)),
}
_ALIASES = {"silu": "swish"}

#: every activation name :func:`transformed_activation` accepts (the engine's, aliases included)
ACTIVATIONS: tuple[str, ...] = tuple(_ACTS) + tuple(_ALIASES)


def _as_float_array(x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.result_type(float))
    return x


def activation_fn(name: str, **params: float) -> Callable[[jax.Array], jax.Array]:
    """The untransformed ``phi`` called ``name`` (PyTorch naming, as the engine), jax-traceable.

    ``params``: ``negative_slope`` (``leaky_relu``, default 0.01), ``alpha`` (``elu``, 1.0),
    ``tau`` (``relu_tau``, ``soft_threshold``, ``crelu``, ``cst``; 1.0), ``m`` (``crelu``,
    ``cst``; 1.0). A parameter given as None takes its default; one the activation does not take
    is an error.
    """
    key = _ALIASES.get(name, name)
    if key not in _ACTS:
        raise ValueError(f"unknown activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    defaults, phi = _ACTS[key]
    unknown = sorted(k for k, v in params.items() if v is not None and k not in defaults)
    if unknown:
        raise ValueError(f"activation {name!r} takes no parameter(s) {', '.join(unknown)}")
    p = {k: float(params[k]) if params.get(k) is not None else v for k, v in defaults.items()}

    def fn(x):
        return phi(_as_float_array(x), **p)

    fn.__name__ = key
    return fn


def _solution(solution) -> Solution:
    if isinstance(solution, Solution):
        return solution
    if isinstance(solution, (str, bytes)):
        return Solution.model_validate_json(solution)
    if isinstance(solution, Mapping):
        return Solution.model_validate(dict(solution))
    raise TypeError(f"expected a sigprop Solution (or its JSON / dict), got {type(solution).__name__}")


def transformed_activation(solution, name: str | None = None) -> Callable[[jax.Array], jax.Array]:
    """``phi_hat(x) = output_scale * (phi(input_scale * x + input_shift) + output_shift)``.

    ``solution``: the answer (a :class:`sigprop.schemas.Solution`, its JSON text or dict).
    ``phi`` is the answer's ``activation`` (or ``name``, to use another activation with the
    answer's parameters), built with the answer's ``negative_slope`` / ``tau`` / ``m``; absent
    transformation parameters are the identity (scale 1, shift 0), so for an Edge-of-Chaos or
    geometric answer this is plain ``phi``. The result is a pure function of an array: use it
    under ``jax.jit``, ``jax.grad``, ``jax.vmap``. Computation stays in the input's dtype.
    """
    sol = _solution(solution)
    act_name = name if name is not None else sol.activation
    key = _ALIASES.get(act_name, act_name)
    if key not in _ACTS:
        raise ValueError(f"unknown activation {act_name!r}; supported: {', '.join(ACTIVATIONS)}")
    defaults = _ACTS[key][0]
    given = {"negative_slope": sol.negative_slope, "tau": sol.tau, "m": sol.m}
    phi = activation_fn(key, **{k: v for k, v in given.items() if k in defaults})

    a = 1.0 if sol.input_scale is None else float(sol.input_scale)
    b = 0.0 if sol.input_shift is None else float(sol.input_shift)
    c = 1.0 if sol.output_scale is None else float(sol.output_scale)
    d = 0.0 if sol.output_shift is None else float(sol.output_shift)

    def phi_hat(x):
        return c * (phi(a * _as_float_array(x) + b) + d)

    phi_hat.__name__ = f"transformed_{key}"
    phi_hat.__doc__ = f"{c!r} * ({key}({a!r} * x + {b!r}) + {d!r})"
    return phi_hat


# --------------------------------------------------------------------------- initializers


def _uniform_orthogonal(key, n_rows: int, n_cols: int, dtype) -> jax.Array:
    """An ``n_rows x n_cols`` matrix from the uniform (Haar) distribution on matrices with
    orthonormal rows (``n_rows <= n_cols``) or columns (``n_rows > n_cols``).

    The construction of ``dks.jax.parameter_sampling_functions._uniform_orthogonal``: QR of a
    Gaussian matrix, column signs fixed by ``diag(R)``; equal to ``(X X^T)^{-1/2} X`` in
    distribution (TAT paper, Appendix D).
    """
    big, small = max(n_rows, n_cols), min(n_rows, n_cols)
    x = jax.random.normal(key, (big, small), dtype)
    q, r = jnp.linalg.qr(x)
    q = q * jnp.sign(jnp.diag(r))
    return q.T if n_rows < n_cols else q


# The samplers are jitted once per (shape, dtype) with the gain traced, so re-initializing a
# model eagerly costs one compiled call per layer shape rather than a dozen dispatches per layer
# (and a new gain never recompiles). Under an outer jit / vmap they are simply inlined.
@functools.partial(jax.jit, static_argnames=("shape", "dtype", "n_spatial"))
def _suo_sample(key, gain, *, shape: tuple[int, ...], dtype, n_spatial: int) -> jax.Array:
    spatial = shape[:n_spatial]
    n_out = shape[-1]
    n_in = math.prod(shape[n_spatial:-1])
    # half-precision kernels are sampled in float32 (LAPACK has no bf16 / f16 QR) and rounded once
    work = dtype if jnp.dtype(dtype).itemsize >= 4 else jnp.float32
    w = _uniform_orthogonal(key, n_out, n_in, work)  # out x in
    mat = (gain.astype(work) * w.T).astype(dtype)  # in x out
    if not spatial:
        return mat.reshape(shape)
    centre = tuple((s - 1) // 2 for s in spatial)
    return jnp.zeros(shape, dtype).at[centre].set(mat)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _gaussian_sample(key, std, *, shape: tuple[int, ...], dtype) -> jax.Array:
    return std.astype(dtype) * jax.random.normal(key, shape, dtype)


def scaled_uniform_orthogonal(gain: float = 1.0, delta: bool = True, *,
                              scale_corrected: bool = False) -> Initializer:
    """Scaled uniform orthogonal (SUO) weights, Orthogonal Delta for conv kernels.

    ``init(key, shape, dtype=jnp.float32)`` returns ``gain`` times a uniformly random matrix
    with orthonormal rows or columns, in JAX's kernel layout:

    - dense ``[in, out]``: with ``W = kernel.T`` (``out x in``), ``W W^T = gain^2 I`` when
      ``in >= out`` and ``W^T W = gain^2 I`` when ``in < out``;
    - conv ``[*spatial, in, out]`` with ``delta=True`` (Orthogonal Delta): every tap is zero
      except the centre one, which is an ``[in, out]`` SUO matrix (spatial sizes must be odd);
      with ``delta=False`` the whole kernel is one ``[prod(spatial) * in, out]`` SUO matrix.

    ``gain`` is the multiplier on the orthonormal matrix, exactly an answer's ``layers[].gain``,
    which already holds the scale correction ``max(sqrt(fan_out / fan_in), 1)`` times
    ``sqrt(sigma_w2)``. With ``scale_corrected=True`` the correction is computed from the shape
    and applied on top of ``gain`` (then ``gain`` plays the role of dks's ``scale`` and the
    result equals ``dks.jax.parameter_sampling_functions.scaled_uniform_orthogonal``, bit for bit).
    """
    gain = float(gain)

    def init(key, shape, dtype=jnp.float32) -> jax.Array:
        shape = tuple(int(s) for s in shape)
        dtype = jnp.dtype(dtype)
        if len(shape) < 2:
            raise ValueError(f"scaled_uniform_orthogonal needs a kernel of rank >= 2, got shape {shape}")
        n_spatial = len(shape) - 2 if delta else 0
        if any(s % 2 != 1 for s in shape[:n_spatial]):
            raise ValueError(f"Orthogonal Delta needs odd spatial sizes, got kernel shape {shape}")
        n_out, n_in = shape[-1], math.prod(shape[n_spatial:-1])
        # the product in float64, cast once (as dks does)
        g = gain * (max(math.sqrt(n_out / n_in), 1.0) if scale_corrected else 1.0)
        return _suo_sample(key, np.asarray(g, np.float32 if dtype.itemsize <= 4 else dtype),
                           shape=shape, dtype=dtype, n_spatial=n_spatial)

    return init


def gaussian(std: float) -> Initializer:
    """``N(0, std^2)`` entries: ``init(key, shape, dtype=jnp.float32)``. An answer's gaussian
    ``layers[].gain`` is this ``std`` (``sqrt(sigma_w2 / fan_in)``)."""
    std = float(std)

    def init(key, shape, dtype=jnp.float32) -> jax.Array:
        dtype = jnp.dtype(dtype)
        return _gaussian_sample(key, np.asarray(std, np.float32 if dtype.itemsize <= 4 else dtype),
                                shape=tuple(int(s) for s in shape), dtype=dtype)

    return init


def zeros(key, shape, dtype=jnp.float32) -> jax.Array:
    """All zeros, with the initializer signature (the key is ignored)."""
    return jnp.zeros(tuple(shape), dtype)


def _layer(layer) -> LayerInit:
    if isinstance(layer, LayerInit):
        return layer
    if isinstance(layer, Mapping):
        return LayerInit.model_validate(dict(layer))
    raise TypeError(f"expected a sigprop LayerInit (or its dict), got {type(layer).__name__}")


def initializer_for(layer) -> Initializer:
    """The kernel initializer an answer's ``layers[]`` entry asks for, with its ``gain``:
    ``scaled_uniform_orthogonal`` -> :func:`scaled_uniform_orthogonal` ``(gain, delta=False)``,
    ``orthogonal_delta`` -> ``(gain, delta=True)``, ``gaussian`` -> :func:`gaussian` ``(gain)``."""
    layer = _layer(layer)
    if layer.distribution == "scaled_uniform_orthogonal":
        return scaled_uniform_orthogonal(layer.gain, delta=False)
    if layer.distribution == "orthogonal_delta":
        return scaled_uniform_orthogonal(layer.gain, delta=True)
    if layer.distribution == "gaussian":
        return gaussian(layer.gain)
    raise ValueError(f"unknown distribution {layer.distribution!r} of layer {layer.id!r}")  # pragma: no cover


def bias_initializer_for(layer) -> Initializer:
    """The bias initializer of an answer's layer: zeros (also for ``bias == "none"``, should the
    model have a bias anyway), or ``N(0, bias_variance)`` for ``gaussian``."""
    layer = _layer(layer)
    if layer.bias == "gaussian" and layer.bias_variance > 0:
        return gaussian(math.sqrt(layer.bias_variance))
    return zeros


def _expected_fans(layer: LayerInit, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(fan_in, fan_out) the answer's layer would have on a kernel of this shape (JAX layout)."""
    if len(shape) < 2:
        return None
    if layer.distribution == "orthogonal_delta" and len(shape) > 2:
        return shape[-2], shape[-1]
    return math.prod(shape[:-1]), shape[-1]


# --------------------------------------------------------------------------- params trees


@dataclass(frozen=True)
class ParamChange:
    """One leaf :func:`apply_to_params` replaced."""

    layer_id: str
    path: tuple  # keys from the root of the params tree to the leaf
    role: str  # "kernel" or "bias"
    init: str  # scaled_uniform_orthogonal | orthogonal_delta | gaussian | zeros
    scale: float  # gain on the orthonormal matrix, or the standard deviation (0 for zeros)
    shape: tuple[int, ...]
    dtype: str


@dataclass
class ApplyReport:
    """What :func:`apply_to_params` did, and what it could not match.

    - ``changed``: every replaced leaf;
    - ``not_found``: ``(layer_id, path, why)`` for answer layers whose mapped path is not in the
      tree (or has no kernel there);
    - ``unmapped_layers``: answer layer ids that ``mapping`` does not mention (left untouched);
    - ``unknown_ids``: ``mapping`` keys that are not layer ids of the answer;
    - ``uncovered_kernels``: paths of kernel leaves in the tree that no answer layer initialized;
    - ``shape_mismatches``: ``(layer_id, path, shape, why)`` for kernels whose fan-in / fan-out
      disagree with the answer's layer (left untouched);
    - ``warnings``: anything else worth knowing (a bias the answer's layer does not have, ...).
    """

    changed: list[ParamChange] = field(default_factory=list)
    not_found: list[tuple[str, tuple, str]] = field(default_factory=list)
    unmapped_layers: list[str] = field(default_factory=list)
    unknown_ids: list[str] = field(default_factory=list)
    uncovered_kernels: list[tuple] = field(default_factory=list)
    shape_mismatches: list[tuple[str, tuple, tuple[int, ...], str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every answer layer was applied and every kernel in the tree was covered."""
        return not (self.not_found or self.unmapped_layers or self.unknown_ids
                    or self.uncovered_kernels or self.shape_mismatches)

    def changed_paths(self) -> list[tuple]:
        return [c.path for c in self.changed]

    def __str__(self) -> str:
        lines = [f"{len(self.changed)} param(s) re-initialized"]
        for c in self.changed:
            lines.append(f"  {'/'.join(map(str, c.path))}: {c.init} ({c.scale:.6g}) {c.shape} <- {c.layer_id}")
        for lid, path, why in self.not_found:
            lines.append(f"  not found: layer {lid!r} -> {'/'.join(map(str, path))}: {why}")
        if self.unmapped_layers:
            lines.append(f"  answer layers not in the mapping: {', '.join(self.unmapped_layers)}")
        if self.unknown_ids:
            lines.append(f"  mapping ids that are not answer layers: {', '.join(self.unknown_ids)}")
        for path in self.uncovered_kernels:
            lines.append(f"  kernel not covered: {'/'.join(map(str, path))}")
        for lid, path, shape, why in self.shape_mismatches:
            lines.append(f"  shape mismatch: layer {lid!r} -> {'/'.join(map(str, path))} {shape}: {why}")
        lines.extend(f"  warning: {w}" for w in self.warnings)
        return "\n".join(lines)


_MISSING = object()


def _get(tree, path: tuple):
    node = tree
    for k in path:
        if not isinstance(node, Mapping) or k not in node:
            return _MISSING
        node = node[k]
    return node


def _rebuild(node: Mapping, items: dict):
    """A mapping like ``node`` (same type where it can be built from a dict) holding ``items``."""
    if type(node) is dict:
        return items
    try:
        return type(node)(items)
    except Exception:  # a Mapping type that cannot be built from a dict: fall back to dict
        return items


def _set(tree, path: tuple, value):
    """A new tree equal to ``tree`` with the leaf at ``path`` replaced; ``tree`` is not modified
    (only the mappings along ``path`` are copied, everything else is shared)."""
    if not path:
        return value
    items = dict(tree)
    items[path[0]] = _set(tree[path[0]], path[1:], value)
    return _rebuild(tree, items)


def _resolve(tree, path: PathLike) -> tuple | None:
    """The key tuple ``path`` names in ``tree``, or None.

    A string is one top-level key if the tree has it (Haiku module names contain ``/``), else a
    ``/``-separated path; a tuple or list is a sequence of keys. If the path is not found at the
    root of a Flax variables dict, it is looked for under its ``"params"`` collection.
    """
    if isinstance(path, str):
        candidates = [(path,)]
        if "/" in path:
            candidates.append(tuple(p for p in path.split("/") if p))
    else:
        candidates = [tuple(path)]
    for cand in list(candidates):
        if cand and cand[0] != "params":
            candidates.append(("params",) + cand)
    for cand in candidates:
        if cand and _get(tree, cand) is not _MISSING:
            return cand
    return None


def _leaf_paths(tree, names: Sequence[str], prefix: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            if isinstance(v, Mapping):
                out.extend(_leaf_paths(v, names, prefix + (k,)))
            elif k in names:
                out.append(prefix + (k,))
    return out


def _shape_dtype(leaf) -> tuple[tuple[int, ...], Any]:
    shape = tuple(int(s) for s in np.shape(leaf)) if not hasattr(leaf, "shape") else tuple(int(s) for s in leaf.shape)
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.float32
    return shape, dtype


def apply_to_params(params, solution, mapping: Mapping[str, PathLike] | None, key,
                    *, kernel_names: Sequence[str] = ("kernel", "w"),
                    bias_names: Sequence[str] = ("bias", "b")) -> tuple[Any, ApplyReport]:
    """Re-initialize a params tree from an answer; returns ``(new_params, report)``.

    ``params``: nested mappings of arrays, e.g. Flax's ``{"Dense_0": {"kernel": ..., "bias":
    ...}}`` (a full variables dict ``{"params": {...}}`` works too) or Haiku's ``{"mlp/~/linear_0":
    {"w": ..., "b": ...}}``. Leaves may be arrays or ``jax.ShapeDtypeStruct`` (e.g. from
    ``jax.eval_shape``); new leaves keep each old leaf's shape and (floating) dtype.

    ``mapping``: answer layer id -> path of its module in the tree: a key tuple
    (``("Encoder_0", "Dense_1")``), a ``/``-separated string, or one key (``"Dense_0"``). The
    module's ``kernel`` (or ``w``) gets :func:`initializer_for` the layer, its ``bias`` (or ``b``)
    zeros or ``N(0, bias_variance)``. A path may also name a kernel leaf directly. ``None`` maps
    every layer id to the key of the same name.

    ``key``: a ``jax.random`` key; layer ``i`` of the answer uses ``jax.random.split(key, n)[i]``,
    so the result is a pure function of ``(params shapes, solution, mapping, key)``.

    The input tree is never modified. Kernels whose fan-in / fan-out disagree with the answer's
    layer are left untouched and reported; so are unknown ids, missing paths and kernels of the
    tree that no layer covered (see :class:`ApplyReport`).
    """
    sol = _solution(solution)
    layers = {l.id: l for l in sol.layers}
    if mapping is None:
        mapping = {lid: lid for lid in layers}
    report = ApplyReport()
    report.unknown_ids = [lid for lid in mapping if lid not in layers]
    report.unmapped_layers = [lid for lid in layers if lid not in mapping]

    order = {lid: i for i, lid in enumerate(layers)}
    layer_keys = jax.random.split(key, max(len(layers), 1))
    new = params
    covered: dict[tuple, str] = {}

    for lid, path in mapping.items():
        layer = layers.get(lid)
        if layer is None:
            continue
        resolved = _resolve(params, path)
        shown = tuple(path) if not isinstance(path, str) else tuple(p for p in path.split("/") if p) or (path,)
        if resolved is None:
            report.not_found.append((lid, shown, "no such path in the params tree"))
            continue
        node = _get(params, resolved)
        if isinstance(node, Mapping):
            kname = next((n for n in kernel_names if n in node and not isinstance(node[n], Mapping)), None)
            bname = next((n for n in bias_names if n in node and not isinstance(node[n], Mapping)), None)
            if kname is None:
                report.not_found.append((lid, resolved, f"no kernel ({' / '.join(kernel_names)}) under this path"))
                continue
            kpath = resolved + (kname,)
            bpath = resolved + (bname,) if bname is not None else None
        else:  # the path names the kernel leaf itself
            kpath, bpath = resolved, None
        if kpath in covered:
            report.warnings.append(f"layers {covered[kpath]!r} and {lid!r} map to the same kernel "
                                   f"{'/'.join(map(str, kpath))}; the later one ({lid!r}) wins")
        shape, dtype = _shape_dtype(_get(params, kpath))
        fans = _expected_fans(layer, shape)
        if fans is None or fans != (layer.fan_in, layer.fan_out):
            got = "a kernel of rank < 2" if fans is None else f"fan_in {fans[0]}, fan_out {fans[1]}"
            report.shape_mismatches.append((lid, kpath, shape,
                                            f"the answer's layer has fan_in {layer.fan_in}, fan_out "
                                            f"{layer.fan_out} ({layer.distribution}); the kernel gives {got}"))
            continue
        if layer.kernel is not None and len(shape) > 2 and tuple(shape[:-2]) != tuple(layer.kernel):
            report.warnings.append(f"layer {lid!r}: kernel {list(shape[:-2])} in the tree, "
                                   f"{layer.kernel} in the graph")
        kkey, bkey = jax.random.split(layer_keys[order[lid]])
        try:
            kernel = initializer_for(layer)(kkey, shape, dtype)
        except ValueError as exc:  # e.g. Orthogonal Delta of an even-sized kernel
            report.shape_mismatches.append((lid, kpath, shape, str(exc)))
            continue
        new = _set(new, kpath, kernel)
        covered[kpath] = lid
        report.changed.append(ParamChange(lid, kpath, "kernel", layer.distribution, float(layer.gain),
                                          shape, jnp.dtype(dtype).name))
        if bpath is not None:
            bshape, bdtype = _shape_dtype(_get(params, bpath))
            if layer.bias == "none":
                report.warnings.append(f"layer {lid!r} has no bias in the graph but "
                                       f"{'/'.join(map(str, bpath))} exists; set to zeros")
            bias = bias_initializer_for(layer)(bkey, bshape, bdtype)
            gaussian_bias = layer.bias == "gaussian" and layer.bias_variance > 0
            new = _set(new, bpath, bias)
            report.changed.append(ParamChange(
                lid, bpath, "bias", "gaussian" if gaussian_bias else "zeros",
                math.sqrt(layer.bias_variance) if gaussian_bias else 0.0, bshape, jnp.dtype(bdtype).name))
        elif layer.bias == "gaussian" and layer.bias_variance > 0:
            report.warnings.append(f"layer {lid!r} asks for N(0, {layer.bias_variance:g}) biases but the "
                                   f"params tree has none at {'/'.join(map(str, resolved))}")

    report.uncovered_kernels = [p for p in _leaf_paths(params, tuple(kernel_names)) if p not in covered]
    return new, report
