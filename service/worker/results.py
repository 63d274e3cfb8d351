"""The results of a validation, typed, and the JSON the API stores for them (contract section 4).

:class:`ValidationResults` holds one :class:`RunResult` (or :class:`RunError`) per trained
network; ``to_json`` gives the stored document, with a ``summary`` comparing the solved run with
each baseline (:func:`compare`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .inputs import TrainConfig
from .measurements import ActivationStats, CValues

__all__ = ["GradNorms", "Curves", "RunResult", "RunError", "ValidationResults", "compare", "finite"]

ACCURACY_TIE = 0.005  # |accuracy difference| at most this is a tie
LOSS_TIE = 0.01  # relative test-loss difference at most this is a tie


@dataclass
class GradNorms:
    """Each weighted layer's weight-gradient norm at one step (None for a layer without one)."""

    step: int
    norms: dict[str, float | None]

    def to_json(self) -> dict:
        return {"step": self.step, "norms": self.norms}


@dataclass
class Curves:
    """What one training loop recorded."""

    loss_every: int
    eval_every: int
    examples: int  # test examples evaluated at each curve point
    loss_steps: list[int] = field(default_factory=list)
    loss_values: list[float] = field(default_factory=list)  # mean training loss since the previous point
    accuracy_steps: list[int] = field(default_factory=list)
    accuracy_values: list[float] = field(default_factory=list)
    test_loss_values: list[float] = field(default_factory=list)
    grad_norms: list[GradNorms] = field(default_factory=list)
    last_loss: float | None = None
    diverged_at: int | None = None  # the step whose training loss was not finite
    steps_done: int = 0
    train_time_s: float = 0.0

    def add_loss(self, step: int, loss: float) -> None:
        self.last_loss = loss
        self.loss_steps.append(step)
        self.loss_values.append(loss)
        if not math.isfinite(loss):
            self.diverged_at = step

    def add_evaluation(self, step: int, accuracy: float, test_loss: float) -> None:
        self.accuracy_steps.append(step)
        self.accuracy_values.append(accuracy)
        self.test_loss_values.append(test_loss)


@dataclass
class RunResult:
    """One trained network: how it was made, what it measured at initialization, how it trained."""

    description: str
    activation: str
    input_scale: float  # the factor applied to the inputs, for the mean square the answer assumes
    input_mean_square: float
    made: dict  # how the network was made, e.g. {"apply": what apply did}
    solution: dict | None  # key, method, activation and targets of the answer applied
    c_values: CValues
    curves: Curves
    final_test_accuracy: float
    final_test_loss: float
    init_stats: ActivationStats
    final_stats: ActivationStats
    stats_examples: int  # training examples the activation statistics are taken on
    sparse: bool  # a sparsifying activation, or a sparse EoC answer: report sparsity
    relu_family: bool  # report dead units
    predicted_sparsity: float | None
    wall_time_s: float
    parameters: int
    build_time_s: float | None = None

    def to_json(self) -> dict:
        c = self.curves
        res: dict[str, Any] = {
            "description": self.description,
            "activation": self.activation,
            "input_scale": self.input_scale,
            "input_mean_square": self.input_mean_square,
            **self.made,
        }
        if self.solution is not None:
            res["solution"] = self.solution
        res["c_values"] = self.c_values.to_json()
        res.update(
            {
                "steps_done": c.steps_done,
                "diverged": c.diverged_at is not None,
                "diverged_at": c.diverged_at,
                "loss": {
                    "steps": c.loss_steps,
                    "values": c.loss_values,
                    "every": c.loss_every,
                    "what": "mean training cross-entropy over the steps since the previous point",
                },
                "test_accuracy": {
                    "steps": c.accuracy_steps,
                    "values": c.accuracy_values,
                    "test_loss": c.test_loss_values,
                    "examples": c.examples,
                    "every": c.eval_every,
                },
                "final_test_accuracy": self.final_test_accuracy,
                "final_test_loss": self.final_test_loss,
                "final_train_loss": c.last_loss,
                "grad_norms": [g.to_json() for g in c.grad_norms],
            }
        )
        init, final = self.init_stats, self.final_stats
        if self.sparse:
            res["sparsity"] = {
                "init": init.zero_fraction,
                "final": final.zero_fraction,
                "predicted": self.predicted_sparsity,
                "init_per_layer": init.zero_per_layer,
                "final_per_layer": final.zero_per_layer,
                "what": "fraction of exact zeros in the activation outputs on a training batch",
            }
        if self.relu_family:
            res["dead_units"] = {
                "init": init.dead_fraction,
                "final": final.dead_fraction,
                "final_per_layer": final.dead_per_layer,
                "what": "fraction of units (features/channels) never on the active side for a "
                f"batch of {self.stats_examples} training examples",
            }
        res.update({"train_time_s": c.train_time_s, "wall_time_s": self.wall_time_s, "parameters": self.parameters})
        if self.build_time_s is not None:
            res["build_time_s"] = self.build_time_s
        return res


@dataclass
class RunError:
    """A baseline that could not be built for this graph and answer (the contract's error object)."""

    code: str
    message: str
    hint: str

    def to_json(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, "hint": self.hint}}


@dataclass
class ValidationResults:
    """Everything a validation reports; ``to_json`` is the document the API stores."""

    device: str
    device_name: str
    torch_version: str
    dataset: dict
    config: TrainConfig
    solution: dict
    graph: dict  # nodes, depth, weighted layers, sums and concats of the validated graph
    runs: dict[str, RunResult | RunError]
    wall_time_s: float

    def to_json(self) -> dict:
        runs = {name: run.to_json() for name, run in self.runs.items()}
        return {
            "device": self.device,
            "device_name": self.device_name,
            "torch_version": self.torch_version,
            "dataset": self.dataset,
            "config": self.config.to_json(),
            "solution": self.solution,
            "graph": self.graph,
            "runs": runs,
            "summary": _summary(runs),
            "wall_time_s": self.wall_time_s,
        }


def _verdict(solved: float | None, other: float | None, higher_is_better: bool, tie: float, relative: bool) -> str:
    ok_s = solved is not None and math.isfinite(solved)
    ok_o = other is not None and math.isfinite(other)
    if not ok_s and not ok_o:
        return "tie"
    if not ok_o:
        return "better"
    if not ok_s:
        return "worse"
    d = solved - other
    limit = tie * max(abs(solved), abs(other)) if relative else tie
    if abs(d) <= limit:
        return "tie"
    return "better" if (d > 0) == higher_is_better else "worse"


def compare(solved: dict, baseline: dict) -> dict:
    """The solved run's final test accuracy and loss against one baseline's."""
    sa, ba = solved.get("final_test_accuracy"), baseline.get("final_test_accuracy")
    sl, bl = solved.get("final_test_loss"), baseline.get("final_test_loss")
    return {
        "accuracy": _verdict(sa, ba, True, ACCURACY_TIE, False),
        "solved_accuracy": sa,
        "baseline_accuracy": ba,
        "accuracy_difference": sa - ba if sa is not None and ba is not None else None,
        "loss": _verdict(sl, bl, False, LOSS_TIE, True),
        "solved_loss": sl,
        "baseline_loss": bl,
        "loss_difference": sl - bl if sl is not None and bl is not None else None,
    }


def _summary(runs: dict) -> dict:
    solved = runs.get("solved", {})
    out: dict[str, Any] = {
        "solved": {
            "final_test_accuracy": solved.get("final_test_accuracy"),
            "final_test_loss": solved.get("final_test_loss"),
        },
        "baselines": {},
        "text": [],
    }
    for name, run in runs.items():
        if name == "solved":
            continue
        if "error" in run:
            out["baselines"][name] = {"accuracy": "unavailable", "loss": "unavailable", "error": run["error"]}
            out["text"].append(f"{name}: unavailable ({run['error']['message']})")
            continue
        c = compare(solved, run)
        out["baselines"][name] = c

        def f(v):
            return "n/a" if v is None or not math.isfinite(v) else f"{v:.4f}"

        out["text"].append(
            f"solved vs {name}: test accuracy {f(c['solved_accuracy'])} vs "
            f"{f(c['baseline_accuracy'])} ({c['accuracy']}), test loss {f(c['solved_loss'])} vs "
            f"{f(c['baseline_loss'])} ({c['loss']})"
        )
    out["text"] = "; ".join(out["text"])
    return out


def finite(obj):
    """JSON-safe results: non-finite floats become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return finite(obj.item())
    return obj
