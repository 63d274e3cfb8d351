"""Validation worker: trains solved networks and baselines on a dataset (contract section 4)."""
