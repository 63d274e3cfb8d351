"""One entry point: a validated ``SolveRequest`` in, a ``Solution`` (the contract's answer) out.

``prepare`` canonicalizes the request and computes its key without solving (the service looks
the key up in its cache first); ``solve_prepared`` does the work. Every achieved value in the
answer is recomputed from the returned parameters, not echoed from the targets.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np

from .. import ENGINE_VERSION
from ..errors import SigpropError
from ..schemas.graph import Template
from ..schemas.solve import (CMapSample, FixedPoint, GraphSummary, JacobianSummary, LayerInit, ResidualBeta, RootInfo,
                             Solution, SolveRequest, TrainableAnswer, VMapSample)
from . import deep_kernel_shaping, eoc, geometric, jacobian, sparse_eoc, tat
from .activations import Activation, get_activation, transformed
from .graph import ACT, CONCAT, SUM, NetworkGraph, build_graph, correlated_sum_warnings
from .initialization import layer_inits
from .qc_maps import HermiteCMap, leaky_relu_c_map, local_stats
from .subnetworks import SubnetworkProgram, compile_subnetworks
from .templates import expand_template

METHOD_TARGETS = {
    "tat": ("eta", "tau"),
    "dks": ("zeta",),
    "eoc": ("q_star",),
    "sparse_eoc": ("sparsity", "v_slope", "q_star"),
    "geometric": (),
}


@dataclass
class Prepared:
    request: SolveRequest
    graph: NetworkGraph
    key: str

    @property
    def ids(self) -> list[str]:
        """The request's node ids by canonical index."""
        return [nd.user_id for nd in self.graph.nodes]


def request_key(graph: NetworkGraph, request: SolveRequest) -> str:
    """Hex digest of the canonical request: equal for reordered or renamed graphs (contract 2)."""
    payload = {
        "engine": ENGINE_VERSION,
        "graph": graph.canonical(),
        "method": request.method,
        "activation": request.activation,
        "targets": {k: float(v) for k, v in request.targets.model_dump(exclude_none=True).items()},
        "init": request.init,
        "c_map_points": request.c_map_points,
    }
    if request.trainable is not None:
        payload["trainable"] = request.trainable.model_dump()
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def prepare(request: SolveRequest) -> Prepared:
    wire_graph = expand_template(request.graph) if isinstance(request.graph, Template) else request.graph
    graph = build_graph(wire_graph, default_activation=request.activation)
    return Prepared(request, graph, request_key(graph, request))


def solve(request: SolveRequest) -> Solution:
    return solve_prepared(prepare(request))


def solve_json(request: SolveRequest) -> str:
    """The answer as the CLI prints it and POST /v1/solve sends it (apart from "cached")."""
    prep = prepare(request)
    return personalize_json(solve_canonical(prep).to_json(), prep.ids, prep.graph.warnings)


def _check_targets(request: SolveRequest) -> dict[str, float]:
    given = request.targets.model_dump(exclude_none=True)
    allowed = METHOD_TARGETS[request.method]
    extra = sorted(set(given) - set(allowed))
    if extra:
        raise SigpropError("invalid_target", f"method '{request.method}' does not use target(s) {', '.join(extra)}",
                           f"targets for '{request.method}': {', '.join(allowed) or 'none'}")
    return given


def _single_activation(graph: NetworkGraph, request: SolveRequest) -> Activation:
    fns = graph.activation_fns()
    if len(fns) > 1:
        raise SigpropError("invalid_request", f"the graph uses several activation functions ({', '.join(fns)})",
                           "this method solves one activation per request: drop the per-node 'fn' attributes")
    return get_activation(fns[0] if fns else request.activation)


def _summary(graph: NetworkGraph, program: SubnetworkProgram) -> GraphSummary:
    return GraphSummary(nodes=graph.n, depth=graph.depth(), activations=graph.count(ACT), sums=graph.count(SUM),
                        concats=graph.count(CONCAT), weighted=sum(1 for nd in graph.nodes if nd.kind == "affine"),
                        subnetworks_considered=program.regions)


def _c_grid(points: int) -> np.ndarray:
    return np.linspace(-1.0, 1.0, points)


def _warnings_for(graph: NetworkGraph) -> list[str]:
    out = list(graph.warnings) + correlated_sum_warnings(graph.nodes)
    pools = [nd.user_id for nd in graph.nodes if nd.op == "max_pool"]
    if pools:
        out.append(f"max_pool is not covered by the Q/C map theory and is treated as the identity ({', '.join(pools[:5])})")
    return out


def _smooth_warnings(act: Activation) -> list[str]:
    out = []
    if not act.d1_continuous:
        out.append(f"'{act.name}' has a jump in its first derivative at 0, so strictly C''(1) is infinite; "
                   "like the reference dks, the solve uses the smooth part of phi''")
    return out


def solve_prepared(prep: Prepared) -> Solution:
    """The answer for this request: the canonical answer relabelled with the request's ids."""
    return personalize(solve_canonical(prep), prep.ids, prep.graph.warnings)


_PLACEHOLDER = re.compile(r"#(\d+)")


def personalize(canonical: Solution, ids, graph_warnings=()) -> Solution:
    """Put a request's own node ids (and its graph's warnings) into a canonical answer."""
    return Solution.model_validate_json(personalize_json(canonical.to_json(), ids, graph_warnings))


def personalize_json(canonical_json: str, ids, graph_warnings=(), cached: bool = False) -> str:
    """``personalize`` on the serialized answer, which is what the cache holds and serves.

    Answers are computed on ``NetworkGraph.anonymized()``, so every node they name is a
    ``#<canonical index>`` placeholder ('#' cannot occur in ids or anywhere else in an answer);
    equal keys mean equal canonical graphs, so the mapping is exact for any request with the same
    key. Ids are restricted to characters JSON never escapes, so substituting them into the text
    gives the same bytes as re-serializing: the CLI and the HTTP service produce identical answers.
    """
    text = _PLACEHOLDER.sub(lambda m: ids[int(m.group(1))], canonical_json) if "#" in canonical_json else canonical_json
    if cached:
        text = text.replace('"cached":false', '"cached":true', 1)
    if graph_warnings:
        answer = Solution.model_validate_json(text)
        answer.warnings = list(graph_warnings) + answer.warnings
        text = answer.to_json()
    return text


def solve_canonical(prep: Prepared) -> Solution:
    """The answer on the anonymized graph: what the cache stores under ``prep.key``."""
    anonymous = Prepared(prep.request, prep.graph.anonymized(), prep.key)
    answer = _solve_method(anonymous)
    if prep.request.trainable is not None:
        answer.trainable, notes = _trainable(anonymous, answer)
        answer.warnings.extend(notes)
    return answer


def _trainable(prep: Prepared, answer: Solution) -> tuple[TrainableAnswer, list[str]]:
    """Mark the TReLU slope and residual betas trainable (trainable-TAT paper, sections 2.1-2.2)."""
    opts, graph = prep.request.trainable, prep.graph
    notes = []
    slope = opts.negative_slope and answer.negative_slope is not None
    if opts.negative_slope and not slope:
        notes.append("trainable negative_slope applies to TAT with leaky_relu only; ignored")
    beta = None
    if opts.residual_beta != "none":
        sums = [nd.user_id for nd in graph.nodes if nd.kind == SUM and len(nd.inputs) == 2]
        if not sums:
            notes.append("trainable residual beta needs residual sums in the graph; there are none")
        else:
            scale = opts.beta / np.sqrt(len(sums))
            beta = ResidualBeta(mode=opts.residual_beta, init=opts.beta, blocks=len(sums), scale=float(scale), sums=sums,
                                prune_fraction=opts.prune_fraction)
            notes.append("with residual beta the sums become x + beta / sqrt(L) F(x): un-normalized, so the "
                         "solved kernel maps describe the network only up to that rescaling")
    return TrainableAnswer(negative_slope=slope, residual_beta=beta), notes


def _solve_method(prep: Prepared) -> Solution:
    request, graph = prep.request, prep.graph
    targets = _check_targets(request)
    method = request.method
    program = compile_subnetworks(graph)
    if method == "geometric":
        return _geometric_solution(prep, program)
    if method == "sparse_eoc":
        return _sparse_eoc_solution(prep, program, targets)
    act = _single_activation(graph, request)
    warnings = _warnings_for(graph)
    grid = _c_grid(request.c_map_points)
    common = dict(key=prep.key, engine_version=ENGINE_VERSION, method=method, activation=request.activation,
                  targets=targets, graph_summary=_summary(graph, program))

    if method == "tat" and act.name == "leaky_relu":
        if "eta" not in targets:
            raise SigpropError("invalid_target", "TAT with leaky_relu needs the target 'eta'",
                               "add \"targets\": {\"eta\": 0.9} (the paper uses 0.9 or 0.95)")
        if "tau" in targets:
            raise SigpropError("invalid_target", "'tau' is the target of TAT for smooth activations",
                               "for leaky_relu give 'eta' only")
        a = tat.solve_tat_leaky_relu(program, targets["eta"])
        out_scale = float(np.sqrt(2.0 / (1.0 + a * a)))
        phi_hat = transformed(get_activation("leaky_relu", negative_slope=a), output_scale=out_scale)
        st = local_stats(phi_hat)
        local = lambda c, _slot: leaky_relu_c_map(c, a)  # noqa: E731
        relu = lambda c, _slot: leaky_relu_c_map(c, 0.0)  # noqa: E731
        return Solution(
            **common, negative_slope=a, output_scale=out_scale, sigma_w2=1.0, sigma_b2=0.0,
            c_f_0=float(tat.max_c_value(program, a)), network_c_f_0=float(program.global_map(0.0, local)),
            q_1=st.q_1, q_slope_1=st.q_slope_1, local_c_0=st.c_0, local_c_slope_1=st.c_slope_1, chi_1=st.c_slope_1,
            c_map=CMapSample(c=grid.tolist(), global_=program.global_map(grid, local).tolist(),
                             local=local(grid, 0).tolist(), untransformed=program.global_map(grid, relu).tolist()),
            jacobian=_jacobian_summary(graph, act),
            layers=layer_inits(graph, request.init), warnings=warnings + _maximizer_note(program, 0.0, local))

    if method in ("tat", "dks") and not act.smooth:
        hint = ("use method 'tat' with activation 'leaky_relu' (TReLU)" if act.name == "relu" or act.positively_homogeneous
                else "choose a smooth activation such as softplus, tanh, gelu or swish")
        raise SigpropError("unsupported_activation",
                           f"'{act.name}' is not smooth: {'TAT' if method == 'tat' else 'DKS'} needs a finite C''(1)", hint)

    if method == "tat":
        if "tau" not in targets:
            raise SigpropError("invalid_target", f"TAT with the smooth activation '{act.name}' needs the target 'tau'",
                               "add \"targets\": {\"tau\": 0.3}; 'eta' is for leaky_relu")
        sol = tat.solve_tat_smooth(program, act, targets["tau"])
        return _smooth_solution(common, program, graph, request, act, sol.transform, grid,
                                warnings + _smooth_warnings(act), curvature=True)

    if method == "dks":
        if "zeta" not in targets:
            raise SigpropError("invalid_target", "DKS needs the target 'zeta'", "add \"targets\": {\"zeta\": 1.5}")
        sol = deep_kernel_shaping.solve_dks(program, act, targets["zeta"])
        return _smooth_solution(common, program, graph, request, act, sol.transform, grid,
                                warnings + _smooth_warnings(act), curvature=False)

    # eoc
    sol = eoc.solve_eoc(act, targets.get("q_star", 1.0))
    sw2, sb2, qs = sol.sigma_w2, sol.sigma_b2, sol.q_star
    table = HermiteCMap(act, input_scale=float(np.sqrt(qs)))
    q_post = float(sw2 and (qs - sb2) / sw2)  # E[phi(sqrt(q*) z)^2]

    def combined(c, _slot):
        # dense + activation at the fixed point: pre-activation correlation -> next one
        return (sw2 * q_post * table(c) + sb2) / qs

    return Solution(
        **common, sigma_w2=sw2, sigma_b2=sb2, q_star=qs, chi_1=sol.chi_1, v_slope=sol.v_slope,
        v_curvature=sol.v_curvature, jacobian=_jacobian_summary(graph, act),
        c_map=CMapSample(c=grid.tolist(), global_=program.global_map(grid, combined).tolist(),
                         local=combined(grid, 0).tolist()),
        layers=layer_inits(graph, request.init, sw2, sb2), warnings=warnings + _c_map_accuracy(table))


def _sparse_eoc_solution(prep: Prepared, program: SubnetworkProgram, targets: dict) -> Solution:
    """Sparse Edge of Chaos (sparsity paper sections 3-4, Appendices A, E, F)."""
    request, graph = prep.request, prep.graph
    fns = graph.activation_fns()
    if len(fns) > 1 or (fns and fns[0] != request.activation):
        raise SigpropError("invalid_request", f"the graph uses activation(s) {', '.join(fns)}, the request '{request.activation}'",
                           "sparse_eoc solves one sparsifying activation: drop the per-node 'fn' attributes")
    if request.activation not in sparse_eoc.SPARSE_KINDS:
        raise SigpropError("unsupported_activation", f"sparse_eoc does not take '{request.activation}'",
                           f"use one of {', '.join(sparse_eoc.SPARSE_KINDS)}")
    if "sparsity" not in targets:
        raise SigpropError("invalid_target", "sparse_eoc needs the target 'sparsity'",
                           "add \"targets\": {\"sparsity\": 0.8, \"v_slope\": 0.7} (v_slope for crelu and cst)")
    sol = sparse_eoc.solve_sparse_eoc(request.activation, targets["sparsity"], targets.get("v_slope"),
                                      targets.get("q_star", 1.0))
    params = {"tau": sol.tau} if sol.m is None else {"tau": sol.tau, "m": sol.m}
    act = get_activation(request.activation, **params)
    sw2, sb2, qs = sol.sigma_w2, sol.sigma_b2, sol.q_star
    table = HermiteCMap(act, input_scale=float(np.sqrt(qs)), terms=160)
    q_post = (qs - sb2) / sw2

    def combined(c, _slot):
        return (sw2 * q_post * table(c) + sb2) / qs

    grid = _c_grid(request.c_map_points)
    qs_grid = np.linspace(3 * qs / request.c_map_points, 3 * qs, request.c_map_points)
    depth = graph.depth()
    return Solution(
        key=prep.key, engine_version=ENGINE_VERSION, method="sparse_eoc", activation=request.activation,
        targets=targets, graph_summary=_summary(graph, program), tau=sol.tau, m=sol.m, sigma_w2=sw2, sigma_b2=sb2,
        q_star=qs, sparsity=sparse_eoc.expected_sparsity(request.activation, sol.tau, qs),
        v_slope=sol.v_slope, v_curvature=sol.v_curvature, chi_1=sol.chi_1,
        fixed_points=[FixedPoint(q=q, stable=st) for q, st in sol.fixed_points], only_stable=sol.only_stable,
        jacobian_spectrum_variance={
            "gaussian": sparse_eoc.jacobian_spectrum_variance(sw2, depth, orthogonal=False),
            "orthogonal": sparse_eoc.jacobian_spectrum_variance(sw2, depth, orthogonal=True)},
        v_map=VMapSample(q=qs_grid.tolist(), v=np.asarray(sparse_eoc.variance_map(
            request.activation, qs_grid, sol.tau, sol.m, sw2, sb2)).tolist()),
        c_map=CMapSample(c=grid.tolist(), global_=program.global_map(grid, combined).tolist(), local=combined(grid, 0).tolist()),
        layers=layer_inits(graph, request.init, sw2, sb2),
        warnings=_warnings_for(graph) + list(sol.warnings) + _c_map_accuracy(table))


def _geometric_solution(prep: Prepared, program: SubnetworkProgram) -> Solution:
    """Geometric initialization and GR scaling (GR scaling paper, equations 1 and 7, Appendix E)."""
    request, graph = prep.request, prep.graph
    act = _single_activation(graph, request)
    sol = geometric.solve_geometric(graph, act)
    layers = []
    for lay in sol.layers:
        var = lay["init_second_moment"]
        nd = graph.nodes[lay["node"]]
        layers.append(LayerInit(
            id=lay["id"], node=lay["node"], op=lay["op"], fan_in=lay["fan_in"], fan_out=lay["fan_out"],
            kernel=lay["kernel"], distribution="gaussian", gain=float(np.sqrt(var)), weight_variance=var,
            bias="zeros" if nd.attrs.get("bias", True) else "none", alpha=lay["alpha"],
            weight_second_moment=lay["weight_second_moment"], gamma=lay["gamma"]))
    return Solution(
        key=prep.key, engine_version=ENGINE_VERSION, method="geometric", activation=request.activation,
        targets={}, graph_summary=_summary(graph, program), input_second_moment=sol.input_second_moment,
        logits_scale=sol.output_scale, gamma_ratio=sol.gamma_ratio, layers=layers, jacobian=_jacobian_summary(graph, act),
        # geometric words its own max_pool warning (Table 1)
        warnings=list(graph.warnings) + correlated_sum_warnings(graph.nodes) + list(sol.warnings))


def _jacobian_summary(graph: NetworkGraph, act: Activation) -> JacobianSummary | None:
    """The finite-width Jacobian statistics, for ReLU-family graphs whose structure the theorems cover."""
    if act.name not in ("relu", "leaky_relu"):
        return None
    try:
        st = jacobian.detect_structure(graph)
        if st is None:
            return None
        stats = jacobian.jacobian_stats(st.kind, st.depth, st.width, st.m, st.alpha)
        rec = None
        if st.kind == "residual":
            r = jacobian.residual_branch_scale(st.depth, st.width, st.m)
            rec = {k: r[k] for k in ("branch_scale", "shortcut_weight", "branch_weight", "alpha")}
        elif st.kind == "dense":
            rec = {"alpha": 1.0}
    except (SigpropError, ArithmeticError):
        # supplementary information: a graph outside the theorems' assumptions, or so deep that
        # the predicted moments overflow a float, gets none
        return None
    return JacobianSummary(kind=st.kind, depth=st.depth, width=st.width, m=stats.m, alpha=st.alpha, mean=stats.mean,
                           var_upper=stats.var_upper, var_exact=stats.var_exact, growth_law=stats.growth_law,
                           recommended=rec)


def max_slope_and_curvature(program: SubnetworkProgram, local_slope: float, local_curv: float) -> np.ndarray:
    """(max_g C'_g(1), max_g C''_g(1)) over subnetworks g, for any local C'(1) and C''(1).

    The pair (C'(1), C''(1)) of a composition follows the chain rule at the fixed point 1:
    (s y1, C''(1) y1^2 + s y2) for a layer after a subnetwork with (y1, y2); normalized sums and
    concatenations average both linearly. With C'(1) = 1 (TAT) the second component is the B.4
    recipe; DKS needs the general form because its layers have C'(1) = zeta^(1/L) != 1.
    """
    def layer(y, _slot):
        return np.array([local_slope * y[0], local_curv * y[0] ** 2 + local_slope * y[1]])

    return program.maximize(np.array([1.0, 0.0]), layer)


def _c_map_accuracy(table: HermiteCMap) -> list[str]:
    if table.tail <= 1e-4:
        return []
    return [f"the sampled c_map is accurate to about {table.tail:.1g} (Hermite series tail of a kinked activation)"]


def _maximizer_note(program: SubnetworkProgram, x: float, r) -> list[str]:
    name = program.argmax(x, r)
    return [] if name == "the whole network" else [f"the maximizing subnetwork is not the whole network: it runs {name}"]


def _smooth_solution(common, program, graph, request, act, tr, grid, warnings, curvature: bool) -> Solution:
    p = tr.params
    phi_hat = transformed(act, p["input_scale"], p["input_shift"], p["output_scale"], p["output_shift"])
    st = local_stats(phi_hat)
    table = HermiteCMap(act, **p)
    local = lambda c, _slot: table(c)  # noqa: E731
    slope, curv = (float(v) for v in max_slope_and_curvature(program, st.c_slope_1, st.c_curv_1))
    return Solution(
        **common, input_scale=p["input_scale"], input_shift=p["input_shift"], output_scale=p["output_scale"],
        output_shift=p["output_shift"], sigma_w2=1.0, sigma_b2=0.0,
        c_curv_1=curv, c_slope_1=slope, network_c_f_0=float(program.global_map(np.array([0.0]), local)[0]),
        q_1=st.q_1, q_slope_1=st.q_slope_1, local_c_0=st.c_0, local_c_slope_1=st.c_slope_1,
        local_c_curv_1=st.c_curv_1, chi_1=st.c_slope_1,
        root=RootInfo(starting_point=list(tr.starting_point), attempt=tr.attempt, rejected=tr.rejected),
        c_map=CMapSample(c=grid.tolist(), global_=program.global_map(grid, local).tolist(), local=table(grid).tolist()),
        layers=layer_inits(graph, request.init),
        warnings=warnings + _c_map_accuracy(table) + (_maximizer_note(program, 0.0, lambda y, _s: st.c_curv_1 + y) if curvature
                             else _maximizer_note(program, 1.0, lambda y, _s: st.c_slope_1 * y)))
