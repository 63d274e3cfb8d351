"""The FastAPI application: wiring only (contract sections 2-3).

``create_app`` builds the services once and puts them on ``app.state`` (``deps.py`` hands them to
the routes), then includes the routers: the ``/v1`` resources (``routers/``) and the dashboard
(``sigprop.dashboard.router``) behind the read-access check, the probes open. The error handlers
are ``handlers.py``, the OpenAPI additions ``openapi.py``.
"""

from __future__ import annotations

import gc
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from starlette.routing import NoMatchFound

from .. import __version__
from ..dashboard.router import pages as dashboard_pages
from ..dashboard.router import router as dashboard_router
from ..engine.solve import solve
from ..schemas.solve import SolveRequest
from ..settings import Settings, get_settings
from ..storage import make_cache
from ..storage.redis_config import check_at_start
from .auth import KeyChecker, check_keys
from .coldpool import SolverPool
from .deps import Offload, read_access, stored_read_access
from .exposure import ClosedSurfacesMiddleware, closed_paths
from .handlers import install_error_handlers
from .http_guards import JSON_METHODS, JsonBodiesMiddleware, NosniffMiddleware
from .inline_lane import InlineLane
from .observability import BodyLimitMiddleware, RequestContextMiddleware, configure_logging, forget_this_process
from .openapi import install_openapi
from .probe_state import ProbeState
from .proxies import apply_proxy_trust
from .ratelimit import make_limits
from .routers import STORED_ROUTERS, V1_ROUTERS, health
from .serve_ready import READY, SOLVERS, report
from .solutions import SolutionService
from .solve_fastpath import SolveFastPath
from .validations import make_validations

# One tiny solve imports and exercises the engine before /readyz says ready.
_WARM_UP = {
    "graph": {"template": "mlp", "depth": 2, "width": 4},
    "method": "tat",
    "activation": "leaky_relu",
    "targets": {"eta": 0.1},
}


@asynccontextmanager
async def lifespan(app: FastAPI):
    state = app.state
    await state.offload.untimed(lambda: solve(SolveRequest.model_validate(_WARM_UP)))
    await state.offload.untimed(dashboard_pages)  # the dashboard's templates and static files
    _build_routes(app)
    if state.solutions.solver is not None:
        report(SOLVERS)  # the slowest step: `sigprop serve` says what it waits for
        await state.offload.untimed(state.solutions.solver.warm)  # the forkserver imports the engine once
    # What start-up loaded lives as long as the app: out of the cyclic collector's sight (the
    # gc.freeze recipe, as in solver_preload.py), a full collection scans only what requests made.
    # Unfrozen, it held the event loop (and every request in flight) for 60-70 ms every few dozen
    # cold solves (bench/README.md, "Cold solves over HTTP against in-process"). Unfrozen again at
    # shutdown, so an app run inside a longer-lived process (the tests' TestClient) leaves its heap
    # collectable. No collection first: it would cost every in-process app start a full pass of its
    # host's heap, and the little start-up garbage it would free is freed at shutdown.
    gc.freeze()
    state.probes.start()  # /readyz's view of the store and the memory gauges, kept fresh by a thread
    state.warm = True
    report(READY)  # `sigprop serve` says it listens once every worker has (serve_ready.py)
    yield
    state.probes.stop()
    gc.unfreeze()
    forget_this_process()
    state.validations.close()  # local (no-Redis) validations still running end "failed": interrupted
    state.offload.shutdown()  # in-flight solves finish before the process exits
    if state.solutions.solver is not None:
        state.solutions.solver.shutdown()
    state.cache.close()  # with the hot answers' pending hit counts (storage/hot.py)


def _build_routes(app: FastAPI) -> None:
    """FastAPI builds an included router's routes (their parameter and response models) the first
    time a request walks it: 130 ms, paid by the first request every worker answers, right after
    `sigprop serve` said it listens. A route name that no route has makes it walk, and build, all
    of them now."""
    try:
        app.url_path_for("sigprop: a name no route has")
    except NoMatchFound:
        pass


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logger = configure_logging(settings.log_level)
    # here, not in `sigprop serve`: `uvicorn --factory sigprop.api.app:create_app` builds the app too
    check_keys(settings.api_keys)  # WeakKeys: no server with a guessable key
    check_keys(settings.admin_keys, "SIGPROP_ADMIN_KEYS")
    apply_proxy_trust(settings.trusted_proxies)  # before uvicorn wraps the app in its proxy headers
    app = FastAPI(
        title="sigprop",
        version=__version__,
        lifespan=lifespan,
        description="Solve activation transformations and initializations for any network graph.",
    )
    state = app.state
    state.settings = settings
    state.limits = make_limits(settings)
    state.keys = KeyChecker(settings.api_keys, failures=state.limits.failed_auth, admin_csv=settings.admin_keys)
    state.cache = make_cache(settings)
    if state.cache.backend == "redis":  # an evicting Redis: no server (storage/redis_config.py)
        check_at_start(state.cache.r)
    cold = state.limits.cold_solves
    state.solutions = SolutionService(
        state.cache,
        settings.lock_timeout_s,
        settings.solve_timeout_s,
        limits=settings.limits(),  # nodes, depth, fan-in and cost: the one object requests are admitted against
        limit_cold=cold if cold.enabled else None,
        memo_bytes=settings.memo_bytes,
        solve_timeout_s=settings.solve_timeout_s,
        solver=(
            SolverPool(settings.solve_processes, settings.small_solve_processes, settings.cold_solves_per_client)
            if settings.solve_processes
            else None
        ),
        small_cost=settings.small_solve_cost,
        inline=(
            InlineLane(settings.inline_solve_cost, settings.inline_solve_budget_ms / 1000)
            if settings.inline_solve_cost and settings.solve_processes
            else None
        ),
        # Redis only: the SQLite file has no change notifications to keep a memory coherent
        hot=state.cache.hot_answers(),
    )
    state.validations = make_validations(settings, state.solutions)
    state.offload = Offload(settings.solve_timeout_s)
    state.probes = ProbeState(state.cache, state.solutions)
    state.warm = False

    install_error_handlers(app)
    read = [Depends(read_access(settings.keys_for_reads))]
    # stored submissions (solutions with their requests and graphs, validations, the dashboard that
    # shows them): a key whenever keys are configured, unless SIGPROP_ANONYMOUS_STORED_READS
    stored = [Depends(stored_read_access(settings, state.keys.configured))]
    for router in V1_ROUTERS:
        app.include_router(router, dependencies=stored if router in STORED_ROUTERS else read)
    app.include_router(dashboard_router, dependencies=stored)
    app.include_router(health.router)
    install_openapi(app)
    # innermost of ours: hits it answers are still size-limited, logged and counted
    app.add_middleware(SolveFastPath, state=state, enabled=not settings.keys_for_reads)
    app.add_middleware(ClosedSurfacesMiddleware, closed=closed_paths(settings))  # docs, dashboard, metrics
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    # 415 before anything reads the body, with the request's id; the other methods and paths get the
    # router's 404/405 as before
    json_paths = frozenset(r.path for router in V1_ROUTERS for r in router.routes if JSON_METHODS & r.methods)
    app.add_middleware(JsonBodiesMiddleware, paths=json_paths)
    app.add_middleware(RequestContextMiddleware, logger=logger)
    app.add_middleware(NosniffMiddleware)  # outermost: nosniff on every answer
    return app
