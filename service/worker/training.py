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

Importing this module needs PyTorch (the API process imports it only when torch is present).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from ..client.torch import NormalizedSum, TransformedActivation
from ..engine.graph import NetworkGraph, build_graph
from ..engine.templates import expand_template
from ..errors import SigpropError
from ..schemas.graph import Graph, Template
from ..schemas.solve import Solution, SolveRequest
from ..schemas.validation import ValidationRequest
from .datasets import Dataset, load_dataset
from .models import RELU_FAMILY, SPARSE_ACTIVATIONS, build_model, build_solved, he_init

__all__ = ["run_validation", "Cancelled", "DEFAULT_LR", "compare", "input_mean_square"]

# Measured on digits with a depth-50 TReLU MLP: SGD (momentum 0.9) diverges at lr >= 0.01 and
# Adam is unstable at 1e-3, while 0.002 / 3e-4 train it to ~0.95 test accuracy in 300 steps.
DEFAULT_LR = {"sgd": 0.002, "adam": 3e-4}
SGD_MOMENTUM = 0.9
GRAD_NORM_STEPS = 3  # per-layer gradient norms are recorded at steps 0, 1, 2 and at the last step
C_PAIRS = 16  # orthogonal input pairs for the empirical C values
STATS_BATCH = 512  # training examples for sparsity / dead-unit statistics
CURVE_TEST_MAX = 2048  # test examples evaluated at curve points (the final evaluation uses all)
ACCURACY_TIE = 0.005  # |accuracy difference| at most this is a tie
LOSS_TIE = 0.01  # relative test-loss difference at most this is a tie
_KERNEL_METHODS = ("tat", "dks", "eoc", "sparse_eoc")
_TRAIN_FIELDS = ("dataset", "steps", "batch_size", "optimizer", "lr", "seed", "baselines")
_DEVICE_DATA_LIMIT = 1 << 30  # datasets up to 1 GiB live on the device; larger ones are moved per batch


class Cancelled(Exception):
    """Raised by :func:`run_validation` when ``cancelled()`` answers True."""


# =============================================================================================
# Inputs
# =============================================================================================

def _training_config(request: Any) -> ValidationRequest:
    """The training fields of a validation request (its solve/key part is the caller's business)."""
    if isinstance(request, ValidationRequest):
        data = request.model_dump()
    elif isinstance(request, Mapping):
        data = dict(request)
    else:
        raise SigpropError("invalid_request", f"the validation request is a {type(request).__name__}, not an object",
                           "send {\"solve\": {...}, \"dataset\": \"digits\", \"steps\": 200, ...}")
    fields = {k: data[k] for k in _TRAIN_FIELDS if k in data and data[k] is not None}
    try:
        return ValidationRequest.model_validate({**fields, "key": "0" * 64})
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "request"
        raise SigpropError("invalid_request", f"{where}: {first.get('msg', 'invalid value')}",
                           "steps >= 1, batch_size >= 1, optimizer 'sgd' or 'adam', lr > 0, baselines among "
                           "'he', 'eoc', 'plain'") from None


def _as_solution(solution: Any) -> Solution:
    if isinstance(solution, Solution):
        return solution
    try:
        if isinstance(solution, (str, bytes)):
            return Solution.model_validate_json(solution)
        if isinstance(solution, Mapping):
            return Solution.model_validate(dict(solution))
    except ValidationError as exc:
        raise SigpropError("invalid_request", f"the solution to validate is not a valid answer: {exc.errors()[0]['msg']}",
                           "validate an answer of POST /v1/solve") from None
    raise TypeError(f"solution must be a Solution, its JSON or a dict, not {type(solution).__name__}")


def _as_graph(graph: Any) -> Graph:
    if isinstance(graph, Graph):
        return graph
    if isinstance(graph, Template):
        return expand_template(graph)
    try:
        if isinstance(graph, Mapping) and "template" in graph:
            return expand_template(Template.model_validate(dict(graph)))
        return Graph.model_validate(graph)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "graph"
        raise SigpropError("invalid_graph", f"{where}: {first.get('msg', 'invalid value')}",
                           "give the graph that was solved (sigprop.graph/v1) or its template") from None


def _request_init(request: Any, solution: Solution) -> str:
    solve = request.get("solve") if isinstance(request, Mapping) else getattr(request, "solve", None)
    if isinstance(solve, Mapping) and solve.get("init") in ("orthogonal", "gaussian"):
        return solve["init"]
    if solve is not None and getattr(solve, "init", None) in ("orthogonal", "gaussian"):
        return solve.init
    return "gaussian" if any(la.distribution == "gaussian" for la in solution.layers) else "orthogonal"


def _pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# =============================================================================================
# Measurements
# =============================================================================================

def _predicted_c0(sol: Solution | None) -> float | None:
    if sol is None:
        return None
    if sol.network_c_f_0 is not None:
        return float(sol.network_c_f_0)
    if sol.c_map is not None and sol.c_map.c:
        return float(np.interp(0.0, sol.c_map.c, sol.c_map.global_))
    return None


PER_LOCATION_MIN_CHANNELS = 8


def _orthogonal_pairs(n_pairs: int, input_shape: tuple[int, ...], q: float, gen: torch.Generator) -> tuple[torch.Tensor, str]:
    """[2 n_pairs, *input_shape] float64 inputs with mean squared value ``q``; the two inputs of a
    pair are orthogonal at every location (over the channel axis) when there are at least
    ``PER_LOCATION_MIN_CHANNELS`` channels, else over all their values (an image with 1 or 3
    channels cannot be orthogonal per location; random patches then have cosine 0 on average)."""
    channels = input_shape[0]
    locations = math.prod(input_shape[1:]) if len(input_shape) > 1 else 1
    per_location = locations == 1 or channels >= PER_LOCATION_MIN_CHANNELS
    if not per_location:
        channels, locations = channels * locations, 1
    a = torch.randn(n_pairs, channels, locations, generator=gen, dtype=torch.float64)
    b = torch.randn(n_pairs, channels, locations, generator=gen, dtype=torch.float64)
    a = a / a.norm(dim=1, keepdim=True)
    b = b - (a * b).sum(1, keepdim=True) * a
    b = b / b.norm(dim=1, keepdim=True)
    x = torch.stack([a, b], 1).reshape(2 * n_pairs, channels, locations) * math.sqrt(channels * q)
    mode = "per_location" if per_location and locations > 1 else "whole_input"
    return x.reshape((2 * n_pairs,) + tuple(input_shape)), mode


def _pair_cosine(y: torch.Tensor) -> float:
    """Mean cosine between the two examples of each pair, per location for feature maps."""
    y = y.reshape(y.shape[0] // 2, 2, y.shape[1], -1)
    return float(F.cosine_similarity(y[:, 0], y[:, 1], dim=1).mean())


class _LeafTracer(torch.fx.Tracer):
    """Keeps sigprop's activation and sum modules whole (as the client's tracer does)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, (TransformedActivation, NormalizedSum)) or super().is_leaf_module(m, qualname)


class _Capture(torch.fx.Interpreter):
    """Runs a GraphModule and keeps the value entering ``site`` (an fx node)."""

    def __init__(self, gm: torch.fx.GraphModule, site: torch.fx.Node | None):
        super().__init__(gm)
        self.site = site
        self.captured: torch.Tensor | None = None

    def run_node(self, n):
        if n is self.site:
            self.captured = self.env[n.args[0]]
        return super().run_node(n)


def _c_values(model: nn.Module, paths: dict[str, str], weighted: list[str], input_shape, q: float,
              predicted: float | None, device: torch.device, seed: int) -> dict:
    """Empirical C values for orthogonal input pairs (c0 = 0) with mean squared value q (TAT paper
    Appendix E.1), at every weighted layer's output (per location for feature maps) and where the
    answer's global C map applies: the input of the last global average pooling (the Q/C map
    analysis treats pooling as the identity on per-location correlations; the pooled vector also
    mixes locations), else the network output."""
    net = copy.deepcopy(model).to(device=device, dtype=torch.float64).eval()
    gm = net if isinstance(net, torch.fx.GraphModule) else torch.fx.GraphModule(net, _LeafTracer().trace(net))
    pools = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "mean"]
    site = pools[-1] if pools else None
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for nid in weighted:
        hooks.append(gm.get_submodule(paths[nid]).register_forward_hook(
            lambda _m, _i, out, nid=nid: seen.__setitem__(nid, out.detach())))
    gen = torch.Generator().manual_seed(10_000 + seed)
    x, mode = _orthogonal_pairs(C_PAIRS, tuple(input_shape), q, gen)
    runner = _Capture(gm, site)
    try:
        with torch.no_grad():
            out = runner.run(x.to(device))
    finally:
        for h in hooks:
            h.remove()
    layers = {nid: _pair_cosine(seen[nid]) for nid in weighted if nid in seen}
    logits = _pair_cosine(out)
    emp = _pair_cosine(runner.captured) if runner.captured is not None else logits
    res = {"input_c": 0.0, "pairs": C_PAIRS, "orthogonal": mode, "q": q, "layers": layers, "logits": logits,
           "output": emp, "output_site": "global_avg_pool input" if site is not None else "network output",
           "predicted_output": predicted}
    if predicted is not None:
        res["deviation"] = emp - predicted
    return res


def _active(module: nn.Module, z: torch.Tensor) -> torch.Tensor | None:
    """Where a ReLU-family activation is on its active (non-flat) side, or None for other activations."""
    if isinstance(module, (nn.ReLU, nn.LeakyReLU)):
        return z > 0
    if isinstance(module, TransformedActivation) and module.name in RELU_FAMILY:
        u = z * module.input_scale + module.input_shift
        tau = module.params.get("tau", 0.0)
        if module.name in ("relu", "leaky_relu"):
            return u > 0
        if module.name in ("relu_tau", "crelu"):
            return u > tau
        return u.abs() > tau
    return None


def _activation_stats(model: nn.Module, paths: dict[str, str], activations: list[str], x: torch.Tensor) -> dict:
    """Fraction of exact zeros in the activation outputs, and dead units (ReLU family: never on the
    active side for any example of the batch, at any location), overall and per layer."""
    zeros = total = dead = units = 0
    per_layer: dict[str, float] = {}
    zero_layer: dict[str, float] = {}
    hooks = []

    def hook(nid, module, inputs, out):
        nonlocal zeros, total, dead, units
        z = int((out == 0).sum())
        zeros += z
        total += out.numel()
        zero_layer[nid] = z / out.numel()
        act = _active(module, inputs[0])
        if act is not None:
            alive = act.transpose(0, 1).reshape(act.shape[1], -1).any(dim=1)
            d = int((~alive).sum())
            dead += d
            units += alive.numel()
            per_layer[nid] = d / alive.numel()

    for nid in activations:
        mod = model.get_submodule(paths[nid])
        hooks.append(mod.register_forward_hook(lambda m, i, o, nid=nid: hook(nid, m, i, o)))
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return {"zero_fraction": zeros / total if total else None, "zero_per_layer": zero_layer,
            "dead_fraction": dead / units if units else None, "dead_per_layer": per_layer}


def _grad_norms(model: nn.Module, paths: dict[str, str], weighted: list[str]) -> dict[str, float]:
    out = {}
    for nid in weighted:
        g = model.get_submodule(paths[nid]).weight.grad
        out[nid] = float(torch.linalg.vector_norm(g)) if g is not None else None
    return out


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, scale: float, device: torch.device,
              chunk: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) in eval mode."""
    was = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    try:
        with torch.no_grad():
            for i in range(0, len(y), chunk):
                xb = x[i:i + chunk].to(device, non_blocking=True) * scale
                yb = y[i:i + chunk].to(device, non_blocking=True)
                out = model(xb)
                loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
                correct += int((out.argmax(1) == yb).sum())
    finally:
        model.train(was)
    return correct / len(y), loss_sum / len(y)


# =============================================================================================
# Runs
# =============================================================================================

class _Run:
    """One network to train: the model, its node id -> module path map, and what to report."""

    def __init__(self, name: str, description: str, model: nn.Module, paths: dict[str, str], weighted: list[str],
                 activations: list[str], activation: str, solution: Solution | None = None, input_scale: float = 1.0,
                 extra: dict | None = None):
        self.name, self.description, self.model, self.paths = name, description, model, paths
        self.weighted, self.activations, self.activation = weighted, activations, activation
        self.solution, self.input_scale, self.extra = solution, input_scale, dict(extra or {})


def input_mean_square(sol: Solution) -> float | None:
    """The mean squared input value the answer's analysis assumes, or None (no assumption).

    Kernel methods fix the pre-activation second moment of every layer at q* (1 unless the answer
    says otherwise); the first layer gets it from inputs with mean square (q* - sigma_b2) / sigma_w2,
    which is q* for TAT and DKS (sigma_w2 = 1, sigma_b2 = 0). Sparse EoC needs this: its q* is
    stable only from one side, and inputs at q* instead (pre-activations at sigma_w2 q* + sigma_b2)
    can sit on the unstable side. Geometric answers state it (``input_second_moment``)."""
    if sol.method == "geometric":
        return float(sol.input_second_moment) if sol.input_second_moment is not None else None
    if sol.method not in _KERNEL_METHODS:
        return None
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
    return {"complete": rep.complete, "activations": len(rep.activations), "layers": len(rep.layers),
            "sums": len(rep.sums), "warnings": list(rep.warnings), "notes": list(rep.notes) + list(built.notes)}


def _solved_run(name: str, description: str, net: NetworkGraph, sol: Solution, n_classes: int, example: torch.Tensor,
                seed: int, mean_square: float) -> _Run:
    torch.manual_seed(seed)
    built = build_solved(net, sol, n_classes, example, seed=seed)
    return _Run(name, description, built.model, built.paths, built.weighted, built.activations, sol.activation, sol,
                _input_scale(sol, mean_square), {"apply": _apply_facts(built)})


def _make_run(name: str, net: NetworkGraph, sol: Solution, graph: Graph, n_classes: int, example: torch.Tensor,
              seed: int, init: str, mean_square: float) -> _Run:
    if name == "solved":
        return _solved_run("solved", f"the answer ({sol.method}, {sol.activation}) applied with "
                           "sigprop.client.torch.apply", net, sol, n_classes, example, seed, mean_square)
    if name == "he":
        torch.manual_seed(seed)
        model = build_model(net, n_classes, activation="relu", residual="plain")
        he_init(model)
        return _Run("he", "ReLU, Kaiming-normal (fan_in) weights, zero biases, unnormalized x + f(x) adds", model,
                    model.paths, model.weighted, model.activations, "relu")
    if name == "plain":
        torch.manual_seed(seed)
        model = build_model(net, n_classes)
        return _Run("plain", f"untransformed {sol.activation}, PyTorch's default initialization", model, model.paths,
                    model.weighted, model.activations, sol.activation)
    if name == "eoc":
        from ..engine.solve import solve
        req = SolveRequest(graph=graph, method="eoc", activation=sol.activation, init=init)
        eoc_sol = solve(req)
        return _solved_run("eoc", f"Edge of Chaos for {sol.activation} (sigma_w2 = {eoc_sol.sigma_w2:.6g}, "
                           f"sigma_b2 = {eoc_sol.sigma_b2:.6g}), applied with sigprop.client.torch.apply",
                           net, eoc_sol, n_classes, example, seed, mean_square)
    raise SigpropError("invalid_request", f"unknown baseline {name!r}", "baselines are 'he', 'eoc' and 'plain'")


def _train(run: _Run, ds_t: dict, cfg: ValidationRequest, lr: float, device: torch.device, eval_every: int,
           loss_every: int, progress_every: int, report: Callable[[str, int, float | None], None],
           cancelled: Callable[[], bool], stats_x: torch.Tensor) -> dict:
    t0 = time.perf_counter()
    model = run.model.to(device)
    model.train()
    res: dict[str, Any] = {"description": run.description, "activation": run.activation,
                           "input_scale": run.input_scale,
                           "input_mean_square": ds_t["mean_square"] * run.input_scale ** 2, **run.extra}
    if run.solution is not None:
        res["solution"] = {"key": run.solution.key, "method": run.solution.method, "activation": run.solution.activation,
                           "targets": dict(run.solution.targets)}
    # -- at initialization ---------------------------------------------------------------------
    c_q = (input_mean_square(run.solution) if run.solution is not None else None) or 1.0
    res["c_values"] = _c_values(model, run.paths, run.weighted, ds_t["input_shape"], c_q,
                                _predicted_c0(run.solution), device, cfg.seed)
    init_stats = _activation_stats(model, run.paths, run.activations, stats_x * run.input_scale)
    x_tr, y_tr, x_te, y_te = ds_t["x_train"], ds_t["y_train"], ds_t["x_test"], ds_t["y_test"]
    n_train = len(y_tr)
    batch = min(cfg.batch_size, n_train)
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM)
    rng = np.random.default_rng(cfg.seed + 1)  # the same batches for every run
    order = np.empty(0, dtype=np.int64)
    pos = 0
    loss_steps, loss_values, acc_steps, acc_values, test_loss_values = [], [], [], [], []
    grad_norms: list[dict] = []
    window = torch.zeros((), device=device)
    window_n = 0
    last_loss: float | None = None
    diverged_at: int | None = None
    steps = cfg.steps
    t_train = time.perf_counter()
    step = 0
    for step in range(steps):
        if cancelled():
            raise Cancelled(f"validation cancelled in run '{run.name}' at step {step}")
        if pos + batch > len(order):
            order = np.concatenate([order[pos:], rng.permutation(n_train)])
            pos = 0
        idx = torch.from_numpy(order[pos:pos + batch])
        pos += batch
        xb = x_tr[idx.to(x_tr.device)].to(device, non_blocking=True) * run.input_scale
        yb = y_tr[idx.to(y_tr.device)].to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if step < GRAD_NORM_STEPS or step == steps - 1:
            grad_norms.append({"step": step, "norms": _grad_norms(model, run.paths, run.weighted)})
        opt.step()
        window = window + loss.detach()
        window_n += 1
        done = step + 1
        if done % loss_every == 0 or done == steps:
            last_loss = float(window) / window_n
            loss_steps.append(done)
            loss_values.append(last_loss)
            window = torch.zeros((), device=device)
            window_n = 0
            if not math.isfinite(last_loss):
                diverged_at = done
        if diverged_at is None and (done % eval_every == 0 or done == steps):
            n_eval = min(len(y_te), CURVE_TEST_MAX)
            acc, tl = _evaluate(model, x_te[:n_eval], y_te[:n_eval], run.input_scale, device)
            acc_steps.append(done)
            acc_values.append(acc)
            test_loss_values.append(tl)
        if done % progress_every == 0 or done == steps or diverged_at is not None:
            report(run.name, done, last_loss)
        if diverged_at is not None:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_time = time.perf_counter() - t_train
    if diverged_at is not None and (not grad_norms or grad_norms[-1]["step"] != step):
        grad_norms.append({"step": step, "norms": _grad_norms(model, run.paths, run.weighted)})
    # -- at the end ----------------------------------------------------------------------------
    acc, tl = _evaluate(model, x_te, y_te, run.input_scale, device)
    final_stats = _activation_stats(model, run.paths, run.activations, stats_x * run.input_scale)
    res.update({
        "steps_done": step + 1,
        "diverged": diverged_at is not None,
        "diverged_at": diverged_at,
        "loss": {"steps": loss_steps, "values": loss_values, "every": loss_every,
                 "what": "mean training cross-entropy over the steps since the previous point"},
        "test_accuracy": {"steps": acc_steps, "values": acc_values, "test_loss": test_loss_values,
                          "examples": min(len(y_te), CURVE_TEST_MAX), "every": eval_every},
        "final_test_accuracy": acc,
        "final_test_loss": tl,
        "final_train_loss": last_loss,
        "grad_norms": grad_norms,
    })
    sparse = run.activation in SPARSE_ACTIVATIONS or (run.solution is not None and run.solution.method == "sparse_eoc")
    if sparse:
        res["sparsity"] = {"init": init_stats["zero_fraction"], "final": final_stats["zero_fraction"],
                           "predicted": run.solution.sparsity if run.solution is not None else None,
                           "init_per_layer": init_stats["zero_per_layer"],
                           "final_per_layer": final_stats["zero_per_layer"],
                           "what": "fraction of exact zeros in the activation outputs on a training batch"}
    if run.activation in RELU_FAMILY:
        res["dead_units"] = {"init": init_stats["dead_fraction"], "final": final_stats["dead_fraction"],
                             "final_per_layer": final_stats["dead_per_layer"],
                             "what": "fraction of units (features/channels) never on the active side for a batch "
                                     f"of {len(stats_x)} training examples"}
    res["train_time_s"] = train_time
    res["wall_time_s"] = time.perf_counter() - t0
    res["parameters"] = int(sum(p.numel() for p in model.parameters()))
    return res


# =============================================================================================
# Summary
# =============================================================================================

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
        "solved_accuracy": sa, "baseline_accuracy": ba,
        "accuracy_difference": sa - ba if sa is not None and ba is not None else None,
        "loss": _verdict(sl, bl, False, LOSS_TIE, True),
        "solved_loss": sl, "baseline_loss": bl,
        "loss_difference": sl - bl if sl is not None and bl is not None else None,
    }


def _summary(runs: dict) -> dict:
    solved = runs.get("solved", {})
    out: dict[str, Any] = {"solved": {"final_test_accuracy": solved.get("final_test_accuracy"),
                                      "final_test_loss": solved.get("final_test_loss")},
                           "baselines": {}, "text": []}
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
        out["text"].append(f"solved vs {name}: test accuracy {f(c['solved_accuracy'])} vs {f(c['baseline_accuracy'])} "
                           f"({c['accuracy']}), test loss {f(c['solved_loss'])} vs {f(c['baseline_loss'])} ({c['loss']})")
    out["text"] = "; ".join(out["text"])
    return out


def _finite(obj):
    """JSON-safe results: non-finite floats become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return _finite(obj.item())
    return obj


# =============================================================================================
# Entry point
# =============================================================================================

def _tensors(ds: Dataset, device: torch.device) -> dict:
    nbytes = ds.x_train.nbytes + ds.x_test.nbytes
    where = device if nbytes <= _DEVICE_DATA_LIMIT else torch.device("cpu")
    return {"x_train": torch.from_numpy(ds.x_train).to(where), "y_train": torch.from_numpy(ds.y_train).to(where),
            "x_test": torch.from_numpy(ds.x_test).to(where), "y_test": torch.from_numpy(ds.y_test).to(where),
            "input_shape": ds.input_shape, "mean_square": float(np.mean(ds.x_train.astype(np.float64) ** 2))}


def run_validation(request: dict, graph_dict: dict, solution: Solution, *,
                   progress: Callable[[dict], None] = lambda p: None,
                   cancelled: Callable[[], bool] = lambda: False,
                   device: str | None = None,
                   eval_every: int | None = None) -> dict:
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
    cfg = _training_config(request)
    sol = _as_solution(solution)
    graph = _as_graph(graph_dict)
    net = build_graph(graph, default_activation=sol.activation)
    dev = _pick_device(device)
    if cancelled():
        raise Cancelled("validation cancelled before it started")

    input_shape = next(nd.shape for nd in net.nodes if nd.op == "input")
    ds = load_dataset(cfg.dataset, cfg.seed, input_shape=input_shape)
    lr = float(cfg.lr) if cfg.lr is not None else DEFAULT_LR[cfg.optimizer]
    names = ["solved"] + [b for i, b in enumerate(cfg.baselines) if b not in cfg.baselines[:i]]
    steps = cfg.steps
    total = steps * len(names)
    eval_every = max(1, int(eval_every) if eval_every else steps // 10)
    loss_every = max(1, steps // 100)
    progress_every = max(1, steps // 100)
    init = _request_init(request, sol)

    ds_t = _tensors(ds, dev)
    mean_square = ds_t["mean_square"]
    stats_x = ds_t["x_train"][:STATS_BATCH].to(dev)
    example = torch.from_numpy(ds.x_train[:8].copy())

    def reporter(index: int):
        def report(run: str, run_step: int, loss: float | None) -> None:
            progress({"run": run, "run_index": index, "runs": names, "step": index * steps + run_step, "total": total,
                      "run_step": run_step, "run_total": steps,
                      "loss": loss if loss is not None and math.isfinite(loss) else None, "device": str(dev)})
        return report

    runs: dict[str, dict] = {}
    for i, name in enumerate(names):
        if cancelled():
            raise Cancelled(f"validation cancelled before run '{name}'")
        progress({"run": name, "run_index": i, "runs": names, "step": i * steps, "total": total, "run_step": 0,
                  "run_total": steps, "loss": None, "device": str(dev)})
        t0 = time.perf_counter()
        try:
            run = _make_run(name, net, sol, graph, ds.n_classes, example, cfg.seed, init, mean_square)
        except SigpropError as exc:
            if name == "solved":
                raise
            runs[name] = {"error": {"code": exc.code, "message": exc.message, "hint": exc.hint}}
            reporter(i)(name, steps, None)
            continue
        build_time = time.perf_counter() - t0
        res = _train(run, ds_t, cfg, lr, dev, eval_every, loss_every, progress_every, reporter(i), cancelled,
                     stats_x)
        res["build_time_s"] = build_time
        res["wall_time_s"] += build_time
        runs[name] = res
        del run
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    results = {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "dataset": ds.describe(),
        "config": {"steps": steps, "batch_size": min(cfg.batch_size, len(ds.y_train)), "optimizer": cfg.optimizer,
                   "lr": lr, "momentum": SGD_MOMENTUM if cfg.optimizer == "sgd" else None, "seed": cfg.seed,
                   "baselines": names[1:], "eval_every": eval_every, "loss_every": loss_every,
                   "init": init},
        "solution": {"key": sol.key, "method": sol.method, "activation": sol.activation, "targets": dict(sol.targets),
                     "predicted_c0": _predicted_c0(sol)},
        "graph": {"nodes": net.n, "depth": net.depth(), "weighted": sum(1 for nd in net.nodes if nd.op in ("dense", "conv")),
                  "sums": sum(1 for nd in net.nodes if nd.op == "sum"),
                  "concats": sum(1 for nd in net.nodes if nd.op == "concat")},
        "runs": runs,
        "summary": _summary(runs),
        "wall_time_s": time.perf_counter() - t_start,
    }
    return _finite(results)
