"""What a classification validation (the default task) will train, its cost and memory bounded
before anything is allocated, as ``charlm_plan`` bounds a charlm validation: checked by the API
when the validation is submitted (413 ``validation_too_large``). Torch-free (the API imports it).

From the wire graph's shapes (``schemas.shapes.infer_shapes``): each dense and conv layer's
parameters and multiply-adds per example, and every node's values per example. Bounds:

- training work: 6 x multiply-adds x examples (forward and backward, the estimate
  ``charlm_plan`` uses), summed over the networks trained (the solved one and each baseline),
  at most ``MAX_TRAIN_FLOPS``;
- memory: per network, 16 bytes a parameter (weights, gradients, two optimizer moments) and
  8 bytes a value per example of the batch (the activations and their gradients), summed over the
  networks, at most ``MAX_TRAIN_BYTES``.

A 10,000-layer, width-1,024 MLP (about 1e10 parameters) trained for 20,000 steps was accepted
with 202 before (issue 35): it is refused now, with the figures and what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import SigpropError
from ..schemas.graph import Graph
from ..schemas.ops import AFFINE, ATTENTION, kind_of
from ..schemas.shapes import infer_shapes

MAX_TRAIN_FLOPS = 2e15  # as charlm_plan's: all networks together
MAX_TRAIN_BYTES = 4 << 30  # parameters with optimizer state, and one batch's activations, all networks
LIMITS = {"train_flops": MAX_TRAIN_FLOPS, "train_bytes": MAX_TRAIN_BYTES}
_HINT = "ask for fewer steps or a smaller batch, validate a smaller network, or train fewer baselines"


@dataclass(frozen=True)
class ClassifyPlan:
    networks: int
    parameters: int  # of one network
    macs: int  # multiply-adds per example, one network
    values: int  # node values per example, one network
    train_flops: float
    train_bytes: float


def _int(x, default: int = 0) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return default


def network_size(graph: dict) -> tuple[int, int, int]:
    """(parameters, multiply-adds per example, values per example) of a wire graph."""
    shapes = infer_shapes(Graph.model_validate(graph))
    params = macs = values = 0
    for node in graph.get("nodes") or ():
        if not isinstance(node, dict) or node.get("id") not in shapes:
            continue
        out = tuple(shapes[node["id"]])
        values += math.prod(out)
        kind = kind_of(node.get("op"))
        ins = [tuple(shapes[i]) for i in node.get("inputs") or () if i in shapes]
        if kind == AFFINE and ins and out:
            if "channels" in node:  # a convolution: kernel x in-channels x out-channels weights
                kernel = node.get("kernel") or (1, 1)
                kernel = kernel if isinstance(kernel, (list, tuple)) else (kernel, kernel)
                weights = ins[0][0] * out[0] * math.prod(_int(k, 1) for k in kernel)
                macs += weights * math.prod(out[1:])
                units = out[0]
            else:  # dense, on the last axis (per token in a sequence)
                weights = ins[0][-1] * out[-1]
                macs += weights * math.prod(out[:-1])
                units = out[-1]
            params += weights + (units if node.get("bias", True) else 0)
        elif kind == ATTENTION and out:
            tokens = out[0]
            macs += 2 * tokens * tokens * math.prod(out[1:])
    return params, macs, values


def plan_classify(request: dict, graph: dict) -> ClassifyPlan:
    """The plan of a classification validation ``request`` (a validated ``ValidationRequest`` dump)
    of ``graph`` (the wire graph that was solved), or 413 ``validation_too_large`` past a bound."""
    params, macs, values = network_size(graph)
    networks = 1 + len(request.get("baselines") or ())
    steps, batch = int(request.get("steps", 200)), int(request.get("batch_size", 64))
    flops = 6.0 * macs * steps * batch * networks
    memory = networks * (16.0 * params + 8.0 * values * batch)
    if not math.isfinite(memory) or memory > MAX_TRAIN_BYTES:
        raise _too_large(
            f"training {networks} network(s) of {params:,} parameters and {values:,} values per example in "
            f"batches of {batch} needs about {memory / 2**30:.3g} GiB, over this server's bound of "
            f"{MAX_TRAIN_BYTES / 2**30:.3g} GiB"
        )
    if not math.isfinite(flops) or flops > MAX_TRAIN_FLOPS:
        raise _too_large(
            f"training {networks} network(s) of {macs:,} multiply-adds per example on {steps} x {batch} examples "
            f"is about {flops:.3g} FLOPs, over this server's bound of {MAX_TRAIN_FLOPS:.3g}"
        )
    return ClassifyPlan(networks, params, macs, values, flops, memory)


def _too_large(message: str) -> SigpropError:
    return SigpropError("validation_too_large", f"classify: {message}", _HINT, 413)
