"""The dashboard's static files, served from memory at URLs that carry their digest (cached for a
year, ``immutable``): its own script, stylesheet and icon (``static/``) and plotly.js as the
installed ``plotly`` package ships it; and gzip for every answer of the dashboard's."""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import threading
from importlib.resources import files
from pathlib import Path

from fastapi import Request
from fastapi.responses import Response

GZIP_MIN_BYTES = 1024
IMMUTABLE = "public, max-age=31536000, immutable"


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


def plotly_asset() -> Asset:
    """plotly.min.js as the ``plotly`` Python package ships it (found without importing plotly)."""
    spec = importlib.util.find_spec("plotly")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js" if spec and spec.origin else None
    try:
        version = importlib.metadata.version("plotly")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return Asset(f"plotly-{version}.min.js", path, "text/javascript; charset=utf-8")


def own_asset(name: str, media_type: str) -> Asset:
    return Asset(name, Path(str(files("sigprop.dashboard") / "static" / name)), media_type)


def dashboard_assets() -> dict[str, Asset]:
    """The files the pages link to, by the name the templates use."""
    return {
        "plotly": plotly_asset(),
        "js": own_asset("dashboard.js", "text/javascript; charset=utf-8"),
        "css": own_asset("dashboard.css", "text/css; charset=utf-8"),
        "icon": own_asset("favicon.svg", "image/svg+xml"),
    }


def accepts_gzip(request: Request) -> bool:
    return "gzip" in request.headers.get("accept-encoding", "").lower()


def respond(
    request: Request, body: bytes, media_type: str, status: int, headers: dict[str, str], gz: bytes | None = None
) -> Response:
    headers = {**headers, "Vary": "Accept-Encoding"}
    if accepts_gzip(request) and len(body) >= GZIP_MIN_BYTES:
        body = gz if gz is not None else gzip.compress(body, 5, mtime=0)
        headers["Content-Encoding"] = "gzip"
    return Response(body, status_code=status, media_type=media_type, headers=headers)
