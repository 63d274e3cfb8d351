"""The attention part of a sequence graph's answer: shaping, initializations and the token kernel.

``engine.solve`` solves the activations (TAT or DKS) on the graph's scalar view
(``sequence_graph``); ``complete_sequence_answer`` then adds, after "Deep Transformers without
Shortcuts: Modifying Self-attention for Faithful Signal Propagation" (He, Martens et al.,
arXiv:2302.10322) and "The Shaped Transformer" (Noci et al., arXiv:2306.17759):

- ``attention``: one compact generator per attention node (``token_kernels.shaping_generators``:
  E-SPA and U-SPA's Cholesky ratios with the paper's schedule, Value-SkipInit, shaped attention),
  which ``schemas.attention_init.expand_attention`` expands for any sequence length;
- ``layers`` for every dense node of the full graph: the query projections zero (so the logits
  vanish and the attention matrix is the generator's fixed A; paper section 3 and Value-SkipInit's
  section 4), the others as the method prescribes (keys included: 1/fan_in variance, or orthogonal);
- ``token_kernel``: the schedule and its last target, and the prediction: the exact infinite-width
  propagation of orthonormal input tokens through the real network (``token_program``), the
  ``output`` for T <= ``MAX_TOKEN_KERNEL`` tokens, else the kernel of the leading
  ``MAX_TOKEN_KERNEL`` tokens (``leading``): at initialization every attention matrix is lower
  triangular (the Cholesky ratios) or the identity (Value-SkipInit, shaped attention at infinite
  width), and every other op acts per token or entrywise, so the first tokens' kernel never reads
  the later tokens, and it is exact whatever T is.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from ...schemas.activations import canonical_name
from ...schemas.attention_init import expand_attention
from ...schemas.ops import AFFINE
from ...schemas.solve import (
    AttentionAnswer,
    AttentionLayer,
    ScheduleEntry,
    Solution,
    SolveRequest,
    TokenKernel,
)
from ..graph.build import NetworkGraph, Node
from ..limits import MAX_TOKEN_KERNEL
from ..maps.token_kernels import (
    activation_token_kernel,
    activation_token_mean,
    answer_activation,
    shaping_generators,
    shaping_schedule,
    shaping_target,
)
from ..network.initialization import layer_inits
from .graph import SequenceView
from .joint_schedule import block_curves, joint_espa_schedule, joint_uspa_schedule, mean_correlation, skipless_reason
from .token_program import TokenKernelProgram, TokenValue, mean_token_correlation

__all__ = ["complete_sequence_answer", "predicted_tokens"]

_TRANSFORM = ("negative_slope", "input_scale", "input_shift", "output_scale", "output_shift")


def predicted_tokens(seq_len: int) -> int:
    """How many leading tokens the answer's token kernel covers."""
    return min(seq_len, MAX_TOKEN_KERNEL)


def complete_sequence_answer(answer: Solution, graph: NetworkGraph, view: SequenceView, request: SolveRequest) -> None:
    """Add the attention shaping, the full graph's initializations and the token kernel to ``answer``
    (solved on ``view``; ``graph`` is the full anonymized graph). Module docstring."""
    layers = len(view.attention)
    nodes = graph.nodes
    sigma_w2 = 1.0 if answer.sigma_w2 is None else answer.sigma_w2
    sigma_b2 = 0.0 if answer.sigma_b2 is None else answer.sigma_b2
    dense = {nd.index: (sigma_w2, sigma_b2) for nd in nodes if nd.kind == AFFINE}
    # the answer's sum_scales renormalize sums that one atom reaches through several paths; the
    # adapters multiply those sums' weights by them, so the propagation does too
    scales = answer.sum_scales or {}
    sum_scales = {nd.index: scales[nd.user_id] for nd in nodes if nd.user_id in scales}
    activation_maps = _activation_maps(graph, answer)
    kernel = None  # the output token kernel, when the schedule's design has already propagated it
    if request.attention is None:
        # a token-wise network (no attention node: the parser requires the key exactly when there is
        # one): every map is entrywise, and the token kernel follows the MLP's C maps alone
        generators, schedule, target = [], [], None
    else:
        shaping, params = request.attention.shaping, request.attention.parameters()
        schedule_params = {k: v for k, v in params.items() if k != "temperature"}
        schedule_name = request.attention.schedule_name()
        joint = None
        if schedule_name == "joint":
            joint = _joint(graph, view, dense, sum_scales, activation_maps, shaping, schedule_params, answer)
            if joint is None:
                schedule_name = "paper"
        if joint is not None:
            generators, schedule, kernel = joint
        else:
            generators = shaping_generators(shaping, layers, **params)
            schedule = shaping_schedule(shaping, layers, **schedule_params)
        target = shaping_target(shaping, layers, **schedule_params)
        answer.attention = AttentionAnswer(
            shaping=shaping,
            parameters=params,
            schedule=schedule_name,
            layers=[
                AttentionLayer(node=nodes[i].user_id, generator=g)
                for i, g in zip(view.attention, generators, strict=True)
            ],
        )
    answer.layers = _full_layers(graph, view, request.init, sigma_w2, sigma_b2)
    if answer.graph_summary is not None:
        answer.graph_summary.nodes = graph.n
    # the per-layer Jacobian statistics are an MLP's (random matrices in a chain): attention mixes tokens
    answer.jacobian = None

    tokens = predicted_tokens(view.tokens)
    if kernel is None:
        kernel = _propagate(graph, view, generators, tokens, dense, sum_scales, activation_maps)
    rows = kernel.tolist()
    whole = tokens == view.tokens
    answer.token_kernel = TokenKernel(
        tokens=view.tokens,
        output=rows if whole else None,
        leading=None if whole else rows,
        leading_tokens=None if whole else tokens,
        target=target,
        target_mean=_target_mean(target, view.tokens),
        predicted_mean=mean_token_correlation(kernel) if target else None,
        schedule=[ScheduleEntry(node=nodes[i].user_id, **s) for i, s in zip(view.attention, schedule, strict=False)],
    )
    if not whole:
        answer.warnings.append(
            f"token_kernel.output is given for sequences of at most {MAX_TOKEN_KERNEL} tokens; for these "
            f"{view.tokens} tokens token_kernel.leading holds the (exact) kernel of the first {tokens}"
        )
    diag = np.diag(kernel)
    if abs(diag - 1.0).max() > 0.05:
        joint = answer.attention is not None and answer.attention.schedule == "joint"
        answer.warnings.append(
            f"the predicted output token kernel's diagonal ranges over [{diag.min():.4g}, {diag.max():.4g}], "
            + (
                "not q = 1: the joint schedule fits each block's kernel to a floored exponential, which is "
                "least exact near the first tokens"
                if joint
                else "not q = 1: the attention's location-dependent rescaling and the MLP blocks' C maps compound"
                + (' (the "joint" schedule keeps q = 1 on skipless stacks)' if request.attention else "")
            )
        )


def _joint(graph, view, dense, sum_scales, activation_maps, shaping: str, params: dict, answer: Solution):
    """(generators, schedule entries, their output kernel when already propagated, else None) of the
    joint schedule (``joint_schedule``), or None with a warning in ``answer`` where the graph has
    shortcuts around its attention nodes (the paper's schedule is used then)."""
    if view.tokens < 2:  # one token has no correlation to keep: every schedule's matrices are [1]
        return None
    reason = skipless_reason(graph, view.attention)
    if reason is not None:
        answer.warnings.append(
            f"{shaping}'s joint schedule needs a skipless stack, and "
            + reason
            + ": the generators follow the paper's schedule, which moves the kernel by attention alone, and "
            "token_kernel.output says where the MLP blocks take it"
        )
        return None
    with _one_blas_thread():
        c, curves = block_curves(graph, view.attention, dense, sum_scales, activation_maps)
    if shaping == "u-spa":
        u = joint_uspa_schedule(c, curves, params["final_rho"])
        entries = [
            {"rho": k, "diagonal": math.sqrt(1.0 - k), "block_rho": b}
            for k, b in zip(u.targets, u.boundaries, strict=True)
        ]
        return u.generators(), entries, None
    e = joint_espa_schedule(c, curves, params["final_gamma"], view.tokens)
    # the design fits each block's kernel to a floored exponential; one exact propagation of the
    # leading tokens measures how far the design's mean correlation there is off (0.037 at T = 64, 12
    # blocks, eta 0.5), and the plan aims that much further (the miss is near-linear in the aim:
    # 0.0003 after the step). Like with like: for T > 256 the exact kernel covers the leading 256
    # tokens only, and so does the design's mean it is compared with.
    tokens = predicted_tokens(view.tokens)
    kernel = _propagate(graph, view, e.generators(), tokens, dense, sum_scales, activation_maps)
    missed = e.leading_mean(tokens) - mean_token_correlation(kernel)
    if abs(missed) > 1e-3:
        e = joint_espa_schedule(c, curves, params["final_gamma"], view.tokens, aim=e.target_mean + missed)
        kernel = None  # new generators: propagated again by the caller
    entries = [
        {"gamma": b, "diagonal": math.sqrt(-math.expm1(-2.0 * b)), "source_floor": f, "block_mean": m}
        for b, (_, f), m in zip(e.betas, e.sources, e.block_means, strict=True)
    ]
    return e.generators(), entries, kernel


def _propagate(graph, view, generators, tokens, dense, sum_scales, activation_maps) -> np.ndarray:
    """The exact output token kernel of the first ``tokens`` tokens for these generators."""
    nodes = graph.nodes
    mixers = {
        i: expand_attention(g, tokens, bool(nodes[i].attrs["causal"])).matrix()
        for i, g in zip(view.attention, generators, strict=True)
    }
    program = TokenKernelProgram(graph, mixers, dense, sum_scales)
    with _one_blas_thread():
        return program.global_map(np.eye(tokens), activation_maps).kernel


def _target_mean(target: dict | None, tokens: int) -> float | None:
    """The target family's mean correlation over the T tokens' pairs (closed form per lag)."""
    if target is None or target.get("family") == "identity":
        return None
    lags = np.arange(tokens, dtype=float)
    if target["family"] == "exponential":
        return mean_correlation(np.exp(-target["gamma"] * lags))
    return float(target["rho"]) if tokens > 1 else 1.0


def _one_blas_thread():
    """BLAS on one thread for the propagation: its products are at most 256 x 256, where threads gain
    little, and on a machine busy with other solves (the service's solver processes) they mostly wait
    for each other: a 72-block T = 2048 solve took 7.5 s with OpenBLAS's default threads and 0.75 s
    with one on a 2-core machine at load 11 (``bench/transformer_bench.py``). A no-op without
    threadpoolctl."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency, but the engine works without it
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _activation_maps(graph: NetworkGraph, answer: Solution):
    """r(value, slot): each activation slot's entrywise token-kernel map, from the answer's transform."""
    acts = []
    for fn in graph.activation_fns():
        per = answer.for_function(fn)
        name = canonical_name(per.activation) or per.activation
        acts.append(answer_activation(name, {k: getattr(per, k) for k in _TRANSFORM}))

    def r(value: TokenValue, slot: int) -> TokenValue:
        act = acts[slot]
        return TokenValue(activation_token_kernel(value.kernel, act), activation_token_mean(np.diag(value.kernel), act))

    return r


def _full_layers(graph: NetworkGraph, view: SequenceView, init: str, sigma_w2: float, sigma_b2: float) -> list:
    """Every dense node's initialization in the full graph: fan-in and fan-out are feature counts
    (dense acts per token), and the query projections are zero (a zero-variance Gaussian)."""
    features = NetworkGraph(
        [Node(nd.index, nd.user_id, nd.op, nd.kind, nd.inputs, nd.attrs, nd.shape[-1:]) for nd in graph.nodes],
        graph.output,
    )
    layers = layer_inits(features, init, sigma_w2, sigma_b2)
    for layer in layers:
        if layer.node in view.queries:
            layer.distribution, layer.gain, layer.weight_variance = "gaussian", 0.0, 0.0
    return layers
