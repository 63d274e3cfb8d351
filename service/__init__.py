"""sigprop: activation transformations and initializations for deep networks without shortcuts.

This package root stays import-light (no numpy) so that ``sigprop.client`` works with only
httpx and pydantic installed.
"""

__version__ = "0.1.0"

# Bumped whenever a solver's numbers may change: it is part of every cache key, so a new engine
# never serves answers computed by an old one.
ENGINE_VERSION = "4"


def solve(*args, **kwargs):
    """The answer to a solve request, computed in this process: see ``sigprop.inprocess.solve``.

    >>> import sigprop
    >>> sol = sigprop.solve({"template": "mlp", "depth": 50}, "tat", "leaky_relu", {"eta": 0.9})
    >>> round(sol.c_f_0, 6)
    0.9
    """
    from .inprocess import solve as _solve  # imported on first use: the package root stays numpy-free

    return _solve(*args, **kwargs)
