"""``POST /v1/solve``: the contract's answer, from the cache or solved (``solutions.SolutionService``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ...schemas.solve import Solution, SolveRequest
from ..auth import client_identity
from ..openapi import ERRORS, JSON_BODY, LIMITED, request_body
from ..solve_fastpath import send_outcome

router = APIRouter(prefix="/v1", tags=["solve"])


@router.post(
    "/solve",
    response_model=Solution,
    responses={**ERRORS, **JSON_BODY, **LIMITED},
    openapi_extra=request_body(SolveRequest),
)
async def post_solve(request: Request):
    # The services come from app.state directly, not as dependencies (deps.py): on the hit path,
    # resolving them cost more than serving the hit; the client's identity is only needed for a
    # cold solve's rate limit.
    state = request.app.state
    body = await request.body()
    # a hit whose answer is in this process's memory is answered here, on the event loop: nothing
    # in it blocks, so the hop to a thread would cost more than the hit itself
    outcome = state.solutions.hot_hit(body)
    if outcome is None:
        outcome = await state.offload.solve(state.solutions, body, client_identity(request, state.keys))
    if outcome.cached:
        request.state.cache_hit = True  # logged at DEBUG, not INFO (observability.py)
    # sent as the fast path sends it (solve_fastpath.send_outcome)
    return _OutcomeResponse(outcome)


class _OutcomeResponse(Response):
    """A solve's answer as an ASGI response that ``send_outcome`` sends."""

    def __init__(self, outcome):
        super().__init__(media_type="application/json")
        self.outcome = outcome

    async def __call__(self, scope, receive, send) -> None:
        await send_outcome(self.outcome, send)
