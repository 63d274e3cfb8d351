"""Diagnosis of an applied sequence model: its output token kernel, measured against the answer's.

The answer's ``token_kernel.output`` is the exact infinite-width propagation of the token kernel
of orthonormal input tokens (q = 1 per token) through the network (attention matrices, the MLPs'
C maps, sums, layer norms; "Deep Transformers without Shortcuts", He, Martens et al.,
arXiv:2302.10322, section 3). :func:`diagnose_tokens` feeds such tokens to one or several applied
networks (``apply`` with different seeds), measures ``K_ij = y_i . y_j / width`` of the output
tokens and each probed node's q (mean square over tokens and features), and compares them with
the answer entry by entry. The comparison, its noise (the standard error over several networks,
or a stated figure for one), its flagging threshold and its warnings are framework-free and shared
with the Flax adapter: ``sigprop.client.token_diagnosis``; here only the measuring.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from ...schemas.ops import OP_TABLE, SOURCE
from ..solution import as_solution
from ..token_diagnosis import (
    FLAG_SIGMAS,
    NodeQ,
    TokenKernelDiagnosis,
    answer_token_kernel,
    flag_sigmas,
    judge_tokens,
    stated_token_noise,
    token_kernel_of,
)
from ..token_diagnosis import orthonormal_tokens as _orthonormal_tokens
from .modules import TransformedActivation
from .sequence_apply import answer_part

__all__ = ["TokenKernelDiagnosis", "diagnose_tokens", "orthonormal_tokens", "flag_sigmas", "FLAG_SIGMAS", "NodeQ"]


def orthonormal_tokens(batch: int, seq_len: int, width: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """``batch`` sets of ``seq_len`` orthogonal tokens of mean square 1 (``x_i . x_j = width *
    delta_ij``): the answer's input kernel ``I`` at q = 1, as a torch tensor
    (:func:`sigprop.client.token_diagnosis.orthonormal_tokens`). Needs ``seq_len <= width``."""
    return torch.from_numpy(_orthonormal_tokens(batch, seq_len, width, seed=seed)).to(dtype)


def _probes(model: nn.Module) -> dict[str, tuple[str, str]]:
    """Graph id -> (module path, op) of the nodes ``apply`` left a module for."""
    info = getattr(model, "sigprop_sequence", None) or {}
    return dict(info.get("probes", {}))


def _measure(model: nn.Module, x: torch.Tensor, probes: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """The output on ``x`` (eval mode, no gradients) and each probed node's q."""
    q: dict[str, float] = {}
    hooks = []
    modules = dict(model.named_modules())
    for gid, (path, _) in probes.items():
        m = modules.get(path)
        if m is None:
            continue

        def hook(_m, _inp, out, gid=gid):
            out = out[0] if isinstance(out, tuple) else out
            q[gid] = float(out.detach().double().pow(2).mean())

        hooks.append(m.register_forward_hook(hook))
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            if "huggingface" in (getattr(model, "sigprop_sequence", None) or {}):  # the embeddings' output is x
                from .huggingface_apply import forward_embeddings

                y = forward_embeddings(model, x)
            else:
                y = model(x)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return y, q


def diagnose_tokens(models, solution, *, batch: int = 4, seed: int = 0) -> TokenKernelDiagnosis:
    """The output token kernel of one applied sequence model (``apply(...).model``) or a list of
    them (the same network applied with different seeds), against the answer's
    ``token_kernel.output`` (module docstring). ``batch`` sets of orthonormal tokens are fed to
    each network; ``str()`` is a summary and a per-node q table."""
    models = list(models) if isinstance(models, (list, tuple)) else [models]
    sol = as_solution(solution)
    predicted = answer_token_kernel(sol)
    t = predicted.shape[0]
    info = getattr(models[0], "sigprop_sequence", None) or {}
    graph = info.get("graph", {})
    width_in = next(
        (nd["shape"][-1] for nd in graph.get("nodes", []) if OP_TABLE[nd.get("op", "")].kind == SOURCE), None
    )
    if width_in is None:
        raise ValueError("diagnose_tokens needs models returned by apply() for a sequence answer")
    x = orthonormal_tokens(batch, t, int(width_in), seed=seed)
    per_net, qs = [], []
    for model in models:
        y, q = _measure(model, x, _probes(model))
        per_net.append(token_kernel_of(y.detach().double().cpu().numpy()))
        qs.append(q)
    stack = np.stack(per_net)
    measured = stack.mean(axis=0)
    if len(models) >= 2:
        noise, source = stack.std(axis=0, ddof=1) / math.sqrt(len(models)), "networks"
    else:
        noise, source = stated_token_noise(sol, graph, x.double().numpy(), _phi(sol)), "stated"
    q_star = sol.q_star if sol.q_star is not None else 1.0
    probes = _probes(models[0])
    nodes = [
        NodeQ(gid, role, 0.0 if role == "query" else q_star, float(np.mean([q[gid] for q in qs if gid in q])))
        for gid, (_, role) in probes.items()  # a probe's role: a graph op, or "query" (zero-initialized)
        if any(gid in q for q in qs)
    ]
    diag = TokenKernelDiagnosis(
        sol.method,
        sol.activation,
        (answer_part(solution, "attention") or {}).get("shaping"),
        len(models),
        predicted,
        measured,
        noise,
        source,
        nodes,
    )
    judge_tokens(diag, layer="a Linear")
    return diag


def _phi(sol):
    """The answer's transformed activation as a numpy function, for the stated noise (None where
    it cannot be built: the noise then takes the activation as the identity)."""
    try:
        act = TransformedActivation.from_solution(sol).double()
    except (KeyError, ValueError, TypeError):
        return None
    return lambda z: act(torch.from_numpy(np.asarray(z, np.float64))).numpy()
