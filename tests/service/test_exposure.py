"""The docs, the dashboard and /metrics are served on the API port only when the settings say so
(issue 26): off by default, on for ``sigprop serve`` on a loopback address unless set, and
``/metrics`` on a private port of its own with ``SIGPROP_METRICS_PORT``."""

from __future__ import annotations

import httpx
import pytest

from sigprop import cli
from sigprop.settings import Settings

from ..inprocess import KEY_ONE, app_client, basic
from ..service_fixtures import LOOPBACK, assert_error, free_port, metric_value, start_service

SURFACES = {
    "SIGPROP_EXPOSE_DOCS": ["/docs", "/redoc", "/openapi.json", "/docs-assets/redoc.standalone.js"],
    "SIGPROP_EXPOSE_DASHBOARD": ["/", "/dashboard", "/dashboard/new", "/dashboard/solutions/abc"],
    "SIGPROP_EXPOSE_METRICS": ["/metrics"],
}
SURFACE_ENV = list(SURFACES)


def test_they_are_off_by_default(monkeypatch):
    for name in SURFACE_ENV:
        monkeypatch.delenv(name, raising=False)
    settings = Settings()
    assert not (settings.expose_docs or settings.expose_dashboard or settings.expose_metrics)
    assert settings.metrics_port == 0


def test_closed_surfaces_answer_404_naming_their_setting_and_the_api_still_answers(tmp_path):
    closed = {"expose_docs": False, "expose_dashboard": False, "expose_metrics": False}
    with app_client(tmp_path, **closed) as c:
        for setting, paths in SURFACES.items():
            for path in paths:
                err = assert_error(c.get(path, follow_redirects=False), 404, "not_found")
                assert f"{setting}=true" in err["hint"], (path, err)
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
        assert c.get("/v1/templates").status_code == 200
        assert (
            c.post(
                "/v1/solve",
                json={"graph": {"template": "mlp", "depth": 3, "width": 8}, "method": "eoc", "activation": "relu"},
            ).status_code
            == 200
        )
        assert c.get("/docsx").status_code == 404 and c.get("/metricsfoo").status_code == 404  # no prefix games
    opened = {"expose_docs": True, "expose_dashboard": True, "expose_metrics": True}
    with app_client(tmp_path, **opened) as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/metrics"):
            assert c.get(path).status_code == 200, path
        # the dashboard is served, and shows stored submissions: with keys configured, to a key
        assert_error(c.get("/dashboard"), 401, "unauthorized")
        assert c.get("/dashboard", headers=basic(KEY_ONE)).status_code == 200


def test_serve_on_loopback_turns_them_on_unless_set(monkeypatch):
    for name in SURFACE_ENV:
        monkeypatch.delenv(name, raising=False)
    cli._expose_on_loopback("0.0.0.0")
    cli._expose_on_loopback("192.0.2.7")
    assert not any(n in __import__("os").environ for n in SURFACE_ENV)
    monkeypatch.setenv("SIGPROP_EXPOSE_METRICS", "false")
    cli._expose_on_loopback("127.0.0.1")
    settings = Settings()
    assert settings.expose_docs and settings.expose_dashboard and not settings.expose_metrics
    assert cli._is_loopback("::1") and cli._is_loopback("localhost") and not cli._is_loopback("::")


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_metrics_on_a_private_port_while_closed_on_the_api_port(tmp_path, workers):
    port = free_port()
    svc = start_service(
        tmp_path,
        {
            "SIGPROP_DATA_DIR": str(tmp_path / "d"),
            "SIGPROP_EXPOSE_METRICS": "false",
            "SIGPROP_METRICS_PORT": str(port),
            "SIGPROP_SOLVE_PROCESSES": "0",
        },
        workers=workers,
    )
    try:
        with svc.client() as c:
            for _ in range(4):
                assert c.get("/healthz").status_code == 200
            assert_error(c.get("/metrics"), 404, "not_found")
            assert c.get("/docs").status_code == 200  # loopback: the others stay on
        text = httpx.get(f"http://{LOOPBACK}:{port}/metrics", timeout=10).text
        served = metric_value(text, "sigprop_requests_total", {"route": "/healthz", "method": "GET", "status": "200"})
        assert served is not None and served >= 4, text[:2000]
        assert "sigprop_memory_bytes" in text
    finally:
        svc.stop()
