"""Per-node q and c of an applied Keras model, measured against what the answer predicts.

:func:`diagnose` re-extracts the model, runs its graph of layer calls once on a pair of inputs at a
known cosine (as Keras runs a Functional model, keeping every node's value, and the pre-activation
of a Dense/Conv layer with a fused activation), and compares with
:func:`sigprop.client.diagnosis.predict` (the answer's maps composed along the graph).
"""

from __future__ import annotations

import keras
import numpy as np

from ..diagnosis import (
    SHOWN_OPS,
    Diagnosis,
    LayerDiagnosis,
    interpolate,
    judge,
    predict,
    stated_noise,
    with_noise,
)
from ..pairs import channels_last_pair, q_and_c
from ..solution import as_solution
from .extraction import extract
from .layers import TransformedActivation

__all__ = ["diagnose", "input_pair"]


def input_pair(example_input, input_c: float, *, same_locations: bool = False, seed: int = 0):
    """Two float32 batches ``(x1, x2)`` (numpy, channels last) with q = 1 and cosine ``input_c`` per
    example or per location, as the other adapters build them
    (:func:`sigprop.client.pairs.channels_last_pair`)."""
    x1, x2 = channels_last_pair(example_input, input_c, same_locations=same_locations, seed=seed)
    return x1.astype(np.float32), x2.astype(np.float32)


def _q_and_c(y, half: int) -> tuple[float, float]:
    return q_and_c(keras.ops.convert_to_numpy(y), half)


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
    JAX adapters do: ``str()`` is the table, ending with the verdict. One finite-width network
    deviates from the prediction by the noise each row states (finite-width theory); average
    several seeds for a tighter check.
    tat and dks answers only (ValueError otherwise)."""
    sol = as_solution(solution)
    x1, x2 = input_pair(example_input, input_c, same_locations=same_locations, seed=seed)
    ext = extract(model)
    one_channel = x1.ndim > 2 and x1.shape[-1] == 1
    values = _run(ext, np.concatenate([x1, x2]))
    half = x1.shape[0]
    ops = {nd["id"]: nd["op"] for nd in ext.graph["nodes"]}
    measured = {gid: _q_and_c(values[gid], half) for gid in ops if gid in values}
    # the prediction is for the pair measured (its cosine is input_c only to rounding, and to within
    # 1 / locations for a one-channel pair)
    actual_c = next(measured[gid][1] for gid, op in ops.items() if op == "input")
    predicted = predict(ext.graph, sol, actual_c, same_locations=same_locations, one_channel=one_channel)
    first = (0, x1.ndim - 1, *range(1, x1.ndim - 1))  # channels last -> channels first
    noise = stated_noise(ext.graph, sol, np.transpose(x1, first), np.transpose(x2, first), _phi(sol))
    rows = []
    for gid, p in predicted.items():
        if ops[gid] in SHOWN_OPS:
            q, c = measured[gid]
            rows.append(with_noise(LayerDiagnosis(gid, ops[gid], p.q, q, p.c, c, p.note), noise[gid]))
    c_global = interpolate(actual_c, sol.c_map.c, sol.c_map.global_) if sol.c_map is not None else None
    scope = "location" if x1.ndim > 2 else "example"
    diag = Diagnosis(
        sol.method, sol.activation, input_c, 1.0, scope, int(half), rows, c_global, list(ext.warnings), pair_c=actual_c
    )
    judge(diag, ext.graph)  # the first node off its prediction by more than its noise, with the likely cause
    return diag


def _phi(sol):
    """The answer's transformed activation as a numpy function, for the stated noise (None where
    it cannot be built: the noise then takes the activation as the identity)."""
    try:
        act = TransformedActivation.from_solution(sol)
    except (KeyError, ValueError, TypeError):
        return None
    return lambda z: np.asarray(keras.ops.convert_to_numpy(act(keras.ops.convert_to_tensor(z))), np.float64)
