"""Per-node q and c of an applied Keras model, measured against what the answer predicts.

:func:`diagnose` re-extracts the model, runs its graph of layer calls once on a pair of inputs at a
known cosine (as Keras runs a Functional model, keeping every node's value, and the pre-activation
of a Dense/Conv layer with a fused activation), and compares with
:func:`sigprop.client.diagnosis.predict` (the answer's maps composed along the graph).
"""

from __future__ import annotations

import math

import keras
import numpy as np

from ..diagnosis import SHOWN_OPS, Diagnosis, LayerDiagnosis, interpolate, pair_c, predict
from ..solution import as_solution
from .extraction import extract

__all__ = ["diagnose", "input_pair"]

# the partner draw is offset from the caller's seed, so it is never the stream apply(seed=s) drew
# the first layer's weights from (which would correlate the pair with those weights)
_PAIR_SEED_OFFSET = 0x51D1A6


def input_pair(example_input, input_c: float, *, same_locations: bool = False, seed: int = 0):
    """Two float32 batches ``(x1, x2)`` (numpy, channels last) with q = 1 and cosine exactly
    ``input_c`` per example (``[B, F]``) or per location (the channel vectors of ``[B, ..., C]``).

    ``x1`` is ``example_input`` with each vector rescaled to mean square 1; ``x2 = input_c * x1 +
    sqrt(1 - input_c^2) * z`` with ``z`` a seeded Gaussian draw orthogonal to ``x1``, of the same
    norm. ``same_locations=True`` first replaces each example by its spatial mean at every location,
    so pooling leaves the maps unchanged. A map with one channel has no cosine per location:
    ValueError (use a flat input or one with several channels)."""
    input_c = pair_c(input_c)
    x = np.asarray(example_input, dtype=np.float64)
    if x.ndim < 2:
        raise ValueError(f"example_input must be batched, got shape {list(x.shape)}")
    n = x.shape[-1]
    if n < 2:
        raise ValueError(
            f"example_input has {n} feature(s) per location (shape {list(x.shape)}): a pair at a cosine needs at "
            "least 2; diagnose a flat [batch, features] input or one with several channels"
        )
    z = np.random.default_rng(_PAIR_SEED_OFFSET + int(seed)).standard_normal(x.shape)
    spatial = tuple(range(1, x.ndim - 1))
    if same_locations and spatial:
        x = np.broadcast_to(x.mean(axis=spatial, keepdims=True), x.shape).copy()
        z = np.broadcast_to(z.mean(axis=spatial, keepdims=True), z.shape).copy()
    x1 = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-30) * math.sqrt(n)
    z = z - (z * x1).sum(-1, keepdims=True) / n * x1
    z = z / np.maximum(np.linalg.norm(z, axis=-1, keepdims=True), 1e-30) * math.sqrt(n)
    x2 = input_c * x1 + math.sqrt(1.0 - input_c * input_c) * z
    return x1.astype(np.float32), x2.astype(np.float32)


def _q_and_c(y, half: int) -> tuple[float, float]:
    """Mean square over both halves; mean cosine of the halves along the channel axis (last)."""
    y = np.asarray(keras.ops.convert_to_numpy(y), dtype=np.float64)
    a, b = y[:half], y[half:]
    num = (a * b).sum(-1)
    den = np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    return float((y * y).mean()), float((num / den).mean())


def _run(ext, x) -> dict:
    """Graph id -> its value on ``x``, running the model's nodes in Keras's own order."""
    fm = ext.model
    values = {id(fm.inputs[0]): keras.ops.convert_to_tensor(x)}
    pre = {}  # graph id of a fused layer's dense/conv node -> its pre-activation
    layer_of = {id(e.layer): e for e in ext.entries.values() if e.kind == "layer" and e.tensor is None}
    for kind, *rest in ext.order:
        if kind == "bind":  # a nested model's input or output: the same value under another tensor
            values[rest[0]] = values[rest[1]]
            continue
        node = rest[0]
        op = node.operation
        if node.is_input:
            continue
        args, kwargs = node.arguments.fill_in(values)
        e = layer_of.get(id(op))
        if e is not None:  # a Dense/Conv with its own activation: keep the pre-activation too
            act = op.activation
            try:
                op.activation = keras.activations.linear
                y = op(*args, **kwargs)
            finally:
                op.activation = act
            pre[e.gid] = y
            out = act(y)
        else:
            out = op(*args, **kwargs)
        for t, v in zip(node.outputs, keras.tree.flatten(out), strict=True):
            values[id(t)] = v
    return {gid: (pre[gid] if gid in pre else e.scale * values[e.tensor]) for gid, e in ext.entries.items()}


def diagnose(model, solution, example_input, *, input_c: float = 0.5, same_locations: bool = False, seed: int = 0):
    """Per-node q and c of ``model`` (an applied model: ``apply(...).model``) against the answer.

    Runs the model once, in inference mode, on the pair :func:`input_pair` builds from
    ``example_input`` (a channels-last batch; q = 1 and cosine ``input_c`` per example, per location
    for feature maps) and returns a :class:`~sigprop.client.diagnosis.Diagnosis`, as the torch and
    JAX adapters do: ``str()`` is the table. One finite-width network deviates from the prediction
    by a few ``1 / sqrt(width x pairs x locations)``; average several seeds for a tighter check.
    tat and dks answers only (ValueError otherwise)."""
    sol = as_solution(solution)
    x1, x2 = input_pair(example_input, input_c, same_locations=same_locations, seed=seed)
    ext = extract(model)
    predicted = predict(ext.graph, sol, input_c, same_locations=same_locations)
    values = _run(ext, np.concatenate([x1, x2]))
    half = x1.shape[0]
    ops = {nd["id"]: nd["op"] for nd in ext.graph["nodes"]}
    rows = []
    for gid, p in predicted.items():
        if ops[gid] in SHOWN_OPS:
            q, c = _q_and_c(values[gid], half)
            rows.append(LayerDiagnosis(gid, ops[gid], p.q, q, p.c, c, p.note))
    c_global = interpolate(input_c, sol.c_map.c, sol.c_map.global_) if sol.c_map is not None else None
    scope = "location" if x1.ndim > 2 else "example"
    return Diagnosis(sol.method, sol.activation, input_c, 1.0, scope, int(half), rows, c_global, list(ext.warnings))
