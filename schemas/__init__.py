"""Pydantic models of everything that crosses the wire (contract: shared/design/contract.md)."""

from .graph import GRAPH_SCHEMA, OPS, Graph, Template
from .validation import ValidationJob, ValidationRequest, ValidationSummary
from .solve import (SOLUTION_SCHEMA, CMapSample, ErrorBody, ErrorResponse, GraphSummary, LayerInit,
                    RootInfo, Solution, SolveRequest, Targets)

__all__ = [
    "GRAPH_SCHEMA", "OPS", "Graph", "Template", "SOLUTION_SCHEMA", "CMapSample", "ErrorBody",
    "ErrorResponse", "GraphSummary", "LayerInit", "RootInfo", "Solution", "SolveRequest", "Targets",
    "ValidationJob", "ValidationRequest", "ValidationSummary",
]
