"""sigprop: activation transformations and initializations for deep networks without shortcuts.

This package root stays import-light (no numpy) so that ``sigprop.client`` works with only
httpx and pydantic installed.
"""

__version__ = "0.1.0"

# Bumped whenever a solver's numbers may change: it is part of every cache key, so a new engine
# never serves answers computed by an old one.
ENGINE_VERSION = "4"
