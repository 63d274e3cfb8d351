"""JAX adapter: use a sigprop answer (``POST /v1/solve``) in a JAX / Flax / Haiku model.

Three things an answer tells a model, each usable on its own:

- :func:`transformed_activation` -- the activation to use, as a jax-traceable function
  ``phi_hat(x) = output_scale * (phi(input_scale * x + input_shift) + output_shift)`` (the dks
  convention of the contract), ``phi`` written exactly as the engine defines it, for every
  activation of the catalogue (``sigprop.schemas.activations``), including ``negative_slope`` of
  ``leaky_relu`` and the threshold ``tau`` / clip ``m`` of the sparsifying activations.
- Initializers with the Flax / Haiku / ``jax.nn.initializers`` signature
  ``init(key, shape, dtype=jnp.float32)``: :func:`scaled_uniform_orthogonal` (with Orthogonal
  Delta for conv kernels), :func:`gaussian`, and :func:`initializer_for` /
  :func:`bias_initializer_for`, which pick the one an answer's ``layers[]`` entry asks for.
- :func:`apply_to_params` -- re-initialize an existing params tree (nested dicts, Flax or Haiku
  style) from an answer, given which param path each answer layer id is, and report what changed
  and what was not covered; with a Flax ``module`` and an ``example_input`` it also measures the
  ops the answer cannot predict (max pooling, ...) and rescales the layers around them
  (``sigprop.client.calibration``).

- :func:`graph_from_flax` -- the graph of a ``flax.linen`` module and the answer-id -> params-path
  mapping that :func:`apply_to_params` takes (``extraction``: read off the jaxpr); and
  :func:`diagnose`, per-node q and c of the applied Flax model against the answer.

Layouts are JAX's: dense kernels ``[in, out]``, conv kernels ``[kh, kw, in, out]`` (any number
of spatial axes first, input and output channels last), as in ``flax.linen.Dense`` / ``Conv`` and
``haiku.Linear`` / ``Conv2D``. Nothing here imports flax or haiku (``graph_from_flax`` takes a
Flax module but only calls its ``init`` / ``apply``).

jax is an optional dependency: ``pip install 'sigprop[jax]'``.
"""

from __future__ import annotations

try:
    import jax
    import jax.numpy as jnp
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("sigprop.client.jax needs JAX, which is not installed: pip install 'sigprop[jax]'") from _exc

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sigprop.schemas import LayerInit
from sigprop.schemas.activations import CATALOGUE

__all__ = [
    "ACTIVATIONS",
    "Initializer",
    "ParamChange",
    "ApplyReport",
    "NothingApplied",
    "activation_fn",
    "transformed_activation",
    "sum_weights",
    "scaled_uniform_orthogonal",
    "gaussian",
    "zeros",
    "initializer_for",
    "bias_initializer_for",
    "apply_to_params",
    "graph_from_flax",
    "diagnose",
    "input_pair",
]

from ..solution import as_solution, tailoring  # noqa: E402 - after the JAX import check above
from .activations import (  # noqa: E402 - after the JAX import check above
    ACTIVATIONS,
    _as_float_array,
    _canonical,
    activation_fn,
)
from .fused import Columns  # noqa: E402
from .initializers import (  # noqa: E402 - after the JAX import check above
    Initializer,
    _expected_fans,
    bias_initializer_for,
    gaussian,
    initializer_for,
    scaled_uniform_orthogonal,
    zeros,
)
from .shaping import COLLECTION, answer_attention, install_answer_attention  # noqa: E402
from .trees import _MISSING, _get, _set  # noqa: E402 - after the JAX import check above

PathLike = str | Sequence[Any]

# --------------------------------------------------------------------------- activations
# (the catalogue's phi in ``activations``; re-exported here, where users import them)


def transformed_activation(solution, name: str | None = None) -> Callable[[jax.Array], jax.Array]:
    """``phi_hat(x) = output_scale * (phi(input_scale * x + input_shift) + output_shift)``.

    ``solution``: the answer (a :class:`sigprop.schemas.Solution`, its JSON text or dict).
    ``phi`` is the answer's ``activation`` (or ``name``, to use another activation with the
    answer's parameters), built with the answer's ``negative_slope`` / ``tau`` / ``m``; absent
    transformation parameters are the identity (scale 1, shift 0), so for an Edge-of-Chaos or
    geometric answer this is plain ``phi``. The result is a pure function of an array: use it
    under ``jax.jit``, ``jax.grad``, ``jax.vmap``. Computation stays in the input's dtype.
    """
    sol = as_solution(solution)
    sol = sol.for_function(name) if name is not None else sol  # a mixed graph's answer: that function's entry
    act_name = name if name is not None else sol.activation
    key = _canonical(act_name)
    defaults = CATALOGUE[key].defaults
    given = {"negative_slope": sol.negative_slope, "tau": sol.tau, "m": sol.m}
    phi = activation_fn(key, **{k: v for k, v in given.items() if k in defaults})

    a, b, c, d = tailoring(sol)

    def phi_hat(x):
        return c * (phi(a * _as_float_array(x) + b) + d)

    phi_hat.__name__ = f"transformed_{key}"
    phi_hat.__doc__ = f"{c!r} * ({key}({a!r} * x + {b!r}) + {d!r})"
    return phi_hat


def transformed_activations(solution, graph: Mapping) -> dict[str, Callable[[jax.Array], jax.Array]]:
    """Graph id -> phi_hat of that activation node (its ``fn``'s entry in ``Solution.activations``, else the top)."""
    sol = as_solution(solution)
    fns = {nd["id"]: nd.get("fn") or sol.activation for nd in graph["nodes"] if nd["op"] == "activation"}
    return {gid: transformed_activation(sol, fn) for gid, fn in fns.items()}


def sum_weights(solution, graph: Mapping) -> dict[str, list[float]]:
    """Sum id -> the weights the answer's network uses there: the graph's (1/sqrt(n) each when it
    gives none) times the answer's ``sum_scales`` factor, which renormalizes a sum that an atom
    reaches through several paths. A JAX model computes its sums in its own code, so it reads them
    here (PyTorch's ``apply`` rewrites the adds itself)."""
    sol = as_solution(solution)
    scales = sol.sum_scales or {}
    out = {}
    for nd in graph["nodes"]:
        if nd["op"] == "sum":
            n = len(nd["inputs"])
            ws = nd.get("weights") or [1.0 / math.sqrt(n)] * n
            out[nd["id"]] = [scales.get(nd["id"], 1.0) * float(w) for w in ws]
    return out


# --------------------------------------------------------------------------- initializers
# (in ``initializers``; re-exported here, where users import them)

# --------------------------------------------------------------------------- params trees


@dataclass(frozen=True)
class ParamChange:
    """One leaf :func:`apply_to_params` replaced."""

    layer_id: str
    path: tuple  # keys from the root of the params tree to the leaf
    role: str  # "kernel", "bias", "attention" (a ShapedAttention's matrix at init) or "layer_norm" (its affine)
    init: str  # scaled_uniform_orthogonal | orthogonal_delta | gaussian | zeros | an attention generator's form
    scale: float  # gain on the orthonormal matrix, or the standard deviation (0 for zeros); attention: max of D
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
    - ``warnings``: anything else worth knowing (a bias the answer's layer does not have, ...);
    - ``calibrations``: the ops measured on ``example_input`` and the factor each got
      (:class:`sigprop.client.calibration.Calibration`; pass them to :func:`diagnose`).
    """

    changed: list[ParamChange] = field(default_factory=list)
    not_found: list[tuple[str, tuple, str]] = field(default_factory=list)
    unmapped_layers: list[str] = field(default_factory=list)
    unknown_ids: list[str] = field(default_factory=list)
    uncovered_kernels: list[tuple] = field(default_factory=list)
    shape_mismatches: list[tuple[str, tuple, tuple[int, ...], str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    calibrations: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every answer layer was applied and every kernel in the tree was covered."""
        return not (
            self.not_found
            or self.unmapped_layers
            or self.unknown_ids
            or self.uncovered_kernels
            or self.shape_mismatches
        )

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
        lines.extend(f"  calibrated {c.describe()}" for c in self.calibrations)
        lines.extend(f"  warning: {w}" for w in self.warnings)
        return "\n".join(lines)


class NothingApplied(ValueError):
    """:func:`apply_to_params` would change no leaf: nothing in ``mapping`` matched a kernel it
    could initialize. ``report`` is the :class:`ApplyReport`; the message names what matched nothing."""

    def __init__(self, report: ApplyReport, n_layers: int, n_mapped: int):
        self.report = report
        super().__init__("apply_to_params changed nothing: " + "; ".join(_nothing_reasons(report, n_layers, n_mapped)))


def _nothing_reasons(report: ApplyReport, n_layers: int, n_mapped: int) -> list[str]:
    """Why no leaf changed, most telling first."""

    def shown(ids) -> str:
        ids = list(ids)
        return ", ".join(map(repr, ids[:8])) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")

    reasons = []
    if n_layers == 0:
        reasons.append("the answer lists no layers")
    if n_mapped == 0:
        reasons.append("the mapping is empty")
    if report.unknown_ids:
        reasons.append(f"mapping ids that are not layers of the answer: {shown(report.unknown_ids)}")
    if report.not_found:
        found = [f"{lid} -> {'/'.join(map(str, path))} ({why})" for lid, path, why in report.not_found]
        reasons.append(f"paths that name no kernel in the params tree: {shown(found)}")
    if report.shape_mismatches:
        bad = [f"{lid} -> {'/'.join(map(str, path))} {list(shape)}" for lid, path, shape, _ in report.shape_mismatches]
        reasons.append(f"kernels whose shape disagrees with the answer's layer: {shown(bad)}")
    if report.unmapped_layers and n_mapped:
        reasons.append(f"answer layers the mapping does not name: {shown(report.unmapped_layers)}")
    return reasons or ["no mapped layer reached a kernel"]


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


def _kernel_and_bias(
    params, lid: str, path: PathLike, kernel_names: Sequence[str], bias_names: Sequence[str], report: ApplyReport
) -> tuple[tuple, tuple, tuple | None] | None:
    """(module path, kernel path, bias path or None) that answer layer ``lid``'s ``path`` names in the
    tree; None, with the reason in the report, where it names no kernel."""
    resolved = _resolve(params, path)
    shown = tuple(path) if not isinstance(path, str) else tuple(p for p in path.split("/") if p) or (path,)
    if resolved is None:
        report.not_found.append((lid, shown, "no such path in the params tree"))
        return None
    node = _get(params, resolved)
    if not isinstance(node, Mapping):  # the path names the kernel leaf itself
        return resolved, resolved, None
    kname = next((n for n in kernel_names if n in node and not isinstance(node[n], Mapping)), None)
    bname = next((n for n in bias_names if n in node and not isinstance(node[n], Mapping)), None)
    if kname is None:
        report.not_found.append((lid, resolved, f"no kernel ({' / '.join(kernel_names)}) under this path"))
        return None
    return resolved, resolved + (kname,), resolved + (bname,) if bname is not None else None


def _set_bias(new, params, layer: LayerInit, resolved: tuple, bpath: tuple | None, key, report: ApplyReport):
    """``new`` with the layer's bias initialized at ``bpath`` (or a warning where the tree has none)."""
    lid = layer.id
    if bpath is None:
        if layer.bias == "gaussian" and layer.bias_variance > 0:
            report.warnings.append(
                f"layer {lid!r} asks for N(0, {layer.bias_variance:g}) biases but the "
                f"params tree has none at {'/'.join(map(str, resolved))}"
            )
        return new
    bshape, bdtype = _shape_dtype(_get(params, bpath))
    if layer.bias == "none":
        report.warnings.append(
            f"layer {lid!r} has no bias in the graph but {'/'.join(map(str, bpath))} exists; set to zeros"
        )
    bias = bias_initializer_for(layer)(key, bshape, bdtype)
    gaussian_bias = layer.bias == "gaussian" and layer.bias_variance > 0
    report.changed.append(
        ParamChange(
            lid,
            bpath,
            "bias",
            "gaussian" if gaussian_bias else "zeros",
            math.sqrt(layer.bias_variance) if gaussian_bias else 0.0,
            bshape,
            jnp.dtype(bdtype).name,
        )
    )
    return _set(new, bpath, bias)


def _fans_agree(layer: LayerInit, lid: str, kpath: tuple, shape: tuple[int, ...], report: ApplyReport) -> bool:
    """Whether the tree's kernel has the answer's fan-in and fan-out (else reported as a mismatch)."""
    fans = _expected_fans(layer, shape)
    if fans is None or fans != (layer.fan_in, layer.fan_out):
        got = "a kernel of rank < 2" if fans is None else f"fan_in {fans[0]}, fan_out {fans[1]}"
        report.shape_mismatches.append(
            (
                lid,
                kpath,
                shape,
                f"the answer's layer has fan_in {layer.fan_in}, fan_out "
                f"{layer.fan_out} ({layer.distribution}); the kernel gives {got}",
            )
        )
        return False
    if layer.kernel is not None and len(shape) > 2 and tuple(shape[:-2]) != tuple(layer.kernel):
        report.warnings.append(f"layer {lid!r}: kernel {list(shape[:-2])} in the tree, {layer.kernel} in the graph")
    return True


def apply_to_params(
    params,
    solution,
    mapping: Mapping[str, PathLike] | None,
    key,
    *,
    kernel_names: Sequence[str] = ("kernel", "w"),
    bias_names: Sequence[str] = ("bias", "b"),
    module=None,
    example_input=None,
) -> tuple[Any, ApplyReport]:
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
    tree that no layer covered (see :class:`ApplyReport`). When nothing at all would change (every
    mapped id unknown, every path missing or mismatched, an empty mapping), it raises
    :class:`NothingApplied` naming what matched nothing: returning the untouched tree with a report
    nobody reads would leave the model at its old initialization without a word.

    A sequence model's answer (``attention``) also shapes each attention node the mapping names
    (``graph_from_flax`` maps it to its ``ShapedAttention`` module): its generator's matrix at
    initialization goes into that module's ``"shaping"`` variables (``sigprop.client.jax.shaping``),
    so pass the whole variables dict; query kernels get the answer's zeros like any other layer, and
    the LayerNorms the mapping names (``layer_norm`` nodes) get scale 1 and bias 0.

    ``module`` and ``example_input`` (the ``flax.linen`` module as it will run, with the answer's
    :func:`transformed_activation`, and one batch, ``[B, F]`` or NHWC): with both, the ops whose
    effect on q the answer cannot predict (max pooling and the activations reading it, average
    pooling of locations that differ, the nodes the answer names as outside its predictions;
    ``sigprop.client.calibration``) are measured on the batch and brought to the q the answer
    predicts, by a factor on the kernel of the layer(s) that read them, else on the kernel and bias
    of the layer that feeds them (pooling). JAX code cannot be rewritten: a node neither can take
    is reported in ``warnings`` with its factor. ``report.calibrations`` lists each one.
    """
    sol = as_solution(solution)
    layers = {layer.id: layer for layer in sol.layers}
    generators = answer_attention(sol)  # attention node -> its matrix at init (sequence models)
    if mapping is None:
        mapping = {lid: lid for lid in [*layers, *generators]}
    report = ApplyReport()
    known = {*layers, *generators}
    report.unknown_ids = [lid for lid in mapping if lid not in known and _layer_norm_path(params, mapping[lid]) is None]
    report.unmapped_layers = [lid for lid in [*layers, *generators] if lid not in mapping]

    order = {lid: i for i, lid in enumerate(layers)}
    layer_keys = jax.random.split(key, max(len(layers), 1))
    new = params
    covered: dict[tuple, str] = {}

    for lid, path in mapping.items():
        layer = layers.get(lid)
        if layer is None:
            continue
        if isinstance(path, Columns):  # a block of a fused qkv Dense (fused.py)
            names = (tuple(kernel_names), tuple(bias_names))
            new = _apply_columns(new, params, layer, lid, path, names, layer_keys[order[lid]], report, covered)
            continue
        paths = _kernel_and_bias(params, lid, path, kernel_names, bias_names, report)
        if paths is None:
            continue
        resolved, kpath, bpath = paths
        if kpath in covered:
            report.warnings.append(
                f"layers {covered[kpath]!r} and {lid!r} map to the same kernel "
                f"{'/'.join(map(str, kpath))}; the later one ({lid!r}) wins"
            )
        shape, dtype = _shape_dtype(_get(params, kpath))
        if not _fans_agree(layer, lid, kpath, shape, report):
            continue
        kkey, bkey = jax.random.split(layer_keys[order[lid]])
        try:
            kernel = initializer_for(layer)(kkey, shape, dtype)
        except ValueError as exc:  # e.g. Orthogonal Delta of an even-sized kernel
            report.shape_mismatches.append((lid, kpath, shape, str(exc)))
            continue
        new = _set(new, kpath, kernel)
        covered[kpath] = lid
        report.changed.append(
            ParamChange(lid, kpath, "kernel", layer.distribution, float(layer.gain), shape, jnp.dtype(dtype).name)
        )
        new = _set_bias(new, params, layer, resolved, bpath, bkey, report)

    new = _install_attention(new, generators, mapping, report)
    new = _reset_layer_norms(new, params, mapping, report)
    report.uncovered_kernels = [p for p in _leaf_paths(params, tuple(kernel_names)) if p not in covered]
    if sol.sum_scales:
        report.warnings.append(
            f"the answer rescales the weights of sum(s) {', '.join(sorted(sol.sum_scales))} (shared atoms: "
            "sum_scales); params hold no sum weights, so multiply those sums in the model by what "
            "sum_weights(solution, graph) gives"
        )
    if not report.changed:
        raise NothingApplied(report, len(layers), len(mapping))
    if module is not None and example_input is not None and np.ndim(example_input) == 3:
        report.warnings.append("no calibration for sequence models: their graphs have no op it measures")
    elif module is not None and example_input is not None:
        from .calibration import calibrate_params

        new, report.calibrations, notes = calibrate_params(module, new, sol, example_input, kernel_names, bias_names)
        report.warnings.extend(notes)
    return new, report


def _install_attention(tree, generators: Mapping[str, dict], mapping: Mapping, report: ApplyReport):
    """``tree`` with the answer's attention matrices at init installed in the mapped ShapedAttention
    modules' ``"shaping"`` variables (``shaping``); one ``attention`` change per node, whose
    ``scale`` is the largest entry of the rescaling D (1 for Value-SkipInit and shaped attention)."""
    if not generators:
        return tree
    new, installed, not_found, notes = install_answer_attention(tree, generators, mapping)
    for gid, path, init in installed:
        shape = tuple(int(s) for s in init.bias.shape)
        form = generators[gid].get("form", "")
        scale = float(np.max(init.scale)) if form == "cholesky_ratio" else 1.0
        report.changed.append(ParamChange(gid, (COLLECTION,) + path, "attention", form, scale, shape, "float32"))
    report.not_found.extend(not_found)
    report.warnings.extend(notes)
    return new


def _layer_norm_path(tree, path: PathLike) -> tuple | None:
    """The resolved path of a layer norm's params (a ``scale`` leaf, no kernel) that ``path`` names, or None."""
    resolved = _resolve(tree, path)
    node = _get(tree, resolved) if resolved is not None else None
    if isinstance(node, Mapping) and "scale" in node and "kernel" not in node and "w" not in node:
        return resolved
    return None


def _reset_layer_norms(tree, params, mapping: Mapping, report: ApplyReport):
    """``tree`` with every mapped layer norm's affine the identity (scale 1, bias 0): the answer's
    ``layer_norm`` nodes normalize only (``graph_from_flax`` maps them to their LayerNorm modules)."""
    for lid, path in mapping.items():
        if any(c.layer_id == lid for c in report.changed):
            continue
        resolved = _layer_norm_path(params, path)
        if resolved is None:
            continue
        for name, fill in (("scale", 1.0), ("bias", 0.0)):
            leaf = _get(params, resolved + (name,))
            if leaf is _MISSING or isinstance(leaf, Mapping):
                continue
            shape, dtype = _shape_dtype(leaf)
            tree = _set(tree, resolved + (name,), jnp.full(shape, fill, dtype))
            report.changed.append(
                ParamChange(lid, resolved + (name,), "layer_norm", "ones" if fill else "zeros", fill, shape,
                            jnp.dtype(dtype).name)
            )  # fmt: skip
    return tree


# Flax extraction and diagnostics live in ``extraction`` (re-exported here)
from .diagnose import diagnose, input_pair  # noqa: E402
from .extraction import graph_from_flax  # noqa: E402


def _apply_columns(new, params, layer, lid: str, cols: Columns, names: tuple, key, report, covered: dict):
    """``new`` with columns ``lo:hi`` of the mapped kernel (and its bias) initialized by ``layer``."""
    import jax
    import jax.numpy as jnp

    from .initializers import bias_initializer_for, initializer_for

    paths = _kernel_and_bias(params, lid, cols.path, names[0], names[1], report)
    if paths is None:
        return new
    _, kpath, bpath = paths
    shape, dtype = _shape_dtype(_get(params, kpath))
    block = (*shape[:-1], cols.hi - cols.lo)
    if cols.hi > shape[-1] or not _fans_agree(layer, lid, kpath, block, report):
        return new
    kkey, bkey = jax.random.split(key)
    old = _get(new, kpath)
    base = jnp.zeros(shape, dtype) if isinstance(old, jax.ShapeDtypeStruct) else jnp.asarray(old)
    new = _set(new, kpath, base.at[..., cols.lo : cols.hi].set(initializer_for(layer)(kkey, block, dtype)))
    covered[kpath] = lid
    report.changed.append(
        ParamChange(lid, kpath, "kernel", layer.distribution, float(layer.gain), block, jnp.dtype(dtype).name)
    )
    if bpath is not None:
        bshape, bdtype = _shape_dtype(_get(params, bpath))
        old = _get(new, bpath)
        base = jnp.zeros(bshape, bdtype) if isinstance(old, jax.ShapeDtypeStruct) else jnp.asarray(old)
        bias = bias_initializer_for(layer)(bkey, (cols.hi - cols.lo,), bdtype)
        new = _set(new, bpath, base.at[cols.lo : cols.hi].set(bias))
        gaussian = layer.bias == "gaussian" and layer.bias_variance > 0
        scale = float(np.sqrt(layer.bias_variance)) if gaussian else 0.0
        report.changed.append(
            ParamChange(lid, bpath, "bias", "gaussian" if gaussian else "zeros", scale, (cols.hi - cols.lo,), "float32")
        )
    return new
