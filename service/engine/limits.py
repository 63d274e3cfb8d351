"""The size limits a request is held to, as one value passed down from whoever read them.

The engine never reads the environment: ``sigprop serve`` builds a ``Limits`` from its
``Settings`` (``Settings.limits``), ``sigprop solve`` and ``sigprop.solve`` from the environment
(``sigprop.settings.offline_limits``), and both hand it to ``sigprop.preparation``, which admits a
request against it before anything is built, and to the template expansion (``max_nodes``).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_NODES = 100_000  # SIGPROP_MAX_NODES' default


@dataclass(frozen=True)
class Limits:
    """The most a request may ask for; ``None``: no bound beyond the others.

    ``max_nodes``: nodes after template expansion; ``max_depth``: nonlinear layers on the longest
    path; ``max_fan_in``: inputs of one sum or concat; ``max_cost``: nodes plus edges, the price of
    a solve (``sigprop.preparation``)."""

    max_nodes: int = DEFAULT_MAX_NODES
    max_depth: int | None = None
    max_fan_in: int | None = None
    max_cost: int | None = None
