"""All settings of the service, from the environment (prefix ``SIGPROP_``), in one place."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIGPROP_", extra="ignore")

    redis_url: str | None = Field(default=None, description="Redis cache, e.g. redis://127.0.0.1:6379/0; unset: embedded SQLite cache")
    data_dir: Path = Field(default=Path.home() / ".sigprop", description="where the embedded cache lives")
    max_body_bytes: int = Field(default=2_000_000, ge=1_000, description="largest request body")
    max_nodes: int = Field(default=100_000, ge=1, description="largest graph, counted after template expansion")
    solve_timeout_s: float = Field(default=30.0, gt=0, description="a solve running longer answers 503 solve_timeout")
    lock_timeout_s: float = Field(default=60.0, gt=0, description="single-flight lock lifetime: a crashed solver's lock expires")
    redis_timeout_s: float = Field(default=0.5, gt=0, description="socket timeout for Redis calls, so an outage cannot hang a request")
    api_keys: str = Field(default="", description="comma-separated API keys for writes that cost or destroy (deletes, validations)")
    log_level: str = Field(default="INFO")
    # validations (contract section 4): RQ jobs run by `sigprop worker`, or with no Redis a thread pool in the API
    validation_queue: str = Field(default="sigprop-validations", min_length=1, max_length=128, description="RQ queue the API enqueues to and `sigprop worker` listens on")
    validation_timeout_s: int = Field(default=3600, ge=1, description="a validation attempt running longer is stopped and fails (not retried)")
    validation_retries: int = Field(default=2, ge=0, le=10, description="retries of a validation whose attempt crashed, raised, or whose worker died")
    validation_cancel_grace_s: float = Field(default=30.0, gt=0, description="a running validation that ignores its cancel this long is killed by its worker")
    validation_local_workers: int = Field(default=1, ge=1, le=64, description="without Redis: validations run at once in the API process")
    worker_heartbeat_s: int = Field(default=10, ge=1, description="a worker refreshes its running job's heartbeat this often; a job unrefreshed for this + 5 s is abandoned")
    worker_maintenance_s: int = Field(default=30, ge=1, description="how often a worker looks for abandoned jobs to retry (RQ registry cleanup)")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
