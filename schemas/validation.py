"""Wire models of validation trainings (contract section 4): POST/GET /v1/validations."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, model_validator

from .solve import SolveRequest

Baseline = Literal["he", "eoc", "plain"]
JobStatus = Literal["queued", "running", "finished", "failed", "cancelled"]


def _one_source_schema(schema: dict) -> None:
    """JSON Schema of ``ValidationRequest``: exactly one of ``solve`` and ``key``, as the validator
    (``_one_source``) demands; the other may be absent or null."""
    schema["oneOf"] = [
        {"required": [given], "properties": {given: {"not": {"type": "null"}}, other: {"type": "null"}}}
        for given, other in (("solve", "key"), ("key", "solve"))
    ]


class ValidationRequest(BaseModel):
    """Train the solved network (and baselines) on a dataset and check the theory against it."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_one_source_schema)

    solve: SolveRequest | None = Field(default=None, description="a full /v1/solve request")
    key: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        default=None, description="a stored solution's key"
    )
    dataset: Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[A-Za-z0-9_.\-/]+$")] = Field(
        default="digits",
        description="'digits' (scikit-learn's bundled set), 'synthetic' (teacher-student), "
        "or an .npz path on the worker",
    )
    # numbers are strict, as in the solve request (schemas/graph.py): "200" is not 200
    steps: Annotated[StrictInt, Field(ge=1, le=1_000_000)] = 200
    batch_size: Annotated[StrictInt, Field(ge=1, le=65_536)] = 64
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: Annotated[StrictFloat, Field(gt=0, le=10, allow_inf_nan=False)] | None = Field(
        default=None, description="learning rate (default: 0.002 for sgd with momentum 0.9, 3e-4 for adam)"
    )
    seed: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)] = 0
    baselines: list[Baseline] = Field(
        default_factory=lambda: ["he"],
        max_length=3,
        description="trained side by side: 'he' (ReLU, Kaiming fan-in), 'eoc', "
        "'plain' (untransformed activation, PyTorch default init)",
    )

    @model_validator(mode="after")
    def _one_source(self):
        if (self.solve is None) == (self.key is None):
            raise ValueError("give exactly one of 'solve' (a solve request) or 'key' (a stored solution's key)")
        return self


class ValidationSummary(BaseModel):
    """One validation as GET /v1/validations lists it: its state, without request and results."""

    id: str
    status: JobStatus
    progress: dict[str, Any] = Field(default_factory=dict, description="{'step': s, 'total': n, 'run': name}")
    key: str = Field(description="the solution being validated")
    created: float
    started: float | None = None
    ended: float | None = None
    attempts: int = 0
    device: str | None = None
    error: str | None = None


class ValidationJob(ValidationSummary):
    """What GET /v1/validations/{id} answers."""

    request: dict[str, Any] = Field(description="the validation request as submitted (solve part included)")
    results: dict[str, Any] | None = None
