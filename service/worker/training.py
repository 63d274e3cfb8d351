"""Validation trainings (contract section 4): train the solved network and baselines side by side.

:func:`run_validation` builds the network of the validated graph with the answer applied the way a
user applies it (``sigprop.client.torch.graph_from_module`` then ``apply``, see
:func:`sigprop.worker.models.build_solved`), builds each requested baseline on the same graph,
trains every run for ``steps`` steps on the same batches, and returns JSON-ready results:

* ``runs[name]`` for ``solved`` and each baseline (``he``: ReLU, Kaiming-normal fan-in weights,
  zero biases, unnormalized ``x + f(x)`` residual adds; ``eoc``: the Edge-of-Chaos answer for the
  request's activation, solved in-process and applied; ``plain``: the request's untransformed
  activation with PyTorch's default initialization and the graph's sum weights): training-loss
  and test-accuracy curves, final test accuracy and loss, per-layer weight-gradient norms at the
  first three steps and the last, empirical C values at initialization for orthogonal input pairs
  (TAT paper Appendix E.1) next to the answer's predicted global C map value, activation
  sparsity (sparsifying activations) and dead units (ReLU family) at initialization and at the
  end, wall time;
* ``summary``: the solved run's final test accuracy and loss against each baseline
  (``better``/``worse``/``tie`` with the numbers).

The measurements are in :mod:`sigprop.worker.measurements`; the typed results
(:class:`~sigprop.worker.results.ValidationResults`, one ``RunResult`` per run) and the JSON the API
stores for them in :mod:`sigprop.worker.results`; how every run trains is one :class:`TrainConfig`.

Importing this module needs PyTorch (the API process imports it only when torch is present).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..engine.graph.build import NetworkGraph, build_graph
from ..errors import SigpropError
from ..schemas.graph import Graph
from ..schemas.ops import AFFINE, CONCAT, SOURCE, SUM
from ..schemas.solve import Solution, SolveRequest
from .datasets import Dataset, load_dataset
from .inputs import DEFAULT_LR, SGD_MOMENTUM, TrainConfig, _as_graph, _as_solution, _training_config
from .measurements import activation_stats, c_values, evaluate, grad_norms, predicted_c0
from .models import RELU_FAMILY, SPARSE_ACTIVATIONS, build_model, build_solved, he_init
from .results import Curves, GradNorms, RunError, RunResult, ValidationResults, compare, finite

__all__ = ["run_validation", "Cancelled", "DEFAULT_LR", "compare", "input_mean_square", "TrainConfig"]

GRAD_NORM_STEPS = 3  # per-layer gradient norms are recorded at steps 0, 1, 2 and at the last step
STATS_BATCH = 512  # training examples for sparsity / dead-unit statistics
CURVE_TEST_MAX = 2048  # test examples evaluated at curve points (the final evaluation uses all)
_KERNEL_METHODS = ("tat", "dks", "eoc", "sparse_eoc")
_DEVICE_DATA_LIMIT = 1 << 30  # datasets up to 1 GiB live on the device; larger ones are moved per batch


class Cancelled(Exception):
    """Raised by :func:`run_validation` when ``cancelled()`` answers True."""


def _pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class _Data:
    """The dataset as tensors, on the device when it fits (``_DEVICE_DATA_LIMIT``)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    input_shape: tuple[int, ...]
    mean_square: float  # of the training inputs
    stats_x: torch.Tensor  # the batch activation statistics are taken on
    example: torch.Tensor  # a few training inputs, on the CPU, for tracing models
    n_classes: int
    device: torch.device


def _tensors(ds: Dataset, device: torch.device) -> _Data:
    nbytes = ds.x_train.nbytes + ds.x_test.nbytes
    where = device if nbytes <= _DEVICE_DATA_LIMIT else torch.device("cpu")
    x_train = torch.from_numpy(ds.x_train).to(where)
    return _Data(
        x_train,
        torch.from_numpy(ds.y_train).to(where),
        torch.from_numpy(ds.x_test).to(where),
        torch.from_numpy(ds.y_test).to(where),
        ds.input_shape,
        float(np.mean(ds.x_train.astype(np.float64) ** 2)),
        x_train[:STATS_BATCH].to(device),
        torch.from_numpy(ds.x_train[:8].copy()),
        ds.n_classes,
        device,
    )


# =============================================================================================
# Runs
# =============================================================================================


@dataclass
class _Run:
    """One network to train: the model, its node id -> module path map, and what to report."""

    name: str
    description: str
    model: nn.Module
    paths: dict[str, str]
    weighted: list[str]
    activations: list[str]
    activation: str
    solution: Solution | None = None
    input_scale: float = 1.0
    made: dict = field(default_factory=dict)


def input_mean_square(sol: Solution) -> float | None:
    """The mean squared input value the answer's analysis assumes, or None (no assumption).

    Kernel methods fix the pre-activation second moment of every layer at q* (1 unless the answer
    says otherwise); for TAT and DKS the first layer gets it from inputs with mean square
    (q* - sigma_b2) / sigma_w2, which is q* (sigma_w2 = 1, sigma_b2 = 0). EoC and sparse EoC plan
    the layer reading the input as q-preserving for inputs of mean square 1 (``sigma_w2`` = q*, no
    bias: docs/contract.md, "Edge of Chaos input"), so their inputs are at 1; sparse EoC needs it,
    its q* being stable from one side only. Geometric answers state it (``input_second_moment``)."""
    if sol.method == "geometric":
        return float(sol.input_second_moment) if sol.input_second_moment is not None else None
    if sol.method not in _KERNEL_METHODS:
        return None
    if sol.method in ("eoc", "sparse_eoc"):
        return 1.0
    q = float(sol.q_star) if sol.q_star is not None else 1.0
    sw2 = float(sol.sigma_w2) if sol.sigma_w2 else 1.0
    sb2 = float(sol.sigma_b2) if sol.sigma_b2 else 0.0
    target = (q - sb2) / sw2
    return target if target > 0 else q


def _input_scale(sol: Solution, mean_square: float) -> float:
    """The factor that gives the training inputs the mean squared value the answer assumes."""
    target = input_mean_square(sol)
    if target is None or mean_square <= 0 or not math.isfinite(mean_square):
        return 1.0
    return math.sqrt(target / mean_square)


def _apply_facts(built) -> dict:
    rep = built.report
    return {
        "complete": rep.complete,
        "activations": len(rep.activations),
        "layers": len(rep.layers),
        "sums": len(rep.sums),
        "warnings": list(rep.warnings),
        "notes": list(rep.notes) + list(built.notes),
    }


def _solved_run(
    name: str,
    description: str,
    net: NetworkGraph,
    sol: Solution,
    n_classes: int,
    example: torch.Tensor,
    seed: int,
    mean_square: float,
) -> _Run:
    torch.manual_seed(seed)
    built = build_solved(net, sol, n_classes, example, seed=seed)
    return _Run(
        name,
        description,
        built.model,
        built.paths,
        built.weighted,
        built.activations,
        sol.activation,
        sol,
        _input_scale(sol, mean_square),
        {"apply": _apply_facts(built)},
    )


def _make_run(
    name: str,
    net: NetworkGraph,
    sol: Solution,
    graph: Graph,
    n_classes: int,
    example: torch.Tensor,
    seed: int,
    init: str,
    mean_square: float,
) -> _Run:
    if name == "solved":
        return _solved_run(
            "solved",
            f"the answer ({sol.method}, {sol.activation}) applied with sigprop.client.torch.apply",
            net,
            sol,
            n_classes,
            example,
            seed,
            mean_square,
        )
    if name == "he":
        torch.manual_seed(seed)
        model = build_model(net, n_classes, activation="relu", residual="plain")
        he_init(model)
        return _Run(
            "he",
            "ReLU, Kaiming-normal (fan_in) weights, zero biases, unnormalized x + f(x) adds",
            model,
            model.paths,
            model.weighted,
            model.activations,
            "relu",
        )
    if name == "plain":
        torch.manual_seed(seed)
        model = build_model(net, n_classes)
        return _Run(
            "plain",
            f"untransformed {sol.activation}, PyTorch's default initialization",
            model,
            model.paths,
            model.weighted,
            model.activations,
            sol.activation,
        )
    if name == "eoc":
        from ..engine.solve import solve

        req = SolveRequest(graph=graph, method="eoc", activation=sol.activation, init=init)
        eoc_sol = solve(req)
        return _solved_run(
            "eoc",
            f"Edge of Chaos for {sol.activation} (sigma_w2 = {eoc_sol.sigma_w2:.6g}, "
            f"sigma_b2 = {eoc_sol.sigma_b2:.6g}), applied with sigprop.client.torch.apply",
            net,
            eoc_sol,
            n_classes,
            example,
            seed,
            mean_square,
        )
    raise SigpropError("invalid_request", f"unknown baseline {name!r}", "baselines are 'he', 'eoc' and 'plain'")


# =============================================================================================
# Training
# =============================================================================================


class _Batches:
    """Training batches, the same for every run: epochs reshuffled by a generator seeded from the seed."""

    def __init__(self, n_train: int, batch: int, seed: int):
        self.n_train, self.batch = n_train, batch
        self.rng = np.random.default_rng(seed + 1)
        self.order = np.empty(0, dtype=np.int64)
        self.pos = 0

    def next(self) -> torch.Tensor:
        if self.pos + self.batch > len(self.order):
            self.order = np.concatenate([self.order[self.pos :], self.rng.permutation(self.n_train)])
            self.pos = 0
        idx = torch.from_numpy(self.order[self.pos : self.pos + self.batch])
        self.pos += self.batch
        return idx


def _optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=SGD_MOMENTUM)


def _fit(
    run: _Run,
    model: nn.Module,
    data: _Data,
    cfg: TrainConfig,
    report: Callable[[str, int, float | None], None],
    cancelled: Callable[[], bool],
) -> Curves:
    """Train for ``cfg.steps`` steps (fewer when the training loss stops being finite)."""
    steps, device = cfg.steps, data.device
    opt = _optimizer(model, cfg)
    batches = _Batches(len(data.y_train), cfg.batch_size, cfg.seed)
    curves = Curves(cfg.loss_every, cfg.eval_every, min(len(data.y_test), CURVE_TEST_MAX))
    window = torch.zeros((), device=device)
    window_n = 0
    t_train = time.perf_counter()
    step = 0
    for step in range(steps):
        if cancelled():
            raise Cancelled(f"validation cancelled in run '{run.name}' at step {step}")
        idx = batches.next()
        xb = data.x_train[idx.to(data.x_train.device)].to(device, non_blocking=True) * run.input_scale
        yb = data.y_train[idx.to(data.y_train.device)].to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if step < GRAD_NORM_STEPS or step == steps - 1:
            curves.grad_norms.append(GradNorms(step, grad_norms(model, run.paths, run.weighted)))
        opt.step()
        window = window + loss.detach()  # summed on the device: no synchronization every step
        window_n += 1
        done = step + 1
        if done % cfg.loss_every == 0 or done == steps:
            curves.add_loss(done, float(window) / window_n)
            window = torch.zeros((), device=device)
            window_n = 0
        if curves.diverged_at is None and (done % cfg.eval_every == 0 or done == steps):
            n_eval = curves.examples
            curves.add_evaluation(
                done, *evaluate(model, data.x_test[:n_eval], data.y_test[:n_eval], run.input_scale, device)
            )
        if done % cfg.progress_every == 0 or done == steps or curves.diverged_at is not None:
            report(run.name, done, curves.last_loss)
        if curves.diverged_at is not None:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    curves.train_time_s = time.perf_counter() - t_train
    curves.steps_done = step + 1
    if curves.diverged_at is not None and (not curves.grad_norms or curves.grad_norms[-1].step != step):
        curves.grad_norms.append(GradNorms(step, grad_norms(model, run.paths, run.weighted)))
    return curves


def _train(
    run: _Run,
    data: _Data,
    cfg: TrainConfig,
    report: Callable[[str, int, float | None], None],
    cancelled: Callable[[], bool],
) -> RunResult:
    """Measure ``run`` at initialization, train it, and measure it again."""
    t0 = time.perf_counter()
    model = run.model.to(data.device)
    model.train()
    sol = run.solution
    c_q = (input_mean_square(sol) if sol is not None else None) or 1.0
    c_vals = c_values(model, run.paths, run.weighted, data.input_shape, c_q, predicted_c0(sol), data.device, cfg.seed)
    init_stats = activation_stats(model, run.paths, run.activations, data.stats_x * run.input_scale)
    curves = _fit(run, model, data, cfg, report, cancelled)
    accuracy, test_loss = evaluate(model, data.x_test, data.y_test, run.input_scale, data.device)
    final_stats = activation_stats(model, run.paths, run.activations, data.stats_x * run.input_scale)
    return RunResult(
        description=run.description,
        activation=run.activation,
        input_scale=run.input_scale,
        input_mean_square=data.mean_square * run.input_scale**2,
        made=run.made,
        solution=None
        if sol is None
        else {"key": sol.key, "method": sol.method, "activation": sol.activation, "targets": dict(sol.targets)},
        c_values=c_vals,
        curves=curves,
        final_test_accuracy=accuracy,
        final_test_loss=test_loss,
        init_stats=init_stats,
        final_stats=final_stats,
        stats_examples=len(data.stats_x),
        sparse=run.activation in SPARSE_ACTIVATIONS or (sol is not None and sol.method == "sparse_eoc"),
        relu_family=run.activation in RELU_FAMILY,
        predicted_sparsity=sol.sparsity if sol is not None else None,
        wall_time_s=time.perf_counter() - t0,
        parameters=int(sum(p.numel() for p in model.parameters())),
    )


# =============================================================================================
# Entry point
# =============================================================================================


@dataclass
class _Progress:
    """Reports progress over all runs to the caller's ``progress`` callback."""

    send: Callable[[dict], None]
    cfg: TrainConfig
    device: str

    def __call__(self, index: int, run: str, run_step: int, loss: float | None) -> None:
        steps, names = self.cfg.steps, list(self.cfg.runs)
        self.send(
            {
                "run": run,
                "run_index": index,
                "runs": names,
                "step": index * steps + run_step,
                "total": steps * len(names),
                "run_step": run_step,
                "run_total": steps,
                "loss": loss if loss is not None and math.isfinite(loss) else None,
                "device": self.device,
            }
        )


def _run_all(
    cfg: TrainConfig,
    net: NetworkGraph,
    sol: Solution,
    graph: Graph,
    data: _Data,
    progress: _Progress,
    cancelled: Callable[[], bool],
) -> dict[str, RunResult | RunError]:
    runs: dict[str, RunResult | RunError] = {}
    for i, name in enumerate(cfg.runs):
        if cancelled():
            raise Cancelled(f"validation cancelled before run '{name}'")
        progress(i, name, 0, None)
        t0 = time.perf_counter()
        try:
            run = _make_run(name, net, sol, graph, data.n_classes, data.example, cfg.seed, cfg.init, data.mean_square)
        except SigpropError as exc:
            if name == "solved":
                raise
            runs[name] = RunError(exc.code, exc.message, exc.hint)
            progress(i, name, cfg.steps, None)
            continue
        build_time = time.perf_counter() - t0
        res = _train(run, data, cfg, lambda run_name, step, loss, i=i: progress(i, run_name, step, loss), cancelled)
        res.build_time_s = build_time
        res.wall_time_s += build_time
        runs[name] = res
        del run
        if data.device.type == "cuda":
            torch.cuda.empty_cache()
    return runs


def _graph_facts(net: NetworkGraph) -> dict:
    return {
        "nodes": net.n,
        "depth": net.depth(),
        "weighted": net.count(AFFINE),
        "sums": net.count(SUM),
        "concats": net.count(CONCAT),
    }


def run_validation(
    request: dict,
    graph_dict: dict,
    solution: Solution,
    *,
    progress: Callable[[dict], None] = lambda p: None,
    cancelled: Callable[[], bool] = lambda: False,
    device: str | None = None,
    eval_every: int | None = None,
) -> dict:
    """Train the solved network and the requested baselines; return the results (module docstring).

    ``request`` is a validation request (its ``dataset``, ``steps``, ``batch_size``, ``optimizer``,
    ``lr``, ``seed``, ``baselines`` are used; ``solve.init`` picks the EOC baseline's weight
    distribution); ``graph_dict`` the graph that was solved (a ``sigprop.graph/v1`` dict or a
    template); ``solution`` the answer (a ``Solution``, its dict or JSON). ``progress`` is called
    with ``{"run", "run_index", "runs", "step", "total", "run_step", "run_total", "loss", "device"}``
    every few steps (``step`` counts steps over all runs, ``total`` = steps x runs); ``cancelled``
    is polled before every step and a True answer raises :class:`Cancelled`. ``device`` defaults
    to CUDA when available. ``eval_every`` (default steps // 10) spaces the test-accuracy curve.
    Raises ``SigpropError`` for a bad dataset, graph or answer.
    """
    t_start = time.perf_counter()
    req = _training_config(request)
    sol = _as_solution(solution)
    graph = _as_graph(graph_dict)
    net = build_graph(graph, default_activation=sol.activation)
    dev = _pick_device(device)
    if cancelled():
        raise Cancelled("validation cancelled before it started")

    input_shape = next(nd.shape for nd in net.nodes if nd.kind == SOURCE)
    ds = load_dataset(req.dataset, req.seed, input_shape=input_shape)
    cfg = TrainConfig.create(req, request, sol, len(ds.y_train), eval_every)
    data = _tensors(ds, dev)
    runs = _run_all(cfg, net, sol, graph, data, _Progress(progress, cfg, str(dev)), cancelled)
    results = ValidationResults(
        device=str(dev),
        device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        torch_version=torch.__version__,
        dataset=ds.describe(),
        config=cfg,
        solution={
            "key": sol.key,
            "method": sol.method,
            "activation": sol.activation,
            "targets": dict(sol.targets),
            "predicted_c0": predicted_c0(sol),
        },
        graph=_graph_facts(net),
        runs=runs,
        wall_time_s=time.perf_counter() - t_start,
    )
    return finite(results.to_json())
