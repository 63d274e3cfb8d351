"""``apply_to_params(..., module=m, example_input=x)``: the JAX side of the calibration of ops the
answer cannot predict (:mod:`sigprop.client.calibration` decides which nodes and computes factors).

Each wave of measurements reads the graph nodes' values off the jaxpr of ``module.apply`` on the
example batch (``extraction``, the same values ``diagnose`` measures); the factors go into the
params tree's kernels (and biases). JAX code cannot be rewritten, so a node whose factor no layer
can take is reported, not calibrated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ...schemas.solve import Solution
from ..calibration import Calibration, Placement, answer_uncovered, calibrate, measured_nodes
from .extraction import extract_flax
from .trees import _MISSING, _get, _set

__all__ = ["calibrate_params"]


def _find(tree, module_path: tuple, names: Sequence[str]) -> tuple | None:
    """The path of the first of ``names`` under ``module_path`` (under ``params`` for a Flax
    variables dict), or None."""
    for root in ((), ("params",)):
        for n in names:
            path = root + tuple(module_path) + (n,)
            if _get(tree, path) is not _MISSING:
                return path
    return None


class _FlaxModel:
    def __init__(self, module, params, example_input, kernel_names, bias_names):
        self.module, self.params, self.x = module, params, jnp.asarray(example_input)
        self.kernel_names, self.bias_names = kernel_names, bias_names
        self.mapping: dict[str, tuple] = {}

    def variables(self):
        return self.params if "params" in self.params else {"params": self.params}

    def extract(self):
        ext = extract_flax(self.module, self.variables(), self.x, allow_unsupported=True)
        self.mapping = ext.mapping
        return ext

    def measure(self, ids: list[str]) -> dict[str, tuple[float, list[float]]]:
        ext = self.extract()
        nodes = {nd["id"]: nd for nd in ext.graph["nodes"]}

        def q(gid: str) -> float:
            return float(np.mean(np.square(np.asarray(ext.values[gid], np.float64))))

        return {gid: (q(gid), [q(i) for i in nodes[gid]["inputs"]]) for gid in ids}

    def rescale(self, place: Placement, factor: float) -> bool:
        if place.where == "multiplier":
            return False
        paths = []
        for gid in place.layers:  # every leaf found before any is changed
            module_path = self.mapping.get(gid, ())
            kernel = _find(self.params, module_path, self.kernel_names)
            if kernel is None:
                return False
            bias = _find(self.params, module_path, self.bias_names) if place.where == "feeds" else None
            paths += [kernel] + ([bias] if bias is not None else [])
        for path in paths:
            leaf = _get(self.params, path)
            self.params = _set(self.params, path, (leaf * factor).astype(leaf.dtype))
        return True


def calibrate_params(
    module,
    params,
    sol: Solution,
    example_input,
    kernel_names: Sequence[str],
    bias_names: Sequence[str],
) -> tuple[Any, list[Calibration], list[str]]:
    """``(params, calibrations, warnings)``: ``params`` with the factors of every calibrated node
    of ``module`` (a ``flax.linen`` module) measured on ``example_input`` (``[B, F]`` or NHWC)."""
    model = _FlaxModel(module, params, example_input, kernel_names, bias_names)
    graph = model.extract().graph
    nodes = measured_nodes(graph, answer_uncovered(sol))
    if not nodes:
        return params, [], []
    cals, warnings = calibrate(graph, sol, nodes, model.measure, model.rescale)
    return model.params, cals, warnings
