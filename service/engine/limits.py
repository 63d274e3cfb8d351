"""The size limits a request is held to, as one value passed down from whoever read them.

The engine never reads the environment: ``sigprop serve`` builds a ``Limits`` from its
``Settings`` (``Settings.limits``), ``sigprop solve`` and ``sigprop.solve`` from the environment
(``sigprop.settings.offline_limits``), and both hand it to ``sigprop.preparation``, which admits a
request against it before anything is built, and to the template expansion (``max_nodes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schemas.shapings import SHAPING_TABLE

DEFAULT_MAX_NODES = 100_000  # SIGPROP_MAX_NODES' default

# Sequence graphs (``engine.sequence.solve``): an answer's predicted token kernel covers at most this
# many tokens (a fixed part of the engine, so an answer is a function of its request alone): T x T
# floats in the answer, and the T^3 of each attention step in the solve.
MAX_TOKEN_KERNEL = 256
DEFAULT_MAX_SEQ_LEN = 65_536  # SIGPROP_MAX_SEQ_LEN's default: T, which only the generators' length grows with
# The token-kernel propagation's price, in about nanoseconds of one core of the development machine:
# per node a fixed 393,216 and 12 K^2 (the entrywise maps of activations, dense and sum nodes over the
# K x K pairs), and K^3 more per attention node (A K A^T), K = min(T, MAX_TOKEN_KERNEL). Fitted on
# 100-block transformers (TAT and DKS, with and without shortcuts): 1.6, 3.6, 7.4 and 18 ms a block
# at K = 16, 64, 128 and 256. The deepest transformer template the budget admits (width 64, 4 heads,
# shortcuts, TAT softplus: 1,260, 1,066, 625 and 174 blocks) solves in 2.2, 3.8, 3.7 and 2.6 s
# (tests/engine/test_transformer_solve.py, slow); a 72-block transformer at T >= 256 costs 2.3e9.
TOKEN_NODE_PRICE = 3 << 17
TOKEN_PAIR_PRICE = 12
# U-SPA's generators are Cholesky ratios of two uniform kernels, each a T x T Cholesky factorization
# and a triangular solve per attention node (E-SPA's have a closed form): measured 1.4-1.6 times
# E-SPA's time at 100 and 190 blocks, T = 256, two solves at once (bench/README.md, "Prices of
# sequence solves"); priced as K^3 / 2 more per attention node.
SHAPING_CUBE_PRICE = {"u-spa": 0.5}
# The joint schedule (``engine.sequence.joint_schedule``, issue 37) adds a probe walk of the graph with
# identity attention on PROBE_TOKENS tokens, and E-SPA's one more exact propagation (its correction of
# the mean correlation): priced as that many whole propagations. Measured at 72 blocks, T = 256:
# E-SPA 0.30 s with the paper's schedule, 0.61 s joint; U-SPA joint 0.45 s. Priced whether or not the
# graph turns out skipless (a graph with shortcuts falls back to the paper's schedule after the check).
PROBE_TOKENS = 48
JOINT_PROPAGATIONS = {"e-spa": 2, "u-spa": 1}
DEFAULT_MAX_TOKEN_WORK = 5_000_000_000


def token_work(
    tokens: int, attention_nodes: int, other_nodes: int, shaping: str | None = None, schedule: str | None = None
) -> int:
    """The price of a sequence graph's token-kernel propagation (see ``DEFAULT_MAX_TOKEN_WORK``),
    with its attention shaping's generators (``SHAPING_CUBE_PRICE``) and schedule (``schedule``: the
    request's, None for the shaping's default; ``JOINT_PROPAGATIONS``)."""
    k = min(tokens, MAX_TOKEN_KERNEL)
    cube = 1.0 + SHAPING_CUBE_PRICE.get(shaping or "", 0.0)
    nodes = attention_nodes + other_nodes
    work = int(attention_nodes * cube * k**3) + nodes * (TOKEN_NODE_PRICE + TOKEN_PAIR_PRICE * k * k)
    # admission prices a body before it is validated: a schedule the shaping does not take is priced
    # as none (validation refuses it)
    if shaping in JOINT_PROPAGATIONS and (schedule or SHAPING_TABLE[shaping].default_schedule) == "joint":
        probe = attention_nodes * PROBE_TOKENS**3 + nodes * (TOKEN_NODE_PRICE + TOKEN_PAIR_PRICE * PROBE_TOKENS**2)
        work = JOINT_PROPAGATIONS[shaping] * work + probe
    return work


@dataclass(frozen=True)
class Limits:
    """The most a request may ask for; ``None``: no bound beyond the others.

    ``max_nodes``: nodes after template expansion; ``max_depth``: nonlinear layers on the longest
    path; ``max_fan_in``: inputs of one sum or concat; ``max_cost``: nodes plus edges, the price of
    a solve (``sigprop.preparation``); ``max_seq_len``: tokens of a sequence graph; ``max_token_work``:
    the price of its token-kernel propagation (``token_work``)."""

    max_nodes: int = DEFAULT_MAX_NODES
    max_depth: int | None = None
    max_fan_in: int | None = None
    max_cost: int | None = None
    max_seq_len: int | None = DEFAULT_MAX_SEQ_LEN
    max_token_work: int | None = DEFAULT_MAX_TOKEN_WORK
