"""What the OpenAPI description says beyond what FastAPI reads from the routes: the error answers
every route documents, and the request models of the routes that read their raw body."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ..schemas.solve import ErrorResponse, SolveRequest
from ..schemas.validation import ValidationRequest

# the contract's error object, for the statuses any route may answer with
ERRORS = {code: {"model": ErrorResponse} for code in (401, 403, 404, 413, 422, 503)}
# routes that spend a client's budget (cold solves, validation submissions)
LIMITED = {
    429: {
        "model": ErrorResponse,
        "description": "rate_limited: over the client's budget; see Retry-After",
        "headers": {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}},
    }
}
# POST /v1/solve and POST /v1/validations read the raw body (the solve memoizes it by digest), so
# FastAPI does not see their models: the routes refer to these components, added below
RAW_BODY_MODELS = (SolveRequest, ValidationRequest)


def request_body(model) -> dict:
    """``openapi_extra`` for a route that reads ``model`` from its raw body."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` add the raw-body request models and their parts to the components."""

    def openapi_with_request_models():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in RAW_BODY_MODELS:
                request_schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
                components.update(request_schema.pop("$defs", {}))
                components[model.__name__] = request_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi_with_request_models
