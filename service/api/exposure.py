"""What the API port serves beyond the API and the probes: the interactive docs (``/docs``,
``/redoc``, ``/openapi.json`` and their assets), the dashboard (``/`` and ``/dashboard``) and
``/metrics``, each only when its setting says so (``SIGPROP_EXPOSE_DOCS``,
``SIGPROP_EXPOSE_DASHBOARD``, ``SIGPROP_EXPOSE_METRICS``; off by default).

On a public port these tell an attacker the service's version, every route and its load, and the
dashboard renders stored requests for anyone (issue 26). ``sigprop serve`` on a loopback address,
a developer's own machine, turns them on unless they are set; a deployment turns on what it needs,
or scrapes ``/metrics`` on the private ``SIGPROP_METRICS_PORT``. A closed surface answers 404 as an
unknown path does, with a hint naming its setting.
"""

from __future__ import annotations

import json

DOCS_PATHS = ("/docs", "/redoc", "/openapi.json", "/docs-assets")
DASHBOARD_PATHS = ("/dashboard",)
METRICS_PATHS = ("/metrics",)


def closed_paths(settings) -> dict[str, str]:
    """Path (or path prefix) -> the setting that opens it, for every surface the settings close."""
    closed: dict[str, str] = {}
    for paths, open_, name in (
        (DOCS_PATHS, settings.expose_docs, "SIGPROP_EXPOSE_DOCS"),
        (DASHBOARD_PATHS, settings.expose_dashboard, "SIGPROP_EXPOSE_DASHBOARD"),
        (METRICS_PATHS, settings.expose_metrics, "SIGPROP_EXPOSE_METRICS"),
    ):
        if not open_:
            closed.update(dict.fromkeys(paths, name))
    return closed


class ClosedSurfacesMiddleware:
    """404 for the closed surfaces, before routing (so not even their redirects answer)."""

    def __init__(self, app, closed: dict[str, str]):
        self.app = app
        self.closed = closed
        self.root_closed = "/dashboard" in closed  # "/" redirects to the dashboard

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.closed:
            setting = self._setting(scope["path"])
            if setting is not None:
                return await _not_exposed(send, setting)
        return await self.app(scope, receive, send)

    def _setting(self, path: str) -> str | None:
        if path == "/" and self.root_closed:
            return self.closed["/dashboard"]
        for prefix, setting in self.closed.items():
            if path == prefix or path.startswith(prefix + "/"):
                return setting
        return None


async def _not_exposed(send, setting: str) -> None:
    body = json.dumps(
        {
            "error": {
                "code": "not_found",
                "message": "no such endpoint on this port",
                "hint": f"the operator can serve it here with {setting}=true",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 404,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
