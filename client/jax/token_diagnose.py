"""``diagnose`` for Flax sequence models: the output token kernel against the answer's
``token_kernel.output`` (the comparison, its noise and its warnings: ``sigprop.client.token_diagnosis``,
shared with the torch adapter; here only the measuring)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...schemas.activations import CATALOGUE, canonical_name
from ..solution import as_solution, tailored, tailoring
from ..token_diagnosis import (
    NodeQ,
    TokenKernelDiagnosis,
    answer_token_kernel,
    judge_tokens,
    orthonormal_tokens,
    stated_token_noise,
    token_kernel_of,
)
from .activations import activation_fn
from .extraction import extract_flax

__all__ = ["TokenKernelDiagnosis", "diagnose_tokens", "measure_token_kernel", "orthonormal_tokens"]

_SHOWN = ("dense", "activation", "attention", "layer_norm", "rms_norm", "sum")


@functools.lru_cache(maxsize=16)
def _jitted_apply(module):
    """``jax.jit(module.apply)``, once per module (Flax modules are frozen dataclasses, hashable)."""
    return jax.jit(module.apply)


def measure_token_kernel(module, variables, x) -> np.ndarray:
    """``K_ij = y_i . y_j / width`` of ``module.apply(variables, x)``'s output tokens, averaged over the batch."""
    return token_kernel_of(_jitted_apply(module)(variables, jnp.asarray(x)))


def _networks(models) -> list[tuple]:
    """(module, variables) pairs from a bound module, a pair, or a list of either."""
    items = models if isinstance(models, list) else [models]
    return [m if isinstance(m, tuple) else m.unbind() for m in items]


def _node_q(module, variables, x, sol) -> tuple[list[NodeQ], dict]:
    """Each graph node's measured q (mean square over tokens and features) beside the scalar
    program's: q* (1 for TAT and DKS), 0 for the queries (zero-initialized); and the graph."""
    ext = extract_flax(module, variables, x, allow_unsupported=True)
    queries = {nd["inputs"][0] for nd in ext.graph["nodes"] if nd["op"] == "attention"}
    q_star = sol.q_star if sol.q_star is not None else 1.0
    rows = []
    for nd in ext.graph["nodes"]:
        if nd["op"] in _SHOWN:
            op = "query" if nd["id"] in queries else nd["op"]
            measured = float(np.mean(np.square(np.asarray(ext.values[nd["id"]], np.float64))))
            rows.append(NodeQ(nd["id"], op, 0.0 if op == "query" else q_star, measured))
    return rows, ext.graph


def diagnose_tokens(models, solution, example_input, *, seed: int = 0) -> TokenKernelDiagnosis:
    """The output token kernel of one applied Flax sequence model, or of several (the same network
    applied with different keys: a list), against the answer's ``token_kernel.output``.

    ``models``: a bound module (``module.bind(variables)``), a ``(module, variables)`` pair, or a
    list of them; the variables with the answer applied (``apply_to_params`` on the whole variables
    dict). ``example_input``: ``[B, T, D]``, only its shape is used: B sets of T orthonormal tokens
    of width D (q = 1 per token) are fed to every network. With several networks the noise is the
    standard error over them; with one it is stated (``sigprop.client.token_diagnosis``). The q per
    node is the first network's."""
    nets = _networks(models)
    sol = as_solution(solution)
    predicted = answer_token_kernel(sol)
    b, t, d = (int(s) for s in np.shape(example_input))
    if predicted.shape[0] != t:
        raise ValueError(f"the answer's token kernel is for {predicted.shape[0]} tokens, example_input has {t}")
    x = jnp.asarray(orthonormal_tokens(b, t, d, seed=seed), jnp.asarray(example_input).dtype)
    stack = np.stack([measure_token_kernel(module, variables, x) for module, variables in nets])
    measured = stack.mean(axis=0)
    nodes, graph = _node_q(nets[0][0], nets[0][1], x, sol)
    if len(nets) >= 2:
        noise, source = stack.std(axis=0, ddof=1) / np.sqrt(len(nets)), "networks"
    else:
        noise, source = stated_token_noise(sol, graph, np.asarray(x, np.float64), answer_phi(sol)), "stated"
    attention = getattr(sol, "attention", None)
    diag = TokenKernelDiagnosis(
        sol.method,
        sol.activation,
        getattr(attention, "shaping", None),
        len(nets),
        predicted,
        measured,
        noise,
        source,
        nodes,
    )
    judge_tokens(diag)
    return diag


def answer_phi(sol):
    """The answer's transformed activation as a numpy function, for the stated noise (None where
    it cannot be built: the noise then takes the activation as the identity)."""
    key = canonical_name(sol.activation)
    if key is None:
        return None
    given = {"negative_slope": sol.negative_slope, "tau": sol.tau, "m": sol.m}
    fn = activation_fn(key, **{k: v for k, v in given.items() if k in CATALOGUE[key].defaults})
    a, b, c, d = tailoring(sol)
    return lambda z: np.asarray(tailored(fn, jnp.asarray(z), a, b, c, d), np.float64)
