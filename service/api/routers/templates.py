"""``/v1/templates``: the graph templates and their parameters; one template expanded."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from ...engine.templates.expand import describe_templates
from ...errors import SigpropError
from ...requests import invalid_request
from ...schemas.graph import TEMPLATE_NAMES, Template
from ..auth import client_identity
from ..openapi import ERRORS
from ..priced import priced

router = APIRouter(prefix="/v1/templates", tags=["templates"])


def _query_value(text: str):
    """A query value as the JSON scalar it spells (``50``, ``0.5``, ``true``): a query string has
    only text, while the template's fields are strict about types, as they are in a solve body."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, (int, float, bool)) else text


@router.get("")
async def templates():
    return describe_templates()


@router.get("/{name}", responses=ERRORS)
async def template(name: str, request: Request):
    if name not in TEMPLATE_NAMES:
        raise SigpropError("not_found", f"no template named '{name}'", f"templates: {', '.join(TEMPLATE_NAMES)}")
    params: dict = {"template": name}
    for k, v in request.query_params.items():
        if k == "input_shape":
            try:
                v = json.loads(v)
            except (ValueError, RecursionError):
                raise SigpropError(
                    "invalid_request",
                    f"input_shape={v[:100]!r} is not a JSON list",
                    "write it as input_shape=[3,32,32]",
                ) from None
        params[k] = v if k == "input_shape" else _query_value(v)
    try:
        t = Template.model_validate(params)
    except ValidationError as exc:
        raise invalid_request(exc, f"see GET /v1/templates for the parameters of '{name}'", default="query") from None
    # priced from the parameters before anything is built (413 over the limits); a large one counts
    # as a cold solve and is built in a solver process, in turn with the cold solves (priced.py)
    text = await priced(request.app.state).template(t, client_identity(request, request.app.state.keys))
    return Response(text, media_type="application/json")
