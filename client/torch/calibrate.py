"""``apply(..., example_input=x)``: the torch side of the calibration of ops the answer cannot
predict (:mod:`sigprop.client.calibration` decides which nodes and computes the factors).

The rewritten GraphModule is run on the example batch with a ``torch.fx.Interpreter`` (eval mode,
no gradients) that keeps the mean square of the calibrated nodes and their inputs; the factors go
into the kernels (and biases) of the layer modules, or into an ``output * factor`` node inserted
after the op where no layer can take them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx

from ...schemas.solve import Solution
from ..calibration import Calibration, Placement, answer_uncovered, calibrate, measured_nodes
from .extraction import Extraction

__all__ = ["calibrate_model"]


class _MeanSquares(torch.fx.Interpreter):
    """Runs the graph and keeps the mean square of the nodes asked for."""

    def __init__(self, gm: torch.fx.GraphModule, keep: set):
        super().__init__(gm)
        self.keep, self.q = keep, {}

    def run_node(self, n: torch.fx.Node):
        out = super().run_node(n)
        if n in self.keep and isinstance(out, torch.Tensor):
            self.q[n] = float(out.detach().double().pow(2).mean())
        return out


def _arg_of(node: torch.fx.Node, a: torch.fx.Node) -> torch.fx.Node:
    """The node ``node`` actually reads for its graph input ``a``: ``a`` itself, or a multiplier
    inserted after it (geometric ``alpha``, an earlier calibration)."""
    if a in node.all_input_nodes:
        return a
    return next((u for u in a.users if u in node.all_input_nodes), a)


class _TorchModel:
    def __init__(self, ext: Extraction, resolve: Callable, example_input: torch.Tensor, out_of_place: list[str]):
        self.ext, self.resolve, self.x, self.out_of_place = ext, resolve, example_input, out_of_place
        self.by_gid = {e.gid: e for e in ext.entries.values()}

    def measure(self, ids: list[str]) -> dict[str, tuple[float, list[float]]]:
        wanted = {}
        for gid in ids:
            e = self.by_gid[gid]
            wanted[gid] = (e.node, [_arg_of(e.node, self.resolve(a)) for a in e.inputs])
        keep = {n for node, ins in wanted.values() for n in [node, *ins]}
        gm = self.ext.gm
        modes = {m: m.training for m in gm.modules()}
        try:
            gm.eval()  # no dropout, no running statistics: the network the maps describe
            rec = _MeanSquares(gm, keep)
            with torch.no_grad():
                rec.run(self.x)
        finally:
            for m, mode in modes.items():
                m.training = mode
        return {gid: (rec.q[node], [rec.q[a] for a in ins]) for gid, (node, ins) in wanted.items()}

    def rescale(self, place: Placement, factor: float) -> bool:
        if place.where == "multiplier":
            node = self.by_gid[place.node].node
            with self.ext.gm.graph.inserting_after(node):
                scaled = self.ext.gm.graph.call_function(operator.mul, (node, float(factor)))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
            self.out_of_place.append(f"the calibration multiplier {factor:.6g} after '{place.node}'")
            return True
        seen = set()
        with torch.no_grad():
            for gid in place.layers:
                module = self.by_gid[gid].module
                if id(module) in seen:
                    continue
                seen.add(id(module))
                module.weight.mul_(factor)
                if place.where == "feeds" and getattr(module, "bias", None) is not None:
                    module.bias.mul_(factor)
        return True


def calibrate_model(
    ext: Extraction,
    resolve: Callable,
    sol: Solution,
    sum_weights: dict[str, list[float]],
    example_input: torch.Tensor,
    out_of_place: list[str],
) -> tuple[list[Calibration], list[str]]:
    """Calibrate the rewritten ``ext.gm`` on ``example_input``; returns (calibrations, warnings).

    ``resolve`` maps an fx node the rewrite replaced to its replacement; ``sum_weights`` are the
    weights the rewritten adds compute, by graph id; ``out_of_place`` collects inserted multipliers
    (``apply(inplace=True)`` refuses them)."""
    # the graph's own (normalized) weights: the adds compute them times the answer's sum_scales,
    # which the prediction applies itself (client.diagnosis mixes shared sums over atoms)
    scales = sol.sum_scales or {}
    graph = {
        **ext.graph,
        "nodes": [
            {**nd, "weights": [w / scales.get(nd["id"], 1.0) for w in sum_weights[nd["id"]]]}
            if nd["id"] in sum_weights
            else nd
            for nd in ext.graph["nodes"]
        ],
    }
    unmodelled = [e.gid for e in ext.entries.values() if e.unsupported]
    nodes = measured_nodes(graph, [*answer_uncovered(sol), *unmodelled])
    if not nodes:
        return [], []
    model = _TorchModel(ext, resolve, example_input, out_of_place)
    return calibrate(graph, sol, nodes, model.measure, model.rescale, unmodelled)
