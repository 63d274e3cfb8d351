"""Checks of a sequence model's trace: every fx node's value on the example input (what the
attention reader compares head plumbing with) and each dense node's fan-in against its Linear."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from ...schemas.errors import SigpropError

__all__ = ["record_values", "check_fan_in"]


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n] = out
        return out


def record_values(gm: torch.fx.GraphModule, example_input: torch.Tensor) -> dict:
    """Every fx node's value on the example input (eval mode, no gradients)."""
    modes = {m: m.training for m in gm.modules()}
    try:
        gm.eval()
        rec = _Recorder(gm)
        with torch.no_grad():
            rec.run(example_input)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return rec.values


def check_fan_in(graph: dict, parts: dict, hint: str) -> None:
    """Each dense node reads as many features as its Linear takes (a reshape the graph does not see
    would break it)."""
    width = {}
    for nd in graph["nodes"]:
        op, ins = nd["op"], nd.get("inputs", [])
        if op == "input":
            width[nd["id"]] = nd["shape"][-1]
        elif op == "dense":
            width[nd["id"]] = nd["units"]
            part = parts.get(nd["id"])
            m = part.module if part is not None else None
            want = m.embed_dim if isinstance(m, nn.MultiheadAttention) else getattr(m, "in_features", None)
            if want is not None and width.get(ins[0]) != want:
                raise SigpropError(
                    "unsupported_op",
                    f"node '{nd['id']}' (Linear '{part.path}') expects {want} input features but the graph gives it "
                    f"{width.get(ins[0])}: something before it changes shapes in a way the graph does not see",
                    hint,
                )
        elif op == "attention":
            width[nd["id"]] = width.get(ins[2])
        elif ins:
            width[nd["id"]] = width.get(ins[0])
