"""What ``run_validation`` accepts, turned into typed inputs: the training fields of a validation
request, the answer to validate and the graph that was solved, each rejected with a contract error
saying what is accepted; and the ``TrainConfig`` every run of one validation trains with (torch-free,
so the results module can name it without importing the training loop)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ..engine.templates.expand import expand_template
from ..errors import SigpropError
from ..requests import invalid_request
from ..schemas.graph import Graph, Template
from ..schemas.solve import Solution
from ..schemas.validation import ValidationRequest
from ..settings import offline_limits

# Measured on digits with a depth-50 TReLU MLP: SGD (momentum 0.9) diverges at lr >= 0.01 and
# Adam is unstable at 1e-3, while 0.002 / 3e-4 train it to ~0.95 test accuracy in 300 steps.
DEFAULT_LR = {"sgd": 0.002, "adam": 3e-4}
SGD_MOMENTUM = 0.9
_TRAIN_FIELDS = ("dataset", "steps", "batch_size", "optimizer", "lr", "seed", "baselines", "task", "arms")


def _training_config(request: Any) -> ValidationRequest:
    """The training fields of a validation request (its solve/key part is the caller's business)."""
    if isinstance(request, ValidationRequest):
        data = request.model_dump()
    elif isinstance(request, Mapping):
        data = dict(request)
    else:
        raise SigpropError(
            "invalid_request",
            f"the validation request is a {type(request).__name__}, not an object",
            'send {"solve": {...}, "dataset": "digits", "steps": 200, ...}',
        )
    fields = {k: data[k] for k in _TRAIN_FIELDS if k in data and data[k] is not None}
    try:
        return ValidationRequest.model_validate({**fields, "key": "0" * 64})
    except ValidationError as exc:
        raise invalid_request(
            exc, "steps >= 1, batch_size >= 1, optimizer 'sgd' or 'adam', lr > 0, baselines among 'he', 'eoc', 'plain'"
        ) from None


def _as_solution(solution: Any) -> Solution:
    if isinstance(solution, Solution):
        return solution
    try:
        if isinstance(solution, (str, bytes)):
            return Solution.model_validate_json(solution)
        if isinstance(solution, Mapping):
            return Solution.model_validate(dict(solution))
    except ValidationError as exc:
        raise SigpropError(
            "invalid_request",
            f"the solution to validate is not a valid answer: {exc.errors()[0]['msg']}",
            "validate an answer of POST /v1/solve",
        ) from None
    raise TypeError(f"solution must be a Solution, its JSON or a dict, not {type(solution).__name__}")


def _as_graph(graph: Any) -> Graph:
    if isinstance(graph, Graph):
        return graph
    if isinstance(graph, Template):
        return expand_template(graph, max_nodes=offline_limits().max_nodes)
    try:
        if isinstance(graph, Mapping) and "template" in graph:
            return expand_template(Template.model_validate(dict(graph)), max_nodes=offline_limits().max_nodes)
        return Graph.model_validate(graph)
    except ValidationError as exc:
        raise invalid_request(
            exc, "give the graph that was solved (sigprop.graph/v1) or its template", "graph", "invalid_graph"
        ) from None


def _request_init(request: Any, solution: Solution) -> str:
    solve = request.get("solve") if isinstance(request, Mapping) else getattr(request, "solve", None)
    if isinstance(solve, Mapping) and solve.get("init") in ("orthogonal", "gaussian"):
        return solve["init"]
    if solve is not None and getattr(solve, "init", None) in ("orthogonal", "gaussian"):
        return solve.init
    return "gaussian" if any(la.distribution == "gaussian" for la in solution.layers) else "orthogonal"


@dataclass(frozen=True)
class TrainConfig:
    """How every run of one validation trains."""

    dataset: str
    steps: int
    batch_size: int  # the request's, at most the training set's size
    optimizer: str
    lr: float
    seed: int
    runs: tuple[str, ...]  # "solved", then the baselines in request order
    eval_every: int  # test-accuracy curve spacing, in steps
    loss_every: int  # training-loss curve spacing
    progress_every: int
    init: str  # weight distribution of the EOC baseline

    @classmethod
    def create(
        cls, req: ValidationRequest, request: Any, sol: Solution, n_train: int, eval_every: int | None
    ) -> TrainConfig:
        """From the validated training fields ``req`` of ``request`` (whose ``solve.init`` picks
        the EOC baseline's distribution), for a training set of ``n_train`` examples."""
        steps = req.steps
        return cls(
            dataset=req.dataset,
            steps=steps,
            batch_size=min(req.batch_size, n_train),
            optimizer=req.optimizer,
            lr=float(req.lr) if req.lr is not None else DEFAULT_LR[req.optimizer],
            seed=req.seed,
            runs=("solved", *(b for i, b in enumerate(req.baselines) if b not in req.baselines[:i])),
            eval_every=max(1, int(eval_every) if eval_every else steps // 10),
            loss_every=max(1, steps // 100),
            progress_every=max(1, steps // 100),
            init=_request_init(request, sol),
        )

    def to_json(self) -> dict:
        return {
            "steps": self.steps,
            "batch_size": self.batch_size,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "momentum": SGD_MOMENTUM if self.optimizer == "sgd" else None,
            "seed": self.seed,
            "baselines": list(self.runs[1:]),
            "eval_every": self.eval_every,
            "loss_every": self.loss_every,
            "init": self.init,
        }
