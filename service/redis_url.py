"""Redis credentials from ``SIGPROP_REDIS_USERNAME`` / ``SIGPROP_REDIS_PASSWORD`` merged into the
Redis URL, so every client built from ``SIGPROP_REDIS_URL`` (cache, queue, worker, rate limiter)
authenticates the same way. ``rediss://`` (TLS) URLs pass through unchanged apart from the
credentials; credentials already in the URL win."""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit


def with_credentials(url: str, username: str | None, password: str | None) -> str:
    """``url`` with ``username``/``password`` in its netloc unless the URL carries its own."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or "@" in parts.netloc:
        return url  # unix sockets take credentials in their query string; a URL's own credentials win
    user, secret = quote(username or "", safe=""), quote(password or "", safe="")
    auth = f"{user}:{secret}@" if secret else (f"{user}@" if user else "")
    return urlunsplit((parts.scheme, auth + parts.netloc, parts.path, parts.query, parts.fragment))


def redacted(url: str | None) -> str:
    """``url`` with its password replaced by ``***`` (for logs and messages)."""
    if not url:
        return ""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, f"{parts.username or ''}:***@{host}", parts.path, parts.query, parts.fragment))
