"""``/dashboard``: read-only pages over the cached solutions and the validations, and a form that
submits a solve for people who do not write JSON.

Pages are rendered on the server with Jinja2 (autoescape on), so the solutions table works
without JavaScript; plots are drawn in the browser by plotly.js, served from the installed
``plotly`` package at a URL that carries the file's digest (cached for a year, ``immutable``), as
are the dashboard's own script and stylesheet (``sigprop/dashboard/static``). Nothing is loaded
from another origin, and the pages send a Content-Security-Policy that forbids it.

Routes (none in the OpenAPI description, which is the API's; ``/v1/...`` serves the same data as
JSON):

* ``GET /`` redirects to ``/dashboard``;
* ``GET /dashboard``: the stored solutions, newest first, ``offset``/``limit`` pages, filters
  ``method`` and ``activation``, search ``q`` (a key prefix, or a method or activation name);
* ``GET /dashboard/solutions/{key}``: one solution: graph diagram, parameters, C map (and V map,
  GR scaling), per-layer initialization, its validations;
* ``GET /dashboard/validations/{id}``: one validation: curves, gradient norms, C values, and live
  progress while it runs, polled from ``GET /dashboard/validations/{id}.json``;
* ``GET /dashboard/new``: the solve form (it POSTs to ``/v1/solve`` from the browser);
* ``GET /dashboard/static/{digest}/{name}``: the script, stylesheet and plotly.js.

Unknown keys and ids answer a 404 page (the JSON route: the contract's error object).

The routes read the services the API built from ``app.state``: ``solutions`` (a stored solution,
personalized as ``GET /v1/solutions/{key}`` answers it), ``cache`` (summaries and counts for the
table) and ``validations``. ``create_app`` includes this router behind the read-access check.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response
from jinja2 import Environment, PackageLoader

from .. import __version__
from ..engine.templates.expand import describe_templates
from ..errors import SigpropError
from ..schemas.activations import (
    ACTIVATION_NAMES,
    CLIPPED_SPARSE_ACTIVATIONS,
    SMOOTH_ACTIVATIONS,
    UNCLIPPED_SPARSE_ACTIVATIONS,
)
from ..schemas.solve import Targets
from ..storage import ACTIVE
from ..storage.records import finite_json
from . import views
from .assets import IMMUTABLE, Asset, accepts_gzip, dashboard_assets, respond

log = logging.getLogger("sigprop")


def has_valid_key(request: Request) -> bool:
    # the app's key checker, from its state: the dashboard does not import the API that mounts it
    return request.app.state.keys.has_valid_key(request)


def viewer(request: Request):
    """The caller as the tenant rules see it (``api.auth.Viewer``): validations are its own only."""
    return request.app.state.keys.viewer(request)


KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
PAGE_SIZES = (25, 50, 100, 200)
VALIDATIONS_SHOWN = 50
# Plotly draws with inline styles and data: icons; everything else comes from this origin only.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
DEFAULT_TARGETS = {"eta": 0.9, "tau": 0.3, "zeta": 1.5, "sparsity": 0.8, "v_slope": 0.7, "q_star": None}

router = APIRouter(include_in_schema=False)


def _json_for_html(value: Any, **kwargs) -> str:
    """What ``tojson`` writes: strict JSON (non-finite numbers as null); Jinja then escapes
    ``<``, ``>``, ``&`` and ``'``, so the text can never close the ``<script>`` element it sits in."""
    return json.dumps(finite_json(value), separators=(",", ":"), allow_nan=False)


def _environment(assets: dict[str, Asset]) -> Environment:
    env = Environment(
        loader=PackageLoader("sigprop.dashboard", "templates"), autoescape=True, trim_blocks=True, lstrip_blocks=True
    )
    env.policies["json.dumps_function"] = _json_for_html
    env.filters.update(num=views.fmt_num, time=views.fmt_time, targets=views.fmt_targets, duration=views.fmt_duration)
    env.globals.update(version=__version__, static={name: a.url for name, a in assets.items()})
    return env


def _environment(assets: dict[str, Asset]) -> Environment:
    env = Environment(
        loader=PackageLoader("sigprop.dashboard", "templates"), autoescape=True, trim_blocks=True, lstrip_blocks=True
    )
    env.policies["json.dumps_function"] = _json_for_html
    env.filters.update(num=views.fmt_num, time=views.fmt_time, targets=views.fmt_targets, duration=views.fmt_duration)
    env.globals.update(version=__version__, static={name: a.url for name, a in assets.items()})
    return env


def form_catalog() -> dict:
    """The solve form's choices: per method, the activations it takes and their targets."""
    described = {name: (field.description or "") for name, field in Targets.model_fields.items()}

    def target(name: str, required: bool) -> dict:
        return {
            "name": name,
            "required": required,
            "default": DEFAULT_TARGETS.get(name),
            "description": described.get(name, ""),
        }

    smooth = list(SMOOTH_ACTIVATIONS)
    methods = {
        "tat": {
            "label": "tat · TAT",
            "activations": ["leaky_relu", *smooth],
            "targets": {"leaky_relu": [target("eta", True)], "*": [target("tau", True)]},
        },
        "dks": {"label": "dks · DKS", "activations": smooth, "targets": {"*": [target("zeta", True)]}},
        "eoc": {
            "label": "eoc · Edge of Chaos",
            "activations": list(ACTIVATION_NAMES),
            "targets": {"*": [target("q_star", False)]},
        },
        "sparse_eoc": {
            "label": "sparse_eoc · sparse EoC",
            "activations": [*UNCLIPPED_SPARSE_ACTIVATIONS, *CLIPPED_SPARSE_ACTIVATIONS],
            "targets": {
                **{
                    k: [target("sparsity", True), target("v_slope", True), target("q_star", False)]
                    for k in CLIPPED_SPARSE_ACTIVATIONS
                },
                "*": [target("sparsity", True), target("q_star", False)],
            },
        },
        "geometric": {"label": "geometric · GR scaling", "activations": ["relu", "leaky_relu"], "targets": {"*": []}},
    }
    # tests/service/test_dashboard.py checks these are exactly the engine's methods (METHOD_TARGETS)
    return {"methods": methods, "templates": describe_templates()}


class Pages:
    """What every page needs, built once per process (:func:`pages`): the static files (their
    digests are in the pages' links), the Jinja2 environment and the solve form's choices."""

    def __init__(self):
        self.assets = dashboard_assets()
        self.by_name = {a.name: a for a in self.assets.values()}
        self.env = _environment(self.assets)
        self.catalog = form_catalog()

    def page(self, request: Request, template: str, status: int = 200, **context) -> Response:
        html = self.env.get_template(template).render(request_path=request.url.path, **context)
        return respond(request, html.encode(), "text/html; charset=utf-8", status, PAGE_HEADERS)

    def record_page(self, request: Request, what: str, json_url: str, template: str, view, **context) -> Response:
        """The page of a stored record, or, for a record of a shape no sigprop wrote (its view or
        template raised), a page saying so with its raw JSON reachable: never a 500."""
        try:
            return self.page(request, template, view=view(), **context)
        except Exception:  # noqa: BLE001
            log.exception("dashboard: %s %s could not be shown", what, json_url)
            return self.page(request, "unreadable.html", what=what, json_url=json_url)

    def not_found(self, request: Request, what: str) -> Response:
        return self.page(request, "not_found.html", 404, what=what)


@functools.cache
def pages() -> Pages:
    """The process's :class:`Pages` (reads and hashes the static files the first time: the app
    calls it while it starts, so no request waits for that)."""
    return Pages()


@router.get("/")
def root():
    return RedirectResponse("/dashboard", status_code=307)


@router.get("/dashboard")
def solutions_page(
    request: Request,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    method: Annotated[str | None, Query(max_length=32)] = None,
    activation: Annotated[str | None, Query(max_length=64)] = None,
    q: Annotated[str | None, Query(max_length=128)] = None,
):
    cache = request.app.state.cache
    search = views.parse_search(q, ACTIVATION_NAMES)
    chosen = {"method": method or search.get("method"), "activation": activation or search.get("activation")}
    if search.get("nothing"):
        total, items = 0, []
    else:
        total, items = cache.list_summaries(
            offset, limit, chosen["method"], chosen["activation"], search.get("key_prefix")
        )
    facets = {
        "method": cache.counts("method", views.METHODS),
        "activation": cache.counts("activation", ACTIVATION_NAMES),
    }
    query = {k: v for k, v in (("method", method), ("activation", activation), ("q", q)) if v}
    return pages().page(
        request,
        "list.html",
        items=items,
        pages=views.pagination(total, offset, limit),
        facets=facets,
        method=method or "",
        activation=activation or "",
        q=q or "",
        search=search,
        chosen=chosen,
        query=query,
        limit=limit,
        page_sizes=sorted({*PAGE_SIZES, limit}),
    )


@router.get("/dashboard/new")
def new_solve_page(request: Request):
    return pages().page(request, "new.html", catalog=pages().catalog)


@router.get("/dashboard/solutions/{key}")
def solution_page(request: Request, key: str):
    if not KEY_PATTERN.match(key):
        return pages().not_found(request, "solution")
    try:
        record = request.app.state.solutions.get(key)
    except SigpropError as exc:
        if exc.code == "not_found":
            return pages().not_found(request, "solution")
        raise
    try:
        found = request.app.state.validations.list_for_key(key, VALIDATIONS_SHOWN, viewer(request))
    except SigpropError as exc:  # the validation store is down: the solution is still worth showing
        found = {"total": 0, "items": [], "error": exc.message}
    return pages().record_page(
        request,
        "solution",
        f"/v1/solutions/{key}",
        "solution.html",
        lambda: views.solution_view(key, record),
        validations=found,
        plots=True,
    )


@router.get("/dashboard/validations/{vid}.json")
def validation_progress(request: Request, vid: str):
    if not ID_PATTERN.match(vid):
        raise SigpropError("not_found", f"no validation has id {vid[:64]}", "list validations with GET /v1/validations")
    return views.progress_view(request.app.state.validations.get(vid, viewer(request)))


@router.get("/dashboard/validations/{vid}")
def validation_page(request: Request, vid: str):
    if not ID_PATTERN.match(vid):
        return pages().not_found(request, "validation")
    try:
        job = request.app.state.validations.get(vid, viewer(request))
    except SigpropError as exc:
        if exc.code == "not_found":
            return pages().not_found(request, "validation")
        raise
    return pages().record_page(
        request,
        "validation",
        f"/v1/validations/{vid}",
        "validation.html",
        lambda: views.validation_view(job),
        active=job.get("status") in ACTIVE,
        plots=True,
    )


@router.get("/dashboard/static/{digest}/{name}")
def static_file(request: Request, digest: str, name: str):
    asset = pages().by_name.get(name)
    if asset is None or not asset.available or digest != asset.digest:
        raise SigpropError(
            "not_found",
            f"no dashboard file {name[:100]} at this version",
            "reload the dashboard page: its links carry the current versions",
        )
    return respond(
        request,
        asset.body(),
        asset.media_type,
        200,
        {"Cache-Control": IMMUTABLE},
        gz=asset.gzipped() if accepts_gzip(request) else None,
    )
