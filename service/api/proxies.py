"""Whose ``X-Forwarded-For`` names the client, the same for every way of starting the app.

Rate limits and failed-key counts are per client address, so an address a client may choose is a
budget it may multiply. ``sigprop serve`` passes uvicorn ``proxy_headers`` and
``forwarded_allow_ips`` from ``SIGPROP_TRUSTED_PROXIES``. ``uvicorn --factory
sigprop.api.app:create_app`` passes nothing, and uvicorn then trusts ``X-Forwarded-For`` from
127.0.0.1 and ::1 (its ``FORWARDED_ALLOW_IPS`` default): any local process, or a proxy on the same
host that appends to the header instead of replacing it, could name any address.

uvicorn reads those two options only after the factory has returned (``Config.load`` wraps the
app in its ``ProxyHeadersMiddleware`` then), so ``create_app`` sets them on the uvicorn config that
is calling it: from ``SIGPROP_TRUSTED_PROXIES`` when it is set; left as they are when the operator
configured uvicorn's own ``--forwarded-allow-ips`` / ``FORWARDED_ALLOW_IPS``; otherwise off.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("sigprop")
UVICORN_DEFAULT_ALLOW = "127.0.0.1,::1"  # uvicorn.config.Config's default forwarded_allow_ips
_SEARCH_FRAMES = 8  # create_app's caller is Config.load; a wrapper or two in between at most


def trusted_list(trusted_proxies: str) -> str:
    """``SIGPROP_TRUSTED_PROXIES`` normalized: comma-separated, no blanks ('' when none)."""
    return ",".join(p.strip() for p in trusted_proxies.split(",") if p.strip())


def _calling_uvicorn_config():
    """The ``uvicorn.config.Config`` whose ``load`` is calling the app factory, else None."""
    module = sys.modules.get("uvicorn.config")
    config_type = getattr(module, "Config", None)
    if config_type is None:
        return None
    frame = sys._getframe(2)
    for _ in range(_SEARCH_FRAMES):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, config_type):
            return candidate
        frame = frame.f_back
    return None


def apply_proxy_trust(trusted_proxies: str) -> str:
    """Make the uvicorn serving this app trust forwarded headers only as configured; returns what
    it now trusts ('' for nobody), or 'not uvicorn' when no uvicorn config is calling."""
    config = _calling_uvicorn_config()
    if config is None:
        return "not uvicorn"
    trusted = trusted_list(trusted_proxies)
    if trusted:
        config.proxy_headers, config.forwarded_allow_ips = True, trusted
        return trusted
    if not config.proxy_headers:
        return ""
    allowed = config.forwarded_allow_ips
    allowed = ",".join(allowed) if isinstance(allowed, list | tuple) else str(allowed)
    if "FORWARDED_ALLOW_IPS" in os.environ or allowed.replace(" ", "") != UVICORN_DEFAULT_ALLOW:
        return allowed  # the operator chose uvicorn's own setting: theirs
    config.proxy_headers = False
    log.info(
        "X-Forwarded-For is ignored: the client is the TCP peer. Behind a reverse proxy, "
        "set SIGPROP_TRUSTED_PROXIES to its address"
    )
    return ""
