"""Wire models of validation trainings (contract section 4): POST/GET /v1/validations."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, model_validator

from .solve import SolveRequest

Baseline = Literal["he", "eoc", "plain"]
Task = Literal["classify", "charlm"]
# the networks a "charlm" validation trains side by side (docs/service.md, "Character-level LM")
CharLMArm = Literal["solved", "shortcuts", "standard", "paper_schedule", "hf_gpt2", "hf_gpt2_keep", "hf_gpt2_norm_free"]
CHARLM_ARMS: tuple[str, ...] = ("solved", "shortcuts", "standard")
CHARLM_DATASET = "stdlib"
JobStatus = Literal["queued", "running", "finished", "failed", "cancelled"]


def _one_source_schema(schema: dict) -> None:
    """JSON Schema of ``ValidationRequest``: exactly one of ``solve`` and ``key``, as the validator
    (``_one_source``) demands; the other may be absent or null. And the task's rules
    (``_task_fields``): a ``charlm`` validation trains on ``stdlib`` with ``arms`` (unique, with
    ``solved``) and no ``baselines``; any other takes no ``arms`` and not the ``stdlib`` text."""
    schema["oneOf"] = [
        {"required": [given], "properties": {given: {"not": {"type": "null"}}, other: {"type": "null"}}}
        for given, other in (("solve", "key"), ("key", "solve"))
    ]
    arms = {"type": "array", "uniqueItems": True, "contains": {"const": "solved"}}
    schema["allOf"] = [
        {
            "if": {"required": ["task"], "properties": {"task": {"const": "charlm"}}},
            "then": {
                "properties": {
                    "dataset": {"const": CHARLM_DATASET},
                    "baselines": {"maxItems": 0},
                    "arms": {"anyOf": [arms, {"type": "null"}]},
                }
            },
            "else": {"properties": {"arms": {"type": "null"}, "dataset": {"not": {"const": CHARLM_DATASET}}}},
        }
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

    task: Task | None = Field(
        default=None,
        description="'classify' (the default: the dataset's classes) or 'charlm' (character-level language "
        "modelling of the 'stdlib' corpus with a transformer graph; its dataset defaults to 'stdlib', "
        "its optimizer to 'adam', and it trains 'arms' instead of 'baselines')",
    )
    arms: list[CharLMArm] | None = Field(
        default=None,
        min_length=1,
        max_length=7,
        description="charlm only: 'solved' (the answer applied), 'shortcuts' (the same transformer with "
        "shortcuts, normalization-free, solved and applied), 'standard' (pre-LN with shortcuts, PyTorch's "
        "default initialization, plain causal attention); default these three, 'solved' always included. "
        "Opt-in: 'paper_schedule' (the same transformer, its e-spa/u-spa attention on the paper's schedule), "
        "'hf_gpt2' (HuggingFace GPT2LMHeadModel of the same size, stock), 'hf_gpt2_keep' and "
        "'hf_gpt2_norm_free' (its two recipes solved and applied; the worker needs transformers)",
    )

    @model_validator(mode="after")
    def _one_source(self):
        if (self.solve is None) == (self.key is None):
            raise ValueError("give exactly one of 'solve' (a solve request) or 'key' (a stored solution's key)")
        return self

    @model_validator(mode="after")
    def _task_fields(self):
        given = self.model_fields_set
        if self.task != "charlm":
            if self.arms is not None:
                raise ValueError("'arms' belongs to task 'charlm'; a classification validation takes 'baselines'")
            if self.dataset == CHARLM_DATASET:
                raise ValueError('dataset \'stdlib\' is text: use it with "task": "charlm"')
            return self
        # defaults of a charlm validation (written into the request, so the stored request says them)
        if "dataset" not in given:
            self.dataset = CHARLM_DATASET
        if self.dataset != CHARLM_DATASET:
            raise ValueError(f"task 'charlm' trains on dataset '{CHARLM_DATASET}' (Python's standard-library sources)")
        if "optimizer" not in given:
            self.optimizer = "adam"
        if "baselines" in given and self.baselines:
            raise ValueError("task 'charlm' compares 'arms' ('solved', 'shortcuts', 'standard'), not 'baselines'")
        self.baselines = []
        arms = list(self.arms) if self.arms is not None else list(CHARLM_ARMS)
        if len(set(arms)) != len(arms):
            raise ValueError("'arms' names an arm twice")
        if "solved" not in arms:
            raise ValueError("'arms' must include 'solved': the validation trains the answer it validates")
        self.arms = ["solved", *(a for a in arms if a != "solved")]
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
