"""What the OpenAPI description says beyond what FastAPI reads from the routes: the error answers
every route documents, and the request models of the routes that read their raw body."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from ..engine.templates.expand import TEMPLATES
from ..schemas.graph import Template
from ..schemas.solve import ErrorResponse, SolveRequest
from ..schemas.validation import ValidationRequest
from .openapi_docs import document_operations

# the contract's error object, for the statuses any route may answer with
ERRORS = {code: {"model": ErrorResponse} for code in (401, 403, 404, 413, 422, 503)}
# routes that take a JSON body: any other Content-Type is refused before the body is read
JSON_BODY = {
    415: {"model": ErrorResponse, "description": "unsupported_media_type: the body is not sent as application/json"}
}
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


def template_rules() -> list[dict]:
    """JSON Schema branches of ``Template``, one per template (``engine.templates.expand.TEMPLATES``): the
    parameters it takes (any other must be absent or null), the ones it needs, the values it allows
    where they are a list (ResNet depths) and the lengths of its arrays (an image's input_shape);
    what a list cannot say (DenseNet's 6n+4 depths, sizes past the limits) stays the validator's
    422 or 413."""
    branches = []
    for name, spec in TEMPLATES.items():
        params = {p["name"]: p for p in spec.parameters}
        properties: dict = {"template": {"const": name}}
        for field in Template.model_fields:
            if field != "template" and field not in params:
                properties[field] = {"type": "null"}
        for field, p in params.items():
            allowed = p.get("allowed")
            if allowed and all(isinstance(v, int) for v in allowed):
                properties[field] = {"enum": list(allowed)} if p["required"] else {"enum": [*allowed, None]}
            elif p.get("lengths"):
                sizes = [{"type": "array", "minItems": n, "maxItems": n} for n in p["lengths"]]
                properties[field] = {"anyOf": sizes if p["required"] else [*sizes, {"type": "null"}]}
            elif p["required"]:
                properties[field] = {"not": {"type": "null"}}
        required = [field for field, p in params.items() if p["required"]]
        rules = {"allOf": list(spec.rules)} if spec.rules else {}
        branches.append({"properties": properties, **({"required": required} if required else {}), **rules})
    return branches


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
            components["Template"]["oneOf"] = template_rules()  # the engine's table: not in schemas/
            document_operations(schema)  # a description and an example request per operation
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi_with_request_models
    install_docs(app)


# /docs and /redoc load Swagger UI and ReDoc from the installed fastapi-offline package (the
# `server` extra), never from a CDN: the service works offline and behind egress filters.
DOCS_ASSETS = "/docs-assets"


def _assets_folder() -> Path:
    import fastapi_offline  # a well-kept package that ships both bundles and nothing else of note

    return Path(fastapi_offline.__file__).parent / "static"


def install_docs(app: FastAPI) -> None:
    """Replace FastAPI's /docs and /redoc (whose pages name CDN URLs) with the same pages pointing
    at the bundles served under ``DOCS_ASSETS``; the OAuth2 redirect page (inline) is kept."""
    docs, redoc = app.docs_url or "/docs", app.redoc_url or "/redoc"
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in (docs, redoc)]
    app.mount(DOCS_ASSETS, StaticFiles(directory=_assets_folder()), name="docs-assets")

    @app.get(docs, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
            oauth2_redirect_url=f"{root}{app.swagger_ui_oauth2_redirect_url}",
        )

    @app.get(redoc, include_in_schema=False)
    async def redoc_page(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,  # the fonts would come from Google's CDN
        )
