"""``diagnose`` for Flax models: measured q and c per graph node against the answer's prediction."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ...schemas.ops import OP_TABLE, SOURCE
from ..diagnosis import (
    SHOWN_OPS,
    Diagnosis,
    LayerDiagnosis,
    interpolate,
    judge,
    note_calibrations,
    predict,
    stated_noise,
    with_noise,
)
from ..pairs import channels_last_pair, q_and_c
from ..solution import as_solution
from .extraction import extract_flax
from .token_diagnose import answer_phi, diagnose_tokens

__all__ = ["diagnose", "input_pair"]


def input_pair(example_input, input_c: float, *, same_locations: bool = False, seed: int = 0):
    """``(x1, x2)`` with q = 1 and cosine ``input_c`` per example (per location of NHWC maps: the
    channel axis is the last), as ``sigprop.client.torch.input_pair`` builds them
    (:func:`sigprop.client.pairs.channels_last_pair`), in ``example_input``'s dtype."""
    dtype = jnp.asarray(example_input).dtype
    x1, x2 = channels_last_pair(example_input, input_c, same_locations=same_locations, seed=seed)
    return jnp.asarray(x1, dtype), jnp.asarray(x2, dtype)


def diagnose(
    model,
    solution,
    example_input,
    *,
    input_c: float = 0.5,
    same_locations: bool = False,
    seed: int = 0,
    calibrations=(),
):
    """Per-node q and c of a Flax model against the answer: ``model`` is a bound module
    (``module.bind(variables)``, e.g. with the params :func:`apply_to_params` returned) or a
    ``(module, variables)`` pair. As ``sigprop.client.torch.diagnose`` (same pair of inputs, same
    :class:`~sigprop.client.diagnosis.Diagnosis`); the values are the graph nodes' own (an
    activation written as ``s * phi`` is measured as ``phi``, a sum as the normalized sum).
    ``calibrations``: ``apply_to_params``'s ``report.calibrations``, marked on their rows.

    A sequence input ``[B, T, D]`` gets the sequence model's check instead: the output token kernel
    measured on B sets of orthonormal tokens against the answer's ``token_kernel.output``, for one
    network or a list of them (the same model applied with different keys): a
    ``sigprop.client.token_diagnosis.TokenKernelDiagnosis``
    (:func:`sigprop.client.jax.token_diagnose.diagnose_tokens`)."""
    if jnp.ndim(example_input) == 3:
        return diagnose_tokens(model, solution, example_input, seed=seed)
    module, variables = model if isinstance(model, tuple) else model.unbind()
    sol = as_solution(solution)
    x1, x2 = input_pair(example_input, input_c, same_locations=same_locations, seed=seed)
    ext = extract_flax(module, variables, jnp.concatenate([x1, x2]), allow_unsupported=True)
    one_channel = x1.ndim > 2 and x1.shape[-1] == 1
    half = int(x1.shape[0])
    ops = {nd["id"]: nd["op"] for nd in ext.graph["nodes"]}
    measured = {gid: q_and_c(ext.values[gid], half) for gid in ops if gid in ext.values}
    # the prediction is for the pair measured (its cosine is input_c only to rounding, and to within
    # 1 / locations for a one-channel pair)
    actual_c = next(measured[gid][1] for gid, op in ops.items() if OP_TABLE[op].kind == SOURCE)
    predicted = predict(ext.graph, sol, actual_c, same_locations=same_locations, one_channel=one_channel)
    first = (0, x1.ndim - 1, *range(1, x1.ndim - 1))  # channels last -> channels first
    noise = stated_noise(ext.graph, sol, np.transpose(x1, first), np.transpose(x2, first), answer_phi(sol))
    rows = []
    for gid, p in predicted.items():
        if ops[gid] in SHOWN_OPS:
            q, c = measured[gid]
            rows.append(with_noise(LayerDiagnosis(gid, ops[gid], p.q, q, p.c, c, p.note), noise[gid]))
    c_global = interpolate(actual_c, sol.c_map.c, sol.c_map.global_)
    scope = "location" if x1.ndim == 4 else "example"
    diag = Diagnosis(sol.method, sol.activation, input_c, 1.0, scope, half, rows, c_global, pair_c=actual_c)
    diag.notes.extend(ext.warnings)
    note_calibrations(diag, calibrations)
    judge(diag, ext.graph)
    return diag
