"""sigprop: activation transformations and initializations for deep networks without shortcuts.

This package root stays import-light (no numpy) so that ``sigprop.client`` works with only
httpx and pydantic installed.
"""

from .version import ENGINE_VERSION, __version__

__all__ = ["ENGINE_VERSION", "__version__", "solve"]


def solve(*args, **kwargs):
    """The answer to a solve request, computed in this process: see ``sigprop.inprocess.solve``.

    >>> import sigprop
    >>> sol = sigprop.solve({"template": "mlp", "depth": 50}, "tat", "leaky_relu", {"eta": 0.9})
    >>> round(sol.c_f_0, 6)
    0.9
    """
    from .inprocess import solve as _solve  # imported on first use: the package root stays numpy-free

    return _solve(*args, **kwargs)
