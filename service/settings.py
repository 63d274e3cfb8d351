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


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
