"""The methods a request can name, one registry entry each: its targets and its answer builder.

Each builder turns a prepared request (canonical, anonymized graph), its network program (every
network-level quantity, ``program.NetworkProgram``) and its structure report into a
``Solution``; ``engine.solve`` looks the method up in ``METHODS``. Every achieved value in an
answer is recomputed from the returned parameters, not echoed from the targets.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...errors import SigpropError
from ...schemas.ops import ACT, CONCAT, SUM
from ...schemas.solve import (
    METHOD_TARGETS,
    ActivationParams,
    CMapSample,
    FixedPoint,
    GraphSummary,
    LayerInit,
    RootInfo,
    Solution,
    SolveRequest,
    VMapSample,
)
from ...schemas.structure import StructureReport, dropout_notes, pooling_warnings, sum_scale_notes
from ...version import ENGINE_VERSION
from ..graph.build import NetworkGraph
from ..maps.activations import Activation, get_activation
from ..maps.qc_maps import (
    HermiteCMap,
    leaky_relu_c_map,
    leaky_relu_stats,
    local_stats,
    rectifier_c_map,
    rectifier_chain_map,
    rectifier_k,
)
from ..network import eoc_network, jacobian
from ..network.initialization import layer_inits
from ..network.program import WHOLE_NETWORK, NetworkProgram
from . import deep_kernel_shaping, eoc, geometric, rectifier_dks, root_scan, sparse_eoc, tat


@dataclass(frozen=True)
class MethodInput:
    """What every builder gets: the request, its canonical graph and key, the compiled M_{f,r}
    program, the structure report and the targets (checked against the method's names)."""

    request: SolveRequest
    graph: NetworkGraph
    key: str
    program: NetworkProgram
    report: StructureReport
    targets: dict[str, float]
    # nodes a method finds outside what its answer predicts (eoc: layers reading a mix of q), added to
    # the structure report's under "assumptions": "warn"
    extra_violations: list[int] = field(default_factory=list)
    # the request's own node ids by index, for refusals (the graph's are placeholders)
    names: list[str] | None = None

    def common(self) -> dict:
        return dict(
            key=self.key,
            engine_version=ENGINE_VERSION,
            method=self.request.method,
            activation=self.request.activation,
            targets=self.targets,
            graph_summary=_summary(self.graph, self.program),
        )


@dataclass(frozen=True)
class Method:
    targets: tuple[str, ...]  # the target names it accepts
    kernel: bool  # its answer is a Q/C (variance) map prediction
    build: Callable[[MethodInput], Solution]


def check_targets(request: SolveRequest) -> dict[str, float]:
    given = request.targets.model_dump(exclude_none=True)
    allowed = METHODS[request.method].targets
    extra = sorted(set(given) - set(allowed))
    if extra:
        raise SigpropError(
            "invalid_target",
            f"method '{request.method}' does not use target(s) {', '.join(extra)}",
            f"targets for '{request.method}': {', '.join(allowed) or 'none'}",
        )
    return given


def _summary(graph: NetworkGraph, program: NetworkProgram) -> GraphSummary:
    kinds = Counter(nd.kind for nd in graph.nodes)
    return GraphSummary(
        nodes=graph.n,
        depth=program.depth,
        activations=kinds[ACT],
        sums=kinds[SUM],
        concats=kinds[CONCAT],
        weighted=kinds["affine"],
        subnetworks_considered=program.regions,
    )


def _tat(m: MethodInput) -> Solution:
    acts = _functions(m.graph, m.request)
    if any(a.name == "leaky_relu" for a in acts):
        if len(acts) > 1:
            # Algorithm 1 solves one negative slope from the closed-form C map of every layer (equation 9)
            raise SigpropError(
                "unsupported_activation",
                f"TAT with leaky_relu needs it to be the network's only activation function, as in "
                f"dks; the graph uses {', '.join(a.name for a in acts)}",
                "use leaky_relu on every activation node, or smooth functions only (target tau), or "
                "method 'dks', which takes several functions including leaky_relu",
            )
        return _tat_leaky_relu(m, acts[0])
    for act in acts:
        _require_smooth(act, "tat")
    if "tau" not in m.targets:
        names = ", ".join(f"'{a.name}'" for a in acts)
        raise SigpropError(
            "invalid_target",
            f"TAT with the smooth activation {names} needs the target 'tau'",
            'add "targets": {"tau": 0.3}; \'eta\' is for leaky_relu',
        )
    # one local target for every function, from the network's maximal curvature function (as dks)
    solved = [(act, tat.solve_tat_smooth(m.program, act, m.targets["tau"]).transform) for act in acts]
    return _smooth_solution(m, solved, curvature=True)


def _tat_leaky_relu(m: MethodInput, act: Activation) -> Solution:
    """TAT Algorithm 1: the negative slope from eta, the closed-form local C map (equation 9)."""
    targets, program, graph = m.targets, m.program, m.graph
    if "eta" not in targets:
        raise SigpropError(
            "invalid_target",
            "TAT with leaky_relu needs the target 'eta'",
            'add "targets": {"eta": 0.9} (the paper uses 0.9 or 0.95)',
        )
    if "tau" in targets:
        raise SigpropError(
            "invalid_target", "'tau' is the target of TAT for smooth activations", "for leaky_relu give 'eta' only"
        )
    a = tat.solve_tat_leaky_relu(program, targets["eta"])
    out_scale = float(np.sqrt(2.0 / (1.0 + a * a)))
    st = leaky_relu_stats(a, out_scale)
    grid = _c_grid(m.request.c_map_points)
    # one pass of the global map for the sample grid and c = 0 with slope a (row 0) and for the
    # untransformed ReLU (row 1): a pass costs a local map evaluation per layer, whatever its size
    rows = np.tile(np.append(grid, 0.0), (2, 1))
    ks = rectifier_k(np.array([[a], [0.0]]))
    both = program.global_map(
        rows, lambda c, _slot: rectifier_c_map(c, ks), repeat=lambda c, layers: rectifier_chain_map(c, ks, layers)
    )
    global_at = both[0]
    return Solution(
        **m.common(),
        negative_slope=a,
        output_scale=out_scale,
        sigma_w2=1.0,
        sigma_b2=0.0,
        c_f_0=float(tat.max_c_value(program, a)),
        network_c_f_0=float(global_at[-1]),
        q_1=st.q_1,
        q_slope_1=st.q_slope_1,
        local_c_0=st.c_0,
        local_c_slope_1=st.c_slope_1,
        chi_1=st.c_slope_1,
        c_map=CMapSample(
            c=grid.tolist(),
            global_=global_at[:-1].tolist(),
            local=leaky_relu_c_map(grid, a).tolist(),
            untransformed=both[1, :-1].tolist(),
        ),
        jacobian=jacobian.summary(graph, act),
        layers=layer_inits(graph, m.request.init),
        warnings=_warnings_for(graph, m.report) + _maximizer_note(program.c0_maximizer(a)),
    )


def _require_smooth(act: Activation, method: str) -> None:
    if act.smooth:
        return
    if method == "tat":
        hint = (
            "use 'leaky_relu' with target 'eta' (TReLU, TAT Algorithm 1)"
            if act.positively_homogeneous
            else "choose a smooth activation such as softplus, tanh, gelu or swish"
        )
        raise SigpropError(
            "unsupported_activation",
            f"TAT takes 'leaky_relu' (target eta) or a smooth activation (target tau, which needs a "
            f"finite C''(1)); '{act.name}' is neither",
            hint,
        )
    raise SigpropError(
        "unsupported_activation",
        f"DKS takes a smooth activation or one of the rectifiers {', '.join(rectifier_dks.RECTIFIERS)}; "
        f"'{act.name}' is neither",
        "choose softplus, tanh, gelu, swish, relu or leaky_relu; sparsifying activations are for method 'sparse_eoc'",
    )


def _dks(m: MethodInput) -> Solution:
    acts = _functions(m.graph, m.request)
    for act in acts:
        if act.name not in rectifier_dks.RECTIFIERS:
            _require_smooth(act, "dks")
    if "zeta" not in m.targets:
        raise SigpropError("invalid_target", "DKS needs the target 'zeta'", 'add "targets": {"zeta": 1.5}')
    q_slope = deep_kernel_shaping.check_local_q_slope(m.targets.get("local_q_slope", 1.0))
    solved, notes = [], []
    # every function gets the same local targets, from the network's maximal slope function (as dks)
    for act in acts:
        if act.name not in rectifier_dks.RECTIFIERS:
            solved.append((act, deep_kernel_shaping.solve_dks(m.program, act, m.targets["zeta"], q_slope).transform))
            continue
        slope = deep_kernel_shaping.local_slope_target(m.program, m.targets["zeta"])
        tr = rectifier_dks.solve_rectifier(act.name, slope, q_slope)
        if "negative_slope" in tr.params:
            act = get_activation(act.name, negative_slope=tr.params["negative_slope"])
        if act.name == "relu" and "local_q_slope" in m.targets:
            notes.append(
                "'relu' has no degree of freedom left for Q'(1) (like dks, the condition is dropped): "
                "local_q_slope is not imposed, see q_slope_1 for the value achieved"
            )
        solved.append((act, tr))
    return _smooth_solution(m, solved, curvature=False, notes=notes)


def _eoc(m: MethodInput) -> Solution:
    """Edge of Chaos: sigma_w^2 = 1 / E[phi'^2], sigma_b^2 from V(q*) = q*, for each function.

    A weighted layer after an activation takes its function's pair (then q_{l+1} = sigma_w2
    E[phi(h_l)^2] + sigma_b2 = q* and chi_1 = 1, TAT section 3); one that reads the input, a sum or
    another weighted layer is q-preserving (``eoc_network``). So q is q* at every Gaussian node
    and the global C map composes at q* over the program, sums atom by atom, as TAT's and DKS's do.
    """
    graph, program, request = m.graph, m.program, m.request
    acts = _functions(graph, request)
    sols = [eoc.solve_eoc(act, m.targets.get("q_star", 1.0)) for act in acts]
    qs = sols[0].q_star
    tables = [HermiteCMap(act, input_scale=float(np.sqrt(qs))) for act in acts]
    grid = _c_grid(request.c_map_points)
    plan = eoc_network.plan_network(graph, sols)
    notes = _eoc_mixed(m, plan)
    maps, global_at = eoc_network.global_c_map(program, plan, sols, tables, grid)
    want = get_activation(request.activation).name
    top = 0 if len(acts) == 1 else next((k for k, a in enumerate(acts) if a.name == want), None)
    shown = top if top is not None else 0
    per = {
        a.name: ActivationParams(sigma_w2=s.sigma_w2, sigma_b2=s.sigma_b2, chi_1=s.chi_1)
        for a, s in zip(acts, sols, strict=True)
    }
    keys = ("sigma_w2", "sigma_b2", "chi_1", "v_slope", "v_curvature")
    head = {} if top is None else {k: getattr(sols[top], k) for k in keys}
    for k in sorted(plan.own):
        name, b2 = acts[k].name, sols[k].sigma_b2
        why = f"an rms_norm or a mul reads '{name}' (its map needs phi's own C map)"
        if k in plan.no_bias:
            why = f"a layer without bias reads '{name}': Edge of Chaos needs sigma_b^2 = {b2:.4g} for V(q*) = q*"
        q_preserving = "q-preserving instead (sigma_w^2 = q* / E[phi^2], no bias; chi_1 is not 1 there)"
        notes.append(f"{why}, so every layer reading '{name}' is {q_preserving}")
    fps = eoc_network.fixed_points(acts[shown], sols[shown]) if top is not None else None
    for act, sol in zip(acts, sols, strict=True):
        notes += eoc_network.unstable_note(act, sol, program.depth, eoc_network.fixed_points(act, sol))
        if sol.v_slope**program.depth >= eoc_network.DRIFT_LIMIT and graph.output not in m.extra_violations:
            # a finite network's q leaves q* by the width's sampling noise, amplified past doubling: the
            # answer's q and C map are not what such networks do (issue 34: swish q 2.7 -> 247 in 20 layers)
            m.extra_violations.append(graph.output)
    return Solution(
        **m.common(),
        **head,
        q_star=qs,
        output_q=plan.output_q,
        fixed_points=None if fps is None else [FixedPoint(q=q, stable=st) for q, st in fps],
        activations=per if len(acts) > 1 else None,
        jacobian=jacobian.summary(graph, acts[shown]) if len(acts) == 1 else None,
        c_map=_eoc_c_map(grid, global_at, maps[shown], tables[shown]),
        network_c_f_0=float(global_at[-1]),
        layers=_eoc_layers(m, plan),
        warnings=_warnings_for(graph, m.report) + notes + sum((_c_map_accuracy(t) for t in tables), []),
    )


def _eoc_c_map(grid: np.ndarray, global_at: np.ndarray, local, phi_map) -> CMapSample:
    """eoc's and sparse_eoc's C maps: ``local`` the activation with the layer reading it, ``activation``
    phi's own at q* (what a network does at an activation node: ``diagnose`` predicts with it)."""
    sample = dict(c=grid.tolist(), global_=global_at[:-1].tolist(), local=local(grid).tolist())
    return CMapSample(**sample, activation=np.asarray(phi_map(grid)).tolist())


def _eoc_layers(m: MethodInput, plan: eoc_network.NetworkPlan) -> list[LayerInit]:
    """Each weighted layer with its own (sigma_w2, sigma_b2) and output q (``eoc_network.plan_network``)."""
    graph = m.graph
    pairs = {(lay.sigma_w2, lay.sigma_b2) for lay in plan.layers.values()}
    inits = {pair: layer_inits(graph, m.request.init, *pair) for pair in pairs}
    affine = [nd.index for nd in graph.nodes if nd.kind == "affine"]
    out = []
    for k, node in enumerate(affine):
        lay = plan.layers[node]
        init = inits[(lay.sigma_w2, lay.sigma_b2)][k]
        out.append(init.model_copy(update={"q": None if math.isnan(lay.q) else lay.q}))
    return out


def _eoc_mixed(m: MethodInput, plan: eoc_network.NetworkPlan) -> list[str]:
    """Layers (or the output) reading a mix of kinds whose q differ: refused, or warned under "warn"."""
    if not plan.mixed:
        return []
    ids = m.names or [nd.user_id for nd in m.graph.nodes]
    names = ", ".join(ids[v] for v in plan.mixed[:6]) + (" ..." if len(plan.mixed) > 6 else "")
    what = (
        f"{len(plan.mixed)} node(s) ({names}) read a mix of values at different q (two functions' activation "
        "outputs, an activation output and a weighted layer's, or the network input and a weighted layer's "
        "output with q_star != 1): Edge of Chaos initializes a layer from what it reads, and no one "
        "(sigma_w2, sigma_b2) makes such a mix exact"
    )
    fix = "put a weighted layer on each branch before they meet, use one function, or q_star = 1"
    if m.request.assumptions == "strict":
        raise SigpropError("unsupported_structure", what, f'{fix}; or send "assumptions": "warn" to solve anyway')
    m.extra_violations.extend(plan.mixed)
    return [f"assumptions not met: {what}; past these nodes the c_map and q do not hold. Fix: {fix}"]


def _functions(graph: NetworkGraph, request: SolveRequest) -> list[Activation]:
    """The graph's activation functions in the subnetwork program's slot order (``activation_fns``)."""
    return [get_activation(f) for f in (graph.activation_fns() or [request.activation])]


def _single_activation(graph: NetworkGraph, request: SolveRequest) -> Activation:
    fns = graph.activation_fns()
    if len(fns) > 1:
        raise SigpropError(
            "invalid_request",
            f"the graph uses several activation functions ({', '.join(fns)})",
            f"method '{request.method}' solves one activation function per graph (tat and dks take "
            "several): drop the per-node 'fn' attributes",
        )
    return get_activation(fns[0] if fns else request.activation)


def _c_grid(points: int) -> np.ndarray:
    return np.linspace(-1.0, 1.0, points)


def _warnings_for(graph: NetworkGraph, report: StructureReport) -> list[str]:
    ids = [nd.user_id for nd in graph.nodes]
    # correlated sums are exact here (the atom pass rescales them), unlike in the geometric method
    return (
        list(graph.warnings) + sum_scale_notes(ids, report) + dropout_notes(ids, report) + pooling_warnings(ids, report)
    )


def _smooth_warnings(act: Activation) -> list[str]:
    out = []
    if not act.d1_continuous:
        out.append(
            f"'{act.name}' has a jump in its first derivative at 0, so strictly C''(1) is infinite; "
            "like the reference dks, the solve uses the smooth part of phi''"
        )
    return out


def _sparse_eoc(m: MethodInput) -> Solution:
    """Sparse Edge of Chaos (sparsity paper sections 3-4, Appendices A, E, F)."""
    request, graph, program, targets = m.request, m.graph, m.program, m.targets
    fns = graph.activation_fns()
    if len(fns) > 1 or (fns and fns[0] != request.activation):
        raise SigpropError(
            "invalid_request",
            f"the graph uses activation(s) {', '.join(fns)}, the request '{request.activation}'",
            "sparse_eoc solves one sparsifying activation: drop the per-node 'fn' attributes",
        )
    if request.activation not in sparse_eoc.SPARSE_KINDS:
        raise SigpropError(
            "unsupported_activation",
            f"sparse_eoc does not take '{request.activation}'",
            f"use one of {', '.join(sparse_eoc.SPARSE_KINDS)}",
        )
    if "sparsity" not in targets:
        raise SigpropError(
            "invalid_target",
            "sparse_eoc needs the target 'sparsity'",
            'add "targets": {"sparsity": 0.8, "v_slope": 0.7} (v_slope for crelu and cst)',
        )
    sol = sparse_eoc.solve_sparse_eoc(
        request.activation, targets["sparsity"], targets.get("v_slope"), targets.get("q_star", 1.0)
    )
    params = {"tau": sol.tau} if sol.m is None else {"tau": sol.tau, "m": sol.m}
    act = get_activation(request.activation, **params)
    sw2, sb2, qs = sol.sigma_w2, sol.sigma_b2, sol.q_star
    # issue 34: the layers are planned as eoc's (q-preserving after the input, a sum or a layer), so
    # every pre-activation is at q* and the sparsity stated (at q*) is every activation's; the first
    # layer no longer gives q = sigma_w2 + sigma_b2, from where V' = 1, V'' > 0 drifted q deterministically
    sols = [eoc.EOCSolution(qs, sw2, sb2, sol.chi_1, sol.v_slope, sol.v_curvature)]
    plan = eoc_network.plan_network(graph, sols)
    notes = _eoc_mixed(m, plan)
    table = HermiteCMap(act, input_scale=float(np.sqrt(qs)), terms=160)
    grid = _c_grid(request.c_map_points)
    maps, global_at = eoc_network.global_c_map(program, plan, sols, [table], grid)
    qs_grid = np.linspace(3 * qs / request.c_map_points, 3 * qs, request.c_map_points)
    depth = graph.depth()
    return Solution(
        **m.common(),
        tau=sol.tau,
        m=sol.m,
        sigma_w2=sw2,
        sigma_b2=sb2,
        q_star=qs,
        output_q=plan.output_q,
        sparsity=sparse_eoc.expected_sparsity(request.activation, sol.tau, qs),
        v_slope=sol.v_slope,
        v_curvature=sol.v_curvature,
        chi_1=sol.chi_1,
        fixed_points=[FixedPoint(q=q, stable=st) for q, st in sol.fixed_points],
        only_stable=sol.only_stable,
        jacobian_spectrum_variance={
            "gaussian": sparse_eoc.jacobian_spectrum_variance(sw2, depth, orthogonal=False),
            "orthogonal": sparse_eoc.jacobian_spectrum_variance(sw2, depth, orthogonal=True),
        },
        v_map=VMapSample(
            q=qs_grid.tolist(),
            v=np.asarray(sparse_eoc.variance_map(request.activation, qs_grid, sol.tau, sol.m, sw2, sb2)).tolist(),
        ),
        c_map=_eoc_c_map(grid, global_at, maps[0], table),
        network_c_f_0=float(global_at[-1]),
        layers=_eoc_layers(m, plan),
        warnings=_warnings_for(graph, m.report) + list(sol.warnings) + notes + _c_map_accuracy(table),
    )


def _geometric(m: MethodInput) -> Solution:
    """Geometric initialization and GR scaling (GR scaling paper, equations 1 and 7, Appendix E)."""
    request, graph = m.request, m.graph
    act = _single_activation(graph, request)
    sol = geometric.solve_geometric(graph, act, atoms=m.report.atoms)
    layers = []
    for lay in sol.layers:
        var = lay["init_second_moment"]
        nd = graph.nodes[lay["node"]]
        layers.append(
            LayerInit(
                id=lay["id"],
                node=lay["node"],
                op=lay["op"],
                fan_in=lay["fan_in"],
                fan_out=lay["fan_out"],
                kernel=lay["kernel"],
                distribution="gaussian",
                gain=float(np.sqrt(var)),
                weight_variance=var,
                bias="zeros" if nd.attrs.get("bias", True) else "none",
                alpha=lay["alpha"],
                weight_second_moment=lay["weight_second_moment"],
                gamma=lay["gamma"],
            )
        )
    return Solution(
        **m.common(),
        input_second_moment=sol.input_second_moment,
        logits_scale=sol.output_scale,
        gamma_ratio=sol.gamma_ratio,
        layers=layers,
        jacobian=jacobian.summary(graph, act),
        sum_scales={graph.nodes[v].user_id: float(s) for v, s in sorted(sol.sum_scales.items())} or None,
        # geometric words its own max_pool warning (Table 1), and the correlated sums it did not rescale
        warnings=list(graph.warnings) + geometric.unscaled_sum_warnings(graph, sol) + list(sol.warnings),
    )


def _c_map_accuracy(table: HermiteCMap) -> list[str]:
    if table.tail <= 1e-4:
        return []
    return [f"the sampled c_map is accurate to about {table.tail:.1g} (Hermite series tail of a kinked activation)"]


def _maximizer_note(name: str) -> list[str]:
    if name == WHOLE_NETWORK:
        return []
    return [f"the maximizing subnetwork is not the whole network: it runs {name}"]


@dataclass(frozen=True)
class _Local:
    """One solved function: its activation (with a solved negative slope), phi_hat's parameters
    without it, its q = 1 statistics and its local C map."""

    act: Activation
    tr: object
    p: dict
    st: object
    table: HermiteCMap

    @classmethod
    def of(cls, act: Activation, tr) -> _Local:
        p = {k: v for k, v in tr.params.items() if k != "negative_slope"}
        # phi_hat's statistics from phi's nodes at (alpha, beta): the root search's last step left
        # them in the cache, and the rule follows phi's own kinks and bend
        return cls(act, tr, p, local_stats(act, **p), HermiteCMap(act, **p))

    @property
    def has_curv(self) -> bool:
        # a rectifier's C''(1) is infinite (the kink), not the 0 its smooth part gives: leave it out
        return self.act.name not in rectifier_dks.RECTIFIERS

    def fields(self) -> dict:
        st = self.st
        return dict(
            negative_slope=self.tr.params.get("negative_slope"),
            **self.p,
            q_1=st.q_1,
            q_slope_1=st.q_slope_1,
            local_c_0=st.c_0,
            local_c_slope_1=st.c_slope_1,
            local_c_curv_1=st.c_curv_1 if self.has_curv else None,
            chi_1=st.c_slope_1,
        )


def _primary(m: MethodInput, per: list[_Local]) -> _Local | None:
    """The function the top-level keys describe: the only one, or the request's ``activation`` if used."""
    if len(per) == 1:
        return per[0]
    want = get_activation(m.request.activation).name
    return next((x for x in per if x.act.name == want), None)


def _smooth_solution(m: MethodInput, solved: list, curvature: bool, notes: list[str] | None = None) -> Solution:
    """The answer of TAT (smooth) and DKS: the transformed activations, one per function slot of the
    program, and what they achieve together (the maps take each layer's own function)."""
    program, graph = m.program, m.graph
    grid = _c_grid(m.request.c_map_points)
    per = [_Local.of(act, tr) for act, tr in solved]
    top = _primary(m, per)
    local = lambda c, slot: per[slot].table(c)  # noqa: E731
    slope, curv = (
        float(v)
        for v in deep_kernel_shaping.max_slope_and_curvature(
            program, [x.st.c_slope_1 for x in per], [x.st.c_curv_1 for x in per]
        )
    )
    has_curv = all(x.has_curv for x in per)
    warnings = _warnings_for(graph, m.report) + list(notes or [])
    for x in per:
        warnings += (_smooth_warnings(x.act) if x.has_curv else []) + _c_map_accuracy(x.table)
    warnings += _maximizer_note(
        program.curvature_maximizer([x.st.c_curv_1 for x in per])
        if curvature
        else program.slope_maximizer([x.st.c_slope_1 for x in per])
    )
    shown = top or per[0]
    # one pass of the global map over the sample grid and c = 0 together (a pass costs a local map
    # evaluation per layer, whatever the number of points)
    sample = np.append(grid, 0.0)
    global_at = program.global_map(sample, local, repeat=per[0].table.iterate if len(per) == 1 else None)
    return Solution(
        **m.common(),
        **(top.fields() if top else {}),
        sigma_w2=1.0,
        sigma_b2=0.0,
        activations={x.act.name: ActivationParams(**x.fields()) for x in per} if len(per) > 1 else None,
        c_curv_1=curv if has_curv else None,
        c_slope_1=slope,
        network_c_f_0=float(global_at[-1]),
        root=RootInfo(
            starting_point=list(shown.tr.starting_point), attempt=shown.tr.attempt, rejected=shown.tr.rejected
        ),
        c_map=CMapSample(c=grid.tolist(), global_=global_at[:-1].tolist(), local=shown.table(grid).tolist()),
        other_roots=_other_roots(m, per),
        layers=layer_inits(graph, m.request.init),
        warnings=warnings,
    )


def _other_roots(m: MethodInput, per: list[_Local]) -> list | None:
    """Only asked for (``roots: all``), for one smooth function: a rectifier's root is unique or dks's."""
    if m.request.roots != "all" or len(per) != 1 or not per[0].has_curv:
        return None
    return root_scan.other_roots(m.program, per[0].act, per[0].tr, m.request.method, m.targets)


METHODS: dict[str, Method] = {
    "tat": Method(METHOD_TARGETS["tat"], True, _tat),
    "dks": Method(METHOD_TARGETS["dks"], True, _dks),
    "eoc": Method(METHOD_TARGETS["eoc"], True, _eoc),
    "sparse_eoc": Method(METHOD_TARGETS["sparse_eoc"], True, _sparse_eoc),
    # geometric initialization states its own assumptions (GR paper Table 1)
    "geometric": Method(METHOD_TARGETS["geometric"], False, _geometric),
}
