"""Applying an answer to a Keras model: a clone with transformed activations, normalized sums and
re-initialized layers.

:func:`apply` never touches the model it is given: it clones it (``keras.models.clone_model``),
swapping each activation layer for an ``Activation`` of the answer's :class:`TransformedActivation`
(same name), each fused ``activation=`` of a Dense/Conv layer for the same, and each plain ``Add``
(or ``x + y``) for a :class:`WeightedSum` with the graph's weights; it copies every weight of the
model into the clone and re-initializes the layers the answer lists. Sums the model already scales
(``Rescaling``, ``0.8 * x``) compute the graph's weights as they are and are left alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import keras
import numpy as np

from ...schemas.activations import canonical_name
from ...schemas.solve import LayerInit, Solution
from .. import adapters
from ..solution import as_solution
from .extraction import Extraction, extract
from .layers import TransformedActivation, WeightedSum

__all__ = ["apply", "ApplyReport", "kernel_init"]


class ApplyReport(adapters.ApplyReport):
    """What :func:`apply` changed and what it could not do. ``model`` is the solved clone; each
    change is a line: ``"<id>: <was> -> <now>"``, ``"<id>: <distribution>, gain g, bias b"``."""


def _uniform_orthogonal(rng: np.random.Generator, n_rows: int, n_cols: int) -> np.ndarray:
    """Haar-uniform ``n_rows x n_cols`` matrix with orthonormal rows or columns: QR of a Gaussian
    matrix with the signs fixed by diag(R) (TAT paper, arXiv:2203.08120, Appendix D; as the JAX
    adapter and dks sample it)."""
    big, small = max(n_rows, n_cols), min(n_rows, n_cols)
    q, r = np.linalg.qr(rng.standard_normal((big, small)))
    q = q * np.sign(np.diag(r))
    return q.T if n_rows < n_cols else q


def kernel_init(layer: LayerInit, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """An answer layer's kernel in Keras's layout (``[in, out]``, conv ``[*spatial, in, out]``).

    ``orthogonal_delta``: zero except the centre tap, an ``[in, out]`` scaled uniform orthogonal
    matrix (spatial sizes must be odd); ``scaled_uniform_orthogonal``: one ``[prod(spatial) * in,
    out]`` such matrix; ``gaussian``: N(0, gain^2). ``gain`` already holds the scale correction."""
    shape = tuple(int(s) for s in shape)
    if layer.distribution == "gaussian":
        return layer.gain * rng.standard_normal(shape)
    delta = layer.distribution == "orthogonal_delta" and len(shape) > 2
    spatial = shape[:-2] if delta else ()
    if any(s % 2 != 1 for s in spatial):
        raise ValueError(f"Orthogonal Delta of '{layer.id}' needs odd kernel sizes, got {list(spatial)}")
    n_in, n_out = (shape[-2] if delta else math.prod(shape[:-1])), shape[-1]
    mat = layer.gain * _uniform_orthogonal(rng, n_out, n_in).T  # in x out
    if not delta:
        return mat.reshape(shape)
    out = np.zeros(shape)
    out[tuple((s - 1) // 2 for s in spatial)] = mat
    return out


def _fans(layer: LayerInit, shape: tuple[int, ...]) -> tuple[int, int]:
    if layer.distribution == "orthogonal_delta" and len(shape) > 2:
        return shape[-2], shape[-1]
    return math.prod(shape[:-1]), shape[-1]


def _activations(ext: Extraction, sol: Solution, solved: dict) -> dict[str, TransformedActivation]:
    """Graph id of every activation -> its transformed activation (per function in a mixed answer)."""
    out = {}
    for gid, e in ext.entries.items():
        if e.op != "activation":
            continue
        fn = solved.get(gid, {}).get("fn") or (e.fn if sol.activations else None)
        own = sol.for_function(fn) if fn else sol
        defaults = e.fn_params if e.fn == canonical_name(own.activation) else {}
        out[gid] = TransformedActivation.from_solution(own, defaults)
    return out


def _sum_weights(wire: dict, scale: float = 1.0) -> list[float]:
    """A sum node's weights (the normalized default where it names none), times ``scale``: the answer's
    ``sum_scales`` factor for a sum that an atom reaches through several paths (contract section 1)."""
    n = len(wire.get("inputs", []))
    return [scale * float(x) for x in (wire.get("weights") or [1.0 / math.sqrt(n)] * n)]


def _refuse_multipliers(sol: Solution) -> None:
    alphas = [lay.id for lay in sol.layers if lay.alpha is not None and lay.alpha != 1.0]
    beta = sol.trainable is not None and sol.trainable.residual_beta is not None
    if alphas or (sol.logits_scale is not None and sol.logits_scale != 1.0) or beta:
        what = "residual beta sums" if beta else "the geometric multipliers alpha / logits_scale"
        raise ValueError(
            f"the Keras adapter does not insert {what} yet; apply the answer with the torch adapter, or insert "
            "them by hand (a Rescaling after each layer the answer gives an alpha)"
        )


def apply(model, solution, *, graph: Mapping | None = None, seed: int | None = None) -> ApplyReport:
    """A clone of ``model`` (Sequential or Functional) solved as ``solution`` says; ``report.model``.

    ``solution`` is an answer of ``POST /v1/solve`` for ``graph_from_keras(model)`` (a ``Solution``,
    its JSON or dict); ``graph`` is the graph that was solved (its sum weights are used; default:
    extracted again); ``seed`` makes the re-initialization reproducible. The clone's activations
    compute the answer's transformed activation, its plain adds the normalized sum (times the answer's
    ``sum_scales`` where it has one), and every layer the answer lists has its kernel and bias
    re-initialized (scale-corrected uniform orthogonal, Orthogonal Delta for convolutions, or
    Gaussian; biases zero or Gaussian); every other weight is copied from ``model``. Geometric
    multipliers and residual betas are refused (ValueError).
    """
    sol = as_solution(solution)
    _refuse_multipliers(sol)
    ext = extract(model)
    report = ApplyReport(model=None, method=sol.method, activation=sol.activation)
    solved = {nd["id"]: nd for nd in (dict(graph) if graph is not None else ext.graph).get("nodes", [])}
    if graph is not None and set(solved) != set(ext.entries):
        report.warnings.append(
            "the graph passed to apply has other ids than the model's: "
            + ", ".join(sorted(set(solved) ^ set(ext.entries))[:10])
        )
    acts = _activations(ext, sol, solved)
    scales = sol.sum_scales or {}
    ext_nodes = {nd["id"]: nd for nd in ext.graph["nodes"]}
    by_layer: dict[int, list] = {}  # id(layer) -> its entries
    for e in ext.entries.values():
        if e.layer is not None:
            by_layer.setdefault(id(e.layer), []).append(e)

    def clone(layer):
        entries = by_layer.get(id(layer), [])
        fused = next((e for e in entries if e.kind == "fused"), None)
        standalone = next((e for e in entries if e.op == "activation" and e.kind == "layer"), None)
        plain = next((e for e in entries if e.op == "sum" and e.plain), None)
        if standalone is not None:
            new = acts[standalone.gid]
            report.activations.append(f"{standalone.gid}: {type(layer).__name__} -> {new!r}")
            return keras.layers.Activation(new, name=layer.name)
        if plain is not None:
            w = _sum_weights(solved.get(plain.gid, ext_nodes[plain.gid]), scales.get(plain.gid, 1.0))
            source = " (graph x sum_scales)" if plain.gid in scales else ""
            report.sums.append(f"{plain.gid}: {type(layer).__name__} -> WeightedSum {[round(x, 6) for x in w]}{source}")
            return WeightedSum(w, name=layer.name)
        config = layer.get_config()
        if fused is not None:
            new = acts[fused.gid]
            report.activations.append(f"{fused.gid}: {type(layer).__name__}'s activation -> {new!r}")
            config["activation"] = new
        return layer.__class__.from_config(config)

    for e in ext.entries.values():
        if e.op == "sum" and not e.plain:
            want = _sum_weights(solved.get(e.gid, ext_nodes[e.gid]), scales.get(e.gid, 1.0))
            has = _sum_weights(ext_nodes[e.gid])
            if len(want) != len(has) or any(abs(a - b) > 1e-6 for a, b in zip(want, has, strict=False)):
                report.warnings.append(
                    f"sum '{e.gid}': the model's scalings weight its inputs {has}, the solved graph {want}; left "
                    "as the model computes it"
                )
    kwargs = {}
    if not isinstance(model, keras.Sequential):  # keep the input's name, so the clone's graph has the same ids
        t = model.inputs[0]
        new_input = keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t._keras_history[0].name)
        kwargs["input_tensors"] = [new_input] if isinstance(model.input, (list, tuple)) else new_input
    new_model = keras.models.clone_model(model, clone_function=clone, recursive=True, **kwargs)
    _copy_weights(model, new_model)
    _init_layers(ext, sol, new_model, report, np.random.default_rng(seed))
    _reset_norms(ext, new_model, report)
    report.model = new_model
    if sol.method in ("tat", "dks", "eoc", "sparse_eoc"):
        q = sol.q_star if sol.q_star is not None else 1.0
        report.notes.append(f"the kernel analysis assumes inputs with mean squared value q = {q:.6g} per example")
    report.notes.extend(f"answer warning: {w}" for w in sol.warnings)
    return report


def _layers(model) -> list:
    """Every layer of ``model``, those of nested models included."""
    return [x for x in model._flatten_layers(include_self=False, recursive=True) if not isinstance(x, keras.Model)]


def _copy_weights(model, new_model) -> None:
    old = {layer.name: layer for layer in _layers(model)}
    for layer in _layers(new_model):
        src = old.get(layer.name)
        if src is not None and src.weights and len(src.weights) == len(layer.weights):
            layer.set_weights(src.get_weights())


def _reset_norms(ext: Extraction, new_model, report: ApplyReport) -> None:
    """RMSNormalization scales at 1: what the answer's ``rms_norm`` nodes are (products have no weights)."""
    layers = {layer.name: layer for layer in _layers(new_model)}
    for e in ext.entries.values():
        target = layers.get(getattr(e.layer, "name", None)) if e.op == "rms_norm" else None
        scale = getattr(target, "scale", None)
        if scale is not None and hasattr(scale, "assign"):
            scale.assign(np.ones(tuple(scale.shape), dtype=scale.dtype))
            report.notes.append(f"rms_norm '{e.gid}': scale reset to 1")


def _init_layers(ext: Extraction, sol: Solution, new_model, report: ApplyReport, rng) -> None:
    layers = {layer.name: layer for layer in _layers(new_model)}
    done: set[str] = set()
    for lay in sol.layers:
        e = ext.entries.get(lay.id)
        target = layers.get(e.layer.name) if e is not None and e.layer is not None else None
        kernel = getattr(target, "kernel", None)
        if e is None or e.op not in ("dense", "conv") or kernel is None:
            report.missing_layers.append(lay.id)
            report.warnings.append(f"answer layer '{lay.id}' ({lay.op}) has no Dense/Conv layer in the model")
            continue
        shape = tuple(int(s) for s in kernel.shape)
        if _fans(lay, shape) != (lay.fan_in, lay.fan_out):
            report.missing_layers.append(lay.id)
            report.warnings.append(
                f"answer layer '{lay.id}' has fan-in/out {lay.fan_in}/{lay.fan_out} but its kernel is {list(shape)}"
            )
            continue
        if target.name in done:
            report.warnings.append(f"layer '{target.name}' is shared: initialized once, as its first call")
            continue
        kernel.assign(kernel_init(lay, shape, rng).astype(kernel.dtype))
        bias = getattr(target, "bias", None)
        if bias is None:
            b = "none"
        elif lay.bias == "gaussian" and lay.bias_variance > 0:
            bias.assign((math.sqrt(lay.bias_variance) * rng.standard_normal(tuple(bias.shape))).astype(bias.dtype))
            b = "gaussian"
        else:
            bias.assign(np.zeros(tuple(bias.shape), dtype=bias.dtype))
            b = "zeros"
        done.add(target.name)
        report.layers.append(f"{lay.id}: {lay.distribution}, gain {lay.gain:.6g}, bias {b}")
    for layer in _layers(new_model):
        if getattr(layer, "kernel", None) is not None and layer.name not in done:
            report.uninitialized.append(f"{layer.name} ({type(layer).__name__}): a kernel the answer does not list")
    if report.uninitialized:
        report.warnings.append("layers left as they were: " + "; ".join(report.uninitialized[:10]))
