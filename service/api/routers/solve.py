"""``POST /v1/solve``: the contract's answer, from the cache or solved (``solutions.SolutionService``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ...schemas.solve import Solution, SolveRequest
from ..deps import Client, Run, Solutions
from ..openapi import ERRORS, LIMITED, request_body

router = APIRouter(prefix="/v1")


@router.post(
    "/solve", response_model=Solution, responses={**ERRORS, **LIMITED}, openapi_extra=request_body(SolveRequest)
)
async def post_solve(request: Request, service: Solutions, run: Run, client: Client):
    outcome = await run.solve(service, await request.body(), client)
    return Response(outcome.body, media_type="application/json", headers={"X-Sigprop-Key": outcome.key})
