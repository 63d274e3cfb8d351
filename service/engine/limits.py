"""The size limits a request is held to, as one value passed down from whoever read them.

The engine never reads the environment: ``sigprop serve`` builds a ``Limits`` from its
``Settings`` (``Settings.limits``), ``sigprop solve`` and ``sigprop.solve`` from the environment
(``sigprop.settings.offline_limits``), and both hand it to ``sigprop.preparation``, which admits a
request against it before anything is built, and to the template expansion (``max_nodes``).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_NODES = 100_000  # SIGPROP_MAX_NODES' default

# Sequence graphs (``engine.sequence_solve``): an answer's predicted token kernel covers at most this
# many tokens (a fixed part of the engine, so an answer is a function of its request alone): T x T
# floats in the answer, and the T^3 of each attention step in the solve.
MAX_TOKEN_KERNEL = 256
DEFAULT_MAX_SEQ_LEN = 65_536  # SIGPROP_MAX_SEQ_LEN's default: T, which only the generators' length grows with
# the token-kernel propagation's price: K^3 per attention node and K^2 per other node, K = min(T, MAX_TOKEN_KERNEL);
# a 72-block T >= 256 transformer costs about 1.3e9, a second's work on one core
DEFAULT_MAX_TOKEN_WORK = 10_000_000_000


def token_work(tokens: int, attention_nodes: int, other_nodes: int) -> int:
    """The price of a sequence graph's token-kernel propagation (see ``DEFAULT_MAX_TOKEN_WORK``)."""
    k = min(tokens, MAX_TOKEN_KERNEL)
    return attention_nodes * k**3 + other_nodes * k * k


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
