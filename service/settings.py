"""All settings of the service, from the environment (prefix ``SIGPROP_``), in one place."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIGPROP_", extra="ignore")

    redis_url: str | None = Field(default=None, description="Redis cache, e.g. redis://127.0.0.1:6379/0; unset: embedded SQLite cache")
    data_dir: Path = Field(default=Path.home() / ".sigprop", description="where the embedded cache lives")
    max_body_bytes: int = Field(default=2_000_000, ge=1_000, description="largest request body")
    max_nodes: int = Field(default=100_000, ge=1, description="largest graph, counted after template expansion")
    max_depth: int = Field(default=10_000, ge=1, description="most nonlinear layers on the longest path of a graph (templates: checked before expansion)")
    max_fan_in: int = Field(default=1024, ge=2, description="most inputs of one sum or concat node")
    solve_timeout_s: float = Field(default=30.0, gt=0, description="a solve running longer answers 503 solve_timeout")
    lock_timeout_s: float = Field(default=60.0, gt=0, description="single-flight lock lifetime: a crashed solver's lock expires")
    redis_timeout_s: float = Field(default=0.5, gt=0, description="socket timeout for Redis calls, so an outage cannot hang a request")
    api_keys: str = Field(default="", description="comma-separated API keys for writes that cost or destroy (deletes, validations), and with keys_for_reads for everything but the probes; kept only as SHA-256 digests")
    keys_for_reads: bool = Field(default=False, description="also require a key for POST /v1/solve and every read (solutions, validations, templates, dashboard); /healthz, /readyz, /metrics stay open")
    # limits' string notation ("600/minute", "10/second;600/hour"); "" or "0" disables. Per API key
    # (a valid one sent) or else per client address; shared through Redis when SIGPROP_REDIS_URL is set.
    rate_limit_cold_solves: str = Field(default="600/minute", description="solves that miss the cache, per client (cache hits are never limited)")
    rate_limit_validations: str = Field(default="60/minute", description="POST /v1/validations, per client")
    log_level: str = Field(default="INFO")
    # validations (contract section 4): RQ jobs run by `sigprop worker`, or with no Redis a thread pool in the API
    validation_queue: str = Field(default="sigprop-validations", min_length=1, max_length=128, description="RQ queue the API enqueues to and `sigprop worker` listens on")
    validation_timeout_s: int = Field(default=3600, ge=1, description="a validation attempt running longer is stopped and fails (not retried)")
    validation_retries: int = Field(default=2, ge=0, le=10, description="retries of a validation whose attempt crashed, raised, or whose worker died")
    validation_cancel_grace_s: float = Field(default=30.0, gt=0, description="a running validation that ignores its cancel this long is killed by its worker")
    validation_local_workers: int = Field(default=1, ge=1, le=64, description="without Redis: validations run at once in the API process")
    worker_heartbeat_s: int = Field(default=10, ge=1, description="a worker refreshes its running job's heartbeat this often; a job unrefreshed for this + 5 s is abandoned")
    worker_maintenance_s: int = Field(default=30, ge=1, description="how often a worker looks for abandoned jobs to retry (RQ registry cleanup)")

    @field_validator("rate_limit_cold_solves", "rate_limit_validations")
    @classmethod
    def _rate_limit(cls, value: str) -> str:
        from .api.ratelimit import parse_rate_limit

        parse_rate_limit(value)  # ValueError with the notation's rules when it does not parse
        return value

    @model_validator(mode="after")
    def _keys_for_reads_needs_keys(self):
        if self.keys_for_reads and not [k for k in self.api_keys.split(",") if k.strip()]:
            raise ValueError("SIGPROP_KEYS_FOR_READS is true but SIGPROP_API_KEYS is empty: every request would be "
                             "refused. Set SIGPROP_API_KEYS (comma-separated keys) or SIGPROP_KEYS_FOR_READS=false")
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
