"""The steps of ``apply``'s rewrite of a traced torch model, shared by the rewrite of MLPs and
CNNs (``apply``) and of sequence models (``sequence_apply``): the report, activations, sums,
layer initializations, the output multiplier, calibration, and what was left uncovered.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn

from ...schemas.activations import canonical_name
from ...schemas.errors import SigpropError
from ...schemas.ops import NORM, OP_TABLE
from ...schemas.solve import LayerInit, Solution
from .. import adapters
from ..calibration import Calibration, answer_uncovered, measured_nodes
from .calibrate import calibrate_model
from .extraction import Entry, Extraction
from .modules import NormalizedSum, TransformedActivation

__all__ = ["ApplyReport", "ActivationChange", "LayerChange", "SumChange", "Calibration"]


@dataclass
class ActivationChange:
    id: str
    module: str  # path of the new module in the rewritten model
    was: str  # what it replaced, e.g. "ReLU module 'net.1'"
    now: str  # repr of the transformed activation

    def __str__(self) -> str:
        return f"{self.id}: {self.was} -> {self.now}"


@dataclass
class LayerChange:
    id: str
    module: str
    op: str
    distribution: str
    gain: float  # multiplier on the orthonormal matrix, or the Gaussian standard deviation
    weight_variance: float
    bias: str  # what was done to the bias: zeros, gaussian, none (the module has no bias), ...
    bias_variance: float = 0.0
    alpha: float | None = None  # conditioning multiplier inserted after the layer (geometric)

    def __str__(self) -> str:
        alpha = f", alpha {self.alpha:.6g}" if self.alpha is not None else ""
        return f"{self.id} ({self.module}): {self.distribution}, gain {self.gain:.6g}, bias {self.bias}{alpha}"


@dataclass
class SumChange:
    id: str
    module: str
    was: str
    weights: list[float]
    residual_beta: str | None = None  # "x + beta/sqrt(L) F(x)" description when the answer asks for it
    # where the weights come from: "graph" (the solved graph), "graph x sum_scales" (renormalized by the
    # answer: shared atoms) or "jacobian.recommended"
    source: str = "graph"

    def __str__(self) -> str:
        now = self.residual_beta or f"weights {[round(w, 6) for w in self.weights]}"
        return f"{self.id}: {self.was} -> {now}" + (f" ({self.source})" if self.source != "graph" else "")


@dataclass
class ApplyReport(adapters.ApplyReport):
    """What ``apply`` changed and what it could not do. ``model`` is the rewritten GraphModule;
    ``activations``, ``layers`` and ``sums`` hold :class:`ActivationChange`, :class:`LayerChange` and
    :class:`SumChange` records."""

    residual: str = "graph"  # the residual adds' weights: "graph" (as solved) or "recommended" (jacobian)
    calibrations: list[Calibration] = field(default_factory=list)  # ops measured on example_input

    def _extra_lines(self) -> list[str]:
        return [f"  calibrated {c.describe()}" for c in self.calibrations]


def _example_from_graph(graph: dict, model: nn.Module) -> torch.Tensor:
    shape = next((nd.get("shape") for nd in graph.get("nodes", []) if nd.get("op") == "input"), None)
    if not shape:
        raise ValueError("apply needs example_input (the graph has no input node with a shape)")
    candidates = [list(shape)]
    if len(shape) == 3 and shape[2] == 1:
        candidates.insert(0, list(shape[:2]))  # a 1-d feature map [C, L, 1] is a [B, C, L] tensor
    last = None
    for cand in candidates:
        x = torch.randn(2, *cand)
        try:
            modes = {m: m.training for m in model.modules()}
            model.eval()
            with torch.no_grad():
                model(x)
            return x
        except Exception as exc:  # noqa: BLE001 - the wrong rank fails in any op: try the next candidate
            last = exc
        finally:
            for m, mode in modes.items():
                m.training = mode
    raise ValueError(f"apply could not build an input of shape {shape} for the model ({last}); pass example_input")


def _reinit(module: nn.Module, layer: LayerInit, generator: torch.Generator | None) -> str:
    """Initialize ``module.weight`` (and bias) as ``layer`` says; returns what was done to the bias."""
    w = module.weight
    with torch.no_grad():
        if layer.distribution == "gaussian":
            w.normal_(0.0, layer.gain, generator=generator)
        elif layer.distribution == "scaled_uniform_orthogonal" and w.dim() == 2:
            # torch weights are [out, in]: orthogonal_ gives orthonormal rows (out <= in) or columns
            # (out > in); the answer's gain carries max(sqrt(out/in), 1) * sqrt(sigma_w2)
            torch.nn.init.orthogonal_(w, gain=layer.gain, generator=generator)
        elif layer.distribution in ("orthogonal_delta", "scaled_uniform_orthogonal"):
            spatial = list(w.shape[2:])
            if any(s % 2 != 1 for s in spatial):
                raise SigpropError(
                    "invalid_request",
                    f"Orthogonal Delta initialization of '{layer.id}' needs odd kernel sizes, got {spatial}",
                    "ask for init 'gaussian' or use an odd kernel",
                )
            centre = w.new_empty(w.shape[0], w.shape[1])
            torch.nn.init.orthogonal_(centre, gain=layer.gain, generator=generator)
            w.zero_()
            w[(slice(None), slice(None)) + tuple((s - 1) // 2 for s in spatial)] = centre
        else:  # pragma: no cover - the schema allows nothing else
            raise SigpropError("invalid_request", f"unknown distribution {layer.distribution!r}", "")
        b = getattr(module, "bias", None)
        if b is None:
            return "none" if layer.bias == "none" else f"none (the module has no bias; the answer says {layer.bias})"
        if layer.bias == "gaussian" and layer.bias_variance > 0:
            b.normal_(0.0, math.sqrt(layer.bias_variance), generator=generator)
            return "gaussian"
        b.zero_()
        return "zeros" if layer.bias != "none" else "zeros (the answer's graph has no bias; the module's is zeroed)"


def _shortcut_index(node: torch.fx.Node, args: list) -> int:
    """Which input of a residual add is the shortcut x: the one the other is computed from."""

    def ancestors(n):
        seen, stack = set(), [n]
        while stack:
            cur = stack.pop()
            for a in cur.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    stack.append(a)
        return seen

    a0, a1 = ancestors(args[0]), ancestors(args[1])
    if args[0] in a1 and args[1] not in a0:
        return 0
    if args[1] in a0 and args[0] not in a1:
        return 1
    # projection shortcuts: the shorter branch (fewer ops since the fork) is the shortcut
    return 0 if len(a0) <= len(a1) else 1


class _Rewrite:
    """The traced GraphModule being rewritten, and which fx nodes the rewrite replaced."""

    def __init__(self, ext: Extraction, report: ApplyReport):
        self.ext, self.gm, self.report = ext, ext.gm, report
        self.module_uses: dict[str, int] = {}
        for node in self.gm.graph.nodes:
            if node.op == "call_module":
                self.module_uses[node.target] = self.module_uses.get(node.target, 0) + 1
        self.replaced: dict = {}  # fx nodes erased by the rewrite -> the nodes that took their place
        # module paths swapped in place, and changes that only the GraphModule can make (an add or an
        # activation written in forward's code, an inserted multiplier): apply(inplace=True) needs
        # the latter empty, since ``model``'s own forward cannot be rewritten
        self.swapped: list[str] = []
        self.out_of_place: list[str] = []

    def resolve(self, n):
        while n in self.replaced:
            n = self.replaced[n]
        return n

    def entries(self, op: str) -> list[Entry]:
        return [e for e in list(self.ext.entries.values()) if e.op == op]

    def own_module(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` calls a module nothing else calls, which can then be swapped in place."""
        return node.op == "call_module" and self.module_uses.get(node.target) == 1

    def put(self, e: Entry, prefix: str, module: nn.Module, in_place: bool, inputs: list) -> str:
        """Make entry ``e`` compute ``module``: in place at its module's path, or as a new module
        ``<prefix>_<node name>`` called on ``inputs`` where the node was. Returns the module's path."""
        node = e.node
        if in_place:
            self.gm.add_submodule(node.target, module)  # replaces it in place: same path
            self.swapped.append(node.target)
            return node.target
        self.out_of_place.append(f"{e.gid} ({e.desc})")
        path = f"{prefix}_{node.name}"
        self.gm.add_submodule(path, module)
        with self.gm.graph.inserting_after(node):
            repl = self.gm.graph.call_module(path, args=tuple(self.resolve(a) for a in inputs))
        node.replace_all_uses_with(repl)
        self.gm.graph.erase_node(node)
        self.replaced[node] = repl
        e.node = repl
        return path


def _apply_activations(rw: _Rewrite, sol: Solution, solved_nodes: dict) -> None:
    for e in rw.entries("activation"):
        # a graph with several functions names each node's: its parameters are the answer's entry
        # for that function (graph id -> fn -> parameters); otherwise the top level applies to all
        fn = solved_nodes.get(e.gid, {}).get("fn") or (e.fn if sol.activations else None)
        own = sol.for_function(fn) if fn else sol
        defaults = e.fn_params if e.fn == canonical_name(own.activation) else {}
        new = TransformedActivation.from_solution(own, defaults=defaults)
        path = rw.put(e, "sigprop_act", new, rw.own_module(e.node), e.inputs[:1])
        rw.report.activations.append(
            ActivationChange(e.gid, path, e.desc, f"TransformedActivation({new.extra_repr()})")
        )


def _sum_weights(e: Entry, wire: dict, ext: Extraction, report: ApplyReport) -> list[float]:
    """The solved graph's weights of sum ``e``, in the order of the traced add's inputs."""
    n = len(e.inputs)
    weights = wire.get("weights") or [1.0 / math.sqrt(n)] * n
    wire_inputs = wire.get("inputs")
    if wire_inputs and sorted(wire_inputs) == sorted(ext.value[a] for a in e.inputs) and wire.get("weights"):
        # match weights to inputs by id (a hand-edited graph may list them in another order)
        pool = list(zip(wire_inputs, wire["weights"], strict=False))  # a length mismatch is reported below
        weights = []
        for a in e.inputs:
            k = next(i for i, (gid, _) in enumerate(pool) if gid == ext.value[a])
            weights.append(float(pool.pop(k)[1]))
    if len(weights) != n:
        report.warnings.append(
            f"sum '{e.gid}': the graph gives {len(weights)} weights for {n} inputs; equal weights used"
        )
        weights = [1.0 / math.sqrt(n)] * n
    return weights


def _recommended_weights(sol: Solution) -> tuple[float, float]:
    """(shortcut, branch) weights of the answer's ``jacobian.recommended``, or ValueError."""
    rec = sol.jacobian.recommended if sol.jacobian is not None else None
    if not rec or "shortcut_weight" not in rec or "branch_weight" not in rec:
        kind = sol.jacobian.kind if sol.jacobian is not None else "none"
        raise ValueError(
            "residual='recommended' needs the answer's jacobian.recommended shortcut and branch weights, which "
            f"only residual ReLU-family graphs carry (this answer's jacobian: {kind}); use residual='graph'"
        )
    return float(rec["shortcut_weight"]), float(rec["branch_weight"])


def _apply_sums(rw: _Rewrite, sol: Solution, solved_nodes: dict, residual: str) -> None:
    recommended = _recommended_weights(sol) if residual == "recommended" else None
    rb = sol.trainable.residual_beta if sol.trainable is not None else None
    beta_sums = set(rb.sums) if rb is not None else set()
    shared_beta = nn.Parameter(torch.tensor(float(rb.init))) if rb is not None and rb.mode == "global" else None
    value = rw.ext.value
    for e in rw.entries("sum"):
        weights = _sum_weights(e, solved_nodes.get(e.gid, {}), rw.ext, rw.report)
        beta_desc, source = None, "graph"
        if sol.sum_scales and e.gid in sol.sum_scales:
            # an atom reaches this sum through several paths: the answer renormalizes it
            weights = [sol.sum_scales[e.gid] * w for w in weights]
            source = "graph x sum_scales"
        if recommended is not None and len(e.inputs) == 2 and e.gid not in beta_sums:
            # the shortcut gets the shortcut weight, whichever argument of the add it is
            sc = _shortcut_index(e.node, [rw.resolve(a) for a in e.inputs])
            weights = [recommended[0], recommended[1]] if sc == 0 else [recommended[1], recommended[0]]
            source = "jacobian.recommended"
        if e.gid in beta_sums and len(e.inputs) == 2:
            sc = _shortcut_index(e.node, [rw.resolve(a) for a in e.inputs])
            beta = shared_beta if shared_beta is not None else float(rb.init)
            mod = NormalizedSum(2, weights, beta=beta, blocks=rb.blocks, shortcut=sc)
            beta_desc = (
                f"{value[e.inputs[sc]]} + beta / sqrt({rb.blocks}) * {value[e.inputs[1 - sc]]} "
                f"(beta {rb.mode}, initially {rb.init:g})"
            )
        else:
            mod = NormalizedSum(len(e.inputs), weights)
        in_place = rw.own_module(e.node) and isinstance(rw.gm.get_submodule(e.node.target), NormalizedSum)
        path = rw.put(e, "sigprop_sum", mod, in_place, e.inputs)
        rw.report.sums.append(SumChange(e.gid, path, e.desc, list(mod.weights), beta_desc, source))
    if recommended is not None:
        rw.report.notes.append(
            f"residual='recommended': residual adds weight the shortcut {recommended[0]:.6g} and the branch "
            f"{recommended[1]:.6g} (the answer's jacobian.recommended, per-layer Jacobian paper) instead of the "
            "solved graph's weights; the answer's C map and q predictions were solved for the graph's weights"
        )
        skipped = [s.id for s in rw.report.sums if s.source != "jacobian.recommended"]
        if skipped:
            rw.report.warnings.append(f"sums left with the graph's weights (not two-input adds): {', '.join(skipped)}")
    unmatched_beta = sorted(beta_sums - {s.id for s in rw.report.sums})
    if unmatched_beta:
        rw.report.warnings.append(f"residual-beta sums not found in the model: {', '.join(unmatched_beta)}")


def _layer_mismatch(layer: LayerInit, e: Entry | None) -> str | None:
    """Why answer layer ``layer`` cannot be applied to the model's entry ``e``, or None."""
    if e is None or e.op not in ("dense", "conv") or e.module is None:
        return (
            f"answer layer '{layer.id}' ({layer.op}) has no "
            f"{'matching weighted ' if e is not None else ''}module in the model; not applied"
        )
    if e.op != layer.op:
        return f"answer layer '{layer.id}' is a {layer.op} but the model's is a {e.op}; not applied"
    m = e.module
    want_in = m.in_features if e.op == "dense" else m.in_channels
    want_out = m.out_features if e.op == "dense" else m.out_channels
    if layer.fan_out != want_out or layer.fan_in not in (want_in, want_in * math.prod(m.weight.shape[2:])):
        return (
            f"answer layer '{layer.id}' has fan-in/out {layer.fan_in}/{layer.fan_out} but "
            f"module '{e.node.target}' is {want_in} -> {want_out}; not applied"
        )
    return None


def _apply_layers(rw: _Rewrite, sol: Solution, generator: torch.Generator | None) -> set[int]:
    """Re-initialize every answer layer's module; returns the ids of the modules it initialized."""
    by_id = {e.gid: e for e in rw.ext.entries.values()}
    done_modules: dict[int, str] = {}
    for layer in sol.layers:
        e = by_id.get(layer.id)
        why = _layer_mismatch(layer, e)
        if why is not None:
            rw.report.missing_layers.append(layer.id)
            rw.report.warnings.append(why)
            continue
        m = e.module
        if id(m) in done_modules:
            rw.report.warnings.append(
                f"layer '{layer.id}' shares its module '{e.node.target}' with "
                f"'{done_modules[id(m)]}' (weight sharing): initialized once, as "
                f"'{done_modules[id(m)]}'"
            )
            continue
        bias_done = _reinit(m, layer, generator)
        done_modules[id(m)] = layer.id
        alpha = layer.alpha if layer.alpha is not None and layer.alpha != 1.0 else None
        if alpha is not None:
            node = e.node
            with rw.gm.graph.inserting_after(node):
                scaled = rw.gm.graph.call_function(operator.mul, (node, float(alpha)))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda u, s=scaled: u is not s)
            rw.out_of_place.append(f"the multiplier alpha = {alpha:.6g} after '{layer.id}'")
        rw.report.layers.append(
            LayerChange(
                layer.id,
                str(e.node.target),
                layer.op,
                layer.distribution,
                layer.gain,
                layer.weight_variance,
                bias_done,
                layer.bias_variance,
                alpha,
            )
        )
    return set(done_modules)


def _apply_output(rw: _Rewrite, sol: Solution) -> None:
    """The output multiplier, and notes on what the caller must do."""
    gm, report = rw.gm, rw.report
    if sol.logits_scale is not None and sol.logits_scale != 1.0:
        rw.out_of_place.append(f"the output multiplier logits_scale = {sol.logits_scale:.6g}")
        out = next(n for n in gm.graph.nodes if n.op == "output")
        src = out.args[0]
        with gm.graph.inserting_before(out):
            scaled = gm.graph.call_function(operator.mul, (src, float(sol.logits_scale)))
        out.replace_input_with(src, scaled)
        report.notes.append(f"the network output is multiplied by logits_scale = {sol.logits_scale:.6g}")
    if sol.input_second_moment is not None:
        report.notes.append(
            f"scale the network input so that E[x^2] = {sol.input_second_moment:.6g} "
            "(geometric initialization, GR section 6.3); apply does not touch the data"
        )
    report.notes.extend(f"answer warning: {w}" for w in sol.warnings)
    if sol.method in ("tat", "dks", "eoc", "sparse_eoc"):
        q = sol.q_star if sol.q_star is not None else 1.0
        report.notes.append(f"the kernel analysis assumes inputs with mean squared value q = {q:.6g} per example")


def _calibrate(rw: _Rewrite, sol: Solution, example_input: torch.Tensor | None) -> None:
    """Measure on ``example_input`` the ops the answer cannot predict and undo their effect on q."""
    if example_input is None:
        unmodelled = [e.gid for e in rw.ext.entries.values() if e.unsupported]
        pending = measured_nodes(rw.ext.graph, [*answer_uncovered(sol), *unmodelled])
        if pending:
            rw.report.notes.append(
                f"not calibrated (no example_input, or calibrate=False): {', '.join(list(pending)[:8])} change q "
                "in a way the answer does not predict; apply(..., example_input=batch) measures and undoes it"
            )
        return
    weights = {c.id: list(c.weights) for c in rw.report.sums}
    cals, warnings = calibrate_model(rw.ext, rw.resolve, sol, weights, example_input, rw.out_of_place)
    rw.report.calibrations.extend(cals)
    rw.report.warnings.extend(warnings)


def _reset_norms(ext: Extraction, report: ApplyReport) -> set[int]:
    """The modules of norm nodes (``nn.RMSNorm``: kind norm) with their affine parameters at the identity
    (weight 1, bias 0), what the answer's ``rms_norm`` nodes are; ids of the modules reset."""
    done: set[int] = set()
    for e in ext.entries.values():
        m = e.module
        if m is None or id(m) in done or e.op not in OP_TABLE or OP_TABLE[e.op].kind != NORM:
            continue
        weight, bias = getattr(m, "weight", None), getattr(m, "bias", None)
        if weight is None and bias is None:
            continue
        with torch.no_grad():
            if weight is not None:
                weight.fill_(1.0)
            if bias is not None:
                bias.zero_()
        done.add(id(m))
        report.notes.append(f"{e.op} '{e.gid}': affine parameters reset to the identity (weight 1)")
    return done


def _report_uncovered(target: nn.Module, ext: Extraction, initialized: set[int], report: ApplyReport) -> None:
    """Modules with parameters that the answer did not cover, and why."""
    for name, mod in target.named_modules():
        own = [p for p in mod.parameters(recurse=False)]
        if not own or id(mod) in initialized or isinstance(mod, (TransformedActivation, NormalizedSum)):
            continue
        if name not in ext.traced_modules:
            why = "never called in forward"
        elif any(e.module is mod and e.op in ("dense", "conv") for e in ext.entries.values()):
            why = "a weighted layer the answer does not list"
        elif any(e.module is mod and e.unsupported for e in ext.entries.values()):
            why = "unsupported op treated as the identity; its parameters are unchanged"
        else:
            why = "its parameters are unchanged"
        report.uninitialized.append(f"{name} ({type(mod).__name__}): {why}")
    if report.uninitialized:
        report.warnings.append("modules with parameters left as they were: " + "; ".join(report.uninitialized[:10]))


def _graph_mismatch(solved_nodes: dict, ext: Extraction) -> str | None:
    """A warning when the graph passed to apply has other ids than the model's, else None."""
    model_ids = {e.gid for e in ext.entries.values()}
    extra_ids = sorted(set(solved_nodes) - model_ids)
    missing_ids = sorted(model_ids - set(solved_nodes))
    if not (extra_ids or missing_ids):
        return None
    return (
        "the graph passed to apply differs from the model's: "
        + (f"ids not in the model: {', '.join(extra_ids[:10])}" if extra_ids else "")
        + ("; " if extra_ids and missing_ids else "")
        + (f"model nodes not in the graph: {', '.join(missing_ids[:10])}" if missing_ids else "")
    )


@dataclass
class ConvertReport:
    """What ``normalization_free`` changed: the converted copy and every change, by module path."""

    model: nn.Module
    removed: list[str] = field(default_factory=list)  # normalization layers replaced by nn.Identity
    rewritten: list[str] = field(default_factory=list)  # residual blocks made pre-activation
    shortcuts_removed: list[str] = field(default_factory=list)  # blocks left without shortcuts (HuggingFace)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"removed {len(self.removed)} normalization layer(s)"
            + (f": {', '.join(self.removed[:8])}" + (" ..." if len(self.removed) > 8 else "") if self.removed else "")
        ]
        if self.rewritten:
            lines.append(
                f"rewrote {len(self.rewritten)} residual block(s) to pre-activation: "
                + ", ".join(self.rewritten[:8])
                + (" ..." if len(self.rewritten) > 8 else "")
            )
        return "\n".join(lines + self.notes)
