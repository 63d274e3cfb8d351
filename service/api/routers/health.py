"""The probes and metrics, open even with ``SIGPROP_KEYS_FOR_READS``: ``/healthz`` (the process is
up), ``/readyz`` (the cache answers and the engine is warm; 503 otherwise), ``/metrics``
(Prometheus). ``/readyz`` answers from the store's state as a background thread last saw it
(``probe_state.py``), at most half a second old.

A store that answers but refuses writes (full, read-only) leaves ``/readyz`` at 200 with
``"storage": "degraded"``: this process still answers every solve (hits from the store, cold
solves without storing them), and every replica shares the same store, so a 503 would only have an
orchestrator restart or unroute all of them, turning a degraded service into none. The degraded
state is for alerts: the body says it, and ``sigprop_storage_events_total`` counts the refusals.

With Redis, ``"redis_config"`` says whether Redis' own settings can drop accepted work (``ok``,
``degraded``: persistence that loses writes on a restart or crash, ``unsafe``: an eviction policy,
which the API refuses at start, ``unknown``: ``CONFIG GET`` refused), ``"redis_config_note"`` why;
it leaves the status code alone, for the reason above (docs/deployment.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ... import ENGINE_VERSION, __version__
from ..observability import metrics_payload

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz():
    return {"status": "ok", "version": __version__, "engine_version": ENGINE_VERSION}


@router.get("/readyz")
async def readyz(request: Request):
    # on the event loop, from the state probe_state.py's thread keeps: no I/O, no pool to queue in
    state = request.app.state
    store = state.probes.current()
    cache_ok, storage = store.reachable, store.storage
    body = {
        "status": "ready" if cache_ok and state.warm else "not_ready",
        "cache": state.cache.backend,
        "cache_reachable": cache_ok,
        "engine_warm": state.warm,
        "storage": storage,
    }
    if storage == "degraded":
        body["storage_note"] = (
            "the store refuses writes (full or read-only): solves are answered but not stored, "
            "hits are not counted, validations are refused with 503 storage_full"
        )
    if store.config is not None:  # Redis: can its own settings drop accepted work? (redis_config.py)
        body["redis_config"] = store.config
        if store.config_note:
            body["redis_config_note"] = store.config_note
    return JSONResponse(body, status_code=200 if body["status"] == "ready" else 503)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {
            "description": "Prometheus text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
async def metrics():
    payload, ctype = metrics_payload()
    return Response(payload, media_type=ctype)
