"""``/v1/validations`` (contract section 4): submit (key required, rate-limited), follow, list and
cancel (key required) validation trainings; the logic is ``api.validations.Validations``. A
validation belongs to the key that submitted it: any other key (an admin key aside) gets 404."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel

from ...schemas.validation import ValidationJob, ValidationRequest, ValidationSummary
from ..deps import Client, Run, ValidationsService, count_validation, require_key
from ..openapi import ERRORS, JSON_BODY, LIMITED, request_body

router = APIRouter(prefix="/v1/validations", tags=["validations"])
ValidationId = Annotated[str, Path(max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class Accepted(BaseModel):
    id: str
    status: Literal["queued"] = "queued"


class ValidationList(BaseModel):
    total: int
    offset: int
    limit: int
    items: list[ValidationSummary]


@router.post(
    "",
    status_code=202,
    response_model=Accepted,
    responses={**ERRORS, **JSON_BODY, **LIMITED},
    dependencies=[Depends(require_key), Depends(count_validation)],
    openapi_extra=request_body(ValidationRequest),
)
async def submit_validation(
    request: Request, response: Response, validations: ValidationsService, run: Run, client: Client
):
    prepared = await run(validations.prepare, await request.body(), client)
    out = await run(validations.submit, prepared, request.app.state.keys.viewer(request).tenant)
    response.headers["Location"] = f"/v1/validations/{out['id']}"
    return out


@router.get("", response_model=ValidationList, responses=ERRORS)
async def list_validations(
    request: Request,
    validations: ValidationsService,
    run: Run,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
):
    return await run(validations.list, offset, limit, request.app.state.keys.viewer(request))


@router.get("/{vid}", response_model=ValidationJob, responses=ERRORS)
async def get_validation(request: Request, vid: ValidationId, validations: ValidationsService, run: Run):
    """404 unless the caller's key submitted it (or is an admin key)."""
    return await run(validations.get, vid, request.app.state.keys.viewer(request))


@router.delete(
    "/{vid}",
    response_model=ValidationJob,
    responses={**ERRORS, 202: {"model": ValidationJob}},
    dependencies=[Depends(require_key)],
)
async def cancel_validation(
    request: Request, vid: ValidationId, response: Response, validations: ValidationsService, run: Run
):
    status, job = await run(validations.cancel, vid, request.app.state.keys.viewer(request))
    response.status_code = status
    return job
