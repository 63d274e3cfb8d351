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
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import re
import threading
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response
from jinja2 import Environment, PackageLoader

from .. import __version__
from ..dashboard import views
from ..engine.activations import ACTIVATION_NAMES, SMOOTH_ACTIVATIONS
from ..engine.sparse_eoc import CLIPPED_KINDS, SPARSE_KINDS
from ..engine.templates import describe_templates
from ..errors import SigpropError
from ..schemas.solve import Targets
from ..worker.queue import ACTIVE, finite_json
from .solutions import SolutionService
from .validations import Validations

log = logging.getLogger("sigprop")
KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
PAGE_SIZES = (25, 50, 100, 200)
VALIDATIONS_SHOWN = 50
GZIP_MIN_BYTES = 1024
# Plotly draws with inline styles and data: icons; everything else comes from this origin only.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
                "Cache-Control": "no-cache"}
IMMUTABLE = "public, max-age=31536000, immutable"
DEFAULT_TARGETS = {"eta": 0.9, "tau": 0.3, "zeta": 1.5, "sparsity": 0.8, "v_slope": 0.7, "q_star": None}


class Asset:
    """A static file served from memory at ``/dashboard/static/{digest}/{name}``: the digest in the
    URL changes with the content, so browsers may keep it for a year. Read, hashed and gzipped
    on first use (plotly.min.js is 4.8 MB; gzipped once, 1.5 MB)."""

    def __init__(self, name: str, path: Path | None, media_type: str):
        self.name, self.path, self.media_type = name, path, media_type
        self._lock = threading.Lock()
        self._body: bytes | None = None
        self._gz: bytes | None = None
        self._digest: str | None = None

    @property
    def available(self) -> bool:
        return self.path is not None and self.path.is_file()

    def body(self) -> bytes:
        with self._lock:
            if self._body is None:
                self._body = self.path.read_bytes()
                self._digest = hashlib.sha256(self._body).hexdigest()[:16]
            return self._body

    def gzipped(self) -> bytes:
        body = self.body()
        with self._lock:
            if self._gz is None:
                self._gz = gzip.compress(body, 6, mtime=0)
            return self._gz

    @property
    def digest(self) -> str:
        self.body()
        return self._digest

    @property
    def url(self) -> str | None:
        return f"/dashboard/static/{self.digest}/{self.name}" if self.available else None


def _plotly_asset() -> Asset:
    """plotly.min.js as the ``plotly`` Python package ships it (found without importing plotly)."""
    spec = importlib.util.find_spec("plotly")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js" if spec and spec.origin else None
    try:
        version = importlib.metadata.version("plotly")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return Asset(f"plotly-{version}.min.js", path, "text/javascript; charset=utf-8")


def _own_asset(name: str, media_type: str) -> Asset:
    return Asset(name, Path(str(files("sigprop.dashboard") / "static" / name)), media_type)


def _json_for_html(value: Any, **kwargs) -> str:
    """What ``tojson`` writes: strict JSON (non-finite numbers as null); Jinja then escapes
    ``<``, ``>``, ``&`` and ``'``, so the text can never close the ``<script>`` element it sits in."""
    return json.dumps(finite_json(value), separators=(",", ":"), allow_nan=False)


def _environment(assets: dict[str, Asset]) -> Environment:
    env = Environment(loader=PackageLoader("sigprop.dashboard", "templates"), autoescape=True,
                      trim_blocks=True, lstrip_blocks=True)
    env.policies["json.dumps_function"] = _json_for_html
    env.filters.update(num=views.fmt_num, time=views.fmt_time, targets=views.fmt_targets,
                       duration=views.fmt_duration)
    env.globals.update(version=__version__, static={name: a.url for name, a in assets.items()})
    return env


def _accepts_gzip(request: Request) -> bool:
    return "gzip" in request.headers.get("accept-encoding", "").lower()


def _respond(request: Request, body: bytes, media_type: str, status: int, headers: dict[str, str],
             gz: bytes | None = None) -> Response:
    headers = {**headers, "Vary": "Accept-Encoding"}
    if _accepts_gzip(request) and len(body) >= GZIP_MIN_BYTES:
        body = gz if gz is not None else gzip.compress(body, 5, mtime=0)
        headers["Content-Encoding"] = "gzip"
    return Response(body, status_code=status, media_type=media_type, headers=headers)


def form_catalog() -> dict:
    """The solve form's choices: per method, the activations it takes and their targets."""
    described = {name: (field.description or "") for name, field in Targets.model_fields.items()}

    def target(name: str, required: bool) -> dict:
        return {"name": name, "required": required, "default": DEFAULT_TARGETS.get(name), "description": described.get(name, "")}

    smooth = list(SMOOTH_ACTIVATIONS)
    methods = {
        "tat": {"label": "tat · TAT", "activations": ["leaky_relu", *smooth],
                "targets": {"leaky_relu": [target("eta", True)], "*": [target("tau", True)]}},
        "dks": {"label": "dks · DKS", "activations": smooth, "targets": {"*": [target("zeta", True)]}},
        "eoc": {"label": "eoc · Edge of Chaos", "activations": list(ACTIVATION_NAMES),
                "targets": {"*": [target("q_star", False)]}},
        "sparse_eoc": {"label": "sparse_eoc · sparse EoC", "activations": list(SPARSE_KINDS),
                       "targets": {**{k: [target("sparsity", True), target("v_slope", True), target("q_star", False)]
                                      for k in CLIPPED_KINDS},
                                   "*": [target("sparsity", True), target("q_star", False)]}},
        "geometric": {"label": "geometric · GR scaling", "activations": ["relu", "leaky_relu"],
                      "targets": {"*": []}},
    }
    # tests/test_dashboard.py checks these are exactly the engine's methods (METHOD_TARGETS)
    return {"methods": methods, "templates": describe_templates()}


def dashboard_router(settings, solutions: SolutionService, validations: Validations, dependencies=()) -> APIRouter:
    """The dashboard's routes; each gets ``dependencies`` (e.g. a read-key check). ``settings`` is
    taken like the other router factories take it; no setting changes the pages today."""
    deps = list(dependencies)
    assets = {"plotly": _plotly_asset(), "js": _own_asset("dashboard.js", "text/javascript; charset=utf-8"),
              "css": _own_asset("dashboard.css", "text/css; charset=utf-8"),
              "icon": _own_asset("favicon.svg", "image/svg+xml")}
    by_name = {a.name: a for a in assets.values()}
    env = _environment(assets)
    router = APIRouter(include_in_schema=False)
    catalog = form_catalog()

    def page(request: Request, template: str, status: int = 200, **context) -> Response:
        html = env.get_template(template).render(request_path=request.url.path, **context)
        return _respond(request, html.encode(), "text/html; charset=utf-8", status, PAGE_HEADERS)

    def page_or_unreadable(request: Request, what: str, json_url: str, template: str, view, **context) -> Response:
        """The page of a stored record, or, for a record of a shape no sigprop wrote (its view or
        template raised), a page saying so with its raw JSON reachable: never a 500."""
        try:
            return page(request, template, view=view(), **context)
        except Exception:  # noqa: BLE001
            log.exception("dashboard: %s %s could not be shown", what, json_url)
            return page(request, "unreadable.html", what=what, json_url=json_url)

    def not_found(request: Request, what: str) -> Response:
        return page(request, "not_found.html", 404, what=what)

    @router.get("/", dependencies=deps)
    def root():
        return RedirectResponse("/dashboard", status_code=307)

    @router.get("/dashboard", dependencies=deps)
    def solutions_page(request: Request,
                       offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
                       limit: Annotated[int, Query(ge=1, le=500)] = 50,
                       method: Annotated[str | None, Query(max_length=32)] = None,
                       activation: Annotated[str | None, Query(max_length=64)] = None,
                       q: Annotated[str | None, Query(max_length=128)] = None):
        search = views.parse_search(q, ACTIVATION_NAMES)
        chosen = {"method": method or search.get("method"), "activation": activation or search.get("activation")}
        if search.get("nothing"):
            total, items = 0, []
        else:
            total, items = solutions.cache.list_summaries(offset, limit, chosen["method"], chosen["activation"],
                                                          search.get("key_prefix"))
        facets = {"method": solutions.cache.counts("method", views.METHODS),
                  "activation": solutions.cache.counts("activation", ACTIVATION_NAMES)}
        query = {k: v for k, v in (("method", method), ("activation", activation), ("q", q)) if v}
        return page(request, "list.html", items=items, pages=views.pagination(total, offset, limit), facets=facets,
                    method=method or "", activation=activation or "", q=q or "", search=search, chosen=chosen,
                    query=query, limit=limit, page_sizes=sorted({*PAGE_SIZES, limit}))

    @router.get("/dashboard/new", dependencies=deps)
    def new_solve_page(request: Request):
        return page(request, "new.html", catalog=catalog)

    @router.get("/dashboard/solutions/{key}", dependencies=deps)
    def solution_page(request: Request, key: str):
        if not KEY_PATTERN.match(key):
            return not_found(request, "solution")
        try:
            record = solutions.get(key)
        except SigpropError as exc:
            if exc.code == "not_found":
                return not_found(request, "solution")
            raise
        try:
            found = validations.list_for_key(key, VALIDATIONS_SHOWN)
        except SigpropError as exc:  # the validation store is down: the solution is still worth showing
            found = {"total": 0, "items": [], "error": exc.message}
        return page_or_unreadable(request, "solution", f"/v1/solutions/{key}", "solution.html",
                                  lambda: views.solution_view(key, record), validations=found, plots=True)

    @router.get("/dashboard/validations/{vid}.json", dependencies=deps)
    def validation_progress(vid: str):
        if not ID_PATTERN.match(vid):
            raise SigpropError("not_found", f"no validation has id {vid[:64]}", "list validations with GET /v1/validations")
        return views.progress_view(validations.get(vid))

    @router.get("/dashboard/validations/{vid}", dependencies=deps)
    def validation_page(request: Request, vid: str):
        if not ID_PATTERN.match(vid):
            return not_found(request, "validation")
        try:
            job = validations.get(vid)
        except SigpropError as exc:
            if exc.code == "not_found":
                return not_found(request, "validation")
            raise
        return page_or_unreadable(request, "validation", f"/v1/validations/{vid}", "validation.html",
                                  lambda: views.validation_view(job), active=job.get("status") in ACTIVE, plots=True)

    @router.get("/dashboard/static/{digest}/{name}", dependencies=deps)
    def static_file(request: Request, digest: str, name: str):
        asset = by_name.get(name)
        if asset is None or not asset.available or digest != asset.digest:
            raise SigpropError("not_found", f"no dashboard file {name[:100]} at this version",
                               "reload the dashboard page: its links carry the current versions")
        return _respond(request, asset.body(), asset.media_type, 200, {"Cache-Control": IMMUTABLE},
                        gz=asset.gzipped() if _accepts_gzip(request) else None)

    return router
