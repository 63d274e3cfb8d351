"""Pydantic models of everything that crosses the wire (contract: docs/contract.md).

This package is the floor the client shares with the service: besides the wire models it holds
the activation catalogue (``activations``), the graph's shape rules (``shapes``) and the error type
(``errors``). It imports nothing of the service and no numpy.
"""

from .graph import GRAPH_SCHEMA, OPS, Graph, Template
from .solve import (
    SOLUTION_SCHEMA,
    ActivationParams,
    CMapSample,
    ErrorBody,
    ErrorResponse,
    GraphSummary,
    LayerInit,
    RootInfo,
    Solution,
    SolveRequest,
    Targets,
)
from .validation import ValidationJob, ValidationRequest, ValidationSummary

__all__ = [
    "GRAPH_SCHEMA",
    "OPS",
    "Graph",
    "Template",
    "SOLUTION_SCHEMA",
    "CMapSample",
    "ErrorBody",
    "ActivationParams",
    "ErrorResponse",
    "GraphSummary",
    "LayerInit",
    "RootInfo",
    "Solution",
    "SolveRequest",
    "Targets",
    "ValidationJob",
    "ValidationRequest",
    "ValidationSummary",
]
