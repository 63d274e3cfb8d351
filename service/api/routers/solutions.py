"""``/v1/solutions``: the stored solutions, newest first; one with its request; deleting one (admin
key required). Solutions are content-addressed and shared: the same request is the same key for
every caller, so none owns one, and only an admin key (``SIGPROP_ADMIN_KEYS``) may delete one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response

from ..auth import client_identity, require_admin
from ..deps import Run, Solutions, require_key
from ..openapi import ERRORS
from ..priced import priced

router = APIRouter(prefix="/v1/solutions", tags=["solutions"])
SolutionKey = Annotated[str, Path(max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]


@router.get("", responses=ERRORS)
async def list_solutions(
    service: Solutions,
    run: Run,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    method: Annotated[str | None, Query(max_length=32, pattern=r"^[A-Za-z0-9_]+$")] = None,
    activation: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_]+$")] = None,
):
    return await run(service.list, offset, limit, method, activation)


@router.get("/{key}", responses=ERRORS)
async def get_solution(key: SolutionKey, request: Request):
    # priced by its size: a large one counts as a cold solve and is rendered in a solver process,
    # in turn with the cold solves (priced.py); never on the event loop
    state = request.app.state
    text = await priced(state).stored(key, client_identity(request, state.keys))
    return Response(text, media_type="application/json")


@router.delete("/{key}", responses=ERRORS, dependencies=[Depends(require_key), Depends(require_admin)])
async def delete_solution(key: SolutionKey, service: Solutions, run: Run):
    return await run(service.delete, key)
