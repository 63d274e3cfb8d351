"""Character-level language modelling validations (``"task": "charlm"``): a solved transformer and
its comparison arms trained side by side on Python's standard-library sources.

The question is the one of "Deep Transformers without Shortcuts: Modifying Self-attention for
Faithful Signal Propagation" (He, Martens et al., arXiv:2302.10322, section 5): does a skipless,
normalization-free transformer with E-SPA attention and TAT activations train like a standard one?
The paper reports that with shortcuts but no normalization such a network trains about as fast as
the standard pre-LN transformer, and without shortcuts it reaches the standard training loss after
about 5x more steps. The arms (``arms`` of the request, ``sigprop.worker.charlm_plan``):

``solved``
    the validated graph (the ``transformer`` template as solved: e.g. skipless, normalization-free,
    E-SPA + TAT leaky_relu) with the answer applied as users apply it (``graph_from_module`` then
    ``sigprop.client.torch.apply``, through ``sigprop.worker.models.build_solved``);
``shortcuts``
    the same template with ``shortcuts=true, norms=false``, solved in-process with the same method,
    activation, targets and attention shaping, and applied the same way;
``standard``
    the same template with ``shortcuts=true, norms=true``: pre-LN blocks with plain ``x + f(x)``
    adds, ReLU (``nn.TransformerEncoderLayer``'s default), plain causal softmax attention, PyTorch's
    default initialization, and a final LayerNorm before the head (as GPT-2's ``ln_f``);
``hf_gpt2``, ``hf_gpt2_keep``, ``hf_gpt2_norm_free``
    HuggingFace's ``GPT2LMHeadModel`` of the template's size: stock, and the two recipes of issue 36
    solved and applied (``sigprop.worker.charlm_hf``; they call the model, not ``CharLM`` below).

Every arm is ``embedding -> graph body -> head``: an ``nn.Embedding(256, width)`` of the corpus
bytes, whose N(0, 1) init gives every token q = 1 and distinct bytes nearly orthogonal vectors (the
answer's orthonormal-token input), no positional embedding (causal attention, and E-SPA's bias,
carry position), and an ``nn.Linear(width, 256)`` head with PyTorch's default init. All arms train
for the same steps on the same batches (random windows of ``seq_len + 1`` bytes of the training
text) with Adam (default lr 1e-3), a linear warm-up over the first 5% of steps then cosine decay
to zero, and gradient clipping at norm 1 (GPT-style practice, the same for every arm).

Recorded per arm: the running training loss (mean next-byte cross-entropy, nats), the loss and
next-byte accuracy on fixed validation windows every ``eval_every`` steps, and at the end the loss
on fixed training windows and on the validation windows (``final_train_loss``,
``final_validation_loss``; ``final_test_loss``/``final_test_accuracy`` are the validation numbers,
so the summary and the dashboard read them like a classification's), weight-gradient norms per
layer at the first steps and the last.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..engine.graph.build import build_graph
from ..errors import SigpropError
from ..schemas.graph import Graph, Template
from ..schemas.solve import Solution, SolveRequest
from .charlm_corpus import VOCAB_SIZE, Corpus, load_corpus
from .charlm_hf import HF_ARMS, make_hf_arm
from .charlm_plan import CharLMPlan, TransformerParams, plan_charlm
from .inputs import _as_graph, _as_solution, _training_config
from .measurements import grad_norms
from .models import GraphModel, build_model, build_solved
from .results import compare, finite
from .training import _apply_facts

__all__ = ["run_charlm_validation", "CharLM", "CharLMConfig", "DEFAULT_CHARLM_LR", "Cancelled"]

DEFAULT_CHARLM_LR = {"adam": 1e-3, "sgd": 0.05}
SGD_MOMENTUM = 0.9
WARMUP_FRACTION = 0.05
CLIP_NORM = 1.0
EVAL_WINDOWS = 64  # fixed windows of the validation (and of the training) text evaluated
EVAL_POINTS = 20  # validation-loss points along the training
LOSS_POINTS = 100  # training-loss points
GRAD_NORM_STEPS = 3
LN2 = math.log(2.0)


class Cancelled(Exception):
    """Raised when ``cancelled()`` answers True."""


class CharLM(nn.Module):
    """``embedding -> body -> (final LayerNorm) -> head`` over byte tokens (module docstring)."""

    def __init__(self, body: GraphModel, width: int, final_norm: bool = False, vocab: int = VOCAB_SIZE):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)  # N(0, 1): q = 1 per token
        self.body = body
        self.final_norm = nn.LayerNorm(width) if final_norm else nn.Identity()
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(self.body(self.embed(tokens))))


@dataclass(frozen=True)
class CharLMConfig:
    """How every arm of one charlm validation trains."""

    steps: int
    batch_size: int
    seq_len: int
    optimizer: str
    lr: float
    seed: int
    arms: tuple[str, ...]
    warmup_steps: int
    clip_norm: float
    eval_every: int
    loss_every: int
    eval_windows: int

    def to_json(self) -> dict:
        out = asdict(self)
        out["arms"] = list(self.arms)
        out["schedule"] = "linear warm-up, then cosine decay to 0"
        out["momentum"] = SGD_MOMENTUM if self.optimizer == "sgd" else None
        return out


def _config(req, plan: CharLMPlan) -> CharLMConfig:
    steps = plan.steps
    return CharLMConfig(
        steps=steps,
        batch_size=plan.batch_size,
        seq_len=plan.params.seq_len,
        optimizer=req.optimizer,
        lr=float(req.lr) if req.lr is not None else DEFAULT_CHARLM_LR[req.optimizer],
        seed=req.seed,
        arms=plan.arms,
        warmup_steps=max(1, int(round(WARMUP_FRACTION * steps))),
        clip_norm=CLIP_NORM,
        eval_every=max(1, steps // EVAL_POINTS),
        loss_every=max(1, steps // LOSS_POINTS),
        eval_windows=EVAL_WINDOWS,
    )


# =============================================================================================
# Arms
# =============================================================================================


@dataclass
class _Arm:
    name: str
    description: str
    model: CharLM
    made: dict
    solution: dict | None
    paths: dict[str, str]  # graph node id -> module path in model.body
    weighted: list[str]


def _solve_request(request: dict, sol: Solution, template: dict) -> SolveRequest:
    """The solve request of the ``shortcuts`` arm: the validated one's (or the answer's method,
    activation, targets and attention) with the template's graph."""
    return SolveRequest.model_validate({**_solve_body(request, sol), "graph": template})


def _solve_body(request: dict, sol: Solution) -> dict:
    """The validated solve request's fields but its graph (or the answer's method, activation,
    targets and attention shaping)."""
    base = request.get("solve_request") or request.get("solve")
    if isinstance(base, dict):
        body = {k: v for k, v in base.items() if k != "graph"}
    else:
        body = {"method": sol.method, "activation": sol.activation, "targets": dict(sol.targets)}
        att = getattr(sol, "attention", None) or (sol.model_extra or {}).get("attention")
        if att is not None:
            shaping = att.get("shaping") if isinstance(att, dict) else att.shaping
            body["attention"] = {"shaping": shaping}
    return body


def _template_graph(template: dict) -> Graph:
    from ..engine.templates.expand import expand_template
    from ..settings import offline_limits

    return expand_template(Template.model_validate(template), max_nodes=offline_limits().max_nodes)


def _solved_arm(name: str, description: str, graph: Graph, sol: Solution, params: TransformerParams, seed: int) -> _Arm:
    """The graph's model with ``sol`` applied the way a user applies it: ``graph_from_module`` then
    ``sigprop.client.torch.apply`` (``models.build_solved``), inside the embedding and head."""
    torch.manual_seed(seed)
    net = build_graph(graph, default_activation=sol.activation)
    example = torch.randn(2, params.seq_len, params.width, generator=torch.Generator().manual_seed(seed))
    built = build_solved(net, sol, None, example, seed=seed)
    lm = CharLM(built.model, params.width)
    facts = {"key": sol.key, "method": sol.method, "activation": sol.activation, "targets": dict(sol.targets)}
    made = _apply_facts(built)
    made["attention"] = {n.split("'")[1]: n.rsplit(", ", 1)[-1] for n in made["notes"] if n.startswith("attention '")}
    return _Arm(name, description, lm, {"apply": made}, facts, built.paths, built.weighted)


def _make_arm(name: str, request: dict, graph: Graph, sol: Solution, params: TransformerParams, seed: int) -> _Arm:
    if name == "solved":
        what = f"{'with' if params.shortcuts else 'without'} shortcuts, {'with' if params.norms else 'no'} norms"
        return _solved_arm(
            "solved", f"the answer ({sol.method}, {sol.activation}; {what}) applied", graph, sol, params, seed
        )
    if name == "shortcuts":
        template = params.template(shortcuts=True, norms=False)
        from ..engine.solve import solve

        other = solve(_solve_request(request, sol, template))
        return _solved_arm(
            "shortcuts",
            f"the same transformer with shortcuts, normalization-free, solved ({other.method}, {other.activation}) "
            "and applied",
            _template_graph(template),
            other,
            params,
            seed,
        )
    if name == "paper_schedule":
        # the validated graph again, its attention on the paper's schedule (issue 37): what the
        # joint schedule changes, on the same batches
        from ..engine.solve import solve

        body = _solve_body(request, sol)
        attention = body.get("attention")
        if not isinstance(attention, dict) or attention.get("shaping") not in ("e-spa", "u-spa"):
            raise SigpropError(
                "invalid_request",
                "arm 'paper_schedule' needs a solution whose attention is shaped by e-spa or u-spa",
                'validate a transformer solved with "attention": {"shaping": "e-spa"}, or drop the arm',
            )
        graph_body = {**body, "attention": {**attention, "schedule": "paper"}, "graph": params.template()}
        other = solve(SolveRequest.model_validate(graph_body))
        return _solved_arm(
            "paper_schedule",
            f"the same transformer, its attention on the paper's schedule ({attention['shaping']}, "
            "moved by attention alone), solved and applied",
            _template_graph(params.template()),
            other,
            params,
            seed,
        )
    if name == "standard":
        torch.manual_seed(seed)
        net = build_graph(_template_graph(params.template(shortcuts=True, norms=True)), default_activation="relu")
        body = build_model(net, None, activation="relu", residual="plain")
        return _Arm(
            "standard",
            "standard pre-LN transformer: x + f(x) shortcuts, LayerNorm, ReLU, plain causal attention, "
            "PyTorch's default initialization, final LayerNorm",
            CharLM(body, params.width, final_norm=True),
            {},
            None,
            body.paths,
            body.weighted,
        )
    if name in HF_ARMS:
        model, description, made, facts, paths, weighted = make_hf_arm(
            name, _solve_body(request, sol), params, seed, VOCAB_SIZE
        )
        return _Arm(name, description, model, made, facts, paths, weighted)
    raise SigpropError(
        "invalid_request",
        f"unknown arm {name!r}",
        f"arms are 'solved', 'shortcuts', 'standard', 'paper_schedule', {', '.join(HF_ARMS)}",
    )


# =============================================================================================
# Training
# =============================================================================================


def _windows(text: torch.Tensor, starts: np.ndarray, length: int) -> torch.Tensor:
    idx = torch.from_numpy(starts[:, None] + np.arange(length + 1)[None, :])
    return text[idx.to(text.device)].long()


def _fixed_starts(n: int, length: int, count: int) -> np.ndarray:
    """``count`` window starts spread evenly over a text of ``n`` bytes."""
    return np.linspace(0, n - length - 2, count).astype(np.int64)


def evaluate_lm(model: CharLM, windows: torch.Tensor, chunk: int = 64) -> tuple[float, float]:
    """(mean next-byte cross-entropy in nats, next-byte accuracy) over ``windows``, in eval mode."""
    was = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    try:
        with torch.no_grad():
            for i in range(0, len(windows), chunk):
                w = windows[i : i + chunk]
                logits = model(w[:, :-1])
                target = w[:, 1:]
                loss_sum += float(
                    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
                )
                correct += int((logits.argmax(-1) == target).sum())
                count += target.numel()
    finally:
        model.train(was)
    return loss_sum / count, correct / count


def _lr_lambda(cfg: CharLMConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


@dataclass
class _Data:
    train: torch.Tensor
    train_eval: torch.Tensor
    validation: torch.Tensor
    device: torch.device


def _fit(arm: _Arm, data: _Data, cfg: CharLMConfig, report, cancelled) -> dict:
    model = arm.model.to(data.device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (
        torch.optim.Adam(params, lr=cfg.lr)
        if cfg.optimizer == "adam"
        else torch.optim.SGD(params, lr=cfg.lr, momentum=SGD_MOMENTUM)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    rng = np.random.default_rng(cfg.seed + 1)  # the same batches for every arm
    n_train = len(data.train)
    loss_steps, loss_values, val_steps, val_values, val_acc, grads = [], [], [], [], [], []
    window, window_n, diverged_at, done = 0.0, 0, None, 0
    body = model.body
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        if cancelled():
            raise Cancelled(f"validation cancelled in arm '{arm.name}' at step {step}")
        batch = _windows(data.train, rng.integers(0, n_train - cfg.seq_len - 1, cfg.batch_size), cfg.seq_len)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step < GRAD_NORM_STEPS or step == cfg.steps - 1:
            grads.append({"step": step, "norms": grad_norms(body, arm.paths, arm.weighted)})
        torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
        opt.step()
        sched.step()
        value = float(loss.detach())
        window += value
        window_n += 1
        done = step + 1
        if not math.isfinite(value):
            diverged_at = done
        if done % cfg.loss_every == 0 or done == cfg.steps or diverged_at is not None:
            loss_steps.append(done)
            loss_values.append(window / window_n)
            window, window_n = 0.0, 0
        if diverged_at is None and (done % cfg.eval_every == 0 or done == cfg.steps):
            v_loss, v_acc = evaluate_lm(model, data.validation)
            val_steps.append(done)
            val_values.append(v_loss)
            val_acc.append(v_acc)
        report(arm.name, done, loss_values[-1] if loss_values else None)
        if diverged_at is not None:
            break
    train_time = time.perf_counter() - t0
    final_train, _ = evaluate_lm(model, data.train_eval)
    final_val, final_acc = evaluate_lm(model, data.validation)
    res = {
        "description": arm.description,
        **arm.made,
        "steps_done": done,
        "diverged": diverged_at is not None,
        "diverged_at": diverged_at,
        "loss": {
            "steps": loss_steps,
            "values": loss_values,
            "every": cfg.loss_every,
            "what": "mean training next-byte cross-entropy (nats) over the steps since the previous point",
        },
        "validation_loss": {
            "steps": val_steps,
            "values": val_values,
            "accuracy": val_acc,
            "every": cfg.eval_every,
            "what": f"next-byte cross-entropy (nats) on {len(data.validation)} fixed validation windows",
        },
        "test_accuracy": {"steps": val_steps, "values": val_acc, "test_loss": val_values, "every": cfg.eval_every},
        "final_train_loss": final_train,
        "final_validation_loss": final_val,
        "final_validation_bits_per_byte": final_val / LN2,
        "final_test_loss": final_val,
        "final_test_accuracy": final_acc,
        "grad_norms": grads,
        "train_time_s": train_time,
        "parameters": int(sum(p.numel() for p in model.parameters())),
    }
    if arm.solution is not None:
        res["solution"] = arm.solution
    return res


def _summary(runs: dict) -> dict:
    solved = runs.get("solved", {})
    out: dict = {
        "solved": {k: solved.get(k) for k in ("final_train_loss", "final_validation_loss", "final_test_accuracy")},
        "arms": {},
        "text": [],
    }

    def f(v):
        return "n/a" if v is None or not math.isfinite(v) else f"{v:.4f}"

    for name, run in runs.items():
        if name == "solved":
            continue
        if "error" in run:
            out["arms"][name] = {"loss": "unavailable", "error": run["error"]}
            out["text"].append(f"{name}: unavailable ({run['error']['message']})")
            continue
        c = compare(solved, run)
        c["solved_train_loss"], c["arm_train_loss"] = solved.get("final_train_loss"), run.get("final_train_loss")
        out["arms"][name] = c
        out["text"].append(
            f"solved vs {name}: validation loss {f(c['solved_loss'])} vs {f(c['baseline_loss'])} nats/byte "
            f"({c['loss']}), train loss {f(c['solved_train_loss'])} vs {f(c['arm_train_loss'])}"
        )
    out["baselines"] = out["arms"]  # the key the classification summary uses
    out["text"] = "; ".join(out["text"])
    return out


# =============================================================================================
# Entry point
# =============================================================================================


def run_charlm_validation(
    request: dict,
    graph_dict: dict,
    solution: Solution,
    *,
    progress: Callable[[dict], None] = lambda p: None,
    cancelled: Callable[[], bool] = lambda: False,
    device: str | None = None,
    corpus: Corpus | None = None,
    only_arms: tuple[str, ...] | None = None,
) -> dict:
    """Train the arms of a charlm validation and return the results (module docstring).

    ``request`` is the validation request (its ``steps``, ``batch_size``, ``optimizer``, ``lr``,
    ``seed``, ``arms``; ``solve`` or ``solve_request`` gives the shortcuts arm its solve fields),
    ``graph_dict`` the expanded graph that was solved, ``solution`` its answer. ``progress`` and
    ``cancelled`` as for ``sigprop.worker.training.run_validation``. ``only_arms`` (benches) trains
    only those of the request's arms, with the same batches and initializations, so arms run in
    separate processes give the numbers of one run.
    """
    t_start = time.perf_counter()
    req = _training_config(request)
    sol = _as_solution(solution)
    graph = _as_graph(graph_dict)
    wire = graph.model_dump(mode="json", by_alias=True, exclude_none=True)
    plan = plan_charlm(req.model_dump(mode="json"), wire)
    cfg = _config(req, plan)
    if only_arms is not None:
        cfg = replace(cfg, arms=tuple(a for a in cfg.arms if a in only_arms))
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    corpus = corpus or load_corpus()
    text_train = torch.from_numpy(corpus.train).to(dev)
    data = _Data(
        text_train,
        _windows(text_train, _fixed_starts(len(corpus.train), cfg.seq_len, EVAL_WINDOWS), cfg.seq_len),
        _windows(
            torch.from_numpy(corpus.validation).to(dev),
            _fixed_starts(len(corpus.validation), cfg.seq_len, EVAL_WINDOWS),
            cfg.seq_len,
        ),
        dev,
    )
    names = list(cfg.arms)
    runs: dict[str, dict] = {}
    for i, name in enumerate(names):
        if cancelled():
            raise Cancelled(f"validation cancelled before arm '{name}'")

        def report(arm: str, step: int, loss: float | None, i=i) -> None:
            progress(
                {
                    "run": arm,
                    "run_index": i,
                    "runs": names,
                    "step": i * cfg.steps + step,
                    "total": cfg.steps * len(names),
                    "run_step": step,
                    "run_total": cfg.steps,
                    "loss": loss if loss is not None and math.isfinite(loss) else None,
                    "device": str(dev),
                }
            )

        report(name, 0, None)
        t0 = time.perf_counter()
        try:
            arm = _make_arm(name, request, graph, sol, plan.params, cfg.seed)
        except SigpropError as exc:
            if name == "solved":
                raise
            runs[name] = {"error": {"code": exc.code, "message": exc.message, "hint": exc.hint}}
            continue
        build = time.perf_counter() - t0
        res = _fit(arm, data, cfg, report, cancelled)
        res["build_time_s"] = build
        res["wall_time_s"] = time.perf_counter() - t0
        runs[name] = res
        del arm
    results = {
        "task": "charlm",
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "dataset": corpus.describe(),
        "config": cfg.to_json(),
        "plan": plan.to_json(),
        "solution": {"key": sol.key, "method": sol.method, "activation": sol.activation, "targets": dict(sol.targets)},
        "graph": {"transformer": asdict(plan.params)},
        "runs": runs,
        "summary": _summary(runs),
        "wall_time_s": time.perf_counter() - t_start,
    }
    return finite(results)
