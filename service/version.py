"""The package's version and the engine's, in a module of their own: the engine and the client read
them from here, so importing them never reaches back into the package root (whose ``solve`` imports
the engine)."""

__version__ = "0.1.0"

# Bumped whenever a solver's numbers may change: it is part of every cache key, so a new engine
# never serves answers computed by an old one.
ENGINE_VERSION = "8"
