"""All settings of the service, from the environment (prefix ``SIGPROP_``), in one place."""

from __future__ import annotations

import textwrap
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .engine.limits import DEFAULT_MAX_NODES, DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_TOKEN_WORK, Limits
from .errors import SigpropError

# a rate limit setting with one of these values limits nothing
RATE_LIMIT_DISABLED = ("", "0", "off", "none")


def parse_rate_limit(text: str) -> list:
    """The limits (``limits.RateLimitItem``) of a setting in limits' notation ("600/minute",
    "10/second;600/hour"); [] when disabled ("" or "0"). Raises ValueError saying what is accepted."""
    # imported here: template expansion reads the node limit from this module in offline solves,
    # where the server's packages (limits) need not be installed
    from limits import parse_many

    text = (text or "").strip()
    if text.lower() in RATE_LIMIT_DISABLED:
        return []
    try:
        items = list(parse_many(text))
    except ValueError:
        raise ValueError(
            f"rate limit {text!r} does not parse: write e.g. '600/minute', '10/second;600/hour' or "
            "'30 per minute' (limits' notation), or '' / '0' to disable"
        ) from None
    if not items or any(item.amount < 1 for item in items):
        raise ValueError(f"rate limit {text!r} allows nothing: use '' or '0' to disable the limit instead")
    return items


class NodeLimit(BaseSettings):
    """The one node limit, readable without the rest of the settings: an offline solve
    (``offline_limits``) reads it, and a setting only the service uses must not break it."""

    model_config = SettingsConfigDict(env_prefix="SIGPROP_", extra="ignore")

    max_nodes: int = Field(
        default=DEFAULT_MAX_NODES, ge=1, description="largest graph, counted after template expansion"
    )


class Settings(NodeLimit):
    """Every setting (``max_nodes`` comes from ``NodeLimit``, with the same prefix)."""

    redis_url: str | None = Field(
        default=None, description="Redis cache, e.g. redis://127.0.0.1:6379/0; unset: embedded SQLite cache"
    )
    data_dir: Path = Field(default=Path.home() / ".sigprop", description="where the embedded cache lives")
    max_body_bytes: int = Field(default=2_000_000, ge=1_000, description="largest request body")
    max_depth: int = Field(
        default=10_000,
        ge=1,
        description="most nonlinear layers on the longest path of a graph (templates: checked before expansion)",
    )
    max_fan_in: int = Field(default=1024, ge=2, description="most inputs of one sum or concat node")
    solve_timeout_s: float = Field(default=30.0, gt=0, description="a solve running longer answers 503 solve_timeout")
    max_solve_cost: int = Field(
        default=50_000,
        ge=1,
        description="most nodes + edges of one graph (templates: computed from the parameters), checked before anything is built; over it: 413 graph_too_large",
    )
    max_seq_len: int = Field(
        default=DEFAULT_MAX_SEQ_LEN,
        ge=1,
        description="most tokens of a sequence graph (transformers); over it: 413 graph_too_large",
    )
    max_token_work: int = Field(
        default=DEFAULT_MAX_TOKEN_WORK,
        ge=1,
        description="price of a sequence graph's token-kernel propagation, about nanoseconds of one core: 393,216 + "
        "12 K^2 per node and K^3 more per attention node, K = min(tokens, 256) (a 72-block transformer at "
        "T >= 256: 2.3e9); over it: 413 graph_too_large",
    )
    solve_processes: int = Field(
        default=2,
        ge=0,
        le=64,
        description="cold solves at once per API process, each in a worker process killed at SIGPROP_SOLVE_TIMEOUT_S; 0: solve in API threads (no kill)",
    )
    small_solve_cost: int = Field(
        default=2_000,
        ge=0,
        description="a cold solve whose price (nodes + edges, plus a sequence graph's token-kernel work at 10 us a unit) is at most this is small: it may also run in the small lane (SIGPROP_SMALL_SOLVE_PROCESSES), so large solves queued ahead never hold it up; 0: every solve is large",
    )
    small_solve_processes: int = Field(
        default=1,
        ge=0,
        le=64,
        description="worker processes per API process besides SIGPROP_SOLVE_PROCESSES that only small solves use (0: no small lane)",
    )
    inline_solve_cost: int = Field(
        default=1_000,
        ge=0,
        description="a cold solve of at most this many nodes + edges (not a sequence graph) is first tried in the API process itself, one at a time per process, within SIGPROP_INLINE_SOLVE_BUDGET_MS; past the budget it goes to a solver process (0: never in the API process)",
    )
    inline_solve_budget_ms: float = Field(
        default=20.0,
        gt=0,
        le=1_000,
        description="the wall-clock budget of a solve tried in the API process (SIGPROP_INLINE_SOLVE_COST); after a solve runs past it, the API process tries none for ten times the time it spent",
    )
    cold_solves_per_client: int = Field(
        default=1,
        ge=0,
        le=64,
        description="large cold solves one client (an API key; all clients without a key together) runs at once per API process; its others wait (within the solve timeout) while other clients' solves start; 0: no cap",
    )
    memo_bytes: int = Field(
        default=64 << 20,
        ge=0,
        description="bytes of parsed request bodies each API process remembers, so a repeated body skips validation",
    )
    trusted_proxies: str = Field(
        default="",
        description="comma-separated addresses (or CIDR ranges) of reverse proxies whose X-Forwarded-For / Forwarded headers name the client; empty: those headers are ignored",
    )
    lock_timeout_s: float = Field(
        default=60.0, gt=0, description="single-flight lock lifetime: a crashed solver's lock expires"
    )
    redis_timeout_s: float = Field(
        default=0.5, gt=0, description="socket timeout for Redis calls, so an outage cannot hang a request"
    )
    # Retention (0: no bound). A typical answer is a few KB; the 10,000-layer MLP's is 1.8 MB, so
    # the byte bound is what keeps a few hundred deep requests from filling Redis.
    cache_max_entries: int = Field(
        default=100_000,
        ge=0,
        description="most stored solutions; past it the least recently used are evicted with their index entries (0: no bound)",
    )
    cache_max_bytes: int = Field(
        default=512 * 1024 * 1024,
        ge=0,
        description="most bytes of stored answers, requests and ids; past it the least recently used are evicted (0: no bound)",
    )
    cache_secret: SecretStr | None = Field(
        default=None,
        description="key of the answers' checksum (HMAC-SHA256): an entry written without it is recomputed, never served; unset: plain SHA-256",
    )
    validation_max_age_days: float = Field(
        default=90.0,
        ge=0,
        description="finished, failed and cancelled validations older than this are removed (0: kept forever)",
    )
    validation_max_records: int = Field(
        default=10_000,
        ge=0,
        description="most validation records kept; past it the oldest final ones are removed (0: no bound)",
    )
    api_keys: str = Field(
        default="",
        description="comma-separated API keys for writes that cost or destroy (deletes, validations), and with keys_for_reads for everything but the probes; kept only as SHA-256 digests",
    )
    admin_keys: str = Field(
        default="",
        repr=False,
        description="comma-separated admin keys: API keys that may also cancel any key's validation and delete cached solutions (shared by every key); kept only as SHA-256 digests",
    )
    anonymous_stored_reads: bool = Field(
        default=False,
        description="with API keys configured, let requests without a key read stored solutions (their requests and graphs) and the dashboard; validations are only ever shown to the key that submitted them and admin keys",
    )
    keys_for_reads: bool = Field(
        default=False,
        description="also require a key for POST /v1/solve and every read (solutions, validations, templates, dashboard); /healthz, /readyz, /metrics stay open",
    )
    # limits' string notation ("600/minute", "10/second;600/hour"); "" or "0" disables. Per API key
    # (a valid one sent) or else per client address; shared through Redis when SIGPROP_REDIS_URL is set.
    rate_limit_cold_solves: str = Field(
        default="600/minute", description="solves that miss the cache, per client (cache hits are never limited)"
    )
    rate_limit_validations: str = Field(default="60/minute", description="POST /v1/validations, per client")
    log_level: str = Field(
        default="INFO", description="level of the JSON log lines on stderr (DEBUG, INFO, WARNING, ERROR)"
    )
    # validations (contract section 4): RQ jobs run by `sigprop worker`, or with no Redis a thread pool in the API
    validation_queue: str = Field(
        default="sigprop-validations",
        min_length=1,
        max_length=128,
        description="RQ queue the API enqueues to and `sigprop worker` listens on",
    )
    validation_timeout_s: int = Field(
        default=3600, ge=1, description="a validation attempt running longer is stopped and fails (not retried)"
    )
    validation_retries: int = Field(
        default=2,
        ge=0,
        le=10,
        description="retries of a validation whose attempt crashed, raised, or whose worker died",
    )
    validation_cancel_grace_s: float = Field(
        default=30.0, gt=0, description="a running validation that ignores its cancel this long is killed by its worker"
    )
    validation_local_workers: int = Field(
        default=1, ge=1, le=64, description="without Redis: validations run at once in the API process"
    )
    worker_heartbeat_s: int = Field(
        default=2,
        ge=1,
        description="a worker refreshes its running job's heartbeat this often; a job unrefreshed for this + 5 s is abandoned",
    )
    worker_maintenance_s: int = Field(
        default=2,
        ge=1,
        description="how often a worker (idle or busy) looks for abandoned jobs to retry; a killed worker's job is queued again within heartbeat + 5 + 2 x this seconds",
    )
    # trust boundaries: Redis credentials, datasets, failed API keys
    redis_username: str | None = Field(
        default=None, description="Redis ACL user, merged into SIGPROP_REDIS_URL (a user in the URL wins)"
    )
    redis_password: str | None = Field(
        default=None,
        repr=False,
        description="Redis password (requirepass or the ACL user's), merged into SIGPROP_REDIS_URL (a password in the URL wins)",
    )
    datasets_dir: Path | None = Field(
        default=None,
        description="folder of the .npz datasets validations may name (relative to it); unset: .npz datasets are off",
    )
    max_dataset_bytes: int = Field(
        default=256_000_000, ge=1, description="largest .npz file, and largest total of its arrays as stored unpacked"
    )
    max_input_values: int = Field(
        default=16_384,
        ge=1,
        description="most values per example of a validation's inputs (synthetic and .npz), checked before anything is allocated",
    )
    rate_limit_failed_auth: str = Field(
        default="20/minute",
        description="requests with a wrong API key per client address (over it: 429 for its wrong keys; a right key always passes)",
    )

    # slow clients and open connections (``sigprop serve``; api/connections.py)
    max_connections: int = Field(
        default=1000,
        ge=16,
        description="open connections per API process, lowered to fit the file-descriptor limit less 256; at the cap the connection sending its request the longest is closed to admit a new one",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a request's headers must arrive within this many seconds of the connection (or of the request's first byte on a kept-alive one), else the connection is closed",
    )
    max_header_bytes: int = Field(
        default=65_536,
        ge=1_024,
        description="largest request line and header block (API and metrics ports); over it: 431 headers_too_large and the connection is closed",
    )
    body_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="a request's body must arrive within this many seconds of its headers, else the connection is closed",
    )

    # what the API port serves beyond the API and the probes; `sigprop serve` on a loopback
    # address turns these on unless they are set (a developer's own machine)
    expose_docs: bool = Field(default=False, description="serve /docs, /redoc and /openapi.json on the API port")
    expose_dashboard: bool = Field(default=False, description="serve the dashboard (/dashboard) on the API port")
    expose_metrics: bool = Field(default=False, description="serve /metrics on the API port")
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="`sigprop serve` also serves /metrics (every worker's) on this port of the same address, for a scraper on a private network; 0: no such port",
    )

    def limits(self) -> Limits:
        """The limits every request to this service is admitted against (``sigprop.preparation``)."""
        return Limits(
            self.max_nodes, self.max_depth, self.max_fan_in, self.max_solve_cost, self.max_seq_len, self.max_token_work
        )

    @model_validator(mode="after")
    def _redis_credentials(self):
        from .redis_url import with_credentials  # a small helper module: settings stay readable

        if self.redis_url and (self.redis_password or self.redis_username):
            self.redis_url = with_credentials(self.redis_url, self.redis_username, self.redis_password)
        return self

    @field_validator("rate_limit_cold_solves", "rate_limit_validations", "rate_limit_failed_auth")
    @classmethod
    def _rate_limit(cls, value: str) -> str:
        parse_rate_limit(value)  # ValueError with the notation's rules when it does not parse
        return value

    @model_validator(mode="after")
    def _keys_for_reads_needs_keys(self):
        if self.keys_for_reads and not [k for k in f"{self.api_keys},{self.admin_keys}".split(",") if k.strip()]:
            raise ValueError(
                "SIGPROP_KEYS_FOR_READS is true but SIGPROP_API_KEYS is empty: every request would be "
                "refused. Set SIGPROP_API_KEYS (comma-separated keys) or SIGPROP_KEYS_FOR_READS=false"
            )
        return self


def _env_name(field: str) -> str:
    return f"{Settings.model_config.get('env_prefix', '')}{field}".upper()


def _shown_default(info) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None or value == "":
        return "unset"
    return str(value)


def settings_help() -> str:
    """Every setting with its environment variable, default and description, generated from the
    fields above (``sigprop serve --help`` shows it), so the help never drifts from the settings."""
    lines = ["settings (environment variables):"]
    for name, info in Settings.model_fields.items():
        lines.append(f"  {_env_name(name)} (default: {_shown_default(info)})")
        if info.description:
            lines.extend(textwrap.wrap(info.description, 100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


@lru_cache(maxsize=1)
def get_node_limit() -> int:
    """``SIGPROP_MAX_NODES`` (``NodeLimit``), read once; raises pydantic's ValidationError when it is invalid."""
    return NodeLimit().max_nodes


def offline_limits() -> Limits:
    """The limits of ``sigprop solve`` and ``sigprop.solve``: the node limit from the environment
    (``SIGPROP_MAX_NODES``), no depth, fan-in or cost budget (those protect a shared service); a
    sequence graph's tokens and token-kernel price keep their defaults (``engine.limits``).
    An invalid ``SIGPROP_MAX_NODES`` is the request's error (``invalid_request``), with the fix."""
    try:
        return Limits(max_nodes=get_node_limit())
    except ValidationError as exc:
        raise SigpropError(
            "invalid_request",
            f"SIGPROP_MAX_NODES: {exc.errors(include_url=False)[0]['msg']}",
            "set SIGPROP_MAX_NODES to a positive number of nodes, or unset it (100000)",
        ) from None
